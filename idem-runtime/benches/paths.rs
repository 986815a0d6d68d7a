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
use idem_runtime::store::memory;
use idem_runtime::{
    idempotent, Error, MemoryStore, Operation, PostgresStore, RedisStore, TieredStore,
};
use tokio::runtime::Runtime;

use self::calls::{cached_charge, charge, charge_redis, hand_key, BenchError};
use self::common::{receipt, Receipt};
use self::interleaved::{on, Ratio, Side};

#[path = "common/http.rs"]
mod baselines;
#[path = "common/calls.rs"]
mod calls;
mod common;
#[path = "paths/harness.rs"]
mod harness;
#[path = "paths/http.rs"]
mod http_layer;
mod interleaved;
#[path = "paths/postgres.rs"]
mod postgres;

use self::harness::{sync, Paths};

/// Fresh keys for paths that need one per iteration, unique across runs too (see
/// `common::run_start`).
static NEXT: LazyLock<AtomicU64> = LazyLock::new(|| AtomicU64::new(common::run_start()));

fn fresh() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

// ---- the functions under test ---------------------------------------------------------

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

/// The least a first execution in memory costs under idem's guarantees, by hand (P2f): the
/// claim in a map of claims in progress, which nothing evicts (a cache could drop a claim
/// and let a duplicate run); the result encoded and decoded once, so that what is recorded
/// is known to replay; the result kept for its own TTL, within a bound of bytes, least
/// recently used first; and a mark of the key that outlives an eviction of its result, so
/// that the key answers `Gone` instead of running again. No engine: no flights, no
/// fingerprint, no metrics, no span, no lease.
struct FirstFloor {
    claims: std::sync::Mutex<std::collections::HashMap<[u8; 32], u64>>,
    results: moka::sync::Cache<[u8; 32], FloorRecord>,
    marks: std::sync::Mutex<FloorMarks>,
    tokens: AtomicU64,
}

/// A result as `FirstFloor` keeps it: the encoding, the value, the TTL.
type FloorRecord = Arc<(Bytes, Receipt, Duration)>;

/// `FirstFloor`'s marks: each key's end, and the keys in the order they were marked.
type FloorMarks = (
    std::collections::HashMap<[u8; 32], Instant>,
    std::collections::VecDeque<[u8; 32]>,
);

/// `FirstFloor`'s expiry: each result's own TTL.
struct OwnTtl;

impl moka::Expiry<[u8; 32], FloorRecord> for OwnTtl {
    fn expire_after_create(
        &self,
        _: &[u8; 32],
        record: &FloorRecord,
        _: Instant,
    ) -> Option<Duration> {
        Some(record.2)
    }
}

impl FirstFloor {
    /// The memory store's default bound on marks.
    const MARKS: usize = (memory::DEFAULT_MAX_MARK_BYTES / memory::MARK_BYTES) as usize;

    fn new() -> Self {
        // As the store weighs a result by default: twice its encoding (the value is kept
        // beside it) and the entry's 160 bytes, at least a `DEFAULT_CAPACITY`th of the bound.
        let least = (memory::DEFAULT_MAX_BYTES / memory::DEFAULT_CAPACITY) as u32;
        Self {
            claims: Default::default(),
            results: moka::sync::Cache::builder()
                .max_capacity(memory::DEFAULT_MAX_BYTES)
                .weigher(move |_, record: &FloorRecord| {
                    (record.0.len() as u32 * 2 + 160).max(least)
                })
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .expire_after(OwnTtl)
                .build(),
            marks: Default::default(),
            tokens: AtomicU64::new(0),
        }
    }

    fn first(&self, id: u64) -> Receipt {
        let key = hand_key(id, "cus_0042", 0);
        let token = self.tokens.fetch_add(1, Ordering::Relaxed);
        self.claims.lock().unwrap().insert(key, token);
        let value = receipt(id);
        let json = Bytes::from(serde_json::to_vec(&value).unwrap());
        serde_json::from_slice::<Receipt>(&json).unwrap();
        let ttl = Duration::from_secs(86_400);
        let mut claims = self.claims.lock().unwrap();
        {
            let (marks, order) = &mut *self.marks.lock().unwrap();
            if marks.len() >= Self::MARKS {
                if let Some(oldest) = order.pop_front() {
                    marks.remove(&oldest);
                }
            }
            marks.insert(key, Instant::now() + ttl);
            order.push_back(key);
        }
        self.results
            .insert(key, Arc::new((json, value.clone(), ttl)));
        claims.remove(&key);
        value
    }
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

    // The same floor from a cache configured as the memory store's (each entry expiring
    // after its own TTL, least recently used evicted first, weighed in bytes): a replay
    // there reads the clock and records the read for the LRU order, as the store's does.
    let kept = FirstFloor::new();
    kept.first(7);
    paths.pair(
        "P1g floor of a replay from the store's cache vs cached",
        on(rt, || async {
            let key = hand_key(black_box(7), black_box("cus_0042"), 0);
            Receipt::clone(&kept.results.get(&key).unwrap().1)
        }),
        on(rt, || cached_charge(black_box(7), "cus_0042".to_string())),
    );

    // P2's baseline, and P2f's: a claim and a record as two bare moka inserts.
    let two_inserts = || async {
        let id = fresh();
        let key = hand_key(id, "cus_0042", 0);
        raw.insert(key, bytes::Bytes::from_static(b"claimed")).await;
        let value = serde_json::to_vec(&receipt(id)).unwrap();
        raw.insert(key, bytes::Bytes::from(value)).await;
    };
    paths.pair(
        "P2 first execution, memory",
        on(rt, || async {
            charge(&store, fresh(), "cus_0042").await.unwrap()
        }),
        on(rt, two_inserts),
    );

    // The floor of P2: what a first execution in memory does to keep idem's guarantees,
    // written by hand against the same baseline (`FirstFloor`, below).
    let floor = FirstFloor::new();
    paths.pair(
        "P2f floor of a first execution in memory",
        on(rt, || async { floor.first(fresh()) }),
        on(rt, two_inserts),
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

fn main() {
    let rt = Arc::new(common::runtime());
    let criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let mut paths = Paths::new(criterion);
    keys(&mut paths);
    memory(&mut paths, &rt);
    redis(&mut paths, &rt);
    postgres::postgres(&mut paths, &rt);
    http_layer::http_layer(&mut paths, &rt);
    paths.finish();
}
