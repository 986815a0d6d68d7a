//! The HTTP benches' handler, the middlewares they are measured against, and their
//! requests: shared by the timed benches (`paths`) and the instruction counts.
#![allow(dead_code)] // each bench uses some

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use super::common::receipt;

/// The handler behind both middlewares: a `201` with a small JSON receipt.
/// A ready response, as the handler gives it.
pub type Ready = std::future::Ready<Result<http::Response<Full<Bytes>>, Infallible>>;

pub fn handler<B>() -> impl tower::Service<
    http::Request<B>,
    Response = http::Response<Full<Bytes>>,
    Error = Infallible,
    Future = Ready,
> + Clone {
    tower::service_fn(|_: http::Request<B>| {
        let body = serde_json::to_vec(&receipt(7)).unwrap();
        let response = http::Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        std::future::ready(Ok(response))
    })
}

/// The middleware the popular tutorials show: the header looked up in a moka cache; a hit
/// replays, a miss runs the handler and inserts its response. No claim (concurrent
/// duplicates both run), no scope.
///
/// With `hashes` set, it is what a careful tutorial writes: it reads the request body,
/// hashes its raw bytes with SHA-256, keeps the digest beside the response, and answers a
/// hit whose digest differs with `422`. Without, it reads no body at all (no fingerprint).
#[derive(Clone)]
pub struct Naive<S> {
    pub inner: S,
    pub cache: moka::future::Cache<String, (http::StatusCode, http::HeaderMap, Bytes, [u8; 32])>,
    pub hashes: bool,
}

impl<S> tower::Service<http::Request<Full<Bytes>>> for Naive<S>
where
    S: tower::Service<
            http::Request<Full<Bytes>>,
            Response = http::Response<Full<Bytes>>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = http::Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Full<Bytes>>) -> Self::Future {
        use sha2::Digest;
        let (mut inner, cache, hashes) = (self.inner.clone(), self.cache.clone(), self.hashes);
        Box::pin(async move {
            let key = request
                .headers()
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let Some(key) = key else {
                return inner.call(request).await;
            };
            let (request, digest) = if hashes {
                let (parts, body) = request.into_parts();
                let body = body.collect().await.unwrap().to_bytes();
                let digest: [u8; 32] = sha2::Sha256::digest(&body).into();
                (http::Request::from_parts(parts, Full::new(body)), digest)
            } else {
                (request, [0; 32])
            };
            if let Some((status, headers, body, recorded)) = cache.get(&key).await {
                if recorded != digest {
                    let mut response = http::Response::new(Full::new(Bytes::new()));
                    *response.status_mut() = http::StatusCode::UNPROCESSABLE_ENTITY;
                    return Ok(response);
                }
                let mut response = http::Response::new(Full::new(body));
                *response.status_mut() = status;
                *response.headers_mut() = headers;
                return Ok(response);
            }
            let response = inner.call(request).await?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            cache
                .insert(
                    key,
                    (parts.status, parts.headers.clone(), body.clone(), digest),
                )
                .await;
            Ok(http::Response::from_parts(parts, Full::new(body)))
        })
    }
}

/// A JSON request body of about 1 KiB: an order with its lines.
pub fn kib_json() -> Bytes {
    let mut items = Vec::new();
    loop {
        let body = serde_json::json!({"amount": 4200, "currency": "eur", "items": items});
        let body = serde_json::to_vec(&body).unwrap();
        if body.len() >= 1024 {
            return Bytes::from(body);
        }
        let i = items.len();
        items.push(serde_json::json!({"sku": format!("sku-{i:04}"), "qty": i}));
    }
}

pub fn request(key: &str, body: &Bytes) -> http::Request<Full<Bytes>> {
    http::Request::post("/payments")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))
        .unwrap()
}

/// The key of the replay benches: recorded before they run.
pub const REPLAY_KEY: &str = "replay-0001";
