//! Reading an answer before handing it over: a response whose body is cut after its headers
//! is a failed attempt, retried with the same key (the server replays what it recorded),
//! not an answer the caller must resend by hand.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;

use crate::BoxError;

/// The body of a response the client's half hands over: read whole before the answer was
/// returned (up to [`max_answer`](super::IdempotencyKeyLayer::max_answer)), or, for a larger
/// answer or with [`stream_answers`](super::IdempotencyKeyLayer::stream_answers), what was
/// read and the rest as it arrives. Read it as any body (`BodyExt::collect`).
pub struct AnswerBody(UnsyncBoxBody<Bytes, BoxError>);

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.0).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.0.size_hint()
    }
}

impl std::fmt::Debug for AnswerBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnswerBody")
            .field("size_hint", &self.0.size_hint())
            .finish()
    }
}

/// A body read up to a limit.
pub(super) enum Read<B> {
    /// All of it, within the limit.
    Whole(Bytes),
    /// More than the limit: what was read, and the rest, unread.
    Over(Bytes, Pin<Box<B>>),
}

/// Reads `body` whole if it ends within `limit` bytes. `Err`: it failed before its end (a
/// connection cut after the headers), an attempt to retry. Trailers are not kept.
pub(super) async fn read<B>(body: B, limit: usize) -> Result<Read<B>, BoxError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let mut body = Box::pin(body);
    let mut read = BytesMut::new();
    while let Some(frame) = body.as_mut().frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(cut) => return Err(cut.into()),
        };
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        read.extend_from_slice(data.chunk());
        if read.len() > limit {
            return Ok(Read::Over(read.freeze(), body));
        }
    }
    Ok(Read::Whole(read.freeze()))
}

impl<B> Read<B>
where
    B: Body + Send + 'static,
    B::Error: Into<BoxError>,
{
    /// As a body to hand over.
    pub(super) fn into_body(self) -> AnswerBody {
        AnswerBody(match self {
            Self::Whole(bytes) => http_body_util::Full::new(bytes)
                .map_err(|never| match never {})
                .boxed_unsync(),
            Self::Over(read, rest) => Prefixed {
                read: Some(read),
                rest,
            }
            .boxed_unsync(),
        })
    }
}

/// A body streamed as it arrives, its data as `Bytes`.
pub(super) fn streamed<B>(body: B) -> AnswerBody
where
    B: Body + Send + 'static,
    B::Error: Into<BoxError>,
{
    AnswerBody(
        Prefixed {
            read: None,
            rest: Box::pin(body),
        }
        .boxed_unsync(),
    )
}

/// What was read of a body, then the rest of it.
pub(super) struct Prefixed<B> {
    read: Option<Bytes>,
    rest: Pin<Box<B>>,
}

impl<B> Body for Prefixed<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(read) = self.read.take() {
            return Poll::Ready(Some(Ok(Frame::data(read))));
        }
        self.rest.as_mut().poll_frame(cx).map(|frame| {
            frame.map(|frame| {
                frame
                    .map(|frame| frame.map_data(|mut data| data.copy_to_bytes(data.remaining())))
                    .map_err(Into::into)
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let read = self.read.as_ref().map_or(0, |read| read.len() as u64);
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + read);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + read);
        }
        hint
    }
}

/// Allows `Prefixed` to be `Sync` where its parts are (reqwest's body needs it).
impl<B> Prefixed<B> {
    /// For the reqwest middleware (feature `reqwest`).
    #[cfg_attr(not(feature = "reqwest"), allow(dead_code))]
    pub(super) fn new(read: Bytes, rest: Pin<Box<B>>) -> Self {
        Self {
            read: Some(read),
            rest,
        }
    }
}
