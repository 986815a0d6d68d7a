//! What a consumer adds per message over the broker's client alone, in instructions and
//! allocations, on RabbitMQ (`lapin`), NATS JetStream (`async-nats`), SQS (`aws-sdk-sqs`,
//! against moto's server) and Kafka (`rdkafka`, against tansu).
//!
//! `cargo bench -p idem-runtime --bench consumers --features lapin,nats,sqs,rdkafka,memory` runs,
//! for each broker, two consumers of the same messages in processes of their own under
//! `valgrind --tool=callgrind`, each counting only its measured loop (after a warm-up of as
//! many messages):
//!
//! - **alone**: what a hand-written at-least-once consumer does: decode the JSON body, run
//!   the handler, acknowledge (`basic.ack`; a JetStream ack confirmed by the server, as
//!   idem's is; `DeleteMessage`; Kafka's offset stored after the record, committed by
//!   librdkafka in the background and synchronously at the end of each batch, as
//!   `KafkaGroup::run_until` does);
//! - **idem**: `Consumer::handle` with an in-memory store: the same, plus the message's id
//!   claimed, the result recorded and, on SQS, the visibility lease's timer; on Kafka, each
//!   batch is a `KafkaGroup::run_until` of as many records (its watermarks, epochs and
//!   rewind included).
//!
//! It prints instructions and allocations per message for both and the difference. The
//! counts include the client's network work (a round trip's wake-ups vary a little from
//! run to run), which both sides share: the difference is the consumer's cost. Brokers:
//! `IDEM_AMQP_URL`, `IDEM_NATS_URL`, `IDEM_SQS_URL` or a `moto_server` this bench starts,
//! and `IDEM_KAFKA_BROKERS` or a `tansu` broker it starts; a broker that is unreachable
//! prints `skipped`. Not run by CI (it needs the
//! brokers and takes a few minutes under callgrind); CI compiles it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use idem_runtime::consumer::kafka::KafkaGroup;
use idem_runtime::consumer::sqs::SqsQueue;
use idem_runtime::consumer::Consumer;
use idem_runtime::{Error, MemoryStore};

#[path = "common/callgrind.rs"]
mod callgrind;

/// Messages measured per side, after as many to warm up.
const MESSAGES: u64 = 200;

/// The function callgrind counts in (and everything it calls).
const MEASURED: &str = "*consumers::measured*";

/// Counts allocations.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[derive(serde::Deserialize)]
struct Order {
    id: u64,
}

async fn ship(order: Order) -> Result<u64, Error> {
    Ok(std::hint::black_box(order.id))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [measure, broker, side] if measure == "measure" => run(broker, side == "idem"),
        _ => drive(),
    }
}

// ---- the driver: each side under callgrind ------------------------------------------------

fn drive() {
    let rt = runtime();
    let moto = rt.block_on(Server::moto());
    let tansu = rt.block_on(Server::tansu());
    println!(
        "{:<10} {:>14} {:>14} {:>10} {:>12} {:>12} {:>10}",
        "per message",
        "alone (instr)",
        "idem (instr)",
        "added",
        "alone (allocs)",
        "idem (allocs)",
        "added"
    );
    for broker in ["rabbitmq", "jetstream", "sqs", "kafka"] {
        let reachable = match broker {
            "rabbitmq" => rt
                .block_on(lapin::Connection::connect(&amqp_url(), Default::default()))
                .is_ok(),
            "jetstream" => rt.block_on(async_nats::connect(nats_url())).is_ok(),
            "sqs" => moto.is_some(),
            _ => tansu.is_some(),
        };
        if !reachable {
            println!("{broker:<10} skipped: the broker is unreachable");
            continue;
        }
        let env = [
            ("IDEM_SQS_URL", Server::address(&moto)),
            ("IDEM_KAFKA_BROKERS", Server::address(&tansu)),
        ];
        let (alone, alone_allocs) = count(broker, "alone", &env);
        let (idem, idem_allocs) = count(broker, "idem", &env);
        if broker == "jetstream" {
            rt.block_on(delete_streams());
        }
        println!(
            "{broker:<10} {alone:>14} {idem:>14} {:>+10} {alone_allocs:>12.1} {idem_allocs:>12.1} {:>+10.1}",
            idem as i64 - alone as i64,
            idem_allocs - alone_allocs,
        );
    }
}

/// Deletes the streams the JetStream sides made (RabbitMQ's queues delete themselves, and
/// SQS's go with the bench's moto).
async fn delete_streams() {
    let js = async_nats::jetstream::new(async_nats::connect(nats_url()).await.unwrap());
    let mut names = js.stream_names();
    let mut ours = Vec::new();
    while let Some(name) = names.next().await {
        let name = name.unwrap();
        if name.starts_with("IDEM_BENCH_") {
            ours.push(name);
        }
    }
    for name in ours {
        js.delete_stream(&name).await.unwrap();
    }
}

/// Instructions and allocations per message of one side: this program run again under
/// callgrind, counting only inside [`measured`].
fn count(broker: &str, side: &str, env: &[(&str, &str)]) -> (u64, f64) {
    let args = ["measure", broker, side];
    let (total, stdout) = callgrind::collected(MEASURED, &args, env);
    let allocations: u64 = stdout
        .lines()
        .find_map(|line| line.strip_prefix("allocations ")?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no allocation count:\n{stdout}"));
    (total / MESSAGES, allocations as f64 / MESSAGES as f64)
}

// ---- one side, in the process callgrind counts ---------------------------------------------

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Publishes twice [`MESSAGES`], consumes as many to warm up, then as many inside
/// [`measured`], and prints the allocations the measured ones made.
fn run(broker: &str, idem: bool) {
    let rt = runtime();
    let consumer = Consumer::new("bench.consumers").store(MemoryStore::new());
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let mut batch: Box<dyn FnMut(u64) + '_> = match broker {
        "rabbitmq" => rabbitmq(&rt, &consumer, idem, run),
        "jetstream" => jetstream(&rt, &consumer, idem, run),
        "sqs" => sqs(&rt, &consumer, idem, run),
        "kafka" => kafka(&rt, &consumer, idem, run),
        other => panic!("no broker {other}"),
    };
    batch(MESSAGES);
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    measured(&mut batch);
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - before;
    println!("allocations {allocations}");
}

/// The only function callgrind counts in.
#[inline(never)]
fn measured(batch: &mut dyn FnMut(u64)) {
    batch(MESSAGES);
}

fn body(n: u64) -> Vec<u8> {
    format!(r#"{{"id":{n}}}"#).into_bytes()
}

fn amqp_url() -> String {
    std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

fn nats_url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// Consumes `n` messages of a fresh RabbitMQ queue per call.
fn rabbitmq<'a>(
    rt: &'a tokio::runtime::Runtime,
    consumer: &'a Consumer<MemoryStore>,
    idem: bool,
    run: u128,
) -> Box<dyn FnMut(u64) + 'a> {
    use lapin::options::{BasicAckOptions, BasicPublishOptions, QueueDeclareOptions};
    use lapin::BasicProperties;

    let queue = format!("idem.bench.{run}");
    let mut deliveries = rt.block_on(async {
        let connection = lapin::Connection::connect(&amqp_url(), Default::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        let options = QueueDeclareOptions {
            auto_delete: true,
            ..Default::default()
        };
        channel
            .queue_declare(queue.as_str().into(), options, Default::default())
            .await
            .unwrap();
        for n in 0..2 * MESSAGES {
            let properties =
                BasicProperties::default().with_message_id(format!("{run}-{n}").into());
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &body(n),
                    properties,
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
        let deliveries = channel
            .basic_consume(
                queue.as_str().into(),
                "bench".into(),
                Default::default(),
                Default::default(),
            )
            .await
            .unwrap();
        // Kept open for as long as the process lives.
        std::mem::forget(connection);
        deliveries
    });
    Box::new(move |n| {
        rt.block_on(async {
            for _ in 0..n {
                let delivery = deliveries.next().await.unwrap().unwrap();
                if idem {
                    consumer.handle(&delivery, ship).await.unwrap();
                } else {
                    let order: Order = serde_json::from_slice(&delivery.data).unwrap();
                    ship(order).await.unwrap();
                    delivery.ack(BasicAckOptions::default()).await.unwrap();
                }
            }
        });
    })
}

/// Consumes `n` messages of a fresh JetStream stream per call.
fn jetstream<'a>(
    rt: &'a tokio::runtime::Runtime,
    consumer: &'a Consumer<MemoryStore>,
    idem: bool,
    run: u128,
) -> Box<dyn FnMut(u64) + 'a> {
    use async_nats::jetstream::{self, consumer::pull};

    let name = format!("IDEM_BENCH_{run}");
    let mut messages = rt.block_on(async {
        let js = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
        let stream = js
            .create_stream(jetstream::stream::Config {
                name: name.clone(),
                subjects: vec![format!("idem.bench.{run}")],
                max_age: Duration::from_secs(600),
                ..Default::default()
            })
            .await
            .unwrap();
        for n in 0..2 * MESSAGES {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", format!("{run}-{n}").as_str());
            js.publish_with_headers(format!("idem.bench.{run}"), headers, body(n).into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
        let pulled: jetstream::consumer::Consumer<pull::Config> = stream
            .create_consumer(pull::Config {
                durable_name: Some("bench".into()),
                ..Default::default()
            })
            .await
            .unwrap();
        pulled.messages().await.unwrap()
    });
    Box::new(move |n| {
        rt.block_on(async {
            for _ in 0..n {
                let message = messages.next().await.unwrap().unwrap();
                if idem {
                    consumer.handle(&message, ship).await.unwrap();
                } else {
                    let order: Order = serde_json::from_slice(&message.payload).unwrap();
                    ship(order).await.unwrap();
                    message.double_ack().await.unwrap();
                }
            }
        });
    })
}

fn sqs_client(url: &str) -> aws_sdk_sqs::Client {
    use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .credentials_provider(Credentials::new("idem", "idem", None, None, "idem-bench"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    aws_sdk_sqs::Client::from_conf(config)
}

/// Consumes `n` messages of a fresh SQS queue per call, received one at a time.
fn sqs<'a>(
    rt: &'a tokio::runtime::Runtime,
    consumer: &'a Consumer<MemoryStore>,
    idem: bool,
    run: u128,
) -> Box<dyn FnMut(u64) + 'a> {
    let client = sqs_client(&std::env::var("IDEM_SQS_URL").unwrap());
    let queue = rt.block_on(async {
        let url = client
            .create_queue()
            .queue_name(format!("idem-bench-{run}"))
            .send()
            .await
            .unwrap()
            .queue_url
            .unwrap();
        for n in 0..2 * MESSAGES {
            let body = String::from_utf8(body(n)).unwrap();
            client
                .send_message()
                .queue_url(&url)
                .message_body(body)
                .send()
                .await
                .unwrap();
        }
        SqsQueue::connect(client.clone(), url).await.unwrap()
    });
    Box::new(move |n| {
        rt.block_on(async {
            for _ in 0..n {
                if idem {
                    let batch = queue.receive(1, Duration::from_secs(5)).await.unwrap();
                    queue
                        .in_order(batch, |message| async move {
                            consumer.handle(&message, ship).await
                        })
                        .await
                        .unwrap();
                } else {
                    let received = client
                        .receive_message()
                        .queue_url(queue.url())
                        .max_number_of_messages(1)
                        .wait_time_seconds(5)
                        .send()
                        .await
                        .unwrap();
                    for message in received.messages.unwrap_or_default() {
                        let order: Order = serde_json::from_str(message.body().unwrap()).unwrap();
                        ship(order).await.unwrap();
                        client
                            .delete_message()
                            .queue_url(queue.url())
                            .receipt_handle(message.receipt_handle().unwrap())
                            .send()
                            .await
                            .unwrap();
                    }
                }
            }
        });
    })
}

/// Consumes `n` records of a fresh one-partition Kafka topic per call.
fn kafka<'a>(
    rt: &'a tokio::runtime::Runtime,
    consumer: &'a Consumer<MemoryStore>,
    idem: bool,
    run: u128,
) -> Box<dyn FnMut(u64) + 'a> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    use rdkafka::{ClientConfig, Message};

    // rdkafka's stream consumers start a task of their own when made.
    let _entered = rt.enter();
    let brokers = std::env::var("IDEM_KAFKA_BROKERS").unwrap();
    let topic = format!("idem-bench-{run}");
    rt.block_on(async {
        let client = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .clone();
        let admin: AdminClient<_> = client.create().unwrap();
        let new = NewTopic::new(&topic, 1, TopicReplication::Fixed(1));
        for created in admin
            .create_topics(&[new], &AdminOptions::new())
            .await
            .unwrap()
        {
            created.unwrap();
        }
        let producer: FutureProducer = client.create().unwrap();
        for n in 0..2 * MESSAGES {
            let payload = body(n);
            let record = FutureRecord::<(), _>::to(&topic)
                .payload(&payload[..])
                .partition(0);
            producer
                .send(record, Duration::from_secs(30))
                .await
                .unwrap();
        }
    });
    let config = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", format!("idem-bench-{run}"))
        .set("auto.offset.reset", "earliest")
        .clone();
    if idem {
        let group = KafkaGroup::join(&config, "bench", &[&topic]).unwrap();
        return Box::new(move |n| {
            let handled = &AtomicU64::new(0);
            let done = &tokio::sync::Notify::new();
            let ran = group.run_until(done.notified(), |record| async move {
                let disposition = consumer.handle(&record, ship).await?;
                if handled.fetch_add(1, Ordering::Relaxed) + 1 == n {
                    done.notify_one();
                }
                Ok(disposition)
            });
            rt.block_on(ran).unwrap();
        });
    }
    let member: std::sync::Arc<StreamConsumer> = std::sync::Arc::new(
        config
            .clone()
            .set("enable.auto.offset.store", "false")
            .create()
            .unwrap(),
    );
    member.subscribe(&[&topic]).unwrap();
    Box::new(move |n| {
        rt.block_on(async {
            for _ in 0..n {
                let message = member.recv().await.unwrap();
                let order: Order = serde_json::from_slice(message.payload().unwrap()).unwrap();
                ship(order).await.unwrap();
                member.store_offset_from_message(&message).unwrap();
            }
            let member = member.clone();
            tokio::task::spawn_blocking(move || member.commit_consumer_state(CommitMode::Sync))
                .await
                .unwrap()
                .unwrap();
        });
    })
}

/// A broker this bench starts on a free port, killed when dropped, or one an environment
/// variable names.
struct Server {
    address: String,
    child: Option<std::process::Child>,
}

impl Server {
    /// moto's server for the SQS side: `IDEM_SQS_URL`, or one of the bench's own.
    async fn moto() -> Option<Self> {
        if let Ok(address) = std::env::var("IDEM_SQS_URL") {
            return Some(Self {
                address,
                child: None,
            });
        }
        let port = free_port()?;
        let server = Self::spawn(
            format!("http://127.0.0.1:{port}"),
            Command::new("moto_server").args(["-H", "127.0.0.1", "-p", &port.to_string()]),
        )?;
        for _ in 0..600 {
            if sqs_client(&server.address)
                .list_queues()
                .send()
                .await
                .is_ok()
            {
                return Some(server);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    /// A tansu broker, in memory, for the Kafka side: `IDEM_KAFKA_BROKERS`, or one of the
    /// bench's own.
    async fn tansu() -> Option<Self> {
        use rdkafka::consumer::{BaseConsumer, Consumer as _};

        if let Ok(address) = std::env::var("IDEM_KAFKA_BROKERS") {
            return Some(Self {
                address,
                child: None,
            });
        }
        let port = free_port()?;
        let address = format!("127.0.0.1:{port}");
        let listener = format!("tcp://{address}");
        let server = Self::spawn(
            address,
            Command::new("tansu").args([
                "broker",
                "--listener-url",
                &listener,
                "--advertised-listener-url",
                &listener,
                "--storage-engine",
                "memory://tansu/",
            ]),
        )?;
        let client: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &server.address)
            .create()
            .ok()?;
        for _ in 0..120 {
            if client
                .fetch_metadata(None, Duration::from_millis(500))
                .is_ok()
            {
                return Some(server);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    fn spawn(address: String, command: &mut Command) -> Option<Self> {
        let child = command
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok()?;
        Some(Self {
            address,
            child: Some(child),
        })
    }

    /// The server's address, or nothing when there is none.
    fn address(server: &Option<Self>) -> &str {
        server.as_ref().map_or("", |server| &server.address)
    }
}

fn free_port() -> Option<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
    Some(listener.local_addr().ok()?.port())
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
