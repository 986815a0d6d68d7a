//! [`IdempotencyService`]: what the layer wraps around a service.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use tower_service::Service;

use super::header;
use super::layer::{Config, KeyScope, ScopeOf};
use super::problem::Problem;
use super::record::{HttpRecord, Recorded};
use crate::{BoxError, Error, Outcome, Store};

/// The body of every response the service gives: the inner service's own (a response
/// passed through, or one not recorded), or a buffered one (recorded, replayed, or a
/// problem).
pub type ResponseBody<B> = Either<B, Full<Bytes>>;

/// The future of [`IdempotencyService`]'s responses.
pub type ResponseFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

/// The service of an [`IdempotencyLayer`](super::IdempotencyLayer) around `S`.
///
/// `S` receives the request with its body as [`ResponseBody`]'s request-side twin: the
/// original body when the request passes through, the buffered one when it is keyed.
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
enum Failure<E, RB> {
    /// Returned as it is, and the key released: a status `record_if` refuses, a body too
    /// large or of unknown length.
    NotRecorded(Response<RB>),
    /// The inner service failed.
    Inner(E),
    /// The response body failed while it was read for recording.
    BodyFailed(String),
    /// The engine answered instead of the handler.
    Idem(Error),
}

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
    let problem = |problem: Problem| Ok(problem.into_response().map(Either::Right));
    if !config.methods.contains(request.method()) {
        return pass(inner, request).await;
    }
    let key = match header::parse(request.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if config.required => return problem(Problem::KeyMissing),
        Ok(None) => return pass(inner, request).await,
        Err(why) => return problem(Problem::KeyMalformed(why)),
    };
    let (mut parts, body) = request.into_parts();
    let scope = match config.scope.of(&parts) {
        ScopeOf::Shared => None,
        ScopeOf::Principal(principal) => Some(principal),
        ScopeOf::Unknown => {
            tracing::debug!("no principal for the key scope: passed through");
            return pass(inner, Request::from_parts(parts, body)).await;
        }
    };

    if body.size_hint().lower() > config.max_body as u64 {
        return problem(Problem::BodyTooLarge(config.max_body));
    }
    let body = match Limited::new(body, config.max_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) if err.is::<LengthLimitError>() => {
            return problem(Problem::BodyTooLarge(config.max_body))
        }
        Err(err) => return problem(Problem::BodyUnreadable(err.to_string())),
    };
    let fingerprint = match (config.fingerprint)(&parts, &body) {
        Ok(fingerprint) => fingerprint,
        Err(err) => return problem(Problem::BodyUnreadable(err.to_string())),
    };
    let derived = match config.operation.key(&(scope.as_deref(), key.as_str())) {
        Ok(derived) => derived,
        Err(err) => return problem(Problem::of(err, config.retry_after)),
    };
    parts.extensions.insert(key);
    let request = Request::from_parts(parts, Either::Right(Full::new(body)));

    let handler = {
        let config = Arc::clone(&config);
        let mut inner = inner;
        async move {
            let response = inner.call(request).await.map_err(Failure::Inner)?;
            config.keep(response).await
        }
    };
    let outcome = config
        .operation
        .run_to_completion_as::<HttpRecord, _, _, _, _>(
            &config.store,
            &derived,
            Some(&fingerprint),
            handler,
        )
        .await;
    match outcome {
        Ok(Outcome::Executed(recorded)) => Ok(recorded.into_response(false).map(Either::Right)),
        Ok(Outcome::Replayed(recorded)) => Ok(recorded.into_response(true).map(Either::Right)),
        Err(Failure::NotRecorded(response)) => Ok(response.map(Either::Left)),
        Err(Failure::Inner(err)) => Err(err),
        Err(Failure::BodyFailed(why)) => problem(Problem::Internal(why)),
        Err(Failure::Idem(err)) => problem(Problem::of(err, config.retry_after)),
    }
}

/// A request the layer does not handle: to the inner service as it is.
async fn pass<S, B, RB>(
    mut inner: S,
    request: Request<B>,
) -> Result<Response<ResponseBody<RB>>, S::Error>
where
    S: Service<Request<Either<B, Full<Bytes>>>, Response = Response<RB>>,
{
    let response = inner.call(request.map(Either::Left)).await?;
    Ok(response.map(Either::Left))
}

impl<St, Sc> Config<St, Sc> {
    /// The response to record, or why it is not one.
    async fn keep<E, RB>(&self, response: Response<RB>) -> Result<Recorded, Failure<E, RB>>
    where
        RB: Body<Data = Bytes>,
        RB::Error: Into<BoxError>,
    {
        if !(self.record_if)(response.status()) {
            return Err(Failure::NotRecorded(response));
        }
        let bounded = response
            .body()
            .size_hint()
            .upper()
            .is_some_and(|len| len <= self.max_recorded_body as u64);
        if !bounded {
            tracing::debug!("the response body is too large or of unknown length: not recorded");
            return Err(Failure::NotRecorded(response));
        }
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|err| {
                Failure::BodyFailed(format!("the response body failed: {}", err.into()))
            })?
            .to_bytes();
        Ok(Recorded::new(parts.status, parts.headers, body))
    }
}
