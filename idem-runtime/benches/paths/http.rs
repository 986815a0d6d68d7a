//! P10 and P11: the HTTP layer in memory.

use super::baselines::{handler, kib_json, request, Naive, REPLAY_KEY};
use super::*;

// ---- the HTTP layer -----------------------------------------------------------------------

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
