//! The throughput rows of PostgreSQL.

use super::*;

/// The throughput rows of PostgreSQL with this pool; returns its server-cost rows when
/// `cost` is set.
pub(super) async fn postgres(pool_size: u32, synchronous_commit: bool, cost: bool) -> Vec<String> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let Ok(options) = url.parse::<PgConnectOptions>() else {
        return Vec::new();
    };
    let options = options.options([(
        "synchronous_commit",
        if synchronous_commit { "on" } else { "off" },
    )]);
    let Ok(pool) = PgPoolOptions::new()
        .max_connections(pool_size)
        .connect_with(options)
        .await
    else {
        println!("postgresql: skipped ({url} unreachable)");
        return Vec::new();
    };
    let store = PostgresStore::from_pool(pool.clone())
        .with_table("idem_records_throughput")
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS throughput_baseline \
         (key bigint PRIMARY KEY, completed boolean NOT NULL, value bytea, expires_at timestamptz NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let label = |what: &str| {
        format!(
            "postgres, {what}, pool {pool_size}, synchronous_commit {}",
            if synchronous_commit { "on" } else { "off" }
        )
    };
    let op = Arc::new(Operation::new(format!(
        "throughput.pg.{:?}",
        Instant::now()
    )));
    let first = idempotent_calls(&op, &store, fresh);
    let base_first = {
        let pool = pool.clone();
        move |n: u64| {
            let pool = pool.clone();
            async move {
                sqlx::query(
                    "INSERT INTO throughput_baseline (key, completed, expires_at) \
                     VALUES ($1, false, now() + interval '30 seconds') ON CONFLICT (key) DO NOTHING",
                )
                .bind(n as i64)
                .execute(&pool)
                .await
                .unwrap();
                sqlx::query(
                    "UPDATE throughput_baseline SET completed = true, value = $2, \
                     expires_at = now() + interval '1 day' WHERE key = $1",
                )
                .bind(n as i64)
                .bind(serde_json::to_vec(&receipt(n)).unwrap())
                .execute(&pool)
                .await
                .unwrap();
            }
        }
    };
    first_executions(
        &label("first executions"),
        &Server::Postgres,
        Some(0.9),
        first.clone(),
        base_first.clone(),
    )
    .await;
    let replay = idempotent_calls(&op, &store, recorded);
    let base_replay = {
        let pool = pool.clone();
        move |n: u64| {
            let pool = pool.clone();
            async move {
                let _: Option<(bool, Option<Vec<u8>>)> = sqlx::query_as(
                "SELECT completed, value FROM throughput_baseline WHERE key = $1 AND expires_at > now()",
            )
            .bind((REPLAYED + n % RECORDED) as i64)
            .fetch_optional(&pool)
            .await
            .unwrap();
            }
        }
    };
    compare(
        &label("replays"),
        &Server::Postgres,
        Some(0.9),
        replay.clone(),
        base_replay.clone(),
    )
    .await;
    if !cost {
        return Vec::new();
    }
    // The floor of a replay (as P8g): the least statement that reads the record or, when
    // there is none, claims the key, on the baseline's table.
    let floor_replay = move |n: u64| {
        let pool = pool.clone();
        async move {
            let found: Option<(bool, Option<Vec<u8>>)> = sqlx::query_as(
                "WITH live AS (SELECT completed, value FROM throughput_baseline \
                    WHERE key = $1 AND expires_at > now()), \
                 claimed AS (INSERT INTO throughput_baseline (key, completed, expires_at) \
                    SELECT $1, false, now() + interval '30 seconds' WHERE NOT EXISTS (SELECT 1 FROM live) \
                    ON CONFLICT (key) DO NOTHING RETURNING completed, value) \
                 SELECT completed, value FROM live UNION ALL SELECT completed, value FROM claimed",
            )
            .bind((REPLAYED + n % RECORDED) as i64)
            .fetch_optional(&pool)
            .await
            .unwrap();
            assert!(matches!(found, Some((true, Some(_)))), "recorded");
        }
    };
    compare(
        &label("replays, floor (see the header)"),
        &Server::Postgres,
        None,
        floor_replay.clone(),
        base_replay.clone(),
    )
    .await;
    compare(
        &label("replays vs the floor"),
        &Server::Postgres,
        None,
        replay.clone(),
        floor_replay,
    )
    .await;
    vec![
        server_cost(
            "postgres, first execution vs INSERT + UPDATE",
            &Server::Postgres,
            1.5,
            first,
            base_first,
        )
        .await,
        server_cost(
            "postgres, replay vs SELECT",
            &Server::Postgres,
            1.2,
            replay,
            base_replay,
        )
        .await,
    ]
}
