use idem_runtime::{idempotent, Error, PostgresStore};
use sqlx::PgConnection;

async fn find(id: u64) -> Result<Option<u64>, Error> {
    Ok(Some(id))
}

// Nothing is ever in doubt in the caller's transaction.
#[idempotent(key = id, store = store, transaction = tx, reconcile = find(id))]
async fn in_transaction(store: &PostgresStore, tx: &mut PgConnection, id: u64) -> Result<u64, Error> {
    let _ = tx;
    Ok(id)
}

// A lookup of another type than the function's.
#[idempotent(key = id, reconcile = find(id))]
async fn wrong_type(id: u64) -> Result<String, Error> {
    Ok(id.to_string())
}

fn main() {}
