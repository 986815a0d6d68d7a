//! A step's record is fenced by its call's claim, and a step never starts on a lease its
//! holder cannot vouch for: two zombie interleavings, driven by gates, on every store.

use std::sync::Arc;
use std::time::Duration;

use idem_runtime::{step, Error, Operation, Outcome, Store};
use idem_tests::scenarios::namespace;
use idem_tests::Probe;
use tokio::sync::{oneshot, Notify};

use super::stores::every_store;
use super::Effect;

/// The operation of a scenario: a short lease, so that a zombie's lapses soon, and a new
/// holder that waits for it as long as it takes.
fn operation(scenario: &str) -> Operation {
    Operation::new(namespace(scenario))
        .lease(Duration::from_millis(300))
        .wait(Duration::from_secs(60))
}

/// Holder A runs a step and is frozen with its record on the way (at a gate, its renewals
/// faked so that it believes it holds the key); its lease lapses; B takes the call over and
/// waits before that step; A's record then lands — and is refused. B runs the step itself,
/// and every later call replays B's value, never A's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_cannot_record_a_step_after_a_takeover() {
    for (name, store) in every_store("zombie_record").await {
        zombie_record(name, store).await;
    }
}

async fn zombie_record(name: &str, store: Arc<dyn Store>) {
    let op = operation("steps_zombie_record");
    let key = op.key(&"order-1").unwrap();
    let charge = Effect::default();
    let (zombie, gate) = Probe::frozen_step_gated(store.clone());
    let a = tokio::spawn({
        let (op, charge) = (op.clone(), charge.clone());
        async move {
            op.run(&zombie, &key, None, async {
                step("charge", charge.run("charge")).await
            })
            .await
        }
    });
    gate.reached().await;

    let (b_holds, holds) = oneshot::channel();
    let proceed = Arc::new(Notify::new());
    let b = tokio::spawn({
        let (op, charge, proceed) = (op.clone(), charge.clone(), proceed.clone());
        let store = Probe::apart(store.clone());
        async move {
            op.run(&store, &key, None, async {
                b_holds.send(()).unwrap();
                proceed.notified().await;
                step("charge", charge.run("charge")).await
            })
            .await
        }
    });
    holds.await.unwrap();
    gate.open();
    let a = a.await.unwrap();
    // Its step ran, its record refused: `Unrecorded`, never `Store`.
    assert!(matches!(a, Err(Error::Unrecorded(_))), "{name}: {a:?}");
    proceed.notify_one();
    let b = b.await.unwrap().unwrap();
    assert_eq!(
        b,
        Outcome::Executed("charge:2".to_string()),
        "{name}: the new holder ran the step itself; the zombie's run (charge:1) is the caveat"
    );
    let later = op
        .run(&store, &key, None, async {
            step("charge", charge.run("charge")).await
        })
        .await
        .unwrap();
    assert_eq!(later, Outcome::Replayed("charge:2".to_string()), "{name}");
    assert_eq!(charge.runs(), 2, "{name}");
}

/// Holder A's renewals fail and the answer of its round trip before a step (the read of
/// the call's steps) comes late, after its lease ran out and B took the call over: A does
/// not start the step, by its own clock, and B runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_does_not_start_a_step_after_a_takeover() {
    for (name, store) in every_store("zombie_start").await {
        zombie_start(name, store).await;
    }
}

async fn zombie_start(name: &str, store: Arc<dyn Store>) {
    let op = operation("steps_zombie_start");
    let key = op.key(&"order-2").unwrap();
    let one = Effect::default();
    let (zombie, gate) = Probe::steps_gated(store.clone());
    let a = tokio::spawn({
        let (op, one, zombie) = (op.clone(), one.clone(), zombie.clone());
        async move {
            op.run(&zombie, &key, None, async {
                zombie.fail_renewals(usize::MAX);
                step("one", one.run("one")).await
            })
            .await
        }
    });
    gate.reached().await;

    let (b_holds, holds) = oneshot::channel();
    let proceed = Arc::new(Notify::new());
    let b = tokio::spawn({
        let (op, one, proceed) = (op.clone(), one.clone(), proceed.clone());
        let store = Probe::apart(store.clone());
        async move {
            op.run(&store, &key, None, async {
                b_holds.send(()).unwrap();
                proceed.notified().await;
                step("one", one.run("one")).await
            })
            .await
        }
    });
    holds.await.unwrap();
    // A's renewals reach the store again: what it hears now is the truth.
    zombie.fail_renewals(0);
    gate.open();
    let a = a.await.unwrap();
    // It did not start its step: `Store`, which says nothing ran.
    assert!(matches!(a, Err(Error::Store(_))), "{name}: {a:?}");
    proceed.notify_one();
    let b = b.await.unwrap().unwrap();
    assert_eq!(b, Outcome::Executed("one:1".to_string()), "{name}");
    assert_eq!(one.runs(), 1, "{name}: the zombie never started the step");
}

/// The claim's reply arrives late, after most of the lease the store started when it applied
/// the claim: the holder counts its lease from when it sent the claim, not from the reply,
/// so before the first step it cannot vouch for the lease by its own clock and asks the
/// store first (a renewal), rather than start the step on time it may no longer have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_counted_from_the_claims_sending_not_its_late_reply() {
    let lease = Duration::from_secs(2);
    let op = Operation::new(namespace("steps_late_claim_reply")).lease(lease);
    let key = op.key(&"order-3").unwrap();
    // The reply comes 90 % of the lease after the claim: a step may start only on a lease
    // with more than a quarter left.
    let store = Probe::answers_claims_late(idem_runtime::MemoryStore::new(), lease * 9 / 10);
    let renewed_before_the_step = op
        .run(&store, &key, None, async {
            step("one", async { Ok::<_, Error>(store.renewals()) }).await
        })
        .await
        .unwrap();
    assert!(
        matches!(renewed_before_the_step, Outcome::Executed(renewals) if renewals >= 1),
        "{renewed_before_the_step:?}"
    );
}
