//! What `RedisStore::with_replicas(1, …)` costs a first execution: a claim and a
//! completion that each wait for the replica's acknowledgement (`WAIT`), interleaved with the
//! same call on the same primary without it (`interleaved/mod.rs`).
//!
//! `cargo bench -p idem-runtime --bench replicas --features redis`
//!
//! It starts a primary and a replica of its own (`redis-server` on free loopback ports) and
//! stops them at the end; without `redis-server` it says so and measures nothing.

#[allow(dead_code)] // the Redis floor helpers are other benches'
mod common;
mod interleaved;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_runtime::{Error, Operation, RedisStore};
use interleaved::{measure, on as side};

/// A `redis-server` of this bench's own, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .unwrap()
}

fn start(port: u16, dir: &std::path::Path, extra: &[String]) -> Option<Server> {
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .args(["--appendonly", "no", "--repl-diskless-sync-delay", "0"])
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdout(Stdio::null())
        .spawn()
        .ok()?;
    Some(Server(child))
}

fn info(port: u16) -> String {
    let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}")) else {
        return String::new();
    };
    let Ok(mut connection) = client.get_connection() else {
        return String::new();
    };
    redis::cmd("INFO")
        .arg("replication")
        .query(&mut connection)
        .unwrap_or_default()
}

/// Waits until `port`'s replication info shows `expected`, at most 30 s.
fn until(port: u16, expected: &str) {
    let started = Instant::now();
    while !info(port).contains(expected) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{expected} on {port}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn main() {
    let dir = std::env::temp_dir().join(format!("idem-bench-replicas-{}", std::process::id()));
    let (primary_dir, replica_dir) = (dir.join("primary"), dir.join("replica"));
    std::fs::create_dir_all(&primary_dir).unwrap();
    std::fs::create_dir_all(&replica_dir).unwrap();
    let (primary_port, replica_port) = (free_port(), free_port());
    let Some(_primary) = start(primary_port, &primary_dir, &[]) else {
        return println!("skipped: redis-server cannot run here");
    };
    let replica_of = [
        "--replicaof".into(),
        "127.0.0.1".into(),
        primary_port.to_string(),
    ];
    let _replica = start(replica_port, &replica_dir, &replica_of).unwrap();
    until(replica_port, "master_link_status:up");
    until(primary_port, "state=online");

    let rt = common::runtime();
    let url = format!("redis://127.0.0.1:{primary_port}");
    let plain = rt.block_on(RedisStore::connect(&url)).unwrap();
    let replicated = plain.clone().with_replicas(1, Duration::from_secs(1));
    let op = Operation::new("bench.replicas");
    let next = AtomicU64::new(0);
    let first = |store: RedisStore| {
        let (op, next) = (&op, &next);
        move || {
            let store = store.clone();
            async move {
                let key = op.key(&next.fetch_add(1, Ordering::Relaxed)).unwrap();
                op.run(&store, &key, None, async {
                    Ok::<_, Error>(common::receipt(1))
                })
                .await
                .unwrap()
            }
        }
    };
    let ratio = measure(
        &mut side(&rt, first(replicated)),
        &mut side(&rt, first(plain)),
        Duration::from_secs(4),
    );
    println!(
        "\n{:<58} {:>10} {:>10} {:>6} {:>13} {:>6}",
        "path", "ours", "baseline", "ratio", "p10 – p90", "pairs"
    );
    println!(
        "{:<58} {:>10.1?} {:>10.1?} {:>6.2} {:>13} {:>6}",
        "first execution with_replicas(1) vs without, one replica",
        ratio.ours,
        ratio.baseline,
        ratio.median,
        format!("{:.2} – {:.2}", ratio.low, ratio.high),
        ratio.pairs
    );
    drop(rt);
    let _ = std::fs::remove_dir_all(dir);
}
