//! Every path of idem next to its baseline, in one run; then a table of ratios.
//!
//! `cargo bench -p idem-runtime --bench paths --all-features` (BENCHMARKS.md has the results).
//! Paths on Redis and PostgreSQL are skipped, with a message, when their server is
//! unreachable (`IDEM_REDIS_URL`, `IDEM_POSTGRES_URL`).

use std::convert::Infallible;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::Criterion;
use http_body_util::{BodyExt, Full};
use idem_runtime::http::IdempotencyLayer;
use idem_runtime::{
    idempotent, Error, MemoryStore, Operation, PostgresStore, RedisStore, TieredStore,
};
use sha2::{Digest, Sha256};
use tokio::runtime::Runtime;

use self::common::{receipt, Receipt};
use self::interleaved::{on, Ratio, Side};

mod common;
mod interleaved;

#[derive(Debug)]
struct BenchError;

impl From<Error> for BenchError {
    fn from(_: Error) -> Self {
        Self
    }
}

/// Fresh keys for paths that need one per iteration, unique across runs too (see
/// `common::run_start`).
static NEXT: LazyLock<AtomicU64> = LazyLock::new(|| AtomicU64::new(common::run_start()));

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

#[idempotent(key = order_id, store = store, namespace = "bench.tiered")]
async fn charge_tiered(
    store: &TieredStore<MemoryStore, PostgresStore>,
    order_id: u64,
) -> Result<Receipt, BenchError> {
    Ok(receipt(order_id))
}

#[idempotent(key = order_id, store = store, namespace = "bench.memory")]
async fn charge_memory(store: &MemoryStore, order_id: u64) -> Result<Receipt, BenchError> {
    Ok(receipt(order_id))
}

// ---- P1, P1b, P2, P3: the in-memory store ----------------------------------------------

fn memory(paths: &mut Paths, rt: &Runtime) {
    let store = MemoryStore::new();
    rt.block_on(charge(&store, 7, "cus_0042")).unwrap();
    let raw: moka::future::Cache<[u8; 32], bytes::Bytes> = moka::future::Cache::new(100_000);
    let json = bytes::Bytes::from(serde_json::to_vec(&receipt(7)).unwrap());
    rt.block_on(raw.insert(hand_key(7, "cus_0042", 0), json));
    let replay = || charge(&store, black_box(7), black_box("cus_0042"));

    paths.pair(
        "P1 replay, memory",
        on(rt, || async { replay().await.unwrap() }),
        on(rt, || async {
            let key = hand_key(black_box(7), black_box("cus_0042"), 0);
            let bytes = raw.get(&key).await.unwrap();
            serde_json::from_slice::<Receipt>(&bytes).unwrap()
        }),
    );

    rt.block_on(cached_charge(7, "cus_0042".into()));
    paths.pair(
        "P1b replay vs cached",
        on(rt, || async { replay().await.unwrap() }),
        on(rt, || cached_charge(black_box(7), "cus_0042".to_string())),
    );

    // The floor of P1b under this design: what any replay keyed by SHA-256 from a bounded,
    // expiring cache pays before its engine does anything (the key's hash, a moka lookup, the
    // value's clone), against the same `cached` hit.
    let floor: moka::sync::Cache<[u8; 32], std::sync::Arc<Receipt>> =
        moka::sync::Cache::new(100_000);
    floor.insert(hand_key(7, "cus_0042", 0), std::sync::Arc::new(receipt(7)));
    paths.pair(
        "P1f the floor of a replay vs cached",
        on(rt, || async {
            let key = hand_key(black_box(7), black_box("cus_0042"), 0);
            Receipt::clone(&floor.get(&key).unwrap())
        }),
        on(rt, || cached_charge(black_box(7), "cus_0042".to_string())),
    );

    paths.pair(
        "P2 first execution, memory",
        on(rt, || async {
            charge(&store, fresh(), "cus_0042").await.unwrap()
        }),
        on(rt, || async {
            let id = fresh();
            let key = hand_key(id, "cus_0042", 0);
            raw.insert(key, bytes::Bytes::from_static(b"claimed")).await;
            let value = serde_json::to_vec(&receipt(id)).unwrap();
            raw.insert(key, bytes::Bytes::from(value)).await;
        }),
    );

    let ours = |key| {
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
    };
    let cache: moka::future::Cache<u64, Receipt> = moka::future::Cache::new(100_000);
    let baseline = |key| {
        let cache = cache.clone();
        async move {
            cache
                .get_with(key, async {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    receipt(key)
                })
                .await
        }
    };
    paths.slow_pair(
        "P3 1000 callers, one key, 20 ms body",
        on(rt, || thousand_callers(ours)),
        on(rt, || thousand_callers(baseline)),
    );
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

fn redis(paths: &mut Paths, rt: &Runtime) {
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

    paths.pair(
        "P5 replay, redis",
        on(rt, || async {
            charge_redis(&store, replay_id).await.unwrap()
        }),
        on(rt, || async {
            let mut con = manager.clone();
            redis::cmd("GET")
                .arg(raw_key)
                .query_async::<Vec<u8>>(&mut con)
                .await
                .unwrap()
        }),
    );

    // P6's baseline, and P6f's.
    let raw_set = || async {
        let mut con = manager.clone();
        let key = format!("idem-bench:raw:{}", fresh());
        redis::cmd("SET")
            .arg(&key)
            .arg(&json)
            .arg("NX")
            .arg("PX")
            .arg(60_000)
            .query_async::<Option<String>>(&mut con)
            .await
            .unwrap()
    };
    paths.pair(
        "P6 first execution, redis",
        on(rt, || async {
            charge_redis(&store, fresh()).await.unwrap()
        }),
        on(rt, raw_set),
    );
    // The floor of P6 on Redis 7.0, written by hand: a claim that returns what is there,
    // then the result set only while the claim is still the holder's. Two round trips.
    paths.pair(
        "P6f floor of a first execution: claim + compare-and-set vs SET",
        on(rt, || async {
            let mut con = manager.clone();
            let n = fresh();
            let key = common::redis_floor::key(n);
            assert!(common::redis_floor::claim(&mut con, &key, n)
                .await
                .is_none());
            assert!(common::redis_floor::complete(&mut con, &key, n, &json).await);
        }),
        on(rt, raw_set),
    );
}

// ---- P8: PostgreSQL ----------------------------------------------------------------------

fn postgres(paths: &mut Paths, rt: &Runtime) {
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
    // The store opens its second pool (completions) lazily, which needs the runtime.
    let _runtime = rt.enter();
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

    paths.pair(
        "P8a first execution, postgres",
        on(rt, || async { charge_postgres(&store, fresh()).await.unwrap() }),
        on(rt, || async {
            let key = hand_key(fresh(), "raw", 0);
            sqlx::query_as::<_, (Vec<u8>,)>(
                "INSERT INTO idem_bench_raw VALUES ($1, $2, now() + interval '1 hour') \
                 ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value WHERE idem_bench_raw.expires_at <= now() \
                 RETURNING key",
            )
            .bind(&key[..])
            .bind(&json)
            .fetch_optional(&pool)
            .await
            .unwrap()
        }),
    );

    // P8b's baseline, and P8g's: the record read by its key.
    let raw_select = || async {
        sqlx::query_as::<_, (Vec<u8>,)>("SELECT value FROM idem_bench_raw WHERE key = $1")
            .bind(&raw_key[..])
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    paths.pair(
        "P8b replay, postgres",
        on(rt, || async {
            charge_postgres(&store, replay_id).await.unwrap()
        }),
        on(rt, raw_select),
    );
    // P13: a PostgreSQL replay through a memory tier in front, against a memory store's
    // replay and against the bare PostgreSQL replay of P8b. The tier's record was copied
    // into its memory tier by the first replay.
    let tiered = TieredStore::new(MemoryStore::new(), store.clone());
    let memory = MemoryStore::new();
    rt.block_on(async {
        charge_tiered(&tiered, replay_id).await.unwrap();
        assert!(charge_tiered(&tiered, replay_id).await.is_ok());
        charge_memory(&memory, replay_id).await.unwrap();
    });
    paths.pair(
        "P13a replay through a memory tier vs a memory replay",
        on(rt, || async {
            charge_tiered(&tiered, replay_id).await.unwrap()
        }),
        on(rt, || async {
            charge_memory(&memory, replay_id).await.unwrap()
        }),
    );
    paths.pair(
        "P13b replay through a memory tier vs a PostgreSQL replay",
        on(rt, || async {
            charge_tiered(&tiered, replay_id).await.unwrap()
        }),
        on(rt, || async {
            charge_postgres(&store, replay_id).await.unwrap()
        }),
    );
    // The floors of P8a and P8b under any design that keeps idem's guarantees, written by
    // hand on the baselines' own table. A first execution must commit its claim before the
    // body runs (else a crash forgets it and a retry runs the body beside it) and commit its
    // result after: two commits where the baseline has one.
    paths.pair(
        "P8f floor of a first execution: INSERT + UPDATE vs INSERT",
        on(rt, || async {
            let key = hand_key(fresh(), "raw", 0);
            sqlx::query("INSERT INTO idem_bench_raw VALUES ($1, NULL, now() + interval '1 minute') ON CONFLICT DO NOTHING")
                .bind(&key[..])
                .execute(&pool)
                .await
                .unwrap();
            sqlx::query("UPDATE idem_bench_raw SET value = $2, expires_at = now() + interval '1 hour' WHERE key = $1")
                .bind(&key[..])
                .bind(&json)
                .execute(&pool)
                .await
                .unwrap()
        }),
        on(rt, || async {
            let key = hand_key(fresh(), "raw", 0);
            sqlx::query("INSERT INTO idem_bench_raw VALUES ($1, $2, now() + interval '1 hour') ON CONFLICT DO NOTHING")
                .bind(&key[..])
                .bind(&json)
                .execute(&pool)
                .await
                .unwrap()
        }),
    );
    // A replay is the claim's statement finding a record: one round trip that reads the
    // record or, if there is none, claims the key. The least such a statement is, with no
    // token, fingerprint or expiry: it may write, so the server sets up the insert even
    // when it only reads.
    paths.pair(
        "P8g floor of a replay: read-or-claim in one statement vs SELECT",
        on(rt, || async {
            sqlx::query_as::<_, (Option<Vec<u8>>,)>(
                "WITH live AS (SELECT value FROM idem_bench_raw WHERE key = $1), \
                 claimed AS (INSERT INTO idem_bench_raw \
                    SELECT $1, NULL, now() + interval '1 minute' WHERE NOT EXISTS (SELECT 1 FROM live) \
                    ON CONFLICT DO NOTHING RETURNING value) \
                 SELECT value FROM live UNION ALL SELECT value FROM claimed",
            )
            .bind(&raw_key[..])
            .fetch_one(&pool)
            .await
            .unwrap()
        }),
        on(rt, raw_select),
    );
    transfers(paths, rt, &store, &pool);
    rt.block_on(async {
        let _ = store.purge_expired().await;
        let _ = sqlx::query("DELETE FROM idem_bench_raw")
            .execute(&pool)
            .await;
        let _ = sqlx::query("DROP TABLE idem_bench_ledger")
            .execute(&pool)
            .await;
    });
}

// ---- P12: a transfer in the caller's transaction ------------------------------------------

/// The transfer both sides make: two `UPDATE`s of a ledger, on the caller's connection.
async fn transfer(tx: &mut sqlx::PgConnection) -> Result<u64, Error> {
    for (id, delta) in [(1, -1_i64), (2, 1)] {
        sqlx::query("UPDATE idem_bench_ledger SET balance = balance + $1 WHERE id = $2")
            .bind(delta)
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(Error::store)?;
    }
    Ok(1)
}

fn transfers(paths: &mut Paths, rt: &Runtime, store: &PostgresStore, pool: &sqlx::PgPool) {
    rt.block_on(async {
        sqlx::query("CREATE TABLE IF NOT EXISTS idem_bench_ledger (id int PRIMARY KEY, balance bigint NOT NULL)")
            .execute(pool)
            .await
            .unwrap();
        sqlx::query("INSERT INTO idem_bench_ledger VALUES (1, 0), (2, 0) ON CONFLICT DO NOTHING")
            .execute(pool)
            .await
            .unwrap();
    });
    let op = Operation::new("bench.transfer");
    // Ours: the claim, the transfer and the record, all in the caller's one transaction.
    let in_transaction = || async {
        let key = op.key(&fresh()).unwrap();
        let mut tx = pool.begin().await.unwrap();
        let outcome = op
            .run_in_transaction(store, &mut tx, &key, None, async |tx| transfer(tx).await)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        outcome
    };
    paths.pair(
        "P12a transfer in a transaction, postgres",
        on(rt, in_transaction),
        on(rt, || async {
            let mut tx = pool.begin().await.unwrap();
            let moved = transfer(&mut tx).await.unwrap();
            tx.commit().await.unwrap();
            moved
        }),
    );
    // The floor of P12a: a claim must reach the server before the body runs, and the record
    // after it, inside the caller's transaction: two more round trips, here empty ones.
    paths.pair(
        "P12f floor: the transaction with two empty round trips vs without",
        on(rt, || async {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
            let moved = transfer(&mut tx).await.unwrap();
            sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
            tx.commit().await.unwrap();
            moved
        }),
        on(rt, || async {
            let mut tx = pool.begin().await.unwrap();
            let moved = transfer(&mut tx).await.unwrap();
            tx.commit().await.unwrap();
            moved
        }),
    );
    // The same transfer through the store's own claims: claim, the transaction, complete.
    paths.pair(
        "P12b same, against the non-transactional store",
        on(rt, in_transaction),
        on(rt, || async {
            let key = op.key(&fresh()).unwrap();
            op.run(store, &key, None, async {
                let mut tx = pool.begin().await.map_err(Error::store)?;
                let moved = transfer(&mut tx).await?;
                tx.commit().await.map_err(Error::store)?;
                Ok::<_, Error>(moved)
            })
            .await
            .unwrap()
        }),
    );
}

// ---- P9: key derivation -------------------------------------------------------------------

fn keys(paths: &mut Paths) {
    paths.pair(
        "P9 key derivation",
        sync(|| {
            Operation::new("bench.key")
                .key(black_box(&(42_u64, "cus_0042", 3_u32)))
                .unwrap()
        }),
        sync(|| hand_key(black_box(42), black_box("cus_0042"), black_box(3))),
    );
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

fn http_layer(paths: &mut Paths, rt: &Runtime) {
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

// ---- the harness ---------------------------------------------------------------------------

/// A side that calls `call` once per iteration.
fn sync<T>(mut call: impl FnMut() -> T) -> impl Side {
    move |iters| {
        let started = Instant::now();
        for _ in 0..iters {
            black_box(call());
        }
        started.elapsed()
    }
}

/// Every path measured twice: by criterion, ours then the baseline (absolute times, and the
/// ratio as most benches report it), and interleaved (the ratio this file is judged by).
struct Paths {
    criterion: Criterion,
    measured: Vec<Measured>,
}

struct Measured {
    group: &'static str,
    /// Criterion's mean of ours over its mean of the baseline, measured one after the other.
    sequential: Option<f64>,
    interleaved: Ratio,
}

impl Paths {
    /// How long the interleaved measurement of one path runs.
    const BUDGET: Duration = Duration::from_secs(3);

    fn pair(&mut self, group: &'static str, ours: impl Side, baseline: impl Side) {
        self.measure(group, None, ours, baseline);
    }

    /// A path of many milliseconds per call: fewer criterion samples.
    fn slow_pair(&mut self, group: &'static str, ours: impl Side, baseline: impl Side) {
        self.measure(group, Some(10), ours, baseline);
    }

    fn measure(
        &mut self,
        group: &'static str,
        samples: Option<usize>,
        mut ours: impl Side,
        mut baseline: impl Side,
    ) {
        let started = std::time::SystemTime::now();
        let mut ran = false;
        let mut criterion_group = self.criterion.benchmark_group(group);
        if let Some(samples) = samples {
            criterion_group.sample_size(samples);
        }
        criterion_group.bench_function("ours", |b| {
            ran = true;
            b.iter_custom(&mut ours)
        });
        criterion_group.bench_function("baseline", |b| b.iter_custom(&mut baseline));
        criterion_group.finish();
        if !ran {
            return; // filtered out
        }
        let sequential = mean_ns(group, "ours", started)
            .zip(mean_ns(group, "baseline", started))
            .map(|(ours, baseline)| ours / baseline);
        let interleaved = interleaved::measure(&mut ours, &mut baseline, Self::BUDGET);
        println!(
            "{group}: interleaved {:.2} [{:.2} – {:.2}] over {} pairs",
            interleaved.median, interleaved.low, interleaved.high, interleaved.pairs
        );
        self.measured.push(Measured {
            group,
            sequential,
            interleaved,
        });
    }

    fn print_ratios(&self) {
        println!(
            "\n{:<48} {:>10} {:>10} {:>6} {:>6} {:>13} {:>6}",
            "path (ratio = ours / baseline)",
            "ours",
            "baseline",
            "seq.",
            "ratio",
            "p10 – p90",
            "target"
        );
        for (group, target) in PATHS {
            let Some(m) = self.measured.iter().find(|m| m.group == *group) else {
                println!("{group:<48} not run");
                continue;
            };
            let r = m.interleaved;
            let verdict = if r.median <= *target { "ok" } else { "MISSED" };
            let sequential = m.sequential.map_or("-".into(), |s| format!("{s:.2}"));
            println!(
                "{group:<48} {:>10} {:>10} {sequential:>6} {:>6.2} {:>13} {target:>6.2} {verdict}",
                human(r.ours),
                human(r.baseline),
                r.median,
                format!("{:.2} – {:.2}", r.low, r.high),
            );
        }
    }
}

// ---- the ratio table ----------------------------------------------------------------------

/// (group, target ratio) of every path.
const PATHS: &[(&str, f64)] = &[
    ("P1 replay, memory", 1.2),
    ("P1b replay vs cached", 2.0),
    ("P1f the floor of a replay vs cached", 2.0),
    ("P2 first execution, memory", 1.3),
    ("P3 1000 callers, one key, 20 ms body", 1.2),
    ("P5 replay, redis", 1.1),
    ("P6 first execution, redis", 2.2),
    (
        "P6f floor of a first execution: claim + compare-and-set vs SET",
        2.2,
    ),
    ("P8a first execution, postgres", 2.0),
    ("P8b replay, postgres", 1.1),
    (
        "P8f floor of a first execution: INSERT + UPDATE vs INSERT",
        2.0,
    ),
    (
        "P8g floor of a replay: read-or-claim in one statement vs SELECT",
        1.1,
    ),
    ("P9 key derivation", 1.3),
    ("P10 HTTP replay, memory, 1 KiB JSON", 1.3),
    ("P10b HTTP replay, fingerprint without the body", 1.3),
    ("P10c HTTP replay, against a body-hashing baseline", 1.5),
    ("P11 HTTP first execution, memory, 1 KiB JSON", 1.5),
    ("P12a transfer in a transaction, postgres", 1.4),
    ("P12b same, against the non-transactional store", 1.0),
    ("P13a replay through a memory tier vs a memory replay", 1.2),
    (
        "P13b replay through a memory tier vs a PostgreSQL replay",
        0.1,
    ),
    (
        "P12f floor: the transaction with two empty round trips vs without",
        1.4,
    ),
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

/// The mean time of one benchmark, in nanoseconds, if it was measured since `started`.
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

fn human(time: Duration) -> String {
    let ns = time.as_secs_f64() * 1e9;
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.1} ns")
    }
}

fn main() {
    let rt = Arc::new(common::runtime());
    let criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let mut paths = Paths {
        criterion,
        measured: Vec::new(),
    };
    keys(&mut paths);
    memory(&mut paths, &rt);
    redis(&mut paths, &rt);
    postgres(&mut paths, &rt);
    http_layer(&mut paths, &rt);
    paths.criterion.final_summary();
    paths.print_ratios();
}
