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
