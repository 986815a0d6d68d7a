//! Expiry: results live for their TTL; a claim whose holder stops renewing is taken over
//! after its lease with a larger token, and the stale holder can no longer write.

use idem_runtime::ClaimRequest;
use std::time::Duration;

use idem_runtime::store::Claim;
use idem_runtime::{Bytes, Error, MemoryStore, Operation, Outcome, Store};
use idem_tests::{Probe, Runs};

#[tokio::test]
async fn after_the_ttl_the_body_runs_again() {
    // A memory store's result TTLs follow real time (its leases follow tokio::time).
    let store = MemoryStore::new();
    let ttl = Duration::from_millis(300);
    let op = Operation::new("expiry.ttl").lease(ttl).ttl(ttl);
    // The replay is judged only when the record was surely live: a machine that stalls
    // past the TTL between the two calls proves nothing either way, so such a try is made
    // again with a fresh key (never skipped), up to five times.
    for attempt in 0..5 {
        let key = op.key(&attempt).unwrap();
        let runs = Runs::default();
        let call = || {
            let r = runs.clone();
            async move { Ok::<_, Error>(r.hit()) }
        };
        let recorded = std::time::Instant::now();
        assert_eq!(
            op.run(&store, &key, None, call()).await.unwrap(),
            Outcome::Executed(0)
        );
        let again = op.run(&store, &key, None, call()).await.unwrap();
        if recorded.elapsed() >= ttl {
            continue;
        }
        assert_eq!(again, Outcome::Replayed(0));
        tokio::time::sleep(ttl + Duration::from_millis(100)).await;
        assert_eq!(
            op.run(&store, &key, None, call()).await.unwrap(),
            Outcome::Executed(1)
        );
        return;
    }
    panic!("the machine stalled past a 300 ms TTL between two calls, five times running");
}

#[tokio::test(start_paused = true)]
async fn a_long_body_keeps_its_claim_by_renewing_it() {
    let store = MemoryStore::new();
    let op = Operation::new("expiry.renew")
        .lease(Duration::from_secs(3))
        .in_flight(idem_runtime::InFlight::Reject);
    let key = op.key(&1).unwrap();
    let long = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async {
                tokio::time::sleep(Duration::from_secs(20)).await;
                Ok::<_, Error>(1)
            })
            .await
        })
    };
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let err = op
            .run(&store, &key, None, async { Ok::<_, Error>(2) })
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::InProgress),
            "a renewed claim is not taken over"
        );
    }
    assert_eq!(long.await.unwrap().unwrap(), Outcome::Executed(1));
}

#[tokio::test(start_paused = true)]
async fn a_lapsed_claim_is_taken_over_and_the_stale_holder_is_fenced() {
    let store = MemoryStore::new();
    let lease = Duration::from_secs(1);
    let op = Operation::new("expiry.zombie").lease(lease);
    let key = op.key(&1).unwrap();

    // A holder that stops renewing (a process paused past its lease).
    let Claim::Acquired { token: stale, .. } =
        store.claim(&ClaimRequest::new(&key, lease)).await.unwrap()
    else {
        panic!("the key was free");
    };
    let err = op
        .clone()
        .in_flight(idem_runtime::InFlight::Reject)
        .run(&store, &key, None, async { Ok::<_, Error>(0) })
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::InProgress),
        "before the lease ends the key is held"
    );

    tokio::time::advance(lease + Duration::from_millis(1)).await;
    let out = op
        .run(&store, &key, None, async { Ok::<_, Error>(2) })
        .await
        .unwrap();
    assert_eq!(
        out,
        Outcome::Executed(2),
        "after the lease another call takes over"
    );

    let ttl = Duration::from_secs(60);
    assert!(!store
        .complete(&key, stale, Bytes::from_static(b"v1"), ttl)
        .await
        .unwrap());
    assert!(!store.release(&key, stale).await.unwrap());
    assert!(!store.renew(&key, stale, lease).await.unwrap());
    let replay = op
        .run(&store, &key, None, async { Ok::<_, Error>(3) })
        .await
        .unwrap();
    assert_eq!(replay, Outcome::Replayed(2), "the newer record survives");
}

// Paused time: the memory store's leases follow tokio's clock, which moves only when every
// task waits, so the takeover happens at the same virtual instant on a busy machine.
#[tokio::test(start_paused = true)]
async fn a_holder_that_lost_its_lease_mid_body_cannot_overwrite_the_new_owner() {
    let store = MemoryStore::new();
    let lease = Duration::from_millis(100);
    let op = Operation::new("expiry.zombie_engine").lease(lease);
    let key = op.key(&1).unwrap();

    // The first "process" never renews, and its body outlives the lease.
    let zombie = {
        let (op, store) = (op.clone(), Probe::frozen(store.clone()));
        tokio::spawn(async move {
            op.run(&store, &key, None, async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok::<_, Error>(String::from("zombie"))
            })
            .await
        })
    };
    tokio::time::sleep(lease + Duration::from_millis(50)).await;
    let owner = op
        .run(&Probe::frozen(store.clone()), &key, None, async {
            Ok::<_, Error>(String::from("owner"))
        })
        .await
        .unwrap();
    assert_eq!(owner, Outcome::Executed(String::from("owner")));

    // The zombie's body did run, but the key's value is the owner's: its caller is told
    // that its body ran unrecorded (never a replay), and every later caller gets the owner's.
    let err = zombie.await.unwrap().unwrap_err();
    assert!(matches!(err, Error::Unrecorded(_)), "{err}");
    let replay = op
        .run(&store, &key, None, async {
            Ok::<_, Error>(String::from("third"))
        })
        .await
        .unwrap();
    assert_eq!(replay, Outcome::Replayed(String::from("owner")));
}

#[tokio::test(start_paused = true)]
async fn local_waiters_of_a_holder_that_lost_its_lease_get_the_new_owners_result() {
    let store = MemoryStore::new();
    let lease = Duration::from_millis(100);
    let op = Operation::new("expiry.zombie_waiters").lease(lease);
    let key = op.key(&1).unwrap();
    let paused = Probe::paused(store.clone());

    let holder = {
        let (op, paused) = (op.clone(), paused.clone());
        tokio::spawn(async move {
            op.run(&paused, &key, None, async {
                tokio::time::sleep(Duration::from_millis(400)).await;
                Ok::<_, Error>("zombie".to_string())
            })
            .await
        })
    };
    tokio::time::sleep(lease + Duration::from_millis(50)).await;
    // Another process takes the lapsed key over and records its result.
    let other_process = Probe::frozen(store.clone());
    let owner = op.run(&other_process, &key, None, async {
        Ok::<_, Error>("owner".to_string())
    });
    assert_eq!(owner.await.unwrap(), Outcome::Executed("owner".to_string()));
    // A call in the holder's process waits on the holder, as local duplicates do.
    let waiter = {
        let (op, paused) = (op.clone().wait(Duration::from_secs(2)), paused.clone());
        tokio::spawn(async move {
            op.run(&paused, &key, None, async {
                Ok::<_, Error>("waiter".to_string())
            })
            .await
        })
    };
    let err = holder.await.unwrap().unwrap_err();
    assert!(
        matches!(err, Error::Unrecorded(_)),
        "the holder is told its own result is unrecorded, never answered another's as a replay: {err}"
    );
    assert_eq!(
        waiter.await.unwrap().unwrap(),
        Outcome::Replayed("owner".to_string()),
        "the waiter sees the store's one result, not the zombie's"
    );
}

/// Renewals that fail are retried soon, not a whole period later: two failures in a row early
/// in the body would otherwise let the lease lapse, and another call take the key over.
#[tokio::test(start_paused = true)]
async fn a_failed_renewal_is_retried_before_the_lease_runs_out() {
    let store = Probe::renewals_fail(MemoryStore::new(), 2);
    let lease = Duration::from_millis(300);
    let op = Operation::new("expiry.renew_retry").lease(lease);
    let key = op.key(&1).unwrap();
    let holder = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async {
                tokio::time::sleep(lease * 10).await;
                Ok::<_, Error>(1_u8)
            })
            .await
        })
    };
    let checker = op.clone().in_flight(idem_runtime::InFlight::Reject);
    for _ in 0..18 {
        tokio::time::sleep(lease / 2).await;
        let taken = checker
            .run(&store, &key, None, async { Ok::<_, Error>(2_u8) })
            .await;
        assert!(
            matches!(taken, Err(Error::InProgress)),
            "the lease lapsed while the body ran: {taken:?}"
        );
    }
    assert_eq!(holder.await.unwrap().unwrap(), Outcome::Executed(1));
    let replay = op.run(&store, &key, None, async { Ok::<_, Error>(3_u8) });
    assert_eq!(replay.await.unwrap(), Outcome::Replayed(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_answers_the_new_owners_record() {
    idem_tests::scenarios::zombie_cannot_overwrite_the_new_owner(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_holder_answers_only_what_the_key_records() {
    idem_tests::scenarios::a_lapsed_holder_answers_only_what_the_key_records(MemoryStore::new())
        .await;
}
