//! The bodies of the layer's responses, and the tee that records a body of unknown length
//! while it is sent.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use tokio::sync::oneshot;

use super::config::Unrecorded;
use crate::BoxError;

pin_project_lite::pin_project! {
    /// The body of every response of [`IdempotencyService`](super::IdempotencyService):
    /// the inner service's own (a response passed through or not recorded, or one
    /// recorded while it is sent), or a buffered one (recorded, replayed, or a problem).
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project_lite::pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Full { #[pin] body: Full<Bytes> },
        Tee { #[pin] body: Tee<B> },
    }
}

impl<B> ResponseBody<B> {
    pub(super) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    pub(super) fn full(body: Full<Bytes>) -> Self {
        Self {
            kind: Kind::Full { body },
        }
    }

    pub(super) fn tee(body: Tee<B>) -> Self {
        Self {
            kind: Kind::Tee { body },
        }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Inner { .. } => "inner",
            Kind::Full { .. } => "full",
            Kind::Tee { .. } => "recorded while sent",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Full { body } => body.poll_frame(cx).map_err(|never| match never {}),
            KindProj::Tee { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { body } => body.is_end_stream(),
            Kind::Tee { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { body } => body.size_hint(),
            Kind::Tee { body } => body.size_hint(),
        }
    }
}

/// How a body sent through a [`Tee`] ended, for the task that records it.
pub(super) enum TeeEnd<B> {
    /// The whole body was sent, and here it is.
    Sent(Bytes),
    /// It cannot be recorded.
    Unrecorded(Unrecorded),
    /// The client went away first: the rest is for the recorder to read.
    Abandoned {
        rest: Pin<Box<B>>,
        kept: BytesMut,
        limit: usize,
    },
}

/// What a [`Tee`] waits for before it ends: the call that records its body.
pub(super) type Landing = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A response body that keeps a copy of what it sends, up to a limit, and tells the
/// recorder how it ended. Dropped before its end (the client went away), it hands the rest
/// of the body to the recorder, which reads it to the end: the handler's response is
/// recorded whether or not anyone receives it, as a buffered one is.
///
/// Its end of stream waits for the recorder's first attempt to land the record (see
/// [`Tee::until`]): a client that read the whole response and retries at once is replayed,
/// not refused as in progress, as with a buffered response.
pub(super) struct Tee<B> {
    body: Option<Pin<Box<B>>>,
    kept: BytesMut,
    limit: usize,
    end: Option<oneshot::Sender<TeeEnd<B>>>,
    landing: Option<Landing>,
}

impl<B: Body<Data = Bytes>> Tee<B> {
    pub(super) fn new(body: B, limit: usize) -> (Self, oneshot::Receiver<TeeEnd<B>>) {
        let (end, ended) = oneshot::channel();
        let tee = Self {
            body: Some(Box::pin(body)),
            kept: BytesMut::new(),
            limit,
            end: Some(end),
            landing: None,
        };
        (tee, ended)
    }

    /// Holds the end of the body until `landing` is done.
    pub(super) fn until(mut self, landing: Landing) -> Self {
        self.landing = Some(landing);
        self
    }

    fn end(&mut self, end: TeeEnd<B>) {
        if let Some(sender) = self.end.take() {
            // The recorder may have gone with a runtime shutting down: nothing to tell.
            let _ = sender.send(end);
        }
        self.kept = BytesMut::new();
    }

    fn keep(&mut self, data: &Bytes) {
        if self.end.is_none() {
            return;
        }
        if self.kept.len() + data.len() > self.limit {
            let limit = self.limit;
            self.end(TeeEnd::Unrecorded(Unrecorded::TooLarge { limit }));
        } else {
            self.kept.extend_from_slice(data);
        }
    }
}

impl<B> Tee<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let Some(body) = this.body.as_mut() else {
            return this.poll_landing(cx);
        };
        let polled = body.as_mut().poll_frame(cx);
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                match frame.data_ref() {
                    Some(data) => this.keep(data),
                    None => this.end(TeeEnd::Unrecorded(Unrecorded::Trailers)),
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => {
                this.body = None;
                this.end(TeeEnd::Unrecorded(Unrecorded::BodyFailed));
                Poll::Ready(Some(Err(err.into())))
            }
            Poll::Ready(None) => {
                this.body = None;
                let kept = std::mem::take(&mut this.kept).freeze();
                this.end(TeeEnd::Sent(kept));
                this.poll_landing(cx)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// The end of the body, once the record landed (or failed to, and was left to the
    /// background).
    fn poll_landing(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(landing) = self.landing.as_mut() {
            std::task::ready!(landing.as_mut().poll(cx));
            self.landing = None;
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        // Not ended while the record is landing: the server must poll once more for the end.
        self.landing.is_none() && self.body.as_ref().is_none_or(|body| body.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.body
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), |body| body.size_hint())
    }
}

impl<B> Drop for Tee<B> {
    fn drop(&mut self) {
        if let (Some(end), Some(rest)) = (self.end.take(), self.body.take()) {
            let kept = std::mem::take(&mut self.kept);
            let limit = self.limit;
            let _ = end.send(TeeEnd::Abandoned { rest, kept, limit });
        }
    }
}

/// The body a [`Tee`] sent, once it ended: read to the end here if its client went away.
pub(super) async fn recorded<B>(ended: oneshot::Receiver<TeeEnd<B>>) -> Result<Bytes, Unrecorded>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match ended.await {
        Ok(TeeEnd::Sent(body)) => Ok(body),
        Ok(TeeEnd::Unrecorded(why)) => Err(why),
        Ok(TeeEnd::Abandoned {
            mut rest,
            mut kept,
            limit,
        }) => loop {
            match rest.frame().await {
                None => return Ok(kept.freeze()),
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        return Err(Unrecorded::Trailers);
                    };
                    if kept.len() + data.len() > limit {
                        return Err(Unrecorded::TooLarge { limit });
                    }
                    kept.extend_from_slice(&data);
                }
                Some(Err(_)) => return Err(Unrecorded::BodyFailed),
            }
        },
        // The tee is dropped only after it sent its end: nothing else closes the channel.
        Err(_) => Err(Unrecorded::BodyFailed),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use http::HeaderMap;

    use super::*;

    /// A body of unknown length that yields `frames` in turn.
    struct Frames(VecDeque<Result<Frame<Bytes>, BoxError>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Ready(self.0.pop_front())
        }
    }

    fn data(chunk: &'static str) -> Result<Frame<Bytes>, BoxError> {
        Ok(Frame::data(Bytes::from_static(chunk.as_bytes())))
    }

    /// What the recorder ends with once the client read `read` frames and went away.
    async fn record(
        frames: Vec<Result<Frame<Bytes>, BoxError>>,
        read: usize,
    ) -> Result<Bytes, Unrecorded> {
        let (tee, ended) = Tee::new(Frames(frames.into()), 8);
        // As the service sends it.
        let mut sent = ResponseBody::tee(tee);
        for _ in 0..read {
            let _ = sent.frame().await;
        }
        drop(sent);
        recorded(ended).await
    }

    #[tokio::test]
    async fn a_body_sent_whole_read_in_part_or_abandoned_is_recorded_whole() {
        let frames = || vec![data("ab"), data("cd")];
        for read in [0, 1, 2, 3] {
            assert_eq!(
                record(frames(), read).await,
                Ok(Bytes::from_static(b"abcd")),
                "{read} read"
            );
        }
    }

    #[tokio::test]
    async fn the_end_of_a_sent_body_waits_for_its_record_to_land() {
        let (tee, ended) = Tee::new(Frames(vec![data("ab")].into()), 8);
        let (landed, landing) = oneshot::channel::<()>();
        let mut sent = ResponseBody::tee(tee.until(Box::pin(async move {
            let _ = landing.await;
        })));
        assert!(!sent.is_end_stream());
        let first = sent.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), "ab");
        // The body is all sent and the recorder has it, but the end waits for the landing.
        let mut end = std::pin::pin!(sent.frame());
        assert!(
            poll_once(end.as_mut()).is_pending(),
            "ended before the record landed"
        );
        assert_eq!(recorded(ended).await, Ok(Bytes::from_static(b"ab")));
        assert!(
            poll_once(end.as_mut()).is_pending(),
            "ended before the record landed"
        );
        landed.send(()).unwrap();
        assert!(end.await.is_none());
        assert!(sent.is_end_stream());
    }

    /// Polls `future` once, with a waker that does nothing.
    fn poll_once<F: Future>(future: Pin<&mut F>) -> Poll<F::Output> {
        future.poll(&mut Context::from_waker(std::task::Waker::noop()))
    }

    #[tokio::test]
    async fn trailers_failures_and_excess_are_not_recorded() {
        let trailers = || vec![data("ab"), Ok(Frame::trailers(HeaderMap::new()))];
        let failing = || vec![data("ab"), Err(BoxError::from("reset"))];
        let large = || vec![data("12345"), data("6789")];
        for read in [0, 3] {
            assert_eq!(record(trailers(), read).await, Err(Unrecorded::Trailers));
            assert_eq!(record(failing(), read).await, Err(Unrecorded::BodyFailed));
            assert_eq!(
                record(large(), read).await,
                Err(Unrecorded::TooLarge { limit: 8 })
            );
        }
    }
}
