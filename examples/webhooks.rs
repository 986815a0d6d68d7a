//! Webhook receivers: a Stripe-style and a GitHub-style endpoint that credit a ledger once per
//! delivery, however often and however concurrently the sender resends it.
//!
//! `cargo run -p idem-examples --example webhooks -- --demo` (PostgreSQL on 127.0.0.1:5432,
//! or `IDEM_POSTGRES_URL`): serves on a loopback port and plays a sender: an event, its
//! resends (sequential and concurrent), a forged delivery (`401`, nothing recorded), a
//! GitHub delivery sent again under new delivery ids (credited once: GitHub signs the body
//! alone, so the body is the key); then checks the ledger. `--serve`
//! serves on `IDEM_WEBHOOKS_ADDR` until killed: `examples/webhooks_test.rs` runs two such
//! receivers on one database and SIGKILLs them mid-delivery.
//!
//! Each endpoint is the handler and one layer: `IdempotencyLayer::webhook` checks the
//! sender's signature before anything is claimed, keys the delivery where the sender puts
//! its id, and answers duplicates with the first answer. The credit itself is claimed in the
//! handler's own transaction (`transaction = tx`): a receiver killed after its commit but
//! before the layer recorded the answer is retried by the sender, and the retry finds the
//! credit's record committed with it, so nothing is credited twice.

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use hmac::{Hmac, Mac};
use idem_runtime::http::{IdempotencyLayer, Webhook};
use idem_runtime::{idempotent, Error, IdempotencyKey, PostgresStore};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use sqlx::{PgConnection, PgPool};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The signing secrets the example's senders and receivers share.
pub const STRIPE_SECRET: &str = "whsec_example";
pub const GITHUB_SECRET: &str = "example hook secret";

/// A Stripe-style event: its id, and the amount it credits.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Event {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub data: EventData,
    /// How many of the event's deliveries are pending: changes between resends.
    #[serde(default)]
    pub pending_webhooks: u32,
    /// The test's hook: where a receiver started with `IDEM_WEBHOOKS_STALL` stops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall: Option<Stall>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EventData {
    pub account: String,
    pub cents: i64,
}

/// Where a stalling receiver stops, to be killed there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stall {
    /// After the credit's write, before its commit: the kill leaves nothing.
    BeforeCommit,
    /// After the commit, before the layer recorded the answer: the kill leaves the credit,
    /// and the sender's retry must not credit again.
    AfterCommit,
}

#[derive(Clone)]
struct App {
    pool: PgPool,
    store: PostgresStore,
    stall: bool,
}

/// Credits `cents` to `account` once per `source`: the claim, the ledger row and the record
/// commit together in `tx`.
#[idempotent(key = source, fingerprint = (account, cents), store = store, transaction = tx, namespace = "ledger.credit.v1")]
async fn credit(
    source: &(String, String),
    account: &str,
    cents: i64,
    store: &PostgresStore,
    tx: &mut PgConnection,
) -> Result<i64, Error> {
    sqlx::query_scalar(
        "INSERT INTO webhook_credits (source, delivery, account, cents) VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(&source.0)
    .bind(&source.1)
    .bind(account)
    .bind(cents)
    .fetch_one(&mut *tx)
    .await
    .map_err(Error::store)
}

/// `POST /webhooks/stripe`: credits the event's amount.
async fn stripe(State(app): State<App>, Json(event): Json<Event>) -> Result<String, Error> {
    let source = ("stripe".to_string(), event.id.clone());
    let mut tx = app.pool.begin().await.map_err(Error::store)?;
    let credited = credit(
        &source,
        &event.data.account,
        event.data.cents,
        &app.store,
        &mut tx,
    )
    .await?;
    app.stall_at(&event, Stall::BeforeCommit).await;
    tx.commit().await.map_err(Error::store)?;
    app.stall_at(&event, Stall::AfterCommit).await;
    Ok(format!("credited {credited}"))
}

/// A GitHub-style delivery: `sponsorship` events credit their sponsor.
#[derive(Debug, Serialize, Deserialize)]
pub struct Sponsorship {
    pub sponsor: String,
    pub cents: i64,
}

/// `POST /webhooks/github`: credits the sponsorship once, by the key the layer found (the
/// event's kind and the signed body's digest, whatever `X-GitHub-Delivery` came with it).
async fn github(
    State(app): State<App>,
    key: IdempotencyKey,
    Json(sponsorship): Json<Sponsorship>,
) -> Result<String, Error> {
    let source = ("github".to_string(), key.to_string());
    let mut tx = app.pool.begin().await.map_err(Error::store)?;
    let credited = credit(
        &source,
        &sponsorship.sponsor,
        sponsorship.cents,
        &app.store,
        &mut tx,
    )
    .await?;
    tx.commit().await.map_err(Error::store)?;
    Ok(format!("credited {credited}"))
}

impl App {
    /// With `IDEM_WEBHOOKS_STALL` set, a delivery marked to stall here says so and waits to
    /// be killed.
    async fn stall_at(&self, event: &Event, here: Stall) {
        if self.stall && event.stall == Some(here) {
            println!("stalled {here:?} {}", event.id);
            std::future::pending::<()>().await;
        }
    }
}

/// The receivers on `url`'s database, the ledger made if missing.
pub async fn router(url: &str) -> Result<Router, BoxError> {
    let store = PostgresStore::connect(url).await?;
    store.migrate().await?;
    let pool = store.pool().clone();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS webhook_credits (id bigserial PRIMARY KEY, \
            source text NOT NULL, delivery text NOT NULL, account text NOT NULL, cents bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let app = App {
        pool,
        store: store.clone(),
        stall: std::env::var_os("IDEM_WEBHOOKS_STALL").is_some(),
    };
    // Each route has its sender's layer, named for the endpoint it is: its records stay
    // its own, through a rotation of its secret too.
    let stripe_endpoint = Webhook::stripe(STRIPE_SECRET)?.endpoint("example-stripe")?;
    let github_endpoint = Webhook::github(GITHUB_SECRET)?.endpoint("example-github")?;
    let stripe_layer = IdempotencyLayer::webhook(store.clone(), stripe_endpoint);
    let github_layer = IdempotencyLayer::webhook(store, github_endpoint);
    Ok(Router::new()
        .route("/webhooks/stripe", post(stripe).layer(stripe_layer))
        .route("/webhooks/github", post(github).layer(github_layer))
        .with_state(app))
}

/// Serves the receivers on `addr` until the process ends.
pub async fn serve(addr: SocketAddr, url: &str) -> Result<(), BoxError> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let app = router(url).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

pub fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn hmac(secret: &str, parts: &[&[u8]]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("any key length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().to_vec()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A sender: signs each delivery as its sender does, now, and resends what is not `2xx`, as
/// senders do (after `Retry-After`, or a moment), up to a minute.
#[derive(Clone)]
pub struct Sender {
    pub http: reqwest::Client,
    pub base: String,
}

impl Sender {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: format!("http://{addr}"),
        }
    }

    /// Delivers `event` once, signed with `secret`: the status.
    pub async fn stripe_once(
        &self,
        event: &Event,
        secret: &str,
    ) -> Result<reqwest::Response, BoxError> {
        let body = serde_json::to_string(event)?;
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs();
        let signature = hex(&hmac(
            secret,
            &[t.to_string().as_bytes(), b".", body.as_bytes()],
        ));
        Ok(self
            .http
            .post(format!("{}/webhooks/stripe", self.base))
            .header("content-type", "application/json")
            .header("stripe-signature", format!("t={t},v1={signature}"))
            .body(body)
            .send()
            .await?)
    }

    /// Delivers `sponsorship` once, as delivery `delivery`.
    pub async fn github_once(
        &self,
        delivery: &str,
        sponsorship: &Sponsorship,
    ) -> Result<reqwest::Response, BoxError> {
        let body = serde_json::to_string(sponsorship)?;
        let signature = hex(&hmac(GITHUB_SECRET, &[body.as_bytes()]));
        Ok(self
            .http
            .post(format!("{}/webhooks/github", self.base))
            .header("content-type", "application/json")
            .header("x-github-event", "sponsorship")
            .header("x-github-delivery", delivery)
            .header("x-hub-signature-256", format!("sha256={signature}"))
            .body(body)
            .send()
            .await?)
    }

    /// Delivers `event` until it is answered `2xx`: its body.
    pub async fn stripe(&self, event: &Event) -> Result<String, BoxError> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            match self.stripe_once(event, STRIPE_SECRET).await {
                Ok(answer) if answer.status().is_success() => return Ok(answer.text().await?),
                Ok(answer) if tokio::time::Instant::now() < deadline => {
                    let after = answer
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(1);
                    tokio::time::sleep(Duration::from_secs(after).min(Duration::from_secs(2)))
                        .await;
                }
                Err(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Ok(answer) => {
                    return Err(format!("answered {} for a minute", answer.status()).into())
                }
                Err(err) => return Err(err),
            }
        }
    }
}

/// How often each delivery of a run was credited: `(source, delivery) → rows`, for the
/// deliveries or the accounts that start with `prefix`.
pub async fn credits(pool: &PgPool, prefix: &str) -> Result<Vec<(String, String, i64)>, BoxError> {
    Ok(sqlx::query_as(
        "SELECT source, delivery, count(*) FROM webhook_credits \
            WHERE delivery LIKE $1 OR account LIKE $1 \
            GROUP BY source, delivery ORDER BY source, delivery",
    )
    .bind(format!("{prefix}%"))
    .fetch_all(pool)
    .await?)
}

/// The demo: a sender's life against the two receivers.
async fn demo() -> Result<(), BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = router(&postgres_url()).await?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    let sender = Sender::new(addr);
    let pool = PgPool::connect(&postgres_url()).await?;
    let run = format!(
        "evt_{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos()
    );
    let event = Event {
        id: run.clone(),
        kind: "charge.succeeded".into(),
        data: EventData {
            account: "acct_1".into(),
            cents: 4200,
        },
        pending_webhooks: 2,
        stall: None,
    };

    let first = sender.stripe_once(&event, STRIPE_SECRET).await?;
    println!(
        "stripe event:        {} {}",
        first.status(),
        first.text().await?
    );
    let resent = Event {
        pending_webhooks: 1,
        ..event.clone()
    };
    let again = sender.stripe_once(&resent, STRIPE_SECRET).await?;
    let replayed = again.headers().get("idempotent-replayed").is_some();
    println!(
        "resent:              {} replayed={replayed} {}",
        again.status(),
        again.text().await?
    );
    let crowd = futures_util::future::join_all((0..8).map(|_| sender.stripe(&event))).await;
    println!(
        "8 concurrent resends: {} answered 2xx",
        crowd.iter().filter(|answer| answer.is_ok()).count()
    );
    let forged_event = Event {
        id: format!("{run}_forged"),
        ..event.clone()
    };
    let forged = sender.stripe_once(&forged_event, "whsec_guessed").await?;
    println!("forged:              {}", forged.status());

    let sponsorship = Sponsorship {
        sponsor: format!("{run}_octocat"),
        cents: 500,
    };
    // One sponsorship, delivered, redelivered, and sent again by someone who captured it
    // under a delivery id of their own: one credit.
    for delivery in ["1", "2", "1"] {
        let delivery = format!("{run}_delivery_{delivery}");
        let answer = sender.github_once(&delivery, &sponsorship).await?;
        let replayed = answer.headers().get("idempotent-replayed").is_some();
        println!("github {delivery}: {} replayed={replayed}", answer.status());
    }

    let ledger = credits(&pool, &run).await?;
    println!("ledger:              {ledger:?}");
    let credited = |source: &str| {
        ledger
            .iter()
            .filter(|(s, _, _)| s == source)
            .map(|(_, _, n)| n)
            .collect::<Vec<_>>()
    };
    let once = credited("github") == [&1] && ledger.contains(&("stripe".to_string(), run, 1));
    if !once || ledger.len() != 2 || forged.status() != 401 || crowd.iter().any(Result::is_err) {
        return Err(format!("the ledger is {ledger:?}: each delivery once, expected").into());
    }
    println!("each delivery credited once; the forged one not at all");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    if std::env::args().any(|arg| arg == "--serve") {
        let addr = std::env::var("IDEM_WEBHOOKS_ADDR")?.parse()?;
        return serve(addr, &postgres_url()).await;
    }
    demo().await
}
