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
use idem_tests::{postgres_store, postgres_url, redis_store, redis_url, Runs};

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
/// measure what a short lease costs (see the README's "Sizing the lease").
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
    tokio::join!(redis, postgres, sqlite, memory);
}
