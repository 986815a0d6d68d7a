use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

#[idempotent(ttl = "1h")]
async fn charge(id: u64) -> Result<u64, PayError> {
    Ok(id)
}
// The function is still emitted beside the error: calling it causes no second error.
fn main() {
    let _ = charge(1);
}
