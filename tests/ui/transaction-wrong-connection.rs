use idem_runtime::{idempotent, Error, SqliteStore};
use sqlx::PgConnection;

// A `SqliteStore` claims in its own file: a PostgreSQL connection cannot hold its claim.
#[idempotent(key = id, store = store, transaction = tx)]
async fn transfer(store: &SqliteStore, tx: &mut PgConnection, id: u64) -> Result<u64, Error> {
    let _ = tx;
    Ok(id)
}

fn main() {}
