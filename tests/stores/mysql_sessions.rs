//! MySqlStore owns its sessions: whatever the pool's sessions or a caller's transaction were
//! set to, the store never replays what has not committed, never answers a claim or record
//! it did not commit, never queues a pool behind an open transaction's row lock, never leaves
//! an abandoned claim behind, and its purge never waits. Against the MariaDB of
//! `IDEM_MYSQL_URL`.

use idem_runtime::ClaimRequest;
use std::time::Duration;

use idem_runtime::{Claim, Error, MySqlStore, Operation, Outcome, Store, Token};
use idem_tests::scenarios::namespace;
use idem_tests::{mysql_store, mysql_url, Runs};
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};

/// A pool of `size` whose every session first runs `session`.
async fn pool_with(session: &'static str, size: u32) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        .after_connect(move |connection, _| {
            Box::pin(async move {
                sqlx::Executor::execute(connection, sqlx::raw_sql(session)).await?;
                Ok(())
            })
        })
        .connect(&mysql_url())
        .await
        .expect("connect")
}

/// A migrated store on a table of the test's own: another test's open transaction (its gap
/// locks on a small table) never holds this one's inserts.
async fn store_on(table: &str) -> Option<MySqlStore> {
    let store = mysql_store().await?.with_table(table).unwrap();
    store.migrate().await.unwrap();
    Some(store)
}

/// A call of the key `k` of `op` on `store`, whose body counts its runs.
async fn call(store: &MySqlStore, op: &Operation, runs: &Runs) -> Result<Outcome<i64>, Error> {
    let key = op.key(&"k").unwrap();
    op.run(store, &key, None, async {
        runs.hit();
        Ok::<_, Error>(1)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_whose_sessions_read_uncommitted_or_do_not_autocommit_are_refused_before_any_body_runs(
) {
    if mysql_store().await.is_none() {
        return;
    }
    for (session, named) in [
        (
            "SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED",
            "READ UNCOMMITTED",
        ),
        ("SET SESSION autocommit = 0", "autocommit"),
    ] {
        let store = MySqlStore::from_pool(pool_with(session, 2).await);
        let runs = Runs::default();
        let op = Operation::new(namespace("sessions.refused"));
        match call(&store, &op, &runs).await {
            Err(Error::Config(err)) => assert!(err.to_string().contains(named), "{err}"),
            other => panic!("{session}: expected Error::Config, got {other:?}"),
        }
        assert_eq!(runs.count(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_sets_sessions_that_commit_and_read_committed_data() {
    if mysql_store().await.is_none() {
        return;
    }
    let store = MySqlStore::connect(&mysql_url()).await.unwrap();
    let (isolation, autocommit): (String, i64) = sqlx::query_as(
        "SELECT CAST(@@SESSION.tx_isolation AS CHAR), CAST(@@SESSION.autocommit AS SIGNED)",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!((isolation.as_str(), autocommit), ("READ-COMMITTED", 1));
    let runs = Runs::default();
    let op = Operation::new(namespace("sessions.connect"));
    assert_eq!(
        call(&store, &op, &runs).await.unwrap(),
        Outcome::Executed(1)
    );
    assert_eq!(
        call(&store, &op, &runs).await.unwrap(),
        Outcome::Replayed(1)
    );
}

/// The defect: a holder's transaction claims and completes a key, uncommitted; a caller
/// whose transaction reads uncommitted data must not be handed that result (the holder then
/// rolls back, and the key would have given two values).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_at_read_uncommitted_is_never_handed_an_uncommitted_result() {
    let Some(store) = store_on("idem_sessions_dirty").await else {
        return;
    };
    let pool = pool_with("SET SESSION autocommit = 1", 4).await;
    let op = Operation::new(namespace("sessions.dirty"));
    let key = op.key(&"k").unwrap();
    let mut holder = pool.begin().await.unwrap();
    let held = op
        .run_in_transaction(&store, &mut holder, &key, None, async |_| {
            Ok::<i64, Error>(1)
        })
        .await;
    assert_eq!(held.unwrap(), Outcome::Executed(1));

    let dirty = pool_with(
        "SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED",
        1,
    )
    .await;
    let mut reader = dirty.begin().await.unwrap();
    let runs = Runs::default();
    let read = op
        .run_in_transaction(&store, &mut reader, &key, None, async |_| {
            runs.hit();
            Ok::<i64, Error>(2)
        })
        .await;
    assert!(matches!(read, Err(Error::Config(_))), "{read:?}");
    assert_eq!(runs.count(), 0);
    reader.rollback().await.unwrap();
    holder.rollback().await.unwrap();

    // Rolled back: the key was never answered, and runs once now.
    let mut retry = pool.begin().await.unwrap();
    let ran = op
        .run_in_transaction(&store, &mut retry, &key, None, async |_| {
            Ok::<i64, Error>(3)
        })
        .await;
    assert_eq!(ran.unwrap(), Outcome::Executed(3));
    retry.commit().await.unwrap();
}

/// An open transaction holds a key's row: a crowd of ordinary callers of that key wait on
/// the server a second at a time and are told it is in progress, so the pool keeps
/// connections for fresh keys; when the holder rolls back, none of the crowd's abandoned
/// inserts lands, and the key runs at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_transaction_holds_its_key_but_not_the_pool() {
    let Some(store) = store_on("idem_sessions_open").await else {
        return;
    };
    let callers = pool_with("SET SESSION autocommit = 1", 2).await;
    let op = Operation::new(namespace("sessions.open")).wait(Duration::from_secs(4));
    let key = op.key(&"held").unwrap();
    let mut holder = callers.begin().await.unwrap();
    let held = op
        .run_in_transaction(&store, &mut holder, &key, None, async |_| {
            Ok::<i64, Error>(1)
        })
        .await;
    assert_eq!(held.unwrap(), Outcome::Executed(1));

    // 16 callers of the held key on a store whose pool has 8 connections.
    let runs = Runs::default();
    let crowd: Vec<_> = (0..16)
        .map(|_| {
            let (op, store, key, runs) = (op.clone(), store.clone(), key, runs.clone());
            tokio::spawn(async move {
                op.run(&store, &key, None, async {
                    runs.hit();
                    Ok::<i64, Error>(2)
                })
                .await
            })
        })
        .collect();
    // Fresh keys keep answering meanwhile (the holder's transaction locks its row, and no
    // range of the table's token index that new claims insert into).
    let fresh = (0..8).map(|i| (i, op.key(&format!("fresh.{i}")).unwrap()));
    for (i, fresh) in fresh {
        let ran = op
            .run(&store, &fresh, None, async { Ok::<i64, Error>(i) })
            .await;
        assert_eq!(ran.unwrap(), Outcome::Executed(i), "fresh key {i}");
    }
    for caller in crowd {
        let answered = caller.await.unwrap();
        assert!(matches!(answered, Err(Error::InProgress)), "{answered:?}");
    }
    assert_eq!(runs.count(), 0, "no body of the held key ran");

    // Every caller has answered; the holder rolls back: the key is free at once, not held
    // by an insert a caller abandoned.
    holder.rollback().await.unwrap();
    let claimed = store
        .claim(&ClaimRequest::new(&key, Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(matches!(claimed, Claim::Acquired { .. }), "{claimed:?}");
}

/// A lapsed claim taken over in an open transaction is locked by it: the purge skips that
/// row and deletes the other expired rows, without waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_purge_skips_a_row_an_open_transaction_holds() {
    let Some(store) = store_on("idem_sessions_purge").await else {
        return;
    };
    let callers = pool_with("SET SESSION autocommit = 1", 2).await;
    let op = Operation::new(namespace("sessions.purge"));
    let (taken, free) = (op.key(&"taken").unwrap(), op.key(&"free").unwrap());
    for key in [&taken, &free] {
        // Not remembered once lapsed, so that the purge may take it at once.
        let request = ClaimRequest::new(key, Duration::from_millis(1)).ttl(Duration::ZERO);
        let claimed = store.claim(&request).await.unwrap();
        assert!(matches!(claimed, Claim::Acquired { .. }));
        idem_tests::until_lapsed(&store, key).await;
    }
    let mut holder = callers.begin().await.unwrap();
    let held = op
        .run_in_transaction(&store, &mut holder, &taken, None, async |_| {
            Ok::<i64, Error>(1)
        })
        .await;
    assert_eq!(held.unwrap(), Outcome::Executed(1));

    let purged = store.purge_expired().await;
    assert!(purged.as_ref().is_ok_and(|n| *n >= 1), "{purged:?}");
    holder.commit().await.unwrap();
    let replay = op
        .run(&store, &taken, None, async { Ok::<i64, Error>(2) })
        .await;
    assert_eq!(
        replay.unwrap(),
        Outcome::Replayed(1),
        "the held row was kept"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_reads_from_an_unsigned_column() {
    let Some(store) = mysql_store().await else {
        return;
    };
    let token: Token = sqlx::query_scalar("SELECT CAST(42 AS UNSIGNED)")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(token, Token::new(42));
    let token: Token = sqlx::query_scalar("SELECT CAST(43 AS SIGNED)")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(token, Token::new(43));
}

/// A record over half the server's `max_allowed_packet` completes in a caller's
/// transaction and replays: it goes bound, not as a literal twice its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_over_half_the_packet_bound_completes_in_a_transaction() {
    let Some(store) = store_on("idem_sessions_large").await else {
        return;
    };
    let packet: u64 = sqlx::query_scalar("SELECT @@max_allowed_packet")
        .fetch_one(store.pool())
        .await
        .unwrap();
    // Its JSON is the string with quotes: 60 % of a packet, over a packet once in hex.
    let large = "x".repeat(usize::try_from(packet * 3 / 5).unwrap());
    let op = Operation::new(namespace("sessions.large"));
    let key = op.key(&"k").unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let ran = op
        .run_in_transaction(&store, &mut tx, &key, None, async |_| {
            Ok::<String, Error>(large.clone())
        })
        .await
        .unwrap();
    assert!(matches!(&ran, Outcome::Executed(value) if value.len() == large.len()));
    tx.commit().await.unwrap();
    let replayed = op
        .run(&store, &key, None, async {
            Ok::<String, Error>(String::new())
        })
        .await
        .unwrap();
    assert!(
        matches!(&replayed, Outcome::Replayed(value) if *value == large),
        "the record replays whole"
    );
}
