//! Shutdown and cancellation at the edges: a runtime dropped under a running call, a caller
//! dropped after its body returned, and `drain` for the work that outlives its caller.

use std::future::Future;
use std::time::Duration;

use idem_runtime::{Error, MemoryStore, Operation, Outcome, MIN_LEASE};
use idem_tests::Probe;

/// Far longer than the lease: a call that takes this long waited for a holder that is gone.
const PATIENCE: Duration = Duration::from_secs(20);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// How the first runtime is left while its call holds the key.
#[derive(Clone, Copy, Debug)]
enum Ending {
    /// `block_on` of a call that is dropped (a timeout), then the runtime is dropped.
    CallDropped,
    /// The call is a task still running when the runtime is dropped.
    TaskRunning,
    /// As `TaskRunning`, with `on_cancel = "complete"` (its body is a background task).
    BackgroundBody,
}

/// A call claims a key in one runtime, which then goes away in the way `ending` says; in a
/// second runtime, on the same store, the next call must run once the first lease lapsed,
/// not wait on the dead holder until it gives up.
fn next_runtime_runs_after_the_lease(ending: Ending) {
    let store = MemoryStore::new();
    let op = Operation::new(format!("shutdown.{ending:?}"))
        .lease(MIN_LEASE)
        .wait(PATIENCE);
    let key = op.key(&1).unwrap();
    let (claimed, was_claimed) = std::sync::mpsc::channel();
    let first = runtime();
    let body = async move {
        claimed.send(()).unwrap();
        std::future::pending::<()>().await;
        Ok::<_, Error>(0)
    };
    match ending {
        Ending::CallDropped => first.block_on(async {
            let (op, store) = (op.clone(), store.clone());
            let call = async move { op.run(&store, &key, None, body).await };
            // The body signals through a channel this thread cannot await; yield until then.
            let wait = async {
                while was_claimed.try_recv().is_err() {
                    tokio::task::yield_now().await;
                }
            };
            tokio::select! {
                _ = call => unreachable!("the body never returns"),
                () = wait => {}
            }
        }),
        Ending::TaskRunning | Ending::BackgroundBody => {
            let (op, store) = (op.clone(), store.clone());
            let background = matches!(ending, Ending::BackgroundBody);
            // A second thread drives the runtime until the key is claimed.
            std::thread::scope(|scope| {
                let first = &first;
                scope.spawn(move || {
                    first.block_on(async move {
                        let call = tokio::spawn(async move {
                            if background {
                                op.run_to_completion(&store, &key, None, body).await
                            } else {
                                op.run(&store, &key, None, body).await
                            }
                        });
                        while was_claimed.try_recv().is_err() {
                            tokio::task::yield_now().await;
                        }
                        drop(call);
                    });
                });
            });
        }
    }
    drop(first);

    let second = runtime();
    let out = second.block_on(async {
        let call = op.run(&store, &key, None, async { Ok::<_, Error>(1) });
        tokio::time::timeout(PATIENCE * 2, call).await
    });
    let out = out.expect("hung").unwrap_or_else(|e| {
        panic!("{ending:?}: the key stayed held after its runtime was dropped: {e}")
    });
    assert_eq!(out, Outcome::Executed(1), "{ending:?}");
}

#[test]
fn a_call_dropped_with_its_runtime_leaves_no_key_stuck() {
    next_runtime_runs_after_the_lease(Ending::CallDropped);
}

#[test]
fn a_task_running_when_its_runtime_drops_leaves_no_key_stuck() {
    next_runtime_runs_after_the_lease(Ending::TaskRunning);
}

#[test]
fn a_background_body_at_runtime_shutdown_leaves_no_key_stuck() {
    next_runtime_runs_after_the_lease(Ending::BackgroundBody);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_dropped_after_its_body_returned_still_records_the_result() {
    let (store, gate) = Probe::gated(MemoryStore::new());
    let op = Operation::new("shutdown.cancel_after_body");
    let key = op.key(&1).unwrap();
    let caller = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            op.run(&store, &key, None, async { Ok::<_, Error>(1) })
                .await
        })
    };
    // The body returned and the completion is on its way to the store: drop the caller now.
    gate.reached().await;
    caller.abort();
    assert!(caller.await.unwrap_err().is_cancelled());
    gate.open();

    let retry = op.run(&store, &key, None, async { Ok::<_, Error>(2) });
    assert_eq!(
        retry.await.unwrap(),
        Outcome::Replayed(1),
        "the body ran again after its caller went away"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_for_background_work_until_its_deadline() {
    let store = MemoryStore::new();
    let op = Operation::new("shutdown.drain");
    let key = op.key(&1).unwrap();
    let (finish, finished) = tokio::sync::oneshot::channel::<()>();
    let (started, has_started) = tokio::sync::oneshot::channel();
    let caller = {
        let (op, store) = (op.clone(), store.clone());
        tokio::spawn(async move {
            op.run_to_completion(&store, &key, None, async move {
                let _ = started.send(());
                let _ = finished.await;
                Ok::<_, Error>(7)
            })
            .await
        })
    };
    has_started.await.unwrap();
    // The caller goes away; the body goes on in the background.
    caller.abort();
    let _ = caller.await;

    let undrained = idem_runtime::drain(Duration::from_millis(20))
        .await
        .unwrap_err();
    assert!(undrained.running() >= 1, "{undrained}");

    finish.send(()).unwrap();
    idem_runtime::drain(PATIENCE)
        .await
        .expect("drained once the body finished");
    let replay = op.run(&store, &key, None, async { Ok::<_, Error>(8) });
    assert_eq!(replay.await.unwrap(), Outcome::Replayed(7));
}

#[tokio::test]
async fn a_holder_that_stopped_making_progress_is_waited_for_one_lease_at_most() {
    let store = MemoryStore::new();
    let op = Operation::new("shutdown.leaked")
        .lease(MIN_LEASE)
        .wait(PATIENCE);
    let key = op.key(&1).unwrap();
    // Polled until its body runs, then neither polled nor dropped again: a holder frozen for
    // good (a leaked future, a task stuck in blocking code). It renews nothing.
    let (claimed, was_claimed) = tokio::sync::oneshot::channel();
    let mut holder = Box::pin(op.run(&store, &key, None, async {
        let _ = claimed.send(());
        std::future::pending::<()>().await;
        Ok::<_, Error>(0)
    }));
    let mut was_claimed = std::pin::pin!(was_claimed);
    std::future::poll_fn(|cx| {
        let _ = holder.as_mut().poll(cx);
        was_claimed.as_mut().poll(cx).map(|_| ())
    })
    .await;
    std::mem::forget(holder);

    let call = op.run(&store, &key, None, async { Ok::<_, Error>(1) });
    let out = tokio::time::timeout(PATIENCE * 2, call)
        .await
        .expect("hung");
    assert_eq!(
        out.expect("the frozen holder's flight was waited for past its lease"),
        Outcome::Executed(1)
    );
}
