//! What the failover tests share: waiting for a state, and callers that claim fresh keys
//! until the primary is killed, keeping the claims it acknowledged.

use idem_runtime::ClaimRequest;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::{Claim, Key, Store};
use tokio::time::Instant;

/// How long [`until`] waits for a state before it fails the test.
const LIMIT: Duration = Duration::from_secs(60);

/// Polls until `check` holds, at most a minute: the state a step waits for (a link up, a
/// promotion done), never a guess of how long it takes.
pub async fn until<F: std::future::Future<Output = bool>>(
    what: &str,
    mut check: impl FnMut() -> F,
) {
    let started = Instant::now();
    while !check().await {
        assert!(started.elapsed() < LIMIT, "{what}: not within {LIMIT:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Callers that claim fresh keys on one store as fast as they can, until stopped: the
/// claims the store acknowledged, and how many it refused.
pub struct Claimers {
    acknowledged: Arc<Mutex<Vec<Key>>>,
    refused: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Claimers {
    /// Starts `callers` callers on `store`; their keys are derived from `namespace`, `round`,
    /// the caller and a count, so that every claim is of a fresh key.
    pub fn start<S: Store + Clone + 'static>(
        store: &S,
        callers: u64,
        namespace: &'static str,
        round: usize,
    ) -> Self {
        let claimers = Self {
            acknowledged: Arc::default(),
            refused: Arc::default(),
            stop: Arc::default(),
            tasks: Vec::new(),
        };
        let tasks = (0..callers)
            .map(|caller| {
                let store = store.clone();
                let (acknowledged, refused, stop) = (
                    Arc::clone(&claimers.acknowledged),
                    Arc::clone(&claimers.refused),
                    Arc::clone(&claimers.stop),
                );
                tokio::spawn(async move {
                    for n in 0_u64.. {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let key = Key::derive(namespace, &(round, caller, n)).unwrap();
                        match store
                            .claim(&ClaimRequest::new(&key, Duration::from_secs(60)))
                            .await
                        {
                            Ok(Claim::Acquired { .. }) => acknowledged.lock().unwrap().push(key),
                            Ok(other) => panic!("a fresh key: {other:?}"),
                            // The kill, or a store that could not make the claim durable
                            // in time: refused, and no body would run.
                            Err(_) => {
                                refused.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                })
            })
            .collect();
        Self { tasks, ..claimers }
    }

    /// Waits until `acknowledged` claims were acknowledged, or `refused` refused.
    pub async fn until(&self, acknowledged: usize, refused: usize) {
        until("claims before the kill", || async {
            self.acknowledged.lock().unwrap().len() >= acknowledged
                || self.refused.load(Ordering::Relaxed) >= refused
        })
        .await;
    }

    /// Stops the callers: the keys whose claims were acknowledged, and how many were
    /// refused.
    pub async fn stop(self) -> (Vec<Key>, usize) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.unwrap();
        }
        let acknowledged = std::mem::take(&mut *self.acknowledged.lock().unwrap());
        (acknowledged, self.refused.load(Ordering::Relaxed))
    }
}

/// What the failovers of one mode found.
#[derive(Debug, Default)]
pub struct Count {
    pub failovers: usize,
    /// Claims the old primary acknowledged before it was killed.
    pub acknowledged: usize,
    /// Of those, the ones the promoted server did not have: a retry there would claim the
    /// key again and run the body a second time.
    pub lost: usize,
    /// Claims refused (the kill, or a commit the replicas did not confirm in time): their
    /// bodies never ran.
    pub refused: usize,
}

impl Count {
    /// Adds one failover: the claims the old primary `acknowledged` and `refused`, each
    /// acknowledged one looked for on the `promoted` server.
    pub async fn failover<S: Store>(&mut self, promoted: &S, acknowledged: &[Key], refused: usize) {
        self.failovers += 1;
        self.acknowledged += acknowledged.len();
        self.refused += refused;
        for key in acknowledged {
            let claim = promoted
                .claim(&ClaimRequest::new(key, Duration::from_secs(60)))
                .await
                .unwrap();
            if let Claim::Acquired { .. } = claim {
                self.lost += 1;
            }
        }
    }
}
