//! The storage contract behind every idempotent call, and its backends.
//!
//! A record per [`Key`] moves through three states:
//!
//! ```text
//!            claim                      complete(token)
//!  absent ──────────▶ in progress ─────────────────────▶ completed ──(ttl)──▶ absent
//!     ▲                 │  │ lease runs out: the next claim takes it over
//!     └─ release(token) ┘  └──────────────▶ in progress (new, larger token)
//! ```
//!
//! Third-party backends implement [`Store`] (with [`async_trait`](macro@async_trait) and [`Bytes`], re-exported
//! here); the conformance suite in `idem_runtime::testkit` (feature `testkit`) checks that an
//! implementation keeps this contract.

#[cfg(feature = "dynamodb")]
pub mod dynamodb;
#[cfg(feature = "memory")]
pub mod memory;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub mod sql;
#[cfg(feature = "sqlite")]
pub mod sqlite;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
mod transaction;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub use transaction::Transactional;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
#[doc(hidden)]
pub use transaction::{Call, Savepoint};
mod holder;
pub mod tiered;

pub use holder::{Claimant, Holder, Holding};

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// Re-exported for implementors of [`Store`]: the trait is written with it.
pub use async_trait::async_trait;
/// Re-exported for implementors of [`Store`]: records are [`Bytes`].
pub use bytes::Bytes;

use crate::{Error, Fingerprint, Flights, Key};

/// How long a completed result is replayed unless told otherwise: 24 hours.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// A claim's token: different for every successful claim of the same key, so that a holder
/// whose lease ran out can be told apart from the one that took the key over.
///
/// The same type carries a claim's *fencing* token ([`Store::fence`], and
/// [`Attempt::token`](crate::Attempt::token) for a body), which is also strictly larger than
/// the fencing token of every earlier claim of the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(u64);

impl Token {
    /// Wraps a raw token, for store implementations.
    pub const fn new(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// A token binds as a signed 64-bit integer in the SQL databases (`bigint` in PostgreSQL,
/// `INTEGER` in SQLite), and reads back from one (or from MySQL's `BIGINT UNSIGNED`), for fenced writes such as
/// `UPDATE … SET fence = $1 WHERE … AND fence < $1`. Tokens count claims from 1, so every
/// one a store hands out fits; a raw token over `i64::MAX` is refused when bound, and a
/// negative integer when read, never wrapped.
macro_rules! token_is_an_integer_in {
    ($feature:literal, $database:ty, $unsigned:ty) => {
        #[cfg(feature = $feature)]
        impl sqlx::Type<$database> for Token {
            fn type_info() -> <$database as sqlx::Database>::TypeInfo {
                <i64 as sqlx::Type<$database>>::type_info()
            }

            fn compatible(ty: &<$database as sqlx::Database>::TypeInfo) -> bool {
                <i64 as sqlx::Type<$database>>::compatible(ty)
                    || <$unsigned as sqlx::Type<$database>>::compatible(ty)
            }
        }

        #[cfg(feature = $feature)]
        impl<'q> sqlx::Encode<'q, $database> for Token {
            fn encode_by_ref(
                &self,
                buf: &mut <$database as sqlx::Database>::ArgumentBuffer<'q>,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                let raw = i64::try_from(self.0).map_err(|_| {
                    format!("fencing token {} does not fit a 64-bit integer", self.0)
                })?;
                <i64 as sqlx::Encode<'q, $database>>::encode_by_ref(&raw, buf)
            }
        }

        #[cfg(feature = $feature)]
        impl<'r> sqlx::Decode<'r, $database> for Token {
            fn decode(
                value: <$database as sqlx::Database>::ValueRef<'r>,
            ) -> Result<Self, sqlx::error::BoxDynError> {
                // An unsigned column (MySQL's `BIGINT UNSIGNED`) reads as one.
                let ty = sqlx::ValueRef::type_info(&value);
                if !<i64 as sqlx::Type<$database>>::compatible(&ty) {
                    let raw = <$unsigned as sqlx::Decode<'r, $database>>::decode(value)?;
                    #[allow(clippy::useless_conversion)]
                    return u64::try_from(raw)
                        .map(Token)
                        .map_err(|_| format!("{raw} is not a fencing token").into());
                }
                let raw = <i64 as sqlx::Decode<'r, $database>>::decode(value)?;
                u64::try_from(raw).map(Token).map_err(|_| {
                    format!("{raw} is not a fencing token: tokens are positive").into()
                })
            }
        }
    };
}

// The third type is the unsigned integer a column may hold tokens as, where there is one.
token_is_an_integer_in!("postgres", sqlx::Postgres, i64);
token_is_an_integer_in!("sqlite", sqlx::Sqlite, i64);
token_is_an_integer_in!("mysql", sqlx::MySql, u64);

/// What [`Store::claim`] found or did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// The key was absent, expired, released, or its lease had run out: the caller now
    /// holds it with this token and must run the operation, then
    /// [`complete`](Store::complete) or [`release`](Store::release).
    Acquired {
        /// The token to present to `complete`, `release` and `renew`.
        token: Token,
        /// Whether this claim took the key over from another claim that was neither
        /// completed nor released: its lease ran out while its body ran (its process died
        /// or stalled), or an operator released it. That body's outcome is unknown, so the
        /// engine runs the call's [`reconcile`](crate::reconcile()) step before its body.
        /// A claim made again under its own nonce (its reply was lost) is not a takeover.
        taken_over: bool,
    },
    /// Another holder's claim is live; nothing was changed.
    InProgress {
        /// The fingerprint the holder claimed with.
        fingerprint: Option<Fingerprint>,
    },
    /// The operation completed before and its record has not expired; nothing was changed.
    Completed {
        /// The recorded result, as passed to [`complete`](Store::complete).
        value: Bytes,
        /// The fingerprint the record was claimed with.
        fingerprint: Option<Fingerprint>,
    },
}

impl Claim {
    /// A claim of a key that no unsettled claim held before: absent, expired, released, or
    /// the caller's own claim made again.
    pub const fn acquired(token: Token) -> Self {
        Self::Acquired {
            token,
            taken_over: false,
        }
    }

    /// A claim that took the key over from an unsettled claim: one whose lease ran out
    /// while it was held, or that an operator released.
    pub const fn taken_over(token: Token) -> Self {
        Self::Acquired {
            token,
            taken_over: true,
        }
    }
}

/// One claim, as the engine asks [`Store::claim`] for it: the key, the payload's
/// fingerprint, the lease, how long the call's record is kept, the call's nonce and whose
/// the claim is. Built with [`new`](Self::new) and its setters; read through its fields,
/// so that a field added later is no new method.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::{ClaimRequest, Key};
///
/// let key = Key::derive("billing.charge.v1", &17)?;
/// let request = ClaimRequest::new(&key, Duration::from_secs(8)).ttl(Duration::from_secs(3600));
/// assert_eq!(request.lease, Duration::from_secs(8));
/// # Ok::<_, idem_runtime::Error>(())
/// ```
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct ClaimRequest<'a> {
    /// The key to claim.
    pub key: &'a Key,
    /// The payload's fingerprint, kept with the claim and its record.
    pub fingerprint: Option<&'a Fingerprint>,
    /// How long the claim lives without renewal.
    pub lease: Duration,
    /// How long the call's record is kept: a completed result's TTL, and how long, after
    /// its lease ran out, a claim that was never settled is remembered so that the claim
    /// that takes it over is told ([`Claim::Acquired`]'s `taken_over`).
    pub ttl: Duration,
    /// A number the caller draws once per call (64 random bits) and sends again with every
    /// retry of the same claim. A key in progress under a claim made with the same nonce is
    /// the caller's own claim, whose reply was lost (a timeout after the store applied it):
    /// it is answered [`Claim::Acquired`] with a whole lease (that claim's token renewed, or
    /// the key taken again under a new token, which fences the old one), instead of leaving
    /// the caller to wait out its own lease. A store that cannot keep the nonce may ignore
    /// it: such a key then stays held until its lease lapses.
    pub nonce: u64,
    /// Whose the claim is: its operation's namespace, a label if the caller chose one, and
    /// this process as its [`Holder`], which a store keeps beside the record so that an
    /// operator's listing (`idem_runtime::admin`) can tell whose a key is.
    pub claimant: Claimant<'a>,
}

impl<'a> ClaimRequest<'a> {
    /// A claim of `key` for `lease`, with no fingerprint, the [default
    /// TTL](DEFAULT_TTL), a nonce of its own (a claim that is never sent again) and
    /// no claimant's name.
    pub fn new(key: &'a Key, lease: Duration) -> Self {
        Self {
            key,
            fingerprint: None,
            lease,
            ttl: DEFAULT_TTL,
            nonce: nonce(),
            claimant: Claimant::unnamed(),
        }
    }

    /// With the payload's fingerprint.
    #[must_use]
    pub const fn fingerprint(mut self, fingerprint: Option<&'a Fingerprint>) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// With how long the call's record is kept.
    #[must_use]
    pub const fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// With the call's nonce, sent again with every retry of this claim.
    #[must_use]
    pub const fn nonce(mut self, nonce: u64) -> Self {
        self.nonce = nonce;
        self
    }

    /// Saying whose the claim is.
    #[must_use]
    pub const fn claimant(mut self, claimant: Claimant<'a>) -> Self {
        self.claimant = claimant;
        self
    }
}

/// A live completed record, as [`Store::lookup`] reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Recorded {
    /// The recorded result, as passed to [`complete`](Store::complete).
    pub value: Bytes,
    /// The fingerprint the record was claimed with.
    pub fingerprint: Option<Fingerprint>,
    /// How long the record has left to live, by the store's clock, when the store can say.
    pub expires_in: Option<Duration>,
}

impl Recorded {
    /// A record, for store implementations.
    pub fn new(
        value: Bytes,
        fingerprint: Option<Fingerprint>,
        expires_in: Option<Duration>,
    ) -> Self {
        Self {
            value,
            fingerprint,
            expires_in,
        }
    }
}

/// Where claims and recorded results live.
///
/// Implementations are cheap handles (`Clone`, an `Arc` inside) shared across tasks; the
/// trait is object safe, so `Arc<dyn Store>` is a store too.
///
/// # Contract
///
/// Every method is **one atomic step** on the record of one key (one round trip on a network
/// store). Expiry is judged by the store's own clock, never by comparing clocks of clients.
/// `complete`, `release` and `renew` are compare-and-set on the [`Token`]: they act only while
/// the record is in progress, live, and holds exactly that token, and otherwise return
/// `Ok(false)` and change nothing. Different keys never block each other.
#[async_trait]
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotency store",
    note = "use one of the stores below (`MemoryStore`, or one of a backend feature), an `Arc<dyn Store>`, or implement `idem_runtime::Store`"
)]
pub trait Store: Send + Sync + 'static {
    /// Takes the request's key for the caller, or reports what is there, in one atomic
    /// step.
    ///
    /// If the record is absent, completed but past its TTL, released, or in progress with a
    /// lease that ran out, it becomes in progress with the request's fingerprint, a lease
    /// of `lease` and a new token that differs from every earlier token of this key:
    /// [`Claim::Acquired`]. Otherwise nothing changes and the live record is returned. A
    /// key in progress under the request's [`nonce`](ClaimRequest::nonce) is the caller's
    /// own claim, acquired again.
    ///
    /// **Takeovers are told.** A claim whose lease ran out before it was completed or
    /// released (and one an operator released, [`admin`](crate::admin)) is remembered for
    /// the request's [`ttl`](ClaimRequest::ttl) after its lease ended: the claim that takes
    /// such a key answers `taken_over: true`, since the body that claim ran may have had
    /// its effect. A completion, a release and [`remove`](Store::remove) forget it.
    ///
    /// The store keeps the [`claimant`](ClaimRequest::claimant) beside the record if it can
    /// (what an operator's listing shows); one that keeps no such metadata loses nothing
    /// else by ignoring it.
    ///
    /// A store whose claim tokens also grow (each larger than any earlier one of the key)
    /// answers [`fence`](Store::fence) with the claim's own token; one whose tokens only
    /// differ (a random nonce, so that a claim needs no clock) takes a fencing token there.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached or fails; the caller must then not
    /// run the operation.
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error>;

    /// Records `value` as the result of the claim `token`, replayed for `ttl`.
    ///
    /// Returns `Ok(false)`, changing nothing, when the record is no longer in progress under
    /// `token` (released, expired, or taken over).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached or fails; the record is then
    /// unchanged and stays in progress until its lease runs out.
    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error>;

    /// Deletes the in-progress record of claim `token`, so that the next claim runs.
    ///
    /// Returns `Ok(false)`, changing nothing, when the record is not in progress under `token`.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached or fails; the record then stays until
    /// its lease runs out.
    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error>;

    /// Extends the lease of claim `token` to `lease` from now (a heartbeat).
    ///
    /// Returns `Ok(false)`, changing nothing, when the record is not in progress under `token`:
    /// the lease was lost and the holder's result will not be recorded.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached or fails.
    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error>;

    /// The fencing token of the live claim `token`: strictly larger than the fencing token of
    /// every earlier claim of `key` whose holder asked for one, so that downstream writes can
    /// refuse a holder whose lease ran out (`… WHERE fence < $token`). Asking twice under one
    /// claim gives the same token.
    ///
    /// Returns `Ok(None)` when the claim is no longer in progress under `token`. A store
    /// whose claim tokens already grow may return `Ok(Some(token))` without looking: a lapsed
    /// holder then gets its own, smaller token, which downstream fences refuse. There is no
    /// default, so that a wrapper around another store cannot forget to forward it.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached or fails.
    async fn fence(&self, key: &Key, token: Token) -> Result<Option<Token>, Error>;

    /// Records `value` as the step `step` of the call `call`, kept for `ttl`, in **one atomic
    /// conditional write** that succeeds only while `call` is in progress under claim
    /// `token` with a live lease (by the store's clock), as
    /// [`complete`](Store::complete) would. A holder whose lease ran out, or whose call was
    /// taken over, is refused with `Ok(false)` and writes nothing, so the new holder never
    /// replays a step that the old one recorded after losing the key. Recording a step again
    /// under the same claim replaces it.
    ///
    /// A step's key shares its call's first 16 bytes ([`Key::as_bytes`]), so a store whose
    /// keys are ordered finds a call's steps in one range of keys.
    ///
    /// The default refuses with [`Error::Config`]: a store that cannot make this write
    /// atomic must not record steps at all, and a body that runs a step on it fails before
    /// the step's future starts ([`steps`](Store::steps) refuses first).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached or fails; nothing was written, or
    /// the write landed (a lost reply): recording the step again under the same claim is
    /// safe either way.
    async fn record_step(
        &self,
        call: &Key,
        token: Token,
        step: &Key,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        let _ = (call, token, step, value, ttl);
        Err(no_steps(std::any::type_name::<Self>()))
    }

    /// Every live step record of the call `call` ([`record_step`](Store::record_step)), in
    /// one round trip: what a retry of the call replays instead of running.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached or fails; [`Error::Config`] from a
    /// store that does not record steps (the default).
    async fn steps(&self, call: &Key) -> Result<Vec<(Key, Bytes)>, Error> {
        let _ = call;
        Err(no_steps(std::any::type_name::<Self>()))
    }

    /// Deletes the record of `key` whatever its state (an administrative reset), with the
    /// records of its steps, so that the next call runs its body and every step again.
    /// Returns whether there was a record of the call. A holder of a removed claim can no
    /// longer complete it or record a step.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached or fails.
    async fn remove(&self, key: &Key) -> Result<bool, Error>;

    /// Reads the live completed record of `key` without claiming it, in one atomic step.
    /// `Ok(None)`: no live completed record (absent, in progress, expired), or a store that
    /// cannot read without claiming (the default). [`TieredStore`](crate::TieredStore) reads
    /// its fast tier with it, and its durable store for the time a copy may live.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached or fails.
    async fn lookup(&self, key: &Key) -> Result<Option<Recorded>, Error> {
        let _ = key;
        Ok(None)
    }
    /// How long the live in-progress claim of `key` has left before its lease runs out, by
    /// the store's clock: when a call that found the key held ([`Error::InProgress`]) may
    /// come back. The HTTP layer's `409` says it as `Retry-After`. `Ok(None)`: no live
    /// claim (absent, completed, lapsed), or a store that cannot say (the default).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached or fails.
    async fn lease_left(&self, key: &Key) -> Result<Option<Duration>, Error> {
        let _ = key;
        Ok(None)
    }

    /// Who holds the live claim of `key` and how long its lease has left, by the store's
    /// clock: what a call that waits on the key logs. `Ok(None)`: no live claim. The
    /// default asks [`lease_left`](Store::lease_left) and names no holder.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached or fails.
    async fn holding(&self, key: &Key) -> Result<Option<Holding>, Error> {
        Ok(self
            .lease_left(key)
            .await?
            .map(|left| Holding::new(left, None)))
    }

    /// Whether an operator released the claim `token` of `key` ([`admin`](crate::admin)):
    /// its holder, whose completion the store refused, must then not claim the key again to
    /// record its result. The engine asks only then, and a store in this process is told
    /// through its registry of running calls instead. The default answers `false`: a store
    /// that keeps no trace of operators' releases lets a holder in another process than the
    /// operator's record its result on a key no call took since.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached or fails.
    async fn released_by_operator(&self, key: &Key, token: Token) -> Result<bool, Error> {
        let _ = (key, token);
        Ok(false)
    }

    /// The longest one [`claim`](Store::claim) may take on this store (its timeout), if it
    /// bounds its operations. A call that sends its claim again after a failure (a reply
    /// may have been lost after the claim landed) sends it only within this bound, counted
    /// from the first try: the tries share one deadline, so a call during a partition or a
    /// stall fails after this long, not after a multiple of it. `None` (the default): the
    /// tries are not bounded together (a store in this process, which never stalls).
    fn claim_timeout(&self) -> Option<Duration> {
        None
    }

    /// A synchronous look at the record of `key`, for stores that hold their records in
    /// this process and can answer without I/O: `Some(Claim::Completed { .. })` for a live
    /// completed record lets a replay skip [`claim`](Store::claim). Any other answer, and
    /// `None` (the default), mean "ask `claim`". It must never return `Acquired`.
    fn peek(&self, key: &Key) -> Option<Claim> {
        let _ = key;
        None
    }

    /// The registry through which calls in this process share the outcome of a running call
    /// on this store instead of asking the store again. Every handle to the same storage
    /// must return the same registry. `None` (the default) turns in-process coalescing off:
    /// duplicates then poll the store.
    fn flights(&self) -> Option<&Flights> {
        None
    }

    /// Not part of the public API: a store in this process that keeps each result's typed
    /// value beside its encoding, so that a replay needs no decoding. `None` (the default)
    /// for every other store.
    #[doc(hidden)]
    fn typed(&self) -> Option<&dyn TypedStore> {
        None
    }

    /// Starts telling `watch` of every completed record removed from this storage, by any
    /// process (an operator's `idem reset`, a [`remove`](Store::remove) elsewhere), so that
    /// a [`TieredStore`](crate::TieredStore) in front of it forgets its copies at once:
    /// [`Removal::Listening`] once it listens (and again each time it listens after it
    /// lost its feed), each [`Removal::Removed`], and [`Removal::Lost`] when it may have
    /// missed some. It stops when `watch` answers `false`. Called within a tokio runtime.
    ///
    /// `false` (the default): this store cannot tell, and a tier in front of it replays its
    /// copies of a record removed by another process until they expire. PostgreSQL tells,
    /// through `LISTEN`/`NOTIFY`.
    fn watch_removals(&self, watch: RemovalWatch) -> bool {
        let _ = watch;
        false
    }
}

/// What a store tells a tier in front of it ([`Store::watch_removals`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Removal<'a> {
    /// The store listens for removals: from now on, each one is told. Once after a
    /// [`Lost`](Self::Lost), too: whatever the tier copied before may have been removed
    /// meanwhile.
    Listening,
    /// The completed record of this key was removed.
    Removed(&'a Key),
    /// The feed was lost: removals may be missed until the next
    /// [`Listening`](Self::Listening).
    Lost,
}

/// Told of each [`Removal`]; answers whether to go on telling.
pub type RemovalWatch = Arc<dyn Fn(Removal<'_>) -> bool + Send + Sync>;

/// What a store that does not record steps answers: steps need a conditional write that
/// the store does not make, so none runs.
fn no_steps(store: &str) -> Error {
    Error::config(format!(
        "`{store}` does not record steps (`Store::record_step`): a step's record must be one write fenced by its call's claim; run steps on a store that implements it"
    ))
}

/// A claim's nonce ([`ClaimRequest::nonce`]), drawn once per call by the engine and by
/// [`ClaimRequest::new`]: 64 bits from a per-process random key (SipHash) and a counter,
/// so that no two calls of any process draw the same one but by chance, with no
/// random-number crate and no lock.
pub(crate) fn nonce() -> u64 {
    use std::hash::BuildHasher;

    static SOURCE: std::sync::LazyLock<(std::hash::RandomState, std::sync::atomic::AtomicU64)> =
        std::sync::LazyLock::new(Default::default);
    let (keys, counter) = &*SOURCE;
    keys.hash_one(counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// A result's typed value, as a store in this process keeps it beside the encoding.
#[doc(hidden)]
pub type Typed = Arc<dyn Any + Send + Sync>;

/// Not part of the public API: what a store that keeps typed values does besides [`Store`].
#[doc(hidden)]
pub trait TypedStore: Send + Sync {
    /// [`Store::complete`], keeping `typed` beside `value`, in the same step: a replay that
    /// finds this record's encoding finds exactly this value beside it.
    /// A store that completes in memory answers at once; one whose completion goes to
    /// another store first (a tier) answers with a future.
    fn complete_typed<'a>(
        &'a self,
        key: &'a Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
        typed: Typed,
    ) -> TypedCompletion<'a>;

    /// As [`Store::peek`], with the typed value kept beside a live completed record, if any.
    /// `None`: no live completed record.
    fn peek_typed(&self, key: &Key) -> Option<Arc<Kept>>;
}

/// Not part of the public API: a completed record as a store in this process keeps it,
/// shared by every replay that finds it (one reference count, not one per part).
#[doc(hidden)]
pub struct Kept {
    /// The encoding.
    pub(crate) value: Bytes,
    /// The value itself, when the call that recorded it could keep it.
    pub(crate) typed: Option<Typed>,
    pub(crate) fingerprint: Option<Fingerprint>,
}

/// What [`TypedStore::complete_typed`] answers: whether the claim was held, now or once the
/// future is done.
#[doc(hidden)]
pub enum TypedCompletion<'a> {
    Done(bool),
    Pending(Pin<Box<dyn Future<Output = Result<bool, Error>> + Send + 'a>>),
}

impl TypedCompletion<'_> {
    /// Whether the claim was held, awaiting the completion if it is pending.
    pub(crate) async fn landed(self) -> Result<bool, Error> {
        match self {
            Self::Done(held) => Ok(held),
            Self::Pending(completion) => completion.await,
        }
    }
}

/// [`Store::complete`], keeping `typed` beside the record where `store` keeps typed values.
pub(crate) async fn complete_keeping<S: Store + ?Sized>(
    store: &S,
    key: &Key,
    token: Token,
    value: Bytes,
    ttl: Duration,
    typed: Option<Typed>,
) -> Result<bool, Error> {
    match (typed, store.typed()) {
        (Some(typed), Some(keeps)) => {
            keeps
                .complete_typed(key, token, value, ttl, typed)
                .landed()
                .await
        }
        _ => store.complete(key, token, value, ttl).await,
    }
}

macro_rules! forward_store {
    ($($ty:ty),*) => {$(
        #[async_trait]
        impl<S: Store + ?Sized> Store for $ty {
            async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
                (**self).claim(request).await
            }

            async fn complete(
                &self,
                key: &Key,
                token: Token,
                value: Bytes,
                ttl: Duration,
            ) -> Result<bool, Error> {
                (**self).complete(key, token, value, ttl).await
            }

            async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
                (**self).release(key, token).await
            }

            async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
                (**self).renew(key, token, lease).await
            }

            async fn fence(&self, key: &Key, token: Token) -> Result<Option<Token>, Error> {
                (**self).fence(key, token).await
            }

            async fn record_step(
                &self,
                call: &Key,
                token: Token,
                step: &Key,
                value: Bytes,
                ttl: Duration,
            ) -> Result<bool, Error> {
                (**self).record_step(call, token, step, value, ttl).await
            }

            async fn steps(&self, call: &Key) -> Result<Vec<(Key, Bytes)>, Error> {
                (**self).steps(call).await
            }

            async fn remove(&self, key: &Key) -> Result<bool, Error> {
                (**self).remove(key).await
            }

            async fn lookup(&self, key: &Key) -> Result<Option<Recorded>, Error> {
                (**self).lookup(key).await
            }

            async fn lease_left(&self, key: &Key) -> Result<Option<Duration>, Error> {
                (**self).lease_left(key).await
            }

            async fn holding(&self, key: &Key) -> Result<Option<Holding>, Error> {
                (**self).holding(key).await
            }

            async fn released_by_operator(&self, key: &Key, token: Token) -> Result<bool, Error> {
                (**self).released_by_operator(key, token).await
            }
            fn claim_timeout(&self) -> Option<Duration> {
                (**self).claim_timeout()
            }

            fn peek(&self, key: &Key) -> Option<Claim> {
                (**self).peek(key)
            }

            fn flights(&self) -> Option<&Flights> {
                (**self).flights()
            }

            fn typed(&self) -> Option<&dyn TypedStore> {
                (**self).typed()
            }

            fn watch_removals(&self, watch: RemovalWatch) -> bool {
                (**self).watch_removals(watch)
            }
        }
    )*};
}

forward_store!(Arc<S>, Box<S>);
