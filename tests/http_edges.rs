//! The `Idempotency-Key` layer where "the same request" and "the same principal" are hard
//! to tell, over real sockets: amounts that differ past a float's precision, principals the
//! scope cannot name, endpoints under nested routers, bodies of unknown length behind
//! compression, store failures, and headers that belong to one caller.

#[path = "http_support.rs"]
mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::request::Parts;
use idem_runtime::http::{IdempotencyLayer, Unrecorded};
use idem_runtime::{Error, InFlight, MemoryStore, Store};
use idem_tests::scenarios::namespace;
use idem_tests::{Down, Probe, DOWN};
use support::*;
use tokio::sync::mpsc;

/// A layer with one key space for every client, in a namespace of the test's own.
fn unscoped<St: Store + Clone>(
    store: St,
) -> IdempotencyLayer<St, impl idem_runtime::http::KeyScope> {
    IdempotencyLayer::new(store)
        .namespace(namespace("http.edges"))
        .unscoped()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_amount_that_differs_past_a_floats_precision_is_never_replayed() {
    let app = App::default();
    let client = server_with(&app, layer(MemoryStore::new())).await;
    let different = [
        ("18446744073709551617", "18446744073709551616"),
        ("99.999999999999999999", "100.0"),
        ("0.1", "0.10000000000000000001"),
        ("100000000000000000000001", "100000000000000000000000"),
        ("1e23", "99999999999999991611392"),
        ("-0.5", "0.5"),
    ];
    // One key per pair: the first amount is recorded, the second sent as a retry.
    let amounts = |key: String, first: &'static str, second: &'static str| {
        let client = client.clone();
        async move {
            let body = |amount: &str| format!(r#"{{"amount":{amount}}}"#);
            let recorded = client.post("/payments", &key, &body(first)).await;
            assert_eq!(recorded.status, StatusCode::CREATED);
            let retry = client.post("/payments", &key, &body(second)).await;
            (recorded, retry)
        }
    };
    for (i, &(first, second)) in different.iter().enumerate() {
        let (_, other) = amounts(format!("differ-{i}"), first, second).await;
        assert_eq!(
            other.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{second} replayed the response recorded for {first}"
        );
    }
    assert_eq!(app.runs(), different.len());

    // Spellings of one value are one payload.
    let same = [
        ("1", "1.0"),
        ("1", "1e0"),
        ("1", "10e-1"),
        ("100", "1e2"),
        ("1.5", "15E-1"),
    ];
    for (i, &(first, second)) in same.iter().enumerate() {
        let (recorded, retry) = amounts(format!("same-{i}"), first, second).await;
        assert!(
            retry.replayed() && retry.same_as(&recorded),
            "{second} is {first}: {}",
            retry.status
        );
    }
    assert_eq!(app.runs(), different.len() + same.len());
}

/// The principal as an authentication layer would name it: the token of a `Bearer`
/// credential, read the way a hurried scope function reads it (case-sensitively).
fn bearer(parts: &Parts) -> Option<String> {
    let value = parts.headers.get("authorization")?.to_str().ok()?;
    value.strip_prefix("Bearer ").map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_request_whose_principal_is_unknown_is_refused_not_run_unprotected() {
    let app = App::default();
    let scoped = || {
        IdempotencyLayer::new(MemoryStore::new())
            .namespace(namespace("http.unknown"))
            .scope(bearer)
            .required()
    };
    let client = server_with(&app, scoped()).await;
    // A lower-case scheme (RFC 9110 allows it), and no credentials at all.
    for headers in [
        &[
            ("idempotency-key", "k"),
            ("authorization", "bearer tok_alice"),
        ][..],
        &[("idempotency-key", "k")][..],
    ] {
        for body in [r#"{"amount":1}"#, r#"{"amount":2}"#, r#"{"amount":1}"#] {
            let answer = client.send(Method::POST, "/payments", headers, body).await;
            assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
            assert!(answer.problem()["type"]
                .as_str()
                .unwrap()
                .ends_with("#principal-unknown"));
        }
    }
    assert_eq!(app.runs(), 0, "a request of unknown principal ran");
    // A known principal is served as ever, and a keyless request is still a 400.
    let known = [
        ("idempotency-key", "k"),
        ("authorization", "Bearer tok_alice"),
    ];
    let first = client.send(Method::POST, "/payments", &known, "{}").await;
    let again = client.send(Method::POST, "/payments", &known, "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(again.replayed());
    let keyless = client
        .send(
            Method::POST,
            "/payments",
            &[("authorization", "bearer x")],
            "{}",
        )
        .await;
    assert_eq!(keyless.status, StatusCode::BAD_REQUEST);
    assert_eq!(app.runs(), 1);

    // Pass-through, chosen out loud: each such request runs, and nothing is recorded.
    let app = App::default();
    let client = server_with(&app, scoped().pass_through_unknown_principal()).await;
    for _ in 0..3 {
        let answer = client
            .send(Method::POST, "/payments", &[("idempotency-key", "k")], "{}")
            .await;
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed());
    }
    assert_eq!(app.runs(), 3);
}

/// What an authentication layer puts on a request it accepted.
#[derive(Clone)]
struct Principal(String);

/// An authentication middleware: an `Authorization: Bearer` token names the principal.
async fn authenticate(mut request: Request, next: axum::middleware::Next) -> Response {
    let principal = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.get(..7)
                .filter(|s| s.eq_ignore_ascii_case("bearer "))
                .map(|_| v[7..].to_string())
        });
    match principal {
        Some(id) => {
            request.extensions_mut().insert(Principal(id));
            next.run(request).await
        }
        None => StatusCode::UNAUTHORIZED.into_response(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scope_reads_the_principal_an_outer_authentication_layer_set() {
    let idempotency = || {
        IdempotencyLayer::new(MemoryStore::new())
            .namespace(namespace("http.auth"))
            .scope(|parts: &Parts| parts.extensions.get::<Principal>().map(|p| p.0.clone()))
    };
    // Right: the authentication layer is added last, so it runs first.
    let app = App::default();
    let right = routes(&app)
        .layer(idempotency())
        .layer(axum::middleware::from_fn(authenticate));
    let client = Client_::new(serve(right).await);
    let as_user = |token: &'static str| [("idempotency-key", "k"), ("authorization", token)];
    let alice = client
        .send(Method::POST, "/payments", &as_user("bearer alice"), "{}")
        .await;
    let again = client
        .send(Method::POST, "/payments", &as_user("Bearer alice"), "{}")
        .await;
    let bob = client
        .send(Method::POST, "/payments", &as_user("Bearer bob"), "{}")
        .await;
    assert_eq!(alice.status, StatusCode::CREATED);
    assert!(again.replayed() && again.same_as(&alice));
    assert!(!bob.replayed(), "bob replayed alice's response");
    assert_eq!(app.runs(), 2);

    // Wrong: authentication inside the idempotency layer has not run when the scope asks.
    let app = App::default();
    let wrong = routes(&app)
        .layer(axum::middleware::from_fn(authenticate))
        .layer(idempotency());
    let client = Client_::new(serve(wrong).await);
    for _ in 0..3 {
        let answer = client
            .send(Method::POST, "/payments", &as_user("Bearer alice"), "{}")
            .await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(
        app.runs(),
        0,
        "the misplaced layer ran requests unprotected"
    );
}

/// Builds a router around an app's routes.
type Compose = Box<dyn Fn(&App) -> Router<()>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_sent_to_two_nested_endpoints_never_replays_one_for_the_other() {
    let store = MemoryStore::new();
    // Every layer in one namespace: the same key on the same store is the same key.
    let ns = namespace("http.nested");
    let in_ns = move |store: MemoryStore| {
        IdempotencyLayer::new(store)
            .namespace(ns.clone())
            .unscoped()
    };
    let shared = in_ns(store.clone());
    let compositions: Vec<(&str, Compose)> = vec![
        (
            "one layer cloned into two nests",
            Box::new(move |app: &App| {
                Router::new()
                    .nest("/v1", routes(app).layer(shared.clone()))
                    .nest("/v2", routes(app).layer(shared.clone()))
            }),
        ),
        (
            "a layer per nest on one store",
            Box::new({
                let (store, in_ns) = (store.clone(), in_ns.clone());
                move |app: &App| {
                    Router::new()
                        .nest("/v1", routes(app).layer(in_ns(store.clone())))
                        .nest("/v2", routes(app).layer(in_ns(store.clone())))
                }
            }),
        ),
        (
            "nest_service and a route layer",
            Box::new({
                let (store, in_ns) = (store.clone(), in_ns.clone());
                move |app: &App| {
                    Router::new()
                        .nest_service("/v1", routes(app).layer(in_ns(store.clone())))
                        .merge(
                            Router::new()
                                .nest("/v2", routes(app))
                                .route_layer(in_ns(store.clone())),
                        )
                }
            }),
        ),
    ];
    for (i, (how, compose)) in compositions.iter().enumerate() {
        let app = App::default();
        let client = Client_::new(serve(compose(&app)).await);
        let key = format!("nested-{i}");
        let v1 = client.post("/v1/payments", &key, r#"{"amount":5}"#).await;
        assert_eq!(v1.status, StatusCode::CREATED, "{how}");
        let v2 = client.post("/v2/payments", &key, r#"{"amount":5}"#).await;
        assert_eq!(
            v2.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{how}: /v2 answered from /v1's record"
        );
        // Each endpoint still replays its own.
        let v1_again = client.post("/v1/payments", &key, r#"{"amount":5}"#).await;
        assert!(v1_again.replayed() && v1_again.same_as(&v1), "{how}");
        assert_eq!(app.runs(), 1, "{how}");
    }
}

/// `POST /chunks`: 201 with a body streamed from the channel the test feeds.
async fn chunks(State(feed): State<Feed>) -> Response {
    feed.runs.fetch_add(1, Ordering::SeqCst);
    let chunks = feed.chunks.lock().unwrap().take();
    match chunks {
        Some(chunks) => {
            (StatusCode::CREATED, axum::body::Body::new(Channel(chunks))).into_response()
        }
        None => (StatusCode::CREATED, "no feed").into_response(),
    }
}

#[derive(Clone, Default)]
struct Feed {
    runs: Arc<AtomicUsize>,
    chunks: Arc<Mutex<Option<mpsc::UnboundedReceiver<Bytes>>>>,
}

impl Feed {
    fn new() -> (Self, mpsc::UnboundedSender<Bytes>) {
        let (send, receive) = mpsc::unbounded_channel();
        let feed = Self::default();
        *feed.chunks.lock().unwrap() = Some(receive);
        (feed, send)
    }
}

/// A body of unknown length: the chunks of a channel, until it closes.
struct Channel(mpsc::UnboundedReceiver<Bytes>);

impl http_body::Body for Channel {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(http_body::Frame::data(c))))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_behind_compression_or_streamed_is_recorded_as_it_is_sent() {
    use tower_http::compression::CompressionLayer;
    // Compression inside the layer: every response body becomes a stream of frames.
    let app = App::default();
    let router = routes(&app)
        .layer(CompressionLayer::new())
        .layer(layer(MemoryStore::new()));
    let client = Client_::new(serve(router).await);
    let gzip = [
        ("idempotency-key", "z"),
        ("x-user", "alice"),
        ("accept-encoding", "gzip"),
    ];
    let body = format!(r#"{{"note":"{}"}}"#, "a".repeat(4096));
    let first = client.send(Method::POST, "/payments", &gzip, &body).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.headers["content-encoding"], "gzip");
    let retry = client.send(Method::POST, "/payments", &gzip, &body).await;
    assert!(retry.replayed(), "a compressed response was not recorded");
    assert_eq!(retry.body, first.body);
    assert_eq!(app.runs(), 1, "the handler ran again behind compression");

    // A stream the client reads as it comes: the first chunk reaches the client before the
    // handler produced the second.
    let (feed, chunks_in) = Feed::new();
    let router = Router::new()
        .route("/chunks", post(chunks))
        .with_state(feed.clone())
        .layer(unscoped(MemoryStore::new()).in_flight(InFlight::Wait));
    let addr = serve(router).await;
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request =
        "POST /chunks HTTP/1.1\r\nhost: test\r\nidempotency-key: s\r\ncontent-length: 0\r\n\r\n";
    socket.write_all(request.as_bytes()).await.unwrap();
    chunks_in.send(Bytes::from_static(b"first-chunk ")).unwrap();
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("first-chunk") {
        let mut buf = [0; 1024];
        let n = socket.read(&mut buf).await.unwrap();
        assert!(n > 0, "the connection closed before the first chunk");
        seen.extend_from_slice(&buf[..n]);
    }
    // The client goes away mid-body; the rest is produced afterwards, and still recorded.
    drop(socket);
    chunks_in.send(Bytes::from_static(b"second-chunk")).unwrap();
    drop(chunks_in);
    let client = Client_::new(addr);
    let retry = client
        .send(Method::POST, "/chunks", &[("idempotency-key", "s")], "")
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed(), "the abandoned stream was not recorded");
    assert_eq!(retry.body, "first-chunk second-chunk");
    assert_eq!(feed.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_over_the_recording_limit_is_sent_and_said_out_loud() {
    let (feed, chunks_in) = Feed::new();
    let unrecorded = Arc::new(Mutex::new(Vec::new()));
    let told = unrecorded.clone();
    let router = Router::new()
        .route("/chunks", post(chunks))
        .with_state(feed.clone())
        .layer(
            unscoped(MemoryStore::new())
                .max_recorded_body(8)
                .on_unrecorded(move |why| told.lock().unwrap().push(*why)),
        );
    let client = Client_::new(serve(router).await);
    chunks_in.send(Bytes::from_static(b"0123456789")).unwrap();
    drop(chunks_in);
    let first = client
        .send(Method::POST, "/chunks", &[("idempotency-key", "big")], "")
        .await;
    assert_eq!(
        (first.status, &first.body[..]),
        (StatusCode::CREATED, &b"0123456789"[..])
    );
    assert_eq!(
        *unrecorded.lock().unwrap(),
        [Unrecorded::TooLarge { limit: 8 }]
    );
    // The key completed without its response: the retry is told `410`, and the handler
    // does not run again.
    let retry = client
        .send(Method::POST, "/chunks", &[("idempotency-key", "big")], "")
        .await;
    assert_eq!(retry.status, StatusCode::GONE);
    assert_eq!(feed.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_unrecorded_runs_an_unrecorded_stream_again() {
    let (feed, chunks_in) = Feed::new();
    let router = Router::new()
        .route("/chunks", post(chunks))
        .with_state(feed.clone())
        .layer(
            unscoped(MemoryStore::new())
                .max_recorded_body(8)
                .release_unrecorded(),
        );
    let client = Client_::new(serve(router).await);
    chunks_in.send(Bytes::from_static(b"0123456789")).unwrap();
    drop(chunks_in);
    let first = client
        .send(Method::POST, "/chunks", &[("idempotency-key", "big")], "")
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = client
        .send(Method::POST, "/chunks", &[("idempotency-key", "big")], "")
        .await;
    assert!(!retry.replayed());
    assert_eq!(feed.runs.load(Ordering::SeqCst), 2);
}

/// A body of known length that fails while it is read.
struct Failing;

impl http_body::Body for Failing {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(Some(Err(DOWN.into())))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(12)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_problem_body_carries_internal_text() {
    let app = App::default();
    let failing =
        || async { (StatusCode::CREATED, axum::body::Body::new(Failing)).into_response() };
    let router = || routes(&app).route("/failing", post(failing));
    let strict = layer(MemoryStore::new()).required().max_body(64);
    let client = Client_::new(serve(router().layer(strict)).await);
    let leaky = Client_::new(serve(router().layer(layer(Down))).await);
    let refusing = layer(MemoryStore::new()).fingerprint(|_, _| Err(Error::codec(DOWN)));
    let unreadable = Client_::new(serve(router().layer(refusing)).await);

    let user = ("x-user", "alice");
    let cases = [
        (
            "key-missing",
            client.send(Method::POST, "/payments", &[user], "{}").await,
        ),
        (
            "key-malformed",
            client
                .send(
                    Method::POST,
                    "/payments",
                    &[user, ("idempotency-key", "\"")],
                    "{}",
                )
                .await,
        ),
        (
            "principal-unknown",
            client
                .send(Method::POST, "/payments", &[("idempotency-key", "k")], "{}")
                .await,
        ),
        (
            "body-too-large",
            client.post("/payments", "k", &"1".repeat(100)).await,
        ),
        (
            "body-unreadable",
            unreadable.post("/payments", "k", "{}").await,
        ),
        (
            "store-unavailable",
            leaky.post("/payments", "k", "{}").await,
        ),
        ("internal", client.post("/failing", "k", "{}").await),
    ];
    let first = client.post("/payments", "used", r#"{"a":1}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let reused = (
        "key-reused",
        client.post("/payments", "used", r#"{"a":2}"#).await,
    );
    let in_flight = {
        let slow = client.clone();
        let running = tokio::spawn(async move { slow.post("/slow", "busy", "{}").await });
        app.entered.notified().await;
        let answer = client.post("/slow", "busy", "{}").await;
        app.open();
        assert_eq!(running.await.unwrap().status, StatusCode::CREATED);
        ("in-flight", answer)
    };
    for (kind, answer) in cases.iter().chain([&reused, &in_flight]) {
        let problem = answer.problem();
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with(&format!("#{kind}")),
            "{kind}: {problem}"
        );
        let detail = problem["detail"].as_str().unwrap();
        for leak in ["hunter2", "postgres", "db.internal", DOWN] {
            assert!(!detail.contains(leak), "{kind}: {detail}");
        }
        // The whole answer, headers too, says nothing of it.
        let all = format!(
            "{:?} {}",
            answer.headers,
            String::from_utf8_lossy(&answer.body)
        );
        assert!(!all.contains("hunter2"), "{kind}: {all}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_over_the_memory_stores_byte_bound_is_gone_not_run_again() {
    let app = App::default();
    let store = MemoryStore::builder().max_bytes(64 * 1024).build();
    let client = server_with(&app, layer(store).max_recorded_body(1 << 20)).await;
    let big = format!(r#""{}""#, "x".repeat(100 * 1024));
    let first = client.post("/payments", "large", &big).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = client.post("/payments", "large", &big).await;
    assert_eq!(
        retry.status,
        StatusCode::GONE,
        "a result over max_bytes answers 410"
    );
    assert!(retry.problem()["type"].as_str().unwrap().ends_with("#gone"));
    assert_eq!(app.runs(), 1, "and never runs again");
    // A small one is kept.
    let small = client.post("/payments", "small", "{}").await;
    assert!(client
        .post("/payments", "small", "{}")
        .await
        .same_as(&small));
    assert_eq!(app.runs(), 2);

    // A store told to run evicted keys again does so.
    let app = App::default();
    let store = MemoryStore::builder()
        .max_bytes(64 * 1024)
        .rerun_evicted()
        .build();
    let client = server_with(&app, layer(store).max_recorded_body(1 << 20)).await;
    client.post("/payments", "large", &big).await;
    let retry = client.post("/payments", "large", &big).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(app.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_does_not_hold_the_response() {
    let app = App::default();
    // The first completion fails; later ones wait until the store is back.
    let (store, back) = Probe::outage(MemoryStore::new(), 1);
    let client = server_with(&app, layer(store.clone()).in_flight(InFlight::Wait)).await;
    // The store stays away until the client has its response: held until the completion
    // succeeded, the response would never come.
    let first = tokio::time::timeout(
        Duration::from_secs(20),
        client.post("/payments", "outage", "{}"),
    )
    .await
    .expect("the response waited for the store");
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    back.open();
    // The completion went on in the background: a retry replays it.
    let retry = client.post("/payments", "outage", "{}").await;
    assert!(retry.replayed() && retry.same_as(&first));
    assert_eq!(app.runs(), 1);
    assert!(store.completes() >= 2, "the completion was not retried");
}

/// `POST /login`: 201 with a session cookie for whoever asked.
async fn login(State(app): State<App>, Extension(()): Extension<()>) -> impl IntoResponse {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        [
            ("set-cookie", format!("session=secret-{n}")),
            ("x-login", "ok".to_string()),
        ],
        "logged in",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cookie_set_for_the_first_caller_is_not_replayed_to_another() {
    for record_all in [false, true] {
        let app = App::default();
        let mut layer = unscoped(MemoryStore::new());
        if record_all {
            layer = layer.record_header_if(|_| true);
        }
        let router = Router::new()
            .route("/login", post(login))
            .with_state(app.clone())
            .layer(Extension(()))
            .layer(layer);
        let client = Client_::new(serve(router).await);
        let first = client
            .send(Method::POST, "/login", &[("idempotency-key", "c")], "{}")
            .await;
        assert_eq!(
            first.headers["set-cookie"], "session=secret-1",
            "the first caller lost its cookie"
        );
        let other = client
            .send(Method::POST, "/login", &[("idempotency-key", "c")], "{}")
            .await;
        assert!(other.replayed());
        assert_eq!(other.headers["x-login"], "ok");
        assert_eq!(
            other.headers.contains_key("set-cookie"),
            record_all,
            "record_all = {record_all}"
        );
        assert_eq!(app.runs(), 1);
    }
}
