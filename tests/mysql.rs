//! `MySqlStore` on the MariaDB server of this machine (written for MySQL 8 too): the store
//! contract, two pools racing on one key, zombies fenced, a lapsed holder, a holder
//! SIGKILLed mid-body, 10 % faults, a crowded pool, tokens after an upgrade; and on a private
//! server of the test's own, SIGKILLed and started again.

use std::sync::Arc;
use std::time::Duration;

use idem_runtime::store::testkit;
use idem_runtime::{Error, MySqlStore, Operation};
use idem_tests::scenarios::{self, namespace};
use idem_tests::{mysql_store, mysql_url, Probe, Runs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_store_keeps_the_store_contract() {
    let Some(store) = mysql_store().await else {
        return;
    };
    testkit::conformance(&store).await;
    let named = store.with_table("idem_other").unwrap();
    named.migrate().await.unwrap();
    named.migrate().await.unwrap(); // idempotent
    testkit::conformance(&named).await;
    assert!(named.clone().with_table("t`; DROP TABLE x").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pools_race_on_one_key_and_one_body_runs() {
    let (Some(first), Some(second)) = (mysql_store().await, mysql_store().await) else {
        return;
    };
    scenarios::two_stores_200_callers_each(first, second).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombies_are_fenced_and_a_lapsed_holder_answers_the_keys_value() {
    let Some(store) = mysql_store().await else {
        return;
    };
    scenarios::zombie_cannot_overwrite_the_new_owner(store.clone()).await;
    scenarios::zombie_fences_are_refused_downstream(store.clone()).await;
    scenarios::a_lapsed_holder_answers_only_what_the_key_records(store).await;
}

/// The child of the crash test, in its own process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by crash_of_a_holder_frees_its_key_after_the_lease, in a child process"]
async fn crash_child() {
    let store = MySqlStore::connect(&mysql_url()).await.unwrap();
    scenarios::crash_child(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_of_a_holder_frees_its_key_after_the_lease() {
    let Some(store) = mysql_store().await else {
        return;
    };
    scenarios::crash_frees_the_key_after_the_lease(store, "crash_child").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_percent_faults_run_each_body_once() {
    // Two pools, each failing 10 % of its operations (half before the server acted, half
    // after: the answer lost) and delaying another 10 %: every key's body runs once and
    // every answered caller gets its value.
    let (Some(first), Some(second)) = (mysql_store().await, mysql_store().await) else {
        return;
    };
    const KEYS: u32 = 60;
    let lease = Duration::from_secs(2);
    let op = Arc::new(Operation::new(namespace("mysql.faults")).lease(lease));
    let bodies: Arc<std::sync::Mutex<std::collections::HashMap<u32, usize>>> = Arc::default();
    let mut tasks = Vec::new();
    for (n, store) in [first, second].into_iter().enumerate() {
        let store = Probe::faulty(store, 7 + n as u64, 0.1, 0.1, Duration::from_millis(20));
        for key in 0..KEYS {
            for _ in 0..2 {
                let (op, store, bodies) = (op.clone(), store.clone(), bodies.clone());
                tasks.push(tokio::spawn(async move {
                    let k = op.key(&key).unwrap();
                    // A failed call is retried, as a client would; it never runs a body
                    // without a claim.
                    for _ in 0..50 {
                        let bodies = bodies.clone();
                        let call = op.run(&store, &k, None, async move {
                            *bodies.lock().unwrap().entry(key).or_default() += 1;
                            Ok::<_, Error>(key * 10)
                        });
                        match call.await {
                            Ok(outcome) => return Some((key, outcome.into_inner())),
                            Err(Error::Store(_) | Error::InProgress) => continue,
                            Err(err) => panic!("key {key}: {err}"),
                        }
                    }
                    None
                }));
            }
        }
    }
    let mut answered = 0;
    for task in tasks {
        if let Some((key, value)) = task.await.unwrap() {
            assert_eq!(
                value,
                key * 10,
                "every answered caller gets its key's value"
            );
            answered += 1;
        }
    }
    let bodies = bodies.lock().unwrap().clone();
    assert!(
        bodies.values().all(|runs| *runs == 1),
        "a body ran twice: {bodies:?}"
    );
    println!(
        "mysql, 10 % faults: {answered} of {} callers answered",
        4 * KEYS
    );
    assert!(answered > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowded_pool_runs_each_body_once() {
    // 600 callers on 300 keys through a pool of 2: claims wait for connections, and a
    // caller told `Store` (no connection in time) retries.
    let pool = match sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(3))
        .connect(&mysql_url())
        .await
    {
        Ok(pool) => pool,
        Err(e) => {
            idem_tests::unavailable::<()>("mysql", e);
            return;
        }
    };
    let store = MySqlStore::from_pool(pool);
    store.migrate().await.unwrap();
    let op = Arc::new(Operation::new(namespace("mysql.crowded")));
    let runs = Runs::default();
    let mut tasks = Vec::new();
    for key in 0..300_u32 {
        for _ in 0..2 {
            let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
            tasks.push(tokio::spawn(async move {
                let k = op.key(&key).unwrap();
                for _ in 0..100 {
                    let runs = runs.clone();
                    let call = op.run(&store, &k, None, async move {
                        runs.hit();
                        Ok::<_, Error>(key)
                    });
                    match call.await {
                        Ok(outcome) => return outcome.into_inner(),
                        Err(Error::Store(_) | Error::InProgress) => continue,
                        Err(err) => panic!("key {key}: {err}"),
                    }
                }
                panic!("key {key}: never answered");
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(runs.count(), 300, "each body once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_rows_are_purged_and_live_ones_kept() {
    let Some(store) = mysql_store().await else {
        return;
    };
    let store = store.with_table("idem_purge").unwrap();
    store.migrate().await.unwrap();
    store.purge_expired().await.unwrap(); // what earlier runs left
    let op = Operation::new(namespace("mysql.purge"));
    let lapsing = op.key(&1).unwrap();
    let live = op.key(&2).unwrap();
    let short = Duration::from_millis(200);
    assert!(matches!(
        idem_runtime::Store::claim(&store, &lapsing, None, short)
            .await
            .unwrap(),
        idem_runtime::Claim::Acquired { .. }
    ));
    assert!(matches!(
        idem_runtime::Store::claim(&store, &live, None, Duration::from_secs(60))
            .await
            .unwrap(),
        idem_runtime::Claim::Acquired { .. }
    ));
    // Until the short lease has lapsed by the server's clock.
    while idem_runtime::Store::lease_left(&store, &lapsing)
        .await
        .unwrap()
        .is_some()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // At least the lapsed claim (an earlier run's claims may lapse meanwhile too).
    assert!(store.purge_expired().await.unwrap() >= 1);
    let rows = |key: idem_runtime::Key| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM idem_purge WHERE `key` = ?")
                .bind(&key.as_bytes()[..])
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(rows(lapsing).await, 0, "the lapsed claim's row is purged");
    assert_eq!(rows(live).await, 1, "the live claim's row stays");
}

/// A table made by an earlier version drew its tokens from a counter: once migrated, the
/// tokens drawn from the `AUTO_INCREMENT` start above the counter's last; the purge leaves
/// the token table only its newest row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_start_above_an_earlier_versions_counter_and_are_purged() {
    let Some(store) = mysql_store().await else {
        return;
    };
    let store = store.with_table("idem_upgraded").unwrap();
    store.migrate().await.unwrap();
    // As an earlier version left it: a counter far ahead, and no token table.
    const LAST: i64 = 5_000_000_000;
    for statement in [
        "DROP TABLE idem_upgraded_tokens".to_string(),
        format!("UPDATE idem_upgraded_token SET last = {LAST} WHERE id = 1"),
    ] {
        sqlx::query(&statement).execute(store.pool()).await.unwrap();
    }
    store.migrate().await.unwrap();
    let op = Operation::new(namespace("mysql.upgraded"));
    for n in 0..5 {
        let claimed =
            idem_runtime::Store::claim(&store, &op.key(&n).unwrap(), None, Duration::from_secs(60))
                .await
                .unwrap();
        let idem_runtime::Claim::Acquired { token } = claimed else {
            panic!("{claimed:?}");
        };
        assert!(
            token.get() > LAST as u64,
            "{token:?} is not above the old counter"
        );
    }
    let rows = || async {
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_upgraded_tokens")
            .fetch_one(store.pool())
            .await
            .unwrap();
        rows
    };
    assert!(rows().await >= 5, "a row per token drawn, until the purge");
    store.purge_expired().await.unwrap();
    assert_eq!(rows().await, 1, "the purge keeps only the newest");
    let claimed =
        idem_runtime::Store::claim(&store, &op.key(&5).unwrap(), None, Duration::from_secs(60))
            .await
            .unwrap();
    assert!(
        matches!(claimed, idem_runtime::Claim::Acquired { token } if token.get() > LAST as u64 + 5),
        "tokens go on growing after the purge: {claimed:?}"
    );
}

/// The server SIGKILLed and started again (a private `mariadbd`): the store's pool
/// reconnects by itself, a recorded result replays, a key held across the crash lapses by
/// the server's clock and is taken over with a larger token (InnoDB kept the
/// `AUTO_INCREMENT` through the crash), and the crashed holder's completion is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_and_restarted_keeps_records_and_tokens_grow() {
    use idem_runtime::{Claim, Store};

    let Some(mut server) = idem_tests::PrivateMariaDb::start() else {
        return;
    };
    let store = MySqlStore::connect(&server.url).await.unwrap();
    store.migrate().await.unwrap();
    let op = Operation::new(namespace("mysql.restart"));
    let (recorded, held) = (op.key(&1).unwrap(), op.key(&2).unwrap());
    let Claim::Acquired { token } = store
        .claim(&recorded, None, Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("a fresh key is free");
    };
    let receipt = idem_runtime::Bytes::from_static(b"receipt 1");
    assert!(store
        .complete(&recorded, token, receipt.clone(), Duration::from_secs(3600))
        .await
        .unwrap());
    let lease = Duration::from_secs(2);
    let Claim::Acquired { token: before } = store.claim(&held, None, lease).await.unwrap() else {
        panic!("a fresh key is free");
    };

    server.kill();
    server.start_again();

    assert_eq!(
        store
            .claim(&recorded, None, Duration::from_secs(60))
            .await
            .unwrap(),
        Claim::Completed {
            value: receipt,
            fingerprint: None
        },
        "a committed result survives the crash"
    );
    // Held until its lease ends by the server's clock, then taken over.
    while store.lease_left(&held).await.unwrap().is_some() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let Claim::Acquired { token: after } = store.claim(&held, None, lease).await.unwrap() else {
        panic!("the lapsed key is taken over");
    };
    assert!(
        after > before,
        "tokens grow through the crash: {after:?} after {before:?}"
    );
    assert!(
        !store
            .complete(&held, before, "zombie".into(), Duration::from_secs(60))
            .await
            .unwrap(),
        "the crashed holder's completion is fenced"
    );
    assert!(store
        .complete(&held, after, "new owner".into(), Duration::from_secs(60))
        .await
        .unwrap());
}

/// A purge beside a claim in a caller's open transaction neither waits for that
/// transaction nor fails: it reads what to delete without locking, and deletes by key. The
/// rows the transaction wrote (its claim, the token it drew) are left, and the next purge
/// deletes the token row; the token table keeps only its newest row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_beside_an_open_transactions_claim_neither_waits_nor_fails() {
    let Some(store) = mysql_store().await else {
        return;
    };
    let store = store
        .with_table("idem_token_purge")
        .unwrap()
        .with_timeout(Duration::from_secs(10));
    store.migrate().await.unwrap();
    let op = Operation::new(namespace("mysql.purge.open"));
    // An expired row for the purge to delete.
    let lapsing = op.key(&0).unwrap();
    let short = Duration::from_millis(100);
    let claimed = idem_runtime::Store::claim(&store, &lapsing, None, short).await;
    assert!(matches!(
        claimed.unwrap(),
        idem_runtime::Claim::Acquired { .. }
    ));
    while idem_runtime::Store::lease_left(&store, &lapsing)
        .await
        .unwrap()
        .is_some()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pool = sqlx::mysql::MySqlPool::connect(&mysql_url()).await.unwrap();
    let mut open = pool.begin().await.unwrap();
    let ran = op
        .run_in_transaction(&store, &mut open, &op.key(&1).unwrap(), None, async |_| {
            Ok::<u8, Error>(1)
        })
        .await;
    assert_eq!(ran.unwrap(), idem_runtime::Outcome::Executed(1));
    // A newer token, so that the open transaction's is below the newest.
    let newer = op.key(&2).unwrap();
    let claimed = idem_runtime::Store::claim(&store, &newer, None, Duration::from_secs(60)).await;
    assert!(matches!(
        claimed.unwrap(),
        idem_runtime::Claim::Acquired { .. }
    ));

    // Waiting for the open transaction would end in the store's timeout, an error.
    assert!(
        store.purge_expired().await.unwrap() >= 1,
        "the expired row went"
    );
    open.commit().await.unwrap();
    store.purge_expired().await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_token_purge_tokens")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(
        rows, 1,
        "the next purge deleted the token row, keeping the newest"
    );
}
