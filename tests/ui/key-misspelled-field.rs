// A misspelled field in the key: the compiler's own error, and nothing else (no claim that
// the part is a `HashSet`).
use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

pub struct Order {
    pub id: u64,
    pub customer_id: u64,
}

#[idempotent(key = (order.customer, order.id))]
async fn charge(order: &Order) -> Result<u64, PayError> {
    Ok(order.id)
}

fn main() {}
