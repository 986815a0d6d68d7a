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

use idem_runtime::{Claim, PostgresStore, Store};
use idem_tests::failover::{until, Claimers};
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

#[derive(Debug, Default)]
struct Count {
    failovers: usize,
    /// Claims the old primary acknowledged before it crashed.
    acknowledged: usize,
    /// Of those, the ones the promoted standby did not have: each a body a retry there
    /// would run a second time.
    lost: usize,
    /// Claims that failed (the crash, or a synchronous commit the standby never confirmed
    /// within the store's timeout): their bodies never ran.
    refused: usize,
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
        count.acknowledged += acknowledged.len();
        count.refused += refused;
        for key in &acknowledged {
            let claim = promoted
                .claim(key, None, Duration::from_secs(60))
                .await
                .unwrap();
            if let Claim::Acquired { .. } = claim {
                count.lost += 1;
            }
        }
        count.failovers += 1;
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
