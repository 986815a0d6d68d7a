// A parameter in neither the key nor the fingerprint: a retry with another `amount` would
// replay the first call's result. The error is on the parameter and offers the three fixes.
use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

#[idempotent(key = order_id)]
async fn charge(order_id: u64, amount: u64) -> Result<u64, PayError> {
    Ok(order_id + amount)
}

fn main() {}
