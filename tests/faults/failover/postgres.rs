//! PostgreSQL with a streaming standby: the primary crashes among claims, the standby is
//! promoted, and every claim the old primary acknowledged is looked for on the new one; with
//! asynchronous replication, and with a synchronous standby (`synchronous_standby_names`).
//!
//! Every server here is the test's own (`initdb`, `pg_basebackup`, private ports); the shared
//! server on 5432 is never touched. The store reaches the promoted server through a store
//! made for its URL, as an application's list of servers or a pool it supplies does.
//!
//! `IDEM_PG_FAILOVERS=20 cargo test -p idem-tests --all-features --test postgres_failover -- --nocapture`
//! runs 20 failovers per mode (CI runs 3).

use std::sync::Arc;
use std::time::Duration;

use idem_runtime::PostgresStore;
use idem_tests::failover::{until, Claimers, Count};
use idem_tests::PrivatePostgres;

fn failovers() -> usize {
    std::env::var("IDEM_PG_FAILOVERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3)
}

/// Whether `primary` streams to its standby, synchronously if `sync`.
async fn streaming(primary: &PostgresStore, sync: bool) -> bool {
    let state = if sync { "sync" } else { "async" };
    let found: Result<(i64,), _> = sqlx::query_as(
        "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = $1",
    )
    .bind(state)
    .fetch_one(primary.pool())
    .await;
    matches!(found, Ok((1,)))
}

/// `cut`: the standby stops streaming before the claims (a partition between the two, or a
/// standby far behind).
async fn count_lost_claims(sync: bool, cut: bool) -> Option<Count> {
    let settings: &[(&str, &str)] = if sync {
        &[("synchronous_standby_names", "standby")]
    } else {
        &[]
    };
    let mut count = Count::default();
    for round in 0..failovers() {
        let primary = tokio::task::spawn_blocking({
            let settings = settings.to_vec();
            move || PrivatePostgres::start_with(&settings)
        })
        .await
        .unwrap()?;
        let store = PostgresStore::connect(&primary.url).await.unwrap();
        let primary = Arc::new(primary);
        let standby = tokio::task::spawn_blocking({
            let primary = Arc::clone(&primary);
            move || PrivatePostgres::standby_of(&primary)
        })
        .await
        .unwrap()?;
        until("the standby streaming", || streaming(&store, sync)).await;
        // After the standby is up: a synchronous primary's commits wait for it.
        store.migrate().await.unwrap();
        if cut {
            let standby_store = PostgresStore::connect(&standby.url).await.unwrap();
            for statement in [
                "ALTER SYSTEM SET primary_conninfo = ''",
                "SELECT pg_reload_conf()",
            ] {
                sqlx::query(statement)
                    .execute(standby_store.pool())
                    .await
                    .unwrap();
            }
            until("the standby cut off", || async {
                let found: Result<(i64,), _> =
                    sqlx::query_as("SELECT count(*) FROM pg_stat_replication")
                        .fetch_one(store.pool())
                        .await;
                matches!(found, Ok((0,)))
            })
            .await;
        }
        let store = store.with_timeout(Duration::from_millis(500));

        let claimers = Claimers::start(&store, 8, "postgres.failover", round);
        // A point among the claims: after some were acknowledged, or refused.
        claimers.until(50 + round * 37 % 150, 8).await;
        tokio::task::spawn_blocking({
            let primary = Arc::clone(&primary);
            move || primary.crash()
        })
        .await
        .unwrap();
        let (acknowledged, refused) = claimers.stop().await;
        let standby = Arc::new(standby);
        tokio::task::spawn_blocking({
            let standby = Arc::clone(&standby);
            move || standby.promote()
        })
        .await
        .unwrap();
        let promoted = PostgresStore::connect(&standby.url).await.unwrap();
        count.failover(&promoted, &acknowledged, refused).await;
        drop(store);
        drop(promoted);
        tokio::task::spawn_blocking(move || drop((primary, standby)))
            .await
            .unwrap();
    }
    Some(count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synchronous_standby_loses_no_acknowledged_claim_in_a_failover() {
    let mut counts = Vec::new();
    for cut in [false, true] {
        for sync in [false, true] {
            let Some(count) = count_lost_claims(sync, cut).await else {
                return;
            };
            let link = if cut { "cut off" } else { "streaming" };
            let mode = if sync { "synchronous" } else { "asynchronous" };
            println!("{mode} standby, {link}: {count:?}");
            counts.push((sync, cut, count));
        }
    }
    for (sync, cut, count) in &counts {
        if *sync {
            assert_eq!(count.lost, 0, "an acknowledged claim was lost: {count:?}");
        } else {
            assert!(count.acknowledged > 0, "{count:?}");
        }
        if *cut && !*sync {
            assert_eq!(
                count.lost, count.acknowledged,
                "a cut standby has none: {count:?}"
            );
        }
        if *cut && *sync {
            assert_eq!(
                count.acknowledged, 0,
                "no commit without the standby: {count:?}"
            );
        }
    }
}

/// What the bodies of one failover round did: how often each key's body ran.
#[derive(Clone, Default)]
struct Bodies(Arc<std::sync::Mutex<std::collections::HashMap<u64, u32>>>);

impl Bodies {
    fn ran(&self, key: u64) {
        *self.0.lock().unwrap().entry(key).or_default() += 1;
    }

    fn runs(&self, key: u64) -> u32 {
        self.0.lock().unwrap().get(&key).copied().unwrap_or(0)
    }
}

/// Callers that execute fresh keys through `store` until stopped: the keys whose call was
/// answered `Executed` (acknowledged executions), and how many calls failed.
async fn execute_until_stopped(
    store: PostgresStore,
    op: idem_runtime::Operation,
    bodies: Bodies,
    stop: Arc<std::sync::atomic::AtomicBool>,
    next: Arc<std::sync::atomic::AtomicU64>,
) -> (Vec<u64>, usize) {
    use std::sync::atomic::Ordering;
    let (mut acknowledged, mut failed) = (Vec::new(), 0);
    while !stop.load(Ordering::Relaxed) {
        let n = next.fetch_add(1, Ordering::Relaxed);
        let key = op.key(&n).unwrap();
        let ran = op
            .run(&store, &key, None, async {
                bodies.ran(n);
                Ok::<_, idem_runtime::Error>(n)
            })
            .await;
        match ran {
            Ok(idem_runtime::Outcome::Executed(_)) => acknowledged.push(n),
            Ok(other) => panic!("a fresh key answered {other:?}"),
            Err(_) => failed += 1,
        }
    }
    (acknowledged, failed)
}

/// Executions, not claims: a store on both hosts in libpq's multi-host form runs fresh keys
/// while the synchronous primary is stopped `-m immediate` and its standby promoted. The
/// store follows the promotion by itself; every call answered `Executed` is replayed by a
/// retry afterwards, and no body runs again (CI runs 3 failovers; `IDEM_PG_FAILOVERS`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_acknowledged_execution_runs_again_after_a_failover_on_a_multi_host_store() {
    for sync in [true, false] {
        let Some((acknowledged, ran_again)) = executions_over_failovers(sync).await else {
            return;
        };
        assert!(acknowledged > 0);
        if sync {
            assert_eq!(ran_again, 0, "an acknowledged execution ran again");
        }
    }
}

/// The failovers of [`no_acknowledged_execution_runs_again_after_a_failover_on_a_multi_host_store`],
/// with a synchronous standby or an asynchronous one: the acknowledged executions, and how
/// many of them ran again (or did not replay).
async fn executions_over_failovers(sync: bool) -> Option<(usize, usize)> {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let (mut acknowledged_total, mut ran_again, mut unanswered) = (0, 0, 0);
    for round in 0..failovers() {
        let settings: &'static [(&str, &str)] = if sync {
            &[("synchronous_standby_names", "standby")]
        } else {
            &[]
        };
        let primary = tokio::task::spawn_blocking(move || PrivatePostgres::start_with(settings))
            .await
            .unwrap()?;
        let primary = Arc::new(primary);
        let standby = tokio::task::spawn_blocking({
            let primary = Arc::clone(&primary);
            move || PrivatePostgres::standby_of(&primary)
        })
        .await
        .unwrap()
        .expect("a standby");
        let url = format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
            primary.port(),
            standby.port()
        );
        let store = PostgresStore::connect(&url).await.unwrap();
        until("the standby streaming", || streaming(&store, sync)).await;
        store.migrate().await.unwrap();
        let store = store.with_timeout(Duration::from_millis(500));

        let op = idem_runtime::Operation::new(idem_tests::scenarios::namespace(&format!(
            "postgres.executions.{round}"
        )));
        let (bodies, stop, next) = (
            Bodies::default(),
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let callers: Vec<_> = (0..8)
            .map(|_| {
                tokio::spawn(execute_until_stopped(
                    store.clone(),
                    op.clone(),
                    bodies.clone(),
                    Arc::clone(&stop),
                    Arc::clone(&next),
                ))
            })
            .collect();
        // A point among the executions, then the crash and the promotion.
        let before = 40 + round as u64 * 37 % 120;
        until("executions before the crash", || async {
            next.load(Ordering::Relaxed) >= before
        })
        .await;
        tokio::task::spawn_blocking({
            let primary = Arc::clone(&primary);
            move || primary.crash()
        })
        .await
        .unwrap();
        let standby = Arc::new(standby);
        tokio::task::spawn_blocking({
            let standby = Arc::clone(&standby);
            move || standby.promote()
        })
        .await
        .unwrap();
        // The same store goes on, on the promoted host.
        let after = next.load(Ordering::Relaxed) + 40;
        until("executions on the promoted host", || async {
            next.load(Ordering::Relaxed) >= after
        })
        .await;
        stop.store(true, Ordering::Relaxed);
        let mut acknowledged = Vec::new();
        for caller in callers {
            let (keys, failed) = caller.await.unwrap();
            acknowledged.extend(keys);
            unanswered += failed;
        }
        // Every acknowledged execution is a record: its retry replays, its body never runs.
        for &n in &acknowledged {
            let key = op.key(&n).unwrap();
            let retry = op
                .run(&store, &key, None, async {
                    bodies.ran(n);
                    Ok::<_, idem_runtime::Error>(n)
                })
                .await;
            if bodies.runs(n) > 1 || !matches!(retry, Ok(idem_runtime::Outcome::Replayed(_))) {
                ran_again += 1;
            }
        }
        acknowledged_total += acknowledged.len();
        drop(store);
        tokio::task::spawn_blocking(move || drop((primary, standby)))
            .await
            .unwrap();
    }
    let mode = if sync { "synchronous" } else { "asynchronous" };
    println!(
        "multi-host store, {mode} standby, {} failovers: {acknowledged_total} acknowledged executions, \
         {ran_again} ran again or did not replay, {unanswered} calls failed (not acknowledged)",
        failovers()
    );
    Some((acknowledged_total, ran_again))
}
