//! A RabbitMQ consumer whose deliveries are settled right: each order shipped exactly once,
//! whatever the broker redelivers, and a poisoned message dead-lettered once, never looped.
//!
//! `cargo run -p idem-examples --example rabbitmq -- --demo` (RabbitMQ on 127.0.0.1:5672 as
//! guest, PostgreSQL on 127.0.0.1:5432; `IDEM_AMQP_URL`, `IDEM_POSTGRES_URL`): declares a
//! queue with a dead-letter queue, publishes orders (some twice, one that does not decode,
//! one whose id is reused with another order), consumes them, and checks the shipments and
//! the dead letters. `--consume` consumes `IDEM_QUEUE` until killed:
//! `examples/queues_test.rs` SIGKILLs such consumers mid-handler.
//!
//! The handler claims the message's id in its own PostgreSQL transaction (the inbox
//! pattern): the claim, the shipment and the record commit together, and the delivery is
//! acknowledged after the commit. A consumer killed anywhere leaves either nothing (the
//! redelivery ships) or the commit (the redelivery replays).

use std::time::Duration;

use futures_util::StreamExt;
use idem_runtime::consumer::Consumer;
use idem_runtime::{idempotent, Error, IdempotencyKey, PostgresStore};
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An order to ship.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Order {
    pub order: u64,
    pub sku: String,
    /// The test's hook: where a consumer started with `IDEM_QUEUE_STALL` stops, on the
    /// message's first delivery, to be killed there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall: Option<Stall>,
}

/// Where a stalling consumer stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stall {
    /// After the shipment's write, before its commit.
    BeforeCommit,
    /// After the commit, before the ack.
    AfterCommit,
}

/// Ships `order` once per message `key`: the claim, the row and the record commit in `tx`.
#[idempotent(key = key, fingerprint = order, store = store, transaction = tx, namespace = "shop.ship.v1")]
pub async fn ship(
    key: &IdempotencyKey,
    order: &Order,
    store: &PostgresStore,
    tx: &mut PgConnection,
) -> Result<i64, Error> {
    sqlx::query_scalar(
        "INSERT INTO queue_shipments (message_id, order_no) VALUES ($1, $2) RETURNING id",
    )
    .bind(key.as_str())
    .bind(order.order as i64)
    .fetch_one(&mut *tx)
    .await
    .map_err(Error::store)
}

/// The handler of one delivered order: begin, ship, commit. With `stall`, a first delivery
/// marked to stall says so and waits to be killed.
pub async fn handle(
    pool: &PgPool,
    store: &PostgresStore,
    order: Order,
    key: IdempotencyKey,
    first: bool,
    stall: bool,
) -> Result<i64, Error> {
    let stall_at = |here| stall && first && order.stall == Some(here);
    let mut tx = pool.begin().await.map_err(Error::store)?;
    let shipment = ship(&key, &order, store, &mut tx).await?;
    if stall_at(Stall::BeforeCommit) {
        println!("stalled before commit {key}");
        std::future::pending::<()>().await;
    }
    tx.commit().await.map_err(Error::store)?;
    if stall_at(Stall::AfterCommit) {
        println!("stalled after commit {key}");
        std::future::pending::<()>().await;
    }
    Ok(shipment)
}

/// The database's side: the store and the shipments table.
pub async fn database(url: &str) -> Result<(PgPool, PostgresStore), BoxError> {
    let store = PostgresStore::connect(url).await?;
    store.migrate().await?;
    let pool = store.pool().clone();
    // Under a lock: two processes creating the table at once could both find it missing,
    // and the second's `CREATE … IF NOT EXISTS` then fails on PostgreSQL's catalog.
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.examples.queue_shipments'))")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS queue_shipments (id bigserial PRIMARY KEY, \
            message_id text NOT NULL, order_no bigint NOT NULL)",
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((pool, store))
}

/// Declares `queue` (a quorum queue, which counts deliveries) and its dead-letter queue
/// `<queue>.dead`, through the exchange `<queue>.dlx`.
pub async fn declare(channel: &Channel, queue: &str) -> Result<(), BoxError> {
    let dlx = format!("{queue}.dlx");
    let dead = format!("{queue}.dead");
    channel
        .exchange_declare(
            dlx.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(dead.as_str().into(), durable, FieldTable::default())
        .await?;
    channel
        .queue_bind(
            dead.as_str().into(),
            dlx.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    arguments.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(dlx.as_str().into()),
    );
    channel
        .queue_declare(queue.into(), durable, arguments)
        .await?;
    Ok(())
}

/// Publishes `payload` to `queue` with the message id `id`, confirmed by the broker.
pub async fn publish(
    channel: &Channel,
    queue: &str,
    id: &str,
    payload: &[u8],
) -> Result<(), BoxError> {
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            payload,
            BasicProperties::default()
                .with_message_id(id.into())
                .with_delivery_mode(2),
        )
        .await?
        .await?;
    Ok(())
}

pub fn amqp_url() -> String {
    std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

pub fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Consumes `queue`, printing `settled <id> <disposition>` for each delivery, until `until`
/// deliveries were settled or `stop` resolves (checked between deliveries); then closes the
/// connection, so that every settlement has reached the broker.
pub async fn consume(
    queue: &str,
    stall: bool,
    until: Option<usize>,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), BoxError> {
    // A stalling consumer takes one message at a time, so that a kill requeues only the one
    // it stalled on.
    let prefetch = if stall { 1 } else { 10 };
    let (pool, store) = database(&postgres_url()).await?;
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            queue.into(),
            "shipper".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    println!("consuming {queue}");
    // The consumer's glue: its policies, and each delivery handled and settled.
    let consumer =
        Consumer::new("shop.orders.v1").backoff(Duration::from_millis(50), Duration::from_secs(1));
    let mut settled = 0;
    let mut stop = std::pin::pin!(stop);
    loop {
        let delivery = tokio::select! {
            biased;
            () = &mut stop => break,
            delivery = deliveries.next() => match delivery {
                Some(delivery) => delivery?,
                None => break,
            },
        };
        let first = !delivery.redelivered;
        let id = delivery
            .properties
            .message_id()
            .clone()
            .map(|id| id.to_string())
            .unwrap_or_default();
        let disposition = consumer
            .inbox(&delivery, |order: Order, key| {
                handle(&pool, &store, order, key, first, stall)
            })
            .await?;
        println!("settled {id} {disposition:?}");
        settled += 1;
        if until.is_some_and(|until| settled >= until) {
            break;
        }
    }
    channel.close(200, "done".into()).await?;
    connection.close(200, "done".into()).await?;
    Ok(())
}

/// The messages in `queue`, taken: their ids, once at least `expected` have arrived (or 10 s
/// have passed). A rejected message reaches its dead-letter queue after the reject, routed
/// by the broker: it is waited for, not assumed.
pub async fn drain(
    channel: &Channel,
    queue: &str,
    expected: usize,
) -> Result<Vec<String>, BoxError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut ids = Vec::new();
    loop {
        while let Some(message) = channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await?
        {
            let id = message.delivery.properties.message_id().clone();
            ids.push(id.map(|id| id.to_string()).unwrap_or_default());
        }
        if ids.len() >= expected || tokio::time::Instant::now() >= deadline {
            return Ok(ids);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The demo: orders with duplicates, a poison and a reused id, consumed in this process.
async fn demo() -> Result<(), BoxError> {
    let (pool, _) = database(&postgres_url()).await?;
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let queue = format!("idem.orders.{run}");
    declare(&channel, &queue).await?;
    let order = |n: u64| Order {
        order: n,
        sku: "sku-1".into(),
        stall: None,
    };
    let mut published = 0;
    for n in 0..20 {
        let payload = serde_json::to_vec(&order(n))?;
        publish(&channel, &queue, &format!("{run}-{n}"), &payload).await?;
        published += 1;
        if n % 4 == 0 {
            // Published twice, as a producer that retries its publish does.
            publish(&channel, &queue, &format!("{run}-{n}"), &payload).await?;
            published += 1;
        }
    }
    publish(&channel, &queue, &format!("{run}-poison"), b"{not json").await?;
    publish(
        &channel,
        &queue,
        &format!("{run}-0"),
        &serde_json::to_vec(&order(999))?,
    )
    .await?;
    published += 2;
    consume(&queue, false, Some(published), std::future::pending()).await?;

    let shipped: Vec<(String, i64)> = sqlx::query_as(
        "SELECT message_id, count(*) FROM queue_shipments WHERE message_id LIKE $1 GROUP BY message_id",
    )
    .bind(format!("{run}-%"))
    .fetch_all(&pool)
    .await?;
    let dead = drain(&channel, &format!("{queue}.dead"), 2).await?;
    let left = drain(&channel, &queue, 0).await?;
    println!(
        "shipped: {} orders, each {:?} time(s)",
        shipped.len(),
        shipped.iter().map(|s| s.1).max()
    );
    println!("dead-lettered: {dead:?}");
    println!("left in the queue: {}", left.len());
    for name in [queue.clone(), format!("{queue}.dead")] {
        channel
            .queue_delete(name.as_str().into(), Default::default())
            .await?;
    }
    let once = shipped.len() == 20 && shipped.iter().all(|(_, n)| *n == 1);
    let expected_dead = vec![format!("{run}-poison"), format!("{run}-0")];
    if !once || dead != expected_dead || !left.is_empty() {
        return Err(
            "a shipment ran twice, was lost, or a message was left or dead-lettered wrongly".into(),
        );
    }
    println!("each order shipped once; the poison and the reused id dead-lettered once");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    if std::env::args().any(|arg| arg == "--consume") {
        let queue = std::env::var("IDEM_QUEUE")?;
        let stall = std::env::var_os("IDEM_QUEUE_STALL").is_some();
        let interrupted = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        return consume(&queue, stall, None, interrupted).await;
    }
    demo().await
}
