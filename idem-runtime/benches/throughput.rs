//! Throughput under concurrency: 64 callers on distinct keys, against raw clients doing the
//! same round trips on the same connection or pool.
//!
//! `cargo bench -p idem-runtime --bench throughput --all-features`. Each configuration runs
//! rounds of ours and the baseline alternately (ours, baseline, ours, …), so that load drifting
//! during the run lands on both; the table shows the median of each side's rounds.
//!
//! - Redis first executions: ours (a claim script, then a complete script) against
//!   `SET key NX PX` then `SET key value PX`. Replays: ours against `GET`.
//! - PostgreSQL first executions: ours (the claim statement, then the complete statement)
//!   against a prepared `INSERT … ON CONFLICT DO NOTHING` then an `UPDATE`, on the same pool.
//!   Replays: ours against a `SELECT` by key. Pool size and `synchronous_commit` vary.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use idem_runtime::{Error, Operation, PostgresStore, RedisStore, Store};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use self::common::receipt;

mod common;

const CALLERS: u64 = 64;
const PER_CALLER: u64 = 50;
const ROUNDS: usize = 3;
/// The numbers of the keys the replay rounds read, apart from every fresh one.
const REPLAYED: u64 = 1 << 40;
/// How many keys the replay rounds read.
const RECORDED: u64 = CALLERS * PER_CALLER;

/// Fresh numbers, unique across runs (see `common::run_start`).
static NEXT: LazyLock<AtomicU64> = LazyLock::new(|| AtomicU64::new(common::run_start()));

/// Operations per second of 64 callers each running `op` on `PER_CALLER` fresh numbers.
async fn ops_per_second<F, Fut>(op: F) -> f64
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let started = Instant::now();
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let op = op.clone();
            tokio::spawn(async move {
                for _ in 0..PER_CALLER {
                    op(NEXT.fetch_add(1, Ordering::Relaxed)).await;
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
    (CALLERS * PER_CALLER) as f64 / started.elapsed().as_secs_f64()
}

/// Calls of `op` on `store`, on the key of `which(n)` for each number `n` they are handed.
fn idempotent_calls<S: Store + Clone>(
    op: &Arc<Operation>,
    store: &S,
    which: fn(u64) -> u64,
) -> impl Fn(u64) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Clone + Send + 'static {
    let (op, store) = (op.clone(), store.clone());
    move |n: u64| {
        let (op, store) = (op.clone(), store.clone());
        Box::pin(async move {
            let key = op.key(&which(n)).unwrap();
            let _ = op
                .run(
                    &store,
                    &key,
                    None,
                    async move { Ok::<_, Error>(receipt(n)) },
                )
                .await
                .unwrap();
        })
    }
}

/// A fresh key per call.
fn fresh(n: u64) -> u64 {
    n
}

/// One of the keys recorded for the replay rounds.
fn recorded(n: u64) -> u64 {
    REPLAYED + n % RECORDED
}

/// Compares first executions, then records the keys the replay rounds read, on both sides.
async fn first_executions<A, AF, B, BF>(label: &str, ours: A, baseline: B)
where
    A: Fn(u64) -> AF + Clone + Send + 'static,
    AF: Future<Output = ()> + Send,
    B: Fn(u64) -> BF + Clone + Send + 'static,
    BF: Future<Output = ()> + Send,
{
    compare(label, ours.clone(), baseline.clone()).await;
    for n in 0..RECORDED {
        ours(REPLAYED + n).await;
        baseline(REPLAYED + n).await;
    }
}

/// Median rounds of ours and the baseline, run alternately; prints one table row.
async fn compare<A, AF, B, BF>(label: &str, ours: A, baseline: B)
where
    A: Fn(u64) -> AF + Clone + Send + 'static,
    AF: Future<Output = ()> + Send,
    B: Fn(u64) -> BF + Clone + Send + 'static,
    BF: Future<Output = ()> + Send,
{
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        a.push(ops_per_second(ours.clone()).await);
        b.push(ops_per_second(baseline.clone()).await);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (ours, base) = (median(&mut a), median(&mut b));
    let ratio = ours / base;
    println!(
        "{label:<52} {ours:>9.0} {base:>9.0} {ratio:>6.2} {}",
        if ratio >= 0.8 {
            "ok"
        } else {
            "MISSED (≥ 0.8)"
        }
    );
}

async fn redis() {
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let Ok(store) = RedisStore::connect(&url).await else {
        println!("redis: skipped ({url} unreachable)");
        return;
    };
    let raw = redis::aio::ConnectionManager::new(redis::Client::open(url.as_str()).unwrap())
        .await
        .unwrap();
    let op = Arc::new(Operation::new(format!(
        "throughput.redis.{:?}",
        Instant::now()
    )));
    let value = serde_json::to_vec(&receipt(1)).unwrap();

    let first = idempotent_calls(&op, &store, fresh);
    let base_first = {
        let (raw, value) = (raw.clone(), value.clone());
        move |n: u64| {
            let (mut raw, value) = (raw.clone(), value.clone());
            async move {
                let key = format!("throughput:{n}");
                let _: Option<String> = redis::cmd("SET")
                    .arg(&key)
                    .arg("p")
                    .arg("NX")
                    .arg("PX")
                    .arg(30_000)
                    .query_async(&mut raw)
                    .await
                    .unwrap();
                let _: () = redis::cmd("SET")
                    .arg(&key)
                    .arg(&value)
                    .arg("PX")
                    .arg(60_000)
                    .query_async(&mut raw)
                    .await
                    .unwrap();
            }
        }
    };
    first_executions("redis, first executions, 64 callers", first, base_first).await;
    let replay = idempotent_calls(&op, &store, recorded);
    let base_replay = move |n: u64| {
        let mut raw = raw.clone();
        async move {
            let _: Option<Vec<u8>> = redis::cmd("GET")
                .arg(format!("throughput:{}", REPLAYED + n % RECORDED))
                .query_async(&mut raw)
                .await
                .unwrap();
        }
    };
    compare("redis, replays, 64 callers", replay, base_replay).await;
}

async fn postgres(pool_size: u32, synchronous_commit: bool) {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let Ok(options) = url.parse::<PgConnectOptions>() else {
        return;
    };
    let options = options.options([(
        "synchronous_commit",
        if synchronous_commit { "on" } else { "off" },
    )]);
    let Ok(pool) = PgPoolOptions::new()
        .max_connections(pool_size)
        .connect_with(options)
        .await
    else {
        println!("postgresql: skipped ({url} unreachable)");
        return;
    };
    let store = PostgresStore::from_pool(pool.clone())
        .with_table("idem_records_throughput")
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS throughput_baseline \
         (key bigint PRIMARY KEY, completed boolean NOT NULL, value bytea, expires_at timestamptz NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let label = |what: &str| {
        format!(
            "postgres, {what}, pool {pool_size}, synchronous_commit {}",
            if synchronous_commit { "on" } else { "off" }
        )
    };
    let op = Arc::new(Operation::new(format!(
        "throughput.pg.{:?}",
        Instant::now()
    )));
    let first = idempotent_calls(&op, &store, fresh);
    let base_first = {
        let pool = pool.clone();
        move |n: u64| {
            let pool = pool.clone();
            async move {
                sqlx::query(
                    "INSERT INTO throughput_baseline (key, completed, expires_at) \
                     VALUES ($1, false, now() + interval '30 seconds') ON CONFLICT (key) DO NOTHING",
                )
                .bind(n as i64)
                .execute(&pool)
                .await
                .unwrap();
                sqlx::query(
                    "UPDATE throughput_baseline SET completed = true, value = $2, \
                     expires_at = now() + interval '1 day' WHERE key = $1",
                )
                .bind(n as i64)
                .bind(serde_json::to_vec(&receipt(n)).unwrap())
                .execute(&pool)
                .await
                .unwrap();
            }
        }
    };
    first_executions(&label("first executions"), first, base_first).await;
    let replay = idempotent_calls(&op, &store, recorded);
    let base_replay = move |n: u64| {
        let pool = pool.clone();
        async move {
            let _: Option<(bool, Option<Vec<u8>>)> = sqlx::query_as(
                "SELECT completed, value FROM throughput_baseline WHERE key = $1 AND expires_at > now()",
            )
            .bind((REPLAYED + n % RECORDED) as i64)
            .fetch_optional(&pool)
            .await
            .unwrap();
        }
    };
    compare(&label("replays"), replay, base_replay).await;
}

fn main() {
    let rt = common::runtime();
    println!(
        "\n{:<52} {:>9} {:>9} {:>6}",
        "(operations per second; ratio = ours / baseline)", "ours", "baseline", "ratio"
    );
    rt.block_on(async {
        redis().await;
        postgres(16, true).await;
        postgres(64, true).await;
        postgres(16, false).await;
    });
}
