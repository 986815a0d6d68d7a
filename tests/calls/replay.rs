//! Replay: a completed call's `Ok` value is returned to every later call with its key, the
//! body not run; errors release unless the policy records them; fingerprints are checked.

use std::time::Duration;

use idem_runtime::{Error, Fingerprint, MemoryStore, Operation, Outcome};
use idem_tests::Probe;
use idem_tests::{Down, Runs};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: String,
    cents: u64,
}

#[tokio::test]
async fn second_call_replays_the_first_result() {
    let store = MemoryStore::new();
    let op = Operation::new("replay.basic");
    let key = op.key(&("order-1", 100_u64)).unwrap();
    let runs = Runs::default();

    let body = |n: u64| {
        let runs = runs.clone();
        async move {
            runs.hit();
            Ok::<_, Error>(Receipt {
                id: format!("r{n}"),
                cents: 100,
            })
        }
    };
    let first = op.run(&store, &key, None, body(1)).await.unwrap();
    let second = op.run(&store, &key, None, body(2)).await.unwrap();
    assert_eq!(
        first,
        Outcome::Executed(Receipt {
            id: "r1".into(),
            cents: 100
        })
    );
    assert_eq!(
        second,
        Outcome::Replayed(Receipt {
            id: "r1".into(),
            cents: 100
        })
    );
    assert_eq!(runs.count(), 1);

    let other = op.key(&("order-2", 100_u64)).unwrap();
    assert!(!op
        .run(&store, &other, None, body(3))
        .await
        .unwrap()
        .is_replayed());
    assert_eq!(runs.count(), 2);
}

async fn replays<T>(value: T)
where
    T: Serialize + serde::de::DeserializeOwned + Clone + PartialEq + std::fmt::Debug + Send,
{
    let store = MemoryStore::new();
    let op = Operation::new("replay.falsy");
    let key = op.key(std::any::type_name::<T>()).unwrap();
    let runs = Runs::default();
    for _ in 0..3 {
        let (runs, returned) = (runs.clone(), value.clone());
        let out = op
            .run(&store, &key, None, async move {
                runs.hit();
                Ok::<_, Error>(returned)
            })
            .await
            .unwrap();
        assert_eq!(out.into_inner(), value);
    }
    assert_eq!(runs.count(), 1, "{} was re-run", std::any::type_name::<T>());
}

#[tokio::test]
async fn falsy_and_empty_results_are_replayed_not_rerun() {
    replays(()).await;
    replays(0_u64).await;
    replays(false).await;
    replays(None::<String>).await;
    replays(Vec::<u8>::new()).await;
    replays(String::new()).await;
}

#[tokio::test]
async fn an_error_releases_the_key_and_the_retry_runs() {
    let store = MemoryStore::new();
    let op = Operation::new("replay.err");
    let key = op.key(&1).unwrap();
    let runs = Runs::default();

    let r = runs.clone();
    let err = op
        .run(&store, &key, None, async move {
            r.hit();
            Err::<u32, _>(Error::store("gateway timeout"))
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Store(_)));

    let r = runs.clone();
    let ok = op
        .run(&store, &key, None, async move {
            r.hit();
            Ok::<_, Error>(5_u32)
        })
        .await
        .unwrap();
    assert_eq!(ok, Outcome::Executed(5));
    assert_eq!(runs.count(), 2);
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum PayError {
    Declined(String),
    GatewayDown,
    Idem(String),
}

impl From<Error> for PayError {
    fn from(e: Error) -> Self {
        Self::Idem(e.to_string())
    }
}

#[tokio::test]
async fn errors_accepted_by_the_predicate_are_recorded_and_replayed() {
    let store = MemoryStore::new();
    let op = Operation::new("replay.cache_err")
        .cache_errors(|e: &PayError| matches!(e, PayError::Declined(_)));
    let runs = Runs::default();
    let call = |key, result: Result<u32, PayError>| {
        let (runs, op, store) = (runs.clone(), op.clone(), store.clone());
        async move {
            let key = op.key(&key).unwrap();
            op.run(&store, &key, None, async move {
                runs.hit();
                result
            })
            .await
        }
    };

    // A final error is recorded: the retry replays it without running.
    assert_eq!(
        call("a", Err(PayError::Declined("insufficient funds".into()))).await,
        Err(PayError::Declined("insufficient funds".into()))
    );
    assert_eq!(
        call("a", Ok(1)).await,
        Err(PayError::Declined("insufficient funds".into()))
    );
    assert_eq!(runs.count(), 1);

    // Another error still releases.
    assert_eq!(
        call("b", Err(PayError::GatewayDown)).await,
        Err(PayError::GatewayDown)
    );
    assert_eq!(call("b", Ok(2)).await, Ok(Outcome::Executed(2)));
    assert_eq!(runs.count(), 3);
}

#[tokio::test]
async fn a_recorded_error_read_by_a_call_that_does_not_cache_errors_is_a_codec_error() {
    let store = MemoryStore::new();
    let caching = Operation::new("replay.err_kind").cache_errors(|_: &PayError| true);
    let plain = Operation::new("replay.err_kind");
    let key = plain.key(&1).unwrap();
    let _ = caching
        .run(&store, &key, None, async {
            Err::<u32, _>(PayError::GatewayDown)
        })
        .await;
    let runs = Runs::default();
    let r = runs.clone();
    let err = plain
        .run(&store, &key, None, async move {
            r.hit();
            Ok::<u32, Error>(1)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Codec(_)), "{err}");
    assert_eq!(runs.count(), 0);
}

#[tokio::test]
async fn a_record_that_does_not_decode_is_a_codec_error_and_the_body_does_not_run() {
    let store = MemoryStore::new();
    let op = Operation::new("replay.codec");
    let key = op.key(&"k").unwrap();
    let first = op
        .run(&store, &key, None, async {
            Ok::<_, Error>("text".to_string())
        })
        .await;
    assert_eq!(first.unwrap(), Outcome::Executed("text".to_string()));

    let runs = Runs::default();
    let r = runs.clone();
    let err = op
        .run(&store, &key, None, async move {
            r.hit();
            Ok::<u64, Error>(1)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Codec(_)), "{err}");
    assert!(err.to_string().contains("does not decode"), "{err}");
    assert_eq!(runs.count(), 0);
}

/// A result JSON cannot carry (map keys must be strings) reaches its caller, and the key is
/// recorded as gone: a retry gets `Error::Gone`, never a second run of the body.
#[tokio::test]
async fn a_result_that_cannot_be_encoded_answers_its_caller_and_gone_after() {
    use std::collections::HashMap;
    let store = MemoryStore::new();
    let op = Operation::new("replay.encode");
    let key = op.key(&1).unwrap();
    let bad: HashMap<(u8, u8), u8> = [((1, 2), 3)].into();
    let first = op
        .run(&store, &key, None, async move { Ok::<_, Error>(bad) })
        .await
        .unwrap();
    assert_eq!(first.into_inner()[&(1, 2)], 3, "the caller gets its value");
    let runs = Runs::default();
    let r = runs.clone();
    let again = op
        .run(&store, &key, None, async move {
            r.hit();
            Ok::<_, Error>(HashMap::<(u8, u8), u8>::new())
        })
        .await;
    assert!(matches!(again, Err(Error::Gone)), "{again:?}");
    assert_eq!(runs.count(), 0, "the body did not run again");
}

#[tokio::test]
async fn a_different_fingerprint_is_refused_after_completion() {
    let store = MemoryStore::new();
    let op = Operation::new("replay.fp");
    let key = op.key(&"order-9").unwrap();
    let fp_a = Fingerprint::of(&("card-1", 500_u32)).unwrap();
    let fp_b = Fingerprint::of(&("card-1", 900_u32)).unwrap();
    let first = op
        .run(&store, &key, Some(&fp_a), async { Ok::<_, Error>(1_u8) })
        .await;
    assert_eq!(first.unwrap(), Outcome::Executed(1));

    let runs = Runs::default();
    let r = runs.clone();
    let err = op
        .run(&store, &key, Some(&fp_b), async move {
            r.hit();
            Ok::<_, Error>(2_u8)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::PayloadMismatch), "{err}");
    let err = op
        .run(&store, &key, None, async { Ok::<_, Error>(2_u8) })
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::PayloadMismatch),
        "a missing fingerprint does not match either"
    );
    assert_eq!(runs.count(), 0);
    let same = op
        .run(&store, &key, Some(&fp_a), async { Ok::<_, Error>(3_u8) })
        .await
        .unwrap();
    assert_eq!(same, Outcome::Replayed(1));
}

#[tokio::test]
async fn a_different_fingerprint_is_refused_while_in_progress() {
    let store = MemoryStore::new();
    for reject in [false, true] {
        let mut op = Operation::new("replay.fp_in_progress");
        if reject {
            op = op.in_flight(idem_runtime::InFlight::Reject);
        }
        let key = op.key(&reject).unwrap();
        let fp_a = Fingerprint::of(&1).unwrap();
        let fp_b = Fingerprint::of(&2).unwrap();
        let (release, hold) = tokio::sync::oneshot::channel::<()>();
        let (claimed, has_claimed) = tokio::sync::oneshot::channel();
        let first = {
            let (op, store) = (op.clone(), store.clone());
            tokio::spawn(async move {
                op.run(&store, &key, Some(&fp_a), async move {
                    let _ = claimed.send(());
                    let _ = hold.await;
                    Ok::<_, Error>(1_u8)
                })
                .await
            })
        };
        has_claimed.await.unwrap();
        let runs = Runs::default();
        let r = runs.clone();
        let err = op
            .run(&store, &key, Some(&fp_b), async move {
                r.hit();
                Ok::<_, Error>(2_u8)
            })
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::PayloadMismatch),
            "reject={reject}: {err}"
        );
        assert_eq!(runs.count(), 0);
        release.send(()).unwrap();
        assert_eq!(first.await.unwrap().unwrap(), Outcome::Executed(1));
    }
}

#[tokio::test]
async fn a_key_that_cannot_be_encoded_is_a_key_error() {
    let op = Operation::new("replay.key");
    assert!(matches!(op.key(&f64::NAN), Err(Error::Key(_))));
}

#[tokio::test]
async fn a_store_that_is_down_fails_closed() {
    let op = Operation::new("replay.down");
    let key = op.key(&1).unwrap();
    let runs = Runs::default();
    let r = runs.clone();
    let err = op
        .run(&Down, &key, None, async move {
            r.hit();
            Ok::<_, Error>(1)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
    assert_eq!(runs.count(), 0, "the body must not run without a claim");
}

#[tokio::test]
async fn namespaces_separate_operations() {
    let store = MemoryStore::new();
    let a = Operation::new("ns.a");
    let b = Operation::new("ns.b");
    let ka = a.key(&1).unwrap();
    let kb = b.key(&1).unwrap();
    let first = a.run(&store, &ka, None, async { Ok::<_, Error>(1) }).await;
    assert_eq!(first.unwrap(), Outcome::Executed(1));
    let out = b
        .run(&store, &kb, None, async { Ok::<_, Error>(2) })
        .await
        .unwrap();
    assert_eq!(out, Outcome::Executed(2));
}

#[tokio::test]
async fn the_default_store_is_shared_and_set_only_once() {
    let store = idem_runtime::default_store();
    let op = Operation::new("replay.default");
    let key = op.key(&1).unwrap();
    let first = op.run(store, &key, None, async { Ok::<_, Error>(1) }).await;
    assert_eq!(first.unwrap(), Outcome::Executed(1));
    let again = op
        .run(idem_runtime::default_store(), &key, None, async {
            Ok::<_, Error>(2)
        })
        .await
        .unwrap();
    assert_eq!(again, Outcome::Replayed(1));
    assert!(
        idem_runtime::set_default_store(MemoryStore::new()).is_err(),
        "already used"
    );
}

// Paused time: the retries, the lease and its lapse all follow tokio's clock.
#[tokio::test(start_paused = true)]
async fn when_recording_fails_until_the_lease_ends_the_caller_is_told_the_body_ran() {
    let store = Probe::complete_fails(MemoryStore::new());
    let op = Operation::new("replay.complete_fails").lease(Duration::from_millis(200));
    let key = op.key(&1).unwrap();
    let runs = Runs::default();
    let call = |n: u32| {
        let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
        async move {
            op.run(&store, &key, None, async move {
                runs.hit();
                tokio::time::sleep(Duration::from_millis(30)).await;
                Ok::<_, Error>(n)
            })
            .await
        }
    };
    // The body ran, and its result could not be recorded: not `Executed(1)`, which a retry
    // would not replay, but an error that says the body ran.
    let started = tokio::time::Instant::now();
    let first = call(1).await;
    assert!(matches!(first, Err(Error::Unrecorded(_))), "{first:?}");
    assert!(first.unwrap_err().to_string().contains("the body ran"));
    // Retried with backoff (5 ms doubling) while the lease lasted: the tries stop when the
    // next pause would pass the lease's end.
    assert!(
        started.elapsed() >= Duration::from_millis(100),
        "the completion was retried through the lease: {:?}",
        started.elapsed()
    );
    assert!(store.completes() >= 4, "the completion was retried");
    assert_eq!(runs.count(), 1);
    // The completion goes on in the background: this process's callers of the key are
    // told it is in progress, before the claim lapses and after, and never run it again.
    let busy = op.clone().in_flight(idem_runtime::InFlight::Reject);
    let held = busy
        .run(&store, &key, None, async { Ok::<_, Error>(3) })
        .await;
    assert!(matches!(held, Err(Error::InProgress)), "{held:?}");
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert!(matches!(call(4).await, Err(Error::InProgress)));
    assert_eq!(runs.count(), 1);
    assert!(store.completes() >= 6, "still recording in the background");
}

// Paused time, as above.
#[tokio::test(start_paused = true)]
async fn a_result_recorded_late_is_tried_once_a_quarter_lease() {
    let store = Probe::complete_fails(MemoryStore::new());
    let lease = Duration::from_secs(2);
    let op = Operation::new("replay.late_cadence").lease(lease);
    let key = op.key(&1).unwrap();
    let first = op
        .run(&store, &key, None, async { Ok::<_, Error>(1) })
        .await;
    assert!(matches!(first, Err(Error::Unrecorded(_))), "{first:?}");
    // After the caller was answered: tries go on, a quarter lease apart (not the 250 ms of
    // the retries within the lease, which would be 40 in these 10 s).
    let before = store.completes();
    tokio::time::sleep(lease * 5).await;
    let tries = store.completes() - before;
    assert!((18..=21).contains(&tries), "{tries} tries in 10 s");
}

// Paused time, as above.
#[tokio::test(start_paused = true)]
async fn a_result_its_caller_was_told_is_unrecorded_is_replayed_once_the_store_is_back() {
    // A disk that filled while the body ran: every completion fails, well past the lease.
    let store = Probe::new(MemoryStore::new());
    store.fail_completes(usize::MAX);
    let op = Operation::new("replay.late_record").lease(Duration::from_millis(200));
    let key = op.key(&1).unwrap();
    let runs = Runs::default();
    let call = |n: u32| {
        let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
        async move {
            op.wait(Duration::from_secs(5))
                .run(&store, &key, None, async move {
                    runs.hit();
                    Ok::<_, Error>(n)
                })
                .await
        }
    };
    let first = call(1).await;
    assert!(matches!(first, Err(Error::Unrecorded(_))), "{first:?}");
    // Long after the lease, a caller of this process waits; the disk drains meanwhile, and
    // the result lands: the waiter, and every later caller, gets the first body's value.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let waiter = tokio::spawn(call(2));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !waiter.is_finished(),
        "the waiter waits for the late record"
    );
    store.fail_completes(0);
    assert_eq!(waiter.await.unwrap().unwrap(), Outcome::Replayed(1));
    let apart = Probe::apart(store.clone());
    let later = op
        .run(&apart, &key, None, async { Ok::<_, Error>(3) })
        .await
        .unwrap();
    assert_eq!(
        later,
        Outcome::Replayed(1),
        "another process replays it too"
    );
    assert_eq!(runs.count(), 1);
}

// Paused time, as above.
#[tokio::test(start_paused = true)]
async fn a_completion_that_lands_on_a_retry_answers_the_caller_then() {
    // The first completion fails (the server went away); the next one waits at the gate
    // until the store is back (another server, after a failover).
    let (store, back) = Probe::outage(MemoryStore::new(), 1);
    let op = Operation::new("replay.outage").lease(Duration::from_millis(400));
    let key = op.key(&1).unwrap();
    let runs = Runs::default();
    let call = |n: u32| {
        let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
        async move {
            op.run(&store, &key, None, async move {
                runs.hit();
                Ok::<_, Error>(n)
            })
            .await
        }
    };
    let first = tokio::spawn(call(1));
    back.reached().await;
    assert!(!first.is_finished(), "the caller waits for its record");
    back.open();
    assert_eq!(first.await.unwrap().unwrap(), Outcome::Executed(1));
    assert_eq!(call(2).await.unwrap(), Outcome::Replayed(1));
    assert_eq!(runs.count(), 1);
}

/// A payload whose second form cannot be encoded: its fingerprint fails to derive.
#[derive(Clone, Copy)]
enum Payload {
    Fine(u64),
    Unencodable,
}

impl Serialize for Payload {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Payload::Fine(cents) => serializer.serialize_u64(*cents),
            Payload::Unencodable => {
                Err(serde::ser::Error::custom("this payload cannot be encoded"))
            }
        }
    }
}

#[idem_runtime::idempotent(key = id, fingerprint = payload, ignore = runs, store = store, namespace = "replay.unencodable")]
async fn charge_payload(
    store: &MemoryStore,
    runs: &Runs,
    id: u64,
    payload: Payload,
) -> Result<u64, Error> {
    runs.hit();
    Ok(id)
}

/// A call whose fingerprint cannot be derived is refused with the derivation's error, even
/// when its key has a record at hand: the memory store's look before the call must not
/// replay a record it cannot tell is for the same payload.
#[tokio::test]
async fn a_fingerprint_that_cannot_be_derived_is_refused_not_replayed() {
    let store = MemoryStore::new();
    let runs = Runs::default();
    let recorded = charge_payload_outcome(&store, &runs, 7, Payload::Fine(100)).await;
    assert_eq!(recorded.unwrap(), Outcome::Executed(7));
    let again = charge_payload_outcome(&store, &runs, 7, Payload::Unencodable).await;
    assert!(matches!(again, Err(Error::Key(_))), "{again:?}");
    assert_eq!(runs.count(), 1, "the body did not run again");
    let replayed = charge_payload_outcome(&store, &runs, 7, Payload::Fine(100)).await;
    assert_eq!(replayed.unwrap(), Outcome::Replayed(7));
}
