//! Durations: every operation's TTL, lease and wait timeout are checked in one place, with a
//! typed error that names the limit and runs nothing; stores handed extreme durations
//! directly clamp them instead of panicking or writing a record that never expires.

use idem_runtime::ClaimRequest;
use std::time::Duration;

use idem_runtime::{
    idempotent, Error, MemoryStore, Operation, Outcome, Store, MAX_DURATION, MIN_LEASE,
};
use idem_tests::scenarios::namespace;
use idem_tests::{postgres_store, redis_store, redis_url, Runs};

/// Every out-of-range setting is `Error::Config` on `store`, and the body never runs.
async fn refused_everywhere<S: Store + Clone>(store: S) {
    let runs = Runs::default();
    let op = || Operation::new(namespace("limits"));
    let settings = [
        ("lease", op().lease(Duration::MAX)),
        ("lease", op().lease(Duration::from_millis(1))),
        ("lease", op().lease(MIN_LEASE - Duration::from_millis(1))),
        ("ttl", op().ttl(Duration::MAX)),
        ("ttl", op().ttl(Duration::ZERO)),
        ("wait timeout", op().wait(Duration::MAX)),
    ];
    for (name, op) in settings {
        let key = op.key(&"k").unwrap();
        let runs = runs.clone();
        let err = op
            .run(&store, &key, None, async move {
                runs.hit();
                Ok::<_, Error>(1)
            })
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{name}: {err}");
        assert!(err.to_string().contains(name), "{err}");
        // Nothing was claimed: the key is free for a call configured within the limits.
        let fine = Operation::new(op.namespace().to_string());
        let out = fine
            .run(&store, &key, None, async { Ok::<_, Error>(2) })
            .await
            .unwrap();
        assert_eq!(
            out,
            Outcome::Executed(2),
            "{name}: a refused call left a claim"
        );
        store.remove(&key).await.unwrap();
    }
    assert_eq!(runs.count(), 0, "a refused configuration ran its body");

    // The limits themselves are accepted.
    let edge = Operation::new(namespace("limits.edge"))
        .lease(MIN_LEASE)
        .ttl(MAX_DURATION)
        .wait(MAX_DURATION);
    let key = edge.key(&"edge").unwrap();
    let first = edge.run(&store, &key, None, async { Ok::<_, Error>(3) });
    assert_eq!(first.await.unwrap(), Outcome::Executed(3));
    let again = edge.run(&store, &key, None, async { Ok::<_, Error>(4) });
    assert_eq!(
        again.await.unwrap(),
        Outcome::Replayed(3),
        "a 365-day TTL records"
    );
}

#[tokio::test]
async fn memory_refuses_durations_out_of_range() {
    refused_everywhere(MemoryStore::new()).await;
}

#[tokio::test]
async fn redis_refuses_durations_out_of_range() {
    let Some(store) = redis_store().await else {
        return;
    };
    refused_everywhere(store).await;
}

#[tokio::test]
async fn postgres_refuses_durations_out_of_range() {
    let Some(store) = postgres_store().await else {
        return;
    };
    refused_everywhere(store).await;
}

/// Handed `Duration::MAX` directly, a store neither panics nor errs: the claim lives at most
/// `MAX_DURATION`, and a completed record replays.
async fn store_clamps<S: Store>(store: &S) -> idem_runtime::Key {
    let key = Operation::new(namespace("limits.clamp")).key(&1).unwrap();
    let token = match store
        .claim(&ClaimRequest::new(&key, Duration::MAX))
        .await
        .unwrap()
    {
        idem_runtime::Claim::Acquired { token, .. } => token,
        other => panic!("{other:?}"),
    };
    assert!(store.renew(&key, token, Duration::MAX).await.unwrap());
    let value = idem_runtime::Bytes::from_static(b"1");
    assert!(store
        .complete(&key, token, value.clone(), Duration::MAX)
        .await
        .unwrap());
    let replay = store
        .claim(&ClaimRequest::new(&key, Duration::MAX))
        .await
        .unwrap();
    assert_eq!(
        replay,
        idem_runtime::Claim::Completed {
            value,
            fingerprint: None
        }
    );
    key
}

#[tokio::test]
async fn memory_clamps_what_it_is_handed() {
    let store = MemoryStore::new();
    store_clamps(&store).await;
}

#[tokio::test]
async fn redis_clamps_what_it_is_handed_and_every_record_expires() {
    let Some(store) = redis_store().await else {
        return;
    };
    let key = Operation::new(namespace("limits.clamp.claim"))
        .key(&1)
        .unwrap();
    store
        .claim(&ClaimRequest::new(&key, Duration::MAX))
        .await
        .unwrap();
    let completed = store_clamps(&store).await;
    let mut redis = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    for key in [key, completed] {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(format!("idem:{{{}}}", key.to_hex()))
            .query_async(&mut redis)
            .await
            .unwrap();
        assert!(
            ttl > 0 && ttl as u128 <= MAX_DURATION.as_millis(),
            "a record without a bounded expiry: PTTL {ttl}"
        );
    }
}

#[tokio::test]
async fn postgres_clamps_what_it_is_handed() {
    let Some(store) = postgres_store().await else {
        return;
    };
    store_clamps(&store).await;
}

#[derive(Debug)]
struct Failed;

impl From<Error> for Failed {
    fn from(_: Error) -> Self {
        Failed
    }
}

// The macro's compile-time limits match the runtime's: the boundary literals compile (and
// `tests/ui/duration-out-of-range.rs` shows the ones past them do not).
#[idempotent(key = id, lease = "100ms", ttl = "365d")]
async fn at_the_limits(id: u64) -> Result<u64, Failed> {
    Ok(id)
}

#[tokio::test]
async fn the_macro_accepts_exactly_the_runtime_limits() {
    assert_eq!(MIN_LEASE, Duration::from_millis(100));
    assert_eq!(MAX_DURATION, Duration::from_secs(365 * 86_400));
    assert_eq!(at_the_limits(7).await.unwrap(), 7);
}

#[test]
fn finishing_in_the_background_outside_a_runtime_is_a_config_error() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let store = MemoryStore::new();
    let op = Operation::new("limits.no_runtime");
    let key = op.key(&1).unwrap();
    let call = op.run_to_completion(&store, &key, None, async { Ok::<_, Error>(1) });
    let mut call = std::pin::pin!(call);
    let polled = call.as_mut().poll(&mut Context::from_waker(Waker::noop()));
    assert!(
        matches!(polled, Poll::Ready(Err(Error::Config(_)))),
        "{polled:?}"
    );
}

/// A parameter the attribute uses as the TTL or the lease is accounted for there: no
/// `ignore` needed, and the durations it carries are the call's.
#[idempotent(key = id, store = store, ttl = ttl, lease = lease, namespace = "limits.params")]
async fn with_durations(
    store: &MemoryStore,
    id: u64,
    ttl: Duration,
    lease: Duration,
) -> Result<u64, Error> {
    Ok(id)
}

#[tokio::test]
async fn durations_from_parameters_are_the_calls() {
    let store = MemoryStore::new();
    let hour = Duration::from_secs(3600);
    assert_eq!(
        with_durations(&store, 1, hour, Duration::from_secs(8))
            .await
            .unwrap(),
        1
    );
    // A lease under the minimum is this call's, and refused as such.
    let err = with_durations(&store, 2, hour, Duration::from_millis(1))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert!(err.to_string().contains("lease"), "{err}");
}
