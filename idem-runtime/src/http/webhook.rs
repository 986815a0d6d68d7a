//! [`Webhook`]: the sender presets of
//! [`IdempotencyLayer::webhook`](super::IdempotencyLayer::webhook). Each knows where its
//! sender puts a delivery's id, how it signs a delivery, and how long it retries one.

use std::fmt;
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

/// A webhook sender: where its deliveries carry their id, how they are signed, and how long
/// the sender retries one. Given to [`IdempotencyLayer::webhook`](super::IdempotencyLayer::webhook).
///
/// | preset | key | signature (HMAC-SHA256) | timestamp tolerance | sender retries | kept (TTL) |
/// |---|---|---|---|---|---|
/// | [`stripe`](Self::stripe) | the body's `/id` (the event) | `Stripe-Signature: t=…,v1=<hex>` over `t.body` | 5 min | 3 days | 4 days |
/// | [`github`](Self::github) | `X-GitHub-Hook-ID` and `X-GitHub-Delivery` | `X-Hub-Signature-256: sha256=<hex>` over the body | none (unsigned) | redelivered by hand, 3 days | 4 days |
/// | [`shopify`](Self::shopify) | `X-Shopify-Webhook-Id` | `X-Shopify-Hmac-Sha256: <base64>` over the body | none (unsigned) | 8 times over 4 hours (formerly 19 over 48 hours) | 3 days |
/// | [`standard`](Self::standard) | `webhook-id` | `webhook-signature: v1,<base64>` over `id.timestamp.body` | 5 min | Svix: past 51 hours | 4 days |
///
/// Every comparison of a signature is in constant time. A request whose signature is
/// missing, malformed, outside the tolerance or not the sender's is answered `401`
/// problem+json before anything is claimed, so a forged delivery can never take an id and
/// turn the real delivery away.
///
/// A GitHub delivery is keyed by its hook too: GitHub sends one delivery id to every hook
/// an event triggers, and each hook's delivery runs once. A Shopify delivery is keyed per
/// subscription (`X-Shopify-Webhook-Id`); to run an event once across subscriptions, key by
/// `X-Shopify-Event-Id` instead (`.key_from(KeyFrom::header("x-shopify-event-id"))`).
/// A Stripe event's `pending_webhooks` (how many of its deliveries are still pending)
/// changes between retries, so it is left out of the fingerprint; the rest of the body is
/// compared as every JSON body is.
///
/// GitHub and Shopify sign no timestamp: a delivery captured on the way and sent again is
/// replayed from its record while the record lasts, but runs again once it has expired.
/// Keep their TTL at least as long as a replayed delivery would matter, or check a date
/// the payload carries; Stripe and Standard Webhooks refuse a signature older than the
/// tolerance.
#[derive(Clone)]
pub struct Webhook {
    sender: Sender,
    secret: Vec<u8>,
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

impl Webhook {
    fn new(sender: Sender, secret: Vec<u8>, ttl: Duration) -> Self {
        Self {
            sender,
            secret,
            tolerance: Duration::from_secs(300),
            ttl,
            max_body: super::DEFAULT_MAX_BODY,
        }
    }

    /// Stripe: the endpoint's signing secret (`whsec_…`, used as it is shown).
    pub fn stripe(secret: impl AsRef<[u8]>) -> Self {
        Self::new(Sender::Stripe, secret.as_ref().to_vec(), 4 * DAY)
    }

    /// GitHub: the hook's secret.
    pub fn github(secret: impl AsRef<[u8]>) -> Self {
        Self::new(Sender::GitHub, secret.as_ref().to_vec(), 4 * DAY)
    }

    /// Shopify: the app's client secret.
    pub fn shopify(secret: impl AsRef<[u8]>) -> Self {
        Self::new(Sender::Shopify, secret.as_ref().to_vec(), 3 * DAY)
    }

    /// Standard Webhooks (Svix and the senders that follow its specification): the
    /// endpoint's secret, `whsec_` and the key in base64.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when the secret is not base64 after its `whsec_` prefix.
    ///
    /// ```
    /// use idem_runtime::http::Webhook;
    ///
    /// let preset = Webhook::standard("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?;
    /// # let _ = preset;
    /// # Ok::<_, idem_runtime::Error>(())
    /// ```
    pub fn standard(secret: &str) -> Result<Self, Error> {
        let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
        let key = BASE64.decode(encoded).map_err(|_| {
            Error::config("a Standard Webhooks secret is `whsec_` and the key in base64")
        })?;
        Ok(Self::new(Sender::Standard, key, 4 * DAY))
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

    /// The namespace of the preset's keys.
    pub(super) fn namespace(&self) -> &'static str {
        match self.sender {
            Sender::Stripe => "idem.webhook.stripe",
            Sender::GitHub => "idem.webhook.github",
            Sender::Shopify => "idem.webhook.shopify",
            Sender::Standard => "idem.webhook.standard",
        }
    }

    /// Where the sender puts a delivery's id.
    pub(super) fn key_from(&self) -> KeyFrom {
        match self.sender {
            Sender::Stripe => KeyFrom::json("/id"),
            Sender::GitHub => KeyFrom::headers(["x-github-hook-id", "x-github-delivery"]),
            Sender::Shopify => KeyFrom::header("x-shopify-webhook-id"),
            Sender::Standard => KeyFrom::header("webhook-id"),
        }
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
                let id = text(headers, "webhook-id")?;
                let timestamp = text(headers, "webhook-timestamp")?;
                let header = text(headers, "webhook-signature")?;
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
        let hook = Webhook::github("It's a Secret to Everybody");
        let signed = headers(&[(
            "x-hub-signature-256",
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
        )]);
        assert_eq!(hook.verify_at(&signed, b"Hello, World!", at(0)), Ok(()));
        assert_eq!(
            hook.verify_at(&signed, b"Hello, World?", at(0)),
            Err(Refused::Mismatch)
        );
        let other = Webhook::github("It's a Secret to Somebody");
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
        let hook = Webhook::stripe("whsec_test_secret");
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
        let hook = Webhook::shopify("shpss_secret");
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

    #[test]
    fn the_secret_is_never_shown() {
        let shown = format!("{:?}", Webhook::github("hunter2"));
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
