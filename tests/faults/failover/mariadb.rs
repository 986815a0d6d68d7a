//! MariaDB with a replica: the primary is SIGKILLed among claims, the replica is promoted
//! once it has applied everything it received, and every claim the old primary
//! acknowledged is looked for on it. Asynchronous replication (MySQL's and MariaDB's
//! default) and semi-synchronous (`AFTER_SYNC`), each with the replica streaming and with
//! it cut off (its I/O thread stopped: a partition, or a replica far behind); and the
//! semi-synchronous primary's silent fall back to asynchronous when its timeout passes.
//!
//! Every server here is the test's own (`mariadb-install-db`, `mariadbd` on free ports);
//! the shared server on 3306 is never touched.
//!
//! `IDEM_MARIADB_FAILOVERS=10 cargo test -p idem-tests --all-features --test mariadb_failover -- --nocapture`
//! runs 10 failovers per mode (CI runs 1).

use std::time::Duration;

use idem_runtime::MySqlStore;
use idem_tests::failover::{until, Claimers, Count};
use idem_tests::PrivateMariaDb;
use sqlx::Row;

fn failovers() -> usize {
    std::env::var("IDEM_MARIADB_FAILOVERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
}

#[derive(Clone, Copy, Debug)]
enum Replication {
    Asynchronous,
    /// Semi-synchronous with a timeout no test reaches: a commit waits for the replica.
    SemiSynchronous,
    /// Semi-synchronous with MariaDB's fall back after 500 ms without the replica's answer.
    FallsBack,
}

impl Replication {
    /// What the primary is told once its replica is attached (not before: a
    /// semi-synchronous primary without a replica holds every commit for its timeout, its
    /// own set-up included).
    fn primary_settings(self) -> Option<&'static str> {
        match self {
            Self::Asynchronous => None,
            Self::SemiSynchronous => Some(
                "SET GLOBAL rpl_semi_sync_master_wait_point = AFTER_SYNC, \
                 rpl_semi_sync_master_timeout = 3600000, rpl_semi_sync_master_enabled = ON",
            ),
            Self::FallsBack => Some(
                "SET GLOBAL rpl_semi_sync_master_wait_point = AFTER_SYNC, \
                 rpl_semi_sync_master_timeout = 500, rpl_semi_sync_master_enabled = ON",
            ),
        }
    }

    fn replica_options(self) -> &'static [&'static str] {
        match self {
            Self::Asynchronous => &[],
            _ => &["--rpl-semi-sync-slave-enabled=ON"],
        }
    }
}

/// A value of `SHOW SLAVE STATUS` on `replica`.
async fn replica_status(replica: &MySqlStore, column: &str) -> Option<String> {
    let row = sqlx::query("SHOW SLAVE STATUS")
        .fetch_optional(replica.pool())
        .await
        .ok()??;
    row.try_get::<String, _>(column).ok()
}

/// One global variable or status value.
async fn value(store: &MySqlStore, query: &str) -> Option<String> {
    let row = sqlx::query(query).fetch_one(store.pool()).await.ok()?;
    row.try_get::<String, _>(row.len() - 1).ok()
}

async fn count_lost_claims(replication: Replication, cut: bool) -> Option<Count> {
    let mut count = Count::default();
    for round in 0..failovers() {
        let mut primary = tokio::task::spawn_blocking(PrivateMariaDb::primary)
            .await
            .unwrap()?;
        let primary_store = MySqlStore::connect(&primary.url).await.unwrap();
        let replica = tokio::task::block_in_place(|| {
            PrivateMariaDb::replica_of(&primary, replication.replica_options())
        })?;
        let replica_store = MySqlStore::connect(&replica.url).await.unwrap();
        if let Some(settings) = replication.primary_settings() {
            primary.sql(settings)?;
            // The replica asks for semi-synchronous replication when it connects.
            replica.sql("STOP SLAVE IO_THREAD; START SLAVE IO_THREAD")?;
            until("the replica acknowledging semi-synchronously", || async {
                value(
                    &primary_store,
                    "SHOW STATUS LIKE 'Rpl_semi_sync_master_clients'",
                )
                .await
                .as_deref()
                    == Some("1")
            })
            .await;
        }
        primary_store.migrate().await.unwrap();
        // The replica has the table (and everything else) before the claims.
        let written = value(&primary_store, "SELECT @@GLOBAL.gtid_binlog_pos")
            .await
            .unwrap();
        until("the replica applying the migration", || async {
            value(&replica_store, "SELECT @@GLOBAL.gtid_slave_pos")
                .await
                .as_deref()
                == Some(written.as_str())
        })
        .await;
        if cut {
            replica.sql("STOP SLAVE IO_THREAD")?;
        }
        // A commit waiting for a cut replica fails the claim after this long; the fall
        // back's first commit waits its 500 ms and then goes on.
        let timeout = match replication {
            Replication::FallsBack => Duration::from_secs(3),
            _ => Duration::from_millis(500),
        };
        let store = primary_store.with_timeout(timeout);

        let claimers = Claimers::start(&store, 8, "mariadb.failover", round);
        claimers.until(50 + round * 37 % 150, 8).await;
        tokio::task::spawn_blocking(move || {
            primary.kill();
            primary
        })
        .await
        .map(drop)
        .unwrap();
        let (acknowledged, refused) = claimers.stop().await;
        // Promoted once it has applied all it received (what a failover tool waits for).
        until("the replica applying what it received", || async {
            let received = replica_status(&replica_store, "Gtid_IO_Pos").await;
            let applied = value(&replica_store, "SELECT @@GLOBAL.gtid_slave_pos").await;
            received.is_some() && received == applied
        })
        .await;
        replica.sql("STOP SLAVE; RESET SLAVE ALL")?;
        count.failover(&replica_store, &acknowledged, refused).await;
        drop((store, replica_store));
        tokio::task::spawn_blocking(move || drop(replica))
            .await
            .unwrap();
    }
    Some(count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semi_synchronous_replica_loses_no_acknowledged_claim_until_the_primary_falls_back() {
    let modes = [
        (Replication::Asynchronous, false),
        (Replication::Asynchronous, true),
        (Replication::SemiSynchronous, false),
        (Replication::SemiSynchronous, true),
        (Replication::FallsBack, true),
    ];
    let mut counts = Vec::new();
    for (replication, cut) in modes {
        let Some(count) = count_lost_claims(replication, cut).await else {
            return;
        };
        let link = if cut { "cut off" } else { "streaming" };
        println!("{replication:?} replica, {link}: {count:?}");
        counts.push((replication, cut, count));
    }
    for (replication, cut, count) in &counts {
        match (replication, cut) {
            (Replication::Asynchronous, false) => {
                assert!(count.acknowledged > 0, "{count:?}");
            }
            (Replication::Asynchronous, true) | (Replication::FallsBack, true) => {
                assert!(count.acknowledged > 0, "{replication:?}: {count:?}");
                assert_eq!(
                    count.lost, count.acknowledged,
                    "{replication:?}: a cut replica has none of them"
                );
            }
            (Replication::SemiSynchronous, false) => {
                assert!(count.acknowledged > 0, "{count:?}");
                assert_eq!(count.lost, 0, "an acknowledged claim was lost: {count:?}");
            }
            (Replication::SemiSynchronous, true) => {
                assert_eq!(
                    count.acknowledged, 0,
                    "no commit is acknowledged without the replica: {count:?}"
                );
            }
            (Replication::FallsBack, false) => unreachable!(),
        }
    }
}
