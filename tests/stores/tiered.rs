//! `TieredStore`: a fast store in front of a durable one, on the real servers. The store
//! contract over three pairs of tiers; a removal racing copies on every pair; a fingerprint
//! mismatch answered from the fast tier; copies that never outlive their durable record; a
//! fast tier that is down; a running call that is never in the fast tier.

use idem_runtime::ClaimRequest;
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::testkit;
use idem_runtime::{
    Claim, Error, Fingerprint, Key, MemoryStore, Operation, Outcome, Store, TieredStore,
};
use idem_tests::scenarios::namespace;
use idem_tests::{postgres_store, redis_store, Down, Probe, Runs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_over_postgres_keeps_the_store_contract() {
    let Some(durable) = postgres_store().await else {
        return;
    };
    testkit::conformance(&TieredStore::new(MemoryStore::new(), durable)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_postgres_keeps_the_store_contract() {
    let (Some(fast), Some(durable)) = (redis_store().await, postgres_store().await) else {
        return;
    };
    testkit::conformance(&TieredStore::new(fast, durable)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_over_redis_keeps_the_store_contract() {
    let Some(durable) = redis_store().await else {
        return;
    };
    testkit::conformance(&TieredStore::new(MemoryStore::new(), durable)).await;
}

/// Runs `op` on `key` through `store` with fingerprint `fp`, counting bodies in `runs`.
async fn call<S: Store + Clone>(
    op: &Operation,
    store: &S,
    key: &Key,
    fp: u32,
    runs: &Runs,
) -> Result<(u32, bool), Error> {
    let fingerprint = Fingerprint::of(&fp).unwrap();
    let runs = runs.clone();
    let outcome = op
        .run(store, key, Some(&fingerprint), async move {
            runs.hit();
            Ok::<_, Error>(fp)
        })
        .await?;
    let replayed = outcome.is_replayed();
    Ok((outcome.into_inner(), replayed))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fingerprint_mismatch_is_answered_from_the_fast_tier() {
    let Some(durable) = postgres_store().await else {
        return;
    };
    let durable = Probe::new(durable);
    let store = TieredStore::new(MemoryStore::new(), durable.clone());
    let op = Operation::new(namespace("tiered.mismatch"));
    let key = op.key(&std::process::id()).unwrap();
    let runs = Runs::default();
    assert_eq!(call(&op, &store, &key, 1, &runs).await.unwrap(), (1, false));
    let claims = durable.claims();
    // The copy is in the fast tier: the same payload replays, another one is refused, and
    // neither reaches the durable store.
    assert_eq!(call(&op, &store, &key, 1, &runs).await.unwrap(), (1, true));
    let err = call(&op, &store, &key, 2, &runs).await.unwrap_err();
    assert!(matches!(err, Error::PayloadMismatch), "{err}");
    assert_eq!(durable.claims(), claims, "answered from the fast tier");
    assert_eq!(runs.count(), 1);
    // The fast tier's own answer carries the fingerprint the call was claimed with.
    match store
        .fast()
        .claim(&ClaimRequest::new(&key, Duration::from_secs(1)))
        .await
    {
        Ok(Claim::Completed { fingerprint, .. }) => {
            assert_eq!(fingerprint, Some(Fingerprint::of(&1_u32).unwrap()))
        }
        other => panic!("the fast tier holds the completed copy: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_never_outlives_its_durable_record() {
    // Two ways into the fast tier: a completion through the tier, and a replay that finds
    // the record in the durable store (recorded there by another process). Each record has
    // a short TTL; once the durable store no longer has it, the fast tier must not either.
    let (Some(pg), Some(redis)) = (postgres_store().await, redis_store().await) else {
        return;
    };
    // Long enough that a loaded machine copies each record before it expires, short
    // enough to wait out twice.
    let ttl = Duration::from_secs(2);
    let op = Operation::new(namespace("tiered.expiry"))
        .lease(ttl)
        .ttl(ttl);
    for (name, fast) in [
        ("memory", Box::new(MemoryStore::new()) as Box<dyn Store>),
        ("redis", Box::new(redis.clone())),
    ] {
        let store = TieredStore::new(std::sync::Arc::<dyn Store>::from(fast), pg.clone());
        let copied = |key: Key| {
            let store = store.clone();
            async move {
                store.fast().peek(&key).is_some()
                    || store.fast().lookup(&key).await.unwrap().is_some()
            }
        };
        let runs = Runs::default();
        let through_the_tier = op.key(&(name, 1, std::process::id())).unwrap();
        call(&op, &store, &through_the_tier, 1, &runs)
            .await
            .unwrap();
        assert!(
            copied(through_the_tier).await,
            "{name}: the record recorded through the tier was copied into the fast tier"
        );
        let from_the_durable = op.key(&(name, 2, std::process::id())).unwrap();
        call(&op, &pg, &from_the_durable, 1, &runs).await.unwrap();
        assert_eq!(
            call(&op, &store, &from_the_durable, 1, &runs)
                .await
                .unwrap(),
            (1, true)
        );
        assert!(
            copied(from_the_durable).await,
            "{name}: the record replayed from the durable store was copied into the fast tier"
        );
        let keys = [
            ("through the tier", through_the_tier),
            ("from the durable store", from_the_durable),
        ];
        for (which, key) in &keys {
            // Until the durable record is gone: then the copy must be gone too.
            while pg.lookup(key).await.unwrap().is_some() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(
                store.fast().peek(key).is_none()
                    && store.fast().lookup(key).await.unwrap().is_none(),
                "{name}: the fast copy of the record {which} outlived the durable record"
            );
            // And the tier runs the body again, as the durable store would.
            assert_eq!(call(&op, &store, key, 1, &runs).await.unwrap(), (1, false));
        }
        assert_eq!(runs.count(), 4, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_tier_that_is_down_degrades_to_the_durable_store() {
    let Some(durable) = postgres_store().await else {
        return;
    };
    let store = TieredStore::new(Down, durable);
    let op = Operation::new(namespace("tiered.fast-down"));
    let runs = Runs::default();
    for n in 0..20_u32 {
        let key = op.key(&(n, std::process::id())).unwrap();
        assert_eq!(call(&op, &store, &key, n, &runs).await.unwrap(), (n, false));
        assert_eq!(call(&op, &store, &key, n, &runs).await.unwrap(), (n, true));
        let err = call(&op, &store, &key, n + 1, &runs).await.unwrap_err();
        assert!(matches!(err, Error::PayloadMismatch), "{err}");
    }
    assert_eq!(runs.count(), 20, "each body once, with the fast tier down");
    // A removal cannot tell whether the fast tier kept a copy: it fails, closed.
    let key = op.key(&(0_u32, std::process::id())).unwrap();
    assert!(matches!(store.remove(&key).await, Err(Error::Store(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_call_is_never_in_the_fast_tier() {
    let (Some(fast), Some(durable)) = (redis_store().await, postgres_store().await) else {
        return;
    };
    let store = TieredStore::new(fast.clone(), durable);
    let op = std::sync::Arc::new(Operation::new(namespace("tiered.running")));
    let key = op.key(&std::process::id()).unwrap();
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (finish, finish_rx) = tokio::sync::oneshot::channel::<()>();
    let call = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async move {
                started_tx.send(()).unwrap();
                finish_rx.await.unwrap();
                Ok::<_, Error>(5_u32)
            })
            .await
        })
    };
    started.await.unwrap();
    assert_eq!(
        fast.lookup(&key).await.unwrap(),
        None,
        "no record while running"
    );
    // Another process's tier sees the call in progress, from the durable store.
    let other = TieredStore::new(MemoryStore::new(), store.durable().clone());
    assert!(matches!(
        other
            .claim(&ClaimRequest::new(&key, Duration::from_secs(1)))
            .await
            .unwrap(),
        Claim::InProgress { .. }
    ));
    finish.send(()).unwrap();
    assert_eq!(call.await.unwrap().unwrap().into_inner(), 5);
    let copy = fast
        .lookup(&key)
        .await
        .unwrap()
        .expect("copied once completed");
    let original = store.durable().lookup(&key).await.unwrap().unwrap();
    assert_eq!(copy.value, original.value);
    assert_eq!(copy.fingerprint, original.fingerprint);
    // Removing through the tier removes both.
    assert!(store.remove(&key).await.unwrap());
    assert_eq!(fast.lookup(&key).await.unwrap(), None);
    assert_eq!(store.durable().lookup(&key).await.unwrap(), None);
}

/// A fast tier that never answers: a stalled connection.
#[derive(Clone)]
struct Stalled;

#[idem_runtime::async_trait]
impl Store for Stalled {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        let _ = request;
        std::future::pending().await
    }
    async fn complete(
        &self,
        _: &Key,
        _: idem_runtime::Token,
        _: idem_runtime::Bytes,
        _: Duration,
    ) -> Result<bool, Error> {
        std::future::pending().await
    }
    async fn release(&self, _: &Key, _: idem_runtime::Token) -> Result<bool, Error> {
        std::future::pending().await
    }
    async fn renew(&self, _: &Key, _: idem_runtime::Token, _: Duration) -> Result<bool, Error> {
        std::future::pending().await
    }
    async fn fence(
        &self,
        _: &Key,
        _: idem_runtime::Token,
    ) -> Result<Option<idem_runtime::Token>, Error> {
        std::future::pending().await
    }
    async fn remove(&self, _: &Key) -> Result<bool, Error> {
        std::future::pending().await
    }
    async fn lookup(&self, _: &Key) -> Result<Option<idem_runtime::Recorded>, Error> {
        std::future::pending().await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_fast_tier_costs_its_timeout_not_the_call() {
    let Some(durable) = postgres_store().await else {
        return;
    };
    let store = TieredStore::new(Stalled, durable).with_fast_timeout(Duration::from_millis(50));
    let op = Operation::new(namespace("tiered.stalled"));
    let key = op.key(&std::process::id()).unwrap();
    let runs = Runs::default();
    // A hang detector, far above the fast tier's timeout, not a stopwatch.
    let calls = async {
        assert_eq!(call(&op, &store, &key, 1, &runs).await.unwrap(), (1, false));
        assert_eq!(call(&op, &store, &key, 1, &runs).await.unwrap(), (1, true));
    };
    tokio::time::timeout(Duration::from_secs(30), calls)
        .await
        .expect("a stalled fast tier held the calls");
    assert_eq!(runs.count(), 1);
    let removal = tokio::time::timeout(Duration::from_secs(30), store.remove(&key))
        .await
        .expect("a stalled fast tier held the removal");
    assert!(matches!(removal, Err(Error::Store(_))), "fails closed");
}

/// A fresh SQLite file of its own.
async fn sqlite_store(test: &str) -> idem_runtime::SqliteStore {
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tiered-{test}-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let store = idem_runtime::SqliteStore::open(&path).await.unwrap();
    store.migrate().await.unwrap();
    store
}

/// Every fast tier in front of every durable store, as `Arc<dyn Store>`s.
async fn every_pair(test: &str) -> Vec<(String, TieredStore<Arc<dyn Store>, Arc<dyn Store>>)> {
    let mut durables: Vec<(&str, Arc<dyn Store>)> =
        vec![("sqlite", Arc::new(sqlite_store(test).await))];
    if let Some(pg) = postgres_store().await {
        durables.push(("postgres", Arc::new(pg)));
    }
    let redis = redis_store().await;
    let mut pairs = Vec::new();
    for (durable_name, durable) in durables {
        let mut fasts: Vec<(&str, Arc<dyn Store>)> = vec![("memory", Arc::new(MemoryStore::new()))];
        if let Some(redis) = &redis {
            fasts.push(("redis", Arc::new(redis.clone())));
        }
        for (fast_name, fast) in fasts {
            pairs.push((
                format!("{fast_name} over {durable_name}"),
                TieredStore::new(fast, durable.clone()),
            ));
        }
    }
    pairs
}

/// The fast tier's copy of `key`, if any.
async fn fast_copy<F: Store, D: Store>(store: &TieredStore<F, D>, key: &Key) -> bool {
    store.fast().peek(key).is_some() || store.fast().lookup(key).await.unwrap().is_some()
}

const RACES: usize = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_racing_copies_leaves_no_copy_behind() {
    // Two ways a copy can be in flight while a removal runs: replays that found the record
    // in the durable store, and the completion that records it. Whatever the interleaving,
    // once the removal has returned and the racers are done, the fast tier holds nothing:
    // a copy left behind would replay the removed value to every later call.
    let op = Operation::new(namespace("tiered.remove-race"));
    let fingerprint = Fingerprint::of(&1_u32).unwrap();
    let lease = Duration::from_secs(5);
    for (name, store) in every_pair("remove-race").await {
        let mut stale = Vec::new();
        for trial in 0..RACES {
            // Replays copying from the durable store.
            let key = op
                .key(&(&name, "replays", trial, std::process::id()))
                .unwrap();
            let Claim::Acquired { token, .. } = store
                .durable()
                .claim(&ClaimRequest::new(&key, lease).fingerprint(Some(&fingerprint)))
                .await
                .unwrap()
            else {
                panic!("{name}: a fresh key is free");
            };
            assert!(store
                .durable()
                .complete(&key, token, idem_runtime::Bytes::from_static(b"1"), lease)
                .await
                .unwrap());
            let start = Arc::new(tokio::sync::Barrier::new(4));
            let replays: Vec<_> = (0..3)
                .map(|_| {
                    let (store, start) = (store.clone(), start.clone());
                    tokio::spawn(async move {
                        start.wait().await;
                        store
                            .claim(&ClaimRequest::new(&key, lease).fingerprint(Some(&fingerprint)))
                            .await
                            .unwrap();
                    })
                })
                .collect();
            start.wait().await;
            store.remove(&key).await.unwrap();
            for replay in replays {
                replay.await.unwrap();
            }
            if fast_copy(&store, &key).await {
                stale.push(format!("replays #{trial}"));
            }

            // The completion's own copy.
            let key = op
                .key(&(&name, "completion", trial, std::process::id()))
                .unwrap();
            let Claim::Acquired { token, .. } = store
                .claim(&ClaimRequest::new(&key, lease).fingerprint(Some(&fingerprint)))
                .await
                .unwrap()
            else {
                panic!("{name}: a fresh key is free");
            };
            let start = Arc::new(tokio::sync::Barrier::new(2));
            let completion = {
                let (store, start) = (store.clone(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    store
                        .complete(&key, token, idem_runtime::Bytes::from_static(b"1"), lease)
                        .await
                        .unwrap()
                })
            };
            start.wait().await;
            store.remove(&key).await.unwrap();
            completion.await.unwrap();
            if fast_copy(&store, &key).await {
                stale.push(format!("completion #{trial}"));
            }
            assert_eq!(
                store.durable().lookup(&key).await.unwrap(),
                None,
                "{name}: a completion fenced by the removal records nothing"
            );
        }
        assert!(
            stale.is_empty(),
            "{name}: {} of {} removals left a copy behind: {stale:?}",
            stale.len(),
            2 * RACES
        );
    }
}

/// A copy the fast tier makes later than the tier allows for (a preempted thread, a slow
/// round trip: here a fast tier held 50 ms at its `complete`) is dropped at once, since
/// the fast tier counts its TTL from when it acts and it could outlive the durable record;
/// replays go on through the durable tier, with the right value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_made_late_is_dropped_from_the_fast_tier() {
    let fast = MemoryStore::new();
    let (gated, gate) = Probe::gated(fast.clone());
    let store = TieredStore::new(gated, MemoryStore::new());
    let op = Operation::new(namespace("tiered-late-copy"));
    let key = op.key(&1).unwrap();
    let call = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async { Ok::<_, Error>(7_u32) })
                .await
                .unwrap()
                .into_inner()
        })
    };
    // The copy into the fast tier reached its `complete`; it lands 50 ms late (a late
    // landing is what is tested: more delay under load only makes it later).
    gate.reached().await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    gate.open();
    assert_eq!(call.await.unwrap(), 7);
    assert!(
        fast.lookup(&key).await.unwrap().is_none(),
        "the late copy was dropped from the fast tier"
    );
    let replay = op
        .run(&store, &key, None, async { Ok::<_, Error>(0_u32) })
        .await
        .unwrap();
    assert_eq!(replay, idem_runtime::Outcome::Replayed(7));
}

/// A transfer in the caller's transaction through a tier of Redis over PostgreSQL: the
/// claim, the effect and the record go in the caller's transaction, in the durable store.
#[idem_runtime::idempotent(key = id, store = store, transaction = tx, namespace = "tiered.transfer.v1")]
async fn transfer(
    store: &TieredStore<idem_runtime::RedisStore, idem_runtime::PostgresStore>,
    tx: &mut sqlx::PgConnection,
    id: &str,
) -> Result<i64, Error> {
    sqlx::query("INSERT INTO tiered_transfers (id) VALUES ($1)")
        .bind(id)
        .execute(&mut *tx)
        .await
        .map_err(Error::store)?;
    Ok(4_200)
}

/// `transaction = tx` with a tier of Redis over PostgreSQL: a rolled-back call leaves
/// neither its effect nor its record; a committed one leaves both, once; its first replay
/// copies the record into Redis, and the next is answered from there without a statement
/// on the caller's connection (proved on a transaction that can run none: an aborted one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_postgres_claims_in_the_callers_transaction() {
    let (Some(fast), Some(durable)) = (redis_store().await, postgres_store().await) else {
        return;
    };
    let pool = durable.pool().clone();
    sqlx::query("CREATE TABLE IF NOT EXISTS tiered_transfers (id text)")
        .execute(&pool)
        .await
        .unwrap();
    let store = TieredStore::new(fast, durable);
    let id = namespace("tr");
    let effects = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM tiered_transfers WHERE id = $1")
            .bind(&id)
            .fetch_one(&pool)
            .await
            .unwrap()
    };

    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        transfer_outcome(&store, &mut tx, &id).await.unwrap(),
        Outcome::Executed(4_200)
    );
    tx.rollback().await.unwrap();
    assert_eq!(effects().await, 0, "rolled back: no effect");

    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        transfer_outcome(&store, &mut tx, &id).await.unwrap(),
        Outcome::Executed(4_200)
    );
    tx.commit().await.unwrap();
    assert_eq!(effects().await, 1, "committed: the effect, once");

    let key = Operation::new("tiered.transfer.v1").key(&id).unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        transfer_outcome(&store, &mut tx, &id).await.unwrap(),
        Outcome::Replayed(4_200)
    );
    tx.commit().await.unwrap();
    assert!(
        store.fast().lookup(&key).await.unwrap().is_some(),
        "the first replay copied the record into the fast tier"
    );

    let mut aborted = pool.begin().await.unwrap();
    assert!(sqlx::query("SELECT 1/0")
        .execute(&mut *aborted)
        .await
        .is_err());
    assert_eq!(
        transfer_outcome(&store, &mut aborted, &id).await.unwrap(),
        Outcome::Replayed(4_200),
        "served from the fast tier: nothing was sent on the (aborted) transaction"
    );
    aborted.rollback().await.unwrap();
    assert_eq!(effects().await, 1);
    store.remove(&key).await.unwrap();
}

/// Two replicas of a service, each a `TieredStore` of its own memory over one PostgreSQL
/// table, both replaying a completed call from memory. An operator resets the call through
/// the durable store alone (as `idem reset` does): each replica's copy is forgotten, told by
/// PostgreSQL (`LISTEN`/`NOTIFY`), and the next call runs the body once, then replays its
/// new value on both, never the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_reset_reaches_every_replicas_fast_tier() {
    use idem_runtime::admin::{Admin, Release, Verdict};

    let (Some(a), Some(b), Some(operator)) = (
        postgres_store().await,
        postgres_store().await,
        postgres_store().await,
    ) else {
        return;
    };
    let replicas = [
        TieredStore::new(MemoryStore::new(), a),
        TieredStore::new(MemoryStore::new(), b),
    ];
    let op = Operation::new(namespace("tiered.reset.replicas"));
    let key = op.key(&1).unwrap();
    let runs = Runs::default();
    assert_eq!(
        call(&op, &replicas[0], &key, 1, &runs).await.unwrap(),
        (1, false)
    );
    for replica in &replicas {
        assert_eq!(call(&op, replica, &key, 1, &runs).await.unwrap(), (1, true));
        assert!(
            fast_copy(replica, &key).await,
            "the replica replays from memory"
        );
    }
    assert_eq!(
        operator.reset(&key, Release::IfSilent).await.unwrap(),
        Verdict::Done
    );
    for replica in &replicas {
        // The replica's own signal that it forgot its copy: its memory no longer has it.
        idem_tests::failover::until("the replica forgot its copy", || {
            let replica = replica.clone();
            async move { !fast_copy(&replica, &key).await }
        })
        .await;
    }
    // The next call, on either replica, runs the body; the other replays its new value.
    let runs_before = runs.count();
    assert_eq!(
        call(&op, &replicas[1], &key, 2, &runs).await.unwrap(),
        (2, false)
    );
    assert_eq!(
        call(&op, &replicas[0], &key, 2, &runs).await.unwrap(),
        (2, true)
    );
    assert_eq!(runs.count(), runs_before + 1);
}

/// A replica whose feed of removals is lost (its listening connection killed by the
/// server) may have missed a removal: once it listens again, no copy it made before is
/// read. The record is deleted behind the store's back (no removal is told, as if its
/// notification had been lost with the connection), the listener killed; once the replica
/// listens again, its next call runs the body instead of replaying the old copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_lost_its_feed_reads_no_copy_made_before() {
    let Some(durable) = postgres_store().await else {
        return;
    };
    // A table of its own, so that its channel's listener is this test's alone.
    let table = format!("idem_feed_{}", std::process::id());
    let durable = durable.with_table(&table).unwrap();
    durable.migrate().await.unwrap();
    let pool = durable.pool().clone();
    let replica = TieredStore::new(MemoryStore::new(), durable);
    let op = Operation::new(namespace("tiered.reset.lost"));
    let key = op.key(&1).unwrap();
    let runs = Runs::default();
    assert_eq!(
        call(&op, &replica, &key, 1, &runs).await.unwrap(),
        (1, false)
    );
    assert_eq!(
        call(&op, &replica, &key, 1, &runs).await.unwrap(),
        (1, true)
    );
    assert!(fast_copy(&replica, &key).await);

    let channel = channel_of(&table);
    let listening = |pool: sqlx::PgPool, channel: String| async move {
        sqlx::query_scalar::<_, i32>(
            "SELECT pid FROM pg_stat_activity WHERE query = 'LISTEN \"' || $1 || '\"'",
        )
        .bind(channel)
        .fetch_optional(&pool)
        .await
        .unwrap()
    };
    let first = listening(pool.clone(), channel.clone())
        .await
        .expect("the replica listens");
    sqlx::query(&format!("DELETE FROM \"{table}\""))
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(first)
        .execute(&pool)
        .await
        .unwrap();
    idem_tests::failover::until("the replica listens again", || {
        let (pool, channel) = (pool.clone(), channel.clone());
        async move {
            listening(pool, channel)
                .await
                .is_some_and(|pid| pid != first)
        }
    })
    .await;
    assert_eq!(
        call(&op, &replica, &key, 2, &runs).await.unwrap(),
        (2, false)
    );
    sqlx::query(&format!("DROP TABLE \"{table}\""))
        .execute(&pool)
        .await
        .unwrap();
}

/// The channel PostgreSQL tells the removals from `table` on (`idem_removed_` and 16 hex
/// digits of its name's SHA-256).
fn channel_of(table: &str) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(table.as_bytes());
    format!("idem_removed_{}", hex::encode(&digest[..8]))
}
