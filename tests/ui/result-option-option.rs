use idem_runtime::idempotent;

#[derive(Debug)]
pub struct LookupError;

impl From<idem_runtime::Error> for LookupError {
    fn from(_: idem_runtime::Error) -> Self {
        LookupError
    }
}

#[idempotent(key = id)]
async fn find(id: u64) -> Result<Option<Option<u64>>, LookupError> {
    Ok(Some(Some(id)))
}

fn main() {}
