//! Running a future idempotently: claim, run once, record, replay. The front of the folder
//! is [`Operation`], the API the attribute expands to; what a call does lives below it:
//! [`call`] (the call's future), `settle` (claiming), `held` (running under a claim),
//! `lease`, `attempt`, `steps`, and `transaction`.

pub(crate) mod attempt;
mod backoff;
mod call;
mod handle;
mod held;
pub(crate) mod label;
mod lease;
mod outcome;
pub(crate) mod reconcile;
mod settings;
pub(crate) mod settle;
pub(crate) mod steps;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
mod transaction;

use std::borrow::Cow;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

use self::call::{Answer, Call};
use self::handle::Begun;
use self::settings::Settings;
use crate::codec::{self, ErrorPolicy, Json, ReleaseErrors, ValueCodec};
use crate::namespace::Namespace;
use crate::{background, CacheErrors, Error, Fingerprint, Key, Store};

pub(crate) use self::call::{unkeyed, Derived};
pub use self::call::{IdemResult, Started, Typing};
pub use self::outcome::Outcome;
pub use self::settings::InFlight;
pub(crate) use self::settle::Found;

pub use crate::store::DEFAULT_TTL;

/// How long a claim lives without renewal unless told otherwise: 8 seconds.
///
/// A holder renews its claim every quarter of the lease (2 s) while its body runs, so a body
/// may run for hours; the lease only bounds how long a crashed holder's key stays locked: a
/// retry after a SIGKILL runs within 8 s of the last renewal. Each renewal may be up to 6 s
/// late (a starved runtime, a slow store) before a live holder can be taken over. See
/// [`guide::leases`](crate::guide::leases) for what a shorter or longer one costs.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(8);

/// How long a duplicate waits for the call that holds its key unless told otherwise
/// ([`Operation::wait`], the attribute's `wait = …`): 10 seconds, whatever the lease.
///
/// The wait is what the duplicate's own caller can bear (an HTTP client's timeout, a
/// webhook sender's), not how long a crashed holder keeps a key: with a five-minute lease a
/// duplicate still answers [`Error::InProgress`] (transient:
/// retry later) within 10 s, and with a lease shorter than the body a duplicate waits
/// while the live holder renews, instead of giving up a moment before it records.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(10);

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
    pub(crate) settings: Settings,
    pub(crate) errors: P,
}

impl Operation {
    /// An operation named `namespace`: a stable name such as `"billing.charge.v1"`, part of
    /// every key, so that renaming code never resets keys and two operations never share them.
    pub fn new(namespace: impl Into<Cow<'static, str>>) -> Self {
        Self {
            settings: Settings {
                namespace: Namespace::from(namespace.into()),
                ttl: DEFAULT_TTL,
                lease: DEFAULT_LEASE,
                in_flight: InFlight::Wait,
                wait_timeout: None,
                record_wait: None,
            },
            errors: ReleaseErrors,
        }
    }
}

impl<P> Operation<P> {
    /// How long a completed result is replayed (default [`DEFAULT_TTL`]).
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.settings.ttl = ttl;
        self
    }

    /// How long a claim lives without renewal (default [`DEFAULT_LEASE`]). The claim is
    /// renewed every quarter of it while the body runs; a crashed holder's claim is free again
    /// at most this long after its last renewal.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.settings.lease = lease;
        self
    }

    /// What a call does when its key is in progress (default [`InFlight::Wait`]).
    #[must_use]
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.settings.in_flight = in_flight;
        self
    }

    /// How long a duplicate waits for the holder at most ([`InFlight::Wait`]), before it
    /// fails with [`Error::InProgress`] (default [`DEFAULT_WAIT`], 10 s, whatever the
    /// lease). `Duration::ZERO` refuses at
    /// once. While a call waits on a key held in another process, it logs the holder and
    /// the lease it has left (`tracing`, `info`), so that a wait is never silent.
    ///
    /// The attribute's `wait = "10s"`.
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.settings.wait_timeout = Some(wait);
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
            settings: self.settings,
            errors: CacheErrors(is_final),
        }
    }

    /// The same operation with another error policy.
    #[cfg(feature = "http")]
    pub(crate) fn with_errors<Q>(self, errors: Q) -> Operation<Q> {
        Operation {
            settings: self.settings,
            errors,
        }
    }

    /// The same operation with its callers waiting at most `wait` for a completion that
    /// failed (see [`Settings::record_wait`]).
    #[cfg(feature = "http")]
    pub(crate) fn record_wait(mut self, wait: Duration) -> Self {
        self.settings.record_wait = Some(wait);
        self
    }

    /// The same operation under another namespace.
    #[cfg(feature = "http")]
    pub(crate) fn renamed(mut self, namespace: impl Into<Cow<'static, str>>) -> Self {
        self.settings.namespace = Namespace::from(namespace.into());
        self
    }

    /// The operation's namespace.
    pub fn namespace(&self) -> &str {
        &self.settings.namespace
    }

    /// Derives the key of `value` in this operation's namespace.
    ///
    /// # Errors
    ///
    /// [`Error::Key`] when the value cannot be encoded deterministically (a NaN float).
    pub fn key<V: Serialize + ?Sized>(&self, value: &V) -> Result<Key, Error> {
        Key::derive(&self.settings.namespace, value)
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
    /// [`Error::InProgress`], [`Error::PayloadMismatch`], [`Error::Gone`], [`Error::Store`]
    /// and [`Error::Codec`] (a recorded result that does not decode), none of which runs the
    /// body; and [`Error::Unrecorded`], the one that answers a body that ran. A value that
    /// has no record of itself is its caller's and recorded as gone: never a second run.
    pub fn run<'a, S, T, E, F>(
        &'a self,
        store: &'a S,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        body: F,
    ) -> impl Future<Output = Result<Outcome<T>, E>> + use<'a, P, S, T, E, F>
    where
        S: Store + Clone,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        P: ErrorPolicy<E>,
        F: Future<Output = Result<T, E>>,
    {
        let derived = Ok(Some((*key, fingerprint.copied())));
        self.call::<Json, S, _, _, _>(store, derived, body, |o| o, None, false)
    }

    /// The call of `body` under `derived` in `store`, answered by `answer`: what
    /// [`run`](Self::run) and every `#[idempotent]` function without `on_cancel` are. A
    /// replay takes the value the store kept where `typing` says how; `looked` if a look
    /// for the key's record at hand found none just before.
    pub(crate) fn call<'a, C, S, R, F, O>(
        &'a self,
        store: &'a S,
        derived: Derived,
        body: F,
        answer: Answer<R, O>,
        typing: Option<Typing<R::Ok>>,
        looked: bool,
    ) -> Call<'a, C, P, R, F, O>
    where
        S: Store + Clone,
        R: IdemResult,
    {
        Call::new(self, store, derived, body, answer, typing, looked)
    }

    /// The outcome of a call answered by a record: the value the store kept, if the call
    /// takes it, or the record decoded.
    #[inline]
    pub(crate) fn replayed<C, R>(
        &self,
        found: &Found,
        typing: Option<Typing<R::Ok>>,
    ) -> Result<Outcome<R::Ok>, R::Err>
    where
        C: ValueCodec<R::Ok>,
        R: IdemResult,
        R::Err: From<Error>,
        P: ErrorPolicy<R::Err>,
    {
        let taken = found
            .typed()
            .zip(typing)
            .and_then(|(typed, typing)| typing.taken(typed));
        match taken {
            Some(value) => Ok(Outcome::Replayed(value)),
            // Kept by a call of another type, or not kept: decoded.
            None => self.replay::<C, _, _>(found.record()),
        }
    }

    /// Like [`run`](Self::run), but if this future is dropped mid-body, the body runs to the
    /// end in the background and its result is recorded (`on_cancel = "complete"`). The body
    /// runs in the caller's task while the caller waits; once the caller drops it, the rest
    /// of it is spawned on the tokio runtime the call started in, so it must be
    /// `Send + 'static`: it cannot borrow the caller's arguments.
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
        let derived = Ok(Some((*key, fingerprint.copied())));
        self.run_to_completion_as::<Json, S, _, _>(store, derived, body, false)
            .await
    }

    /// [`run_to_completion`](Self::run_to_completion) under `derived`, with values recorded
    /// by `C`: the HTTP layer records responses in a format of its own through it. `looked`
    /// if a look for the key's record at hand found none just before.
    pub(crate) async fn run_to_completion_as<C, S, R, F>(
        &self,
        store: &S,
        derived: Derived,
        body: F,
        looked: bool,
    ) -> Result<Outcome<R::Ok>, R::Err>
    where
        C: ValueCodec<R::Ok> + 'static,
        S: Store + Clone,
        R: IdemResult,
        R::Ok: Send + 'static,
        R::Err: From<Error> + Send + 'static,
        P: ErrorPolicy<R::Err> + Clone + Send + Sync + 'static,
        F: Future<Output = R> + Send + 'static,
    {
        let (key, fingerprint) = match derived {
            Ok(Some(derived)) => derived,
            Ok(None) => {
                unkeyed();
                let output = attempt::scope_unkeyed(body).await;
                return Ok(Outcome::Executed(output.into_result()?));
            }
            Err(err) => return Err(err.into()),
        };
        let runtime = spawner()?;
        let at_once = (!looked).then(|| {
            self.settings
                .replay_at_once(store, &key, fingerprint.as_ref())
        });
        let begun = match at_once.flatten() {
            Some(replay) => replay.map(|found| Begun::Replay(found.record().clone())),
            None => self.settings.begin(store, key, fingerprint).await,
        };
        let held = match begun? {
            Begun::Replay(record) => return self.replay::<C, _, _>(&record),
            Begun::Run(held) => held,
        };
        // The body runs in this task while its caller waits, and goes on in a task of its
        // own if the caller goes away; its guard releases the key if that task never runs.
        let operation = self.clone();
        background::finish_if_dropped(runtime, async move {
            Call::<C, P, R, F, _>::running(&operation, held, body, |o| o).await
        })
        .await
    }

    pub(crate) fn replay<C, T, E>(&self, record: &Bytes) -> Result<Outcome<T>, E>
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
}

/// The runtime an `on_cancel = "complete"` body goes on in when its caller drops it,
/// checked before the claim: without one the body could not go on.
pub(crate) fn spawner() -> Result<tokio::runtime::Handle, Error> {
    tokio::runtime::Handle::try_current().map_err(|_| {
        Error::config("`on_cancel = \"complete\"` finishes a dropped body on the runtime: call it inside a tokio runtime")
    })
}
