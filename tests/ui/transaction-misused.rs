use idem_runtime::{idempotent, Error, PostgresStore};
use sqlx::PgConnection;

// No store: the claim would have no table to go in.
#[idempotent(key = id, transaction = tx)]
async fn without_store(tx: &mut PgConnection, id: u64) -> Result<u64, Error> {
    let _ = tx;
    Ok(id)
}

// The connection parameter is called `conn`, not `tx`.
#[idempotent(key = id, store = store, transaction = tx)]
async fn wrong_name(store: &PostgresStore, conn: &mut PgConnection, id: u64) -> Result<u64, Error> {
    let _ = conn;
    Ok(id)
}

// The body runs on the caller's connection: it cannot finish in the background.
#[idempotent(key = id, store = store, transaction = tx, on_cancel = "complete")]
async fn in_background(store: &PostgresStore, tx: &mut PgConnection, id: u64) -> Result<u64, Error> {
    let _ = tx;
    Ok(id)
}

fn main() {}
