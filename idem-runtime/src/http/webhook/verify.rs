//! A [`Webhook`] preset as a layer of its own: the sender's signature checked and the
//! delivery's id found, before the handler, which claims the id in its own transaction.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use tower_layer::Layer;
use tower_service::Service;

use super::Webhook;
use crate::http::body::ResponseBody;
use crate::http::key_from::Found;
use crate::http::problem::Problem;
use crate::BoxError;

impl<S> Layer<S> for Webhook {
    type Service = WebhookService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        WebhookService {
            inner,
            sender: Arc::new(self.clone()),
        }
    }
}

/// The service of a [`Webhook`] preset used as a layer: every request's body is read (up to
/// [`Webhook::max_body`]), its signature checked (`401` otherwise, whatever the method), and
/// the delivery's id found where the sender puts it (`400` without one); the handler then
/// gets the request, its body whole, with the id as an
/// [`IdempotencyKey`](crate::IdempotencyKey) extension, which the extractor of that name
/// reads. Nothing is claimed here: the handler claims the id, in its own transaction.
pub struct WebhookService<S> {
    inner: S,
    sender: Arc<Webhook>,
}

impl<S: Clone> Clone for WebhookService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            sender: Arc::clone(&self.sender),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for WebhookService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WebhookService")
            .field("inner", &self.inner)
            .field("sender", &self.sender)
            .finish()
    }
}

/// The future of [`WebhookService`]'s responses.
pub type WebhookFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

impl<S, B, RB> Service<Request<B>> for WebhookService<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = S::Error;
    type Future = WebhookFuture<RB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service that was polled ready serves this request; a clone takes its place.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        Box::pin(verified(Arc::clone(&self.sender), inner, request))
    }
}

/// A delivery checked and keyed, then handed to `inner`; or the problem that refuses it.
async fn verified<S, B, RB>(
    sender: Arc<Webhook>,
    mut inner: S,
    request: Request<B>,
) -> Result<Response<ResponseBody<RB>>, S::Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<RB>>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let source = sender.key_from();
    let refuse = |problem: Problem| Ok(problem.answer(&source.naming()).map(ResponseBody::full));
    let (mut parts, body) = request.into_parts();
    let limit = sender.max_body;
    if body.size_hint().lower() > limit as u64 {
        return refuse(Problem::BodyTooLarge(limit));
    }
    let body = match Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) if err.is::<LengthLimitError>() => return refuse(Problem::BodyTooLarge(limit)),
        Err(err) => {
            tracing::info!(error = %err, "a webhook delivery's body could not be read: answered 400");
            return refuse(Problem::BodyUnreadable);
        }
    };
    if let Err(why) = sender.verify(&parts.headers, &body) {
        tracing::info!(reason = %why, method = %parts.method, "a webhook delivery without its sender's signature: answered 401");
        return refuse(Problem::SignatureInvalid);
    }
    let key = match source.in_request(&parts, &body) {
        Found::Key(keyed) => keyed.shown,
        Found::Missing => return refuse(Problem::KeyMissing),
        Found::Malformed(why) => return refuse(Problem::KeyMalformed(why)),
        // Looked for in the request, body included: never here.
        Found::InBody => return refuse(Problem::Internal),
    };
    parts.extensions.insert(key);
    let response = inner
        .call(Request::from_parts(parts, Full::new(body)))
        .await?;
    Ok(response.map(ResponseBody::inner))
}
