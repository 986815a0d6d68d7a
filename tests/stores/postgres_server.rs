//! `PostgresStore` against a private PostgreSQL server: statements per call, counted by the
//! server (`pg_stat_statements`), and records that survive a restart of the server.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use idem_runtime::{Error, Operation, Outcome, PostgresStore};
use idem_tests::PrivatePostgres;
use sqlx::postgres::{PgPool, PgPoolOptions};

/// Statements the server executed since the last reset, by text; the admin's own excluded.
async fn statements(admin: &PgPool) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>(
        "SELECT query, calls FROM pg_stat_statements \
         WHERE query NOT ILIKE '%pg_stat_statements%' AND calls > 0",
    )
    .fetch_all(admin)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

async fn reset(admin: &PgPool) {
    sqlx::query("SELECT pg_stat_statements_reset()")
        .execute(admin)
        .await
        .unwrap();
}

/// What `call` sent, as the server counted it: its output, and the statements it executed.
async fn sent<T>(admin: &PgPool, call: impl Future<Output = T>) -> (T, BTreeMap<String, i64>) {
    reset(admin).await;
    let output = call.await;
    (output, statements(admin).await)
}

fn count(statements: &BTreeMap<String, i64>) -> i64 {
    statements.values().sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_is_one_statement_and_first_execution_two() {
    let Some(server) = PrivatePostgres::start() else {
        return;
    };
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&server.url)
        .await
        .unwrap();
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&admin)
        .await
        .unwrap();
    let store = PostgresStore::connect(&server.url).await.unwrap();
    store.migrate().await.unwrap();

    let op = Operation::new("statements");
    let call = |key: &'static str| {
        let (op, store) = (op.clone(), store.clone());
        async move {
            let key = op.key(key).unwrap();
            op.run(&store, &key, None, async { Ok::<_, Error>(7_u32) })
                .await
        }
    };
    assert!(!call("warm-up").await.unwrap().is_replayed()); // opens the pool's connection

    let (outcome, executed) = sent(&admin, call("k")).await;
    assert_eq!(outcome.unwrap(), Outcome::Executed(7));
    assert_eq!(
        count(&executed),
        2,
        "first execution: claim + complete; {executed:#?}"
    );

    let (outcome, replayed) = sent(&admin, call("k")).await;
    assert_eq!(outcome.unwrap(), Outcome::Replayed(7));
    assert_eq!(
        count(&replayed),
        1,
        "replay: the claim alone; {replayed:#?}"
    );
    assert!(
        replayed.keys().all(|q| q.contains("INSERT INTO")),
        "the claim statement: {replayed:#?}"
    );
    // The claim sent first is the cheaper `DO NOTHING` form: it settles a replay and a
    // fresh key alone.
    for (call, statements) in [("replay", &replayed), ("first execution", &executed)] {
        let claims: Vec<_> = statements
            .keys()
            .filter(|q| q.contains("INSERT INTO"))
            .collect();
        assert!(
            !claims.is_empty() && claims.iter().all(|q| q.contains("DO NOTHING")),
            "{call}: {statements:#?}"
        );
    }

    // A key whose row is not live (expired here) takes the whole claim after it: three
    // statements, and the key is taken over.
    let key = op.key("k").unwrap();
    sqlx::query("UPDATE idem_records SET expires_at = now() - interval '1 second' WHERE key = $1")
        .bind(&key.as_bytes()[..])
        .execute(&admin)
        .await
        .unwrap();
    let (outcome, taken_over) = sent(&admin, call("k")).await;
    assert_eq!(outcome.unwrap(), Outcome::Executed(7));
    assert_eq!(
        count(&taken_over),
        3,
        "an expired key: the fast claim, the whole claim, the completion; {taken_over:#?}"
    );
    assert!(
        taken_over.keys().any(|q| q.contains("DO UPDATE")),
        "the whole claim: {taken_over:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_record_survives_a_restart_of_the_server() {
    let Some(server) = PrivatePostgres::start() else {
        return;
    };
    let store = PostgresStore::connect(&server.url).await.unwrap();
    store.migrate().await.unwrap();
    let op = Operation::new("restart");
    let key = op.key(&"order-1").unwrap();
    let first = op
        .run(&store, &key, None, async {
            Ok::<_, Error>("receipt".to_string())
        })
        .await;
    assert_eq!(first.unwrap(), Outcome::Executed("receipt".to_string()));

    server.restart();

    // A new process after the restart, and the old pool, which reconnects.
    let fresh = PostgresStore::connect(&server.url).await.unwrap();
    for store in [fresh, store] {
        let mut replay = op
            .run(&store, &key, None, async {
                Ok::<_, Error>("again".to_string())
            })
            .await;
        for _ in 0..20 {
            // The old pool may hold a connection the restart closed; it is dropped on error.
            if !matches!(replay, Err(Error::Store(_))) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            replay = op
                .run(&store, &key, None, async {
                    Ok::<_, Error>("again".to_string())
                })
                .await;
        }
        assert_eq!(replay.unwrap(), Outcome::Replayed("receipt".to_string()));
    }
}
