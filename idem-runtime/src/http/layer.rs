//! [`IdempotencyLayer`]: the layer's configuration, with a builder whose key scope must be
//! chosen before the layer can be used.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, SET_COOKIE};
use http::request::Parts;
use http::{Method, StatusCode};
use tower_layer::Layer;

use super::config::{
    Config, FingerprintFn, KeyScope, ScopeNotChosen, ScopedBy, UnkeptPolicy, UnknownPrincipal,
    Unrecorded, Unscoped,
};
use super::fingerprint;
use super::key_from::KeyFrom;
use super::service::IdempotencyService;
use super::webhook::Webhook;
use crate::{Error, Fingerprint, InFlight, Operation, Store};

/// The namespace of the layer's keys unless [`IdempotencyLayer::namespace`] sets one.
pub const DEFAULT_NAMESPACE: &str = "idem.http";

/// The largest request body a keyed request may carry unless
/// [`IdempotencyLayer::max_body`] says otherwise: 1 MiB.
pub const DEFAULT_MAX_BODY: usize = 1024 * 1024;

/// A tower layer that makes `POST` and `PATCH` handlers idempotent under the
/// `Idempotency-Key` header. See the [module documentation](super) for what it answers.
///
/// Built with [`new`](Self::new); its key scope must then be chosen with
/// [`scope`](Self::scope) or [`unscoped`](Self::unscoped) before it is a [`Layer`]:
///
/// ```
/// use idem_runtime::http::IdempotencyLayer;
/// use idem_runtime::MemoryStore;
///
/// # #[derive(Clone)] struct Principal { id: u64 }
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .scope(|parts: &http::request::Parts| {
///         parts.extensions.get::<Principal>().map(|p| p.id.to_string())
///     })
///     .required()
///     .ttl(std::time::Duration::from_secs(24 * 3600));
/// # let _ = layer;
/// ```
#[must_use]
pub struct IdempotencyLayer<St, Sc = ScopeNotChosen> {
    pub(super) config: Arc<Config<St, Sc>>,
}

impl<St, Sc> Clone for IdempotencyLayer<St, Sc> {
    fn clone(&self) -> Self {
        Self {
            config: Arc::clone(&self.config),
        }
    }
}

impl<St: fmt::Debug, Sc> fmt::Debug for IdempotencyLayer<St, Sc> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let config = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("store", &config.store)
            .field("scope", &std::any::type_name::<Sc>())
            .field("namespace", &config.operation.namespace())
            .field("methods", &config.methods)
            .field("required", &config.required)
            .field("max_body", &config.max_body)
            .field("max_recorded_body", &config.max_recorded_body)
            .field("unknown_principal", &config.unknown_principal)
            .finish_non_exhaustive()
    }
}

/// How long a request waits for a record that fails, on a store that states no timeout
/// of its own: the network stores' default timeout.
const RECORD_WAIT: Duration = Duration::from_secs(3);

impl<St: Store + Clone> IdempotencyLayer<St, ScopeNotChosen> {
    /// A layer over `store`: `POST` and `PATCH` requests with an `Idempotency-Key` run once
    /// per key and TTL (24 h), `2xx` responses are recorded, a duplicate in flight gets `409`.
    pub fn new(store: St) -> Self {
        // A request waits for a failing record at most its store's timeout, then gets the
        // handler's response, marked (`Idempotent-Unrecorded`).
        let record_wait = store.claim_timeout().unwrap_or(RECORD_WAIT);
        Self {
            config: Arc::new(Config {
                store,
                scope: ScopeNotChosen,
                operation: Operation::new(DEFAULT_NAMESPACE)
                    .in_flight(InFlight::Reject)
                    .record_wait(record_wait)
                    .with_errors(UnkeptPolicy::default()),
                methods: vec![Method::POST, Method::PATCH],
                required: false,
                max_body: DEFAULT_MAX_BODY,
                max_recorded_body: DEFAULT_MAX_BODY,
                record_if: Arc::new(|status: StatusCode| status.is_success()),
                record_header_if: Arc::new(|name: &HeaderName| name != SET_COOKIE),
                on_unrecorded: None,
                fingerprint: FingerprintFn::Default(Arc::new(fingerprint::Memo::new())),
                retry_after: super::problem::DEFAULT_RETRY_AFTER,
                unknown_principal: UnknownPrincipal::Refuse,
                key_from: KeyFrom::default(),
                webhook: None,
                #[cfg(feature = "governor")]
                rate_limit: None,
            }),
        }
    }
}

impl<St: Store + Clone> IdempotencyLayer<St, ScopeNotChosen> {
    /// A layer that receives `sender`'s webhooks: each delivery is checked against the
    /// sender's signature **before anything is claimed** (`401` problem+json, no record, when
    /// it is missing or not the sender's), keyed as the sender names a delivery, and run once
    /// per key for at least as long as the sender retries. See [`Webhook`] for each sender.
    ///
    /// A duplicate delivery answers `2xx`, since a sender resends anything else: the
    /// recorded response once the first is done, the same after waiting for a first still
    /// running (`409` with `Retry-After` once the preset's wait, below the sender's timeout,
    /// runs out), and `200` when the first completed but its response was not kept (where a
    /// plain layer answers `410`, which senders such as Standard Webhooks read as "disable
    /// this endpoint"). A handler's non-`2xx` answer is not recorded: the sender's retry runs
    /// it again. A request of another method than `POST` is verified too, then passed on
    /// unclaimed.
    ///
    /// The key space is the receiving endpoint's (the layer is
    /// [`unscoped`](Self::unscoped): the signature is what says whose the delivery is, and
    /// the namespace is the endpoint's, see [`Webhook::endpoint`]). Each claim is labelled
    /// with the delivery's id, for an operator. Other settings (the namespace, the TTL, the
    /// wait, a [`key_from`](Self::key_from)) can still be changed after.
    ///
    /// ```
    /// use idem_runtime::http::{IdempotencyLayer, Webhook};
    /// use idem_runtime::MemoryStore;
    ///
    /// let preset = Webhook::github("hook secret")?.endpoint("github-ci")?;
    /// let layer = IdempotencyLayer::webhook(MemoryStore::new(), preset);
    /// // axum: Router::new().route("/webhooks/github", post(receive)).layer(layer)
    /// # let _ = layer;
    /// # Ok::<_, idem_runtime::Error>(())
    /// ```
    pub fn webhook(store: St, sender: Webhook) -> IdempotencyLayer<St, Unscoped> {
        let layer = Self::new(store)
            .unscoped()
            .namespace(sender.namespace())
            .ttl(sender.kept())
            .methods([Method::POST])
            .required()
            .in_flight(InFlight::Wait)
            .wait(sender.wait())
            .key_from(sender.key_from());
        let left_out = sender.unfingerprinted();
        layer.with(|c| {
            if !left_out.is_empty() {
                c.fingerprint = FingerprintFn::Custom(Arc::new(|parts: &Parts, body: &Bytes| {
                    fingerprint::of_request_without(parts, body, left_out)
                }));
            }
            c.webhook = Some(Arc::new(sender));
        })
    }
}

impl<St: Clone, Sc: Clone> IdempotencyLayer<St, Sc> {
    /// Where requests carry their key (default: the `Idempotency-Key` header). See
    /// [`KeyFrom`]: another header, several headers, a member of the JSON body, or a
    /// function. A body key is found once the body is read (within
    /// [`max_body`](Self::max_body)); a request without one passes through, or gets `400`
    /// when the layer is [`required`](Self::required).
    pub fn key_from(self, source: KeyFrom) -> Self {
        self.with(|c| c.key_from = source)
    }

    fn with(self, change: impl FnOnce(&mut Config<St, Sc>)) -> Self {
        let mut config = Arc::unwrap_or_clone(self.config);
        change(&mut config);
        Self {
            config: Arc::new(config),
        }
    }

    fn rescoped<Sc2>(self, scope: Sc2) -> IdempotencyLayer<St, Sc2> {
        let c = Arc::unwrap_or_clone(self.config);
        IdempotencyLayer {
            config: Arc::new(Config {
                store: c.store,
                scope,
                operation: c.operation,
                methods: c.methods,
                required: c.required,
                max_body: c.max_body,
                max_recorded_body: c.max_recorded_body,
                record_if: c.record_if,
                record_header_if: c.record_header_if,
                on_unrecorded: c.on_unrecorded,
                fingerprint: c.fingerprint,
                retry_after: c.retry_after,
                unknown_principal: c.unknown_principal,
                key_from: c.key_from,
                webhook: c.webhook,
                #[cfg(feature = "governor")]
                rate_limit: c.rate_limit,
            }),
        }
    }

    /// Keys each principal apart: `scope` names whose request it is (a user, a tenant, an API
    /// key), usually from an extension your authentication put there. The same key sent by
    /// two principals is two operations, and neither ever sees the other's response.
    ///
    /// A request with a key whose principal `scope` cannot name (`None`: no credentials, a
    /// scheme it does not parse, or an authentication layer placed *inside* this one, so
    /// that it has not run yet) is refused with `401`, and its handler does not run: the
    /// layer cannot tell whose key it is, and running it unprotected would turn
    /// idempotency off without a word. Put the authentication layer outside this one (in
    /// axum, `.layer(idempotency).layer(auth)`: the last layer added runs first), or choose
    /// pass-through with [`pass_through_unknown_principal`](Self::pass_through_unknown_principal).
    pub fn scope<F>(self, scope: F) -> IdempotencyLayer<St, ScopedBy<F>>
    where
        F: Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static,
    {
        self.rescoped(ScopedBy(scope))
    }

    /// Shares one key space between every client: a key sent by one is replayed to any
    /// other that sends it. Right only when keys are unguessable and responses hold nothing
    /// private, or when one client is the only caller.
    pub fn unscoped(self) -> IdempotencyLayer<St, Unscoped> {
        self.rescoped(Unscoped)
    }

    /// Lets a keyed request whose principal [`scope`](Self::scope) cannot name pass
    /// through to its handler *without idempotency* (no claim, no record, no replay),
    /// instead of answering `401`. For services where anonymous requests are legitimate
    /// and their keys must not be shared: each such request runs, however often it is
    /// retried.
    pub fn pass_through_unknown_principal(self) -> Self {
        self.with(|c| c.unknown_principal = UnknownPrincipal::PassThrough)
    }

    /// Answers `400` to a request of the layer's methods without an `Idempotency-Key`
    /// (default: such requests pass through).
    pub fn required(self) -> Self {
        self.with(|c| c.required = true)
    }

    /// The stable name of the endpoint group, part of every key (default
    /// [`DEFAULT_NAMESPACE`]): two layers with different namespaces never share keys.
    pub fn namespace(self, namespace: impl Into<Cow<'static, str>>) -> Self {
        self.with(|c| c.operation = c.operation.clone().renamed(namespace))
    }

    /// How long a recorded response is replayed (default 24 h).
    pub fn ttl(self, ttl: Duration) -> Self {
        self.with(|c| c.operation = c.operation.clone().ttl(ttl))
    }

    /// How long a claim lives without renewal while the handler runs (default 8 s).
    pub fn lease(self, lease: Duration) -> Self {
        self.with(|c| c.operation = c.operation.clone().lease(lease))
    }

    /// What a request whose key is in flight gets: `409` with `Retry-After`
    /// ([`InFlight::Reject`], the default), or the first request's response once it is
    /// done ([`InFlight::Wait`], bounded by [`wait`](Self::wait)).
    pub fn in_flight(self, in_flight: InFlight) -> Self {
        self.with(|c| c.operation = c.operation.clone().in_flight(in_flight))
    }

    /// With [`InFlight::Wait`], how long a duplicate waits for the first request's response
    /// (default [`DEFAULT_WAIT`](crate::DEFAULT_WAIT), 10 s, whatever the lease; a webhook
    /// preset's is below its sender's timeout), then `409` with `Retry-After`, as a
    /// duplicate that does not wait gets at once.
    pub fn wait(self, wait: Duration) -> Self {
        self.with(|c| c.operation = c.operation.clone().wait(wait))
    }

    /// The `Retry-After` of a `409` when the store cannot say how long the holder's lease
    /// has left (default 1 s); a store that can ([`Store::lease_left`])
    /// answers with that, rounded up to whole seconds.
    pub fn retry_after(self, after: Duration) -> Self {
        self.with(|c| c.retry_after = after)
    }

    /// The methods the layer handles (default `POST` and `PATCH`); others pass through
    /// untouched, without store traffic.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.with(|c| c.methods = methods.into_iter().collect())
    }

    /// Which responses are recorded and replayed (default: `2xx`). A response it refuses is
    /// returned to its client and releases the key, so that a retry runs the handler again.
    pub fn record_if(self, record: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.with(|c| c.record_if = Arc::new(record))
    }

    /// The largest request body a keyed request may carry (default [`DEFAULT_MAX_BODY`]);
    /// a larger one gets `413` and the handler does not run.
    pub fn max_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_body = bytes)
    }

    /// The largest response body recorded (default [`DEFAULT_MAX_BODY`]). A body whose
    /// length is known is read whole before the response is sent; one whose length is not
    /// (a stream, or a middleware inside this layer that maps frames, such as compression)
    /// is recorded as it is sent. A larger one is sent unrecorded, and its key completes
    /// without it: a retry gets `410 Gone`, never a second run of the handler. A `warn!`
    /// event and [`on_unrecorded`](Self::on_unrecorded) say so.
    pub fn max_recorded_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_recorded_body = bytes)
    }

    /// Limits how fast keyed requests may come, per key and per principal (feature
    /// `governor`; off by default): a request over a limit gets `429` with `Retry-After`,
    /// answered from memory before the store is asked or the body read, so that a client
    /// retrying in a tight loop, or creating keys in a flood, costs the store nothing. The
    /// limits are this instance's: each instance of a service counts its own requests. See
    /// [`RateLimit`](super::RateLimit).
    #[cfg(feature = "governor")]
    #[cfg_attr(docsrs, doc(cfg(feature = "governor")))]
    pub fn rate_limit(self, limits: super::RateLimit) -> Self {
        self.with(|c| c.rate_limit = limits.build().map(Arc::new))
    }

    /// A recordable response that cannot be recorded (over
    /// [`max_recorded_body`](Self::max_recorded_body), trailers, a body that failed)
    /// releases its key, so that a retry runs the handler **again**, instead of answering
    /// `410 Gone`. Only for handlers whose effects are safe to repeat.
    pub fn release_unrecorded(self) -> Self {
        self.with(|c| {
            c.operation.errors.release = true;
        })
    }

    /// Called for each response that `record_if` accepted but that could not be recorded
    /// (too large, trailers, a body that failed): its key completed without it, so a retry
    /// gets `410` (or, with [`release_unrecorded`](Self::release_unrecorded), was released,
    /// so a retry runs the handler again). A hook to count and alert on; each case is also
    /// a `warn!` event.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::sync::Arc;
    /// use idem_runtime::http::IdempotencyLayer;
    /// use idem_runtime::MemoryStore;
    ///
    /// let unrecorded = Arc::new(AtomicU64::new(0));
    /// let counter = unrecorded.clone();
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .unscoped()
    ///     .on_unrecorded(move |_why| {
    ///         counter.fetch_add(1, Ordering::Relaxed);
    ///     });
    /// # let _ = layer;
    /// ```
    pub fn on_unrecorded(self, hook: impl Fn(&Unrecorded) + Send + Sync + 'static) -> Self {
        self.with(|c| c.on_unrecorded = Some(Arc::new(hook)))
    }

    /// Which response headers are recorded and replayed (default: all but `Set-Cookie`;
    /// hop-by-hop headers never are). The first response is sent with all its headers; a
    /// replay, which may answer another client when the layer is unscoped, carries only
    /// the recorded ones. Leave out any header derived from the first caller's
    /// credentials or session.
    ///
    /// ```
    /// use http::header::{HeaderName, SET_COOKIE};
    /// use idem_runtime::http::IdempotencyLayer;
    /// use idem_runtime::MemoryStore;
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .unscoped()
    ///     .record_header_if(|name: &HeaderName| name != SET_COOKIE && name != "x-session");
    /// # let _ = layer;
    /// ```
    pub fn record_header_if(
        self,
        record: impl Fn(&HeaderName) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.with(|c| c.record_header_if = Arc::new(record))
    }

    /// Replaces the default fingerprint (method, path and query, body; JSON bodies by their
    /// meaning) with one of your own, for APIs whose requests carry fields that may change
    /// between retries (a timestamp, a trace id).
    ///
    /// ```
    /// use idem_runtime::http::IdempotencyLayer;
    /// use idem_runtime::{Fingerprint, MemoryStore};
    ///
    /// #[derive(serde::Deserialize, serde::Serialize)]
    /// struct Payment { amount: u64, currency: String }
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .unscoped()
    ///     .fingerprint(|parts, body| {
    ///         let payment: Payment = serde_json::from_slice(body)
    ///             .map_err(idem_runtime::Error::codec)?;
    ///         Fingerprint::of(&(parts.uri.path(), payment))
    ///     });
    /// # let _ = layer;
    /// ```
    pub fn fingerprint(
        self,
        fingerprint: impl Fn(&Parts, &Bytes) -> Result<Fingerprint, Error> + Send + Sync + 'static,
    ) -> Self {
        self.with(|c| c.fingerprint = FingerprintFn::Custom(Arc::new(fingerprint)))
    }
}

impl<S, St, Sc> Layer<S> for IdempotencyLayer<St, Sc>
where
    St: Store + Clone,
    Sc: KeyScope,
{
    type Service = IdempotencyService<S, St, Sc>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, Arc::clone(&self.config))
    }
}
