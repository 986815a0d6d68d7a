//! A claim's lease as this process knows it: renewed by the holder's heartbeat, vouched
//! for before a step starts, and presented (its token) with every step's record.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::backoff::backoff;
use crate::flights::FlightRef;
use crate::{Error, Fingerprint, Key, Store, Token};

/// How many times a holder renews its claim per lease while the body runs.
const RENEWALS_PER_LEASE: u32 = 4;

/// How many leases a body may spend inside one poll (blocking its thread) while the
/// watchdog keeps its claim: past that, the claim is left to lapse, so that a body stuck in
/// blocking code for good does not hold its key for good.
const BLOCKED_LEASES: u32 = 4;

/// How many renewals a step asks for at most before it starts, when the answers come too
/// late to leave a quarter of the lease.
const VOUCHES: u32 = 3;

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
    /// When the body's current poll began, in milliseconds since `born` plus one; `0` while
    /// the body is not inside a poll. The watchdog reads it.
    pub(super) polling: AtomicU64,
    /// The clock `polling` counts from.
    pub(super) born: Instant,
    /// Where the retries of the holder's owed step within the lease end (see
    /// [`retries_end`](Self::retries_end)).
    pub(super) retries_end: Mutex<Option<Instant>>,
    /// How long the holder's caller waits for a completion that failed
    /// ([`Settings::record_wait`](super::settings::Settings)).
    pub(super) record_wait: Option<Duration>,
    /// The nonce of the claims made again to record a refused completion, drawn by the
    /// first of them: a retry's claim finds a claim of its own whose reply was lost.
    pub(super) nonce: OnceLock<u64>,
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
                    self.lose("a renewal found the claim no longer held while the body ran; its result will not be recorded")
                        .await;
                    return std::future::pending().await;
                }
                Err(err) => {
                    failures += 1;
                    // Once at `warn` per outage: the renewals retried meanwhile at debug.
                    if failures == 1 {
                        tracing::warn!(error = %err, "renewing the lease failed; retrying (later failures at debug)");
                    } else {
                        tracing::debug!(error = %err, failures, "renewing the lease failed; retrying");
                    }
                }
            }
        }
    }

    /// Marks the body as inside a poll (`true`) or out of it (`false`).
    pub(super) fn polling(&self, inside: bool) {
        let mark = if inside {
            u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1
        } else {
            0
        };
        self.polling.store(mark, Ordering::Relaxed);
    }

    /// How long the body has been inside its current poll, if it is in one.
    fn blocked_for(&self) -> Option<Duration> {
        let mark = self.polling.load(Ordering::Relaxed);
        let since = Duration::from_millis(mark.checked_sub(1)?);
        Some(self.born.elapsed().saturating_sub(since))
    }

    /// Renews the claim while the body blocks its thread inside a poll, where the heartbeat
    /// polled beside it cannot run: a task of its own, on another worker of the runtime.
    /// It renews only a poll that has lasted a renewal period or more, and for at most
    /// [`BLOCKED_LEASES`] leases of one poll; a body that is waiting (between polls) is
    /// left to the heartbeat, which shows that the call's task still runs: a call whose
    /// future was leaked or frozen renews nothing, and its key lapses with its lease.
    pub(super) async fn watchdog(self: Arc<Self>) {
        let period = self.lease / RENEWALS_PER_LEASE;
        loop {
            tokio::time::sleep(period).await;
            let blocked = match self.blocked_for() {
                Some(blocked) if blocked >= period => blocked,
                _ => continue,
            };
            if self.lost.load(Ordering::Relaxed) {
                return;
            }
            if blocked > self.lease * BLOCKED_LEASES {
                tracing::warn!(
                    blocked_ms = blocked.as_millis() as u64,
                    "the body has blocked its thread for more than {BLOCKED_LEASES} leases: its claim is no longer renewed and lapses"
                );
                return;
            }
            let sent = Instant::now();
            match self.store.renew(&self.key, self.token, self.lease).await {
                Ok(true) => self.extend(sent + self.lease),
                Ok(false) => {
                    self.lose("a renewal found the claim no longer held while the body blocked its thread")
                        .await;
                    return;
                }
                Err(err) => {
                    tracing::warn!(error = %err, "renewing the lease of a blocked body failed")
                }
            }
        }
    }

    /// Where the retries of the holder's owed step end: the lease as it stood at the first
    /// retry. Renewals meanwhile keep the claim, but must not keep a failing store retried
    /// for ever; and a guard that goes to the background after its caller was told the
    /// result is unrecorded does not retry for another lease before it goes on late.
    pub(super) fn retries_end(&self) -> Instant {
        *self
            .retries_end
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(|| self.expires())
    }

    /// Ends the retries within the lease now: they gave up, and whatever takes the owed
    /// step over (the guard's background half) goes on to its late tries without more.
    pub(super) fn end_retries(&self) {
        *self
            .retries_end
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
    }

    pub(super) fn expires(&self) -> Instant {
        *self.expires.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether this process cannot vouch for the claim without asking the store: a renewal
    /// found it taken over, or two renewals in a row were missed, so that the lease is
    /// within a quarter of running out (a margin for renewals late or lost; the lease is
    /// counted from before the store started it).
    pub(super) fn in_doubt(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
            || Instant::now() + self.lease / RENEWALS_PER_LEASE >= self.expires()
    }

    /// Asks the store whether the claim is still held, renewing it if so: the check a step
    /// passes before it starts when this process cannot vouch for the lease by its own clock
    /// ([`in_doubt`](Self::in_doubt)).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the claim is no longer held, or the store cannot say.
    pub(super) async fn confirm(&self) -> Result<(), Error> {
        if self.lost.load(Ordering::Relaxed) {
            return Err(self.not_held().await);
        }
        let sent = Instant::now();
        if self.store.renew(&self.key, self.token, self.lease).await? {
            self.extend(sent + self.lease);
            Ok(())
        } else {
            Err(self
                .lose("a step found the call's claim no longer held: the step does not start")
                .await)
        }
    }

    /// Makes sure a step may start: this process's own reading of the lease leaves at least
    /// a quarter of it, after every round trip that came before. Otherwise the store is
    /// asked (a renewal) until it does; a store that answers so slowly that even a fresh
    /// renewal leaves less than that is an error, never a start on a lease that may be gone.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the claim is no longer held or cannot be vouched for.
    pub(super) async fn vouch(&self) -> Result<(), Error> {
        for _ in 0..VOUCHES {
            if !self.in_doubt() {
                return Ok(());
            }
            self.confirm().await?;
        }
        if self.in_doubt() {
            return Err(Error::store(
                "the store answered too slowly to vouch for this call's lease: the step does not start",
            ));
        }
        Ok(())
    }

    /// Records `value` as step `step` of this claim, in one write the store makes only while
    /// this claim holds the key with a live lease. A store that fails is asked again, with
    /// backoff, while the lease lasts by this process's clock (the heartbeat renews it
    /// meanwhile); recording twice under one claim writes the same record.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store refused (the claim is no longer held: the step ran,
    /// its record is not written) or kept failing until the lease ran out.
    pub(super) async fn record_step(
        &self,
        step: &Key,
        value: Bytes,
        ttl: Duration,
    ) -> Result<(), Error> {
        let mut failures = 0;
        loop {
            match self
                .store
                .record_step(&self.key, self.token, step, value.clone(), ttl)
                .await
            {
                Ok(true) => return Ok(()),
                Ok(false) => {
                    return Err(self
                        .lose("a step ran, but the call's claim was no longer held when it was to be recorded: its record is not written")
                        .await)
                }
                Err(err) => {
                    failures += 1;
                    let pause = backoff(failures);
                    if self.lost.load(Ordering::Relaxed) || Instant::now() + pause >= self.expires()
                    {
                        return Err(err);
                    }
                    if failures == 1 {
                        tracing::warn!(error = %err, attempts = failures, "recording a step failed; retrying (later failures at debug)");
                    } else {
                        tracing::debug!(error = %err, attempts = failures, "recording a step failed; retrying");
                    }
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }

    /// Marks the claim lost (a store answered "not held" under this token), logs `what`
    /// happened with the reason, and returns the error the step answers.
    pub(super) async fn lose(&self, what: &str) -> Error {
        self.lost.store(true, Ordering::Relaxed);
        let err = self.not_held().await;
        tracing::warn!(
            outcome = "lease lost",
            token = self.token.get(),
            "{what}: {err}"
        );
        err
    }

    /// Why the claim is no longer held, as far as the store can tell: another holder's
    /// live claim means the key was taken over; no claim at all, that the lease lapsed (or
    /// the record was removed) with no one else holding it.
    async fn not_held(&self) -> Error {
        match self.store.lease_left(&self.key).await {
            Ok(Some(_)) => Error::store(
                "this call's claim is no longer held: its lease ran out and another call took the key over",
            ),
            _ => Error::store(
                "this call's claim is no longer held: its lease ran out (or its record was removed) before the step",
            ),
        }
    }

    pub(super) fn extend(&self, until: Instant) {
        *self.expires.lock().unwrap_or_else(PoisonError::into_inner) = until;
        if let Some(flight) = &self.flight {
            flight.extend(until);
        }
    }
}
