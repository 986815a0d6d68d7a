//! AWS Lambda's batches of SQS, Kinesis, DynamoDB Streams and Kafka records, through
//! `aws_lambda_events` (feature `lambda`).
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
//! | final ([`Disposition::Reject`]): a poison, an id reused with another body, a transient failure on the consumer's last delivery ([`max_deliveries`](Consumer::max_deliveries)), an error its [`Classify`] calls final | not listed, an error logged with its message id | Lambda deletes it: no delivery can succeed, and it is not retried until a redrive policy takes it |
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
//! **Streams.** A Kinesis or DynamoDB Streams batch is one shard's records, in order, and
//! Lambda retries a shard from a checkpoint: [`Consumer::kinesis_batch`] and
//! [`Consumer::dynamodb_stream_batch`] handle the records one at a time, stop at the first
//! transient failure and name its sequence number, so that Lambda retries from it and
//! nothing after it runs first. A record's id is its stream's ARN and its `eventID`, the
//! same on every retry of the batch (a function that timed out, a batch retried from its
//! checkpoint); a producer that may put a record twice writes its own id in the data, read
//! with [`MessageId::json`](super::MessageId::json). A stream counts no deliveries: a
//! record that keeps failing transiently is retried until the event source mapping's
//! `MaximumRetryAttempts` or `MaximumRecordAgeInSeconds` sends it to its on-failure
//! destination. A final failure is skipped, an error logged with its sequence number.
//!
//! **Kafka.** An Amazon MSK or self-managed Kafka batch holds records of several
//! partitions. [`Consumer::kafka_batch`] runs each partition's records in order and the
//! partitions at once, stops a partition at its first transient failure and names it
//! (`{"partition": "<topic>-<partition>", "offset": …}`), so that Lambda retries that
//! partition from it. A record's id is its coordinates with the cluster's name (the
//! event's `eventSourceArn`, or its `bootstrapServers`), or a header or a member of its
//! value where the consumer's [`MessageId`](super::MessageId) says.
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
use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;

use aws_lambda_events::event::dynamodb::Event as DynamoDbEvent;
use aws_lambda_events::event::kafka::KafkaEvent;
use aws_lambda_events::event::kinesis::KinesisEvent;
use aws_lambda_events::event::sqs::{SqsBatchResponse, SqsEvent, SqsMessageAttribute};
use aws_lambda_events::event::streams::{
    DynamoDbBatchItemFailure, DynamoDbEventResponse, KinesisEventResponse,
};
use base64::Engine as _;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{Classify, Consumer, Delivery, Disposition};
use crate::{BoxError, Error, Store};

/// How many records of a standard queue's batch are handled at once.
pub const CONCURRENCY: usize = 10;

/// One record of a batch, whatever its source: a [`Delivery`] whose settlement is
/// remembered for the response.
struct Record<'a> {
    payload: Cow<'a, [u8]>,
    id: Option<Cow<'a, str>>,
    /// An SQS message's attributes, its headers.
    headers: Option<&'a HashMap<String, SqsMessageAttribute>>,
    /// A Kafka record's headers, as Lambda sends them: signed bytes.
    kafka_headers: &'a [HashMap<String, Vec<i8>>],
    deliveries: Option<u64>,
    /// What the response names it by: SQS's message id, a stream's sequence number.
    item: &'a str,
    settled: Mutex<Option<Disposition>>,
}

impl<'a> Record<'a> {
    fn new(payload: Cow<'a, [u8]>, id: Option<Cow<'a, str>>, item: &'a str) -> Self {
        Self {
            payload,
            id,
            headers: None,
            kafka_headers: &[],
            deliveries: None,
            item,
            settled: Mutex::new(None),
        }
    }

    fn settled(&self) -> Option<Disposition> {
        *self
            .settled
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether Lambda must deliver it again: requeued, or never handled (a batch stopped
    /// before it). A final failure is not: no delivery can succeed.
    fn again(&self) -> bool {
        !matches!(self.settled(), Some(Disposition::Ack | Disposition::Reject))
    }
}

#[crate::async_trait]
impl Delivery for Record<'_> {
    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn message_id(&self) -> Option<Cow<'_, str>> {
        self.id.as_deref().map(Cow::Borrowed)
    }

    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        if let Some(attribute) = self.headers.and_then(|headers| headers.get(name)) {
            return attribute.string_value.as_deref().map(Cow::Borrowed);
        }
        // Kafka allows repeats: the last one counts.
        let value = self
            .kafka_headers
            .iter()
            .rev()
            .find_map(|header| header.get(name))?;
        let bytes: Vec<u8> = value.iter().map(|byte| byte.to_ne_bytes()[0]).collect();
        String::from_utf8(bytes).ok().map(Cow::Owned)
    }

    fn deliveries(&self) -> Option<u64> {
        self.deliveries
    }

    async fn settle(&self, disposition: Disposition) -> Result<(), BoxError> {
        *self
            .settled
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(disposition);
        Ok(())
    }
}

/// A stream record's id: its stream's ARN and the record's event id, so that two streams
/// read by one consumer never share a key.
fn stream_id<'a>(arn: Option<&str>, event_id: Option<&'a str>) -> Option<Cow<'a, str>> {
    let event_id = event_id.filter(|id| !id.is_empty())?;
    Some(match arn {
        Some(arn) => Cow::Owned(format!("{arn}/{event_id}")),
        None => Cow::Borrowed(event_id),
    })
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
            .map(|message| {
                let attribute = |name: &str| message.attributes.get(name).map(String::as_str);
                let id = if fifo {
                    attribute("MessageDeduplicationId")
                } else {
                    message.message_id.as_deref()
                };
                let body = message.body.as_deref().unwrap_or_default();
                let item = message.message_id.as_deref().unwrap_or_default();
                let mut record =
                    Record::new(Cow::Borrowed(body.as_bytes()), id.map(Cow::Borrowed), item);
                record.deliveries =
                    attribute("ApproximateReceiveCount").and_then(|n| n.parse().ok());
                record.headers = Some(&message.message_attributes);
                record
            })
            .collect();
        let order = if fifo { Order::Fifo } else { Order::Concurrent };
        let mut response = SqsBatchResponse::default();
        for item in self.batch(&records, order, &handler).await {
            response.add_failure(item);
        }
        response
    }

    /// Handles a Lambda Kinesis batch (one shard's records, in order) with `handler`, which
    /// gets each record's data decoded: each record at most once per stream and event id
    /// (`eventSourceARN/eventID`, the same on every retry of the batch), or where the
    /// consumer's [`MessageId`](super::MessageId) says in the data. Handling stops at the
    /// first transient failure, whose sequence number the response names: Lambda retries
    /// the shard from it. A final failure is skipped, an error logged.
    pub async fn kinesis_batch<M, T, E, F, Fut>(
        &self,
        event: &KinesisEvent,
        handler: F,
    ) -> KinesisEventResponse
    where
        M: DeserializeOwned,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Classify,
        F: Fn(M) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let records: Vec<Record<'_>> = event
            .records
            .iter()
            .map(|record| {
                let id = stream_id(
                    record.event_source_arn.as_deref(),
                    record.event_id.as_deref(),
                );
                let data = Cow::Borrowed(record.kinesis.data.0.as_slice());
                Record::new(data, id, &record.kinesis.sequence_number)
            })
            .collect();
        let mut response = KinesisEventResponse::default();
        response.set_failures(self.batch(&records, Order::Shard, &handler).await);
        response
    }

    /// Handles a Lambda DynamoDB Streams batch (one shard's records, in order) with
    /// `handler`, which gets each whole record (`EventRecord`, or a type of yours that
    /// deserializes from its JSON): each at most once per stream and event id. Handling
    /// stops at the first transient failure, whose sequence number the response names, as
    /// [`kinesis_batch`](Self::kinesis_batch) does.
    pub async fn dynamodb_stream_batch<M, T, E, F, Fut>(
        &self,
        event: &DynamoDbEvent,
        handler: F,
    ) -> DynamoDbEventResponse
    where
        M: DeserializeOwned,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Classify,
        F: Fn(M) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let records: Vec<Record<'_>> = event
            .records
            .iter()
            .map(|record| {
                let id = stream_id(record.event_source_arn.as_deref(), Some(&record.event_id));
                let item = record.change.sequence_number.as_deref().unwrap_or_default();
                // A record that does not encode has no payload: rejected as a poison.
                let json = serde_json::to_vec(record).unwrap_or_default();
                Record::new(Cow::Owned(json), id, item)
            })
            .collect();
        let mut response = DynamoDbEventResponse::default();
        for item in self.batch(&records, Order::Shard, &handler).await {
            let mut failure = DynamoDbBatchItemFailure::default();
            failure.item_identifier = Some(item.to_owned());
            response.batch_item_failures.push(failure);
        }
        response
    }

    /// Handles a Lambda Kafka batch (Amazon MSK or self-managed Apache Kafka) with `handler`,
    /// which gets each record's value decoded. Each partition's records run in order,
    /// partitions at once; a partition stops at its first transient failure, which the
    /// response names (its partition and offset) so that Lambda retries from it. Each record
    /// is handled at most once per coordinates, which name the cluster (the event's
    /// `eventSourceArn`, or its `bootstrapServers` for a self-managed cluster):
    /// `<cluster>/<topic>/<partition>/<offset>`; or where the consumer's
    /// [`MessageId`](super::MessageId) says (a header, the value's JSON). A batch that
    /// names no cluster cannot key its records by coordinates: each is rejected unhandled,
    /// an error logged. A final failure is skipped, an error logged.
    pub async fn kafka_batch<M, T, E, F, Fut>(
        &self,
        event: &KafkaEvent,
        handler: F,
    ) -> KafkaBatchResponse
    where
        M: DeserializeOwned,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Classify,
        F: Fn(M) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let cluster = event
            .event_source_arn
            .as_deref()
            .or(event.bootstrap_servers.as_deref())
            .filter(|cluster| !cluster.is_empty());
        let partitions: Vec<_> = event.records.iter().collect();
        // What the response names a record by, within its partition.
        let offsets: Vec<Vec<String>> = partitions
            .iter()
            .map(|(_, records)| {
                records
                    .iter()
                    .map(|record| record.offset.to_string())
                    .collect()
            })
            .collect();
        let batches: Vec<Vec<Record<'_>>> = partitions
            .iter()
            .zip(&offsets)
            .map(|((_, records), offsets)| {
                records
                    .iter()
                    .zip(offsets)
                    .map(|(record, offset)| {
                        let topic = record.topic.as_deref().unwrap_or_default();
                        let id = cluster.map(|cluster| {
                            Cow::Owned(format!("{cluster}/{topic}/{}/{offset}", record.partition))
                        });
                        // A value that does not decode is no payload: rejected as a poison.
                        let value = record.value.as_deref().unwrap_or_default();
                        let payload = base64::engine::general_purpose::STANDARD
                            .decode(value)
                            .unwrap_or_default();
                        let mut delivery = Record::new(Cow::Owned(payload), id, offset);
                        delivery.kafka_headers = &record.headers;
                        delivery
                    })
                    .collect()
            })
            .collect();
        let handler = &handler;
        let failed = futures_util::future::join_all(partitions.iter().zip(&batches).map(
            |((partition, _), records)| async move {
                (*partition, self.batch(records, Order::Shard, handler).await)
            },
        ))
        .await;
        let mut response = KafkaBatchResponse::default();
        for (partition, items) in failed {
            for offset in items {
                response.batch_item_failures.push(KafkaItemFailure {
                    item_identifier: KafkaItem {
                        partition: partition.clone(),
                        offset: offset.parse().unwrap_or_default(),
                    },
                });
            }
        }
        response
    }

    /// Handles `records` with `handler` in the batch's `order`, and returns what the
    /// response names: the records Lambda must deliver again. Every final failure is
    /// logged, with its item.
    async fn batch<'r, M, T, E, F, Fut>(
        &self,
        records: &'r [Record<'r>],
        order: Order,
        handler: &F,
    ) -> Vec<&'r str>
    where
        M: DeserializeOwned,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Classify,
        F: Fn(M) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        // A `Record` settles by remembering: that never fails.
        if order == Order::Concurrent {
            futures_util::stream::iter(records)
                .for_each_concurrent(CONCURRENCY, |record| async {
                    let _ = self.handle(record, handler).await;
                })
                .await;
        } else {
            for record in records {
                let _ = self.handle(record, handler).await;
                if record.again() {
                    break;
                }
            }
        }
        for record in records {
            if record.settled() == Some(Disposition::Reject) {
                tracing::error!(
                    namespace = self.namespace(),
                    item = record.item,
                    "a record that failed for good is not retried: Lambda moves past it"
                );
            }
        }
        let mut again = records.iter().skip_while(|record| !record.again());
        match order {
            Order::Concurrent => records
                .iter()
                .filter(|record| record.again())
                .map(|record| record.item)
                .collect(),
            // The first failure and everything after it, which never ran.
            Order::Fifo => again.map(|record| record.item).collect(),
            // The checkpoint: Lambda retries the shard from it.
            Order::Shard => again.next().map(|record| record.item).into_iter().collect(),
        }
    }
}

/// A Lambda Kafka batch's partial batch response: the first failed record of each
/// partition that Lambda must deliver again.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KafkaBatchResponse {
    /// The records to deliver again, at most one a partition.
    pub batch_item_failures: Vec<KafkaItemFailure>,
}

/// A record of a [`KafkaBatchResponse`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KafkaItemFailure {
    /// Which record.
    pub item_identifier: KafkaItem,
}

/// A Kafka record as Lambda names it in a partial batch response.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KafkaItem {
    /// Its topic and partition as the event keys them: `<topic>-<partition>`.
    pub partition: String,
    /// Its offset.
    pub offset: i64,
}

/// How a batch's records are handled, and what its response names.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Order {
    /// A standard queue's: up to [`CONCURRENCY`] at once; every record to deliver again.
    Concurrent,
    /// A FIFO queue's: one at a time, stopped at the first failure; it and every later one.
    Fifo,
    /// A stream shard's: one at a time, stopped at the first failure; its sequence number.
    Shard,
}
