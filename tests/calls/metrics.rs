//! `idem_runtime::metrics`: every outcome counted once, under its namespace, with the claim's
//! latency; calls without a key not counted.

use std::collections::BTreeMap;
use std::future::Future;

use idem_runtime::metrics::{CALLS, CLAIM_DURATION};
use idem_runtime::{idempotent, Error, Fingerprint, InFlight, MemoryStore, Operation};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::sync::oneshot;

/// Runs `work` on a current-thread runtime with a recorder of its own, and returns what was
/// recorded: counters by (namespace, outcome), and histogram samples by namespace.
fn recorded<F: Future>(work: impl FnOnce() -> F) -> Recorded {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                work().await;
                // The releases of dropped calls run in tasks of their own.
                idem_runtime::drain(std::time::Duration::from_secs(10))
                    .await
                    .unwrap();
            })
    });
    Recorded::from(&snapshotter)
}

#[derive(Debug, Default)]
struct Recorded {
    calls: BTreeMap<(String, String), u64>,
    claims: BTreeMap<String, usize>,
    /// The claim latencies of each namespace, in seconds, in the order they were recorded.
    latencies: BTreeMap<String, Vec<f64>>,
}

impl From<&Snapshotter> for Recorded {
    fn from(snapshotter: &Snapshotter) -> Self {
        let mut recorded = Recorded::default();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            let label = |name: &str| {
                key.labels()
                    .find(|label| label.key() == name)
                    .map(|label| label.value().to_string())
                    .unwrap_or_default()
            };
            match (key.name(), value) {
                (CALLS, DebugValue::Counter(n)) => {
                    recorded
                        .calls
                        .insert((label("namespace"), label("outcome")), n);
                }
                (CLAIM_DURATION, DebugValue::Histogram(samples)) => {
                    recorded.claims.insert(label("namespace"), samples.len());
                    recorded.latencies.insert(
                        label("namespace"),
                        samples.iter().map(|sample| sample.into_inner()).collect(),
                    );
                }
                (name, value) => panic!("unexpected metric {name}: {value:?}"),
            }
        }
        recorded
    }
}

impl Recorded {
    fn count(&self, namespace: &str, outcome: &str) -> u64 {
        self.calls
            .get(&(namespace.to_string(), outcome.to_string()))
            .copied()
            .unwrap_or(0)
    }
}

async fn body(value: u32) -> Result<u32, Error> {
    Ok(value)
}

#[test]
fn every_outcome_is_counted_once_with_the_claim_latency() {
    let recorded = recorded(|| async {
        let store = MemoryStore::new();
        let op = Operation::new("metrics.ops.v1");
        let key = op.key(&"k").unwrap();
        let one = Fingerprint::of(&1).unwrap();
        let two = Fingerprint::of(&2).unwrap();

        // executed, then replayed, then mismatched
        let first = op.run(&store, &key, Some(&one), body(1)).await.unwrap();
        let again = op.run(&store, &key, Some(&one), body(1)).await.unwrap();
        assert!(!first.is_replayed() && again.is_replayed());
        let err = op.run(&store, &key, Some(&two), body(2)).await.unwrap_err();
        assert!(matches!(err, Error::PayloadMismatch));

        // released: an error
        let failed = op.key(&"failed").unwrap();
        let _ = op
            .run(&store, &failed, None, async {
                Err::<u32, _>(Error::InProgress)
            })
            .await;

        // rejected: a call that finds the key running, under `in_flight = "reject"`
        let running = op.key(&"running").unwrap();
        let (entered, inside) = oneshot::channel::<()>();
        let (finish, finished) = oneshot::channel::<()>();
        let holder = op.run(&store, &running, None, async move {
            entered.send(()).unwrap();
            finished.await.unwrap();
            Ok::<_, Error>(0)
        });
        let rejecting = op.clone().in_flight(InFlight::Reject);
        let reject = async {
            inside.await.unwrap();
            let err = rejecting
                .run(&store, &running, None, body(0))
                .await
                .unwrap_err();
            assert!(matches!(err, Error::InProgress));
            finish.send(()).unwrap();
        };
        let (held, ()) = tokio::join!(holder, reject);
        assert_eq!(held.unwrap().into_inner(), 0);

        // released: a call dropped mid-body
        let dropped = op.key(&"dropped").unwrap();
        let (entered, inside) = oneshot::channel::<()>();
        let call = op.run(&store, &dropped, None, async move {
            entered.send(()).unwrap();
            std::future::pending::<Result<u32, Error>>().await
        });
        tokio::select! {
            _ = call => unreachable!("the body never returns"),
            _ = inside => {}
        }
    });
    let ns = "metrics.ops.v1";
    assert_eq!(recorded.count(ns, "executed"), 2, "{recorded:?}");
    assert_eq!(recorded.count(ns, "replayed"), 1, "{recorded:?}");
    assert_eq!(recorded.count(ns, "mismatched"), 1, "{recorded:?}");
    assert_eq!(recorded.count(ns, "rejected"), 1, "{recorded:?}");
    assert_eq!(recorded.count(ns, "released"), 2, "{recorded:?}");
    // One claim latency per keyed call: 2 executed, 1 replayed, 1 mismatched, 1 rejected,
    // 2 released.
    assert_eq!(recorded.claims.get(ns), Some(&7), "{recorded:?}");
}

#[idempotent(key = id, namespace = "metrics.attribute.v1")]
async fn charge(id: Option<u64>) -> Result<u64, Error> {
    Ok(id.unwrap_or(0) * 2)
}

#[test]
fn an_attribute_s_calls_are_counted_under_its_namespace_and_unkeyed_calls_not_at_all() {
    let recorded = recorded(|| async {
        // The default store is shared by the whole test binary: a key of this test's own.
        let id = 0x5eed_0001;
        assert_eq!(charge(Some(id)).await.unwrap(), 2 * id);
        assert_eq!(charge(Some(id)).await.unwrap(), 2 * id);
        assert_eq!(charge(None).await.unwrap(), 0);
    });
    let ns = "metrics.attribute.v1";
    assert_eq!(recorded.count(ns, "executed"), 1, "{recorded:?}");
    assert_eq!(recorded.count(ns, "replayed"), 1, "{recorded:?}");
    let counted: u64 = recorded.calls.values().sum();
    assert_eq!(counted, 2, "the unkeyed call is not counted: {recorded:?}");
    assert_eq!(recorded.claims.get(ns), Some(&2), "{recorded:?}");
}

#[test]
fn a_replay_answered_at_once_from_memory_records_a_claim_latency_of_zero() {
    let recorded = recorded(|| async {
        let store = MemoryStore::new();
        let op = Operation::new("metrics.at_once.v1");
        let key = op.key(&"k").unwrap();
        let first = op.run(&store, &key, None, body(1)).await.unwrap();
        let again = op.run(&store, &key, None, body(1)).await.unwrap();
        assert!(!first.is_replayed() && again.is_replayed());
    });
    let latencies = &recorded.latencies["metrics.at_once.v1"];
    // The first execution's claim is timed; the replay, read from memory without a wait,
    // is recorded as zero rather than timed.
    assert_eq!(latencies.len(), 2, "{recorded:?}");
    assert_eq!(latencies[1], 0.0, "{recorded:?}");
}

#[test]
fn many_namespaces_each_keep_their_own_counts() {
    // More namespaces than a thread keeps the metric keys of, static and shared names
    // alike, two with equal text held apart, called in turns: each call is counted under
    // its own name, whichever keys were still cached.
    let shared: Vec<String> = (0..20).map(|i| format!("metrics.many.{i}.v1")).collect();
    let recorded = recorded(|| async {
        let store = MemoryStore::new();
        for round in 0..3_u32 {
            for name in &shared {
                // A new shared name each round: the cache can only match it by its text.
                let op = Operation::new(name.clone());
                let key = op.key(&round).unwrap();
                let ran = op.run(&store, &key, None, body(round)).await.unwrap();
                assert!(!ran.is_replayed());
            }
            let op = Operation::new("metrics.many.static.v1");
            let key = op.key(&round).unwrap();
            let ran = op.run(&store, &key, None, body(round)).await.unwrap();
            assert!(!ran.is_replayed());
        }
    });
    for name in &shared {
        assert_eq!(recorded.count(name, "executed"), 3, "{name}: {recorded:?}");
        assert_eq!(recorded.claims.get(name.as_str()), Some(&3), "{recorded:?}");
    }
    assert_eq!(
        recorded.count("metrics.many.static.v1", "executed"),
        3,
        "{recorded:?}"
    );
    let counted: u64 = recorded.calls.values().sum();
    assert_eq!(counted, 3 * 21, "{recorded:?}");
}
