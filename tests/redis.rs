//! `RedisStore` against a real Redis server: the store contract, cross-process exclusivity,
//! crashes, zombies and a server that goes away.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::{testkit, Error, InFlight, Operation, Outcome, RedisStore};
use idem_tests::{redis_store, redis_url, Frozen, PrivateRedis, Runs};
use tokio::time::Instant;

/// A namespace of its own for each run, so that runs never see each other's records.
fn namespace(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("redis-test.{test}.{nanos}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_keeps_the_store_contract() {
    let Some(store) = redis_store().await else {
        return;
    };
    testkit::conformance(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefixed_multiplexed_store_keeps_the_store_contract() {
    let Some(_) = redis_store().await else { return };
    let client = redis::Client::open(redis_url()).unwrap();
    let connection = client.get_multiplexed_async_connection().await.unwrap();
    let store = RedisStore::from_multiplexed(connection)
        .with_prefix("idem-test-prefix:")
        .unwrap();
    testkit::conformance(&store).await;
    assert!(store.clone().with_prefix("bad{prefix").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_with_200_callers_each_run_the_body_once() {
    let Some(first) = redis_store().await else {
        return;
    };
    let Some(second) = redis_store().await else {
        return;
    };
    let op = Arc::new(Operation::new(namespace("two_stores")));
    let key = op.key(&"order-1").unwrap();
    let runs = Runs::default();
    let mut calls = Vec::new();
    for store in [first, second] {
        for i in 0..200_u32 {
            let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
            calls.push(tokio::spawn(async move {
                op.run(&store, &key, None, async move {
                    runs.hit();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok::<_, Error>(format!("receipt-{i}"))
                })
                .await
            }));
        }
    }
    let mut values = Vec::new();
    for call in calls {
        values.push(call.await.unwrap().unwrap().into_inner());
    }
    assert_eq!(
        runs.count(),
        1,
        "one body for 400 callers on two connections"
    );
    assert_eq!(values.len(), 400);
    assert!(
        values.iter().all(|v| *v == values[0]),
        "all 400 got the same value"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_lost_its_lease_cannot_overwrite_the_new_owner() {
    let Some(store) = redis_store().await else {
        return;
    };
    let lease = Duration::from_millis(200);
    let op = Operation::new(namespace("zombie")).lease(lease);
    let key = op.key(&1).unwrap();
    let zombie = {
        let (op, store) = (op.clone(), Frozen(store.clone()));
        tokio::spawn(async move {
            op.run(&store, &key, None, async {
                tokio::time::sleep(Duration::from_millis(600)).await;
                Ok::<_, Error>("zombie".to_string())
            })
            .await
        })
    };
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let other_process = Frozen(store.clone());
    let owner = op.run(&other_process, &key, None, async {
        Ok::<_, Error>("owner".to_string())
    });
    assert_eq!(owner.await.unwrap(), Outcome::Executed("owner".to_string()));
    assert_eq!(
        zombie.await.unwrap().unwrap(),
        Outcome::Executed("zombie".to_string())
    );
    let replay = op.run(&store, &key, None, async {
        Ok::<_, Error>("third".to_string())
    });
    assert_eq!(
        replay.await.unwrap(),
        Outcome::Replayed("owner".to_string())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_to_a_closed_port_is_a_store_error_within_the_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = Instant::now();
    let err = RedisStore::connect(&format!("redis://127.0.0.1:{port}"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
    assert!(
        started.elapsed() < idem_runtime::store::redis::DEFAULT_TIMEOUT + Duration::from_secs(1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stopped_mid_test_gives_store_errors_and_never_runs_the_body() {
    let Some(mut server) = PrivateRedis::start() else {
        return;
    };
    let timeout = Duration::from_millis(500);
    let store = RedisStore::connect(&server.url)
        .await
        .unwrap()
        .with_timeout(timeout);
    let op = Operation::new(namespace("server_down"));
    let runs = Runs::default();
    let call = |n: u32| {
        let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
        async move {
            let key = op.key(&n).unwrap();
            op.run(&store, &key, None, async move {
                runs.hit();
                Ok::<_, Error>(n)
            })
            .await
        }
    };
    assert_eq!(call(1).await.unwrap(), Outcome::Executed(1));

    server.kill();
    for n in 2..5 {
        let started = Instant::now();
        let err = call(n).await.unwrap_err();
        assert!(matches!(err, Error::Store(_)), "{err}");
        assert!(
            started.elapsed() < timeout * 3,
            "took {:?}",
            started.elapsed()
        );
    }
    assert_eq!(runs.count(), 1, "no body ran without a claim");
}

const CRASH_KEY: &str = "IDEM_CRASH_NAMESPACE";

/// The child of the crash test: claims a key with a 1 s lease, says so, and hangs until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by crash_of_a_holder_frees_its_key_after_the_lease, in a child process"]
async fn crash_child() {
    let namespace = std::env::var(CRASH_KEY).expect("run by the crash test");
    let store = RedisStore::connect(&redis_url()).await.unwrap();
    let op = Operation::new(namespace).lease(Duration::from_secs(1));
    let key = op.key(&"crash").unwrap();
    let _ = op
        .run(&store, &key, None, async {
            println!("claimed");
            std::future::pending::<()>().await;
            Ok::<_, Error>(0_u32)
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_of_a_holder_frees_its_key_after_the_lease() {
    let Some(store) = redis_store().await else {
        return;
    };
    let namespace = namespace("crash");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "crash_child", "--nocapture"])
        .env(CRASH_KEY, &namespace)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let claimed = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains("claimed"))
    });
    assert!(
        tokio::time::timeout(Duration::from_secs(20), claimed)
            .await
            .unwrap()
            .unwrap(),
        "the child claimed the key"
    );
    child.kill().unwrap(); // SIGKILL: no destructor, no release
    child.wait().unwrap();
    let killed = Instant::now();

    let op = Operation::new(namespace).lease(Duration::from_secs(1));
    let key = op.key(&"crash").unwrap();
    let err = op
        .clone()
        .in_flight(InFlight::Reject)
        .run(&store, &key, None, async { Ok::<_, Error>(1_u32) })
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::InProgress),
        "before the lease ends: {err}"
    );
    assert!(killed.elapsed() < Duration::from_millis(500));

    // A waiting call polls until the lease runs out, then claims and runs.
    let out = op
        .run(&store, &key, None, async { Ok::<_, Error>(2_u32) })
        .await
        .unwrap();
    assert_eq!(out, Outcome::Executed(2));
    assert!(
        killed.elapsed() <= Duration::from_millis(1500),
        "took {:?}",
        killed.elapsed()
    );
}
