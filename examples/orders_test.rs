//! The orders endpoint (`orders.rs`) end to end, in a process of its own: a SIGKILL between
//! the handler's write and its commit leaves nothing, and the client's retry runs once;
//! duplicates sent together make one order; a replay carries `Idempotent-Replayed: true`
//! with the same status and body; another payload under the key is a `422`; no key, `400`.

#[path = "orders.rs"]
#[allow(dead_code)]
mod orders;

#[path = "process.rs"]
mod process;

use std::net::SocketAddr;
use std::time::Duration;

use idem_runtime::http::client::{IdempotencyKeyMiddleware, Retry};
use process::Service;
use reqwest::StatusCode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the orders service, started (and killed) by a_kill_before_the_commit_leaves_nothing_and_the_retry_runs_once"]
async fn orders_service() {
    let addr: SocketAddr = std::env::var("IDEM_ORDERS_ADDR").unwrap().parse().unwrap();
    orders::serve(addr, &url()).await.unwrap();
}

fn url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The orders service on `addr`, stalling before its commit if `stall`.
fn start(addr: SocketAddr, stall: bool) -> Service {
    let mut env = vec![("IDEM_ORDERS_ADDR", addr.to_string())];
    if stall {
        env.push(("IDEM_ORDERS_STALL", "1".to_string()));
    }
    Service::start("orders_service", &env)
}

async fn rows(pool: &sqlx::PgPool, sku: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE sku = $1")
        .bind(sku)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_before_the_commit_leaves_nothing_and_the_retry_runs_once() {
    let pool = match sqlx::PgPool::connect(&url()).await {
        Ok(pool) => pool,
        Err(e) => {
            assert!(
                std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(),
                "PostgreSQL is required (IDEM_REQUIRE_SERVICES): {e}"
            );
            eprintln!("skipped: PostgreSQL is unreachable ({e})");
            return;
        }
    };
    let addr = process::free_addr();
    let endpoint = format!("http://{addr}/orders");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let run = format!("{}-{nanos}", std::process::id());
    let sku = format!("sku-{run}");
    let order = |quantity: u32| orders::Order {
        sku: sku.clone(),
        quantity,
    };

    // The first request stalls after its write, uncommitted, and the service is killed.
    let mut service = start(addr, true);
    service.said("listening").await;
    let retrying = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(
            IdempotencyKeyMiddleware::new().retry(
                Retry::new()
                    .attempts(20)
                    .budget(Duration::from_secs(120))
                    .timeout(Duration::from_secs(30)),
            ),
        )
        .build();
    let key = format!("order-{run}-killed");
    let first = tokio::spawn({
        let (retrying, endpoint, key, body) =
            (retrying.clone(), endpoint.clone(), key.clone(), order(2));
        async move {
            retrying
                .post(&endpoint)
                .header("idempotency-key", &key)
                .json(&body)
                .send()
                .await
        }
    });
    service.said("stalled before commit").await;
    drop(service);
    assert_eq!(
        rows(&pool, &sku).await,
        0,
        "the killed transaction left nothing"
    );
    let mut service = start(addr, false);
    service.said("listening").await;
    let first = first
        .await
        .unwrap()
        .expect("the client delivered after the restart");
    assert_eq!(first.status(), StatusCode::CREATED);
    let receipt: orders::Receipt = first.json().await.unwrap();
    assert_eq!(rows(&pool, &sku).await, 1, "the retry ran once");

    // The replay: the same status and body, marked.
    let plain = reqwest::Client::new();
    let send = |key: Option<&str>, quantity: u32| {
        let mut request = plain.post(&endpoint).json(&order(quantity));
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        request.send()
    };
    let again = send(Some(&key), 2).await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<orders::Receipt>().await.unwrap(), receipt);

    // Another payload under the key; no key at all.
    let changed = send(Some(&key), 3).await.unwrap();
    assert_eq!(changed.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let keyless = send(None, 2).await.unwrap();
    assert_eq!(keyless.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        keyless.headers()["content-type"],
        "application/problem+json"
    );
    assert_eq!(rows(&pool, &sku).await, 1);

    // Duplicates sent together: one order; each gets it (or 409 while it runs).
    let key = format!("order-{run}-crowd");
    let crowd: Vec<_> = (0..8).map(|_| send(Some(&key), 5)).collect();
    let mut created = Vec::new();
    for answer in futures_util::future::join_all(crowd).await {
        let answer = answer.unwrap();
        match answer.status() {
            StatusCode::CREATED => created.push(answer.json::<orders::Receipt>().await.unwrap()),
            StatusCode::CONFLICT => {}
            other => panic!("a duplicate was answered {other}"),
        }
    }
    assert!(!created.is_empty());
    assert!(created.iter().all(|r| *r == created[0]), "{created:?}");
    assert_eq!(rows(&pool, &sku).await, 2, "the crowd made one order");
    drop(service);
}
