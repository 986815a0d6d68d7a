//! Commands per call, counted by a private Redis server itself (`INFO commandstats`): a
//! replay is one native `SET` and nothing else, a first execution a `SET` and one script
//! (complete), a release a `SET` and one script (release). Its own binary and server, so that
//! nothing else adds to the counters.
//!
//! The server also counts the commands a script runs inside it, under their own names; each
//! delta below is asserted whole, with those named.

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

/// A delta of commands, by name.
fn counts(commands: &[(&str, u64)]) -> BTreeMap<String, u64> {
    commands
        .iter()
        .map(|(name, calls)| ((*name).to_string(), *calls))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_one_native_command_and_a_first_execution_one_script() {
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
        work,
        // The claim's SET; the complete script, which reads the claim and SETs the record
        // and, beside it, what the claim said of itself (one round trip, one slot).
        counts(&[("set", 3), ("evalsha", 1), ("get", 1)]),
        "first execution: a native claim, one script to complete"
    );

    assert_eq!(call("k", true).await.unwrap(), Outcome::Replayed(1));
    let replayed = commands(&mut admin).await;
    let work = delta(&executed, &replayed);
    assert_eq!(
        work,
        counts(&[("set", 1)]),
        "replay: the native claim (SET NX GET) alone, which finds the record and writes nothing"
    );

    call("released", false).await.unwrap_err();
    let released = commands(&mut admin).await;
    let work = delta(&replayed, &released);
    assert_eq!(
        work,
        // The claim's SET; the release script, which reads the claim and deletes it.
        counts(&[("set", 1), ("evalsha", 1), ("get", 1), ("del", 1)]),
        "release: a native claim, one script to release"
    );
}
