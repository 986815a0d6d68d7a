//! [`Webhook`]: the sender presets of
//! [`IdempotencyLayer::webhook`](super::IdempotencyLayer::webhook). Each knows where its
//! sender puts a delivery's id, how it signs a delivery, and how long it retries one.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha2::Sha256;

use super::key_from::KeyFrom;
use crate::Error;

mod verify;

pub use self::verify::{WebhookFuture, WebhookService};

type HmacSha256 = Hmac<Sha256>;

const DAY: Duration = Duration::from_secs(24 * 3600);

/// A webhook sender: how it signs a delivery, what identifies one, how long it retries one,
/// and the receiving endpoint the records belong to. Given to
/// [`IdempotencyLayer::webhook`](super::IdempotencyLayer::webhook), or used as a layer of
/// its own in front of a handler that claims the delivery in its transaction.
///
/// | preset | key (what the signature vouches for) | signature (HMAC-SHA256) | timestamp tolerance | sender retries | kept (TTL) | duplicate waits |
/// |---|---|---|---|---|---|---|
/// | [`stripe`](Self::stripe) | the body's `/id` (the event) | `Stripe-Signature: t=…,v1=<hex>` over `t.body` | 5 min | 3 days | 4 days | 8 s |
/// | [`github`](Self::github) | `X-GitHub-Event` and the body's SHA-256 | `X-Hub-Signature-256: sha256=<hex>` over the body | none (unsigned) | redelivered by hand, 3 days | 4 days | 8 s |
/// | [`shopify`](Self::shopify) | `X-Shopify-Topic` and the body's SHA-256 | `X-Shopify-Hmac-Sha256: <base64>` over the body | none (unsigned) | 8 times over 4 hours (formerly 19 over 48 hours) | 3 days | 4 s |
/// | [`standard`](Self::standard) | `webhook-id` (Svix: `svix-id`) | `webhook-signature: v1,<base64>` (Svix: `svix-signature`) over `id.timestamp.body` | 5 min | Svix: past 51 hours | 4 days | 8 s |
///
/// **Every endpoint keeps its own records.** Senders send one event id to every endpoint
/// subscribed to it (Stripe, Standard Webhooks; GitHub to every hook an event triggers),
/// so a preset's keys live in a namespace of the receiving endpoint,
/// `idem.webhook.<sender>.<endpoint>`: the name [`endpoint`](Self::endpoint) gives it, or,
/// unnamed, one derived from its secret (`key-` and 12 hex digits of a SHA-256 of it, which
/// tells nothing of the secret). Two endpoints of one sender on one store each run each
/// event once. **Name an endpoint whose secret will change**: an unnamed one is its secret,
/// and a new secret starts its records afresh, where a named one keeps them through the
/// rotation (Stripe and Standard Webhooks sign with the old and the new secret together
/// while a rotation lasts; the preset accepts a delivery one of whose signatures is its
/// secret's). Endpoints that share a secret (one GitHub App, hooks sharing one) must be
/// named apart, or they share their records.
///
/// **What each sender lets a receiver defend** (a secret leaked to an attacker defends
/// nothing):
///
/// | | Stripe | Standard Webhooks / Svix | GitHub | Shopify |
/// |---|---|---|---|---|
/// | a forged delivery | `401` | `401` | `401` | `401` |
/// | a captured delivery sent again | replayed while kept; `401` past the 5 min tolerance | replayed while kept; `401` past the tolerance | replayed while kept, **under any delivery id** (the key is the signed body); runs again once its record expired | as GitHub |
/// | an id taken by another body | impossible: the id is in the signed body | impossible: the id is signed | nothing to take: the key is the signed body, so an old body under a new delivery's id is its old self, and the real delivery runs | as GitHub |
/// | a captured body under another topic header | (signed) | (signed) | runs as that topic, once: the topic header is not signed | as GitHub |
/// | a secret's rotation | both signatures accepted while it lasts; records kept if named | as Stripe | one secret at a time; records kept if named | as GitHub |
///
/// Every comparison of a signature is in constant time. A request whose signature is
/// missing, malformed, outside the tolerance or not the sender's is answered `401`
/// problem+json before anything is claimed, whatever its method, and a request of another
/// method than `POST` is passed on unclaimed only once verified. GitHub and Shopify sign no
/// timestamp: keep their TTL at least as long as a replayed delivery would matter, or check
/// a date the payload carries. A Stripe event's `pending_webhooks` (how many of its
/// deliveries are still pending) changes between retries, so it is left out of the
/// fingerprint, whatever the `Content-Type`.
///
/// Each claim is labelled with the delivery's id as the sender names it (Stripe's event id,
/// `X-GitHub-Delivery`, `X-Shopify-Webhook-Id`, `webhook-id`): an operator finds a stuck
/// delivery by it, `idem show --webhook stripe evt_…`. Ids are not personal data.
#[derive(Clone)]
pub struct Webhook {
    sender: Sender,
    secret: Vec<u8>,
    /// The receiving endpoint's name, if it was given one.
    endpoint: Option<Arc<str>>,
    tolerance: Duration,
    ttl: Duration,
    /// The largest body read when the preset is a layer of its own.
    max_body: usize,
}

/// The senders with a preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sender {
    Stripe,
    GitHub,
    Shopify,
    Standard,
}

impl Sender {
    fn name(self) -> &'static str {
        match self {
            Self::Stripe => "stripe",
            Self::GitHub => "github",
            Self::Shopify => "shopify",
            Self::Standard => "standard",
        }
    }
}

/// Why a delivery's signature is refused: said in `tracing`, never to the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Refused {
    /// The signature header (or the timestamp it needs) is missing.
    Missing,
    /// The header does not parse as the sender writes it.
    Malformed,
    /// The timestamp is further from now than the tolerance.
    Stale,
    /// No signature in the header is the sender's for this body.
    Mismatch,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Missing => "the signature is missing",
            Self::Malformed => "the signature header is malformed",
            Self::Stale => "the signature's timestamp is outside the tolerance",
            Self::Mismatch => "the signature does not match the body",
        })
    }
}

/// The headers of a Standard Webhooks delivery, in the spelling it came with: the
/// specification's (`webhook-*`), or Svix's default (`svix-*`).
const STANDARD_HEADERS: [[&str; 3]; 2] = [
    ["webhook-id", "webhook-timestamp", "webhook-signature"],
    ["svix-id", "svix-timestamp", "svix-signature"],
];

/// The spelling of a Standard Webhooks delivery's headers: the first whose signature header
/// it carries (the specification's when none). The signature, the key and the label all
/// read this one spelling, so that an unsigned id of the other spelling, added to a
/// captured delivery, is never its key.
fn standard_spelling(headers: &HeaderMap) -> [&'static str; 3] {
    STANDARD_HEADERS
        .into_iter()
        .find(|[_, _, signature]| headers.contains_key(*signature))
        .unwrap_or(STANDARD_HEADERS[0])
}

impl Webhook {
    fn new(sender: Sender, secret: Vec<u8>, ttl: Duration) -> Result<Self, Error> {
        if secret.iter().all(u8::is_ascii_whitespace) {
            // A missing environment variable read as "" would let anyone sign.
            return Err(Error::config(format!(
                "the {} webhook secret is empty: anyone could sign a delivery with it (is the variable that holds it set?)",
                sender.name()
            )));
        }
        Ok(Self {
            sender,
            secret,
            endpoint: None,
            tolerance: Duration::from_secs(300),
            ttl,
            max_body: super::DEFAULT_MAX_BODY,
        })
    }

    /// Stripe: the endpoint's signing secret (`whsec_…`, used as it is shown).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when the secret is empty.
    pub fn stripe(secret: impl AsRef<[u8]>) -> Result<Self, Error> {
        Self::new(Sender::Stripe, secret.as_ref().to_vec(), 4 * DAY)
    }

    /// GitHub: the hook's secret.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when the secret is empty.
    pub fn github(secret: impl AsRef<[u8]>) -> Result<Self, Error> {
        Self::new(Sender::GitHub, secret.as_ref().to_vec(), 4 * DAY)
    }

    /// Shopify: the app's client secret.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when the secret is empty.
    pub fn shopify(secret: impl AsRef<[u8]>) -> Result<Self, Error> {
        Self::new(Sender::Shopify, secret.as_ref().to_vec(), 3 * DAY)
    }

    /// Standard Webhooks (Svix and the senders that follow its specification): the
    /// endpoint's secret, `whsec_` and the key in base64. Deliveries are accepted with the
    /// specification's headers (`webhook-id`, `webhook-timestamp`, `webhook-signature`)
    /// and with Svix's default ones (`svix-id`, `svix-timestamp`, `svix-signature`).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when the secret is not base64 after its `whsec_` prefix, or is
    /// empty.
    ///
    /// ```
    /// use idem_runtime::http::Webhook;
    ///
    /// let preset = Webhook::standard("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?.endpoint("orders")?;
    /// # let _ = preset;
    /// # Ok::<_, idem_runtime::Error>(())
    /// ```
    pub fn standard(secret: &str) -> Result<Self, Error> {
        let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
        let key = BASE64.decode(encoded).map_err(|_| {
            Error::config("a Standard Webhooks secret is `whsec_` and the key in base64")
        })?;
        Self::new(Sender::Standard, key, 4 * DAY)
    }

    /// Names the receiving endpoint (`"billing"`, `"stripe-eu"`): its records are kept
    /// under `idem.webhook.<sender>.<name>`, apart from every other endpoint's, and through
    /// a rotation of its secret. Without a name, an endpoint is known by its secret.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when `name` is empty, longer than 64 bytes, or has a character
    /// other than ASCII letters, digits, `-`, `_` and `.`.
    pub fn endpoint(mut self, name: &str) -> Result<Self, Error> {
        let fits = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !fits {
            return Err(Error::config(format!(
                "a webhook endpoint's name is 1 to 64 ASCII letters, digits, `-`, `_` and `.`, not {name:?}"
            )));
        }
        self.endpoint = Some(name.into());
        Ok(self)
    }

    /// How far a signed timestamp may be from this machine's clock (default 5 minutes), for
    /// the senders that sign one (Stripe, Standard Webhooks): an older delivery is refused,
    /// so a captured one cannot be sent again later.
    #[must_use]
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// How long a delivery's response is kept and replayed (the table's default covers the
    /// sender's retries).
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The largest delivery body read when the preset is a layer of its own (default
    /// [`DEFAULT_MAX_BODY`](super::DEFAULT_MAX_BODY), 1 MiB): a larger one is answered
    /// `413` before its signature is checked. Behind
    /// [`IdempotencyLayer::webhook`](super::IdempotencyLayer::webhook), the idempotency
    /// layer's own [`max_body`](super::IdempotencyLayer::max_body) bounds it.
    #[must_use]
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// The kept response's lifetime.
    pub(super) fn kept(&self) -> Duration {
        self.ttl
    }

    /// How long a duplicate waits for a delivery still running: well within the sender's
    /// own timeout (GitHub's 10 s, Shopify's 5 s), so that it is answered (`409` at worst,
    /// which the sender retries) rather than cut off.
    pub(super) fn wait(&self) -> Duration {
        match self.sender {
            Sender::Shopify => Duration::from_secs(4),
            Sender::Stripe | Sender::GitHub | Sender::Standard => Duration::from_secs(8),
        }
    }

    /// The receiving endpoint as its records know it: its name, or one derived from its
    /// secret.
    pub(super) fn identity(&self) -> Cow<'_, str> {
        use sha2::Digest as _;
        match &self.endpoint {
            Some(name) => Cow::Borrowed(name),
            None => {
                let mut digest = Sha256::new();
                digest.update(b"idem webhook endpoint\0");
                digest.update(&self.secret);
                let digest = digest.finalize();
                Cow::Owned(format!("key-{}", hex::encode(&digest[..6])))
            }
        }
    }

    /// The namespace of the preset's keys: the sender's, and the receiving endpoint's.
    pub(super) fn namespace(&self) -> String {
        format!("idem.webhook.{}.{}", self.sender.name(), self.identity())
    }

    /// What identifies a delivery: what its signature vouches for.
    pub(super) fn key_from(&self) -> KeyFrom {
        match self.sender {
            Sender::Stripe => KeyFrom::json("/id"),
            Sender::GitHub => KeyFrom::signed_body("x-github-event"),
            Sender::Shopify => KeyFrom::signed_body("x-shopify-topic"),
            Sender::Standard => {
                KeyFrom::signed_id(&STANDARD_HEADERS.map(|[id, _, signature]| [id, signature]))
            }
        }
    }

    /// The delivery's id as its sender names it, for an operator: the claim's label. `None`
    /// when it has none that reads as a label (at most 255 bytes of visible ASCII).
    pub(super) fn delivery_id(&self, headers: &HeaderMap, body: &[u8]) -> Option<String> {
        let id = match self.sender {
            Sender::Stripe => {
                #[derive(serde::Deserialize)]
                struct Event {
                    id: String,
                }
                serde_json::from_slice::<Event>(body).ok()?.id
            }
            Sender::GitHub => text(headers, "x-github-delivery").ok()?.to_owned(),
            Sender::Shopify => text(headers, "x-shopify-webhook-id").ok()?.to_owned(),
            Sender::Standard => text(headers, standard_spelling(headers)[0])
                .ok()?
                .to_owned(),
        };
        let readable = !id.is_empty()
            && id.len() <= super::header::MAX_KEY_LEN
            && id.bytes().all(|b| b.is_ascii_graphic());
        readable.then_some(id)
    }

    /// The top-level members of a delivery's JSON body its fingerprint leaves out: those
    /// the sender changes between resends of one delivery (Stripe's count of the event's
    /// pending deliveries).
    pub(super) fn unfingerprinted(&self) -> &'static [&'static str] {
        match self.sender {
            Sender::Stripe => &["pending_webhooks"],
            Sender::GitHub | Sender::Shopify | Sender::Standard => &[],
        }
    }

    /// Whether `body` with `headers` is the sender's, now.
    pub(super) fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<(), Refused> {
        self.verify_at(headers, body, SystemTime::now())
    }

    /// Whether `body` with `headers` is the sender's at `now`.
    fn verify_at(&self, headers: &HeaderMap, body: &[u8], now: SystemTime) -> Result<(), Refused> {
        match self.sender {
            Sender::Stripe => {
                let header = text(headers, "stripe-signature")?;
                let mut timestamp = None;
                let mut signatures = Vec::new();
                for pair in header.split(',') {
                    match pair.trim().split_once('=') {
                        Some(("t", t)) => timestamp = Some(t),
                        Some(("v1", signature)) => {
                            signatures.push(hex::decode(signature).map_err(|_| Refused::Malformed)?)
                        }
                        // Other schemes (`v0`, test-mode signatures) are not checked.
                        Some(_) => {}
                        None => return Err(Refused::Malformed),
                    }
                }
                let timestamp = timestamp.ok_or(Refused::Missing)?;
                self.fresh(timestamp, now)?;
                let mac = self.mac([timestamp.as_bytes(), b".", body]);
                any_matches(&mac, &signatures)
            }
            Sender::GitHub => {
                let header = text(headers, "x-hub-signature-256")?;
                let signature = header.strip_prefix("sha256=").ok_or(Refused::Malformed)?;
                let signature = hex::decode(signature).map_err(|_| Refused::Malformed)?;
                any_matches(&self.mac([body]), &[signature])
            }
            Sender::Shopify => {
                let header = text(headers, "x-shopify-hmac-sha256")?;
                let signature = BASE64.decode(header).map_err(|_| Refused::Malformed)?;
                any_matches(&self.mac([body]), &[signature])
            }
            Sender::Standard => {
                let [id, timestamp, signature] = standard_spelling(headers);
                let id = text(headers, id)?;
                let timestamp = text(headers, timestamp)?;
                let header = text(headers, signature)?;
                self.fresh(timestamp, now)?;
                let mut signatures = Vec::new();
                for entry in header.split(' ').filter(|entry| !entry.is_empty()) {
                    let (version, signature) = entry.split_once(',').ok_or(Refused::Malformed)?;
                    // Other versions (`v1a`, asymmetric) are not checked.
                    if version == "v1" {
                        signatures.push(BASE64.decode(signature).map_err(|_| Refused::Malformed)?);
                    }
                }
                let mac = self.mac([id.as_bytes(), b".", timestamp.as_bytes(), b".", body]);
                any_matches(&mac, &signatures)
            }
        }
    }

    /// The MAC of the concatenated `parts` under the secret.
    fn mac<const N: usize>(&self, parts: [&[u8]; N]) -> HmacSha256 {
        // HMAC takes a key of any length.
        let mut mac = HmacSha256::new_from_slice(&self.secret).expect("HMAC takes any key length");
        for part in parts {
            mac.update(part);
        }
        mac
    }

    /// Whether a signed timestamp (seconds since the epoch) is within the tolerance of now.
    fn fresh(&self, timestamp: &str, now: SystemTime) -> Result<(), Refused> {
        let signed: u64 = timestamp.parse().map_err(|_| Refused::Malformed)?;
        let now = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        if now.abs_diff(signed) > self.tolerance.as_secs() {
            return Err(Refused::Stale);
        }
        Ok(())
    }
}

impl fmt::Debug for Webhook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the secret.
        f.debug_struct("Webhook")
            .field("sender", &self.sender)
            .field("endpoint", &self.identity())
            .field("tolerance", &self.tolerance)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

/// The one value of the header `name`, as text.
fn text<'a>(headers: &'a HeaderMap, name: &str) -> Result<&'a str, Refused> {
    let mut values = headers.get_all(name).iter();
    let value = values.next().ok_or(Refused::Missing)?;
    if values.next().is_some() {
        return Err(Refused::Malformed);
    }
    value
        .to_str()
        .map(str::trim)
        .map_err(|_| Refused::Malformed)
}

/// Whether one of `signatures` is `mac`'s, each compared in constant time.
fn any_matches(mac: &HmacSha256, signatures: &[Vec<u8>]) -> Result<(), Refused> {
    if signatures.is_empty() {
        return Err(Refused::Missing);
    }
    // Every candidate is compared, so that how many there are is all the timing tells.
    let matched = signatures.iter().fold(false, |matched, s| {
        mac.clone().verify_slice(s).is_ok() | matched
    });
    if matched {
        Ok(())
    } else {
        Err(Refused::Mismatch)
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    fn at(seconds: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(seconds)
    }

    /// GitHub's own example ("Validating webhook deliveries"): this secret and payload
    /// sign as this digest.
    #[test]
    fn github_publishes_this_vector() {
        let hook = Webhook::github("It's a Secret to Everybody").unwrap();
        let signed = headers(&[(
            "x-hub-signature-256",
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
        )]);
        assert_eq!(hook.verify_at(&signed, b"Hello, World!", at(0)), Ok(()));
        assert_eq!(
            hook.verify_at(&signed, b"Hello, World?", at(0)),
            Err(Refused::Mismatch)
        );
        let other = Webhook::github("It's a Secret to Somebody").unwrap();
        assert_eq!(
            other.verify_at(&signed, b"Hello, World!", at(0)),
            Err(Refused::Mismatch)
        );
        assert_eq!(
            hook.verify_at(&HeaderMap::new(), b"Hello, World!", at(0)),
            Err(Refused::Missing)
        );
        let bare = headers(&[(
            "x-hub-signature-256",
            "757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
        )]);
        assert_eq!(
            hook.verify_at(&bare, b"Hello, World!", at(0)),
            Err(Refused::Malformed)
        );
    }

    /// The Standard Webhooks specification's example (its libraries test against it):
    /// this secret, id, timestamp and payload sign as this signature.
    #[test]
    fn standard_webhooks_publishes_this_vector() {
        let hook = Webhook::standard("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let payload = br#"{"test": 2432232314}"#;
        let signed = |signature: &str| {
            headers(&[
                ("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek"),
                ("webhook-timestamp", "1614265330"),
                ("webhook-signature", signature),
            ])
        };
        let good = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
        let now = at(1_614_265_330 + 60);
        assert_eq!(hook.verify_at(&signed(good), payload, now), Ok(()));
        // Several signatures, one of them good (a secret being rotated).
        let rotated = format!("v1,Zm9yZ2Vk {good} v1a,c29tZXRoaW5n");
        assert_eq!(hook.verify_at(&signed(&rotated), payload, now), Ok(()));
        assert_eq!(
            hook.verify_at(&signed(good), br#"{"test": 2432232315}"#, now),
            Err(Refused::Mismatch)
        );
        assert_eq!(
            hook.verify_at(&signed(good), payload, at(1_614_265_330 + 301)),
            Err(Refused::Stale)
        );
        assert_eq!(
            hook.verify_at(&signed("v1a,Zm9v"), payload, now),
            Err(Refused::Missing)
        );
        assert!(Webhook::standard("whsec_not base64!").is_err());
    }

    /// Stripe's scheme ("Verify the signature manually"), against a signature computed
    /// apart (Python's `hmac`): Stripe publishes the scheme but no vector.
    #[test]
    fn stripe_signs_the_timestamp_and_the_body() {
        let hook = Webhook::stripe("whsec_test_secret").unwrap();
        let body = br#"{"id":"evt_1","object":"event"}"#;
        let signed = |header: &str| headers(&[("stripe-signature", header)]);
        let now = at(1_700_000_100);
        let header = format!("t=1700000000,v1={STRIPE_VECTOR},v0=00");
        assert_eq!(hook.verify_at(&signed(&header), body, now), Ok(()));
        let two = format!("t=1700000000,v1={},v1={STRIPE_VECTOR}", "ab".repeat(32));
        assert_eq!(hook.verify_at(&signed(&two), body, now), Ok(()));
        assert_eq!(
            hook.verify_at(&signed(&header), body, at(1_700_000_000 + 301)),
            Err(Refused::Stale)
        );
        let forged = format!("t=1700000050,v1={STRIPE_VECTOR}");
        assert_eq!(
            hook.verify_at(&signed(&forged), body, now),
            Err(Refused::Mismatch)
        );
        assert_eq!(
            hook.verify_at(&signed(&format!("v1={STRIPE_VECTOR}")), body, now),
            Err(Refused::Missing)
        );
        assert_eq!(
            hook.verify_at(&signed("t=1700000000,v1=zz"), body, now),
            Err(Refused::Malformed)
        );
    }

    /// `hmac.new(b"whsec_test_secret", b'1700000000.{"id":"evt_1","object":"event"}', sha256)`
    const STRIPE_VECTOR: &str = "0c8670ed117751cc551a20e35839447075c42800ea3cf3e8a2fbda99cd1e6edd";

    /// Shopify's scheme ("Verify webhooks"): the body's HMAC in base64, against a value
    /// computed apart (Python's `hmac`).
    #[test]
    fn shopify_signs_the_body_in_base64() {
        let hook = Webhook::shopify("shpss_secret").unwrap();
        let body = br#"{"id":820982911946154508}"#;
        let signed = |header: &str| headers(&[("x-shopify-hmac-sha256", header)]);
        assert_eq!(hook.verify_at(&signed(SHOPIFY_VECTOR), body, at(0)), Ok(()));
        assert_eq!(
            hook.verify_at(&signed(SHOPIFY_VECTOR), b"{}", at(0)),
            Err(Refused::Mismatch)
        );
        assert_eq!(
            hook.verify_at(&signed("***"), body, at(0)),
            Err(Refused::Malformed)
        );
    }

    /// `base64(hmac.new(b"shpss_secret", b'{"id":820982911946154508}', sha256))`
    const SHOPIFY_VECTOR: &str = "jqbalbO3Z8mDmrF2/+wzM3KYvbgqzVBF969vgiIy80I=";

    /// Svix sends its deliveries with headers of its own name by default: the same scheme.
    #[test]
    fn standard_webhooks_takes_svix_headers_too() {
        let hook = Webhook::standard("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let payload = br#"{"test": 2432232314}"#;
        let svix = headers(&[
            ("svix-id", "msg_p5jXN8AQM9LWM0D4loKWxJek"),
            ("svix-timestamp", "1614265330"),
            (
                "svix-signature",
                "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
            ),
        ]);
        let now = at(1_614_265_330 + 60);
        assert_eq!(hook.verify_at(&svix, payload, now), Ok(()));
        assert_eq!(
            hook.delivery_id(&svix, payload).as_deref(),
            Some("msg_p5jXN8AQM9LWM0D4loKWxJek")
        );
        // Another id under Svix's names is not what was signed.
        let moved = headers(&[
            ("svix-id", "msg_other"),
            ("svix-timestamp", "1614265330"),
            (
                "svix-signature",
                "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
            ),
        ]);
        assert_eq!(hook.verify_at(&moved, payload, now), Err(Refused::Mismatch));
    }

    /// A missing environment variable read as "" would open the endpoint to anyone.
    #[test]
    fn an_empty_secret_is_refused_at_construction() {
        for refused in [
            Webhook::stripe("").err(),
            Webhook::github("").err(),
            Webhook::shopify(" ").err(),
            Webhook::standard("whsec_").err(),
            Webhook::standard("").err(),
        ] {
            let err = refused.expect("an empty secret is refused");
            assert!(matches!(err, Error::Config(_)), "{err}");
            assert!(err.to_string().contains("empty"), "{err}");
        }
    }

    /// Two endpoints of one sender keep their records apart: by name, or, unnamed, by
    /// secret; a named endpoint keeps its namespace through a new secret.
    #[test]
    fn each_endpoint_has_a_namespace_of_its_own() {
        let a = Webhook::stripe("whsec_a").unwrap();
        let b = Webhook::stripe("whsec_b").unwrap();
        assert_ne!(a.namespace(), b.namespace());
        assert!(
            a.namespace().starts_with("idem.webhook.stripe.key-"),
            "{}",
            a.namespace()
        );
        assert!(!a.namespace().contains("whsec"), "{}", a.namespace());
        let named = Webhook::stripe("whsec_a")
            .unwrap()
            .endpoint("billing")
            .unwrap();
        let rotated = Webhook::stripe("whsec_new")
            .unwrap()
            .endpoint("billing")
            .unwrap();
        assert_eq!(named.namespace(), "idem.webhook.stripe.billing");
        assert_eq!(named.namespace(), rotated.namespace());
        for bad in ["", "a b", "é", &"x".repeat(65)] {
            assert!(
                Webhook::github("s").unwrap().endpoint(bad).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_secret_is_never_shown() {
        let shown = format!("{:?}", Webhook::github("hunter2").unwrap());
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
