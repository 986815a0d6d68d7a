// A mistake in the attribute makes its one error: the function is kept as written beside
// it, and its parameters, which only the expansion would have used, are not reported unused.
#![deny(unused_variables)]

use idem_runtime::{idempotent, MemoryStore};

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

#[idempotent(key = id, store = store, tll = "1h")]
async fn charge(store: &MemoryStore, id: u64) -> Result<u64, PayError> {
    Ok(7)
}

fn main() {}
