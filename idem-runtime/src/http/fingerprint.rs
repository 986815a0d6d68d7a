//! What makes two requests with one key the same request: the method, the path and query,
//! and the body, a JSON body by its meaning rather than its bytes.

use std::sync::{Mutex, PoisonError};

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::request::Parts;
use http::Method;
use serde::{Serialize, Serializer};
use sha2::{Digest, Sha256};

use crate::{Error, Fingerprint, Key};

/// The default fingerprint of a request.
pub(super) fn of_request(parts: &Parts, body: &Bytes) -> Result<Fingerprint, Error> {
    let target = target(parts);
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

/// The default fingerprint but that the named members of a JSON object body are left out:
/// for senders that resend one event with a member that counts its deliveries. The body is
/// read as JSON whatever its `Content-Type` says (a sender's, not a client's, so the
/// member is left out however the delivery is labelled); a body that is not a JSON object
/// counts as [`of_request`] counts it.
pub(super) fn of_request_without(
    parts: &Parts,
    body: &Bytes,
    left_out: &[&str],
) -> Result<Fingerprint, Error> {
    if let Some(canonical) = canonical_json_without(body, left_out) {
        let digest: [u8; 32] = Sha256::digest(&canonical).into();
        return Fingerprint::of(&(parts.method.as_str(), target(parts), 1_u8, Raw(&digest)));
    }
    of_request(parts, body)
}

/// The default fingerprint, remembering those of recent JSON requests by their bytes.
///
/// A retry sends the bytes it sent the first time, and canonicalising them again would
/// cost most of a replay (about 4 µs for 1 KiB). A request whose method, target and body
/// are byte for byte those of a remembered JSON request has that one's fingerprint,
/// because [`of_request`] depends on nothing else: the memo can only answer what
/// canonicalising would have answered, never decide it. Any request it does not remember
/// is canonicalised, as always.
///
/// A request is remembered in the slot its idempotency key names, so that its retry finds
/// it without hashing the body: a body of up to [`MEMO_BODY`] bytes is kept and compared
/// byte for byte (a SHA-256 pass over 1 KiB cost a replay more than a quarter of its time);
/// a larger one is kept as its SHA-256 digest, which its retry computes again to compare.
pub(super) struct Memo {
    slots: Box<[Mutex<Option<Remembered>>]>,
}

/// A remembered JSON request, and its fingerprint.
struct Remembered {
    method: Method,
    target: Box<str>,
    body: Seen,
    fingerprint: Fingerprint,
}

/// A remembered body: its bytes, or the digest of a large one.
#[derive(PartialEq, Eq)]
enum Seen {
    Bytes(Box<[u8]>),
    Digest([u8; 32]),
}

impl Seen {
    /// What the memo keeps of `body`; `digest` is its SHA-256 if it is a large one.
    fn of(body: &[u8], digest: Option<[u8; 32]>) -> Self {
        match digest {
            Some(digest) => Self::Digest(digest),
            None => Self::Bytes(body.into()),
        }
    }

    /// Whether `body` (with its digest, if it is a large one) is this one.
    fn is(&self, body: &[u8], digest: Option<&[u8; 32]>) -> bool {
        match (self, digest) {
            (Self::Bytes(seen), None) => **seen == *body,
            (Self::Digest(seen), Some(digest)) => seen == digest,
            _ => false,
        }
    }
}

/// How many requests a layer's memo remembers at most: the most recent one of each slot
/// (about 100 bytes each, and the body kept).
const MEMO_SLOTS: usize = 2048;

/// The largest body the memo keeps as it is, 4 KiB: a layer's memo then holds at most
/// 8 MiB of bodies. Larger ones are kept as their digest.
const MEMO_BODY: usize = 4096;

impl Memo {
    pub(super) fn new() -> Self {
        Self {
            slots: (0..MEMO_SLOTS).map(|_| Mutex::new(None)).collect(),
        }
    }

    /// The fingerprint of a request sent with idempotency key `key`.
    pub(super) fn of_request(
        &self,
        key: &Key,
        parts: &Parts,
        body: &Bytes,
    ) -> Result<Fingerprint, Error> {
        // Other bodies are fingerprinted by their bytes already.
        if !is_json(parts) {
            return of_request(parts, body);
        }
        let slot = self.slot(key);
        let target = target(parts);
        // A large body's digest is computed before the slot is locked.
        let digest: Option<[u8; 32]> =
            (body.len() > MEMO_BODY).then(|| Sha256::digest(body).into());
        {
            let remembered = slot.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(seen) = &*remembered {
                if seen.method == parts.method
                    && *seen.target == *target
                    && seen.body.is(body, digest.as_ref())
                {
                    return Ok(seen.fingerprint);
                }
            }
        }
        let fingerprint = of_request(parts, body)?;
        let remembered = Remembered {
            method: parts.method.clone(),
            target: target.into(),
            body: Seen::of(body, digest),
            fingerprint,
        };
        *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(remembered);
        Ok(fingerprint)
    }

    /// The slot of requests sent with `key`.
    fn slot(&self, key: &Key) -> &Mutex<Option<Remembered>> {
        let [a, b, ..] = *key.as_bytes();
        &self.slots[usize::from(u16::from_le_bytes([a, b])) % MEMO_SLOTS]
    }
}

/// The path and query the client sent. A router may have rewritten the request's own URI
/// before the layer runs: axum's `nest` strips its prefix, so that `/v1/pay` and `/v2/pay`
/// both reach a layer inside them as `/pay`. With the feature `axum`, the URI axum saw
/// first (`OriginalUri`) is the target, so that a key sent to two endpoints is never the
/// same request.
pub(super) fn target(parts: &Parts) -> &str {
    #[cfg(feature = "axum")]
    let uri = parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    #[cfg(not(feature = "axum"))]
    let uri = &parts.uri;
    uri.path_and_query().map_or(uri.path(), |pq| pq.as_str())
}

/// The canonical form of a JSON document, `None` if it is not one (RFC 8259, nested at most
/// [`MAX_DEPTH`] deep). Objects have their members sorted by name; there is no whitespace;
/// strings are written as `serde_json` writes them (escapes resolved); and every number is
/// written by its exact decimal value, never through a float: `1`, `1.0`, `1e0` and `10e-1`
/// are one value, `0.1` and `0.10000000000000000001` two (see [`number`]).
///
/// It is written in one pass over the bytes, without building a tree or a float: the
/// document's own text decides, so the result does not depend on `serde_json`'s features
/// (`arbitrary_precision` changes what its deserializer hands out).
pub(crate) fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    canonical_json_without(body, &[])
}

/// [`canonical_json`], without the top-level members named `left_out`.
fn canonical_json_without(body: &[u8], left_out: &[&str]) -> Option<Vec<u8>> {
    #[cfg(test)]
    tests::CANONICALISED.set(tests::CANONICALISED.get() + 1);
    // Validated once, so that strings without escapes can be copied as they are.
    std::str::from_utf8(body).ok()?;
    let mut canonical = Canonical {
        input: body,
        at: 0,
        out: Vec::with_capacity(body.len()),
        members: Vec::new(),
        left_out,
    };
    canonical.value(0)?;
    canonical.skip_whitespace();
    (canonical.at == body.len()).then_some(canonical.out)
}

/// How deeply arrays and objects may nest in a document canonicalized by its meaning (as
/// `serde_json`'s own limit); a deeper one counts by its bytes.
const MAX_DEPTH: u32 = 128;

/// The state of one canonicalization: where it is in the input, and what it wrote.
struct Canonical<'a> {
    input: &'a [u8],
    at: usize,
    out: Vec<u8>,
    /// Where the members of the objects being written are in `out` (start, end of the
    /// name, end), one stack for the whole document: an object's members sit above those
    /// of the objects around it.
    members: Vec<(usize, usize, usize)>,
    /// The names of the top-level members not written (each as a JSON string would be).
    left_out: &'a [&'a str],
}

impl Canonical<'_> {
    /// Whether a written member name (a JSON string, quotes included) is left out.
    fn is_left_out(&self, name: &[u8]) -> bool {
        let Some(name) = name.strip_prefix(b"\"").and_then(|n| n.strip_suffix(b"\"")) else {
            return false;
        };
        self.left_out.iter().any(|left| left.as_bytes() == name)
    }

    fn peek(&self) -> Option<u8> {
        self.input.get(self.at).copied()
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.at += 1;
        }
    }

    /// Consumes `byte` after optional whitespace, if it is next.
    fn eat(&mut self, byte: u8) -> bool {
        self.skip_whitespace();
        let found = self.peek() == Some(byte);
        self.at += usize::from(found);
        found
    }

    fn value(&mut self, depth: u32) -> Option<()> {
        self.skip_whitespace();
        match self.peek()? {
            b'{' if depth < MAX_DEPTH => self.object(depth + 1),
            b'[' if depth < MAX_DEPTH => self.array(depth + 1),
            b'"' => self.string(),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => {
                let start = self.at;
                let end = start + number::length(&self.input[start..])?;
                self.at = end;
                number::write_canonical(&self.input[start..end], &mut self.out)
            }
            _ => None,
        }
    }

    fn literal(&mut self, word: &'static [u8]) -> Option<()> {
        let rest = self.input.get(self.at..)?;
        rest.starts_with(word).then_some(())?;
        self.at += word.len();
        self.out.extend_from_slice(word);
        Some(())
    }

    fn string(&mut self) -> Option<()> {
        let start = self.at;
        let mut escaped = false;
        let mut i = start + 1;
        loop {
            match *self.input.get(i)? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    i += 2;
                }
                0x00..=0x1f => return None,
                _ => i += 1,
            }
        }
        let token = &self.input[start..=i];
        self.at = i + 1;
        if escaped {
            // Escapes are resolved, and written back as `serde_json` writes the string.
            let text: String = serde_json::from_slice(token).ok()?;
            serde_json::to_writer(&mut self.out, &text).ok()?;
        } else {
            // What `serde_json` would write: it escapes only quotes, backslashes and control
            // characters, and none of them can be in a string without escapes.
            self.out.extend_from_slice(token);
        }
        Some(())
    }

    fn array(&mut self, depth: u32) -> Option<()> {
        self.at += 1;
        self.out.push(b'[');
        if !self.eat(b']') {
            loop {
                self.value(depth)?;
                if self.eat(b']') {
                    break;
                }
                self.eat(b',').then_some(())?;
                self.out.push(b',');
            }
        }
        self.out.push(b']');
        Some(())
    }

    fn object(&mut self, depth: u32) -> Option<()> {
        self.at += 1;
        self.out.push(b'{');
        let start = self.out.len();
        let base = self.members.len();
        let mut sorted = true;
        if !self.eat(b'}') {
            loop {
                let member_start = self.out.len();
                if self.out.len() > start {
                    self.out.push(b',');
                }
                let name_start = self.out.len();
                self.skip_whitespace();
                (self.peek() == Some(b'"')).then_some(())?;
                self.string()?;
                let name_end = self.out.len();
                if let Some(&(previous, previous_end, _)) = self.members[base..].last() {
                    sorted &= self.out[previous..previous_end] <= self.out[name_start..name_end];
                }
                self.eat(b':').then_some(())?;
                self.out.push(b':');
                self.value(depth)?;
                if depth == 1 && self.is_left_out(&self.out[name_start..name_end]) {
                    self.out.truncate(member_start);
                } else {
                    self.members.push((name_start, name_end, self.out.len()));
                }
                if self.eat(b'}') {
                    break;
                }
                self.eat(b',').then_some(())?;
            }
        }
        // Written in order (a sorted map, or a client that sorts), the members stay; else
        // they are put in order by name. Members of one name keep their order: a document
        // that repeats a name is another document if the values swap.
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
        Some(())
    }
}

/// JSON numbers by their exact decimal value.
pub(crate) mod number {
    /// The length of the JSON number at the start of `input` (RFC 8259:
    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`), or `None` if there is none.
    pub(crate) fn length(input: &[u8]) -> Option<usize> {
        let digits = |from: usize| {
            input[from..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count()
        };
        let mut at = usize::from(input.first() == Some(&b'-'));
        match input.get(at)? {
            b'0' => at += 1,
            b'1'..=b'9' => at += digits(at),
            _ => return None,
        }
        if input.get(at) == Some(&b'.') {
            let n = digits(at + 1);
            (n > 0).then_some(())?;
            at += 1 + n;
        }
        if let Some(b'e' | b'E') = input.get(at) {
            at += 1;
            if let Some(b'+' | b'-') = input.get(at) {
                at += 1;
            }
            let n = digits(at);
            (n > 0).then_some(())?;
            at += n;
        }
        Some(at)
    }

    /// Writes the canonical form of the JSON number `text` (whole, as [`length`] measured
    /// it): `0` for every zero, else the sign, the significant digits without leading or
    /// trailing zeros, `e` and the exponent that makes them the value (`-15e-1` for
    /// `-1.50`). Two numbers have one canonical form exactly when their decimal values are
    /// equal. `None` for an exponent beyond ±10^18, which no value in a request needs: such
    /// a document counts by its bytes, so that two spellings of it may differ, but two
    /// different values never meet.
    pub(crate) fn write_canonical(text: &[u8], out: &mut Vec<u8>) -> Option<()> {
        use std::io::Write;

        let (negative, text) = match text.split_first() {
            Some((b'-', rest)) => (true, rest),
            _ => (false, text),
        };
        let mantissa_end = text
            .iter()
            .position(|b| matches!(b, b'e' | b'E'))
            .unwrap_or(text.len());
        let (mantissa, exponent) = text.split_at(mantissa_end);
        let (integer, fraction) = match mantissa.iter().position(|&b| b == b'.') {
            Some(dot) => (&mantissa[..dot], &mantissa[dot + 1..]),
            None => (mantissa, &[][..]),
        };
        let mut exponent = parse_exponent(exponent)?;
        exponent -= i128::try_from(fraction.len()).ok()?;
        // The significant digits: the integer's and the fraction's, leading zeros dropped,
        // trailing zeros moved into the exponent.
        let mark = out.len();
        if negative {
            out.push(b'-');
        }
        let first = out.len();
        out.extend(integer.iter().chain(fraction).skip_while(|&&b| b == b'0'));
        let trailing = out[first..]
            .iter()
            .rev()
            .take_while(|&&b| b == b'0')
            .count();
        out.truncate(out.len() - trailing);
        if out.len() == first {
            out.truncate(mark);
            out.push(b'0');
            return Some(());
        }
        exponent += i128::try_from(trailing).ok()?;
        // Written in place: no string per number.
        write!(out, "e{exponent}").ok()
    }

    /// The exponent part (`e-07`, `E+3`, or nothing), if its value is within ±10^18.
    fn parse_exponent(part: &[u8]) -> Option<i128> {
        let Some((_, rest)) = part.split_first() else {
            return Some(0);
        };
        let (negative, digits) = match rest.split_first() {
            Some((b'-', digits)) => (true, digits),
            Some((b'+', digits)) => (false, digits),
            _ => (false, rest),
        };
        let start = digits
            .iter()
            .position(|&b| b != b'0')
            .unwrap_or(digits.len());
        let digits = &digits[start..];
        if digits.len() > 18 {
            return None;
        }
        let value = digits
            .iter()
            .fold(0_i128, |value, &d| value * 10 + i128::from(d - b'0'));
        Some(if negative { -value } else { value })
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
    use std::cell::Cell;

    use http::Request;

    use super::*;

    thread_local! {
        /// How many documents this thread canonicalised.
        pub(super) static CANONICALISED: Cell<usize> = const { Cell::new(0) };
    }

    fn print(method: &str, uri: &str, content_type: Option<&str>, body: &str) -> Fingerprint {
        let mut request = Request::builder().method(method).uri(uri);
        if let Some(content_type) = content_type {
            request = request.header(CONTENT_TYPE, content_type);
        }
        let (parts, ()) = request.body(()).unwrap().into_parts();
        of_request(&parts, &Bytes::copy_from_slice(body.as_bytes())).unwrap()
    }

    #[test]
    fn the_memo_answers_what_canonicalising_answers_and_forgets_nothing_it_should_not() {
        let memo = Memo::new();
        let json = Some("application/json");
        let large = format!(r#"{{"note": "{}", "amount": 1}}"#, "x".repeat(MEMO_BODY));
        // Requests under eleven keys, each asked twice, so that every key (and its slot)
        // comes with other methods, targets and bodies (small ones, and large ones kept by
        // their digest): every answer is the one canonicalising gives, remembered or not.
        let requests: Vec<_> = (0..600)
            .map(|i| {
                let (method, uri) =
                    [("POST", "/pay"), ("PATCH", "/pay"), ("POST", "/pay?x=1")][i % 3];
                let content_type = [json, None, Some("text/plain")][i % 5 % 3];
                let body = [
                    format!(r#"{{"amount": {}, "currency": "eur"}}"#, i / 4),
                    format!(r#"{{"currency":"eur","amount":{}}}"#, i / 4),
                    format!("{} not json", i / 4),
                    format!(r#"{{"amount": {}.0, "currency": "eur"}}"#, i / 4),
                    large.replace("1}", &format!("{}}}", i / 6)),
                    large.clone(),
                ][i % 6]
                    .clone();
                let mut request = Request::builder().method(method).uri(uri);
                if let Some(content_type) = content_type {
                    request = request.header(CONTENT_TYPE, content_type);
                }
                let (parts, ()) = request.body(()).unwrap().into_parts();
                let key = Key::derive("memo", &(i % 11)).unwrap();
                (key, parts, Bytes::from(body))
            })
            .collect();
        for round in 0..2 {
            for (key, parts, body) in &requests {
                assert_eq!(
                    memo.of_request(key, parts, body).unwrap(),
                    of_request(parts, body).unwrap(),
                    "round {round}: {} {} {body:?}",
                    parts.method,
                    parts.uri
                );
            }
        }
        // Asked again at once, a JSON request is answered from its slot, not canonicalised,
        // whether its body is kept as it is or by its digest; another body under the same key
        // is canonicalised.
        let json_request = |body: &str| {
            let request = Request::builder().method("POST").uri("/pay");
            let (parts, ()) = request
                .header(CONTENT_TYPE, "application/json")
                .body(())
                .unwrap()
                .into_parts();
            (parts, Bytes::copy_from_slice(body.as_bytes()))
        };
        let key = Key::derive("memo", &"again").unwrap();
        // Another body of the same kind: small and kept as it is, or large and kept by its
        // digest.
        let other_large = large.replace("1}", "2}");
        for (body, other) in [
            (r#"{"amount": 1}"#, r#"{"amount": 2}"#),
            (large.as_str(), other_large.as_str()),
        ] {
            let (parts, body) = json_request(body);
            memo.of_request(&key, &parts, &body).unwrap();
            let before = CANONICALISED.get();
            memo.of_request(&key, &parts, &body).unwrap();
            assert_eq!(CANONICALISED.get(), before, "answered from the memo");
            assert!(before > 0);
            let (parts, other) = json_request(other);
            assert_eq!(
                memo.of_request(&key, &parts, &other).unwrap(),
                of_request(&parts, &other).unwrap()
            );
            assert_ne!(
                of_request(&parts, &other).unwrap(),
                of_request(&parts, &body).unwrap()
            );
            // Canonicalised four times: by the memo, and by `of_request` three times above.
            assert_eq!(
                CANONICALISED.get(),
                before + 4,
                "another body is canonicalised"
            );
        }
    }

    #[test]
    fn a_memo_slot_takes_what_the_guide_says() {
        // The guide: "about 100 bytes per slot", besides the body and the target kept.
        let slot = std::mem::size_of::<Mutex<Option<Remembered>>>();
        assert!((64..=128).contains(&slot), "{slot} bytes");
        // And "at most 8 MiB of bodies": a body is kept as it is up to 4 KiB, beyond that
        // by its digest.
        assert_eq!(MEMO_SLOTS * MEMO_BODY, 8 << 20);
        let memo = Memo::new();
        for len in [MEMO_BODY - 2, MEMO_BODY + 1] {
            let body = format!("\"{}\"", "x".repeat(len - 2));
            let (parts, ()) = Request::builder()
                .method("POST")
                .uri("/pay")
                .header(CONTENT_TYPE, "application/json")
                .body(())
                .unwrap()
                .into_parts();
            let key = Key::derive("memo", &len).unwrap();
            memo.of_request(&key, &parts, &Bytes::from(body)).unwrap();
            let kept = memo.slot(&key).lock().unwrap();
            match &kept.as_ref().expect("remembered").body {
                Seen::Bytes(bytes) => assert!(len <= MEMO_BODY, "{} bytes kept", bytes.len()),
                Seen::Digest(_) => assert!(len > MEMO_BODY, "a {len}-byte body as a digest"),
            }
        }
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
            r#"{"a":"xA","b":[1e0,{"a":true,"z":null}]}"#
        );
        assert_eq!(canonical("[]"), "[]");
        assert_eq!(canonical("{}"), "{}");
        assert_eq!(canonical("-1.5e3"), "-15e2");
        assert_eq!(canonical("[0, -0.0, 1.50, 100]"), "[0,0,15e-1,1e2]");
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

    /// One JSON spelling of the value `digits × 10^exponent` (with `negative` its sign),
    /// chosen by `pick`: zeros padded on either side, the decimal point anywhere, the
    /// exponent written in any of its forms.
    fn spell(
        negative: bool,
        digits: &str,
        exponent: i64,
        pick: &mut impl FnMut(u64) -> u64,
    ) -> String {
        let lead = "0".repeat(pick(3) as usize);
        let trail = pick(4) as usize;
        let padded = format!("{lead}{digits}{}", "0".repeat(trail));
        let point = pick(padded.len() as u64 + 1) as usize;
        let (integer, fraction) = padded.split_at(point);
        let integer = integer.trim_start_matches('0');
        let exponent = exponent - trail as i64 + fraction.len() as i64;
        let mut text = String::new();
        if negative {
            text.push('-');
        }
        text.push_str(if integer.is_empty() { "0" } else { integer });
        if !fraction.is_empty() {
            text.push('.');
            text.push_str(fraction);
        }
        if exponent != 0 || pick(2) == 0 {
            text.push(if pick(2) == 0 { 'e' } else { 'E' });
            match (exponent < 0, pick(2)) {
                (true, _) => text.push('-'),
                (false, 0) => text.push('+'),
                _ => {}
            }
            text.push_str(&"0".repeat(pick(2) as usize));
            text.push_str(&exponent.unsigned_abs().to_string());
        }
        text
    }

    fn canonical_number(text: &str) -> Vec<u8> {
        assert_eq!(number::length(text.as_bytes()), Some(text.len()), "{text}");
        let mut out = Vec::new();
        number::write_canonical(text.as_bytes(), &mut out).unwrap();
        out
    }

    #[test]
    fn numbers_are_compared_by_their_exact_decimal_value() {
        let same = |a: &str, b: &str| canonical_number(a) == canonical_number(b);
        for (a, b) in [
            ("1", "1.0"),
            ("1", "1e0"),
            ("1", "10e-1"),
            ("100", "1e2"),
            ("100", "1E+2"),
            ("0", "-0.0e7"),
            ("0.5", "5e-1"),
            ("-12.50", "-1.25e1"),
        ] {
            assert!(same(a, b), "{a} and {b} are one value");
        }
        for (a, b) in [
            ("18446744073709551617", "18446744073709551616"),
            ("99.999999999999999999", "100.0"),
            ("0.1", "0.10000000000000000001"),
            ("100000000000000000000001", "100000000000000000000000"),
            ("1e23", "99999999999999991611392"),
            ("1", "-1"),
            ("1e400", "1e401"),
        ] {
            assert!(!same(a, b), "{a} and {b} are two values");
        }
        // An exponent no value needs: the document counts by its bytes instead.
        assert!(canonical_json(b"[1e1000000000000000000]").is_none());
        assert!(canonical_json(b"[1e999999999999999999]").is_some());
        for invalid in [
            "01", "1.", ".5", "-", "1e", "1e+", "+1", "0x10", "NaN", "1.5.2",
        ] {
            assert!(canonical_json(invalid.as_bytes()).is_none(), "{invalid}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 32_768,
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// 2 million pairs (64 a case): two numbers canonicalize alike exactly when an
        /// arbitrary-precision decimal says they are equal. A pair is two spellings of one
        /// value, a value and a near neighbour (a digit changed, added or dropped, the
        /// exponent moved), or two independent values.
        #[test]
        fn canonical_numbers_agree_with_an_exact_decimal_oracle(seed in proptest::prelude::any::<u64>()) {
            use std::str::FromStr;
            use bigdecimal::BigDecimal;

            let mut state = seed | 1;
            let mut pick = move |n: u64| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state % n.max(1)
            };
            let value = |pick: &mut dyn FnMut(u64) -> u64| {
                let len = 1 + pick(40) as usize;
                let digits: String = (0..len).map(|_| char::from(b'0' + pick(10) as u8)).collect();
                (pick(4) == 0, digits, pick(80) as i64 - 40)
            };
            for _ in 0..64 {
                let (negative, digits, exponent) = value(&mut pick);
                let a = spell(negative, &digits, exponent, &mut pick);
                let b = match pick(4) {
                    0 | 1 => spell(negative, &digits, exponent, &mut pick),
                    2 => {
                        let mut near = digits.clone().into_bytes();
                        let at = pick(near.len() as u64) as usize;
                        match pick(4) {
                            0 => near[at] = b'0' + (near[at] - b'0' + 1 + pick(9) as u8) % 10,
                            1 => near.insert(at, b'0' + pick(10) as u8),
                            2 if near.len() > 1 => {
                                near.remove(at);
                            }
                            _ => {}
                        }
                        let near = String::from_utf8(near).unwrap();
                        let shift = pick(3) as i64 - 1;
                        spell(negative ^ (pick(16) == 0), &near, exponent + shift, &mut pick)
                    }
                    _ => {
                        let (negative, digits, exponent) = value(&mut pick);
                        spell(negative, &digits, exponent, &mut pick)
                    }
                };
                let equal = BigDecimal::from_str(&a).unwrap() == BigDecimal::from_str(&b).unwrap();
                proptest::prop_assert_eq!(
                    canonical_number(&a) == canonical_number(&b),
                    equal,
                    "{} and {}", a, b
                );
            }
        }
    }
}
