//! A Kafka-protocol broker for the tests: `IDEM_KAFKA_BROKERS`, or a tansu broker of the test
//! process's own on a free port (`tansu`, from crates.io: `.ci/run` installs it), in memory,
//! which ends with the process.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio::sync::OnceCell;

use crate::unavailable;

/// The brokers' `bootstrap.servers`, or `None` (skipped) when there are none:
/// `IDEM_KAFKA_BROKERS`, or a tansu broker this process starts, once.
pub async fn kafka_brokers() -> Option<String> {
    static UP: OnceCell<Result<String, String>> = OnceCell::const_new();
    let up = UP
        .get_or_init(|| async {
            match std::env::var("IDEM_KAFKA_BROKERS") {
                Ok(brokers) => Ok(brokers),
                Err(_) => start_tansu().await,
            }
        })
        .await;
    match up {
        Ok(brokers) => Some(brokers.clone()),
        Err(why) => unavailable("a Kafka broker", why),
    }
}

/// Starts `tansu broker` on a free port, its storage in memory: its address once it
/// answers a metadata request.
async fn start_tansu() -> Result<String, String> {
    let port = crate::free_port().ok_or("no free port")?;
    let address = format!("127.0.0.1:{port}");
    let listener = format!("tcp://{address}");
    crate::tied::spawn(&[
        "tansu",
        "broker",
        "--listener-url",
        &listener,
        "--advertised-listener-url",
        &listener,
        "--storage-engine",
        "memory://tansu/",
    ])
    .ok_or("`sh` could not be started")?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &address)
        .create()
        .map_err(|err| err.to_string())?;
    // Up to 60 s, on a loaded machine.
    for _ in 0..120 {
        let producer = producer.clone();
        let metadata = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, Duration::from_millis(500))
                .is_ok()
        });
        if metadata.await.unwrap_or(false) {
            return Ok(address);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(
        "`tansu` did not answer within a minute (`cargo install tansu --features dynostore`)"
            .into(),
    )
}

/// A topic of `partitions` partitions named `name` and a unique suffix: its name.
pub async fn kafka_topic(brokers: &str, name: &str, partitions: i32) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let topic = format!("{name}-{}-{nanos}", std::process::id());
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let created = admin
        .create_topics(
            &[NewTopic::new(
                &topic,
                partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
    for result in created {
        result.unwrap();
    }
    topic
}

/// Produces `payload` to `partition` of `topic`, with `headers`: the record's offset.
pub async fn kafka_produce(
    brokers: &str,
    topic: &str,
    partition: i32,
    headers: &[(&str, &str)],
    payload: &[u8],
) -> i64 {
    static PRODUCERS: std::sync::Mutex<Vec<(String, FutureProducer)>> =
        std::sync::Mutex::new(Vec::new());
    let producer = {
        let mut producers = PRODUCERS.lock().unwrap();
        match producers.iter().find(|(at, _)| at == brokers) {
            Some((_, producer)) => producer.clone(),
            None => {
                let producer: FutureProducer = ClientConfig::new()
                    .set("bootstrap.servers", brokers)
                    .create()
                    .unwrap();
                producers.push((brokers.to_owned(), producer.clone()));
                producer
            }
        }
    };
    let mut record_headers = OwnedHeaders::new();
    for (key, value) in headers {
        record_headers = record_headers.insert(Header {
            key,
            value: Some(*value),
        });
    }
    let record = FutureRecord::<(), _>::to(topic)
        .partition(partition)
        .payload(payload)
        .headers(record_headers);
    producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(err, _)| err)
        .unwrap()
        .offset
}

/// The offsets the consumer group `group` committed on `topic`'s `partitions`, `None` for
/// a partition without one.
pub async fn kafka_committed(
    brokers: &str,
    group: &str,
    topic: &str,
    partitions: i32,
) -> Vec<Option<i64>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .create()
        .unwrap();
    let mut asked = TopicPartitionList::new();
    for partition in 0..partitions {
        asked.add_partition(topic, partition);
    }
    let committed = tokio::task::spawn_blocking(move || {
        consumer
            .committed_offsets(asked, Duration::from_secs(30))
            .unwrap()
    })
    .await
    .unwrap();
    (0..partitions)
        .map(
            |partition| match committed.find_partition(topic, partition)?.offset() {
                Offset::Offset(offset) => Some(offset),
                _ => None,
            },
        )
        .collect()
}

/// Every record of `topic` (of `partitions` partitions), from its start to its end now.
pub async fn kafka_read_all(brokers: &str, topic: &str, partitions: i32) -> Vec<OwnedMessage> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "idem-tests-reader")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut assignment = TopicPartitionList::new();
        let mut left = 0;
        for partition in 0..partitions {
            let (low, high) = consumer
                .fetch_watermarks(&topic, partition, Duration::from_secs(30))
                .unwrap();
            left += high - low;
            assignment
                .add_partition_offset(&topic, partition, Offset::Offset(low))
                .unwrap();
        }
        consumer.assign(&assignment).unwrap();
        let mut records = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while left > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{topic}: {left} records unread after a minute"
            );
            if let Some(message) = consumer.poll(Duration::from_millis(200)) {
                records.push(message.unwrap().detach());
                left -= 1;
            }
        }
        records
    })
    .await
    .unwrap()
}
