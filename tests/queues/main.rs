//! `consumer::Consumer::handle` against the real RabbitMQ and NATS JetStream: each delivery
//! settled as its outcome says. A transient failure is requeued with its backoff and
//! succeeds on a later delivery; one that never succeeds is rejected after the last
//! delivery the consumer allows; a duplicate replays; an id reused with another payload, a
//! payload that does not decode and a message without an id are rejected once, unhandled.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy};
use futures_util::{Stream, StreamExt};
use idem_runtime::consumer::{Consumer, Delivery, Disposition, MessageId};
use idem_runtime::{Error, MemoryStore};
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ExchangeKind};

type Publish =
    Box<dyn Fn(Option<String>, Vec<u8>) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// What the handler of each message id saw, in order: the deliveries it ran on.
#[derive(Default)]
struct Runs(Mutex<BTreeMap<String, u32>>);

impl Runs {
    fn ran(&self, id: &str) -> u32 {
        let mut runs = self.0.lock().unwrap();
        let n = runs.entry(id.to_string()).or_default();
        *n += 1;
        *n
    }

    fn of(&self, id: &str) -> u32 {
        self.0.lock().unwrap().get(id).copied().unwrap_or(0)
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Job {
    id: String,
    /// How many runs fail transiently before one succeeds (`u32::MAX`: never).
    failures: u32,
}

fn unique(broker: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{broker}-{}-{nanos}", std::process::id())
}

/// Publishes the scenario's messages and handles deliveries until every one is settled for
/// good; returns each delivery's id and disposition, in order. The id is the broker's own,
/// or the header `id_header`.
async fn scenario<D: Delivery>(
    run: &str,
    id_header: Option<&str>,
    publish: Publish,
    mut deliveries: impl Stream<Item = D> + Unpin,
) -> (Vec<(String, Disposition)>, Arc<Runs>) {
    let job = |name: &str, failures: u32| {
        let id = format!("{run}-{name}");
        (
            Some(id.clone()),
            serde_json::to_vec(&Job { id, failures }).unwrap(),
        )
    };
    let messages = [
        job("plain", 0),
        job("plain", 0),         // published twice
        job("flaky", 2),         // two transient failures, then done
        job("doomed", u32::MAX), // never succeeds
        (
            Some(format!("{run}-plain")),
            b"{\"id\":\"other\",\"failures\":0}".to_vec(),
        ), // reused id
        (Some(format!("{run}-poison")), b"{not json".to_vec()),
        (
            None,
            serde_json::to_vec(&Job {
                id: "anonymous".into(),
                failures: 0,
            })
            .unwrap(),
        ),
    ];
    for (id, payload) in messages.clone() {
        publish(id, payload).await;
    }
    let ids = id_header.map_or_else(MessageId::broker, MessageId::header);
    let consumer = Consumer::new(format!("queues.{run}"))
        .message_id(ids)
        .store(MemoryStore::new())
        .backoff(Duration::from_millis(20), Duration::from_millis(80))
        .max_deliveries(3);
    let runs = Arc::new(Runs::default());
    let mut settled = Vec::new();
    // Final dispositions expected: plain ×2 acked, flaky acked, doomed rejected, reused,
    // poison and anonymous rejected.
    let finals = |settled: &Vec<(String, Disposition)>| {
        settled
            .iter()
            .filter(|(_, d)| !matches!(d, Disposition::Requeue { .. }))
            .count()
    };
    while finals(&settled) < messages.len() {
        let delivery = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
            .await
            .expect("no delivery for 30 s")
            .expect("the deliveries ended");
        let id = match id_header {
            Some(header) => delivery.header(header),
            None => delivery.message_id(),
        };
        let id = id.map(|id| id.into_owned()).unwrap_or_default();
        let runs = Arc::clone(&runs);
        let disposition = consumer
            .handle(&delivery, |job: Job| async move {
                let n = runs.ran(&job.id);
                if n <= job.failures {
                    return Err(Error::store("the downstream is down"));
                }
                Ok::<_, Error>(format!("done {} on run {n}", job.id))
            })
            .await
            .unwrap();
        settled.push((id, disposition));
    }
    (settled, runs)
}

fn check(run: &str, settled: &[(String, Disposition)], runs: &Runs) {
    let of = |name: &str| -> Vec<Disposition> {
        let id = format!("{run}-{name}");
        settled
            .iter()
            .filter(|(i, _)| *i == id)
            .map(|(_, d)| *d)
            .collect()
    };
    let requeued = |d: &Disposition| matches!(d, Disposition::Requeue { .. });
    // The duplicate replays; the reused id is rejected.
    let plain = of("plain");
    assert_eq!(
        plain.iter().filter(|d| **d == Disposition::Ack).count(),
        2,
        "{plain:?}"
    );
    assert_eq!(
        plain.iter().filter(|d| **d == Disposition::Reject).count(),
        1,
        "{plain:?}"
    );
    assert_eq!(
        runs.of(&format!("{run}-plain")),
        1,
        "the duplicate ran again"
    );
    // Two transient failures with the backoff growing, then done.
    let flaky = of("flaky");
    assert_eq!(flaky.len(), 3, "{flaky:?}");
    assert_eq!(
        flaky[0],
        Disposition::Requeue {
            after: Duration::from_millis(20)
        }
    );
    assert_eq!(
        flaky[1],
        Disposition::Requeue {
            after: Duration::from_millis(40)
        }
    );
    assert_eq!(flaky[2], Disposition::Ack);
    // Never succeeds: rejected on its third delivery, the last allowed.
    let doomed = of("doomed");
    assert_eq!(doomed.len(), 3, "{doomed:?}");
    assert!(doomed[..2].iter().all(requeued), "{doomed:?}");
    assert_eq!(doomed[2], Disposition::Reject);
    assert_eq!(runs.of(&format!("{run}-doomed")), 3);
    // Rejected once, never handled.
    assert_eq!(of("poison"), vec![Disposition::Reject]);
    assert_eq!(of(""), Vec::<Disposition>::new());
    let anonymous: Vec<_> = settled
        .iter()
        .filter(|(id, _)| id.is_empty())
        .map(|(_, d)| *d)
        .collect();
    assert_eq!(anonymous, vec![Disposition::Reject]);
    assert_eq!(runs.of("anonymous"), 0, "a message without an id ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_deliveries_are_settled_by_their_outcome() {
    let url = std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = match Connection::connect(&url, Default::default()).await {
        Ok(connection) => connection,
        Err(err) => {
            assert!(
                std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(),
                "RabbitMQ is required (IDEM_REQUIRE_SERVICES): {err}"
            );
            eprintln!("skipped: RabbitMQ is unreachable ({err})");
            return;
        }
    };
    let channel = connection.create_channel().await.unwrap();
    let run = unique("amqp");
    let queue = format!("idem.settle.{run}");
    let (dlx, dead) = (format!("{queue}.dlx"), format!("{queue}.dead"));
    channel
        .exchange_declare(
            dlx.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_declare(
            dead.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            dead.as_str().into(),
            dlx.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut arguments = FieldTable::default();
    // A quorum queue counts deliveries (`x-delivery-count`), so that the last one is known.
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    arguments.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(dlx.as_str().into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.as_str().into(), durable, arguments)
        .await
        .unwrap();

    let publisher = connection.create_channel().await.unwrap();
    let target = queue.clone();
    let publish: Publish = Box::new(move |id, payload| {
        let (publisher, target) = (publisher.clone(), target.clone());
        Box::pin(async move {
            let mut properties = BasicProperties::default();
            if let Some(id) = id {
                properties = properties.with_message_id(id.as_str().into());
            }
            publisher
                .basic_publish(
                    "".into(),
                    target.as_str().into(),
                    BasicPublishOptions::default(),
                    &payload,
                    properties,
                )
                .await
                .unwrap()
                .await
                .unwrap();
        })
    });
    channel
        .basic_qos(4, BasicQosOptions::default())
        .await
        .unwrap();
    let deliveries = channel
        .basic_consume(
            queue.as_str().into(),
            "settler".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap()
        .map(Result::unwrap);
    let (settled, runs) = scenario(&run, None, publish, deliveries).await;
    check(&run, &settled, &runs);

    // What was rejected is in the dead-letter queue, once each; nothing is left.
    let other = connection.create_channel().await.unwrap();
    // A rejected message reaches the dead-letter queue after its reject, routed by the
    // broker: waited for (10 s at most), not assumed to be there already.
    let mut dead_ids = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while dead_ids.len() < 4 && tokio::time::Instant::now() < deadline {
        while let Some(message) = other
            .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let id = message.delivery.properties.message_id().clone();
            dead_ids.push(id.map(|id| id.to_string()).unwrap_or_default());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    dead_ids.sort();
    let mut expected = vec![
        String::new(),
        format!("{run}-doomed"),
        format!("{run}-plain"),
        format!("{run}-poison"),
    ];
    expected.sort();
    assert_eq!(dead_ids, expected);
    drop(channel);
    let info = other
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(info.message_count(), 0, "left in the queue");
    for name in [queue.as_str(), dead.as_str()] {
        other
            .queue_delete(name.into(), Default::default())
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_deliveries_are_settled_by_their_outcome() {
    let url = std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let client = match async_nats::connect(&url).await {
        Ok(client) => client,
        Err(err) => {
            assert!(
                std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(),
                "NATS is required (IDEM_REQUIRE_SERVICES): {err}"
            );
            eprintln!("skipped: NATS is unreachable ({err})");
            return;
        }
    };
    let js = jetstream::new(client);
    let run = unique("nats");
    let name = run.replace('-', "_").to_uppercase();
    let subject = format!("idem.settle.{name}");
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            max_age: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .unwrap();
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("settler".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .unwrap();
    let publisher = js.clone();
    let publish: Publish = Box::new(move |id, payload| {
        let (publisher, subject) = (publisher.clone(), subject.clone());
        Box::pin(async move {
            // The id in a header of the test's own, not `Nats-Msg-Id`: JetStream would drop
            // the duplicate itself, within its window, and the consumer must be the one to
            // deduplicate it. (`examples/queues_test.rs` keys on `Nats-Msg-Id`.)
            let mut headers = async_nats::HeaderMap::new();
            if let Some(id) = id {
                headers.insert("Idem-Msg-Id", id.as_str());
            }
            publisher
                .publish_with_headers(subject, headers, payload.into())
                .await
                .unwrap()
                .await
                .unwrap();
        })
    });
    let deliveries = consumer.messages().await.unwrap().map(Result::unwrap);
    let (settled, runs) = scenario(&run, Some("Idem-Msg-Id"), publish, deliveries).await;
    check(&run, &settled, &runs);

    let mut consumer: jetstream::consumer::Consumer<pull::Config> =
        stream.get_consumer("settler").await.unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!(info.num_pending, 0, "{info:?}");
    assert_eq!(info.num_ack_pending, 0, "{info:?}");
    js.delete_stream(&name).await.unwrap();
}
