//! The client's half (feature `client`): a tower layer for outgoing requests that gives each
//! logical request one `Idempotency-Key`, resends that key on every retry, and retries only
//! what is safe to retry.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use idem_runtime::http::client::{Delivery, IdempotencyKeyLayer, Retry};
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! let hyper_client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let client = ServiceBuilder::new()
//!     .layer(IdempotencyKeyLayer::new().retry(Retry::new().attempts(6).budget(Duration::from_secs(30))))
//!     .service(hyper_client);
//!
//! let request = http::Request::post("http://127.0.0.1:3000/payments")
//!     .header("content-type", "application/json")
//!     .body(Full::<Bytes>::from(r#"{"amount":1000}"#))?;
//! let response = client.oneshot(request).await?; // Err(..) once the budget is spent
//! if let Some(delivery) = response.extensions().get::<Delivery>() {
//!     // "key 0193… after 2 attempt(s), replayed": the first answer was lost on the way.
//!     tracing::info!(%delivery, "payment created");
//! }
//! # Ok(()) }
//! ```
//!
//! What a request gets:
//!
//! | request or answer | what the layer does |
//! |---|---|
//! | a method in the set (default `POST`, `PATCH`, see [`methods`](IdempotencyKeyLayer::methods)) without `Idempotency-Key`, inside a keyed call | adds a key derived from the call (its key, the method, the URI, the request's occurrence in the body: [`keys_from_calls`](IdempotencyKeyLayer::keys_from_calls)), the same on every attempt and redelivery of the call |
//! | the same, outside every keyed call | adds a fresh UUIDv7, quoted as a structured-field string, used for this request only |
//! | any request with `Idempotency-Key` | keeps the caller's key, and is retried like a `POST` |
//! | a method outside the set, without a key | sent once, untouched (no key, no retry, no [`Delivery`]) |
//! | a malformed `Idempotency-Key` (the server's rules) | [`Error::KeyMalformed`]; nothing is sent |
//! | a body over [`max_body`](IdempotencyKeyLayer::max_body) (default 1 MiB) | [`Error::BodyTooLarge`]; nothing is sent |
//! | a request body that does not arrive within the [budget](Retry::budget) | [`Error::BodyTimedOut`]; nothing is sent |
//! | a refused connection (nothing was sent) | retried until the budget is spent, without counting against [`attempts`](Retry::attempts) |
//! | any other error of the inner service, or an attempt over [`Retry::timeout`] (10 s by default) | retried |
//! | `409`, `429`, `502`, `503`, `504` | retried, no sooner than their `Retry-After` |
//! | any other answer (`2xx`, `400`, `401`, `403`, `404`, `422`, `500`, …) | read whole (up to [`max_answer`](IdempotencyKeyLayer::max_answer)), then returned, with a [`Delivery`] extension; a body cut before its end is retried |
//! | attempts or [budget](Retry::budget) spent, or a `Retry-After` beyond the budget | [`Error::GaveUp`], with the key, the attempts, the last failure and the last problem the server explained it with |
//!
//! Every retry of a request sends the same method, URI, headers and body bytes, so the
//! server's fingerprint matches and it replays the first answer instead of running again.
//! An error of the inner service is retried whatever it is: with the key, resending a request
//! the server may have processed is safe, which is the point of the key.
//!
//! # Recovering from a server crash
//!
//! The defaults are sized against the server's: a server's claim on a key whose holder
//! crashed lapses within its lease (8 s by default, `idem_runtime::DEFAULT_LEASE`), and a
//! `409` for a held key carries a `Retry-After` of the time the lease has left. [`Retry::new`]
//! spends up to 30 s, cuts each attempt at 10 s, and does not count refused connections
//! (a restarting server) against its attempts, so a request whose server was killed
//! mid-request and restarted is retried until the server runs it, or replays it. A budget
//! shorter than the server's lease plus its restart time cannot outlast a crash: see
//! [`guide::leases`](crate::guide::leases).
//!
//! # Where timeouts and retries may sit
//!
//! The key lives for one call of this layer: every retry *inside* it resends it. So:
//! - **per-attempt timeouts** go inside, with [`Retry::timeout`] or a timeout layer between
//!   this layer and the client;
//! - **a timeout or a retry around this layer** (a `tower::timeout` above it, or your own
//!   loop calling it again) starts a new logical request with a new key, which the server
//!   runs again. To retry above the layer, give the request its own `Idempotency-Key`
//!   (kept as it is, see the table), or resend [`Delivery::key`].
//! - An answer is read whole before it is handed over (up to
//!   [`max_answer`](IdempotencyKeyLayer::max_answer), 1 MiB by default): one whose body is
//!   cut after its headers is a failed attempt, retried with the same key within the budget,
//!   and the server replays it. A larger answer, or any with
//!   [`stream_answers`](IdempotencyKeyLayer::stream_answers), is handed over as it arrives:
//!   a cut then reaches the caller, who resends the request with [`Delivery::key`].
//!
//! # Which clients
//!
//! The layer speaks `http` types: it wraps any `tower::Service<http::Request<Full<Bytes>>>`
//! that is `Clone` — hyper-util's `Client`, a `tower::ServiceBuilder` stack around it, or an
//! in-process service in tests. That is the client tower, axum and hyper users already have,
//! and it keeps every retry inside one layer a stack can put where it wants (under a
//! timeout, above tracing).
//!
//! reqwest users extend their client with `reqwest-middleware`: with the feature `reqwest`,
//! `IdempotencyKeyMiddleware` is the same keys, retries, errors and [`Delivery`] as a
//! middleware, through the same loop of attempts (the two differ only in how one attempt
//! is sent). Both pass the same end-to-end test: 1000 payments through a proxy that loses
//! answers, cuts, refuses and stalls, each run once (`tests/client/network.rs`).

use std::collections::hash_map::RandomState;
use std::fmt;
use std::future::{poll_fn, Future};
use std::hash::{BuildHasher, Hasher};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

#[cfg(feature = "tonic")]
pub(crate) use self::attempts::{earliest, resume_at, within};
use self::attempts::{Attempts, Verdict};
use super::header::IdempotencyKey;
use crate::BoxError;

mod answer;
mod attempts;
pub use self::answer::AnswerBody;
#[cfg(feature = "reqwest")]
mod reqwest;
#[cfg(feature = "reqwest")]
pub use self::reqwest::IdempotencyKeyMiddleware;

/// The request body the layer buffers by default, in bytes (1 MiB, the server's default).
pub const DEFAULT_MAX_BODY: usize = 1024 * 1024;

/// The answer body the layer reads before it hands the answer over, by default, in bytes
/// (1 MiB, the largest response the server's layer records by default).
pub const DEFAULT_MAX_ANSWER: usize = 1024 * 1024;

/// How a request is retried: at most [`attempts`](Retry::attempts) sends within a total
/// [`budget`](Retry::budget) of time, waiting a jittered exponential backoff between them.
///
/// No duration overflows: a budget, backoff or `Retry-After` too large for the clock means
/// "no deadline" or "beyond the budget", never a panic.
#[derive(Clone, Debug)]
pub struct Retry {
    attempts: u32,
    budget: Duration,
    first_delay: Duration,
    max_delay: Duration,
    timeout: Option<Duration>,
}

impl Retry {
    /// As many attempts as fit in 30 s; backoff from 100 ms up to 5 s; each attempt cut at
    /// 10 s. The budget outlasts a server's default crash recovery (its 8 s lease and a
    /// restart); see the [module](self).
    pub fn new() -> Self {
        Self {
            attempts: u32::MAX,
            budget: Duration::from_secs(30),
            first_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            timeout: Some(Duration::from_secs(10)),
        }
    }

    /// Sends a request once: the key is still added, nothing is retried.
    pub fn never() -> Self {
        Self::new().attempts(1)
    }

    /// The most sends of one request, the first included (at least 1; by default, as many
    /// as the budget allows). A connection the server refused sent nothing and does not
    /// count: a restarting server cannot spend the attempts before it is back.
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts.max(1);
        self
    }

    /// The most time one request may take, reading its body, every attempt and wait
    /// included. An attempt still running when it is spent is cut, and the call fails with
    /// [`Error::GaveUp`]. Every attempt is left at least a second, a tenth of the budget or
    /// the per-attempt timeout, whichever is least: a backoff that would leave less is
    /// shortened once, and a retry that a busy machine wakes too late for is not sent (the
    /// call gives up with what the server last said).
    pub fn budget(mut self, budget: Duration) -> Self {
        self.budget = budget;
        self
    }

    /// The backoff: the wait before the `n`-th retry is drawn uniformly from zero to
    /// `first × 2ⁿ⁻¹`, capped at `max` ("full jitter", so that clients that failed together
    /// do not retry together).
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.first_delay = first;
        self.max_delay = max.max(first);
        self
    }

    /// The most time one attempt may take (default 10 s); a slower one is abandoned and
    /// retried.
    pub fn timeout(mut self, per_attempt: Duration) -> Self {
        self.timeout = Some(per_attempt);
        self
    }

    /// No per-attempt timeout: only the budget cuts an attempt.
    pub fn no_timeout(mut self) -> Self {
        self.timeout = None;
        self
    }

    /// The jittered wait before retry number `retry` (1 for the first).
    /// The most sends of one request.
    #[cfg(feature = "tonic")]
    pub(crate) fn attempts_of(&self) -> u32 {
        self.attempts
    }

    /// The most time one request may take.
    #[cfg(feature = "tonic")]
    pub(crate) fn budget_of(&self) -> Duration {
        self.budget
    }

    /// When one attempt is cut.
    #[cfg(feature = "tonic")]
    pub(crate) fn timeout_of(&self) -> Option<Duration> {
        self.timeout
    }

    fn delay(&self, retry: u32) -> Duration {
        let doubling = 2u32.saturating_pow(retry.saturating_sub(1));
        let ceiling = self
            .first_delay
            .saturating_mul(doubling)
            .min(self.max_delay);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        match nanos.checked_add(1) {
            Some(span) => Duration::from_nanos(random() % span),
            None => ceiling,
        }
    }
}

impl Default for Retry {
    fn default() -> Self {
        Self::new()
    }
}

/// A uniformly random `u64` from std's per-process random hash keys: enough for jitter,
/// without a random-number crate.
fn random() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(0);
    hasher.finish()
}

/// Adds an `Idempotency-Key` to outgoing requests and retries them safely; see the
/// [module](self).
#[derive(Clone, Debug)]
pub struct IdempotencyKeyLayer {
    config: Arc<Config>,
}

#[derive(Clone, Debug)]
struct Config {
    retry: Retry,
    methods: Vec<Method>,
    max_body: usize,
    /// `None`: answers are streamed as they come ([`IdempotencyKeyLayer::stream_answers`]).
    max_answer: Option<usize>,
    /// Whether a request without a key, sent inside a keyed call, takes one derived from
    /// the call's key ([`IdempotencyKeyLayer::keys_from_calls`]).
    call_keys: bool,
}

impl IdempotencyKeyLayer {
    /// Keys for `POST` and `PATCH`, [`Retry::new()`], bodies up to [`DEFAULT_MAX_BODY`].
    pub fn new() -> Self {
        Self {
            config: Arc::new(Config {
                retry: Retry::new(),
                methods: vec![Method::POST, Method::PATCH],
                max_body: DEFAULT_MAX_BODY,
                max_answer: Some(DEFAULT_MAX_ANSWER),
                call_keys: true,
            }),
        }
    }

    /// How requests are retried.
    pub fn retry(mut self, retry: Retry) -> Self {
        Arc::make_mut(&mut self.config).retry = retry;
        self
    }

    /// The methods that get a key when they have none (default `POST`, `PATCH`). A request
    /// of another method is sent once, untouched, unless it carries its own key.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        Arc::make_mut(&mut self.config).methods = methods.into_iter().collect();
        self
    }

    /// The largest request body buffered for resending, in bytes; a larger one fails with
    /// [`Error::BodyTooLarge`] before anything is sent.
    pub fn max_body(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.config).max_body = bytes;
        self
    }

    /// The largest answer body read before the answer is handed over, in bytes (default
    /// [`DEFAULT_MAX_ANSWER`]). An answer is read whole first, so that one whose body is
    /// cut after its headers (a connection lost mid-answer) is retried with the same key
    /// within the budget, and the server replays it, instead of reaching the caller broken.
    /// A larger answer is handed over with what was read and the rest as it arrives: a cut
    /// past the limit reaches the caller, who resends [`Delivery::key`].
    pub fn max_answer(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.config).max_answer = Some(bytes);
        self
    }

    /// Hands answers over as they arrive, without reading them first (for streamed
    /// answers): a body cut after its headers then reaches the caller, who resends
    /// [`Delivery::key`] to learn the recorded answer.
    pub fn stream_answers(mut self) -> Self {
        Arc::make_mut(&mut self.config).max_answer = None;
        self
    }

    /// Whether a request sent without a key of its own inside a keyed call (the body of an
    /// `#[idempotent]` function, of `Operation::run`, of a consumer's handler, an HTTP
    /// handler behind the idempotency layer, or a [`step`](crate::step()) of one) takes a
    /// key derived from that call: from the call's (or step's) key, the request's method
    /// and target (its URI), and its occurrence (the first such request of a body is 0, the
    /// next of the same method and target 1, …), in hex. Every attempt of the call, and
    /// every redelivery of the message it handles, then sends each request under the same
    /// key, so the next service dedupes it across crashes of this one; two requests of one
    /// body go under two keys. On by default; `false` gives every request without a key a
    /// fresh UUIDv7, as a request outside every keyed call always gets. A body must send
    /// its requests in the same order on every attempt, as it creates its steps; a target
    /// that changes between attempts (a timestamp in the query) gets a new key.
    pub fn keys_from_calls(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.config).call_keys = on;
        self
    }

    /// The former name of [`keys_from_calls`](Self::keys_from_calls), which now derives a
    /// key inside any keyed call, not only inside a step.
    #[deprecated(
        note = "renamed `keys_from_calls`: a request inside any keyed call, not only a step, takes a derived key"
    )]
    pub fn step_keys(self, on: bool) -> Self {
        self.keys_from_calls(on)
    }
}

impl Default for IdempotencyKeyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for IdempotencyKeyLayer {
    type Service = IdempotencyKeyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyKeyService {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// The service of an [`IdempotencyKeyLayer`].
#[derive(Clone, Debug)]
pub struct IdempotencyKeyService<S> {
    inner: S,
    config: Arc<Config>,
}

/// How one logical request was delivered: a response extension of every request the layer
/// keyed (`response.extensions().get::<Delivery>()`).
#[derive(Clone, Debug)]
pub struct Delivery {
    key: IdempotencyKey,
    attempts: u32,
    replayed: bool,
}

impl Delivery {
    /// The request's key (unquoted), the same on every attempt.
    pub fn key(&self) -> &str {
        self.key.as_str()
    }

    /// How many times the request was sent, the first included.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the server answered with a recorded response (`Idempotent-Replayed: true`):
    /// an earlier attempt was processed, and its answer is this one.
    pub fn replayed(&self) -> bool {
        self.replayed
    }
}

/// Why a request got no response.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request body is larger than the layer buffers; nothing was sent.
    #[error("the request body is over the {limit}-byte limit buffered for retries; raise `max_body` or send less")]
    BodyTooLarge {
        /// The limit, [`IdempotencyKeyLayer::max_body`].
        limit: usize,
    },
    /// The request body failed while it was read; nothing was sent.
    #[error("the request body could not be read")]
    Body(#[source] BoxError),
    /// The request body did not arrive within the budget; nothing was sent.
    #[error("the request body did not arrive within the {budget:?} budget; nothing was sent")]
    BodyTimedOut {
        /// The budget, [`Retry::budget`].
        budget: Duration,
    },
    /// The request body is a stream, which cannot be resent (reqwest's `Body::wrap_stream`);
    /// nothing was sent. Give a keyed request its body as bytes.
    #[error("the request body is a stream, which cannot be resent on a retry; give it as bytes")]
    BodyNotReplayable,
    /// The request's own `Idempotency-Key` would be refused by the server; nothing was sent.
    #[error("the request's `Idempotency-Key` is malformed: {0}")]
    KeyMalformed(&'static str),
    /// Every attempt the budget allowed failed in a way worth retrying. The server may have
    /// processed the request: retry later **with the same key** to learn its outcome.
    ///
    /// Its `Display` says what gave up; the last failure is its
    /// [`source`](std::error::Error::source), printed by error reporters that walk the chain
    /// (`anyhow`'s `{:#}`), never twice.
    #[error("gave up on the request with key `{}` after {attempts} attempt(s)", key.as_str())]
    GaveUp {
        /// The request's key.
        key: IdempotencyKey,
        /// How many times it was sent (refused connections, which sent nothing, aside).
        attempts: u32,
        /// What the last attempt got.
        #[source]
        last: Failure,
        /// The last `application/problem+json` answer's `type`, `title` and `detail`, if
        /// the server explained a retried answer with one.
        problem: Option<Problem>,
    },
    /// A request the layer does not manage (a method outside the set, without a key)
    /// failed in the inner service.
    #[error("the request failed")]
    Service(#[source] BoxError),
}

/// What a retried attempt got.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Failure {
    /// An answer worth retrying: `409`, `429`, `502`, `503` or `504`.
    #[error("the server answered {0}")]
    Status(StatusCode),
    /// The inner service failed: a connection refused or cut, a protocol error.
    #[error("no answer from the server")]
    Transport(#[source] BoxError),
    /// The attempt took longer than [`Retry::timeout`] or than the budget had left.
    #[error("the attempt timed out")]
    TimedOut,
}

/// An RFC 9457 problem a server explained a retried answer with
/// (`application/problem+json`): its `type`, `title`, `status` and `detail` members.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// `type`: a URI naming the kind of problem.
    pub kind: Option<String>,
    /// `title`: its short summary.
    pub title: Option<String>,
    /// `status`: the HTTP status the server meant.
    pub status: Option<u16>,
    /// `detail`: what happened to this request.
    pub detail: Option<String>,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = [self.title.as_deref(), self.detail.as_deref()]
            .into_iter()
            .flatten();
        match (parts.next(), parts.next()) {
            (Some(first), Some(second)) => write!(f, "{first}: {second}"),
            (Some(only), None) => f.write_str(only),
            _ => f.write_str(self.kind.as_deref().unwrap_or("a problem")),
        }
    }
}

impl<S, B, ResBody> Service<Request<B>> for IdempotencyKeyService<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<AnswerBody>;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<AnswerBody>, Error>> + Send>>;

    /// Always ready: each attempt waits for a clone of the inner service to be ready.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        Box::pin(deliver(
            self.inner.clone(),
            Arc::clone(&self.config),
            request,
        ))
    }
}

async fn deliver<S, B, ResBody>(
    mut inner: S,
    config: Arc<Config>,
    request: Request<B>,
) -> Result<Response<AnswerBody>, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError>,
{
    let started = Instant::now();
    let retry = &config.retry;
    let (mut parts, body) = request.into_parts();
    let key = attempts::assign(&parts.method, &parts.uri, &mut parts.headers, &config)
        .map_err(Error::KeyMalformed)?;
    let body = attempts::within(
        started.checked_add(retry.budget),
        buffer(body, config.max_body),
    )
    .await
    .ok_or(Error::BodyTimedOut {
        budget: retry.budget,
    })??;
    let Some(key) = key else {
        let request = Request::from_parts(parts, Full::new(body));
        return send(&mut inner, request)
            .await
            .map(|response| response.map(answer::streamed))
            .map_err(|error| Error::Service(error.into()));
    };
    let mut attempts = Attempts::new(retry, key, started);
    loop {
        let attempt_deadline = attempts.attempt_deadline();
        let request = Request::from_parts(parts.clone(), Full::new(body.clone()));
        let sent = attempts::within(attempt_deadline, async {
            let response = match send(&mut inner, request).await {
                Ok(response) => response,
                Err(error) => {
                    let error: BoxError = error.into();
                    return Err(error);
                }
            };
            read_answer(response, config.max_answer).await
        })
        .await;
        if let Verdict::Answer(response) = attempts.judge(sent, attempt_deadline).await? {
            return Ok(response);
        }
    }
}

/// One attempt: waits for the service to be ready, then calls it.
async fn send<S, ResBody>(
    inner: &mut S,
    request: Request<Full<Bytes>>,
) -> Result<Response<ResBody>, S::Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
{
    poll_fn(|cx| inner.poll_ready(cx)).await?;
    inner.call(request).await
}

/// `response`, its body read whole first if the layer hands it over (not a status it
/// retries) and reads answers: `Err` when the body was cut, an attempt to retry.
async fn read_answer<ResBody>(
    response: Response<ResBody>,
    limit: Option<usize>,
) -> Result<Response<AnswerBody>, BoxError>
where
    ResBody: Body + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let limit = limit.filter(|_| !attempts::retryable(response.status()));
    let (parts, body) = response.into_parts();
    let body = match limit {
        Some(limit) => match answer::read(body, limit).await {
            Ok(read) => read.into_body(),
            Err(cut) => return Err(cut),
        },
        None => answer::streamed(body),
    };
    Ok(Response::from_parts(parts, body))
}

async fn buffer<B>(body: B, limit: usize) -> Result<Bytes, Error>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => Err(Error::BodyTooLarge { limit }),
        Err(error) => Err(Error::Body(error)),
    }
}

impl fmt::Display for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "key {} after {} attempt(s){}",
            self.key.as_str(),
            self.attempts,
            if self.replayed { ", replayed" } else { "" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_jittered_below_a_doubling_capped_ceiling() {
        let retry = Retry::new().backoff(Duration::from_millis(100), Duration::from_millis(350));
        for _ in 0..200 {
            assert!(retry.delay(1) <= Duration::from_millis(100));
            assert!(retry.delay(2) <= Duration::from_millis(200));
            assert!(retry.delay(3) <= Duration::from_millis(350));
            assert!(retry.delay(40) <= Duration::from_millis(350));
        }
        let draws: std::collections::HashSet<_> = (0..50).map(|_| retry.delay(3)).collect();
        assert!(draws.len() > 40, "the wait is drawn, not fixed: {draws:?}");
    }
}
