//! A claim's lease as this process knows it: renewed by the holder's heartbeat, and
//! confirmed with the store by a step before it is recorded.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::backoff;
use crate::flights::FlightRef;
use crate::{Error, Fingerprint, Key, Store, Token};

/// How many times a holder renews its claim per lease while the body runs.
const RENEWALS_PER_LEASE: u32 = 4;

/// The claim as the holder, its heartbeat and the body's steps share it.
pub(super) struct Lease {
    /// The store, shared: every method of the guard is compiled once, whatever the store.
    pub(super) store: Arc<dyn Store>,
    pub(super) key: Key,
    /// The fingerprint the key was claimed with: a claim made again after a refused
    /// completion carries it.
    pub(super) fingerprint: Option<Fingerprint>,
    pub(super) token: Token,
    pub(super) lease: Duration,
    /// When the lease runs out, as far as this process knows: pushed forward by each
    /// renewal. Retries of the owed step stop there; the store refuses them after it anyway.
    pub(super) expires: Mutex<Instant>,
    /// The flight, told of each renewal, so that its waiters wait as long as the lease.
    pub(super) flight: Option<FlightRef>,
    /// Whether the store answered a renewal with "not held": the key was taken over.
    pub(super) lost: AtomicBool,
}

impl Lease {
    pub(super) async fn heartbeat(self: Arc<Self>) {
        // A quarter: a renewal may then be three periods late, or fail for that long, before
        // the lease lapses under a live holder.
        let period = self.lease / RENEWALS_PER_LEASE;
        let mut failures = 0;
        loop {
            // After a failure, try again soon: four missed periods lose the lease.
            let pause = if failures == 0 {
                period
            } else {
                backoff(failures).min(period)
            };
            tokio::time::sleep(pause).await;
            let sent = Instant::now();
            match self.store.renew(&self.key, self.token, self.lease).await {
                Ok(true) => {
                    failures = 0;
                    self.extend(sent + self.lease);
                }
                Ok(false) => {
                    self.lost.store(true, Ordering::Relaxed);
                    tracing::warn!(
                        outcome = "lease lost",
                        token = self.token.get(),
                        "the claim was taken over while the body ran; its result will not be recorded"
                    );
                    return std::future::pending().await;
                }
                Err(err) => {
                    failures += 1;
                    tracing::warn!(error = %err, "renewing the lease failed; retrying");
                }
            }
        }
    }

    pub(super) fn expires(&self) -> Instant {
        *self.expires.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether this process cannot vouch for the claim without asking the store: a renewal
    /// found it taken over, or two renewals in a row were missed, so that the lease is
    /// within a quarter of running out (a margin for this process's clock reading of the
    /// lease's start, taken after the store's).
    pub(super) fn in_doubt(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
            || Instant::now() + self.lease / RENEWALS_PER_LEASE >= self.expires()
    }

    /// Asks the store whether the claim is still held, renewing it if so: the check a step
    /// passes before it runs (when [`in_doubt`](Self::in_doubt)) and before it is recorded.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the claim is no longer held, or the store cannot say.
    pub(super) async fn confirm(&self) -> Result<(), Error> {
        if self.lost.load(Ordering::Relaxed) {
            return Err(taken_over());
        }
        let sent = Instant::now();
        match self.store.renew(&self.key, self.token, self.lease).await {
            Ok(true) => {
                self.extend(sent + self.lease);
                Ok(())
            }
            Ok(false) => {
                self.lost.store(true, Ordering::Relaxed);
                tracing::warn!(
                    outcome = "lease lost",
                    token = self.token.get(),
                    "a step found the call's claim taken over: the step is not recorded"
                );
                Err(taken_over())
            }
            Err(err) => Err(err),
        }
    }

    pub(super) fn extend(&self, until: Instant) {
        *self.expires.lock().unwrap_or_else(PoisonError::into_inner) = until;
        if let Some(flight) = &self.flight {
            flight.extend(until);
        }
    }
}

/// What a step of a call whose claim was taken over gets instead of a record.
fn taken_over() -> Error {
    Error::store(
        "this call's claim is no longer held (its lease ran out and another call took the key over): the step is not run or recorded",
    )
}
