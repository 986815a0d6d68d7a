//! Idempotency shared through Redis: two stores on separate connections, standing in for two
//! processes, race on one key; the body runs once and both get its result.
//!
//! Run it with a Redis server on 127.0.0.1:6379 (or `IDEM_REDIS_URL`):
//! `cargo run -p idem-examples --example redis`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_runtime::{idempotent, RedisStore};

static SHIPMENTS: AtomicUsize = AtomicUsize::new(0);

#[derive(Debug)]
struct ShipError(idem_runtime::Error);

impl From<idem_runtime::Error> for ShipError {
    fn from(e: idem_runtime::Error) -> Self {
        Self(e)
    }
}

impl std::fmt::Display for ShipError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shipping failed: {}", self.0)
    }
}

impl std::error::Error for ShipError {}

/// Books a courier for an order: at most once per order, across every process on this Redis.
#[idempotent(key = order_id, store = store, namespace = "examples.ship.v1", ttl = "1h", lease = "10s")]
async fn ship(store: &RedisStore, order_id: u64) -> Result<String, ShipError> {
    let n = SHIPMENTS.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(Duration::from_millis(100)).await; // the courier's API
    Ok(format!("shipment #{n} for order {order_id}"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let process_a = RedisStore::connect(&url)
        .await?
        .with_prefix("idem-example:")?;
    let process_b = RedisStore::connect(&url)
        .await?
        .with_prefix("idem-example:")?;

    let order_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as u64;
    let (a, b) = tokio::join!(ship(&process_a, order_id), ship(&process_b, order_id));
    println!("process A got: {}", a?);
    println!("process B got: {}", b?);
    println!("a retry got:   {}", ship(&process_a, order_id).await?);
    println!(
        "the courier was called {} time(s)",
        SHIPMENTS.load(Ordering::SeqCst)
    );
    Ok(())
}
