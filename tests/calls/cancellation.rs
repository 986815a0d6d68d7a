//! Panics and cancellation: a call that does not finish never leaves its key stuck.
//!
//! The bodies signal where they are instead of sleeping, and "at once" is checked against
//! the lease: a next call that had to wait for the lease (30 s by default) would take longer
//! than [`SOONER_THAN_THE_LEASE`].

use std::time::Duration;

use idem_runtime::{Error, MemoryStore, Operation, Outcome};
use idem_tests::Runs;
use tokio::sync::oneshot;

const SOONER_THAN_THE_LEASE: Duration = Duration::from_secs(10);

/// Runs `call`, failing the test if it took as long as a lease.
async fn soon<T>(call: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(SOONER_THAN_THE_LEASE, call)
        .await
        .expect("the call waited for the lease: the key was not released")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_body_releases_the_key_and_the_panic_reaches_the_caller() {
    let store = MemoryStore::new();
    let op = Operation::new("cancel.panic");
    let key = op.key(&1).unwrap();
    let call = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async {
                tokio::task::yield_now().await;
                if true {
                    panic!("card reader on fire");
                }
                Ok::<u32, Error>(0)
            })
            .await
        })
    };
    let joined = call.await.unwrap_err();
    assert!(joined.is_panic());
    let message = joined.into_panic();
    assert_eq!(message.downcast_ref::<&str>(), Some(&"card reader on fire"));

    let next = soon(op.run(&store, &key, None, async { Ok::<_, Error>(2_u32) })).await;
    assert_eq!(next.unwrap(), Outcome::Executed(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_call_releases_its_key_at_once() {
    let store = MemoryStore::new();
    let op = Operation::new("cancel.release");
    let key = op.key(&1).unwrap();
    let runs = Runs::default();
    let (started, has_started) = oneshot::channel();
    let call = {
        let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async move {
                runs.hit();
                let _ = started.send(());
                std::future::pending::<()>().await;
                Ok::<_, Error>(1_u32)
            })
            .await
        })
    };
    has_started.await.unwrap();
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());

    let next = soon(op.run(&store, &key, None, async { Ok::<_, Error>(2_u32) })).await;
    assert_eq!(
        next.unwrap(),
        Outcome::Executed(2),
        "the aborted call's body never finished"
    );
    assert_eq!(runs.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_call_wakes_its_waiters_and_one_of_them_runs() {
    let store = MemoryStore::new();
    let op = Operation::new("cancel.waiters");
    let key = op.key(&1).unwrap();
    let (started, has_started) = oneshot::channel();
    let first = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async {
                let _ = started.send(());
                std::future::pending::<()>().await;
                Ok::<_, Error>(1_u32)
            })
            .await
        })
    };
    has_started.await.unwrap();
    let waiter = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async { Ok::<_, Error>(2_u32) })
                .await
        })
    };
    // Whether the waiter is already waiting or arrives after the abort, it must run.
    tokio::task::yield_now().await;
    first.abort();
    let out = soon(waiter).await.unwrap();
    assert_eq!(out.unwrap(), Outcome::Executed(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_run_to_completion_an_aborted_call_finishes_in_the_background_and_is_recorded() {
    let store = MemoryStore::new();
    let op = Operation::new("cancel.complete");
    let key = op.key(&1).unwrap();
    let runs = Runs::default();
    let (started, has_started) = oneshot::channel();
    let (go_on, proceed) = oneshot::channel::<()>();
    let (finished_tx, finished) = oneshot::channel();
    let call = {
        let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
        tokio::spawn(async move {
            op.run_to_completion(&store, &key, None, async move {
                runs.hit();
                let _ = started.send(());
                let _ = proceed.await;
                let _ = finished_tx.send(());
                Ok::<_, Error>(7_u32)
            })
            .await
        })
    };
    has_started.await.unwrap();
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    go_on.send(()).unwrap();

    finished
        .await
        .expect("the body ran to the end after its caller was dropped");
    let next = op
        .run(&store, &key, None, async { Ok::<_, Error>(8_u32) })
        .await
        .unwrap();
    assert_eq!(next, Outcome::Replayed(7));
    assert_eq!(runs.count(), 1);
}

/// A body under `run_to_completion` is polled in its caller's task: a task is spawned only
/// when the caller goes away (the test above), not for every call.
#[tokio::test(flavor = "current_thread")]
async fn with_run_to_completion_a_body_runs_in_its_callers_task() {
    let store = MemoryStore::new();
    let op = Operation::new("cancel.complete_inline");
    let key = op.key(&1).unwrap();
    let tasks = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
    let before = tasks();
    let during = op
        .run_to_completion(&store, &key, None, async move { Ok::<_, Error>(tasks()) })
        .await
        .unwrap();
    assert_eq!(
        during,
        Outcome::Executed(before),
        "the body ran in a task of its own"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_run_to_completion_a_panic_still_reaches_the_caller_and_releases() {
    let store = MemoryStore::new();
    let op = Operation::new("cancel.complete_panic");
    let key = op.key(&1).unwrap();
    let call = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            op.run_to_completion(&store, &key, None, async {
                if true {
                    panic!("boom");
                }
                Ok::<u32, Error>(0)
            })
            .await
        })
    };
    assert!(call.await.unwrap_err().is_panic());
    let next = soon(op.run(&store, &key, None, async { Ok::<_, Error>(2_u32) })).await;
    assert_eq!(next.unwrap(), Outcome::Executed(2));
}

#[idem_runtime::idempotent(
    key = id,
    store = store,
    namespace = "cancel.outside",
    on_cancel = "complete"
)]
async fn completing(store: MemoryStore, id: u64) -> Result<u64, Error> {
    Ok(id)
}

/// `on_cancel = "complete"` finishes a dropped body on the runtime the call started in: a
/// call polled outside one is refused with a configuration error, before its claim, and a
/// replay the same, so that the mistake shows on the first test, not in production.
#[test]
fn a_completing_call_outside_a_runtime_is_refused_replay_or_not() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    let store = MemoryStore::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert_eq!(runtime.block_on(completing(store.clone(), 1)).unwrap(), 1);
    for id in [1, 2] {
        let mut call = std::pin::pin!(completing(store.clone(), id));
        let polled = call.as_mut().poll(&mut Context::from_waker(Waker::noop()));
        assert!(
            matches!(polled, Poll::Ready(Err(Error::Config(_)))),
            "key {id} outside a runtime: {polled:?}"
        );
    }
    // The refused first call claimed nothing: inside a runtime, it runs.
    assert_eq!(runtime.block_on(completing(store, 2)).unwrap(), 2);
}
