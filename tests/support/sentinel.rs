//! Redis replication of the tests' own: a replica of a private primary, and a Sentinel
//! that monitors it as `idem` (for the failover tests and the operated Sentinel store).

use std::sync::atomic::Ordering;

use crate::failover::until;
use crate::{unavailable, PrivateRedis};

/// Asks `url` for `INFO replication` and whether its text has `expected`.
pub async fn replication_has(url: &str, expected: &str) -> bool {
    let Ok(client) = redis::Client::open(url) else {
        return false;
    };
    let Ok(mut connection) = client.get_multiplexed_async_connection().await else {
        return false;
    };
    let info: Result<String, _> = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut connection)
        .await;
    info.is_ok_and(|info| info.contains(expected))
}

pub async fn command(url: &str, cmd: &redis::Cmd) -> redis::RedisResult<redis::Value> {
    let client = redis::Client::open(url)?;
    let mut connection = client.get_multiplexed_async_connection().await?;
    cmd.query_async(&mut connection).await
}

/// A replica of `primary`, in sync.
pub async fn replica_of(primary: &PrivateRedis) -> Option<PrivateRedis> {
    let replica = PrivateRedis::start_with_args(&replica_args(primary.port))?;
    until("the replica's link to its primary", || {
        replication_has(&replica.url, "master_link_status:up")
    })
    .await;
    until("the primary's view of its replica", || {
        replication_has(&primary.url, "state=online")
    })
    .await;
    Some(replica)
}

pub fn replica_args(primary: u16) -> Vec<String> {
    let mut args = fast_sync();
    args.extend([
        "--replicaof".into(),
        "127.0.0.1".into(),
        primary.to_string(),
    ]);
    args
}

/// A server of its own for the failovers: a replica's first sync at once (not after the
/// default 5 s wait for more replicas), and a directory of its own for the snapshot it loads,
/// so that no server ever loads a snapshot another one wrote.
pub fn fast_sync() -> Vec<String> {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "idem-redis-failover-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    [
        "--repl-diskless-sync-delay",
        "0",
        "--dir",
        dir.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

/// A Redis Sentinel of the test's own that monitors `primary` as `idem`.
pub struct PrivateSentinel {
    child: std::process::Child,
    /// Where it answers: `redis://127.0.0.1:PORT`.
    pub url: String,
    dir: std::path::PathBuf,
}

impl PrivateSentinel {
    pub async fn start(primary: &PrivateRedis) -> Option<Self> {
        let port = crate::free_port()?;
        let dir = std::env::temp_dir().join(format!("idem-sentinel-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let config = dir.join("sentinel.conf");
        std::fs::write(
            &config,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor idem 127.0.0.1 {} 1\n\
                 sentinel down-after-milliseconds idem 300\nsentinel failover-timeout idem 3000\n",
                dir.display(),
                primary.port
            ),
        )
        .ok()?;
        let child = match std::process::Command::new("redis-server")
            .arg(&config)
            .arg("--sentinel")
            .stdout(std::process::Stdio::null())
            .spawn()
        {
            Ok(child) => child,
            Err(e) => return unavailable("redis-server --sentinel", e),
        };
        let sentinel = Self {
            child,
            url: format!("redis://127.0.0.1:{port}"),
            dir,
        };
        // Ready once it knows the replica: only then can it promote it.
        let url = sentinel.url.clone();
        until("the sentinel's view of the replica", || {
            let url = url.clone();
            async move {
                let replicas =
                    command(&url, redis::cmd("SENTINEL").arg("replicas").arg("idem")).await;
                matches!(replicas, Ok(redis::Value::Array(found)) if !found.is_empty())
            }
        })
        .await;
        Some(sentinel)
    }
}

impl PrivateSentinel {
    /// Waits until the sentinel names `replica` as the primary (after its primary died).
    pub async fn promoted(&self, replica: &PrivateRedis) {
        let sentinel = self.url.clone();
        until("the sentinel's promotion of the replica", || {
            let (sentinel, port) = (sentinel.clone(), replica.port.to_string());
            async move {
                let found = command(
                    &sentinel,
                    redis::cmd("SENTINEL")
                        .arg("get-master-addr-by-name")
                        .arg("idem"),
                )
                .await;
                matches!(found, Ok(redis::Value::Array(addr)) if addr.get(1) == Some(&redis::Value::BulkString(port.into_bytes())))
            }
        })
        .await;
    }
}

impl Drop for PrivateSentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
