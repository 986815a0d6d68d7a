//! Recovery with the default lease: a holder SIGKILLed mid-body frees its key within seconds
//! on every shared store, and live holders keep their keys through renewals on a busy
//! machine (the price of a short lease, measured: a live body must never be taken over).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::{
    Error, InFlight, MemoryStore, Operation, Outcome, PostgresStore, RedisStore, SqliteStore,
    Store, DEFAULT_LEASE,
};
use idem_tests::scenarios::{self, namespace};
use idem_tests::{
    dynamodb_store, postgres_store, postgres_url, redis_store, redis_url, Child, Runs,
};

/// The SQLite file the crash test and its child share: the child finds it without being
/// told; namespaces keep runs apart.
fn sqlite_file() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("recovery.db")
}

async fn sqlite_store() -> SqliteStore {
    let store = SqliteStore::open(sqlite_file()).await.unwrap();
    store.migrate().await.unwrap();
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child of a_crashed_holder_frees_its_key_within_10s_on_every_shared_store"]
async fn redis_child() {
    let store = RedisStore::connect(&redis_url()).await.unwrap();
    scenarios::default_lease_crash_child(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child of a_crashed_holder_frees_its_key_within_10s_on_every_shared_store"]
async fn postgres_child() {
    let store = PostgresStore::connect(&postgres_url()).await.unwrap();
    scenarios::default_lease_crash_child(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child of a_crashed_holder_frees_its_key_within_10s_on_every_shared_store"]
async fn sqlite_child() {
    scenarios::default_lease_crash_child(sqlite_store().await).await;
}

/// Each shared store at once (the three take a lease each, side by side).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_holder_frees_its_key_within_10s_on_every_shared_store() {
    let redis = async {
        if let Some(store) = redis_store().await {
            scenarios::a_crashed_holder_frees_its_key_within_seconds(store, "redis_child").await;
        }
    };
    let postgres = async {
        if let Some(store) = postgres_store().await {
            scenarios::a_crashed_holder_frees_its_key_within_seconds(store, "postgres_child").await;
        }
    };
    let sqlite = async {
        let store = sqlite_store().await;
        scenarios::a_crashed_holder_frees_its_key_within_seconds(store, "sqlite_child").await;
    };
    tokio::join!(redis, postgres, sqlite);
}

/// Live holders with the default lease, bodies of two and a half leases each, while other
/// "processes" (callers that share no registry) try to take every key every 200 ms: no key
/// is ever taken over, every holder records its own value. Run with both cores busy to
/// measure what a short lease costs (see `idem_runtime::guide::leases`).
async fn live_holders_are_never_taken_over<S: Store + Clone>(store: S) {
    const HOLDERS: usize = 16;
    let op = Operation::new(namespace("live_holders"));
    let body = DEFAULT_LEASE * 5 / 2;
    let thefts = Runs::default();
    let holders_done = Arc::new(tokio::sync::Notify::new());
    let mut holders = Vec::new();
    let (started, mut all_started) = tokio::sync::mpsc::channel(HOLDERS);
    for holder in 0..HOLDERS {
        let (op, store, started) = (op.clone(), store.clone(), started.clone());
        holders.push(tokio::spawn(async move {
            let key = op.key(&holder).unwrap();
            op.run(&store, &key, None, async {
                started.send(()).await.unwrap();
                tokio::time::sleep(body).await;
                Ok::<_, Error>(format!("holder {holder}"))
            })
            .await
        }));
    }
    for _ in 0..HOLDERS {
        all_started.recv().await.unwrap();
    }
    // The thieves see the store as another process does: no in-process registry.
    let thieves = {
        let (op, store, thefts) = (
            op.clone(),
            idem_tests::Probe::frozen(store.clone()),
            thefts.clone(),
        );
        let done = Arc::clone(&holders_done);
        tokio::spawn(async move {
            let steal = async {
                loop {
                    for holder in 0..HOLDERS {
                        let key = op.key(&holder).unwrap();
                        let stolen = op
                            .clone()
                            .in_flight(InFlight::Reject)
                            .run(&store, &key, None, async {
                                Ok::<_, Error>("thief".to_string())
                            })
                            .await;
                        match stolen {
                            Err(Error::InProgress) => {}
                            Ok(Outcome::Replayed(_)) => {}
                            Ok(Outcome::Executed(_)) => {
                                thefts.hit();
                            }
                            Err(other) => panic!("a thief's claim failed: {other}"),
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            };
            tokio::select! {
                () = steal => {}
                () = done.notified() => {}
            }
        })
    };
    for (holder, handle) in holders.into_iter().enumerate() {
        let outcome = handle.await.unwrap().unwrap();
        assert_eq!(outcome, Outcome::Executed(format!("holder {holder}")));
    }
    holders_done.notify_one();
    thieves.await.unwrap();
    assert_eq!(thefts.count(), 0, "a live holder's key was taken over");
    for holder in 0..HOLDERS {
        let key = op.key(&holder).unwrap();
        let replay = op
            .run(&store, &key, None, async {
                Ok::<_, Error>("late".to_string())
            })
            .await
            .unwrap();
        assert_eq!(replay, Outcome::Replayed(format!("holder {holder}")));
    }
}

/// Every store at once, so that the machine is as busy as it gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_holders_keep_their_keys_with_the_default_lease() {
    let redis = async {
        if let Some(store) = redis_store().await {
            live_holders_are_never_taken_over(store).await;
        }
    };
    let postgres = async {
        if let Some(store) = postgres_store().await {
            live_holders_are_never_taken_over(store).await;
        }
    };
    let sqlite = async { live_holders_are_never_taken_over(sqlite_store().await).await };
    let memory = live_holders_are_never_taken_over(MemoryStore::new());
    let dynamodb = async {
        if let Some(store) = dynamodb_store().await {
            live_holders_are_never_taken_over(store).await;
        }
    };
    tokio::join!(redis, postgres, sqlite, memory, dynamodb);
}

// ---- A client through a server that is SIGKILLed mid-request and restarted ---------------

/// Hands the server child its database file, its port, and whether its handler hangs.
const SERVER_FILE: &str = "IDEM_RECOVERY_SERVER_FILE";
const SERVER_PORT: &str = "IDEM_RECOVERY_SERVER_PORT";
const SERVER_HANGS: &str = "IDEM_RECOVERY_SERVER_HANGS";

/// A payments server on `SqliteStore` behind `IdempotencyLayer`, as a real process: prints
/// `listening` once it accepts, `executing` when its handler starts and `effect` when the
/// handler's effect is done. With `SERVER_HANGS` set, the handler never finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the server of a_client_with_default_retry_outlasts_a_server_crash_and_restart"]
async fn server_child() {
    use axum::routing::post;
    use idem_runtime::http::IdempotencyLayer;

    let file = std::env::var(SERVER_FILE).unwrap();
    let port: u16 = std::env::var(SERVER_PORT).unwrap().parse().unwrap();
    let hangs = std::env::var(SERVER_HANGS).is_ok();
    let store = SqliteStore::open(&file).await.unwrap();
    store.migrate().await.unwrap();
    let pay = move || async move {
        println!("executing");
        if hangs {
            std::future::pending::<()>().await;
        }
        println!("effect");
        (axum::http::StatusCode::CREATED, "paid")
    };
    let router = axum::Router::new()
        .route("/payments", post(pay))
        .layer(IdempotencyLayer::new(store).unscoped());
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    println!("listening");
    axum::serve(listener, router).await.unwrap();
}

/// A server process started as [`server_child`], once it listens.
async fn start_server(file: &std::path::Path, port: u16, hangs: bool) -> Child {
    let (file, port) = (file.to_str().unwrap(), port.to_string());
    let mut env = vec![(SERVER_FILE, file), (SERVER_PORT, port.as_str())];
    if hangs {
        env.push((SERVER_HANGS, "1"));
    }
    let mut server = Child::start("server_child", &env);
    server.wait_for("listening").await;
    server
}

/// The default client (`Retry::new()`) sends a payment; the server is SIGKILLed while its
/// handler runs, and restarted 2 s later on the same file and port. The client's budget
/// outlasts the outage and the dead holder's lease: the payment is delivered, with one
/// effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_default_retry_outlasts_a_server_crash_and_restart() {
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use idem_runtime::http::client::{Delivery, IdempotencyKeyLayer};
    use tower::{Layer, ServiceExt};

    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "recovery-server-{}-{}.db",
        std::process::id(),
        namespace("server")
    ));
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let mut first = start_server(&file, port, true).await;
    let client = IdempotencyKeyLayer::new()
        .layer(Client::builder(TokioExecutor::new()).build_http::<Full<bytes::Bytes>>());
    let request = http::Request::post(format!("http://127.0.0.1:{port}/payments"))
        .header("content-type", "application/json")
        .body(Full::<bytes::Bytes>::from(r#"{"amount":1000}"#))
        .unwrap();
    let started = tokio::time::Instant::now();
    let delivered = tokio::spawn(client.oneshot(request));

    first.wait_for("executing").await;
    let first_effects = first.kill("effect");
    // The outage: a restart takes a moment; the client meets refused connections meanwhile.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut second = start_server(&file, port, false).await;

    let response = delivered
        .await
        .unwrap()
        .expect("delivered within the default budget");
    let elapsed = started.elapsed();
    let delivery = response.extensions().get::<Delivery>().cloned().unwrap();
    assert_eq!(response.status(), 201);
    let second_effects = second.kill("effect");
    println!(
        "delivered after {elapsed:?} in {} attempt(s) through a SIGKILL and a restart",
        delivery.attempts()
    );
    assert_eq!(first_effects + second_effects, 1, "one effect");
    assert!(
        delivery.attempts() >= 2,
        "the first attempt died with its server"
    );
}

// ---- A claim whose reply was lost ------------------------------------------------------

/// The store applies the claim and its reply is lost: the call claims again with the same
/// nonce, finds its own claim, and runs at once, instead of failing and leaving its key held
/// for a whole lease (30 s here) against the caller's own retry.
async fn a_lost_claim_reply_is_recognised<S: idem_runtime::Store + Clone>(store: S) {
    let lease = Duration::from_secs(30);
    let op = Operation::new(namespace("lost_reply")).lease(lease);
    let key = op.key(&"order-17").unwrap();
    let probe = idem_tests::Probe::loses_claim_replies(store.clone(), 1);
    let runs = Runs::default();
    let started = tokio::time::Instant::now();
    let out = op
        .clone()
        .in_flight(InFlight::Reject)
        .run(&probe, &key, None, async {
            runs.hit();
            Ok::<_, Error>("charged".to_string())
        })
        .await
        .unwrap();
    assert_eq!(out, Outcome::Executed("charged".to_string()));
    assert_eq!(probe.claims(), 2, "one lost reply, one claim that found it");
    assert!(started.elapsed() < lease / 2, "{:?}", started.elapsed());
    // Recorded under the recognised claim: a later call replays it.
    let again = op
        .run(&store, &key, None, async {
            runs.hit();
            Ok::<_, Error>("twice".to_string())
        })
        .await
        .unwrap();
    assert_eq!(again, Outcome::Replayed("charged".to_string()));
    assert_eq!(runs.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claim_reply_is_recognised_on_every_shared_store() {
    if let Some(store) = redis_store().await {
        a_lost_claim_reply_is_recognised(store).await;
    }
    if let Some(store) = postgres_store().await {
        a_lost_claim_reply_is_recognised(store).await;
    }
    a_lost_claim_reply_is_recognised(sqlite_store().await).await;
    if let Some(store) = dynamodb_store().await {
        a_lost_claim_reply_is_recognised(store).await;
    }
    let tiered = idem_runtime::TieredStore::new(MemoryStore::new(), sqlite_store().await);
    a_lost_claim_reply_is_recognised(tiered).await;
}

/// A store that fails every claim: the call sends its claim three times in all (the reply
/// of each may have been lost), then fails closed with `Error::Store`, its body not run.
#[tokio::test]
async fn a_claim_that_keeps_failing_is_sent_three_times_then_fails_closed() {
    let probe = idem_tests::Probe::new(idem_tests::Down);
    let op = Operation::new(namespace("claims_fail"));
    let key = op.key(&"order-17").unwrap();
    let runs = Runs::default();
    let out = op
        .run(&probe, &key, None, async {
            runs.hit();
            Ok::<_, Error>(1_u32)
        })
        .await;
    assert!(matches!(out, Err(Error::Store(_))), "{out:?}");
    assert_eq!(probe.claims(), 3, "the first claim and two more");
    assert_eq!(runs.count(), 0, "fail closed");
}
