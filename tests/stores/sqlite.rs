//! `SqliteStore` on real files: the store contract, two OS processes on one file, a holder
//! SIGKILLed mid-body, a record that outlives the process that wrote it, zombies, purging,
//! fencing tokens that grow (and a table made before their triggers, refused).
//!
//! Over the suite's 600 lines for a reason: one store's whole behaviour, like each store's file;
//! the write lock's contention has a file of its own (`sqlite_locks.rs`).

use idem_runtime::ClaimRequest;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::testkit;
use idem_runtime::MemoryStore;
use idem_runtime::{Claim, Error, Operation, Outcome, SqliteStore, Store, TieredStore};
use idem_tests::scenarios::{self, namespace};
use idem_tests::Runs;

/// Hands a child process its database file.
const FILE: &str = "IDEM_SQLITE_FILE";
/// Hands a child process its namespace.
const NAMESPACE: &str = "IDEM_SQLITE_NAMESPACE";

/// A fresh file of its own for one test.
fn fresh_file(test: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("sqlite-{test}-{}-{nanos}.db", std::process::id()))
}

async fn open(path: &std::path::Path) -> SqliteStore {
    let store = SqliteStore::open(path).await.unwrap();
    store.migrate().await.unwrap();
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store_keeps_the_store_contract() {
    let file = fresh_file("contract");
    let store = open(&file).await;
    testkit::conformance(&store).await;
    testkit::conformance_across(&store, &open(&file).await).await;
    let named = store.with_table("idem_other").unwrap();
    named.migrate().await.unwrap();
    named.migrate().await.unwrap(); // idempotent
    testkit::conformance(&named).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_tier_over_sqlite_keeps_the_store_contract() {
    let durable = open(&fresh_file("tiered")).await;
    testkit::conformance(&TieredStore::new(MemoryStore::new(), durable)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_is_in_wal_mode_and_names_are_checked() {
    let store = open(&fresh_file("wal")).await;
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(mode, "wal");
    let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(
        synchronous, 2,
        "FULL: a commit is on disk before it returns"
    );
    for bad in ["idem records", "x\"; DROP TABLE y; --", "main.idem"] {
        let err = store.clone().with_table(bad).unwrap_err();
        assert!(matches!(err, Error::Store(_)), "{bad:?}: {err:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_reads_while_another_process_holds_the_write_lock() {
    let file = fresh_file("write-lock");
    let store = open(&file).await;
    let op = Operation::new(namespace("write-lock"));
    let recorded = op.key(&"recorded").unwrap();
    let _ = op
        .run(&store, &recorded, None, async { Ok::<_, Error>(7_u32) })
        .await
        .unwrap();

    // Another process's writer holds the file's write lock for as long as the test needs.
    let other = open(&file).await;
    let mut writer = other.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    sqlx::query("DELETE FROM idem_records WHERE key = x'00'")
        .execute(&mut *writer)
        .await
        .unwrap();

    let store = store.with_timeout(Duration::from_secs(30));
    let replay = op
        .run(&store, &recorded, None, async { Ok::<_, Error>(8_u32) })
        .await
        .unwrap();
    assert_eq!(replay, Outcome::Replayed(7), "a replay takes no write lock");

    // A first execution needs the lock: it waits for the writer, then runs.
    let first = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            let key = op.key(&"first").unwrap();
            op.run(&store, &key, None, async { Ok::<_, Error>(9_u32) })
                .await
        })
    };
    writer.rollback().await.unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Outcome::Executed(9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_from_many_pools_at_once_all_succeed() {
    let file = fresh_file("migrations");
    let mut stores = Vec::new();
    for _ in 0..8 {
        stores.push(SqliteStore::open(&file).await.unwrap());
    }
    let migrations: Vec<_> = stores
        .iter()
        .cloned()
        .map(|store| tokio::spawn(async move { store.migrate().await }))
        .collect();
    for migration in migrations {
        migration.await.unwrap().unwrap();
    }
    testkit::conformance(&stores[0]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pools_on_one_file_run_one_body_for_400_callers() {
    let path = fresh_file("two-pools");
    scenarios::two_stores_200_callers_each(open(&path).await, open(&path).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_cannot_overwrite_the_new_owner() {
    let store = open(&fresh_file("zombie")).await;
    scenarios::zombie_cannot_overwrite_the_new_owner(store.clone()).await;
    scenarios::a_lapsed_holder_answers_only_what_the_key_records(store.clone()).await;
    scenarios::zombie_fences_are_refused_downstream(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purging_deletes_expired_rows_only() {
    let store = open(&fresh_file("purge")).await;
    let op = Operation::new(namespace("purge"))
        .lease(Duration::from_millis(200))
        .ttl(Duration::from_millis(200));
    let short = op.key(&"short").unwrap();
    let _ = op
        .run(&store, &short, None, async { Ok::<_, Error>(1_u32) })
        .await
        .unwrap();
    let long = Operation::new(namespace("purge-long"));
    let kept = long.key(&"long").unwrap();
    let _ = long
        .run(&store, &kept, None, async { Ok::<_, Error>(2_u32) })
        .await
        .unwrap();
    // Wait, by SQLite's own clock, until the short record has expired.
    while store.lookup(&short).await.unwrap().is_some() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(store.purge_expired().await.unwrap(), 1);
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    assert!(
        store.lookup(&kept).await.unwrap().is_some(),
        "a live record stays"
    );
}

// ---- Several processes ---------------------------------------------------------------

/// Starts this test binary's ignored test `child` as a process of its own.
fn child(test: &str, file: &std::path::Path, namespace: &str) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            test,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FILE, file)
        .env(NAMESPACE, namespace)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// What follows `prefix` on each line a child printed it (the test harness may have
/// started the line with its own `test … `).
fn lines_after(output: &str, prefix: &str) -> Vec<String> {
    output
        .lines()
        .filter_map(|line| {
            line.find(prefix)
                .map(|at| line[at + prefix.len()..].to_string())
        })
        .collect()
}

const CALLERS: usize = 250;

/// The child of the two-process test: 250 callers on one key once the parent says go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by two_processes_on_one_file_run_one_body_for_500_callers, in a child process"]
async fn one_key_child() {
    let store = open(std::path::Path::new(&std::env::var(FILE).unwrap())).await;
    let op =
        Arc::new(Operation::new(std::env::var(NAMESPACE).unwrap()).wait(Duration::from_secs(60)));
    let key = op.key(&"order-1").unwrap();
    println!("ready");
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).unwrap();
    let runs = Runs::default();
    let mut calls = Vec::new();
    for _ in 0..CALLERS {
        let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
        calls.push(tokio::spawn(async move {
            op.run(&store, &key, None, async move {
                runs.hit();
                // Long enough for the other process's callers to find the key held.
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok::<_, Error>(format!("receipt-of-{}", std::process::id()))
            })
            .await
        }));
    }
    for call in calls {
        println!("value {}", call.await.unwrap().unwrap().into_inner());
    }
    println!("runs {}", runs.count());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_on_one_file_run_one_body_for_500_callers() {
    let file = fresh_file("two-processes");
    open(&file).await; // migrated once, before either child starts
    let namespace = namespace("two-processes");
    let mut children: Vec<_> = (0..2)
        .map(|_| child("one_key_child", &file, &namespace))
        .collect();
    let mut outputs = Vec::new();
    let mut readers = Vec::new();
    for process in &mut children {
        let mut stdout = BufReader::new(process.stdout.take().unwrap());
        let mut line = String::new();
        while !line.contains("ready") {
            line.clear();
            assert!(
                stdout.read_line(&mut line).unwrap() > 0,
                "the child ended before it was ready"
            );
        }
        readers.push(stdout);
    }
    // Both are ready: let them go together.
    for process in &mut children {
        process.stdin.take().unwrap().write_all(b"go\n").unwrap();
    }
    for (process, mut stdout) in children.into_iter().zip(readers) {
        let output = tokio::task::spawn_blocking(move || {
            let mut output = String::new();
            std::io::Read::read_to_string(&mut stdout, &mut output).unwrap();
            let mut process = process;
            assert!(
                process.wait().unwrap().success(),
                "a child failed:\n{output}"
            );
            output
        })
        .await
        .unwrap();
        outputs.push(output);
    }
    let runs: usize = outputs
        .iter()
        .flat_map(|output| lines_after(output, "runs "))
        .map(|runs| runs.parse::<usize>().unwrap())
        .sum();
    let values: Vec<String> = outputs
        .iter()
        .flat_map(|output| lines_after(output, "value "))
        .collect();
    println!(
        "{} callers in 2 processes, {runs} body run(s)",
        values.len()
    );
    assert_eq!(values.len(), 2 * CALLERS, "every caller answered");
    assert_eq!(runs, 1, "one body for 500 callers in two processes");
    assert!(
        values.iter().all(|value| *value == values[0]),
        "every caller got the one body's value"
    );
}

/// The child of the crash test, in its own process, on the crash test's file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by a_holder_killed_mid_body_is_taken_over_after_its_lease, in a child process"]
async fn crash_child() {
    scenarios::crash_child(open(&crash_file()).await).await;
}

/// The crash test's file: the child must find it without being told (the scenario starts
/// it); namespaces keep runs apart.
fn crash_file() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sqlite-crash.db")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_killed_mid_body_is_taken_over_after_its_lease() {
    scenarios::crash_frees_the_key_after_the_lease(open(&crash_file()).await, "crash_child").await;
}

/// The child of the restart test: records a result and exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by a_result_outlives_the_process_that_recorded_it, in a child process"]
async fn record_child() {
    let store = open(std::path::Path::new(&std::env::var(FILE).unwrap())).await;
    let op = Operation::new(std::env::var(NAMESPACE).unwrap());
    let key = op.key(&"charge-7").unwrap();
    let outcome = op
        .run(&store, &key, None, async {
            Ok::<_, Error>(format!("receipt-of-{}", std::process::id()))
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Executed(_)), "{outcome:?}");
    println!("recorded {}", outcome.into_inner());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_outlives_the_process_that_recorded_it() {
    let file = fresh_file("restart");
    let namespace = namespace("restart");
    let process = child("record_child", &file, &namespace);
    let output = tokio::task::spawn_blocking(move || process.wait_with_output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(
        output.status.success(),
        "the recording process failed:\n{stdout}"
    );
    let recorded = lines_after(&stdout, "recorded ");
    assert_eq!(recorded.len(), 1, "{stdout}");

    // A new process (this one) on the same file: the retry replays, the body never runs.
    let store = open(&file).await;
    let op = Operation::new(namespace);
    let key = op.key(&"charge-7").unwrap();
    let retry = op
        .run(&store, &key, None, async {
            Ok::<_, Error>("charged again".to_string())
        })
        .await
        .unwrap();
    assert_eq!(retry, Outcome::Replayed(recorded[0].clone()));

    // The token counter outlived the process too: the next claim's token is past the
    // recording process's.
    let next = op.key(&"charge-8").unwrap();
    let Claim::Acquired { token, .. } = store
        .claim(&ClaimRequest::new(&next, Duration::from_secs(5)))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed")
    };
    assert!(
        token.get() > 1,
        "token {token:?} after the first process took token 1"
    );
}

/// An in-memory database is one per connection: every pooled connection would see a
/// database of its own, and claims would not be shared. Refused with a clear error.
#[tokio::test]
async fn an_in_memory_database_is_refused_with_a_clear_error() {
    for path in [
        ":memory:",
        "",
        "file::memory:?cache=shared",
        "file:idem?mode=memory",
    ] {
        let refused = SqliteStore::open(path).await;
        let Err(Error::Config(why)) = refused else {
            panic!("{path:?} was accepted: {refused:?}");
        };
        assert!(why.to_string().contains("MemoryStore"), "{path:?}: {why}");
    }
}

/// A copy in a memory tier never outlives its SQLite record: watched from both sides as
/// they expire, the durable record is never gone while its copy is still replayed (the
/// durable store's clock counts whole milliseconds, and a copy ends a grain early).
///
/// Each watcher needs a copy to watch: on a machine too busy to replay a record within its
/// short TTL (the record then expired, or too little was left to copy), it records another
/// key and tries again, so that what is asserted is always the expiry of a real copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_never_outlives_its_durable_record() {
    const KEYS: u32 = 40;
    const TRIES: u32 = 50;
    let durable = open(&fresh_file("copy-expiry")).await;
    let tier = TieredStore::new(MemoryStore::new(), durable.clone());
    let op = Operation::new(namespace("copy_expiry"))
        .lease(Duration::from_millis(300))
        .ttl(Duration::from_millis(300));
    let mut watchers = Vec::new();
    for i in 0..KEYS {
        let (op, tier, durable) = (op.clone(), tier.clone(), durable.clone());
        watchers.push(tokio::spawn(async move {
            let mut tries = 0..TRIES;
            let key = loop {
                let n = tries.next().expect("no replay in time to copy, 50 times") * KEYS + i;
                let key = op.key(&n).unwrap();
                // Recorded in the durable store; the tier's replay copies it, for what the
                // durable store says is left.
                let first = op
                    .run(&durable, &key, None, async { Ok::<_, Error>(n) })
                    .await;
                assert_eq!(first.unwrap(), Outcome::Executed(n));
                let replay = op
                    .run(&tier, &key, None, async { Ok::<_, Error>(n + 1) })
                    .await
                    .unwrap();
                // Expired before the replay (run again now): its value stays n + 1.
                assert!(
                    matches!(replay, Outcome::Replayed(v) if v == n)
                        || matches!(replay, Outcome::Executed(v) if v == n + 1),
                    "{replay:?}"
                );
                if replay.is_replayed() && tier.fast().peek(&key).is_some() {
                    break key;
                }
            };
            // Until both are gone: the durable record first, then the copy, each time.
            loop {
                let durable_live = durable.lookup(&key).await.unwrap().is_some();
                let copy_live = tier.fast().peek(&key).is_some();
                if !durable_live && copy_live {
                    return false;
                }
                if !durable_live && !copy_live {
                    return true;
                }
                tokio::task::yield_now().await;
            }
        }));
    }
    for watcher in watchers {
        assert!(
            watcher.await.unwrap(),
            "a copy was replayed after its durable record expired"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_binds_and_reads_back_as_an_integer() {
    let store = open(&fresh_file("token")).await;
    let pool = store.pool();
    sqlx::query(
        "CREATE TABLE accounts (id INTEGER PRIMARY KEY, fence INTEGER NOT NULL, note TEXT)",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO accounts VALUES (1, 0, 'none')")
        .execute(pool)
        .await
        .unwrap();
    let op = Operation::new(namespace("sqlite.token"));
    let mut tokens = Vec::new();
    for n in 0..2 {
        let key = op.key(&n).unwrap();
        let Claim::Acquired { token, .. } = store
            .claim(&ClaimRequest::new(&key, Duration::from_secs(5)))
            .await
            .unwrap()
        else {
            panic!("a fresh key is free");
        };
        tokens.push(token);
    }
    let (older, newer) = (tokens[0], tokens[1]);
    assert!(newer > older, "tokens grow");
    // The fenced write binds the token itself.
    let write = |token: idem_runtime::Token, note: &'static str| async move {
        sqlx::query("UPDATE accounts SET fence = ?1, note = ?2 WHERE id = 1 AND fence < ?1")
            .bind(token)
            .bind(note)
            .execute(pool)
            .await
            .map(|done| done.rows_affected())
    };
    assert_eq!(write(newer, "newer").await.unwrap(), 1);
    assert_eq!(
        write(older, "older").await.unwrap(),
        0,
        "an older token is refused"
    );
    let fence: idem_runtime::Token = sqlx::query_scalar("SELECT fence FROM accounts WHERE id = 1")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(fence, newer, "and reads back as the token");
    // Never wrapped: a token over i64::MAX is not bound, a negative integer is not a token.
    assert!(write(idem_runtime::Token::new(u64::MAX), "huge")
        .await
        .is_err());
    let negative = sqlx::query_scalar::<_, idem_runtime::Token>("SELECT -1")
        .fetch_one(pool)
        .await;
    assert!(negative.is_err(), "{negative:?}");
}

async fn token(store: &SqliteStore, key: u8) -> idem_runtime::Token {
    match store
        .claim(&ClaimRequest::new(
            &idem_runtime::Key::from_bytes([key; 32]),
            Duration::from_secs(60),
        ))
        .await
        .unwrap()
    {
        Claim::Acquired { token, .. } => token,
        other => panic!("{other:?}"),
    }
}

/// A take draws its token from the counter in its own statement, and the triggers move
/// the counter: tokens grow across keys, and a key taken again after a release gets a
/// token above every earlier one, alone or in a batch of writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_grow_across_keys_and_takes() {
    let store = open(&fresh_file("tokens")).await;
    let a = token(&store, 1).await;
    let b = token(&store, 2).await;
    assert!(b > a, "{b:?} after {a:?}");
    let key = idem_runtime::Key::from_bytes([1; 32]);
    assert!(store.release(&key, a).await.unwrap());
    let again = token(&store, 1).await;
    assert!(again > b, "{again:?} after {b:?}");
    let mut claims = tokio::task::JoinSet::new();
    for key in 10..30 {
        let store = store.clone();
        claims.spawn(async move { token(&store, key).await });
    }
    let crowd = claims.join_all().await;
    let mut sorted = crowd.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), crowd.len(), "one token each: {crowd:?}");
    assert!(sorted[0] > again);
}

/// A table made before the token triggers existed would give every take the same token:
/// its claims are refused, saying to migrate, and work once it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_the_token_triggers_is_refused_until_migrated() {
    let migrated = open(&fresh_file("triggers")).await;
    for trigger in ["idem_records_token_inserted", "idem_records_token_updated"] {
        sqlx::query(&format!("DROP TRIGGER \"{trigger}\""))
            .execute(migrated.pool())
            .await
            .unwrap();
    }
    let old = SqliteStore::from_pool(migrated.pool().clone());
    let refused = old
        .claim(&ClaimRequest::new(
            &idem_runtime::Key::from_bytes([1; 32]),
            Duration::from_secs(60),
        ))
        .await
        .unwrap_err();
    assert!(
        matches!(refused, Error::Store(_)) && refused.to_string().contains("migrate"),
        "{refused}"
    );
    old.migrate().await.unwrap();
    let old = SqliteStore::from_pool(migrated.pool().clone());
    assert!(token(&old, 1).await > idem_runtime::Token::new(0));
}

/// SQLite's names are case-insensitive: a store told `IDEM_RECORDS` on a file whose
/// `idem_records` another store made uses that table (its records and triggers), instead of
/// being accepted and then refusing every claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_named_in_another_case_is_the_same_table() {
    let path = fresh_file("table-case");
    let lower = SqliteStore::open(&path).await.unwrap();
    lower.migrate().await.unwrap();
    let op = Operation::new(namespace("sqlite.table-case"));
    let (recorded, fresh) = (op.key(&1).unwrap(), op.key(&2).unwrap());
    let first = op
        .run(&lower, &recorded, None, async { Ok::<_, Error>(1) })
        .await;
    assert_eq!(first.unwrap(), Outcome::Executed(1));

    let upper = SqliteStore::open(&path)
        .await
        .unwrap()
        .with_table("IDEM_RECORDS")
        .unwrap();
    upper.migrate().await.unwrap();
    let replay = op
        .run(&upper, &recorded, None, async { Ok::<_, Error>(9) })
        .await;
    assert_eq!(replay.unwrap(), Outcome::Replayed(1));
    let ran = op
        .run(&upper, &fresh, None, async { Ok::<_, Error>(2) })
        .await;
    assert_eq!(ran.unwrap(), Outcome::Executed(2));
}
