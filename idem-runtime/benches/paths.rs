//! Every path of idem next to its baseline, in one run; then a table of ratios.
//!
//! `cargo bench -p idem-runtime --bench paths --all-features` (BENCHMARKS.md has the results).
//! Paths on Redis and PostgreSQL are skipped, with a message, when their server is
//! unreachable (`IDEM_REDIS_URL`, `IDEM_POSTGRES_URL`).

use std::convert::Infallible;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::Criterion;
use http_body_util::{BodyExt, Full};
use idem_runtime::http::IdempotencyLayer;
use idem_runtime::{idempotent, Error, MemoryStore, Operation, PostgresStore, RedisStore};
use sha2::{Digest, Sha256};
use tokio::runtime::Runtime;

use self::common::{receipt, Receipt};

mod common;

#[derive(Debug)]
struct BenchError;

impl From<Error> for BenchError {
    fn from(_: Error) -> Self {
        Self
    }
}

/// Unique keys for paths that need a fresh key per iteration.
static NEXT: AtomicU64 = AtomicU64::new(1);

fn fresh() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The hand-written key of the baselines: the same fields, concatenated, hashed once.
fn hand_key(order_id: u64, customer: &str, line: u32) -> [u8; 32] {
    let mut bytes = [0_u8; 64];
    bytes[..8].copy_from_slice(&order_id.to_le_bytes());
    bytes[8..8 + customer.len()].copy_from_slice(customer.as_bytes());
    let end = 8 + customer.len();
    bytes[end..end + 4].copy_from_slice(&line.to_le_bytes());
    Sha256::digest(&bytes[..end + 4]).into()
}

// ---- the functions under test ---------------------------------------------------------

#[idempotent(key = (order_id, customer), store = store, namespace = "bench.charge")]
async fn charge(store: &MemoryStore, order_id: u64, customer: &str) -> Result<Receipt, BenchError> {
    Ok(receipt(order_id))
}

#[cached::proc_macro::cached(max_size = 10_000)]
async fn cached_charge(order_id: u64, customer: String) -> Receipt {
    let _ = customer;
    receipt(order_id)
}

#[idempotent(key = order_id, store = store, namespace = "bench.redis")]
async fn charge_redis(store: &RedisStore, order_id: u64) -> Result<Receipt, BenchError> {
    Ok(receipt(order_id))
}

#[idempotent(key = order_id, store = store, namespace = "bench.postgres")]
async fn charge_postgres(store: &PostgresStore, order_id: u64) -> Result<Receipt, BenchError> {
    Ok(receipt(order_id))
}

// ---- P1, P1b, P2, P3: the in-memory store ----------------------------------------------

fn memory(c: &mut Criterion, rt: &Runtime) {
    let store = MemoryStore::new();
    rt.block_on(charge(&store, 7, "cus_0042")).unwrap();
    let raw: moka::future::Cache<[u8; 32], bytes::Bytes> = moka::future::Cache::new(100_000);
    let json = bytes::Bytes::from(serde_json::to_vec(&receipt(7)).unwrap());
    rt.block_on(raw.insert(hand_key(7, "cus_0042", 0), json));

    let mut p1 = c.benchmark_group("P1 replay, memory");
    p1.bench_function("ours", |b| {
        b.to_async(rt).iter(|| async {
            black_box(
                charge(&store, black_box(7), black_box("cus_0042"))
                    .await
                    .unwrap(),
            )
        })
    });
    p1.bench_function("baseline", |b| {
        b.to_async(rt).iter(|| async {
            let key = hand_key(black_box(7), black_box("cus_0042"), 0);
            let bytes = raw.get(&key).await.unwrap();
            black_box(serde_json::from_slice::<Receipt>(&bytes).unwrap())
        })
    });
    p1.finish();

    rt.block_on(cached_charge(7, "cus_0042".into()));
    let mut p1b = c.benchmark_group("P1b replay vs cached");
    p1b.bench_function("ours", |b| {
        b.to_async(rt).iter(|| async {
            black_box(
                charge(&store, black_box(7), black_box("cus_0042"))
                    .await
                    .unwrap(),
            )
        })
    });
    p1b.bench_function("baseline", |b| {
        b.to_async(rt)
            .iter(|| async { black_box(cached_charge(black_box(7), "cus_0042".to_string()).await) })
    });
    p1b.finish();

    let mut p2 = c.benchmark_group("P2 first execution, memory");
    p2.bench_function("ours", |b| {
        b.to_async(rt)
            .iter(|| async { black_box(charge(&store, fresh(), "cus_0042").await.unwrap()) })
    });
    p2.bench_function("baseline", |b| {
        b.to_async(rt).iter(|| async {
            let id = fresh();
            let key = hand_key(id, "cus_0042", 0);
            raw.insert(key, bytes::Bytes::from_static(b"claimed")).await;
            let value = serde_json::to_vec(&receipt(id)).unwrap();
            raw.insert(key, bytes::Bytes::from(value)).await;
        })
    });
    p2.finish();

    let mut p3 = c.benchmark_group("P3 1000 callers, one key, 20 ms body");
    p3.sample_size(10).measurement_time(Duration::from_secs(4));
    p3.bench_function("ours", |b| {
        b.to_async(rt).iter_custom(|iters| {
            let store = store.clone();
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total += thousand_callers(|key| {
                        let store = store.clone();
                        async move {
                            let op = Operation::new("bench.p3");
                            let key = op.key(&key).unwrap();
                            op.run(&store, &key, None, async {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                                Ok::<_, Error>(receipt(key.as_bytes()[0].into()))
                            })
                            .await
                            .unwrap()
                            .into_inner()
                        }
                    })
                    .await;
                }
                total
            }
        })
    });
    p3.bench_function("baseline", |b| {
        b.to_async(rt).iter_custom(|iters| {
            let cache: moka::future::Cache<u64, Receipt> = moka::future::Cache::new(100_000);
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total += thousand_callers(|key| {
                        let cache = cache.clone();
                        async move {
                            cache
                                .get_with(key, async {
                                    tokio::time::sleep(Duration::from_millis(20)).await;
                                    receipt(key)
                                })
                                .await
                        }
                    })
                    .await;
                }
                total
            }
        })
    });
    p3.finish();
}

/// 1000 concurrent calls on one fresh key; the wall time until all have their value.
async fn thousand_callers<F, Fut>(call: F) -> Duration
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = Receipt> + Send + 'static,
{
    let key = fresh();
    let started = Instant::now();
    let calls: Vec<_> = (0..1000).map(|_| tokio::spawn(call(key))).collect();
    for call in calls {
        black_box(call.await.unwrap());
    }
    started.elapsed()
}

// ---- P5, P6: Redis -----------------------------------------------------------------------

fn redis(c: &mut Criterion, rt: &Runtime) {
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let manager = match rt.block_on(async {
        let client = redis::Client::open(url.as_str())?;
        redis::aio::ConnectionManager::new(client).await
    }) {
        Ok(manager) => manager,
        Err(e) => return println!("skipped P5, P6: redis at {url} is unreachable ({e})"),
    };
    let store = RedisStore::from_manager(manager.clone())
        .with_prefix("idem-bench:")
        .unwrap();
    let replay_id = fresh() + 1_000_000_000;
    rt.block_on(charge_redis(&store, replay_id)).unwrap();
    let raw_key = "idem-bench:raw";
    let json = serde_json::to_vec(&receipt(1)).unwrap();
    rt.block_on(async {
        let mut con = manager.clone();
        redis::cmd("SET")
            .arg(raw_key)
            .arg(&json)
            .query_async::<()>(&mut con)
            .await
    })
    .unwrap();

    let mut p5 = c.benchmark_group("P5 replay, redis");
    p5.bench_function("ours", |b| {
        b.to_async(rt)
            .iter(|| async { black_box(charge_redis(&store, replay_id).await.unwrap()) })
    });
    p5.bench_function("baseline", |b| {
        b.to_async(rt).iter(|| async {
            let mut con = manager.clone();
            black_box(
                redis::cmd("GET")
                    .arg(raw_key)
                    .query_async::<Vec<u8>>(&mut con)
                    .await
                    .unwrap(),
            )
        })
    });
    p5.finish();

    let mut p6 = c.benchmark_group("P6 first execution, redis");
    p6.bench_function("ours", |b| {
        b.to_async(rt)
            .iter(|| async { black_box(charge_redis(&store, fresh()).await.unwrap()) })
    });
    p6.bench_function("baseline", |b| {
        b.to_async(rt).iter(|| async {
            let mut con = manager.clone();
            let key = format!("idem-bench:raw:{}", fresh());
            let set: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(&json)
                .arg("NX")
                .arg("PX")
                .arg(60_000)
                .query_async(&mut con)
                .await
                .unwrap();
            black_box(set)
        })
    });
    p6.finish();
}

// ---- P8: PostgreSQL ----------------------------------------------------------------------

fn postgres(c: &mut Criterion, rt: &Runtime) {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = match rt.block_on(
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&url),
    ) {
        Ok(pool) => pool,
        Err(e) => return println!("skipped P8: postgresql at {url} is unreachable ({e})"),
    };
    let store = PostgresStore::from_pool(pool.clone())
        .with_table("idem_bench")
        .unwrap();
    rt.block_on(async {
        store.migrate().await.unwrap();
        sqlx::query("CREATE TABLE IF NOT EXISTS idem_bench_raw (key bytea PRIMARY KEY, value bytea, expires_at timestamptz)")
            .execute(&pool)
            .await
            .unwrap();
    });
    let replay_id = fresh() + 2_000_000_000;
    rt.block_on(charge_postgres(&store, replay_id)).unwrap();
    let json = serde_json::to_vec(&receipt(1)).unwrap();
    let raw_key = hand_key(replay_id, "raw", 0);
    rt.block_on(
        sqlx::query("INSERT INTO idem_bench_raw VALUES ($1, $2, now() + interval '1 hour') ON CONFLICT DO NOTHING")
            .bind(&raw_key[..])
            .bind(&json)
            .execute(&pool),
    )
    .unwrap();

    let mut first = c.benchmark_group("P8a first execution, postgres");
    first.bench_function("ours", |b| {
        b.to_async(rt)
            .iter(|| async { black_box(charge_postgres(&store, fresh()).await.unwrap()) })
    });
    first.bench_function("baseline", |b| {
        b.to_async(rt).iter(|| async {
            let key = hand_key(fresh(), "raw", 0);
            let row: Option<(Vec<u8>,)> = sqlx::query_as(
                "INSERT INTO idem_bench_raw VALUES ($1, $2, now() + interval '1 hour') \
                 ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value WHERE idem_bench_raw.expires_at <= now() \
                 RETURNING key",
            )
            .bind(&key[..])
            .bind(&json)
            .fetch_optional(&pool)
            .await
            .unwrap();
            black_box(row)
        })
    });
    first.finish();

    let mut replay = c.benchmark_group("P8b replay, postgres");
    replay.bench_function("ours", |b| {
        b.to_async(rt)
            .iter(|| async { black_box(charge_postgres(&store, replay_id).await.unwrap()) })
    });
    replay.bench_function("baseline", |b| {
        b.to_async(rt).iter(|| async {
            let row: (Vec<u8>,) = sqlx::query_as("SELECT value FROM idem_bench_raw WHERE key = $1")
                .bind(&raw_key[..])
                .fetch_one(&pool)
                .await
                .unwrap();
            black_box(row)
        })
    });
    replay.finish();
    rt.block_on(async {
        let _ = store.purge_expired().await;
        let _ = sqlx::query("DELETE FROM idem_bench_raw")
            .execute(&pool)
            .await;
    });
}

// ---- P9: key derivation -------------------------------------------------------------------

fn keys(c: &mut Criterion) {
    let mut p9 = c.benchmark_group("P9 key derivation");
    p9.bench_function("ours", |b| {
        b.iter(|| {
            Operation::new("bench.key")
                .key(black_box(&(42_u64, "cus_0042", 3_u32)))
                .unwrap()
        })
    });
    p9.bench_function("baseline", |b| {
        b.iter(|| hand_key(black_box(42), black_box("cus_0042"), black_box(3)))
    });
    p9.finish();
}

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
/// duplicates both run), no fingerprint, no scope.
#[derive(Clone)]
struct Naive<S> {
    inner: S,
    cache: moka::future::Cache<String, (http::StatusCode, http::HeaderMap, Bytes)>,
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
        let (mut inner, cache) = (self.inner.clone(), self.cache.clone());
        Box::pin(async move {
            let key = request
                .headers()
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let Some(key) = key else {
                return inner.call(request).await;
            };
            if let Some((status, headers, body)) = cache.get(&key).await {
                let mut response = http::Response::new(Full::new(body));
                *response.status_mut() = status;
                *response.headers_mut() = headers;
                return Ok(response);
            }
            let response = inner.call(request).await?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            cache
                .insert(key, (parts.status, parts.headers.clone(), body.clone()))
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

fn http_layer(c: &mut Criterion, rt: &Runtime) {
    use tower::{Layer, ServiceExt};
    let body = kib_json();
    assert!((1024..1100).contains(&body.len()), "{} bytes", body.len());
    let ours = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .layer(handler());
    let naive = Naive {
        inner: handler(),
        cache: moka::future::Cache::new(100_000),
    };
    let first = rt
        .block_on(ours.clone().oneshot(request(REPLAY_KEY, &body)))
        .unwrap();
    assert_eq!(first.status(), 201);
    rt.block_on(naive.clone().oneshot(request(REPLAY_KEY, &body)))
        .unwrap();

    // Measured from inside a worker task, as a server runs a request: a body the layer
    // spawns then starts on the same worker, and no iteration pays a hand-off from
    // criterion's thread to the runtime.
    let replays = |_| REPLAY_KEY.to_string();
    let fresh_keys = |_| fresh().to_string();
    let pair = (&body, rt);
    bench_pair(
        c,
        "P10 HTTP replay, memory, 1 KiB JSON",
        pair,
        &ours,
        &naive,
        replays,
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
    bench_pair(c, group, pair, &headless, &naive, replays);

    let group = "P11 HTTP first execution, memory, 1 KiB JSON";
    bench_pair(c, group, pair, &ours, &naive, fresh_keys);
}

/// The key of the replay benches: recorded before they run.
const REPLAY_KEY: &str = "replay-0001";

/// One group: `ours` and `baseline` each send requests with the keys `key` makes.
fn bench_pair<S1, S2, B1, B2>(
    c: &mut Criterion,
    group: &str,
    (body, rt): (&Bytes, &Runtime),
    ours: &S1,
    baseline: &S2,
    key: fn(u64) -> String,
) where
    S1: HttpService<B1>,
    S2: HttpService<B2>,
    B1: http_body::Body<Data = Bytes> + Send,
    B1::Error: std::fmt::Debug,
    B2: http_body::Body<Data = Bytes> + Send,
    B2::Error: std::fmt::Debug,
{
    let mut group = c.benchmark_group(group);
    group.bench_function("ours", |b| {
        b.iter_custom(|iters| in_worker(rt, iters, ours.clone(), body.clone(), key))
    });
    group.bench_function("baseline", |b| {
        b.iter_custom(|iters| in_worker(rt, iters, baseline.clone(), body.clone(), key))
    });
    group.finish();
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

/// Sends `iters` requests through `service` one after the other, from a task on the
/// runtime, and returns how long they took.
fn in_worker<S, B>(
    rt: &Runtime,
    iters: u64,
    service: S,
    body: Bytes,
    key: fn(u64) -> String,
) -> Duration
where
    S: HttpService<B>,
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: std::fmt::Debug,
{
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

// ---- the ratio table ----------------------------------------------------------------------

/// (group, target ratio) of every path.
const PATHS: &[(&str, f64)] = &[
    ("P1 replay, memory", 1.2),
    ("P1b replay vs cached", 3.0),
    ("P2 first execution, memory", 1.3),
    ("P3 1000 callers, one key, 20 ms body", 1.2),
    ("P5 replay, redis", 1.1),
    ("P6 first execution, redis", 2.2),
    ("P8a first execution, postgres", 2.2),
    ("P8b replay, postgres", 1.1),
    ("P9 key derivation", 1.3),
    ("P10 HTTP replay, memory, 1 KiB JSON", 1.3),
    ("P10b HTTP replay, fingerprint without the body", 1.3),
    ("P11 HTTP first execution, memory, 1 KiB JSON", 1.5),
];

/// Where criterion keeps its estimates: `$CRITERION_HOME`, else `<target>/criterion`.
fn criterion_home() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return home.into();
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("criterion")
}

/// The mean time of one benchmark, in nanoseconds, if it was measured by this run.
fn mean_ns(group: &str, function: &str, started: std::time::SystemTime) -> Option<f64> {
    let path = criterion_home()
        .join(group)
        .join(function)
        .join("new/estimates.json");
    let modified = std::fs::metadata(&path).and_then(|m| m.modified()).ok()?;
    if modified < started {
        return None; // left by an earlier run
    }
    let estimates: serde_json::Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    estimates["mean"]["point_estimate"].as_f64()
}

fn print_ratios(started: std::time::SystemTime) {
    println!(
        "\n{:<40} {:>11} {:>11} {:>6} {:>7}",
        "path (ratio = ours / baseline)", "ours", "baseline", "ratio", "target"
    );
    for (group, target) in PATHS {
        match (
            mean_ns(group, "ours", started),
            mean_ns(group, "baseline", started),
        ) {
            (Some(ours), Some(baseline)) => {
                let ratio = ours / baseline;
                let verdict = if ratio <= *target { "ok" } else { "MISSED" };
                println!(
                    "{group:<40} {:>11} {:>11} {ratio:>6.2} {target:>7.2} {verdict}",
                    human(ours),
                    human(baseline)
                );
            }
            _ => println!(
                "{group:<40} {:>11} {:>11} {:>6} {target:>7.2} not run",
                "-", "-", "-"
            ),
        }
    }
}

fn human(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.1} ns")
    }
}

fn main() {
    let started = std::time::SystemTime::now();
    let rt = Arc::new(common::runtime());
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    keys(&mut c);
    memory(&mut c, &rt);
    redis(&mut c, &rt);
    postgres(&mut c, &rt);
    http_layer(&mut c, &rt);
    c.final_summary();
    print_ratios(started);
}
