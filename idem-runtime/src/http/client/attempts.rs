//! What every front end of the client's half shares: which requests get a key, and the
//! loop of attempts (when to send again, when to give up, what the caller learns). The tower
//! layer and the reqwest middleware differ only in how they send one attempt.

use std::future::Future;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use tokio::time::Instant;

use super::{Delivery, Error, Failure, Problem, Retry};
use crate::http::header::{self, IdempotencyKey, IDEMPOTENCY_KEY};
use crate::http::record::IDEMPOTENT_REPLAYED;
use crate::BoxError;

/// The largest problem+json body read from a retried answer.
const MAX_PROBLEM: usize = 16 * 1024;

/// A response, as the loop reads it, whatever client it came from.
pub(super) trait Answer: Sized + Send {
    fn status(&self) -> StatusCode;
    fn headers(&self) -> &HeaderMap;
    fn extensions_mut(&mut self) -> &mut http::Extensions;
    /// The body, if it arrives whole within `limit` bytes.
    fn into_bytes(self, limit: usize) -> impl Future<Output = Option<Bytes>> + Send;
}

/// The tower layer's answers, their bodies boxed. (Not a blanket impl over bodies: the
/// `Into<BoxError>` bound of one, met by a concrete body, fails rustc's check that the
/// layer's future is `Send`.)
impl Answer for http::Response<super::AnswerBody> {
    fn status(&self) -> StatusCode {
        self.status()
    }

    fn headers(&self) -> &HeaderMap {
        self.headers()
    }

    fn extensions_mut(&mut self) -> &mut http::Extensions {
        self.extensions_mut()
    }

    async fn into_bytes(self, limit: usize) -> Option<Bytes> {
        use http_body_util::BodyExt;
        let mut body = self.into_body();
        let mut read = bytes::BytesMut::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.ok()?.into_data() {
                read.extend_from_slice(&data);
                if read.len() > limit {
                    return None;
                }
            }
        }
        Some(read.freeze())
    }
}

/// The key of a request: its own, when it has one (checked as the server checks it: `Err`
/// says why it would be refused); for a method in the config's `methods`, a key derived
/// from the keyed call it is sent in (unless the config says otherwise), or a fresh UUIDv7
/// outside every keyed call, set in `headers`; else `None`, a request the client's half
/// leaves alone.
pub(super) fn assign(
    method: &Method,
    target: &impl std::fmt::Display,
    headers: &mut HeaderMap,
    config: &super::Config,
) -> Result<Option<IdempotencyKey>, &'static str> {
    if let Some(own) = header::parse(headers)? {
        return Ok(Some(own));
    }
    if !config.methods.contains(method) {
        return Ok(None);
    }
    let derived = match config.call_keys {
        true => crate::engine::attempt::request_key(method.as_str(), &target.to_string()),
        false => None,
    };
    let key = match derived {
        Some(derived) => derived.to_hex(),
        None => uuid::Uuid::now_v7().hyphenated().to_string(),
    };
    let value = HeaderValue::try_from(format!("\"{key}\""))
        .expect("a UUID or hex digits are printable ASCII");
    headers.insert(HeaderName::from_static(IDEMPOTENCY_KEY), value);
    Ok(Some(IdempotencyKey::new(key)))
}

/// The attempts of one logical request under its key.
pub(super) struct Attempts<'a> {
    retry: &'a Retry,
    key: IdempotencyKey,
    /// The budget's end; `None`: a budget too long for the clock, no deadline at all.
    deadline: Option<Instant>,
    /// Sends that may have reached the server.
    attempts: u32,
    /// Tries of any kind, refused connections included (for the backoff).
    tries: u32,
    /// The last problem the server explained a retried answer with.
    problem: Option<Problem>,
}

/// What an attempt's outcome means.
pub(super) enum Verdict<R> {
    /// The answer to return, with its [`Delivery`].
    Answer(R),
    /// Send again: the wait before it is over.
    Again,
}

impl<'a> Attempts<'a> {
    /// The attempts of a request keyed `key`, whose budget starts at `started`.
    pub(super) fn new(retry: &'a Retry, key: IdempotencyKey, started: Instant) -> Self {
        Self {
            retry,
            key,
            deadline: started.checked_add(retry.budget),
            attempts: 0,
            tries: 0,
            problem: None,
        }
    }

    /// When the next attempt is cut: its timeout, or the budget's end if that comes first.
    pub(super) fn attempt_deadline(&self) -> Option<Instant> {
        match self.retry.timeout {
            Some(timeout) => earliest(self.deadline, Instant::now().checked_add(timeout)),
            None => self.deadline,
        }
    }

    /// Judges an attempt cut at `attempt_deadline`: what it got (`None`: it timed out).
    /// Returns the answer to hand over, or waits out the backoff and asks for another
    /// attempt, or ends the call with [`Error::GaveUp`].
    pub(super) async fn judge<R: Answer>(
        &mut self,
        sent: Option<Result<R, BoxError>>,
        attempt_deadline: Option<Instant>,
    ) -> Result<Verdict<R>, Error> {
        self.tries += 1;
        let (failure, retry_after) = match sent {
            Some(Ok(mut response)) if !retryable(response.status()) => {
                let replayed = is_replayed(response.headers());
                response.extensions_mut().insert(Delivery {
                    key: self.key.clone(),
                    attempts: self.attempts + 1,
                    replayed,
                });
                return Ok(Verdict::Answer(response));
            }
            Some(Ok(response)) => {
                self.attempts += 1;
                let after = retry_after(response.headers());
                let status = response.status();
                if let Some(explained) = read_problem(response, attempt_deadline).await {
                    self.problem = Some(explained);
                }
                (Failure::Status(status), after)
            }
            Some(Err(error)) => {
                if !refused(&*error) {
                    self.attempts += 1;
                }
                (Failure::Transport(error), None)
            }
            None => {
                self.attempts += 1;
                (Failure::TimedOut, None)
            }
        };
        let now = Instant::now();
        let resume = match (self.attempts < self.retry.attempts)
            .then(|| resume_at(self.retry, self.tries, retry_after, now, self.deadline))
        {
            Some(Some(resume)) => resume,
            _ => return Err(self.give_up(failure)),
        };
        tracing::debug!(
            key = self.key.as_str(),
            attempt = self.attempts,
            failure = %failure,
            wait_ms = resume.saturating_duration_since(now).as_millis() as u64,
            "idempotent request retried"
        );
        tokio::time::sleep_until(resume).await;
        // A busy machine may wake us late. A try that has lost more than half the time it
        // was planned to get is not started: cut before it could connect, it would count as
        // an attempt that may have reached the server, and report `TimedOut` instead of what
        // the server last said.
        if let Some(deadline) = self.deadline {
            let planned = deadline
                .saturating_duration_since(resume)
                .min(last_attempt(self.retry));
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || left < planned / 2 {
                return Err(self.give_up(failure));
            }
        }
        Ok(Verdict::Again)
    }

    fn give_up(&mut self, last: Failure) -> Error {
        Error::GaveUp {
            key: self.key.clone(),
            attempts: self.attempts,
            last,
            problem: self.problem.take(),
        }
    }
}

/// When to send again after try number `tries`, or `None` to give up: after the jittered
/// backoff, and no sooner than the server's `Retry-After`. A `Retry-After` past the deadline
/// gives up (the server will not be ready in time); a backoff that would leave the next try
/// less than [`last_attempt`] is shortened so that one last attempt gets that much.
pub(crate) fn resume_at(
    retry: &Retry,
    tries: u32,
    retry_after: Option<Duration>,
    now: Instant,
    deadline: Option<Instant>,
) -> Option<Instant> {
    let not_before = match retry_after {
        Some(after) => Some(now.checked_add(after)?),
        None => None,
    };
    if let (Some(not_before), Some(deadline)) = (not_before, deadline) {
        if not_before >= deadline {
            return None;
        }
    }
    let backoff = now.checked_add(retry.delay(tries));
    let resume = match (backoff, not_before) {
        (Some(backoff), Some(not_before)) => backoff.max(not_before),
        (Some(backoff), None) => backoff,
        (None, _) => deadline?,
    };
    let Some(deadline) = deadline else {
        return Some(resume);
    };
    if now >= deadline {
        return None;
    }
    // The last attempt's window: a try resumed in it would be cut before it could be
    // answered. Shortened once: the attempt it starts ends inside the window, so a failure
    // of that one gives up instead of spinning at the deadline.
    let start = deadline.checked_sub(last_attempt(retry))?;
    if resume <= start {
        return Some(resume);
    }
    (start > now).then(|| start.max(not_before.unwrap_or(start)))
}

/// What the last attempt of a budget is given at least: a second, or a tenth of the budget,
/// or the per-attempt timeout, whichever is least.
fn last_attempt(retry: &Retry) -> Duration {
    const AT_MOST: Duration = Duration::from_secs(1);
    AT_MOST
        .min(retry.budget / 10)
        .min(retry.timeout.unwrap_or(AT_MOST))
}

/// `future`'s output, or `None` if `deadline` passed first (never, without a deadline).
pub(crate) async fn within<F: Future>(deadline: Option<Instant>, future: F) -> Option<F::Output> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, future).await.ok(),
        None => Some(future.await),
    }
}

/// The earlier of two deadlines, either of which may be absent.
pub(crate) fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Whether the connection was refused: the request never left, and a server that is
/// restarting refuses until it is back.
fn refused(error: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(error), |error| error.source()).any(|error| {
        error
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}

/// The problem a retried answer explains itself with, when it is `application/problem+json`
/// and arrives whole, in time and within [`MAX_PROBLEM`] bytes.
async fn read_problem<R: Answer>(response: R, deadline: Option<Instant>) -> Option<Problem> {
    let is_problem = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.trim_start().starts_with("application/problem+json"));
    if !is_problem {
        return None;
    }
    let bytes = within(deadline, response.into_bytes(MAX_PROBLEM)).await??;
    let json: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let text = |member: &str| json.get(member)?.as_str().map(str::to_owned);
    Some(Problem {
        kind: text("type"),
        title: text("title"),
        status: json
            .get("status")
            .and_then(serde_json::Value::as_u64)
            .and_then(|status| u16::try_from(status).ok()),
        detail: text("detail"),
    })
}

/// The answers worth another attempt: the key's first request still runs (`409`), the
/// server sheds load (`429`, `503`), or a gateway lost the server (`502`, `504`).
pub(super) fn retryable(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::CONFLICT
            | StatusCode::TOO_MANY_REQUESTS
            | StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT
    )
}

fn is_replayed(headers: &HeaderMap) -> bool {
    headers
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|value| value.as_bytes().trim_ascii().eq_ignore_ascii_case(b"true"))
}

/// `Retry-After` as delay-seconds or an HTTP date (RFC 9110 §10.2.3); an unreadable value
/// counts as absent.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(
        date.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_retries_exactly_what_the_layer_answers_for_a_transient_error() {
        let errors = [
            crate::Error::InProgress,
            crate::Error::PayloadMismatch,
            crate::Error::Gone,
            crate::Error::store("down"),
            crate::Error::codec("truncated"),
            crate::Error::Key("NaN".into()),
            crate::Error::config("too long"),
            crate::Error::Unrecorded("lost".into()),
        ];
        for err in errors {
            let answer = crate::http::problem(&err);
            assert_eq!(retryable(answer.status()), err.is_transient(), "{err}");
            assert_eq!(
                answer.headers().contains_key(http::header::RETRY_AFTER),
                err.is_transient(),
                "{err}"
            );
        }
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let mut headers = HeaderMap::new();
        assert_eq!(retry_after(&headers), None);
        headers.insert(RETRY_AFTER, HeaderValue::from_static("3"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(3)));
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
        headers.insert(RETRY_AFTER, HeaderValue::try_from(later).unwrap());
        let wait = retry_after(&headers).unwrap();
        assert!(
            wait > Duration::from_secs(100) && wait <= Duration::from_secs(120),
            "{wait:?}"
        );
        headers.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&headers), Some(Duration::ZERO));
        headers.insert(RETRY_AFTER, HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&headers), None);
    }

    /// Every try is left the last attempt's share of the budget: a backoff that would start
    /// one later is shortened, and once inside that window the call gives up.
    #[test]
    fn every_try_gets_the_last_attempts_share_of_the_budget() {
        let retry = Retry::new()
            .budget(Duration::from_millis(200))
            .backoff(Duration::from_millis(1), Duration::from_millis(5));
        let share = last_attempt(&retry);
        assert_eq!(share, Duration::from_millis(20));
        let deadline = Instant::now() + Duration::from_secs(1);
        for left in 0..400u64 {
            let now = deadline - Duration::from_micros(left * 100);
            for tries in 1..12 {
                match resume_at(&retry, tries, None, now, Some(deadline)) {
                    Some(resume) => {
                        assert!(resume >= now, "{left} {tries}");
                        assert!(deadline - resume >= share, "{left} {tries}");
                    }
                    None => assert!(deadline - now <= share, "gave up early: {left} {tries}"),
                }
            }
        }
    }

    #[test]
    fn only_the_documented_answers_are_retried() {
        for code in [409, 429, 502, 503, 504] {
            assert!(retryable(StatusCode::from_u16(code).unwrap()), "{code}");
        }
        for code in [200, 201, 400, 401, 403, 404, 422, 500] {
            assert!(!retryable(StatusCode::from_u16(code).unwrap()), "{code}");
        }
    }
}
