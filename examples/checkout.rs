//! The whole chain, end to end: a client that retries, a network that loses answers, a
//! checkout service that is SIGKILLed at random points and restarted, and the services it
//! calls, with every effect counted.
//!
//! `cargo run -p idem-examples --example checkout -- --demo` (PostgreSQL on 127.0.0.1:5432;
//! `IDEM_POSTGRES_URL` points elsewhere) runs 200 checkouts and prints the counts;
//! `examples/checkout_test.rs` runs 1000.
//!
//! ```text
//! client (IdempotencyKeyLayer: one key per checkout, retries)
//!   → loopback proxy (loses answers, refuses, cuts requests, stalls)
//!     → checkout service, its own OS process (IdempotencyLayer on PostgreSQL)
//!         step "reserve": POST the shop (behind IdempotencyLayer), keyed by the step's key
//!         step "charge":  POST the gateway (dedupes by Idempotency-Key, counts charges)
//!         step "order":   the order row, claimed and written in one PostgreSQL transaction
//! ```
//!
//! The checkout service is killed after a random number of completed checkouts, at a random
//! moment, and started again on the same port. A killed attempt leaves its key held until
//! its lease runs out (2 s here); the client's retries then find the steps that finished
//! recorded, and the step that did not runs: with the same downstream key, so that the shop
//! and the gateway, which may have seen it before the kill, answer it once.
//!
//! The run checks that every checkout made exactly one reservation, one charge and one order,
//! that every client got its own receipt, and that no claim is left held.//!
//! Here: the client and the driver; `checkout/service.rs`: the checkout service;
//! `checkout/downstream.rs`: the shop and the gateway; `checkout/network.rs`: the proxy.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem_runtime::http::client::IdempotencyKeyService;
use idem_runtime::http::client::{Delivery, IdempotencyKeyLayer, Retry};
use idem_runtime::http::IdempotencyLayer;
use idem_runtime::{attempt, step, Error, MemoryStore, Operation, PostgresStore};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::{ServiceBuilder, ServiceExt};

#[path = "checkout/downstream.rs"]
mod downstream;
#[path = "checkout/network.rs"]
mod network;
#[path = "checkout/service.rs"]
mod service;

use downstream::*;
use network::*;
pub use service::serve_from_env;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The checkout service's lease: how long a killed attempt's key stays held.
const LEASE: Duration = Duration::from_secs(2);

#[derive(Debug, Serialize, Deserialize)]
pub struct Order {
    pub id: u64,
    pub total: u64,
}

/// What a checkout answers, and every retry of it replays.
#[derive(Debug, Serialize, Deserialize)]
pub struct Receipt {
    pub order: u64,
    pub hold: String,
    pub charge: String,
    pub row: i64,
}

/// What a downstream service answers: the id of what it made.
#[derive(Serialize, Deserialize)]
struct Made {
    id: String,
}

/// A client that resends each request with the same `Idempotency-Key` until it succeeds or
/// the budget is spent; one connection per attempt, so that each meets the network anew.
type Keyed = IdempotencyKeyService<Client<HttpConnector, Full<Bytes>>>;

fn keyed_client(budget: Duration) -> Keyed {
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<Full<Bytes>>();
    ServiceBuilder::new()
        .layer(
            IdempotencyKeyLayer::new().retry(
                Retry::new()
                    .budget(budget)
                    .backoff(Duration::from_millis(5), Duration::from_millis(200))
                    // A stalled answer never comes; a real one takes milliseconds.
                    .timeout(Duration::from_secs(2)),
            ),
        )
        .service(client)
}

/// POSTs `body` to `url` and reads the answer's body; `key` (if any) is the request's
/// `Idempotency-Key`. Returns the status, the body, and how the answer was delivered.
async fn send(
    client: &Keyed,
    url: &str,
    key: Option<&str>,
    body: Vec<u8>,
) -> Result<(StatusCode, Bytes, Option<Delivery>), BoxError> {
    let mut request = http::Request::post(url).header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = client
        .clone()
        .oneshot(request.body(Full::new(Bytes::from(body)))?)
        .await?;
    let status = response.status();
    let delivery = response.extensions().get::<Delivery>().cloned();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, body, delivery))
}

// ---- the driver ----------------------------------------------------------------------------

/// What a run counted.
#[derive(Debug, Default)]
pub struct Report {
    pub checkouts: u64,
    pub kills: u64,
    /// Attempts the clients made, and how many answers were replays.
    pub attempts: u64,
    pub replays: u64,
    /// Per order: reservations the shop made, charges the gateway made, order rows written.
    pub reservations: HashMap<u64, u32>,
    pub charges: HashMap<u64, u32>,
    pub orders: HashMap<u64, i64>,
    /// Checkouts whose receipt named another order, or a hold or charge the shop or the
    /// gateway did not make for it.
    pub wrong_receipts: u64,
    /// Claims still held in the store after the run.
    pub held: i64,
    pub downstream_calls: u64,
    pub slowest: Duration,
}

impl Report {
    /// Whether every checkout made exactly one of each effect and got its own receipt.
    pub fn exactly_once(&self) -> bool {
        let once = |counts: &HashMap<u64, u32>| {
            counts.len() as u64 == self.checkouts && counts.values().all(|&n| n == 1)
        };
        once(&self.reservations)
            && once(&self.charges)
            && self.orders.len() as u64 == self.checkouts
            && self.orders.values().all(|&n| n == 1)
            && self.wrong_receipts == 0
            && self.held == 0
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sum = |counts: &HashMap<u64, u32>| counts.values().map(|&n| u64::from(n)).sum::<u64>();
        write!(
            f,
            "{} checkouts through {} kills of the service: {} client attempts ({} answers replayed), \
             {} downstream calls; {} reservations, {} charges, {} orders; {} wrong receipts; \
             {} claims left held; slowest checkout {:.1?}",
            self.checkouts,
            self.kills,
            self.attempts,
            self.replays,
            self.downstream_calls,
            sum(&self.reservations),
            sum(&self.charges),
            self.orders.values().sum::<i64>(),
            self.wrong_receipts,
            self.held,
            self.slowest,
        )
    }
}

/// The checkout service's process, started by `start` with the environment it is given;
/// reports when it listens.
struct Process {
    child: std::process::Child,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl Process {
    fn start(start: &dyn Fn() -> Command, env: &[(&str, String)]) -> Result<Self, BoxError> {
        use std::io::{BufRead, BufReader};
        let mut command = start();
        command
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped());
        let mut child = command.spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (send, lines) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self { child, lines })
    }

    /// Waits until the service says it listens.
    async fn listening(&mut self) -> Result<(), BoxError> {
        while let Some(line) = self.lines.recv().await {
            if line.contains("listening") {
                return Ok(());
            }
        }
        Err("the checkout service exited before it listened".into())
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `checkouts` checkouts, 50 at a time, through the whole chain, against a checkout
/// service that `start` starts as a process of its own (and this run kills and restarts),
/// and counts every effect.
pub async fn run(checkouts: u64, start: &dyn Fn() -> Command) -> Result<Report, BoxError> {
    const CONCURRENT: usize = 50;
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let (table, orders) = (
        format!("idem_checkout_{run}"),
        format!("checkout_orders_{run}"),
    );
    let store = PostgresStore::connect(&url).await?.with_table(&table)?;
    store.migrate().await?;
    let pool = store.pool().clone();
    sqlx::query(&format!(
        "CREATE TABLE {orders} (id bigserial PRIMARY KEY, order_id bigint NOT NULL, hold text NOT NULL, charge text NOT NULL)"
    ))
    .execute(&pool)
    .await?;

    let down = Arc::new(Downstream::default());
    let shop = serve(
        Router::new()
            .route("/reserve", post(reserve))
            .with_state(Arc::clone(&down))
            .layer(
                IdempotencyLayer::new(MemoryStore::new())
                    .unscoped()
                    .required(),
            ),
    )
    .await?;
    let gateway = serve(
        Router::new()
            .route("/charge", post(charge))
            .with_state(Arc::clone(&down)),
    )
    .await?;
    let port = TcpListener::bind("127.0.0.1:0").await?.local_addr()?.port();
    let env = [
        ("IDEM_POSTGRES_URL", url.clone()),
        ("IDEM_CHECKOUT_TABLE", table.clone()),
        ("IDEM_CHECKOUT_ORDERS", orders.clone()),
        ("IDEM_CHECKOUT_SHOP", format!("http://{shop}/reserve")),
        ("IDEM_CHECKOUT_GATEWAY", format!("http://{gateway}/charge")),
        ("IDEM_CHECKOUT_PORT", port.to_string()),
    ];
    let mut service = Process::start(start, &env)?;
    service.listening().await?;
    let address = proxy(SocketAddr::from(([127, 0, 0, 1], port))).await?;

    // The load: each checkout one logical request, its key kept across every retry.
    let client = keyed_client(Duration::from_secs(120));
    let done = Arc::new(AtomicU64::new(0));
    let progress = Arc::new(tokio::sync::Notify::new());
    let slots = Arc::new(tokio::sync::Semaphore::new(CONCURRENT));
    let mut calls = tokio::task::JoinSet::new();
    for id in 0..checkouts {
        let slot = Arc::clone(&slots).acquire_owned().await?;
        let (client, done, progress) = (client.clone(), Arc::clone(&done), Arc::clone(&progress));
        calls.spawn(async move {
            let started = Instant::now();
            let order = serde_json::to_vec(&Order {
                id,
                total: 1000 + id,
            })?;
            let answer = send(&client, &format!("http://{address}/checkout"), None, order).await;
            drop(slot);
            done.fetch_add(1, Ordering::SeqCst);
            progress.notify_one();
            let (status, body, delivery) = answer?;
            if status != StatusCode::CREATED {
                return Err(format!("checkout {id}: {status}").into());
            }
            let receipt: Receipt = serde_json::from_slice(&body)?;
            Ok::<_, BoxError>((id, receipt, delivery, started.elapsed()))
        });
    }

    // The kills: after a random number of completed checkouts, at a random moment.
    let mut report = Report {
        checkouts,
        ..Report::default()
    };
    let mut next_kill = 20 + draw(run as u64) % 80;
    while done.load(Ordering::SeqCst) < checkouts {
        progress.notified().await;
        if done.load(Ordering::SeqCst) >= next_kill && done.load(Ordering::SeqCst) < checkouts {
            tokio::time::sleep(Duration::from_millis(draw(next_kill) % 30)).await;
            service.kill();
            report.kills += 1;
            service = Process::start(start, &env)?;
            service.listening().await?;
            next_kill += 40 + draw(next_kill ^ run as u64) % 120;
        }
    }

    while let Some(call) = calls.join_next().await {
        let (id, receipt, delivery, took) = call??;
        if let Some(delivery) = delivery {
            report.attempts += u64::from(delivery.attempts());
            report.replays += u64::from(delivery.replayed());
        }
        report.slowest = report.slowest.max(took);
        let hold_ok = receipt.hold.starts_with(&format!("hold_{id}_"));
        let charge_ok = receipt.charge.starts_with(&format!("ch_{id}_"));
        if receipt.order != id || !hold_ok || !charge_ok {
            report.wrong_receipts += 1;
        }
    }
    drop(service);

    report.reservations = down.reservations.lock().unwrap().clone();
    report.charges = down.charges.lock().unwrap().clone();
    report.downstream_calls = down.asked.load(Ordering::Relaxed);
    let rows: Vec<(i64, i64)> = sqlx::query_as(&format!(
        "SELECT order_id, count(*) FROM {orders} GROUP BY order_id"
    ))
    .fetch_all(&pool)
    .await?;
    report.orders = rows.into_iter().map(|(id, n)| (id as u64, n)).collect();
    (report.held,) = sqlx::query_as(&format!("SELECT count(*) FROM {table} WHERE NOT completed"))
        .fetch_one(&pool)
        .await?;
    for dropped in [&orders, &table, &format!("{table}_token")] {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {dropped}"))
            .execute(&pool)
            .await;
    }
    let _ = sqlx::query(&format!("DROP SEQUENCE IF EXISTS {table}_token"))
        .execute(&pool)
        .await;
    Ok(report)
}

#[allow(dead_code)] // a test includes this file without calling `main`
#[tokio::main]
async fn main() -> Result<(), BoxError> {
    if std::env::args().any(|arg| arg == "--serve") {
        return serve_from_env().await;
    }
    let exe = std::env::current_exe()?;
    let report = run(200, &|| {
        let mut command = Command::new(&exe);
        command.arg("--serve");
        command
    })
    .await?;
    println!("{report}");
    if !report.exactly_once() {
        return Err("a checkout did not make exactly one reservation, charge and order".into());
    }
    println!("every checkout reserved, charged and ordered exactly once, and got its own receipt");
    Ok(())
}
