//! A small payments API behind `Idempotency-Key`, with axum.
//!
//! `cargo run -p idem-examples --example http` serves on 127.0.0.1:3000 with the in-memory store;
//! `cargo run -p idem-examples --example http -- --redis` keeps keys in Redis (`IDEM_REDIS_URL`, default
//! `redis://127.0.0.1:6379`), so that several instances share them;
//! `cargo run -p idem-examples --example http -- --sqlite idem.db` keeps them in one SQLite
//! file, so that a restart (a deploy) still replays what was recorded. Try it with curl (the
//! HTTP guide, `idem_runtime::guide::http`, has a session). `cargo run -p idem-examples --example http -- --demo` runs that
//! session against itself on a free port and exits.
//!
//! Keys are scoped per API key (the bearer token): the same `Idempotency-Key` from two
//! clients is two payments, and neither sees the other's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Json, Router};
use idem_runtime::http::{IdempotencyKey, IdempotencyLayer};
use idem_runtime::{MemoryStore, RedisStore, SqliteStore, Store};
use serde::{Deserialize, Serialize};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Deserialize)]
struct NewPayment {
    amount: u64,
    currency: String,
}

#[derive(Serialize)]
struct Payment {
    id: String,
    amount: u64,
    currency: String,
    idempotency_key: Option<String>,
}

/// `POST /payments`: charges the card (a gateway call of 300 ms), once per key.
async fn create_payment(
    State(charges): State<Arc<AtomicU64>>,
    key: Option<Extension<IdempotencyKey>>,
    Json(new): Json<NewPayment>,
) -> (StatusCode, Json<Payment>) {
    tokio::time::sleep(Duration::from_millis(300)).await; // the card gateway
    let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
    let payment = Payment {
        id: format!("pay_{n:04}"),
        amount: new.amount,
        currency: new.currency,
        idempotency_key: key.map(|Extension(k)| k.as_str().to_string()),
    };
    (StatusCode::CREATED, Json(payment))
}

fn app<St: Store + Clone>(store: St, charges: Arc<AtomicU64>) -> Router {
    let idempotency = IdempotencyLayer::new(store)
        .namespace("examples.payments.v1")
        // Whose key: the API key the client authenticates with.
        .scope(|parts: &http::request::Parts| {
            parts
                .headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::to_string)
        })
        .required()
        .ttl(Duration::from_secs(24 * 3600));
    Router::new()
        .route("/payments", post(create_payment))
        .with_state(charges)
        .layer(idempotency)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let charges = Arc::new(AtomicU64::new(0));
    let sqlite = args
        .iter()
        .position(|a| a == "--sqlite")
        .map(|at| {
            args.get(at + 1)
                .ok_or("--sqlite needs a file: --sqlite idem.db")
        })
        .transpose()?;
    let router = if let Some(file) = sqlite {
        let store = SqliteStore::open(file).await?;
        store.migrate().await?;
        app(store, charges.clone())
    } else if args.iter().any(|a| a == "--redis") {
        let url =
            std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        app(RedisStore::connect(&url).await?, charges.clone())
    } else {
        app(MemoryStore::new(), charges.clone())
    };
    if args.iter().any(|a| a == "--demo") {
        return demo(router, charges).await;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("payments API on http://127.0.0.1:3000 (Ctrl-C to stop)");
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // Let payments whose clients went away finish and be recorded.
    idem_runtime::drain(Duration::from_secs(10)).await?;
    Ok(())
}

/// The HTTP guide's curl session, against this server on a free port.
async fn demo(router: Router, charges: Arc<AtomicU64>) -> Result<(), BoxError> {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, router).await });
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let send = |key: Option<&'static str>, body: &'static str| {
        let client = client.clone();
        async move {
            let mut request = http::Request::post(format!("http://{addr}/payments"))
                .header("authorization", "Bearer sk_test_alice")
                .header("content-type", "application/json");
            if let Some(key) = key {
                request = request.header("idempotency-key", key);
            }
            let response = client
                .request(request.body(Full::new(Bytes::from_static(body.as_bytes())))?)
                .await?;
            let status = response.status();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let body = response.into_body().collect().await?.to_bytes();
            println!(
                "  {status}{} {}",
                if replayed {
                    " (Idempotent-Replayed: true)"
                } else {
                    ""
                },
                String::from_utf8_lossy(&body)
            );
            Ok::<_, BoxError>((status, replayed))
        }
    };
    let order = r#"{"amount": 4200, "currency": "eur"}"#;
    println!("first request:");
    let first = send(Some("\"order-17\""), order).await?;
    println!("the retry (same key, same body, other layout):");
    let retry = send(Some("\"order-17\""), r#"{"currency":"eur","amount":4200}"#).await?;
    println!("the same key with another amount:");
    let reused = send(
        Some("\"order-17\""),
        r#"{"amount": 9900, "currency": "eur"}"#,
    )
    .await?;
    println!("two requests with a new key at once:");
    // Whichever claims the key first charges (300 ms at the gateway); the other is told so.
    let (a, b) = tokio::join!(
        send(Some("\"order-18\""), order),
        send(Some("\"order-18\""), order)
    );
    println!("no key:");
    let missing = send(None, order).await?;

    let checks = [
        (
            first == (StatusCode::CREATED, false),
            "the first request runs",
        ),
        (retry == (StatusCode::CREATED, true), "the retry replays"),
        (
            reused.0 == StatusCode::UNPROCESSABLE_ENTITY,
            "a reused key is a 422",
        ),
        (
            [a?.0, b?.0].contains(&StatusCode::CONFLICT),
            "a duplicate in flight is a 409",
        ),
        (
            missing.0 == StatusCode::BAD_REQUEST,
            "a missing key is a 400",
        ),
        (charges.load(Ordering::SeqCst) == 2, "two charges in all"),
    ];
    for (ok, what) in checks {
        if !ok {
            return Err(format!("demo: expected that {what}").into());
        }
    }
    println!(
        "card charged {} times for 6 requests",
        charges.load(Ordering::SeqCst)
    );
    Ok(())
}
