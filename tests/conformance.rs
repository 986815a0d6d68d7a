//! The store conformance suite (`idem_runtime::testkit`) against every backend.

use idem_runtime::{testkit, MemoryStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_keeps_the_store_contract() {
    testkit::conformance(&MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arc_dyn_store_keeps_the_store_contract() {
    let store: std::sync::Arc<dyn idem_runtime::Store> = std::sync::Arc::new(MemoryStore::new());
    testkit::conformance(&store).await;
}
