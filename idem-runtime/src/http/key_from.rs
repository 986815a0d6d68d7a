//! [`KeyFrom`]: where a request carries its idempotency key. The `Idempotency-Key` header by
//! default; a header of the service's choosing, several headers together, a member of the
//! JSON body, or a function of the request, for callers that send no such header (webhook
//! senders, which put their event's id in the body or a header of their own).

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::header::HeaderName;
use http::request::Parts;
use http::HeaderMap;

use super::header::{self, IdempotencyKey, MAX_KEY_LEN};
use super::problem::KeyNaming;
#[cfg(feature = "axum")]
use super::problem::Problem;

/// A function that finds a request's key in its parts and body: `None` when it has none.
type KeyFn = Arc<dyn Fn(&Parts, &Bytes) -> Option<String> + Send + Sync>;

/// Where a request carries its idempotency key; given to
/// [`IdempotencyLayer::key_from`](super::IdempotencyLayer::key_from).
///
/// Whatever the source, a key is at most [`MAX_KEY_LEN`] bytes of text, and a request without
/// one passes through unless the layer is [`required`](super::IdempotencyLayer::required).
/// Problems name the source (`the \`X-GitHub-Delivery\` header`, `the body's \`/id\``), never
/// a header the request did not use. The fingerprint stays method, path and query, and body:
/// a body key is part of its body, so it changes nothing there.
///
/// ```
/// use idem_runtime::http::{IdempotencyLayer, KeyFrom};
/// use idem_runtime::MemoryStore;
///
/// // Stripe-style events: the id is the body's `id` member.
/// let events = IdempotencyLayer::new(MemoryStore::new())
///     .unscoped()
///     .key_from(KeyFrom::json("/id"));
/// // A delivery named by two headers together.
/// let hooks = IdempotencyLayer::new(MemoryStore::new())
///     .unscoped()
///     .key_from(KeyFrom::headers(["x-github-hook-id", "x-github-delivery"]));
/// # let _ = (events, hooks);
/// ```
#[derive(Clone)]
pub struct KeyFrom {
    source: Source,
}

#[derive(Clone)]
enum Source {
    /// The `Idempotency-Key` header, as the IETF draft defines it.
    IdempotencyKey,
    /// The values of these headers, in this order, each present once.
    Headers(Arc<[HeaderName]>),
    /// The JSON body's member at this pointer (RFC 6901).
    Json(Arc<str>),
    /// The service's own function.
    With(KeyFn),
    /// One sender's id header in the spelling whose signature header the request has
    /// (`[id, signature]` pairs, the first spelling when none is there): the id the
    /// signature that is checked vouches for, never another spelling's unsigned one.
    SignedId(Arc<[[HeaderName; 2]]>),
    /// What a sender that signs the body alone authenticates: the topic header's value (not
    /// signed, but it names which kind of event the body is), and the body's SHA-256.
    SignedBody(HeaderName),
}

/// What looking for a key found.
pub(super) enum Found {
    /// The request's key: its parts (one per header, or one), and what a handler sees.
    Key(Keyed),
    /// The request carries no key.
    Missing,
    /// The key is there but unusable, and why, in the layer's own words.
    Malformed(&'static str),
    /// The key is in the body, which has not been read yet.
    InBody,
}

/// A key found in a request.
pub(super) struct Keyed {
    /// What the key is derived from: one value, or one per header, in order.
    pub(super) values: KeyValues,
    /// What a handler reads as its request's key.
    pub(super) shown: IdempotencyKey,
}

/// The values a key is derived from. One value (the key shown) derives exactly as the
/// `Idempotency-Key` header always has, so that records made before a source was chosen
/// still match.
pub(super) enum KeyValues {
    /// The key shown is the one value.
    One,
    /// One value per header, in order.
    Several(Vec<String>),
}

impl KeyFrom {
    /// The `Idempotency-Key` header (the default): a structured-field string, or the bare
    /// token Stripe's clients send.
    pub fn idempotency_key() -> Self {
        Self {
            source: Source::IdempotencyKey,
        }
    }

    /// The value of the header `name`, as it is sent (visible ASCII, surrounding spaces
    /// trimmed). Several values of it are malformed.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name: a programming error, found on the first run.
    pub fn header(name: &str) -> Self {
        Self::headers([name])
    }

    /// The values of every header in `names` together, in this order: a request without
    /// any one of them has no key. For senders that name a delivery by more than one
    /// header (GitHub: the hook and the delivery). A handler reads the values joined by `/`
    /// as its request's [`IdempotencyKey`].
    ///
    /// # Panics
    ///
    /// If a name is not a valid header name, or `names` is empty.
    pub fn headers<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        let names: Arc<[HeaderName]> = names
            .into_iter()
            .map(|name| match HeaderName::from_bytes(name.as_bytes()) {
                Ok(name) => name,
                Err(_) => panic!("`{name}` is not a valid header name"),
            })
            .collect();
        assert!(
            !names.is_empty(),
            "`KeyFrom::headers` needs at least one name"
        );
        Self {
            source: Source::Headers(names),
        }
    }

    /// The member of the JSON body at `pointer` (RFC 6901: `"/id"`, `"/data/object/id"`), a
    /// string or an integer. A body that is not JSON, or has no such member, has no key;
    /// any other type there is malformed. The integer `1` and the string `"1"` are one key
    /// (what a handler reads is the same text): two requests that differ so differ in their
    /// bodies too, and the second is a `422`, never the first's response.
    ///
    /// # Panics
    ///
    /// If `pointer` is neither empty nor starts with `/`.
    pub fn json(pointer: &str) -> Self {
        assert!(
            pointer.is_empty() || pointer.starts_with('/'),
            "`{pointer}` is not a JSON pointer: it starts with `/`, as in `/id`"
        );
        Self {
            source: Source::Json(pointer.into()),
        }
    }

    /// A function of the request's parts and body: `None` when the request has no key.
    ///
    /// ```
    /// use idem_runtime::http::{IdempotencyLayer, KeyFrom};
    /// use idem_runtime::MemoryStore;
    ///
    /// // The last segment of the path: `POST /transfers/{id}`.
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .unscoped()
    ///     .key_from(KeyFrom::with(|parts, _body| {
    ///         parts.uri.path().rsplit('/').next().map(str::to_owned)
    ///     }));
    /// # let _ = layer;
    /// ```
    pub fn with<F>(key: F) -> Self
    where
        F: Fn(&Parts, &Bytes) -> Option<String> + Send + Sync + 'static,
    {
        Self {
            source: Source::With(Arc::new(key)),
        }
    }

    /// The id header of the first spelling whose signature header the request carries
    /// (`[id, signature]` pairs: Standard Webhooks' `webhook-*` and Svix's `svix-*`), as
    /// the sender's verification picks the same spelling.
    pub(super) fn signed_id(spellings: &[[&'static str; 2]]) -> Self {
        Self {
            source: Source::SignedId(
                spellings
                    .iter()
                    .map(|pair| pair.map(HeaderName::from_static))
                    .collect(),
            ),
        }
    }

    /// The topic header's value and the SHA-256 of the body: the key of a sender that signs
    /// the body and nothing else, so that the key is what the signature vouches for.
    pub(super) fn signed_body(topic: &'static str) -> Self {
        Self {
            source: Source::SignedBody(HeaderName::from_static(topic)),
        }
    }

    /// Whether the key is found only once the body is read.
    pub(super) fn reads_body(&self) -> bool {
        matches!(
            self.source,
            Source::Json(_) | Source::With(_) | Source::SignedBody(_)
        )
    }

    /// The key of a request whose body is not read yet.
    pub(super) fn in_head(&self, headers: &HeaderMap) -> Found {
        match &self.source {
            Source::IdempotencyKey => match header::parse(headers) {
                Ok(Some(key)) => Found::Key(Keyed {
                    values: KeyValues::One,
                    shown: key,
                }),
                Ok(None) => Found::Missing,
                Err(why) => Found::Malformed(why),
            },
            Source::Headers(names) => {
                let mut values = Vec::with_capacity(names.len());
                for name in names.iter() {
                    let mut all = headers.get_all(name).iter();
                    let Some(value) = all.next() else {
                        return Found::Missing;
                    };
                    if all.next().is_some() {
                        return Found::Malformed("the key header is sent more than once");
                    }
                    let Ok(value) = value.to_str() else {
                        return Found::Malformed("the key header is not visible ASCII");
                    };
                    match checked(value.trim()) {
                        Ok(value) => values.push(value.to_owned()),
                        Err(why) => return Found::Malformed(why),
                    }
                }
                Found::Key(Keyed::of(values))
            }
            Source::SignedId(spellings) => {
                let signed = spellings
                    .iter()
                    .find(|[_, signature]| headers.contains_key(signature))
                    .unwrap_or(&spellings[0]);
                Self::headers([signed[0].as_str()]).in_head(headers)
            }
            Source::Json(_) | Source::With(_) | Source::SignedBody(_) => Found::InBody,
        }
    }

    /// The key of a request whose body is read.
    pub(super) fn in_request(&self, parts: &Parts, body: &Bytes) -> Found {
        match &self.source {
            Source::Json(pointer) => {
                let Ok(document) = serde_json::from_slice::<serde_json::Value>(body) else {
                    return Found::Missing;
                };
                let key = match document.pointer(pointer) {
                    None | Some(serde_json::Value::Null) => return Found::Missing,
                    Some(serde_json::Value::String(key)) => key.clone(),
                    Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
                    Some(_) => {
                        return Found::Malformed("the key is neither a string nor an integer")
                    }
                };
                keyed(key)
            }
            Source::With(find) => match find(parts, body) {
                Some(key) => keyed(key),
                None => Found::Missing,
            },
            Source::SignedBody(topic) => {
                use sha2::Digest as _;
                let topic = match parts.headers.get(topic).map(|t| t.to_str().map(str::trim)) {
                    None => "",
                    Some(Ok(topic)) if topic.len() <= 64 => topic,
                    Some(_) => return Found::Malformed("the topic header is not a short text"),
                };
                let digest = hex::encode(sha2::Sha256::digest(body));
                let shown = if topic.is_empty() {
                    digest.clone()
                } else {
                    format!("{topic}/{digest}")
                };
                Found::Key(Keyed {
                    values: KeyValues::Several(vec![topic.to_owned(), digest]),
                    shown: IdempotencyKey::new(shown),
                })
            }
            Source::IdempotencyKey | Source::Headers(_) | Source::SignedId(_) => {
                self.in_head(&parts.headers)
            }
        }
    }

    /// Where the key is, as a problem names it.
    pub(super) fn naming(&self) -> KeyNaming {
        match &self.source {
            Source::IdempotencyKey => KeyNaming::IdempotencyKey,
            _ => KeyNaming::Named(self.named()),
        }
    }

    /// Where the key is, in words: "the `Idempotency-Key` header".
    fn named(&self) -> String {
        match &self.source {
            Source::IdempotencyKey => "the `Idempotency-Key` header".to_owned(),
            Source::Headers(names) if names.len() == 1 => format!("the `{}` header", names[0]),
            Source::Headers(names) => {
                let names: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
                format!("the {} headers", names.join(" and "))
            }
            Source::Json(pointer) => format!("the body's `{pointer}`"),
            Source::With(_) => "the request's key".to_owned(),
            Source::SignedId(spellings) => {
                let names: Vec<String> =
                    spellings.iter().map(|[id, _]| format!("`{id}`")).collect();
                format!("the {} header", names.join(" or "))
            }
            Source::SignedBody(_) => "the signed body".to_owned(),
        }
    }
}

/// The key of a request's head, read from `source`: `Ok(None)` when there is none, the
/// problem when it is malformed or cannot be read from the head.
/// The request's key as a handler extracts it: the one a layer in front found (the
/// idempotency layer, or a webhook preset, which may have read it from the body), else the
/// one `source` finds in the head.
#[cfg(feature = "axum")]
fn extracted(source: &KeyFrom, parts: &Parts) -> Result<Option<IdempotencyKey>, Problem> {
    if let Some(found) = parts.extensions.get::<IdempotencyKey>() {
        return Ok(Some(found.clone()));
    }
    match source.in_head(&parts.headers) {
        Found::Key(keyed) => Ok(Some(keyed.shown)),
        Found::Missing => Ok(None),
        Found::Malformed(why) => Err(Problem::KeyMalformed(why)),
        Found::InBody => {
            tracing::error!(source = ?source, "the `IdempotencyKey` extractor reads the request's head, and this key is in its body: answered 500");
            Err(Problem::Internal)
        }
    }
}

/// The source an extractor reads: the request's [`KeyFrom`] extension, or the default.
#[cfg(feature = "axum")]
fn source_of(parts: &Parts) -> KeyFrom {
    parts
        .extensions
        .get::<KeyFrom>()
        .cloned()
        .unwrap_or_default()
}

#[cfg(feature = "axum")]
fn rejection(source: &KeyFrom, problem: Problem) -> axum::response::Response {
    problem.answer(&source.naming()).map(axum::body::Body::new)
}

#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for IdempotencyKey {
    type Rejection = axum::response::Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let source = source_of(parts);
        match extracted(&source, parts) {
            Ok(Some(key)) => Ok(key),
            Ok(None) => Err(rejection(&source, Problem::KeyMissing)),
            Err(problem) => Err(rejection(&source, problem)),
        }
    }
}

#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = axum::response::Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        let source = source_of(parts);
        extracted(&source, parts).map_err(|problem| rejection(&source, problem))
    }
}

impl Default for KeyFrom {
    fn default() -> Self {
        Self::idempotency_key()
    }
}

impl fmt::Debug for KeyFrom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("KeyFrom").field(&self.named()).finish()
    }
}

impl Keyed {
    fn of(mut values: Vec<String>) -> Self {
        if values.len() == 1 {
            return Self {
                shown: IdempotencyKey::new(values.remove(0)),
                values: KeyValues::One,
            };
        }
        Self {
            shown: IdempotencyKey::new(values.join("/")),
            values: KeyValues::Several(values),
        }
    }
}

/// A key found in the body, checked.
fn keyed(key: String) -> Found {
    match checked(&key) {
        Ok(_) => Found::Key(Keyed::of(vec![key])),
        Err(why) => Found::Malformed(why),
    }
}

/// A key value within the limits every source shares.
fn checked(value: &str) -> Result<&str, &'static str> {
    if value.is_empty() {
        Err("the key is empty")
    } else if value.len() > MAX_KEY_LEN {
        Err("the key is longer than 255 bytes")
    } else {
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderValue, Request};

    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut request = Request::post("/hooks");
        for (name, value) in headers {
            request = request.header(*name, HeaderValue::from_str(value).unwrap());
        }
        request.body(()).unwrap().into_parts().0
    }

    fn key(found: Found) -> Result<Option<Vec<String>>, &'static str> {
        match found {
            Found::Key(keyed) => Ok(Some(match keyed.values {
                KeyValues::One => vec![keyed.shown.as_str().to_owned()],
                KeyValues::Several(several) => several,
            })),
            Found::Missing => Ok(None),
            Found::Malformed(why) => Err(why),
            Found::InBody => panic!("the key is in the body"),
        }
    }

    #[test]
    fn several_headers_make_one_key_and_each_is_required() {
        let source = KeyFrom::headers(["x-hook", "x-delivery"]);
        let both = parts(&[("x-delivery", " d-1 "), ("x-hook", "7")]);
        assert_eq!(
            key(source.in_head(&both.headers)),
            Ok(Some(vec!["7".into(), "d-1".into()]))
        );
        let one = parts(&[("x-delivery", "d-1")]);
        assert_eq!(key(source.in_head(&one.headers)), Ok(None));
        let twice = parts(&[("x-hook", "7"), ("x-hook", "8"), ("x-delivery", "d")]);
        assert!(key(source.in_head(&twice.headers)).is_err());
        let empty = parts(&[("x-hook", " "), ("x-delivery", "d")]);
        assert!(key(source.in_head(&empty.headers)).is_err());
    }

    #[test]
    fn a_json_pointer_takes_strings_and_integers() {
        let source = KeyFrom::json("/data/id");
        let found = |body: &str| key(source.in_request(&parts(&[]), &Bytes::from(body.to_owned())));
        assert_eq!(
            found(r#"{"data":{"id":"evt_1"}}"#),
            Ok(Some(vec!["evt_1".into()]))
        );
        assert_eq!(found(r#"{"data":{"id":42}}"#), Ok(Some(vec!["42".into()])));
        assert_eq!(found(r#"{"data":{}}"#), Ok(None));
        assert_eq!(found(r#"{"data":{"id":null}}"#), Ok(None));
        assert_eq!(found("not json"), Ok(None));
        assert!(found(r#"{"data":{"id":1.5}}"#).is_err());
        assert!(found(r#"{"data":{"id":{"a":1}}}"#).is_err());
        assert!(found(r#"{"data":{"id":""}}"#).is_err());
        let long = format!(r#"{{"data":{{"id":"{}"}}}}"#, "k".repeat(MAX_KEY_LEN + 1));
        assert!(found(&long).is_err());
    }

    #[test]
    fn problems_name_where_the_key_is() {
        assert_eq!(KeyFrom::default().named(), "the `Idempotency-Key` header");
        assert_eq!(
            KeyFrom::header("X-Shopify-Webhook-Id").named(),
            "the `x-shopify-webhook-id` header"
        );
        assert_eq!(
            KeyFrom::headers(["a", "b"]).named(),
            "the `a` and `b` headers"
        );
        assert_eq!(KeyFrom::json("/id").named(), "the body's `/id`");
    }
}
