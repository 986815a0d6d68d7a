//! Consumers SIGKILLed mid-handler, against the real RabbitMQ, NATS JetStream and SQS (moto) and
//! PostgreSQL: orders published (some twice), a poisoned message and an id reused with
//! another order among them; consumer processes killed before and after their commits, ten
//! times and more, each redelivery handled by the next. Every order ships exactly once, none
//! is lost, nothing is left in the queue, and the poisoned message and the reused id are
//! rejected once each: dead-lettered on RabbitMQ, terminated on JetStream, never looped.

#[path = "process.rs"]
mod process;
#[path = "rabbitmq.rs"]
#[allow(dead_code)]
mod rabbitmq;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy};
use futures_util::StreamExt;
use idem_runtime::consumer::Consumer;
use process::Service;
use rabbitmq::{Order, Stall};

/// How many orders a run publishes: a quarter of them stall a consumer, each one kill.
const ORDERS: u64 = 48;

/// The orders of a run: every fourth stalls on its first delivery, alternately before and
/// after its commit; every seventh is published twice.
fn orders() -> Vec<(u64, Order, bool)> {
    (0..ORDERS)
        .map(|n| {
            let here = if n % 8 == 0 {
                Stall::BeforeCommit
            } else {
                Stall::AfterCommit
            };
            let stall = (n % 4 == 0).then_some(here);
            let order = Order {
                order: n,
                sku: "sku-1".into(),
                stall,
            };
            (n, order, n % 7 == 0)
        })
        .collect()
}

fn required(what: &str, err: impl std::fmt::Display) -> bool {
    assert!(
        std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(),
        "{what} is required (IDEM_REQUIRE_SERVICES): {err}"
    );
    eprintln!("skipped: {what} is unreachable ({err})");
    false
}

fn run_id(broker: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{broker}-{}-{nanos}", std::process::id())
}

/// What consumers said they did with each delivery, by message id.
#[derive(Default, Debug)]
struct Settled {
    acked: BTreeSet<String>,
    rejected: BTreeMap<String, usize>,
}

impl Settled {
    fn read(&mut self, line: &str) {
        let mut words = line.split(' ').skip(1);
        let (Some(id), Some(disposition)) = (words.next(), words.next()) else {
            return;
        };
        match disposition {
            "Ack" => {
                self.acked.insert(id.to_string());
            }
            "Reject" => *self.rejected.entry(id.to_string()).or_default() += 1,
            _ => {}
        }
    }
}

/// Starts consumers one after the other until one drains the queue: a stalling consumer is
/// SIGKILLed as soon as it stalls; once every stalling message has been delivered, the last
/// one settles what is left. Returns the kills and what was settled.
async fn consume_with_kills(
    start: impl Fn() -> Service,
    expected: &BTreeSet<String>,
    rejects: usize,
) -> (u64, Settled) {
    let mut settled = Settled::default();
    let mut kills = 0;
    'consumers: loop {
        let mut consumer = start();
        while let Some(line) = consumer.line().await {
            if line.starts_with("stalled") {
                drop(consumer);
                kills += 1;
                continue 'consumers;
            }
            if line.starts_with("settled") {
                settled.read(&line);
                let rejected: usize = settled.rejected.values().sum();
                if settled.acked == *expected && rejected >= rejects {
                    // Stopped, not killed: what it settled reaches the broker.
                    consumer.finish().await;
                    break 'consumers;
                }
            }
        }
        panic!("a consumer ended on its own; settled so far: {settled:?}");
    }
    (kills, settled)
}

async fn shipments(pool: &sqlx::PgPool, run: &str) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>(
        "SELECT message_id, count(*) FROM queue_shipments WHERE message_id LIKE $1 GROUP BY message_id",
    )
    .bind(format!("{run}-%"))
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

fn expected_ids(run: &str) -> BTreeSet<String> {
    (0..ORDERS).map(|n| format!("{run}-{n}")).collect()
}

/// Every order shipped once, and the two bad messages rejected once each.
fn check(run: &str, kills: u64, settled: &Settled, shipped: &BTreeMap<String, i64>) {
    eprintln!(
        "{run}: {kills} consumers killed mid-handler; rejected {:?}",
        settled.rejected
    );
    assert!(
        kills >= 10,
        "only {kills} consumers were killed mid-handler"
    );
    for id in expected_ids(run) {
        assert_eq!(
            shipped.get(&id),
            Some(&1),
            "{id} shipped {:?} time(s)",
            shipped.get(&id)
        );
    }
    assert_eq!(
        shipped.len() as u64,
        ORDERS,
        "shipments of unknown messages: {shipped:?}"
    );
    let poison = format!("{run}-poison");
    assert_eq!(settled.rejected.get(&poison), Some(&1), "{settled:?}");
    // The id reused with another order: rejected once, its first order shipped once.
    assert_eq!(
        settled.rejected.get(&format!("{run}-1")),
        Some(&1),
        "{settled:?}"
    );
    assert_eq!(settled.rejected.len(), 2, "{settled:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a RabbitMQ consumer, started (and killed) by rabbitmq_consumers_killed_mid_handler_ship_each_order_once"]
async fn rabbitmq_consumer() {
    let queue = std::env::var("IDEM_QUEUE").unwrap();
    let stall = std::env::var_os("IDEM_QUEUE_STALL").is_some();
    rabbitmq::consume(&queue, stall, None, process::stdin_closed())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_consumers_killed_mid_handler_ship_each_order_once() {
    let connection =
        match lapin::Connection::connect(&rabbitmq::amqp_url(), Default::default()).await {
            Ok(connection) => connection,
            Err(err) => {
                required("RabbitMQ", err);
                return;
            }
        };
    let (pool, _) = rabbitmq::database(&rabbitmq::postgres_url()).await.unwrap();
    let channel = connection.create_channel().await.unwrap();
    let run = run_id("amqp");
    let queue = format!("idem.kills.{run}");
    rabbitmq::declare(&channel, &queue).await.unwrap();
    for (n, order, twice) in orders() {
        let payload = serde_json::to_vec(&order).unwrap();
        for _ in 0..if twice { 2 } else { 1 } {
            rabbitmq::publish(&channel, &queue, &format!("{run}-{n}"), &payload)
                .await
                .unwrap();
        }
    }
    rabbitmq::publish(&channel, &queue, &format!("{run}-poison"), b"{not json")
        .await
        .unwrap();
    let reused = Order {
        order: 1_000,
        sku: "sku-2".into(),
        stall: None,
    };
    rabbitmq::publish(
        &channel,
        &queue,
        &format!("{run}-1"),
        &serde_json::to_vec(&reused).unwrap(),
    )
    .await
    .unwrap();

    let start = || {
        Service::start(
            "rabbitmq_consumer",
            &[
                ("IDEM_QUEUE", queue.clone()),
                ("IDEM_QUEUE_STALL", "1".into()),
            ],
        )
    };
    let (kills, settled) = consume_with_kills(start, &expected_ids(&run), 2).await;
    check(&run, kills, &settled, &shipments(&pool, &run).await);

    let left = rabbitmq::drain(&channel, &queue, 0).await.unwrap();
    assert!(left.is_empty(), "left in the queue: {left:?}");
    let mut dead = rabbitmq::drain(&channel, &format!("{queue}.dead"), 2)
        .await
        .unwrap();
    dead.sort();
    assert_eq!(
        dead,
        vec![format!("{run}-1"), format!("{run}-poison")],
        "dead-lettered once each"
    );
    for name in [queue.clone(), format!("{queue}.dead")] {
        channel
            .queue_delete(name.as_str().into(), Default::default())
            .await
            .unwrap();
    }
}

fn nats_url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A JetStream consumer of the stream `IDEM_QUEUE`, as `rabbitmq::consume` is of a queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a JetStream consumer, started (and killed) by nats_consumers_killed_mid_handler_ship_each_order_once"]
async fn nats_consumer() {
    let stream = std::env::var("IDEM_QUEUE").unwrap();
    let stall = std::env::var_os("IDEM_QUEUE_STALL").is_some();
    let (pool, store) = rabbitmq::database(&rabbitmq::postgres_url()).await.unwrap();
    let js = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
    let consumer: pull::Stream = js
        .get_stream(&stream)
        .await
        .unwrap()
        .get_consumer::<pull::Config>("shipper")
        .await
        .unwrap()
        .messages()
        .await
        .unwrap();
    let mut messages = consumer;
    println!("consuming {stream}");
    let settle =
        Consumer::new("shop.orders.v1").backoff(Duration::from_millis(50), Duration::from_secs(1));
    let mut stop = std::pin::pin!(process::stdin_closed());
    loop {
        // Each settlement waits for the server's confirmation: stopping between deliveries
        // leaves nothing unsettled.
        let message = tokio::select! {
            biased;
            () = &mut stop => break,
            message = messages.next() => message.expect("the messages ended").unwrap(),
        };
        let first = message.info().unwrap().delivered == 1;
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|id| id.as_str().to_string())
            .unwrap_or_default();
        let disposition = settle
            .inbox(&message, |order: Order, key| {
                rabbitmq::handle(&pool, &store, order, key, first, stall)
            })
            .await
            .unwrap();
        println!("settled {id} {disposition:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_consumers_killed_mid_handler_ship_each_order_once() {
    let client = match async_nats::connect(nats_url()).await {
        Ok(client) => client,
        Err(err) => {
            required("NATS", err);
            return;
        }
    };
    let (pool, _) = rabbitmq::database(&rabbitmq::postgres_url()).await.unwrap();
    let js = jetstream::new(client);
    let run = run_id("nats");
    let name = run.replace('-', "_").to_uppercase();
    let subject = format!("idem.kills.{name}");
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            max_age: Duration::from_secs(3600),
            // The shortest window JetStream takes: the second copies below are published
            // after it, so that the consumer must deduplicate them itself.
            duplicate_window: Duration::from_millis(100),
            ..Default::default()
        })
        .await
        .unwrap();
    stream
        .create_consumer(pull::Config {
            durable_name: Some("shipper".into()),
            ack_policy: AckPolicy::Explicit,
            // A killed consumer's message comes back after this long.
            ack_wait: Duration::from_secs(1),
            // One message at a time, so that a kill holds back only the one it stalled on.
            max_ack_pending: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    let publish = |id: String, payload: Vec<u8>| {
        let (js, subject) = (js.clone(), subject.clone());
        async move {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", id.as_str());
            js.publish_with_headers(subject, headers, payload.into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    };
    for (n, order, _) in orders() {
        publish(format!("{run}-{n}"), serde_json::to_vec(&order).unwrap()).await;
    }
    // Past the duplicate window (were it not, the broker would drop a copy, and the test
    // would only prove less).
    tokio::time::sleep(Duration::from_millis(150)).await;
    for (n, order, twice) in orders() {
        if twice {
            publish(format!("{run}-{n}"), serde_json::to_vec(&order).unwrap()).await;
        }
    }
    publish(format!("{run}-poison"), b"{not json".to_vec()).await;
    let reused = Order {
        order: 1_000,
        sku: "sku-2".into(),
        stall: None,
    };
    publish(format!("{run}-1"), serde_json::to_vec(&reused).unwrap()).await;

    let start = || {
        Service::start(
            "nats_consumer",
            &[
                ("IDEM_QUEUE", name.clone()),
                ("IDEM_QUEUE_STALL", "1".into()),
            ],
        )
    };
    let (kills, settled) = consume_with_kills(start, &expected_ids(&run), 2).await;
    check(&run, kills, &settled, &shipments(&pool, &run).await);

    let mut consumer: jetstream::consumer::Consumer<pull::Config> =
        stream.get_consumer("shipper").await.unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!(info.num_pending, 0, "left in the stream: {info:?}");
    assert_eq!(info.num_ack_pending, 0, "awaiting an ack: {info:?}");
    js.delete_stream(&name).await.unwrap();
}

/// moto's SQS server on a free port, for this test process: `IDEM_SQS_URL` when set, else
/// `moto_server` (PyPI's `moto[server]`, which `.ci/run` installs), SIGKILLed on drop.
struct Moto {
    url: String,
    child: Option<std::process::Child>,
}

impl Moto {
    async fn start() -> Option<Self> {
        if let Ok(url) = std::env::var("IDEM_SQS_URL") {
            return Some(Self { url, child: None });
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .unwrap()
            .port();
        let child = std::process::Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(err) => {
                required("moto_server (SQS)", err);
                return None;
            }
        };
        let moto = Self {
            url: format!("http://127.0.0.1:{port}"),
            child: Some(child),
        };
        // Up to a minute: moto is a Python program, slow to start on a loaded machine.
        for _ in 0..600 {
            if sqs_client(&moto.url).list_queues().send().await.is_ok() {
                return Some(moto);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("moto_server did not answer within a minute");
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn sqs_client(url: &str) -> aws_sdk_sqs::Client {
    use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .credentials_provider(Credentials::new(
            "idem",
            "idem",
            None,
            None,
            "idem-examples",
        ))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    aws_sdk_sqs::Client::from_conf(config)
}

/// An SQS consumer of the queue `IDEM_QUEUE` at `IDEM_SQS_URL`, as `rabbitmq::consume` is of
/// a RabbitMQ queue: the producer's `order-id` attribute is the id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "an SQS consumer, started (and killed) by sqs_consumers_killed_mid_handler_ship_each_order_once"]
async fn sqs_consumer() {
    use idem_runtime::consumer::{sqs::SqsQueue, Delivery, MessageId};

    let url = std::env::var("IDEM_QUEUE").unwrap();
    let stall = std::env::var_os("IDEM_QUEUE_STALL").is_some();
    let (pool, store) = rabbitmq::database(&rabbitmq::postgres_url()).await.unwrap();
    let client = sqs_client(&std::env::var("IDEM_SQS_URL").unwrap());
    let queue = SqsQueue::connect(client, url).await.unwrap();
    println!("consuming {}", queue.url());
    let consumer = &Consumer::new("shop.orders.v1")
        .message_id(MessageId::header("order-id"))
        .backoff(Duration::from_millis(50), Duration::from_secs(1));
    let (pool, store) = (&pool, &store);
    let mut stop = std::pin::pin!(process::stdin_closed());
    loop {
        // One message at a time, so that a kill holds back only the one it stalled on.
        let batch = tokio::select! {
            biased;
            () = &mut stop => break,
            batch = queue.receive(1, Duration::from_secs(1)) => batch.unwrap(),
        };
        queue
            .in_order(batch, |message| async move {
                let first = message.deliveries() == Some(1);
                let id = message.header("order-id").unwrap_or_default().into_owned();
                let disposition = consumer
                    .inbox(&message, |order: Order, key| {
                        rabbitmq::handle(pool, store, order, key, first, stall)
                    })
                    .await?;
                println!("settled {id} {disposition:?}");
                Ok(disposition)
            })
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_consumers_killed_mid_handler_ship_each_order_once() {
    use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};

    let Some(moto) = Moto::start().await else {
        return;
    };
    let client = sqs_client(&moto.url);
    let (pool, _) = rabbitmq::database(&rabbitmq::postgres_url()).await.unwrap();
    let run = run_id("sqs");
    let dead = client
        .create_queue()
        .queue_name(format!("idem-kills-{run}-dead"))
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    let dead_arn = client
        .get_queue_attributes()
        .queue_url(&dead)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap()
        .remove(&QueueAttributeName::QueueArn)
        .unwrap();
    // A killed consumer's message comes back 2 s after its last renewal. The redrive
    // policy's count is above the kills a message can take: only the consumer's rejects
    // dead-letter.
    let queue = client
        .create_queue()
        .queue_name(format!("idem-kills-{run}"))
        .attributes(QueueAttributeName::VisibilityTimeout, "2")
        .attributes(
            QueueAttributeName::RedrivePolicy,
            format!(r#"{{"deadLetterTargetArn":"{dead_arn}","maxReceiveCount":"50"}}"#),
        )
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    let send = |id: String, body: Vec<u8>| {
        let (client, queue) = (client.clone(), queue.clone());
        async move {
            let id = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(id)
                .build()
                .unwrap();
            client
                .send_message()
                .queue_url(queue)
                .message_body(String::from_utf8(body).unwrap())
                .message_attributes("order-id", id)
                .send()
                .await
                .unwrap();
        }
    };
    for (n, order, twice) in orders() {
        let body = serde_json::to_vec(&order).unwrap();
        for _ in 0..if twice { 2 } else { 1 } {
            send(format!("{run}-{n}"), body.clone()).await;
        }
    }
    send(format!("{run}-poison"), b"{not json".to_vec()).await;
    let reused = Order {
        order: 1_000,
        sku: "sku-2".into(),
        stall: None,
    };
    send(format!("{run}-1"), serde_json::to_vec(&reused).unwrap()).await;

    let start = || {
        Service::start(
            "sqs_consumer",
            &[
                ("IDEM_QUEUE", queue.clone()),
                ("IDEM_SQS_URL", moto.url.clone()),
                ("IDEM_QUEUE_STALL", "1".into()),
            ],
        )
    };
    let (kills, settled) = consume_with_kills(start, &expected_ids(&run), 2).await;
    check(&run, kills, &settled, &shipments(&pool, &run).await);

    let attributes = client
        .get_queue_attributes()
        .queue_url(&queue)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap();
    assert!(
        attributes.values().all(|n| n == "0"),
        "left in the queue: {attributes:?}"
    );
    let mut dead_ids = Vec::new();
    loop {
        let messages = client
            .receive_message()
            .queue_url(&dead)
            .max_number_of_messages(10)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap()
            .messages
            .unwrap_or_default();
        if messages.is_empty() {
            break;
        }
        for message in messages {
            let id = message.message_attributes.unwrap()["order-id"]
                .string_value
                .clone()
                .unwrap();
            dead_ids.push(id);
            client
                .delete_message()
                .queue_url(&dead)
                .receipt_handle(message.receipt_handle.unwrap())
                .send()
                .await
                .unwrap();
        }
    }
    dead_ids.sort();
    assert_eq!(
        dead_ids,
        [format!("{run}-1"), format!("{run}-poison")],
        "dead-lettered once each"
    );
}

/// How many orders the Kafka run produces.
const KAFKA_ORDERS: u64 = 1_000;

/// The Kafka run's orders, on four partitions: every 40th (bar those also sent twice)
/// stalls its consumer once, alternately before and after its commit; every 7th is
/// produced twice, the second time to the next partition.
fn kafka_orders() -> Vec<(u64, Order, bool)> {
    (0..KAFKA_ORDERS)
        .map(|n| {
            let twice = n % 7 == 0;
            let stall = (n % 40 == 2 && !twice).then_some(if n % 80 == 2 {
                Stall::BeforeCommit
            } else {
                Stall::AfterCommit
            });
            let order = Order {
                order: n,
                sku: "sku-1".into(),
                stall,
            };
            (n, order, twice)
        })
        .collect()
}

fn kafka_config(brokers: &str) -> rdkafka::ClientConfig {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .clone()
}

/// A Kafka consumer of the topic `IDEM_QUEUE` at `IDEM_KAFKA_BROKERS` in the group
/// `IDEM_GROUP`, as `rabbitmq::consume` is of a RabbitMQ queue: eight records at once, the
/// producer's `order-id` header as the id, the inbox on PostgreSQL. A stalling order stalls
/// only the first time any consumer runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a Kafka consumer, started (and killed) by kafka_consumers_killed_mid_record_ship_each_order_once"]
async fn kafka_consumer() {
    use idem_runtime::consumer::kafka::{KafkaGroup, KafkaRecord};
    use idem_runtime::consumer::{Delivery, MessageId};
    use rdkafka::Message;

    let var = |name| std::env::var(name).unwrap();
    let (pool, store) = rabbitmq::database(&rabbitmq::postgres_url()).await.unwrap();
    let config = kafka_config(&var("IDEM_KAFKA_BROKERS"))
        .set("group.id", var("IDEM_GROUP"))
        .set("auto.offset.reset", "earliest")
        .set("auto.commit.interval.ms", "200")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .set("max.poll.interval.ms", "10000")
        .clone();
    let group = KafkaGroup::join(&config, "examples", &[&var("IDEM_QUEUE")])
        .unwrap()
        .dead_letter(&var("IDEM_DEAD"))
        .unwrap()
        .concurrency(8);
    let consumer = &Consumer::new("shop.orders.v1")
        .message_id(MessageId::header("order-id"))
        .backoff(Duration::from_millis(50), Duration::from_secs(1));
    let (pool, store) = (&pool, &store);
    println!("consuming");
    group
        .run_until(process::stdin_closed(), |record: KafkaRecord| async move {
            let id = record.header("order-id").unwrap_or_default().into_owned();
            let at = format!(
                "{}/{}",
                record.message().partition(),
                record.message().offset()
            );
            let disposition = consumer
                .inbox(&record, |order: Order, key| async move {
                    let first = order.stall.is_some() && first_stall(pool, &key).await?;
                    rabbitmq::handle(pool, store, order, key, first, true).await
                })
                .await?;
            println!("settled {id} {disposition:?} {at}");
            Ok(disposition)
        })
        .await
        .unwrap();
}

/// Whether this is the first time any consumer stalls on `key`'s order.
async fn first_stall(
    pool: &sqlx::PgPool,
    key: &idem_runtime::IdempotencyKey,
) -> Result<bool, idem_runtime::Error> {
    let inserted =
        sqlx::query("INSERT INTO queue_stalls (message_id) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(key.as_str())
            .execute(pool)
            .await
            .map_err(idem_runtime::Error::store)?;
    Ok(inserted.rows_affected() == 1)
}

/// Waits (bounded: two minutes) until the consumer group `group` is stable with `members`
/// members.
async fn group_settled(brokers: &str, group: &str, members: usize) {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};

    let client: BaseConsumer = kafka_config(brokers).create().unwrap();
    let group = group.to_owned();
    tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let list = client.fetch_group_list(Some(&group), Duration::from_secs(10));
            let state = list
                .as_ref()
                .ok()
                .and_then(|list| list.groups().first())
                .map(|info| (info.state().to_owned(), info.members().len()));
            if state
                .as_ref()
                .is_some_and(|(state, n)| state == "Stable" && *n == members)
            {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "group {group} not stable with {members} members after two minutes: {state:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    })
    .await
    .unwrap();
}

/// What the broker says of `group`: its state, its members, and its commits on `topic`'s
/// four partitions (for a run that fails).
async fn group_state(brokers: &str, group: &str, topic: &str) -> String {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    use rdkafka::TopicPartitionList;

    let member: BaseConsumer = kafka_config(brokers)
        .set("group.id", group)
        .create()
        .unwrap();
    let (group, topic) = (group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let list = member.fetch_group_list(Some(&group), Duration::from_secs(10));
        let described = match list.as_ref().map(|list| list.groups().first()) {
            Ok(Some(info)) => {
                let members: Vec<_> = info
                    .members()
                    .iter()
                    .map(|m| format!("{} at {}", m.id(), m.client_host()))
                    .collect();
                format!("{}, members {members:?}", info.state())
            }
            Ok(None) => "unknown to the broker".to_owned(),
            Err(err) => format!("not listed: {err}"),
        };
        let mut asked = TopicPartitionList::new();
        for partition in 0..4 {
            asked.add_partition(&topic, partition);
        }
        let commits = match member.committed_offsets(asked, Duration::from_secs(10)) {
            Ok(list) => format!(
                "{:?}",
                list.elements()
                    .iter()
                    .map(|e| (e.partition(), e.offset()))
                    .collect::<Vec<_>>()
            ),
            Err(err) => format!("not read: {err}"),
        };
        format!("{described}; commits {commits}")
    })
    .await
    .unwrap()
}

/// The records of the Kafka run: its topic's `(partition, offset)`s and their order ids.
type Produced = BTreeMap<(i32, i64), String>;

/// Every record of `topic` on `brokers`, whatever its partition.
async fn kafka_read(
    brokers: &str,
    topic: &str,
    partitions: i32,
) -> Vec<rdkafka::message::OwnedMessage> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    use rdkafka::{Offset, TopicPartitionList};

    let reader: BaseConsumer = kafka_config(brokers)
        .set("group.id", "idem-examples-reader")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut assignment = TopicPartitionList::new();
        let mut left = 0;
        for partition in 0..partitions {
            let (low, high) = reader
                .fetch_watermarks(&topic, partition, Duration::from_secs(30))
                .unwrap();
            left += high - low;
            assignment
                .add_partition_offset(&topic, partition, Offset::Offset(low))
                .unwrap();
        }
        reader.assign(&assignment).unwrap();
        let mut records = Vec::new();
        while left > 0 {
            let message = reader
                .poll(Duration::from_secs(60))
                .expect("a record unread for a minute");
            records.push(message.unwrap().detach());
            left -= 1;
        }
        records
    })
    .await
    .unwrap()
}

/// The `(partition, offset)`s of the records dead-lettered so far, from their headers.
async fn dead_lettered(brokers: &str, dead: &str) -> Vec<(i32, i64, String)> {
    use rdkafka::message::{Headers, Message};
    let mut letters: Vec<_> = kafka_read(brokers, dead, 1)
        .await
        .iter()
        .map(|letter| {
            let headers = letter.headers().unwrap();
            let header = |name: &str| {
                let found = headers.iter().filter(|h| h.key == name).last().unwrap();
                String::from_utf8(found.value.unwrap().to_vec()).unwrap()
            };
            (
                header("idem-source-partition").parse().unwrap(),
                header("idem-source-offset").parse().unwrap(),
                header("order-id"),
            )
        })
        .collect();
    letters.sort();
    letters
}

/// The group's commits never pass a record whose order is not shipped nor dead-lettered
/// in `dead`: the commits are read first, then what is finished.
async fn check_commits(
    brokers: &str,
    group: &str,
    topic: &str,
    produced: &Produced,
    pool: &sqlx::PgPool,
    run: &str,
    dead: &str,
) {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    use rdkafka::{Offset, TopicPartitionList};

    let member: BaseConsumer = kafka_config(brokers)
        .set("group.id", group)
        .create()
        .unwrap();
    let mut asked = TopicPartitionList::new();
    for partition in 0..4 {
        asked.add_partition(topic, partition);
    }
    let committed = tokio::task::spawn_blocking(move || {
        member
            .committed_offsets(asked, Duration::from_secs(30))
            .unwrap()
    })
    .await
    .unwrap();
    let shipped = shipments(pool, run).await;
    let dead = dead_lettered(brokers, dead).await;
    for partition in 0..4 {
        let Offset::Offset(commit) = committed.find_partition(topic, partition).unwrap().offset()
        else {
            continue;
        };
        for ((_, offset), id) in produced.range((partition, 0)..(partition, commit)) {
            let finished = shipped.contains_key(id)
                || dead
                    .iter()
                    .any(|(p, o, _)| (*p, *o) == (partition, *offset));
            assert!(
                finished,
                "committed {commit} on partition {partition} past {offset} ({id}), unfinished"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_consumers_killed_mid_record_ship_each_order_once() {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};

    let Some(kafka) = Tansu::start().await else {
        return;
    };
    let brokers = kafka.brokers.clone();
    let (pool, _) = rabbitmq::database(&rabbitmq::postgres_url()).await.unwrap();
    sqlx::query("CREATE TABLE IF NOT EXISTS queue_stalls (message_id text PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    let run = run_id("kafka");
    let (topic, dead, group) = (
        format!("idem-kills-{run}"),
        format!("idem-kills-{run}-dead"),
        format!("idem-kills-{run}-shipper"),
    );
    let admin: AdminClient<DefaultClientContext> = kafka_config(&brokers).create().unwrap();
    let topics = [
        NewTopic::new(&topic, 4, TopicReplication::Fixed(1)),
        NewTopic::new(&dead, 1, TopicReplication::Fixed(1)),
    ];
    for created in admin
        .create_topics(&topics, &AdminOptions::new())
        .await
        .unwrap()
    {
        created.unwrap();
    }
    let producer: FutureProducer = kafka_config(&brokers).create().unwrap();
    let mut produced = Produced::new();
    let mut sends = Vec::new();
    for (n, order, twice) in kafka_orders() {
        let payload = serde_json::to_vec(&order).unwrap();
        let partition = i32::try_from(n % 4).unwrap();
        sends.push((format!("{run}-{n}"), partition, payload.clone()));
        if twice {
            sends.push((format!("{run}-{n}"), (partition + 1) % 4, payload));
        }
    }
    sends.push((format!("{run}-poison"), 2, b"{not json".to_vec()));
    let reused = Order {
        order: 1_000_000,
        sku: "sku-2".into(),
        stall: None,
    };
    sends.push((format!("{run}-1"), 3, serde_json::to_vec(&reused).unwrap()));
    for (id, partition, payload) in &sends {
        let headers = OwnedHeaders::new().insert(Header {
            key: "order-id",
            value: Some(id.as_str()),
        });
        let record = FutureRecord::<(), _>::to(&topic)
            .partition(*partition)
            .payload(payload)
            .headers(headers);
        let delivered = producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(err, _)| err)
            .unwrap();
        produced.insert((delivered.partition, delivered.offset), id.clone());
    }

    let start = || {
        Service::start(
            "kafka_consumer",
            &[
                ("IDEM_KAFKA_BROKERS", brokers.clone()),
                ("IDEM_QUEUE", topic.clone()),
                ("IDEM_DEAD", dead.clone()),
                ("IDEM_GROUP", group.clone()),
            ],
        )
    };
    // Two members at a time: each kill moves the killed one's partitions to the other
    // mid-record (it runs eight at once), and its replacement's join moves some back.
    let mut members = [start(), start()];
    let expected: BTreeSet<String> = (0..KAFKA_ORDERS).map(|n| format!("{run}-{n}")).collect();
    let mut settled = Settled::default();
    let mut kills = 0;
    loop {
        let [first, second] = &mut members;
        // Shorter than `line`'s own minute, so that a group that falls silent is described.
        let next = tokio::time::timeout(Duration::from_secs(59), async {
            tokio::select! {
                line = first.line() => (0, line),
                line = second.line() => (1, line),
            }
        });
        let Ok((member, line)) = next.await else {
            panic!(
                "both consumers printed nothing for 59 s after {kills} kills; the group: {}; settled so far: {settled:?}",
                group_state(&brokers, &group, &topic).await
            );
        };
        let line = line
            .unwrap_or_else(|| panic!("a consumer ended on its own; settled so far: {settled:?}"));
        if line.starts_with("stalled") {
            // SIGKILLed, and its replacement started once the group has evicted it (its
            // session lapses after 6 s) and the survivor holds every partition: tansu leaves a
            // member that dies while the group forms its partitions, until the next rebalance.
            // What it printed before it died counts: a record it settled may be committed.
            for line in members[member].kill_and_drain().await {
                if line.starts_with("settled") {
                    settled.read(&line);
                }
            }
            group_settled(&brokers, &group, 1).await;
            members[member] = start();
            kills += 1;
            check_commits(&brokers, &group, &topic, &produced, &pool, &run, &dead).await;
        } else if line.starts_with("settled") {
            settled.read(&line);
            if settled.acked == expected && settled.rejected.values().sum::<usize>() >= 2 {
                break;
            }
        }
    }
    let [first, second] = members;
    tokio::join!(first.finish(), second.finish());

    eprintln!(
        "{run}: {} records, {kills} consumers killed mid-record",
        produced.len()
    );
    let shipped = shipments(&pool, &run).await;
    assert!(kills >= 10, "only {kills} consumers were killed mid-record");
    for id in &expected {
        assert_eq!(
            shipped.get(id),
            Some(&1),
            "{id} shipped {:?} time(s)",
            shipped.get(id)
        );
    }
    assert_eq!(
        shipped.len(),
        expected.len(),
        "shipments of unknown messages"
    );
    let dead_topic = dead;
    let dead = dead_lettered(&brokers, &dead_topic).await;
    let ids: Vec<_> = dead.iter().map(|(_, _, id)| id.clone()).collect();
    assert_eq!(ids.len(), 2, "dead-lettered once each: {dead:?}");
    assert!(
        ids.contains(&format!("{run}-poison")) && ids.contains(&format!("{run}-1")),
        "{dead:?}"
    );
    // Everything was read and committed, and nothing committed is unfinished.
    check_commits(
        &brokers,
        &group,
        &topic,
        &produced,
        &pool,
        &run,
        &dead_topic,
    )
    .await;
    let member: rdkafka::consumer::BaseConsumer = kafka_config(&brokers)
        .set("group.id", &group)
        .create()
        .unwrap();
    let mut asked = rdkafka::TopicPartitionList::new();
    for partition in 0..4 {
        asked.add_partition(&topic, partition);
    }
    let committed = tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::Consumer as _;
        member
            .committed_offsets(asked, Duration::from_secs(30))
            .unwrap()
    })
    .await
    .unwrap();
    for partition in 0..4 {
        let end = produced
            .range((partition, 0)..(partition + 1, 0))
            .next_back()
            .map_or(0, |((_, o), _)| o + 1);
        assert_eq!(
            committed
                .find_partition(&topic, partition)
                .unwrap()
                .offset(),
            rdkafka::Offset::Offset(end),
            "partition {partition} committed to its end"
        );
    }
}

/// A tansu broker (a Kafka-protocol broker, from crates.io) on a free port, in memory, for
/// this test process: `IDEM_KAFKA_BROKERS` when set, else `tansu` (which `.ci/run`
/// installs), SIGKILLed on drop.
struct Tansu {
    brokers: String,
    child: Option<std::process::Child>,
}

impl Tansu {
    async fn start() -> Option<Self> {
        use rdkafka::producer::{FutureProducer, Producer};

        if let Ok(brokers) = std::env::var("IDEM_KAFKA_BROKERS") {
            return Some(Self {
                brokers,
                child: None,
            });
        }
        let address = process::free_addr().to_string();
        let child = std::process::Command::new("tansu")
            .args(tansu_args(&address))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(err) => {
                required("tansu (Kafka)", err);
                return None;
            }
        };
        let tansu = Self {
            brokers: address,
            child: Some(child),
        };
        let producer: FutureProducer = kafka_config(&tansu.brokers).create().unwrap();
        // Up to a minute, on a loaded machine.
        for _ in 0..120 {
            let producer = producer.clone();
            let up = tokio::task::spawn_blocking(move || {
                producer
                    .client()
                    .fetch_metadata(None, Duration::from_millis(500))
                    .is_ok()
            });
            if up.await.unwrap() {
                return Some(tansu);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("tansu did not answer within a minute");
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `tansu`'s arguments for a broker at `address`, its storage in memory.
fn tansu_args(address: &str) -> Vec<String> {
    let listener = format!("tcp://{address}");
    [
        "broker",
        "--listener-url",
        &listener,
        "--advertised-listener-url",
        &listener,
    ]
    .into_iter()
    .chain(["--storage-engine", "memory://tansu/"])
    .map(str::to_owned)
    .collect()
}
