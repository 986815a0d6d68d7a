//! [`IdempotencyService`]: what the layer wraps around a service.

use std::fmt;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use tokio::sync::oneshot;
use tower_service::Service;

use super::body::{self, ResponseBody, Tee};
use super::config::{Config, KeyScope, ScopeOf, UnkeptPolicy, UnknownPrincipal, Unrecorded};
use super::header::IdempotencyKey;
use super::key_from::{Found, KeyValues};
use super::problem::Problem;
use super::record::{HttpRecord, Recorded, IDEMPOTENT_REPLAYED};
use crate::codec::{self, ErrorPolicy};
use crate::{BoxError, Error, Key, Outcome, Store};

/// The future of [`IdempotencyService`]'s responses.
pub type ResponseFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

/// The service of an [`IdempotencyLayer`](super::IdempotencyLayer) around `S`.
///
/// `S` receives the request with its body as an [`Either`]: the original body when the
/// request passes through, the buffered one when it is keyed.
pub struct IdempotencyService<S, St, Sc> {
    inner: S,
    config: Arc<Config<St, Sc>>,
}

impl<S, St, Sc> IdempotencyService<S, St, Sc> {
    pub(super) fn new(inner: S, config: Arc<Config<St, Sc>>) -> Self {
        Self { inner, config }
    }
}

impl<S: Clone, St, Sc> Clone for IdempotencyService<S, St, Sc> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug, Sc> fmt::Debug for IdempotencyService<S, St, Sc> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("store", &self.config.store)
            .finish_non_exhaustive()
    }
}

impl<S, St, Sc, B, RB> Service<Request<B>> for IdempotencyService<S, St, Sc>
where
    S: Service<Request<Either<B, Full<Bytes>>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
    St: Store + Clone,
    Sc: KeyScope,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = S::Error;
    type Future = ResponseFuture<RB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service that was polled ready serves this request; a clone takes its place.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        Box::pin(handle(Arc::clone(&self.config), inner, request))
    }
}

/// Why the handler's outcome is not a response to record.
pub(super) enum Failure<E, RB> {
    /// Returned as it is, and the key released: a status `record_if` refuses.
    NotRecorded(Response<RB>),
    /// Returned as it is, but not kept: a recordable response whose known length is over
    /// the limit. The key completes without it ([`UnkeptPolicy`]).
    Unkept(Response<RB>),
    /// Sent while it was recorded (through [`Early`]), and then not recordable: the key
    /// completes without it ([`UnkeptPolicy`]).
    Sent,
    /// The inner service failed.
    Inner(E),
    /// The response body failed while it was read for recording.
    BodyFailed,
    /// The engine answered instead of the handler.
    Idem(Error),
}

impl<E, RB> ErrorPolicy<Failure<E, RB>> for UnkeptPolicy {
    fn encode(&self, err: &Failure<E, RB>) -> Option<Result<Bytes, Error>> {
        let unkept = matches!(
            err,
            Failure::Unkept(_) | Failure::Sent | Failure::BodyFailed
        );
        (unkept && !self.release).then(|| Ok(Bytes::from_static(codec::GONE)))
    }

    fn decode(&self, _: &[u8]) -> Result<Failure<E, RB>, Error> {
        Err(Error::codec(
            "an HTTP record holds an error, which the layer never records",
        ))
    }
}

/// Where the handler's task sends a response that is recorded while it is sent, so that
/// its client gets it at once.
type Early<RB> = oneshot::Sender<Response<Tee<RB>>>;

impl<E, RB> From<Error> for Failure<E, RB> {
    fn from(err: Error) -> Self {
        Self::Idem(err)
    }
}

async fn handle<S, St, Sc, B, RB>(
    config: Arc<Config<St, Sc>>,
    inner: S,
    request: Request<B>,
) -> Result<Response<ResponseBody<RB>>, S::Error>
where
    S: Service<Request<Either<B, Full<Bytes>>>, Response = Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
    St: Store + Clone,
    Sc: KeyScope,
{
    let problem = |problem: Problem| {
        let naming = config.key_from.naming();
        Ok(problem.answer(&naming).map(ResponseBody::full))
    };
    // A webhook's every request is verified, whatever its method; only its methods claim.
    let claims = config.methods.contains(request.method());
    if !claims && config.webhook.is_none() {
        return pass(inner, request).await;
    }
    let (parts, body) = request.into_parts();
    // A key in the head is admitted before the body is read, unless a signature must be
    // checked first: nothing about an unsigned request is looked up.
    let mut admitted = None;
    if !config.key_from.reads_body() && config.webhook.is_none() {
        match config.admit(config.key_from.in_head(&parts.headers), &parts) {
            Admission::Admitted(keyed) => admitted = Some(keyed),
            Admission::Pass => return pass(inner, Request::from_parts(parts, body)).await,
            Admission::Refused(refused) => return problem(refused),
        }
    }

    if body.size_hint().lower() > config.max_body as u64 {
        return problem(Problem::BodyTooLarge(config.max_body));
    }
    let body = match Limited::new(body, config.max_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) if err.is::<LengthLimitError>() => {
            return problem(Problem::BodyTooLarge(config.max_body))
        }
        Err(err) => {
            tracing::info!(error = %err, "the request body could not be read: answered 400");
            return problem(Problem::BodyUnreadable);
        }
    };
    let mut label = None;
    if let Some(sender) = &config.webhook {
        if let Err(why) = sender.verify(&parts.headers, &body) {
            tracing::info!(reason = %why, method = %parts.method, "a webhook delivery without its sender's signature: answered 401, nothing claimed");
            return problem(Problem::SignatureInvalid);
        }
        if !claims {
            return pass_read(inner, parts, body).await;
        }
        label = sender.delivery_id(&parts.headers, &body);
    }
    let (key, derived) = match admitted {
        Some(admitted) => admitted,
        None => match config.admit(config.key_from.in_request(&parts, &body), &parts) {
            Admission::Admitted(admitted) => admitted,
            Admission::Pass => return pass_read(inner, parts, body).await,
            Admission::Refused(refused) => return problem(refused),
        },
    };
    let fingerprint = match config.fingerprint.of(&derived, &parts, &body) {
        Ok(fingerprint) => fingerprint,
        Err(err) => {
            tracing::info!(error = %err, "the request could not be fingerprinted: answered 400");
            return problem(Problem::BodyUnreadable);
        }
    };
    let mut parts = parts;
    let (early, mut sent) = oneshot::channel();
    let handler = {
        let config = Arc::clone(&config);
        let mut inner = inner;
        async move {
            // Built only when the handler runs: a replay never needs the request.
            parts.extensions.insert(key);
            let request = Request::from_parts(parts, Either::Right(Full::new(body)));
            let response = inner.call(request).await.map_err(Failure::Inner)?;
            config.keep(response, early).await
        }
    };
    let run = {
        let config = Arc::clone(&config);
        async move {
            let run = config
                .operation
                .run_to_completion_as::<HttpRecord, _, _, _>(
                    &config.store,
                    Ok(Some((derived, Some(fingerprint)))),
                    handler,
                    false,
                );
            // A webhook's claim says which delivery it is, for an operator.
            match label {
                Some(label) => crate::labelled(label, run).await,
                None => run.await,
            }
        }
    };
    // A response recorded while it is sent reaches its client as soon as it exists; the
    // handler's task records it meanwhile, and goes on if this future is dropped. Boxed,
    // because the body of such a response ends only when this future does.
    let mut run = Box::pin(run);
    let mut sent_open = true;
    let outcome = poll_fn(|cx| {
        if sent_open {
            match Pin::new(&mut sent).poll(cx) {
                Poll::Ready(Ok(response)) => return Poll::Ready(Err(response)),
                Poll::Ready(Err(_)) => sent_open = false,
                Poll::Pending => {}
            }
        }
        run.as_mut().poll(cx).map(Ok)
    })
    .await;
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(response) => {
            let landing: body::Landing = Box::pin(async move {
                // Whatever the outcome, the response is sent: only its end waited for it.
                let _ = run.await;
            });
            return Ok(response.map(|tee| ResponseBody::tee(tee.until(landing))));
        }
    };
    match outcome {
        Ok(Outcome::Executed(recorded)) => {
            Ok(recorded.into_response(false).map(ResponseBody::full))
        }
        Ok(Outcome::Replayed(recorded)) => Ok(recorded.into_response(true).map(ResponseBody::full)),
        Err(Failure::NotRecorded(response) | Failure::Unkept(response)) => {
            Ok(response.map(ResponseBody::inner))
        }
        Err(Failure::Inner(err)) => Err(err),
        // Sent before the engine finished: the response is waiting in the channel.
        Err(Failure::Sent) => match sent.try_recv() {
            Ok(response) => Ok(response.map(ResponseBody::tee)),
            Err(_) => problem(Problem::Internal),
        },
        Err(Failure::BodyFailed) => problem(Problem::Internal),
        Err(Failure::Idem(Error::InProgress)) => {
            problem(Problem::InFlight(config.come_back(&derived).await))
        }
        // A webhook delivery that completed without its response kept was delivered: its
        // sender must not be told otherwise (some read `410` as "disable this endpoint").
        Err(Failure::Idem(Error::Gone)) if config.webhook.is_some() => {
            tracing::info!(
                outcome = "replayed",
                "a duplicate delivery whose response was not kept: answered 200"
            );
            let mut delivered = Response::new(ResponseBody::full(Full::new(Bytes::new())));
            delivered
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, http::HeaderValue::from_static("true"));
            Ok(delivered)
        }
        Err(Failure::Idem(err)) => problem(Problem::of(err, config.retry_after)),
    }
}

/// What the layer makes of a request's key before it runs anything.
enum Admission {
    /// Keyed: the key a handler sees, and the key derived in the layer's namespace and scope.
    Admitted((IdempotencyKey, Key)),
    /// Not the layer's: it passes through without idempotency.
    Pass,
    /// Answered with a problem.
    Refused(Problem),
}

impl<St, Sc: KeyScope> Config<St, Sc> {
    /// Admits a request whose key lookup found `found`: whose it is, its derived key, and
    /// the rate limits.
    fn admit(&self, found: Found, parts: &Parts) -> Admission {
        let keyed = match found {
            Found::Key(keyed) => keyed,
            Found::Missing if self.required => return Admission::Refused(Problem::KeyMissing),
            Found::Missing => return Admission::Pass,
            Found::Malformed(why) => return Admission::Refused(Problem::KeyMalformed(why)),
            // Looked for in the head only by a source that reads the head.
            Found::InBody => return Admission::Refused(Problem::Internal),
        };
        let scope = match self.scope.of(parts) {
            ScopeOf::Shared => None,
            ScopeOf::Principal(principal) => Some(principal),
            ScopeOf::Unknown if self.unknown_principal == UnknownPrincipal::PassThrough => {
                tracing::debug!("no principal for the key scope: passed through, as configured");
                return Admission::Pass;
            }
            ScopeOf::Unknown => {
                tracing::warn!("a keyed request whose principal the key scope cannot name: answered 401 (is the authentication layer inside the idempotency layer?)");
                return Admission::Refused(Problem::PrincipalUnknown);
            }
        };
        // One value derives as the `Idempotency-Key` header always has.
        let derived = match &keyed.values {
            KeyValues::One => self
                .operation
                .key(&(scope.as_deref(), keyed.shown.as_str())),
            KeyValues::Several(several) => self.operation.key(&(scope.as_deref(), several)),
        };
        let derived = match derived {
            Ok(derived) => derived,
            Err(err) => return Admission::Refused(Problem::of(err, self.retry_after)),
        };
        #[cfg(feature = "governor")]
        if let Some(limiter) = &self.rate_limit {
            if let Err(wait) = limiter.check(&derived, scope.as_deref()) {
                tracing::debug!(outcome = "rate limited", "answered 429 from memory");
                return Admission::Refused(Problem::RateLimited(wait));
            }
        }
        Admission::Admitted((keyed.shown, derived))
    }
}

/// A request the layer read but does not handle (it has no key): to the inner service with
/// the body it read.
async fn pass_read<S, B, RB>(
    mut inner: S,
    parts: Parts,
    body: Bytes,
) -> Result<Response<ResponseBody<RB>>, S::Error>
where
    S: Service<Request<Either<B, Full<Bytes>>>, Response = Response<RB>>,
{
    let call = inner.call(Request::from_parts(parts, Either::Right(Full::new(body))));
    let response = crate::engine::attempt::scope_unkeyed(call).await?;
    Ok(response.map(ResponseBody::inner))
}

/// A request the layer does not handle: to the inner service as it is.
async fn pass<S, B, RB>(
    mut inner: S,
    request: Request<B>,
) -> Result<Response<ResponseBody<RB>>, S::Error>
where
    S: Service<Request<Either<B, Full<Bytes>>>, Response = Response<RB>>,
{
    let call = inner.call(request.map(Either::Left));
    // Not an idempotent call: the handler's steps run as plain futures.
    let response = crate::engine::attempt::scope_unkeyed(call).await?;
    Ok(response.map(ResponseBody::inner))
}

impl<St: Store, Sc> Config<St, Sc> {
    /// When a request whose key is held may come back: when the holder's lease ends, by
    /// the store's clock, rounded up to a whole second (at least one); the configured
    /// `retry_after` when the store cannot say or fails to.
    async fn come_back(&self, key: &Key) -> Duration {
        match self.store.lease_left(key).await {
            Ok(Some(left)) => Duration::from_secs(left.as_millis().div_ceil(1000).max(1) as u64),
            Ok(None) => self.retry_after,
            Err(err) => {
                tracing::debug!(error = %err, "the holder's lease could not be read for Retry-After");
                self.retry_after
            }
        }
    }
}

impl<St, Sc> Config<St, Sc> {
    /// The response to record, or why it is not one. A body of known length within the
    /// limit is read whole here; one of unknown length is sent through `early` at once and
    /// recorded as it is sent.
    async fn keep<E, RB>(
        &self,
        response: Response<RB>,
        early: Early<RB>,
    ) -> Result<Recorded, Failure<E, RB>>
    where
        RB: Body<Data = Bytes>,
        RB::Error: Into<BoxError>,
    {
        if !(self.record_if)(response.status()) {
            return Err(Failure::NotRecorded(response));
        }
        let limit = self.max_recorded_body;
        let hint = response.body().size_hint();
        if hint.upper().is_some_and(|len| len <= limit as u64) {
            let (parts, body) = response.into_parts();
            let body = match body.collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(err) => {
                    tracing::error!(error = %err.into(), "the response body failed while it was read for recording: answered 500");
                    return Err(Failure::BodyFailed);
                }
            };
            return Ok(Recorded::new(
                parts.status,
                parts.headers,
                body,
                &*self.record_header_if,
            ));
        }
        if hint.exact().is_some() {
            self.unrecorded(Unrecorded::TooLarge { limit });
            return Err(Failure::Unkept(response));
        }
        let (parts, body) = response.into_parts();
        let (status, headers) = (parts.status, parts.headers.clone());
        let (tee, ended) = Tee::new(body, limit);
        // If the caller is gone already, the tee is dropped here and hands its body back.
        let _ = early.send(Response::from_parts(parts, tee));
        match body::recorded(ended).await {
            Ok(body) => Ok(Recorded::new(
                status,
                headers,
                body,
                &*self.record_header_if,
            )),
            Err(why) => {
                self.unrecorded(why);
                Err(Failure::Sent)
            }
        }
    }

    /// A response that should have been recorded was not: said loudly.
    fn unrecorded(&self, why: Unrecorded) {
        if self.operation.errors.release {
            tracing::warn!(
                outcome = "unrecorded",
                "{why}: the response was sent unrecorded and its key released, so a retry runs the handler again"
            );
        } else {
            tracing::warn!(
                outcome = "unrecorded",
                "{why}: the response was sent unrecorded; its key completes without it, so a retry gets 410 Gone"
            );
        }
        if let Some(hook) = &self.on_unrecorded {
            hook(&why);
        }
    }
}
