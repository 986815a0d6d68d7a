use idem_runtime::idempotent;

#[derive(Debug)]
pub struct PayError;

#[idempotent(key = id)]
async fn charge(id: u64) -> Result<u64, PayError> {
    Ok(id)
}

fn main() {}
