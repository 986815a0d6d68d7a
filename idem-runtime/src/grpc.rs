//! gRPC unary methods made idempotent, and the client's half, for `tonic` (feature `tonic`).
//!
//! A gRPC client cannot read an HTTP layer's `409` or problem+json: it reads a status. So
//! the server's half works on the method, not on HTTP: [`Idempotency::unary`] wraps a
//! tonic method's body, keys the call on the `idempotency-key` metadata (or, with
//! [`unary_by`](Idempotency::unary_by), on fields of the request message), records the
//! response message and its metadata, and answers everything of its own as a gRPC status
//! with machine-readable details (`google.rpc.ErrorInfo`, and `google.rpc.RetryInfo` where a
//! retry is the answer).
//!
//! ```no_run
//! # mod pb { #[derive(Clone, PartialEq, prost::Message)] pub struct Charge { #[prost(uint64, tag = "1")] pub cents: u64 }
//! #          #[derive(Clone, PartialEq, prost::Message)] pub struct Receipt { #[prost(uint64, tag = "1")] pub id: u64 } }
//! use idem_runtime::grpc::{Idempotency, Scoped};
//! use idem_runtime::MemoryStore;
//! use tonic::{Request, Response, Status};
//!
//! struct Payments {
//!     idem: Idempotency<MemoryStore, Scoped>,
//! }
//!
//! impl Payments {
//!     // In `#[tonic::async_trait] impl pb::payments_server::Payments for Payments`:
//!     async fn charge(&self, request: Request<pb::Charge>) -> Result<Response<pb::Receipt>, Status> {
//!         self.idem.unary("payments.charge.v1", request, |request| async move {
//!             let receipt = pb::Receipt { id: request.into_inner().cents };
//!             Ok(Response::new(receipt))
//!         }).await
//!     }
//! }
//! # fn make() -> Payments {
//! // Whose key is it? Here, the principal an authentication interceptor put in the extensions.
//! # #[derive(Clone)] struct Principal(String);
//! let idem = Idempotency::new(MemoryStore::new())
//!     .scope(|request| request.extensions().get::<Principal>().map(|p| p.0.clone()));
//! # Payments { idem } }
//! ```
//!
//! What a call gets:
//!
//! | call | answer |
//! |---|---|
//! | no `idempotency-key` | the body runs, unprotected; `INVALID_ARGUMENT` (`KEY_MISSING`) with [`required`](Idempotency::required) |
//! | a key, but the [scope](Idempotency::scope) cannot name the principal | `UNAUTHENTICATED` (`PRINCIPAL_UNKNOWN`); the body does not run |
//! | a malformed key (empty, over 255 characters, several values, neither a quoted string nor a token) | `INVALID_ARGUMENT` (`KEY_MALFORMED`) |
//! | the first call with a key | the body runs; an `Ok` response (its message and metadata) is recorded |
//! | a retry with the same request message | the recorded message and metadata, plus `idempotent-replayed: true`; the body does not run |
//! | the same key with another request message | `FAILED_PRECONDITION` (`KEY_REUSED`): a state of the server, not of the request alone, and not to be retried |
//! | a retry while the first still runs | `ABORTED` (`IN_FLIGHT`) with a `RetryInfo` delay (gRPC's "retry at a higher level"), or the first call's answer with [`InFlight::Wait`] |
//! | the body returns a `Status` | that status; the key is released, so a retry runs |
//! | a completed key whose response is gone (not kept, evicted) | `ALREADY_EXISTS` (`GONE`): the work was done; the body does not run again |
//! | the store is down | `UNAVAILABLE` (`STORE_UNAVAILABLE`) with a `RetryInfo` delay; the body does not run |
//! | the body's response could not be recorded | `UNKNOWN` (`UNRECORDED`): the work ran and its answer is not kept |
//! | the client goes away (a cancelled call, a lost connection) | the body runs to its end and its response is recorded: the retry replays it |
//!
//! The error details' domain is [`ERROR_DOMAIN`]; a status's message never carries a
//! store's or a library's own text (that goes to `tracing`).
//!
//! **The fingerprint** is the request message as prost encodes it (SHA-256), so a retry
//! must resend the same message. prost encodes fields in tag order, and a `map` field in
//! its map's order: generate map fields as `BTreeMap` (`prost_build::Config::btree_map`),
//! or use [`unary_by`](Idempotency::unary_by) on fields whose encoding is stable.
//!
//! **The client's half**: [`send`] gives a logical call one key, resends it with every retry
//! of the call, and retries what is safe to retry (see its table).

use std::borrow::Cow;
use std::future::Future;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use tonic::metadata::{KeyAndValueRef, MetadataKey, MetadataValue};
use tonic::{Code, Request, Response, Status};
use tonic_types::{ErrorDetails, StatusExt as _};

use crate::http::client::{earliest, resume_at, within, Retry};
use crate::http::{ScopeNotChosen, Unscoped};
use crate::IdempotencyKey;
use crate::{Error, Fingerprint, InFlight, Operation, Outcome, Store};

/// The metadata that carries a call's key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The metadata a replayed response carries, with the value `true`.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The `domain` of the `google.rpc.ErrorInfo` in every status this module answers itself.
pub const ERROR_DOMAIN: &str = "idem.rs";

/// Who a call is from, for [`Idempotency::scope`].
type ScopeFn = Arc<dyn Fn(&Request<()>) -> Option<String> + Send + Sync>;

/// Keys of one principal, named by a function of the call ([`Idempotency::scope`]).
#[derive(Clone)]
pub struct Scoped(ScopeFn);

impl std::fmt::Debug for Scoped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scoped")
    }
}

/// How a chosen scope names a call's principal.
#[diagnostic::on_unimplemented(
    message = "choose whose keys these are before the first call",
    label = "no scope chosen",
    note = "call `.scope(|call| ..)` (keys per principal) or `.unscoped()` (keys shared by every caller) on `Idempotency::new(store)`"
)]
pub trait GrpcScope: Send + Sync + 'static {
    /// The principal of a call (its metadata and extensions), `Some("")` for a service
    /// whose keys are shared, `None` when it cannot be named.
    #[doc(hidden)]
    fn principal(&self, call: &Request<()>) -> Option<String>;
}

impl GrpcScope for Scoped {
    fn principal(&self, call: &Request<()>) -> Option<String> {
        (self.0)(call)
    }
}

impl GrpcScope for Unscoped {
    fn principal(&self, _: &Request<()>) -> Option<String> {
        Some(String::new())
    }
}

/// Unary gRPC methods made idempotent in a store; see the [module](self). Cheap to clone.
#[derive(Clone, Debug)]
pub struct Idempotency<St, Sc = ScopeNotChosen> {
    store: St,
    scope: Sc,
    ttl: Duration,
    lease: Duration,
    in_flight: InFlight,
    required: bool,
}

impl<St: Store + Clone> Idempotency<St> {
    /// Calls recorded in `store`, for [`DEFAULT_TTL`](crate::DEFAULT_TTL), keys optional.
    /// Choose whose keys they are with [`scope`](Self::scope) or
    /// [`unscoped`](Self::unscoped) before the first call.
    pub fn new(store: St) -> Self {
        Self {
            store,
            scope: ScopeNotChosen,
            ttl: crate::DEFAULT_TTL,
            lease: crate::DEFAULT_LEASE,
            in_flight: InFlight::Reject,
            required: false,
        }
    }

    /// Keys are per principal: `principal` names a call's (from its metadata or the
    /// extensions an authentication interceptor set), and a keyed call it cannot name is
    /// refused with `UNAUTHENTICATED`. Two principals' equal keys never meet.
    pub fn scope<F>(self, principal: F) -> Idempotency<St, Scoped>
    where
        F: Fn(&Request<()>) -> Option<String> + Send + Sync + 'static,
    {
        self.with_scope(Scoped(Arc::new(principal)))
    }

    /// Keys are shared by every caller: for a service whose clients are one principal (an
    /// internal service behind its own authentication).
    pub fn unscoped(self) -> Idempotency<St, Unscoped> {
        self.with_scope(Unscoped)
    }
}

impl<St, Sc> Idempotency<St, Sc> {
    fn with_scope<S>(self, scope: S) -> Idempotency<St, S> {
        Idempotency {
            store: self.store,
            scope,
            ttl: self.ttl,
            lease: self.lease,
            in_flight: self.in_flight,
            required: self.required,
        }
    }

    /// How long a response is replayed (default [`DEFAULT_TTL`](crate::DEFAULT_TTL)).
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The claim's lease while a body runs, renewed as it runs (default
    /// [`DEFAULT_LEASE`](crate::DEFAULT_LEASE)).
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// What a call gets while its key's first call still runs: `ABORTED` at once
    /// ([`InFlight::Reject`], the default), or the first call's answer
    /// ([`InFlight::Wait`]).
    #[must_use]
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.in_flight = in_flight;
        self
    }

    /// Calls without an `idempotency-key` are refused with `INVALID_ARGUMENT` instead of
    /// running unprotected.
    #[must_use]
    pub fn required(mut self) -> Self {
        self.required = true;
        self
    }
}

impl<St: Store + Clone, Sc> Idempotency<St, Sc> {
    /// Runs `body` once per key in `namespace` (a stable name of the method, such as
    /// `"payments.charge.v1"`): the key is the call's `idempotency-key` metadata, scoped by
    /// its principal; a retry with the same request message gets the recorded response.
    /// A call its client cancels runs `body` to its end (on the tokio runtime) and records
    /// its response, which the retry replays; so `body` owns what it uses (`'static`: clone
    /// the service's handles into it). It reads the key through the request extension
    /// [`IdempotencyKey`].
    ///
    /// # Errors
    ///
    /// `body`'s own status (the key released), or this module's (see the [module](self)).
    pub async fn unary<M, R, F, Fut>(
        &self,
        namespace: impl Into<Cow<'static, str>>,
        request: Request<M>,
        body: F,
    ) -> Result<Response<R>, Status>
    where
        M: prost::Message + Send + 'static,
        R: prost::Message + Default + Send + 'static,
        F: FnOnce(Request<M>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Response<R>, Status>> + Send + 'static,
        Sc: GrpcScope,
    {
        let key = match crate::http::header::parse(request.metadata().as_ref()) {
            Ok(Some(key)) => key,
            Ok(None) if self.required => {
                return Err(refusal(
                    Code::InvalidArgument,
                    "KEY_MISSING",
                    "this method needs an `idempotency-key` metadata entry",
                ))
            }
            Ok(None) => return body(request).await,
            Err(why) => return Err(refusal(Code::InvalidArgument, "KEY_MALFORMED", why)),
        };
        let value = key.as_str().to_owned();
        self.keyed(namespace.into(), request, value, Some(key), body)
            .await
    }

    /// [`unary`](Self::unary), keyed on fields of the request message instead of its
    /// metadata: `key` picks them (a value that serializes, such as `(m.account, m.order_id)`).
    /// Every call is keyed: there is no call without a key.
    ///
    /// # Errors
    ///
    /// As [`unary`](Self::unary).
    pub async fn unary_by<M, R, K, V, F, Fut>(
        &self,
        namespace: impl Into<Cow<'static, str>>,
        request: Request<M>,
        key: K,
        body: F,
    ) -> Result<Response<R>, Status>
    where
        M: prost::Message + Send + 'static,
        R: prost::Message + Default + Send + 'static,
        K: FnOnce(&M) -> V,
        V: Serialize,
        F: FnOnce(Request<M>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Response<R>, Status>> + Send + 'static,
        Sc: GrpcScope,
    {
        let value = key(request.get_ref());
        self.keyed(namespace.into(), request, value, None, body)
            .await
    }

    async fn keyed<M, R, V, F, Fut>(
        &self,
        namespace: Cow<'static, str>,
        request: Request<M>,
        value: V,
        key: Option<IdempotencyKey>,
        body: F,
    ) -> Result<Response<R>, Status>
    where
        M: prost::Message + Send + 'static,
        R: prost::Message + Default + Send + 'static,
        V: Serialize,
        F: FnOnce(Request<M>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Response<R>, Status>> + Send + 'static,
        Sc: GrpcScope,
    {
        // The scope reads the call's head, lent without copying its metadata or extensions.
        let (metadata, extensions, message) = request.into_parts();
        let head = Request::from_parts(metadata, extensions, ());
        let principal = self.scope.principal(&head);
        let (metadata, extensions, ()) = head.into_parts();
        let mut request = Request::from_parts(metadata, extensions, message);
        let Some(principal) = principal else {
            tracing::info!(namespace = %namespace, "a keyed gRPC call whose principal is unknown: answered UNAUTHENTICATED");
            return Err(refusal(
                Code::Unauthenticated,
                "PRINCIPAL_UNKNOWN",
                "the call carries an idempotency key, but whose call it is cannot be told: authenticate, and retry with the same key",
            ));
        };
        let operation = Operation::new(namespace)
            .ttl(self.ttl)
            .lease(self.lease)
            .in_flight(self.in_flight);
        let derived = operation
            .key(&(principal.as_str(), &value))
            .map_err(|err| internal(&err))?;
        let fingerprint = fingerprint(request.get_ref());
        if let Some(key) = key {
            request.extensions_mut().insert(key);
        }
        // The body's own response, answered as it is when this call ran it: never decoded
        // again from its record, so a body that ran is never answered anything else.
        let ran_here = Arc::new(std::sync::Mutex::new(None));
        let answer = Arc::clone(&ran_here);
        // Called inside the claim: not even the closure's own code runs for a replay.
        let run = async move {
            match body(request).await {
                Ok(response) => {
                    let kept = Kept::of(&response);
                    *answer.lock().unwrap_or_else(PoisonError::into_inner) = Some(response);
                    Ok(kept)
                }
                Err(status) => Err(Failed::Body(status)),
            }
        };
        let ran = operation
            .run_to_completion(&self.store, &derived, Some(&fingerprint), run)
            .await;
        match ran {
            Ok(Outcome::Executed(kept)) => {
                let response = ran_here
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take();
                response.map_or_else(|| kept.response(false), Ok)
            }
            Ok(Outcome::Replayed(kept)) => kept.response(true),
            Err(Failed::Body(status)) => Err(status),
            Err(Failed::Idem(err)) => Err(status(&err)),
        }
    }
}

/// What a call ends in, inside the engine: the body's status, or idem's error.
enum Failed {
    Body(Status),
    Idem(Error),
}

impl From<Error> for Failed {
    fn from(err: Error) -> Self {
        Self::Idem(err)
    }
}

/// A response as it is recorded: its message as prost encodes it, and its metadata
/// (binary values in base64, as they travel).
#[derive(Serialize, Deserialize)]
struct Kept {
    message: String,
    metadata: Vec<(String, String)>,
}

impl Kept {
    fn of<R: prost::Message>(response: &Response<R>) -> Self {
        let engine = &base64::engine::general_purpose::STANDARD;
        let metadata = response
            .metadata()
            .iter()
            .map(|entry| match entry {
                KeyAndValueRef::Ascii(key, value) => (
                    key.as_str().to_owned(),
                    String::from_utf8_lossy(value.as_encoded_bytes()).into_owned(),
                ),
                // Kept decoded, in base64 of its own: the wire's may be padded or not.
                KeyAndValueRef::Binary(key, value) => (
                    key.as_str().to_owned(),
                    engine.encode(value.to_bytes().unwrap_or_default()),
                ),
            })
            .collect();
        Self {
            message: engine.encode(response.get_ref().encode_to_vec()),
            metadata,
        }
    }

    /// The response again, marked `idempotent-replayed: true` when `replayed`.
    fn response<R: prost::Message + Default>(self, replayed: bool) -> Result<Response<R>, Status> {
        let engine = &base64::engine::general_purpose::STANDARD;
        let undecodable = |what: &str| {
            tracing::error!(
                what,
                "a recorded gRPC response does not decode: answered INTERNAL"
            );
            refusal(
                Code::Internal,
                "INTERNAL",
                "the recorded response does not decode",
            )
        };
        let bytes = engine
            .decode(&self.message)
            .map_err(|_| undecodable("its message is not base64"))?;
        let message = R::decode(bytes.as_slice()).map_err(|_| undecodable("its message"))?;
        let mut response = Response::new(message);
        let metadata = response.metadata_mut();
        for (key, value) in self.metadata {
            if key.ends_with("-bin") {
                let key =
                    MetadataKey::from_bytes(key.as_bytes()).map_err(|_| undecodable("a key"))?;
                let value = engine
                    .decode(&value)
                    .map_err(|_| undecodable("a binary value"))?;
                metadata.append_bin(key, MetadataValue::from_bytes(&value));
            } else {
                let key =
                    MetadataKey::from_bytes(key.as_bytes()).map_err(|_| undecodable("a key"))?;
                let value = MetadataValue::try_from(value).map_err(|_| undecodable("a value"))?;
                metadata.append(key, value);
            }
        }
        if replayed {
            metadata.insert(IDEMPOTENT_REPLAYED, MetadataValue::from_static("true"));
        }
        Ok(response)
    }
}

/// The request message's fingerprint: the SHA-256 of its prost encoding.
fn fingerprint<M: prost::Message>(message: &M) -> Fingerprint {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(message.encode_to_vec());
    Fingerprint::from_bytes(digest.into())
}

/// A status of this module's own, with its reason in a `google.rpc.ErrorInfo`.
fn refusal(code: Code, reason: &str, message: &str) -> Status {
    let details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, []);
    Status::with_error_details(code, message, details)
}

fn internal(err: &Error) -> Status {
    tracing::error!(error = %err, "a gRPC call failed inside idem: answered INTERNAL");
    refusal(
        Code::Internal,
        "INTERNAL",
        "the call could not be keyed or recorded",
    )
}

/// The status an [`Error`] is answered with (see the [module](self)'s table); also what
/// `Status::from(err)` is, so that a tonic method can `?` an `#[idempotent]` call's error.
/// Its message never carries the error's own text.
pub fn status(err: &Error) -> Status {
    let retry_in = |code: Code, reason: &str, message: &str, delay: Duration| {
        let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, []);
        details.set_retry_info(Some(delay));
        Status::with_error_details(code, message, details)
    };
    match err {
        Error::InProgress => retry_in(
            Code::Aborted,
            "IN_FLIGHT",
            "the first call with this key has not finished: retry with the same key",
            err.retry_after().unwrap_or(crate::RETRY_AFTER),
        ),
        Error::PayloadMismatch => refusal(
            Code::FailedPrecondition,
            "KEY_REUSED",
            "this idempotency key was used with another request: use a new key for a new call",
        ),
        Error::Gone => refusal(
            Code::AlreadyExists,
            "GONE",
            "the call with this key completed, but its response was not kept: it is not run again",
        ),
        Error::Store(_) => {
            tracing::warn!(error = %err, "the idempotency store failed: answered UNAVAILABLE");
            retry_in(
                Code::Unavailable,
                "STORE_UNAVAILABLE",
                "the call was not processed: retry with the same key",
                crate::RETRY_AFTER,
            )
        }
        Error::Unrecorded(_) => {
            tracing::warn!(error = %err, "a gRPC call's response was not recorded: answered UNKNOWN");
            refusal(
                Code::Unknown,
                "UNRECORDED",
                "the call ran, but its response could not be recorded",
            )
        }
        other => internal(other),
    }
}

impl From<Error> for Status {
    fn from(err: Error) -> Self {
        status(&err)
    }
}

// ---- the client's half ----------------------------------------------------------------------

/// Sends one logical call through `send` under one `idempotency-key`, and retries it within
/// `retry`'s attempts and budget, resending the same message and key, so that the server
/// replays the first answer instead of running again.
///
/// ```no_run
/// # mod pb { #[derive(Clone, PartialEq, prost::Message)] pub struct Charge { #[prost(uint64, tag = "1")] pub cents: u64 }
/// #          #[derive(Clone, PartialEq, prost::Message)] pub struct Receipt { #[prost(uint64, tag = "1")] pub id: u64 }
/// #          #[derive(Clone)] pub struct PaymentsClient;
/// #          impl PaymentsClient { pub async fn charge(&mut self, _: tonic::Request<Charge>) -> Result<tonic::Response<Receipt>, tonic::Status> { unimplemented!() } } }
/// # async fn pay(client: pb::PaymentsClient) -> Result<(), tonic::Status> {
/// use idem_runtime::grpc;
/// use idem_runtime::http::client::Retry;
///
/// let request = tonic::Request::new(pb::Charge { cents: 1000 });
/// let receipt = grpc::send(&Retry::new(), request, |request| {
///     let mut client = client.clone(); // a tonic client: cheap to clone
///     async move { client.charge(request).await }
/// })
/// .await?;
/// # let _ = receipt; Ok(()) }
/// ```
///
/// | the call or its answer | what `send` does |
/// |---|---|
/// | the request has an `idempotency-key` | keeps it |
/// | none, inside a keyed call (an `#[idempotent]` body, a consumer's handler, …) | a key derived from that call's key, the message's type and its occurrence: the same on every attempt and redelivery of the call |
/// | none, outside every keyed call | a fresh UUIDv7 |
/// | `UNAVAILABLE`, `ABORTED`, `RESOURCE_EXHAUSTED`, `DEADLINE_EXCEEDED` | retried after the backoff, no sooner than the status's `RetryInfo` delay |
/// | a status the transport made (a connection lost or reset mid-call: tonic gives it a source error) | retried |
/// | any other status, or a response | returned |
/// | attempts or budget spent | the last status |
///
/// Each attempt is cut at [`Retry::timeout`] (10 s by default; its status is
/// `DEADLINE_EXCEEDED`, retried).
///
/// # Errors
///
/// The answer's status, or the last retried one once the attempts or the budget are spent.
/// A request whose own `idempotency-key` is malformed: `INVALID_ARGUMENT`, nothing sent.
pub async fn send<M, R, F, Fut>(
    retry: &Retry,
    request: Request<M>,
    mut send: F,
) -> Result<Response<R>, Status>
where
    M: Clone,
    F: FnMut(Request<M>) -> Fut,
    Fut: Future<Output = Result<Response<R>, Status>>,
{
    let (mut metadata, extensions, message) = request.into_parts();
    match crate::http::header::parse(metadata.as_ref()) {
        Ok(Some(_)) => {}
        Ok(None) => {
            let derived = crate::engine::attempt::request_key("grpc", std::any::type_name::<M>());
            let key = match derived {
                Some(derived) => derived.to_hex(),
                None => uuid::Uuid::now_v7().hyphenated().to_string(),
            };
            let value = MetadataValue::try_from(key.as_str())
                .expect("a UUID or hex digits are printable ASCII");
            metadata.insert(IDEMPOTENCY_KEY, value);
        }
        Err(why) => return Err(refusal(Code::InvalidArgument, "KEY_MALFORMED", why)),
    }
    let started = tokio::time::Instant::now();
    let deadline = started.checked_add(retry.budget_of());
    let mut tries = 0u32;
    loop {
        tries += 1;
        let attempt = Request::from_parts(metadata.clone(), extensions.clone(), message.clone());
        let cut = retry
            .timeout_of()
            .and_then(|timeout| tokio::time::Instant::now().checked_add(timeout));
        let answer = within(earliest(cut, deadline), send(attempt))
            .await
            .unwrap_or_else(|| Err(Status::deadline_exceeded("the attempt was cut")));
        let status = match answer {
            Ok(response) => return Ok(response),
            Err(status) if !retryable(&status) => return Err(status),
            Err(status) => status,
        };
        if tries >= retry.attempts_of() {
            return Err(status);
        }
        let delay = status
            .get_details_retry_info()
            .and_then(|info| info.retry_delay);
        let now = tokio::time::Instant::now();
        let Some(resume) = resume_at(retry, tries, delay, now, deadline) else {
            return Err(status);
        };
        tokio::time::sleep_until(resume).await;
    }
}

/// Whether a status is worth sending the call again for, under the same key.
fn retryable(status: &Status) -> bool {
    use std::error::Error as _;
    matches!(
        status.code(),
        Code::Unavailable | Code::Aborted | Code::ResourceExhausted | Code::DeadlineExceeded
    ) || status.source().is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_has_its_documented_status() {
        let cases = [
            (Error::InProgress, Code::Aborted, "IN_FLIGHT", true),
            (
                Error::PayloadMismatch,
                Code::FailedPrecondition,
                "KEY_REUSED",
                false,
            ),
            (Error::Gone, Code::AlreadyExists, "GONE", false),
            (
                Error::store("db at 10.0.0.3 down"),
                Code::Unavailable,
                "STORE_UNAVAILABLE",
                true,
            ),
            (
                Error::Unrecorded("disk full".into()),
                Code::Unknown,
                "UNRECORDED",
                false,
            ),
            (
                Error::codec("bad json at byte 3"),
                Code::Internal,
                "INTERNAL",
                false,
            ),
        ];
        for (err, code, reason, retry_info) in cases {
            let status = status(&err);
            assert_eq!(status.code(), code, "{err:?}");
            let info = status.get_details_error_info().expect("an ErrorInfo");
            assert_eq!(
                (info.reason.as_str(), info.domain.as_str()),
                (reason, ERROR_DOMAIN)
            );
            assert_eq!(
                status.get_details_retry_info().is_some(),
                retry_info,
                "{err:?}"
            );
            assert!(
                !status.message().contains("10.0.0.3")
                    && !status.message().contains("disk")
                    && !status.message().contains("byte 3"),
                "a status carries no internal text: {}",
                status.message()
            );
        }
    }

    /// `send` resends the one key it gave the call, no sooner than a status's `RetryInfo`
    /// delay (on a paused clock: the delay is the clock's, not the machine's), and sends
    /// nothing for a malformed key of the caller's.
    #[tokio::test(start_paused = true)]
    async fn send_resends_one_key_after_the_retry_info_delay() {
        let sent = std::sync::Mutex::new(Vec::new());
        let answer = send(&Retry::new(), Request::new(()), |request: Request<()>| {
            let key = request.metadata().get(IDEMPOTENCY_KEY).cloned();
            let mut sent = sent.lock().unwrap();
            sent.push((tokio::time::Instant::now(), key));
            let first = sent.len() == 1;
            async move {
                if first {
                    return Err(status(&Error::InProgress));
                }
                Ok(Response::new(()))
            }
        })
        .await;
        assert!(answer.is_ok());
        let sent = sent.into_inner().unwrap();
        assert_eq!(sent.len(), 2);
        assert!(sent[0].1.is_some());
        assert_eq!(sent[0].1, sent[1].1, "one key for the call's attempts");
        assert!(
            sent[1].0 - sent[0].0 >= crate::RETRY_AFTER,
            "resent after {:?}, before the RetryInfo delay",
            sent[1].0 - sent[0].0
        );

        let mut malformed = Request::new(());
        malformed
            .metadata_mut()
            .insert(IDEMPOTENCY_KEY, MetadataValue::from_static("\"open"));
        let refused = send(&Retry::new(), malformed, |_: Request<()>| async {
            panic!("a call with a malformed key is sent");
            #[allow(unreachable_code)]
            Ok(Response::new(()))
        })
        .await
        .unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument);
    }

    #[test]
    fn only_transient_statuses_and_transport_failures_are_retried() {
        for code in [
            Code::Unavailable,
            Code::Aborted,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
        ] {
            assert!(retryable(&Status::new(code, "")), "{code:?}");
        }
        for code in [
            Code::Ok,
            Code::InvalidArgument,
            Code::FailedPrecondition,
            Code::AlreadyExists,
            Code::Unauthenticated,
            Code::Unknown,
            Code::Internal,
        ] {
            assert!(!retryable(&Status::new(code, "")), "{code:?}");
        }
        let cut = Status::from_error(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )));
        assert!(retryable(&cut), "a status the transport made: {cut:?}");
    }
}
