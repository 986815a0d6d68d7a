//! The throughput rows of MySQL or MariaDB: first executions against the two statements of
//! the floor (a claim's `INSERT IGNORE`, then the result's `UPDATE`), and replays against a
//! `SELECT`, on one pool.

use sqlx::mysql::MySqlPoolOptions;

use super::*;

/// The throughput rows of MySQL on a pool of `pool_size`.
pub(super) async fn mysql(pool_size: u32) {
    let url = std::env::var("IDEM_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let Ok(pool) = MySqlPoolOptions::new()
        .max_connections(pool_size)
        .connect(&url)
        .await
    else {
        println!("mysql: skipped ({url} unreachable)");
        return;
    };
    let store = MySqlStore::from_pool(pool.clone())
        .with_table("idem_records_throughput")
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS throughput_baseline (`key` BIGINT PRIMARY KEY, \
         completed BOOLEAN NOT NULL, value LONGBLOB, expires_at BIGINT NOT NULL) ENGINE = InnoDB",
    )
    .execute(&pool)
    .await
    .unwrap();
    let label = |what: &str| format!("mysql, {what}, pool {pool_size}");
    let op = Arc::new(Operation::new(format!(
        "throughput.mysql.{:?}",
        Instant::now()
    )));
    let first = idempotent_calls(&op, &store, fresh);
    let base_first = {
        let pool = pool.clone();
        move |n: u64| {
            let pool = pool.clone();
            async move {
                sqlx::query(
                    "INSERT IGNORE INTO throughput_baseline (`key`, completed, expires_at) \
                     VALUES (?, FALSE, 30000)",
                )
                .bind(n as i64)
                .execute(&pool)
                .await
                .unwrap();
                sqlx::query(
                    "UPDATE throughput_baseline SET completed = TRUE, value = ?, \
                     expires_at = 86400000 WHERE `key` = ?",
                )
                .bind(serde_json::to_vec(&receipt(n)).unwrap())
                .bind(n as i64)
                .execute(&pool)
                .await
                .unwrap();
            }
        }
    };
    first_executions(
        &label("first executions"),
        &Server::Mysql,
        None,
        first,
        base_first,
    )
    .await;
    let replay = idempotent_calls(&op, &store, recorded);
    let base_replay = {
        let pool = pool.clone();
        move |n: u64| {
            let pool = pool.clone();
            async move {
                let (value,): (Vec<u8>,) =
                    sqlx::query_as("SELECT value FROM throughput_baseline WHERE `key` = ?")
                        .bind(recorded(n) as i64)
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                serde_json::from_slice::<common::Receipt>(&value).unwrap();
            }
        }
    };
    compare(&label("replays"), &Server::Mysql, None, replay, base_replay).await;
}
