//! Amazon SQS, through `aws-sdk-sqs` (feature `sqs`).
//!
//! SQS has no acknowledgement: a received message is hidden from every other consumer for
//! the queue's visibility timeout, and comes back when it lapses unless it was deleted. So
//! a [`SqsQueue`]'s messages are settled as:
//!
//! | disposition | SQS |
//! |---|---|
//! | [`Ack`](Disposition::Ack) | `DeleteMessage`, once the result is recorded |
//! | [`Requeue`](Disposition::Requeue) | `ChangeMessageVisibility` to the backoff: the message comes back after it |
//! | [`Reject`](Disposition::Reject) | sent to the queue's redrive target (its `RedrivePolicy`'s `deadLetterTargetArn`), then deleted; deleted alone, with an error logged, when the queue has no redrive policy |
//!
//! While a handler runs, the consumer renews the message's visibility every third of the
//! timeout ([`Delivery::lease`]): a handler slower than the timeout keeps its message, and
//! a consumer that dies lets it go a timeout later, to a consumer whose claim replays or
//! waits. `ApproximateReceiveCount` is the delivery count that bounds redeliveries
//! ([`Consumer::max_deliveries`](super::Consumer::max_deliveries)).
//!
//! **The message id.** On a FIFO queue it is the message's `MessageDeduplicationId` (the
//! producer's, which SQS deduplicates sends by for five minutes; idem for as long as the
//! consumer's TTL). On a standard queue it is SQS's `MessageId`, which is new on every send:
//! it keys SQS's own redeliveries, not a producer's retried send. A producer that may send
//! twice puts its own id in a message attribute and the consumer reads it with
//! [`MessageId::header`](super::MessageId::header) (attributes are headers), or in the body
//! with [`MessageId::json`](super::MessageId::json).
//!
//! **FIFO order.** SQS delivers a message group's next message only once the one before
//! it is deleted; a batch may hold several messages of a group. [`SqsQueue::receive`]
//! returns them in order: handle them in order, one group at a time, and once one is not
//! acknowledged, [`release`](SqsMessage::release) the rest of its group unhandled, so that
//! none overtakes it. [`SqsQueue::in_order`] does that.
//!
//! ```no_run
//! # async fn consume(client: aws_sdk_sqs::Client, url: String) -> Result<(), idem_runtime::BoxError> {
//! use std::time::Duration;
//! use idem_runtime::consumer::{sqs::SqsQueue, Consumer};
//! use idem_runtime::MemoryStore;
//! # #[derive(serde::Deserialize)] struct Order { id: u64 }
//! # async fn ship(order: Order) -> Result<u64, idem_runtime::Error> { Ok(order.id) }
//!
//! let consumer = &Consumer::new("shop.orders.v1").store(MemoryStore::new());
//! let queue = SqsQueue::connect(client, url).await?;
//! loop {
//!     let batch = queue.receive(10, Duration::from_secs(20)).await?;
//!     queue.in_order(batch, |message| async move { consumer.handle(&message, ship).await }).await?;
//! }
//! # }
//! ```

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};
use aws_sdk_sqs::Client;

use super::{Delivery, Disposition};
use crate::BoxError;

/// The longest visibility timeout SQS takes: 12 hours.
const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 3600);

/// An SQS queue, read once for what settling its messages needs: whether it is FIFO, its
/// visibility timeout and its redrive target. Cheap to clone.
#[derive(Clone, Debug)]
pub struct SqsQueue {
    inner: Arc<Queue>,
}

#[derive(Debug)]
struct Queue {
    client: Client,
    url: String,
    fifo: bool,
    visibility: Duration,
    /// The URL of the redrive policy's dead-letter queue, and whether it is FIFO.
    dead_letter: Option<(String, bool)>,
}

impl SqsQueue {
    /// The queue at `url`, its attributes read with `client` (`sqs:GetQueueAttributes`; the
    /// dead-letter queue's URL with `sqs:GetQueueUrl`).
    ///
    /// # Errors
    ///
    /// SQS's, or a redrive policy that does not parse.
    pub async fn connect(client: Client, url: impl Into<String>) -> Result<Self, BoxError> {
        let url = url.into();
        let attributes = client
            .get_queue_attributes()
            .queue_url(&url)
            .attribute_names(QueueAttributeName::All)
            .send()
            .await?;
        let attribute = |name: QueueAttributeName| {
            attributes
                .attributes()
                .and_then(|all| all.get(&name))
                .map(String::as_str)
        };
        let fifo = attribute(QueueAttributeName::FifoQueue) == Some("true");
        let visibility = attribute(QueueAttributeName::VisibilityTimeout)
            .and_then(|seconds| seconds.parse().ok())
            .map_or(Duration::from_secs(30), Duration::from_secs);
        let dead_letter = match attribute(QueueAttributeName::RedrivePolicy) {
            Some(policy) => Some(dead_letter_url(&client, policy).await?),
            None => None,
        };
        Ok(Self {
            inner: Arc::new(Queue {
                client,
                url,
                fifo,
                visibility,
                dead_letter,
            }),
        })
    }

    /// Up to `max` messages (SQS takes 1 to 10), waiting up to `wait` (long polling, at
    /// most 20 s) for the first, with what a consumer reads: the receive count, a FIFO
    /// message's group and deduplication id, and every message attribute (headers, and what
    /// a dead-lettered message carries on). Nothing else: each attribute asked for is parsed
    /// on every receive.
    ///
    /// # Errors
    ///
    /// SQS's.
    pub async fn receive(&self, max: u8, wait: Duration) -> Result<Vec<SqsMessage>, BoxError> {
        let mut request = self
            .inner
            .client
            .receive_message()
            .queue_url(&self.inner.url)
            .max_number_of_messages(i32::from(max.clamp(1, 10)))
            .wait_time_seconds(seconds(wait.min(Duration::from_secs(20))))
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_attribute_names("All");
        if self.inner.fifo {
            request = request
                .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
                .message_system_attribute_names(MessageSystemAttributeName::MessageDeduplicationId);
        }
        let output = request.send().await?;
        Ok(output
            .messages
            .unwrap_or_default()
            .into_iter()
            .map(|message| SqsMessage {
                queue: self.clone(),
                message,
            })
            .collect())
    }

    /// Handles a received batch with `handle` (which settles each message, as
    /// [`Consumer::handle`](super::Consumer::handle) and [`Consumer::inbox`](super::Consumer::inbox)
    /// do), one message at a time, in the order received. On a FIFO queue, once a message is
    /// not acknowledged, the rest of its group in the batch is
    /// [released](SqsMessage::release) unhandled: it comes back after that message, in order.
    /// Returns each message's disposition; a released one has none.
    ///
    /// # Errors
    ///
    /// The first that `handle` returns (a settlement that failed: the message comes back
    /// when its visibility lapses), or SQS's for a release.
    pub async fn in_order<F, Fut>(
        &self,
        batch: Vec<SqsMessage>,
        mut handle: F,
    ) -> Result<Vec<Option<Disposition>>, BoxError>
    where
        F: FnMut(SqsMessage) -> Fut,
        Fut: std::future::Future<Output = Result<Disposition, BoxError>>,
    {
        let mut stopped: Vec<String> = Vec::new();
        let mut dispositions = Vec::with_capacity(batch.len());
        for message in batch {
            let group = self
                .is_fifo()
                .then(|| message.group().unwrap_or_default().to_owned());
            if group.as_ref().is_some_and(|group| stopped.contains(group)) {
                tracing::debug!(
                    group,
                    "released behind an unacknowledged message of its group"
                );
                message.release().await?;
                dispositions.push(None);
                continue;
            }
            let disposition = handle(message).await?;
            if disposition != Disposition::Ack {
                stopped.extend(group);
            }
            dispositions.push(Some(disposition));
        }
        Ok(dispositions)
    }

    /// The queue's URL.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// Whether it is a FIFO queue.
    pub fn is_fifo(&self) -> bool {
        self.inner.fifo
    }

    /// Its visibility timeout: the lease a consumer renews while it handles a message.
    pub fn visibility_timeout(&self) -> Duration {
        self.inner.visibility
    }

    /// The URL of its redrive policy's dead-letter queue, where rejected messages go.
    pub fn dead_letter_url(&self) -> Option<&str> {
        self.inner.dead_letter.as_ref().map(|(url, _)| url.as_str())
    }

    async fn change_visibility(&self, handle: &str, to: Duration) -> Result<(), BoxError> {
        self.inner
            .client
            .change_message_visibility()
            .queue_url(&self.inner.url)
            .receipt_handle(handle)
            .visibility_timeout(seconds(to.min(MAX_VISIBILITY)))
            .send()
            .await?;
        Ok(())
    }

    async fn delete(&self, handle: &str) -> Result<(), BoxError> {
        self.inner
            .client
            .delete_message()
            .queue_url(&self.inner.url)
            .receipt_handle(handle)
            .send()
            .await?;
        Ok(())
    }
}

/// The URL of the queue a redrive policy (`{"deadLetterTargetArn": "arn:aws:sqs:…"}`) names.
async fn dead_letter_url(client: &Client, policy: &str) -> Result<(String, bool), BoxError> {
    let policy: serde_json::Value = serde_json::from_str(policy)?;
    let arn = policy
        .get("deadLetterTargetArn")
        .and_then(serde_json::Value::as_str)
        .ok_or("the queue's redrive policy names no deadLetterTargetArn")?;
    // arn:aws:sqs:<region>:<account>:<name>
    let mut parts = arn.rsplitn(3, ':');
    let (Some(name), Some(account)) = (parts.next(), parts.next()) else {
        return Err(format!("not an SQS queue's ARN: {arn}").into());
    };
    let url = client
        .get_queue_url()
        .queue_name(name)
        .queue_owner_aws_account_id(account)
        .send()
        .await?
        .queue_url
        .ok_or("SQS answered no URL for the dead-letter queue")?;
    Ok((url, name.ends_with(".fifo")))
}

/// Whole seconds, as SQS takes them, rounded up: a lease is never shortened.
fn seconds(duration: Duration) -> i32 {
    let whole = duration
        .as_secs()
        .saturating_add(u64::from(duration.subsec_nanos() > 0));
    i32::try_from(whole).unwrap_or(i32::MAX)
}

/// A message received from an [`SqsQueue`]: a [`Delivery`] whose settlements are SQS calls
/// (the module's table).
#[derive(Clone, Debug)]
pub struct SqsMessage {
    queue: SqsQueue,
    message: Message,
}

impl SqsMessage {
    /// The message as SQS returned it.
    pub fn message(&self) -> &Message {
        &self.message
    }

    /// Its FIFO message group, on a FIFO queue.
    pub fn group(&self) -> Option<&str> {
        self.system(MessageSystemAttributeName::MessageGroupId)
    }

    /// Makes the message visible again at once, unhandled: for the rest of a FIFO group
    /// whose earlier message was not acknowledged.
    ///
    /// # Errors
    ///
    /// SQS's.
    pub async fn release(&self) -> Result<(), BoxError> {
        self.queue
            .change_visibility(self.receipt()?, Duration::ZERO)
            .await
    }

    fn system(&self, name: MessageSystemAttributeName) -> Option<&str> {
        let attributes = self.message.attributes.as_ref()?;
        attributes.get(&name).map(String::as_str)
    }

    fn receipt(&self) -> Result<&str, BoxError> {
        self.message
            .receipt_handle
            .as_deref()
            .ok_or_else(|| "SQS returned a message without a receipt handle".into())
    }

    /// Sends the message to the dead-letter queue as it is (its body, its attributes, its
    /// group), keyed on a FIFO dead-letter queue by its id, so that a consumer that dies
    /// between this send and the delete does not dead-letter it twice there.
    async fn dead_letter(&self, url: &str, fifo: bool) -> Result<(), BoxError> {
        let queue = &self.queue.inner;
        let send = queue
            .client
            .send_message()
            .queue_url(url)
            .message_body(self.message.body.as_deref().unwrap_or_default())
            .set_message_attributes(self.message.message_attributes.clone());
        let send = if fifo {
            send.message_group_id(self.group().unwrap_or("idem.dead-letter"))
                .set_message_deduplication_id(self.message.message_id.clone())
        } else {
            send
        };
        send.send().await?;
        Ok(())
    }
}

#[crate::async_trait]
impl Delivery for SqsMessage {
    fn payload(&self) -> &[u8] {
        self.message.body.as_deref().unwrap_or_default().as_bytes()
    }

    fn message_id(&self) -> Option<Cow<'_, str>> {
        let id = if self.queue.inner.fifo {
            self.system(MessageSystemAttributeName::MessageDeduplicationId)
        } else {
            self.message.message_id.as_deref()
        };
        id.map(Cow::Borrowed)
    }

    /// A message attribute of type `String` (or a custom `String.*` type).
    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        let attribute = self.message.message_attributes.as_ref()?.get(name)?;
        attribute.string_value().map(Cow::Borrowed)
    }

    fn deliveries(&self) -> Option<u64> {
        self.system(MessageSystemAttributeName::ApproximateReceiveCount)?
            .parse()
            .ok()
    }

    async fn settle(&self, disposition: Disposition) -> Result<(), BoxError> {
        let handle = self.receipt()?;
        match disposition {
            Disposition::Ack => self.queue.delete(handle).await,
            Disposition::Requeue { after } => self.queue.change_visibility(handle, after).await,
            Disposition::Reject => {
                match &self.queue.inner.dead_letter {
                    Some((url, fifo)) => self.dead_letter(url, *fifo).await?,
                    None => tracing::error!(
                        queue = self.queue.url(),
                        message_id = self.message.message_id.as_deref(),
                        "a rejected message is deleted: the queue has no redrive policy"
                    ),
                }
                self.queue.delete(handle).await
            }
        }
    }

    /// The queue's visibility timeout; none for a queue whose timeout is zero (every
    /// received message is visible again at once: there is nothing to renew).
    fn lease(&self) -> Option<Duration> {
        Some(self.queue.inner.visibility).filter(|visibility| !visibility.is_zero())
    }

    async fn renew(&self) -> Result<(), BoxError> {
        let visibility = self.queue.inner.visibility;
        self.queue
            .change_visibility(self.receipt()?, visibility)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_rounded_up_to_whole_seconds() {
        assert_eq!(seconds(Duration::ZERO), 0);
        assert_eq!(seconds(Duration::from_millis(1)), 1);
        assert_eq!(seconds(Duration::from_secs(2)), 2);
        assert_eq!(seconds(Duration::from_millis(2_001)), 3);
        assert_eq!(seconds(Duration::MAX), i32::MAX);
    }
}
