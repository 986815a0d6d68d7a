//! Rate limits by idempotency key (feature `governor`): a key retried faster than a rate, or a
//! principal creating keys faster than a rate, is answered `429` from memory, before the
//! store is asked. Each limit is a GCRA cell from `governor`; the limiters live in bounded
//! caches, so that a flood of new keys cannot take the service's memory.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota};
use moka::sync::Cache;

use crate::key::KeyHasher;
use crate::Key;

/// What one remembered key or principal is counted for against [`RateLimit::max_bytes`]:
/// the key, its limiter and the cache's entry, measured at 322 heap bytes
/// (`tests/http/rate_limit.rs::limiters_are_within_the_bytes_their_bound_counts`).
pub const LIMITER_BYTES: u64 = 512;

/// The default bound on the memory of a layer's limiters: 16 MiB, about 32 000 keys and
/// principals remembered.
pub const DEFAULT_RATE_LIMIT_BYTES: u64 = 16 * 1024 * 1024;

/// How fast keyed requests may come, per key and per principal; see
/// [`IdempotencyLayer::rate_limit`](super::IdempotencyLayer::rate_limit). Off until one of
/// the limits is set.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::http::{IdempotencyLayer, RateLimit};
/// use idem_runtime::MemoryStore;
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .unscoped()
///     .rate_limit(
///         RateLimit::new()
///             // A key may be sent 5 times in 10 s: a client retrying in a tight loop is told
///             // to slow down without costing the store anything.
///             .per_key(5, Duration::from_secs(10))
///             // A principal may start 100 new operations a minute.
///             .per_principal(100, Duration::from_secs(60)),
///     );
/// # let _ = layer;
/// ```
#[derive(Clone, Debug)]
pub struct RateLimit {
    per_key: Option<Quota>,
    per_principal: Option<Quota>,
    max_bytes: u64,
}

impl RateLimit {
    /// No limits yet; [`DEFAULT_RATE_LIMIT_BYTES`] of memory for them.
    pub fn new() -> Self {
        Self {
            per_key: None,
            per_principal: None,
            max_bytes: DEFAULT_RATE_LIMIT_BYTES,
        }
    }

    /// Each key (in its principal's scope) may be sent `count` times per `period`, in a
    /// burst or spread out; a faster retry gets `429` with `Retry-After`. A `count` of 0 or
    /// a zero period turns the limit off.
    #[must_use]
    pub fn per_key(mut self, count: u32, period: Duration) -> Self {
        self.per_key = quota(count, period);
        self
    }

    /// Each principal (the layer's [scope](super::IdempotencyLayer::scope); all requests
    /// together on an unscoped layer) may send `count` keys this instance has not seen
    /// before per `period`; a faster one gets `429` with `Retry-After`, and its key is not
    /// remembered as seen. A `count` of 0 or a zero period turns the limit off.
    #[must_use]
    pub fn per_principal(mut self, count: u32, period: Duration) -> Self {
        self.per_principal = quota(count, period);
        self
    }

    /// The memory the limiters of one layer may take, [`LIMITER_BYTES`] a key or principal
    /// remembered (default [`DEFAULT_RATE_LIMIT_BYTES`]). The least recently seen are
    /// forgotten first: a forgotten key starts afresh, and counts as new for its principal.
    #[must_use]
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = bytes;
        self
    }

    pub(super) fn build(self) -> Option<Limiter> {
        if self.per_key.is_none() && self.per_principal.is_none() {
            return None;
        }
        // Shared by keys and principals: principals are few beside keys.
        let entries = (self.max_bytes / LIMITER_BYTES).max(2);
        Some(Limiter {
            per_key: self.per_key,
            per_principal: self.per_principal,
            keys: bounded(entries - entries / 8),
            principals: bounded(entries / 8),
            clock: DefaultClock::default(),
        })
    }
}

impl Default for RateLimit {
    fn default() -> Self {
        Self::new()
    }
}

/// A cache of at most `entries`, the least recently used forgotten first.
fn bounded<V: Clone + Send + Sync + 'static>(entries: u64) -> Cache<Key, V, KeyHasher> {
    Cache::builder()
        .max_capacity(entries.max(1))
        .eviction_policy(moka::policy::EvictionPolicy::lru())
        .build_with_hasher(KeyHasher::default())
}

/// `count` cells per `period`, all of them available at once.
fn quota(count: u32, period: Duration) -> Option<Quota> {
    let count = NonZeroU32::new(count)?;
    Quota::with_period(period / count.get()).map(|quota| quota.allow_burst(count))
}

/// A layer's limiters, shared by its services.
pub(super) struct Limiter {
    per_key: Option<Quota>,
    per_principal: Option<Quota>,
    /// The keys seen, each with its limiter if keys are limited.
    keys: Cache<Key, Option<Arc<DefaultDirectRateLimiter>>, KeyHasher>,
    principals: Cache<Key, Arc<DefaultDirectRateLimiter>, KeyHasher>,
    clock: DefaultClock,
}

impl Limiter {
    /// Whether a request with `key` of `principal` may go on; otherwise how long until it
    /// may. No I/O: everything is in memory.
    pub(super) fn check(&self, key: &Key, principal: Option<&str>) -> Result<(), Duration> {
        let seen = self
            .keys
            .entry(*key)
            .or_insert_with(|| self.per_key.map(|quota| Arc::new(limiter(quota))));
        if seen.is_fresh() {
            if let Some(quota) = self.per_principal {
                let principal =
                    Key::derive("idem.http.rate_limit.principal", &principal).unwrap_or(*key);
                let limiter = self
                    .principals
                    .get_with(principal, || Arc::new(limiter(quota)));
                if let Err(not_until) = limiter.check() {
                    // Not seen after all: its next try is a new key again.
                    self.keys.invalidate(key);
                    return Err(not_until.wait_time_from(self.clock.now()));
                }
            }
        }
        match seen.into_value() {
            Some(limiter) => limiter
                .check()
                .map_err(|not_until| not_until.wait_time_from(self.clock.now())),
            None => Ok(()),
        }
    }
}

fn limiter(quota: Quota) -> DefaultDirectRateLimiter {
    governor::RateLimiter::direct(quota)
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("per_key", &self.per_key)
            .field("per_principal", &self.per_principal)
            .field("keys", &self.keys.entry_count())
            .field("principals", &self.principals.entry_count())
            .finish()
    }
}
