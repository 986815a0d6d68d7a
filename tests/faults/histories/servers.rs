//! Histories on servers of the test's own: a Redis server frozen (`SIGSTOP`, for longer
//! than the lease) and thawed, and killed (`SIGKILL`) and restarted on its port, over and
//! over while the calls run; a PostgreSQL server crashed (`pg_ctl stop -m immediate`) and
//! started again the same way. The Redis server keeps every write on disk before it
//! answers (`appendfsync always`), so that a kill loses nothing it acknowledged: what the
//! store promises over a crash of such a server. The calls' store operations fail as in
//! the other histories on top of that.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use idem_runtime::testkit::{histories, Faults, Plan};
use idem_runtime::{PostgresStore, RedisStore};
use idem_tests::{PrivatePostgres, PrivateRedis};

use super::{calls, seeds};

/// What happens to the server while the calls run.
#[derive(Clone, Copy, Debug)]
enum Blow {
    /// `SIGSTOP` for a lease and a half, then `SIGCONT`.
    Freeze,
    /// `SIGKILL`, then started again on its port from its append-only file.
    Kill,
}

async fn under(blow: Blow, base: u64) {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("histories-redis-{}-{base}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let durable = |dir: &std::path::Path| {
        ["--appendonly", "yes", "--appendfsync", "always", "--dir"]
            .into_iter()
            .map(String::from)
            .chain([dir.display().to_string()])
            .collect::<Vec<_>>()
    };
    let Some(server) = PrivateRedis::start_with_args(&durable(&dir)) else {
        return;
    };
    let (url, port) = (server.url.clone(), server.port);
    let server = Arc::new(std::sync::Mutex::new(Some(server)));
    for seed in seeds(base) {
        let plan = Plan::new(seed).calls(calls(), (calls() * 2 / 25).max(1) as u64);
        let lease = plan.lease;
        let stores = [
            RedisStore::connect(&url).await.unwrap(),
            RedisStore::connect(&url).await.unwrap(),
        ];
        let done = Arc::new(AtomicBool::new(false));
        let blows = {
            let (done, server, dir) = (done.clone(), server.clone(), dir.clone());
            tokio::spawn(async move {
                // The first blow comes at once, so that every run has one however fast
                // its calls end; then one every half lease until they have.
                let mut blows = 0;
                loop {
                    if blows > 0 {
                        if done.load(Ordering::Relaxed) {
                            break;
                        }
                        tokio::time::sleep(lease / 2).await;
                    }
                    let pid = server.lock().unwrap().as_ref().map(PrivateRedis::pid);
                    let Some(pid) = pid else { break };
                    match blow {
                        Blow::Freeze => {
                            signal("-STOP", pid);
                            tokio::time::sleep(lease + lease / 2).await;
                            signal("-CONT", pid);
                        }
                        Blow::Kill => {
                            if let Some(mut old) = server.lock().unwrap().take() {
                                old.kill();
                            }
                            tokio::time::sleep(lease / 2).await;
                            let back = PrivateRedis::start_on_with_args(port, &durable(&dir));
                            *server.lock().unwrap() = Some(back.expect("redis back on its port"));
                        }
                    }
                    blows += 1;
                }
                blows
            })
        };
        let report = histories(&stores, &plan.faults(Faults::ten_percent())).await;
        done.store(true, Ordering::Relaxed);
        let blows = blows.await.unwrap();
        println!("redis {blow:?} x{blows}: seed {seed}: {report}");
        assert!(blows > 0, "the server was {blow:?} while the calls ran");
    }
}

fn signal(name: &str, pid: u32) {
    let sent = std::process::Command::new("kill")
        .args([name, &pid.to_string()])
        .status();
    assert!(sent.unwrap().success(), "kill {name} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_past_the_lease_again_and_again() {
    under(Blow::Freeze, 21).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_again_and_again() {
    under(Blow::Kill, 22).await;
}

/// PostgreSQL crashed and started again, over and over while the calls run: at once, then
/// every lease once it is back. A claim in flight when it goes down fails closed; a
/// completion that cannot land is retried, and answered `Unrecorded` past its bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crashed_and_restarted_again_and_again() {
    let Some(server) = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .unwrap()
    else {
        return;
    };
    let server = Arc::new(server);
    let first = PostgresStore::connect(&server.url).await.unwrap();
    first.migrate().await.unwrap();
    let stores = [first, PostgresStore::connect(&server.url).await.unwrap()];
    for seed in seeds(23) {
        let plan = Plan::new(seed).calls(calls(), (calls() * 2 / 25).max(1) as u64);
        let lease = plan.lease;
        let done = Arc::new(AtomicBool::new(false));
        let crashes = {
            let (done, server) = (done.clone(), server.clone());
            tokio::task::spawn_blocking(move || {
                let mut crashes = 0;
                while crashes == 0 || !done.load(Ordering::Relaxed) {
                    server.crash();
                    std::thread::sleep(lease / 2);
                    server.start_again();
                    crashes += 1;
                    std::thread::sleep(lease);
                }
                crashes
            })
        };
        let report = histories(&stores, &plan.faults(Faults::ten_percent())).await;
        done.store(true, Ordering::Relaxed);
        let crashes = crashes.await.unwrap();
        println!("postgres crashed x{crashes}: seed {seed}: {report}");
    }
}
