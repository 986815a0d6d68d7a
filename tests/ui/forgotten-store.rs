// A store parameter that `store =` does not name: without it the call would use the
// process-wide in-memory default. The error says so, and how to name it.
use idem_runtime::{idempotent, MemoryStore, Store};

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

#[idempotent(key = id)]
async fn charge(store: &MemoryStore, id: u64) -> Result<u64, PayError> {
    Ok(id)
}

#[idempotent(key = id)]
async fn generic<S: Store + Clone>(id: u64, store: &S) -> Result<u64, PayError> {
    Ok(id)
}

fn main() {}
