//! `PostgresStore` against the real PostgreSQL server: the store contract, cross-process
//! exclusivity, crashes, zombies, an unreachable database, table names.
//!
//! Over the suite's 600 lines for a reason: one store's whole behaviour, like each store's file;
//! the private server's tests (crashes, statement counts) are `postgres_server.rs`.

use std::sync::Arc;
use std::time::Duration;

use idem_runtime::testkit;
use idem_runtime::{Error, InFlight, Operation, Outcome, PostgresStore};
use idem_tests::scenarios::{self, namespace};
use idem_tests::{drop_store_objects, postgres_store, postgres_url, Probe, Runs};
use sqlx::postgres::PgPoolOptions;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_keeps_the_store_contract() {
    let (Some(store), Some(other)) = (postgres_store().await, postgres_store().await) else {
        return;
    };
    testkit::conformance(&store).await;
    testkit::conformance_across(&store, &other).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_on_its_own_table_keeps_the_store_contract() {
    let Some(default) = postgres_store().await else {
        return;
    };
    let store = default.with_table("public.idem_records_custom").unwrap();
    store.migrate().await.unwrap();
    store.migrate().await.unwrap(); // idempotent
    testkit::conformance(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_from_many_processes_at_once_all_succeed() {
    let Some(store) = postgres_store().await else {
        return;
    };
    let table = format!("idem_concurrent_migrate_{}", std::process::id());
    let store = store.with_table(&table).unwrap();
    let migrations: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    for migration in migrations {
        migration.await.unwrap().unwrap();
    }
    testkit::conformance(&store).await;
    drop_store_objects(store.pool(), &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_needs_one_connection_only() {
    // A migration holds its connection while it waits for the others' lock: if it asked
    // the pool for a second one, 8 migrations on a pool of 8 could wait for each other
    // until the pool timed out (seen under load). On a pool of one it never could.
    if postgres_store().await.is_none() {
        return;
    }
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&postgres_url())
        .await
        .unwrap();
    let table = format!("idem_one_connection_migrate_{}", std::process::id());
    let store = PostgresStore::from_pool(pool.clone())
        .with_table(&table)
        .unwrap();
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    testkit::conformance(&store).await;
    drop_store_objects(&pool, &table).await;
}

#[tokio::test]
async fn table_names_that_are_not_identifiers_are_refused() {
    let Some(store) = postgres_store().await else {
        return;
    };
    for bad in [
        "x; DROP TABLE idem_records",
        "idem records",
        "\"quoted\"",
        "",
    ] {
        let err = store.clone().with_table(bad).unwrap_err();
        assert!(matches!(err, Error::Store(_)), "{bad:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pools_with_200_callers_each_run_the_body_once() {
    let Some(first) = postgres_store().await else {
        return;
    };
    let Some(second) = postgres_store().await else {
        return;
    };
    scenarios::two_stores_200_callers_each(first, second).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_claims_from_other_processes_have_one_winner() {
    // Without in-process coalescing every call reaches the database, so claims truly race.
    let Some(store) = postgres_store().await else {
        return;
    };
    let op = Arc::new(Operation::new(namespace("race")).in_flight(InFlight::Reject));
    for round in 0..20 {
        let key = op.key(&round).unwrap();
        let runs = Runs::default();
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let (op, store, runs) = (op.clone(), Probe::frozen(store.clone()), runs.clone());
                tokio::spawn(async move {
                    op.run(&store, &key, None, async move {
                        runs.hit();
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok::<_, Error>(())
                    })
                    .await
                })
            })
            .collect();
        for call in calls {
            match call.await.unwrap() {
                Ok(_) | Err(Error::InProgress) => {}
                Err(other) => panic!("round {round}: {other}"),
            }
        }
        assert_eq!(runs.count(), 1, "round {round}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_lost_its_lease_cannot_overwrite_the_new_owner() {
    let Some(store) = postgres_store().await else {
        return;
    };
    scenarios::zombie_cannot_overwrite_the_new_owner(store.clone()).await;
    scenarios::a_lapsed_holder_answers_only_what_the_key_records(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombies_fenced_write_is_refused_downstream() {
    let Some(store) = postgres_store().await else {
        return;
    };
    scenarios::zombie_fences_are_refused_downstream(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_is_a_store_error_within_the_acquire_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/test");

    let started = Instant::now();
    let err = PostgresStore::connect(&url).await.unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
    // Hang detectors, not stopwatches: far above the timeout, far below "forever".
    assert!(
        started.elapsed()
            < idem_runtime::store::postgres::DEFAULT_ACQUIRE_TIMEOUT + Duration::from_secs(10)
    );

    let timeout = Duration::from_millis(500);
    let pool = PgPoolOptions::new()
        .acquire_timeout(timeout)
        .connect_lazy(&url)
        .unwrap();
    let store = PostgresStore::from_pool(pool);
    let op = Operation::new(namespace("unreachable"));
    let key = op.key(&1).unwrap();
    let runs = Runs::default();
    let r = runs.clone();
    let started = Instant::now();
    let err = op
        .run(&store, &key, None, async move {
            r.hit();
            Ok::<_, Error>(1)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
    assert!(
        started.elapsed() < timeout + Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(runs.count(), 0, "the body must not run without a claim");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_expired_rows_only() {
    let Some(store) = postgres_store().await else {
        return;
    };
    let store = store.with_table("idem_records_purge").unwrap();
    store.migrate().await.unwrap();
    let op = Operation::new(namespace("purge"))
        .lease(Duration::from_millis(100))
        .ttl(Duration::from_millis(100));
    let short = op.key(&"short").unwrap();
    let long = op.key(&"long").unwrap();
    let _ = op
        .run(&store, &short, None, async { Ok::<_, Error>(1) })
        .await
        .unwrap();
    let _ = op
        .clone()
        .ttl(Duration::from_secs(3600))
        .run(&store, &long, None, async { Ok::<_, Error>(2) })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(store.purge_expired().await.unwrap() >= 1);
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    let replay = op
        .run(&store, &long, None, async { Ok::<_, Error>(3) })
        .await
        .unwrap();
    assert_eq!(
        replay,
        Outcome::Replayed(2),
        "a live result survives the purge"
    );

    // The background task purges too.
    let _ = op
        .run(&store, &op.key(&"short-2").unwrap(), None, async {
            Ok::<_, Error>(1)
        })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let purger = store.purge_every(Duration::from_millis(50));
    // Polled, not slept: the task purges the expired row on its own, however busy we are.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&postgres_url())
        .await
        .unwrap();
    let expired = async {
        let query = "SELECT count(*) FROM idem_records_purge WHERE expires_at <= now()";
        loop {
            let left: i64 = sqlx::query_scalar(query).fetch_one(&pool).await.unwrap();
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), expired)
        .await
        .expect("the task never purged the expired row");

    // Dropping the guard stops the task: a row that expires afterwards stays until purged.
    drop(purger);
    let _ = op
        .run(&store, &op.key(&"short-3").unwrap(), None, async {
            Ok::<_, Error>(1)
        })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(
        store.purge_expired().await.unwrap(),
        1,
        "the dropped task kept purging"
    );
}

/// The child of the crash test, in its own process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by crash_of_a_holder_frees_its_key_after_the_lease, in a child process"]
async fn crash_child() {
    let store = PostgresStore::connect(&postgres_url()).await.unwrap();
    scenarios::crash_child(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_of_a_holder_frees_its_key_after_the_lease() {
    let Some(store) = postgres_store().await else {
        return;
    };
    scenarios::crash_frees_the_key_after_the_lease(store, "crash_child").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_neither_writes_nor_locks_the_row() {
    let Some(store) = postgres_store().await else {
        return;
    };
    let pool = PgPoolOptions::new().connect(&postgres_url()).await.unwrap();
    let op = Operation::new(namespace("read_only_replay"));
    let key = op.key(&1).unwrap();
    let first = op
        .run(&store, &key, None, async { Ok::<_, Error>(1) })
        .await
        .unwrap();
    assert_eq!(first, Outcome::Executed(1));

    // A row lock (even ON CONFLICT DO UPDATE ... WHERE false) or an update sets xmax or xmin.
    let versions = || async {
        sqlx::query_as::<_, (String, String)>(
            "SELECT xmin::text, xmax::text FROM idem_records WHERE key = $1",
        )
        .bind(&key.as_bytes()[..])
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let before = versions().await;
    assert_eq!(before.1, "0");
    for _ in 0..3 {
        let replay = op
            .run(&store, &key, None, async { Ok::<_, Error>(2) })
            .await
            .unwrap();
        assert_eq!(replay, Outcome::Replayed(1));
    }
    assert_eq!(
        versions().await,
        before,
        "replays changed or locked the row"
    );
}

/// Claims that race with releases on one hot key (6 pools × 20 callers, a body that always
/// fails, so the row is inserted and deleted over and over) never give up with a spurious
/// `Error::Store` on a healthy database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_on_one_key_gives_no_spurious_store_errors() {
    if postgres_store().await.is_none() {
        return;
    }
    // Small pools, so that the test leaves the server's connections to the others.
    let mut pools = Vec::new();
    for _ in 0..6 {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(&postgres_url())
            .await
            .unwrap();
        pools.push(PostgresStore::from_pool(pool));
    }
    // Waiters wait as long as the churn may take on a busy machine: this test is about store
    // errors, and a wait bounded by the default lease (8 s) can run out under 120 callers
    // taking turns on one key while both cores are saturated.
    let op = Arc::new(Operation::new(namespace("churn")).wait(Duration::from_secs(60)));
    let key = op.key(&"hot").unwrap();
    let (store_errors, calls) = (Runs::default(), Runs::default());
    let mut tasks = Vec::new();
    for store in &pools {
        for _ in 0..20 {
            let (op, store, store_errors, calls) = (
                op.clone(),
                store.clone(),
                store_errors.clone(),
                calls.clone(),
            );
            tasks.push(tokio::spawn(async move {
                for _ in 0..20 {
                    calls.hit();
                    let failing = async { Err::<(), _>(Error::codec("the body always fails")) };
                    match op.run(&store, &key, None, failing).await {
                        Err(Error::Store(e)) => {
                            store_errors.hit();
                            eprintln!("spurious store error: {e}");
                        }
                        Err(Error::Codec(_)) => {}
                        other => panic!("{other:?}"),
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    println!(
        "churn: {} calls on one key from 6 pools, {} spurious store errors",
        calls.count(),
        store_errors.count()
    );
    assert_eq!(store_errors.count(), 0);
}

/// A purge deletes in batches and waits for no one: an expired row that another transaction
/// holds is skipped, and the purge finishes while that transaction is still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_goes_in_batches_and_skips_rows_it_would_wait_for() {
    let Some(store) = postgres_store().await else {
        return;
    };
    let table = "idem_records_purge_batches";
    let store = store.with_table(table).unwrap();
    store.migrate().await.unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&postgres_url())
        .await
        .unwrap();
    sqlx::query(&format!("TRUNCATE {table}"))
        .execute(&pool)
        .await
        .unwrap();
    // 2500 expired rows: three batches.
    sqlx::query(&format!(
        "INSERT INTO {table} (key, token, completed, value, expires_at) \
         SELECT sha256(i::text::bytea), i, true, '\\x76'::bytea, now() - interval '1 hour' \
         FROM generate_series(1, 2500) AS i"
    ))
    .execute(&pool)
    .await
    .unwrap();
    // Another session holds one of them.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {table} WHERE key = sha256('7'::bytea) FOR UPDATE"
    ))
    .execute(&mut *holder)
    .await
    .unwrap();

    let purged = tokio::time::timeout(Duration::from_secs(30), store.purge_expired())
        .await
        .expect("the purge waited for the held row")
        .unwrap();
    assert_eq!(purged, 2499, "every expired row but the held one");
    holder.rollback().await.unwrap();
    assert_eq!(
        store.purge_expired().await.unwrap(),
        1,
        "the next purge gets it"
    );
}

/// A store on a pool of `size` whose connections carry `name` as their `application_name`,
/// so that the server can count them.
async fn named_store(size: u32, name: &str) -> PostgresStore {
    let options = postgres_url()
        .parse::<sqlx::postgres::PgConnectOptions>()
        .unwrap()
        .application_name(name);
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(options)
        .await
        .unwrap();
    let store = PostgresStore::from_pool(pool);
    store.migrate().await.unwrap();
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_opens_no_more_connections_than_the_pool_and_the_renewals() {
    // 400 first executions at once on a pool of 4: the completions share the store's pool
    // (behind at most one pool's worth of claims), so the server never sees a second pool
    // of the same size; pools keep what they opened, so counting afterwards sees the peak.
    let Some(observer) = postgres_store().await else {
        return;
    };
    const SIZE: u32 = 4;
    let name = format!("idem_crowd_{}", std::process::id());
    let store = named_store(SIZE, &name).await;
    let op = Arc::new(Operation::new(namespace("crowd.connections")));
    let runs = Runs::default();
    let calls: Vec<_> = (0..400_u32)
        .map(|n| {
            let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
            tokio::spawn(async move {
                let key = op.key(&(n, std::process::id())).unwrap();
                // A crowded pool may answer `Error::Store` (no connection in time); the
                // caller retries, as a client would, a bounded number of times.
                for _ in 0..100 {
                    let runs = runs.clone();
                    let call = op.run(&store, &key, None, async move {
                        runs.hit();
                        Ok::<_, Error>(n)
                    });
                    match call.await {
                        Ok(value) => return value.into_inner(),
                        Err(Error::Store(_)) => continue,
                        Err(other) => panic!("{other}"),
                    }
                }
                panic!("call {n} failed 100 times with Error::Store")
            })
        })
        .collect();
    for (n, call) in calls.into_iter().enumerate() {
        assert_eq!(call.await.unwrap(), n as u32);
    }
    assert_eq!(runs.count(), 400);
    idem_runtime::drain(Duration::from_secs(30)).await.unwrap();
    let opened: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
            .bind(&name)
            .fetch_one(observer.pool())
            .await
            .unwrap();
    let bound = SIZE + idem_runtime::store::postgres::RENEWAL_CONNECTIONS;
    println!("a pool of {SIZE}, 400 first executions: {opened} connections (at most {bound})");
    assert!(opened >= 1, "the store's connections are counted");
    assert!(
        opened <= i64::from(bound),
        "{opened} connections for a pool of {SIZE}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_go_through_while_the_application_holds_every_connection() {
    // The application's own transactions may take every connection of the store's pool for
    // longer than a lease: the holder's renewals have connections of their own, so its key
    // is still held when its first lease has run out.
    let Some(other) = postgres_store().await else {
        return;
    };
    let store = named_store(2, "idem_renewals").await;
    // Renewed every third of it, on connections opened for the first renewal: a second
    // leaves a loaded machine room for both.
    let lease = Duration::from_secs(1);
    let op = Arc::new(Operation::new(namespace("renewals.isolated")).lease(lease));
    let key = op.key(&std::process::id()).unwrap();
    let runs = Runs::default();
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (finish, finish_rx) = tokio::sync::oneshot::channel::<()>();
    let call = {
        let (op, store, key, runs) = (op.clone(), store.clone(), key, runs.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async move {
                runs.hit();
                started_tx.send(()).unwrap();
                finish_rx.await.unwrap();
                Ok::<_, Error>(7_u32)
            })
            .await
        })
    };
    started.await.unwrap();
    let first_expiry: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM expires_at)::float8 FROM idem_records WHERE key = $1",
    )
    .bind(&key.as_bytes()[..])
    .fetch_one(other.pool())
    .await
    .unwrap();
    // The application takes both connections of the store's pool.
    let held = (
        store.pool().acquire().await.unwrap(),
        store.pool().acquire().await.unwrap(),
    );
    // Until the server's clock passes the first lease's end.
    loop {
        let past: bool = sqlx::query_scalar("SELECT extract(epoch FROM now()) > $1")
            .bind(first_expiry)
            .fetch_one(other.pool())
            .await
            .unwrap();
        if past {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Another process asks for the key: it is still held, by a renewed lease.
    let claim = idem_runtime::Store::claim(&other, &idem_runtime::ClaimRequest::new(&key, lease))
        .await
        .unwrap();
    assert!(
        matches!(claim, idem_runtime::Claim::InProgress { .. }),
        "the key was taken over while its holder's pool was busy: {claim:?}"
    );
    drop(held);
    finish.send(()).unwrap();
    assert_eq!(call.await.unwrap().unwrap().into_inner(), 7);
    assert_eq!(runs.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_reads_back_from_a_bigint() {
    let Some(store) = postgres_store().await else {
        return;
    };
    let token: idem_runtime::Token = sqlx::query_scalar("SELECT $1::bigint")
        .bind(idem_runtime::Token::new(7))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(token, idem_runtime::Token::new(7));
    let negative = sqlx::query_scalar::<_, idem_runtime::Token>("SELECT (-1)::bigint")
        .fetch_one(store.pool())
        .await;
    assert!(negative.is_err(), "{negative:?}");
}
