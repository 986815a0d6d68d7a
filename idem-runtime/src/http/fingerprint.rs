//! What makes two requests with one key the same request: the method, the path and query,
//! and the body, a JSON body by its meaning rather than its bytes.

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use std::fmt;

use http::request::Parts;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Serialize, Serializer};
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
        if let Some(canonical) = canonical_json(body) {
            let digest: [u8; 32] = Sha256::digest(&canonical).into();
            return Fingerprint::of(&(method, target, 1_u8, Raw(&digest)));
        }
    }
    Fingerprint::of(&(method, target, 0_u8, Raw(body)))
}

/// The canonical form of a JSON document: objects with their members sorted by name, no
/// whitespace, strings and numbers as `serde_json` writes them; `None` if it does not parse.
///
/// It is written while the document is parsed, without building a `serde_json::Value`: on
/// a 1 KiB body that is several times faster. The key encoder would give the same
/// guarantee, but it pays a SHA-256 per object member to make maps order-independent (the
/// P10 and P11 benchmarks).
fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(body.len());
    let mut members = Vec::new();
    let mut parser = serde_json::Deserializer::from_slice(body);
    Canonical {
        out: &mut out,
        members: &mut members,
    }
    .deserialize(&mut parser)
    .ok()?;
    parser.end().ok()?;
    Some(out)
}

/// Writes the value it is handed, canonically, to `out`.
struct Canonical<'a> {
    out: &'a mut Vec<u8>,
    /// Where the members of the objects being written are in `out` (start, end of the
    /// name, end), one stack for the whole document: an object's members sit above those
    /// of the objects around it.
    members: &'a mut Vec<(usize, usize, usize)>,
}

impl<'de> DeserializeSeed<'de> for Canonical<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl Canonical<'_> {
    fn write<T: Serialize + ?Sized, E: de::Error>(self, value: &T) -> Result<(), E> {
        serde_json::to_writer(&mut *self.out, value).map_err(E::custom)
    }

    fn nested(&mut self) -> Canonical<'_> {
        Canonical {
            out: self.out,
            members: self.members,
        }
    }
}

impl<'de> Visitor<'de> for Canonical<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.write(&v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.write(&v)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.write(&v)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.write(&v)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.write(v)
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut items: A) -> Result<(), A::Error> {
        self.out.push(b'[');
        let mut first = true;
        loop {
            let mark = self.out.len();
            if !first {
                self.out.push(b',');
            }
            if items.next_element_seed(self.nested())?.is_none() {
                self.out.truncate(mark);
                break;
            }
            first = false;
        }
        self.out.push(b']');
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        self.out.push(b'{');
        let start = self.out.len();
        let base = self.members.len();
        let mut sorted = true;
        loop {
            let begin = self.out.len();
            if begin > start {
                self.out.push(b',');
            }
            let name_start = self.out.len();
            if map.next_key_seed(self.nested())?.is_none() {
                self.out.truncate(begin);
                break;
            }
            let name_end = self.out.len();
            if let Some(&(previous, previous_end, _)) =
                self.members.get(base..).and_then(|m| m.last())
            {
                let previous = &self.out[previous..previous_end];
                sorted &= previous <= &self.out[name_start..name_end];
            }
            self.out.push(b':');
            map.next_value_seed(self.nested())?;
            self.members.push((name_start, name_end, self.out.len()));
        }
        // Written in order (a sorted map, or a client that sorts), the members stay; else
        // they are put in order by name.
        if !sorted {
            let written = self.out.split_off(start);
            let members = &mut self.members[base..];
            members.sort_by(|a, b| {
                written[a.0 - start..a.1 - start].cmp(&written[b.0 - start..b.1 - start])
            });
            for (i, &(begin, _, end)) in members.iter().enumerate() {
                if i > 0 {
                    self.out.push(b',');
                }
                self.out
                    .extend_from_slice(&written[begin - start..end - start]);
            }
        }
        self.members.truncate(base);
        self.out.push(b'}');
        Ok(())
    }
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
    fn the_canonical_form_sorts_members_at_every_depth_and_drops_whitespace() {
        let canonical =
            |json: &str| String::from_utf8(canonical_json(json.as_bytes()).unwrap()).unwrap();
        assert_eq!(
            canonical(r#" { "b" : [ 1 , { "z" : null , "a" : true } ] , "a" : "x\u0041" } "#),
            r#"{"a":"xA","b":[1,{"a":true,"z":null}]}"#
        );
        assert_eq!(canonical("[]"), "[]");
        assert_eq!(canonical("{}"), "{}");
        assert_eq!(canonical("-1.5e3"), "-1500.0");
        assert!(canonical_json(b"{\"a\":1} trailing").is_none());
        assert!(canonical_json(b"{\"a\":").is_none());
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
