//! AWS Lambda's SQS batches, through `aws_lambda_events` (feature `lambda`).
//!
//! Lambda reads an SQS queue for a function and invokes it with a batch of messages; the
//! function answers which of them failed (a partial batch response: the event source
//! mapping's `FunctionResponseTypes` must include `ReportBatchItemFailures`), Lambda
//! deletes the rest and the failed ones come back when their visibility lapses.
//! [`Consumer::sqs_batch`] is that loop: each record is handled at most once per message
//! id, in the consumer's store, as [`Consumer::handle`] does with one delivery.
//!
//! | a record's outcome | in the response | so |
//! |---|---|---|
//! | `Ok`, executed or replayed (a duplicate, within the batch or across batches) | not listed | Lambda deletes it |
//! | transient ([`Disposition::Requeue`]) | in `batchItemFailures` | it comes back after the queue's visibility timeout |
//! | final ([`Disposition::Reject`]): a poison, an id reused with another body, a transient failure on the consumer's last delivery ([`max_deliveries`](Consumer::max_deliveries)), an error its [`Classify`](super::Classify) calls final | not listed, an error logged with its message id | Lambda deletes it: no delivery can succeed, and it is not retried until a redrive policy takes it |
//!
//! Lambda has no reject: a record that is never listed goes nowhere. A function whose
//! final failures must be kept sends them on itself (its handler's own error, before it
//! returns it), or classes them transient so that the queue's redrive policy dead-letters
//! them after its `maxReceiveCount`.
//!
//! On a FIFO queue (`.fifo`) the records are handled one at a time, in order, and the
//! first that is not acknowledged stops the batch: it and every record after it are
//! listed, as Lambda requires, so that none overtakes it. On a standard queue up to
//! [`CONCURRENCY`] records are handled at once.
//!
//! The message id is SQS's `MessageId` (a FIFO queue's `MessageDeduplicationId`), or where
//! the consumer's [`MessageId`](super::MessageId) says: a message attribute is a header.
//!
//! ```no_run
//! # #[cfg(feature = "dynamodb")]
//! # async fn function(store: idem_runtime::DynamoDbStore, event: aws_lambda_events::event::sqs::SqsEvent) {
//! use idem_runtime::consumer::Consumer;
//! # #[derive(serde::Deserialize)] struct Order { id: u64 }
//! # async fn ship(order: Order) -> Result<u64, idem_runtime::Error> { Ok(order.id) }
//!
//! let consumer = Consumer::new("shop.orders.v1").store(store);
//! // In `lambda_runtime::service_fn(|event: LambdaEvent<SqsEvent>| …)`:
//! let response = consumer.sqs_batch(&event, ship).await;
//! # }
//! ```

use std::borrow::Cow;
use std::future::Future;
use std::sync::Mutex;

use aws_lambda_events::event::sqs::{SqsBatchResponse, SqsEvent, SqsMessage};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{Classify, Consumer, Delivery, Disposition};
use crate::{BoxError, Error, Store};

/// How many records of a standard queue's batch are handled at once.
pub const CONCURRENCY: usize = 10;

/// One record of a batch: a [`Delivery`] whose settlement is remembered for the response.
struct Record<'a> {
    message: &'a SqsMessage,
    fifo: bool,
    settled: Mutex<Option<Disposition>>,
}

impl Record<'_> {
    fn settled(&self) -> Option<Disposition> {
        *self
            .settled
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn attribute(&self, name: &str) -> Option<&str> {
        self.message.attributes.get(name).map(String::as_str)
    }
}

#[crate::async_trait]
impl Delivery for Record<'_> {
    fn payload(&self) -> &[u8] {
        self.message.body.as_deref().unwrap_or_default().as_bytes()
    }

    fn message_id(&self) -> Option<Cow<'_, str>> {
        let id = if self.fifo {
            self.attribute("MessageDeduplicationId")
        } else {
            self.message.message_id.as_deref()
        };
        id.map(Cow::Borrowed)
    }

    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        let attribute = self.message.message_attributes.get(name)?;
        attribute.string_value.as_deref().map(Cow::Borrowed)
    }

    fn deliveries(&self) -> Option<u64> {
        self.attribute("ApproximateReceiveCount")?.parse().ok()
    }

    async fn settle(&self, disposition: Disposition) -> Result<(), BoxError> {
        *self
            .settled
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(disposition);
        Ok(())
    }
}

impl<St: Store + Clone> Consumer<St> {
    /// Handles a Lambda SQS batch with `handler`, each record at most once per message id
    /// (the module's table), and returns the partial batch response that lists the records
    /// Lambda must deliver again.
    pub async fn sqs_batch<M, T, E, F, Fut>(&self, event: &SqsEvent, handler: F) -> SqsBatchResponse
    where
        M: DeserializeOwned,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Classify,
        F: Fn(M) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let fifo = event.records.iter().any(|message| {
            message
                .event_source_arn
                .as_deref()
                .is_some_and(|arn| arn.ends_with(".fifo"))
        });
        let records: Vec<Record<'_>> = event
            .records
            .iter()
            .map(|message| Record {
                message,
                fifo,
                settled: Mutex::new(None),
            })
            .collect();
        if fifo {
            for record in &records {
                // A `Record` settles by remembering: that never fails.
                let _ = self.handle(record, &handler).await;
                if matches!(record.settled(), Some(Disposition::Requeue { .. })) {
                    break;
                }
            }
        } else {
            futures_util::stream::iter(&records)
                .for_each_concurrent(CONCURRENCY, |record| async {
                    let _ = self.handle(record, &handler).await;
                })
                .await;
        }

        let mut response = SqsBatchResponse::default();
        // On a FIFO queue, the first failure stops the batch: it and everything after it.
        let mut stopped = false;
        for record in &records {
            let settled = record.settled();
            let listed = !matches!(settled, Some(Disposition::Ack | Disposition::Reject));
            stopped |= fifo && listed;
            if listed || stopped {
                response.add_failure(record.message.message_id.clone().unwrap_or_default());
            } else if settled == Some(Disposition::Reject) {
                tracing::error!(
                    namespace = self.namespace(),
                    message_id = record.message.message_id.as_deref(),
                    "a record that failed for good is not retried: Lambda deletes it"
                );
            }
        }
        response
    }
}
