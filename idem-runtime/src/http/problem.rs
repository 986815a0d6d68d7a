//! Every answer the layer gives on its own, as RFC 9457 problem details
//! (`application/problem+json`), built here and nowhere else.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::Full;

use crate::Error;

/// The documentation of each problem type: the `type` member of the problem is this page's
/// URL with the problem's anchor.
const TYPES: &str = "https://docs.rs/idem-runtime/latest/idem_runtime/http/index.html";

/// Where a request's key is, as a problem names it.
pub(super) enum KeyNaming {
    /// The `Idempotency-Key` header, whose problems say how to send it.
    IdempotencyKey,
    /// Another source, named: "the body's `/id`".
    Named(String),
}

impl KeyNaming {
    fn named(&self) -> &str {
        match self {
            Self::IdempotencyKey => "the `Idempotency-Key` header",
            Self::Named(named) => named,
        }
    }
}

/// A problem the layer answers with instead of running the handler.
///
/// No variant carries an error's text: a problem's `detail` is written here, from the
/// layer's own words and numbers, so that no store address, SQL or library message ever
/// reaches a client. What went wrong inside goes to `tracing` where it happens.
#[derive(Debug)]
pub(super) enum Problem {
    /// 400: the key is required and missing.
    KeyMissing,
    /// 400: the key header is malformed, and the layer's own words for why.
    KeyMalformed(&'static str),
    /// 401: the request carries a key, but the key scope cannot name its principal.
    PrincipalUnknown,
    /// 401: a webhook's signature is missing or is not its sender's.
    SignatureInvalid,
    /// 400: the request body could not be read, or fingerprinted.
    BodyUnreadable,
    /// 413: the request body is over the limit.
    BodyTooLarge(usize),
    /// 409: the key's first request still runs.
    InFlight(Duration),
    /// 422: the key was used with another request.
    PayloadMismatch,
    /// 410: the key's request completed, but its response was not kept.
    Gone,
    /// 429: the key, or its principal's new keys, came faster than the layer's rate limits.
    #[cfg_attr(not(feature = "governor"), allow(dead_code))]
    RateLimited(Duration),
    /// 503: the store failed; the handler did not run.
    StoreDown,
    /// 500: a record that does not decode, a misconfiguration, a failed response body.
    Internal,
    /// 500: the handler ran, and its response could not be recorded.
    Unrecorded,
}

impl Problem {
    /// The problem of an [`Error`] from the engine, said in `tracing` too.
    pub(super) fn of(err: Error, retry_after: Duration) -> Self {
        let problem = Self::classify(&err, retry_after);
        match &problem {
            Self::StoreDown => tracing::warn!(error = %err, "the store failed: answered 503"),
            Self::BodyUnreadable => {
                tracing::info!(error = %err, "the request could not be keyed: answered 400");
            }
            Self::Internal | Self::Unrecorded => {
                tracing::error!(error = %err, "answered 500");
            }
            _ => {}
        }
        problem
    }

    /// The problem of an [`Error`], and nothing else.
    pub(super) fn classify(err: &Error, retry_after: Duration) -> Self {
        match err {
            Error::InProgress => Self::InFlight(retry_after),
            Error::PayloadMismatch => Self::PayloadMismatch,
            Error::Gone => Self::Gone,
            Error::Store(_) => Self::StoreDown,
            Error::Key(_) => Self::BodyUnreadable,
            Error::Codec(_) | Error::Config(_) => Self::Internal,
            Error::Unrecorded(_) => Self::Unrecorded,
        }
    }

    pub(super) fn into_response(self) -> Response<Full<Bytes>> {
        self.answer(&KeyNaming::IdempotencyKey)
    }

    /// The answer, its texts naming where the request's key is (`key`).
    pub(super) fn answer(self, key: &KeyNaming) -> Response<Full<Bytes>> {
        let retry_after = match &self {
            Self::InFlight(after) | Self::RateLimited(after) => Some(*after),
            // A transient failure (`Error::is_transient`): its client may come back.
            Self::StoreDown => Some(crate::RETRY_AFTER),
            _ => None,
        };
        // The `Idempotency-Key` header says how it is sent; any other source is named.
        let header = matches!(key, KeyNaming::IdempotencyKey);
        let (status, anchor, title, detail) = match self {
            Self::KeyMissing if header => (
                StatusCode::BAD_REQUEST,
                "key-missing",
                "Idempotency-Key is missing",
                "this endpoint requires an `Idempotency-Key` header; send a unique value per operation and the same one on every retry".to_string(),
            ),
            Self::KeyMissing => (
                StatusCode::BAD_REQUEST,
                "key-missing",
                "The idempotency key is missing",
                format!("this endpoint requires a key in {}; send the same one on every retry", key.named()),
            ),
            Self::KeyMalformed(why) if header => (
                StatusCode::BAD_REQUEST,
                "key-malformed",
                "Idempotency-Key is malformed",
                format!("{why}: send one quoted string of at most 255 characters, e.g. `Idempotency-Key: \"8e03978e-40d5\"`"),
            ),
            Self::KeyMalformed(why) => (
                StatusCode::BAD_REQUEST,
                "key-malformed",
                "The idempotency key is malformed",
                format!("{why}: the key in {} is one value of at most 255 bytes", key.named()),
            ),
            Self::SignatureInvalid => (
                StatusCode::UNAUTHORIZED,
                "signature-invalid",
                "The request's signature is missing or invalid",
                "the signature is missing, malformed, outside its time tolerance, or not the sender's for this body; nothing was processed".to_string(),
            ),
            Self::PrincipalUnknown => (
                StatusCode::UNAUTHORIZED,
                "principal-unknown",
                "The request's principal is unknown",
                "a request with an `Idempotency-Key` must be authenticated, so that its key is not shared with other clients; authenticate and retry with the same key".to_string(),
            ),
            Self::BodyUnreadable => (
                StatusCode::BAD_REQUEST,
                "body-unreadable",
                "The request body could not be read",
                "the request body ended early or could not be read as its content type says; send it whole and retry with the same key".to_string(),
            ),
            Self::BodyTooLarge(limit) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "The request body is too large",
                format!("requests to this endpoint may carry at most {limit} bytes"),
            ),
            Self::InFlight(after) => (
                StatusCode::CONFLICT,
                "in-flight",
                if header { "A request with this Idempotency-Key is in progress" } else { "A request with this idempotency key is in progress" },
                format!("the first request with this key ({}) has not finished; retry in {} s (`Retry-After`) to get its response", key.named(), whole_seconds(after)),
            ),
            Self::PayloadMismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "key-reused",
                if header { "Idempotency-Key reused with another request" } else { "Idempotency key reused with another request" },
                format!("the key in {} was used before with a different method, path, query or body; a new operation needs a new key", key.named()),
            ),
            Self::Gone => (
                StatusCode::GONE,
                "gone",
                if header { "The response of this Idempotency-Key is gone" } else { "The response of this idempotency key is gone" },
                "the first request with this key completed, but its response could not be kept (too large, or evicted); it is not run again, so its effect is not repeated. Use a new key only for a new operation".to_string(),
            ),
            Self::RateLimited(after) => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate-limited",
                if header { "Too many requests for this Idempotency-Key" } else { "Too many requests for this idempotency key" },
                format!("this key, or this client's new keys, came faster than the service allows; retry with the same key in {} s (`Retry-After`)", whole_seconds(after)),
            ),
            Self::StoreDown => (
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "Idempotency store unavailable",
                "the request was not processed; retry it with the same key".to_string(),
            ),
            Self::Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Idempotency layer failure",
                "the request could not be completed; it is safe to retry with the same key".to_string(),
            ),
            Self::Unrecorded => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "unrecorded",
                "The request was processed, its response was not recorded",
                "the request was processed, but its response could not be recorded; a retry with the same key may process it again once its claim lapses: check its effect first".to_string(),
            ),
        };
        let body = serde_json::json!({
            "type": format!("{TYPES}#{anchor}"),
            "title": title,
            "status": status.as_u16(),
            "detail": detail,
        });
        let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(whole_seconds(after)));
        }
        response
    }
}

/// The `application/problem+json` answer for an [`Error`]: the same status, `type`, title
/// and detail the layer answers with, and `Retry-After: 1` on a `409` and a `503` (the
/// transient errors, [`Error::is_transient`]). The `detail` never
/// carries the error's own text (a store's address, SQL): log `err` yourself if you want it.
///
/// | [`Error`] | status | `type` anchor |
/// |---|---|---|
/// | `InProgress` | `409` + `Retry-After` | `in-flight` |
/// | `PayloadMismatch` | `422` | `key-reused` |
/// | `Gone` | `410` | `gone` |
/// | `Store` | `503` + `Retry-After` | `store-unavailable` |
/// | `Key` | `400` | `body-unreadable` |
/// | `Codec`, `Config` | `500` | `internal` |
///
/// ```
/// use idem_runtime::http::problem;
/// use idem_runtime::Error;
///
/// let answer = problem(&Error::PayloadMismatch);
/// assert_eq!(answer.status(), 422);
/// assert_eq!(answer.headers()["content-type"], "application/problem+json");
/// ```
///
/// With the feature `axum`, [`Error`] is an `axum::response::IntoResponse` that answers this.
pub fn problem(err: &Error) -> Response<Full<Bytes>> {
    Problem::classify(err, DEFAULT_RETRY_AFTER).into_response()
}

/// A delay as `Retry-After` says it: whole seconds, rounded up, at least one.
fn whole_seconds(after: Duration) -> u64 {
    after
        .as_secs()
        .saturating_add(u64::from(after.subsec_nanos() > 0))
        .max(1)
}

/// The `Retry-After` of a `409`, unless a layer is told otherwise.
pub(super) const DEFAULT_RETRY_AFTER: Duration = crate::RETRY_AFTER;

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for Error {
    fn into_response(self) -> axum::response::Response {
        problem(&self).map(axum::body::Body::new)
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    /// Every problem the layer answers with, once.
    fn every_problem() -> Vec<Problem> {
        vec![
            Problem::KeyMissing,
            Problem::KeyMalformed("empty"),
            Problem::PrincipalUnknown,
            Problem::SignatureInvalid,
            Problem::BodyUnreadable,
            Problem::BodyTooLarge(1024),
            Problem::InFlight(Duration::from_secs(1)),
            Problem::PayloadMismatch,
            Problem::Gone,
            Problem::RateLimited(Duration::from_millis(1500)),
            Problem::StoreDown,
            Problem::Internal,
            Problem::Unrecorded,
        ]
    }

    #[tokio::test]
    async fn every_error_has_its_problem_and_no_detail_carries_its_text() {
        let secret = "postgres://app:hunter2@10.0.0.7/db";
        let cases = [
            (Error::InProgress, 409, "in-flight"),
            (Error::PayloadMismatch, 422, "key-reused"),
            (Error::Gone, 410, "gone"),
            (Error::store(secret), 503, "store-unavailable"),
            (Error::Key(secret.into()), 400, "body-unreadable"),
            (Error::codec(secret), 500, "internal"),
            (Error::Config(secret.into()), 500, "internal"),
            (Error::Unrecorded(secret.into()), 500, "unrecorded"),
        ];
        for (err, status, anchor) in cases {
            let response = problem(&err);
            assert_eq!(response.status(), status, "{err}");
            assert_eq!(
                response.headers().get(RETRY_AFTER).is_some(),
                status == 409 || status == 503,
                "{err}"
            );
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let text = String::from_utf8(body.to_vec()).unwrap();
            assert!(!text.contains("hunter2"), "{text}");
            let problem: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(problem["type"], format!("{TYPES}#{anchor}"));
            assert_eq!(problem["status"], status);
        }
    }

    #[cfg(feature = "axum")]
    #[tokio::test]
    async fn an_error_is_an_axum_response() {
        use axum::response::IntoResponse;
        let response = Error::InProgress.into_response();
        assert_eq!(response.status(), 409);
        assert_eq!(response.headers()[RETRY_AFTER], "1");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(problem["type"], format!("{TYPES}#in-flight"));
    }

    #[tokio::test]
    async fn every_problem_type_links_to_a_section_of_the_module_docs() {
        let docs = include_str!("../http.rs");
        for problem in every_problem() {
            let response = problem.into_response();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let link = problem["type"].as_str().unwrap();
            let anchor = link.strip_prefix(&format!("{TYPES}#")).unwrap();
            assert!(
                docs.contains(&format!("//! ## {anchor}\n")),
                "`{link}` has no section `## {anchor}` in src/http.rs"
            );
        }
    }
}
