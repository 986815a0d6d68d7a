//! The client's half for reqwest: a `reqwest-middleware` middleware with the tower layer's
//! keys, retries and [`Delivery`](super::Delivery), through the same loop of attempts.

use std::sync::Arc;

use reqwest_middleware::{Middleware, Next};
use tokio::time::Instant;

use super::attempts::{self, Answer, Attempts, Verdict};
use super::{Config, Error, IdempotencyKeyLayer, Retry};
use crate::BoxError;

/// Adds an `Idempotency-Key` to the requests of a `reqwest_middleware::ClientWithMiddleware`
/// and retries them safely: the keys, retries, errors and [`Delivery`](super::Delivery) of
/// [`IdempotencyKeyLayer`], for reqwest.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use std::time::Duration;
/// use idem_runtime::http::client::{Delivery, IdempotencyKeyMiddleware, Retry};
///
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotencyKeyMiddleware::new().retry(Retry::new().budget(Duration::from_secs(30))))
///     .build();
/// let response = client
///     .post("http://127.0.0.1:3000/payments")
///     .header("content-type", "application/json")
///     .body(r#"{"amount":1000}"#)
///     .send()
///     .await?; // Err(..) once the budget is spent: an `idem_runtime::http::client::Error`
/// if let Some(delivery) = response.extensions().get::<Delivery>() {
///     println!("{delivery}");
/// }
/// # Ok(()) }
/// ```
///
/// A request whose body is a stream cannot be resent: a keyed one fails with
/// [`Error::BodyNotReplayable`] before anything is sent. The layer's errors reach the caller
/// as `reqwest_middleware::Error::Middleware`, whose `downcast_ref::<Error>()` is the typed
/// error. Put the middleware first in the chain (`with` it before the others): a middleware
/// before it that retries would start a new logical request with a new key.
#[derive(Clone, Debug)]
pub struct IdempotencyKeyMiddleware {
    config: Arc<Config>,
}

impl IdempotencyKeyMiddleware {
    /// Keys for `POST` and `PATCH`, [`Retry::new()`], bodies up to
    /// [`DEFAULT_MAX_BODY`](super::DEFAULT_MAX_BODY); as [`IdempotencyKeyLayer::new`].
    pub fn new() -> Self {
        IdempotencyKeyLayer::new().into()
    }

    /// How requests are retried.
    pub fn retry(self, retry: Retry) -> Self {
        IdempotencyKeyLayer::from(self).retry(retry).into()
    }

    /// The methods that get a key when they have none (default `POST`, `PATCH`); see
    /// [`IdempotencyKeyLayer::methods`].
    pub fn methods(self, methods: impl IntoIterator<Item = http::Method>) -> Self {
        IdempotencyKeyLayer::from(self).methods(methods).into()
    }

    /// The largest request body sent, in bytes; a larger keyed one fails with
    /// [`Error::BodyTooLarge`] before anything is sent.
    pub fn max_body(self, bytes: usize) -> Self {
        IdempotencyKeyLayer::from(self).max_body(bytes).into()
    }

    /// The largest answer body read before the answer is handed over, in bytes; see
    /// [`IdempotencyKeyLayer::max_answer`].
    pub fn max_answer(self, bytes: usize) -> Self {
        IdempotencyKeyLayer::from(self).max_answer(bytes).into()
    }

    /// Hands answers over as they arrive, without reading them first; see
    /// [`IdempotencyKeyLayer::stream_answers`].
    pub fn stream_answers(self) -> Self {
        IdempotencyKeyLayer::from(self).stream_answers().into()
    }

    /// Whether a request sent without a key of its own inside a keyed call takes a key
    /// derived from the call (on by default); see [`IdempotencyKeyLayer::keys_from_calls`].
    pub fn keys_from_calls(self, on: bool) -> Self {
        IdempotencyKeyLayer::from(self).keys_from_calls(on).into()
    }

    /// The former name of [`keys_from_calls`](Self::keys_from_calls).
    #[deprecated(
        note = "renamed `keys_from_calls`: a request inside any keyed call, not only a step, takes a derived key"
    )]
    pub fn step_keys(self, on: bool) -> Self {
        self.keys_from_calls(on)
    }
}

impl Default for IdempotencyKeyMiddleware {
    fn default() -> Self {
        Self::new()
    }
}

/// The same keys and retries, as a middleware.
impl From<IdempotencyKeyLayer> for IdempotencyKeyMiddleware {
    fn from(layer: IdempotencyKeyLayer) -> Self {
        Self {
            config: layer.config,
        }
    }
}

impl From<IdempotencyKeyMiddleware> for IdempotencyKeyLayer {
    fn from(middleware: IdempotencyKeyMiddleware) -> Self {
        Self {
            config: middleware.config,
        }
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotencyKeyMiddleware {
    async fn handle(
        &self,
        mut request: reqwest::Request,
        extensions: &mut http::Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let started = Instant::now();
        let config = &self.config;
        let method = request.method().clone();
        let target = request.url().clone();
        let key = attempts::assign(&method, &target, request.headers_mut(), config)
            .map_err(|why| reqwest_middleware::Error::middleware(Error::KeyMalformed(why)))?;
        let Some(key) = key else {
            return next.run(request, extensions).await;
        };
        if let Some(body) = request.body() {
            match body.as_bytes() {
                Some(bytes) if bytes.len() > config.max_body => {
                    return Err(reqwest_middleware::Error::middleware(Error::BodyTooLarge {
                        limit: config.max_body,
                    }))
                }
                Some(_) => {}
                None => {
                    return Err(reqwest_middleware::Error::middleware(
                        Error::BodyNotReplayable,
                    ))
                }
            }
        }
        let mut attempts = Attempts::new(&config.retry, key, started);
        loop {
            let attempt_deadline = attempts.attempt_deadline();
            let resent = request
                .try_clone()
                .expect("a request whose body is bytes clones");
            let sent = attempts::within(attempt_deadline, async {
                let response = match next.clone().run(resent, extensions).await {
                    Ok(response) => response,
                    Err(error) => return Err(unwrapped(error)),
                };
                read_answer(response, config.max_answer).await
            })
            .await;
            match attempts.judge(sent, attempt_deadline).await {
                Ok(Verdict::Answer(response)) => return Ok(response),
                Ok(Verdict::Again) => {}
                Err(error) => return Err(reqwest_middleware::Error::middleware(error)),
            }
        }
    }
}

/// `response`, its body read whole first if the middleware hands it over (not a status it
/// retries) and reads answers: `Err` when the body was cut, an attempt to retry.
async fn read_answer(
    response: reqwest::Response,
    limit: Option<usize>,
) -> Result<reqwest::Response, BoxError> {
    use reqwest::ResponseBuilderExt;

    use super::answer::{self, Prefixed, Read};

    let Some(limit) = limit.filter(|_| !attempts::retryable(response.status())) else {
        return Ok(response);
    };
    let url = response.url().clone();
    let (mut parts, body) = http::Response::<reqwest::Body>::from(response).into_parts();
    let body = match answer::read(body, limit).await {
        Ok(Read::Whole(bytes)) => reqwest::Body::from(bytes),
        Ok(Read::Over(read, rest)) => reqwest::Body::wrap(Prefixed::new(read, rest)),
        Err(cut) => return Err(cut),
    };
    // The URL reqwest reports travels in the response's extensions.
    let located = http::Response::builder()
        .url(url)
        .body(())
        .expect("a response of no parts but its URL");
    parts.extensions.extend(located.into_parts().0.extensions);
    Ok(reqwest::Response::from(http::Response::from_parts(
        parts, body,
    )))
}

/// The error under a middleware chain's own, so that a refused connection is seen as one.
fn unwrapped(error: reqwest_middleware::Error) -> BoxError {
    match error {
        reqwest_middleware::Error::Reqwest(error) => Box::new(error),
        reqwest_middleware::Error::Middleware(error) => error.into(),
    }
}

impl Answer for reqwest::Response {
    fn status(&self) -> http::StatusCode {
        self.status()
    }

    fn headers(&self) -> &http::HeaderMap {
        self.headers()
    }

    fn extensions_mut(&mut self) -> &mut http::Extensions {
        self.extensions_mut()
    }

    async fn into_bytes(mut self, limit: usize) -> Option<bytes::Bytes> {
        let mut body = Vec::new();
        while let Some(chunk) = self.chunk().await.ok()? {
            if body.len() + chunk.len() > limit {
                return None;
            }
            body.extend_from_slice(&chunk);
        }
        Some(body.into())
    }
}
