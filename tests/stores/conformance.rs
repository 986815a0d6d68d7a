//! The store conformance suite (`idem_runtime::testkit`) against every backend.

use idem_runtime::testkit;
use idem_runtime::ClaimRequest;
use idem_runtime::MemoryStore;
use idem_tests::own_store::{Mutation, OwnStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_keeps_the_store_contract() {
    testkit::conformance(&MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arc_dyn_store_keeps_the_store_contract() {
    let store: std::sync::Arc<dyn idem_runtime::Store> = std::sync::Arc::new(MemoryStore::new());
    testkit::conformance(&store).await;
}

/// The store a third party writes from the trait's docs keeps the contract, alone and as
/// two instances over one server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_written_store_keeps_the_store_contract() {
    let store = OwnStore::new(Mutation::Kept);
    testkit::conformance(&store).await;
    testkit::conformance_across(&store, &store.instance()).await;
}

/// Runs `check` on a broken store: it must fail, naming `named`.
async fn caught<F: std::future::Future<Output = ()> + Send + 'static>(check: F, named: &str) {
    let failure = tokio::spawn(check)
        .await
        .expect_err("the testkit passed a store that breaks the contract");
    let panic = failure.into_panic();
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.starts_with(&format!("idem testkit: check `{named}` failed: ")),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_testkit_catches_a_takeover_that_skips_the_recheck_and_names_it() {
    let store = OwnStore::new(Mutation::TakeoverSkipsRecheck);
    caught(
        async move { testkit::conformance(&store).await },
        "a_renewal_racing_a_takeover_has_one_winner",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_testkit_catches_a_takeover_on_first_sight_across_instances() {
    let store = OwnStore::new(Mutation::TakeoverOnFirstSight);
    // Alone (clones share what their process saw), the breakage cannot show.
    testkit::conformance(&store).await;
    caught(
        async move { testkit::conformance_across(&store, &store.instance()).await },
        "a_live_claim_is_seen_by_the_other_instance",
    )
    .await;
}

#[tokio::test]
async fn memory_store_capacity_never_evicts_a_claim_in_progress() {
    use idem_runtime::store::Claim;
    use idem_runtime::{Bytes, Key, Store};
    use std::time::Duration;

    let store = MemoryStore::builder().capacity(10).build();
    let lease = Duration::from_secs(60);
    let keys: Vec<Key> = (0..2_000)
        .map(|i| Key::derive("capacity", &i).unwrap())
        .collect();
    // Fill the results far past capacity while 1000 claims are held.
    for key in &keys[..1_000] {
        assert!(matches!(
            store.claim(&ClaimRequest::new(key, lease)).await.unwrap(),
            Claim::Acquired { .. }
        ));
    }
    for key in &keys[1_000..] {
        let Claim::Acquired { token, .. } =
            store.claim(&ClaimRequest::new(key, lease)).await.unwrap()
        else {
            panic!("fresh key");
        };
        assert!(store
            .complete(key, token, Bytes::from_static(b"v1"), lease)
            .await
            .unwrap());
    }
    for key in &keys[..1_000] {
        assert_eq!(
            store.claim(&ClaimRequest::new(key, lease)).await.unwrap(),
            Claim::InProgress { fingerprint: None },
            "a claim in progress was evicted"
        );
    }
}
