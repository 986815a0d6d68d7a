//! A payment service with its own store: `&self` methods, a fingerprint that refuses a reused
//! key with another payload, and `cache_err` that records a declined card as final.
//!
//! Run it with `cargo run --example payments`.

use std::sync::atomic::{AtomicUsize, Ordering};

use idem_runtime::{idempotent, MemoryStore};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct ChargeRequest {
    /// The client's `Idempotency-Key` header.
    idempotency_key: String,
    card: String,
    cents: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    id: String,
    cents: u64,
}

#[derive(Debug, Serialize, Deserialize)]
enum PayError {
    /// The bank said no: final, so it is recorded and replayed.
    Declined { reason: String },
    /// The gateway was unreachable: worth a retry, so the key is released.
    Unavailable,
    /// The idempotency layer refused (reused key, in progress, store down).
    Refused(String),
}

impl From<idem_runtime::Error> for PayError {
    fn from(e: idem_runtime::Error) -> Self {
        Self::Refused(e.to_string())
    }
}

fn is_final(e: &PayError) -> bool {
    matches!(e, PayError::Declined { .. })
}

struct Payments {
    store: MemoryStore,
    gateway_calls: AtomicUsize,
}

impl Payments {
    #[idempotent(
        key = req.idempotency_key,
        fingerprint = (&req.card, req.cents),
        store = self.store,
        namespace = "payments.charge.v1",
        cache_err = is_final,
    )]
    async fn charge(&self, req: &ChargeRequest) -> Result<Receipt, PayError> {
        self.gateway_calls.fetch_add(1, Ordering::SeqCst);
        if req.card.ends_with("0002") {
            return Err(PayError::Declined {
                reason: "insufficient funds".into(),
            });
        }
        Ok(Receipt {
            id: format!("ch_{}", req.idempotency_key),
            cents: req.cents,
        })
    }
}

#[tokio::main]
async fn main() {
    let payments = Payments {
        store: MemoryStore::builder().capacity(100_000).build(),
        gateway_calls: AtomicUsize::new(0),
    };
    let request = |key: &str, card: &str, cents| ChargeRequest {
        idempotency_key: key.into(),
        card: card.into(),
        cents,
    };

    let ok = request("idem-1", "4242424242424242", 1999);
    println!("charge:         {:?}", payments.charge(&ok).await);
    println!("retry:          {:?}", payments.charge(&ok).await);

    let tampered = request("idem-1", "4242424242424242", 9999);
    println!(
        "same key, other amount: {:?}",
        payments.charge(&tampered).await
    );

    let declined = request("idem-2", "4000000000000002", 500);
    println!("declined card:  {:?}", payments.charge(&declined).await);
    println!("retry declined: {:?}", payments.charge(&declined).await);

    println!(
        "the gateway was called {} times for 5 requests",
        payments.gateway_calls.load(Ordering::SeqCst)
    );
}
