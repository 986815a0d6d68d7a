//! `RedisStore` against a real Redis server: the store contract, cross-process exclusivity,
//! crashes, zombies and a server that goes away.

use idem_runtime::ClaimRequest;
use std::time::Duration;

use idem_runtime::testkit;
use idem_runtime::{Error, Operation, Outcome, RedisStore, Store};
use idem_tests::scenarios::{self, namespace};
use idem_tests::{redis_store, redis_url, PrivateRedis, Runs};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_keeps_the_store_contract() {
    let (Some(store), Some(other)) = (redis_store().await, redis_store().await) else {
        return;
    };
    testkit::conformance(&store).await;
    testkit::conformance_across(&store, &other).await;
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
    scenarios::two_stores_200_callers_each(first, second).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_lost_its_lease_cannot_overwrite_the_new_owner() {
    let Some(store) = redis_store().await else {
        return;
    };
    scenarios::zombie_cannot_overwrite_the_new_owner(store.clone()).await;
    scenarios::a_lapsed_holder_answers_only_what_the_key_records(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombies_fenced_write_is_refused_downstream() {
    let Some(store) = redis_store().await else {
        return;
    };
    scenarios::zombie_fences_are_refused_downstream(store).await;
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
        started.elapsed() < idem_runtime::store::redis::DEFAULT_TIMEOUT + Duration::from_secs(10)
    );
}

/// A server that says it is Redis 6.2 (which refuses `SET` with both `NX` and `GET`): every
/// command gets `+OK`, but `INFO`, which gets that version.
async fn redis_6_2() -> std::net::SocketAddr {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (read, mut write) = socket.into_split();
                let mut lines = BufReader::new(read).lines();
                // Each command is an array of bulk strings: `*n`, then `$len` and the word.
                while let Ok(Some(header)) = lines.next_line().await {
                    let Some(words) = header.strip_prefix('*').and_then(|n| n.parse().ok()) else {
                        continue;
                    };
                    let mut name = String::new();
                    for word in 0..words {
                        let _length = lines.next_line().await;
                        let text = lines.next_line().await.ok().flatten().unwrap_or_default();
                        if word == 0 {
                            name = text.to_ascii_uppercase();
                        }
                    }
                    let reply = if name == "INFO" {
                        let info = "# Server\r\nredis_version:6.2.14\r\n";
                        format!("${}\r\n{info}\r\n", info.len())
                    } else {
                        "+OK\r\n".to_string()
                    };
                    if write.write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    address
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_older_than_redis_7_is_refused_at_connect() {
    let address = redis_6_2().await;
    let err = RedisStore::connect(&format!("redis://{address}"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("Redis 7.0 or later") && message.contains("6.2.14"),
        "{message}"
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
        // A hang detector, not a stopwatch: far above the timeout, far below "forever".
        assert!(
            started.elapsed() < timeout + Duration::from_secs(10),
            "took {:?}",
            started.elapsed()
        );
    }
    assert_eq!(runs.count(), 1, "no body ran without a claim");

    // The server comes back on the same port: the connection manager reconnects on its own.
    let Some(_back) = PrivateRedis::start_on(server.port) else {
        return;
    };
    let mut recovered = call(5).await;
    for _ in 0..50 {
        if recovered.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        recovered = call(5).await;
    }
    assert_eq!(
        recovered.unwrap(),
        Outcome::Executed(5),
        "no recovery within 5 s"
    );
}

/// The child of the crash test, in its own process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by crash_of_a_holder_frees_its_key_after_the_lease, in a child process"]
async fn crash_child() {
    scenarios::crash_child(RedisStore::connect(&redis_url()).await.unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_of_a_holder_frees_its_key_after_the_lease() {
    let Some(store) = redis_store().await else {
        return;
    };
    scenarios::crash_frees_the_key_after_the_lease(store, "crash_child").await;
}

/// Only the store's own timeout bounds an operation: a claim made to wait for a replica
/// longer than the connection's default response time (3 s) gets the server's answer (no
/// replica acknowledged it) and is refused for that reason, not cut off by a timer of the
/// connection's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_replicas_longer_than_the_default_timeout_gets_the_servers_answer() {
    let Some(store) = redis_store().await else {
        return;
    };
    let store = store.with_replicas(1, Duration::from_millis(3_500));
    let key = Operation::new(namespace("redis.long_wait"))
        .key(&1)
        .unwrap();
    let err = store
        .claim(&ClaimRequest::new(&key, Duration::from_secs(60)))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("acknowledged by 0 of the 1 replicas"),
        "{err}"
    );
}

/// Records say whose they are, and versions mix: a completed record is written as every
/// version reads it (`c`, the fingerprint, the value; what its claim said of itself is kept
/// beside it), and one an earlier version wrote, with nothing beside it, replays and lists
/// as namespace unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_an_earlier_version_replay_beside_the_new_ones() {
    use idem_runtime::admin::{Admin, Filter, State};
    let Some(store) = redis_store().await else {
        return;
    };
    let prefix = format!("{}:", namespace("redis.versions"));
    let store = store.with_prefix(&prefix).unwrap();
    let op = Operation::new(namespace("redis.versions"));

    let new = op.key(&1).unwrap();
    let ran = op
        .run(&store, &new, None, async { Ok::<_, Error>(7_u32) })
        .await
        .unwrap();
    assert_eq!(ran, Outcome::Executed(7));
    let found = store
        .lookup(&new)
        .await
        .unwrap()
        .expect("a completed record");
    let replayed = op
        .run(&store, &new, None, async { Ok::<_, Error>(8_u32) })
        .await
        .unwrap();
    assert_eq!(replayed, Outcome::Replayed(7));
    let entry = store.inspect(&new).await.unwrap().unwrap();
    assert_eq!(entry.namespace(), Some(op.namespace()));
    assert_eq!(entry.value(), Some(&found.value));
    let client = redis::Client::open(redis_url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let raw: Vec<u8> = redis::cmd("GET")
        .arg(format!("{prefix}{{{}}}", new.to_hex()))
        .query_async(&mut connection)
        .await
        .unwrap();
    let mut record = vec![b'c', 0];
    record.extend_from_slice(&found.value);
    assert_eq!(raw, record, "the layout every version reads");

    // As an earlier version wrote it, with nothing beside it.
    let old = op.key(&2).unwrap();
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}{{{}}}", old.to_hex()))
        .arg(record)
        .arg("PX")
        .arg(60_000)
        .query_async(&mut connection)
        .await
        .unwrap();
    let replayed = op
        .run(&store, &old, None, async { Ok::<_, Error>(9_u32) })
        .await
        .unwrap();
    assert_eq!(replayed, Outcome::Replayed(7));
    assert!(store.lookup(&old).await.unwrap().is_some());
    let mut listed = Vec::new();
    let mut cursor = None;
    loop {
        let page = store
            .list(&Filter::all().completed(), cursor.as_ref())
            .await
            .unwrap();
        listed.extend(page.entries().iter().cloned());
        match page.next() {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    let earlier = listed
        .iter()
        .find(|entry| entry.key() == &old)
        .expect("listed");
    assert_eq!(earlier.namespace(), None, "namespace unknown");
    assert_eq!(earlier.state(), State::Completed);
}
