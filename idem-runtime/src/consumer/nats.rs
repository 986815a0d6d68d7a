//! NATS JetStream, through `async-nats` (feature `nats`).

use std::borrow::Cow;

use async_nats::jetstream::message::{AckKind, Message};

use super::{Delivery, Disposition};
use crate::BoxError;

/// A JetStream message: its `Nats-Msg-Id` header is the broker's id (the one JetStream
/// deduplicates publishes by), and JetStream counts its deliveries. An ack, a requeue (a
/// `Nak` with its delay) and a reject (a `Term`: never delivered again) each wait for the
/// server's confirmation (`double_ack_with`): a consumer that dies after settling a message
/// has settled it, and a rejected message is rejected once.
#[crate::async_trait]
impl Delivery for Message {
    fn payload(&self) -> &[u8] {
        &self.message.payload
    }

    fn message_id(&self) -> Option<Cow<'_, str>> {
        self.header("Nats-Msg-Id")
    }

    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        let value = self.message.headers.as_ref()?.get(name)?;
        Some(Cow::Borrowed(value.as_str()))
    }

    fn deliveries(&self) -> Option<u64> {
        let info = self.info().ok()?;
        u64::try_from(info.delivered).ok()
    }

    async fn settle(&self, disposition: Disposition) -> Result<(), BoxError> {
        match disposition {
            Disposition::Ack => self.double_ack_with(AckKind::Ack).await?,
            Disposition::Requeue { after } => {
                self.double_ack_with(AckKind::Nak(Some(after))).await?;
            }
            Disposition::Reject => self.double_ack_with(AckKind::Term).await?,
        }
        Ok(())
    }
}
