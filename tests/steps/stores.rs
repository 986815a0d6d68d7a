//! The stores every step scenario runs on: memory, Redis, PostgreSQL, SQLite and MySQL
//! (each one reachable; a missing server is skipped, or fails with
//! `IDEM_REQUIRE_SERVICES=1`).

use std::path::PathBuf;
use std::sync::Arc;

use idem_runtime::{MemoryStore, SqliteStore, Store};
use idem_tests::{mysql_store, postgres_store, redis_store};

/// A store shared by the "processes" of one scenario, and its name for the messages.
pub type Named = (&'static str, Arc<dyn Store>);

/// Every store that is reachable, each fresh enough for a scenario of its own.
pub async fn every_store(scenario: &str) -> Vec<Named> {
    let mut stores: Vec<Named> = vec![("memory", Arc::new(MemoryStore::new()))];
    if let Some(redis) = redis_store().await {
        stores.push(("redis", Arc::new(redis)));
    }
    if let Some(postgres) = postgres_store().await {
        stores.push(("postgres", Arc::new(postgres)));
    }
    stores.push(("sqlite", Arc::new(sqlite_store(scenario).await)));
    if let Some(mysql) = mysql_store().await {
        stores.push(("mysql", Arc::new(mysql)));
    }
    stores
}

/// A migrated SQLite store on a file of its own, made anew.
pub async fn sqlite_store(name: &str) -> SqliteStore {
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("steps-{name}.db"));
    for stale in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{stale}", file.display()));
    }
    let store = SqliteStore::open(&file).await.unwrap();
    store.migrate().await.unwrap();
    store
}
