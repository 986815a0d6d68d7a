use idem_runtime::{idempotent, Error, PostgresStore};
use sqlx::PgConnection;

pub struct Receipt;

// The recorded value must be serializable, in a transaction as anywhere: said once.
#[idempotent(key = id, store = store, transaction = tx)]
async fn transfer(store: &PostgresStore, tx: &mut PgConnection, id: u64) -> Result<Receipt, Error> {
    let _ = (tx, id);
    Ok(Receipt)
}

fn main() {}
