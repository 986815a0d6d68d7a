use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

impl From<idem_runtime::Error> for PayError {
    fn from(_: idem_runtime::Error) -> Self {
        PayError
    }
}

fn is_final(_: &PayError) -> bool {
    true
}

#[idempotent(key = id, cache_err = is_final)]
async fn charge(id: u64) -> Result<u64, PayError> {
    Ok(id)
}
fn main() {}
