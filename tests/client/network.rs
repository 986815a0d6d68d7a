//! The client's half end to end over real sockets, against idem's own `IdempotencyLayer`:
//! through a proxy that loses answers, cuts requests and answers (mid-body), stalls and
//! delays, with the tower
//! layer (`IdempotencyKeyLayer`) and with reqwest (`IdempotencyKeyMiddleware`), and against
//! a server that never stops answering `409`.

#[path = "support.rs"]
mod client_support;

#[path = "../http/support.rs"]
mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use client_support::{delivery, fast};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem_runtime::http::client::{
    Delivery, Error, Failure, IdempotencyKeyLayer, IdempotencyKeyMiddleware, Retry,
};
use idem_runtime::http::IdempotencyLayer;
use idem_runtime::MemoryStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tower::{Layer, ServiceBuilder, ServiceExt};

/// How many times each logical request's handler ran.
#[derive(Clone, Default)]
struct Executions(Arc<Mutex<HashMap<u64, u32>>>);

/// `POST /payments`: counts the run of payment `n` and answers which run it was.
async fn pay(State(executions): State<Executions>, body: Bytes) -> (StatusCode, String) {
    let payment: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let n = payment["n"].as_u64().unwrap();
    let run = {
        let mut runs = executions.0.lock().unwrap();
        let run = runs.entry(n).or_default();
        *run += 1;
        *run
    };
    (StatusCode::CREATED, format!(r#"{{"n":{n},"run":{run}}}"#))
}

/// What the proxy does to one connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Fault {
    /// Forwarded both ways.
    None,
    /// Forwarded both ways, the answer held back a few milliseconds.
    Delay,
    /// The request reaches the server, which processes it; its answer is thrown away and
    /// the client's connection closed.
    LoseAnswer,
    /// Closed before anything is forwarded.
    Refuse,
    /// Part of the request is forwarded, then both sides are closed.
    CutRequest,
    /// The request is processed; its answer is forwarded up to the middle of its body (the
    /// headers whole), then the client's connection is closed.
    CutAnswer,
    /// The request is processed; the answer never comes, the connection stays open.
    Stall,
}

/// A deterministic fault for connection number `n` (splitmix64).
fn fault(n: u64) -> (Fault, u64) {
    let mut z = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let fault = match z % 100 {
        0..=43 => Fault::None,
        44..=49 => Fault::CutAnswer,
        50..=61 => Fault::Delay,
        62..=76 => Fault::LoseAnswer,
        77..=85 => Fault::Refuse,
        86..=93 => Fault::CutRequest,
        _ => Fault::Stall,
    };
    (fault, z >> 32)
}

#[derive(Default)]
struct Proxied {
    connections: AtomicU64,
    faults: Mutex<HashMap<Fault, u64>>,
}

async fn proxy(upstream: SocketAddr, proxied: Arc<Proxied>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (client, _) = listener.accept().await.unwrap();
            let n = proxied.connections.fetch_add(1, Ordering::SeqCst);
            let (fault, draw) = fault(n);
            *proxied.faults.lock().unwrap().entry(fault).or_default() += 1;
            tokio::spawn(relay(client, upstream, fault, draw));
        }
    });
    address
}

async fn relay(mut client: TcpStream, upstream: SocketAddr, fault: Fault, draw: u64) {
    if fault == Fault::Refuse {
        return;
    }
    let mut server = TcpStream::connect(upstream).await.unwrap();
    if fault == Fault::CutRequest {
        let mut start = vec![0; 1 + (draw % 64) as usize];
        if let Ok(read) = client.read(&mut start).await {
            let _ = server.write_all(&start[..read]).await;
        }
        return;
    }
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upward = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    });
    let mut answer = vec![0; 64 * 1024];
    loop {
        let read = match server_read.read(&mut answer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        match fault {
            // The server has answered, so it processed the request: lose the answer.
            Fault::LoseAnswer => break,
            Fault::Stall => {
                // Hold the connection open, answering nothing, until the client leaves.
                let _ = upward.await;
                return;
            }
            Fault::Delay => tokio::time::sleep(Duration::from_millis(draw % 20)).await,
            Fault::CutAnswer => {
                let headers = answer[..read]
                    .windows(4)
                    .position(|end| end == b"\r\n\r\n")
                    .map_or(read, |at| at + 4);
                let cut = headers + (read - headers) / 2;
                let _ = client_write.write_all(&answer[..cut]).await;
                break;
            }
            _ => {}
        }
        if client_write.write_all(&answer[..read]).await.is_err() {
            break;
        }
    }
    upward.abort();
}

/// A payments server behind idem's `IdempotencyLayer`, reached through a proxy whose
/// faults lose answers, cut requests, refuse, stall and delay.
struct FaultyNetwork {
    executions: Executions,
    proxied: Arc<Proxied>,
    /// The proxy's address, where clients send.
    address: SocketAddr,
}

/// Requests in all, and at once.
const REQUESTS: u64 = 1000;
const CONCURRENT: usize = 50;

impl FaultyNetwork {
    async fn start() -> Self {
        let executions = Executions::default();
        let router = Router::new()
            .route("/payments", post(pay))
            .with_state(executions.clone())
            .layer(IdempotencyLayer::new(MemoryStore::new()).unscoped());
        let server = support::serve(router).await;
        let proxied = Arc::new(Proxied::default());
        let address = proxy(server, Arc::clone(&proxied)).await;
        Self {
            executions,
            proxied,
            address,
        }
    }

    /// The retries every client here uses: a stalled answer never comes, a real one takes
    /// milliseconds.
    fn retry() -> Retry {
        Retry::new()
            .attempts(40)
            .budget(Duration::from_secs(300))
            .backoff(Duration::from_millis(5), Duration::from_millis(100))
            .timeout(Duration::from_secs(2))
    }

    fn url(&self) -> String {
        format!("http://{}/payments", self.address)
    }

    /// Checks the answer to payment `n`: created, its own, from its first run.
    fn check(n: u64, status: u16, body: &[u8]) {
        assert_eq!(
            status,
            201,
            "payment {n}: {}",
            String::from_utf8_lossy(body)
        );
        let answer: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!(answer["n"], n, "payment {n} got another request's answer");
        assert_eq!(answer["run"], 1, "payment {n}'s answer is its first run");
    }

    /// Sends every payment through `pay` (given its number and the URL; it answers the
    /// status, the body and the `Delivery`), `CONCURRENT` at a time, and checks each answer:
    /// the deliveries.
    async fn pay_all<F, Fut>(&self, pay: F) -> Vec<Delivery>
    where
        F: Fn(u64, String) -> Fut,
        Fut: std::future::Future<Output = (u16, Bytes, Delivery)> + Send + 'static,
    {
        let slots = Arc::new(Semaphore::new(CONCURRENT));
        let mut calls = JoinSet::new();
        for n in 0..REQUESTS {
            let slot = Arc::clone(&slots).acquire_owned().await.unwrap();
            let paid = pay(n, self.url());
            calls.spawn(async move {
                let (status, body, delivered) = paid.await;
                drop(slot);
                FaultyNetwork::check(n, status, &body);
                delivered
            });
        }
        calls.join_all().await
    }

    /// Every payment ran exactly once, some answers were lost and replayed.
    fn assert_each_ran_once(&self, client: &str, deliveries: &[Delivery]) {
        let attempts: u64 = deliveries.iter().map(|d| u64::from(d.attempts())).sum();
        let replays = deliveries.iter().filter(|d| d.replayed()).count();
        let retried = deliveries.iter().filter(|d| d.attempts() > 1).count();
        let runs = self.executions.0.lock().unwrap().clone();
        let executed: u64 = runs.values().map(|&runs| u64::from(runs)).sum();
        let faults = self.proxied.faults.lock().unwrap().clone();
        println!(
            "{client}: requests {REQUESTS}, attempts {attempts}, retried {retried}, replays \
             {replays}, executions {executed}, connections {}, faults {faults:?}",
            self.proxied.connections.load(Ordering::SeqCst)
        );
        assert_eq!(deliveries.len() as u64, REQUESTS);
        assert_eq!(runs.len() as u64, REQUESTS, "every payment ran");
        for (n, count) in &runs {
            assert_eq!(*count, 1, "payment {n} ran {count} times");
        }
        assert_eq!(executed, REQUESTS);
        assert!(attempts > REQUESTS, "the network lost attempts: {attempts}");
        assert!(
            replays > 0,
            "some answers were lost after processing and replayed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_logical_request_runs_once_through_a_faulty_network() {
    let network = FaultyNetwork::start().await;
    // One connection per attempt, so that each attempt meets the proxy's fault for it.
    let hyper_client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<Full<Bytes>>();
    let client = ServiceBuilder::new()
        .layer(IdempotencyKeyLayer::new().retry(FaultyNetwork::retry()))
        .service(hyper_client);

    let deliveries = network
        .pay_all(|n, url| {
            let client = client.clone();
            async move {
                let request = Request::post(url)
                    .header("content-type", "application/json")
                    .body(Full::<Bytes>::from(format!(r#"{{"n":{n},"amount":1000}}"#)))
                    .unwrap();
                let response = client.oneshot(request).await;
                let response = response.unwrap_or_else(|error| panic!("payment {n}: {error}"));
                let delivered = delivery(&response);
                let status = response.status().as_u16();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                (status, body, delivered)
            }
        })
        .await;
    network.assert_each_ran_once("tower", &deliveries);
}

/// The same network and server, through reqwest and `IdempotencyKeyMiddleware`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_logical_request_runs_once_through_a_faulty_network_with_reqwest() {
    let network = FaultyNetwork::start().await;
    let reqwest_client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let client = reqwest_middleware::ClientBuilder::new(reqwest_client)
        .with(IdempotencyKeyMiddleware::new().retry(FaultyNetwork::retry()))
        .build();

    let deliveries = network
        .pay_all(|n, url| {
            let client = client.clone();
            async move {
                let response = client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(format!(r#"{{"n":{n},"amount":1000}}"#))
                    .send()
                    .await;
                let response = response.unwrap_or_else(|error| panic!("payment {n}: {error}"));
                let delivered = response
                    .extensions()
                    .get::<Delivery>()
                    .cloned()
                    .expect("a keyed request has a Delivery");
                let status = response.status().as_u16();
                (status, response.bytes().await.unwrap(), delivered)
            }
        })
        .await;
    network.assert_each_ran_once("reqwest", &deliveries);
}

/// A server that always answers `409` with its `Retry-After`, as if the key's first request
/// never finished, and counts the requests it answered.
#[derive(Clone)]
struct Conflict {
    seen: Arc<AtomicUsize>,
    retry_after: &'static str,
}

async fn conflict(
    State(server): State<Conflict>,
) -> (StatusCode, [(&'static str, &'static str); 1]) {
    server.seen.fetch_add(1, Ordering::SeqCst);
    (StatusCode::CONFLICT, [("retry-after", server.retry_after)])
}

/// A server of its own that always answers `409` with `retry_after`, and the count of the
/// requests it answered.
async fn conflict_server(retry_after: &'static str) -> (SocketAddr, Arc<AtomicUsize>) {
    let seen = Arc::new(AtomicUsize::new(0));
    let router = Router::new()
        .route("/", post(conflict))
        .with_state(Conflict {
            seen: Arc::clone(&seen),
            retry_after,
        });
    (support::serve(router).await, seen)
}

#[tokio::test]
async fn a_server_that_always_answers_409_meets_the_budget() {
    // One server per case, so that an attempt cut by a budget and reaching its server late
    // is never counted by another case.
    let server = conflict_server;
    let hyper_client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let post_to = |server: SocketAddr| {
        Request::post(format!("http://{server}/"))
            .body(Full::<Bytes>::from("{}"))
            .unwrap()
    };

    // Out of attempts.
    let (busy_server, seen) = server("0").await;
    let client = IdempotencyKeyLayer::new()
        .retry(fast().attempts(5))
        .layer(hyper_client.clone());
    let error = client.oneshot(post_to(busy_server)).await.unwrap_err();
    assert!(
        matches!(
            error,
            Error::GaveUp {
                attempts: 5,
                last: Failure::Status(StatusCode::CONFLICT),
                ..
            }
        ),
        "{error:?}"
    );
    assert_eq!(seen.load(Ordering::SeqCst), 5);

    // Out of time: attempts are plenty, the budget is not. The last attempt gets what the
    // budget has left, so it may be cut (`TimedOut`) before the server answers.
    let (busy_server, seen) = server("0").await;
    let client = IdempotencyKeyLayer::new()
        .retry(
            Retry::new()
                .attempts(10_000)
                .budget(Duration::from_millis(300))
                .backoff(Duration::from_millis(20), Duration::from_millis(20)),
        )
        .layer(hyper_client.clone());
    let error = client.oneshot(post_to(busy_server)).await.unwrap_err();
    let Error::GaveUp { attempts, last, .. } = error else {
        panic!("{error:?}")
    };
    assert!(
        matches!(
            last,
            Failure::Status(StatusCode::CONFLICT) | Failure::TimedOut
        ),
        "{last:?}"
    );
    assert!(attempts < 10_000, "the budget stopped it: {attempts}");
    let answered = seen.load(Ordering::SeqCst);
    assert!(
        (attempts as usize - 1..=attempts as usize).contains(&answered),
        "{answered} of {attempts} attempts reached the server"
    );

    // A `Retry-After` beyond the budget is not waited for.
    let (later_server, seen) = server("3600").await;
    let client = IdempotencyKeyLayer::new()
        .retry(fast().budget(Duration::from_secs(60)))
        .layer(hyper_client);
    let error = client.oneshot(post_to(later_server)).await.unwrap_err();
    assert!(
        matches!(error, Error::GaveUp { attempts: 1, .. }),
        "{error:?}"
    );
    assert_eq!(seen.load(Ordering::SeqCst), 1);
}

/// The middleware's errors are the layer's, typed: out of attempts against a server that
/// always answers `409`, a refused connection that spends no attempt, a streaming body that
/// cannot be resent.
#[tokio::test]
async fn the_middlewares_errors_are_typed_like_the_layers() {
    let (busy_server, seen) = conflict_server("0").await;
    let client = |retry: Retry| {
        reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(IdempotencyKeyMiddleware::new().retry(retry))
            .build()
    };
    let typed = |error: reqwest_middleware::Error| match error {
        reqwest_middleware::Error::Middleware(error) => error.downcast::<Error>().unwrap(),
        other => panic!("not the middleware's error: {other:?}"),
    };

    let error = client(fast().attempts(5))
        .post(format!("http://{busy_server}/"))
        .body("{}")
        .send()
        .await
        .unwrap_err();
    let error = typed(error);
    assert!(
        matches!(
            error,
            Error::GaveUp {
                attempts: 5,
                last: Failure::Status(StatusCode::CONFLICT),
                ..
            }
        ),
        "{error:?}"
    );
    assert_eq!(seen.load(Ordering::SeqCst), 5);

    // Nothing listens there: every try is refused, none spends an attempt, and the budget
    // ends the call.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let nowhere = closed.local_addr().unwrap();
    drop(closed);
    let error = client(fast().attempts(1).budget(Duration::from_millis(200)))
        .post(format!("http://{nowhere}/"))
        .body("{}")
        .send()
        .await
        .unwrap_err();
    let error = typed(error);
    assert!(
        matches!(
            error,
            Error::GaveUp {
                attempts: 0,
                last: Failure::Transport(_),
                ..
            }
        ),
        "{error:?}"
    );

    let stream = futures_util::stream::iter([Ok::<_, std::io::Error>(Bytes::from("{}"))]);
    let error = client(fast())
        .post(format!("http://{busy_server}/"))
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(typed(error), Error::BodyNotReplayable),
        "a stream cannot be resent"
    );
    assert_eq!(seen.load(Ordering::SeqCst), 5, "nothing more was sent");
}

/// `POST /charges` that keeps every `Idempotency-Key` it is sent.
async fn record_key(
    State(keys): State<Arc<Mutex<Vec<String>>>>,
    headers: http::HeaderMap,
) -> StatusCode {
    let key = headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    keys.lock().unwrap().push(key);
    StatusCode::CREATED
}

/// Through reqwest: two attempts of one keyed call (the first released by an `Err` after
/// its request went out) each send one request without a key, and both carry the same
/// `Idempotency-Key`, derived from the call's; the same request outside any keyed call
/// gets a fresh one.
#[tokio::test]
async fn a_keyed_calls_request_through_reqwest_carries_one_key_on_every_attempt() {
    use idem_runtime::{Operation, Store};

    let keys = Arc::new(Mutex::new(Vec::new()));
    let router = Router::new()
        .route("/charges", post(record_key))
        .with_state(Arc::clone(&keys));
    let url = format!("http://{}/charges", support::serve(router).await);
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(IdempotencyKeyMiddleware::new())
        .build();
    let charge = || async {
        let response = client
            .post(&url)
            .body("{}")
            .send()
            .await
            .map_err(|e| idem_runtime::Error::store(e.to_string()))?;
        assert_eq!(response.status(), 201);
        Ok::<_, idem_runtime::Error>(())
    };
    let store = MemoryStore::new();
    let op = Operation::new("client.reqwest_call_keys");
    let call = op.key(&"order-7").unwrap();
    let failed = op
        .run(&store, &call, None, async {
            charge().await?;
            Err::<(), _>(idem_runtime::Error::store("the ledger is down"))
        })
        .await;
    assert!(failed.is_err());
    let again = op.run(&store, &call, None, charge()).await.unwrap();
    assert!(!again.is_replayed());
    charge().await.unwrap();
    store.remove(&call).await.unwrap();
    let keys = keys.lock().unwrap();
    assert_eq!(keys.len(), 3);
    assert_eq!(keys[0], keys[1], "both attempts send one key: {keys:?}");
    assert_eq!(keys[0].len(), 66, "derived from the call's key: {keys:?}");
    assert_ne!(keys[2], keys[0], "outside the call, a fresh key");
}
