//! What steps cost in round trips, counted by a probe around every store: one a step that
//! runs, and a single read for all of a call's recorded steps when a retry resumes.

use std::sync::Arc;

use idem_runtime::{step, Error, Operation, Outcome, Store};
use idem_tests::scenarios::namespace;
use idem_tests::Probe;

use super::stores::every_store;

const STEPS: usize = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_run_costs_one_round_trip_and_a_resumed_one_almost_none() {
    for (name, store) in every_store("costs").await {
        costs(name, store).await;
    }
}

async fn costs(name: &str, store: Arc<dyn Store>) {
    let op = Operation::new(namespace("steps_costs"));
    let key = op.key(&"batch-1").unwrap();
    let body = |fail: bool| async move {
        let mut total = 0;
        for i in 0..STEPS {
            total += step("item", async move { Ok::<_, Error>(i) }).await?;
        }
        if fail {
            return Err(Error::store("the batch's last write failed"));
        }
        Ok::<_, Error>(total)
    };

    // The first attempt runs every step, then fails: its claim, one read of the (no) steps,
    // a record a step, and the release.
    let probe = Probe::apart(store.clone());
    assert!(op.run(&probe, &key, None, body(true)).await.is_err());
    let per_step = (probe.trips() - 3) as f64 / STEPS as f64;
    assert!(
        per_step <= 1.1,
        "{name}: {per_step} round trips a step run ({} in all)",
        probe.trips()
    );

    // The retry replays all of them: its claim, one read, the completion.
    let probe = Probe::apart(store.clone());
    let done = op.run(&probe, &key, None, body(false)).await.unwrap();
    assert_eq!(done, Outcome::Executed((0..STEPS).sum()), "{name}");
    let per_step = (probe.trips() - 2) as f64 / STEPS as f64;
    assert!(
        per_step <= 0.1,
        "{name}: {per_step} round trips a step resumed ({} in all)",
        probe.trips()
    );
}
