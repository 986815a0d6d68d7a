//! Idempotency records in PostgreSQL: durable across restarts, shared by every process on the
//! database. Provisions a tenant once, however many times the request is retried.
//!
//! Run it with PostgreSQL on 127.0.0.1:5432 (or `IDEM_POSTGRES_URL`):
//! `cargo run -p idem-examples --example postgres`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_runtime::{idempotent, PostgresStore};
use serde::{Deserialize, Serialize};

static PROVISIONED: AtomicUsize = AtomicUsize::new(0);

#[derive(Debug, Serialize, Deserialize)]
struct Tenant {
    id: String,
    plan: String,
}

#[derive(Debug)]
struct ProvisionError(idem_runtime::Error);

impl From<idem_runtime::Error> for ProvisionError {
    fn from(e: idem_runtime::Error) -> Self {
        Self(e)
    }
}

impl std::fmt::Display for ProvisionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "provisioning failed: {}", self.0)
    }
}

impl std::error::Error for ProvisionError {}

#[idempotent(
    key = request_id,
    fingerprint = plan,
    store = store,
    namespace = "tenants.provision.v1",
    ttl = "7d",
)]
async fn provision(
    store: &PostgresStore,
    request_id: &str,
    plan: &str,
) -> Result<Tenant, ProvisionError> {
    let n = PROVISIONED.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(Duration::from_millis(50)).await; // create the database, the bucket, …
    Ok(Tenant {
        id: format!("tenant-{n}"),
        plan: plan.to_string(),
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let store = PostgresStore::connect(&url)
        .await?
        .with_table("idem_example_records")?;
    store.migrate().await?;
    let _purger = store.purge_every(Duration::from_secs(600));

    let request = format!(
        "req-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos()
    );
    println!(
        "first request: {:?}",
        provision(&store, &request, "pro").await?
    );
    println!(
        "retried:       {:?}",
        provision(&store, &request, "pro").await?
    );
    match provision(&store, &request, "enterprise").await {
        Err(e) => println!("same request id, other plan: refused ({e})"),
        Ok(t) => println!("unexpected: {t:?}"),
    }
    println!(
        "tenants provisioned: {}",
        PROVISIONED.load(Ordering::SeqCst)
    );
    Ok(())
}
