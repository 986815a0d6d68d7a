//! RabbitMQ and any AMQP 0.9.1 broker, through `lapin` (feature `lapin`).

use std::borrow::Cow;

use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use lapin::types::AMQPValue;

use super::{Delivery, Disposition};
use crate::BoxError;

/// A `lapin` delivery: its `message-id` property is the broker's id; the delivery count is 1
/// for a delivery the broker does not mark redelivered, and one more than a quorum queue's
/// `x-delivery-count` header for one it does (unknown on a classic queue, which has none). A requeue waits
/// its delay holding the message (AMQP has no delayed requeue), then `basic.nack`s it with
/// `requeue`; a reject is `basic.reject` without requeue, which dead-letters it where the
/// queue has a dead-letter exchange.
#[crate::async_trait]
impl Delivery for AmqpDelivery {
    fn payload(&self) -> &[u8] {
        &self.data
    }

    fn message_id(&self) -> Option<Cow<'_, str>> {
        self.properties
            .message_id()
            .as_ref()
            .map(|id| Cow::Borrowed(id.as_str()))
    }

    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        let headers = self.properties.headers().as_ref()?;
        match headers.inner().get(name)? {
            AMQPValue::LongString(text) => {
                std::str::from_utf8(text.as_bytes()).ok().map(Cow::Borrowed)
            }
            AMQPValue::ShortString(text) => Some(Cow::Borrowed(text.as_str())),
            _ => None,
        }
    }

    fn deliveries(&self) -> Option<u64> {
        if !self.redelivered {
            return Some(1);
        }
        let headers = self.properties.headers().as_ref()?;
        // The count of earlier deliveries: this one is the next.
        let earlier = match headers.inner().get("x-delivery-count")? {
            AMQPValue::LongLongInt(n) => u64::try_from(*n).ok()?,
            AMQPValue::LongInt(n) => u64::try_from(*n).ok()?,
            AMQPValue::LongUInt(n) => u64::from(*n),
            AMQPValue::ShortInt(n) => u64::try_from(*n).ok()?,
            _ => return None,
        };
        Some(earlier + 1)
    }

    async fn settle(&self, disposition: Disposition) -> Result<(), BoxError> {
        match disposition {
            Disposition::Ack => {
                self.acker.ack(BasicAckOptions::default()).await?;
            }
            Disposition::Requeue { after } => {
                tokio::time::sleep(after).await;
                let requeue = BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                };
                self.acker.nack(requeue).await?;
            }
            Disposition::Reject => {
                self.acker
                    .reject(BasicRejectOptions { requeue: false })
                    .await?;
            }
        }
        Ok(())
    }
}
