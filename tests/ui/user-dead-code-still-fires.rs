#![deny(dead_code)]

use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

// An annotated function that nothing calls is still dead code, and so is its `_outcome`
// sibling (a call of either keeps both).
#[idempotent(key = id)]
async fn never_called(id: u64) -> Result<u64, PayError> {
    Ok(id)
}

fn main() {}
