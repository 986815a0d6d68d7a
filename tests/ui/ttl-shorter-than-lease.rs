use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

#[idempotent(key = id, ttl = "2s")]
async fn charge(id: u64) -> Result<u64, PayError> {
    Ok(id)
}

#[idempotent(key = id, ttl = "1s", lease = "5s")]
async fn refund(id: u64) -> Result<u64, PayError> {
    Ok(id)
}

fn main() {}
