//! Claims inside the caller's PostgreSQL transaction (`transaction = tx`,
//! `Operation::run_in_transaction`), against a real server: the effect and the record commit
//! together or not at all, duplicates wait or are rejected, crashes need no lease, and the
//! statements sent are counted.

#[path = "support.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;
use support::*;

use idem_runtime::{idempotent, Error, InFlight, Operation, Outcome, PostgresStore};
use idem_tests::scenarios::namespace;
use sqlx::PgConnection;
use tokio::sync::Barrier;
use tokio::time::Instant;

// ---- the macro: `transaction = tx` --------------------------------------------------------

/// A transfer made idempotent with the attribute: the claim, the two `UPDATE`s, the journal
/// line and the record are one transaction, the caller's.
#[idempotent(key = transfer, store = store, transaction = tx, ignore = (ledger, task), namespace = "tests.transfer")]
async fn transfer(
    store: &PostgresStore,
    tx: &mut PgConnection,
    ledger: &Ledger,
    transfer: &str,
    task: i32,
) -> Result<i64, Error> {
    ledger.transfer(tx, transfer, task).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_tasks_fifty_keys_one_transfer_per_key() {
    let Some(store) = store().await else { return };
    let callers = callers_pool(&idem_tests::postgres_url(), 8).await;
    let ledger = Arc::new(Ledger::new(callers.clone(), "ledger").await);
    let run = namespace("ledger");
    let barrier = Arc::new(Barrier::new(8));
    let tasks: Vec<_> = (0..8)
        .map(|task| {
            let (store, callers, ledger, run, barrier) = (
                store.clone(),
                callers.clone(),
                ledger.clone(),
                run.clone(),
                barrier.clone(),
            );
            tokio::spawn(async move {
                let mut results = Vec::new();
                for round in 0..50 {
                    let key = format!("{run}.{round}");
                    barrier.wait().await; // all 8 on the same key at once
                    let mut tx = callers.begin().await.unwrap();
                    let id = transfer(&store, &mut tx, &ledger, &key, task)
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                    results.push(id);
                }
                results
            })
        })
        .collect();
    let mut all = Vec::new();
    for task in tasks {
        all.push(task.await.unwrap());
    }
    for round in 0..50 {
        let ids: Vec<i64> = all.iter().map(|results| results[round]).collect();
        assert!(
            ids.iter().all(|id| *id == ids[0]),
            "round {round}: every caller gets the same journal line: {ids:?}"
        );
        assert_eq!(
            ledger.journal_lines(&format!("{run}.{round}")).await,
            1,
            "round {round}: exactly one transfer"
        );
    }
    assert_eq!(
        ledger.balance(2).await,
        50 * 100,
        "50 transfers of 100, no more"
    );
    assert_eq!(ledger.balance(1).await, 1_000_000 - 50 * 100);
    ledger.drop_tables().await;
}

// ---- rollback semantics --------------------------------------------------------------------

#[tokio::test]
async fn err_then_commit_leaves_nothing_and_the_retry_runs() {
    let Some(store) = store().await else { return };
    let ledger = Ledger::new(store.pool().clone(), "err_commit").await;
    let op = Operation::new(namespace("err_commit"));
    let key = op.key(&"t-1").unwrap();

    let mut tx = store.pool().begin().await.unwrap();
    let failed = op
        .run_in_transaction(&store, &mut tx, &key, None, async |tx| {
            ledger.transfer(tx, "t-1", 0).await?;
            Err::<i64, _>(Error::store("the gateway said no"))
        })
        .await;
    assert!(matches!(failed, Err(Error::Store(_))), "{failed:?}");
    // The transaction is still usable, and the caller commits it.
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        ledger.journal_lines("t-1").await,
        0,
        "the failed body's writes are gone"
    );
    assert_eq!(ledger.balance(2).await, 0);
    assert!(
        !recorded(&store, &key).await,
        "no record of the failed attempt"
    );

    let mut tx = store.pool().begin().await.unwrap();
    let retried = op
        .run_in_transaction(&store, &mut tx, &key, None, async |tx| {
            ledger.transfer(tx, "t-1", 1).await
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(matches!(retried, Outcome::Executed(_)), "the retry runs");
    assert_eq!(ledger.journal_lines("t-1").await, 1);
    ledger.drop_tables().await;
}

#[tokio::test]
async fn ok_then_rollback_leaves_nothing_and_the_retry_runs() {
    let Some(store) = store().await else { return };
    let ledger = Ledger::new(store.pool().clone(), "ok_rollback").await;
    let op = Operation::new(namespace("ok_rollback"));
    let key = op.key(&"t-2").unwrap();

    let mut tx = store.pool().begin().await.unwrap();
    let first = op
        .run_in_transaction(&store, &mut tx, &key, None, async |tx| {
            ledger.transfer(tx, "t-2", 0).await
        })
        .await
        .unwrap();
    assert!(matches!(first, Outcome::Executed(_)));
    tx.rollback().await.unwrap();
    assert_eq!(ledger.journal_lines("t-2").await, 0);
    assert!(
        !recorded(&store, &key).await,
        "the record went with the rollback"
    );

    let mut tx = store.pool().begin().await.unwrap();
    let retried = op
        .run_in_transaction(&store, &mut tx, &key, None, async |tx| {
            ledger.transfer(tx, "t-2", 1).await
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(matches!(retried, Outcome::Executed(_)), "the retry runs");
    assert_eq!(ledger.journal_lines("t-2").await, 1);
    // And now it is recorded, for transactional and ordinary calls alike.
    let mut tx = store.pool().begin().await.unwrap();
    let replayed = op
        .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<i64, Error>(-1))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(replayed, Outcome::Replayed(*retried.get()));
    let ordinary = op
        .run(&store, &key, None, async { Ok::<i64, Error>(-1) })
        .await
        .unwrap();
    assert_eq!(
        ordinary,
        Outcome::Replayed(*retried.get()),
        "ordinary calls honour it"
    );
    ledger.drop_tables().await;
}

#[tokio::test]
async fn a_transaction_honours_a_record_of_an_ordinary_call() {
    let Some(store) = store().await else { return };
    let op = Operation::new(namespace("mixed"));
    let key = op.key(&"m-1").unwrap();
    let ordinary = op
        .run(&store, &key, None, async { Ok::<u32, Error>(7) })
        .await
        .unwrap();
    assert_eq!(ordinary, Outcome::Executed(7));
    let mut tx = store.pool().begin().await.unwrap();
    let replayed = op
        .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<u32, Error>(8))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(replayed, Outcome::Replayed(7));
}

// ---- concurrent duplicates -------------------------------------------------------------

/// Holds `key` in a transaction of its own: the body returned `Ok(value)`, not committed.
async fn hold(
    store: &PostgresStore,
    op: &Operation,
    key: &idem_runtime::Key,
    value: u32,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = store.pool().begin().await.unwrap();
    let outcome = op
        .run_in_transaction(store, &mut tx, key, None, async |_| Ok::<u32, Error>(value))
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Executed(value));
    tx
}

#[tokio::test]
async fn reject_returns_in_progress_at_once_while_another_transaction_holds_the_key() {
    let Some(store) = store().await else { return };
    let op = Operation::new(namespace("reject"));
    let key = op.key(&"r-1").unwrap();
    let holder = hold(&store, &op, &key, 1).await;

    let reject = op.clone().in_flight(InFlight::Reject);
    let mut times = Vec::new();
    for _ in 0..5 {
        let mut tx = store.pool().begin().await.unwrap();
        let started = Instant::now();
        let refused = reject
            .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<u32, Error>(2))
            .await;
        times.push(started.elapsed());
        assert!(matches!(refused, Err(Error::InProgress)), "{refused:?}");
        // The rejected caller's transaction is still usable.
        sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
        tx.rollback().await.unwrap();
    }
    println!("reject answered in {times:?} (the holder's transaction stayed open)");
    let quickest = times.iter().min().unwrap();
    assert!(
        *quickest < Duration::from_millis(50),
        "InProgress within 50 ms, not after a wait: {times:?}"
    );
    holder.rollback().await.unwrap();
}

#[tokio::test]
async fn a_duplicate_waits_for_the_commit_and_replays_never_an_uncommitted_result() {
    let Some(store) = store().await else { return };
    let op = Operation::new(namespace("wait"));
    let key = op.key(&"w-1").unwrap();
    let holder = hold(&store, &op, &key, 1).await;

    let (waiter, pid) = duplicate(&store, &op, key).await;
    // The waiter is blocked on the holder's transaction (a lock wait on the server), and has
    // no result: nothing uncommitted is handed out.
    wait_for_lock_wait(&store, pid).await;
    assert!(!waiter.is_finished(), "the duplicate waits for the commit");
    holder.commit().await.unwrap();
    let outcome = waiter.await.unwrap().unwrap();
    assert_eq!(
        outcome,
        Outcome::Replayed(1),
        "it replays the committed result"
    );
}

#[tokio::test]
async fn a_waiting_duplicate_gives_up_at_its_wait_timeout() {
    let Some(store) = store().await else { return };
    let op = Operation::new(namespace("wait_timeout"));
    let key = op.key(&"w-3").unwrap();
    let holder = hold(&store, &op, &key, 1).await;
    let patient = op.clone().wait(Duration::from_millis(300));
    let mut tx = store.pool().begin().await.unwrap();
    let started = Instant::now();
    let given_up = patient
        .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<u32, Error>(2))
        .await;
    let waited = started.elapsed();
    println!("gave up after {waited:?} (wait timeout 300 ms)");
    assert!(matches!(given_up, Err(Error::InProgress)), "{given_up:?}");
    // The server's lock timeout, not a client-side cut: at least the wait, and the
    // transaction is still usable.
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert!(waited < Duration::from_secs(10), "bounded: {waited:?}");
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    holder.rollback().await.unwrap();
}

#[tokio::test]
async fn a_duplicate_runs_when_the_holder_rolls_back() {
    let Some(store) = store().await else { return };
    let op = Operation::new(namespace("wait_rollback"));
    let key = op.key(&"w-2").unwrap();
    let holder = hold(&store, &op, &key, 1).await;
    let (waiter, pid) = duplicate(&store, &op, key).await;
    wait_for_lock_wait(&store, pid).await;
    holder.rollback().await.unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), Outcome::Executed(2));
}

#[tokio::test]
async fn an_ordinary_call_waits_for_an_open_transaction_and_replays_its_commit() {
    let Some(store) = store().await else { return };
    let op = Operation::new(namespace("ordinary_waits"));
    // One after the other, so that only one ordinary claim ever waits in this test binary.
    for commits in [true, false] {
        let key = op.key(&("o-1", commits)).unwrap();
        let holder = hold(&store, &op, &key, 1).await;
        let ordinary = {
            let (store, op) = (store.clone(), op.clone());
            tokio::spawn(async move {
                op.run(&store, &key, None, async { Ok::<u32, Error>(2) })
                    .await
            })
        };
        // The ordinary claim's INSERT waits on the uncommitted row of the holder's
        // transaction.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND query LIKE 'WITH live AS%'",
            )
            .fetch_one(store.pool())
            .await
            .unwrap();
            if waiting > 0 {
                break;
            }
            assert!(Instant::now() < deadline, "the ordinary claim never waited");
            tokio::task::yield_now().await;
        }
        assert!(!ordinary.is_finished(), "nothing uncommitted is handed out");
        if commits {
            holder.commit().await.unwrap();
            assert_eq!(ordinary.await.unwrap().unwrap(), Outcome::Replayed(1));
        } else {
            // The holder rolled back: the ordinary call claims and runs.
            holder.rollback().await.unwrap();
            assert_eq!(ordinary.await.unwrap().unwrap(), Outcome::Executed(2));
        }
    }
}

/// A duplicate call (value `2`) in a transaction of its own, in a task; and its session's
/// process id, to watch it on the server.
async fn duplicate(
    store: &PostgresStore,
    op: &Operation,
    key: idem_runtime::Key,
) -> (tokio::task::JoinHandle<Result<Outcome<u32>, Error>>, i32) {
    let (store, op) = (store.clone(), op.clone());
    let (pid_tx, pid) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut tx = store.pool().begin().await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        pid_tx.send(pid).unwrap();
        let outcome = op
            .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<u32, Error>(2))
            .await;
        tx.commit().await.unwrap();
        outcome
    });
    (task, pid.await.unwrap())
}

/// Waits until the session `pid` waits for a lock in the claim function.
async fn wait_for_lock_wait(store: &PostgresStore, pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE pid = $1 AND wait_event_type = 'Lock' AND query LIKE '%claim_in_transaction%'",
        )
        .bind(pid)
        .fetch_one(store.pool())
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "no claim ever waited for a lock");
        tokio::task::yield_now().await;
    }
}

// ---- isolation levels ----------------------------------------------------------------------

#[tokio::test]
async fn repeatable_read_and_serializable_never_run_a_duplicate() {
    let Some(store) = store().await else { return };
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        let op = Operation::new(namespace(&level.replace(' ', "_")));
        let key = op.key(&"i-1").unwrap();
        // The duplicate's snapshot is taken before the holder commits.
        let mut late = store.pool().begin().await.unwrap();
        sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {level}"))
            .execute(&mut *late)
            .await
            .unwrap();
        sqlx::query("SELECT 1").execute(&mut *late).await.unwrap();
        hold(&store, &op, &key, 1).await.commit().await.unwrap();

        let refused = op
            .run_in_transaction(&store, &mut late, &key, None, async |_| Ok::<u32, Error>(2))
            .await;
        match &refused {
            Err(Error::Store(e)) => assert!(
                e.to_string().contains("retry the transaction"),
                "{level}: the error says what to do: {e}"
            ),
            other => panic!("{level}: a duplicate must not run: {other:?}"),
        }
        late.rollback().await.unwrap();

        // Retried, as the error says: it replays.
        let mut retry = store.pool().begin().await.unwrap();
        sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {level}"))
            .execute(&mut *retry)
            .await
            .unwrap();
        let replayed = op
            .run_in_transaction(&store, &mut retry, &key, None, async |_| {
                Ok::<u32, Error>(3)
            })
            .await
            .unwrap();
        retry.commit().await.unwrap();
        assert_eq!(replayed, Outcome::Replayed(1), "{level}");
    }
}
