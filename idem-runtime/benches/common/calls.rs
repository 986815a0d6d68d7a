//! The functions the path benches call through the macro, shared by the timed benches
//! (`paths`) and the instruction counts, and the key their hand-written baselines derive.
#![allow(dead_code)] // each bench calls some

use idem_runtime::{idempotent, Error, MemoryStore, RedisStore};
use sha2::{Digest, Sha256};

use super::common::{receipt, Receipt};

#[derive(Debug)]
pub struct BenchError;

impl From<Error> for BenchError {
    fn from(_: Error) -> Self {
        Self
    }
}

#[idempotent(key = (order_id, customer), store = store, namespace = "bench.charge")]
pub async fn charge(
    store: &MemoryStore,
    order_id: u64,
    customer: &str,
) -> Result<Receipt, BenchError> {
    Ok(receipt(order_id))
}

#[idempotent(key = order_id, store = store, namespace = "bench.redis")]
pub async fn charge_redis(store: &RedisStore, order_id: u64) -> Result<Receipt, BenchError> {
    Ok(receipt(order_id))
}

#[cached::proc_macro::cached(max_size = 10_000)]
pub async fn cached_charge(order_id: u64, customer: String) -> Receipt {
    let _ = customer;
    receipt(order_id)
}

/// The hand-written key of the baselines: the same fields, concatenated, hashed once.
pub fn hand_key(order_id: u64, customer: &str, line: u32) -> [u8; 32] {
    let mut bytes = [0_u8; 64];
    bytes[..8].copy_from_slice(&order_id.to_le_bytes());
    bytes[8..8 + customer.len()].copy_from_slice(customer.as_bytes());
    let end = 8 + customer.len();
    bytes[end..end + 4].copy_from_slice(&line.to_le_bytes());
    Sha256::digest(&bytes[..end + 4]).into()
}
