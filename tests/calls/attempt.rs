//! The attempt a body runs under (`idem_runtime::attempt()`), and calls that would wait for
//! their own enclosing call: they fail at once instead of waiting out the lease.

use std::time::Duration;

use idem_runtime::{attempt, Error, InFlight, MemoryStore, Operation, Outcome, Store};
use idem_tests::{Probe, Runs};

/// Far longer than "at once", far shorter than the 30 s default lease a self-wait would take.
const AT_ONCE: Duration = Duration::from_secs(5);

#[tokio::test]
async fn the_body_sees_its_key_and_token_and_nothing_else_does() {
    let store = MemoryStore::new();
    let op = Operation::new("attempt.visible");
    let key = op.key(&1).unwrap();
    assert!(attempt().is_none());
    let seen = op
        .run(&store, &key, None, async {
            let attempt = attempt().expect("a body runs under an attempt");
            Ok::<_, Error>((attempt.key().to_hex(), attempt.token().await?.get()))
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(seen.0, key.to_hex());
    assert!(attempt().is_none(), "the attempt ends with the body");

    // A later claim of the same key has a larger token.
    store.remove(&key).await.unwrap();
    let again = op
        .run(&store, &key, None, async {
            Ok::<_, Error>(attempt().unwrap().token().await?.get())
        })
        .await
        .unwrap()
        .into_inner();
    assert!(again > seen.1, "{again:?} after {:?}", seen.1);

    // A replay runs no body, and tasks the body spawns are outside the attempt.
    let replay = op.run(&store, &key, None, async {
        Ok::<_, Error>(attempt().unwrap().token().await?.get())
    });
    assert_eq!(replay.await.unwrap(), Outcome::Replayed(again));
    let other = op.key(&2).unwrap();
    let spawned = op
        .run(&store, &other, None, async {
            Ok::<_, Error>(tokio::spawn(async { attempt().is_some() }).await.unwrap())
        })
        .await
        .unwrap();
    assert!(!spawned.into_inner());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombies_fenced_write_is_refused_downstream() {
    idem_tests::scenarios::zombie_fences_are_refused_downstream(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_finished_in_the_background_sees_its_attempt() {
    let store = MemoryStore::new();
    let op = Operation::new("attempt.background");
    let key = op.key(&1).unwrap();
    let out = op
        .run_to_completion(&store, &key, None, async move {
            Ok::<_, Error>(attempt().map(|a| a.key().to_hex()))
        })
        .await
        .unwrap();
    assert_eq!(out.into_inner(), Some(key.to_hex()));
}

/// `inner` runs `op` on `key` inside a body that holds `key`: it must fail at once with
/// `InProgress`, under every policy and whether or not the store coalesces.
async fn recursion_fails_at_once<S: idem_runtime::Store + Clone>(store: S, in_flight: InFlight) {
    let op = Operation::new("attempt.recursion").in_flight(in_flight);
    let key = op.key(&"self").unwrap();
    let runs = Runs::default();
    let outer = op.run(&store, &key, None, async {
        runs.hit();
        let inner = op.run(&store, &key, None, async {
            runs.hit();
            Ok::<_, Error>(0)
        });
        let inner = tokio::time::timeout(AT_ONCE, inner)
            .await
            .expect("the inner call waited for its own enclosing call");
        assert!(matches!(inner, Err(Error::InProgress)), "{inner:?}");
        Ok::<_, Error>(1)
    });
    assert_eq!(outer.await.unwrap(), Outcome::Executed(1));
    assert_eq!(runs.count(), 1, "the inner body never ran");
}

#[tokio::test]
async fn a_body_calling_its_own_key_fails_at_once() {
    recursion_fails_at_once(MemoryStore::new(), InFlight::Wait).await;
    recursion_fails_at_once(MemoryStore::new(), InFlight::Reject).await;
}

#[tokio::test]
async fn without_coalescing_the_store_answer_is_checked_too() {
    // `frozen` shares no in-process registry: the inner call finds the key in progress in
    // the store itself, as a call in another process would.
    recursion_fails_at_once(Probe::frozen(MemoryStore::new()), InFlight::Wait).await;
}

#[tokio::test]
async fn recursion_through_other_operations_is_caught() {
    let store = MemoryStore::new();
    let a = Operation::new("attempt.chain.a");
    let b = Operation::new("attempt.chain.b");
    let (ka, kb) = (a.key(&1).unwrap(), b.key(&1).unwrap());
    let out = a.run(&store, &ka, None, async {
        // A → B → A: B runs (another key), and its inner call on A's key fails at once.
        let inner = b.run(&store, &kb, None, async {
            let back = tokio::time::timeout(
                AT_ONCE,
                a.run(&store, &ka, None, async { Ok::<_, Error>(9) }),
            )
            .await
            .expect("waited for the enclosing call");
            Ok::<_, Error>(matches!(back, Err(Error::InProgress)))
        });
        inner.await.map(Outcome::into_inner)
    });
    assert!(
        out.await.unwrap().into_inner(),
        "A → B → A was refused at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recursion_in_a_background_body_is_caught() {
    let store = MemoryStore::new();
    let op = Operation::new("attempt.recursion.background");
    let key = op.key(&1).unwrap();
    let (op2, store2) = (op.clone(), store.clone());
    let out = op
        .run_to_completion(&store, &key, None, async move {
            let inner = op2.run(&store2, &key, None, async { Ok::<_, Error>(0) });
            let inner = tokio::time::timeout(AT_ONCE, inner)
                .await
                .expect("waited for the enclosing call");
            Ok::<_, Error>(matches!(inner, Err(Error::InProgress)))
        })
        .await
        .unwrap();
    assert!(out.into_inner());
}
