//! A completed key is never run again silently within its TTL: a result evicted from a
//! memory store under its bounds, or too large for it, answers `Error::Gone` (the body does
//! not run), and the marks that make it so are bounded in bytes, measured here with a
//! counting allocator.

use std::time::Duration;

use idem_runtime::store::memory::MARK_BYTES;
use idem_runtime::{Error, Fingerprint, MemoryStore, Operation, Outcome};
use idem_tests::Runs;

#[global_allocator]
static ALLOCATOR: idem_tests::CountingAllocator = idem_tests::CountingAllocator;

const TTL: Duration = Duration::from_secs(3600);

/// 2 000 results of 64 KiB in a store that keeps 1 MiB of them: the early ones are evicted.
async fn fill(store: &MemoryStore, op: &Operation, runs: &Runs) {
    for i in 0..2000_u32 {
        let key = op.key(&i).unwrap();
        let fingerprint = Fingerprint::of(&i).unwrap();
        let value = "x".repeat(64 << 10);
        let out = op
            .run(store, &key, Some(&fingerprint), async {
                runs.hit();
                Ok::<_, Error>(value)
            })
            .await
            .unwrap();
        assert!(matches!(out, Outcome::Executed(_)));
    }
}

#[tokio::test]
async fn an_evicted_result_answers_gone_and_never_runs_again() {
    let store = MemoryStore::builder().max_bytes(1 << 20).build();
    let op = Operation::new("gone.evicted").ttl(TTL);
    let runs = Runs::default();
    fill(&store, &op, &runs).await;
    assert_eq!(runs.count(), 2000);

    // The newest result replays; the first was evicted, and answers `Gone`.
    let newest = op.key(&1999_u32).unwrap();
    let replay = op
        .run(
            &store,
            &newest,
            Some(&Fingerprint::of(&1999_u32).unwrap()),
            async {
                runs.hit();
                Ok::<_, Error>(String::new())
            },
        )
        .await
        .unwrap();
    assert!(replay.is_replayed());
    let mut gone = 0;
    for i in 0..1000_u32 {
        let key = op.key(&i).unwrap();
        let again = op
            .run(&store, &key, Some(&Fingerprint::of(&i).unwrap()), async {
                runs.hit();
                Ok::<_, Error>(String::new())
            })
            .await;
        match again {
            Err(Error::Gone) => gone += 1,
            Ok(Outcome::Replayed(_)) => {}
            other => panic!("key {i}: {other:?}"),
        }
    }
    assert!(gone > 900, "the early results were evicted: {gone} gone");
    assert_eq!(runs.count(), 2000, "no body ran twice");
    // The fingerprint is still checked: another payload under a gone key is a mismatch.
    let first = op.key(&0_u32).unwrap();
    let other = op
        .run(
            &store,
            &first,
            Some(&Fingerprint::of(&"other").unwrap()),
            async { Ok::<_, Error>(String::new()) },
        )
        .await;
    assert!(matches!(other, Err(Error::PayloadMismatch)), "{other:?}");
    assert_eq!(store.marks_dropped(), 0);
}

#[tokio::test]
async fn a_result_larger_than_the_store_keeps_answers_gone() {
    let store = MemoryStore::builder().max_bytes(1 << 10).build();
    let op = Operation::new("gone.oversize").ttl(TTL);
    let key = op.key(&"huge").unwrap();
    let runs = Runs::default();
    let body = || async {
        runs.hit();
        Ok::<_, Error>("x".repeat(4 << 10))
    };
    let first = op.run(&store, &key, None, body()).await.unwrap();
    assert!(
        matches!(first, Outcome::Executed(_)),
        "the caller gets its value"
    );
    let again = op.run(&store, &key, None, body()).await;
    assert!(matches!(again, Err(Error::Gone)), "{again:?}");
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn rerun_evicted_runs_an_evicted_key_again_as_asked() {
    let store = MemoryStore::builder()
        .max_bytes(1 << 20)
        .rerun_evicted()
        .build();
    let op = Operation::new("gone.rerun").ttl(TTL);
    let runs = Runs::default();
    fill(&store, &op, &runs).await;
    let first = op.key(&0_u32).unwrap();
    let again = op
        .run(
            &store,
            &first,
            Some(&Fingerprint::of(&0_u32).unwrap()),
            async { Ok::<_, Error>(String::new()) },
        )
        .await
        .unwrap();
    assert!(matches!(again, Outcome::Executed(_)), "{again:?}");
}

#[tokio::test]
async fn marks_over_their_bound_are_counted_when_their_result_is_gone_too() {
    let store = MemoryStore::builder()
        .max_bytes(1 << 20)
        .max_mark_bytes(100 * MARK_BYTES)
        .build();
    let op = Operation::new("gone.dropped").ttl(TTL);
    fill(&store, &op, &Runs::default()).await;
    let dropped = store.marks_dropped();
    assert!(
        dropped > 1000,
        "the marks of evicted results were counted: {dropped}"
    );
}

/// Completes `keys` keys (small results) and then calls each once more: how many bodies ran
/// again on the second pass.
async fn completed_then_retried(store: &MemoryStore, op: &Operation, keys: u32) -> usize {
    let runs = Runs::default();
    let call = |i: u32| {
        let runs = runs.clone();
        async move {
            let key = op.key(&i).unwrap();
            op.run(store, &key, None, async {
                runs.hit();
                Ok::<_, Error>(i)
            })
            .await
        }
    };
    for i in 0..keys {
        assert_eq!(call(i).await.unwrap(), Outcome::Executed(i));
    }
    assert_eq!(runs.count(), keys as usize);
    for i in 0..keys {
        match call(i).await {
            Ok(Outcome::Replayed(value)) => assert_eq!(value, i),
            Ok(Outcome::Executed(value)) => assert_eq!(value, i),
            Err(Error::Gone) => {}
            other => panic!("key {i}: {other:?}"),
        }
    }
    runs.count() - keys as usize
}

/// A store that keeps 100 results and `marks` marks: nearly every result is evicted, so a
/// completed key answers by its mark.
fn with_marks(marks: u64) -> MemoryStore {
    MemoryStore::builder()
        .capacity(100)
        .max_mark_bytes(marks * MARK_BYTES)
        .build()
}

#[tokio::test]
async fn up_to_their_bound_marks_keep_every_completed_key_from_running_again() {
    // The bound is the store's, not each shard's share of it: at 90 % and at 100 % of it,
    // every key whose result was evicted answers `Gone`.
    for keys in [9_000, 10_000] {
        let store = with_marks(10_000);
        let op = Operation::new(format!("gone.bound.{keys}")).ttl(TTL);
        let reruns = completed_then_retried(&store, &op, keys).await;
        assert_eq!(reruns, 0, "{keys} keys within a bound of 10 000 marks");
        assert_eq!(store.marks_dropped(), 0);
    }
}

#[tokio::test]
async fn past_their_bound_a_rerun_never_costs_another_key_its_mark() {
    // 12 000 keys for 10 000 marks: 2 000 marks are not kept; the keys that have one keep
    // it, so retrying every key reruns at most those 2 000, however often it is retried.
    let store = with_marks(10_000);
    let op = Operation::new("gone.past").ttl(TTL);
    let reruns = completed_then_retried(&store, &op, 12_000).await;
    let dropped = store.marks_dropped();
    println!("12 000 keys, 10 000 marks: {dropped} marks not kept, {reruns} bodies ran again");
    assert_eq!(
        dropped as usize,
        2_000 + reruns,
        "every rerun's mark is refused too"
    );
    assert!(reruns <= 2_000, "{reruns} reruns for 2 000 marks not kept");
    // The first 10 000 keys kept their marks through the reruns: none runs again.
    let runs = Runs::default();
    for i in 0..10_000_u32 {
        let key = op.key(&i).unwrap();
        let again = op
            .run(&store, &key, None, async {
                runs.hit();
                Ok::<_, Error>(i)
            })
            .await;
        assert!(
            matches!(again, Err(Error::Gone) | Ok(Outcome::Replayed(_))),
            "key {i}: {again:?}"
        );
    }
    assert_eq!(runs.count(), 0);
}

/// What a mark costs: the heap of a store that keeps marks, less one that does not, per
/// completed key, with every result kept by both; printed as `per mark <bytes>`.
#[tokio::test]
#[ignore = "run alone in a process of its own by marks_are_within_the_bytes_their_bound_counts"]
async fn bytes_of_marks_child() {
    const KEYS: u32 = 20_000;
    async fn heap_of(store: MemoryStore) -> isize {
        let op = Operation::new("gone.bytes").ttl(TTL);
        let before = idem_tests::heap_bytes();
        for i in 0..KEYS {
            let key = op.key(&i).unwrap();
            let fingerprint = Fingerprint::of(&i).unwrap();
            let out = op
                .run(&store, &key, Some(&fingerprint), async {
                    Ok::<_, Error>(i)
                })
                .await;
            assert_eq!(out.unwrap(), Outcome::Executed(i));
        }
        let after = idem_tests::heap_bytes();
        drop(store);
        after - before
    }
    let with = heap_of(MemoryStore::new()).await;
    let without = heap_of(MemoryStore::builder().rerun_evicted().build()).await;
    println!("per mark {}", (with - without) / KEYS as isize);
}

/// A mark weighs no more than [`MARK_BYTES`], what the marks' bound counts it for.
#[test]
fn marks_are_within_the_bytes_their_bound_counts() {
    let per_mark = idem_tests::measured_in_child("bytes_of_marks_child", "per mark");
    println!("a mark costs {per_mark} heap bytes");
    assert!(per_mark > 0, "marks are kept");
    assert!(
        per_mark <= MARK_BYTES as isize,
        "a mark weighs {per_mark} bytes, more than the {MARK_BYTES} its bound counts"
    );
}
