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
//! The instances are this test binary's ignored test `instance::instance`, run in their hosts with
//! `ip netns exec`; the store is a Redis server of the test's own in the third host. Only the
//! link between instance `a` and the store is ever cut: `a` still reaches the downstream, as
//! a service still reaches its payment gateway when the database link fails.
//!
//! Needs root (namespaces); skipped loudly without it, and failed in CI
//! (`IDEM_REQUIRE_SERVICES=1`). `IDEM_PARTITIONS=50 cargo test -p idem-tests --all-features
//! --test partitions -- --nocapture` runs 50 partitions at random points (CI runs 4).//!
//! Here: the hosts, the store and the downstream; `scenarios.rs`: the tests; `instance.rs`:
//! the application instance the hosts run.

mod instance;
mod scenarios;

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
/// What an instance is told in its environment: its store, the downstream, its name.
const STORE_VAR: &str = "IDEM_PARTITION_STORE";
const DOWNSTREAM_VAR: &str = "IDEM_PARTITION_DOWNSTREAM";
const NAME_VAR: &str = "IDEM_PARTITION_NAME";

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
                "instance::instance",
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
