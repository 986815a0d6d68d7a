//! What this process has seen of other holders' claims, and since when, by its own clock.
//!
//! DynamoDB has no clock a condition can read. A lease is therefore measured where it is
//! waited out: a claim in progress may be taken over once this process has seen it
//! *unchanged* (the same token and the same count of writes) for a whole lease, by its
//! monotonic clock. A live holder renews, which changes the count, so its claim is never
//! taken however far apart the machines' wall clocks are; a dead holder's claim is taken a
//! lease after this process first saw it, not earlier. No two clocks are ever compared.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::{Key, Token};

/// A claim in progress as one read found it: its token, how many writes the item has had,
/// and the lease its holder asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Held {
    pub(super) token: Token,
    pub(super) version: u64,
    pub(super) lease: Duration,
}

/// How many claims a store remembers before it forgets those seen longest ago.
const REMEMBERED: usize = 4096;

#[derive(Default)]
pub(super) struct Seen {
    claims: Mutex<HashMap<Key, (Held, Instant)>>,
    /// The TTL of each claim this process holds, by key: how long its item is kept past a
    /// renewal's lease, should the claim lapse unsettled.
    ttls: Mutex<HashMap<Key, Duration>>,
}

impl Seen {
    /// Notes `held` as found at `at`: the time it was first seen in this state is kept while
    /// it does not change. Returns how long it has been seen unchanged.
    pub(super) fn saw(&self, key: &Key, held: Held, at: Instant) -> Duration {
        let mut claims = self.lock();
        if claims.len() >= REMEMBERED && !claims.contains_key(key) {
            // Entries of a lease and more ago tell only that a claim may be taken now: the
            // next read of such a key sees it again and starts its wait anew.
            claims.retain(|_, (held, since)| since.elapsed() < held.lease);
            if claims.len() >= REMEMBERED {
                claims.clear();
            }
        }
        let (seen, since) = claims.entry(*key).or_insert((held, at));
        if *seen != held {
            *seen = held;
            *since = at;
        }
        at.saturating_duration_since(*since)
    }

    /// The claim of `key` this process has seen unchanged for its whole lease, if any: the
    /// one a claim may take over, if the item is still exactly that.
    pub(super) fn lapsed(&self, key: &Key) -> Option<Held> {
        let claims = self.lock();
        let (held, since) = claims.get(key)?;
        (since.elapsed() >= held.lease).then_some(*held)
    }

    /// Whether this process has seen `key` in progress, and not yet unchanged for a whole
    /// lease: a claim of it would find it held, unless it changed since.
    pub(super) fn held(&self, key: &Key) -> bool {
        let claims = self.lock();
        claims
            .get(key)
            .is_some_and(|(held, since)| since.elapsed() < held.lease)
    }

    /// How long the claim of `key` has left, by what this process has seen of it.
    pub(super) fn left(&self, key: &Key, held: Held) -> Option<Duration> {
        let unchanged = self.saw(key, held, Instant::now());
        held.lease
            .checked_sub(unchanged)
            .filter(|left| !left.is_zero())
    }

    /// Forgets `key`: it is no longer in progress, as far as this process knows.
    pub(super) fn forget(&self, key: &Key) {
        self.lock().remove(key);
        self.ttls().remove(key);
    }

    /// Notes the TTL of this process's claim of `key`. Past [`REMEMBERED`] claims, it is not
    /// noted, and a renewal keeps the item a day past its lease ([`kept`](Self::kept)).
    pub(super) fn claimed(&self, key: &Key, ttl: Duration) {
        let mut ttls = self.ttls();
        if ttls.len() < REMEMBERED || ttls.contains_key(key) {
            ttls.insert(*key, ttl);
        }
    }

    /// The TTL of this process's claim of `key`, if it noted one.
    pub(super) fn kept(&self, key: &Key) -> Option<Duration> {
        self.ttls().get(key).copied()
    }

    fn ttls(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Duration>> {
        self.ttls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, (Held, Instant)>> {
        // The map holds no invariant a panic could break halfway.
        self.claims
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(token: u64, version: u64) -> Held {
        Held {
            token: Token::new(token),
            version,
            lease: Duration::from_secs(8),
        }
    }

    #[test]
    fn a_claim_is_lapsed_only_after_a_whole_lease_unchanged() {
        let seen = Seen::default();
        let key = Key::from_bytes([1; 32]);
        let start = Instant::now();
        assert_eq!(seen.saw(&key, held(1, 1), start), Duration::ZERO);
        let later = start + Duration::from_secs(5);
        assert_eq!(seen.saw(&key, held(1, 1), later), Duration::from_secs(5));
        // A renewal (another write) starts the wait again.
        assert_eq!(seen.saw(&key, held(1, 2), later), Duration::ZERO);
        assert_eq!(
            seen.saw(&key, held(1, 2), later + Duration::from_secs(8)),
            Duration::from_secs(8)
        );
        assert_eq!(
            seen.lapsed(&key),
            None,
            "measured from `later`, in the future"
        );
        seen.forget(&key);
        assert_eq!(seen.lapsed(&key), None);
    }
}
