//! The error table proven on histories: on every store, many concurrent calls through a
//! store whose every operation fails before or after it reached the store, is delayed or
//! stalls past the lease, by a seeded schedule; every history checked by
//! `idem_runtime::testkit::History::check` (each answer's "body ran?" column, one value a
//! key, one run a key unless a caller was told `Unrecorded` or `Gone`, every call within its
//! bound). Each run prints its figures.
//!
//! Beside them: calls in the caller's transaction (`transactions.rs`) and processes killed
//! mid-call (`killed.rs`), through the HTTP layer (`http.rs`), and a Redis server of the
//! test's own frozen and killed under the calls (`servers.rs`).
//!
//! CI runs `IDEM_HISTORY_SEEDS` seeds a store (default 3) of `IDEM_HISTORY_CALLS` calls
//! (default 2 000). A failing run prints its seed; `IDEM_HISTORY_SEED=<n>` runs that seed
//! alone. The soak of the README's reliability section:
//! `IDEM_HISTORY_SEEDS=20 IDEM_HISTORY_CALLS=10000 cargo test -p idem-tests --test histories -- --nocapture`.

mod http;
mod killed;
mod servers;
mod transactions;

use std::path::PathBuf;

use idem_runtime::admin::Admin;
use idem_runtime::testkit::{histories, histories_with_operator, Faults, Plan, Report};
use idem_runtime::{MemoryStore, SqliteStore, Store, TieredStore};
use idem_tests::own_store::{Mutation, OwnStore};
use idem_tests::{dynamodb_store, mysql_store, postgres_store, redis_store};

/// The seeds of this run: `IDEM_HISTORY_SEED` alone, or the first `IDEM_HISTORY_SEEDS`
/// (default 3) after `base`, a number of each test's own.
fn seeds(base: u64) -> Vec<u64> {
    if let Some(seed) = env_number("IDEM_HISTORY_SEED") {
        return vec![seed];
    }
    let count = env_number("IDEM_HISTORY_SEEDS").unwrap_or(3);
    (0..count).map(|i| base * 1_000 + i).collect()
}

fn env_number(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value} is not a number")),
    )
}

fn calls() -> usize {
    env_number("IDEM_HISTORY_CALLS").map_or(2_000, |n| n as usize)
}

/// The plans of one store: 10 % faults, with a short lease; the same with 1 % of the
/// operations stalled past the lease; and (where `steps`) bodies that run two steps.
fn plans(seed: u64, steps: bool) -> Vec<(&'static str, Plan)> {
    let calls = calls();
    // 800 keys for 10 000 calls.
    let keys = (calls * 2 / 25).max(1) as u64;
    let base = Plan::new(seed).calls(calls, keys);
    let lease = base.lease;
    let mut plans = vec![
        ("10% faults", base.clone()),
        (
            "10% faults, 1% stalls past the lease",
            base.clone()
                .faults(Faults::ten_percent().stalling(0.01, lease + lease / 2)),
        ),
    ];
    if steps {
        plans.push(("10% faults, two steps a body", base.clone().with_steps()));
    }
    plans.push((
        "10% faults, effects beside the store reconciled, 5% of callers killed",
        base.clone().with_effects(true),
    ));
    plans.push((
        "10% faults, effects beside the store not reconciled, 5% of callers killed",
        base.with_effects(false),
    ));
    plans
}

/// Runs every plan of every seed on `stores` (handles of one storage), printing each
/// report.
async fn run<S: Store + Clone>(label: &str, base: u64, stores: &[S], steps: bool) {
    for seed in seeds(base) {
        for (name, plan) in plans(seed, steps) {
            let report: Report = histories(stores, &plan).await;
            println!("{label}: seed {seed}, {name}: {report}");
            assert!(report.faults > 0, "{label}: the schedule injected faults");
            // With effects reconciled, the history holds every key to one effect (its check
            // panics otherwise); without, the report counts the keys that had theirs twice.
        }
    }
}

/// Every seed with an operator beside the calls, releasing claims (by force one time in
/// two) while they run under 10 % faults, with steps: the same rules hold.
async fn operated<S: Store + Admin + Clone>(label: &str, base: u64, stores: &[S]) {
    let calls = calls() / 2;
    let keys = (calls * 2 / 25).max(1) as u64;
    for seed in seeds(base) {
        let plan = Plan::new(seed).calls(calls, keys).with_steps();
        let report = histories_with_operator(stores, &plan).await;
        println!("{label}: seed {seed}, with an operator: {report}");
        // One body in four waits while the operator finds its claim and releases it, by
        // force one time in two: a seed without a release would have proven nothing.
        assert!(
            report.released > 0,
            "{label}: seed {seed}: the operator released claims"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_with_an_operator() {
    operated("memory", 11, &[MemoryStore::new()]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_with_an_operator() {
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("histories-operated.db");
    for stale in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{stale}", file.display()));
    }
    let first = SqliteStore::open(&file).await.unwrap();
    first.migrate().await.unwrap();
    let second = SqliteStore::open(&file).await.unwrap();
    operated("sqlite", 12, &[first, second]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_an_operator() {
    let (Some(first), Some(second)) = (postgres_store().await, postgres_store().await) else {
        return;
    };
    operated("postgres", 14, &[first, second]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_with_an_operator() {
    let (Some(first), Some(second)) = (redis_store().await, redis_store().await) else {
        return;
    };
    operated("redis", 13, &[first, second]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_with_an_operator() {
    let (Some(first), Some(second)) = (dynamodb_store().await, dynamodb_store().await) else {
        return;
    };
    operated("dynamodb", 16, &[first, second]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_with_an_operator() {
    let (Some(first), Some(second)) = (mysql_store().await, mysql_store().await) else {
        return;
    };
    operated("mysql", 15, &[first, second]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory() {
    let store = MemoryStore::new();
    run("memory", 1, &[store], true).await;
}

/// The store a third party writes from the trait's docs (`idem_tests::own_store`), as two
/// instances over one server: the histories hold it to the same table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_written_store() {
    let store = OwnStore::new(Mutation::Kept);
    run("hand-written", 14, &[store.clone(), store.instance()], true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_written_store_with_an_operator() {
    let store = OwnStore::new(Mutation::Kept);
    operated("hand-written", 15, &[store.clone(), store.instance()]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite() {
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("histories.db");
    for stale in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{stale}", file.display()));
    }
    let first = SqliteStore::open(&file).await.unwrap();
    first.migrate().await.unwrap();
    // A second handle on the file: another process, in effect.
    let second = SqliteStore::open(&file).await.unwrap();
    run("sqlite", 2, &[first, second], true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis() {
    let (Some(first), Some(second)) = (redis_store().await, redis_store().await) else {
        return;
    };
    run("redis", 3, &[first, second], true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    let (Some(first), Some(second)) = (postgres_store().await, postgres_store().await) else {
        return;
    };
    run("postgres", 4, &[first, second], true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql() {
    let (Some(first), Some(second)) = (mysql_store().await, mysql_store().await) else {
        return;
    };
    run("mysql", 5, &[first, second], true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb() {
    let (Some(first), Some(second)) = (dynamodb_store().await, dynamodb_store().await) else {
        return;
    };
    run("dynamodb", 6, &[first, second], false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered() {
    let Some(durable) = redis_store().await else {
        return;
    };
    // Two processes, each with a memory tier of its own in front of the shared Redis.
    let first = TieredStore::new(MemoryStore::new(), durable.clone());
    let second = TieredStore::new(MemoryStore::new(), durable);
    run("tiered", 7, &[first, second], true).await;
}
