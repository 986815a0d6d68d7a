//! What the tests of claims in a PostgreSQL transaction share: a ledger of the test's own,
//! the callers' pool, the store.

#![allow(dead_code)]

use std::time::Duration;

use idem_runtime::{Error, PostgresStore};
use idem_tests::postgres_store;
use idem_tests::scenarios::namespace;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::PgConnection;

/// A ledger of two accounts and a journal of transfers, in tables of the test's own.
pub struct Ledger {
    pub pool: PgPool,
    pub accounts: String,
    pub journal: String,
}

impl Ledger {
    pub async fn new(pool: PgPool, name: &str) -> Self {
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
    pub async fn transfer(
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

    pub async fn balance(&self, id: i32) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT balance FROM {} WHERE id = $1",
            self.accounts
        ))
        .bind(id)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    pub async fn journal_lines(&self, transfer: &str) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE transfer = $1",
            self.journal
        ))
        .bind(transfer)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    pub async fn drop_tables(&self) {
        let _ = sqlx::query(&format!("DROP TABLE {}, {}", self.accounts, self.journal))
            .execute(&self.pool)
            .await;
    }
}

/// A pool for the callers' own transactions.
pub async fn callers_pool(url: &str, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
        .expect("connect the callers' pool")
}

pub async fn store() -> Option<PostgresStore> {
    postgres_store().await
}

/// Whether the store's table has a row for `key`, committed.
pub async fn recorded(store: &PostgresStore, key: &idem_runtime::Key) -> bool {
    sqlx::query_scalar(&format!(
        "SELECT count(*) > 0 FROM {} WHERE key = $1",
        store.table()
    ))
    .bind(&key.as_bytes()[..])
    .fetch_one(store.pool())
    .await
    .unwrap()
}
