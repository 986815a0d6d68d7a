#![deny(unused_variables)]

use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

// The user's own lints still fire inside an annotated function.
#[idempotent(key = id)]
pub async fn used(id: u64) -> Result<u64, PayError> {
    let unused = 5;
    Ok(id)
}

fn main() {}
