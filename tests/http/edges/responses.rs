//! What is recorded and replayed of an answer: streamed and compressed bodies, bodies over
//! the limit or failing, problem bodies, a store outage, cookies.

use super::*;

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
async fn a_store_outage_holds_the_response_until_it_is_recorded() {
    let app = App::default();
    // The first completion fails; later ones wait until the store is back.
    let (store, back) = Probe::outage(MemoryStore::new(), 1);
    let client = server_with(&app, layer(store.clone()).in_flight(InFlight::Wait)).await;
    let first = tokio::spawn({
        let client = client.clone();
        async move { client.post("/payments", "outage", "{}").await }
    });
    // The completion is retried while the response waits: answered before it landed, the
    // response would be one that a retry could not replay.
    back.reached().await;
    assert!(!first.is_finished(), "the response waits for its record");
    back.open();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    let retry = client.post("/payments", "outage", "{}").await;
    assert!(retry.replayed() && retry.same_as(&first));
    assert_eq!(app.runs(), 1);
    assert!(store.completes() >= 2, "the completion was not retried");
}

/// A response whose record never lands: the client gets the handler's own `201`, marked
/// `Idempotent-Unrecorded: true`, never a `500` for work that succeeded; after the lease
/// (shorter here than the store's timeout) or after the store's timeout (shorter than the
/// lease), whichever ends first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_that_cannot_be_recorded_is_the_handlers_own_marked_unrecorded() {
    // The memory store states no timeout: a request waits at most 3 s.
    let wait = Duration::from_secs(3);
    for lease in [Duration::from_millis(300), Duration::from_secs(60)] {
        let app = App::default();
        let store = Probe::complete_fails(MemoryStore::new());
        let layer = layer(store).lease(lease);
        let client = server_with(&app, layer).await;
        let sent = std::time::Instant::now();
        let answer = client.post("/payments", "unrecorded", "{}").await;
        let took = sent.elapsed();
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
        assert_eq!(
            answer.headers[idem_runtime::http::IDEMPOTENT_UNRECORDED],
            "true",
            "{answer:?}"
        );
        assert!(!answer.replayed());
        assert!(String::from_utf8_lossy(&answer.body).contains("pay_1"));
        assert_eq!(app.runs(), 1);
        // Not held for the whole lease (a minute) when the store's timeout is shorter.
        assert!(
            took < wait + lease.min(wait) + Duration::from_secs(10),
            "{took:?}"
        );
    }
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
