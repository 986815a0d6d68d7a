//! Claims inside the caller's PostgreSQL transaction (`transaction = tx`,
//! `Operation::run_in_transaction`), against a real server: the effect and the record commit
//! together or not at all, duplicates wait or are rejected, crashes need no lease, and the
//! statements sent are counted.

use std::sync::Arc;
use std::time::Duration;

use idem_runtime::{
    attempt, idempotent, Error, InFlight, Operation, Outcome, PostgresStore, Token, DEFAULT_LEASE,
};
use idem_tests::scenarios::namespace;
use idem_tests::{drop_store_objects, postgres_store, PrivatePostgres, Probe};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Connection, PgConnection};
use tokio::sync::Barrier;
use tokio::time::Instant;

/// A ledger of two accounts and a journal of transfers, in tables of the test's own.
struct Ledger {
    pool: PgPool,
    accounts: String,
    journal: String,
}

impl Ledger {
    async fn new(pool: PgPool, name: &str) -> Self {
        let suffix = namespace(name).replace('.', "_");
        let ledger = Self {
            accounts: format!("accounts_{suffix}"),
            journal: format!("journal_{suffix}"),
            pool,
        };
        for statement in [
            format!(
                "CREATE TABLE {} (id int PRIMARY KEY, balance bigint NOT NULL, fence bigint NOT NULL DEFAULT 0, note text)",
                ledger.accounts
            ),
            format!("INSERT INTO {} (id, balance) VALUES (1, 1000000), (2, 0)", ledger.accounts),
            format!(
                "CREATE TABLE {} (id bigserial PRIMARY KEY, transfer text NOT NULL, by_task int)",
                ledger.journal
            ),
        ] {
            sqlx::query(&statement).execute(&ledger.pool).await.unwrap();
        }
        ledger
    }

    /// The transfer: two `UPDATE`s and a journal line, on the caller's connection.
    async fn transfer(
        &self,
        tx: &mut PgConnection,
        transfer: &str,
        task: i32,
    ) -> Result<i64, Error> {
        for (id, delta) in [(1, -100), (2, 100)] {
            sqlx::query(&format!(
                "UPDATE {} SET balance = balance + $1 WHERE id = $2",
                self.accounts
            ))
            .bind(delta as i64)
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(Error::store)?;
        }
        sqlx::query_scalar(&format!(
            "INSERT INTO {} (transfer, by_task) VALUES ($1, $2) RETURNING id",
            self.journal
        ))
        .bind(transfer)
        .bind(task)
        .fetch_one(&mut *tx)
        .await
        .map_err(Error::store)
    }

    async fn balance(&self, id: i32) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT balance FROM {} WHERE id = $1",
            self.accounts
        ))
        .bind(id)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    async fn journal_lines(&self, transfer: &str) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE transfer = $1",
            self.journal
        ))
        .bind(transfer)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    async fn drop_tables(&self) {
        let _ = sqlx::query(&format!("DROP TABLE {}, {}", self.accounts, self.journal))
            .execute(&self.pool)
            .await;
    }
}

/// A pool for the callers' own transactions.
async fn callers_pool(url: &str, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
        .expect("connect the callers' pool")
}

async fn store() -> Option<PostgresStore> {
    postgres_store().await
}

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

/// Whether the store's table has a row for `key`, committed.
async fn recorded(store: &PostgresStore, key: &idem_runtime::Key) -> bool {
    sqlx::query_scalar(&format!(
        "SELECT count(*) > 0 FROM {} WHERE key = $1",
        store.table()
    ))
    .bind(&key.as_bytes()[..])
    .fetch_one(store.pool())
    .await
    .unwrap()
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
    let patient = op.clone().wait_timeout(Duration::from_millis(300));
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

// ---- crash: no lease ------------------------------------------------------------------

const CRASH_RUN: &str = "IDEM_TX_CRASH_RUN";

#[tokio::test]
#[ignore = "the child process of a_crash_before_commit_leaves_nothing_and_frees_the_key_at_once"]
async fn crash_child() {
    let run = std::env::var(CRASH_RUN).expect("run by the crash test");
    let store = store().await.unwrap();
    let ledger = Ledger {
        pool: store.pool().clone(),
        accounts: format!("accounts_{run}"),
        journal: format!("journal_{run}"),
    };
    let op = Operation::new(run.clone());
    let key = op.key(&"crash").unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let _ = op
        .run_in_transaction(&store, &mut tx, &key, None, async |tx| {
            ledger.transfer(tx, "crash", 99).await?;
            println!("claimed and written");
            std::future::pending::<()>().await;
            Ok::<i64, Error>(0)
        })
        .await;
}

#[tokio::test]
async fn a_crash_before_commit_leaves_nothing_and_frees_the_key_at_once() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let Some(store) = store().await else { return };
    let ledger = Ledger::new(store.pool().clone(), "crash").await;
    let run = ledger.accounts.trim_start_matches("accounts_").to_string();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "crash_child", "--nocapture"])
        .env(CRASH_RUN, &run)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let written = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains("claimed and written"))
    });
    let written = tokio::time::timeout(Duration::from_secs(30), written).await;
    assert!(written.unwrap().unwrap(), "the child claimed and wrote");
    child.kill().unwrap(); // SIGKILL: no destructor, no rollback of its own
    child.wait().unwrap();

    // A call that had to wait for the dead holder would wait out its wait timeout (the
    // default lease, 8 s) and fail; the server's rollback frees the key at once.
    let op = Operation::new(run.clone());
    let key = op.key(&"crash").unwrap();
    let started = Instant::now();
    let mut tx = store.pool().begin().await.unwrap();
    let outcome = op
        .run_in_transaction(&store, &mut tx, &key, None, async |tx| {
            ledger.transfer(tx, "crash", 1).await
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let elapsed = started.elapsed();
    println!("after the SIGKILL, the next call ran in {elapsed:?} (lease: {DEFAULT_LEASE:?})");
    assert!(matches!(outcome, Outcome::Executed(_)));
    assert!(elapsed < DEFAULT_LEASE / 2, "no lease wait: {elapsed:?}");
    let by_child: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE by_task = 99",
        ledger.journal
    ))
    .fetch_one(&ledger.pool)
    .await
    .unwrap();
    assert_eq!(
        by_child, 0,
        "nothing of the killed child is in the database"
    );
    assert_eq!(ledger.journal_lines("crash").await, 1);
    assert_eq!(ledger.balance(2).await, 100, "one transfer");
    ledger.drop_tables().await;
}

// ---- statements, counted by the server ------------------------------------------------------

#[tokio::test]
async fn statements_counted_by_pg_stat_statements() {
    let Some(server) = PrivatePostgres::start() else {
        return;
    };
    let pool = callers_pool(&server.url, 2).await;
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&pool)
        .await
        .unwrap();
    let store = PostgresStore::from_pool(pool.clone());
    store.migrate().await.unwrap();
    let ledger = Ledger::new(pool.clone(), "counted").await;
    let op = Operation::new("tests.counted");
    let mut conn = pool.acquire().await.unwrap().detach();

    let transfer = async |conn: &mut PgConnection, name: &str| {
        let key = op.key(&name).unwrap();
        let mut tx = conn.begin().await.unwrap();
        let outcome = op
            .run_in_transaction(&store, &mut tx, &key, None, async |tx| {
                ledger.transfer(tx, name, 0).await
            })
            .await
            .unwrap();
        tx.commit().await.unwrap();
        outcome
    };
    // Warm the connection's statement cache, so that only executions are counted.
    let _ = transfer(&mut conn, "warm-up").await;
    let _ = transfer(&mut conn, "warm-up").await;

    let counted = async |conn: &mut PgConnection| -> Vec<(String, i64)> {
        sqlx::query_as(
            "SELECT query, calls FROM pg_stat_statements \
             WHERE query NOT LIKE '%pg_stat_statements%' \
             AND query <> 'SELECT $1' ORDER BY query", // the log's marks
        )
        .fetch_all(&mut *conn)
        .await
        .unwrap()
    };
    let reset = async |conn: &mut PgConnection| {
        sqlx::query("SELECT pg_stat_statements_reset()")
            .execute(&mut *conn)
            .await
            .unwrap();
    };

    // Every statement the session sends, as the server logs it: pg_stat_statements (of
    // PostgreSQL 15) does not list `SAVEPOINT` and `RELEASE SAVEPOINT` sent through the
    // extended protocol, so the log is what proves the full count.
    sqlx::query("SET log_statement = 'all'")
        .execute(&mut conn)
        .await
        .unwrap();
    let logged = async |conn: &mut PgConnection, label: &str, transfer_name: &str| {
        let start = format!("idem-count-{label}-start");
        let end = format!("idem-count-{label}-end");
        sqlx::query(&format!("SELECT '{start}'"))
            .execute(&mut *conn)
            .await
            .unwrap();
        let outcome = transfer(conn, transfer_name).await;
        sqlx::query(&format!("SELECT '{end}'"))
            .execute(&mut *conn)
            .await
            .unwrap();
        let log = server.log();
        let from = log.find(&start).expect("the start mark is logged");
        let to = log[from..].find(&end).expect("the end mark is logged") + from;
        let to = log[..to].rfind('\n').unwrap_or(to); // the end mark's line is not counted
                                                      // A simple-protocol message ("statement: A; B") may carry several statements; an
                                                      // extended-protocol one ("execute <name>: A") carries one.
        let statements: Vec<String> = log[from..to]
            .lines()
            .skip(1) // the rest of the start mark's line
            .flat_map(|line| {
                let statements: Vec<&str> = match line.split_once("LOG:  statement: ") {
                    Some((_, simple)) => simple.split(';').map(str::trim).collect(),
                    None => line
                        .split_once("LOG:  execute ")
                        .map(|(_, b)| b.split_once(": ").map_or(b, |(_, s)| s))
                        .into_iter()
                        .collect(),
                };
                statements
                    .into_iter()
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .filter(|statement| !statement.contains("idem-count-"))
            .collect();
        // One logged line per message, that is per round trip (the end mark's excluded).
        let messages = log[from..to]
            .lines()
            .skip(1)
            .filter(|line| line.contains("LOG:  statement: ") || line.contains("LOG:  execute "))
            .count();
        (outcome, statements, messages)
    };

    // A first execution: the caller's BEGIN, two UPDATEs, an INSERT and COMMIT (5), plus ours.
    reset(&mut conn).await;
    let (outcome, statements, messages) = logged(&mut conn, "first", "first").await;
    assert!(matches!(outcome, Outcome::Executed(_)));
    println!("first execution, as logged: {statements:#?}");
    assert_eq!(
        statements.len(),
        5 + 4,
        "as documented: savepoint, claim, completion, release: {statements:#?}"
    );
    assert!(
        statements
            .iter()
            .any(|s| s.to_ascii_uppercase().starts_with("RELEASE SAVEPOINT")),
        "the savepoint is released: {statements:#?}"
    );
    assert_eq!(
        messages,
        5 + 2,
        "two round trips of its own: {statements:#?}"
    );
    assert_eq!(
        statements
            .iter()
            .filter(|s| s.eq_ignore_ascii_case("commit"))
            .count(),
        1,
        "no commit of its own: {statements:#?}"
    );
    let first = counted(&mut conn).await;
    let calls: i64 = first.iter().map(|(_, calls)| calls).sum();
    println!("first execution, pg_stat_statements: {calls} statements: {first:?}");
    assert!(calls <= 5 + 4, "at most the caller's 5 plus 4: {first:?}");

    // A replay: the caller's BEGIN and COMMIT, plus ours; the body does not run. The
    // savepoint the claim was sent in is ended in a second message (a transaction of many
    // replays would otherwise nest one level deeper per call).
    reset(&mut conn).await;
    let (outcome, statements, messages) = logged(&mut conn, "replay", "first").await;
    assert!(matches!(outcome, Outcome::Replayed(_)));
    println!("replay, as logged: {statements:#?}");
    assert_eq!(
        statements.len(),
        2 + 4,
        "savepoint, claim, rollback to it, release: {statements:#?}"
    );
    assert_eq!(
        messages,
        2 + 2,
        "two round trips of its own: {statements:#?}"
    );
    let replay = counted(&mut conn).await;
    let calls: i64 = replay.iter().map(|(_, calls)| calls).sum();
    println!("replay, pg_stat_statements: {calls} statements: {replay:?}");
    assert!(calls <= 2 + 4, "at most the caller's 2 plus 4: {replay:?}");
    assert!(
        !replay.iter().any(|(q, _)| q.contains("UPDATE accounts")),
        "the body did not run: {replay:?}"
    );
    drop(conn);
    ledger.drop_tables().await;
}

// ---- the fencing token ---------------------------------------------------------------------

#[tokio::test]
async fn a_zombie_holders_fenced_write_is_refused() {
    let Some(store) = store().await else { return };
    let ledger = Ledger::new(store.pool().clone(), "fence").await;
    let op = Operation::new(namespace("fence")).lease(Duration::from_millis(300));
    let key = op.key(&"f-1").unwrap();
    // The token binds as a `bigint` as it is.
    let fenced_write = |pool: PgPool, accounts: String, token: Token, note: &'static str| async move {
        sqlx::query(&format!(
            "UPDATE {accounts} SET fence = $1, note = $2 WHERE id = 1 AND fence < $1"
        ))
        .bind(token)
        .bind(note)
        .execute(&pool)
        .await
        .unwrap()
        .rows_affected()
    };

    // The zombie: claims, then pauses (it never renews, as a process stopped by the
    // scheduler or a long GC would not) until the key was taken over.
    let (taken_over, resume) = tokio::sync::oneshot::channel::<()>();
    let (claimed, is_claimed) = tokio::sync::oneshot::channel::<()>();
    // What the zombie's write did: its caller is answered the new holder's record.
    let (wrote, zombie_wrote) = tokio::sync::oneshot::channel();
    let zombie = {
        let (op, store) = (op.clone(), Probe::frozen(store.clone()));
        let (pool, accounts) = (ledger.pool.clone(), ledger.accounts.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async move {
                let token = attempt().expect("inside the body").token().await?;
                claimed.send(()).unwrap();
                resume.await.unwrap();
                let rows = fenced_write(pool, accounts, token, "zombie").await;
                wrote.send(rows).unwrap();
                Ok::<_, Error>(rows)
            })
            .await
        })
    };
    is_claimed.await.unwrap();
    // The new holder waits until the zombie's lease lapses, takes the key over, and writes.
    let started = Instant::now();
    let newer = op
        .clone()
        .wait_timeout(Duration::from_secs(20))
        .run(&store, &key, None, async {
            let token = attempt().unwrap().token().await?;
            Ok::<_, Error>(
                fenced_write(ledger.pool.clone(), ledger.accounts.clone(), token, "new").await,
            )
        })
        .await
        .unwrap_or_else(|e| panic!("after {:?}: {e:?}", started.elapsed()));
    assert_eq!(newer, Outcome::Executed(1), "the new holder's write lands");
    taken_over.send(()).unwrap();
    assert_eq!(
        zombie_wrote.await.unwrap(),
        0,
        "the zombie's write is refused by the fence"
    );
    assert_eq!(
        zombie.await.unwrap().unwrap(),
        Outcome::Replayed(1),
        "the zombie answers the new holder's record"
    );
    let note: String = sqlx::query_scalar(&format!(
        "SELECT note FROM {} WHERE id = 1",
        ledger.accounts
    ))
    .fetch_one(&ledger.pool)
    .await
    .unwrap();
    assert_eq!(note, "new");
    ledger.drop_tables().await;
}

// ---- recursion -----------------------------------------------------------------------------

#[tokio::test]
async fn a_body_calling_its_own_key_fails_at_once() {
    let Some(store) = store().await else { return };
    let op = Operation::new(namespace("recursion"));
    let key = op.key(&"self").unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let outcome = op
        .run_in_transaction(&store, &mut tx, &key, None, async |tx| {
            // In the same transaction, and through the store's own pool.
            let started = Instant::now();
            let nested = op
                .run_in_transaction(&store, tx, &key, None, async |_| Ok::<u32, Error>(2))
                .await;
            let ordinary = op
                .run(&store, &key, None, async { Ok::<u32, Error>(3) })
                .await;
            let elapsed = started.elapsed();
            println!("both recursive calls failed in {elapsed:?}: {nested:?}, {ordinary:?}");
            let refused = |r: &Result<Outcome<u32>, Error>| matches!(r, Err(Error::InProgress));
            Ok::<_, Error>((
                elapsed.as_micros() as u64,
                refused(&nested),
                refused(&ordinary),
            ))
        })
        .await
        .unwrap()
        .into_inner();
    tx.rollback().await.unwrap();
    let (micros, nested, ordinary) = outcome;
    let elapsed = Duration::from_micros(micros);
    assert!(
        nested,
        "the nested call in the same transaction is InProgress"
    );
    assert!(ordinary, "the nested ordinary call is InProgress");
    assert!(
        elapsed < Duration::from_millis(100),
        "at once, not after the lease: {elapsed:?}"
    );
}

#[tokio::test]
async fn a_store_migrated_before_transactions_existed_says_to_migrate() {
    let Some(store) = store().await else { return };
    let table = namespace("unmigrated").replace('.', "_");
    let store = store.with_table(&table).unwrap();
    store.migrate().await.unwrap();
    // What a table created by an earlier version of idem lacks.
    sqlx::query(&format!("DROP FUNCTION \"{table}_claim_in_transaction\""))
        .execute(store.pool())
        .await
        .unwrap();
    let op = Operation::new(namespace("unmigrated"));
    let key = op.key(&"u-1").unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let refused = op
        .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<u32, Error>(1))
        .await;
    tx.rollback().await.unwrap();
    match refused {
        Err(Error::Store(e)) => assert!(e.to_string().contains("migrate()"), "{e}"),
        other => panic!("{other:?}"),
    }
    store.migrate().await.unwrap(); // and migrating again is all it takes
    let mut tx = store.pool().begin().await.unwrap();
    let ran = op
        .run_in_transaction(&store, &mut tx, &key, None, async |_| Ok::<u32, Error>(1))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(ran, Outcome::Executed(1));
    drop_store_objects(store.pool(), &table).await;
}

#[tokio::test]
async fn a_connection_killed_mid_body_leaves_nothing_and_the_retry_runs() {
    let Some(store) = store().await else { return };
    let ledger = Ledger::new(store.pool().clone(), "killed").await;
    let op = Operation::new(namespace("killed"));
    let key = op.key(&"k-1").unwrap();

    // The server ends the holder's session after its writes, before the completion: a
    // failover, an admin's `pg_terminate_backend`, a network cut.
    let mut conn = PgConnection::connect(&idem_tests::postgres_url())
        .await
        .unwrap();
    let mut tx = conn.begin().await.unwrap();
    let killed = op
        .run_in_transaction(&store, &mut tx, &key, None, async |tx| {
            let written = ledger.transfer(tx, "k-1", 0).await?;
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *tx)
                .await
                .map_err(Error::store)?;
            sqlx::query("SELECT pg_terminate_backend($1)")
                .bind(pid)
                .execute(store.pool())
                .await
                .map_err(Error::store)?;
            Ok::<_, Error>(written)
        })
        .await;
    assert!(matches!(killed, Err(Error::Store(_))), "{killed:?}");
    assert!(tx.commit().await.is_err(), "the session is gone");
    assert_eq!(
        ledger.journal_lines("k-1").await,
        0,
        "nothing of it was committed"
    );
    assert!(!recorded(&store, &key).await);

    let mut tx = store.pool().begin().await.unwrap();
    let retried = op
        .run_in_transaction(&store, &mut tx, &key, None, async |tx| {
            ledger.transfer(tx, "k-1", 1).await
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(
        matches!(retried, Outcome::Executed(_)),
        "the retry runs at once"
    );
    assert_eq!(ledger.journal_lines("k-1").await, 1);
    ledger.drop_tables().await;
}

#[tokio::test]
async fn a_connection_outside_a_transaction_is_refused_and_nothing_is_claimed() {
    let Some(store) = store().await else { return };
    let op = Operation::new(namespace("no_transaction"));
    let key = op.key(&"n-1").unwrap();
    let mut conn = store.pool().acquire().await.unwrap();
    let refused = op
        .run_in_transaction(&store, &mut conn, &key, None, async |_| Ok::<u32, Error>(1))
        .await;
    match refused {
        Err(Error::Store(e)) => assert!(e.to_string().contains("begin one"), "{e}"),
        other => panic!("{other:?}"),
    }
    assert!(
        !recorded(&store, &key).await,
        "no claim was made, let alone committed"
    );
}

/// A final error, recorded and replayed like a value.
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq)]
enum Declined {
    Card,
    Idem(String),
}

impl From<Error> for Declined {
    fn from(e: Error) -> Self {
        Self::Idem(e.to_string())
    }
}

#[tokio::test]
async fn a_final_error_is_recorded_with_the_bodys_writes() {
    let Some(store) = store().await else { return };
    let ledger = Ledger::new(store.pool().clone(), "final_error").await;
    let op = Operation::new(namespace("final_error"))
        .cache_errors(|e: &Declined| matches!(e, Declined::Card));
    let key = op.key(&"d-1").unwrap();

    let mut tx = store.pool().begin().await.unwrap();
    let declined = op
        .run_in_transaction(&store, &mut tx, &key, None, async |tx| {
            // The attempt is a fact worth keeping: its journal line commits with the record.
            ledger
                .transfer(tx, "d-1", 0)
                .await
                .map_err(|e| Declined::Idem(e.to_string()))?;
            Err::<i64, _>(Declined::Card)
        })
        .await;
    assert_eq!(declined, Err(Declined::Card));
    tx.commit().await.unwrap();
    assert_eq!(
        ledger.journal_lines("d-1").await,
        1,
        "the writes commit with the record"
    );

    let mut tx = store.pool().begin().await.unwrap();
    let replayed = op
        .run_in_transaction(&store, &mut tx, &key, None, async |_| {
            Ok::<i64, Declined>(7)
        })
        .await;
    tx.commit().await.unwrap();
    assert_eq!(
        replayed,
        Err(Declined::Card),
        "the recorded error is replayed"
    );
    assert_eq!(ledger.journal_lines("d-1").await, 1);
    ledger.drop_tables().await;
}

#[tokio::test]
async fn a_cancelled_call_committed_anyway_lapses_after_its_lease() {
    let Some(store) = store().await else { return };
    let ledger = Ledger::new(store.pool().clone(), "cancelled").await;
    let op = Operation::new(namespace("cancelled")).lease(Duration::from_millis(300));
    let key = op.key(&"c-1").unwrap();

    let mut tx = store.pool().begin().await.unwrap();
    let (written, is_written) = tokio::sync::oneshot::channel::<()>();
    let mut written = Some(written);
    let call = op.run_in_transaction(&store, &mut tx, &key, None, async |tx| {
        let moved = ledger.transfer(tx, "c-1", 0).await?;
        written.take().unwrap().send(()).unwrap();
        std::future::pending::<()>().await;
        Ok::<_, Error>(moved)
    });
    // The caller gives up on the call once the body wrote (a request timeout, say)...
    tokio::select! {
        _ = call => panic!("the body never finishes"),
        _ = is_written => {}
    }
    // ...and commits its transaction anyway: the writes so far, and a claim with a lease.
    tx.commit().await.unwrap();
    assert_eq!(
        ledger.journal_lines("c-1").await,
        1,
        "the writes so far committed"
    );
    assert!(
        recorded(&store, &key).await,
        "the claim committed, in progress"
    );

    // A later call waits for the lease (its wait timeout is the lease), then runs.
    let mut tx = store.pool().begin().await.unwrap();
    let later = op
        .clone()
        .wait_timeout(Duration::from_secs(20))
        .run_in_transaction(&store, &mut tx, &key, None, async |tx| {
            ledger.transfer(tx, "c-1", 1).await
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(
        matches!(later, Outcome::Executed(_)),
        "the lapsed claim was taken over"
    );
    ledger.drop_tables().await;
}
