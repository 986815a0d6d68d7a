//! P10 and P11: the HTTP layer in memory.

use super::*;

// ---- the HTTP layer -----------------------------------------------------------------------

/// The handler behind both middlewares: a `201` with a small JSON receipt.
/// A ready response, as the handler gives it.
type Ready = std::future::Ready<Result<http::Response<Full<Bytes>>, Infallible>>;

fn handler<B>() -> impl tower::Service<
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
struct Naive<S> {
    inner: S,
    cache: moka::future::Cache<String, (http::StatusCode, http::HeaderMap, Bytes, [u8; 32])>,
    hashes: bool,
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
fn kib_json() -> Bytes {
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

fn request(key: &str, body: &Bytes) -> http::Request<Full<Bytes>> {
    http::Request::post("/payments")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))
        .unwrap()
}

pub(super) fn http_layer(paths: &mut Paths, rt: &Runtime) {
    use tower::{Layer, ServiceExt};
    let body = kib_json();
    assert!((1024..1100).contains(&body.len()), "{} bytes", body.len());
    let ours = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .layer(handler());
    let naive = Naive {
        inner: handler(),
        cache: moka::future::Cache::new(100_000),
        hashes: false,
    };
    let careful = Naive {
        cache: moka::future::Cache::new(100_000),
        hashes: true,
        ..naive.clone()
    };
    let first = rt
        .block_on(ours.clone().oneshot(request(REPLAY_KEY, &body)))
        .unwrap();
    assert_eq!(first.status(), 201);
    rt.block_on(naive.clone().oneshot(request(REPLAY_KEY, &body)))
        .unwrap();
    rt.block_on(careful.clone().oneshot(request(REPLAY_KEY, &body)))
        .unwrap();
    // The careful baseline does refuse another body under the same key, as ours does.
    let other = Bytes::from_static(b"{\"amount\": 1}");
    let refused = rt.block_on(careful.clone().oneshot(request(REPLAY_KEY, &other)));
    assert_eq!(refused.unwrap().status(), 422);
    let refused = rt.block_on(ours.clone().oneshot(request(REPLAY_KEY, &other)));
    assert_eq!(refused.unwrap().status(), 422);

    // Measured from inside a worker task, as a server runs a request: a body the layer
    // spawns then starts on the same worker, and no iteration pays a hand-off from
    // criterion's thread to the runtime.
    let replays = |_| REPLAY_KEY.to_string();
    let fresh_keys = |_| fresh().to_string();
    paths.pair(
        "P10 HTTP replay, memory, 1 KiB JSON",
        in_worker(rt, ours.clone(), &body, replays),
        in_worker(rt, naive.clone(), &body, replays),
    );
    paths.pair(
        "P10c HTTP replay, against a body-hashing baseline",
        in_worker(rt, ours.clone(), &body, replays),
        in_worker(rt, careful, &body, replays),
    );

    // The same, with a fingerprint that leaves the body out: what reading and canonicalising
    // the body costs.
    let headless = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .fingerprint(|parts, _| {
            idem_runtime::Fingerprint::of(&(parts.method.as_str(), parts.uri.path()))
        })
        .layer(handler());
    rt.block_on(headless.clone().oneshot(request(REPLAY_KEY, &body)))
        .unwrap();
    let group = "P10b HTTP replay, fingerprint without the body";
    paths.pair(
        group,
        in_worker(rt, headless, &body, replays),
        in_worker(rt, naive.clone(), &body, replays),
    );

    let group = "P11 HTTP first execution, memory, 1 KiB JSON";
    paths.pair(
        group,
        in_worker(rt, ours, &body, fresh_keys),
        in_worker(rt, naive, &body, fresh_keys),
    );
}

/// The key of the replay benches: recorded before they run.
const REPLAY_KEY: &str = "replay-0001";

/// What both middlewares of the HTTP benches are.
trait HttpService<B>:
    tower::Service<
        http::Request<Full<Bytes>>,
        Response = http::Response<B>,
        Error = Infallible,
        Future: Send,
    > + Clone
    + Send
    + 'static
{
}

impl<S, B> HttpService<B> for S where
    S: tower::Service<
            http::Request<Full<Bytes>>,
            Response = http::Response<B>,
            Error = Infallible,
            Future: Send,
        > + Clone
        + Send
        + 'static
{
}

/// Sends requests through `service` one after the other, from a task on the runtime, and
/// returns how long they took.
fn in_worker<'a, S, B>(
    rt: &'a Runtime,
    service: S,
    body: &Bytes,
    key: fn(u64) -> String,
) -> impl Side + 'a
where
    S: HttpService<B>,
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: std::fmt::Debug,
{
    let body = body.clone();
    move |iters| {
        let (service, body) = (service.clone(), body.clone());
        let task = rt.spawn(async move {
            let started = Instant::now();
            for i in 0..iters {
                let response = tower::ServiceExt::oneshot(service.clone(), request(&key(i), &body))
                    .await
                    .unwrap();
                black_box(response.into_body().collect().await.unwrap().to_bytes());
            }
            started.elapsed()
        });
        rt.block_on(task).unwrap()
    }
}
