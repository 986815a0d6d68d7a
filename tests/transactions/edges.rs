//! Claims in the caller's PostgreSQL transaction where transactions get hard: calls nested
//! in calls, a transaction its caller already aborted, many calls in one transaction, a
//! migration beside an open transaction, an ordinary call that gives up on one, long
//! leases, clashing names, and snapshots that cannot see a result. Against a real server.

use std::time::Duration;

use idem_runtime::{Error, InFlight, Operation, Outcome, PostgresStore};
use idem_tests::postgres_url;
use idem_tests::scenarios::namespace;
use sqlx::postgres::PgPool;
use sqlx::{Connection, PgConnection};

async fn store() -> Option<PostgresStore> {
    idem_tests::postgres_store().await
}

async fn connect() -> PgConnection {
    PgConnection::connect(&postgres_url())
        .await
        .expect("connect")
}

/// A table of notes the bodies write, one per effect.
struct Notes {
    pool: PgPool,
    table: String,
}

impl Notes {
    async fn new(pool: &PgPool, name: &str) -> Self {
        let table = format!("notes_{}", namespace(name).replace('.', "_"));
        sqlx::query(&format!("CREATE TABLE {table} (note text NOT NULL)"))
            .execute(pool)
            .await
            .unwrap();
        Self {
            pool: pool.clone(),
            table,
        }
    }

    async fn write(&self, tx: &mut PgConnection, note: &str) -> Result<(), Error> {
        sqlx::query(&format!("INSERT INTO {} (note) VALUES ($1)", self.table))
            .bind(note)
            .execute(&mut *tx)
            .await
            .map(|_| ())
            .map_err(Error::store)
    }

    async fn count(&self, note: &str) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE note = $1",
            self.table
        ))
        .bind(note)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
}

#[tokio::test]
async fn a_failed_call_leaves_nothing_of_itself_however_deeply_calls_nest() {
    let Some(store) = store().await else { return };
    let notes = Notes::new(store.pool(), "nested").await;
    let order = Operation::new(namespace("nested.order"));
    let line = Operation::new(namespace("nested.line"));
    let item = Operation::new(namespace("nested.item"));
    let (order_key, line_key, item_key) = (
        order.key(&"o-1").unwrap(),
        line.key(&"l-1").unwrap(),
        item.key(&"i-1").unwrap(),
    );

    // place_order writes, calls add_line (which writes and calls add_item), writes again,
    // then fails. Every call nests in the one before, on one connection.
    let mut conn = connect().await;
    let mut tx = conn.begin().await.unwrap();
    let failed = order
        .run_in_transaction(&store, &mut tx, &order_key, None, async |tx| {
            notes.write(tx, "order-before").await?;
            let added = line
                .run_in_transaction(&store, tx, &line_key, None, async |tx| {
                    notes.write(tx, "line").await?;
                    let item = item
                        .run_in_transaction(&store, tx, &item_key, None, async |tx| {
                            notes.write(tx, "item").await?;
                            Ok::<_, Error>(3_u32)
                        })
                        .await?;
                    Ok::<_, Error>(item.into_inner())
                })
                .await?;
            assert!(matches!(added, Outcome::Executed(3)));
            notes.write(tx, "order-after").await?;
            Err::<u32, _>(Error::store("the gateway declined"))
        })
        .await;
    assert!(failed.is_err());
    // The caller's transaction goes on, and commits its own work.
    notes.write(&mut tx, "caller").await.unwrap();
    tx.commit().await.unwrap();

    for note in ["order-before", "line", "item", "order-after"] {
        assert_eq!(
            notes.count(note).await,
            0,
            "{note} of the failed call was committed"
        );
    }
    assert_eq!(notes.count("caller").await, 1);
    // Nothing of the failed call is recorded: the retry runs at once, not after a lease.
    let mut tx = conn.begin().await.unwrap();
    let retry = order
        .clone()
        .in_flight(InFlight::Reject)
        .run_in_transaction(&store, &mut tx, &order_key, None, async |tx| {
            notes.write(tx, "order-retry").await?;
            Ok::<_, Error>(1_u32)
        })
        .await
        .unwrap();
    assert_eq!(retry, Outcome::Executed(1));
    let inner = line
        .run_in_transaction(&store, &mut tx, &line_key, None, async |_| {
            Ok::<_, Error>(9_u32)
        })
        .await
        .unwrap();
    assert_eq!(
        inner,
        Outcome::Executed(9),
        "the inner call of the failed one was recorded"
    );
    tx.commit().await.unwrap();
    assert_eq!(notes.count("order-retry").await, 1);
}

#[tokio::test]
async fn a_call_on_a_transaction_the_caller_aborted_undoes_nothing() {
    let Some(store) = store().await else { return };
    let notes = Notes::new(store.pool(), "aborted").await;
    let op = Operation::new(namespace("aborted"));
    let mut conn = connect().await;
    let mut tx = conn.begin().await.unwrap();
    let first = op
        .run_in_transaction(&store, &mut tx, &op.key(&1).unwrap(), None, async |tx| {
            notes.write(tx, "first").await?;
            Ok::<_, Error>(1_u32)
        })
        .await
        .unwrap();
    assert_eq!(first, Outcome::Executed(1));
    // The caller's own statement fails: the transaction is aborted.
    assert!(sqlx::query("SELECT 1/0").execute(&mut *tx).await.is_err());
    let second = op
        .run_in_transaction(&store, &mut tx, &op.key(&2).unwrap(), None, async |_| {
            Ok::<_, Error>(2_u32)
        })
        .await;
    let err = second.unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err:?}");
    assert!(err.to_string().contains("aborted"), "{err}");
    // Still aborted: nothing rolled the first call back and made the transaction look
    // healthy.
    let still = sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap_err();
    assert_eq!(
        still.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("25P02"),
        "{still}"
    );
    tx.rollback().await.unwrap();
    assert_eq!(notes.count("first").await, 0);
}

#[tokio::test]
async fn migrate_on_a_current_schema_does_not_wait_for_an_open_transaction() {
    let Some(store) = store().await else { return };
    let op = Operation::new(namespace("migrate.open"));
    // A transaction holds a claim, uncommitted, for as long as the test likes.
    let (inside, mut entered) = tokio::sync::mpsc::channel::<()>(1);
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let held = {
        let (store, op) = (store.clone(), op.clone());
        tokio::spawn(async move {
            let mut holder = connect().await;
            let mut tx = holder.begin().await.unwrap();
            let out = op
                .run_in_transaction(
                    &store,
                    &mut tx,
                    &op.key(&"held").unwrap(),
                    None,
                    async |_| {
                        inside.send(()).await.unwrap();
                        released.await.unwrap();
                        Ok::<_, Error>(1_u32)
                    },
                )
                .await;
            tx.rollback().await.unwrap();
            out
        })
    };
    entered.recv().await.unwrap();
    // Another instance starts up and migrates; then serves a claim of another key.
    let restarted = idem_tests::postgres_store().await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), restarted.migrate())
        .await
        .expect("migrate() waited for the open transaction")
        .unwrap();
    let other = tokio::time::timeout(
        Duration::from_secs(20),
        op.run(&restarted, &op.key(&"other").unwrap(), None, async {
            Ok::<_, Error>(2_u32)
        }),
    )
    .await
    .expect("a claim queued behind the migration")
    .unwrap();
    assert_eq!(other, Outcome::Executed(2));
    release.send(()).unwrap();
    assert!(held.await.unwrap().is_ok());
}

#[tokio::test]
async fn an_ordinary_call_that_gives_up_on_a_transactions_claim_leaves_no_claim_behind() {
    let Some(store) = store().await else { return };
    let store = store.with_timeout(Duration::from_millis(600));
    let op = Operation::new(namespace("orphan"));
    let key = op.key(&"k").unwrap();
    let mut holder = connect().await;
    let mut tx = holder.begin().await.unwrap();
    let claimed = op
        .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<_, Error>(1_u32))
        .await;
    assert!(claimed.is_ok());
    // The ordinary call waits for the uncommitted claim's row, and gives up.
    let gave_up = op
        .run(&store, &key, None, async { Ok::<_, Error>(2_u32) })
        .await;
    assert!(gave_up.is_err(), "{gave_up:?}");
    tx.rollback().await.unwrap();
    // Whatever the server still had of that call is over: no backend waits on a lock.
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()",
        )
        .fetch_one(store.pool())
        .await
        .unwrap();
        if waiting == 0 {
            break;
        }
        tokio::task::yield_now().await;
    }
    // The key is free: the retry runs now, not after an orphan claim's lease.
    let retry = op
        .clone()
        .in_flight(InFlight::Reject)
        .run(&store, &key, None, async { Ok::<_, Error>(3_u32) })
        .await;
    assert_eq!(retry.unwrap(), Outcome::Executed(3));
}

#[tokio::test]
async fn a_lease_of_a_year_works_in_a_transaction() {
    let Some(store) = store().await else { return };
    let year = Duration::from_secs(365 * 24 * 3600);
    let op = Operation::new(namespace("year")).lease(year).ttl(year);
    let mut conn = connect().await;
    let mut tx = conn.begin().await.unwrap();
    let out = op
        .run_in_transaction(&store, &mut tx, &op.key(&1).unwrap(), None, async |_| {
            Ok::<_, Error>(7_u32)
        })
        .await;
    assert_eq!(out.unwrap(), Outcome::Executed(7));
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn a_table_named_like_another_stores_sequence_is_refused_by_migrate() {
    let Some(store) = store().await else { return };
    let base = namespace("clash").replace('.', "_");
    let first = store.clone().with_table(&base).unwrap();
    first.migrate().await.unwrap();
    // `<base>_token` is the first store's token sequence.
    let clashing = store.clone().with_table(&format!("{base}_token")).unwrap();
    let err = clashing.migrate().await.unwrap_err().to_string();
    assert!(
        err.contains("sequence") && err.contains(&format!("{base}_token")),
        "{err}"
    );
    // And the other way round: a store whose sequence would be an existing table.
    let other = namespace("clash2").replace('.', "_");
    store
        .clone()
        .with_table(&format!("{other}_token"))
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let err = store
        .clone()
        .with_table(&other)
        .unwrap()
        .migrate()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("token sequence"), "{err}");
}

#[tokio::test]
async fn a_missing_search_path_is_named_as_a_cause() {
    let Some(store) = store().await else { return };
    let mut conn = connect().await;
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SET LOCAL search_path = pg_catalog")
        .execute(&mut *tx)
        .await
        .unwrap();
    let op = Operation::new(namespace("search_path"));
    let err = op
        .run_in_transaction(&store, &mut tx, &op.key(&1).unwrap(), None, async |_| {
            Ok::<_, Error>(1_u32)
        })
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("search_path"), "{err}");
}

#[tokio::test]
async fn a_repeatable_read_duplicate_of_an_ordinary_holder_is_told_to_retry_at_once() {
    let Some(store) = store().await else { return };
    let op = Operation::new(namespace("rr.ordinary"));
    let key = op.key(&"k").unwrap();
    let (inside, entered) = tokio::sync::oneshot::channel::<()>();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let holder = {
        let (store, op) = (store.clone(), op.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async move {
                inside.send(()).unwrap();
                released.await.unwrap();
                Ok::<_, Error>(1_u32)
            })
            .await
        })
    };
    entered.await.unwrap();
    let mut conn = connect().await;
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    // A wait far longer than the test: the answer must not come from running it out.
    let waiting = op.clone().wait(Duration::from_secs(600));
    let answer = tokio::time::timeout(
        Duration::from_secs(20),
        waiting.run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<_, Error>(2_u32)),
    )
    .await
    .expect("the duplicate waited out its wait");
    let err = answer.unwrap_err().to_string();
    assert!(err.contains("retry the transaction"), "{err}");
    tx.rollback().await.unwrap();
    release.send(()).unwrap();
    assert_eq!(holder.await.unwrap().unwrap(), Outcome::Executed(1));
}

#[tokio::test]
async fn a_transactional_holder_is_bounded_by_the_servers_idle_timeout() {
    let Some(store) = store().await else { return };
    let op = Operation::new(namespace("idle.holder"));
    let key = op.key(&"k").unwrap();
    // A holder that claims and then goes idle in its transaction (a leaked connection, a
    // paused process): it has no lease. The server's idle timeout ends it.
    let mut holder = connect().await;
    sqlx::query("SET idle_in_transaction_session_timeout = '300ms'")
        .execute(&mut holder)
        .await
        .unwrap();
    let mut tx = holder.begin().await.unwrap();
    let claimed = op
        .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<_, Error>(1_u32))
        .await
        .unwrap();
    assert_eq!(claimed, Outcome::Executed(1));
    let leaked = tx; // never committed, never rolled back: idle
                     // A duplicate that waits runs once the server ended the idle holder.
    let duplicate = op
        .clone()
        .wait(Duration::from_secs(60))
        .run(&store, &key, None, async { Ok::<_, Error>(2_u32) })
        .await
        .unwrap();
    assert_eq!(duplicate, Outcome::Executed(2));
    drop(leaked);
}
