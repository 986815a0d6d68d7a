//! The `Idempotency-Key` request header (draft-ietf-httpapi-idempotency-key-header): a
//! structured-field string, or, leniently, the bare token that Stripe's clients send.

use http::HeaderMap;

pub use crate::IdempotencyKey;

/// The header's name.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The longest key accepted, in characters (the draft's recommendation, Stripe's limit).
pub const MAX_KEY_LEN: usize = 255;

/// Why a present header is refused.
pub(crate) type Malformed = &'static str;

/// The key of a request: `Ok(None)` when it has none.
pub(crate) fn parse(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, Malformed> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err("the request has several `Idempotency-Key` headers; send exactly one");
    }
    let raw = value.as_bytes().trim_ascii();
    let key = match raw {
        [b'"', inner @ .., b'"'] => unquote(inner)?,
        [b'"', ..] => return Err("the `Idempotency-Key` string is not closed with `\"`"),
        bare => token(bare)?,
    };
    if key.is_empty() {
        return Err("the `Idempotency-Key` header is empty");
    }
    if key.len() > MAX_KEY_LEN {
        return Err("the `Idempotency-Key` is longer than 255 characters");
    }
    Ok(Some(IdempotencyKey::new(key)))
}

/// The inside of a structured-field string (RFC 8941 §3.3.3): printable ASCII, with `\"`
/// and `\\` the only escapes.
fn unquote(inner: &[u8]) -> Result<String, Malformed> {
    let mut key = String::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&byte) = bytes.next() {
        match byte {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => key.push(char::from(escaped)),
                _ => return Err("the `Idempotency-Key` string has an invalid escape"),
            },
            b'"' => return Err("the `Idempotency-Key` string has an unescaped `\"`"),
            0x20..=0x7e => key.push(char::from(byte)),
            _ => {
                return Err("the `Idempotency-Key` string has a character outside printable ASCII")
            }
        }
    }
    Ok(key)
}

/// A bare key, as Stripe's clients send it: visible ASCII without quotes, backslashes,
/// commas or spaces.
fn token(bare: &[u8]) -> Result<String, Malformed> {
    if bare
        .iter()
        .all(|&b| (0x21..=0x7e).contains(&b) && !matches!(b, b'"' | b'\\' | b','))
    {
        Ok(bare.iter().map(|&b| char::from(b)).collect())
    } else {
        Err("the `Idempotency-Key` is neither a quoted string nor a bare token")
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn a_key_serializes_as_its_string() {
        let key = IdempotencyKey::new("8e03978e-40d5".to_string());
        assert_eq!(serde_json::to_value(&key).unwrap(), "8e03978e-40d5");
    }

    fn parsed(values: &[&[u8]]) -> Result<Option<String>, Malformed> {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(IDEMPOTENCY_KEY, HeaderValue::from_bytes(value).unwrap());
        }
        parse(&headers).map(|key| key.map(|k| k.as_str().to_owned()))
    }

    #[test]
    fn strings_and_bare_tokens_are_keys() {
        assert_eq!(parsed(&[]), Ok(None));
        assert_eq!(
            parsed(&[b"\"8e03978e-40d5\""]),
            Ok(Some("8e03978e-40d5".into()))
        );
        assert_eq!(
            parsed(&[b"8e03978e-40d5"]),
            Ok(Some("8e03978e-40d5".into()))
        );
        assert_eq!(parsed(&[b" \"a b\" "]), Ok(Some("a b".into())));
        assert_eq!(parsed(&[br#""q\"uote\\""#]), Ok(Some(r#"q"uote\"#.into())));
        let longest = "k".repeat(MAX_KEY_LEN);
        assert_eq!(parsed(&[longest.as_bytes()]), Ok(Some(longest.clone())));
    }

    #[test]
    fn malformed_keys_are_refused() {
        for bad in [
            &b"\"\""[..],
            b"",
            b"\"open",
            b"\"bad\\escape\"",
            b"a,b",
            b"two words",
            b"\"in\"side\"",
            "k".repeat(MAX_KEY_LEN + 1).as_bytes(),
        ] {
            assert!(
                parsed(&[bad]).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(parsed(&[b"a", b"b"]).is_err(), "several values");
    }
}
