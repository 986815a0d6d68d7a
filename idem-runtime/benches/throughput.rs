//! Throughput under concurrency: 64 callers on distinct keys, against raw clients doing the
//! same round trips on the same connection or pool.
//!
//! `cargo bench -p idem-runtime --bench throughput --all-features`. Each configuration runs
//! rounds of ours and the baseline alternately (ours, baseline, ours, …), so that load drifting
//! during the run lands on both; the table shows the median of each side's rounds.
//!
//! - Redis first executions: ours (the native claim `SET NX GET PX`, then the complete
//!   script) against `SET key NX PX` then `SET key value PX`. Replays: ours against `GET`.
//!   On a private `redis-server` the bench starts (or `IDEM_REDIS_URL` when set).
//! - Redis floors (informative, no target): the least a hand-written client that keeps idem's
//!   guarantees on Redis 7.0 does, against the same baselines. Its key is a SHA-256 digest in
//!   hex; its claim is `SET NX GET PX`, which returns the record that is there; a first
//!   execution completes through a compare-and-set script (Redis 7 has no native one), and
//!   its value is JSON, decoded again on every replay.
//! - PostgreSQL first executions: ours (the claim statement, then the complete statement)
//!   against a prepared `INSERT … ON CONFLICT DO NOTHING` then an `UPDATE`, on the same pool.
//!   Replays: ours against a `SELECT` by key. Pool size and `synchronous_commit` vary.
//!   The floor of a replay (informative, pool 16): the least statement that reads the record
//!   or, when there is none, claims the key (as `paths`' P8g). A first execution's baseline,
//!   a claim's insert then the result's update, is its floor already (P8f).
//!
//! Beside the calls per second, each row gives the **server's own CPU time per call** over
//! the same rounds: Redis's `INFO cpu` (user + system), and for PostgreSQL the CPU time of
//! every `postgres` process on this machine (`/proc/<pid>/stat`: backends, WAL writer and
//! the rest, all of which the calls make work for, and the exited backends the postmaster
//! reaped). It is steadier than wall time on a shared machine, and it is what bounds a
//! server shared by many clients.
//!
//! Here: the harness and the table; `throughput/redis.rs` and `throughput/postgres.rs`: each
//! server's rows.

use std::future::Future;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use idem_runtime::{Error, MySqlStore, Operation, PostgresStore, RedisStore, Store};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use self::common::{receipt, redis_floor};

mod common;
#[path = "throughput/mysql.rs"]
mod mysql_rows;
#[path = "throughput/postgres.rs"]
mod postgres_rows;
#[path = "throughput/redis.rs"]
mod redis_rows;

const CALLERS: u64 = 64;
const PER_CALLER: u64 = 50;
/// Rounds of each side: at least `MIN_ROUNDS`, and more (up to `MAX_ROUNDS`) until both sides
/// together have run for `MIN_TIME`, so that a fast path's median is not taken over rounds
/// of a few milliseconds each.
const MIN_ROUNDS: usize = 3;
const MAX_ROUNDS: usize = 15;
const MIN_TIME: std::time::Duration = std::time::Duration::from_secs(3);
/// The numbers of the keys the replay rounds read, apart from every fresh one.
const REPLAYED: u64 = 1 << 40;
/// How many keys the replay rounds read.
const RECORDED: u64 = CALLERS * PER_CALLER;

/// Fresh numbers, unique across runs (see `common::run_start`).
static NEXT: LazyLock<AtomicU64> = LazyLock::new(|| AtomicU64::new(common::run_start()));

/// Where the server's CPU time is read.
#[derive(Clone)]
enum Server {
    Redis(redis::aio::ConnectionManager),
    /// Every `postgres` process on this machine.
    Postgres,
    /// Every `mariadbd` or `mysqld` process on this machine.
    Mysql,
}

impl Server {
    /// CPU seconds the server has used so far, if it can be read.
    async fn cpu(&self) -> Option<f64> {
        match self {
            Self::Redis(connection) => {
                let info: String = redis::cmd("INFO")
                    .arg("cpu")
                    .query_async(&mut connection.clone())
                    .await
                    .ok()?;
                let field = |name: &str| {
                    info.lines()
                        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                        .and_then(|value| value.trim().parse::<f64>().ok())
                };
                Some(field("used_cpu_user")? + field("used_cpu_sys")?)
            }
            Self::Postgres => processes_cpu(&["postgres"]),
            Self::Mysql => processes_cpu(&["mariadbd", "mysqld"]),
        }
    }
}

/// CPU seconds of every process with one of these `names`, from `/proc` (Linux).
fn processes_cpu(names: &[&str]) -> Option<f64> {
    // Clock ticks per second: 100 on every Linux this runs on (`getconf CLK_TCK`).
    const TICKS: f64 = 100.0;
    let mut ticks = 0_u64;
    let mut found = false;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`: comm may hold spaces, so split after its `)`.
        let Some((head, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        if !names.iter().any(|name| head.ends_with(&format!("({name}"))) {
            continue;
        }
        let fields: Vec<&str> = rest.split(' ').collect();
        // utime, stime, cutime and cstime are fields 14 to 17 of the line, 12 to 15 after
        // `) `. A backend that exits takes its own time out of `/proc`, and the postmaster
        // that reaps it gains it as `cutime` and `cstime`: the sum only grows.
        let Some(times) = fields.get(11..15) else {
            continue;
        };
        ticks += times
            .iter()
            .map(|t| t.parse::<u64>().unwrap_or(0))
            .sum::<u64>();
        found = true;
    }
    found.then(|| ticks as f64 / TICKS)
}

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

/// Calls one caller makes in a round of the server-cost table.
const SEQUENTIAL: u64 = 2000;
/// Rounds of each side in the server-cost table.
const COST_ROUNDS: usize = 5;

/// The server's CPU time per call, one caller calling in sequence (so that both sides reach
/// the server one command at a time, and neither gains from batching), in rounds that
/// alternate between ours and the baseline; prints the medians and their ratio.
async fn server_cost<A, AF, B, BF>(
    label: &str,
    server: &Server,
    target: f64,
    ours: A,
    baseline: B,
) -> String
where
    A: Fn(u64) -> AF,
    AF: Future<Output = ()>,
    B: Fn(u64) -> BF,
    BF: Future<Output = ()>,
{
    async fn round<F: Fn(u64) -> Fut, Fut: Future<Output = ()>>(
        side: &F,
        server: &Server,
    ) -> Option<f64> {
        let before = server.cpu().await?;
        for _ in 0..SEQUENTIAL {
            side(NEXT.fetch_add(1, Ordering::Relaxed)).await;
        }
        Some((server.cpu().await? - before) / SEQUENTIAL as f64 * 1e6)
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for n in 0..COST_ROUNDS {
        if n % 2 == 0 {
            a.push(round(&ours, server).await);
            b.push(round(&baseline, server).await);
        } else {
            b.push(round(&baseline, server).await);
            a.push(round(&ours, server).await);
        }
    }
    let median = |v: Vec<Option<f64>>| {
        let mut v: Vec<f64> = v.into_iter().collect::<Option<_>>()?;
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    };
    let Some((ours, base)) = median(a).zip(median(b)) else {
        return format!("{label:<52} (the server's CPU time cannot be read here)");
    };
    let ratio = ours / base;
    format!(
        "{label:<52} {ours:>9.1} {base:>9.1} {ratio:>6.2} {}",
        if ratio <= target {
            "ok".to_string()
        } else {
            format!("MISSED (≤ {target})")
        }
    )
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
async fn first_executions<A, AF, B, BF>(
    label: &str,
    server: &Server,
    target: Option<f64>,
    ours: A,
    baseline: B,
) where
    A: Fn(u64) -> AF + Clone + Send + 'static,
    AF: Future<Output = ()> + Send,
    B: Fn(u64) -> BF + Clone + Send + 'static,
    BF: Future<Output = ()> + Send,
{
    compare(label, server, target, ours.clone(), baseline.clone()).await;
    for n in 0..RECORDED {
        ours(REPLAYED + n).await;
        baseline(REPLAYED + n).await;
    }
}

/// Median rounds of ours and the baseline, run alternately, and the server's CPU time per
/// call over all of each side's rounds; prints one table row, judged against `target`.
async fn compare<A, AF, B, BF>(
    label: &str,
    server: &Server,
    target: Option<f64>,
    ours: A,
    baseline: B,
) where
    A: Fn(u64) -> AF + Clone + Send + 'static,
    AF: Future<Output = ()> + Send,
    B: Fn(u64) -> BF + Clone + Send + 'static,
    BF: Future<Output = ()> + Send,
{
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let (mut cpu_a, mut cpu_b) = (Some(0.0), Some(0.0));
    // The CPU a round of `side` made the server use, added to `total`.
    async fn round<F, Fut>(side: F, server: &Server, total: &mut Option<f64>) -> f64
    where
        F: Fn(u64) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        let before = server.cpu().await;
        let rate = ops_per_second(side).await;
        let used = before.zip(server.cpu().await).map(|(b, a)| a - b);
        *total = total.zip(used).map(|(t, u)| t + u);
        rate
    }
    let started = Instant::now();
    while a.len() < MIN_ROUNDS || (a.len() < MAX_ROUNDS && started.elapsed() < MIN_TIME) {
        a.push(round(ours.clone(), server, &mut cpu_a).await);
        b.push(round(baseline.clone(), server, &mut cpu_b).await);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (ours, base) = (median(&mut a), median(&mut b));
    let ratio = ours / base;
    let calls = (a.len() as u64 * CALLERS * PER_CALLER) as f64;
    let per_call = |cpu: Option<f64>| cpu.map(|cpu| cpu / calls * 1e6);
    let (cpu_ours, cpu_base) = (per_call(cpu_a), per_call(cpu_b));
    let cpu = match cpu_ours.zip(cpu_base) {
        Some((o, b)) => format!("{o:>8.1} {b:>8.1} {:>6.2}", o / b),
        None => format!("{:>8} {:>8} {:>6}", "-", "-", "-"),
    };
    println!(
        "{label:<52} {ours:>9.0} {base:>9.0} {ratio:>6.2} {cpu} {}",
        match target {
            None if label.contains("floor") => "(floor)".to_string(),
            None => "(no target)".to_string(),
            Some(target) if ratio >= target => "ok".to_string(),
            Some(target) => format!("MISSED (≥ {target})"),
        }
    );
}

fn main() {
    let rt = common::runtime();
    println!(
        "\n{:<52} {:>9} {:>9} {:>6} {:>8} {:>8} {:>6}",
        "(calls per second, and server CPU µs per call)",
        "ours",
        "baseline",
        "ratio",
        "cpu ours",
        "cpu base",
        "ratio"
    );
    // `cargo bench --bench throughput -- mysql` runs only the servers named.
    let named: Vec<String> = std::env::args()
        .skip(1)
        .filter(|arg| !arg.starts_with('-'))
        .collect();
    let runs = |server: &str| named.is_empty() || named.iter().any(|name| name == server);
    let costs = rt.block_on(async {
        let mut costs = Vec::new();
        if runs("redis") {
            costs.extend(redis_rows::redis().await);
        }
        if runs("postgres") {
            costs.extend(postgres_rows::postgres(16, true, true).await);
            postgres_rows::postgres(64, true, false).await;
            postgres_rows::postgres(16, false, false).await;
        }
        if runs("mysql") {
            mysql_rows::mysql(16).await;
        }
        costs
    });
    println!(
        "\n{:<52} {:>9} {:>9} {:>6}",
        "(server CPU µs per call, one caller in sequence)", "ours", "baseline", "ratio"
    );
    for row in costs {
        println!("{row}");
    }
}
