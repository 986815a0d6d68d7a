use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

pub struct NotAStore;

#[idempotent(key = id, store = NotAStore)]
async fn charge(id: u64) -> Result<u64, PayError> {
    Ok(id)
}
fn main() {}
