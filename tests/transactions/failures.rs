//! Claims inside the caller's PostgreSQL transaction when things go wrong: a crashed holder
//! (no lease needed), the statements counted by the server, a zombie's fenced write, a body
//! calling its own key, a store migrated before transactions, a connection killed mid-body or
//! outside a transaction, a final error, a cancelled call committed anyway.
//!
//! Over the suite's 600 lines for a reason: each failure needs its own server setup (a private
//! server to crash, statements counted), written once here for all of them.

#[path = "support.rs"]
mod support;

use std::time::Duration;
use support::*;

use idem_runtime::{attempt, Error, Operation, Outcome, PostgresStore, Token, DEFAULT_LEASE};
use idem_tests::scenarios::namespace;
use idem_tests::{drop_store_objects, PrivatePostgres, Probe};
use sqlx::postgres::PgPool;
use sqlx::{Connection, PgConnection};
use tokio::time::Instant;

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
        .wait(Duration::from_secs(20))
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
    let zombie = zombie.await.unwrap();
    assert!(
        matches!(zombie, Err(Error::Unrecorded(_))),
        "the zombie is told its body ran unrecorded, never a replay: {zombie:?}"
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
        .wait(Duration::from_secs(20))
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
