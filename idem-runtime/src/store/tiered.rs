//! A fast store in front of a durable one: "Redis (or memory) for speed, the database for
//! durability", without serving a stale state.
//!
//! Claims, completions, releases, renewals and fences go to the durable store, which alone
//! decides who runs. The fast tier only ever holds copies of completed records, each for at
//! most the time its durable record has left, and a replay reads it first. Every answer from
//! it carries the record's fingerprint, which the engine checks as it checks the durable
//! store's. A fast tier that fails is skipped: the call goes on against the durable store.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::time::Instant;

mod fresh;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
mod transaction;

use super::{Holding, Kept, Recorded, Typed, TypedCompletion, TypedStore};
use crate::{Claim, ClaimRequest, Error, Fingerprint, Flights, Key, Store, Token};

/// The lease of the claim through which a record is copied into the fast tier. The claim is
/// taken before the durable record is read (a replay) or written (a completion), so that a
/// removal meanwhile refuses the copy; it must outlast that step, or the copy is not made.
/// A process that dies between the claim and the copy leaves it this long; meanwhile the
/// fast tier answers "in progress", which the tier reads as a miss.
const COPY_LEASE: Duration = Duration::from_secs(2);

/// Copies with less time left than this are not made: a store rounds a TTL to its unit
/// (a millisecond on Redis and PostgreSQL), and a copy must never outlive its original.
const SHORTEST_COPY: Duration = Duration::from_millis(5);

/// The grain of a durable store's clock: whole milliseconds.
const CLOCK_GRAIN: Duration = Duration::from_millis(1);

/// How late the fast tier may act on a copy (a preempted thread, a slow round trip) and the
/// copy still die before its durable record: a copy is made this much shorter, and dropped
/// if it was made later than that.
const LATE: Duration = Duration::from_millis(20);

/// How long the fast tier may take over one step before the tier goes on without it
/// (default; [`TieredStore::with_fast_timeout`]).
pub const DEFAULT_FAST_TIMEOUT: Duration = Duration::from_millis(250);

/// How long a removal waits for the fast tier at least: a removal is an administrative
/// step that must not fail for a moment's slowness, only for a tier that is not there.
const REMOVAL_TIMEOUT: Duration = Duration::from_secs(3);

/// How many running claims remember their fingerprint for the copy their completion makes.
/// Past it, a completion reads the fingerprint back from the durable store instead.
const REMEMBERED_CLAIMS: usize = 65_536;

/// A fast store `F` (memory, Redis) in front of a durable store `D` (PostgreSQL, Redis with
/// persistence): replays read `F` first, and everything that decides who runs goes to `D`.
///
/// - Claims, completions, releases, renewals and fences go to `D`.
/// - A completed record is copied into `F` when it is recorded here, and when a replay
///   finds it in `D` (then `D` must say how long it has left: [`Store::lookup`]). A copy
///   lives at most as long as the record in `D` has left, measured from before `D` was
///   asked, so it never outlives it.
/// - `F` never holds an in-progress state of a call: a running call is only ever in `D`.
/// - [`remove`](Store::remove) removes from both, and no copy in flight survives it.
/// - A failing `F` is skipped (logged at `debug`): calls then go to `D` alone.
///
/// - A record removed from `D` by another process (an operator's `idem reset`) is
///   forgotten by every process's `F` when `D` tells its removals
///   ([`Store::watch_removals`]: PostgreSQL, through `LISTEN`/`NOTIFY`): each tier drops
///   its copy as it hears the removal, reads no copy while its feed is lost, and never
///   one made before the feed was lost once it listens again. A `D` that cannot tell
///   (MySQL, SQLite, DynamoDB, Redis) leaves a copy in another process's `F` until it
///   expires: reset through the tier itself in every process, or share one `F` (Redis)
///   and name it to `idem` (`--fast`).
///
/// ```no_run
/// # #[cfg(all(feature = "memory", feature = "postgres"))]
/// # async fn example() -> Result<(), idem_runtime::Error> {
/// use idem_runtime::{MemoryStore, PostgresStore, TieredStore};
///
/// let durable = PostgresStore::connect("postgres://app@127.0.0.1/app").await?;
/// durable.migrate().await?;
/// let store = TieredStore::new(MemoryStore::new(), durable);
/// # Ok(())
/// # }
/// ```
pub struct TieredStore<F, D> {
    fast: Arc<F>,
    durable: D,
    /// What this tier knows of removals made elsewhere.
    fresh: Arc<fresh::Freshness>,
    /// The fingerprint of each claim held through this store, until it completes or is
    /// released: the copy of its record into `F` must carry it.
    claims: Arc<Mutex<Fingerprints>>,
    fast_timeout: Duration,
}

/// The fingerprint each running claim was taken with.
type Fingerprints = HashMap<(Key, Token), Option<Fingerprint>>;

impl<F, D: Clone> Clone for TieredStore<F, D> {
    fn clone(&self) -> Self {
        Self {
            fast: Arc::clone(&self.fast),
            durable: self.durable.clone(),
            fresh: Arc::clone(&self.fresh),
            claims: Arc::clone(&self.claims),
            fast_timeout: self.fast_timeout,
        }
    }
}

impl<F: Store, D: Store> TieredStore<F, D> {
    /// `fast` in front of `durable`.
    pub fn new(fast: F, durable: D) -> Self {
        Self {
            fast: Arc::new(fast),
            durable,
            fresh: Arc::default(),
            claims: Arc::default(),
            fast_timeout: DEFAULT_FAST_TIMEOUT,
        }
    }

    /// The key of `key`'s copy in the fast tier, when a copy may be read or begun now
    /// (the watch of removals elsewhere started, listening, and not forgetting this key).
    fn fast_key(&self, key: &Key) -> Option<Key> {
        self.fresh.start(&self.fast, &self.durable);
        self.fresh.fast_key(key)
    }

    /// [`fast_key`](Self::fast_key), once the durable store's feed of removals listens (a
    /// first call waits for it, within the fast tier's timeout).
    async fn fast_key_heard(&self, key: &Key) -> Option<Key> {
        self.fresh.start(&self.fast, &self.durable);
        self.fresh.first_heard(self.fast_timeout).await;
        self.fresh.fast_key(key)
    }

    /// Sets how long the fast tier may take over one step (a read, a copy) before the tier
    /// goes on without it (default [`DEFAULT_FAST_TIMEOUT`]): a stalled fast tier then
    /// costs a call this long at most, not its own store's timeout. A removal waits for it
    /// longer (at least 3 s), and fails if it does not answer, as when it fails.
    #[must_use]
    pub fn with_fast_timeout(mut self, timeout: Duration) -> Self {
        self.fast_timeout = timeout;
        self
    }

    /// One step on the fast tier, within its timeout.
    async fn on_fast<T>(
        &self,
        step: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        within(self.fast_timeout, step).await
    }

    /// The fast tier.
    pub fn fast(&self) -> &F {
        &self.fast
    }

    /// The durable store.
    pub fn durable(&self) -> &D {
        &self.durable
    }

    /// Runs `forget`, the durable store's forgetting of `key`, between two removals of its
    /// copy from the fast tier (see [`remove`](Store::remove)): whether the first removal
    /// found a copy, and what `forget` answered. A fast tier that fails (or does not answer
    /// within 3 s, or the fast timeout if longer) is an error.
    async fn forgetting<T>(
        &self,
        key: &Key,
        forget: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<(bool, T), Error> {
        let bound = self.fast_timeout.max(REMOVAL_TIMEOUT);
        let copied = within(bound, self.fast.remove(&self.fresh.mapped(key))).await?;
        let forgotten = forget.await?;
        within(bound, self.fast.remove(&self.fresh.mapped(key))).await?;
        Ok((copied, forgotten))
    }

    /// The fast tier's live completed record of `key`; `None` when it has none, or fails,
    /// or may not be read now.
    async fn read_fast(&self, key: &Key) -> Option<Recorded> {
        let key = &self.fast_key_heard(key).await?;
        if let Some(Claim::Completed { value, fingerprint }) = self.fast.peek(key) {
            return Some(Recorded::new(value, fingerprint, None));
        }
        self.on_fast(self.fast.lookup(key))
            .await
            .unwrap_or_else(|err| {
                tracing::debug!(error = %err, "the fast tier failed; reading the durable store");
                None
            })
    }

    /// Starts a copy into the fast tier: claims the key there, before the durable record
    /// is read or written. A removal meanwhile deletes this claim, so the copy's completion
    /// is refused: whatever the durable store said before the removal is never copied after
    /// it. `None` when a copy is there already, being made, may not be made now, or the
    /// fast tier fails; else the copy's key in the fast tier and its claim's token.
    async fn begin_copy(
        &self,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
    ) -> Option<(Key, Token)> {
        let key = &self.fast_key_heard(key).await?;
        let began = self
            .on_fast(async {
                // A copy's claim that lapses (its process died) need not be remembered.
                let request = ClaimRequest::new(key, COPY_LEASE)
                    .fingerprint(fingerprint)
                    .ttl(COPY_LEASE);
                let mut claim = self.fast.claim(&request).await?;
                if matches!(&claim, Claim::Completed { value, .. } if value[..] == *crate::codec::GONE)
                {
                    // The fast tier lost its copy and kept a mark: the durable record is
                    // whole, so the copy is made again.
                    self.fast.remove(key).await?;
                    claim = self.fast.claim(&request).await?;
                }
                Ok(match claim {
                    Claim::Acquired { token, .. } => Some((*key, token)),
                    Claim::Completed { .. } | Claim::InProgress { .. } => None,
                })
            })
            .await;
        began.unwrap_or_else(|err| {
            tracing::debug!(error = %err, "claiming a copy in the fast tier failed");
            None
        })
    }

    /// Ends a copy begun under `token` (at `key`, its key in the fast tier) with the
    /// durable record's value (and its typed value, when this process made it and the fast
    /// tier keeps one), to expire by `expires` (never later than the durable record).
    /// Refused when a removal came since the copy began; a failure leaves the fast tier
    /// without it, nothing more.
    async fn finish_copy(
        &self,
        (key, token): (Key, Token),
        value: Bytes,
        typed: Option<Typed>,
        expires: Instant,
    ) {
        // A grain early: durable stores count time in whole milliseconds, so `expires` may be
        // a fraction of one past the record's end; the copy must never outlive it.
        let sent = Instant::now();
        let ttl = expires
            .saturating_duration_since(sent)
            .saturating_sub(CLOCK_GRAIN + LATE);
        if ttl < SHORTEST_COPY {
            self.abandon_copy((key, token)).await;
            return;
        }
        let key = &key;
        let copied = super::complete_keeping(&*self.fast, key, token, value, ttl, typed);
        match self.on_fast(copied).await {
            // The fast tier counts the TTL from when it acts, anywhere between `sent` and
            // now: a copy made later than the allowance could outlive the durable record.
            // It is dropped at once, while the durable record still lives; the next replay
            // copies it again.
            Ok(true) if sent.elapsed() > CLOCK_GRAIN + LATE => {
                let _ = self.on_fast(self.fast.remove(key)).await;
            }
            Ok(_) => {}
            Err(err) => {
                tracing::debug!(error = %err, "copying a record into the fast tier failed");
                self.abandon_copy((*key, token)).await;
            }
        }
    }

    /// Copies the durable record of `key`, found completed with `fingerprint`, into the
    /// fast tier: worth two more round trips once per key, for the next replays are the
    /// fast tier's. Only a durable store that says how long the record has left is copied
    /// from, and only what it holds once the copy has begun.
    async fn copy(&self, key: &Key, fingerprint: Option<&Fingerprint>) {
        let Some(copy) = self.begin_copy(key, fingerprint).await else {
            return;
        };
        let asked = Instant::now();
        match self.durable.lookup(key).await {
            Ok(Some(Recorded {
                value,
                fingerprint: recorded,
                expires_in: Some(left),
                ..
            })) if recorded.as_ref() == fingerprint => {
                self.finish_copy(copy, value, None, asked + left).await;
            }
            _ => self.abandon_copy(copy).await,
        }
    }

    /// Gives up a copy begun under `token` at `key` (its key in the fast tier): frees it at
    /// once, or at the end of the copy's short lease.
    async fn abandon_copy(&self, (key, token): (Key, Token)) {
        let _ = self.on_fast(self.fast.release(&key, token)).await;
    }

    /// [`Store::complete`], and the copy, with `typed` beside it if there is one.
    async fn complete_and_copy(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        typed: Option<Typed>,
        ttl: Duration,
    ) -> Result<bool, Error> {
        // Only a claim whose fingerprint is remembered is copied (past REMEMBERED_CLAIMS,
        // the first replay copies it). The copy begins before the durable record is
        // written, so that a removal from here on refuses it.
        let remembered = self.claims().remove(&(*key, token));
        let copy = match &remembered {
            Some(fingerprint) => self.begin_copy(key, fingerprint.as_ref()).await,
            None => None,
        };
        // The durable record expires `ttl` after the durable store acts, which is after now.
        let expires = Instant::now() + crate::limits::clamp(ttl);
        let completed = self.durable.complete(key, token, value.clone(), ttl).await;
        match (copy, &completed) {
            (Some(copy), Ok(true)) => self.finish_copy(copy, value, typed, expires).await,
            (Some(copy), _) => self.abandon_copy(copy).await,
            (None, _) => {}
        }
        completed
    }

    fn claims(&self) -> std::sync::MutexGuard<'_, Fingerprints> {
        self.claims.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `step`, failed with [`Error::Store`] if it takes longer than `timeout`.
async fn within<T>(
    timeout: Duration,
    step: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(timeout, step)
        .await
        .unwrap_or_else(|_| {
            Err(Error::store(format!(
                "the fast tier did not answer within {timeout:?}"
            )))
        })
}

#[async_trait]
impl<F: Store, D: Store> Store for TieredStore<F, D> {
    /// The fast tier's copy answers a replay; claims go to the durable store, which keeps
    /// whose they are, recognises a claim whose reply was lost, and remembers claims that
    /// lapsed.
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        let key = request.key;
        if let Some(copy) = self.read_fast(key).await {
            return Ok(Claim::Completed {
                value: copy.value,
                fingerprint: copy.fingerprint,
            });
        }
        let claim = self.durable.claim(request).await?;
        match &claim {
            Claim::Acquired { token, .. } => {
                let mut claims = self.claims();
                if claims.len() < REMEMBERED_CLAIMS {
                    claims.insert((*key, *token), request.fingerprint.copied());
                }
            }
            Claim::Completed { fingerprint, .. } => self.copy(key, fingerprint.as_ref()).await,
            Claim::InProgress { .. } => {}
        }
        Ok(claim)
    }

    async fn holding(&self, key: &Key) -> Result<Option<Holding>, Error> {
        self.durable.holding(key).await
    }

    async fn released_by_operator(&self, key: &Key, token: Token) -> Result<bool, Error> {
        self.durable.released_by_operator(key, token).await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.complete_and_copy(key, token, value, None, ttl).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        // A claim being released is never completed: its fingerprint is not needed again,
        // whether this attempt succeeds or the claim lapses.
        self.claims().remove(&(*key, token));
        self.durable.release(key, token).await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        self.durable.renew(key, token, lease).await
    }

    async fn fence(&self, key: &Key, token: Token) -> Result<Option<Token>, Error> {
        self.durable.fence(key, token).await
    }

    /// The durable store's: a step is recorded where its call's claim is.
    async fn record_step(
        &self,
        call: &Key,
        token: Token,
        step: &Key,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.durable
            .record_step(call, token, step, value, ttl)
            .await
    }

    /// The durable store's: the fast tier never holds a step.
    async fn steps(&self, call: &Key) -> Result<Vec<(Key, Bytes)>, Error> {
        self.durable.steps(call).await
    }

    /// Removes the record from both tiers: the fast one before and after the durable one.
    /// A copy in flight meanwhile holds a claim in the fast tier taken before it read or
    /// wrote the durable record; the first removal deletes that claim and refuses the copy,
    /// or the copy read the durable store after it was emptied and has nothing to copy, or
    /// it landed before the second removal. No copy outlives a removal that returned.
    /// A fast tier that fails (or does not answer within 3 s, or the fast timeout if
    /// longer) is an error here, unlike everywhere else: a removal that left a copy behind
    /// would go on replaying what was reset.
    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        let (fast, durable) = self.forgetting(key, self.durable.remove(key)).await?;
        Ok(durable || fast)
    }

    async fn lookup(&self, key: &Key) -> Result<Option<Recorded>, Error> {
        match self.read_fast(key).await {
            Some(copy) => Ok(Some(copy)),
            None => self.durable.lookup(key).await,
        }
    }

    /// The durable store's: claims live there alone.
    async fn lease_left(&self, key: &Key) -> Result<Option<Duration>, Error> {
        self.durable.lease_left(key).await
    }

    /// A completed copy in a fast tier that answers without I/O (memory): a replay then
    /// takes no round trip at all.
    fn peek(&self, key: &Key) -> Option<Claim> {
        self.fast
            .peek(&self.fast_key(key)?)
            .filter(|claim| matches!(claim, Claim::Completed { .. }))
    }

    /// The durable store's: that is where calls run.
    /// The durable store's, after the fast tier's look.
    fn claim_timeout(&self) -> Option<Duration> {
        self.durable
            .claim_timeout()
            .map(|durable| durable + self.fast_timeout)
    }

    fn flights(&self) -> Option<&Flights> {
        self.durable.flights()
    }

    /// This tier, when its fast tier keeps typed values.
    fn typed(&self) -> Option<&dyn TypedStore> {
        self.fast.typed().map(|_| self as &dyn TypedStore)
    }
}

/// An operator's view of a tier: its durable store's records, which alone decide who runs
/// (the fast tier holds copies of completed ones, nothing else). A reset forgets the call
/// in both tiers, so that no copy replays what was reset.
#[cfg(feature = "admin")]
#[async_trait]
impl<F: Store, D: Store + crate::admin::Admin> crate::admin::Admin for TieredStore<F, D> {
    async fn list(
        &self,
        filter: &crate::admin::Filter,
        after: Option<&crate::admin::Cursor>,
    ) -> Result<crate::admin::Page, Error> {
        self.durable.list(filter, after).await
    }

    async fn inspect(&self, key: &Key) -> Result<Option<crate::admin::Entry>, Error> {
        self.durable.inspect(key).await
    }

    async fn look(&self, key: &Key) -> Result<Option<crate::admin::Entry>, Error> {
        self.durable.look(key).await
    }

    /// The durable store's: claims live there alone. A reset's (`forget`) goes between two
    /// removals of the copy, as [`remove`](Store::remove)'s does, so that no copy begun
    /// meanwhile survives it. A release's fence reaches the holders of this process too,
    /// whose registry of running calls is the durable store's.
    async fn end_claim(
        &self,
        entry: &crate::admin::Entry,
        token: Token,
        how: crate::admin::Release,
        forget: bool,
    ) -> Result<crate::admin::Ending, Error> {
        let ended = self.durable.end_claim(entry, token, how, forget);
        if !forget {
            return ended.await;
        }
        Ok(self.forgetting(entry.key(), ended).await?.1)
    }

    /// The durable store's, between two removals of the copy, as
    /// [`remove`](Store::remove)'s: a copy replays nothing that was reset.
    async fn forget_call(
        &self,
        entry: &crate::admin::Entry,
    ) -> Result<crate::admin::Ending, Error> {
        let forgotten = self.durable.forget_call(entry);
        Ok(self.forgetting(entry.key(), forgotten).await?.1)
    }

    /// The durable store's expired records; copies expire by themselves, before their
    /// records.
    async fn purge(&self) -> Result<u64, Error> {
        self.durable.purge().await
    }
}

/// A fast tier that keeps typed values (memory) keeps them for the copies of records
/// completed through this process, so that their replays decode nothing; a copy made from a
/// replay of the durable record is kept encoded.
impl<F: Store, D: Store> TypedStore for TieredStore<F, D> {
    fn complete_typed<'a>(
        &'a self,
        key: &'a Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
        typed: Typed,
    ) -> TypedCompletion<'a> {
        TypedCompletion::Pending(Box::pin(self.complete_and_copy(
            key,
            token,
            value,
            Some(typed),
            ttl,
        )))
    }

    fn peek_typed(&self, key: &Key) -> Option<Arc<Kept>> {
        self.fast.typed()?.peek_typed(&self.fast_key(key)?)
    }
}

impl<F: std::fmt::Debug, D: std::fmt::Debug> std::fmt::Debug for TieredStore<F, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieredStore")
            .field("fast", &self.fast)
            .field("durable", &self.durable)
            .field("fast_timeout", &self.fast_timeout)
            .finish()
    }
}
