//! A store that blinks while a handler runs: Redis killed for a second and restarted (empty:
//! it keeps nothing on disk), or frozen (`SIGSTOP`) for two seconds and resumed, with the
//! handler answering during the blip or after it. The handler's answer goes out once
//! Redis answers again, within the store's timeout, never after the whole lease; it is the
//! handler's own `201`, recorded, so that the client's retry replays it.

use std::time::{Duration, Instant};

use idem_runtime::RedisStore;
use idem_tests::PrivateRedis;

use super::*;

enum Blip {
    /// Killed for 1 s, then started again on its port.
    Killed,
    /// Stopped for 2 s, then resumed.
    Frozen,
}

/// When the handler returns.
#[derive(Clone, Copy, Debug)]
enum Returns {
    DuringTheBlip,
    AfterIt,
}

async fn a_blip_mid_handler(blip: Blip, returns: Returns) {
    let Some(mut server) = PrivateRedis::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url).await.unwrap();
    let app = App::default();
    // The default lease (8 s): an answer held for it is the bug this guards.
    let client = server_with(&app, unscoped(store)).await;
    let first = {
        let client = client.clone();
        tokio::spawn(async move { client.post("/slow", "blip-1", "{}").await })
    };
    app.entered.notified().await;
    let answer_during = || {
        if matches!(returns, Returns::DuringTheBlip) {
            app.open();
        }
    };
    let pid = server.pid().to_string();
    let signal = |name: &str| {
        let sent = std::process::Command::new("kill")
            .args([name, &pid])
            .status();
        assert!(sent.unwrap().success(), "kill {name} the private redis");
    };
    let _restarted = match blip {
        Blip::Killed => {
            server.kill();
            answer_during();
            tokio::time::sleep(Duration::from_secs(1)).await;
            Some(PrivateRedis::start_on(server.port).expect("redis back on its port"))
        }
        Blip::Frozen => {
            signal("-STOP");
            answer_during();
            tokio::time::sleep(Duration::from_secs(2)).await;
            signal("-CONT");
            None
        }
    };
    let back = Instant::now();
    if matches!(returns, Returns::AfterIt) {
        app.open();
    }
    let answer = first.await.unwrap();
    let after = back.elapsed();
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    assert!(!answer.replayed());
    // Within the store's timeout (3 s) of Redis answering again, with as much again for a
    // loaded machine: short of the 8 s lease an answer held for it would take.
    assert!(
        after < idem_runtime::store::redis::DEFAULT_TIMEOUT * 2,
        "the answer went out {after:?} after Redis was back"
    );
    let again = client.post("/slow", "blip-1", "{}").await;
    assert!(again.replayed(), "{again:?}");
    assert!(again.same_as(&answer));
    assert_eq!(app.runs(), 1);
    let blip = match blip {
        Blip::Killed => "killed 1 s",
        Blip::Frozen => "frozen 2 s",
    };
    println!("redis {blip}, the handler returning {returns:?}: the 201 went out {after:?} after Redis answered again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_while_the_handler_answers() {
    a_blip_mid_handler(Blip::Killed, Returns::DuringTheBlip).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_before_the_handler_answers() {
    a_blip_mid_handler(Blip::Killed, Returns::AfterIt).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_while_the_handler_answers() {
    a_blip_mid_handler(Blip::Frozen, Returns::DuringTheBlip).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_before_the_handler_answers() {
    a_blip_mid_handler(Blip::Frozen, Returns::AfterIt).await;
}

/// Redis gone for longer than its timeout while the handler answers: the client gets the
/// handler's own `201` marked `Idempotent-Unrecorded: true` once the store's timeout is
/// over, not a `500` after the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_gone_past_its_timeout_the_handlers_201_goes_out_marked() {
    let Some(mut server) = PrivateRedis::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url).await.unwrap();
    let app = App::default();
    // A lease far past the store's timeout (3 s): an answer held for it is the bug.
    let lease = Duration::from_secs(60);
    let client = server_with(&app, unscoped(store).lease(lease)).await;
    let first = {
        let client = client.clone();
        tokio::spawn(async move { client.post("/slow", "gone-1", "{}").await })
    };
    app.entered.notified().await;
    server.kill();
    let killed = Instant::now();
    app.open();
    let answer = first.await.unwrap();
    let after = killed.elapsed();
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    assert_eq!(
        answer.headers[idem_runtime::http::IDEMPOTENT_UNRECORDED],
        "true",
        "{answer:?}"
    );
    assert!(!answer.replayed());
    assert_eq!(app.runs(), 1);
    assert!(
        after < lease / 4,
        "answered {after:?} after Redis went away (lease {lease:?})"
    );
    println!("redis gone: the handler's 201 went out marked unrecorded {after:?} after the kill");
}
