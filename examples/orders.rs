//! One request, one transaction: an HTTP endpoint whose effect is a write in the same
//! database. The key's claim, the order row and the recorded answer commit together, in the
//! handler's own PostgreSQL transaction, so a crash anywhere before the commit leaves
//! nothing, and a retry after it replays the answer.
//!
//! `cargo run -p idem-examples --example orders -- --demo` (PostgreSQL on 127.0.0.1:5432, or
//! `IDEM_POSTGRES_URL`): serves on a loopback port, then sends an order twice with one key
//! (created, then replayed with `Idempotent-Replayed: true`), once more with another payload
//! (`422`), and once without a key (`400`). `--serve` serves on `IDEM_ORDERS_ADDR` until
//! killed; `examples/orders_test.rs` kills it between the handler's write and its commit.

use std::net::SocketAddr;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::http::IdempotencyKey;
use idem_runtime::{idempotent, Error, Outcome, PostgresStore};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a client orders.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Order {
    pub sku: String,
    pub quantity: u32,
}

/// What the endpoint answers: the order's row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    pub order_id: i64,
    pub sku: String,
    pub quantity: u32,
}

#[derive(Clone)]
struct App {
    pool: PgPool,
    store: PostgresStore,
}

/// Places an order: its row, written in the caller's transaction, where its key is claimed
/// and its receipt recorded.
#[idempotent(key = key, fingerprint = order, store = store, transaction = tx)]
async fn place(
    key: &IdempotencyKey,
    order: &Order,
    store: &PostgresStore,
    tx: &mut PgConnection,
) -> Result<Receipt, Error> {
    let order_id: i64 =
        sqlx::query_scalar("INSERT INTO orders (sku, quantity) VALUES ($1, $2) RETURNING id")
            .bind(&order.sku)
            .bind(i64::from(order.quantity))
            .fetch_one(&mut *tx)
            .await
            .map_err(Error::store)?;
    stall_before_commit().await;
    Ok(Receipt {
        order_id,
        sku: order.sku.clone(),
        quantity: order.quantity,
    })
}

/// `POST /orders`: extract the key, begin, place, commit, answer. A replay answers the same
/// status and body, with `Idempotent-Replayed: true`.
async fn create(
    State(app): State<App>,
    key: IdempotencyKey,
    Json(order): Json<Order>,
) -> Result<Outcome<(StatusCode, Json<Receipt>)>, Error> {
    let mut tx = app.pool.begin().await.map_err(Error::store)?;
    let outcome = place_outcome(&key, &order, &app.store, &mut tx).await?;
    tx.commit().await.map_err(Error::store)?;
    Ok(outcome.map(|receipt| (StatusCode::CREATED, Json(receipt))))
}

/// The hook of `orders_test.rs`: with `IDEM_ORDERS_STALL` set, the handler says so after
/// its write and waits there, uncommitted, to be killed.
async fn stall_before_commit() {
    if std::env::var_os("IDEM_ORDERS_STALL").is_some() {
        println!("stalled before commit");
        std::future::pending::<()>().await;
    }
}

/// The service on `pool`'s database, its orders table made if missing.
pub async fn router(url: &str) -> Result<Router, BoxError> {
    let store = PostgresStore::connect(url).await?;
    store.migrate().await?;
    let pool = store.pool().clone();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (\
            id bigserial PRIMARY KEY, sku text NOT NULL, quantity bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;
    Ok(Router::new()
        .route("/orders", post(create))
        .with_state(App { pool, store }))
}

/// Serves `router` on `addr` until the process ends.
pub async fn serve(addr: SocketAddr, url: &str) -> Result<(), BoxError> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, router(url).await?).await?;
    Ok(())
}

fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The demo: one order sent as a client would, with its retries and mistakes.
async fn demo() -> Result<(), BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = router(&postgres_url()).await?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/orders");
    let key = format!("order-{}", std::process::id());
    let send = |key: Option<&str>, quantity: u32| {
        let mut request = client.post(&url).json(&Order {
            sku: "sku-42".into(),
            quantity,
        });
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        request.send()
    };
    let first = send(Some(&key), 2).await?;
    let replayed = first.headers().get("idempotent-replayed").is_some();
    println!(
        "first:         {} replayed={replayed} {}",
        first.status(),
        first.text().await?
    );
    let again = send(Some(&key), 2).await?;
    let replayed = again.headers().get("idempotent-replayed").is_some();
    println!(
        "again:         {} replayed={replayed} {}",
        again.status(),
        again.text().await?
    );
    let changed = send(Some(&key), 3).await?;
    println!("other payload: {}", changed.status());
    let keyless = send(None, 2).await?;
    println!("no key:        {}", keyless.status());
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    if std::env::args().any(|arg| arg == "--serve") {
        let addr = std::env::var("IDEM_ORDERS_ADDR")?.parse()?;
        return serve(addr, &postgres_url()).await;
    }
    demo().await
}
