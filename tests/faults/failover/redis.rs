//! Redis with a replica: a Sentinel failover followed without a restart, and what
//! `RedisStore::with_replicas` buys, counted over many failovers at random points.
//!
//! Every server here is the test's own (a primary, a replica, a sentinel on free loopback
//! ports), started and killed by PID; the shared server on 6379 is never touched.
//!
//! `IDEM_FAILOVERS=200 cargo test -p idem-tests --all-features --test redis_failover -- --nocapture`
//! runs the count over 200 failovers per mode (CI runs 10).

use idem_runtime::ClaimRequest;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem_runtime::{Claim, Error, Operation, Outcome, RedisStore, Store};
use idem_tests::failover::{until, Claimers, Count};
use idem_tests::sentinel::{
    command, fast_sync, replica_args, replica_of, replication_has, PrivateSentinel,
};
use idem_tests::PrivateRedis;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_is_followed_without_a_restart() {
    let Some(mut primary) = PrivateRedis::start_with_args(&fast_sync()) else {
        return;
    };
    let Some(replica) = replica_of(&primary).await else {
        return;
    };
    let Some(sentinel) = PrivateSentinel::start(&primary).await else {
        return;
    };
    let store = RedisStore::connect_sentinel([sentinel.url.as_str()], "idem")
        .await
        .unwrap()
        .with_replicas(1, Duration::from_secs(2));
    let op = Operation::new("redis.failover.sentinel");
    let (before, after) = (op.key(&1).unwrap(), op.key(&2).unwrap());
    let recorded = op
        .run(&store, &before, None, async {
            Ok::<_, Error>("before".to_string())
        })
        .await
        .unwrap();
    assert_eq!(recorded, Outcome::Executed("before".to_string()));

    primary.kill();
    let killed = Instant::now();
    sentinel.promoted(&replica).await;
    println!(
        "the sentinel promoted the replica {:.1?} after the kill",
        killed.elapsed()
    );

    // The new primary has no replica yet: a claim it cannot get acknowledged is refused,
    // and its body does not run.
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let body = || async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, Error>("after".to_string())
    };
    let refused = op.run(&store, &after, None, body()).await;
    assert!(matches!(refused, Err(Error::Store(_))), "{refused:?}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "no body runs on an unreplicated claim"
    );

    // The old primary comes back as the new primary's replica (as its orchestrator restarts
    // it; the sentinel would convert it too, after its next look), and the same store,
    // never restarted, runs and replays through the new primary.
    let _back =
        PrivateRedis::start_on_with_args(primary.port, &replica_args(replica.port)).unwrap();
    until("the returning server's link to the new primary", || {
        replication_has(&replica.url, "state=online")
    })
    .await;
    let started = Instant::now();
    let answered = loop {
        match op.run(&store, &after, None, body()).await {
            Ok(outcome) => break outcome,
            // While the sentinel settles (it may flag the new primary down for a moment
            // after the switch), calls fail closed; they never run a body.
            Err(Error::Store(why)) if started.elapsed() < Duration::from_secs(30) => {
                eprintln!("retrying after: {why}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(other) => panic!("{other:?}"),
        }
    };
    assert_eq!(answered, Outcome::Executed("after".to_string()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let replay = op
        .run(&store, &before, None, async {
            Ok::<_, Error>("again".to_string())
        })
        .await
        .unwrap();
    assert_eq!(
        replay,
        Outcome::Replayed("before".to_string()),
        "a record the replica acknowledged survives the failover"
    );
}

/// How many failovers each mode of the count makes: `IDEM_FAILOVERS`, 10 by default.
fn failovers() -> usize {
    std::env::var("IDEM_FAILOVERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(10)
}

/// Failovers at random points: callers claim fresh keys on the primary as fast as they can;
/// the primary is SIGKILLed at a random moment, the replica promoted (`REPLICAOF NO ONE`,
/// what Sentinel does), and every claim the old primary acknowledged is looked for on the new
/// one. The killed server comes back as the new primary's replica for the next round.
async fn count_lost_claims(replicas: Option<u32>, link: Link) -> Option<Count> {
    let mut primary = PrivateRedis::start_with_args(&fast_sync())?;
    let mut replica = replica_of(&primary).await?;
    let mut count = Count::default();
    let mut seed = 0x2545_f491_4f6c_dd1d_u64 ^ u64::from(replicas.unwrap_or(7));
    for round in 0..failovers() {
        let store = RedisStore::connect(&primary.url).await.unwrap();
        let store = match replicas {
            Some(n) => store.with_replicas(n, Duration::from_millis(100)),
            None => store,
        };
        if link == Link::Cut {
            // The replica stops following the primary, keeping what it has: a partition
            // between the two, or a replica that fell behind.
            let nowhere = idem_tests::free_port()?.to_string();
            command(
                &replica.url,
                redis::cmd("REPLICAOF").arg("127.0.0.1").arg(nowhere),
            )
            .await
            .unwrap();
        }
        if link == Link::Healthy {
            // The replica applies the stream: a write it acknowledged, before the claims.
            command(
                &primary.url,
                redis::cmd("SET").arg("idem-failover-marker").arg(round),
            )
            .await
            .unwrap();
            until("the replica's acknowledgement of a write", || async {
                let acknowledged = command(&primary.url, redis::cmd("WAIT").arg(1).arg(100)).await;
                matches!(acknowledged, Ok(redis::Value::Int(1)))
            })
            .await;
        }
        let claimers = Claimers::start(&store, 8, "redis.failover.count", round);
        // A random moment after the callers got going.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        claimers.until(20 + (seed % 200) as usize, 16).await;
        primary.kill();
        let (acknowledged, refused) = claimers.stop().await;
        // Promoted once it saw its primary go (as Sentinel promotes it only after its
        // primary was down for a while): by then it applied what reached it.
        until("the replica's view of the kill", || {
            replication_has(&replica.url, "master_link_status:down")
        })
        .await;
        command(&replica.url, redis::cmd("REPLICAOF").arg("NO").arg("ONE"))
            .await
            .unwrap();
        let promoted = RedisStore::connect(&replica.url).await.unwrap();
        count.failover(&promoted, &acknowledged, refused).await;

        // The old primary comes back as the replica of the new one.
        let port = primary.port;
        drop(primary);
        primary = replica;
        replica = PrivateRedis::start_on_with_args(port, &replica_args(primary.port))?;
        until("the new replica's link", || {
            replication_has(&replica.url, "master_link_status:up")
        })
        .await;
        until("the new primary's view of its replica", || {
            replication_has(&primary.url, "state=online")
        })
        .await;
    }
    Some(count)
}

/// The replication link during a round of the count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    /// The replica follows the primary on loopback, as fast as it can.
    Healthy,
    /// The replica stopped following the primary before the claims.
    Cut,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_replicas_no_acknowledged_claim_is_lost_in_a_failover() {
    let mut counts = Vec::new();
    for link in [Link::Healthy, Link::Cut] {
        for replicas in [None, Some(1)] {
            let Some(count) = count_lost_claims(replicas, link).await else {
                return;
            };
            let knob = replicas.map_or("without with_replicas".into(), |n| {
                format!("with_replicas({n}, 100 ms)")
            });
            println!("{link:?} link, {knob}: {count:?}");
            counts.push((link, replicas, count));
        }
    }
    for (link, replicas, count) in &counts {
        match replicas {
            Some(_) => assert_eq!(count.lost, 0, "{link:?}: an acknowledged claim was lost"),
            None if *link == Link::Cut => assert_eq!(
                count.lost, count.acknowledged,
                "a cut replica has none of the claims the primary acknowledged"
            ),
            None => {}
        }
        if *link == Link::Healthy || replicas.is_none() {
            assert!(count.acknowledged > 0, "{link:?} {replicas:?}: {count:?}");
        }
    }
}

/// Sends `signal` (`STOP`, `CONT`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// With `with_replicas`, what no replica acknowledged fails closed: a renewal, a fence and a
/// completion fail with `Error::Store` (applied on the primary all the same, as the README
/// says), and a new claim is refused and released; once the replica answers again, claims
/// are acknowledged again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_replicas_fails_what_no_replica_acknowledged() {
    let Some(primary) = PrivateRedis::start_with_args(&fast_sync()) else {
        return;
    };
    let Some(replica) = replica_of(&primary).await else {
        return;
    };
    let plain = RedisStore::connect(&primary.url).await.unwrap();
    // What must be acknowledged gets a generous wait (a loaded machine delays the replica);
    // what must not be, with the replica stopped, a short one: it can only fail sooner.
    let patient = plain.clone().with_replicas(1, Duration::from_secs(10));
    let store = plain.clone().with_replicas(1, Duration::from_millis(100));
    let op = Operation::new("replicas.refused");
    let (held, refused, later) = (
        op.key(&1).unwrap(),
        op.key(&2).unwrap(),
        op.key(&3).unwrap(),
    );
    let lease = Duration::from_secs(30);
    let Claim::Acquired { token, .. } = patient
        .claim(&ClaimRequest::new(&held, lease))
        .await
        .unwrap()
    else {
        panic!("a fresh key is free, and the replica acknowledges its claim");
    };

    signal(replica.pid(), "STOP");
    let renewed = store.renew(&held, token, lease).await;
    let fenced = store.fence(&held, token).await;
    let completed = store
        .complete(&held, token, "v\"done\"".into(), Duration::from_secs(60))
        .await;
    let claimed = store.claim(&ClaimRequest::new(&refused, lease)).await;
    signal(replica.pid(), "CONT");

    assert!(matches!(renewed, Err(Error::Store(_))), "{renewed:?}");
    assert!(matches!(fenced, Err(Error::Store(_))), "{fenced:?}");
    assert!(matches!(completed, Err(Error::Store(_))), "{completed:?}");
    assert!(matches!(claimed, Err(Error::Store(_))), "{claimed:?}");
    // The completion was applied on the primary; the refused claim was released there.
    let record = plain
        .lookup(&held)
        .await
        .unwrap()
        .expect("recorded on the primary");
    assert_eq!(&record.value[..], b"v\"done\"");
    assert!(plain.lookup(&refused).await.unwrap().is_none());
    assert!(matches!(
        plain
            .claim(&ClaimRequest::new(&refused, lease))
            .await
            .unwrap(),
        Claim::Acquired { .. }
    ));

    assert!(matches!(
        patient
            .claim(&ClaimRequest::new(&later, lease))
            .await
            .unwrap(),
        Claim::Acquired { .. }
    ));
}
