//! Round trips per call, counted by a private Redis server itself (`INFO commandstats`): a
//! replay is one command, a first execution two (claim, complete), a release two (claim,
//! release). Its own binary and server, so that nothing else adds to the counters.
//!
//! The server also counts the commands a script runs inside it; those belong to the one
//! `EVALSHA` round trip that ran the script. Commands a client can send are told apart from
//! them by name: every command our scripts run is in `SCRIPT_INTERNAL`.

use std::collections::BTreeMap;

use idem_runtime::{Error, Operation, Outcome, RedisStore};
use idem_tests::PrivateRedis;

/// Commands the server has processed, by name, without the `info` that asks.
async fn commands(admin: &mut redis::aio::MultiplexedConnection) -> BTreeMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .unwrap();
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = stats.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
            Some((name.to_string(), calls.parse().ok()?))
        })
        .filter(|(name, _)| name != "info")
        .collect()
}

/// What ran between two readings.
fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(name, calls)| (name.clone(), calls - before.get(name).copied().unwrap_or(0)))
        .filter(|(_, calls)| *calls > 0)
        .collect()
}

/// The commands our Lua scripts run inside Redis.
const SCRIPT_INTERNAL: &[&str] = &["hmget", "hget", "hset", "pexpire", "time", "del"];

/// The commands the client sent: the round trips.
fn round_trips(delta: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    delta
        .iter()
        .filter(|(name, _)| !SCRIPT_INTERNAL.contains(&name.as_str()))
        .map(|(name, calls)| (name.clone(), *calls))
        .collect()
}

fn evalsha(n: u64) -> BTreeMap<String, u64> {
    [("evalsha".to_string(), n)].into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_is_one_command_execution_two_release_two() {
    let Some(server) = PrivateRedis::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url).await.unwrap();
    let mut admin = redis::Client::open(server.url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let op = Operation::new("round-trips");
    let call = |key: &'static str, ok: bool| {
        let (op, store) = (op.clone(), store.clone());
        async move {
            let key = op.key(key).unwrap();
            op.run(&store, &key, None, async move {
                if ok {
                    Ok(1_u32)
                } else {
                    Err(Error::store("the body failed"))
                }
            })
            .await
        }
    };
    // Load the scripts once (EVALSHA, NOSCRIPT, SCRIPT LOAD, EVALSHA), as any first use does.
    assert!(!call("warm-up", true).await.unwrap().is_replayed());
    call("warm-up-error", false).await.unwrap_err();

    let before = commands(&mut admin).await;
    assert_eq!(call("k", true).await.unwrap(), Outcome::Executed(1));
    let executed = commands(&mut admin).await;
    let work = delta(&before, &executed);
    assert_eq!(
        round_trips(&work),
        evalsha(2),
        "first execution: claim + complete; {work:?}"
    );

    assert_eq!(call("k", true).await.unwrap(), Outcome::Replayed(1));
    let replayed = commands(&mut admin).await;
    let work = delta(&executed, &replayed);
    assert_eq!(
        round_trips(&work),
        evalsha(1),
        "replay: claim only; {work:?}"
    );
    assert_eq!(
        work.get("hmget"),
        Some(&1),
        "a replay reads the record once and writes nothing"
    );
    assert_eq!(work.len(), 2, "{work:?}");

    call("released", false).await.unwrap_err();
    let released = commands(&mut admin).await;
    let work = delta(&replayed, &released);
    assert_eq!(
        round_trips(&work),
        evalsha(2),
        "release: claim + release; {work:?}"
    );
}
