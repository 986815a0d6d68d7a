//! `MemoryStore` at capacity: the most recent results are the ones kept, since they are the
//! ones retries come for.

use idem_runtime::{Claim, Error, MemoryStore, Operation, Outcome, Store};

/// Records `total` results in a store of `capacity`, then counts how many of the newest
/// `capacity` are still there (looked at without recording anything, so nothing is evicted
/// by the counting itself).
async fn newest_kept(capacity: u64, total: u64) -> u64 {
    let store = MemoryStore::builder().capacity(capacity).build();
    let op = Operation::new("capacity.newest");
    for i in 0..total {
        let key = op.key(&i).unwrap();
        let out = op.run(&store, &key, None, async move { Ok::<_, Error>(i) });
        assert_eq!(out.await.unwrap(), Outcome::Executed(i));
    }
    let mut kept = 0;
    for i in total - capacity..total {
        let key = op.key(&i).unwrap();
        if let Some(Claim::Completed { .. }) = store.peek(&key) {
            kept += 1;
        }
    }
    kept
}

#[tokio::test]
async fn the_most_recent_results_are_kept_at_capacity() {
    for (capacity, total) in [(1_000, 10_000), (1_000, 100_000)] {
        let kept = newest_kept(capacity, total).await;
        println!(
            "capacity {capacity}, {total} results recorded: {kept} of the newest {capacity} kept"
        );
        assert_eq!(kept, capacity, "after {total} results");
    }
}

#[tokio::test]
async fn a_replayed_result_counts_as_recent() {
    let store = MemoryStore::builder().capacity(100).build();
    let op = Operation::new("capacity.replayed");
    let hot = op.key(&"hot").unwrap();
    let first = op.run(&store, &hot, None, async { Ok::<_, Error>(0_u64) });
    assert_eq!(first.await.unwrap(), Outcome::Executed(0));
    for i in 0..1_000_u64 {
        let key = op.key(&i).unwrap();
        let _ = op
            .run(&store, &key, None, async move { Ok::<_, Error>(i) })
            .await
            .unwrap();
        // A key that retries keep asking for stays.
        let again = op.run(&store, &hot, None, async { Ok::<_, Error>(1_u64) });
        assert_eq!(
            again.await.unwrap(),
            Outcome::Replayed(0),
            "after {i} others"
        );
    }
}
