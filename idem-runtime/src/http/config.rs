//! What an [`IdempotencyLayer`](super::IdempotencyLayer) was configured with, shared by the
//! layer that builds it, the services that read it and the bodies that report to it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderName;
use http::request::Parts;
use http::{Method, StatusCode};

use super::fingerprint::Memo;
use super::key_from::KeyFrom;
use super::webhook::Webhook;
use crate::{Error, Fingerprint, Key, Operation};

pub(super) type RecordIf = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;
pub(super) type RecordHeaderIf = Arc<dyn Fn(&HeaderName) -> bool + Send + Sync>;
pub(super) type OnUnrecorded = Arc<dyn Fn(&Unrecorded) + Send + Sync>;
/// An application's own fingerprint of a request.
pub(super) type CustomFingerprint =
    Arc<dyn Fn(&Parts, &Bytes) -> Result<Fingerprint, Error> + Send + Sync>;

/// How a layer fingerprints a keyed request.
#[derive(Clone)]
pub(super) enum FingerprintFn {
    /// The default: method, target and body, recent JSON requests remembered.
    Default(Arc<Memo>),
    /// The application's own.
    Custom(CustomFingerprint),
}

impl FingerprintFn {
    /// The fingerprint of a request sent with the idempotency key `key`.
    pub(super) fn of(&self, key: &Key, parts: &Parts, body: &Bytes) -> Result<Fingerprint, Error> {
        match self {
            Self::Default(memo) => memo.of_request(key, parts, body),
            Self::Custom(fingerprint) => fingerprint(parts, body),
        }
    }
}

/// Everything a layer was configured with, shared by its services.
pub(super) struct Config<St, Sc> {
    pub(super) store: St,
    pub(super) scope: Sc,
    pub(super) operation: Operation<UnkeptPolicy>,
    pub(super) methods: Vec<Method>,
    pub(super) required: bool,
    pub(super) max_body: usize,
    pub(super) max_recorded_body: usize,
    pub(super) record_if: RecordIf,
    pub(super) record_header_if: RecordHeaderIf,
    pub(super) on_unrecorded: Option<OnUnrecorded>,
    pub(super) fingerprint: FingerprintFn,
    pub(super) retry_after: Duration,
    pub(super) unknown_principal: UnknownPrincipal,
    /// Where a request carries its key.
    pub(super) key_from: KeyFrom,
    /// The sender whose signature a request must carry, before anything is claimed.
    pub(super) webhook: Option<Arc<Webhook>>,
    /// The rate limits, checked in memory before the store is asked.
    #[cfg(feature = "governor")]
    pub(super) rate_limit: Option<Arc<super::rate_limit::Limiter>>,
}

/// What a keyed request whose principal the scope cannot name gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum UnknownPrincipal {
    /// `401`: the handler does not run.
    Refuse,
    /// The request passes through without idempotency, as the service chose.
    PassThrough,
}

/// Why a response the layer would have recorded was sent unrecorded (its key completes
/// without it, so a retry gets `410`; or, with
/// [`release_unrecorded`](super::IdempotencyLayer::release_unrecorded), is released): what
/// [`super::IdempotencyLayer::on_unrecorded`] is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unrecorded {
    /// The body is larger than [`max_recorded_body`](super::IdempotencyLayer::max_recorded_body).
    TooLarge {
        /// The limit it went over, in bytes.
        limit: usize,
    },
    /// The body ended with trailers, which a record does not keep.
    Trailers,
    /// The body failed while it was sent or read.
    BodyFailed,
}

impl fmt::Display for Unrecorded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooLarge { limit } => write!(f, "the response body is over {limit} bytes"),
            Self::Trailers => f.write_str("the response body has trailers"),
            Self::BodyFailed => f.write_str("the response body failed"),
        }
    }
}

impl<St: Clone, Sc: Clone> Clone for Config<St, Sc> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            scope: self.scope.clone(),
            operation: self.operation.clone(),
            methods: self.methods.clone(),
            required: self.required,
            max_body: self.max_body,
            max_recorded_body: self.max_recorded_body,
            record_if: Arc::clone(&self.record_if),
            record_header_if: Arc::clone(&self.record_header_if),
            on_unrecorded: self.on_unrecorded.clone(),
            fingerprint: self.fingerprint.clone(),
            retry_after: self.retry_after,
            unknown_principal: self.unknown_principal,
            key_from: self.key_from.clone(),
            webhook: self.webhook.clone(),
            #[cfg(feature = "governor")]
            rate_limit: self.rate_limit.clone(),
        }
    }
}

/// The layer's error policy: a recordable response that could not be kept (over the limit,
/// trailers, a body that failed) completes its key with the [`GONE`](crate::codec::GONE) record,
/// so that a retry gets `410` instead of running the handler again, unless the layer was
/// told to [`release_unrecorded`](super::IdempotencyLayer::release_unrecorded). Every other
/// failure releases the key.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct UnkeptPolicy {
    pub(super) release: bool,
}

/// The key scope of a layer that has not been chosen yet: call
/// [`super::IdempotencyLayer::scope`] or [`super::IdempotencyLayer::unscoped`].
#[derive(Clone, Copy, Debug)]
pub struct ScopeNotChosen;

/// Keys scoped per principal by a function of the request's parts.
#[derive(Clone)]
pub struct ScopedBy<F>(pub(super) F);

/// One key space shared by every client, chosen out loud.
#[derive(Clone, Copy, Debug)]
pub struct Unscoped;

/// Whose key a request carries.
#[doc(hidden)]
#[derive(Debug)]
pub enum ScopeOf {
    /// Every client shares the key space.
    Shared,
    /// The key is this principal's.
    Principal(String),
    /// The principal is unknown: the request is refused, or passes through untouched if
    /// the service said so.
    Unknown,
}

/// A chosen key scope: [`ScopedBy`] or [`Unscoped`].
#[diagnostic::on_unimplemented(
    message = "choose the key scope of `IdempotencyLayer` before using it",
    label = "the key scope is not chosen",
    note = "call `.scope(|parts| …)` to key each principal (user, tenant, API key) apart, or `.unscoped()` to share one key space between every client"
)]
pub trait KeyScope: Clone + Send + Sync + 'static {
    #[doc(hidden)]
    fn of(&self, parts: &Parts) -> ScopeOf;
}

impl<F> KeyScope for ScopedBy<F>
where
    F: Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static,
{
    fn of(&self, parts: &Parts) -> ScopeOf {
        (self.0)(parts).map_or(ScopeOf::Unknown, ScopeOf::Principal)
    }
}

impl KeyScope for Unscoped {
    fn of(&self, _: &Parts) -> ScopeOf {
        ScopeOf::Shared
    }
}
