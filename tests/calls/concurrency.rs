//! Concurrency: duplicates never run the body twice; different keys never wait for each other.

use std::sync::Arc;
use std::time::Duration;

use idem_runtime::{Error, InFlight, MemoryStore, Operation, Outcome, DEFAULT_WAIT};
use idem_tests::{Probe, Runs};
use tokio::time::Instant;

const CALLERS: usize = 1000;

/// 1000 callers on one key. The body holds the key until `open_after` callers have answered
/// (signals, not sleeps: a busy machine changes nothing).
async fn one_key_many_callers(
    in_flight: InFlight,
    open_after: usize,
) -> (Runs, Vec<Result<Outcome<u64>, Error>>) {
    let store = MemoryStore::new();
    let op = Arc::new(Operation::new("concurrency.one_key").in_flight(in_flight));
    let key = op.key(&"hot-key").unwrap();
    let runs = Runs::default();
    let barrier = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (answers, mut answered) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..CALLERS {
        let (op, store, runs, barrier, gate, answers) = (
            op.clone(),
            store.clone(),
            runs.clone(),
            barrier.clone(),
            gate.clone(),
            answers.clone(),
        );
        tokio::spawn(async move {
            barrier.wait().await;
            let result = op
                .run(&store, &key, None, async move {
                    runs.hit();
                    let _open = gate.acquire().await;
                    Ok::<_, Error>(i as u64 + 1_000_000)
                })
                .await;
            let _ = answers.send(result);
        });
    }
    let mut results = Vec::with_capacity(CALLERS);
    if open_after == 0 {
        gate.add_permits(1);
    }
    while results.len() < CALLERS {
        let result = answered.recv().await.expect("a caller panicked");
        results.push(result);
        if results.len() == open_after {
            gate.add_permits(1);
        }
    }
    (runs, results)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_waiting_duplicates_run_the_body_once_and_share_its_value() {
    let (runs, results) = one_key_many_callers(InFlight::Wait, 0).await;
    assert_eq!(runs.count(), 1);
    let values: Vec<u64> = results
        .into_iter()
        .map(|r| r.unwrap().into_inner())
        .collect();
    assert!(
        values.iter().all(|v| *v == values[0]),
        "all callers get the one value"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_rejecting_duplicates_run_the_body_once_and_999_are_told_in_progress() {
    // The body holds the key until the 999 others have answered.
    let (runs, results) = one_key_many_callers(InFlight::Reject, CALLERS - 1).await;
    assert_eq!(runs.count(), 1);
    let executed = results
        .iter()
        .filter(|r| matches!(r, Ok(Outcome::Executed(_))))
        .count();
    let rejected = results
        .iter()
        .filter(|r| matches!(r, Err(Error::InProgress)))
        .count();
    assert_eq!((executed, rejected), (1, CALLERS - 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_distinct_keys_run_in_parallel() {
    let store = MemoryStore::new();
    let op = Arc::new(Operation::new("concurrency.many_keys"));
    let runs = Runs::default();
    // Every body waits until all 1000 are running at once: if keys waited for each other,
    // this would never finish (the outer timeout turns that into a failure).
    let all_running = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let started = Instant::now();
    let calls: Vec<_> = (0..CALLERS)
        .map(|i| {
            let (op, store, runs, all_running) =
                (op.clone(), store.clone(), runs.clone(), all_running.clone());
            tokio::spawn(async move {
                let key = op.key(&i).unwrap();
                op.run(&store, &key, None, async move {
                    runs.hit();
                    all_running.wait().await;
                    Ok::<_, Error>(i)
                })
                .await
            })
        })
        .collect();
    let all = async {
        for (i, call) in calls.into_iter().enumerate() {
            assert_eq!(call.await.unwrap().unwrap(), Outcome::Executed(i));
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("1000 bodies on distinct keys were never all running at once");
    assert_eq!(runs.count(), CALLERS);
    println!(
        "1000 distinct keys, all bodies in flight together: {:?}",
        started.elapsed()
    );
}

/// A holder that keeps its key until released, and a second call on the key; returns how
/// long (in tokio's paused clock) the second call waited before it gave up with
/// `InProgress`.
async fn waiter_gives_up_after(op: Operation) -> Duration {
    let store = MemoryStore::new();
    let key = op.key(&1).unwrap();
    let (claimed_tx, claimed) = tokio::sync::oneshot::channel();
    let (finish, finished) = tokio::sync::oneshot::channel::<()>();
    let holder = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            // Renewed while it runs, so the claim outlives many leases.
            op.run(&store, &key, None, async {
                let _ = claimed_tx.send(());
                let _ = finished.await;
                Ok::<_, Error>(1)
            })
            .await
        })
    };
    claimed.await.unwrap();
    let started = Instant::now();
    let err = op
        .run(&store, &key, None, async { Ok::<_, Error>(2) })
        .await
        .unwrap_err();
    let waited = started.elapsed();
    assert!(matches!(err, Error::InProgress), "{err}");
    finish.send(()).unwrap();
    assert_eq!(holder.await.unwrap().unwrap(), Outcome::Executed(1));
    waited
}

// Paused time: the waits below are measured on tokio's virtual clock, which only moves when
// every task is idle, so they are exact however busy the machine is.
#[tokio::test(start_paused = true)]
async fn waiters_that_outlast_their_wait_timeout_get_in_progress() {
    let timeout = Duration::from_millis(50);
    let op = Operation::new("concurrency.timeout").wait(timeout);
    let waited = waiter_gives_up_after(op).await;
    assert_eq!(waited, timeout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_a_call_that_fails_claim_again_and_one_of_them_runs() {
    let store = MemoryStore::new();
    let op = Arc::new(Operation::new("concurrency.retry_after_err"));
    let key = op.key(&1).unwrap();
    let runs = Runs::default();
    let calls: Vec<_> = (0..50)
        .map(|_| {
            let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
            tokio::spawn(async move {
                op.run(&store, &key, None, async move {
                    let n = runs.hit();
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    if n == 0 {
                        Err(Error::store("first attempt fails"))
                    } else {
                        Ok(n)
                    }
                })
                .await
            })
        })
        .collect();
    let mut oks = Vec::new();
    for call in calls {
        if let Ok(out) = call.await.unwrap() {
            oks.push(out.into_inner());
        }
    }
    assert_eq!(runs.count(), 2, "the failed run, then exactly one retry");
    assert_eq!(oks.len(), 49);
    assert!(oks.iter().all(|v| *v == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_in_one_process_wait_without_store_traffic() {
    let store = Probe::new(MemoryStore::new());
    let op = Arc::new(Operation::new("concurrency.coalesce"));
    let key = op.key(&1).unwrap();
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let leader = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async move {
                let _ = started_tx.send(());
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok::<_, Error>(42)
            })
            .await
        })
    };
    started.await.unwrap();
    assert_eq!(store.claims(), 1);
    let waiters: Vec<_> = (0..100)
        .map(|_| {
            let (op, store) = (op.clone(), store.clone());
            tokio::spawn(async move {
                op.run(&store, &key, None, async { Ok::<_, Error>(0) })
                    .await
            })
        })
        .collect();
    for waiter in waiters {
        assert_eq!(waiter.await.unwrap().unwrap(), Outcome::Replayed(42));
    }
    assert_eq!(leader.await.unwrap().unwrap(), Outcome::Executed(42));
    assert_eq!(
        store.claims(),
        1,
        "100 waiters shared the running call without claiming"
    );
}

/// The default wait is the caller's patience, not the lease: beside a five-minute lease a
/// duplicate answers `InProgress` after [`DEFAULT_WAIT`], and beside a lease shorter than
/// the holder's body it waits on while the holder renews, for the same 10 s.
#[tokio::test(start_paused = true)]
async fn by_default_a_waiter_waits_ten_seconds_whatever_the_lease() {
    for lease in [Duration::from_secs(300), Duration::from_millis(200)] {
        let op = Operation::new("concurrency.default_wait").lease(lease);
        let waited = waiter_gives_up_after(op).await;
        assert_eq!(
            waited, DEFAULT_WAIT,
            "waited {waited:?} beside a lease of {lease:?}"
        );
    }
}

/// A body longer than its lease, renewed as it runs: a duplicate that comes while it runs
/// waits for it and replays its value, instead of giving up a moment before it records
/// (which a wait of one lease did).
#[tokio::test(start_paused = true)]
async fn a_duplicate_outwaits_a_renewing_holder_whose_body_outlasts_the_lease() {
    let store = MemoryStore::new();
    let op = Operation::new("concurrency.renewing_holder").lease(Duration::from_millis(200));
    let key = op.key(&1).unwrap();
    let (claimed_tx, claimed) = tokio::sync::oneshot::channel();
    let holder = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async {
                let _ = claimed_tx.send(());
                // Five leases long, renewed all along.
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok::<_, Error>(1)
            })
            .await
        })
    };
    claimed.await.unwrap();
    let duplicate = op
        .run(&store, &key, None, async { Ok::<_, Error>(2) })
        .await
        .unwrap();
    assert_eq!(duplicate, Outcome::Replayed(1));
    assert_eq!(holder.await.unwrap().unwrap(), Outcome::Executed(1));
}

/// A body that blocks its thread (a synchronous write, a long computation) keeps its claim:
/// the heartbeat runs as a task of its own, on another worker. The body blocks until the
/// store has seen a renewal (a signal, bounded by a minute), which a heartbeat polled only
/// beside the body could never send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_blocks_its_thread_keeps_its_claim_renewed() {
    let probe = Probe::apart(MemoryStore::new());
    let op = Operation::new("concurrency.blocking_body").lease(Duration::from_millis(400));
    let key = op.key(&"blocking").unwrap();
    let watched = probe.clone();
    let renewed = op
        .run(&probe, &key, None, async move {
            // Let the call start its heartbeat (it does at the body's first wait), then block.
            tokio::task::yield_now().await;
            let trips = watched.trips();
            let started = std::time::Instant::now();
            while watched.trips() == trips && started.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok::<_, Error>(watched.trips() > trips)
        })
        .await
        .unwrap();
    assert!(
        renewed.into_inner(),
        "no renewal reached the store while the body blocked its thread"
    );
}
