//! Where the transactional stores differ: SQLite's savepoint and deferred transactions,
//! MySQL's refusal outside a transaction, a key held by an ordinary call.

use crate::{lite, my};

/// SQLite: a connection outside a transaction gets one from the call's savepoint, which
/// commits with the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_outside_a_transaction_the_savepoint_is_the_transaction() {
    use idem_runtime::{Error, Operation, Outcome};

    let (store, pool) = lite::open("tx.outside").await.unwrap();
    sqlx::query("CREATE TABLE journal (transfer TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let op = Operation::new(idem_tests::scenarios::namespace("tx.outside"));
    let key = op.key(&"t").unwrap();
    let mut conn = pool.acquire().await.unwrap(); // no BEGIN
    let ran = op
        .run_in_transaction(&store, &mut conn, &key, None, async |tx| {
            sqlx::query("INSERT INTO journal VALUES ('t')")
                .execute(&mut *tx)
                .await
                .map_err(Error::store)?;
            Ok::<_, Error>(1_i64)
        })
        .await;
    assert_eq!(ran.unwrap(), Outcome::Executed(1));
    drop(conn);
    // Committed: another connection sees the effect, and the record replays.
    let lines: i64 = sqlx::query_scalar("SELECT count(*) FROM journal")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(lines, 1);
    let replayed = op
        .run(&store, &key, None, async { Ok::<i64, Error>(2) })
        .await;
    assert_eq!(replayed.unwrap(), Outcome::Replayed(1));
}

/// SQLite: a claim in a transaction on the store's own pool needs no other connection of
/// it. Callers that held every pooled connection in a transaction used to find the first
/// claim waiting for one (to check the table once), held by the caller itself or by another
/// caller waiting for the write lock that transaction holds: every call failed with
/// `Error::Store` after the timeout (found by the histories in transactions). Here the pool
/// has one connection, the caller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_claim_on_the_stores_only_connection_needs_no_other() {
    use idem_runtime::{Error, Operation, Outcome, SqliteStore};
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "transactions-one-connection-{}.db",
        std::process::id()
    ));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true);
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .unwrap();
    let store = SqliteStore::from_pool(pool).with_timeout(std::time::Duration::from_secs(1));
    store.migrate().await.unwrap();
    let op = Operation::new(idem_tests::scenarios::namespace("tx.one-connection"));
    let key = op.key(&"t").unwrap();
    for expected in [Outcome::Executed(1), Outcome::Replayed(1)] {
        let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
        let ran = op
            .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<_, Error>(1_i64))
            .await;
        assert_eq!(ran.unwrap(), expected);
        tx.commit().await.unwrap();
    }
}

/// MySQL: the same, for its checks of the server and the table, made once per store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_claim_on_the_stores_only_connection_needs_no_other() {
    use idem_runtime::{Error, MySqlStore, Operation, Outcome};

    let url = idem_tests::mysql_url();
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(std::time::Duration::from_secs(1))
        .connect(&url)
        .await;
    let pool = match pool {
        Ok(pool) => pool,
        Err(err) => return idem_tests::unavailable(&format!("mysql at {url}"), err).unwrap_or(()),
    };
    let store = MySqlStore::from_pool(pool);
    store.migrate().await.unwrap();
    let store = MySqlStore::from_pool(store.pool().clone()); // its checks not made yet
    let op = Operation::new(idem_tests::scenarios::namespace("tx.my-one-connection"));
    let key = op.key(&"t").unwrap();
    for expected in [Outcome::Executed(1), Outcome::Replayed(1)] {
        let mut tx = store.pool().begin().await.unwrap();
        let ran = op
            .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<_, Error>(1_i64))
            .await;
        assert_eq!(ran.unwrap(), expected);
        tx.commit().await.unwrap();
    }
}

/// SQLite: a deferred transaction that read the file before another transaction recorded
/// the key cannot take the lock after it; its claim fails closed, saying to retry with
/// `BEGIN IMMEDIATE`, and the retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_stale_deferred_transaction_fails_closed_and_its_retry_replays() {
    use idem_runtime::{Error, Operation, Outcome};
    use idem_tests::Runs;

    let (store, pool) = lite::open("tx.snapshot").await.unwrap();
    let op = Operation::new(idem_tests::scenarios::namespace("tx.snapshot"));
    let key = op.key(&"t").unwrap();
    // A deferred transaction reads: its snapshot is fixed from here.
    let mut stale = pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM sqlite_master")
        .execute(&mut *stale)
        .await
        .unwrap();
    // Another transaction records the key and commits.
    let mut first = lite::begin(&pool).await;
    let ran = op
        .run_in_transaction(&store, &mut first, &key, None, async |_| {
            Ok::<i64, Error>(1)
        })
        .await;
    assert_eq!(ran.unwrap(), Outcome::Executed(1));
    first.commit().await.unwrap();
    // The stale transaction's claim: refused, the body not run.
    let runs = Runs::default();
    let refused = op
        .run_in_transaction(&store, &mut stale, &key, None, async |_| {
            runs.hit();
            Ok::<i64, Error>(2)
        })
        .await;
    match refused {
        Err(Error::Store(err)) => assert!(err.to_string().contains("BEGIN IMMEDIATE"), "{err}"),
        other => panic!("expected a store error, got {other:?}"),
    }
    assert_eq!(runs.count(), 0);
    stale.rollback().await.unwrap();
    let mut retry = lite::begin(&pool).await;
    let replayed = op
        .run_in_transaction(&store, &mut retry, &key, None, async |_| {
            Ok::<i64, Error>(3)
        })
        .await;
    assert_eq!(replayed.unwrap(), Outcome::Replayed(1));
    retry.commit().await.unwrap();
}

/// SQLite: a claim sets the connection's busy timeout to the call's wait while it takes the
/// lock, and puts the caller's back whether it took the key, found its record, or gave up
/// waiting for another transaction's lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_claim_puts_the_callers_busy_timeout_back() {
    use std::time::Duration;

    use idem_runtime::{Error, Operation, Outcome};

    async fn busy_timeout(conn: &mut sqlx::SqliteConnection) -> i64 {
        sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(conn)
            .await
            .unwrap()
    }
    async fn set(conn: &mut sqlx::SqliteConnection, millis: i64) {
        sqlx::query(&format!("PRAGMA busy_timeout = {millis}"))
            .execute(conn)
            .await
            .unwrap();
    }

    let (store, pool) = lite::open("tx.busy").await.unwrap();
    let op = Operation::new(idem_tests::scenarios::namespace("tx.busy"))
        .wait(Duration::from_millis(100));
    let key = op.key(&"t").unwrap();
    for (millis, expected) in [(4321, Outcome::Executed(1)), (4322, Outcome::Replayed(1))] {
        let mut tx = lite::begin(&pool).await;
        set(&mut tx, millis).await;
        let ran = op
            .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<i64, Error>(1))
            .await;
        assert_eq!(ran.unwrap(), expected);
        assert_eq!(busy_timeout(&mut tx).await, millis, "after {expected:?}");
        tx.commit().await.unwrap();
    }
    // Another transaction holds the file's write lock past the call's wait.
    let holder = lite::begin(&pool).await;
    let mut tx = lite::begin_without_waiting(&pool).await;
    set(&mut tx, 4323).await;
    let waited = op
        .run_in_transaction(&store, &mut tx, &op.key(&"u").unwrap(), None, async |_| {
            Ok::<i64, Error>(2)
        })
        .await;
    assert!(matches!(waited, Err(Error::InProgress)), "{waited:?}");
    assert_eq!(busy_timeout(&mut tx).await, 4323, "after giving up");
    tx.rollback().await.unwrap();
    holder.rollback().await.unwrap();
}

/// MySQL: outside a transaction each statement would commit by itself, the claim before the
/// body's writes; the call is refused and nothing is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_outside_a_transaction_is_refused_and_nothing_is_claimed() {
    use idem_runtime::{Error, Operation, Outcome};
    use idem_tests::Runs;

    let Some((store, pool)) = my::connect().await else {
        return;
    };
    let op = Operation::new(idem_tests::scenarios::namespace("tx.outside"));
    let key = op.key(&"t").unwrap();
    let runs = Runs::default();
    let mut conn = pool.acquire().await.unwrap(); // autocommit, no BEGIN
    let refused = op
        .run_in_transaction(&store, &mut conn, &key, None, async |_| {
            runs.hit();
            Ok::<i64, Error>(1)
        })
        .await;
    match refused {
        Err(Error::Store(err)) => assert!(err.to_string().contains("not in one"), "{err}"),
        other => panic!("expected a store error, got {other:?}"),
    }
    assert_eq!(runs.count(), 0);
    let mut tx = my::begin(&pool).await;
    let ran = op
        .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<i64, Error>(2))
        .await;
    assert_eq!(ran.unwrap(), Outcome::Executed(2), "nothing was claimed");
    tx.commit().await.unwrap();
}

/// SQLite and MySQL: a key held by an ordinary call in progress answers `InProgress` at once
/// inside a transaction, which holds what that call needs to record (SQLite's file lock, a
/// MySQL row lock once read), instead of polling for a result that cannot land meanwhile.
/// With an hour's wait, a call that polled would still be waiting at the bound below.
mod held_by_an_ordinary_call {
    use std::time::Duration;

    use idem_runtime::store::Transactional;
    use idem_runtime::{Claim, Error, Key, Operation, Store};
    use idem_tests::Runs;

    /// An ordinary call's claim of a fresh key, held for an hour.
    pub async fn hold(store: &impl Store) -> (Operation, Key) {
        let op = Operation::new(idem_tests::scenarios::namespace("tx.held"))
            .wait(Duration::from_secs(3600));
        let key = op.key(&"t").unwrap();
        let held = store
            .claim(&idem_runtime::ClaimRequest::new(
                &key,
                Duration::from_secs(3600),
            ))
            .await;
        assert!(matches!(held.unwrap(), Claim::Acquired { .. }));
        (op, key)
    }

    pub async fn answers_in_progress_at_once<S: Transactional>(
        store: &S,
        connection: &mut S::Connection,
        (op, key): (Operation, Key),
    ) {
        let runs = Runs::default();
        let answered = tokio::time::timeout(
            Duration::from_secs(60),
            op.run_in_transaction(store, connection, &key, None, async |_| {
                runs.hit();
                Ok::<i64, Error>(1)
            }),
        )
        .await
        .expect("answered without polling the holder");
        assert!(matches!(answered, Err(Error::InProgress)), "{answered:?}");
        assert_eq!(runs.count(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_key_held_by_an_ordinary_call_answers_in_progress_at_once() {
    let (store, pool) = lite::open("tx.held").await.unwrap();
    let held = held_by_an_ordinary_call::hold(&store).await;
    let mut tx = lite::begin(&pool).await;
    held_by_an_ordinary_call::answers_in_progress_at_once(&store, &mut tx, held).await;
    tx.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_key_held_by_an_ordinary_call_answers_in_progress_at_once() {
    let Some((store, pool)) = my::connect().await else {
        return;
    };
    let held = held_by_an_ordinary_call::hold(&store).await;
    let mut tx = my::begin(&pool).await;
    held_by_an_ordinary_call::answers_in_progress_at_once(&store, &mut tx, held).await;
    tx.rollback().await.unwrap();
}
