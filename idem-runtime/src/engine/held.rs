//! A claim held by this call: renewed while the body runs, then completed or released, with
//! retries while the lease lasts; and, if the call is dropped first, finished in the
//! background by the same code.
//!
//! What the guard still owes the store is explicit ([`Owed`]): a release while the body
//! runs, the completion once the body returned a recordable result. Dropping the guard hands
//! whatever is owed to a background task, so that a caller that goes away right after its
//! body returned still gets the result recorded: the body's outcome is a fact. The
//! in-process flight lands when the owed step is done, or at once when it cannot be done
//! (no runtime, or a runtime shutting down): a waiter is never left waiting on a holder
//! that is gone.

use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use tracing::Instrument;

use super::attempt::{Attempt, Journal};
use super::backoff::backoff;
use super::lease::Lease;
use super::settings::Settings;
use crate::background;
use crate::flights::{FlightRef, Landing};
use crate::meter::{self, Event};
use crate::namespace::Namespace;
use crate::store::Claimant;
use crate::store::Typed;
use crate::{Claim, ClaimRequest, Error, Fingerprint, Key, Store, Token};

pub(super) struct Held {
    /// What the heartbeat shares with the guard.
    claim: Arc<Lease>,
    /// This call's entry in the store's in-process registry, for its waiters.
    flight: Option<FlightRef>,
    attempt: Attempt,
    owed: Owed,
    /// Whether this guard already runs in the background: dropping it then only lands.
    detached: bool,
    /// How many attempts at the owed step failed so far.
    failures: AtomicU32,
    /// When the body started, for the log of its outcome.
    started: Instant,
    /// The call's span: the body runs in it, and its end is logged in it.
    span: tracing::Span,
    /// The operation's namespace, for the metrics and for a claim made again to record.
    namespace: Namespace,
    /// The call's label, if it has one, for a claim made again to record.
    label: Option<Arc<str>>,
    /// Whether the call's outcome was counted: by [`end`](Self::end), or, for a call
    /// dropped mid-body, by the drop.
    counted: bool,
    /// What the caller is answered, once the owed completion was refused: set by
    /// [`after_refusal`](Self::after_refusal); and while the completion fails, the
    /// [`Error::Unrecorded`] with its last failure, cleared when a retry lands.
    verdict: Mutex<Option<Verdict>>,
}

/// The verdict of a body that ran and whose result `why` kept from being recorded.
fn unrecorded(why: Error) -> Verdict {
    Verdict::Failed(Error::Unrecorded(Box::new(why)))
}

/// What a call whose body returned is answered.
pub(super) enum Verdict {
    /// Its own result, recorded.
    Own,
    /// No answer the key can stand behind: the result cannot be recorded, or it could not
    /// be settled after the store refused it.
    Failed(Error),
}

/// What a body ended with, as the record sees it: a value's record (its encoding, or
/// [`GONE`](crate::codec::GONE) for a value that has none; and the value itself, for a
/// store that keeps it), or an error's encoding, if the error policy records it.
pub(super) enum Ending {
    Value(Bytes, Option<Typed>),
    Error(Option<Result<Bytes, Error>>),
}

/// The heartbeat of a running body, from the first poll that found the body waiting: a
/// body that returns at once never starts one.
pub(super) type Beat = Option<Heartbeat>;

/// A running body's heartbeat, polled beside the body (so that it renews only while the
/// call's task runs), and its watchdog, a task of its own on the body's runtime that
/// renews while the body blocks its thread inside a poll (see [`Lease::watchdog`]). Both
/// end when the call stops running the body.
pub(super) struct Heartbeat {
    beat: Pin<Box<dyn Future<Output = ()> + Send>>,
    watchdog: Option<tokio::task::AbortHandle>,
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        if let Some(watchdog) = &self.watchdog {
            watchdog.abort();
        }
    }
}

/// What the holder still has to tell the store.
enum Owed {
    /// The body runs, failed, panicked or was cancelled: free the key.
    Release,
    /// The body's outcome is final: record it (with its typed value, if the store keeps it).
    Complete {
        record: Bytes,
        typed: Option<Typed>,
        ttl: Duration,
    },
    /// The store was told (or gave up on), and the flight landed.
    Nothing,
}

impl Owed {
    fn what(&self) -> &'static str {
        match self {
            Self::Complete { .. } => "recording the result",
            _ => "releasing the claim",
        }
    }

    /// How the flight lands once this step is done.
    fn landing(&self) -> Landing {
        match self {
            Self::Complete { record, .. } => Landing::Completed(record.clone()),
            _ => Landing::Released,
        }
    }
}

impl Held {
    pub(super) fn new(
        store: Arc<dyn Store>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        granted: Granted,
        settings: &Settings,
        span: tracing::Span,
    ) -> Self {
        let Granted {
            token,
            sent,
            taken_over,
        } = granted;
        let lease = settings.lease;
        // Counted from when the claim was sent, before the store started the lease: this
        // process never believes its lease lasts longer than the store's, however late the
        // claim's answer came (a step starts on that belief, by this clock).
        let expires = sent + lease;
        let now = Instant::now();
        let flight = store
            .flights()
            .map(|flights| flights.start(key, fingerprint, expires));
        let claim = Arc::new(Lease {
            store: Arc::clone(&store),
            key,
            fingerprint,
            token,
            lease,
            expires: Mutex::new(expires),
            flight: flight.clone(),
            lost: AtomicBool::new(false),
            polling: AtomicU64::new(0),
            born: now,
            retries_end: Mutex::new(None),
            record_wait: settings.record_wait,
            nonce: OnceLock::new(),
        });
        let journal = Journal::new(key, settings, fingerprint, Some(Arc::clone(&claim)));
        let attempt = Attempt::enter(&claim.store, key, token, journal, taken_over);
        if taken_over {
            tracing::warn!(
                parent: &span,
                outcome = "taken over",
                "the key was taken over from a claim that was never settled (its holder died or stalled past its lease, or an operator released it): that body's effect may have happened; `reconcile` asks its destination before the body runs"
            );
        }
        Self {
            claim,
            flight,
            attempt,
            owed: Owed::Release,
            detached: false,
            failures: AtomicU32::new(0),
            started: now,
            span,
            namespace: settings.namespace.clone(),
            label: super::label::current(),
            counted: false,
            verdict: Mutex::new(None),
        }
    }

    /// One poll of the running body (`body` polls it), as the current [`Attempt`] and in
    /// the call's span; while it waits, the heartbeat renews the lease, and while it blocks
    /// its thread inside a poll, the watchdog does.
    pub(super) fn poll_body(
        &self,
        cx: &mut Context<'_>,
        heartbeat: &mut Beat,
        body: &mut dyn FnMut(&mut Context<'_>) -> Poll<()>,
    ) -> Poll<()> {
        let _entered = self.span.enter();
        // Marked only once the heartbeat runs: a body that returns at once costs nothing.
        let watched = heartbeat.is_some();
        if watched {
            self.claim.polling(true);
        }
        let polled = self.attempt.clone().sync_scope(|| body(cx));
        if watched {
            self.claim.polling(false);
        }
        if polled.is_ready() {
            return Poll::Ready(());
        }
        let heartbeat = heartbeat.get_or_insert_with(|| Heartbeat {
            beat: Box::pin(Arc::clone(&self.claim).heartbeat()),
            watchdog: tokio::runtime::Handle::try_current().ok().map(|runtime| {
                let watchdog = Arc::clone(&self.claim).watchdog();
                runtime
                    .spawn(watchdog.instrument(self.span.clone()))
                    .abort_handle()
            }),
        });
        // The heartbeat never finishes; it only needs to be polled beside the body.
        let _ = heartbeat.beat.as_mut().poll(cx);
        Poll::Pending
    }

    /// Polls `work` to completion while renewing the lease every quarter of it.
    async fn renewing<F: Future>(&self, work: F) -> F::Output {
        let mut work = pin!(work);
        let mut heartbeat = pin!(Arc::clone(&self.claim).heartbeat());
        poll_fn(|cx| {
            if let Poll::Ready(output) = work.as_mut().poll(cx) {
                return Poll::Ready(output);
            }
            let _ = heartbeat.as_mut().poll(cx);
            Poll::Pending
        })
        .await
    }

    fn failures(&self) -> u32 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Records or releases, as the body's `ending` asks: the end of every execution. The
    /// verdict is what the store settled.
    pub(super) async fn end(mut self, ending: Ending, ttl: Duration) -> Verdict {
        let span = self.span.clone();
        let event = match ending {
            Ending::Value(..) | Ending::Error(Some(Ok(_))) => Event::Executed,
            _ => Event::Released,
        };
        meter::count(&self.namespace, event);
        self.counted = true;
        let elapsed_ms = self.started.elapsed().as_millis() as u64;
        async move {
            match ending {
                Ending::Value(record, typed) => {
                    let verdict = self.record(record, typed, ttl).await;
                    tracing::debug!(outcome = "executed", elapsed_ms);
                    return verdict;
                }
                Ending::Error(Some(Ok(record))) => {
                    let verdict = self.record(record, None, ttl).await;
                    tracing::debug!(outcome = "executed", elapsed_ms, "recorded a final error");
                    return verdict;
                }
                Ending::Error(Some(Err(codec))) => {
                    tracing::error!(outcome = "released", error = %codec, "the final error cannot be recorded");
                    self.release().await;
                }
                Ending::Error(None) => {
                    self.release().await;
                    tracing::debug!(outcome = "released", elapsed_ms, "the body failed");
                }
            }
            Verdict::Own
        }
        .instrument(span)
        .await
    }

    /// Whether the body's value is the effect [`reconcile`](crate::reconcile()) found of
    /// the claim this one took over.
    pub(super) fn reconciled(&self) -> bool {
        self.attempt.reconciled()
    }

    /// Whether the store keeps a result's typed value beside its encoding.
    pub(super) fn keeps_typed(&self) -> bool {
        self.claim.store.typed().is_some()
    }

    /// Records `record` under this claim, replayed for `ttl`, and hands it to the waiters.
    async fn record(mut self, record: Bytes, typed: Option<Typed>, ttl: Duration) -> Verdict {
        self.owed = Owed::Complete { record, typed, ttl };
        self.finish().await;
        let verdict = self
            .verdict
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        verdict.unwrap_or(Verdict::Own)
    }

    /// Releases the claim so that the next call runs the body; or, while the outcome of
    /// the claim it took over is in doubt, leaves it to lapse (see [`abandon`](Self::abandon)).
    async fn release(mut self) {
        if self.attempt.in_doubt() {
            return self.abandon();
        }
        self.owed = Owed::Release;
        self.finish().await;
    }

    /// Tells the store nothing: the claim lapses at the end of its lease, and the claim
    /// that takes it over then is told so. For a call that took the key over from a claim
    /// whose outcome is unknown, and ended without a value while it is still unknown (its
    /// `reconcile` failed, or was cancelled) or after `reconcile` found the effect: a
    /// release would make the next attempt run the body without asking again.
    fn abandon(&mut self) {
        tracing::warn!(
            outcome = "released",
            "the call ended without a value while the outcome of the claim it took over is in doubt: the claim is left to lapse, so that the next attempt reconciles again"
        );
        self.settled(Landing::Released);
    }

    /// Tells the store what is owed, then lands the flight. A completion is retried here,
    /// renewing the lease, until it lands or the lease runs out, on whatever server the
    /// store reaches meanwhile (a failover): the caller is answered when the result is
    /// recorded, or told it is not ([`Error::Unrecorded`]), never answered `Executed` with
    /// a value a retry would not replay; the guard, still owing, then keeps trying in the
    /// background ([`late`](Self::late)). A release is tried once by the caller's own call:
    /// if the store fails, the guard is left owing, and its `Drop` retries in the
    /// background while the lease lasts (the body's failure needs no record).
    async fn finish(&mut self) {
        if !self.detached {
            if let Some(landing) = self.attempt().await {
                return self.settled(landing);
            }
            // Only a failed first completion pays for the retries' heartbeat and clock.
            if !matches!(self.owed, Owed::Complete { .. }) {
                return;
            }
        }
        let end = self.claim.retries_end();
        // A caller that waits less than the lease is answered sooner; the guard's
        // background half goes on with the retries until their end.
        let wait = match self.claim.record_wait {
            Some(wait) if !self.detached => end.min(Instant::now() + wait),
            _ => end,
        };
        if let Some(landing) = self.renewing(self.discharge(wait, Duration::ZERO)).await {
            return self.settled(landing);
        }
        if wait < end {
            // The caller is told (the failed attempts set its `Unrecorded`), and the drop
            // hands the retries within the lease to the background.
            return;
        }
        // The retries within the lease are over, for this guard and the background that
        // takes it over: a caller told the result is unrecorded, then the late tries.
        self.claim.end_retries();
        if self.detached {
            let landing = self.late().await;
            self.settled(landing);
        }
        // Otherwise the caller is told (the failed attempts set its `Unrecorded`), and the
        // drop hands the completion to the background.
    }

    /// The store was told: nothing is owed, and the flight lands.
    fn settled(&mut self, landing: Landing) {
        self.owed = Owed::Nothing;
        self.land(landing);
    }

    /// Retries the owed step until it is done, or `None` when the next try would pass
    /// `deadline` (at once if it has passed), pausing between tries by the backoff, and at
    /// least `least`.
    async fn discharge(&self, deadline: Instant, least: Duration) -> Option<Landing> {
        loop {
            if Instant::now() >= deadline {
                return None;
            }
            if let Some(landing) = self.attempt().await {
                return Some(landing);
            }
            let pause = backoff(self.failures()).max(least);
            if Instant::now() + pause >= deadline {
                return None;
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// What a guard still owes once the lease ran out. A release is given up: the key frees
    /// when the claim lapses. A completion goes on being tried, for as long as the record
    /// would be replayed (its TTL): the body ran, so once the store is back (a disk that
    /// filled drained, a server that came back after the lease) the key answers its value,
    /// not a second run. The holder's renewals would fail with its completions, so none
    /// are sent; the claim lapses in the store, and the completion, refused then, claims
    /// the key again to record it if it is free ([`after_refusal`](Self::after_refusal)).
    /// Meanwhile this process's own callers of the key wait on its flight, which lasts as
    /// long as the tries (one a quarter lease); a process that exits stops trying.
    async fn late(&self) -> Landing {
        let Owed::Complete { ttl, .. } = &self.owed else {
            tracing::warn!(
                attempts = self.failures(),
                "{} failed until the lease ran out; the key is freed when it lapses",
                self.owed.what()
            );
            return Landing::Released;
        };
        tracing::warn!(
            attempts = self.failures(),
            "recording the result failed until the lease ran out; trying on in the background"
        );
        let until = Instant::now() + *ttl;
        if let Some(flight) = &self.flight {
            flight.extend(until);
        }
        // One try a quarter lease (the retries' backoff, up to 250 ms, for a lease under a
        // second): a store that is back is found within it, and one that refuses for good
        // (a record it will never take) is not asked four times a second for a day.
        let least = self.claim.lease / 4;
        self.discharge(until, least).await.unwrap_or_else(|| {
            tracing::error!(
                attempts = self.failures(),
                "recording the result failed for as long as it would have been replayed; the key is free"
            );
            Landing::Released
        })
    }

    /// One attempt at the owed step: how the flight lands, or `None` if the store failed.
    async fn attempt(&self) -> Option<Landing> {
        let result = match &self.owed {
            Owed::Complete { record, typed, ttl } => {
                let claim = &self.claim;
                let (record, typed) = (record.clone(), typed.clone());
                crate::store::complete_keeping(
                    &*claim.store,
                    &claim.key,
                    claim.token,
                    record,
                    *ttl,
                    typed,
                )
                .await
            }
            Owed::Release => {
                self.claim
                    .store
                    .release(&self.claim.key, self.claim.token)
                    .await
            }
            Owed::Nothing => return Some(Landing::Released),
        };
        let what = self.owed.what();
        match (result, &self.owed) {
            (Ok(true), _) => {
                if self.failures() > 0 {
                    // Landed on a retry: the caller is answered its own result.
                    self.verdict
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .take();
                }
                Some(self.owed.landing())
            }
            (Ok(false), Owed::Complete { record, ttl, .. }) => {
                self.after_refusal(record, *ttl).await
            }
            (Ok(false), _) if self.failures() > 0 => {
                // An earlier attempt may have landed before its answer was lost; or the key
                // was taken over. Either way the store knows: the waiters ask it.
                tracing::debug!(
                    token = self.claim.token.get(),
                    "{what}: the claim is no longer held after a failed attempt"
                );
                Some(Landing::Released)
            }
            (Ok(false), _) => {
                tracing::warn!(
                    outcome = "lease lost",
                    token = self.claim.token.get(),
                    "{what}: the claim was no longer held (its lease lapsed, or another call took the key over); nothing was changed"
                );
                // The store has the key's state now: the waiters ask the store, which has the
                // one result every later call will see.
                Some(Landing::Released)
            }
            (Err(err), _) => self.failed_try(err),
        }
    }

    /// Settles a result whose completion the store refused: the claim is no longer held
    /// under this token (the lease ran out, and the key may have been taken over), or an
    /// earlier attempt landed before its answer was lost. One claim (tagged with this
    /// holder's nonce, so that a claim of its own whose reply was lost is its own again)
    /// asks the store which:
    ///
    /// - the key is free: it is claimed again and the result recorded under the new token;
    /// - this result is there (an earlier attempt landed before its answer was lost): the
    ///   caller gets it;
    /// - another record is there (another holder's, logged: this body's run was
    ///   superseded; one of another payload; one that can no longer be replayed): this
    ///   result is unrecorded for good, and the key's waiters get its record;
    /// - another holder runs: this result is not recorded yet, and is tried again (that
    ///   holder may release the key).
    ///
    /// `None` is a failed try, as a store that failed is: the owed completion is tried again
    /// while the retries last, and the caller is told [`Error::Unrecorded`] if none lands.
    /// The body ran, so no answer from here is an error that says it did not.
    async fn after_refusal(&self, record: &Bytes, ttl: Duration) -> Option<Landing> {
        let claim = &self.claim;
        // An operator's release, as this process's registry was told or (for an operator
        // in another process) as the store keeps it.
        let released = self.released_by_operator()
            || match claim
                .store
                .released_by_operator(&claim.key, claim.token)
                .await
            {
                Ok(released) => released,
                Err(err) => return self.failed_try(err),
            };
        if released {
            // Not a lapse but a release by an operator: the key is not this holder's to
            // take again, whoever runs it now must not find this result, and this caller
            // must not be told `Executed`.
            tracing::warn!(
                outcome = "lease lost",
                token = claim.token.get(),
                "the claim was released by an operator while the body ran; this result is not recorded"
            );
            let why = "the claim was released by an operator (by force, or as its holder was silent) while the body ran; its result is not recorded, and a retry runs the body again: reconcile its effect first";
            *self.verdict.lock().unwrap_or_else(PoisonError::into_inner) =
                Some(Verdict::Failed(Error::Unrecorded(why.into())));
            return Some(Landing::Released);
        }
        let nonce = *claim.nonce.get_or_init(crate::store::nonce);
        // Whose the claim is, as the first claim said: the record lists under its namespace
        // and label, whichever claim completed it.
        let claimant = Claimant::of(&self.namespace);
        let claimant = match &self.label {
            Some(label) => claimant.labelled(label),
            None => claimant,
        };
        let request = ClaimRequest::new(&claim.key, claim.lease)
            .fingerprint(claim.fingerprint.as_ref())
            .ttl(ttl)
            .nonce(nonce)
            .claimant(claimant);
        let claimed = claim.store.claim(&request).await;
        let (landing, verdict) = match claimed {
            // Taken over or not, the key was free: this body ran, its result is recorded.
            Ok(Claim::Acquired { token, .. }) => {
                match claim
                    .store
                    .complete(&claim.key, token, record.clone(), ttl)
                    .await
                {
                    Ok(true) => {
                        tracing::warn!(
                            outcome = "lease lost",
                            token = claim.token.get(),
                            "the lease ran out before the result was recorded; the key was free, so it was claimed again and recorded"
                        );
                        (Landing::Completed(record.clone()), Verdict::Own)
                    }
                    refused => {
                        // The claim is left to lapse, never released: this body ran and
                        // its effect may have landed, so the claim that takes the key after
                        // it must be told so (a release would let it run the body blind).
                        // The next try's claim, with the same nonce, finds it as this
                        // holder's own.
                        let err = match refused {
                            Err(err) => err,
                            Ok(_) => Error::store(
                                "the claim made again to record the result was lost at once",
                            ),
                        };
                        return self.failed_try(err);
                    }
                }
            }
            Ok(Claim::Completed { value, fingerprint }) => {
                if fingerprint != claim.fingerprint {
                    tracing::warn!(
                        outcome = "lease lost",
                        token = claim.token.get(),
                        "the lease ran out while the body ran and the key was recorded for another payload; this result is not recorded"
                    );
                    (Landing::Released, unrecorded(Error::PayloadMismatch))
                } else if value[..] == *crate::codec::GONE {
                    (Landing::Released, unrecorded(Error::Gone))
                } else if value == *record {
                    (Landing::Completed(value), Verdict::Own)
                } else {
                    tracing::warn!(
                        outcome = "lease lost",
                        token = claim.token.get(),
                        "the lease ran out while the body ran and another holder recorded its result first; this result is not recorded"
                    );
                    // The key's waiters get its one record; this caller is told that its
                    // body ran and its result is not that record.
                    let why = "the lease ran out while the body ran, and another holder recorded its result first (a retry replays that record)";
                    let verdict = Verdict::Failed(Error::Unrecorded(why.into()));
                    (Landing::Completed(value), verdict)
                }
            }
            Ok(Claim::InProgress { .. }) => {
                tracing::warn!(
                    outcome = "lease lost",
                    token = claim.token.get(),
                    "the lease ran out while the body ran and another holder runs the key now; its result is not recorded yet"
                );
                return self.failed_try(Error::InProgress);
            }
            Err(err) => return self.failed_try(err),
        };
        *self.verdict.lock().unwrap_or_else(PoisonError::into_inner) = Some(verdict);
        Some(landing)
    }

    /// Whether an operator released this call's claim (`idem_runtime::admin`), as the
    /// store's registry in this process was told: the refusal is then no lapse, and the
    /// key is not this holder's to take again.
    fn released_by_operator(&self) -> bool {
        self.flight.as_ref().is_some_and(|flight| flight.fenced())
    }

    /// Counts a try at the owed step that did not land (`err`: why), and, for a
    /// completion, sets what the caller is told if no retry lands: the body ran, its result
    /// is [`Error::Unrecorded`].
    fn failed_try(&self, err: Error) -> Option<Landing> {
        let attempts = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        // Once at `warn` per call: an outage retried many times is one line, not one a try.
        if attempts == 1 {
            tracing::warn!(error = %err, attempts, "{} failed; retrying (later failures at debug)", self.owed.what());
        } else {
            tracing::debug!(error = %err, attempts, "{} failed; retrying", self.owed.what());
        }
        if matches!(self.owed, Owed::Complete { .. }) {
            *self.verdict.lock().unwrap_or_else(PoisonError::into_inner) = Some(unrecorded(err));
        }
        None
    }

    fn land(&mut self, landing: Landing) {
        if let (Some(flights), Some(flight)) = (self.claim.store.flights(), self.flight.take()) {
            flights.land(&self.claim.key, &flight, landing);
        }
    }
}

impl Drop for Held {
    /// The call was dropped (cancelled, or a panic unwinds through it) before it told the
    /// store: finish in the background, or, where no task can run, land at once.
    fn drop(&mut self) {
        let owed = std::mem::replace(&mut self.owed, Owed::Nothing);
        if matches!(owed, Owed::Nothing) {
            return;
        }
        if matches!(owed, Owed::Release) && self.attempt.in_doubt() {
            if !self.counted {
                meter::count(&self.namespace, Event::Released);
            }
            return self.abandon();
        }
        if !self.counted {
            // Dropped mid-body: the claim is released.
            meter::count(&self.namespace, Event::Released);
        }
        let runtime = match tokio::runtime::Handle::try_current() {
            Ok(runtime) if !self.detached => runtime,
            _ => {
                tracing::warn!(
                    outcome = "released",
                    "the call was dropped where no task can finish it: the key is freed when its lease runs out"
                );
                self.land(Landing::Released);
                return;
            }
        };
        tracing::debug!(
            outcome = if matches!(owed, Owed::Release) {
                "released"
            } else {
                "executed"
            },
            "the call was dropped; finishing in the background"
        );
        let mut rest = Held {
            claim: Arc::clone(&self.claim),
            flight: self.flight.take(),
            attempt: self.attempt.clone(),
            owed,
            detached: true,
            failures: AtomicU32::new(self.failures()),
            started: self.started,
            span: self.span.clone(),
            namespace: self.namespace.clone(),
            label: self.label.clone(),
            counted: true,
            verdict: Mutex::new(None),
        };
        // If the runtime is shutting down, the task is dropped unrun, and `rest`'s own drop
        // lands the flight.
        background::spawn(&runtime, async move { rest.finish().await });
    }
}

/// A claim the store granted.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Granted {
    /// The claim's token.
    pub(crate) token: Token,
    /// When the claim that took it was sent: the store's lease began after it.
    pub(crate) sent: Instant,
    /// Whether it took the key over from a claim that was never settled: that claim's
    /// outcome is unknown ([`Claim::Acquired`]).
    pub(crate) taken_over: bool,
}
