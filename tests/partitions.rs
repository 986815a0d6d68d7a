//! Partitions between hosts: two application instances, each in a network namespace of its
//! own, and their store in a third. One instance is cut off from the store mid-body; the
//! other takes the key over once the lease lapses; the link heals and the first finishes.
//!
//! ```text
//!   instance a ──┐            ┌── downstream (this test's own namespace:
//!                ├── store ───┤   a service that refuses a write whose
//!   instance b ──┘            │   fencing token is not above the last one)
//!        └────────────────────┘
//! ```
//!
//! The instances are this test binary's ignored test `instance`, run in their hosts with
//! `ip netns exec`; the store is a Redis server of the test's own in the third host. Only the
//! link between instance `a` and the store is ever cut: `a` still reaches the downstream, as
//! a service still reaches its payment gateway when the database link fails.
//!
//! Needs root (namespaces); skipped loudly without it, and failed in CI
//! (`IDEM_REQUIRE_SERVICES=1`). `IDEM_PARTITIONS=50 cargo test -p idem-tests --all-features
//! --test partitions -- --nocapture` runs 50 partitions at random points (CI runs 4).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::{attempt, Error, Operation, Outcome, PostgresStore, RedisStore, Store, Token};
use idem_tests::netns::{Network, HERE};
use idem_tests::{unavailable, Child, PrivatePostgres};
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// The lease of every call here: how long the cut-off holder keeps the key from the other.
const LEASE: Duration = Duration::from_secs(1);
/// Each store operation's bound in the instances.
const STORE_TIMEOUT: Duration = Duration::from_millis(500);
const NAMESPACE: &str = "partitions.v1";

/// What a body records: which instance ran it, under which fencing token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Written {
    by: char,
    token: u64,
}

/// One write the downstream received.
#[derive(Clone, Copy, Debug)]
struct Received {
    by: char,
    token: u64,
    landed: bool,
}

/// A downstream service fenced by tokens, one line per write over TCP: `<key> <token> <by>`,
/// answered `landed` when the token is above the last one that landed for the key, or
/// `refused`.
#[derive(Clone, Default)]
struct Downstream(Arc<Mutex<HashMap<String, Vec<Received>>>>);

impl Downstream {
    /// Serves on every address of this namespace; returns the port.
    async fn serve(&self) -> u16 {
        let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let writes = self.clone();
        tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    return;
                };
                let writes = writes.clone();
                tokio::spawn(async move {
                    let (read, mut write) = socket.into_split();
                    let mut lines = BufReader::new(read).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        let answer = if writes.receive(&line) {
                            "landed\n"
                        } else {
                            "refused\n"
                        };
                        if write.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        port
    }

    fn receive(&self, line: &str) -> bool {
        let [key, token, by] = line.split(' ').collect::<Vec<_>>()[..] else {
            panic!("a downstream write must be `<key> <token> <by>`: {line:?}");
        };
        let token: u64 = token.parse().unwrap();
        let mut all = self.0.lock().unwrap();
        let writes = all.entry(key.to_string()).or_default();
        let last = writes.iter().filter(|w| w.landed).map(|w| w.token).max();
        let landed = last.is_none_or(|last| token > last);
        writes.push(Received {
            by: by.chars().next().unwrap(),
            token,
            landed,
        });
        landed
    }

    fn writes(&self, key: &str) -> Vec<Received> {
        self.0.lock().unwrap().get(key).cloned().unwrap_or_default()
    }
}

/// The store the hosts share.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Redis,
    Postgres,
}

/// Three hosts and what runs in them. Fields drop in order: the instances and the server
/// are stopped before their namespaces are deleted.
struct Hosts {
    a: Child,
    b: Child,
    _server: Server,
    /// The store, reached from this test's own namespace (to read what a key recorded).
    store: Arc<dyn Store>,
    downstream: Downstream,
    network: Network,
}

/// The server in the store's host, stopped on drop.
enum Server {
    Redis(std::process::Child, std::path::PathBuf),
    Postgres(PrivatePostgres),
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Self::Redis(server, dir) = self {
            let _ = server.kill();
            let _ = server.wait();
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Server {
    /// Starts the store's server in the host `store` of `network`.
    fn start(kind: Kind, network: &Network) -> Option<Self> {
        match kind {
            Kind::Redis => {
                let dir = std::env::temp_dir().join(format!(
                    "idem-partitions-{}-{}",
                    std::process::id(),
                    network.address(HERE, "store")
                ));
                std::fs::create_dir_all(&dir).unwrap();
                let server = network
                    .command("store", "redis-server")
                    .args(["--port", "6379", "--bind", "0.0.0.0"])
                    .args(["--protected-mode", "no", "--save", "", "--appendonly", "no"])
                    .arg("--dir")
                    .arg(&dir)
                    .stdout(std::process::Stdio::null())
                    .spawn();
                match server {
                    Ok(server) => Some(Self::Redis(server, dir)),
                    Err(e) => unavailable("redis-server (for the store's host)", e),
                }
            }
            Kind::Postgres => {
                PrivatePostgres::start_within(network.within("store")).map(Self::Postgres)
            }
        }
    }

    /// The store's URL from `host`.
    fn url(&self, network: &Network, host: &str) -> String {
        let address = network.address(host, "store");
        match self {
            Self::Redis(..) => format!("redis://{address}:6379"),
            Self::Postgres(server) => {
                format!("postgres://postgres@{address}:{}/postgres", server.port())
            }
        }
    }
}

impl Hosts {
    async fn start(kind: Kind) -> Option<Self> {
        let mut network = Network::new(&["store", "a", "b"])?;
        for (x, y) in [
            ("a", "store"),
            ("b", "store"),
            ("a", HERE),
            ("b", HERE),
            (HERE, "store"),
        ] {
            network.link(x, y);
        }
        let server = Server::start(kind, &network)?;
        let store = connect(&server.url(&network, HERE)).await?;
        let downstream = Downstream::default();
        let port = downstream.serve().await;
        let instance = |name: &str| {
            let store_url = server.url(&network, name);
            let downstream = format!("{}:{port}", network.address(name, HERE));
            Child::start_as(
                network.command(name, std::env::current_exe().unwrap()),
                "instance",
                &[
                    (STORE_VAR, &store_url),
                    (DOWNSTREAM_VAR, &downstream),
                    (NAME_VAR, name),
                ],
            )
        };
        let (mut a, mut b) = (instance("a"), instance("b"));
        a.wait_for("ready").await;
        b.wait_for("ready").await;
        Some(Self {
            a,
            b,
            _server: server,
            store,
            downstream,
            network,
        })
    }

    /// What `key` recorded, replayed from this test's own namespace (a call whose body
    /// never runs: it fails, and leaves nothing).
    async fn recorded(&self, key: &str) -> Option<Written> {
        let op = Operation::new(NAMESPACE).lease(LEASE);
        let unrecorded = async { Err(Error::Config("the key has no record".into())) };
        match op
            .run(&self.store, &op.key(key).unwrap(), None, unrecorded)
            .await
        {
            Ok(Outcome::Replayed(written)) => Some(written),
            Ok(Outcome::Executed(_)) => unreachable!("the body fails"),
            Err(Error::Config(_)) => None,
            Err(e) => panic!("reading {key}'s record: {e}"),
        }
    }
}

/// A store on the server at `url`, once it answers (it was just started), with its table
/// made where it has one.
async fn connect(url: &str) -> Option<Arc<dyn Store>> {
    let started = Instant::now();
    loop {
        match store(url).await {
            Ok(store) => return Some(store),
            Err(e) if started.elapsed() > Duration::from_secs(10) => {
                return unavailable("the server in the store's host", e)
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// A store on the server at `url`: Redis or PostgreSQL, as the URL says.
async fn store(url: &str) -> Result<Arc<dyn Store>, Error> {
    Ok(if url.starts_with("redis:") {
        Arc::new(RedisStore::connect(url).await?.with_timeout(STORE_TIMEOUT))
    } else {
        let store = PostgresStore::connect(url).await?;
        store.migrate().await?;
        Arc::new(store.with_timeout(STORE_TIMEOUT))
    })
}

/// A line an instance printed about a call: `<event> <key> <rest…>`.
fn event<'a>(line: &'a str, event: &str, key: &str) -> Option<Vec<&'a str>> {
    let mut words = line.split(' ');
    (words.next() == Some(event) && words.next() == Some(key)).then(|| words.collect())
}

/// How a call ended, as an instance reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Ended {
    Executed(Written),
    Replayed(Written),
    Failed(String),
}

fn ended(words: &[&str]) -> Ended {
    let written = || Written {
        by: words[1].chars().next().unwrap(),
        token: words[2].parse().unwrap(),
    };
    match words[0] {
        "executed" => Ended::Executed(written()),
        "replayed" => Ended::Replayed(written()),
        _ => Ended::Failed(words[1..].join(" ")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_from_redis_is_fenced_after_the_takeover() {
    a_holder_cut_off_is_fenced_after_the_takeover(Kind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_from_postgres_is_fenced_after_the_takeover() {
    a_holder_cut_off_is_fenced_after_the_takeover(Kind::Postgres).await;
}

async fn a_holder_cut_off_is_fenced_after_the_takeover(kind: Kind) {
    let Some(mut hosts) = Hosts::start(kind).await else {
        return;
    };
    let key = "held";
    hosts.a.say(&format!("run {key} hold 0"));
    let claimed = hosts.a.line_with("claimed held").await;
    let first: u64 = event(&claimed, "claimed", key).unwrap()[0].parse().unwrap();

    hosts.network.cut("a", "store");
    let cut = Instant::now();
    // The other instance waits out the lease, takes the key over, writes downstream and
    // records.
    hosts.b.say(&format!("run {key} go 0"));
    let owner = ended(&event(&hosts.b.line_with("outcome held").await, "outcome", key).unwrap());
    let took_over = cut.elapsed();
    let Ended::Executed(owner) = owner else {
        panic!("the instance that still reaches the store must run the body: {owner:?}");
    };
    assert_eq!(owner.by, 'b');
    assert!(owner.token > first, "{owner:?} after token {first}");

    hosts.network.heal("a", "store");
    let healed = Instant::now();
    hosts.a.say(&format!("finish {key}"));
    let wrote = hosts.a.line_with("wrote held").await;
    assert_eq!(
        event(&wrote, "wrote", key).unwrap(),
        [first.to_string().as_str(), "refused"],
        "the zombie's downstream write carries its token, and is refused"
    );
    let zombie = ended(&event(&hosts.a.line_with("outcome held").await, "outcome", key).unwrap());
    let zombie_answered = healed.elapsed();
    assert_eq!(
        zombie,
        Ended::Replayed(owner),
        "the zombie's completion is fenced: it answers the owner's record"
    );

    // Not stuck: the instance that was cut off replays the key at once.
    let again = Instant::now();
    hosts.a.say(&format!("run {key} go 0"));
    let replay = ended(&event(&hosts.a.line_with("outcome held").await, "outcome", key).unwrap());
    assert_eq!(replay, Ended::Replayed(owner));
    let replayed_in = again.elapsed();

    assert_eq!(hosts.recorded(key).await, Some(owner));
    let writes = hosts.downstream.writes(key);
    let landed: Vec<_> = writes.iter().filter(|w| w.landed).collect();
    assert_eq!(landed.len(), 1, "one effect landed: {writes:?}");
    assert_eq!((landed[0].by, landed[0].token), (owner.by, owner.token));
    println!(
        "{kind:?}, partition of the holder (lease {LEASE:?}): the other instance ran the key {took_over:?} \
         after the cut; after the heal, the zombie's write was refused and its completion \
         fenced ({zombie_answered:?}); the key replayed in {replayed_in:?}"
    );
}

/// One partition at a random point, counted.
#[derive(Debug, Default)]
struct Count {
    keys: usize,
    /// Bodies of the cut-off instance that finished and whose completion the store refused.
    fenced: usize,
    /// Its downstream writes refused for their stale token.
    refused: usize,
    /// Keys whose body ran in both instances: the first one's effect landed and its record
    /// did not (the cut came between the two, and lasted past the lease); both effects
    /// landed, in token order, and the record is the second's. Only a downstream that
    /// deduplicates by `attempt().key()` makes these once.
    ran_twice: usize,
    /// Of those, the calls of the cut-off instance answered with their own, unrecorded value
    /// (every attempt to record it failed until the lease ran out).
    unrecorded: usize,
    /// Calls of the cut-off instance that ended with an error (its store unreachable).
    failed: usize,
    /// The longest time from a cut until the other instance had an answer for every key.
    recovered: Duration,
    /// The longest time from a heal until the cut-off instance had answered every call.
    healed: Duration,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_from_redis_at_random_points_leave_one_outcome_per_key() {
    partitions_at_random_points_leave_one_outcome_per_key(Kind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_from_postgres_at_random_points_leave_one_outcome_per_key() {
    partitions_at_random_points_leave_one_outcome_per_key(Kind::Postgres).await;
}

async fn partitions_at_random_points_leave_one_outcome_per_key(kind: Kind) {
    let Some(mut hosts) = Hosts::start(kind).await else {
        return;
    };
    let rounds: usize = std::env::var("IDEM_PARTITIONS").map_or(4, |n| n.parse().unwrap());
    // A new schedule each run, printed so that a failure can be run again
    // (`IDEM_PARTITION_SEED=<seed>`).
    let seed = std::env::var("IDEM_PARTITION_SEED").map_or_else(
        |_| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            now.unwrap().as_nanos() as u64
        },
        |seed| seed.parse().unwrap(),
    );
    let mut rng = rand_xorshift::XorShiftRng::seed_from_u64(seed);
    const KEYS: usize = 16;
    let mut count = Count::default();
    for round in 0..rounds {
        let keys: Vec<String> = (0..KEYS).map(|i| format!("r{round}k{i}")).collect();
        // Each key's call in the instance to be cut off is one of three: started before the
        // cut with a body of 0–20 ms (done, or finishing in the cut), started before the cut
        // with a body that goes on until after the heal (past the lease: a zombie), or
        // started after the cut. The cut comes 0–40 ms after the first call.
        let kinds: Vec<u8> = keys.iter().map(|_| rng.random_range(0..3)).collect();
        for (key, kind) in keys.iter().zip(&kinds) {
            match kind {
                0 => hosts
                    .a
                    .say(&format!("run {key} go {}", rng.random_range(0..20))),
                1 => hosts.a.say(&format!("run {key} hold 0")),
                _ => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..40))).await;
        hosts.network.cut("a", "store");
        let cut = Instant::now();
        for (key, _) in keys.iter().zip(&kinds).filter(|(_, kind)| **kind == 2) {
            hosts.a.say(&format!("run {key} go 0"));
        }
        for key in &keys {
            hosts.b.say(&format!("run {key} go 0"));
        }
        let b = outcomes(&mut hosts.b, KEYS).await;
        count.recovered = count.recovered.max(cut.elapsed());
        hosts.network.heal("a", "store");
        let healed = Instant::now();
        for (key, _) in keys.iter().zip(&kinds).filter(|(_, kind)| **kind == 1) {
            hosts.a.say(&format!("finish {key}"));
        }
        let a = outcomes(&mut hosts.a, KEYS).await;
        count.healed = count.healed.max(healed.elapsed());

        for key in &keys {
            let recorded = hosts.recorded(key).await.expect("every key recorded");
            let context = format!("seed {seed}, key {key}: {:?} {:?}", a[key], b[key]);
            match &b[key].ended {
                Ended::Executed(w) | Ended::Replayed(w) => assert_eq!(*w, recorded, "{context}"),
                Ended::Failed(e) => panic!("the instance that reaches the store failed: {e}"),
            }
            match &a[key].ended {
                Ended::Executed(w) if *w == recorded => {}
                Ended::Executed(w) => {
                    // Its body finished in the cut, and no attempt to record reached the store
                    // before the lease ran out: the caller has the value of the effect that
                    // happened, and the other instance ran the key again.
                    assert_eq!((w.by, recorded.by), ('a', 'b'), "{context}");
                    assert_eq!(a[key].wrote, Some(true), "{context}");
                    count.unrecorded += 1;
                }
                Ended::Replayed(w) => {
                    assert_eq!(*w, recorded, "{context}");
                    count.fenced += usize::from(a[key].wrote.is_some());
                }
                Ended::Failed(_) => count.failed += 1,
            }
            let writes = hosts.downstream.writes(key);
            let landed: Vec<_> = writes.iter().filter(|w| w.landed).collect();
            let last = landed.last().expect("the recorded body wrote");
            assert_eq!(
                Written {
                    by: last.by,
                    token: last.token
                },
                recorded,
                "the record and the downstream's state come from one body ({context}, {writes:?})"
            );
            if let [first, second] = landed[..] {
                // Both bodies' effects: the first instance's, then the other's, fenced in order.
                assert_eq!((first.by, second.by), ('a', 'b'), "{context}: {writes:?}");
                assert!(first.token < second.token, "{context}: {writes:?}");
                count.ran_twice += 1;
            }
            assert!(landed.len() <= 2, "{context}: {writes:?}");
            count.refused += writes.iter().filter(|w| !w.landed).count();
            assert_eq!(
                a[key].wrote == Some(false),
                writes.iter().any(|w| w.by == 'a' && !w.landed),
                "{context}"
            );
        }
        count.keys += KEYS;
    }
    println!("{kind:?}, {rounds} partitions at random points (seed {seed}): {count:?}");
}

/// What one instance said about one call.
#[derive(Debug)]
struct Said {
    /// Its downstream write, when the body got that far: landed or not.
    wrote: Option<bool>,
    ended: Ended,
}

/// Reads an instance's lines until `calls` calls have ended.
async fn outcomes(instance: &mut Child, calls: usize) -> HashMap<String, Said> {
    let mut wrote = HashMap::new();
    let mut said = HashMap::new();
    while said.len() < calls {
        let line = instance.next_line().await;
        let words: Vec<&str> = line.split(' ').collect();
        match words[..] {
            ["wrote", key, _, answer] => {
                wrote.insert(key.to_string(), answer == "landed");
            }
            ["outcome", key, ..] => {
                let ended = ended(&words[2..]);
                let wrote = wrote.remove(key);
                said.insert(key.to_string(), Said { wrote, ended });
            }
            _ => {}
        }
    }
    said
}

const STORE_VAR: &str = "IDEM_PARTITION_STORE";
const DOWNSTREAM_VAR: &str = "IDEM_PARTITION_DOWNSTREAM";
const NAME_VAR: &str = "IDEM_PARTITION_NAME";

/// An application instance, run by the tests above in a host of its own. It reads
/// instructions on its stdin: `run <key> <hold|go> <ms>` starts a call whose body prints
/// `claimed <key> <token>`, waits for `finish <key>` (hold), pauses `ms`, writes downstream
/// with its fencing token and prints `wrote <key> <token> <landed|refused>`; the call prints
/// `outcome <key> <executed|replayed> <by> <token>` or `outcome <key> failed <error>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "an application instance: started by the partition tests in a host of its own"]
async fn instance() {
    let (Ok(url), Ok(downstream), Ok(name)) = (
        std::env::var(STORE_VAR),
        std::env::var(DOWNSTREAM_VAR),
        std::env::var(NAME_VAR),
    ) else {
        println!("started alone: the partition tests run this in a host of its own");
        return;
    };
    let store = store(&url).await.unwrap();
    let op = Operation::new(NAMESPACE)
        .lease(LEASE)
        .wait_timeout(Duration::from_secs(60));
    let by = name.chars().next().unwrap();
    let mut held = HashMap::new();
    let mut calls = tokio::task::JoinSet::new();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    println!("ready");
    while let Some(line) = lines.next_line().await.unwrap() {
        let words: Vec<&str> = line.split(' ').collect();
        match words[..] {
            ["run", key, hold, pause] => {
                let finish = (hold == "hold").then(|| {
                    let (finish, finished) = tokio::sync::oneshot::channel();
                    held.insert(key.to_string(), finish);
                    finished
                });
                let pause = Duration::from_millis(pause.parse().unwrap());
                let (op, store, downstream) = (op.clone(), store.clone(), downstream.clone());
                let key = key.to_string();
                calls.spawn(async move {
                    let body = async {
                        let token = attempt().expect("in the body").token().await?;
                        println!("claimed {key} {}", token.get());
                        if let Some(finish) = finish {
                            let _ = finish.await;
                        }
                        tokio::time::sleep(pause).await;
                        let landed = write(&downstream, &key, token, by).await;
                        let answer = if landed { "landed" } else { "refused" };
                        println!("wrote {key} {} {answer}", token.get());
                        Ok::<_, Error>(Written {
                            by,
                            token: token.get(),
                        })
                    };
                    let outcome = op.run(&store, &op.key(&key).unwrap(), None, body).await;
                    match outcome {
                        Ok(Outcome::Executed(w)) => {
                            println!("outcome {key} executed {} {}", w.by, w.token)
                        }
                        Ok(Outcome::Replayed(w)) => {
                            println!("outcome {key} replayed {} {}", w.by, w.token)
                        }
                        Err(e) => println!("outcome {key} failed {}", one_line(&e)),
                    }
                });
            }
            ["finish", key] => {
                // A call whose claim failed never started its body: nothing to finish.
                let _ = held.remove(key).expect("a held call").send(());
            }
            _ => panic!("an instruction this instance does not know: {line:?}"),
        }
    }
    while calls.join_next().await.is_some() {}
}

fn one_line(e: &Error) -> String {
    e.to_string().replace('\n', " ")
}

/// One fenced write downstream: whether it landed.
async fn write(downstream: &str, key: &str, token: Token, by: char) -> bool {
    let socket = tokio::net::TcpStream::connect(downstream)
        .await
        .expect("the downstream is never cut off");
    let (read, mut write) = socket.into_split();
    write
        .write_all(format!("{key} {} {by}\n", token.get()).as_bytes())
        .await
        .unwrap();
    let answer = BufReader::new(read).lines().next_line().await.unwrap();
    answer.as_deref() == Some("landed")
}
