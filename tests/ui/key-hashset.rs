use std::collections::HashSet;

use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

#[derive(serde::Serialize)]
pub struct Order {
    pub id: u64,
    pub tags: HashSet<String>,
}

// A parameter that is a set.
#[idempotent(key = tags)]
async fn tag(tags: &HashSet<String>) -> Result<u64, PayError> {
    Ok(tags.len() as u64)
}

// A set inside the key's tuple, reached through a field.
#[idempotent(key = (order.id, &order.tags))]
async fn charge(order: &Order) -> Result<u64, PayError> {
    Ok(order.id)
}

fn main() {}
