//! `consumer::kafka` against a Kafka-protocol broker nobody here wrote (tansu, or the brokers
//! of `IDEM_KAFKA_BROKERS`): records handled once, concurrently, duplicates replayed, a
//! poison and a reused id sent to the dead-letter topic once each, with their source; the
//! commit never passes a running record; a record whose partition moves to another member
//! mid-record waits for its claim and replays; a transient failure is retried in place,
//! holding its partition's order, and dead-lettered after the last attempt; what a stopped
//! run read and did not run, the next run runs.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::consumer::kafka::{KafkaGroup, KafkaRecord};
use idem_runtime::consumer::{Consumer, Delivery, Disposition, MessageId};
use idem_runtime::{Error, MemoryStore};
use idem_tests::{
    kafka_brokers, kafka_committed, kafka_produce, kafka_read_all, kafka_topic, redis_store,
};
use rdkafka::consumer::Consumer as _;
use rdkafka::message::{Headers, Message};
use rdkafka::ClientConfig;
use tokio::sync::{mpsc, Notify};

/// A member's config: the group `group`, reading a new group's partitions from their
/// start, committing every 100 ms.
fn config(brokers: &str, group: &str) -> ClientConfig {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("auto.commit.interval.ms", "100")
        .clone()
}

fn consumer() -> Consumer<MemoryStore> {
    Consumer::new("kafka.orders.v1")
        .store(MemoryStore::new())
        .message_id(MessageId::json("/id"))
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
}

/// Waits (bounded: two minutes) for the next disposition a handler reports.
async fn next<T>(settled: &mut mpsc::UnboundedReceiver<T>) -> T {
    tokio::time::timeout(Duration::from_secs(120), settled.recv())
        .await
        .expect("no record settled for two minutes")
        .expect("the consumer ended")
}

#[derive(serde::Deserialize)]
struct Order {
    id: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_run_once_concurrently_and_poison_is_dead_lettered_once() {
    let Some(brokers) = kafka_brokers().await else {
        return;
    };
    let topic = kafka_topic(&brokers, "orders", 3).await;
    let dead = kafka_topic(&brokers, "orders-dead", 1).await;
    // 30 orders over three partitions, the first ten sent again to another partition.
    let mut records = 0;
    for n in 0..30_i32 {
        let payload = format!(r#"{{"id":{n}}}"#);
        kafka_produce(&brokers, &topic, n % 3, &[], payload.as_bytes()).await;
        if n < 10 {
            kafka_produce(&brokers, &topic, (n + 1) % 3, &[], payload.as_bytes()).await;
            records += 1;
        }
        records += 1;
    }
    kafka_produce(
        &brokers,
        &topic,
        0,
        &[("source", "bad-producer")],
        b"{not json",
    )
    .await;
    kafka_produce(&brokers, &topic, 1, &[], br#"{"id":5,"more":true}"#).await;
    records += 2;

    let group_id = format!("{topic}-shipper");
    let group = KafkaGroup::join(&config(&brokers, &group_id), "test-cluster", &[&topic])
        .unwrap()
        .dead_letter(&dead)
        .unwrap()
        .concurrency(8);
    let consumer = &consumer();
    let runs = &Mutex::new(BTreeMap::<u64, u32>::new());
    let (report, mut settled) = mpsc::unbounded_channel();
    let stop = Arc::new(Notify::new());
    let run = group.run_until(stop.clone().notified_owned(), |record: KafkaRecord| {
        let report = report.clone();
        async move {
            let disposition = consumer
                .handle(&record, |order: Order| async move {
                    *runs.lock().unwrap().entry(order.id).or_default() += 1;
                    tokio::task::yield_now().await;
                    Ok::<_, Error>(order.id)
                })
                .await?;
            report.send(disposition).unwrap();
            Ok(disposition)
        }
    });
    let watch = async {
        let mut finished = Vec::new();
        while finished.len() < records {
            match next(&mut settled).await {
                Disposition::Requeue { .. } => {}
                disposition => finished.push(disposition),
            }
        }
        stop.notify_one();
        finished
    };
    let (ran, finished) = tokio::join!(run, watch);
    ran.unwrap();

    let rejected = finished
        .iter()
        .filter(|d| **d == Disposition::Reject)
        .count();
    assert_eq!(rejected, 2, "{finished:?}");
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 30, "{runs:?}");
    assert!(
        runs.values().all(|n| *n == 1),
        "an order ran twice: {runs:?}"
    );

    let letters = kafka_read_all(&brokers, &dead, 1).await;
    let mut payloads: Vec<_> = letters
        .iter()
        .map(|m| m.payload().unwrap().to_vec())
        .collect();
    payloads.sort();
    assert_eq!(
        payloads,
        [br#"{"id":5,"more":true}"#.to_vec(), b"{not json".to_vec()]
    );
    for letter in &letters {
        let headers = letter.headers().unwrap();
        let header = |name: &str| {
            let found = headers.iter().find(|h| h.key == name)?;
            Some(String::from_utf8(found.value?.to_vec()).unwrap())
        };
        assert_eq!(
            header("idem-source-cluster").as_deref(),
            Some("test-cluster")
        );
        assert_eq!(header("idem-source-topic").as_deref(), Some(topic.as_str()));
        assert!(header("idem-source-offset").is_some());
        if letter.payload() == Some(b"{not json") {
            assert_eq!(
                header("source").as_deref(),
                Some("bad-producer"),
                "its own headers kept"
            );
        }
    }
    // Everything read is committed: per partition, one past its last record.
    let committed = kafka_committed(&brokers, &group_id, &topic, 3).await;
    let ends: Vec<_> = kafka_read_all(&brokers, &topic, 3)
        .await
        .iter()
        .fold(vec![0; 3], |mut ends, m| {
            let p = usize::try_from(m.partition()).unwrap();
            ends[p] = ends[p].max(m.offset() + 1);
            ends
        })
        .into_iter()
        .map(Some)
        .collect();
    assert_eq!(committed, ends);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commit_never_passes_a_running_record() {
    let Some(brokers) = kafka_brokers().await else {
        return;
    };
    let topic = kafka_topic(&brokers, "watermark", 1).await;
    for n in 0..6 {
        let offset = kafka_produce(
            &brokers,
            &topic,
            0,
            &[],
            format!(r#"{{"id":{n}}}"#).as_bytes(),
        )
        .await;
        assert_eq!(offset, n);
    }
    let group_id = format!("{topic}-shipper");
    let group = KafkaGroup::join(&config(&brokers, &group_id), "test-cluster", &[&topic])
        .unwrap()
        .concurrency(6);
    let consumer = &consumer();
    let release = &Notify::new();
    let (report, mut settled) = mpsc::unbounded_channel();
    let stop = Arc::new(Notify::new());
    let run = group.run_until(stop.clone().notified_owned(), |record: KafkaRecord| {
        let report = report.clone();
        async move {
            let offset = record.message().offset();
            let disposition = consumer
                .handle(&record, |order: Order| async move {
                    if order.id == 0 {
                        release.notified().await;
                    }
                    Ok::<_, Error>(order.id)
                })
                .await?;
            report.send(offset).unwrap();
            Ok(disposition)
        }
    });
    let watch = async {
        let mut finished: Vec<i64> = Vec::new();
        for _ in 1..6 {
            finished.push(next(&mut settled).await);
        }
        finished.sort_unstable();
        assert_eq!(
            finished,
            [1, 2, 3, 4, 5],
            "the five after the first finish first"
        );
        // What is stored now is committed, and it is not past the first record.
        let member = group.clone();
        tokio::task::spawn_blocking(move || {
            let _nothing_stored = member
                .consumer()
                .commit_consumer_state(rdkafka::consumer::CommitMode::Sync);
        })
        .await
        .unwrap();
        let committed = kafka_committed(&brokers, &group_id, &topic, 1).await;
        assert!(
            committed[0].is_none_or(|offset| offset <= 0),
            "committed {committed:?} while offset 0 runs"
        );
        release.notify_one();
        assert_eq!(next(&mut settled).await, 0);
        stop.notify_one();
    };
    let (ran, ()) = tokio::join!(run, watch);
    ran.unwrap();
    assert_eq!(
        kafka_committed(&brokers, &group_id, &topic, 1).await,
        [Some(6)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_moved_to_another_member_mid_record_waits_and_replays() {
    let Some(brokers) = kafka_brokers().await else {
        return;
    };
    let topic = kafka_topic(&brokers, "rebalance", 1).await;
    kafka_produce(&brokers, &topic, 0, &[], br#"{"id":1}"#).await;
    let group_id = format!("{topic}-shipper");
    // Two members as two processes would be: one Redis, a connection each.
    let (Some(store_a), Some(store_b)) = (redis_store().await, redis_store().await) else {
        return;
    };
    let member = |store| {
        Consumer::new(format!("kafka.rebalance.{topic}"))
            .store(store)
            .message_id(MessageId::json("/id"))
            .backoff(Duration::from_millis(20), Duration::from_millis(200))
            .max_deliveries(1_000)
    };
    let consumers = &[member(store_a), member(store_b)];
    let runs = &std::sync::atomic::AtomicU32::new(0);
    let (started, release) = (&Notify::new(), &Notify::new());
    let handler = |record: KafkaRecord,
                   report: mpsc::UnboundedSender<(char, Disposition)>,
                   member: char| async move {
        let consumer = &consumers[usize::from(member == 'b')];
        let disposition = consumer
            .handle(&record, |order: Order| async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                started.notify_one();
                release.notified().await;
                Ok::<_, Error>(order.id)
            })
            .await?;
        report.send((member, disposition)).unwrap();
        Ok(disposition)
    };
    let first = KafkaGroup::join(&config(&brokers, &group_id), "test-cluster", &[&topic]).unwrap();
    let (report, mut settled) = mpsc::unbounded_channel();
    let stop = Arc::new(Notify::new());
    let first_run = first.run_until(stop.clone().notified_owned(), |record| {
        handler(record, report.clone(), 'a')
    });
    let watch = async {
        started.notified().await;
        // A second member joins, and the partition moves to it while the first runs its
        // record (if the join did not move it already).
        let second =
            KafkaGroup::join(&config(&brokers, &group_id), "test-cluster", &[&topic]).unwrap();
        first.consumer().unsubscribe();
        let second_run = second.run_until(stop.clone().notified_owned(), |record| {
            handler(record, report.clone(), 'b')
        });
        let steps = async {
            assert!(
                matches!(next(&mut settled).await, ('b', Disposition::Requeue { .. })),
                "the second member waits for the first's claim"
            );
            release.notify_one();
            let mut rest = Vec::new();
            while rest.len() < 2 {
                let (member, disposition) = next(&mut settled).await;
                if !matches!(disposition, Disposition::Requeue { .. }) {
                    rest.push((member, disposition));
                }
            }
            stop.notify_waiters();
            rest
        };
        let (ran, rest) = tokio::join!(second_run, steps);
        ran.unwrap();
        rest
    };
    let (ran, mut rest) = tokio::join!(first_run, watch);
    ran.unwrap();
    rest.sort_by_key(|(member, _)| *member);
    assert_eq!(rest, [('a', Disposition::Ack), ('b', Disposition::Ack)]);
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the body ran once"
    );
    assert_eq!(
        kafka_committed(&brokers, &group_id, &topic, 1).await,
        [Some(1)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_failure_is_retried_in_order_then_dead_lettered() {
    let Some(brokers) = kafka_brokers().await else {
        return;
    };
    let topic = kafka_topic(&brokers, "transient", 1).await;
    let dead = kafka_topic(&brokers, "transient-dead", 1).await;
    for n in 0..3 {
        kafka_produce(
            &brokers,
            &topic,
            0,
            &[],
            format!(r#"{{"id":{n}}}"#).as_bytes(),
        )
        .await;
    }
    let group_id = format!("{topic}-shipper");
    let group = KafkaGroup::join(&config(&brokers, &group_id), "test-cluster", &[&topic])
        .unwrap()
        .dead_letter(&dead)
        .unwrap();
    let consumer = &consumer().max_deliveries(3);
    let (report, mut settled) = mpsc::unbounded_channel();
    let stop = Arc::new(Notify::new());
    // Order 0 fails on every attempt; order 1 once.
    let failures = &Mutex::new(BTreeMap::from([(0_u64, u32::MAX), (1, 1)]));
    let run = group.run_until(stop.clone().notified_owned(), |record: KafkaRecord| {
        let report = report.clone();
        async move {
            let attempt = record.deliveries();
            let disposition = consumer
                .handle(&record, |order: Order| async move {
                    let mut failures = failures.lock().unwrap();
                    let left = failures.entry(order.id).or_default();
                    if *left > 0 {
                        *left -= 1;
                        return Err(Error::store("the carrier is down"));
                    }
                    Ok(order.id)
                })
                .await?;
            report
                .send((record.message().offset(), attempt, disposition))
                .unwrap();
            Ok(disposition)
        }
    });
    let watch = async {
        let mut seen = Vec::new();
        while seen.len() < 5 {
            seen.push(next(&mut settled).await);
        }
        stop.notify_one();
        seen
    };
    let (ran, seen) = tokio::join!(run, watch);
    ran.unwrap();
    let requeue = Disposition::Requeue {
        after: Duration::ZERO,
    };
    let seen: Vec<_> = seen
        .into_iter()
        .map(|(offset, attempt, d)| {
            (
                offset,
                attempt,
                if matches!(d, Disposition::Requeue { .. }) {
                    requeue
                } else {
                    d
                },
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            (0, Some(1), requeue),
            (0, Some(2), requeue),
            (0, Some(3), Disposition::Reject),
            (1, Some(1), requeue),
            (1, Some(2), Disposition::Ack),
        ],
        "in order, each record retried in place before the next"
    );
    let letters = kafka_read_all(&brokers, &dead, 1).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].payload(), Some(&br#"{"id":0}"#[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_run_leaves_what_it_read_and_did_not_run_to_the_next() {
    let Some(brokers) = kafka_brokers().await else {
        return;
    };
    let topic = kafka_topic(&brokers, "leftovers", 1).await;
    // More than the 64 a member reads ahead before it pauses its partitions.
    const RECORDS: i64 = 70;
    for n in 0..RECORDS {
        let payload = format!(r#"{{"id":{n}}}"#);
        kafka_produce(&brokers, &topic, 0, &[], payload.as_bytes()).await;
    }
    let group_id = format!("{topic}-shipper");
    let group = KafkaGroup::join(&config(&brokers, &group_id), "test-cluster", &[&topic]).unwrap();
    let consumer = &consumer();
    let release = &Notify::new();
    let (report, mut settled) = mpsc::unbounded_channel();
    let handler = |record: KafkaRecord| {
        let report = report.clone();
        async move {
            let offset = record.message().offset();
            let disposition = consumer
                .handle(&record, |order: Order| async move {
                    if order.id == 0 {
                        release.notified().await;
                    }
                    Ok::<_, Error>(order.id)
                })
                .await?;
            report.send(offset).unwrap();
            Ok(disposition)
        }
    };

    // The first run reads ahead while offset 0 runs, until it pauses the partition, and is
    // stopped then: what it read after 0 it never starts.
    let stop = Arc::new(Notify::new());
    let first = group.run_until(stop.clone().notified_owned(), handler);
    let watch = async {
        let read_ahead = async {
            loop {
                let position = group.consumer().position().unwrap();
                let next = position.elements().first().map(|at| at.offset());
                if next.is_some_and(|next| next.to_raw() >= Some(65)) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(120), read_ahead)
            .await
            .expect("the member did not read 64 records ahead in two minutes");
        stop.notify_one();
        release.notify_one();
        assert_eq!(next(&mut settled).await, 0);
    };
    let (ran, ()) = tokio::join!(first, watch);
    ran.unwrap();
    assert_eq!(
        kafka_committed(&brokers, &group_id, &topic, 1).await,
        [Some(1)]
    );

    // The next run on the same member runs every one of them, in order, and commits them.
    let stop = Arc::new(Notify::new());
    let second = group.run_until(stop.clone().notified_owned(), handler);
    let watch = async {
        let mut finished = Vec::new();
        while finished.len() < RECORDS as usize - 1 {
            finished.push(next(&mut settled).await);
        }
        stop.notify_one();
        finished
    };
    let (ran, finished) = tokio::join!(second, watch);
    ran.unwrap();
    assert_eq!(finished, (1..RECORDS).collect::<Vec<_>>());
    assert_eq!(
        kafka_committed(&brokers, &group_id, &topic, 1).await,
        [Some(RECORDS)]
    );
}
