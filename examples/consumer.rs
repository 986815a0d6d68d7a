//! A queue consumer with at-least-once delivery whose effects happen exactly once.
//!
//! `cargo run -p idem-examples --example consumer` (NATS with JetStream on 127.0.0.1:4222, PostgreSQL on
//! 127.0.0.1:5432; `IDEM_NATS_URL` and `IDEM_POSTGRES_URL` point elsewhere).
//!
//! It publishes 200 orders to a JetStream stream and consumes them with a durable pull
//! consumer that acknowledges explicitly. Each order's effect (a shipment row and a stock
//! decrement) is applied in PostgreSQL by an idempotent handler whose claim is part of the
//! same transaction (`transaction = tx`). The message is acknowledged only after that
//! transaction committed. To show what at-least-once means, no first delivery is
//! acknowledged:
//!
//! - orders `n % 3 == 0` are applied and committed, then refused (`nak`): redelivered at once,
//!   as after a crash between the commit and the ack;
//! - orders `n % 3 == 1` are applied and committed, then left unacknowledged: redelivered
//!   after the ack wait, as when the ack is lost;
//! - orders `n % 3 == 2` are applied but their transaction is dropped before the commit: a
//!   crash mid-handler, which leaves nothing.
//!
//! Every order is delivered at least twice, and the run checks that each has exactly one
//! shipment and that the stock went down by exactly the ordered quantities.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, AckKind};
use futures_util::StreamExt;
use idem_runtime::{idempotent, Error, PostgresStore};
use serde::{Deserialize, Serialize};
use sqlx::{Connection, PgConnection};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Serialize, Deserialize)]
pub struct Order {
    pub id: u64,
    pub sku: String,
    pub quantity: i64,
}

/// What the handler records and every redelivery replays.
#[derive(Debug, Serialize, Deserialize)]
pub struct Shipment {
    pub shipment: i64,
}

/// The tables of one run, and how long its records live.
struct Shop {
    stock: String,
    shipments: String,
    /// Outlasts every redelivery the stream can make: see [`record_ttl`].
    ttl: Duration,
}

/// How long a record must live for exactly once to hold on this stream. A message can be
/// delivered again as long as the stream keeps it (`max_age`), and its last delivery can be
/// handled up to an ack wait after that; a record that expired before would let a
/// redelivery run the handler again. A stream that keeps messages forever (`max_age` 0)
/// would need records kept forever: refused, so that the bound is chosen, not forgotten.
fn record_ttl(max_age: Duration, ack_wait: Duration) -> Result<Duration, BoxError> {
    if max_age.is_zero() {
        return Err(
            "the stream keeps messages forever (max_age 0): no record TTL outlasts its \
                    redeliveries; set the stream's max_age"
                .into(),
        );
    }
    // A margin for clocks and a slow handler on the last delivery.
    Ok(max_age + ack_wait + Duration::from_secs(60))
}

/// The handler: claims the order's key in the caller's transaction, writes the shipment and
/// takes the stock, and records the result, all in `tx`.
#[idempotent(key = order.id, store = store, transaction = tx, ignore = shop, ttl = shop.ttl, namespace = "shop.ship_order.v1")]
async fn ship(
    store: &PostgresStore,
    tx: &mut PgConnection,
    shop: &Shop,
    order: &Order,
) -> Result<Shipment, Error> {
    sqlx::query(&format!(
        "UPDATE {} SET quantity = quantity - $1 WHERE sku = $2",
        shop.stock
    ))
    .bind(order.quantity)
    .bind(&order.sku)
    .execute(&mut *tx)
    .await
    .map_err(Error::store)?;
    let shipment = sqlx::query_scalar(&format!(
        "INSERT INTO {} (order_id) VALUES ($1) RETURNING id",
        shop.shipments
    ))
    .bind(order.id as i64)
    .fetch_one(&mut *tx)
    .await
    .map_err(Error::store)?;
    Ok(Shipment { shipment })
}

/// What a run saw.
#[derive(Debug)]
pub struct Report {
    /// Deliveries per order.
    pub deliveries: BTreeMap<u64, u64>,
    /// Shipment rows per order.
    pub shipments: BTreeMap<u64, i64>,
    /// Stock taken, and the sum of the ordered quantities.
    pub taken: i64,
    pub ordered: i64,
}

/// Publishes `orders` orders and consumes them until each was acknowledged.
pub async fn run(orders: u64) -> Result<Report, BoxError> {
    let nats_url =
        std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let pg_url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();

    let store = PostgresStore::connect(&pg_url).await?;
    store.migrate().await?;
    // The stream keeps a message an hour; a delivery unacknowledged after a second comes back.
    let max_age = Duration::from_secs(3600);
    let ack_wait = Duration::from_secs(1);
    let mut shop = Shop {
        stock: format!("shop_stock_{run}"),
        shipments: format!("shop_shipments_{run}"),
        ttl: Duration::ZERO,
    };
    for statement in [
        format!(
            "CREATE TABLE {} (sku text PRIMARY KEY, quantity bigint NOT NULL)",
            shop.stock
        ),
        format!("INSERT INTO {} VALUES ('sku-1', 1000000)", shop.stock),
        format!(
            "CREATE TABLE {} (id bigserial PRIMARY KEY, order_id bigint NOT NULL)",
            shop.shipments
        ),
    ] {
        sqlx::query(&statement).execute(store.pool()).await?;
    }

    let client = async_nats::connect(&nats_url).await?;
    let js = jetstream::new(client);
    let stream_name = format!("IDEM_ORDERS_{run}");
    let subject = format!("idem.orders.{run}");
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: stream_name.clone(),
            subjects: vec![subject.clone()],
            max_age,
            ..Default::default()
        })
        .await?;
    // From the stream as the server has it, not as it was asked for.
    shop.ttl = record_ttl(stream.cached_info().config.max_age, ack_wait)?;
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("shipper".into()),
            ack_policy: AckPolicy::Explicit,
            // An unacknowledged delivery comes back after this long.
            ack_wait,
            ..Default::default()
        })
        .await?;

    // Orders 1..=n, each a run-wide unique id so that runs never replay each other.
    let first_id = (run % 1_000_000_000) as u64 * 1_000;
    let mut ordered = 0;
    for n in 0..orders {
        let order = Order {
            id: first_id + n,
            sku: "sku-1".into(),
            quantity: 1 + (n % 5) as i64,
        };
        ordered += order.quantity;
        js.publish(subject.clone(), serde_json::to_vec(&order)?.into())
            .await?
            .await?;
    }

    let mut deliveries: BTreeMap<u64, u64> = BTreeMap::new();
    let mut acked = 0;
    let mut messages = consumer.messages().await?;
    while acked < orders {
        let message = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .map_err(|_| "no delivery for 30 s")?
            .ok_or("the consumer stopped")??;
        let order: Order = serde_json::from_slice(&message.payload)?;
        let delivered = message.info()?.delivered;
        *deliveries.entry(order.id).or_default() += 1;
        let n = order.id - first_id;

        let mut conn = store.pool().acquire().await?;
        let mut tx = conn.begin().await?;
        let shipped = ship(&store, &mut tx, &shop, &order).await;
        if delivered == 1 {
            match n % 3 {
                0 => {
                    tx.commit().await?;
                    message.ack_with(AckKind::Nak(None)).await?;
                }
                1 => tx.commit().await?, // the ack is lost
                _ => drop(tx),           // a crash before the commit
            }
            continue;
        }
        match shipped {
            Ok(_) => {
                tx.commit().await?;
                // Only now, with the effect committed, is the message done.
                message.ack().await?;
                acked += 1;
            }
            Err(err) => {
                // Not applied: roll back and let the broker deliver it again.
                drop(tx);
                message.ack_with(AckKind::Nak(None)).await?;
                eprintln!("order {}: {err}; redelivering", order.id);
            }
        }
    }

    let rows: Vec<(i64, i64)> = sqlx::query_as(&format!(
        "SELECT order_id, count(*) FROM {} GROUP BY order_id",
        shop.shipments
    ))
    .fetch_all(store.pool())
    .await?;
    let shipments = rows
        .into_iter()
        .map(|(order, count)| (order as u64, count))
        .collect();
    let left: i64 = sqlx::query_scalar(&format!("SELECT quantity FROM {}", shop.stock))
        .fetch_one(store.pool())
        .await?;

    js.delete_stream(&stream_name).await?;
    sqlx::query(&format!("DROP TABLE {}, {}", shop.stock, shop.shipments))
        .execute(store.pool())
        .await?;
    Ok(Report {
        deliveries,
        shipments,
        taken: 1_000_000 - left,
        ordered,
    })
}

#[allow(dead_code)] // a test includes this file without calling `main`
#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let report = run(200).await?;
    let delivered: u64 = report.deliveries.values().sum();
    let least = report.deliveries.values().min().copied().unwrap_or(0);
    println!(
        "{} orders, {delivered} deliveries (each at least {least}), {} shipments, stock taken {} of {} ordered",
        report.deliveries.len(),
        report.shipments.values().sum::<i64>(),
        report.taken,
        report.ordered
    );
    let once = report.shipments.len() == report.deliveries.len()
        && report.shipments.values().all(|count| *count == 1);
    if least < 2 || !once || report.taken != report.ordered {
        return Err("an order was not applied exactly once".into());
    }
    println!("every order was delivered at least twice and applied exactly once");
    Ok(())
}
