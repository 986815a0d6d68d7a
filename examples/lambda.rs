//! A payment function on AWS Lambda, idempotent on DynamoDB.
//!
//! Lambda delivers an event at least once, and a client that timed out invokes again: the
//! charge runs once per order, a retry gets the recorded receipt, and the same order with
//! another amount is refused.
//!
//! ```sh
//! cargo lambda build --release --example lambda     # to deploy (needs cargo-lambda)
//! cargo run -p idem-examples --example lambda -- --demo   # its handler, against the emulator
//! ```
//!
//! Deployed, it reads its table from `IDEM_TABLE` and the region and credentials from the
//! environment Lambda sets (`AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_SESSION_TOKEN`); a function that already depends on `aws-config` builds the client
//! with `aws_config::load_defaults` instead. Its role needs `dynamodb:UpdateItem` and
//! `dynamodb:GetItem` on the table. `--demo` invokes the handler as Lambda would, against
//! `IDEM_DYNAMODB_URL` (default `http://127.0.0.1:8000`, where `.ci/run` starts dynoxide).

#[path = "aws.rs"]
mod aws;

use std::sync::atomic::{AtomicU32, Ordering};

use idem_runtime::{idempotent, DynamoDbStore};
use lambda_runtime::{service_fn, Context, LambdaEvent};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct ChargeRequest {
    pub order_id: String,
    pub cents: u64,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Serialize)]
pub struct Receipt {
    pub charge_id: String,
    pub cents: u64,
}

#[derive(Debug)]
pub enum ChargeError {
    Declined,
    Idempotency(idem_runtime::Error),
}

impl From<idem_runtime::Error> for ChargeError {
    fn from(err: idem_runtime::Error) -> Self {
        Self::Idempotency(err)
    }
}

impl std::fmt::Display for ChargeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Declined => f.write_str("the card was declined"),
            Self::Idempotency(err) => err.fmt(f),
        }
    }
}

impl std::error::Error for ChargeError {}

/// How many charges the payment provider saw (the demo checks it).
static CHARGES: AtomicU32 = AtomicU32::new(0);

/// One charge per order: the key is the order, the amount its fingerprint.
#[idempotent(key = request.order_id, fingerprint = request.cents, store = store,
             namespace = "lambda.payments.charge.v1", ttl = "24h")]
async fn charge(request: &ChargeRequest, store: &DynamoDbStore) -> Result<Receipt, ChargeError> {
    if request.cents == 0 {
        return Err(ChargeError::Declined); // not recorded: a retry tries again
    }
    let n = CHARGES.fetch_add(1, Ordering::SeqCst) + 1;
    Ok(Receipt {
        charge_id: format!("ch_{n}"),
        cents: request.cents,
    })
}

/// The function's handler: a Lambda event in, a receipt out.
async fn handler(
    store: &DynamoDbStore,
    event: LambdaEvent<ChargeRequest>,
) -> Result<Receipt, lambda_runtime::Error> {
    Ok(charge(&event.payload, store).await?)
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    if std::env::args().any(|arg| arg == "--demo") {
        return demo().await;
    }
    let table = std::env::var("IDEM_TABLE").unwrap_or_else(|_| "idempotency".into());
    let store = DynamoDbStore::new(
        aws_sdk_dynamodb::Client::from_conf(aws::lambda_config()),
        table,
    );
    lambda_runtime::run(service_fn(|event| handler(&store, event))).await
}

/// The handler invoked as Lambda would: the same event three times (a retry, a duplicate
/// delivery), the same order with another amount, and a declined card retried.
async fn demo() -> Result<(), lambda_runtime::Error> {
    let url = std::env::var("IDEM_DYNAMODB_URL").unwrap_or_else(|_| "http://127.0.0.1:8000".into());
    let client = aws_sdk_dynamodb::Client::from_conf(aws::emulator_config(&url));
    let store = DynamoDbStore::new(client, "idem_lambda_demo");
    store.migrate().await?;
    let run = std::process::id();
    let invoke = |order_id: String, cents: u64| {
        let event = LambdaEvent::new(ChargeRequest { order_id, cents }, Context::default());
        handler(&store, event)
    };
    let order = format!("order-{run}");
    let first = invoke(order.clone(), 4200).await?;
    let retried = invoke(order.clone(), 4200).await?;
    let delivered_again = invoke(order.clone(), 4200).await?;
    println!("first: {first:?}; a retry and a second delivery: {retried:?}, {delivered_again:?}");
    assert!(first == retried && retried == delivered_again);
    assert_eq!(
        CHARGES.load(Ordering::SeqCst),
        1,
        "one charge for three invocations"
    );

    let mismatch = invoke(order, 9900).await.unwrap_err();
    println!("the same order with another amount: {mismatch}");
    assert!(mismatch.to_string().contains("different payload"));

    let declined = format!("declined-{run}");
    assert!(invoke(declined.clone(), 0).await.is_err());
    assert!(
        invoke(declined, 0).await.is_err(),
        "a failure is not recorded"
    );
    assert_eq!(CHARGES.load(Ordering::SeqCst), 1);
    println!("a declined card is not recorded: its retry runs again");
    Ok(())
}
