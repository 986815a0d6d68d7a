//! `Consumer::sqs_batch`, `kinesis_batch` and `dynamodb_stream_batch`: Lambda's batches, as
//! Lambda sends them (`events/*.json` are records in the shapes AWS documents), on
//! DynamoDB. The partial batch response names exactly the transient records; duplicates,
//! within a batch and across batches, replay; final failures are not retried; a FIFO batch
//! stops at its first failure; a stream's batch stops at its first transient failure and
//! names its sequence number, the checkpoint Lambda retries from.

use std::collections::BTreeMap;
use std::sync::Mutex;

use aws_lambda_events::event::dynamodb::{Event as DynamoDbEvent, EventRecord};
use aws_lambda_events::event::kafka::{KafkaEvent, KafkaRecord};
use aws_lambda_events::event::kinesis::{KinesisEvent, KinesisEventRecord};
use aws_lambda_events::event::sqs::{SqsBatchResponse, SqsEvent, SqsMessage};
use idem_runtime::consumer::{Classify, Consumer, Disposition, MessageId};
use idem_tests::dynamodb_store;

#[derive(serde::Deserialize)]
struct Order {
    order: u64,
    cents: u64,
}

#[derive(Debug)]
enum ChargeError {
    Idem(idem_runtime::Error),
    GatewayDown,
    Declined,
}

impl From<idem_runtime::Error> for ChargeError {
    fn from(err: idem_runtime::Error) -> Self {
        Self::Idem(err)
    }
}

impl Classify for ChargeError {
    fn disposition(&self) -> Disposition {
        match self {
            Self::Idem(err) => err.disposition(),
            Self::GatewayDown => Disposition::requeue(),
            Self::Declined => Disposition::Reject,
        }
    }
}

/// What the payment gateway saw: attempts by order, and charges made.
#[derive(Default)]
struct Gateway {
    attempts: Mutex<BTreeMap<u64, u32>>,
    charged: Mutex<BTreeMap<u64, u32>>,
}

impl Gateway {
    /// Order 2's gateway is down on its first attempt, order 3 is declined.
    async fn charge(&self, order: Order) -> Result<u64, ChargeError> {
        let attempt = {
            let mut attempts = self.attempts.lock().unwrap();
            let attempt = attempts.entry(order.order).or_default();
            *attempt += 1;
            *attempt
        };
        match order.order {
            2 if attempt == 1 => Err(ChargeError::GatewayDown),
            3 => Err(ChargeError::Declined),
            _ => {
                *self.charged.lock().unwrap().entry(order.order).or_default() += 1;
                Ok(order.cents)
            }
        }
    }
}

fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{}-{nanos}", std::process::id())
}

/// The sample record with this id, body and receive count; on the queue `queue`.
fn record(id: &str, body: &str, deliveries: u32, queue: &str) -> SqsMessage {
    let sample: SqsEvent = serde_json::from_str(include_str!("events/sqs.json")).unwrap();
    let mut record = sample.records.into_iter().next().unwrap();
    record.message_id = Some(id.to_owned());
    record.body = Some(body.to_owned());
    record
        .attributes
        .insert("ApproximateReceiveCount".into(), deliveries.to_string());
    record.event_source_arn = Some(format!("arn:aws:sqs:eu-west-1:210987654321:{queue}"));
    record
}

fn event(records: Vec<SqsMessage>) -> SqsEvent {
    let mut event: SqsEvent = serde_json::from_str(include_str!("events/sqs.json")).unwrap();
    event.records = records;
    event
}

fn failures(response: &SqsBatchResponse) -> Vec<String> {
    response
        .batch_item_failures
        .iter()
        .map(|failure| failure.item_identifier.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_lists_exactly_its_transient_records() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    let run = run_id();
    let id = |n: &str| format!("{run}-{n}");
    let order = |n: u64| format!(r#"{{"order":{n},"cents":{}}}"#, n * 100);
    let gateway = Gateway::default();
    // The function's glue: its consumer, and each batch handed to it.
    let consumer = Consumer::new("lambda.orders.v1").store(store);
    let charge = |order: Order| gateway.charge(order);

    let first = event(vec![
        record(&id("1"), &order(1), 1, "orders"),
        record(&id("2"), &order(2), 1, "orders"),
        record(&id("3"), &order(3), 1, "orders"),
        record(&id("poison"), "{not json", 1, "orders"),
        // SQS delivers at least once: the same message twice in one batch.
        record(&id("1"), &order(1), 1, "orders"),
        record(&id("reused"), &order(4), 1, "orders"),
    ]);
    let response = consumer.sqs_batch(&first, charge).await;
    assert_eq!(failures(&response), [id("2")], "only the transient record");

    // Lambda's next batch: the transient record again, a redelivered duplicate, and the
    // reused id with another order.
    let second = event(vec![
        record(&id("2"), &order(2), 2, "orders"),
        record(&id("1"), &order(1), 2, "orders"),
        record(&id("reused"), &order(5), 1, "orders"),
    ]);
    let response = consumer.sqs_batch(&second, charge).await;
    assert!(failures(&response).is_empty(), "{response:?}");

    let charged = gateway.charged.into_inner().unwrap();
    assert_eq!(
        charged,
        BTreeMap::from([(1, 1), (2, 1), (4, 1)]),
        "each order charged once; the reused id's second order never"
    );
    let attempts = gateway.attempts.into_inner().unwrap();
    assert_eq!(attempts[&3], 1, "a final failure is not retried");
    assert_eq!(attempts.get(&5), None, "{attempts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_failure_on_the_last_delivery_is_not_retried() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    let run = run_id();
    let gateway = Gateway::default();
    let consumer = Consumer::new("lambda.orders.last.v1")
        .store(store)
        .max_deliveries(3);
    let charge = |order: Order| gateway.charge(order);
    let body = r#"{"order":2,"cents":200}"#;
    // Order 2 fails on its first attempt: here that is its third delivery, the last.
    let batch = event(vec![record(&format!("{run}-2"), body, 3, "orders")]);
    let response = consumer.sqs_batch(&batch, charge).await;
    assert!(failures(&response).is_empty(), "{response:?}");
    assert_eq!(gateway.attempts.into_inner().unwrap()[&2], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_batch_stops_at_its_first_failure() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    let run = run_id();
    let gateway = Gateway::default();
    let consumer = Consumer::new("lambda.orders.fifo.v1").store(store);
    let charge = |order: Order| gateway.charge(order);
    let fifo = |n: u64| {
        let mut record = record(
            &format!("{run}-sqs-{n}"),
            &format!(r#"{{"order":{n},"cents":1}}"#),
            1,
            "orders.fifo",
        );
        record
            .attributes
            .insert("MessageGroupId".into(), "customer-7".into());
        // On a FIFO queue the producer's deduplication id is the key.
        record
            .attributes
            .insert("MessageDeduplicationId".into(), format!("{run}-{n}"));
        record
    };
    let batch = event(vec![fifo(1), fifo(2), fifo(3), fifo(4)]);
    let response = consumer.sqs_batch(&batch, charge).await;
    assert_eq!(
        failures(&response),
        [
            format!("{run}-sqs-2"),
            format!("{run}-sqs-3"),
            format!("{run}-sqs-4")
        ],
        "the failure and every record after it"
    );
    let attempts = gateway.attempts.lock().unwrap().clone();
    assert_eq!(
        attempts,
        BTreeMap::from([(1, 1), (2, 1)]),
        "nothing handled after the failure"
    );

    // Lambda delivers the rest again, in order: the first, already done, is not in it.
    let mut again = vec![fifo(2), fifo(3), fifo(4)];
    for record in &mut again {
        record
            .attributes
            .insert("ApproximateReceiveCount".into(), "2".into());
    }
    let response = consumer.sqs_batch(&event(again), charge).await;
    assert!(failures(&response).is_empty(), "{response:?}");
    assert_eq!(
        gateway.charged.into_inner().unwrap(),
        BTreeMap::from([(1, 1), (2, 1), (4, 1)]),
        "order 3 is declined: final, not retried, and not in the way of order 4"
    );
}

/// The sample Kinesis record, for order `n`, its sequence number and event id made of `n`.
fn kinesis_record(run: &str, n: u64) -> KinesisEventRecord {
    let sample: KinesisEvent = serde_json::from_str(include_str!("events/kinesis.json")).unwrap();
    let mut record = sample.records.into_iter().next().unwrap();
    let sequence = format!("{run}{n:04}");
    record.kinesis.data.0 = format!(r#"{{"order":{n},"cents":{}}}"#, n * 100).into_bytes();
    record.event_id = Some(format!("shardId-000000000003:{sequence}"));
    record.kinesis.sequence_number = sequence;
    record
}

fn kinesis_event(records: Vec<KinesisEventRecord>) -> KinesisEvent {
    let mut event: KinesisEvent =
        serde_json::from_str(include_str!("events/kinesis.json")).unwrap();
    event.records = records;
    event
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kinesis_batch_stops_at_its_first_transient_failure() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    // Digits only: a sequence number is a decimal number.
    let run = run_id().replace('-', "");
    let gateway = Gateway::default();
    let consumer = Consumer::new("lambda.orders.kinesis.v1").store(store);
    let charge = |order: Order| gateway.charge(order);
    let record = |n| kinesis_record(&run, n);

    let batch = kinesis_event(vec![record(1), record(2), record(3), record(4)]);
    let response = consumer.kinesis_batch(&batch, charge).await;
    let named: Vec<_> = response
        .batch_item_failures
        .iter()
        .map(|failure| failure.item_identifier.clone().unwrap())
        .collect();
    assert_eq!(named, [format!("{run}0002")], "the checkpoint: order 2");
    assert_eq!(
        gateway.attempts.lock().unwrap().clone(),
        BTreeMap::from([(1, 1), (2, 1)]),
        "nothing after the failure ran"
    );

    // Lambda retries from the checkpoint; then the whole batch again, as after a
    // function that timed out: every record done replays.
    let retried = consumer
        .kinesis_batch(
            &kinesis_event(vec![record(2), record(3), record(4)]),
            charge,
        )
        .await;
    assert!(retried.batch_item_failures.is_empty(), "{retried:?}");
    let again = consumer.kinesis_batch(&batch, charge).await;
    assert!(again.batch_item_failures.is_empty(), "{again:?}");
    assert_eq!(
        gateway.charged.into_inner().unwrap(),
        BTreeMap::from([(1, 1), (2, 1), (4, 1)]),
        "each order charged once; order 3 declined, skipped"
    );
}

/// The sample DynamoDB Streams record of order `n`.
fn stream_record(run: &str, n: u64) -> EventRecord {
    let sample: DynamoDbEvent = serde_json::from_str(include_str!("events/dynamodb.json")).unwrap();
    let mut record = sample.records.into_iter().next().unwrap();
    record.event_id = format!("{run}-{n}");
    record.change.sequence_number = Some(format!("{n}"));
    let image: serde_json::Value = serde_json::json!({
        "order": {"N": n.to_string()},
        "cents": {"N": (n * 100).to_string()},
    });
    record.change.new_image = serde_json::from_value(image).unwrap();
    record
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dynamodb_stream_batch_is_handled_once_per_record() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    let run = run_id();
    let gateway = Gateway::default();
    let consumer = Consumer::new("lambda.orders.stream.v1").store(store);
    // The handler gets the whole stream record, and reads the new image.
    let charge = |record: EventRecord| {
        let gateway = &gateway;
        async move {
            let image = serde_json::to_value(&record.change.new_image).unwrap();
            let number = |name: &str| image[name]["N"].as_str().unwrap().parse().unwrap();
            let order = Order {
                order: number("order"),
                cents: number("cents"),
            };
            gateway.charge(order).await
        }
    };
    let event = |numbers: &[u64]| {
        let mut event: DynamoDbEvent =
            serde_json::from_str(include_str!("events/dynamodb.json")).unwrap();
        event.records = numbers.iter().map(|n| stream_record(&run, *n)).collect();
        event
    };

    let response = consumer
        .dynamodb_stream_batch(&event(&[1, 2, 4]), charge)
        .await;
    let named: Vec<_> = response
        .batch_item_failures
        .iter()
        .map(|failure| failure.item_identifier.clone().unwrap())
        .collect();
    assert_eq!(named, ["2"], "the checkpoint: order 2's sequence number");
    let response = consumer
        .dynamodb_stream_batch(&event(&[1, 2, 4]), charge)
        .await;
    assert!(response.batch_item_failures.is_empty(), "{response:?}");
    assert_eq!(
        gateway.charged.into_inner().unwrap(),
        BTreeMap::from([(1, 1), (2, 1), (4, 1)])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standard_batch_runs_its_records_at_once() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    let run = run_id();
    let consumer = Consumer::new("lambda.orders.concurrent.v1").store(store);
    // Each handler waits for the other: one at a time, neither would finish.
    let both = tokio::sync::Barrier::new(2);
    let meet = |order: Order| {
        let both = &both;
        async move {
            match tokio::time::timeout(std::time::Duration::from_secs(60), both.wait()).await {
                Ok(_) => Ok(order.cents),
                Err(_) => Err(ChargeError::GatewayDown),
            }
        }
    };
    let batch = event(vec![
        record(&format!("{run}-1"), r#"{"order":1,"cents":1}"#, 1, "orders"),
        record(&format!("{run}-2"), r#"{"order":2,"cents":2}"#, 1, "orders"),
    ]);
    let response = consumer.sqs_batch(&batch, meet).await;
    assert!(failures(&response).is_empty(), "{response:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_attribute_can_be_the_id() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    let run = run_id();
    let gateway = Gateway::default();
    let consumer = Consumer::new("lambda.orders.attribute.v1")
        .store(store)
        .message_id(MessageId::header("order-id"));
    let charge = |order: Order| gateway.charge(order);
    // A producer that sent order 1 twice: two SQS messages, one order id.
    let sent = |sqs_id: &str| {
        let mut record = record(
            &format!("{run}-{sqs_id}"),
            r#"{"order":1,"cents":100}"#,
            1,
            "orders",
        );
        let mut id = record.message_attributes["tenant"].clone();
        id.string_value = Some(format!("{run}-order-1"));
        record.message_attributes.insert("order-id".into(), id);
        record
    };
    let first = consumer.sqs_batch(&event(vec![sent("a")]), charge).await;
    let again = consumer.sqs_batch(&event(vec![sent("b")]), charge).await;
    assert!(failures(&first).is_empty() && failures(&again).is_empty());
    assert_eq!(
        gateway.charged.into_inner().unwrap(),
        BTreeMap::from([(1, 1)]),
        "the second send replays"
    );
}

/// The sample Kafka event, its records replaced by `records`: `(partition, offset, order)`,
/// an order of 0 a value that is no JSON.
fn kafka_event(records: &[(i64, i64, u64)]) -> KafkaEvent {
    use base64::Engine as _;
    let mut event: KafkaEvent = serde_json::from_str(include_str!("events/kafka.json")).unwrap();
    let sample: KafkaRecord = event.records.values().next().unwrap()[0].clone();
    event.records.clear();
    for &(partition, offset, order) in records {
        let mut record = sample.clone();
        record.partition = partition;
        record.offset = offset;
        let value = if order == 0 {
            "{not json".to_owned()
        } else {
            format!(r#"{{"order":{order},"cents":{}}}"#, order * 100)
        };
        record.value = Some(base64::engine::general_purpose::STANDARD.encode(value));
        event
            .records
            .entry(format!("orders-{partition}"))
            .or_default()
            .push(record);
    }
    event
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_batch_stops_each_partition_at_its_first_transient_failure() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    let gateway = Gateway::default();
    // Coordinates repeat across runs of the test: a namespace of this run's own.
    let consumer = Consumer::new(format!("lambda.orders.kafka.{}", run_id())).store(store);
    let charge = |order: Order| gateway.charge(order);
    // Partition 0: orders 1, 2 (down once), 4. Partition 1: a poison, order 3 (declined),
    // order 5.
    let batch = kafka_event(&[
        (0, 40, 1),
        (0, 41, 2),
        (0, 42, 4),
        (1, 7, 0),
        (1, 8, 3),
        (1, 9, 5),
    ]);
    let response = consumer.kafka_batch(&batch, charge).await;
    let named = serde_json::to_value(&response).unwrap();
    assert_eq!(
        named,
        serde_json::json!({"batchItemFailures": [{"itemIdentifier": {"partition": "orders-0", "offset": 41}}]}),
        "partition 0's checkpoint, as Lambda reads it; partition 1 skips its final failures"
    );
    assert_eq!(
        gateway.attempts.lock().unwrap().clone(),
        BTreeMap::from([(1, 1), (2, 1), (3, 1), (5, 1)]),
        "nothing after partition 0's failure ran; partition 1 ran whole"
    );

    // Lambda retries partition 0 from its checkpoint, then the whole batch again: every
    // record done replays.
    let retried = consumer
        .kafka_batch(&kafka_event(&[(0, 41, 2), (0, 42, 4)]), charge)
        .await;
    assert!(retried.batch_item_failures.is_empty(), "{retried:?}");
    let again = consumer.kafka_batch(&batch, charge).await;
    assert!(again.batch_item_failures.is_empty(), "{again:?}");
    assert_eq!(
        gateway.charged.into_inner().unwrap(),
        BTreeMap::from([(1, 1), (2, 1), (4, 1), (5, 1)]),
        "each order charged once; order 3 declined, the poison skipped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_record_s_header_can_be_its_id() {
    let Some(store) = dynamodb_store().await else {
        return;
    };
    let run = run_id();
    let gateway = Gateway::default();
    let consumer = Consumer::new(format!("lambda.orders.kafka.header.{run}"))
        .store(store)
        .message_id(MessageId::header("source"));
    let charge = |order: Order| gateway.charge(order);
    // The sample's `source` header on two records at two offsets: one id, charged once.
    let response = consumer
        .kafka_batch(&kafka_event(&[(0, 1, 1), (0, 2, 1)]), charge)
        .await;
    assert!(response.batch_item_failures.is_empty(), "{response:?}");
    assert_eq!(
        gateway.charged.into_inner().unwrap(),
        BTreeMap::from([(1, 1)])
    );
}
