//! [`IdempotencyKey`]: the key a delivery carries, one name on every surface whose claim
//! goes in the handler's own transaction.

use std::fmt;

/// The key a delivery carries: a request's `Idempotency-Key` (or the key a [`KeyFrom`]
/// finds), a webhook's delivery id, a queue message's id. It serializes as its string, so
/// it is an `#[idempotent]` key as it is (`key = key`, or `key = (customer.id, key)`).
///
/// One name, one shape, wherever the effect is a write in the store's own database: the
/// handler takes the key, opens its transaction, calls an `#[idempotent(…, transaction =
/// tx)]` function with it, and commits; the claim, the effect and the record commit
/// together, so that a crash anywhere leaves all three or none.
///
/// - **An HTTP endpoint** (feature `axum`): an extractor that reads and checks the
///   `Idempotency-Key` header as [`IdempotencyLayer`] does (`400` problem+json when it is
///   missing or malformed; `Option<IdempotencyKey>` for an optional key).
/// - **A webhook receiver**: behind a [`Webhook`] preset used as a layer, which checks the
///   sender's signature first and finds the sender's delivery id; the extractor reads that.
/// - **A queue consumer**: [`Consumer::inbox`](crate::consumer::Consumer::inbox) hands the
///   handler the message's id as one.
///
/// Behind [`IdempotencyLayer`] it is a request extension too, and the extractor reads the
/// key the layer found.
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use axum::{routing::post, Router};
/// use idem_runtime::IdempotencyKey;
///
/// async fn create(key: IdempotencyKey) -> String {
///     format!("created under {key}")
/// }
/// let app: Router = Router::new().route("/orders", post(create));
/// # }
/// ```
///
/// [`KeyFrom`]: crate::http::KeyFrom
/// [`IdempotencyLayer`]: crate::http::IdempotencyLayer
/// [`Webhook`]: crate::http::Webhook
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct IdempotencyKey(String);

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl IdempotencyKey {
    /// A key found by the runtime (checked where it was found).
    pub(crate) fn new(key: String) -> Self {
        Self(key)
    }

    /// The key as it was sent (a structured-field string unquoted and unescaped).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}
