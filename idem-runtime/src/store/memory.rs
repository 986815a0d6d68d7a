//! The embedded in-memory store, on `moka`.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use moka::future::Cache;
use moka::ops::compute::{CompResult, Op};
use moka::Expiry;
use tokio::time::Instant;

use crate::{Claim, Error, Fingerprint, Flights, Key, Store, Token};

/// The default number of completed results a [`MemoryStore`] keeps.
pub const DEFAULT_CAPACITY: u64 = 100_000;

/// An in-process store: claims and results live in this process's memory.
///
/// It de-duplicates calls within one process and is the default store. Use a shared store
/// (Redis, PostgreSQL) when several processes serve the same keys.
///
/// Claims in progress are never evicted. Completed results are kept for their TTL or until
/// the store holds [`capacity`](MemoryStoreBuilder::capacity) of them, whichever comes first;
/// past capacity the least useful results are evicted early, and a call with an evicted key
/// runs again. Expiry follows `tokio::time`, so `tokio::time::pause` drives it in tests.
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
    /// In-progress claims: unbounded, expiring after their lease.
    claims: Cache<Key, ClaimRecord>,
    /// Completed results: bounded, expiring after their TTL.
    results: Cache<Key, ResultRecord>,
    /// The last token handed out; one counter for all keys makes every key's tokens grow.
    tokens: AtomicU64,
    capacity: u64,
    flights: Flights,
}

#[derive(Clone)]
struct ClaimRecord {
    token: Token,
    fingerprint: Option<Fingerprint>,
    lease: Duration,
    until: Instant,
}

#[derive(Clone)]
struct ResultRecord {
    value: Bytes,
    fingerprint: Option<Fingerprint>,
    ttl: Duration,
    until: Instant,
}

impl ResultRecord {
    fn into_claim(self) -> Claim {
        Claim::Completed {
            value: self.value,
            fingerprint: self.fingerprint,
        }
    }
}

/// How long moka keeps a record: the record's own lifetime. Liveness itself is judged by
/// `until` against `tokio::time`, so moka's eviction only reclaims memory.
struct Lifetime;

trait Lived {
    fn lifetime(&self) -> Duration;
}

impl Lived for ClaimRecord {
    fn lifetime(&self) -> Duration {
        self.lease
    }
}

impl Lived for ResultRecord {
    fn lifetime(&self) -> Duration {
        self.ttl
    }
}

impl<V: Lived> Expiry<Key, V> for Lifetime {
    fn expire_after_create(&self, _: &Key, value: &V, _: std::time::Instant) -> Option<Duration> {
        Some(value.lifetime())
    }

    fn expire_after_update(
        &self,
        _: &Key,
        value: &V,
        _: std::time::Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(value.lifetime())
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

    /// The live result of `key`, without taking any lock: completed records never change, so
    /// reading one outside the claim step is safe.
    async fn live_result(&self, key: &Key, now: Instant) -> Option<ResultRecord> {
        self.inner
            .results
            .get(key)
            .await
            .filter(|record| record.until > now)
    }

    /// Runs `f` on the live claim of `key` under moka's per-key lock.
    async fn with_claim(
        &self,
        key: &Key,
        f: impl FnOnce(ClaimRecord) -> Op<ClaimRecord> + Send,
    ) -> CompResult<Key, ClaimRecord> {
        let now = Instant::now();
        self.inner
            .claims
            .entry(*key)
            .and_compute_with(|current| {
                let op = match current.map(|entry| entry.into_value()) {
                    Some(claim) if claim.until > now => f(claim),
                    _ => Op::Nop,
                };
                std::future::ready(op)
            })
            .await
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
            .field("claims", &self.inner.claims.entry_count())
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
                claims: Cache::builder().expire_after(Lifetime).build(),
                results: Cache::builder()
                    .max_capacity(self.capacity)
                    .expire_after(Lifetime)
                    .build(),
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
        let now = Instant::now();
        // Fast path for replays: no per-key lock.
        if let Some(done) = self.live_result(key, now).await {
            return Ok(done.into_claim());
        }

        let mut outcome = None;
        let slot = &mut outcome;
        self.inner
            .claims
            .entry(*key)
            .and_compute_with(|current| async move {
                // Under the key's lock. `complete` moves a claim to the results under the
                // same lock, so a result that landed since the fast path is seen here.
                if let Some(done) = self.live_result(key, now).await {
                    *slot = Some(done.into_claim());
                    return Op::Nop;
                }
                match current.map(|entry| entry.into_value()) {
                    Some(claim) if claim.until > now => {
                        *slot = Some(Claim::InProgress {
                            fingerprint: claim.fingerprint,
                        });
                        Op::Nop
                    }
                    _ => {
                        let token =
                            Token::new(self.inner.tokens.fetch_add(1, Ordering::Relaxed) + 1);
                        *slot = Some(Claim::Acquired { token });
                        Op::Put(ClaimRecord {
                            token,
                            fingerprint: fingerprint.copied(),
                            lease,
                            until: now + lease,
                        })
                    }
                }
            })
            .await;
        outcome.ok_or_else(|| Error::store("memory store: the claim step did not run"))
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        let now = Instant::now();
        let inner = &self.inner;
        let result = inner
            .claims
            .entry(*key)
            .and_compute_with(|current| async move {
                match current.map(|entry| entry.into_value()) {
                    Some(claim) if claim.until > now && claim.token == token => {
                        // Insert the result before the claim goes, both under the key's
                        // lock: no claim can slip in between.
                        let record = ResultRecord {
                            value,
                            fingerprint: claim.fingerprint,
                            ttl,
                            until: now + ttl,
                        };
                        inner.results.insert(*key, record).await;
                        Op::Remove
                    }
                    _ => Op::Nop,
                }
            })
            .await;
        Ok(matches!(result, CompResult::Removed(_)))
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        let result = self
            .with_claim(key, |claim| {
                if claim.token == token {
                    Op::Remove
                } else {
                    Op::Nop
                }
            })
            .await;
        Ok(matches!(result, CompResult::Removed(_)))
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        let now = Instant::now();
        let result = self
            .with_claim(key, |claim| {
                if claim.token == token {
                    Op::Put(ClaimRecord {
                        lease,
                        until: now + lease,
                        ..claim
                    })
                } else {
                    Op::Nop
                }
            })
            .await;
        Ok(matches!(result, CompResult::ReplacedWith(_)))
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        let claim = self.inner.claims.remove(key).await;
        let result = self.inner.results.remove(key).await;
        Ok(claim.is_some() || result.is_some())
    }

    fn flights(&self) -> Option<&Flights> {
        Some(&self.inner.flights)
    }
}
