//! The store conformance suite (`idem_runtime::testkit`) against every backend.

use idem_runtime::testkit;
use idem_runtime::ClaimRequest;
use idem_runtime::MemoryStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_keeps_the_store_contract() {
    testkit::conformance(&MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arc_dyn_store_keeps_the_store_contract() {
    let store: std::sync::Arc<dyn idem_runtime::Store> = std::sync::Arc::new(MemoryStore::new());
    testkit::conformance(&store).await;
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
