//! What the bench programs share: the recorded value and the runtime they run on.

use serde::{Deserialize, Serialize};

/// A small struct result, as a payment call returns: about 70 bytes of JSON.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Receipt {
    pub id: u64,
    pub customer: String,
    pub cents: u64,
    pub currency: String,
}

pub fn receipt(id: u64) -> Receipt {
    Receipt {
        id,
        customer: "cus_0042".into(),
        cents: 1999,
        currency: "EUR".into(),
    }
}

/// A tokio runtime with the 2 workers of the machine the figures come from.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A number no earlier run started from (nanoseconds since the epoch), to count fresh keys
/// from: the stores keep records for a day, and a key an earlier run recorded would replay
/// where a first execution is meant.
#[allow(dead_code)] // the footprint bench derives no fresh keys
pub fn run_start() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}
