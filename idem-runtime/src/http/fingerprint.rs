//! What makes two requests with one key the same request: the method, the path and query,
//! and the body, a JSON body by its meaning rather than its bytes.

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::request::Parts;
use serde::{Serialize, Serializer};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::{Error, Fingerprint};

/// The default fingerprint of a request.
pub(super) fn of_request(parts: &Parts, body: &Bytes) -> Result<Fingerprint, Error> {
    let target = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |pq| pq.as_str());
    let method = parts.method.as_str();
    // A JSON body counts by its canonical form: members sorted by name, no whitespace, so
    // that member order and layout do not change it. One that does not parse counts by its
    // bytes, as other bodies do.
    if is_json(parts) {
        if let Ok(document) = serde_json::from_slice::<Value>(body) {
            let mut canonical = Sha256::new();
            write_canonical(&document, &mut canonical);
            let digest: [u8; 32] = canonical.finalize().into();
            return Fingerprint::of(&(method, target, 1_u8, Raw(&digest)));
        }
    }
    Fingerprint::of(&(method, target, 0_u8, Raw(body)))
}

/// Feeds the canonical JSON of `value` to `hasher`: objects with their members sorted by
/// name (whatever order the map keeps, `serde_json`'s `preserve_order` included), no
/// whitespace, scalars as `serde_json` writes them.
///
/// The key encoder would give the same guarantee, but it makes maps order-independent with
/// a SHA-256 per member; sorting by name costs a comparison per member instead (the P10 and
/// P11 benchmarks).
fn write_canonical(value: &Value, hasher: &mut Sha256) {
    match value {
        Value::Object(members) => {
            hasher.update(b"{");
            let mut sorted: Vec<(&String, &Value)> = members.iter().collect();
            sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
            for (i, (name, member)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    hasher.update(b",");
                }
                write_json(name.as_str(), hasher);
                hasher.update(b":");
                write_canonical(member, hasher);
            }
            hasher.update(b"}");
        }
        Value::Array(items) => {
            hasher.update(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    hasher.update(b",");
                }
                write_canonical(item, hasher);
            }
            hasher.update(b"]");
        }
        scalar => write_json(scalar, hasher),
    }
}

fn write_json<T: Serialize + ?Sized>(value: &T, hasher: &mut Sha256) {
    struct Feed<'a>(&'a mut Sha256);
    impl std::io::Write for Feed<'_> {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.update(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    // Writing a string or a scalar into a hasher cannot fail.
    let _ = serde_json::to_writer(Feed(hasher), value);
}

/// `application/json`, or any `+json` type.
fn is_json(parts: &Parts) -> bool {
    let Some(value) = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
        || essence
            .rsplit_once('+')
            .is_some_and(|(_, suffix)| suffix.eq_ignore_ascii_case("json"))
}

/// Bytes encoded as one byte string, not a sequence of numbers.
struct Raw<'a>(&'a [u8]);

impl Serialize for Raw<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(self.0)
    }
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;

    fn print(method: &str, uri: &str, content_type: Option<&str>, body: &str) -> Fingerprint {
        let mut request = Request::builder().method(method).uri(uri);
        if let Some(content_type) = content_type {
            request = request.header(CONTENT_TYPE, content_type);
        }
        let (parts, ()) = request.body(()).unwrap().into_parts();
        of_request(&parts, &Bytes::copy_from_slice(body.as_bytes())).unwrap()
    }

    #[test]
    fn a_json_body_is_the_same_payload_whatever_its_layout() {
        let json = Some("application/json; charset=utf-8");
        let a = print(
            "POST",
            "/pay?x=1",
            json,
            r#"{"amount": 100, "currency": "eur"}"#,
        );
        let b = print(
            "POST",
            "/pay?x=1",
            json,
            "{\"currency\":\"eur\",\n \"amount\":100}",
        );
        assert_eq!(a, b);
        let problem = Some("application/merge-patch+json");
        assert_eq!(
            print("PATCH", "/p", problem, r#"{"a":1,"b":2}"#),
            print("PATCH", "/p", problem, r#"{"b":2, "a":1}"#)
        );
    }

    #[test]
    fn method_target_and_body_each_change_the_payload() {
        let json = Some("application/json");
        let base = print("POST", "/pay?x=1", json, r#"{"amount":100}"#);
        for other in [
            print("PATCH", "/pay?x=1", json, r#"{"amount":100}"#),
            print("POST", "/refund?x=1", json, r#"{"amount":100}"#),
            print("POST", "/pay?x=2", json, r#"{"amount":100}"#),
            print("POST", "/pay?x=1", json, r#"{"amount":101}"#),
            print("POST", "/pay?x=1", None, r#"{"amount":100}"#),
        ] {
            assert_ne!(base, other);
        }
        // Other bodies count by their bytes.
        let text = Some("text/plain");
        assert_ne!(
            print("POST", "/t", text, "a b"),
            print("POST", "/t", text, "a  b")
        );
    }
}
