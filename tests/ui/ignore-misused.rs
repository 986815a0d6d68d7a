// `ignore` names parameters that do not change the outcome: not one that is not there, not
// one the key or fingerprint already uses, and not an expression.
use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

pub struct Gateway;

#[idempotent(key = order_id, fingerprint = amount, ignore = (gateway, amount, log))]
async fn charge(order_id: u64, amount: u64, gateway: &Gateway) -> Result<u64, PayError> {
    let _ = gateway;
    Ok(order_id + amount)
}

#[idempotent(key = order_id, ignore = gateway.client)]
async fn refund(order_id: u64, gateway: &Gateway) -> Result<u64, PayError> {
    let _ = gateway;
    Ok(order_id)
}

fn main() {}
