//! A notifications and fulfilment service written with the README's default patterns:
//! Redis in front for speed, PostgreSQL for durability and for every effect.
//!
//! - `POST /webhooks/standard` (Standard Webhooks, as Svix sends them) notifies a user, and
//!   `POST /webhooks/github` credits a sponsor: each preset is a layer that checks the
//!   sender's signature and finds the delivery's key (Svix's message id; for GitHub, which
//!   signs the body alone, the event's kind and the body's digest), and the handler claims
//!   that key in its own transaction, beside its row.
//! - A NATS JetStream consumer ships orders: `Consumer::inbox` hands the handler the
//!   message's id, which it claims in its transaction, beside the shipment's row; the
//!   payment is captured from an API through `IdempotencyKeyMiddleware`, whose key is
//!   derived from the order's claim, the same on every redelivery.
//! - The store is a `TieredStore` of Redis over PostgreSQL: claims and records commit with
//!   the effects, in PostgreSQL; replays come from Redis.
//!
//! `cargo run -p idem-examples --example fulfilment -- --demo` (Redis, PostgreSQL and NATS
//! on their usual local ports, or `IDEM_REDIS_URL`, `IDEM_POSTGRES_URL`, `IDEM_NATS_URL`)
//! runs the service, a payments API and a sender in one process: deliveries resent,
//! orders published twice, and the counts checked. `--serve` serves until its stdin
//! closes: `examples/fulfilment_test.rs` runs two such instances and SIGKILLs them, more
//! than fifty times, between their effects and their answers.

use std::net::SocketAddr;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy};
use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use futures_util::StreamExt;
use hmac::{Hmac, Mac};
use idem_runtime::consumer::Consumer;
use idem_runtime::http::client::IdempotencyKeyMiddleware;
use idem_runtime::http::Webhook;
use idem_runtime::{idempotent, Error, IdempotencyKey, PostgresStore, RedisStore, TieredStore};
use reqwest_middleware::ClientWithMiddleware;
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use sqlx::{PgConnection, PgPool};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Redis in front, PostgreSQL for durability and effects.
pub type Store = TieredStore<RedisStore, PostgresStore>;

/// The Standard Webhooks endpoint's secret (`whsec_` and the key in base64) and the GitHub
/// hook's, which the example's senders share.
pub const STANDARD_SECRET: &str = "whsec_ZnVsZmlsbWVudCBleGFtcGxlIHNlY3JldA==";
pub const GITHUB_SECRET: &str = "fulfilment hook secret";
/// The durable JetStream consumer every instance pulls from.
pub const CONSUMER: &str = "fulfilment";

/// Where a stalling instance stops, to be killed there (the kill test's hook; an instance
/// started without `IDEM_FULFILMENT_STALL` never stops).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stall {
    /// A webhook's or an order's transaction committed, its answer or ack not sent.
    AfterCommit,
    /// An order's payment captured, its transaction not committed.
    AfterCapture,
}

/// A Standard Webhooks event: a user to notify.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct UserEvent {
    #[serde(rename = "type")]
    pub kind: String,
    pub user: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall: Option<Stall>,
}

/// A GitHub sponsorship: a sponsor to credit.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sponsorship {
    pub sponsor: String,
    pub cents: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall: Option<Stall>,
}

/// An order to ship, and its payment to capture.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Order {
    pub order: String,
    pub cents: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall: Option<Stall>,
}

#[derive(Clone)]
struct App {
    pool: PgPool,
    store: Store,
    payments: ClientWithMiddleware,
    payments_url: String,
    stall: bool,
}

impl App {
    /// With stalls on, says where it stopped and waits there to be killed.
    async fn stall_at(&self, marked: Option<Stall>, here: Stall, what: &str) {
        if self.stall && marked == Some(here) {
            println!("stalled {here:?} {what}");
            std::future::pending::<()>().await;
        }
    }
}

/// Notifies `event.user` once per delivery: the claim, the row and the record commit in
/// `tx`.
#[idempotent(key = key, fingerprint = event.user, store = store, transaction = tx, namespace = "fulfilment.notify.v1")]
async fn notify(
    key: &IdempotencyKey,
    event: &UserEvent,
    store: &Store,
    tx: &mut PgConnection,
) -> Result<i64, Error> {
    sqlx::query_scalar(
        "INSERT INTO fulfilment_notifications (delivery, recipient) VALUES ($1, $2) RETURNING id",
    )
    .bind(key.as_str())
    .bind(&event.user)
    .fetch_one(&mut *tx)
    .await
    .map_err(Error::store)
}

/// Credits a sponsorship once: its key is what GitHub signed (the event's kind and the
/// body), whatever delivery id it came with.
#[idempotent(key = key, fingerprint = (sponsorship.sponsor, sponsorship.cents), store = store, transaction = tx, namespace = "fulfilment.sponsor.v1")]
async fn sponsor(
    key: &IdempotencyKey,
    sponsorship: &Sponsorship,
    store: &Store,
    tx: &mut PgConnection,
) -> Result<i64, Error> {
    sqlx::query_scalar(
        "INSERT INTO fulfilment_credits (delivery, sponsor, cents) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(key.as_str())
    .bind(&sponsorship.sponsor)
    .bind(sponsorship.cents)
    .fetch_one(&mut *tx)
    .await
    .map_err(Error::store)
}

/// `POST /webhooks/standard`.
async fn standard(
    State(app): State<App>,
    key: IdempotencyKey,
    Json(event): Json<UserEvent>,
) -> Result<String, Error> {
    let mut tx = app.pool.begin().await.map_err(Error::store)?;
    let notified = notify(&key, &event, &app.store, &mut tx).await?;
    tx.commit().await.map_err(Error::store)?;
    app.stall_at(event.stall, Stall::AfterCommit, key.as_str())
        .await;
    Ok(format!("notification {notified}"))
}

/// `POST /webhooks/github`.
async fn github(
    State(app): State<App>,
    key: IdempotencyKey,
    Json(sponsorship): Json<Sponsorship>,
) -> Result<String, Error> {
    let mut tx = app.pool.begin().await.map_err(Error::store)?;
    let credited = sponsor(&key, &sponsorship, &app.store, &mut tx).await?;
    tx.commit().await.map_err(Error::store)?;
    app.stall_at(sponsorship.stall, Stall::AfterCommit, key.as_str())
        .await;
    Ok(format!("credit {credited}"))
}

/// What the payments API answered a capture.
#[derive(Debug, Deserialize)]
struct Captured {
    capture: u64,
}

/// Ships `order` once per message: the claim, the shipment and the record commit in `tx`.
/// The capture goes out first; its key is derived from this call's, so a redelivery (after
/// a kill before the commit) sends it again under the same key, and the API replays it.
#[idempotent(key = key, fingerprint = (order.order, order.cents), store = store, transaction = tx, namespace = "fulfilment.ship.v1", ignore = app)]
async fn ship(
    key: &IdempotencyKey,
    order: &Order,
    store: &Store,
    tx: &mut PgConnection,
    app: &App,
) -> Result<i64, Error> {
    let captured: Captured = app
        .payments
        .post(format!("{}/captures", app.payments_url))
        .json(&serde_json::json!({ "order": order.order, "cents": order.cents }))
        .send()
        .await
        .and_then(|answer| Ok(answer.error_for_status()?))
        .map_err(Error::store)?
        .json()
        .await
        .map_err(Error::store)?;
    app.stall_at(order.stall, Stall::AfterCapture, &order.order)
        .await;
    sqlx::query_scalar(
        "INSERT INTO fulfilment_shipments (message, order_id, capture) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(key.as_str())
    .bind(&order.order)
    .bind(captured.capture as i64)
    .fetch_one(&mut *tx)
    .await
    .map_err(Error::store)
}

/// The handler of one order: begin, ship, commit.
async fn handle(app: &App, order: Order, key: IdempotencyKey) -> Result<i64, Error> {
    let mut tx = app.pool.begin().await.map_err(Error::store)?;
    let shipment = ship(&key, &order, &app.store, &mut tx, app).await?;
    tx.commit().await.map_err(Error::store)?;
    app.stall_at(order.stall, Stall::AfterCommit, &order.order)
        .await;
    Ok(shipment)
}

/// Where the service finds what it uses.
#[derive(Clone, Debug)]
pub struct Config {
    pub postgres_url: String,
    pub redis_url: String,
    pub nats_url: String,
    /// The JetStream stream of orders (its durable consumer is [`CONSUMER`]).
    pub stream: String,
    pub payments_url: String,
    pub stall: bool,
}

impl Config {
    /// From the environment, with the local defaults.
    pub fn from_env() -> Self {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
        Self {
            postgres_url: var(
                "IDEM_POSTGRES_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            redis_url: var("IDEM_REDIS_URL", "redis://127.0.0.1:6379"),
            nats_url: var("IDEM_NATS_URL", "nats://127.0.0.1:4222"),
            stream: var("IDEM_FULFILMENT_STREAM", "FULFILMENT_DEMO"),
            payments_url: var("IDEM_PAYMENTS_URL", "http://127.0.0.1:3001"),
            stall: std::env::var_os("IDEM_FULFILMENT_STALL").is_some(),
        }
    }
}

/// The tables of the effects (no unique constraint: any deduplication is idem's), made
/// under a lock, so that two instances starting together do not race PostgreSQL's catalog.
pub async fn tables(pool: &PgPool) -> Result<(), BoxError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.examples.fulfilment'))")
        .execute(&mut *tx)
        .await?;
    for table in [
        "fulfilment_notifications (id bigserial PRIMARY KEY, delivery text NOT NULL, recipient text NOT NULL)",
        "fulfilment_credits (id bigserial PRIMARY KEY, delivery text NOT NULL, sponsor text NOT NULL, cents bigint NOT NULL)",
        "fulfilment_shipments (id bigserial PRIMARY KEY, message text NOT NULL, order_id text NOT NULL, capture bigint NOT NULL)",
    ] {
        sqlx::query(&format!("CREATE TABLE IF NOT EXISTS {table}"))
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

async fn app(config: &Config) -> Result<App, BoxError> {
    let durable = PostgresStore::connect(&config.postgres_url).await?;
    durable.migrate().await?;
    let pool = durable.pool().clone();
    tables(&pool).await?;
    let fast = RedisStore::connect(&config.redis_url).await?;
    let payments = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(IdempotencyKeyMiddleware::new())
        .build();
    Ok(App {
        pool,
        store: TieredStore::new(fast, durable),
        payments,
        payments_url: config.payments_url.clone(),
        stall: config.stall,
    })
}

fn router(app: App) -> Result<Router, BoxError> {
    Ok(Router::new()
        .route(
            "/webhooks/standard",
            post(standard).layer(Webhook::standard(STANDARD_SECRET)?.endpoint("fulfilment")?),
        )
        .route(
            "/webhooks/github",
            post(github).layer(Webhook::github(GITHUB_SECRET)?.endpoint("fulfilment")?),
        )
        .with_state(app))
}

/// Consumes the orders until `stop` resolves: each settled once its transaction committed.
async fn consume(
    app: App,
    config: &Config,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), BoxError> {
    let js = jetstream::new(async_nats::connect(&config.nats_url).await?);
    let mut messages = js
        .get_stream(&config.stream)
        .await?
        .get_consumer::<pull::Config>(CONSUMER)
        .await?
        .messages()
        .await?;
    let consumer = Consumer::new("fulfilment.orders.v1")
        .backoff(Duration::from_millis(50), Duration::from_secs(1));
    let mut stop = std::pin::pin!(stop);
    loop {
        let message = tokio::select! {
            biased;
            () = &mut stop => return Ok(()),
            message = messages.next() => match message {
                Some(message) => message?,
                None => return Ok(()),
            },
        };
        let disposition = consumer
            .inbox(&message, |order: Order, key| handle(&app, order, key))
            .await?;
        println!("settled {disposition:?}");
    }
}

/// Serves the webhooks on `listener` and consumes the orders, until `stop` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: Config,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), BoxError> {
    let app = app(&config).await?;
    let addr = listener.local_addr()?;
    let http = axum::serve(listener, router(app.clone())?);
    tokio::spawn(async move { http.await });
    println!("listening on {addr}");
    consume(app, &config, stop).await
}

/// The payments API the service captures from: idem's own layer in front (a key replays
/// its first answer), a capture counted for each run of its handler, by order; and every
/// request's key, counted in front of the layer.
pub mod payments {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use axum::extract::{Request, State};
    use axum::middleware::{self, Next};
    use axum::response::Response;
    use axum::routing::post;
    use axum::{Extension, Json, Router};
    use idem_runtime::http::IdempotencyLayer;
    use idem_runtime::{IdempotencyKey, MemoryStore};

    /// What the API saw.
    #[derive(Default)]
    pub struct Seen {
        /// Captures by order: how many times the handler ran for each.
        pub captures: HashMap<String, u64>,
        /// The key each order's capture ran under.
        pub keys: HashMap<String, String>,
        /// Requests by key, replays included.
        pub requests: HashMap<String, u64>,
    }

    pub type Captures = Arc<Mutex<Seen>>;

    async fn capture(
        State(seen): State<Captures>,
        Extension(key): Extension<IdempotencyKey>,
        Json(request): Json<serde_json::Value>,
    ) -> Json<serde_json::Value> {
        let order = request["order"].as_str().unwrap_or_default().to_owned();
        let mut seen = seen.lock().unwrap();
        *seen.captures.entry(order.clone()).or_default() += 1;
        seen.keys.insert(order, key.as_str().to_owned());
        let n = seen.captures.values().sum::<u64>();
        Json(serde_json::json!({ "capture": n }))
    }

    async fn count(State(seen): State<Captures>, request: Request, next: Next) -> Response {
        let key = request
            .headers()
            .get("idempotency-key")
            .and_then(|key| key.to_str().ok())
            .unwrap_or_default()
            .trim_matches('"')
            .to_owned();
        *seen.lock().unwrap().requests.entry(key).or_default() += 1;
        next.run(request).await
    }

    /// The API, and what it saw.
    pub fn api() -> (Router, Captures) {
        let seen = Captures::default();
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .namespace("payments.captures.v1")
            .unscoped()
            .required();
        let router = Router::new()
            .route("/captures", post(capture).layer(layer))
            .layer(middleware::from_fn_with_state(Arc::clone(&seen), count))
            .with_state(Arc::clone(&seen));
        (router, seen)
    }
}

/// A sender of webhooks: each delivery signed as its sender signs it, resent until it is
/// answered `2xx` (a minute at most).
#[derive(Clone)]
pub struct Sender {
    pub http: reqwest::Client,
}

impl Default for Sender {
    fn default() -> Self {
        Self {
            http: reqwest::Client::new(),
        }
    }
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("any key length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().to_vec()
}

impl Sender {
    /// Delivers a Standard Webhooks message once to `addr` (with Svix's header names).
    pub async fn standard_once(
        &self,
        addr: SocketAddr,
        id: &str,
        event: &UserEvent,
    ) -> Result<reqwest::Response, BoxError> {
        let body = serde_json::to_string(event)?;
        let timestamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs()
            .to_string();
        let key = BASE64.decode(STANDARD_SECRET.trim_start_matches("whsec_"))?;
        let signed = hmac(
            &key,
            &[
                id.as_bytes(),
                b".",
                timestamp.as_bytes(),
                b".",
                body.as_bytes(),
            ],
        );
        Ok(self
            .http
            .post(format!("http://{addr}/webhooks/standard"))
            .header("content-type", "application/json")
            .header("svix-id", id)
            .header("svix-timestamp", timestamp)
            .header("svix-signature", format!("v1,{}", BASE64.encode(signed)))
            .body(body)
            .send()
            .await?)
    }

    /// Delivers a GitHub sponsorship once to `addr`, as delivery `delivery`.
    pub async fn github_once(
        &self,
        addr: SocketAddr,
        delivery: &str,
        sponsorship: &Sponsorship,
    ) -> Result<reqwest::Response, BoxError> {
        let body = serde_json::to_string(sponsorship)?;
        let signature: String = hmac(GITHUB_SECRET.as_bytes(), &[body.as_bytes()])
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(self
            .http
            .post(format!("http://{addr}/webhooks/github"))
            .header("content-type", "application/json")
            .header("x-github-event", "sponsorship")
            .header("x-github-delivery", delivery)
            .header("x-hub-signature-256", format!("sha256={signature}"))
            .body(body)
            .send()
            .await?)
    }
}

/// Resends `send` (given the number of the try, to pick an address by) until it is
/// answered `2xx`, a minute at most: the body of the answer. Before the service listens, a
/// try fails to connect, and is made again.
pub async fn until_delivered<F, Fut>(mut send: F) -> Result<String, BoxError>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = Result<reqwest::Response, BoxError>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut tries = 0;
    loop {
        let answered = send(tries).await;
        tries += 1;
        match answered {
            Ok(answer) if answer.status().is_success() => return Ok(answer.text().await?),
            _ if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(answer) => return Err(format!("answered {} for a minute", answer.status()).into()),
            Err(err) => return Err(err),
        }
    }
}

/// The stream of orders and its durable consumer, made for this run: a killed instance's
/// message comes back after a second.
pub async fn stream(nats_url: &str, name: &str) -> Result<jetstream::Context, BoxError> {
    let js = jetstream::new(async_nats::connect(nats_url).await?);
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("idem.fulfilment.{name}")],
            max_age: Duration::from_secs(3600),
            // The shortest window JetStream takes: a copy published after it reaches the
            // consumers, which must deduplicate it themselves.
            duplicate_window: Duration::from_millis(100),
            ..Default::default()
        })
        .await?;
    stream
        .create_consumer(pull::Config {
            durable_name: Some(CONSUMER.into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(1),
            max_deliver: -1,
            ..Default::default()
        })
        .await?;
    Ok(js)
}

/// Publishes `order` on the stream `name`, its id as its message id.
pub async fn publish(js: &jetstream::Context, name: &str, order: &Order) -> Result<(), BoxError> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", order.order.as_str());
    js.publish_with_headers(
        format!("idem.fulfilment.{name}"),
        headers,
        serde_json::to_vec(order)?.into(),
    )
    .await?
    .await?;
    Ok(())
}

/// What the run left, by what it sent: rows per delivery and per order.
pub async fn counts(pool: &PgPool, run: &str) -> Result<Vec<(String, String, i64)>, BoxError> {
    Ok(sqlx::query_as(
        "SELECT 'notification', delivery, count(*) FROM fulfilment_notifications WHERE delivery LIKE $1 GROUP BY delivery \
         UNION ALL SELECT 'credit', sponsor, count(*) FROM fulfilment_credits WHERE sponsor LIKE $1 GROUP BY sponsor \
         UNION ALL SELECT 'shipment', order_id, count(*) FROM fulfilment_shipments WHERE order_id LIKE $1 GROUP BY order_id",
    )
    .bind(format!("{run}%"))
    .fetch_all(pool)
    .await?)
}

/// The demo: the service, the payments API and a sender, in this process.
async fn demo() -> Result<(), BoxError> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let run = format!("demo{nanos}");
    let mut config = Config::from_env();
    config.stream = run.to_uppercase();
    let js = stream(&config.nats_url, &config.stream).await?;
    let (payments, captures) = payments::api();
    let payments_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    config.payments_url = format!("http://{}", payments_listener.local_addr()?);
    tokio::spawn(async move { axum::serve(payments_listener, payments).await });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let service = tokio::spawn(serve(listener, config.clone(), async {
        let _ = stopped.await;
    }));
    let sender = Sender::default();
    let pool = PgPool::connect(&config.postgres_url).await?;
    tables(&pool).await?;

    let event = UserEvent {
        kind: "user.created".into(),
        user: "ada".into(),
        stall: None,
    };
    let id = format!("{run}-msg-1");
    for _ in 0..3 {
        let answer = until_delivered(|_| sender.standard_once(addr, &id, &event)).await?;
        println!("standard webhook {id}: {answer}");
    }
    let sponsorship = Sponsorship {
        sponsor: format!("{run}-octocat"),
        cents: 500,
        stall: None,
    };
    // Delivered, redelivered under a new delivery id, and again: one credit.
    for delivery in ["1", "2", "1"] {
        let delivery = format!("{run}-gh-{delivery}");
        let answer = until_delivered(|_| sender.github_once(addr, &delivery, &sponsorship)).await?;
        println!("github delivery {delivery}: {answer}");
    }
    let orders: Vec<Order> = (0..5)
        .map(|n| Order {
            order: format!("{run}-order-{n}"),
            cents: 1_000 + n,
            stall: None,
        })
        .collect();
    for order in &orders {
        publish(&js, &config.stream, order).await?;
    }
    // Past the broker's duplicate window: the copies reach the consumer.
    tokio::time::sleep(Duration::from_millis(150)).await;
    for order in &orders {
        publish(&js, &config.stream, order).await?;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let counts = loop {
        let counts = counts(&pool, &run).await?;
        let shipped = counts
            .iter()
            .filter(|(kind, ..)| kind == "shipment")
            .count();
        if shipped == orders.len() || tokio::time::Instant::now() > deadline {
            break counts;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = stop.send(());
    service.await??;
    js.delete_stream(&config.stream).await?;
    let captured: u64 = captures
        .lock()
        .unwrap()
        .captures
        .iter()
        .filter(|(order, _)| order.starts_with(&run))
        .map(|(_, n)| *n)
        .sum();
    println!("effects: {counts:?}");
    println!("payments captured: {captured} for {} orders", orders.len());
    let once = counts.iter().all(|(.., n)| *n == 1);
    if counts.len() != 2 + orders.len() || !once || captured != orders.len() as u64 {
        return Err("an effect ran twice or not at all".into());
    }
    println!("every delivery and order had its effect once");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    if std::env::args().any(|arg| arg == "--serve") {
        let addr: SocketAddr = std::env::var("IDEM_FULFILMENT_ADDR")?.parse()?;
        let listener = tokio::net::TcpListener::bind(addr).await?;
        return serve(listener, Config::from_env(), stdin_closed()).await;
    }
    demo().await
}

/// Resolves when this process's stdin closes: how a test stops a served instance.
pub async fn stdin_closed() {
    use tokio::io::AsyncReadExt;
    let mut stdin = tokio::io::stdin();
    let mut buffer = [0_u8; 64];
    while matches!(stdin.read(&mut buffer).await, Ok(n) if n > 0) {}
}
