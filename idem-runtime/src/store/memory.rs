//! The embedded in-memory store, on `moka`.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use moka::policy::EvictionPolicy;
use moka::sync::Cache;
use moka::Expiry;
use tokio::time::Instant;

use crate::key::KeyHasher;
use crate::namespace::Namespace;
use crate::store::{Claimant, Holder, Holding, Kept, Recorded, Typed, TypedCompletion, TypedStore};
use crate::{limits, Claim, ClaimRequest, Error, Fingerprint, Flights, Key, Store, Token};

#[cfg(feature = "admin")]
mod admin;
mod marks;
mod steps;

use marks::{Marked, Marks};
use steps::Steps;

/// The default number of completed results a [`MemoryStore`] keeps.
pub const DEFAULT_CAPACITY: u64 = 100_000;

/// The default bound on the bytes of the completed results a [`MemoryStore`] keeps: 256 MiB.
pub const DEFAULT_MAX_BYTES: u64 = 256 * 1024 * 1024;

/// What a result costs beyond its value: its key, fingerprint, TTL and the cache's entry.
const ENTRY_OVERHEAD: u64 = 160;

/// The default bound on the bytes of the marks of completed keys a [`MemoryStore`] keeps
/// so that an evicted result answers [`Error::Gone`]: 64 MiB, 262 144 marks, more than the
/// [`DEFAULT_CAPACITY`] results the store keeps.
pub const DEFAULT_MAX_MARK_BYTES: u64 = 64 * 1024 * 1024;

/// What the mark of a completed key is counted for against
/// [`max_mark_bytes`](MemoryStoreBuilder::max_mark_bytes): its key, fingerprint and end in
/// its shard's map and its place in the shard's order, measured at 224 heap bytes
/// (`tests/calls/gone.rs::bytes_of_marks`).
pub const MARK_BYTES: u64 = 256;

/// An in-process store: claims and results live in this process's memory.
///
/// It de-duplicates calls within one process and is the default store. Use a shared store
/// (Redis, PostgreSQL) when several processes serve the same keys.
///
/// Claims in progress are never evicted. Completed results are kept for their TTL, within
/// two bounds: at most [`capacity`](MemoryStoreBuilder::capacity) results, and at most
/// [`max_bytes`](MemoryStoreBuilder::max_bytes) of them (256 MiB by default, whatever the
/// size of each result, so that large results cannot take a service's memory). Past either
/// bound the least recently recorded or replayed results are evicted first (LRU), so the
/// newest results are always kept.
///
/// **An evicted result never runs again silently.** Every completed key also leaves a
/// small mark (its fingerprint and TTL, [`MARK_BYTES`] each, within
/// [`max_mark_bytes`](MemoryStoreBuilder::max_mark_bytes)) for its TTL: a call with a key
/// whose result was evicted, or was larger than `max_bytes` on its own and never kept,
/// gets [`Error::Gone`] (`410` over HTTP), not a second run. The bound holds for the whole
/// store: up to it, no completed key runs again within its TTL. At the bound (every mark
/// live), a new mark is not kept: that key is then protected by its result alone, the
/// newest in the results' order, and runs again only if that is evicted within its TTL.
/// The marks kept are never pushed out, so a rerun never costs another key its mark (no
/// cascade: at most one rerun per mark not kept). Each mark not kept is counted
/// ([`marks_dropped`](MemoryStore::marks_dropped)) and logged (`warn!`). [`rerun_evicted`](MemoryStoreBuilder::rerun_evicted) turns the
/// marks off: an evicted key then runs again.
///
/// A call's steps ([`step`](crate::step())) are kept beside its record, for the call's TTL,
/// for at most [`capacity`](MemoryStoreBuilder::capacity) calls (past it the least recently
/// used call's steps go, and its next attempt runs them again under the same
/// `attempt().key()`).
///
/// Leases follow `tokio::time`, so `tokio::time::pause` drives their expiry in tests. Result
/// TTLs follow the cache's own clock (real time): a replay then reads no clock at all.
///
/// A result recorded by an `#[idempotent]` function whose success type is `Clone` is kept
/// twice: encoded, as every store keeps it, and as the value itself, so that a replay hands
/// back a clone instead of decoding. The value kept is the encoding decoded (which recording
/// does anyway, to check that the result replays as itself), so a replay from memory is
/// exactly what a replay from the encoding is, down to a field `serde` skips. Both are kept
/// in one step, and the bytes bound counts such a result twice (the encoding's length
/// standing for the value's).
///
/// Cloning is cheap and every clone shares the same records.
///
/// ```
/// use idem_runtime::MemoryStore;
///
/// let store = MemoryStore::builder().capacity(10_000).build();
/// let same_records = store.clone();
/// # drop(same_records);
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// In-progress claims, by shard of the key: never evicted, only swept once lapsed.
    claims: [Mutex<Claims>; SHARDS],
    /// Completed results: bounded, expiring after their TTL.
    results: Cache<Key, ResultRecord, KeyHasher>,
    /// The recorded steps of calls, by call.
    steps: Steps,
    /// The marks of completed keys, within one bound for the store. Locked after a shard's
    /// claims, never before.
    marks: Mutex<Marks>,
    /// How many marks of completed keys the store keeps at most; `None` with
    /// [`MemoryStoreBuilder::rerun_evicted`]: no marks.
    marks_bound: Option<usize>,
    /// Marks not kept over their bound.
    marks_dropped: Arc<AtomicU64>,
    /// The last token handed out; one counter for all keys makes every key's tokens grow.
    tokens: AtomicU64,
    capacity: u64,
    max_bytes: u64,
    flights: Flights,
}

const SHARDS: usize = 64;

/// The claims of one shard. A lapsed claim stays for its call's TTL after its lease ran
/// out, so that the claim that takes its key over is told; claims past that are swept
/// whenever the shard has doubled since the last sweep, which keeps the cost of sweeping
/// constant per claim.
#[derive(Default)]
struct Claims {
    live: HashMap<Key, ClaimRecord, KeyHasher>,
    sweep_at: usize,
}

impl Claims {
    fn insert(&mut self, key: Key, claim: ClaimRecord, now: Instant) {
        self.live.insert(key, claim);
        if self.live.len() >= self.sweep_at {
            self.live.retain(|_, claim| claim.remembered(now));
            self.sweep_at = (self.live.len() * 2).max(64);
        }
    }

    /// The live claim of `key` held with `token`.
    fn held(&mut self, key: &Key, token: Token, now: Instant) -> Option<&mut ClaimRecord> {
        self.live
            .get_mut(key)
            .filter(|claim| claim.token == token && claim.until > now)
    }
}

struct ClaimRecord {
    token: Token,
    fingerprint: Option<Fingerprint>,
    until: Instant,
    /// How long the claim is remembered once its lease ran out: its call's TTL.
    ttl: Duration,
    /// Whose the claim is, for an operator (`idem_runtime::admin`); the holder is this
    /// process.
    about: About,
}

impl ClaimRecord {
    /// Whether the claim is live, or lapsed within its call's TTL: a claim that was never
    /// settled, which the next claim of its key takes over knowingly.
    fn remembered(&self, now: Instant) -> bool {
        self.until.checked_add(self.ttl).is_none_or(|end| end > now)
    }
}

/// What a record says of itself: its operation and, if its caller chose one, a label.
/// Read by [`Admin`](crate::admin::Admin) only.
#[derive(Clone, Default)]
#[cfg_attr(not(feature = "admin"), allow(dead_code))]
struct About {
    namespace: Option<Namespace>,
    label: Option<Arc<str>>,
    lease: Duration,
}

impl About {
    fn of(claimant: &Claimant<'_>, lease: Duration) -> Self {
        Self {
            namespace: claimant.kept(),
            label: claimant.label().map(Arc::from),
            lease,
        }
    }
}

/// A completed result: what a replay takes, shared, and how long it lives.
#[derive(Clone)]
#[cfg_attr(not(feature = "admin"), allow(dead_code))]
struct ResultRecord {
    kept: Arc<Kept>,
    ttl: Duration,
    /// When the record ends, by the leases' clock (what a listing says is left).
    until: Instant,
    about: About,
}

impl ResultRecord {
    /// What the record weighs against [`MemoryStoreBuilder::max_bytes`].
    fn bytes(&self) -> u64 {
        weight(&self.kept.value, self.kept.typed.is_some())
    }

    fn into_claim(self) -> Claim {
        Claim::Completed {
            value: self.kept.value.clone(),
            fingerprint: self.kept.fingerprint,
        }
    }
}

/// What a result weighs: its encoding, and as much again for a typed value kept beside it
/// (its heap size is not known; the encoding's length stands for it).
fn weight(value: &Bytes, typed: bool) -> u64 {
    let copies = if typed { 2 } else { 1 };
    value.len() as u64 * copies + ENTRY_OVERHEAD
}

/// How long moka keeps a result: its TTL. Moka never returns an expired entry, so this is
/// also what judges a result live.
struct Lifetime;

impl Expiry<Key, ResultRecord> for Lifetime {
    fn expire_after_create(
        &self,
        _: &Key,
        value: &ResultRecord,
        _: std::time::Instant,
    ) -> Option<Duration> {
        Some(value.ttl)
    }

    fn expire_after_update(
        &self,
        _: &Key,
        value: &ResultRecord,
        _: std::time::Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(value.ttl)
    }
}

impl MemoryStore {
    /// A store that keeps up to [`DEFAULT_CAPACITY`] completed results.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Configures a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            capacity: DEFAULT_CAPACITY,
            max_bytes: DEFAULT_MAX_BYTES,
            max_mark_bytes: Some(DEFAULT_MAX_MARK_BYTES),
        }
    }

    /// How many marks of completed keys were not kept, the store's marks being at their
    /// bound: keys protected by their result alone, which run again if it is evicted
    /// within their TTL. Zero unless
    /// [`max_mark_bytes`](MemoryStoreBuilder::max_mark_bytes) is too small for the keys the
    /// store completes within a TTL; each one is also a `warn!` event.
    pub fn marks_dropped(&self) -> u64 {
        self.inner.marks_dropped.load(Ordering::Relaxed)
    }

    /// The live result of `key`. Completed records never change, so reading one outside
    /// the key's lock is safe.
    fn live_result(&self, key: &Key) -> Option<ResultRecord> {
        self.inner.results.get(key)
    }

    /// Claims `key`: its record, the claim in progress, its mark, or a new claim. No
    /// look outside the lock first: every call through the engine has just looked for a
    /// record at hand ([`Store::peek`], [`TypedStore::peek_typed`]), so a key that comes
    /// here is all but always new.
    fn take(&self, request: &ClaimRequest<'_>) -> Claim {
        let key = request.key;
        let now = Instant::now();
        let mut claims = self.claims(key);
        // Under the lock: `complete` moves a claim to the results under the same lock, so a
        // result that landed since the caller looked is seen here.
        if self.inner.results.contains_key(key) {
            if let Some(done) = self.live_result(key) {
                return done.into_claim();
            }
        }
        let lapsed = match claims.live.get(key) {
            Some(claim) if claim.until > now => {
                return Claim::InProgress {
                    fingerprint: claim.fingerprint,
                };
            }
            Some(claim) => claim.remembered(now),
            None => false,
        };
        // Completed within its TTL, but its result is gone: never run again.
        if let Some(mark) = self.marks().get(key, now) {
            return mark.into_claim();
        }
        let token = Token::new(self.inner.tokens.fetch_add(1, Ordering::Relaxed) + 1);
        let lease = limits::clamp(request.lease);
        let claim = ClaimRecord {
            token,
            fingerprint: request.fingerprint.copied(),
            until: now + lease,
            ttl: limits::clamp(request.ttl),
            about: About::of(&request.claimant, lease),
        };
        claims.insert(*key, claim, now);
        Claim::Acquired {
            token,
            taken_over: lapsed,
        }
    }

    /// Completes the claim `token` of `key` with `value` (and its typed value): whether the
    /// claim was held.
    fn record(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        typed: Option<Typed>,
        ttl: Duration,
    ) -> bool {
        let now = Instant::now();
        let mut claims = self.claims(key);
        let Some(claim) = claims.held(key, token, now) else {
            return false;
        };
        let ttl = limits::clamp(ttl);
        // Kept encoded only if both copies do not fit: the one copy may, its replays decode.
        let typed = typed.filter(|_| weight(&value, true) <= self.inner.max_bytes);
        let record = ResultRecord {
            kept: Arc::new(Kept {
                value,
                typed,
                fingerprint: claim.fingerprint,
            }),
            ttl,
            until: now + ttl,
            // Moved, not cloned: the claim goes below, on every path.
            about: std::mem::take(&mut claim.about),
        };
        // The mark first: from here on the key answers, whatever becomes of its result.
        let mut marked = false;
        if let Some(bound) = self.inner.marks_bound {
            let until = now + record.ttl;
            let kept = self
                .marks()
                .insert(*key, record.kept.fingerprint, until, bound, now);
            marked = kept == Marked::Kept;
            if !marked {
                let total = self.inner.marks_dropped.fetch_add(1, Ordering::Relaxed) + 1;
                tracing::warn!(
                    key = %key.short(),
                    dropped = total,
                    "the memory store's marks are at their bound: this key runs again if its result is evicted within its TTL; raise `max_mark_bytes`"
                );
            }
        }
        if record.bytes() > self.inner.max_bytes {
            claims.live.remove(key);
            if marked {
                tracing::warn!(
                    outcome = "unrecorded",
                    bytes = record.bytes(),
                    max_bytes = self.inner.max_bytes,
                    "the result is larger than the memory store's `max_bytes`: not kept; its key answers `Gone`"
                );
            } else {
                tracing::warn!(
                    outcome = "unrecorded",
                    bytes = record.bytes(),
                    max_bytes = self.inner.max_bytes,
                    "the result is larger than the memory store's `max_bytes`: not recorded, the key is released"
                );
            }
            return true;
        }
        // The result is visible before the claim goes, and both under the key's lock.
        self.inner.results.insert(*key, record);
        claims.live.remove(key);
        true
    }

    /// The claims of `key`'s shard, locked. Every step that moves a key between the claims
    /// and the results holds it, so each is atomic.
    fn claims(&self, key: &Key) -> MutexGuard<'_, Claims> {
        // The key is a sha256 digest already: any byte of it is uniformly distributed.
        let shard = &self.inner.claims[usize::from(key.as_bytes()[1]) % SHARDS];
        shard.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The marks of completed keys, locked; taken under a shard's lock, never the reverse.
    fn marks(&self) -> MutexGuard<'_, Marks> {
        self.inner
            .marks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("capacity", &self.inner.capacity)
            .field("max_bytes", &self.inner.max_bytes)
            .field("results", &self.inner.results.entry_count())
            .finish()
    }
}

/// Builds a [`MemoryStore`]; from [`MemoryStore::builder`].
#[derive(Clone, Debug)]
#[must_use]
pub struct MemoryStoreBuilder {
    capacity: u64,
    max_bytes: u64,
    /// `None`: no marks ([`rerun_evicted`](Self::rerun_evicted)).
    max_mark_bytes: Option<u64>,
}

impl MemoryStoreBuilder {
    /// The number of completed results to keep at most (default [`DEFAULT_CAPACITY`]).
    /// Claims in progress do not count and are never evicted.
    pub fn capacity(mut self, results: u64) -> Self {
        self.capacity = results;
        self
    }

    /// The bytes of completed results to keep at most, values and their bookkeeping
    /// (default [`DEFAULT_MAX_BYTES`]). A single result larger than this is not recorded.
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// The bytes of marks of completed keys to keep at most (default
    /// [`DEFAULT_MAX_MARK_BYTES`], [`MARK_BYTES`] a mark): enough for every key the store
    /// completes within a TTL, so that each evicted result answers
    /// [`Error::Gone`] rather than running again.
    pub fn max_mark_bytes(mut self, bytes: u64) -> Self {
        self.max_mark_bytes = Some(bytes);
        self
    }

    /// Keeps no marks: a call whose result was evicted, or was too large to keep, runs the
    /// body **again** instead of answering [`Error::Gone`]. Only for
    /// operations whose effects are safe to repeat.
    pub fn rerun_evicted(mut self) -> Self {
        self.max_mark_bytes = None;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        // Both bounds in one weight: every result weighs its bytes, and at least the
        // share of `max_bytes` that one of `capacity` results may take, so that the cache's
        // bound on the total weight, `max_bytes`, keeps the count within `capacity` too.
        let max_bytes = self.max_bytes.max(1);
        let floor = max_bytes / self.capacity.max(1);
        let results = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(move |_: &Key, record: &ResultRecord| {
                u32::try_from(record.bytes().max(floor)).unwrap_or(u32::MAX)
            })
            // Retries come for the newest results: keep them, never admit by
            // frequency (moka's default would turn new keys away at capacity).
            .eviction_policy(EvictionPolicy::lru())
            .expire_after(Lifetime)
            .build_with_hasher(KeyHasher::default());
        let marks_bound = self.max_mark_bytes.map(|bytes| {
            usize::try_from(bytes / MARK_BYTES)
                .unwrap_or(usize::MAX)
                .max(1)
        });
        MemoryStore {
            inner: Arc::new(Inner {
                claims: std::array::from_fn(|_| Mutex::default()),
                results,
                steps: Steps::new(self.capacity),
                marks: Mutex::default(),
                marks_bound,
                marks_dropped: Arc::new(AtomicU64::new(0)),
                tokens: AtomicU64::new(0),
                capacity: self.capacity,
                max_bytes,
                flights: Flights::default(),
            }),
        }
    }
}

#[async_trait]
impl Store for MemoryStore {
    /// A claim in this process never loses its reply, so the nonce is not needed.
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        Ok(self.take(request))
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        Ok(self.record(key, token, value, None, ttl))
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        let now = Instant::now();
        let mut claims = self.claims(key);
        if claims.held(key, token, now).is_none() {
            return Ok(false);
        }
        claims.live.remove(key);
        Ok(true)
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        let now = Instant::now();
        let mut claims = self.claims(key);
        Ok(claims
            .held(key, token, now)
            .map(|claim| claim.until = now + limits::clamp(lease))
            .is_some())
    }

    /// Claim tokens already grow here (one counter per store): the claim's own token is its
    /// fencing token.
    async fn fence(&self, _: &Key, token: Token) -> Result<Option<Token>, Error> {
        Ok(Some(token))
    }

    async fn record_step(
        &self,
        call: &Key,
        token: Token,
        step: &Key,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        let now = Instant::now();
        let mut claims = self.claims(call);
        if claims.held(call, token, now).is_none() {
            return Ok(false);
        }
        self.inner
            .steps
            .record(call, step, value, limits::clamp(ttl));
        Ok(true)
    }

    async fn steps(&self, call: &Key) -> Result<Vec<(Key, Bytes)>, Error> {
        Ok(self.inner.steps.of(call))
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        let now = Instant::now();
        let mut claims = self.claims(key);
        self.inner.steps.remove(key);
        let claim = claims.live.remove(key).filter(|claim| claim.until > now);
        let result = self.inner.results.remove(key);
        let marked = self.marks().remove(key);
        Ok(claim.is_some() || result.is_some() || marked)
    }

    /// Its records' remaining TTL is not known here: `expires_in` is `None`.
    ///
    /// A key whose result is gone but whose mark is kept has no live completed record here
    /// (`None`): a [`TieredStore`](crate::TieredStore) over this one as its fast tier then
    /// reads its durable store, which has the result.
    async fn lookup(&self, key: &Key) -> Result<Option<Recorded>, Error> {
        Ok(self
            .live_result(key)
            .map(|record| Recorded::new(record.kept.value.clone(), record.kept.fingerprint, None)))
    }

    async fn lease_left(&self, key: &Key) -> Result<Option<Duration>, Error> {
        let now = Instant::now();
        let claims = self.claims(key);
        Ok(claims
            .live
            .get(key)
            .and_then(|claim| claim.until.checked_duration_since(now))
            .filter(|left| !left.is_zero()))
    }

    /// Every claim here is this process's.
    async fn holding(&self, key: &Key) -> Result<Option<Holding>, Error> {
        Ok(self
            .lease_left(key)
            .await?
            .map(|left| Holding::new(left, Some(Holder::this_process().clone()))))
    }

    fn peek(&self, key: &Key) -> Option<Claim> {
        self.live_result(key).map(ResultRecord::into_claim)
    }

    fn flights(&self) -> Option<&Flights> {
        Some(&self.inner.flights)
    }

    fn typed(&self) -> Option<&dyn TypedStore> {
        Some(self)
    }
}

impl TypedStore for MemoryStore {
    fn complete_typed<'a>(
        &'a self,
        key: &'a Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
        typed: Typed,
    ) -> TypedCompletion<'a> {
        TypedCompletion::Done(self.record(key, token, value, Some(typed), ttl))
    }

    fn peek_typed(&self, key: &Key) -> Option<Arc<Kept>> {
        self.live_result(key).map(|record| record.kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(until: Instant) -> ClaimRecord {
        ClaimRecord {
            token: Token::new(1),
            fingerprint: None,
            until,
            ttl: Duration::ZERO,
            about: About::default(),
        }
    }

    #[tokio::test]
    async fn a_typed_result_weighs_twice_and_is_kept_encoded_when_twice_does_not_fit() {
        let store = MemoryStore::builder()
            .max_bytes(ENTRY_OVERHEAD + 150)
            .build();
        let typed = || -> Typed { Arc::new(7_u64) };
        let (small, large) = (
            Key::derive("typed", &1).unwrap(),
            Key::derive("typed", &2).unwrap(),
        );
        let mut kept = Vec::new();
        for (key, len) in [(&small, 70), (&large, 100)] {
            let Ok(Claim::Acquired { token, .. }) = store
                .claim(&ClaimRequest::new(key, Duration::from_secs(60)))
                .await
            else {
                panic!("a fresh key is acquired");
            };
            let value = Bytes::from(vec![b'7'; len]);
            let completed =
                store.complete_typed(key, token, value, Duration::from_secs(60), typed());
            assert!(completed.landed().await.unwrap());
            kept.push(store.peek_typed(key).expect("recorded"));
        }
        assert!(
            kept[0].typed.is_some(),
            "70 bytes twice fit in 150: the value is kept"
        );
        assert!(
            kept[1].typed.is_none(),
            "100 bytes twice do not fit in 150: encoded only"
        );
        assert_eq!(kept[1].value.len(), 100, "and the encoding is recorded");
    }

    #[test]
    fn lapsed_claims_are_swept_when_a_shard_doubles() {
        let start = Instant::now();
        let mut claims = Claims::default();
        for i in 0..63_u32 {
            let key = Key::derive("sweep", &i).unwrap();
            claims.insert(key, claim(start + Duration::from_millis(1)), start);
        }
        assert_eq!(claims.live.len(), 63, "nothing has lapsed yet");

        // Later, with all of them lapsed, the insert that reaches the sweep mark sweeps.
        let later = start + Duration::from_secs(1);
        let live = Key::derive("sweep", &"live").unwrap();
        claims.insert(live, claim(later + Duration::from_secs(30)), later);
        assert_eq!(claims.live.len(), 1, "lapsed claims stayed");
        assert!(claims.live.contains_key(&live));
        assert_eq!(
            claims.sweep_at, 64,
            "the next sweep waits for the shard to grow again"
        );
    }

    /// Claims a fresh `key`, and its token.
    async fn acquired(store: &MemoryStore, key: &Key) -> Token {
        match store
            .claim(&ClaimRequest::new(key, Duration::from_secs(30)))
            .await
            .unwrap()
        {
            Claim::Acquired { token, .. } => token,
            other => panic!("a fresh key was not acquired: {other:?}"),
        }
    }

    #[tokio::test]
    async fn results_are_bounded_by_their_bytes_as_well_as_their_count() {
        // 3000 results of 256 KiB (750 MiB) in a store bounded to 4 MiB.
        let store = MemoryStore::builder().max_bytes(4 << 20).build();
        let value = Bytes::from(vec![7_u8; 256 << 10]);
        for i in 0..3000_u32 {
            let key = Key::derive("bytes", &i).unwrap();
            let token = acquired(&store, &key).await;
            assert!(store
                .complete(&key, token, value.clone(), Duration::from_secs(60))
                .await
                .unwrap());
        }
        store.inner.results.run_pending_tasks();
        let weight = store.inner.results.weighted_size();
        assert!(weight <= 4 << 20, "{weight} bytes kept");
        assert!(store.inner.results.entry_count() <= 16);
        // The newest one is there.
        assert!(store
            .peek(&Key::derive("bytes", &2999_u32).unwrap())
            .is_some());

        // One result larger than the bound on its own is not kept: its key answers with the
        // record of a result that is gone, never a second run...
        let huge = Bytes::from(vec![0_u8; 5 << 20]);
        let key = Key::derive("bytes", &"huge").unwrap();
        let token = acquired(&store, &key).await;
        assert!(store
            .complete(&key, token, huge.clone(), Duration::from_secs(60))
            .await
            .unwrap());
        assert!(matches!(
            store
                .claim(&ClaimRequest::new(&key, Duration::from_secs(30)))
                .await
                .unwrap(),
            Claim::Completed { value, .. } if value[..] == *crate::codec::GONE
        ));
        // ...unless the store was told to run it again.
        let rerun = MemoryStore::builder()
            .max_bytes(4 << 20)
            .rerun_evicted()
            .build();
        let token = acquired(&rerun, &key).await;
        assert!(rerun
            .complete(&key, token, huge, Duration::from_secs(60))
            .await
            .unwrap());
        assert!(matches!(
            rerun
                .claim(&ClaimRequest::new(&key, Duration::from_secs(30)))
                .await
                .unwrap(),
            Claim::Acquired { .. }
        ));
    }

    #[test]
    fn the_default_bound_is_256_mib() {
        let store = MemoryStore::new();
        assert_eq!(store.inner.max_bytes, 256 * 1024 * 1024);
        assert_eq!(store.inner.capacity, DEFAULT_CAPACITY);
    }
}
