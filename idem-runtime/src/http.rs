//! The `Idempotency-Key` header at the HTTP boundary: a tower layer for axum, hyper and any
//! tower service (feature `http`).
//!
//! ```
//! use std::time::Duration;
//! use idem_runtime::http::IdempotencyLayer;
//! use idem_runtime::MemoryStore;
//!
//! # #[derive(Clone)] struct Principal { id: u64 }
//! let layer = IdempotencyLayer::new(MemoryStore::new())
//!     // Whose key is it? Keys of two principals never meet.
//!     .scope(|parts: &http::request::Parts| {
//!         parts.extensions.get::<Principal>().map(|p| p.id.to_string())
//!     })
//!     .required() // 400 when a POST or PATCH has no key
//!     .ttl(Duration::from_secs(24 * 3600));
//! // axum: Router::new().route("/payments", post(create)).layer(layer)
//! # let _ = layer;
//! ```
//!
//! What a request gets, following `draft-ietf-httpapi-idempotency-key-header` and Stripe:
//!
//! | request | answer |
//! |---|---|
//! | a method outside the set (default `POST`, `PATCH`) | passed through untouched, no store traffic |
//! | no `Idempotency-Key` | passed through; `400` with [`required`](IdempotencyLayer::required) |
//! | a key, but the [scope](IdempotencyLayer::scope) cannot name the principal | `401`; the handler does not run ([`pass_through_unknown_principal`](IdempotencyLayer::pass_through_unknown_principal) runs it without idempotency) |
//! | a malformed key (empty, over 255 characters, several values, neither a structured-field string nor a bare token) | `400` |
//! | the first request with a key | the handler runs; a `2xx` response (by default, see [`record_if`](IdempotencyLayer::record_if)) is recorded: status, headers but hop-by-hop ones and `Set-Cookie` (see [`record_header_if`](IdempotencyLayer::record_header_if)), body; it is sent with all its headers as soon as the handler produced it |
//! | a response of unknown length (a stream, or compression inside the layer) | sent at once and recorded as it is sent, up to [`max_recorded_body`](IdempotencyLayer::max_recorded_body); its end waits for the record to land, so a client that read it all and retries is replayed; read to its end and recorded if the client goes away |
//! | a retry with the same payload | the recorded response, plus `Idempotent-Replayed: true`; the handler does not run |
//! | the same key with another method, path, query or body | `422` |
//! | a retry while the first still runs | `409` with `Retry-After`, or, with [`InFlight::Wait`](crate::InFlight::Wait), the first response once it is ready |
//! | a response whose status [`record_if`](IdempotencyLayer::record_if) refuses (an error) | returned as it is; the key is released, so a retry runs |
//! | a recordable response that cannot be recorded (body over [`max_recorded_body`](IdempotencyLayer::max_recorded_body), trailers, a body that failed) | returned as it is; the key is recorded as completed without its response, so a retry gets `410` and the handler never runs twice ([`release_unrecorded`](IdempotencyLayer::release_unrecorded) releases it instead); a `warn!` event, and [`on_unrecorded`](IdempotencyLayer::on_unrecorded) is called |
//! | a retry of a key whose response is gone (not kept, or evicted by the store) | `410`; the handler does not run |
//! | a request body over the limit (default 1 MiB) | `413`; the handler does not run |
//! | a key retried, or a principal's new keys sent, faster than the [rate limits](IdempotencyLayer::rate_limit) (feature `governor`, off by default) | `429` with `Retry-After`, from memory: the store is not asked, the handler does not run |
//! | the store is down | `503`; the handler does not run |
//! | the store fails after the handler answered | the response once it is recorded, retried at most the store's timeout; past that the handler's response, marked `Idempotent-Unrecorded: true` (see [unrecorded](#unrecorded)) |
//! | the client disconnects while the handler runs | the handler runs to the end and its response is recorded: the retry replays it |
//!
//! # Keys where the client puts them
//!
//! The key is the `Idempotency-Key` header unless [`key_from`](IdempotencyLayer::key_from)
//! names another source ([`KeyFrom`]): a header, several headers together, a member of the
//! JSON body (`KeyFrom::json("/id")`), or a function of the request. Problems then name that
//! source ("the key in the body's `/id` was used before with a different … body"), never a
//! header the client did not send.
//!
//! # Webhooks
//!
//! [`IdempotencyLayer::webhook`] with a [`Webhook`] preset (Stripe, GitHub, Shopify, Standard
//! Webhooks) is a receiver in one line: the sender's signature is checked before anything is
//! claimed (`401` [signature-invalid](#signature-invalid) otherwise), the key is what the
//! signature vouches for, in the receiving endpoint's namespace, the record outlives the
//! sender's retries, and a duplicate delivery is answered `2xx`.
//!
//! ```
//! use idem_runtime::http::{IdempotencyLayer, Webhook};
//! use idem_runtime::MemoryStore;
//!
//! let billing = Webhook::stripe("whsec_…")?.endpoint("billing")?;
//! let stripe = IdempotencyLayer::webhook(MemoryStore::new(), billing);
//! // axum: Router::new().route("/webhooks/stripe", post(credit)).layer(stripe)
//! # let _ = stripe;
//! # Ok::<_, idem_runtime::Error>(())
//! ```
//!
//! The key is (namespace, scope, header value), hashed like every idem key. The fingerprint
//! is (method, path and query, body), a JSON body (`application/json` or `+json`) by its
//! meaning: member order and whitespace do not change it, and numbers count by their exact
//! decimal value (`1.0` is `1`; `0.1` is not `0.10000000000000000001`). With the feature
//! `axum`, the path is the one the client sent, also under `Router::nest`. A handler reads the key through
//! the request extension [`IdempotencyKey`] (axum: `Option<Extension<IdempotencyKey>>`), and
//! the claim's fencing token through [`attempt()`](crate::attempt()). Without the layer,
//! [`IdempotencyKey`] is an axum extractor (feature `axum`) for an endpoint whose claim,
//! writes and answer commit in one transaction (`transaction =`, and the `name_outcome`
//! sibling every `#[idempotent]` function has, whose [`Outcome`](crate::Outcome) answers
//! HTTP with `Idempotent-Replayed: true` on a replay).
//!
//! # Problems
//!
//! Every answer of the layer's own is RFC 9457 `application/problem+json`, with a `type`
//! that points at one of the sections below.
//!
//! ## key-missing
//! `400`: the layer is [`required`](IdempotencyLayer::required) and the request has no key.
//!
//! ## key-malformed
//! `400`: the header is empty, longer than 255 characters, repeated, or neither a quoted
//! string nor a bare token.
//!
//! ## signature-invalid
//! `401`: a [`webhook`](IdempotencyLayer::webhook) layer's request whose signature is
//! missing, malformed, outside the sender's time tolerance, or not the sender's for this
//! body. Nothing was claimed or recorded, so the real delivery, when it comes, runs.
//!
//! ## principal-unknown
//! `401`: the request carries a key, but the key scope cannot name whose request it is (no
//! credentials, or an authentication layer that has not run yet because it sits inside this
//! one). Authenticate, and retry with the same key.
//!
//! ## body-unreadable
//! `400`: the request body could not be read, or the custom fingerprint refused it.
//!
//! ## body-too-large
//! `413`: the body is over [`max_body`](IdempotencyLayer::max_body).
//!
//! ## in-flight
//! `409`, with `Retry-After`: the key's first request has not finished.
//!
//! ## key-reused
//! `422`: the key was used with another method, path, query or body.
//!
//! ## gone
//! `410`: the key's first request completed, but its response was not kept (over the
//! recording limit, or evicted from a memory store under its bounds). The handler is not run
//! again, since its effect may not be repeatable. Look the outcome up another way; use a
//! new key only for a new operation.
//!
//! ## rate-limited
//! `429`, with `Retry-After`: the key was sent again faster than the layer's per-key rate,
//! or its principal started new keys faster than its per-principal rate
//! ([`rate_limit`](IdempotencyLayer::rate_limit), feature `governor`). Answered from memory;
//! the store was not asked. Retry after the delay, with the same key.
//!
//! ## store-unavailable
//! `503`: the store could not be reached; the request was not processed.
//!
//! ## internal
//! `500`: a recorded response that does not decode, a configuration out of range, or a
//! response body that failed while it was read.
//!
//! ## unrecorded
//! `500`: what [`problem()`] makes of an [`Error::Unrecorded`](crate::Error::Unrecorded)
//! that a service answers itself: the work ran, its answer is not recorded. The layer
//! sends the handler's own response instead. A handler's response whose record fails
//! is retried while the request waits, at most the store's timeout
//! ([`Store::claim_timeout`](crate::Store::claim_timeout), 3 s where the store has none):
//! once the store answers again, the record lands and the response goes out. If it has not
//! landed by then, the client gets the handler's own response, marked
//! `Idempotent-Unrecorded: true` ([`IDEMPOTENT_UNRECORDED`]), rather than a `500` for work
//! that succeeded; so does a handler whose lease ran out while it ran and whose key another
//! request took (a retry replays that request's record). The service goes on recording it
//! in the background, and replays it once the store is back; until then a retry with the
//! same key to another instance may run the handler again once the claim lapses: check the
//! request's effect first.
//!
//! Services answer their own [`Error`](crate::Error)s the same way with [`problem()`] (and,
//! with the feature `axum`, by returning the error: it is an `IntoResponse`).
//!
//! No problem's `detail` carries an error's own text (a store's address, SQL, a library's
//! message): those go to `tracing`.

mod body;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod config;
pub(crate) mod fingerprint;
pub(crate) mod header;
mod key_from;
mod layer;
#[cfg(feature = "axum")]
mod outcome;
mod problem;
#[cfg(feature = "governor")]
mod rate_limit;
mod record;
mod service;
mod webhook;

pub use self::body::ResponseBody;
pub use self::config::{KeyScope, ScopeNotChosen, ScopeOf, ScopedBy, Unrecorded, Unscoped};
pub use self::header::{IdempotencyKey, IDEMPOTENCY_KEY, MAX_KEY_LEN};
pub use self::key_from::KeyFrom;
pub use self::layer::{IdempotencyLayer, DEFAULT_MAX_BODY, DEFAULT_NAMESPACE};
pub use self::problem::problem;
#[cfg(feature = "governor")]
#[cfg_attr(docsrs, doc(cfg(feature = "governor")))]
pub use self::rate_limit::{RateLimit, DEFAULT_RATE_LIMIT_BYTES, LIMITER_BYTES};
pub use self::record::{IDEMPOTENT_REPLAYED, IDEMPOTENT_UNRECORDED};
pub use self::service::{IdempotencyService, ResponseFuture};
pub use self::webhook::{Webhook, WebhookFuture, WebhookService};
