//! The embedded default store: the first call runs, the second replays, 100 concurrent
//! duplicates run the body once, and an error releases the key.
//!
//! Run it with `cargo run --example quickstart`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_runtime::idempotent;
use serde::{Deserialize, Serialize};

/// How many times a body really ran.
static CHARGES: AtomicUsize = AtomicUsize::new(0);
static FLAKY_CALLS: AtomicUsize = AtomicUsize::new(0);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Receipt {
    id: String,
    cents: u64,
}

#[derive(Debug)]
enum PayError {
    GatewayTimeout,
    Idem(idem_runtime::Error),
}

impl std::fmt::Display for PayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::GatewayTimeout => f.write_str("the payment gateway timed out"),
            Self::Idem(e) => write!(f, "idempotency: {e}"),
        }
    }
}

impl std::error::Error for PayError {}

impl From<idem_runtime::Error> for PayError {
    fn from(e: idem_runtime::Error) -> Self {
        Self::Idem(e)
    }
}

/// Charges an order once, however often it is retried.
#[idempotent(key = (order_id, customer), fingerprint = cents, ttl = "24h")]
async fn charge(order_id: u64, customer: &str, cents: u64) -> Result<Receipt, PayError> {
    let n = CHARGES.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(Duration::from_millis(50)).await; // the payment gateway
    Ok(Receipt {
        id: format!("rcpt_{order_id}_{n}"),
        cents,
    })
}

/// Fails the first time, as a gateway that times out would.
#[idempotent(key = order_id)]
async fn flaky_charge(order_id: u64) -> Result<Receipt, PayError> {
    if FLAKY_CALLS.fetch_add(1, Ordering::SeqCst) == 0 {
        return Err(PayError::GatewayTimeout);
    }
    Ok(Receipt {
        id: format!("rcpt_{order_id}_flaky"),
        cents: 100,
    })
}

#[tokio::main]
async fn main() -> Result<(), PayError> {
    let first = charge(1001, "cus_42", 1999).await?;
    println!("first call:  ran the body, receipt {}", first.id);
    let again = charge(1001, "cus_42", 1999).await?;
    println!(
        "second call: replayed receipt {} (body runs so far: {})",
        again.id,
        CHARGES.load(Ordering::SeqCst)
    );

    let before = CHARGES.load(Ordering::SeqCst);
    let duplicates: Vec<_> = (0..100)
        .map(|_| tokio::spawn(charge(2002, "cus_7", 500)))
        .collect();
    let mut receipts = Vec::new();
    for duplicate in duplicates {
        receipts.push(duplicate.await.expect("task panicked")?.id);
    }
    receipts.dedup();
    println!(
        "100 concurrent duplicates: the body ran {} time(s), every caller got {:?}",
        CHARGES.load(Ordering::SeqCst) - before,
        receipts
    );

    match flaky_charge(3003).await {
        Err(PayError::GatewayTimeout) => println!("flaky call:  failed, and the key was released"),
        other => println!("flaky call:  unexpected {other:?}"),
    }
    let retried = flaky_charge(3003).await?;
    println!("retry:       ran the body again and got {}", retried.id);
    Ok(())
}
