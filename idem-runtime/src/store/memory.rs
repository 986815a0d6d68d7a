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
use crate::{limits, Claim, Error, Fingerprint, Flights, Key, Store, Token};

/// The default number of completed results a [`MemoryStore`] keeps.
pub const DEFAULT_CAPACITY: u64 = 100_000;

/// An in-process store: claims and results live in this process's memory.
///
/// It de-duplicates calls within one process and is the default store. Use a shared store
/// (Redis, PostgreSQL) when several processes serve the same keys.
///
/// Claims in progress are never evicted. Completed results are kept for their TTL or until
/// the store holds [`capacity`](MemoryStoreBuilder::capacity) of them, whichever comes first;
/// past capacity the least recently recorded or replayed results are evicted first (LRU), so
/// the newest `capacity` results are always kept. A call with an evicted key runs again.
///
/// Leases follow `tokio::time`, so `tokio::time::pause` drives their expiry in tests. Result
/// TTLs follow the cache's own clock (real time): a replay then reads no clock at all.
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
    /// The last token handed out; one counter for all keys makes every key's tokens grow.
    tokens: AtomicU64,
    capacity: u64,
    flights: Flights,
}

const SHARDS: usize = 64;

/// The claims of one shard. Lapsed claims are swept whenever the shard has doubled since
/// the last sweep, which keeps the cost of sweeping constant per claim.
#[derive(Default)]
struct Claims {
    live: HashMap<Key, ClaimRecord, KeyHasher>,
    sweep_at: usize,
}

impl Claims {
    fn insert(&mut self, key: Key, claim: ClaimRecord, now: Instant) {
        self.live.insert(key, claim);
        if self.live.len() >= self.sweep_at {
            self.live.retain(|_, claim| claim.until > now);
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
}

#[derive(Clone)]
struct ResultRecord {
    value: Bytes,
    fingerprint: Option<Fingerprint>,
    ttl: Duration,
}

impl ResultRecord {
    fn into_claim(self) -> Claim {
        Claim::Completed {
            value: self.value,
            fingerprint: self.fingerprint,
        }
    }
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
        }
    }

    /// The live result of `key`. Completed records never change, so reading one outside
    /// the key's lock is safe.
    fn live_result(&self, key: &Key) -> Option<ResultRecord> {
        self.inner.results.get(key)
    }

    /// The claims of `key`'s shard, locked. Every step that moves a key between the claims
    /// and the results holds it, so each is atomic.
    fn claims(&self, key: &Key) -> MutexGuard<'_, Claims> {
        // The key is a sha256 digest already: any byte of it is uniformly distributed.
        let shard = &self.inner.claims[usize::from(key.as_bytes()[1]) % SHARDS];
        shard.lock().unwrap_or_else(PoisonError::into_inner)
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
            .field("results", &self.inner.results.entry_count())
            .finish()
    }
}

/// Builds a [`MemoryStore`]; from [`MemoryStore::builder`].
#[derive(Clone, Debug)]
#[must_use]
pub struct MemoryStoreBuilder {
    capacity: u64,
}

impl MemoryStoreBuilder {
    /// The number of completed results to keep at most (default [`DEFAULT_CAPACITY`]).
    /// Claims in progress do not count and are never evicted.
    pub fn capacity(mut self, results: u64) -> Self {
        self.capacity = results;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        MemoryStore {
            inner: Arc::new(Inner {
                claims: std::array::from_fn(|_| Mutex::default()),
                results: Cache::builder()
                    .max_capacity(self.capacity)
                    // Retries come for the newest results: keep them, never admit by
                    // frequency (moka's default would turn new keys away at capacity).
                    .eviction_policy(EvictionPolicy::lru())
                    .expire_after(Lifetime)
                    .build_with_hasher(KeyHasher::default()),
                tokens: AtomicU64::new(0),
                capacity: self.capacity,
                flights: Flights::default(),
            }),
        }
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(
        &self,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Claim, Error> {
        // Fast path for replays: no lock, no clock.
        if let Some(done) = self.live_result(key) {
            return Ok(done.into_claim());
        }
        let now = Instant::now();
        let mut claims = self.claims(key);
        // Under the lock: `complete` moves a claim to the results under the same lock, so a
        // result that landed since the fast path is seen here.
        if self.inner.results.contains_key(key) {
            if let Some(done) = self.live_result(key) {
                return Ok(done.into_claim());
            }
        }
        if let Some(claim) = claims.live.get(key).filter(|claim| claim.until > now) {
            return Ok(Claim::InProgress {
                fingerprint: claim.fingerprint,
            });
        }
        let token = Token::new(self.inner.tokens.fetch_add(1, Ordering::Relaxed) + 1);
        let claim = ClaimRecord {
            token,
            fingerprint: fingerprint.copied(),
            until: now + limits::clamp(lease),
        };
        claims.insert(*key, claim, now);
        Ok(Claim::Acquired { token })
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        let now = Instant::now();
        let mut claims = self.claims(key);
        let Some(claim) = claims.held(key, token, now) else {
            return Ok(false);
        };
        let record = ResultRecord {
            value,
            fingerprint: claim.fingerprint,
            ttl: limits::clamp(ttl),
        };
        // The result is visible before the claim goes, and both under the key's lock.
        self.inner.results.insert(*key, record);
        claims.live.remove(key);
        Ok(true)
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

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        let now = Instant::now();
        let mut claims = self.claims(key);
        let claim = claims.live.remove(key).filter(|claim| claim.until > now);
        let result = self.inner.results.remove(key);
        Ok(claim.is_some() || result.is_some())
    }

    fn peek(&self, key: &Key) -> Option<Claim> {
        self.live_result(key).map(ResultRecord::into_claim)
    }

    fn flights(&self) -> Option<&Flights> {
        Some(&self.inner.flights)
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
        }
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
}
