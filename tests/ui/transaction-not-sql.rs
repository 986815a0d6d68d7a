use idem_runtime::{idempotent, Error, MemoryStore};
use sqlx::PgConnection;

// `transaction =` claims inside a SQL transaction: a memory store cannot.
#[idempotent(key = id, store = store, transaction = tx)]
async fn transfer(store: &MemoryStore, tx: &mut PgConnection, id: u64) -> Result<u64, Error> {
    let _ = tx;
    Ok(id)
}

fn main() {}
