//! `MySqlStore` on the MariaDB server of this machine (written for MySQL 8 too): the store
//! contract, two pools racing on one key, zombies fenced, a lapsed holder, a holder
//! SIGKILLed mid-body, 10 % faults, a crowded pool, tokens after an upgrade; and on a private
//! server of the test's own, SIGKILLed and started again.

use idem_runtime::ClaimRequest;
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::testkit;
use idem_runtime::{Error, MySqlStore, Operation};
use idem_tests::scenarios::{self, namespace};
use idem_tests::{mysql_store, mysql_url, until_lapsed, Probe, Runs};

/// A store on a table of the test's own, migrated; `None` when the server is unavailable.
async fn on_table(table: &str) -> Option<MySqlStore> {
    let store = mysql_store().await?.with_table(table).unwrap();
    store.migrate().await.unwrap();
    Some(store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_store_keeps_the_store_contract() {
    let (Some(store), Some(other)) = (mysql_store().await, mysql_store().await) else {
        return;
    };
    testkit::conformance(&store).await;
    testkit::conformance_across(&store, &other).await;
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
    let Some(store) = on_table("idem_purge").await else {
        return;
    };
    store.purge_expired().await.unwrap(); // what earlier runs left
    let op = Operation::new(namespace("mysql.purge"));
    let lapsing = op.key(&1).unwrap();
    let live = op.key(&2).unwrap();
    let remembered = op.key(&3).unwrap();
    let short = Duration::from_millis(200);
    // Remembered for no time once lapsed, and for a day: the purge takes the first only.
    for (key, ttl) in [
        (&lapsing, Duration::ZERO),
        (&remembered, Duration::from_secs(86_400)),
    ] {
        let request = idem_runtime::ClaimRequest::new(key, short).ttl(ttl);
        assert!(matches!(
            idem_runtime::Store::claim(&store, &request).await.unwrap(),
            idem_runtime::Claim::Acquired { .. }
        ));
    }
    assert!(matches!(
        idem_runtime::Store::claim(
            &store,
            &idem_runtime::ClaimRequest::new(&live, Duration::from_secs(60))
        )
        .await
        .unwrap(),
        idem_runtime::Claim::Acquired { .. }
    ));
    // Until the short leases have lapsed by the server's clock.
    until_lapsed(&store, &lapsing).await;
    until_lapsed(&store, &remembered).await;
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
    assert_eq!(
        rows(remembered).await,
        1,
        "a claim that lapsed unsettled stays for its call's TTL, so that its next claim is told"
    );
    idem_runtime::Store::remove(&store, &remembered)
        .await
        .unwrap();
    assert_eq!(rows(remembered).await, 0, "a removal forgets it");
}

/// A table made by an earlier version, whose tokens came from tables of their own (a
/// counter, then an `AUTO_INCREMENT` of its own), is upgraded once by two processes
/// migrating at the same time: its records still replay, and every token taken after (a
/// new key, a lapsed row taken over) is above every token it drew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_versions_table_is_upgraded_and_its_tokens_start_above_it() {
    let Some(store) = mysql_store().await else {
        return;
    };
    // The first versions kept a counter; later ones an `AUTO_INCREMENT` table above it.
    for drawn in [None, Some(6_000_000_000)] {
        let store = store.clone().with_table("idem_upgraded").unwrap();
        upgrade_from_an_earlier_version(&store, 5_000_000_000, drawn).await;
    }
}

/// An earlier version's table with tokens up to 4e9 in its rows, `counter` in its counter
/// and `drawn` in its token table (if it had one), migrated by two processes at once.
async fn upgrade_from_an_earlier_version(store: &MySqlStore, counter: i64, drawn: Option<i64>) {
    use idem_runtime::{Claim, Store};

    let pool = store.pool().clone();
    let in_rows = 4_000_000_000_i64;
    let mut statements = vec![
        "DROP TABLE IF EXISTS idem_upgraded, idem_upgraded_token, idem_upgraded_tokens".to_string(),
        "CREATE TABLE idem_upgraded (`key` VARBINARY(32) NOT NULL PRIMARY KEY, \
         token BIGINT NOT NULL, completed BOOLEAN NOT NULL, fingerprint VARBINARY(32) NULL, \
         value LONGBLOB NULL, expires_at BIGINT NOT NULL, \
         INDEX idem_upgraded_expires_at (expires_at)) ENGINE = InnoDB"
            .to_string(),
        "CREATE TABLE idem_upgraded_token (id TINYINT NOT NULL PRIMARY KEY, last BIGINT NOT NULL)"
            .to_string(),
        format!("INSERT INTO idem_upgraded_token VALUES (1, {counter})"),
    ];
    if let Some(drawn) = drawn {
        statements.push(
            "CREATE TABLE idem_upgraded_tokens (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY)"
                .to_string(),
        );
        statements.push(format!("INSERT INTO idem_upgraded_tokens VALUES ({drawn})"));
    }
    for statement in statements {
        sqlx::query(&statement).execute(&pool).await.unwrap();
    }
    let op = Operation::new(namespace("mysql.upgraded"));
    let (recorded, lapsed) = (op.key(&"recorded").unwrap(), op.key(&"lapsed").unwrap());
    let now = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)) DIV 1000)";
    for (key, token, completed, value, lease) in [
        (&recorded, in_rows, true, Some(&b"receipt1"[..]), 3_600_000),
        (&lapsed, in_rows - 1, false, None, -1),
    ] {
        let insert = format!("INSERT INTO idem_upgraded VALUES (?, ?, ?, NULL, ?, {now} + ?)");
        sqlx::query(&insert)
            .bind(&key.as_bytes()[..])
            .bind(token)
            .bind(completed)
            .bind(value)
            .bind(lease)
            .execute(&pool)
            .await
            .unwrap();
    }

    // Until migrated, its claims are refused (an insert would give each the token 0), in
    // a transaction too, and nothing is written.
    let fresh = op.key(&"fresh").unwrap();
    let claimed = store
        .claim(&ClaimRequest::new(&fresh, Duration::from_secs(60)))
        .await;
    assert!(
        matches!(&claimed, Err(Error::Store(e)) if e.to_string().contains("migrate()")),
        "{claimed:?}"
    );
    let mut tx = pool.begin().await.unwrap();
    let ran = op
        .run_in_transaction(store, &mut tx, &fresh, None, async |_| Ok::<u8, Error>(1))
        .await;
    assert!(matches!(&ran, Err(Error::Store(_))), "{ran:?}");
    tx.rollback().await.unwrap();
    // Two processes' pools.
    let other = mysql_store()
        .await
        .unwrap()
        .with_table("idem_upgraded")
        .unwrap();
    let (first, second) = tokio::join!(store.migrate(), other.migrate());
    first.unwrap();
    second.unwrap();
    store.migrate().await.unwrap(); // and again, once upgraded: nothing to do

    assert_eq!(
        store
            .claim(&ClaimRequest::new(&recorded, Duration::from_secs(60)))
            .await
            .unwrap(),
        Claim::Completed {
            value: idem_runtime::Bytes::from_static(b"receipt1"),
            fingerprint: None
        },
        "a record of the earlier version replays"
    );
    for key in [lapsed, fresh, op.key(&"new").unwrap()] {
        let claimed = store
            .claim(&ClaimRequest::new(&key, Duration::from_secs(60)))
            .await;
        let Claim::Acquired { token, .. } = claimed.unwrap() else {
            panic!("a lapsed row or a new key is taken");
        };
        assert!(
            token.get() > drawn.unwrap_or(counter) as u64,
            "{token:?} is not above the earlier version's tokens"
        );
    }
}

/// InnoDB keeps the `AUTO_INCREMENT` past the rows that held the largest tokens: a key
/// claimed after they were purged, or removed, takes a larger token still.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_grow_after_the_rows_with_the_largest_are_deleted() {
    use idem_runtime::{Claim, Store};

    let Some(store) = on_table("idem_token_growth").await else {
        return;
    };
    let op = Operation::new(namespace("mysql.token.growth"));
    let mut last = 0;
    for round in 0..3 {
        let key = op.key(&round).unwrap();
        let lease = Duration::from_millis(100);
        // Not remembered once lapsed: the purge takes it at once.
        let request = ClaimRequest::new(&key, lease).ttl(Duration::ZERO);
        let Claim::Acquired { token, .. } = store.claim(&request).await.unwrap() else {
            panic!("a fresh key is free");
        };
        assert!(token.get() > last, "{token:?} after {last}");
        last = token.get();
        if round % 2 == 0 {
            assert!(store.remove(&key).await.unwrap());
        } else {
            until_lapsed(&store, &key).await;
            assert!(store.purge_expired().await.unwrap() >= 1);
        }
        let left: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM idem_token_growth WHERE `key` = ?")
                .bind(&key.as_bytes()[..])
                .fetch_one(store.pool())
                .await
                .unwrap();
        assert_eq!(left, 0, "the row with the largest token is gone");
    }
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
    let Claim::Acquired { token, .. } = store
        .claim(&ClaimRequest::new(&recorded, Duration::from_secs(60)))
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
    let Claim::Acquired { token: before, .. } =
        store.claim(&ClaimRequest::new(&held, lease)).await.unwrap()
    else {
        panic!("a fresh key is free");
    };
    // The largest token drawn, in a row deleted before the crash: a server that took its
    // AUTO_INCREMENT from the rows on restart would give it again.
    let removed = op.key(&3).unwrap();
    let Claim::Acquired { token: largest, .. } = store
        .claim(&ClaimRequest::new(&removed, lease))
        .await
        .unwrap()
    else {
        panic!("a fresh key is free");
    };
    assert!(store.remove(&removed).await.unwrap());

    server.kill();
    server.start_again();

    assert_eq!(
        store
            .claim(&ClaimRequest::new(&recorded, Duration::from_secs(60)))
            .await
            .unwrap(),
        Claim::Completed {
            value: receipt,
            fingerprint: None
        },
        "a committed result survives the crash"
    );
    // Held until its lease ends by the server's clock, then taken over.
    until_lapsed(&store, &held).await;
    let Claim::Acquired { token: after, .. } =
        store.claim(&ClaimRequest::new(&held, lease)).await.unwrap()
    else {
        panic!("the lapsed key is taken over");
    };
    assert!(
        after > largest && largest > before,
        "tokens grow through the crash: {after:?} after {largest:?} and {before:?}"
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
/// transaction's claim is left to it, and commits with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_beside_an_open_transactions_claim_neither_waits_nor_fails() {
    let Some(store) = on_table("idem_open_purge").await else {
        return;
    };
    let store = store.with_timeout(Duration::from_secs(10));
    let op = Operation::new(namespace("mysql.purge.open"));
    // An expired row for the purge to delete.
    let lapsing = op.key(&0).unwrap();
    let short = Duration::from_millis(100);
    let request = idem_runtime::ClaimRequest::new(&lapsing, short).ttl(Duration::ZERO);
    let claimed = idem_runtime::Store::claim(&store, &request).await;
    assert!(matches!(
        claimed.unwrap(),
        idem_runtime::Claim::Acquired { .. }
    ));
    until_lapsed(&store, &lapsing).await;
    let pool = sqlx::mysql::MySqlPool::connect(&mysql_url()).await.unwrap();
    let mut open = pool.begin().await.unwrap();
    let in_open = op.key(&1).unwrap();
    let ran = op
        .run_in_transaction(&store, &mut open, &in_open, None, async |_| {
            Ok::<u8, Error>(1)
        })
        .await;
    assert_eq!(ran.unwrap(), idem_runtime::Outcome::Executed(1));

    // Waiting for the open transaction would end in the store's timeout, an error.
    assert!(
        store.purge_expired().await.unwrap() >= 1,
        "the expired row went"
    );
    open.commit().await.unwrap();
    let replayed = op
        .run_in_transaction(
            &store,
            &mut pool.begin().await.unwrap(),
            &in_open,
            None,
            async |_| Ok::<u8, Error>(2),
        )
        .await;
    assert_eq!(
        replayed.unwrap(),
        idem_runtime::Outcome::Replayed(1),
        "the open transaction's claim was left to it and committed with it"
    );
}

/// The purge beside an open transaction that took an expired row over (a completed record
/// past its TTL, and a claim that lapsed unsettled and is kept for its call's TTL, each
/// claimed again in the caller's transaction, which then holds the row's lock): the purge
/// answers at once, under a store timeout of 2 s, and leaves the row to the transaction.
/// Twenty rounds, each on keys of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_beside_an_open_transaction_that_took_an_expired_row_answers_at_once() {
    let Some(store) = on_table("idem_open_takeover").await else {
        return;
    };
    let store = store.with_timeout(Duration::from_secs(2));
    let pool = sqlx::mysql::MySqlPool::connect(&mysql_url()).await.unwrap();
    let op = Operation::new(namespace("mysql.purge.takeover"))
        .lease(Duration::from_millis(200))
        .ttl(Duration::from_millis(300));
    for round in 0..20_u32 {
        let (completed, lapsed) = (
            op.key(&(round, "c")).unwrap(),
            op.key(&(round, "l")).unwrap(),
        );
        // A record past its TTL, and a claim whose lease ran out, kept for a day.
        let done = op
            .run(&store, &completed, None, async { Ok::<u32, Error>(1) })
            .await
            .unwrap();
        assert_eq!(done, idem_runtime::Outcome::Executed(1));
        let request =
            ClaimRequest::new(&lapsed, Duration::from_millis(50)).ttl(Duration::from_secs(86_400));
        let claimed = idem_runtime::Store::claim(&store, &request).await.unwrap();
        assert!(matches!(claimed, idem_runtime::Claim::Acquired { .. }));
        until_lapsed(&store, &lapsed).await;
        idem_tests::failover::until("the record expired", || {
            let (store, completed) = (store.clone(), completed);
            async move {
                idem_runtime::Store::lookup(&store, &completed)
                    .await
                    .unwrap()
                    .is_none()
            }
        })
        .await;
        let mut open = pool.begin().await.unwrap();
        for key in [&completed, &lapsed] {
            let ran = op
                .run_in_transaction(&store, &mut open, key, None, async |_| Ok::<u32, Error>(2))
                .await;
            assert_eq!(
                ran.unwrap(),
                idem_runtime::Outcome::Executed(2),
                "round {round}"
            );
        }
        let started = std::time::Instant::now();
        let purged = store.purge_expired().await;
        assert!(
            purged.is_ok(),
            "round {round}: {purged:?} after {:?}",
            started.elapsed()
        );
        open.commit().await.unwrap();
        for key in [&completed, &lapsed] {
            let replayed = op
                .run(&store, key, None, async { Ok::<u32, Error>(3) })
                .await;
            assert_eq!(
                replayed.unwrap(),
                idem_runtime::Outcome::Replayed(2),
                "round {round}: the transaction's record was left to it"
            );
        }
    }
}

/// A table made by an earlier version in a `latin1` database (its text columns in the
/// database's default character set) is made UTF-8 by `migrate`: a namespace and a label
/// beyond ASCII read back as they were written, and a prefix of them finds the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latin1_table_lists_and_filters_non_ascii_namespaces() {
    use idem_runtime::admin::{Admin, Filter};

    let Some(store) = mysql_store().await else {
        return;
    };
    let table = format!("idem_latin1_{}", std::process::id());
    let pool = store.pool().clone();
    sqlx::query(&format!("DROP TABLE IF EXISTS `{table}`"))
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(&format!(
        "CREATE TABLE `{table}` (`key` VARBINARY(32) NOT NULL PRIMARY KEY, \
         token BIGINT NOT NULL AUTO_INCREMENT, completed BOOLEAN NOT NULL, \
         fingerprint VARBINARY(32) NULL, value LONGBLOB NULL, expires_at BIGINT NOT NULL, \
         namespace TEXT NULL, label TEXT NULL, holder TEXT NULL, lease_ms BIGINT NULL, \
         step BOOLEAN NULL, ttl_ms BIGINT NULL, taken_over BOOLEAN NULL, INDEX (token), \
         INDEX (expires_at)) ENGINE = InnoDB DEFAULT CHARSET = latin1"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let store = store.with_table(&table).unwrap();
    store.migrate().await.unwrap();
    let prefix = format!("{}.café.日本", namespace("mysql.latin1"));
    let op = Operation::new(format!("{prefix}.créer"));
    let key = op.key(&1).unwrap();
    let ran = idem_runtime::labelled(
        "commande n°1 ✓",
        op.run(&store, &key, None, async { Ok::<u8, Error>(1) }),
    )
    .await;
    assert_eq!(ran.unwrap(), idem_runtime::Outcome::Executed(1));
    let page = store.list(&Filter::namespace(&prefix), None).await.unwrap();
    assert_eq!(page.entries().len(), 1, "{page:?}");
    let entry = &page.entries()[0];
    assert_eq!(entry.namespace(), Some(op.namespace()));
    assert_eq!(entry.label(), Some("commande n°1 ✓"));
    let labelled = store
        .list(&Filter::all().label("commande n°1 ✓"), None)
        .await
        .unwrap();
    assert_eq!(labelled.entries().len(), 1);
    sqlx::query(&format!("DROP TABLE `{table}`"))
        .execute(&pool)
        .await
        .unwrap();
}
