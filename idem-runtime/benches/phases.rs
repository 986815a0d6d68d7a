//! Where a first execution's time goes, phase by phase, against raw round trips.
//!
//! `cargo bench -p idem-runtime --bench phases --all-features`. One first execution on
//! Redis and on PostgreSQL is cut into its store calls (the claim, the completion) and the
//! rest (key, engine, JSON); each phase is measured interleaved against the raw command
//! that does the same round trip. On Redis the server's own time per command comes from
//! `INFO commandstats`, so a phase's cost splits into server time and everything else
//! (client, network, scheduling).

use idem_runtime::ClaimRequest;
use std::future::Future;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use idem_runtime::{Claim, Error, Operation, PostgresStore, RedisStore, Store, Token};
use tokio::runtime::Runtime;

use self::common::receipt;
use self::interleaved::{Ratio, Side};

mod common;
mod interleaved;

static NEXT: LazyLock<AtomicU64> = LazyLock::new(|| AtomicU64::new(common::run_start()));

fn fresh() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(600);
const BUDGET: Duration = Duration::from_secs(2);

/// A side that awaits `call` once per iteration; `call` returns the time of the part it
/// measures, so that set-up in the same iteration (claiming the key a completion needs)
/// stays out of it.
fn timed<'a, F, Fut>(rt: &'a Runtime, mut call: F) -> impl Side + 'a
where
    F: FnMut() -> Fut + 'a,
    Fut: Future<Output = Duration>,
{
    move |iters| {
        rt.block_on(async {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                total += call().await;
            }
            total
        })
    }
}

/// How long `f` took.
async fn time<T>(f: impl Future<Output = T>) -> Duration {
    let started = Instant::now();
    black_box(f.await);
    started.elapsed()
}

fn row(phase: &str, r: &Ratio) {
    println!(
        "{phase:<44} {:>9.1} µs {:>9.1} µs {:>+9.1} µs {:>6.2} [{:.2} – {:.2}], {} pairs",
        r.ours.as_secs_f64() * 1e6,
        r.baseline.as_secs_f64() * 1e6,
        (r.ours.as_secs_f64() - r.baseline.as_secs_f64()) * 1e6,
        r.median,
        r.low,
        r.high,
        r.pairs
    );
}

fn header(store: &str) {
    println!(
        "\n{:<44} {:>12} {:>12} {:>12} {:>6}",
        format!("{store}: phase (ours vs raw)"),
        "ours",
        "raw",
        "extra",
        "ratio [p10 – p90]"
    );
}

async fn claimed<S: Store>(store: &S, op: &Operation) -> (idem_runtime::Key, Token) {
    let key = op.key(&fresh()).unwrap();
    match store.claim(&ClaimRequest::new(&key, LEASE)).await.unwrap() {
        Claim::Acquired { token, .. } => (key, token),
        other => panic!("a fresh key was not free: {other:?}"),
    }
}

/// A first execution of `op` on `store`, with a fresh key.
async fn first_execution<S: Store + Clone>(store: &S, op: &Operation) {
    let key = op.key(&fresh()).unwrap();
    let outcome = op.run(store, &key, None, async { Ok::<_, Error>(receipt(1)) });
    let _ = black_box(outcome.await.unwrap());
}

/// The raw counterparts of a first execution's phases, and how to name them.
struct Raw<W, C, K> {
    whole: (&'static str, W),
    claim: (&'static str, C),
    complete: (&'static str, K),
}

/// Measures a first execution on `store` and its two store calls, each interleaved against
/// its raw counterpart, prints a row each, and what is left for the rest of the call.
fn phases<S, W, C, K>(rt: &Runtime, store: &S, op: &Operation, raw: Raw<W, C, K>)
where
    S: Store + Clone,
    W: Side,
    C: Side,
    K: Side,
{
    let Raw {
        whole: (whole_label, mut raw_whole),
        claim: (claim_label, mut raw_claim),
        complete: (complete_label, mut raw_complete),
    } = raw;
    let record = bytes::Bytes::from(serde_json::to_vec(&receipt(1)).unwrap());
    let whole = interleaved::measure(
        &mut timed(rt, || time(first_execution(store, op))),
        &mut raw_whole,
        BUDGET,
    );
    row(whole_label, &whole);
    let claim = interleaved::measure(
        &mut timed(rt, || time(claimed(store, op))),
        &mut raw_claim,
        BUDGET,
    );
    row(claim_label, &claim);
    let complete = interleaved::measure(
        &mut timed(rt, || async {
            let (key, token) = claimed(store, op).await;
            time(store.complete(&key, token, record.clone(), TTL)).await
        }),
        &mut raw_complete,
        BUDGET,
    );
    row(complete_label, &complete);
    let rest = whole.ours.as_secs_f64() - claim.ours.as_secs_f64() - complete.ours.as_secs_f64();
    println!(
        "  the rest of ours (key, engine, JSON): {:.1} µs",
        rest * 1e6
    );
}

fn redis(rt: &Runtime) {
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let Ok(manager) = rt.block_on(async {
        redis::aio::ConnectionManager::new(redis::Client::open(url.as_str())?).await
    }) else {
        return println!("redis: skipped ({url} unreachable)");
    };
    let store = RedisStore::from_manager(manager.clone())
        .with_prefix("idem-phases:")
        .unwrap();
    let op = Operation::new("bench.phases").ttl(TTL).lease(LEASE);
    let json = serde_json::to_vec(&receipt(1)).unwrap();
    let raw_set = |nx: bool| {
        let mut con = manager.clone();
        let json = json.clone();
        async move {
            let mut cmd = redis::cmd("SET");
            cmd.arg(format!("idem-phases:raw:{}", fresh())).arg(&json);
            if nx {
                cmd.arg("NX");
            }
            cmd.arg("PX")
                .arg(60_000)
                .query_async::<Option<String>>(&mut con)
                .await
                .unwrap()
        }
    };
    header("redis");
    phases(
        rt,
        &store,
        &op,
        Raw {
            whole: (
                "first execution vs SET NX PX + SET PX",
                timed(rt, || {
                    time(async { (raw_set(true).await, raw_set(false).await) })
                }),
            ),
            claim: (
                "  claim script vs SET NX PX",
                timed(rt, || time(raw_set(true))),
            ),
            complete: (
                "  complete script vs SET PX",
                timed(rt, || time(raw_set(false))),
            ),
        },
    );

    // The server's side: microseconds per command, from Redis itself.
    let server = rt.block_on(async {
        let mut con = manager.clone();
        redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async::<()>(&mut con)
            .await
            .unwrap();
        for _ in 0..2000 {
            first_execution(&store, &op).await;
            raw_set(true).await;
            raw_set(false).await;
        }
        redis::cmd("INFO")
            .arg("commandstats")
            .query_async::<String>(&mut con)
            .await
            .unwrap()
    });
    println!("  server time per command (INFO commandstats, 2000 of each):");
    for line in server.lines() {
        let Some((command, stats)) = line.split_once(':') else {
            continue;
        };
        if ["cmdstat_evalsha", "cmdstat_set"].contains(&command) {
            let usec = stats
                .split(',')
                .find_map(|kv| kv.strip_prefix("usec_per_call="))
                .unwrap_or("?");
            println!(
                "    {:<12} {usec} µs",
                command.trim_start_matches("cmdstat_")
            );
        }
    }
}

fn postgres(rt: &Runtime) {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let Ok(pool) = rt.block_on(
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&url),
    ) else {
        return println!("postgresql: skipped ({url} unreachable)");
    };
    // The store opens its second pool (completions) lazily, which needs the runtime.
    let _runtime = rt.enter();
    let store = PostgresStore::from_pool(pool.clone())
        .with_table("idem_phases")
        .unwrap();
    rt.block_on(async {
        store.migrate().await.unwrap();
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS idem_phases_raw \
             (key bytea PRIMARY KEY, state \"char\", token bigint, value bytea, expires_at timestamptz)",
        )
        .execute(&pool)
        .await
        .unwrap();
    });
    let op = Operation::new("bench.phases").ttl(TTL).lease(LEASE);
    let json = serde_json::to_vec(&receipt(1)).unwrap();
    let insert = |key: [u8; 8]| {
        sqlx::query(
            "INSERT INTO idem_phases_raw VALUES ($1, 'p', 1, NULL, now() + interval '30 s') \
             ON CONFLICT DO NOTHING",
        )
        .bind(key.to_vec())
        .execute(&pool)
    };
    let update = |key: [u8; 8]| {
        sqlx::query(
            "UPDATE idem_phases_raw SET state = 'c', value = $2, expires_at = now() + interval '10 min' \
             WHERE key = $1 AND token = 1",
        )
        .bind(key.to_vec())
        .bind(&json)
        .execute(&pool)
    };
    header("postgresql");
    phases(
        rt,
        &store,
        &op,
        Raw {
            whole: (
                "first execution vs INSERT + UPDATE",
                timed(rt, || {
                    let key = fresh().to_le_bytes();
                    time(async move { (insert(key).await.unwrap(), update(key).await.unwrap()) })
                }),
            ),
            claim: (
                "  claim vs INSERT … ON CONFLICT DO NOTHING",
                timed(rt, || time(insert(fresh().to_le_bytes()))),
            ),
            complete: (
                "  complete vs UPDATE",
                timed(rt, || async {
                    let key = fresh().to_le_bytes();
                    insert(key).await.unwrap();
                    time(update(key)).await
                }),
            ),
        },
    );
    rt.block_on(async {
        let _ = sqlx::query("DROP TABLE idem_phases, idem_phases_raw")
            .execute(&pool)
            .await;
    });
}

fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return; // `cargo test --benches` and `--list`: nothing to list or test here
    }
    let rt = common::runtime();
    redis(&rt);
    postgres(&rt);
}
