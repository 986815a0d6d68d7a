//! The `Idempotency-Key` layer over real sockets: an axum server on 127.0.0.1 and hyper's
//! client. Every row of the layer's table, two instances sharing Redis, two principals, a
//! client that disconnects mid-handler, and a replay after a restart on PostgreSQL.
//!
//! Over the suite's 600 lines for a reason: the layer's table, row by row, against one server
//! set up once in this file; the edges (blips, bodies, headers) are `http/edges/`.

#[path = "support.rs"]
mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::{Method, StatusCode};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use idem_runtime::http::IdempotencyLayer;
use idem_runtime::{InFlight, MemoryStore};
use idem_tests::scenarios::namespace;
use idem_tests::{postgres_store, redis_store, Down, Probe};
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_request_runs_and_a_retry_replays_it_byte_for_byte() {
    let app = App::default();
    let client = server_with(&app, layer(MemoryStore::new())).await;
    let first = client
        .post("/payments", "\"k-1\"", r#"{"amount":100}"#)
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.headers["x-payment"], "created");
    assert!(!first.replayed());

    // The same document with other whitespace and member order is the same payload.
    let retry = client
        .post("/payments", "\"k-1\"", "{ \"amount\" : 100 }")
        .await;
    assert!(retry.replayed(), "no Idempotent-Replayed header");
    assert!(
        retry.same_as(&first),
        "the replay differs from the first response"
    );
    assert_eq!(app.runs(), 1, "the handler ran again");

    // Stripe's bare token is the same key as the quoted string.
    let bare = client.post("/payments", "k-1", r#"{"amount":100}"#).await;
    assert!(bare.replayed() && bare.same_as(&first));
    assert_eq!(app.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn methods_outside_the_set_and_requests_without_a_key_pass_through() {
    let app = App::default();
    let store = Probe::new(MemoryStore::new());
    let client = server_with(&app, layer(store.clone())).await;
    for _ in 0..2 {
        let get = client
            .send(
                Method::GET,
                "/payments",
                &[("idempotency-key", "k"), ("x-user", "a")],
                "",
            )
            .await;
        assert_eq!(get.status, StatusCode::CREATED);
        assert!(!get.replayed());
        let keyless = client
            .send(Method::POST, "/payments", &[("x-user", "a")], "{}")
            .await;
        assert_eq!(keyless.status, StatusCode::CREATED);
    }
    assert_eq!(app.runs(), 4, "every pass-through ran its handler");
    assert_eq!(store.claims(), 0, "a pass-through touched the store");

    // A keyed request whose principal is unknown is refused, not run unprotected.
    let anonymous = client
        .send(Method::POST, "/payments", &[("idempotency-key", "k")], "{}")
        .await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert!(anonymous.problem()["type"]
        .as_str()
        .unwrap()
        .ends_with("#principal-unknown"));
    assert_eq!(app.runs(), 4, "an unknown principal's keyed request ran");
    assert_eq!(store.claims(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_key_that_is_missing_or_malformed_is_a_400() {
    let app = App::default();
    let client = server_with(&app, layer(MemoryStore::new()).required()).await;
    let missing = client
        .send(Method::POST, "/payments", &[("x-user", "a")], "{}")
        .await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert!(missing.problem()["type"]
        .as_str()
        .unwrap()
        .ends_with("#key-missing"));

    let long = "k".repeat(256);
    for bad in ["\"\"", "", "\"unclosed", "two words", "a,b", long.as_str()] {
        let answer = client
            .send(
                Method::POST,
                "/payments",
                &[("idempotency-key", bad), ("x-user", "a")],
                "{}",
            )
            .await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{bad:?}");
        assert!(answer.problem()["type"]
            .as_str()
            .unwrap()
            .ends_with("#key-malformed"));
    }
    let twice = client
        .send(
            Method::POST,
            "/payments",
            &[
                ("idempotency-key", "a"),
                ("idempotency-key", "b"),
                ("x-user", "a"),
            ],
            "{}",
        )
        .await;
    assert_eq!(twice.status, StatusCode::BAD_REQUEST);
    assert_eq!(app.runs(), 0, "a refused request ran its handler");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_another_request_is_a_422() {
    let app = App::default();
    let client = server_with(&app, layer(MemoryStore::new())).await;
    let first = client.post("/payments", "k", r#"{"amount":100}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let others = [
        (Method::POST, "/payments", r#"{"amount":999}"#),
        (Method::POST, "/refunds", r#"{"amount":100}"#),
        (Method::POST, "/payments?currency=eur", r#"{"amount":100}"#),
        (Method::PATCH, "/payments", r#"{"amount":100}"#),
    ];
    for (method, path, body) in others {
        let answer = client
            .send(
                method.clone(),
                path,
                &[("idempotency-key", "k"), ("x-user", "alice")],
                body,
            )
            .await;
        assert_eq!(
            answer.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{method} {path} {body}"
        );
        assert!(answer.problem()["type"]
            .as_str()
            .unwrap()
            .ends_with("#key-reused"));
    }
    assert_eq!(app.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_while_the_first_runs_is_a_409_or_waits_for_it() {
    for wait in [false, true] {
        let app = App::default();
        let mut layer = layer(MemoryStore::new());
        if wait {
            layer = layer.in_flight(InFlight::Wait);
        }
        let client = server_with(&app, layer).await;
        let first = {
            let client = client.clone();
            tokio::spawn(async move { client.post("/slow", "k", "{}").await })
        };
        app.entered.notified().await;
        let second = {
            let client = client.clone();
            tokio::spawn(async move { client.post("/slow", "k", "{}").await })
        };
        if wait {
            // Released only once the duplicate is in; it waits for the first response.
            tokio::task::yield_now().await;
            app.open();
            let (first, second) = (first.await.unwrap(), second.await.unwrap());
            assert!(second.replayed() && second.same_as(&first));
        } else {
            let second = second.await.unwrap();
            assert_eq!(second.status, StatusCode::CONFLICT);
            assert!(second.headers.contains_key("retry-after"));
            assert!(second.problem()["type"]
                .as_str()
                .unwrap()
                .ends_with("#in-flight"));
            app.open();
            assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
        }
        assert_eq!(app.runs(), 1, "wait = {wait}");
    }
}

/// `wait = 2s` beside a holder of a five-minute lease: the duplicate waits its two seconds,
/// not the lease, then gets `409` with the lease's `Retry-After`; the first completes alone.
async fn a_duplicate_waits_as_told_then_gets_a_409<St: idem_runtime::Store + Clone>(store: St) {
    let app = App::default();
    let layer = layer(store)
        .lease(std::time::Duration::from_secs(300))
        .in_flight(InFlight::Wait)
        .wait(std::time::Duration::from_secs(2));
    let client = server_with(&app, layer).await;
    let first = {
        let client = client.clone();
        tokio::spawn(async move { client.post("/slow", "k", "{}").await })
    };
    app.entered.notified().await;
    let asked = std::time::Instant::now();
    let second = client.post("/slow", "k", "{}").await;
    assert!(
        asked.elapsed() >= std::time::Duration::from_secs(2),
        "{:?}",
        asked.elapsed()
    );
    assert_eq!(second.status, StatusCode::CONFLICT);
    let after: u64 = second.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((60..=300).contains(&after), "Retry-After: {after}");
    app.open();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(app.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_that_waits_two_seconds_beside_a_five_minute_lease_gets_a_409() {
    a_duplicate_waits_as_told_then_gets_a_409(MemoryStore::new()).await;
    if let Some(store) = idem_tests::postgres_store().await {
        a_duplicate_waits_as_told_then_gets_a_409(store).await;
    }
}

/// A `409` says when the holder's lease ends, by the store's clock, as `Retry-After` and in
/// its problem's detail, on every store that can say: not the layer's fixed 1 s.
async fn a_409_says_when_the_lease_ends<St: idem_runtime::Store + Clone>(store: St) {
    let lease = std::time::Duration::from_secs(30);
    let app = App::default();
    let client = server_with(&app, layer(store).lease(lease)).await;
    let first = {
        let client = client.clone();
        tokio::spawn(async move { client.post("/slow", "k", "{}").await })
    };
    app.entered.notified().await;
    let second = client.post("/slow", "k", "{}").await;
    assert_eq!(second.status, StatusCode::CONFLICT);
    let after: u64 = second.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // Rounded up from what the lease has left: 30 s, less what a busy machine took since.
    assert!((20..=30).contains(&after), "Retry-After: {after}");
    let detail = second.problem()["detail"].as_str().unwrap().to_string();
    assert!(detail.contains(&format!("in {after} s")), "{detail}");
    app.open();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_409_carries_the_holders_remaining_lease_as_retry_after() {
    a_409_says_when_the_lease_ends(MemoryStore::new()).await;
    if let Some(store) = redis_store().await {
        a_409_says_when_the_lease_ends(store).await;
    }
    if let Some(store) = postgres_store().await {
        a_409_says_when_the_lease_ends(store).await;
    }
    let file = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("http-409-{}.db", namespace("sqlite")));
    let sqlite = idem_runtime::SqliteStore::open(&file).await.unwrap();
    sqlite.migrate().await.unwrap();
    a_409_says_when_the_lease_ends(sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_that_is_not_recorded_releases_the_key() {
    // A status `record_if` refuses: returned, and the retry runs.
    let app = App::default();
    let client = server_with(&app, layer(MemoryStore::new())).await;
    let failed = client.post("/flaky", "k", "{}").await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(failed.body, "gateway down");
    let retry = client.post("/flaky", "k", "{}").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert!(client.post("/flaky", "k", "{}").await.replayed());
    assert_eq!(app.runs(), 2);

    // A body over the recording limit: returned whole, not recorded; the key completes
    // without it, so a retry is told `410 Gone` and the handler does not run twice.
    let app = App::default();
    let client = server_with(&app, layer(MemoryStore::new()).max_recorded_body(16)).await;
    let big = client.post("/payments", "k", r#"{"amount":100}"#).await;
    assert_eq!(big.status, StatusCode::CREATED);
    assert!(big.body.len() > 16);
    let again = client.post("/payments", "k", r#"{"amount":100}"#).await;
    assert_eq!(again.status, StatusCode::GONE);
    assert!(again.problem()["type"].as_str().unwrap().ends_with("#gone"));
    let mismatch = client.post("/payments", "k", r#"{"amount":101}"#).await;
    assert_eq!(
        mismatch.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "still fingerprinted"
    );
    assert_eq!(app.runs(), 1);

    // Today's behaviour, asked for by name: the key is released and the retry runs.
    let app = App::default();
    let rerun = layer(MemoryStore::new())
        .max_recorded_body(16)
        .release_unrecorded();
    let client = server_with(&app, rerun).await;
    client.post("/payments", "k", r#"{"amount":100}"#).await;
    let again = client.post("/payments", "k", r#"{"amount":100}"#).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed());
    assert_eq!(app.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_is_a_413_and_a_store_that_is_down_a_503() {
    let app = App::default();
    let client = server_with(&app, layer(MemoryStore::new()).max_body(64)).await;
    let large = client
        .post("/payments", "k", &format!("\"{}\"", "x".repeat(100)))
        .await;
    assert_eq!(large.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(large.problem()["type"]
        .as_str()
        .unwrap()
        .ends_with("#body-too-large"));

    let down = server_with(&app, layer(Down)).await;
    let answer = down.post("/payments", "k", "{}").await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(answer.problem()["type"]
        .as_str()
        .unwrap()
        .ends_with("#store-unavailable"));
    assert_eq!(app.runs(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_reads_its_key_and_runs_under_the_claim() {
    let app = App::default();
    let client = server_with(&app, layer(MemoryStore::new())).await;
    let keyed = client.post("/whoami", "\"k-9\"", "{}").await;
    assert_eq!(keyed.body, "key=Some(\"k-9\") attempt=true");
    let keyless = client
        .send(Method::POST, "/whoami", &[("x-user", "a")], "{}")
        .await;
    assert_eq!(keyless.body, "key=None attempt=false");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_principals_with_one_key_each_get_their_own_execution() {
    let app = App::default();
    let client = server_with(&app, layer(MemoryStore::new())).await;
    let as_user = |user: &'static str| {
        let client = client.clone();
        async move {
            client
                .send(
                    Method::POST,
                    "/payments",
                    &[("idempotency-key", "shared"), ("x-user", user)],
                    "{}",
                )
                .await
        }
    };
    let alice = as_user("alice").await;
    let bob = as_user("bob").await;
    assert_eq!(
        app.runs(),
        2,
        "the second principal replayed the first one's response"
    );
    assert!(String::from_utf8_lossy(&alice.body).contains("\"user\":\"alice\""));
    assert!(String::from_utf8_lossy(&bob.body).contains("\"user\":\"bob\""));
    let alice_again = as_user("alice").await;
    let bob_again = as_user("bob").await;
    assert!(alice_again.replayed() && alice_again.same_as(&alice));
    assert!(bob_again.replayed() && bob_again.same_as(&bob));
    assert_eq!(app.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_handler_gets_the_result_on_its_retry() {
    use tokio::io::AsyncWriteExt;
    let app = App::default();
    let client = server_with(&app, layer(MemoryStore::new()).in_flight(InFlight::Wait)).await;
    // A raw connection, so that the test can drop it mid-request.
    let mut socket = tokio::net::TcpStream::connect(client.addr).await.unwrap();
    let request = "POST /slow HTTP/1.1\r\nhost: test\r\nidempotency-key: gone\r\nx-user: alice\r\n\
                   content-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    socket.write_all(request.as_bytes()).await.unwrap();
    app.entered.notified().await;
    drop(socket);
    // The handler goes on after its client left.
    app.open();
    let retry = client.post("/slow", "gone", "{}").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed(), "the retry ran the handler again");
    assert_eq!(app.runs(), 1);
}

/// Two server instances on one Redis, 200 concurrent requests with one key split between
/// them: the handler runs once.
async fn two_instances_on_redis(wait: bool) {
    let (Some(first), Some(second)) = (redis_store().await, redis_store().await) else {
        return;
    };
    let app = App::default();
    let ns = namespace("http.two_instances");
    let instance = |store| {
        let mut layer = layer(store).namespace(ns.clone());
        if wait {
            layer = layer.in_flight(InFlight::Wait);
        }
        server_with(&app, layer)
    };
    let clients = [instance(first).await, instance(second).await];
    let (answered, mut answers_rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..200 {
        let (client, answered) = (clients[i % 2].clone(), answered.clone());
        tokio::spawn(async move {
            let _ = answered.send(client.post("/slow", "one", "{}").await);
        });
    }
    app.entered.notified().await;
    let mut answers = Vec::new();
    if wait {
        app.open();
    }
    while answers.len() < 200 {
        answers.push(answers_rx.recv().await.expect("a request task failed"));
        // Rejecting: the handler finishes only once the 199 duplicates were answered.
        if !wait && answers.len() == 199 {
            app.open();
        }
    }
    assert_eq!(
        app.runs(),
        1,
        "the handler ran more than once across two instances"
    );
    let recorded = answers
        .iter()
        .find(|a| a.status == StatusCode::CREATED)
        .expect("one request ran the handler");
    let conflicts = answers
        .iter()
        .filter(|a| a.status == StatusCode::CONFLICT)
        .count();
    for answer in &answers {
        assert!(
            answer.same_as(recorded) || (!wait && answer.status == StatusCode::CONFLICT),
            "{}: {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
    }
    println!("two instances on redis (wait = {wait}): 200 requests, 1 execution, {conflicts} answered 409");
    assert_eq!(conflicts, if wait { 0 } else { 199 });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_redis_run_the_handler_once_and_reject_the_rest() {
    two_instances_on_redis(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_redis_that_wait_all_get_the_one_response() {
    two_instances_on_redis(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_recorded_in_postgres_is_replayed_after_a_restart() {
    let Some(store) = postgres_store().await else {
        return;
    };
    let ns = namespace("http.restart");
    let app = App::default();
    let first = server_with(&app, layer(store).namespace(ns.clone())).await;
    let recorded = first.post("/payments", "durable", r#"{"amount":7}"#).await;
    assert_eq!(recorded.status, StatusCode::CREATED);
    drop(first);

    // A new process, in effect: a new pool, a new server, the same table.
    let Some(store) = postgres_store().await else {
        return;
    };
    let restarted = server_with(&app, layer(store).namespace(ns)).await;
    let replay = restarted
        .post("/payments", "durable", r#"{"amount":7}"#)
        .await;
    assert!(replay.replayed() && replay.same_as(&recorded));
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn it_is_a_plain_tower_layer() {
    use tower::{Layer, ServiceExt};
    // Any tower service, no axum: a closure over `http` types.
    let runs = Arc::new(AtomicUsize::new(0));
    let inner = {
        let runs = runs.clone();
        tower::service_fn(move |_: http::Request<_>| {
            let n = runs.fetch_add(1, Ordering::SeqCst);
            async move {
                Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from(
                    n.to_string(),
                ))))
            }
        })
    };
    let service = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .layer(inner);
    let request = || {
        http::Request::post("/x")
            .header("idempotency-key", "k")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    let first = service.clone().oneshot(request()).await.unwrap();
    let again = service.oneshot(request()).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(first.into_body().collect().await.unwrap().to_bytes(), "0");
    assert_eq!(again.into_body().collect().await.unwrap().to_bytes(), "0");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_future_dropped_mid_handler_still_records() {
    use tower::{Layer, ServiceExt};
    // What a server does when its client disconnects, made explicit: the future is dropped.
    let app = App::default();
    let service = layer(MemoryStore::new())
        .in_flight(InFlight::Wait)
        .layer(routes(&app));
    let request = || {
        http::Request::post("/slow")
            .header("idempotency-key", "k")
            .header("x-user", "alice")
            .body(axum::body::Body::from("{}"))
            .unwrap()
    };
    let call = tokio::spawn(service.clone().oneshot(request()));
    app.entered.notified().await;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    app.open();
    let retry = service.oneshot(request()).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(app.runs(), 1);
}

/// `IdempotencyKey` as an axum extractor: required, it answers a missing or malformed key
/// `400` problem+json before the handler runs; optional, it runs without one and still
/// refuses a malformed one. `Outcome` answers as its value, marked when replayed.
#[tokio::test]
async fn the_key_extractor_and_the_outcome_answer_as_the_layer_does() {
    use axum::routing::post;
    use idem_runtime::http::IdempotencyKey;
    use idem_runtime::Outcome;
    use tower::ServiceExt;

    let ran = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new()
        .route(
            "/required",
            post({
                let ran = ran.clone();
                move |key: IdempotencyKey| async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    let outcome = if key.as_str() == "again" {
                        Outcome::Replayed(key.to_string())
                    } else {
                        Outcome::Executed(key.to_string())
                    };
                    outcome.map(|key| (StatusCode::CREATED, key))
                }
            }),
        )
        .route(
            "/optional",
            post(|key: Option<IdempotencyKey>| async move {
                key.map_or("none".to_string(), |key| key.to_string())
            }),
        );
    let send = |path: &'static str, key: Option<&'static str>| {
        let app = app.clone();
        async move {
            let mut request = http::Request::post(path);
            if let Some(key) = key {
                request = request.header("idempotency-key", key);
            }
            let response = app
                .oneshot(request.body(axum::body::Body::empty()).unwrap())
                .await
                .unwrap();
            let status = response.status();
            let replayed = response.headers().get("idempotent-replayed").cloned();
            let kind = response.headers().get("content-type").cloned();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (
                status,
                replayed,
                kind,
                String::from_utf8(body.to_vec()).unwrap(),
            )
        }
    };

    let (status, replayed, _, body) = send("/required", Some("\"k-1\"")).await;
    assert_eq!(
        (status, replayed, body.as_str()),
        (StatusCode::CREATED, None, "k-1")
    );
    let (status, replayed, _, body) = send("/required", Some("again")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(replayed.unwrap(), "true");
    assert_eq!(body, "again");
    for (key, problem) in [(None, "#key-missing"), (Some("\"open"), "#key-malformed")] {
        let (status, _, kind, body) = send("/required", key).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(kind.unwrap(), "application/problem+json");
        assert!(body.contains(problem), "{body}");
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        2,
        "refused requests never ran the handler"
    );

    assert_eq!(send("/optional", None).await.3, "none");
    assert_eq!(send("/optional", Some("k-2")).await.3, "k-2");
    assert_eq!(
        send("/optional", Some("\"open")).await.0,
        StatusCode::BAD_REQUEST
    );
}

mod on_sqlite {
    //! The endpoint of "One request, one transaction" on SQLite: the claim, the row and the
    //! answer in the handler's own transaction.

    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::Json;
    use idem_runtime::http::IdempotencyKey;
    use idem_runtime::{idempotent, Error, Outcome, SqliteStore};
    use sqlx::SqliteConnection;
    use tower::ServiceExt;

    #[derive(Clone)]
    struct App {
        store: SqliteStore,
    }

    #[idempotent(key = key, fingerprint = sku, store = store, transaction = tx)]
    async fn place(
        key: &IdempotencyKey,
        sku: &String,
        store: &SqliteStore,
        tx: &mut SqliteConnection,
    ) -> Result<i64, Error> {
        sqlx::query_scalar("INSERT INTO orders (sku) VALUES (?1) RETURNING id")
            .bind(sku)
            .fetch_one(&mut *tx)
            .await
            .map_err(Error::store)
    }

    async fn create(
        State(app): State<App>,
        key: IdempotencyKey,
        Json(sku): Json<String>,
    ) -> Result<Outcome<(StatusCode, Json<i64>)>, Error> {
        let mut tx = app.store.pool().begin().await.map_err(Error::store)?;
        let outcome = place_outcome(&key, &sku, &app.store, &mut tx).await?;
        tx.commit().await.map_err(Error::store)?;
        Ok(outcome.map(|id| (StatusCode::CREATED, Json(id))))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_order_is_written_once_and_its_answer_replayed() {
        let file = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("http-orders.db");
        for stale in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{stale}", file.display()));
        }
        let store = SqliteStore::open(&file).await.unwrap();
        store.migrate().await.unwrap();
        sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, sku TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .unwrap();
        let app = axum::Router::new()
            .route("/orders", axum::routing::post(create))
            .with_state(App {
                store: store.clone(),
            });
        let mut answers = Vec::new();
        for _ in 0..2 {
            let request = http::Request::post("/orders")
                .header("idempotency-key", "order-1")
                .header("content-type", "application/json")
                .body(axum::body::Body::from("\"sku-1\""))
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::CREATED);
            answers.push(response.headers().get("idempotent-replayed").cloned());
        }
        assert_eq!(answers[0], None);
        assert_eq!(answers[1].as_ref().unwrap(), "true");
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
            .fetch_one(store.pool())
            .await
            .unwrap();
        assert_eq!(rows, 1);
    }
}
