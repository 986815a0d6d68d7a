//! Instruction counts of the in-process paths, next to their hand-written baselines, under
//! callgrind: a count does not move with the machine's load, so a path that grows shows up
//! here however noisy the clock is.
//!
//! `cargo bench -p idem-runtime --features http,redis --bench instructions` runs each side of each
//! path in a process of its own under `valgrind --tool=callgrind`, counting only the
//! measured loop (after a warm-up), prints the counts per call and their ratios, and fails
//! when one of idem's paths costs more than 5 % over its count in `instructions.counts`
//! beside this file. `IDEM_ACCEPT_INSTRUCTIONS=1` writes the new counts there instead: a
//! commit that changes them says why.
//!
//! Two more paths are counted for information, not gated: a replay and a first execution
//! on Redis, against the floor's hand-written client on the same connection (the client's
//! side of the throughput bench's rows; a round trip's wake-ups vary from run to run). They
//! need Redis (`IDEM_REDIS_URL`, default `redis://127.0.0.1:6379`), and print `skipped`
//! without it.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::hint::black_box;
use std::path::PathBuf;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use idem_runtime::http::IdempotencyLayer;
use idem_runtime::{idempotent, MemoryStore, Operation, RedisStore, TieredStore};
use tokio::runtime::Runtime;
use tower::{Layer, Service, ServiceExt};

use self::baselines::{handler, kib_json, request, Naive, REPLAY_KEY};
use self::calls::{cached_charge, charge, charge_redis, hand_key, BenchError};
use self::common::{receipt, Receipt};

#[path = "common/http.rs"]
mod baselines;
#[path = "common/callgrind.rs"]
mod callgrind;
#[path = "common/calls.rs"]
mod calls;
mod common;

/// Calls measured per path and side, after as many to warm up.
const CALLS: u64 = 2_000;

/// How much over its committed count a path of idem may grow before the run fails.
const TOLERANCE: f64 = 0.05;

/// The function callgrind counts in (and everything it calls).
const MEASURED: &str = "*instructions::measured*";

#[idempotent(key = order_id, store = store, namespace = "bench.tiered")]
async fn charge_tiered(
    store: &TieredStore<MemoryStore, MemoryStore>,
    order_id: u64,
) -> Result<Receipt, BenchError> {
    Ok(receipt(order_id))
}

/// A path: idem's side and its baseline, each a name for the command line.
struct Path {
    name: &'static str,
    what: &'static str,
    baseline: &'static str,
    /// Whether its count is committed and gated (in-process paths), or only printed.
    gated: bool,
}

const PATHS: &[Path] = &[
    Path {
        name: "replay",
        what: "memory replay through the macro",
        baseline: "a hash, a moka lookup and a decode, by hand",
        gated: true,
    },
    Path {
        name: "replay-cached",
        what: "memory replay through the macro",
        baseline: "`cached`'s hit",
        gated: true,
    },
    Path {
        name: "first",
        what: "memory first execution through the macro",
        baseline: "a hash, two moka inserts and an encode, by hand",
        gated: true,
    },
    Path {
        name: "key",
        what: "key derivation (`Operation::key`)",
        baseline: "the same fields hashed by hand",
        gated: true,
    },
    Path {
        name: "http-replay",
        what: "HTTP replay, memory store, 1 KiB JSON",
        baseline: "a moka cache by the header, the tutorials' middleware",
        gated: true,
    },
    Path {
        name: "http-replay-hashing",
        what: "HTTP replay, memory store, 1 KiB JSON",
        baseline: "the same, hashing the body",
        gated: true,
    },
    Path {
        name: "http-first",
        what: "HTTP first execution, memory store, 1 KiB JSON",
        baseline: "a moka cache by the header, the tutorials' middleware",
        gated: true,
    },
    Path {
        name: "tier-replay",
        what: "replay through a memory tier",
        baseline: "memory replay through the macro",
        gated: true,
    },
    Path {
        name: "redis-replay",
        what: "Redis replay, the client's side",
        baseline: "the floor's client: SET NX GET PX, a JSON decode",
        gated: false,
    },
    Path {
        name: "redis-first",
        what: "Redis first execution, the client's side",
        baseline: "the floor's client: SET NX GET PX, a compare-and-set script",
        gated: false,
    },
];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [measure, path, side] if measure == "measure" => run(path, side == "baseline"),
        _ => drive(),
    }
}

// ---- the driver: each side under callgrind ------------------------------------------------

fn drive() {
    let counts_file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/instructions.counts");
    const COUNTS: &str = "idem-runtime/benches/instructions.counts";
    let committed = read_counts(&counts_file);
    let accept = std::env::var("IDEM_ACCEPT_INSTRUCTIONS").is_ok_and(|v| v == "1");
    let mut counted = BTreeMap::new();
    let mut grown = Vec::new();
    println!(
        "{:<20} {:>9} {:>9} {:>6} {:>10}  path (baseline)",
        "", "idem", "baseline", "ratio", "committed"
    );
    for path in PATHS {
        if !path.gated && !redis_reachable() {
            println!("{:<20} skipped: Redis is unreachable", path.name);
            continue;
        }
        let ours = count(path.name, "idem");
        let baseline = count(path.name, "baseline");
        if !path.gated {
            println!(
                "{:<20} {:>9} {:>9} {:>6.2} {:>10}  {} ({})",
                path.name,
                ours,
                baseline,
                ours as f64 / baseline as f64,
                "(not gated)",
                path.what,
                path.baseline
            );
            continue;
        }
        let before = committed.get(path.name).copied();
        let change = before.map_or(String::new(), |before| {
            format!("{:+.1} %", (ours as f64 / before as f64 - 1.0) * 100.0)
        });
        println!(
            "{:<20} {:>9} {:>9} {:>6.2} {:>10}  {} ({})",
            path.name,
            ours,
            baseline,
            ours as f64 / baseline as f64,
            change,
            path.what,
            path.baseline
        );
        if before.is_some_and(|before| ours as f64 > before as f64 * (1.0 + TOLERANCE)) {
            grown.push(path.name);
        }
        counted.insert(path.name, ours);
    }
    if accept {
        let text: String = counted
            .iter()
            .map(|(name, count)| format!("{name} {count}\n"))
            .collect();
        std::fs::write(&counts_file, text).unwrap();
        println!("wrote {COUNTS}");
    } else if !grown.is_empty() {
        eprintln!(
            "instructions per call grew more than {} % over {} for: {}\n\
             (if that is meant, rerun with IDEM_ACCEPT_INSTRUCTIONS=1 and say why in the commit)",
            TOLERANCE * 100.0,
            COUNTS,
            grown.join(", ")
        );
        std::process::exit(1);
    }
}

fn redis_url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn redis_reachable() -> bool {
    redis::Client::open(redis_url())
        .and_then(|client| client.get_connection())
        .is_ok()
}

/// The committed counts: `name count` per line.
fn read_counts(file: &std::path::Path) -> BTreeMap<String, u64> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let (name, count) = line.split_once(' ')?;
            Some((name.to_string(), count.trim().parse().ok()?))
        })
        .collect()
}

/// Instructions per call of one side of a path: this program run again under callgrind,
/// counting only inside [`measured`].
fn count(path: &str, side: &str) -> u64 {
    callgrind::collected(MEASURED, &["measure", path, side], &[]).0 / CALLS
}

// ---- one side of one path, in the process callgrind counts ----------------------------------

/// Runs `call` [`CALLS`] times to warm up, then [`CALLS`] times inside [`measured`].
fn run(path: &str, baseline: bool) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut call = side(&rt, path, baseline);
    for _ in 0..CALLS {
        call();
    }
    measured(&mut call);
}

/// The only function callgrind counts in.
#[inline(never)]
fn measured(call: &mut dyn FnMut()) {
    for _ in 0..CALLS {
        call();
    }
}

type Call<'a> = Box<dyn FnMut() + 'a>;

fn side<'a>(rt: &'a Runtime, path: &str, baseline: bool) -> Call<'a> {
    match (path, baseline) {
        ("replay", false) | ("replay-cached", false) | ("tier-replay", true) => {
            let store = MemoryStore::new();
            rt.block_on(charge(&store, 7, "cus_0042")).unwrap();
            Box::new(move || {
                black_box(
                    rt.block_on(charge(&store, black_box(7), black_box("cus_0042")))
                        .unwrap(),
                );
            })
        }
        ("replay", true) => {
            let raw: moka::future::Cache<[u8; 32], Bytes> = moka::future::Cache::new(100_000);
            let json = Bytes::from(serde_json::to_vec(&receipt(7)).unwrap());
            rt.block_on(raw.insert(hand_key(7, "cus_0042", 0), json));
            Box::new(move || {
                black_box(rt.block_on(async {
                    let key = hand_key(black_box(7), black_box("cus_0042"), 0);
                    let bytes = raw.get(&key).await.unwrap();
                    serde_json::from_slice::<Receipt>(&bytes).unwrap()
                }));
            })
        }
        ("replay-cached", true) => {
            rt.block_on(cached_charge(7, "cus_0042".into()));
            Box::new(move || {
                black_box(rt.block_on(cached_charge(black_box(7), "cus_0042".to_string())));
            })
        }
        ("first", false) => {
            let store = MemoryStore::new();
            let mut id = 0;
            Box::new(move || {
                id += 1;
                black_box(rt.block_on(charge(&store, id, "cus_0042")).unwrap());
            })
        }
        ("first", true) => {
            let raw: moka::future::Cache<[u8; 32], Bytes> = moka::future::Cache::new(100_000);
            let mut id = 0;
            Box::new(move || {
                id += 1;
                rt.block_on(async {
                    let key = hand_key(id, "cus_0042", 0);
                    raw.insert(key, Bytes::from_static(b"claimed")).await;
                    let value = serde_json::to_vec(&receipt(id)).unwrap();
                    raw.insert(key, Bytes::from(value)).await;
                });
            })
        }
        ("key", false) => Box::new(|| {
            black_box(
                Operation::new("bench.key")
                    .key(black_box(&(42_u64, "cus_0042", 3_u32)))
                    .unwrap(),
            );
        }),
        ("key", true) => Box::new(|| {
            black_box(hand_key(black_box(42), black_box("cus_0042"), black_box(3)));
        }),
        ("http-replay", false) | ("http-replay-hashing", false) => {
            let service = IdempotencyLayer::new(MemoryStore::new())
                .unscoped()
                .layer(handler());
            replays(rt, service)
        }
        ("http-replay", true) => replays(rt, naive(false)),
        ("http-replay-hashing", true) => replays(rt, naive(true)),
        ("http-first", false) => {
            let service = IdempotencyLayer::new(MemoryStore::new())
                .unscoped()
                .layer(handler());
            first_executions(rt, service)
        }
        ("http-first", true) => first_executions(rt, naive(false)),
        ("tier-replay", false) => {
            let store = TieredStore::new(MemoryStore::new(), MemoryStore::new());
            rt.block_on(charge_tiered(&store, 7)).unwrap();
            Box::new(move || {
                black_box(rt.block_on(charge_tiered(&store, black_box(7))).unwrap());
            })
        }
        ("redis-replay", false) | ("redis-first", false) => {
            let store = rt
                .block_on(RedisStore::connect(&redis_url()))
                .unwrap()
                .with_prefix("idem-bench:")
                .unwrap();
            let start = common::run_start();
            if path == "redis-replay" {
                rt.block_on(charge_redis(&store, start)).unwrap();
                Box::new(move || {
                    black_box(rt.block_on(charge_redis(&store, start)).unwrap());
                })
            } else {
                let mut id = start;
                Box::new(move || {
                    id += 1;
                    black_box(rt.block_on(charge_redis(&store, id)).unwrap());
                })
            }
        }
        ("redis-replay", true) | ("redis-first", true) => {
            let manager = rt
                .block_on(async {
                    let client = redis::Client::open(redis_url())?;
                    redis::aio::ConnectionManager::new(client).await
                })
                .unwrap();
            let json = serde_json::to_vec(&receipt(1)).unwrap();
            let start = common::run_start();
            if path == "redis-replay" {
                let key = common::redis_floor::key(start);
                let mut con = manager.clone();
                rt.block_on(async {
                    assert!(common::redis_floor::claim(&mut con, &key, start)
                        .await
                        .is_none());
                    assert!(common::redis_floor::complete(&mut con, &key, start, &json).await);
                });
                Box::new(move || {
                    let mut con = manager.clone();
                    black_box(rt.block_on(async {
                        // The key derived on every call, as idem's is.
                        let key = common::redis_floor::key(black_box(start));
                        let record = common::redis_floor::claim(&mut con, &key, start)
                            .await
                            .unwrap();
                        serde_json::from_slice::<Receipt>(&record[1..]).unwrap()
                    }));
                })
            } else {
                let mut id = start;
                Box::new(move || {
                    id += 1;
                    let mut con = manager.clone();
                    rt.block_on(async {
                        let key = common::redis_floor::key(id);
                        assert!(common::redis_floor::claim(&mut con, &key, id)
                            .await
                            .is_none());
                        let value = serde_json::to_vec(&receipt(id)).unwrap();
                        assert!(common::redis_floor::complete(&mut con, &key, id, &value).await);
                    });
                })
            }
        }
        _ => panic!("no path {path:?}"),
    }
}

// ---- the HTTP paths -------------------------------------------------------------------------

/// The middleware of the tutorials: a moka cache by the header, hashing the body or not.
fn naive(
    hashes: bool,
) -> Naive<
    impl Service<
            http::Request<Full<Bytes>>,
            Response = http::Response<Full<Bytes>>,
            Error = Infallible,
            Future: Send,
        > + Clone
        + Send
        + 'static,
> {
    Naive {
        inner: handler(),
        cache: moka::future::Cache::new(100_000),
        hashes,
    }
}

/// Replays of one recorded request through `service`.
fn replays<'a, S, B>(rt: &'a Runtime, service: S) -> Call<'a>
where
    S: Service<http::Request<Full<Bytes>>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + 'a,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let body = kib_json();
    respond(rt, service.clone(), request(REPLAY_KEY, &body));
    requests(rt, service, body, || REPLAY_KEY.to_string())
}

/// First executions through `service`, a fresh key each.
fn first_executions<'a, S, B>(rt: &'a Runtime, service: S) -> Call<'a>
where
    S: Service<http::Request<Full<Bytes>>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + 'a,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let mut id = 0_u64;
    requests(rt, service, kib_json(), move || {
        id += 1;
        id.to_string()
    })
}

/// Requests with `body` through `service`, each under the key `key` gives.
fn requests<'a, S, B>(
    rt: &'a Runtime,
    service: S,
    body: Bytes,
    mut key: impl FnMut() -> String + 'a,
) -> Call<'a>
where
    S: Service<http::Request<Full<Bytes>>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + 'a,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    Box::new(move || respond(rt, service.clone(), request(&key(), &body)))
}

/// Sends `request` through `service` and reads the whole response, as a server would.
fn respond<S, B>(rt: &Runtime, service: S, request: http::Request<Full<Bytes>>)
where
    S: Service<http::Request<Full<Bytes>>, Response = http::Response<B>, Error = Infallible>,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let body = rt.block_on(async {
        let response = service.oneshot(request).await.unwrap();
        assert!(response.status().is_success(), "{}", response.status());
        response.into_body().collect().await.unwrap().to_bytes()
    });
    black_box(body);
}
