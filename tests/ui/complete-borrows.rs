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
}

#[idempotent(key = order.id, on_cancel = "complete")]
async fn charge(order: &Order) -> Result<u64, PayError> {
    Ok(order.id)
}
fn main() {}
