//! Running a future idempotently: claim, run once, record, replay.

pub(crate) mod attempt;
mod held;

use std::borrow::Cow;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::Instant;
use tracing::Instrument;

use self::held::Held;
use crate::codec::{self, ErrorPolicy, Json, ReleaseErrors, ValueCodec};
use crate::flights::Landing;
use crate::{background, limits, CacheErrors, Claim, Error, Fingerprint, Key, Store, Token};

/// How long a completed result is replayed unless told otherwise: 24 hours.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// How long a claim lives without renewal unless told otherwise: 30 seconds.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// What a call does when it finds its key in progress.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum InFlight {
    /// Wait for the running call and share its outcome: its recorded result, or, if it
    /// released the key, a fresh claim. Bounded by the wait timeout (the lease by default),
    /// after which the call fails with [`Error::InProgress`].
    #[default]
    Wait,
    /// Fail at once with [`Error::InProgress`].
    Reject,
}

/// The result of an idempotent call, and whether it ran here or was recorded before.
///
/// Services that answer HTTP use [`is_replayed`](Outcome::is_replayed) to set a replay
/// header such as `Idempotent-Replayed: true`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Outcome<T> {
    /// This call ran the body.
    Executed(T),
    /// The body ran in an earlier (or concurrent) call; this is its recorded result.
    Replayed(T),
}

impl<T> Outcome<T> {
    /// The value, however it was obtained.
    pub fn into_inner(self) -> T {
        match self {
            Self::Executed(value) | Self::Replayed(value) => value,
        }
    }

    /// A reference to the value.
    pub fn get(&self) -> &T {
        match self {
            Self::Executed(value) | Self::Replayed(value) => value,
        }
    }

    /// Whether the value was recorded by an earlier or concurrent call.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Self::Replayed(_))
    }
}

/// One idempotent operation: its stable name and its policies.
///
/// This is the API the `#[idempotent]` attribute expands to; use it directly to make any
/// future idempotent.
///
/// ```
/// use idem_runtime::{MemoryStore, Operation, Outcome};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::Error> {
/// let store = MemoryStore::new();
/// let charge = Operation::new("billing.charge.v1");
/// let key = charge.key(&("order-17", 4_200_u64))?;
///
/// let first = charge.run(&store, &key, None, async { Ok::<_, idem_runtime::Error>(7_u32) }).await?;
/// let again = charge.run(&store, &key, None, async { Ok::<_, idem_runtime::Error>(8_u32) }).await?;
/// assert_eq!(first, Outcome::Executed(7));
/// assert_eq!(again, Outcome::Replayed(7));
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Operation<P = ReleaseErrors> {
    namespace: Namespace,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) in_flight: InFlight,
    pub(crate) wait_timeout: Option<Duration>,
    pub(crate) errors: P,
}

impl Operation {
    /// An operation named `namespace`: a stable name such as `"billing.charge.v1"`, part of
    /// every key, so that renaming code never resets keys and two operations never share them.
    pub fn new(namespace: impl Into<Cow<'static, str>>) -> Self {
        Self {
            namespace: Namespace::from(namespace.into()),
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            in_flight: InFlight::Wait,
            wait_timeout: None,
            errors: ReleaseErrors,
        }
    }
}

impl<P> Operation<P> {
    /// How long a completed result is replayed (default [`DEFAULT_TTL`]).
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long a claim lives without renewal (default [`DEFAULT_LEASE`]). The claim is
    /// renewed every third of it while the body runs; a crashed holder's claim is free again
    /// at most this long after its last renewal.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// What a call does when its key is in progress (default [`InFlight::Wait`]).
    #[must_use]
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.in_flight = in_flight;
        self
    }

    /// How long [`InFlight::Wait`] waits at most (default: the lease).
    #[must_use]
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = Some(timeout);
        self
    }

    /// Records the errors `is_final` accepts and replays them like values; other errors still
    /// release the key. The error type must be `Serialize + DeserializeOwned`.
    ///
    /// ```
    /// use idem_runtime::Operation;
    ///
    /// #[derive(Debug, serde::Serialize, serde::Deserialize)]
    /// enum PayError { Declined, GatewayDown, Idem(String) }
    ///
    /// let charge = Operation::new("billing.charge.v1")
    ///     .cache_errors(|e: &PayError| matches!(e, PayError::Declined));
    /// # let _ = charge;
    /// ```
    pub fn cache_errors<F>(self, is_final: F) -> Operation<CacheErrors<F>> {
        Operation {
            namespace: self.namespace,
            ttl: self.ttl,
            lease: self.lease,
            in_flight: self.in_flight,
            wait_timeout: self.wait_timeout,
            errors: CacheErrors(is_final),
        }
    }

    /// The same operation under another namespace.
    #[cfg(feature = "http")]
    pub(crate) fn renamed(mut self, namespace: impl Into<Cow<'static, str>>) -> Self {
        self.namespace = Namespace::from(namespace.into());
        self
    }

    /// The operation's namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Derives the key of `value` in this operation's namespace.
    ///
    /// # Errors
    ///
    /// [`Error::Key`] when the value cannot be encoded deterministically (a NaN float).
    pub fn key<V: Serialize + ?Sized>(&self, value: &V) -> Result<Key, Error> {
        Key::derive(&self.namespace, value)
    }

    /// Runs `body` at most once per `key` and returns its result, or the recorded one.
    ///
    /// - The key is claimed in `store` first; a recorded result is replayed without polling
    ///   `body`, after checking `fingerprint` against the recorded one.
    /// - While `body` runs, the claim's lease is renewed.
    /// - `Ok` is recorded for the TTL; `Err` releases the key (unless the error policy
    ///   records it); a panic releases the key and resumes unwinding.
    /// - If this future is dropped mid-body, the body is dropped too and the key released
    ///   (`on_cancel = "release"`). See [`run_to_completion`](Self::run_to_completion) for
    ///   the alternative.
    ///
    /// # Errors
    ///
    /// `body`'s own errors, and [`Error`]s converted with `E: From<Error>`:
    /// [`Error::InProgress`], [`Error::PayloadMismatch`], [`Error::Store`] and [`Error::Codec`]
    /// (a recorded result that does not decode). None of them runs the body, except a
    /// [`Error::Codec`] on encoding the body's own result, which releases the key.
    pub async fn run<S, T, E, F>(
        &self,
        store: &S,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        body: F,
    ) -> Result<Outcome<T>, E>
    where
        S: Store + Clone,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        P: ErrorPolicy<E>,
        F: Future<Output = Result<T, E>>,
    {
        async {
            match self.settle(store, key, fingerprint).await? {
                Settled::Replay(record) => self.replay::<Json, _, _>(&record),
                Settled::Run(token) => {
                    let held =
                        Held::new(store.clone(), *key, fingerprint.copied(), token, self.lease);
                    // Boxed: the execution's state (guard, heartbeat, timers) would otherwise
                    // be part of every call's future, and be copied with it on every replay.
                    Box::pin(self.execute::<Json, _, _, _, _>(held, body)).await
                }
            }
        }
        .instrument(self.span(key))
        .await
    }

    /// Like [`run`](Self::run), but if this future is dropped mid-body, the body runs to the
    /// end in the background and its result is recorded (`on_cancel = "complete"`). The body
    /// is spawned on the current tokio runtime, so it must be `Send + 'static`: it cannot
    /// borrow the caller's arguments.
    ///
    /// # Errors
    ///
    /// As for [`run`](Self::run).
    pub async fn run_to_completion<S, T, E, F>(
        &self,
        store: &S,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        body: F,
    ) -> Result<Outcome<T>, E>
    where
        S: Store + Clone,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: From<Error> + Send + 'static,
        P: ErrorPolicy<E> + Clone + Send + Sync + 'static,
        F: Future<Output = Result<T, E>> + Send + 'static,
    {
        self.run_to_completion_as::<Json, S, T, E, F>(store, key, fingerprint, body)
            .await
    }

    /// [`run_to_completion`](Self::run_to_completion), with values recorded by `C`: the
    /// HTTP layer records responses in a format of its own through it.
    pub(crate) async fn run_to_completion_as<C, S, T, E, F>(
        &self,
        store: &S,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        body: F,
    ) -> Result<Outcome<T>, E>
    where
        C: ValueCodec<T> + 'static,
        S: Store + Clone,
        T: Send + 'static,
        E: From<Error> + Send + 'static,
        P: ErrorPolicy<E> + Clone + Send + Sync + 'static,
        F: Future<Output = Result<T, E>> + Send + 'static,
    {
        async {
            // Checked before the claim: without a runtime the body could not be spawned.
            let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
                Error::config(
                    "`on_cancel = \"complete\"` spawns the body: call it inside a tokio runtime",
                )
            })?;
            let token = match self.settle(store, key, fingerprint).await? {
                Settled::Replay(record) => return self.replay::<C, _, _>(&record),
                Settled::Run(token) => token,
            };
            // Between the claim and the spawn there is no await point: once claimed, the
            // guard lives in the task and releases the key if the task never runs.
            let held = Held::new(store.clone(), *key, fingerprint.copied(), token, self.lease);
            let operation = self.clone();
            let task = background::spawn(
                &runtime,
                async move { operation.execute::<C, _, _, _, _>(held, body).await }
                    .in_current_span(),
            );
            match task.await {
                Ok(result) => result,
                Err(join) => match join.try_into_panic() {
                    Ok(panic) => std::panic::resume_unwind(panic),
                    Err(_) => Err(Error::store("the runtime shut down while the body ran").into()),
                },
            }
        }
        .instrument(self.span(key))
        .await
    }

    /// The span of one call: the namespace and a short digest of the key, never its value.
    pub(crate) fn span(&self, key: &Key) -> tracing::Span {
        tracing::debug_span!("idempotent", namespace = %&*self.namespace, key = %key.short())
    }

    /// Claims the key, or waits until there is a result to replay or a claim to take.
    async fn settle<S: Store>(
        &self,
        store: &S,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Settled, Error> {
        limits::check(self.ttl, self.lease, self.wait_timeout)?;
        // The clock is read only once a call has to wait: replays and first calls never do.
        let mut deadline = None;
        let wait_until = |deadline: &mut Option<Instant>| {
            *deadline
                .get_or_insert_with(|| Instant::now() + self.wait_timeout.unwrap_or(self.lease))
        };
        let mut polls = 0_u32;
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
            let claim = match store.peek(key) {
                Some(completed @ Claim::Completed { .. }) => completed,
                _ => {
                    // The enclosing call's claim may be uncommitted in its transaction, where
                    // a claim would wait for the very call that waits for it.
                    attempt::refuse_recursion(store, key)?;
                    store.claim(key, fingerprint, self.lease).await?
                }
            };
            match claim {
                Claim::Acquired { token } => return Ok(Settled::Run(token)),
                Claim::Completed {
                    value,
                    fingerprint: recorded,
                } => return Settled::replay(value, recorded.as_ref(), fingerprint),
                Claim::InProgress {
                    fingerprint: holder,
                } => {
                    self.found_in_progress(store, key, holder.as_ref(), fingerprint)?;
                    pause_before_polling(wait_until(&mut deadline), polls).await?;
                    polls += 1;
                }
            }
        }
    }

    /// The checks on a record found in progress: the fingerprint first, then whether the
    /// holder is this call's own enclosing call, then the policy.
    pub(crate) fn found_in_progress<S: Store + ?Sized>(
        &self,
        store: &S,
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

    pub(crate) fn replay<C, T, E>(&self, record: &[u8]) -> Result<Outcome<T>, E>
    where
        C: ValueCodec<T>,
        E: From<Error>,
        P: ErrorPolicy<E>,
    {
        match codec::decode::<C, T, E, P>(record, &self.errors)? {
            Ok(value) => Ok(Outcome::Replayed(value)),
            Err(recorded) => Err(recorded),
        }
    }

    /// Runs the body under a held claim, then records or releases.
    async fn execute<C, S, T, E, F>(&self, held: Held<S>, body: F) -> Result<Outcome<T>, E>
    where
        C: ValueCodec<T>,
        S: Store + Clone,
        E: From<Error>,
        P: ErrorPolicy<E>,
        F: Future<Output = Result<T, E>>,
    {
        let started = Instant::now();
        let result = held.run(body).await;
        let elapsed_ms = started.elapsed().as_millis() as u64;
        match result {
            Ok(value) => match codec::encode_value::<C, T>(&value) {
                Ok(record) => {
                    held.complete(record, self.ttl).await;
                    tracing::debug!(outcome = "executed", elapsed_ms);
                    Ok(Outcome::Executed(value))
                }
                Err(codec) => {
                    tracing::error!(outcome = "released", error = %codec, "the result cannot be recorded");
                    held.release().await;
                    Err(codec.into())
                }
            },
            Err(err) => {
                match self.errors.encode(&err) {
                    Some(Ok(record)) => {
                        held.complete(record, self.ttl).await;
                        tracing::debug!(outcome = "executed", elapsed_ms, "recorded a final error");
                    }
                    Some(Err(codec)) => {
                        tracing::error!(outcome = "released", error = %codec, "the final error cannot be recorded");
                        held.release().await;
                    }
                    None => {
                        held.release().await;
                        tracing::debug!(outcome = "released", elapsed_ms, "the body failed");
                    }
                }
                Err(err)
            }
        }
    }
}

impl Settled {
    /// A completed record found by a claim: replayed if its fingerprint is this call's.
    pub(crate) fn replay(
        value: Bytes,
        recorded: Option<&Fingerprint>,
        ours: Option<&Fingerprint>,
    ) -> Result<Self, Error> {
        check_fingerprint(recorded, ours)?;
        tracing::debug!(outcome = "replayed");
        Ok(Self::Replay(value))
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

/// An operation's name: a static string, or a shared one, so that cloning an operation (as
/// every spawned body does) never allocates.
#[derive(Clone)]
pub(crate) enum Namespace {
    Static(&'static str),
    Shared(Arc<str>),
}

impl From<Cow<'static, str>> for Namespace {
    fn from(name: Cow<'static, str>) -> Self {
        match name {
            Cow::Borrowed(name) => Self::Static(name),
            Cow::Owned(name) => Self::Shared(name.into()),
        }
    }
}

impl std::fmt::Debug for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&**self, f)
    }
}

impl std::ops::Deref for Namespace {
    type Target = str;

    fn deref(&self) -> &str {
        match self {
            Self::Static(name) => name,
            Self::Shared(name) => name,
        }
    }
}

/// What settling a claim ended with: a record to replay, or the claim's token to run under.
pub(crate) enum Settled {
    Replay(Bytes),
    Run(Token),
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

fn timed_out() -> Error {
    tracing::debug!(outcome = "rejected", "gave up waiting for the running call");
    Error::InProgress
}

/// Exponential backoff with jitter for polling a key held by another process: 5 ms doubling
/// up to 250 ms, each delay drawn from its upper half so that waiters spread out.
fn backoff(polls: u32) -> Duration {
    let ceiling = Duration::from_millis(5)
        .saturating_mul(1 << polls.min(6))
        .min(Duration::from_millis(250));
    let half = ceiling / 2;
    let jitter = std::collections::hash_map::RandomState::new().hash_one(polls);
    half + Duration::from_nanos(jitter % (half.as_nanos() as u64).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_stays_bounded() {
        for polls in 0..20 {
            let ceiling = Duration::from_millis((5_u64 << polls.min(6)).min(250));
            let delay = backoff(polls);
            assert!(
                delay >= ceiling / 2 && delay <= ceiling,
                "{polls}: {delay:?}"
            );
        }
    }

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
