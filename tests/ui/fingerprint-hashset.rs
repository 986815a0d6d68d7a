use std::collections::HashSet;

use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

#[idempotent(key = id, fingerprint = (id, items))]
async fn ship(id: u64, items: HashSet<u32>) -> Result<usize, PayError> {
    Ok(items.len())
}

fn main() {}
