//! Commands per call, counted by a private Redis server itself (`INFO commandstats`): a
//! replay is one script (the claim, whose `SET … NX GET` finds the record) and nothing
//! else, a first execution two scripts (claim, complete), a release two (claim, release):
//! one round trip each. Its own binary and server, so that nothing else adds to the
//! counters.
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
async fn a_replay_is_one_script_and_a_first_execution_two() {
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
        // The claim script: its SET NX GET, and the trace of the unsettled claim; the
        // complete script, which reads the claim, SETs the record and, beside it, what the
        // claim said of itself, and deletes the trace (one round trip each, one slot).
        counts(&[("set", 4), ("evalsha", 2), ("get", 1), ("del", 1)]),
        "first execution: one script to claim, one to complete"
    );

    assert_eq!(call("k", true).await.unwrap(), Outcome::Replayed(1));
    let replayed = commands(&mut admin).await;
    let work = delta(&executed, &replayed);
    assert_eq!(
        work,
        counts(&[("evalsha", 1), ("set", 1)]),
        "replay: the claim script alone, whose SET NX GET finds the record and writes nothing"
    );

    call("released", false).await.unwrap_err();
    let released = commands(&mut admin).await;
    let work = delta(&replayed, &released);
    assert_eq!(
        work,
        // The claim script's two SETs; the release script, which reads the claim and
        // deletes it and its trace.
        counts(&[("set", 2), ("evalsha", 2), ("get", 1), ("del", 1)]),
        "release: one script to claim, one to release"
    );
}
