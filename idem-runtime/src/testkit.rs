//! The store conformance suite (feature `testkit`).
//!
//! One suite checks every backend against the [`Store`] contract: atomic claims, claim
//! tokens that differ and fencing tokens that grow, compare-and-set completion, release and renewal, expiry of leases and
//! results by the store's clock, administrative removal, and steps' records fenced by their
//! call's claim. The author of a third-party
//! backend runs it on theirs:
//!
//! ```no_run
//! # async fn my_store() -> idem_runtime::MemoryStore { idem_runtime::MemoryStore::new() }
//! #[tokio::test]
//! async fn my_store_keeps_the_contract() {
//!     idem_runtime::testkit::conformance(&my_store().await).await;
//! }
//! ```
//!
//! and then on two instances of it, each connected on its own ([`conformance_across`]): a
//! store that judges a claim by what its own process saw, or whose takeover does not
//! re-check in its write for a renewal that raced it, passes the first (clones of one
//! instance share their process's state) and fails the second.
//!
//! Beside it, the contract as a checker over histories ([`histories()`], [`History`]): many
//! concurrent calls through a store whose every operation fails, loses its answer, slows
//! down or stalls by a seeded schedule ([`Faulty`]), each answer held to the error table
//! and each key to one value and one run (or a caller told `Unrecorded`):
//!
//! ```no_run
//! # async fn my_store() -> idem_runtime::MemoryStore { idem_runtime::MemoryStore::new() }
//! #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
//! async fn my_store_keeps_the_error_table_under_faults() {
//!     let store = my_store().await;
//!     let report = idem_runtime::testkit::histories(&[store], &idem_runtime::testkit::Plan::new(1)).await;
//!     println!("{report}");
//! }
//! ```
//!
//! A [`History`] can be written by hand too, for calls [`histories()`] does not make: in the
//! caller's transaction ([`History::rolled_back`] for one that did not commit), or in
//! processes that are killed ([`Answer::Killed`] for a call its process never finished).
//!
//! The suite uses real time (leases and TTLs of a few hundred milliseconds), since a network
//! store judges expiry by its own clock; it takes about seven seconds (the memory store here). Its keys live in a
//! namespace of their own for each run, so it can run against a shared server. A broken
//! promise panics with a message that names the check first (`idem testkit: check
//! \`a_renewal_racing_a_takeover_has_one_winner\` failed: …`), then the promise broken.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::{step, Claim, ClaimRequest, Error, Fingerprint, Key, Operation, Outcome, Store, Token};

mod faults;
mod histories;

pub use self::faults::{Faults, Faulty};
#[cfg(feature = "admin")]
pub use self::histories::histories_with_operator;
pub use self::histories::{
    body_ran, histories, Answer, BodyId, CallId, Effects, Failure, History, Plan, Report, Violation,
};

/// A short lease, for the checks that a lease runs out: long enough for a slow server's
/// round trips, short enough to wait out. A check never needs such a claim to be still held
/// after a step a busy machine could delay past it; where it does, it measures the time and
/// tries again with a fresh key, and fails only if the store let go within the lease.
const LEASE: Duration = Duration::from_millis(400);

/// The lease of every claim that must stay held while a check looks at it: no machine is
/// slow enough for it to run out.
const HELD: Duration = Duration::from_secs(60);

/// How many fresh keys a check that needs a short lease still held tries before it gives
/// up (a machine too slow to take a step within 400 ms five times running).
const TRIES: usize = 5;

/// Runs one check, and names it in its failure.
macro_rules! check {
    ($name:ident($($arg:expr),*)) => {
        named(stringify!($name), $name($($arg),*)).await
    };
}

/// Runs `check`; a panic in it panics again with its `name` in front.
async fn named<F: std::future::Future<Output = ()>>(name: &str, check: F) {
    let mut check = std::pin::pin!(check);
    let failed = std::future::poll_fn(|cx| {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check.as_mut().poll(cx))) {
            Ok(std::task::Poll::Ready(())) => std::task::Poll::Ready(None),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(panic) => std::task::Poll::Ready(Some(panic)),
        }
    })
    .await;
    if let Some(panic) = failed {
        let message = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("(a panic without a message)");
        panic!("idem testkit: check `{name}` failed: {message}");
    }
}

/// Runs every check against `store`. Panics on the first broken promise, naming the check
/// that found it (`idem testkit: check \`…\` failed: …`).
pub async fn conformance<S: Store + Clone>(store: &S) {
    let keys = Keys::new();
    check!(claim_takes_an_absent_key(store, &keys));
    check!(complete_records_and_replays(store, &keys));
    check!(stale_tokens_change_nothing(store, &keys));
    check!(release_frees_the_key_with_a_larger_fence(store, &keys));
    check!(lapsed_lease_is_taken_over_and_fences_the_old_holder(
        store, &keys
    ));
    check!(renew_extends_the_lease(store, &keys));
    check!(results_expire_after_their_ttl(store, &keys));
    check!(remove_deletes_any_record(store, &keys));
    check!(records_keep_arbitrary_bytes(store, &keys));
    check!(concurrent_claims_have_one_winner(store, &keys));
    check!(keys_are_independent(store, &keys));
    check!(lookup_reads_completed_records_only(store, &keys));
    check!(lease_left_is_the_live_claims_only(store, &keys));
    check!(a_claim_again_with_its_nonce_is_its_own(store, &keys));
    check!(a_takeover_is_told_until_a_claim_settles(store, &keys));
    check!(a_renewal_racing_a_takeover_has_one_winner(
        store, store, &keys
    ));
    check!(step_records_are_fenced_by_the_calls_claim(store, &keys));
    check!(steps_resume_where_the_last_attempt_stopped(store, &keys));
}

/// Runs the checks that two processes keep between them against two instances of a store
/// over the same data, each with its own connections and its own per-process state (as two
/// processes have: not two clones of one instance, which share it). Panics on the first
/// broken promise, naming the check.
///
/// What it catches that [`conformance`] on one instance cannot: a store that answers from
/// what its own process claimed (a live claim another instance holds must be seen in
/// progress, never taken over on first sight), and a takeover that does not re-check, in
/// the write that takes the key, for a renewal that raced it.
///
/// ```no_run
/// # async fn my_store() -> idem_runtime::MemoryStore { idem_runtime::MemoryStore::new() }
/// #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
/// async fn two_instances_of_my_store_keep_the_contract() {
///     let (first, second) = (my_store().await, my_store().await);
///     idem_runtime::testkit::conformance_across(&first, &second).await;
/// }
/// ```
pub async fn conformance_across<S: Store>(first: &S, second: &S) {
    let keys = Keys::new();
    check!(a_live_claim_is_seen_by_the_other_instance(
        first, second, &keys
    ));
    check!(a_lapsed_claim_is_taken_over_by_the_other_instance(
        first, second, &keys
    ));
    check!(a_renewal_racing_a_takeover_has_one_winner(
        first, second, &keys
    ));
    check!(a_renewal_racing_a_takeover_has_one_winner(
        second, first, &keys
    ));
}

/// Unique keys for one run of the suite.
struct Keys {
    run: u128,
    next: AtomicU64,
}

impl Keys {
    fn new() -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        Self {
            run: nanos ^ u128::from(std::process::id()) << 64,
            next: AtomicU64::new(0),
        }
    }

    fn fresh(&self) -> Key {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Key::derive("idem.testkit", &(self.run, n)).expect("integers always encode")
    }
}

fn fingerprint(n: u32) -> Fingerprint {
    Fingerprint::of(&n).expect("integers always encode")
}

async fn acquire<S: Store>(store: &S, key: &Key, fp: Option<&Fingerprint>) -> Token {
    acquire_for(store, key, fp, HELD).await
}

/// Claims a key that no unsettled claim held (fresh, released, completed and expired,
/// removed): the claim must acquire it, and must not say it took anything over.
async fn acquire_for<S: Store>(
    store: &S,
    key: &Key,
    fp: Option<&Fingerprint>,
    lease: Duration,
) -> Token {
    match store.claim(&ClaimRequest::new(key, lease).fingerprint(fp)).await {
        Ok(Claim::Acquired {
            token,
            taken_over: false,
        }) => token,
        Ok(Claim::Acquired {
            taken_over: true, ..
        }) => panic!(
            "a claim of a key no unsettled claim held (fresh, released, completed and expired, or removed) must not say `taken_over: true`"
        ),
        other => panic!("claim of a free key must acquire it, got {other:?}"),
    }
}

/// Claims a key whose last claim was never settled (its lease ran out, or an operator
/// released it): the claim must acquire it and say so, `taken_over: true`.
async fn take_over<S: Store>(store: &S, key: &Key, fp: Option<&Fingerprint>) -> Token {
    match store.claim(&ClaimRequest::new(key, HELD).fingerprint(fp)).await {
        Ok(Claim::Acquired {
            token,
            taken_over: true,
        }) => token,
        Ok(Claim::Acquired {
            taken_over: false, ..
        }) => panic!(
            "a claim that takes a key over from a claim whose lease ran out unsettled must say `taken_over: true` (the store must remember a lapsed claim for the request's TTL)"
        ),
        other => panic!("a claim of a lapsed key must acquire it, got {other:?}"),
    }
}

/// The fencing token of a claim that is still held; asking twice gives the same token.
async fn fence<S: Store>(store: &S, key: &Key, token: Token) -> Token {
    let first = store.fence(key, token).await.unwrap();
    let again = store.fence(key, token).await.unwrap();
    let fence = first.unwrap_or_else(|| panic!("a held claim must get a fencing token"));
    assert_eq!(again, Some(fence), "asking twice must give the same fence");
    fence
}

/// Whether a fence of a claim that is no longer held is refused, or smaller than `newer`.
async fn fence_is_stale<S: Store>(store: &S, key: &Key, token: Token, newer: Token) -> bool {
    match store.fence(key, token).await.unwrap() {
        None => true,
        Some(fence) => fence < newer,
    }
}

async fn claim<S: Store>(store: &S, key: &Key, fp: Option<&Fingerprint>) -> Claim {
    store
        .claim(&ClaimRequest::new(key, HELD).fingerprint(fp))
        .await
        .unwrap_or_else(|e| panic!("claim failed: {e}"))
}

async fn claim_takes_an_absent_key<S: Store>(store: &S, keys: &Keys) {
    let key = keys.fresh();
    let fp = fingerprint(1);
    acquire(store, &key, Some(&fp)).await;
    assert_eq!(
        claim(store, &key, Some(&fingerprint(2))).await,
        Claim::InProgress {
            fingerprint: Some(fp)
        },
        "a second claim must see the first in progress, with the first claim's fingerprint"
    );
}

async fn complete_records_and_replays<S: Store>(store: &S, keys: &Keys) {
    let key = keys.fresh();
    let fp = fingerprint(7);
    let token = acquire(store, &key, Some(&fp)).await;
    let value = Bytes::from_static(b"v\"receipt\"");
    assert!(
        store
            .complete(&key, token, value.clone(), Duration::from_secs(60))
            .await
            .unwrap(),
        "the holder's complete must apply"
    );
    let expected = Claim::Completed {
        value,
        fingerprint: Some(fp),
    };
    assert_eq!(
        claim(store, &key, None).await,
        expected,
        "a completed record replays"
    );
    assert_eq!(
        claim(store, &key, None).await,
        expected,
        "replays do not change the record"
    );
    assert!(
        !store.release(&key, token).await.unwrap(),
        "release after complete must be refused"
    );
    assert_eq!(
        claim(store, &key, None).await,
        expected,
        "a refused release changes nothing"
    );
}

async fn stale_tokens_change_nothing<S: Store>(store: &S, keys: &Keys) {
    let key = keys.fresh();
    let token = acquire(store, &key, None).await;
    let wrong = Token::new(token.get().wrapping_add(1_000_000));
    let ttl = Duration::from_secs(60);
    assert!(!store
        .complete(&key, wrong, Bytes::from_static(b"x"), ttl)
        .await
        .unwrap());
    assert!(!store.release(&key, wrong).await.unwrap());
    assert!(!store.renew(&key, wrong, LEASE).await.unwrap());
    assert_eq!(
        claim(store, &key, None).await,
        Claim::InProgress { fingerprint: None },
        "operations with another token must leave the claim as it was"
    );
    let absent = keys.fresh();
    assert!(!store
        .complete(&absent, token, Bytes::from_static(b"x"), ttl)
        .await
        .unwrap());
    assert!(!store.release(&absent, token).await.unwrap());
    assert!(!store.renew(&absent, token, LEASE).await.unwrap());
}

async fn release_frees_the_key_with_a_larger_fence<S: Store>(store: &S, keys: &Keys) {
    let key = keys.fresh();
    let first = acquire(store, &key, None).await;
    let first_fence = fence(store, &key, first).await;
    assert!(
        store.release(&key, first).await.unwrap(),
        "the holder's release must apply"
    );
    assert!(
        !store.release(&key, first).await.unwrap(),
        "a second release must be refused"
    );
    let second = acquire(store, &key, None).await;
    assert_ne!(second, first, "claim tokens must differ");
    let second_fence = fence(store, &key, second).await;
    assert!(
        second_fence > first_fence,
        "fencing tokens must grow: {second_fence:?} after {first_fence:?}"
    );
    assert!(
        fence_is_stale(store, &key, first, second_fence).await,
        "a released claim must get no fence, or a smaller one"
    );
    assert!(store.release(&key, second).await.unwrap());
}

async fn lapsed_lease_is_taken_over_and_fences_the_old_holder<S: Store>(store: &S, keys: &Keys) {
    let (key, stale, stale_fence) = fenced_with_a_short_lease(store, keys).await;
    tokio::time::sleep(LEASE + LEASE / 2).await;
    let owner = take_over(store, &key, Some(&fingerprint(2))).await;
    assert_ne!(owner, stale, "a takeover must get another token");
    let owner_fence = fence(store, &key, owner).await;
    assert!(
        owner_fence > stale_fence,
        "a takeover must get a larger fence"
    );
    assert!(
        fence_is_stale(store, &key, stale, owner_fence).await,
        "the lapsed holder must get no fence, or a smaller one"
    );

    let ttl = Duration::from_secs(60);
    assert!(
        !store.renew(&key, stale, LEASE).await.unwrap(),
        "stale renew"
    );
    assert!(
        !store
            .complete(&key, stale, Bytes::from_static(b"stale"), ttl)
            .await
            .unwrap(),
        "stale complete"
    );
    assert!(!store.release(&key, stale).await.unwrap(), "stale release");
    assert!(store
        .complete(&key, owner, Bytes::from_static(b"owner"), ttl)
        .await
        .unwrap());
    assert_eq!(
        claim(store, &key, None).await,
        Claim::Completed {
            value: Bytes::from_static(b"owner"),
            fingerprint: Some(fingerprint(2)),
        },
        "the new owner's record must survive the stale holder"
    );
}

/// Runs `check` on fresh keys until one sees what it looks for within `window` (a short
/// lease or TTL): `check` answers `Err(asked)` when the store let go, `asked` being when the
/// window began. That is a broken promise only if `window` had not passed since; otherwise
/// the machine was slower than the window, and another key is tried.
async fn on_a_fresh_key<T, F, Fut>(keys: &Keys, window: Duration, promise: &str, mut check: F) -> T
where
    F: FnMut(Key) -> Fut,
    Fut: std::future::Future<Output = Result<T, Instant>>,
{
    for _ in 0..TRIES {
        match check(keys.fresh()).await {
            Ok(seen) => return seen,
            Err(asked) => assert!(asked.elapsed() >= window, "{promise}"),
        }
    }
    panic!("{TRIES} tries outlasted their {window:?} before this could be checked: {promise} (too slow a machine for this check)")
}

/// A claim of a fresh key under the short lease, and its fence, taken while it was held.
async fn fenced_with_a_short_lease<S: Store>(store: &S, keys: &Keys) -> (Key, Token, Token) {
    on_a_fresh_key(
        keys,
        LEASE,
        "a held claim must get a fencing token",
        |key| async move {
            let asked = Instant::now();
            let token = acquire_for(store, &key, None, LEASE).await;
            match store.fence(&key, token).await.unwrap() {
                Some(fence) => Ok((key, token, fence)),
                None => Err(asked),
            }
        },
    )
    .await
}

async fn renew_extends_the_lease<S: Store>(store: &S, keys: &Keys) {
    let (key, token) = on_a_fresh_key(
        keys,
        LEASE,
        "the holder's renew must apply",
        |key| async move {
            let asked = Instant::now();
            let token = acquire_for(store, &key, None, LEASE).await;
            tokio::time::sleep(LEASE / 2).await;
            match store.renew(&key, token, HELD).await.unwrap() {
                true => Ok((key, token)),
                false => Err(asked),
            }
        },
    )
    .await;
    tokio::time::sleep(LEASE).await; // past the original lease, inside the renewed one
    assert_eq!(
        claim(store, &key, None).await,
        Claim::InProgress { fingerprint: None },
        "a renewed claim must outlive its first lease"
    );
    assert!(store.release(&key, token).await.unwrap());
}

async fn results_expire_after_their_ttl<S: Store>(store: &S, keys: &Keys) {
    let ttl = Duration::from_millis(300);
    let replayed = "a record must be replayed within its TTL";
    let (key, token, first_fence) = on_a_fresh_key(keys, ttl, replayed, |key| async move {
        let token = acquire(store, &key, None).await;
        let first_fence = fence(store, &key, token).await;
        let asked = Instant::now();
        assert!(store
            .complete(&key, token, Bytes::from_static(b"v1"), ttl)
            .await
            .unwrap());
        match claim(store, &key, None).await {
            Claim::Completed { .. } => Ok((key, token, first_fence)),
            _ => Err(asked),
        }
    })
    .await;
    tokio::time::sleep(ttl * 2).await;
    let next = acquire(store, &key, None).await;
    assert_ne!(next, token, "a claim after the TTL must get another token");
    assert!(
        fence(store, &key, next).await > first_fence,
        "a claim after the TTL must get a larger fence"
    );
}

async fn remove_deletes_any_record<S: Store>(store: &S, keys: &Keys) {
    let key = keys.fresh();
    assert!(
        !store.remove(&key).await.unwrap(),
        "removing nothing reports false"
    );

    let token = acquire(store, &key, None).await;
    assert!(store.remove(&key).await.unwrap(), "remove deletes a claim");
    assert!(
        !store
            .complete(
                &key,
                token,
                Bytes::from_static(b"x"),
                Duration::from_secs(60)
            )
            .await
            .unwrap(),
        "the holder of a removed claim cannot complete it"
    );

    let token = acquire(store, &key, None).await;
    assert!(store
        .complete(
            &key,
            token,
            Bytes::from_static(b"x"),
            Duration::from_secs(60)
        )
        .await
        .unwrap());
    assert!(store.remove(&key).await.unwrap(), "remove deletes a result");
    acquire(store, &key, None).await;
}

async fn records_keep_arbitrary_bytes<S: Store>(store: &S, keys: &Keys) {
    let key = keys.fresh();
    let token = acquire(store, &key, None).await;
    let value: Bytes = (0..=255_u8)
        .chain([0, 0, b'\n', b'"'])
        .collect::<Vec<_>>()
        .into();
    assert!(store
        .complete(&key, token, value.clone(), Duration::from_secs(60))
        .await
        .unwrap());
    assert_eq!(
        claim(store, &key, None).await,
        Claim::Completed {
            value,
            fingerprint: None
        },
        "values are opaque bytes and must come back unchanged"
    );
}

async fn concurrent_claims_have_one_winner<S: Store + Clone>(store: &S, keys: &Keys) {
    let key = keys.fresh();
    let claims: Vec<_> = (0..64)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.claim(&ClaimRequest::new(&key, HELD)).await })
        })
        .collect();
    let mut acquired = 0;
    for claim in claims {
        match claim
            .await
            .expect("claim task panicked")
            .expect("claim failed")
        {
            Claim::Acquired { .. } => acquired += 1,
            Claim::InProgress { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(
        acquired, 1,
        "exactly one of 64 concurrent claims must acquire the key"
    );
}

async fn keys_are_independent<S: Store>(store: &S, keys: &Keys) {
    let (a, b) = (keys.fresh(), keys.fresh());
    let ta = acquire(store, &a, None).await;
    acquire(store, &b, None).await;
    assert!(store
        .complete(&a, ta, Bytes::from_static(b"a"), Duration::from_secs(60))
        .await
        .unwrap());
    assert_eq!(
        claim(store, &b, None).await,
        Claim::InProgress { fingerprint: None },
        "completing one key must not touch another"
    );
}

/// `lookup` never claims, sees only live completed records, and, when it answers, answers
/// what was recorded, with at most the TTL left. A store that cannot read without claiming
/// answers `None` throughout (the default).
async fn lookup_reads_completed_records_only<S: Store>(store: &S, keys: &Keys) {
    let key = keys.fresh();
    assert_eq!(store.lookup(&key).await.unwrap(), None, "an absent key");
    let fp = fingerprint(3);
    let token = acquire(store, &key, Some(&fp)).await;
    assert_eq!(
        store.lookup(&key).await.unwrap(),
        None,
        "a claim in progress"
    );
    let value = Bytes::from_static(b"looked up");
    let ttl = Duration::from_secs(60);
    assert!(store
        .complete(&key, token, value.clone(), ttl)
        .await
        .unwrap());
    if let Some(found) = store.lookup(&key).await.unwrap() {
        assert_eq!(found.value, value, "the recorded value");
        assert_eq!(found.fingerprint, Some(fp), "the record's fingerprint");
        if let Some(left) = found.expires_in {
            assert!(left <= ttl, "{left:?} left of a TTL of {ttl:?}");
        }
    }
    // A lookup of an absent key took nothing: the key is still free to claim.
    let untouched = keys.fresh();
    assert_eq!(store.lookup(&untouched).await.unwrap(), None);
    acquire(store, &untouched, None).await;
    assert!(store.remove(&key).await.unwrap());
    assert_eq!(store.lookup(&key).await.unwrap(), None, "a removed record");
}

/// `lease_left` answers for a live claim only, with at most its lease; a store that cannot
/// say answers `None` throughout.
async fn lease_left_is_the_live_claims_only<S: Store>(store: &S, keys: &Keys) {
    let key = keys.fresh();
    let left = |key: Key| async move { store.lease_left(&key).await.unwrap() };
    assert_eq!(left(key).await, None, "lease_left of an absent key");
    let token = acquire(store, &key, None).await;
    let held = left(key).await;
    if let Some(held) = held {
        assert!(
            !held.is_zero() && held <= HELD,
            "lease_left of a fresh claim must be within its lease: {held:?}"
        );
    }
    assert!(store
        .complete(&key, token, Bytes::from_static(b"v"), LEASE)
        .await
        .unwrap());
    assert_eq!(left(key).await, None, "lease_left of a completed record");

    let released = keys.fresh();
    let token = acquire(store, &released, None).await;
    assert!(store.release(&released, token).await.unwrap());
    assert_eq!(left(released).await, None, "lease_left of a released claim");
    if held.is_none() {
        return;
    }
    let lapsed = keys.fresh();
    acquire_for(store, &lapsed, None, LEASE).await;
    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    assert_eq!(left(lapsed).await, None, "lease_left of a lapsed claim");
}

/// A claim sent again with the same nonce (its reply was lost) gets the key back: with its
/// token, or taken again under a new one (and a whole lease), in which case the old token
/// no longer completes. Any other claim finds the key in progress. A store that forgets
/// nonces answers `InProgress` to both.
async fn a_claim_again_with_its_nonce_is_its_own<S: Store>(store: &S, keys: &Keys) {
    let key = keys.fresh();
    let fp = fingerprint(7);
    let claim = |nonce: u64| async move {
        store
            .claim(
                &ClaimRequest::new(&key, HELD)
                    .fingerprint(Some(&fp))
                    .nonce(nonce),
            )
            .await
            .unwrap_or_else(|e| panic!("claim failed: {e}"))
    };
    let Claim::Acquired { token: first, .. } = claim(41).await else {
        panic!("claim_with_nonce of a free key must acquire it");
    };
    let token = match claim(41).await {
        Claim::Acquired {
            token,
            taken_over: false,
        } => token,
        Claim::Acquired {
            taken_over: true, ..
        } => panic!("a fresh claim sent again with its nonce must not say `taken_over: true`"),
        Claim::InProgress { fingerprint } => {
            assert_eq!(fingerprint, Some(fp));
            first
        }
        other => panic!("a claim sent again with its nonce got {other:?}"),
    };
    assert_eq!(
        claim(42).await,
        Claim::InProgress {
            fingerprint: Some(fp)
        },
        "another nonce must find the key in progress"
    );
    if token != first {
        assert!(
            !store
                .complete(&key, first, Bytes::from_static(b"old"), HELD)
                .await
                .unwrap(),
            "a claim taken again must refuse its old token"
        );
    }
    assert!(
        store
            .complete(&key, token, Bytes::from_static(b"v"), HELD)
            .await
            .unwrap(),
        "the claim completes under its token"
    );
    assert!(
        matches!(claim(41).await, Claim::Completed { .. }),
        "a completed key replays, whatever the nonce"
    );
}

/// A claim that lapsed unsettled is remembered: each claim that takes it over says so, as
/// long as the claims keep lapsing, and a claim that settles (a completion or a release)
/// ends it. A takeover and its lapse are told whatever the store's clock grain: each waits
/// out two leases. A takeover sent again with its nonce says so too, at once or after its
/// own claim lapsed: a store that takes its own lapsed claim for the claim it took over
/// forgets what that one left unsettled, and the body runs blind.
async fn a_takeover_is_told_until_a_claim_settles<S: Store>(store: &S, keys: &Keys) {
    for settle in ["release", "complete"] {
        let key = keys.fresh();
        acquire_for(store, &key, None, LEASE).await;
        tokio::time::sleep(LEASE * 2).await;
        // Taken over, and left to lapse again: the next claim is told again. Sent three
        // times with one nonce (its answers lost), it says so every time.
        let request = ClaimRequest::new(&key, LEASE).nonce(0x7a6b);
        for send in ["first", "again", "after its own lapse"] {
            if send == "after its own lapse" {
                tokio::time::sleep(LEASE * 2).await;
            }
            let lapsed = store
                .claim(&request)
                .await
                .unwrap_or_else(|e| panic!("claim failed: {e}"));
            match lapsed {
                Claim::Acquired {
                    taken_over: true, ..
                } => {}
                // A store that keeps no nonce finds its own claim held.
                Claim::InProgress { .. } if send == "again" => {}
                other => panic!(
                    "a claim of a key whose claim lapsed unsettled must say `taken_over: true` ({send}), got {other:?}"
                ),
            }
        }
        tokio::time::sleep(LEASE * 2).await;
        let token = take_over(store, &key, None).await;
        match settle {
            "release" => assert!(store.release(&key, token).await.unwrap()),
            _ => {
                assert!(store
                    .complete(&key, token, Bytes::from_static(b"v"), LEASE)
                    .await
                    .unwrap());
                tokio::time::sleep(LEASE * 2).await; // past the record's TTL
            }
        }
        acquire(store, &key, None).await;
    }
}

/// The key of step `n` of `call`: its first 16 bytes are the call's, as the engine's are.
fn step_of(call: &Key, n: u8) -> Key {
    let mut step = [n; 32];
    step[..16].copy_from_slice(&call.as_bytes()[..16]);
    Key::from_bytes(step)
}

/// How many keys race a renewal against a takeover: the race is lost or won within one
/// write, so it is run on many keys at once.
const RACES: usize = 24;

/// A claim whose lease ran out, renewed by its holder on `first` while `second` takes it
/// over: one of them wins, never both. A takeover that judges the claim lapsed and then
/// writes without checking, in that write, that the claim is still the one it judged lets
/// both win, and two bodies run.
async fn a_renewal_racing_a_takeover_has_one_winner<S: Store>(first: &S, second: &S, keys: &Keys) {
    let mut held = Vec::with_capacity(RACES);
    for _ in 0..RACES {
        let key = keys.fresh();
        held.push((key, acquire_for(first, &key, None, LEASE).await));
    }
    tokio::time::sleep(LEASE + LEASE / 2).await;
    for (key, token) in &held {
        let request = ClaimRequest::new(key, HELD);
        let (claimed, renewed) = both(second.claim(&request), first.renew(key, *token, HELD)).await;
        let renewed = renewed.unwrap_or_else(|e| panic!("renew failed: {e}"));
        let claimed = claimed.unwrap_or_else(|e| panic!("claim failed: {e}"));
        match claimed {
            Claim::Acquired { token: taker, .. } => {
                assert!(
                    !renewed,
                    "a lapsed claim was both renewed by its holder and taken over: the takeover must re-check, in the write that takes the key, that no renewal came first"
                );
                assert!(
                    !first.renew(key, *token, HELD).await.unwrap(),
                    "the holder of a claim taken over renewed it afterwards"
                );
                assert!(second.release(key, taker).await.unwrap());
            }
            Claim::InProgress { .. } => {
                assert!(
                    renewed,
                    "a lapsed claim neither renewed nor taken: the claim must take it over"
                );
                assert!(first.release(key, *token).await.unwrap());
            }
            other => panic!("a claim of a lapsed key answered {other:?}"),
        }
    }
}

/// Runs `a` and `b` together, polling `a` first each time: the takeover is sent before the
/// renewal, so that the renewal lands while the takeover is being judged and written.
async fn both<A: std::future::Future, B: std::future::Future>(
    a: A,
    b: B,
) -> (A::Output, B::Output) {
    use std::task::Poll;
    let (mut a, mut b) = (std::pin::pin!(a), std::pin::pin!(b));
    let (mut first, mut second) = (None, None);
    std::future::poll_fn(|cx| {
        if first.is_none() {
            if let Poll::Ready(out) = a.as_mut().poll(cx) {
                first = Some(out);
            }
        }
        if second.is_none() {
            if let Poll::Ready(out) = b.as_mut().poll(cx) {
                second = Some(out);
            }
        }
        match (first.take(), second.take()) {
            (Some(a), Some(b)) => Poll::Ready((a, b)),
            (a, b) => {
                (first, second) = (a, b);
                Poll::Pending
            }
        }
    })
    .await
}

/// A claim held on `first` is in progress on `second`, which holds no state of it.
async fn a_live_claim_is_seen_by_the_other_instance<S: Store>(first: &S, second: &S, keys: &Keys) {
    let key = keys.fresh();
    let fp = fingerprint(7);
    let token = acquire(first, &key, Some(&fp)).await;
    assert_eq!(
        claim(second, &key, None).await,
        Claim::InProgress {
            fingerprint: Some(fp)
        },
        "a claim held by another instance must be in progress there, not taken on first sight"
    );
    assert!(
        second
            .renew(&key, Token::new(token.get() ^ 1), HELD)
            .await
            .map_or(true, |r| !r),
        "another token must not renew the claim"
    );
    assert!(first.release(&key, token).await.unwrap());
    let again = acquire(second, &key, None).await;
    assert!(second.release(&key, again).await.unwrap());
}

/// A claim that lapsed on `first` is taken over on `second`, told so, and the old holder's
/// writes through `first` change nothing.
async fn a_lapsed_claim_is_taken_over_by_the_other_instance<S: Store>(
    first: &S,
    second: &S,
    keys: &Keys,
) {
    let key = keys.fresh();
    let stale = acquire_for(first, &key, None, LEASE).await;
    tokio::time::sleep(LEASE + LEASE / 2).await;
    let owner = match claim(second, &key, None).await {
        Claim::Acquired {
            token,
            taken_over: true,
        } => token,
        // A store without a clock of its own judges a lapse by watching the claim for a
        // lease without a renewal (DynamoDB): on first sight, the claim is in progress.
        Claim::InProgress { .. } => {
            tokio::time::sleep(LEASE + LEASE / 2).await;
            take_over(second, &key, None).await
        }
        other => panic!(
            "a claim of a key whose claim lapsed unsettled must take it over and say `taken_over: true`, got {other:?}"
        ),
    };
    let ttl = Duration::from_secs(60);
    assert!(
        !first
            .complete(&key, stale, Bytes::from_static(b"stale"), ttl)
            .await
            .unwrap(),
        "the lapsed holder's completion through its own instance must be refused"
    );
    assert!(second
        .complete(&key, owner, Bytes::from_static(b"owner"), ttl)
        .await
        .unwrap());
    assert_eq!(
        claim(first, &key, None).await,
        Claim::Completed {
            value: Bytes::from_static(b"owner"),
            fingerprint: None,
        },
        "the other instance must replay the new owner's record"
    );
}

/// [`Store::record_step`] writes only under the call's live claim, and [`Store::steps`]
/// reads back what it wrote; recording again replaces; a stale token, a released or
/// completed call write nothing; [`Store::remove`] of the call removes its steps.
async fn step_records_are_fenced_by_the_calls_claim<S: Store>(store: &S, keys: &Keys) {
    let (call, other) = (keys.fresh(), keys.fresh());
    let token = acquire(store, &call, None).await;
    let value = |v: &'static [u8]| Bytes::from_static(v);
    let record = |step: Key, token: Token, v: &'static [u8]| async move {
        store
            .record_step(&call, token, &step, value(v), Duration::from_secs(60))
            .await
    };
    let read = |call: Key| async move {
        let mut steps = store.steps(&call).await.expect("steps");
        steps.sort_by_key(|(key, _)| *key);
        steps
    };
    assert!(read(call).await.is_empty(), "a new call has no steps");
    assert!(record(step_of(&call, 1), token, b"one")
        .await
        .expect("record_step"));
    assert!(record(step_of(&call, 2), token, b"two")
        .await
        .expect("record_step"));
    assert!(
        record(step_of(&call, 2), token, b"two again")
            .await
            .expect("record_step"),
        "a step recorded again under the same claim is replaced"
    );
    let stale = Token::new(token.get().wrapping_add(1));
    assert!(
        !record(step_of(&call, 3), stale, b"stale")
            .await
            .expect("record_step"),
        "a token that is not the claim's records nothing"
    );
    assert_eq!(
        read(call).await,
        vec![
            (step_of(&call, 1), value(b"one")),
            (step_of(&call, 2), value(b"two again"))
        ],
        "the steps read back as recorded"
    );
    assert!(
        read(other).await.is_empty(),
        "another call's steps are its own"
    );

    assert!(store.release(&call, token).await.expect("release"));
    assert!(
        !record(step_of(&call, 4), token, b"late")
            .await
            .expect("record_step"),
        "a released claim records no step"
    );
    assert_eq!(
        read(call).await.len(),
        2,
        "a release keeps the steps for the next attempt"
    );

    let token = acquire(store, &call, None).await;
    assert!(store
        .complete(&call, token, value(b"done"), Duration::from_secs(60))
        .await
        .expect("complete"));
    assert!(
        !record(step_of(&call, 5), token, b"late")
            .await
            .expect("record_step"),
        "a completed call records no step"
    );
    assert!(store.remove(&call).await.expect("remove"));
    assert!(
        read(call).await.is_empty(),
        "removing a call removes its steps"
    );
}

/// The steps of a call ([`step`](crate::step())), recorded in the store: an attempt that
/// fails after its first step leaves it recorded, the next attempt replays it and runs the
/// second, and the call then replays whole. Each step's future runs once.
async fn steps_resume_where_the_last_attempt_stopped<S: Store + Clone>(store: &S, keys: &Keys) {
    let op = Operation::new(format!("idem.testkit.steps.{}", keys.run));
    let key = keys.fresh();
    let runs = [AtomicU64::new(0), AtomicU64::new(0)];
    let attempt = |fail: bool| {
        let runs = &runs;
        async move {
            let first = step("first", async {
                Ok::<_, Error>(runs[0].fetch_add(1, Ordering::SeqCst) + 1)
            })
            .await?;
            if fail {
                return Err(Error::store("the attempt fails after its first step"));
            }
            let second = step("second", async {
                Ok::<_, Error>(runs[1].fetch_add(1, Ordering::SeqCst) + 1)
            })
            .await?;
            Ok::<_, Error>((first, second))
        }
    };
    let failed = op.run(store, &key, None, attempt(true)).await;
    assert!(failed.is_err(), "the first attempt fails: {failed:?}");
    let resumed = op.run(store, &key, None, attempt(false)).await;
    assert_eq!(
        resumed.unwrap_or_else(|e| panic!("the second attempt failed: {e}")),
        Outcome::Executed((1, 1)),
        "the second attempt replays the first step and runs the second"
    );
    let replayed = op.run(store, &key, None, attempt(false)).await;
    assert_eq!(
        replayed.unwrap_or_else(|e| panic!("the replay failed: {e}")),
        Outcome::Replayed((1, 1))
    );
    let counts = runs.each_ref().map(|runs| runs.load(Ordering::SeqCst));
    assert_eq!(counts, [1, 1], "each step's future ran once");
}
