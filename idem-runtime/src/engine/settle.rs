//! Settling a key: the claim and its retries, waiting for a call that holds the key (here
//! or in another process), and what a claim ends with: a record to replay, or a token to run
//! under.

use std::sync::Arc;

use bytes::Bytes;
use tokio::time::Instant;
use tracing::Instrument;

use super::attempt;
use super::backoff::backoff;
use super::handle::{Begun, Handle};
use super::held::{Granted, Held};
use super::settings::InFlight;
use super::settings::{traced, Settings};
use crate::flights::Landing;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
use crate::store::{Call, Transactional};
use crate::store::{Claimant, Kept, Typed};
use crate::{limits, meter, Claim, ClaimRequest, Error, Fingerprint, Key, Store};

impl Settings {
    /// The record to replay, if the store has it at hand (in memory) and no call of the key
    /// is running here: the first step of [`settle`](Self::settle), taken without a future.
    pub(crate) fn replay_at_once(
        &self,
        store: &dyn Store,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
    ) -> Option<Result<Found, Error>> {
        if let Err(err) = limits::check(self.ttl, self.lease, self.wait_timeout) {
            return Some(Err(err));
        }
        if store
            .flights()
            .is_some_and(|flights| flights.get(key).is_some())
        {
            return None;
        }
        // With the value itself kept beside the record, where the store keeps it: one look.
        let found = match store.typed() {
            Some(keeps) => Found::Kept(keeps.peek_typed(key)?),
            None => match store.peek(key)? {
                Claim::Completed { value, fingerprint } => Found::Encoded(value, fingerprint),
                _ => return None,
            },
        };
        let _entered = traced().then(|| self.traced_span(key).entered());
        let recorded = found.fingerprint();
        let replay = replayable(found, recorded.as_ref(), fingerprint);
        meter::settled_at_once(&self.namespace, &replay);
        Some(replay)
    }

    /// [`settle`](Self::settle), in the call's span: the record to replay, or the claim,
    /// held.
    pub(super) async fn begin(
        &self,
        store: &dyn Handle,
        key: Key,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Begun, Error> {
        let span = self.span(&key);
        let started = meter::start();
        let settled = self
            .settle(store.get(), &key, fingerprint.as_ref())
            .instrument(span.clone())
            .await;
        meter::settled(&self.namespace, started, &settled, |settled| {
            matches!(settled, Settled::Replay(_))
        });
        Ok(match settled? {
            Settled::Replay(record) => Begun::Replay(record),
            Settled::Run(granted) => Begun::Run(Held::new(
                store.shared(),
                key,
                fingerprint,
                granted,
                self,
                span,
            )),
        })
    }

    /// Claims the key, or waits until there is a result to replay or a claim to take.
    async fn settle(
        &self,
        store: &dyn Store,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Settled, Error> {
        limits::check(self.ttl, self.lease, self.wait_timeout)?;
        // The clock is read only once a call has to wait: replays and first calls never do.
        let mut deadline = None;
        let wait_until = |deadline: &mut Option<Instant>| {
            *deadline.get_or_insert_with(|| Instant::now() + self.wait())
        };
        let mut polls = 0_u32;
        // Drawn at the first claim, and sent with every claim of this call.
        let mut nonce = None;
        // `begin` follows `replay_at_once`, which looked for a record at hand already: the
        // first claim goes to the store without a second look (a claim answers a completed
        // key with its record anyway; the look only spares a store a claim).
        let mut looked = true;
        loop {
            let flight = store.flights().and_then(|flights| flights.get(key));
            // A flight whose holder stopped renewing is not waited for: the store decides.
            if let Some(flight) = flight.filter(|f| f.expires() > Instant::now()) {
                self.found_in_progress(store, key, flight.fingerprint(), fingerprint)?;
                let deadline = wait_until(&mut deadline);
                // Waiting is the slow path: boxed, so that its timers are not part of the
                // state of every call.
                let wait = tokio::time::timeout_at(deadline.min(flight.expires()), flight.wait());
                match Box::pin(wait).await {
                    Ok(Landing::Completed(record)) => {
                        tracing::debug!(
                            outcome = "waited",
                            "replayed the result of a concurrent call"
                        );
                        return Ok(Settled::Replay(record));
                    }
                    Ok(Landing::Released) => continue,
                    Err(_) if Instant::now() >= deadline => return Err(timed_out()),
                    // The holder's lease was renewed meanwhile, or it lapsed: look again.
                    Err(_) => continue,
                }
            }
            let at_hand = if std::mem::take(&mut looked) {
                None
            } else {
                store.peek(key)
            };
            if let Some(Claim::Completed {
                value,
                fingerprint: recorded,
            }) = at_hand
            {
                return Settled::replay(value, recorded.as_ref(), fingerprint);
            }
            // The enclosing call's claim may be uncommitted in its transaction, where a claim
            // would wait for the very call that waits for it.
            attempt::refuse_recursion(store, key)?;
            let nonce = *nonce.get_or_insert_with(crate::store::nonce);
            let (claim, sent) = self.claim(store, key, fingerprint, nonce).await?;
            match claim {
                Claim::Acquired { token, taken_over } => {
                    return Ok(Settled::Run(Granted {
                        token,
                        sent,
                        taken_over,
                    }))
                }
                Claim::Completed {
                    value,
                    fingerprint: recorded,
                } => return Settled::replay(value, recorded.as_ref(), fingerprint),
                Claim::InProgress {
                    fingerprint: holder,
                } => {
                    self.found_in_progress(store, key, holder.as_ref(), fingerprint)?;
                    let until = wait_until(&mut deadline);
                    if polls == 0 {
                        Box::pin(waiting_on(store, key, until)).await;
                    }
                    pause_before_polling(until, polls).await?;
                    polls += 1;
                }
            }
        }
    }

    /// Claims `key`, and claims it again after a store failure, up to [`CLAIM_TRIES`] in
    /// all and within the store's [`claim_timeout`](Store::claim_timeout) from the first
    /// try: the failure may be a reply lost after the store applied the claim, which the
    /// same `nonce` finds as this call's own. After the last failure the call fails closed.
    async fn claim(
        &self,
        store: &dyn Store,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        nonce: u64,
    ) -> Result<(Claim, Instant), Error> {
        // When the try that answers was sent: the store's lease starts after it, so a
        // holder that counts its lease from here never believes it has more than the store
        // gave it (a step starts by that belief). A try sent again must end by the
        // first's deadline, if the store bounds its claims.
        let mut sent = Instant::now();
        let deadline = store.claim_timeout().map(|bound| sent + bound);
        let mut failures = 0;
        let label = super::label::current();
        let claimant = match &label {
            Some(label) => Claimant::of(&self.namespace).labelled(label),
            None => Claimant::of(&self.namespace),
        };
        let request = self.request(key, fingerprint, nonce, claimant);
        let mut claimed = store.claim(&request).await;
        loop {
            match claimed {
                Err(Error::Store(err)) if failures + 1 < CLAIM_TRIES => {
                    failures += 1;
                    let again = Instant::now() + backoff(failures);
                    if deadline.is_some_and(|deadline| again >= deadline) {
                        return Err(Error::Store(err));
                    }
                    tracing::debug!(error = %err, failures, "the claim failed; claiming again with its nonce");
                    // Boxed: the slow path's timers stay out of the state of every call.
                    Box::pin(tokio::time::sleep_until(again)).await;
                    sent = Instant::now();
                    let again = store.claim(&request);
                    claimed = match deadline {
                        Some(deadline) => Box::pin(tokio::time::timeout_at(deadline, again))
                            .await
                            .unwrap_or_else(|_| Err(claim_timed_out(store))),
                        None => again.await,
                    };
                }
                claimed => return claimed.map(|claim| (claim, sent)),
            }
        }
    }

    /// The claim of `key` this operation sends: its lease and TTL, the call's `nonce`, and
    /// whose it is.
    pub(crate) fn request<'a>(
        &self,
        key: &'a Key,
        fingerprint: Option<&'a Fingerprint>,
        nonce: u64,
        claimant: Claimant<'a>,
    ) -> ClaimRequest<'a> {
        ClaimRequest::new(key, self.lease)
            .fingerprint(fingerprint)
            .ttl(self.ttl)
            .nonce(nonce)
            .claimant(claimant)
    }

    /// The checks on a record found in progress: the fingerprint first, then whether the
    /// holder is this call's own enclosing call, then the policy.
    pub(crate) fn found_in_progress(
        &self,
        store: &dyn Store,
        key: &Key,
        holder: Option<&Fingerprint>,
        ours: Option<&Fingerprint>,
    ) -> Result<(), Error> {
        check_fingerprint(holder, ours)?;
        attempt::refuse_recursion(store, key)?;
        if self.in_flight == InFlight::Reject {
            tracing::debug!(outcome = "rejected");
            return Err(Error::InProgress);
        }
        Ok(())
    }
}

impl Settled {
    /// A completed record found by a claim: replayed if its fingerprint is this call's.
    pub(crate) fn replay(
        value: Bytes,
        recorded: Option<&Fingerprint>,
        ours: Option<&Fingerprint>,
    ) -> Result<Self, Error> {
        replayable(value, recorded, ours).map(Self::Replay)
    }
}

/// A completed record found for a call: the store's own shared record (with the value itself
/// beside the encoding, if it kept it), or an encoding and its fingerprint.
pub(crate) enum Found {
    Kept(Arc<Kept>),
    Encoded(Bytes, Option<Fingerprint>),
}

impl Found {
    fn fingerprint(&self) -> Option<Fingerprint> {
        match self {
            Self::Kept(kept) => kept.fingerprint,
            Self::Encoded(_, fingerprint) => *fingerprint,
        }
    }

    /// The typed value, if the store kept one.
    pub(crate) fn typed(&self) -> Option<&Typed> {
        match self {
            Self::Kept(kept) => kept.typed.as_ref(),
            Self::Encoded(..) => None,
        }
    }

    /// The encoding.
    pub(crate) fn record(&self) -> &Bytes {
        match self {
            Self::Kept(kept) => &kept.value,
            Self::Encoded(value, _) => value,
        }
    }
}

/// A completed record, if its fingerprint is this call's.
fn replayable<T>(
    value: T,
    recorded: Option<&Fingerprint>,
    ours: Option<&Fingerprint>,
) -> Result<T, Error> {
    check_fingerprint(recorded, ours)?;
    tracing::debug!(outcome = "replayed");
    Ok(value)
}

/// Says, once per call that waits on a key held in another process, whom it waits for:
/// the holder and its lease left as the store tells them (one read, only when `info` is
/// on), and how long this call waits at most, so that no wait is silent.
async fn waiting_on(store: &dyn Store, key: &Key, until: Instant) {
    let wait = until.saturating_duration_since(Instant::now());
    // A call that does not wait (`wait = "0s"`, or a deadline spent) has nothing to say.
    if wait.is_zero() || !tracing::enabled!(tracing::Level::INFO) {
        return;
    }
    let wait_ms = wait.as_millis();
    match store.holding(key).await {
        Ok(Some(holding)) => {
            let holder = holding
                .holder
                .as_ref()
                .map_or_else(|| "unknown".to_owned(), ToString::to_string);
            tracing::info!(
                key = %key.short(),
                holder = %holder,
                lease_left_ms = holding.lease_left.as_millis(),
                wait_ms,
                "waiting on a key another process holds"
            );
        }
        Ok(None) => tracing::info!(
            key = %key.short(),
            wait_ms,
            "waiting on a key another process holds; its claim just ended"
        ),
        Err(err) => tracing::info!(
            key = %key.short(),
            wait_ms,
            error = %err,
            "waiting on a key another process holds; the store could not say who"
        ),
    }
}

/// Waits before asking the store again about a key held by another process (backoff with
/// jitter), or gives up with [`Error::InProgress`] at `deadline`.
pub(crate) async fn pause_before_polling(deadline: Instant, polls: u32) -> Result<(), Error> {
    let now = Instant::now();
    if now >= deadline {
        return Err(timed_out());
    }
    // Boxed: the slow path's timer stays out of the state of every call.
    Box::pin(tokio::time::sleep_until(deadline.min(now + backoff(polls)))).await;
    Ok(())
}

/// How many times a call sends its claim when the store fails, the first included.
const CLAIM_TRIES: u32 = 3;

/// What settling a claim ended with: a record to replay, or the claim to run under.
pub(crate) enum Settled {
    Replay(Bytes),
    Run(Granted),
}

fn check_fingerprint(
    recorded: Option<&Fingerprint>,
    ours: Option<&Fingerprint>,
) -> Result<(), Error> {
    if recorded == ours {
        Ok(())
    } else {
        tracing::info!(
            outcome = "mismatch",
            "the key was used with a different payload"
        );
        Err(Error::PayloadMismatch)
    }
}

/// What a claim sent again answers when the tries' shared deadline passes first.
fn claim_timed_out(store: &dyn Store) -> Error {
    let bound = store.claim_timeout().unwrap_or_default();
    Error::store(format!(
        "the claim was sent again after a store failure and got no answer within the store's timeout ({bound:?} from the first try)"
    ))
}

fn timed_out() -> Error {
    tracing::debug!(outcome = "rejected", "gave up waiting for the running call");
    Error::InProgress
}

/// Settling in the caller's transaction (see `transaction.rs`).
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
impl Settings {
    /// Claims the call's key in the transaction under its savepoint: the record to replay,
    /// or the token of the claim. Only a claim keeps the savepoint; any other outcome ends
    /// it (a replay wrote nothing; a refused claim rolls back to it), so that a transaction
    /// of many calls does not nest one level deeper per call.
    pub(super) async fn settle_in<S: Transactional>(
        &self,
        store: &S,
        connection: &mut S::Connection,
        call: &Call<'_>,
    ) -> Result<Settled, Error> {
        let started = meter::start();
        let settled = self.settle_under(store, connection, call).await;
        meter::settled(&self.namespace, started, &settled, |settled| {
            matches!(settled, Settled::Replay(_))
        });
        settled
    }

    /// [`settle_in`](Self::settle_in), unmeasured.
    async fn settle_under<S: Transactional>(
        &self,
        store: &S,
        connection: &mut S::Connection,
        call: &Call<'_>,
    ) -> Result<Settled, Error> {
        limits::check(self.ttl, self.lease, self.wait_timeout)?;
        // Before any statement: the enclosing call's uncommitted claim would make a claim on
        // another connection wait for the very transaction that waits for it.
        attempt::refuse_recursion(store, call.key)?;
        // A record at hand outside the database (a tier's fast copy) is replayed without a
        // statement on the caller's connection.
        if let Some((value, recorded)) = store.__recorded(call.key).await {
            return Settled::replay(value, recorded.as_ref(), call.fingerprint);
        }
        let deadline = Instant::now() + self.wait();
        let mut polls = 0;
        loop {
            let sent = Instant::now();
            let settled = match store.__claim_in(connection, call, polls == 0).await? {
                Claim::Acquired { token, taken_over } => {
                    return Ok(Settled::Run(Granted {
                        token,
                        sent,
                        taken_over,
                    }))
                }
                Claim::Completed {
                    value,
                    fingerprint: recorded,
                } => Settled::replay(value, recorded.as_ref(), call.fingerprint),
                // Held by a committed claim of `run` (a lease), not by a transaction: poll.
                Claim::InProgress {
                    fingerprint: holder,
                } => {
                    let polled = async {
                        self.found_in_progress(store, call.key, holder.as_ref(), call.fingerprint)?;
                        if polls == 0 {
                            store.__before_polling(connection).await?;
                        }
                        pause_before_polling(deadline, polls).await
                    }
                    .await;
                    match polled {
                        Ok(()) => {
                            polls += 1;
                            continue;
                        }
                        Err(err) => Err(err),
                    }
                }
            };
            store.__roll_back(connection, call).await;
            return settled;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_must_match_exactly() {
        let a = Fingerprint::of(&1).unwrap();
        let b = Fingerprint::of(&2).unwrap();
        assert!(check_fingerprint(Some(&a), Some(&a)).is_ok());
        assert!(check_fingerprint(None, None).is_ok());
        assert!(check_fingerprint(Some(&a), Some(&b)).is_err());
        assert!(check_fingerprint(None, Some(&b)).is_err());
        assert!(check_fingerprint(Some(&a), None).is_err());
    }
}
