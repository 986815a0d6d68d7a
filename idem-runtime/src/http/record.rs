//! A recorded response: status, headers (hop-by-hop ones removed) and body, in a compact,
//! versioned binary format behind the record tag `h`.
//!
//! ```text
//! version (1 byte, 1) | status (u16 BE) | header count (u16 BE)
//! per header: name length (u16 BE) | name | value length (u32 BE) | value
//! body (the rest, raw bytes)
//! ```

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONNECTION};
use http::{HeaderMap, Response, StatusCode};
use http_body_util::Full;

use crate::codec::{self, ValueCodec};
use crate::Error;

const VERSION: u8 = 1;

/// The header a replayed response carries (Stripe's name, which clients look for).
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The header of a response whose handler ran but whose record had not landed when it was
/// sent (the store failed for as long as the layer waits, its store's timeout): the
/// handler's own answer, marked. The layer goes on recording it in the background; a retry
/// with the key replays it once it landed (a retry to another instance before then, once
/// the claim lapsed, runs the handler again: check the request's effect first).
pub const IDEMPOTENT_UNRECORDED: &str = "idempotent-unrecorded";

/// Headers that describe one connection, not the response: never recorded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// A response as recorded, and the headers of the first response that are sent with it but
/// not recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Recorded {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    /// Sent to the first caller only (never encoded): what `record_header_if` refused.
    unrecorded: HeaderMap,
}

impl Recorded {
    /// What to record of a response whose body was read whole: hop-by-hop headers, and the
    /// headers the `Connection` header names, are left out; the headers `record` refuses
    /// are kept aside for the first response only.
    pub(super) fn new(
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
        record: &dyn Fn(&HeaderName) -> bool,
    ) -> Self {
        let mut headers = without_hop_by_hop(headers);
        let mut unrecorded = HeaderMap::new();
        if headers.keys().any(|name| !record(name)) {
            let mut recorded = HeaderMap::with_capacity(headers.len());
            for (name, value) in &headers {
                let into = if record(name) {
                    &mut recorded
                } else {
                    &mut unrecorded
                };
                into.append(name.clone(), value.clone());
            }
            headers = recorded;
        }
        Self {
            status,
            headers,
            body,
            unrecorded,
        }
    }

    /// The response to send: the recorded one, marked `Idempotent-Replayed: true` when it
    /// answers a later request; the first answer also carries the unrecorded headers.
    pub(super) fn into_response(self, replayed: bool) -> Response<Full<Bytes>> {
        let mut response = Response::new(Full::new(self.body));
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers;
        let headers = response.headers_mut();
        if replayed {
            headers.insert(
                HeaderName::from_static(IDEMPOTENT_REPLAYED),
                HeaderValue::from_static("true"),
            );
        } else {
            for (name, value) in &self.unrecorded {
                headers.append(name, value.clone());
            }
        }
        response
    }
}

/// `headers` without the hop-by-hop ones and those the `Connection` header names.
fn without_hop_by_hop(mut headers: HeaderMap) -> HeaderMap {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::try_from(name.trim()).ok())
        .collect();
    for name in HOP_BY_HOP
        .iter()
        .copied()
        .map(HeaderName::from_static)
        .chain(named)
    {
        headers.remove(name);
    }
    headers
}

/// The codec of recorded responses.
pub(super) struct HttpRecord;

impl ValueCodec<Recorded> for HttpRecord {
    const TAG: u8 = codec::HTTP;

    fn encode_into(value: &Recorded, buf: &mut Vec<u8>) -> Result<(), Error> {
        let count = u16::try_from(value.headers.len())
            .map_err(|_| Error::codec("a response with more than 65535 headers"))?;
        buf.reserve(5 + value.body.len() + 64 * value.headers.len());
        buf.push(VERSION);
        buf.extend_from_slice(&value.status.as_u16().to_be_bytes());
        buf.extend_from_slice(&count.to_be_bytes());
        for (name, header) in &value.headers {
            let name = name.as_str().as_bytes();
            // Header names are short (hyper refuses long ones), values bounded by `u32`.
            let name_len = u16::try_from(name.len())
                .map_err(|_| Error::codec("a header name over 65535 bytes"))?;
            let value_len = u32::try_from(header.len())
                .map_err(|_| Error::codec("a header value over 4 GiB"))?;
            buf.extend_from_slice(&name_len.to_be_bytes());
            buf.extend_from_slice(name);
            buf.extend_from_slice(&value_len.to_be_bytes());
            buf.extend_from_slice(header.as_bytes());
        }
        buf.extend_from_slice(&value.body);
        Ok(())
    }

    /// The handler's own response, marked `Idempotent-Unrecorded: true` (sent to this
    /// caller only, like every header kept off the record).
    fn unrecorded(mut value: Recorded) -> Option<Recorded> {
        value.unrecorded.insert(
            HeaderName::from_static(IDEMPOTENT_UNRECORDED),
            HeaderValue::from_static("true"),
        );
        Some(value)
    }

    fn decode(payload: &Bytes) -> Result<Recorded, Error> {
        let mut rest = &payload[..];
        let version = take(&mut rest, 1)?[0];
        if version != VERSION {
            return Err(Error::codec(format!(
                "a recorded response of format version {version}; this build reads version {VERSION}"
            )));
        }
        let status = u16::from_be_bytes(take(&mut rest, 2)?.try_into().map_err(corrupt)?);
        let status = StatusCode::from_u16(status).map_err(corrupt)?;
        let count = u16::from_be_bytes(take(&mut rest, 2)?.try_into().map_err(corrupt)?);
        let mut headers = HeaderMap::with_capacity(usize::from(count));
        for _ in 0..count {
            let len = u16::from_be_bytes(take(&mut rest, 2)?.try_into().map_err(corrupt)?);
            let name =
                HeaderName::from_bytes(take(&mut rest, usize::from(len))?).map_err(corrupt)?;
            let len = u32::from_be_bytes(take(&mut rest, 4)?.try_into().map_err(corrupt)?);
            let len = usize::try_from(len).map_err(corrupt)?;
            // Shared with the record too, not copied.
            let at = payload.len() - rest.len();
            take(&mut rest, len)?;
            let value =
                HeaderValue::from_maybe_shared(payload.slice(at..at + len)).map_err(corrupt)?;
            headers.append(name, value);
        }
        // The body shares the record's bytes: a replay copies nothing.
        let body = payload.slice(payload.len() - rest.len()..);
        Ok(Recorded {
            status,
            headers,
            body,
            unrecorded: HeaderMap::new(),
        })
    }
}

fn take<'a>(rest: &mut &'a [u8], n: usize) -> Result<&'a [u8], Error> {
    if rest.len() < n {
        return Err(Error::codec("a recorded response is truncated"));
    }
    let (head, tail) = rest.split_at(n);
    *rest = tail;
    Ok(head)
}

fn corrupt(err: impl std::fmt::Display) -> Error {
    Error::codec(format!("a recorded response is corrupt: {err}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(response: &Recorded) -> Bytes {
        codec::encode_value::<HttpRecord, _>(response).unwrap()
    }

    #[test]
    fn a_response_round_trips_with_its_body_as_raw_bytes() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        headers.insert(
            "connection",
            HeaderValue::from_static("keep-alive, x-trace"),
        );
        headers.insert("x-trace", HeaderValue::from_static("hop"));
        headers.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        let body = Bytes::from_static(b"{\"id\":\"pay_1\"}");
        let response = Recorded::new(StatusCode::CREATED, headers, body.clone(), &|_| true);
        assert!(response.headers.get("connection").is_none());
        assert!(
            response.headers.get("x-trace").is_none(),
            "named by Connection"
        );
        assert!(response.headers.get("transfer-encoding").is_none());
        assert_eq!(response.headers.get_all("set-cookie").iter().count(), 2);

        let bytes = record(&response);
        assert_eq!(bytes[0], codec::HTTP);
        assert!(
            bytes.ends_with(&body),
            "the body is stored as its own bytes, not as JSON"
        );
        let back = HttpRecord::decode(&bytes.slice(1..)).unwrap();
        assert_eq!(back, response);
    }

    #[test]
    fn refused_headers_go_to_the_first_answer_only() {
        let mut headers = HeaderMap::new();
        headers.append("set-cookie", HeaderValue::from_static("session=alice"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        headers.insert("x-payment", HeaderValue::from_static("created"));
        let response = Recorded::new(StatusCode::CREATED, headers, Bytes::new(), &|name| {
            name != http::header::SET_COOKIE
        });
        let first = response.clone().into_response(false);
        assert_eq!(first.headers().get_all("set-cookie").iter().count(), 2);
        assert_eq!(first.headers()["x-payment"], "created");
        let replayed = HttpRecord::decode(&record(&response).slice(1..))
            .unwrap()
            .into_response(true);
        assert!(replayed.headers().get("set-cookie").is_none());
        assert_eq!(replayed.headers()["x-payment"], "created");
    }

    #[test]
    fn truncated_or_foreign_records_are_codec_errors() {
        let response = Recorded::new(
            StatusCode::OK,
            HeaderMap::new(),
            Bytes::from_static(b"x"),
            &|_| true,
        );
        let bytes = record(&response);
        for cut in 1..6 {
            assert!(matches!(
                HttpRecord::decode(&bytes.slice(1..cut)),
                Err(Error::Codec(_))
            ));
        }
        let mut future = bytes[1..].to_vec();
        future[0] = 2;
        assert!(matches!(
            HttpRecord::decode(&Bytes::from(future)),
            Err(Error::Codec(_))
        ));
    }
}
