use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

pub struct Receipt;

#[idempotent(key = id)]
async fn charge(id: u64) -> Result<Receipt, PayError> {
    let _ = id;
    Ok(Receipt)
}
fn main() {}
