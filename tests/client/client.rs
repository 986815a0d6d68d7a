//! The client's half: `IdempotencyKeyLayer` in front of an in-process service that answers
//! from a script (what is retried, with which key and body). End to end over real sockets:
//! `network.rs`.
//!
//! Over the suite's 600 lines for a reason: one scripted service answers every test here, each
//! a row of what is retried; the network's own tests are `network.rs`.

#[path = "support.rs"]
mod client_support;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use client_support::{delivery, fast};
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use idem_runtime::http::client::{Delivery, Error, Failure, IdempotencyKeyLayer, Retry};
use idem_runtime::BoxError;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

/// What the scripted service answers, attempt by attempt.
#[derive(Clone)]
enum Step {
    Answer(u16, &'static [(&'static str, &'static str)]),
    Fail,
    /// The connection is refused: nothing reaches the server.
    Refuse,
    /// An `application/problem+json` answer with this status and body.
    Problem(u16, &'static str),
    Hang,
}

/// What one attempt carried.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    key: Option<String>,
    body: Bytes,
}

#[derive(Clone, Default)]
struct Script {
    steps: Arc<Mutex<VecDeque<Step>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Script {
    fn new(steps: impl IntoIterator<Item = Step>) -> Self {
        let script = Self::default();
        script.steps.lock().unwrap().extend(steps);
        script
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// A service that records each request and answers with the next step (`200` once the
    /// script is spent).
    fn service(
        &self,
    ) -> impl Service<
        Request<Full<Bytes>>,
        Response = Response<Full<Bytes>>,
        Error = BoxError,
        Future = impl Send,
    > + Clone
           + Send
           + 'static {
        let script = self.clone();
        tower::service_fn(move |request: Request<Full<Bytes>>| {
            let script = script.clone();
            async move {
                let (parts, body) = request.into_parts();
                let body = body.collect().await?.to_bytes();
                script.seen.lock().unwrap().push(Seen {
                    method: parts.method,
                    key: parts
                        .headers
                        .get("idempotency-key")
                        .map(|key| key.to_str().unwrap().to_string()),
                    body,
                });
                let step = script.steps.lock().unwrap().pop_front();
                match step.unwrap_or(Step::Answer(200, &[])) {
                    Step::Answer(status, headers) => {
                        let mut response = Response::builder().status(status);
                        for (name, value) in headers {
                            response = response.header(*name, *value);
                        }
                        Ok(response.body(Full::from("answer"))?)
                    }
                    Step::Fail => Err("connection reset by peer".into()),
                    Step::Refuse => Err(Box::new(std::io::Error::from(
                        std::io::ErrorKind::ConnectionRefused,
                    )) as BoxError),
                    Step::Problem(status, body) => Ok(Response::builder()
                        .status(status)
                        .header("content-type", "application/problem+json")
                        .body(Full::from(body))?),
                    Step::Hang => std::future::pending().await,
                }
            }
        })
    }
}

/// A request body that never ends: no frame, and no end, ever.
struct Endless;

impl http_body::Body for Endless {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        std::task::Poll::Pending
    }
}

fn post_body(body: &'static str) -> Request<Full<Bytes>> {
    Request::post("http://payments.test/charges")
        .body(Full::from(body))
        .unwrap()
}

#[tokio::test]
async fn a_generated_key_is_resent_on_every_retry_and_never_reused() {
    let script = Script::new([
        Step::Answer(503, &[]),
        Step::Fail,
        Step::Answer(409, &[("retry-after", "0")]),
        Step::Answer(201, &[("idempotent-replayed", "true")]),
    ]);
    let client = ServiceBuilder::new()
        .layer(IdempotencyKeyLayer::new().retry(fast()))
        .service(script.service());

    let response = client
        .clone()
        .oneshot(post_body("{\"amount\":1000}"))
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let delivered = delivery(&response);
    assert_eq!((delivered.attempts(), delivered.replayed()), (4, true));

    let seen = script.seen();
    assert_eq!(seen.len(), 4);
    let key = seen[0].key.clone().expect("the layer added a key");
    // A UUIDv7, sent as a structured-field string.
    assert_eq!(key.len(), 38, "{key}");
    assert!(key.starts_with('"') && key.ends_with('"'), "{key}");
    assert_eq!(&key[15..16], "7", "version 7: {key}");
    assert_eq!(delivered.key(), &key[1..37]);
    for attempt in &seen {
        assert_eq!(attempt.key.as_deref(), Some(key.as_str()));
        assert_eq!(attempt.body, "{\"amount\":1000}");
        assert_eq!(attempt.method, Method::POST);
    }

    let next = client
        .oneshot(post_body("{\"amount\":1000}"))
        .await
        .unwrap();
    let next = delivery(&next);
    assert_eq!((next.attempts(), next.replayed()), (1, false));
    assert_ne!(
        next.key(),
        delivered.key(),
        "a new logical request gets a new key"
    );
}

#[tokio::test]
async fn a_callers_key_is_kept_and_makes_any_method_retried() {
    let script = Script::new([Step::Answer(502, &[]), Step::Answer(504, &[])]);
    let client = IdempotencyKeyLayer::new()
        .retry(fast())
        .layer(script.service());
    let request = Request::put("http://payments.test/orders/42")
        .header("idempotency-key", "order-42-v1")
        .body(Full::<Bytes>::from("{}"))
        .unwrap();
    let response = client.oneshot(request).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(delivery(&response).attempts(), 3);
    assert_eq!(delivery(&response).key(), "order-42-v1");
    let keys: Vec<_> = script.seen().into_iter().map(|seen| seen.key).collect();
    assert_eq!(keys, vec![Some("order-42-v1".to_string()); 3]);
}

#[tokio::test]
async fn client_errors_and_other_answers_are_returned_at_once() {
    for status in [400, 401, 403, 404, 422, 500, 201] {
        let script = Script::new([Step::Answer(status, &[])]);
        let client = IdempotencyKeyLayer::new()
            .retry(fast())
            .layer(script.service());
        let response = client.oneshot(post_body("{}")).await.unwrap();
        assert_eq!(response.status(), status);
        assert_eq!(delivery(&response).attempts(), 1, "{status}");
        assert_eq!(script.seen().len(), 1, "{status} is never retried");
    }
}

#[tokio::test]
async fn a_method_outside_the_set_without_a_key_is_sent_once_untouched() {
    let script = Script::new([Step::Answer(503, &[])]);
    let client = IdempotencyKeyLayer::new()
        .retry(fast())
        .layer(script.service());
    let request = Request::get("http://payments.test/charges")
        .body(Full::<Bytes>::default())
        .unwrap();
    let response = client.oneshot(request).await.unwrap();
    assert_eq!(response.status(), 503);
    assert!(response.extensions().get::<Delivery>().is_none());
    let seen = script.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].key, None);

    // PUT is configured in, so it gets a key and is retried.
    let script = Script::new([Step::Answer(503, &[])]);
    let client = IdempotencyKeyLayer::new()
        .methods([Method::POST, Method::PUT])
        .retry(fast())
        .layer(script.service());
    let request = Request::put("http://payments.test/charges")
        .body(Full::<Bytes>::default())
        .unwrap();
    let response = client.oneshot(request).await.unwrap();
    assert_eq!(delivery(&response).attempts(), 2);
}

#[tokio::test]
async fn a_body_over_the_limit_or_a_malformed_key_is_refused_before_anything_is_sent() {
    let script = Script::new([]);
    let client = IdempotencyKeyLayer::new()
        .max_body(10)
        .layer(script.service());
    let error = client
        .clone()
        .oneshot(post_body("12345678901"))
        .await
        .unwrap_err();
    assert!(
        matches!(error, Error::BodyTooLarge { limit: 10 }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("max_body"),
        "the message names the fix: {error}"
    );
    assert!(script.seen().is_empty());

    let request = Request::post("http://payments.test/charges")
        .header("idempotency-key", "two words")
        .body(Full::<Bytes>::default())
        .unwrap();
    let error = client.clone().oneshot(request).await.unwrap_err();
    assert!(matches!(error, Error::KeyMalformed(_)), "{error:?}");
    assert!(script.seen().is_empty());

    let response = client.oneshot(post_body("1234567890")).await.unwrap();
    assert_eq!(response.status(), 200, "a body at the limit is sent");
}

/// On tokio's paused clock: time moves only when every task waits, so the hanging attempt
/// alone meets its timeout, however slow the machine.
#[tokio::test(start_paused = true)]
async fn an_attempt_over_its_timeout_is_abandoned_and_retried() {
    let script = Script::new([Step::Hang, Step::Fail, Step::Answer(201, &[])]);
    let client = IdempotencyKeyLayer::new()
        .retry(
            fast()
                .timeout(Duration::from_millis(20))
                .budget(Duration::from_secs(3600)),
        )
        .layer(script.service());
    // Without the per-attempt timeout, the hanging attempt would last the whole budget.
    let response = client.oneshot(post_body("{}")).await.unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(delivery(&response).attempts(), 3);
}

/// On tokio's paused clock, as above: the waits are measured on a clock only the test moves.
#[tokio::test(start_paused = true)]
async fn a_retry_waits_for_retry_after_and_the_budget_cuts_an_attempt() {
    let script = Script::new([
        Step::Answer(429, &[("retry-after", "5")]),
        Step::Answer(201, &[]),
    ]);
    let client = IdempotencyKeyLayer::new()
        .retry(fast())
        .layer(script.service());
    let started = tokio::time::Instant::now();
    let response = client.oneshot(post_body("{}")).await.unwrap();
    assert_eq!(delivery(&response).attempts(), 2);
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "retried after {:?}, before its Retry-After",
        started.elapsed()
    );

    // No per-attempt timeout: the budget alone ends an attempt that never answers.
    let script = Script::new([Step::Hang]);
    let client = IdempotencyKeyLayer::new()
        .retry(fast().no_timeout().budget(Duration::from_secs(1)))
        .layer(script.service());
    let error = client.oneshot(post_body("{}")).await.unwrap_err();
    assert!(
        matches!(
            error,
            Error::GaveUp {
                attempts: 1,
                last: Failure::TimedOut,
                ..
            }
        ),
        "{error:?}"
    );

    // `Retry::never()`: keyed, sent once.
    let script = Script::new([Step::Answer(503, &[])]);
    let client = IdempotencyKeyLayer::new()
        .retry(Retry::never())
        .layer(script.service());
    let error = client.oneshot(post_body("{}")).await.unwrap_err();
    assert!(
        matches!(error, Error::GaveUp { attempts: 1, .. }),
        "{error:?}"
    );
    assert!(script.seen()[0].key.is_some());
}

#[tokio::test]
async fn the_last_failure_is_a_typed_error_with_the_key() {
    let script = Script::new([Step::Fail, Step::Fail]);
    let client = IdempotencyKeyLayer::new()
        .retry(fast().attempts(2))
        .layer(script.service());
    let error = client.oneshot(post_body("{}")).await.unwrap_err();
    let Error::GaveUp {
        key,
        attempts,
        last,
        ..
    } = error
    else {
        panic!("{error:?}")
    };
    assert_eq!(attempts, 2);
    assert!(matches!(last, Failure::Transport(_)), "{last:?}");
    assert_eq!(
        script.seen()[0].key.as_deref(),
        Some(format!("\"{}\"", key.as_str()).as_str())
    );
}

/// Every duration a server or a caller can hand the layer, however absurd, ends in an
/// answer or a typed error, never a panic (`Instant + Duration` overflows).
#[tokio::test(start_paused = true)]
async fn no_duration_from_a_server_or_a_caller_panics() {
    // A `Retry-After` of u64::MAX seconds: beyond any budget.
    let script = Script::new([Step::Answer(
        503,
        &[("retry-after", "18446744073709551615")],
    )]);
    let client = IdempotencyKeyLayer::new()
        .retry(fast())
        .layer(script.service());
    let error = client.oneshot(post_body("{}")).await.unwrap_err();
    assert!(
        matches!(error, Error::GaveUp { attempts: 1, .. }),
        "{error:?}"
    );

    // A budget of `Duration::MAX`: no deadline at all.
    let script = Script::new([Step::Answer(503, &[]), Step::Answer(201, &[])]);
    let client = IdempotencyKeyLayer::new()
        .retry(fast().budget(Duration::MAX))
        .layer(script.service());
    let response = client.oneshot(post_body("{}")).await.unwrap();
    assert_eq!(delivery(&response).attempts(), 2);

    // A backoff of `Duration::MAX` within a budget: the wait is cut to the budget's end.
    let script = Script::new([Step::Answer(503, &[]), Step::Answer(201, &[])]);
    let client = IdempotencyKeyLayer::new()
        .retry(
            Retry::new()
                .budget(Duration::from_secs(20))
                .backoff(Duration::MAX, Duration::MAX),
        )
        .layer(script.service());
    let response = client.oneshot(post_body("{}")).await.unwrap();
    assert_eq!(delivery(&response).attempts(), 2);

    // A per-attempt timeout of `Duration::MAX`: the budget cuts the attempt.
    let script = Script::new([Step::Hang]);
    let client = IdempotencyKeyLayer::new()
        .retry(fast().timeout(Duration::MAX).budget(Duration::from_secs(1)))
        .layer(script.service());
    let error = client.oneshot(post_body("{}")).await.unwrap_err();
    assert!(
        matches!(
            error,
            Error::GaveUp {
                last: Failure::TimedOut,
                ..
            }
        ),
        "{error:?}"
    );
}

/// A backoff drawn past the deadline is shortened: the last attempt gets what the budget
/// has left instead of the request giving up early.
#[tokio::test(start_paused = true)]
async fn the_last_backoff_is_shortened_to_the_budget() {
    let script = Script::new([Step::Answer(503, &[]), Step::Answer(201, &[])]);
    let client = IdempotencyKeyLayer::new()
        .retry(
            Retry::new()
                .budget(Duration::from_secs(3))
                .backoff(Duration::from_secs(3600), Duration::from_secs(3600)),
        )
        .layer(script.service());
    let started = tokio::time::Instant::now();
    let response = client.oneshot(post_body("{}")).await.unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(delivery(&response).attempts(), 2);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

/// A server that refuses connections (it is restarting) cannot spend a small attempt count:
/// refusals sent nothing, and only the budget bounds them.
#[tokio::test(start_paused = true)]
async fn refused_connections_do_not_spend_the_attempts() {
    let script = Script::new(std::iter::repeat_n(Step::Refuse, 12).chain([Step::Answer(201, &[])]));
    let client = IdempotencyKeyLayer::new()
        .retry(fast().attempts(2))
        .layer(script.service());
    let response = client.oneshot(post_body("{}")).await.unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(delivery(&response).attempts(), 1, "refusals sent nothing");
    assert_eq!(script.seen().len(), 13);

    // Refused until the budget is spent: the budget alone ends it.
    let script = Script::new(std::iter::repeat_n(Step::Refuse, 100_000));
    let client = IdempotencyKeyLayer::new()
        .retry(fast().attempts(2).budget(Duration::from_secs(2)))
        .layer(script.service());
    let error = client.oneshot(post_body("{}")).await.unwrap_err();
    let Error::GaveUp { attempts, last, .. } = error else {
        panic!("{error:?}")
    };
    assert_eq!(attempts, 0);
    assert!(matches!(last, Failure::Transport(_)), "{last:?}");
}

/// A request body that never ends is bounded by the budget, and the error says that nothing
/// was sent.
#[tokio::test(start_paused = true)]
async fn a_request_body_that_never_ends_is_bounded_by_the_budget() {
    let script = Script::new([]);
    let client = IdempotencyKeyLayer::new()
        .retry(fast().budget(Duration::from_secs(2)))
        .layer(script.service());
    let request = Request::post("http://payments.test/charges")
        .body(Endless)
        .unwrap();
    let error = client.oneshot(request).await.unwrap_err();
    assert!(matches!(error, Error::BodyTimedOut { .. }), "{error:?}");
    assert!(error.to_string().contains("nothing was sent"), "{error}");
    assert!(script.seen().is_empty());
}

/// `GaveUp` says what gave up once, keeps the last failure as its source, and keeps the
/// server's problem (`type`, `title`, `detail`).
#[tokio::test(start_paused = true)]
async fn giving_up_shows_its_cause_once_and_keeps_the_servers_problem() {
    const PROBLEM: &str = r#"{"type":"https://example.test/problems#in-flight","title":"Request in flight","status":409,"detail":"the first request with this key is still running; retry in 5 s"}"#;
    let script = Script::new([Step::Problem(409, PROBLEM), Step::Problem(409, PROBLEM)]);
    let client = IdempotencyKeyLayer::new()
        .retry(fast().attempts(2))
        .layer(script.service());
    let error = client.oneshot(post_body("{}")).await.unwrap_err();
    let shown = error.to_string();
    assert!(
        shown.starts_with("gave up on the request with key `"),
        "{shown}"
    );
    assert!(shown.ends_with("after 2 attempt(s)"), "{shown}");
    let source = std::error::Error::source(&error)
        .expect("the last failure")
        .to_string();
    assert_eq!(source, "the server answered 409 Conflict");
    assert!(!shown.contains(&source), "the cause is shown once: {shown}");
    let Error::GaveUp {
        problem: Some(problem),
        ..
    } = error
    else {
        panic!("the problem is kept: {error:?}")
    };
    assert_eq!(
        problem.kind.as_deref(),
        Some("https://example.test/problems#in-flight")
    );
    assert_eq!(problem.title.as_deref(), Some("Request in flight"));
    assert_eq!(problem.status, Some(409));
    assert!(problem.detail.unwrap().contains("still running"));
}

/// A response body that yields its first bytes, then fails: a connection cut mid-answer.
struct CutBody(bool);

impl http_body::Body for CutBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        if std::mem::replace(&mut self.0, true) {
            std::task::Poll::Ready(Some(Err("connection reset mid-body".into())))
        } else {
            std::task::Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
                b"{\"payment\":",
            )))))
        }
    }
}

/// A server whose first answer is cut after its headers and whose later answers are whole
/// (the recorded answer, replayed); the keys it saw go to `keys`.
/// A first answer cut mid-body, or a whole one.
type CutOrWhole = http_body_util::Either<CutBody, Full<Bytes>>;

fn cut_once_then_replayed(
    keys: &Arc<Mutex<Vec<String>>>,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<CutOrWhole>,
    Error = BoxError,
    Future = impl Send,
> + Clone
       + Send
       + 'static {
    use http_body_util::Either;
    let seen = Arc::clone(keys);
    tower::service_fn(move |request: Request<Full<Bytes>>| {
        let key = request.headers()["idempotency-key"]
            .to_str()
            .unwrap()
            .to_string();
        let first = {
            let mut seen = seen.lock().unwrap();
            seen.push(key);
            seen.len() == 1
        };
        async move {
            let response = Response::builder().status(201);
            Ok::<_, BoxError>(if first {
                response.body(Either::Left(CutBody(false))).unwrap()
            } else {
                response
                    .header("idempotent-replayed", "true")
                    .body(Either::Right(Full::from("{\"payment\":7}")))
                    .unwrap()
            })
        }
    })
}

/// An answer cut after its headers is a failed attempt: the layer reads the answer before
/// it hands it over, sends the request again with the same key within the budget, and
/// delivers the server's replay, whole, once.
#[tokio::test]
async fn an_answer_cut_mid_body_is_retried_with_its_key_and_delivered_whole() {
    let keys = Arc::default();
    let server = cut_once_then_replayed(&keys);
    let client = IdempotencyKeyLayer::new().retry(fast()).layer(server);
    let response = client.oneshot(post_body("{}")).await.unwrap();
    assert_eq!(response.status(), 201);
    let delivery = delivery(&response);
    assert_eq!((delivery.attempts(), delivery.replayed()), (2, true));
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "{\"payment\":7}");
    let keys = keys.lock().unwrap();
    assert_eq!(keys.len(), 2);
    assert_eq!(
        keys[0], keys[1],
        "the retry carries the first request's key"
    );
}

/// With `stream_answers()` (or past `max_answer`), an answer is handed over as it comes:
/// a cut reaches the caller with its `Delivery`, who resends with `Delivery::key()`, and
/// the server sees the same key (so it replays instead of running again).
#[tokio::test]
async fn a_streamed_answer_cut_mid_body_is_handed_over_with_its_key_for_a_safe_resend() {
    for layer in [
        IdempotencyKeyLayer::new().stream_answers(),
        IdempotencyKeyLayer::new().max_answer(4),
    ] {
        let keys = Arc::default();
        let server = cut_once_then_replayed(&keys);
        let client = layer.layer(server);
        let response = client.clone().oneshot(post_body("{}")).await.unwrap();
        assert_eq!(response.status(), 201);
        let delivery = delivery(&response);
        assert_eq!(delivery.attempts(), 1);
        assert!(
            response.into_body().collect().await.is_err(),
            "the body was cut"
        );
        // The caller's own retry, with the key the layer handed over.
        let resend = Request::post("http://payments.test/charges")
            .header("idempotency-key", format!("\"{}\"", delivery.key()))
            .body(Full::<Bytes>::from("{}"))
            .unwrap();
        let replayed = client.oneshot(resend).await.unwrap();
        let body = replayed.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "{\"payment\":7}");
        let keys = keys.lock().unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(
            keys[0], keys[1],
            "the resend carries the first request's key"
        );
    }
}

/// Inside a keyed call, a request without a key of its own takes one derived from the
/// call: the same on every attempt of the call (here the first attempt's body fails after
/// its request went out, and the second sends it again), a key per request of one body, and
/// a step's requests keys of their own. Outside every keyed call, and with
/// `keys_from_calls(false)`, a fresh UUIDv7 each time.
#[tokio::test]
async fn a_request_inside_a_keyed_call_takes_the_same_key_on_every_attempt() {
    use idem_runtime::{step, MemoryStore, Operation, Store};

    let script = Script::new([]);
    let store = MemoryStore::new();
    let op = Operation::new("client.call_keys");
    let call = op.key(&"order-1").unwrap();
    let client = ServiceBuilder::new()
        .layer(IdempotencyKeyLayer::new().retry(fast()))
        .service(script.service());
    let send = |client: &Client, target: &'static str| {
        let client = client.clone();
        async move {
            let request = Request::post(target)
                .body(Full::<Bytes>::from("{}"))
                .unwrap();
            let response = client
                .oneshot(request)
                .await
                .map_err(|e: Error| idem_runtime::Error::store(e.to_string()))?;
            assert_eq!(response.status(), 200);
            Ok::<_, idem_runtime::Error>(())
        }
    };
    type Client = tower::util::BoxCloneService<
        Request<Full<Bytes>>,
        Response<idem_runtime::http::client::AnswerBody>,
        Error,
    >;
    let boxed = |client| -> Client { Client::new(client) };
    let client = boxed(client);
    let last_key = || script.seen().last().unwrap().key.clone().unwrap();

    // The first attempt sends its request, then fails: the key is released.
    let failed = op
        .run(&store, &call, None, async {
            send(&client, "http://payments.test/charges").await?;
            Err::<(), _>(idem_runtime::Error::store("the order table is down"))
        })
        .await;
    assert!(failed.is_err());
    let first = last_key();
    // The retry sends it again, then two more requests, one in a step.
    let mut keys = Vec::new();
    let _ = op
        .run(&store, &call, None, async {
            send(&client, "http://payments.test/charges").await?;
            keys.push(last_key());
            send(&client, "http://payments.test/charges").await?;
            keys.push(last_key());
            send(&client, "http://payments.test/refunds").await?;
            keys.push(last_key());
            step("notify", send(&client, "http://payments.test/charges")).await?;
            keys.push(last_key());
            Ok::<_, idem_runtime::Error>(())
        })
        .await
        .unwrap();
    assert_eq!(
        keys[0], first,
        "each attempt of the call sends its first request under one key"
    );
    let distinct: std::collections::HashSet<_> = keys.iter().collect();
    assert_eq!(
        distinct.len(),
        4,
        "a second request to the same target, one to another, and a step's each have a key of their own: {keys:?}"
    );
    for key in &keys {
        assert_eq!(
            key.len(),
            66,
            "a derived key is 64 hex digits, quoted: {key}"
        );
        assert_ne!(
            *key,
            format!("\"{}\"", call.to_hex()),
            "not the call's own key"
        );
    }
    store.remove(&call).await.unwrap();

    // Off, or outside every keyed call: a fresh UUIDv7 each time.
    let off = boxed(
        ServiceBuilder::new()
            .layer(
                IdempotencyKeyLayer::new()
                    .keys_from_calls(false)
                    .retry(fast()),
            )
            .service(script.service()),
    );
    let mut fresh = Vec::new();
    for _ in 0..2 {
        op.run(&store, &call, None, async {
            send(&off, "http://payments.test/charges").await?;
            Err::<(), _>(idem_runtime::Error::store("released"))
        })
        .await
        .unwrap_err();
        fresh.push(last_key());
        send(&client, "http://payments.test/charges").await.unwrap();
        fresh.push(last_key());
    }
    let distinct: std::collections::HashSet<_> = fresh.iter().collect();
    assert_eq!(distinct.len(), 4, "{fresh:?}");
    assert!(fresh.iter().all(|key| key.len() == 38), "UUIDs: {fresh:?}");
}
