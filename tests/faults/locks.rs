//! PostgreSQL under locks and crowds: a table locked by another session, and a pool far
//! smaller than its crowd of callers.

use super::*;

/// A table locked by another session: calls fail with `Error::Store` within the timeout,
/// never run the body, and run once each after the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_locked_table_times_out_instead_of_hanging() {
    let Some(store) = postgres_store().await else {
        return;
    };
    let timeout = Duration::from_millis(300);
    let table = "idem_faults_locked";
    let store = store.with_table(table).unwrap().with_timeout(timeout);
    store.migrate().await.unwrap();
    let mut locker = match sqlx::PgConnection::connect(&postgres_url()).await {
        Ok(c) => c,
        Err(e) => return unavailable("postgresql", e).unwrap_or(()),
    };
    use sqlx::Connection;
    let mut tx = locker.begin().await.unwrap();
    sqlx::query(&format!("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
        .execute(&mut *tx)
        .await
        .unwrap();

    let op = Operation::new(namespace("faults.locked")).lease(LEASE);
    let ledger = Ledger::default();
    let mut calls = Vec::new();
    for key in 0..20_u32 {
        let (op, store, ledger) = (op.clone(), store.clone(), ledger.clone());
        calls.push(tokio::spawn(async move {
            let k = op.key(&key).unwrap();
            let call = op.run(&store, &k, None, async {
                Ok::<_, Error>(ledger.body(key, std::future::ready(())).await)
            });
            tokio::time::timeout(HANG, call).await
        }));
    }
    let mut timed_out = 0;
    for call in calls {
        let err = call
            .await
            .unwrap()
            .expect("a call hung on the locked table")
            .unwrap_err();
        assert!(matches!(err, Error::Store(_)), "{err}");
        timed_out += 1;
    }
    assert_eq!(ledger.bodies(), 0, "no body runs while the table is locked");
    tx.rollback().await.unwrap();

    let mut ran = 0;
    for key in 0..20_u32 {
        let k = op.key(&key).unwrap();
        for _ in 0..20 {
            let call = op.run(&store, &k, None, async {
                Ok::<_, Error>(ledger.body(key, std::future::ready(())).await)
            });
            if tokio::time::timeout(HANG, call)
                .await
                .expect("hung")
                .is_ok()
            {
                ran += 1;
                break;
            }
        }
    }
    println!(
        "postgres, locked table: {timed_out} calls failed with Error::Store within {timeout:?}; after unlocking {ran} of 20 ran, keys run twice: {}",
        ledger.doubles()
    );
    assert_eq!(ran, 20);
    assert_eq!(ledger.doubles(), 0);
}

/// 2000 callers on 1000 keys through one store whose pool has 4 connections, at the default
/// lease: new claims crowd the pool, and a holder's completion or renewal must still get
/// through before its lease lapses, or another caller runs the body again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crowded_pool_runs_each_body_once() {
    const KEYS: u32 = 1000;
    let url = postgres_url();
    let pool = match sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(3))
        .connect(&url)
        .await
    {
        Ok(pool) => pool,
        Err(e) => {
            unavailable::<()>(&format!("postgresql at {url}"), e);
            return;
        }
    };
    let store = PostgresStore::from_pool(pool);
    store.migrate().await.expect("migrate");
    let op = Arc::new(Operation::new(namespace("faults.crowded")));
    let ledger = Ledger::default();
    let mut tasks = Vec::new();
    for key in 0..KEYS {
        for _ in 0..2 {
            let (op, store, ledger) = (op.clone(), store.clone(), ledger.clone());
            tasks.push(tokio::spawn(async move {
                let k = op.key(&key).unwrap();
                // A crowded pool may answer `Error::Store` (no connection in time): the
                // caller retries, as a client would.
                for _ in 0..100 {
                    let call = op.run(&store, &k, None, async {
                        Ok::<_, Error>(ledger.body(key, tokio::task::yield_now()).await)
                    });
                    if let Ok(value) = call.await {
                        return Some(value.into_inner());
                    }
                }
                None
            }));
        }
    }
    let mut answered = 0;
    for (i, task) in tasks.into_iter().enumerate() {
        if let Some(value) = task.await.unwrap() {
            assert_eq!(value, (i / 2) as u32, "a caller got another key's value");
            answered += 1;
        }
    }
    let doubles = ledger.doubles();
    println!(
        "postgres, a pool of 4: {} callers, {KEYS} keys, {} bodies, {answered} answered, keys run twice: {doubles}",
        KEYS * 2,
        ledger.bodies()
    );
    assert_eq!(doubles, 0, "keys whose body ran twice");
    assert_eq!(answered, KEYS * 2, "every caller gets a value in the end");
}
