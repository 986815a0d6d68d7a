//! Queue consumers whose deliveries are settled right: acknowledged only once the handler's
//! result (or its transaction) is durable, requeued with a bounded backoff when a retry may
//! succeed, rejected once (dead-lettered, where the queue has a dead-letter target) when it
//! never will.
//!
//! **Redeliveries are bounded where the broker counts them**: a message that keeps failing
//! transiently is rejected after [`max_deliveries`](Consumer::max_deliveries) (default 10)
//! on a RabbitMQ quorum queue (`x-delivery-count`) and on JetStream. Two cases are not:
//!
//! - **A RabbitMQ classic queue counts no deliveries**: a message that fails transiently
//!   there is requeued after the first backoff (1 s) each time, for as long as it fails.
//!   Use a quorum queue (`x-queue-type: quorum`), or a handler error that
//!   [`Classify`]s as [`Reject`](Disposition::Reject) once it knows better.
//! - **A JetStream consumer whose `max_deliver` is below `max_deliveries`** stops
//!   redelivering on its own, before the consumer rejects: the message is dropped, with no
//!   `+TERM` and no advisory of a termination (only `MAX_DELIVERIES`). Set `max_deliver`
//!   above `max_deliveries`, or unlimited (`-1`).
//!
//! Brokers deliver at least once: a consumer that dies between its effect and its ack gets
//! the message again, and so does another consumer. The message's id keys the handler, so
//! the redelivery replays instead of running twice.
//!
//! ```no_run
//! # #[cfg(feature = "lapin")]
//! # async fn consume(channel: lapin::Channel) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use futures_util::StreamExt;
//! use idem_runtime::consumer::Consumer;
//! use idem_runtime::MemoryStore;
//! # #[derive(serde::Deserialize)] struct Order { id: u64 }
//! # async fn ship(order: Order) -> Result<u64, idem_runtime::Error> { Ok(order.id) }
//!
//! let consumer = Consumer::new("shop.orders.v1").store(MemoryStore::new());
//! let mut deliveries = channel
//!     .basic_consume("orders".into(), "shipper".into(), Default::default(), Default::default())
//!     .await?;
//! while let Some(delivery) = deliveries.next().await {
//!     consumer.handle(&delivery?, |order: Order| ship(order)).await?;
//! }
//! # Ok(()) }
//! ```
//!
//! What each outcome does to the delivery ([`Disposition::of`]):
//!
//! | outcome | disposition | why |
//! |---|---|---|
//! | `Ok`, executed or replayed | [`Ack`](Disposition::Ack) | the result is recorded (or committed) before the ack |
//! | `Err(Error::Store)`, `Err(Error::InProgress)` | [`Requeue`](Disposition::Requeue), after a backoff that doubles with each delivery | transient: another delivery may succeed |
//! | the same past [`max_deliveries`](Consumer::max_deliveries) (default 10), where the broker counts deliveries | [`Reject`](Disposition::Reject) | bounded: a message that cannot succeed does not circle forever |
//! | `Err(Error::PayloadMismatch)`, `Codec`, `Gone`, `Key`, `Config` | [`Reject`](Disposition::Reject) | final: no redelivery can succeed |
//! | a payload that does not decode, a message without an id | [`Reject`](Disposition::Reject), before anything is claimed | poison: the handler never sees it |
//! | `Err(Error::Unrecorded)` | [`Ack`](Disposition::Ack) | the body ran: a redelivery could run it again once the claim lapses |
//! | the handler's own error | what its [`Classify`] says | |
//!
//! A rejected AMQP message goes to the queue's dead-letter exchange if it has one, and is
//! dropped otherwise; a rejected JetStream message is terminated (`AckKind::Term`, an
//! advisory on `$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED`). JetStream requeues natively
//! after the delay (`AckKind::Nak(Some(after))`); AMQP has no delayed requeue, so the
//! consumer waits the delay while it holds the message, then requeues it.
//!
//! Two ways to claim: [`Consumer::handle`] claims the message's key in the consumer's
//! store around the handler; [`Consumer::inbox`] hands the handler the key value and lets it
//! claim inside its own SQL transaction (`#[idempotent(key = id, transaction = tx)]`), so that
//! the claim, the effect and the record commit together: the inbox pattern, which a SIGKILL
//! anywhere cannot break. With `handle`, a consumer killed after its effect but before the
//! record runs the effect again on the redelivery once the claim's lease lapses, as any
//! store outside the effect's own database would: see the
//! [queues guide](crate::guide::queues).
//!
//! Brokers are behind features named for them: `lapin` (RabbitMQ and any AMQP 0.9.1
//! broker), `nats` (NATS JetStream), `sqs` (Amazon SQS, in `consumer::sqs`), `rdkafka`
//! (Apache Kafka, in `consumer::kafka`) and `lambda` (a Lambda function's SQS, Kinesis and
//! DynamoDB Streams batches, in `consumer::lambda`).
//! Another broker is a [`Delivery`] implementation: a payload, an id, a delivery count if it
//! has one, the three settlements, and a lease if the broker's hold on a delivery lapses
//! unless renewed.

#[cfg(feature = "rdkafka")]
pub mod kafka;
#[cfg(feature = "lambda")]
pub mod lambda;
#[cfg(feature = "lapin")]
mod lapin;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "sqs")]
pub mod sqs;

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::{BoxError, Error, Fingerprint, IdempotencyKey, Operation, Outcome, Store, RETRY_AFTER};

/// What to do with a delivery once its handler is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disposition {
    /// Done: acknowledge it, so it is never delivered again.
    Ack,
    /// A retry may succeed: deliver it again after `after`.
    Requeue {
        /// How long to wait before it is delivered again.
        after: Duration,
    },
    /// No retry can succeed: reject it without requeueing, so that it goes to the
    /// dead-letter target if there is one, once.
    Reject,
}

impl Disposition {
    /// The disposition of a handler's result: `Ok` acks, a transient error
    /// ([`Error::is_transient`]) requeues after [`RETRY_AFTER`], a final one rejects, and
    /// [`Error::Unrecorded`] (the body ran) acks.
    ///
    /// ```
    /// use idem_runtime::consumer::Disposition;
    /// use idem_runtime::Error;
    ///
    /// assert_eq!(Disposition::of(&Ok::<_, Error>(7)), Disposition::Ack);
    /// assert_eq!(Disposition::of(&Err::<u8, _>(Error::PayloadMismatch)), Disposition::Reject);
    /// assert!(matches!(
    ///     Disposition::of(&Err::<u8, _>(Error::store("connection refused"))),
    ///     Disposition::Requeue { .. }
    /// ));
    /// ```
    pub fn of<T>(result: &Result<T, Error>) -> Self {
        match result {
            Ok(_) => Self::Ack,
            // Without a consumer's backoff, the delay every transient error may be retried
            // after.
            Err(err) => match err.disposition() {
                Self::Requeue { after } => Self::Requeue {
                    after: after.max(RETRY_AFTER),
                },
                other => other,
            },
        }
    }
}

/// What a handler's error asks of its delivery: implemented by [`Error`], and by a
/// handler's own error type so that its policy says which of its errors are final.
///
/// ```
/// use idem_runtime::consumer::{Classify, Disposition};
///
/// enum ShipError { Idem(idem_runtime::Error), OutOfStock, CarrierDown }
///
/// impl Classify for ShipError {
///     fn disposition(&self) -> Disposition {
///         match self {
///             Self::Idem(err) => err.disposition(),
///             Self::OutOfStock => Disposition::Reject, // final: dead-letter it
///             Self::CarrierDown => Disposition::requeue(),
///         }
///     }
/// }
/// ```
pub trait Classify {
    /// The delivery's disposition after this error. A [`Disposition::Requeue`]'s delay is
    /// the least the error asks for: a [`Consumer`] waits its backoff (doubling with each
    /// delivery the broker counts) or this, whichever is longer.
    fn disposition(&self) -> Disposition;
}

impl Classify for Error {
    fn disposition(&self) -> Disposition {
        match self {
            // The body ran: its effect happened, and a redelivery could repeat it.
            Error::Unrecorded(_) => Disposition::Ack,
            err if err.is_transient() => Disposition::requeue(),
            _ => Disposition::Reject,
        }
    }
}

impl Disposition {
    /// A requeue after the consumer's backoff, with no delay of the error's own.
    pub const fn requeue() -> Self {
        Self::Requeue {
            after: Duration::ZERO,
        }
    }
}

/// A message as a broker delivered it: what a consumer needs to key, decode and settle it.
/// Implemented for `lapin`'s deliveries (feature `lapin`), JetStream's messages (feature
/// `nats`), SQS's (`sqs::SqsMessage`, feature `sqs`) and Kafka's (`kafka::KafkaRecord`,
/// feature `rdkafka`); a few lines for any other broker.
#[crate::async_trait]
pub trait Delivery: Send + Sync {
    /// The message's bytes.
    fn payload(&self) -> &[u8];

    /// The message's id by the broker's convention (AMQP's `message-id` property,
    /// JetStream's `Nats-Msg-Id` header), if it has one.
    fn message_id(&self) -> Option<Cow<'_, str>>;

    /// The value of the header `name`, if the message has it as text.
    fn header(&self, name: &str) -> Option<Cow<'_, str>>;

    /// How many times this message has been delivered, this delivery included (1 for the
    /// first), if the broker counts; `None` if it does not (an AMQP classic queue).
    fn deliveries(&self) -> Option<u64>;

    /// Settles the delivery as `disposition` says.
    async fn settle(&self, disposition: Disposition) -> Result<(), BoxError>;

    /// How long the broker keeps this delivery from every other consumer, if that is a
    /// lease the consumer must renew while it works (SQS's visibility timeout); `None` (the
    /// default) where the broker holds an unsettled delivery for as long as the consumer's
    /// connection lives (AMQP) or the consumer settles it in time (JetStream's `ack_wait`).
    ///
    /// A [`Consumer`] renews such a lease ([`renew`](Self::renew)) every third of it while
    /// its handler runs, so that a handler slower than the lease keeps its delivery, and a
    /// consumer that dies lets it go when the lease lapses.
    fn lease(&self) -> Option<Duration> {
        None
    }

    /// Renews the delivery's [`lease`](Self::lease) for as long again, from now.
    async fn renew(&self) -> Result<(), BoxError> {
        Ok(())
    }
}

/// A lease's renewal under way.
type Renewal<'a> = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send + 'a>>;

/// Runs `work` while renewing `delivery`'s lease, if it has one, every third of it. A renewal
/// that fails is logged and tried again at the next tick: the message may come back to
/// another consumer, whose claim then waits for or replays this one's.
async fn renewing<D, F>(delivery: &D, work: F) -> F::Output
where
    D: Delivery + ?Sized,
    F: Future,
{
    let Some(lease) = delivery.lease() else {
        return work.await;
    };
    let every = (lease / 3).max(Duration::from_millis(10));
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut work = std::pin::pin!(work);
    let mut renewal: Option<Renewal<'_>> = None;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(output) = work.as_mut().poll(cx) {
            return Poll::Ready(output);
        }
        loop {
            if let Some(pending) = renewal.as_mut() {
                let Poll::Ready(renewed) = pending.as_mut().poll(cx) else {
                    return Poll::Pending;
                };
                renewal = None;
                if let Err(err) = renewed {
                    tracing::warn!(error = %err, "a delivery's lease could not be renewed");
                }
            }
            if ticks.poll_tick(cx).is_pending() {
                return Poll::Pending;
            }
            renewal = Some(delivery.renew());
        }
    })
    .await
}

/// Where a message carries the id that keys its handler.
#[derive(Clone, Debug, Default)]
pub struct MessageId {
    source: IdSource,
}

#[derive(Clone, Debug, Default)]
enum IdSource {
    #[default]
    Broker,
    Header(Arc<str>),
    Json(Arc<str>),
}

impl MessageId {
    /// The broker's own convention (the default): AMQP's `message-id` property, JetStream's
    /// `Nats-Msg-Id` header (which JetStream also deduplicates publishes by).
    pub fn broker() -> Self {
        Self::default()
    }

    /// The header `name`.
    pub fn header(name: impl Into<Arc<str>>) -> Self {
        Self {
            source: IdSource::Header(name.into()),
        }
    }

    /// The member of the JSON payload at `pointer` (RFC 6901: `"/id"`), a string or an
    /// integer. The integer `1` and the string `"1"` are one id: a producer that writes
    /// both for two messages has them deduplicated as one (their payloads then differ, so
    /// the second is refused as [`Error::PayloadMismatch`], never replayed the first's
    /// result).
    pub fn json(pointer: impl Into<Arc<str>>) -> Self {
        Self {
            source: IdSource::Json(pointer.into()),
        }
    }

    /// The id of `delivery`, if it carries one.
    fn of<D: Delivery + ?Sized>(&self, delivery: &D) -> Option<String> {
        let id = match &self.source {
            IdSource::Broker => delivery.message_id().map(Cow::into_owned),
            IdSource::Header(name) => delivery.header(name).map(Cow::into_owned),
            IdSource::Json(pointer) => {
                let document: serde_json::Value =
                    serde_json::from_slice(delivery.payload()).ok()?;
                match document.pointer(pointer)? {
                    serde_json::Value::String(id) => Some(id.clone()),
                    serde_json::Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string()),
                    _ => None,
                }
            }
        };
        id.filter(|id| !id.is_empty())
    }
}

/// A consumer's policies: the operation its messages are keyed in, where their ids are, and
/// how deliveries that may succeed later are requeued. With a [`store`](Self::store) it
/// claims each message around its handler ([`handle`](Self::handle)); without one, the
/// handler claims in its own transaction ([`inbox`](Self::inbox)).
#[derive(Clone, Debug)]
#[must_use]
pub struct Consumer<St = ()> {
    store: St,
    operation: Operation,
    id: MessageId,
    first_backoff: Duration,
    max_backoff: Duration,
    max_deliveries: u64,
}

impl Consumer<()> {
    /// A consumer of the operation `namespace` (a stable name such as `"shop.orders.v1"`):
    /// records kept 7 days, the broker's message id, a backoff from 1 s doubling to 60 s,
    /// at most 10 deliveries of a message that keeps failing transiently.
    pub fn new(namespace: impl Into<Cow<'static, str>>) -> Self {
        Self {
            store: (),
            operation: Operation::new(namespace).ttl(Duration::from_secs(7 * 24 * 3600)),
            id: MessageId::default(),
            first_backoff: RETRY_AFTER,
            max_backoff: Duration::from_secs(60),
            max_deliveries: 10,
        }
    }
}

impl<St> Consumer<St> {
    /// Claims each message in `store`, around its handler: [`handle`](Self::handle).
    pub fn store<S: Store + Clone>(self, store: S) -> Consumer<S> {
        Consumer {
            store,
            operation: self.operation,
            id: self.id,
            first_backoff: self.first_backoff,
            max_backoff: self.max_backoff,
            max_deliveries: self.max_deliveries,
        }
    }

    /// How long a handled message's result is kept (default 7 days): longer than the
    /// broker may deliver it again (a JetStream stream's `max_age`, an AMQP queue's
    /// message TTL, a dead-letter queue replayed by hand).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.operation = self.operation.ttl(ttl);
        self
    }

    /// How long a claim lives without renewal (default [`DEFAULT_LEASE`](crate::DEFAULT_LEASE)).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.operation = self.operation.lease(lease);
        self
    }

    /// Where messages carry their id (default [`MessageId::broker`]).
    pub fn message_id(mut self, id: MessageId) -> Self {
        self.id = id;
        self
    }

    /// The requeue delay after the first delivery (default 1 s), doubling with each
    /// delivery the broker counts, up to `max`.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.first_backoff = first;
        self.max_backoff = max.max(first);
        self
    }

    /// How many deliveries a message that keeps failing transiently gets before it is
    /// rejected (default 10), where the broker counts deliveries (JetStream, AMQP quorum
    /// queues' `x-delivery-count`).
    pub fn max_deliveries(mut self, deliveries: u64) -> Self {
        self.max_deliveries = deliveries.max(1);
        self
    }

    /// The operation messages are keyed in.
    pub fn namespace(&self) -> &str {
        self.operation.namespace()
    }

    /// Handles `delivery` with `handler`, which claims the message's id itself, in its own
    /// transaction (the inbox pattern): `handler` gets the decoded payload and the id as an
    /// [`IdempotencyKey`] (the name the key has on every surface that claims in the
    /// handler's transaction: an HTTP endpoint's, a webhook receiver's), and returns once
    /// its transaction committed. The delivery is then settled as the result says, and the
    /// disposition returned.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn consume(delivery: &dyn idem_runtime::consumer::Delivery, store: &idem_runtime::PostgresStore) -> Result<(), idem_runtime::BoxError> {
    /// use idem_runtime::consumer::Consumer;
    /// use idem_runtime::{idempotent, Error, IdempotencyKey, PostgresStore};
    /// # #[derive(serde::Deserialize)] struct Order { id: u64 }
    ///
    /// #[idempotent(key = key, store = store, transaction = tx, ignore = order, namespace = "shop.ship.v1")]
    /// async fn ship(key: &IdempotencyKey, order: &Order, store: &PostgresStore, tx: &mut sqlx::PgConnection) -> Result<u64, Error> {
    ///     Ok(order.id) // the shipment's row, through `tx`
    /// }
    ///
    /// let consumer = Consumer::new("shop.orders.v1");
    /// consumer
    ///     .inbox(delivery, |order: Order, key: IdempotencyKey| async move {
    ///         let mut tx = store.pool().begin().await.map_err(Error::store)?;
    ///         ship(&key, &order, store, &mut tx).await?;
    ///         tx.commit().await.map_err(Error::store)
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// The broker's, when the delivery could not be settled (its connection is gone: the
    /// broker redelivers it).
    pub async fn inbox<D, M, T, E, F, Fut>(
        &self,
        delivery: &D,
        handler: F,
    ) -> Result<Disposition, BoxError>
    where
        D: Delivery + ?Sized,
        M: DeserializeOwned,
        E: Classify,
        F: FnOnce(M, IdempotencyKey) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let (id, message) = match self.admit(delivery) {
            Ok(admitted) => admitted,
            Err(disposition) => return self.settle(delivery, disposition, None).await,
        };
        // The handler's claims are labelled with the message's id, for an operator.
        let handled = crate::labelled(
            id.clone(),
            renewing(delivery, handler(message, IdempotencyKey::new(id.clone()))),
        );
        let disposition = match handled.await {
            Ok(_) => Disposition::Ack,
            Err(err) => err.disposition(),
        };
        self.settle(delivery, disposition, Some(&id)).await
    }

    /// The id and decoded payload of `delivery`, or why it is rejected unhandled.
    fn admit<D, M>(&self, delivery: &D) -> Result<(String, M), Disposition>
    where
        D: Delivery + ?Sized,
        M: DeserializeOwned,
    {
        let Some(id) = self.id.of(delivery) else {
            tracing::error!(
                namespace = self.namespace(),
                "a message without an id cannot be told from its redeliveries: rejected unhandled"
            );
            return Err(Disposition::Reject);
        };
        match serde_json::from_slice(delivery.payload()) {
            Ok(message) => Ok((id, message)),
            Err(err) => {
                tracing::error!(namespace = self.namespace(), error = %err, "a payload that does not decode: rejected unhandled");
                Err(Disposition::Reject)
            }
        }
    }

    /// Settles `delivery` (of message `id`, once it has one): a requeue's delay scaled by
    /// the deliveries so far, and a requeue past the last delivery turned into a reject.
    /// Every reject is logged with the message's id (ids are not personal data): an
    /// operator finds the message, and its claim by the label it carries.
    async fn settle<D: Delivery + ?Sized>(
        &self,
        delivery: &D,
        disposition: Disposition,
        id: Option<&str>,
    ) -> Result<Disposition, BoxError> {
        let disposition = match disposition {
            Disposition::Requeue { after } => {
                let deliveries = delivery.deliveries();
                if deliveries.is_some_and(|n| n >= self.max_deliveries) {
                    tracing::error!(
                        namespace = self.namespace(),
                        message_id = id,
                        deliveries,
                        "a message failed transiently on its last delivery: rejected"
                    );
                    Disposition::Reject
                } else {
                    Disposition::Requeue {
                        after: self.backoff_after(after, deliveries.unwrap_or(1)),
                    }
                }
            }
            Disposition::Reject if id.is_some() => {
                tracing::warn!(
                    namespace = self.namespace(),
                    message_id = id,
                    "a message whose handling failed for good (its id reused with another payload, or an error its handler classed final): rejected"
                );
                Disposition::Reject
            }
            other => other,
        };
        delivery.settle(disposition).await?;
        Ok(disposition)
    }

    /// The delay before the next delivery after the `deliveries`th failed: the first backoff
    /// doubled for each earlier delivery, at most the max; or what the error asked for, if
    /// that is longer.
    fn backoff_after(&self, asked: Duration, deliveries: u64) -> Duration {
        let doublings = u32::try_from(deliveries.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .min(20);
        let scheduled = self
            .first_backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff);
        scheduled.max(asked)
    }
}

impl<St: Store + Clone> Consumer<St> {
    /// Handles `delivery` with `handler` at most once per message id: the payload is decoded
    /// (a payload that does not decode is rejected before anything is claimed), the id is
    /// claimed in the consumer's store, `handler` runs (or its recorded result is replayed,
    /// for a redelivery), and only once its result is recorded is the delivery acknowledged.
    /// The payload is the fingerprint: an id reused with another payload is
    /// [`Error::PayloadMismatch`], rejected. Returns the disposition the delivery was settled
    /// with.
    ///
    /// # Errors
    ///
    /// The broker's, when the delivery could not be settled (its connection is gone: the
    /// broker redelivers it, and the redelivery replays).
    pub async fn handle<D, M, T, E, F, Fut>(
        &self,
        delivery: &D,
        handler: F,
    ) -> Result<Disposition, BoxError>
    where
        D: Delivery + ?Sized,
        M: DeserializeOwned,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Classify,
        F: FnOnce(M) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let (id, message) = match self.admit(delivery) {
            Ok(admitted) => admitted,
            Err(disposition) => return self.settle(delivery, disposition, None).await,
        };
        let keyed = self.operation.key(&id).and_then(|key| {
            let digest: [u8; 32] = Sha256::digest(delivery.payload()).into();
            Ok((key, Fingerprint::of(&digest)?))
        });
        let disposition = match keyed {
            Ok((key, fingerprint)) => {
                // Labelled with the message's id, for an operator.
                let run =
                    self.operation
                        .run(&self.store, &key, Some(&fingerprint), handler(message));
                let result = crate::labelled(id.clone(), renewing(delivery, run)).await;
                match result {
                    Ok(Outcome::Executed(_) | Outcome::Replayed(_)) => Disposition::Ack,
                    Err(err) => err.disposition(),
                }
            }
            Err(err) => err.disposition(),
        };
        self.settle(delivery, disposition, Some(&id)).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// A delivery of no broker: what a third-party implementation looks like.
    struct Fake {
        payload: &'static [u8],
        id: Option<&'static str>,
        headers: Vec<(&'static str, &'static str)>,
        settled: Mutex<Vec<Disposition>>,
    }

    impl Fake {
        fn new(payload: &'static [u8], id: Option<&'static str>) -> Self {
            Self {
                payload,
                id,
                headers: vec![("x-order-id", "o-7")],
                settled: Mutex::default(),
            }
        }
    }

    #[crate::async_trait]
    impl Delivery for Fake {
        fn payload(&self) -> &[u8] {
            self.payload
        }
        fn message_id(&self) -> Option<Cow<'_, str>> {
            self.id.map(Cow::Borrowed)
        }
        fn header(&self, name: &str) -> Option<Cow<'_, str>> {
            let found = self.headers.iter().find(|(n, _)| *n == name);
            found.map(|(_, v)| Cow::Borrowed(*v))
        }
        fn deliveries(&self) -> Option<u64> {
            None
        }
        async fn settle(&self, disposition: Disposition) -> Result<(), BoxError> {
            self.settled.lock().unwrap().push(disposition);
            Ok(())
        }
    }

    #[test]
    fn an_id_is_found_where_its_source_says() {
        let fake = Fake::new(br#"{"order":{"id":42},"name":"x"}"#, Some("m-1"));
        assert_eq!(MessageId::broker().of(&fake).as_deref(), Some("m-1"));
        assert_eq!(
            MessageId::header("x-order-id").of(&fake).as_deref(),
            Some("o-7")
        );
        assert_eq!(MessageId::header("x-none").of(&fake), None);
        assert_eq!(
            MessageId::json("/order/id").of(&fake).as_deref(),
            Some("42")
        );
        assert_eq!(MessageId::json("/name").of(&fake).as_deref(), Some("x"));
        assert_eq!(
            MessageId::json("/order").of(&fake),
            None,
            "an object is no id"
        );
        assert_eq!(
            MessageId::broker().of(&Fake::new(b"{}", Some(""))),
            None,
            "empty"
        );
    }

    #[cfg(feature = "memory")]
    #[tokio::test]
    async fn a_delivery_of_any_broker_is_handled_once_and_settled() {
        let consumer = Consumer::new("consumer.unit").store(crate::MemoryStore::new());
        let runs = std::sync::atomic::AtomicU32::new(0);
        // Counted when the body runs, not when its future is made.
        let handler = |n: u32| {
            let runs = &runs;
            async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, Error>(n * 2)
            }
        };
        let first = Fake::new(b"21", Some("m-1"));
        let again = Fake::new(b"21", Some("m-1"));
        let reused = Fake::new(b"22", Some("m-1"));
        let poison = Fake::new(b"not json", Some("m-2"));
        let anonymous = Fake::new(b"5", None);
        for delivery in [&first, &again, &reused, &poison, &anonymous] {
            consumer.handle(delivery, handler).await.unwrap();
        }
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
        let settled = |fake: &Fake| fake.settled.lock().unwrap().clone();
        assert_eq!(settled(&first), [Disposition::Ack]);
        assert_eq!(settled(&again), [Disposition::Ack]);
        assert_eq!(settled(&reused), [Disposition::Reject]);
        assert_eq!(settled(&poison), [Disposition::Reject]);
        assert_eq!(settled(&anonymous), [Disposition::Reject]);
    }

    #[test]
    fn every_error_has_its_disposition() {
        assert_eq!(Error::InProgress.disposition(), Disposition::requeue());
        assert_eq!(Error::store("down").disposition(), Disposition::requeue());
        for err in [
            Error::PayloadMismatch,
            Error::Gone,
            Error::codec("x"),
            Error::Key("nan".into()),
            Error::config("x"),
        ] {
            assert_eq!(err.disposition(), Disposition::Reject, "{err}");
        }
        assert_eq!(
            Error::Unrecorded("x".into()).disposition(),
            Disposition::Ack
        );
    }

    #[test]
    fn the_backoff_doubles_per_delivery_up_to_its_max() {
        let consumer = Consumer::new("t").backoff(Duration::from_secs(1), Duration::from_secs(10));
        let after = |n| consumer.backoff_after(Duration::ZERO, n);
        assert_eq!(after(1), Duration::from_secs(1));
        assert_eq!(after(2), Duration::from_secs(2));
        assert_eq!(after(4), Duration::from_secs(8));
        assert_eq!(after(5), Duration::from_secs(10));
        assert_eq!(after(u64::MAX), Duration::from_secs(10));
        // An error that asks for longer than the step gets it.
        assert_eq!(
            consumer.backoff_after(Duration::from_secs(3), 1),
            Duration::from_secs(3)
        );
        assert_eq!(
            consumer.backoff_after(Duration::from_secs(3), 3),
            Duration::from_secs(4)
        );
    }
}
