//! Histories with processes SIGKILLed mid-call, on the stores processes share: a SQLite
//! file, Redis and PostgreSQL. Two child processes of this binary call the same keys
//! without pause, eight callers each, and print every event of every call; the parent
//! kills one of them a seeded number of events after one of its bodies starts (mid-body,
//! mid-record, just after), starts another in its place, and so on. From what the processes
//! printed it builds one history: a call its process never finished is `Answer::Killed`,
//! which excuses a second run of its key (its body may have returned before its record was
//! written), and nothing else. `History::check` then holds it to the same rules as every
//! other history: no survivor is told `Store` for a body that ran, every key answers one
//! value, a key runs twice only where a caller was killed or told `Unrecorded`, every
//! call ends within its bound (as the process measured it).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_runtime::testkit::{Answer, Failure, History};
use idem_runtime::{Error, Fingerprint, Operation, Outcome, SqliteStore, Store};
use idem_tests::{postgres_store, redis_store, Child};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

use super::seeds;

/// The lease of every call: a killed holder's keys free this long after its last renewal.
const LEASE: Duration = Duration::from_millis(300);
/// Callers in each child process.
const CALLERS: usize = 8;
/// Keys the callers share at a time: few, so that survivors meet the keys the dead held,
/// and new ones every [`WINDOW`] (by the host's clock, which both processes read), so that
/// bodies run all along and a kill finds some mid-body, not only replays.
const KEYS: u64 = 4;
const WINDOW: u128 = 50;
/// Kills in one history.
const KILLS: usize = 8;
/// How long a call may take, as its process measures it: the store's timeout, a wait for
/// a dead holder's lease, and what a loaded machine adds.
const BOUND: Duration = Duration::from_secs(15);

const STORE: &str = "IDEM_KILLED_STORE";
const FILE: &str = "IDEM_KILLED_FILE";
const NAMESPACE: &str = "IDEM_KILLED_NAMESPACE";
const GENERATION: &str = "IDEM_KILLED_GENERATION";

/// One child process: calls until its standard input says `stop`, printing, for every
/// call, `B <call> <key> <payload>` as it begins, `S <call> <body>` as its body starts,
/// `O <body>` or `F <body>` as the body returns or fails, and `E <call> <ms> <answer>` as
/// it ends. A body's value is its generation (which process) and number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by the killed-process histories, in a child process"]
async fn child() {
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is set"));
    match var(STORE).as_str() {
        "sqlite" => calls(SqliteStore::open(var(FILE)).await.unwrap()).await,
        "redis" => calls(redis_store().await.expect("redis")).await,
        "postgres" => calls(postgres_store().await.expect("postgres")).await,
        other => panic!("no store {other}"),
    }
}

async fn calls<S: Store + Clone>(store: S) {
    let generation: u64 = std::env::var(GENERATION).unwrap().parse().unwrap();
    let op = Arc::new(
        Operation::new(std::env::var(NAMESPACE).unwrap())
            .lease(LEASE)
            .ttl(Duration::from_secs(3600)),
    );
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut line = String::new();
            while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
                if line.trim() == "stop" {
                    stop.store(true, Ordering::SeqCst);
                }
                line.clear();
            }
        });
    }
    let (next_call, next_body) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    println!("ready");
    let mut callers = tokio::task::JoinSet::new();
    for caller in 0..CALLERS {
        let (store, op, stop) = (store.clone(), Arc::clone(&op), Arc::clone(&stop));
        let (next_call, next_body) = (Arc::clone(&next_call), Arc::clone(&next_body));
        let mut rng = XorShiftRng::seed_from_u64(generation << 8 | caller as u64);
        callers.spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let window = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_millis()
                    / WINDOW;
                // A quarter of the calls go back over the keys of the last 600 ms, past a
                // lease: a dead holder's key is taken over.
                let back = if rng.random::<f64>() < 0.25 {
                    rng.random_range(0..12)
                } else {
                    0
                };
                let key = (window as u64).saturating_sub(back) * KEYS + rng.random_range(0..KEYS);
                let payload = u64::from(rng.random::<f64>() < 0.02);
                let fails = rng.random::<f64>() < 0.05;
                let work = Duration::from_micros(rng.random_range(0..20_000));
                let call = next_call.fetch_add(1, Ordering::Relaxed);
                println!("B {call} {key} {payload}");
                let started = Instant::now();
                let next_body = Arc::clone(&next_body);
                let result = op
                    .run(
                        &store,
                        &op.key(&key).unwrap(),
                        Some(&Fingerprint::of(&payload).unwrap()),
                        async move {
                            let body = next_body.fetch_add(1, Ordering::Relaxed);
                            println!("S {call} {body}");
                            tokio::time::sleep(work).await;
                            if fails {
                                println!("F {body}");
                                return Err(Failure::Body);
                            }
                            println!("O {body}");
                            Ok(generation << 32 | body)
                        },
                    )
                    .await;
                // A runtime error as its serde form: the parent reads it back as an `Error`.
                let answer = match &result {
                    Ok(Outcome::Executed(v)) => format!("X {v}"),
                    Ok(Outcome::Replayed(v)) => format!("R {v}"),
                    Err(Failure::Idem(err)) => format!("K {}", serde_json::to_string(err).unwrap()),
                    Err(Failure::Body) => "BF".to_string(),
                };
                println!("E {call} {} {answer}", started.elapsed().as_millis());
            }
        });
    }
    while callers.join_next().await.is_some() {}
    println!("done");
}

/// What one process printed, and whether it was killed.
struct Printed {
    generation: u64,
    lines: Vec<String>,
    killed: bool,
}

/// Runs one history of `seed` on the store `env` names, and checks it.
async fn killed(label: &str, env: &[(&str, &str)], seed: u64) {
    let namespace = idem_tests::scenarios::namespace(&format!("histories.killed.{label}.{seed}"));
    let start = |generation: u64| {
        let generation_text = (seed << 16 | generation).to_string();
        let mut vars = env.to_vec();
        vars.extend([
            (NAMESPACE, namespace.as_str()),
            (GENERATION, generation_text.as_str()),
        ]);
        (
            seed << 16 | generation,
            Child::start("killed::child", &vars),
            Vec::new(),
        )
    };
    let mut rng = XorShiftRng::seed_from_u64(seed);
    let mut running = [start(0), start(1)];
    let mut printed = Vec::new();
    for round in 0..KILLS {
        let slot = round % 2;
        let (_, child, lines) = &mut running[slot];
        // Its n-th body start, and k events more: the kill lands mid-body, at the record,
        // or just after, where a call can be cut.
        let (mut starts, more) = (rng.random_range(1..6), rng.random_range(0..8));
        while starts > 0 {
            let line = child.next_line().await;
            starts -= usize::from(line.starts_with("S "));
            lines.push(line);
        }
        for _ in 0..more {
            lines.push(child.next_line().await);
        }
        lines.extend(child.kill_reading());
        let (generation, _, lines) = std::mem::replace(&mut running[slot], start(round as u64 + 2));
        printed.push(Printed {
            generation,
            lines,
            killed: true,
        });
    }
    for (generation, mut child, mut lines) in running {
        child.say("stop");
        loop {
            let line = child.next_line().await;
            let done = line == "done";
            lines.push(line);
            if done {
                break;
            }
        }
        printed.push(Printed {
            generation,
            lines,
            killed: false,
        });
    }

    let history = build(&printed);
    let mut report = history
        .check()
        .unwrap_or_else(|violation| panic!("{label}: seed {seed}: {violation}"));
    report.faults = KILLS;
    let cut = cut_bodies(&printed);
    println!(
        "{label} with {KILLS} processes killed: seed {seed}: {report}; bodies cut by a kill: {cut}"
    );
    assert!(
        report.answers.get("killed").copied().unwrap_or(0) >= KILLS,
        "{label}: every kill caught calls in flight: {report}"
    );
}

/// How many bodies a kill cut: started in a killed process, never returned.
fn cut_bodies(printed: &[Printed]) -> usize {
    let mut cut = 0;
    for process in printed.iter().filter(|p| p.killed) {
        let word = |line: &String, i: usize| line.split(' ').nth(i).map(str::to_owned);
        let ended: std::collections::HashSet<_> = process
            .lines
            .iter()
            .filter(|l| l.starts_with("O ") || l.starts_with("F "))
            .filter_map(|l| word(l, 1))
            .collect();
        cut += process
            .lines
            .iter()
            .filter(|l| l.starts_with("S "))
            .filter_map(|l| word(l, 2))
            .filter(|body| !ended.contains(body))
            .count();
    }
    cut
}

/// The history of what the processes printed: every call and body first, then the
/// answers, whose values name bodies of any process.
fn build(printed: &[Printed]) -> History {
    let history = History::new();
    let mut calls = HashMap::new();
    let mut bodies = HashMap::new();
    // A body's value (its generation and number) to its id in the history.
    let mut values = HashMap::new();
    for process in printed {
        let g = process.generation;
        for line in &process.lines {
            let words: Vec<&str> = line.split(' ').collect();
            let number = |i: usize| words[i].parse::<u64>().unwrap();
            match words[0] {
                // The call's bound is checked below, by the time its process measured.
                "B" => {
                    let call = history.begin(number(2), number(3), Duration::MAX);
                    calls.insert((g, number(1)), call);
                }
                "S" => {
                    let body = history.body_started(calls[&(g, number(1))]);
                    bodies.insert((g, number(2)), body);
                    values.insert(g << 32 | number(2), body);
                }
                "O" => {
                    let body = bodies[&(g, number(1))];
                    history.body_ended(body, Ok(body));
                }
                "F" => history.body_ended(bodies[&(g, number(1))], Err(())),
                _ => {}
            }
        }
    }
    for process in printed {
        let g = process.generation;
        let mut ended = std::collections::HashSet::new();
        for line in &process.lines {
            // The error's serde form, last, may hold spaces.
            let words: Vec<&str> = line.splitn(5, ' ').collect();
            if words[0] != "E" {
                continue;
            }
            let call = calls[&(g, words[1].parse::<u64>().unwrap())];
            let took = Duration::from_millis(words[2].parse().unwrap());
            assert!(took <= BOUND, "call {call} took {took:?}: {line}");
            let value = |v: &str| {
                values
                    .get(&v.parse::<u64>().unwrap())
                    .copied()
                    .unwrap_or(u64::MAX)
            };
            let answer = match words[3] {
                "X" => Answer::Executed(value(words[4])),
                "R" => Answer::Replayed(value(words[4])),
                "K" => {
                    let err: Error = serde_json::from_str(words[4]).unwrap();
                    Answer::of(&Err::<Outcome<u64>, _>(err), |err: &Error| Some(err))
                }
                _ => Answer::BodyFailed,
            };
            history.end(call, answer);
            ended.insert(call);
        }
        if process.killed {
            for (&(generation, _), &call) in &calls {
                if generation == g && !ended.contains(&call) {
                    history.end(call, Answer::Killed);
                }
            }
        }
    }
    history
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_with_processes_killed() {
    let file = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("histories-killed.db");
    for stale in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{stale}", file.display()));
    }
    SqliteStore::open(&file)
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let file = file.to_string_lossy().into_owned();
    for seed in seeds(31) {
        killed("sqlite", &[(STORE, "sqlite"), (FILE, &file)], seed).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_with_processes_killed() {
    if redis_store().await.is_none() {
        return;
    }
    for seed in seeds(32) {
        killed("redis", &[(STORE, "redis")], seed).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_processes_killed() {
    if postgres_store().await.is_none() {
        return;
    }
    for seed in seeds(33) {
        killed("postgres", &[(STORE, "postgres")], seed).await;
    }
}
