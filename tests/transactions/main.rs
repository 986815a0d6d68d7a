//! One suite of claims in the caller's transaction (`transaction = tx`,
//! `Operation::run_in_transaction`), written once and run on every transactional store:
//! PostgreSQL and MariaDB (real servers) and SQLite (a real file). The effect and the record commit
//! together or not at all, an `Err` leaves nothing, calls nest, a duplicate in another
//! transaction waits for the holder's commit and replays (or is rejected at once), and a
//! crashed transaction frees its key at once.
//!
//! PostgreSQL's own behaviours beyond these (isolation levels, statement counts, a killed
//! server connection) are in `tests/transactions/transaction.rs`.//!
//! The suite is `suite.rs`; the behaviours that differ between the databases are
//! `dialects.rs`; the connections each store's tests use are here.

#[macro_use]
mod suite;
mod dialects;

/// The process id of a child's parent test, for what the child must share with it.
const PARENT: &str = "IDEM_TX_PARENT";

mod pg {
    use std::time::Duration;

    use sqlx::postgres::{PgPool, PgPoolOptions};

    pub async fn connect() -> Option<(idem_runtime::PostgresStore, PgPool)> {
        let store = idem_tests::postgres_store().await?;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&idem_tests::postgres_url())
            .await
            .expect("connect the callers' pool");
        Some((store, pool))
    }

    pub async fn begin(pool: &PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
        pool.begin().await.unwrap()
    }

    pub use begin as begin_without_waiting;
}

mod my {
    use std::time::Duration;

    use sqlx::mysql::{MySqlPool, MySqlPoolOptions};

    pub async fn connect() -> Option<(idem_runtime::MySqlStore, MySqlPool)> {
        let store = idem_tests::mysql_store().await?;
        let pool = MySqlPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&idem_tests::mysql_url())
            .await
            .expect("connect the callers' pool");
        Some((store, pool))
    }

    pub async fn begin(pool: &MySqlPool) -> sqlx::Transaction<'static, sqlx::MySql> {
        pool.begin().await.unwrap()
    }

    pub use begin as begin_without_waiting;
}

mod lite {
    use std::path::PathBuf;
    use std::time::Duration;

    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use sqlx::SqlitePool;

    /// A store on a file of the test's own, and a pool for the callers' transactions on it
    /// whose `BEGIN IMMEDIATE` waits long for the lock (a crowd of transactions takes
    /// turns on it).
    pub async fn open(test: &str) -> Option<(idem_runtime::SqliteStore, SqlitePool)> {
        // A child process opens its parent's file.
        let parent = std::env::var(super::PARENT).ok();
        let pid = parent
            .clone()
            .unwrap_or_else(|| std::process::id().to_string());
        let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("transactions-{test}-{pid}.db"));
        if parent.is_none() {
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
        }
        let store = idem_runtime::SqliteStore::open(&path).await.unwrap();
        store.migrate().await.unwrap();
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(&path)
                    .busy_timeout(Duration::from_secs(60)),
            )
            .await
            .unwrap();
        Some((store, pool))
    }

    /// `BEGIN IMMEDIATE`: the transaction takes the file's write lock first, so that a
    /// duplicate waits for the holder's commit and then sees its record.
    pub async fn begin(pool: &SqlitePool) -> sqlx::Transaction<'static, sqlx::Sqlite> {
        pool.begin_with("BEGIN IMMEDIATE").await.unwrap()
    }

    /// A deferred transaction, which waits for nothing until it writes: the claim is the
    /// first to ask for the lock.
    pub async fn begin_without_waiting(
        pool: &SqlitePool,
    ) -> sqlx::Transaction<'static, sqlx::Sqlite> {
        pool.begin().await.unwrap()
    }
}

mod postgres_suite {
    pub(crate) use crate::pg::{begin, begin_without_waiting};
    suite!(
        postgres,
        idem_runtime::PostgresStore,
        sqlx::PgConnection,
        sqlx::PgPool,
        ["$1", "$2"],
        |_test| crate::pg::connect().await
    );
}

mod sqlite_suite {
    pub(crate) use crate::lite::{begin, begin_without_waiting};
    suite!(
        sqlite,
        idem_runtime::SqliteStore,
        sqlx::SqliteConnection,
        sqlx::SqlitePool,
        ["$1", "$2"],
        |test| crate::lite::open(test).await
    );
}

mod mysql_suite {
    pub(crate) use crate::my::{begin, begin_without_waiting};
    suite!(
        mysql,
        idem_runtime::MySqlStore,
        sqlx::MySqlConnection,
        sqlx::MySqlPool,
        ["?", "?"],
        |_test| crate::my::connect().await
    );
}
