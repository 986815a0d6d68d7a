//! A Lambda function fed by an SQS queue, idempotent on DynamoDB: each order in a batch is
//! shipped once, whatever Lambda delivers again, and the function answers which records
//! Lambda must deliver again (a partial batch response).
//!
//! ```sh
//! cargo lambda build --release --example lambda_sqs          # to deploy (needs cargo-lambda)
//! cargo run -p idem-examples --example lambda_sqs -- --demo   # batches, against the emulator
//! ```
//!
//! Deployed, it reads its table from `IDEM_TABLE`, as `examples/lambda.rs` does; its event
//! source mapping must report batch item failures (`FunctionResponseTypes:
//! ReportBatchItemFailures`). `--demo` hands the function two batches as Lambda would,
//! against `IDEM_DYNAMODB_URL` (default `http://127.0.0.1:8000`, where `.ci/run` starts
//! dynoxide): duplicates, a carrier that is down once and a poisoned message.

#[path = "aws.rs"]
mod aws;

use std::sync::atomic::{AtomicU32, Ordering};

use aws_lambda_events::event::sqs::{SqsEvent, SqsMessage};
use idem_runtime::consumer::{Classify, Consumer, Disposition};
use idem_runtime::DynamoDbStore;
use lambda_runtime::{service_fn, LambdaEvent};
use serde::Deserialize;

#[derive(Deserialize)]
struct Order {
    order: u64,
}

#[derive(Debug)]
enum ShipError {
    Idem(idem_runtime::Error),
    CarrierDown,
}

impl From<idem_runtime::Error> for ShipError {
    fn from(err: idem_runtime::Error) -> Self {
        Self::Idem(err)
    }
}

impl Classify for ShipError {
    fn disposition(&self) -> Disposition {
        match self {
            Self::Idem(err) => err.disposition(),
            Self::CarrierDown => Disposition::requeue(),
        }
    }
}

/// Shipments made, and whether the carrier has been down once (the demo's).
static SHIPPED: AtomicU32 = AtomicU32::new(0);
static CARRIER_WAS_DOWN: AtomicU32 = AtomicU32::new(0);

/// The record handler: ships one order. The carrier is down for order 2, once.
async fn ship(order: Order) -> Result<u32, ShipError> {
    if order.order == 2 && CARRIER_WAS_DOWN.fetch_add(1, Ordering::SeqCst) == 0 {
        return Err(ShipError::CarrierDown);
    }
    Ok(SHIPPED.fetch_add(1, Ordering::SeqCst) + 1)
}

fn store(config: aws_sdk_dynamodb::Config) -> DynamoDbStore {
    let table = std::env::var("IDEM_TABLE").unwrap_or_else(|_| "idem_lambda_demo".into());
    DynamoDbStore::new(aws_sdk_dynamodb::Client::from_conf(config), table)
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    if std::env::args().any(|arg| arg == "--demo") {
        return demo().await;
    }
    let store = store(aws::lambda_config());
    // The glue beyond the record handler.
    let consumer = &Consumer::new("shop.orders.v1").store(store);
    lambda_runtime::run(service_fn(|event: LambdaEvent<SqsEvent>| async move {
        Ok::<_, lambda_runtime::Error>(consumer.sqs_batch(&event.payload, ship).await)
    }))
    .await
}

/// A record as Lambda hands it over from a standard queue.
fn record(id: &str, body: &str, receives: u32) -> SqsMessage {
    let mut record = SqsMessage::default();
    record.message_id = Some(id.to_owned());
    record.body = Some(body.to_owned());
    record
        .attributes
        .insert("ApproximateReceiveCount".into(), receives.to_string());
    record.event_source = Some("aws:sqs".into());
    record.event_source_arn = Some("arn:aws:sqs:eu-west-1:210987654321:orders".into());
    record
}

/// Two batches as Lambda would send them.
async fn demo() -> Result<(), lambda_runtime::Error> {
    let url = std::env::var("IDEM_DYNAMODB_URL").unwrap_or_else(|_| "http://127.0.0.1:8000".into());
    let store = store(aws::emulator_config(&url));
    store.migrate().await?;
    let consumer = Consumer::new("shop.orders.v1").store(store);
    let run = std::process::id();
    let id = |n: &str| format!("{run}-{n}");
    let mut first = SqsEvent::default();
    first.records = vec![
        record(&id("1"), r#"{"order":1}"#, 1),
        record(&id("2"), r#"{"order":2}"#, 1),
        record(&id("1"), r#"{"order":1}"#, 1),
        record(&id("poison"), "{not json", 1),
    ];
    let response = consumer.sqs_batch(&first, ship).await;
    let failed: Vec<_> = response
        .batch_item_failures
        .iter()
        .map(|failure| failure.item_identifier.clone())
        .collect();
    println!("first batch: delivered again {failed:?}");
    assert_eq!(failed, [id("2")], "only the order whose carrier was down");

    let mut second = SqsEvent::default();
    second.records = vec![
        record(&id("2"), r#"{"order":2}"#, 2),
        record(&id("1"), r#"{"order":1}"#, 2),
    ];
    let response = consumer.sqs_batch(&second, ship).await;
    println!(
        "second batch: delivered again {:?}",
        response.batch_item_failures
    );
    assert!(response.batch_item_failures.is_empty());
    assert_eq!(SHIPPED.load(Ordering::SeqCst), 2, "each order shipped once");
    println!("each order shipped once; the duplicate replayed, the poison not retried");
    Ok(())
}
