//! The marks of completed keys: that a key completed, kept for its TTL after its result may
//! have been evicted, so that a call on it answers [`Error::Gone`](crate::Error::Gone)
//! instead of running again.

use std::collections::HashMap;

use bytes::Bytes;
use tokio::time::Instant;

use crate::key::KeyHasher;
use crate::{Claim, Fingerprint, Key};

/// The marks of the store's completed keys, oldest first, within one bound for the whole
/// store (a bound per shard of keys filled its busiest shards at ~80 % of the total).
#[derive(Default)]
pub(super) struct Marks {
    by_key: HashMap<Key, Mark, KeyHasher>,
    /// Keys in the order they were marked, with the mark's number: an entry whose key was
    /// marked again since (or removed) is stale, and skipped.
    order: std::collections::VecDeque<(Key, u64)>,
    next: u64,
    /// Marks refused since the last sweep of the whole map for marks past their end.
    refused_since_sweep: usize,
}

/// Whether a mark was kept.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Marked {
    Kept,
    /// The marks are at their bound with live marks: this one is not kept.
    Full,
}

impl Marks {
    /// Marks `key`, within `bound` marks: marks past their end go first (from the front,
    /// and by a sweep of the whole map when the front holds none); if every mark is live,
    /// the new one is refused. The marks kept are those of keys that completed earlier,
    /// whose results are the likelier to be evicted already: dropping one of them would let
    /// its key run again at once, and that run's own mark would push out another, a cascade.
    /// A refused key still has its result, the newest in the results' LRU order.
    pub(super) fn insert(
        &mut self,
        key: Key,
        fingerprint: Option<Fingerprint>,
        until: Instant,
        bound: usize,
        now: Instant,
    ) -> Marked {
        self.expire_front(now);
        let marked_before = self.by_key.contains_key(&key);
        if !marked_before && self.by_key.len() >= bound {
            // Marks past their end behind a live one at the front (a longer TTL marked
            // earlier): swept, at most once per `bound / 16` refusals, so that a store
            // over its bound does not scan its marks on every completion.
            self.refused_since_sweep += 1;
            if self.refused_since_sweep > bound / 16 {
                self.refused_since_sweep = 0;
                self.by_key.retain(|_, mark| mark.until > now);
            }
            if self.by_key.len() >= bound {
                return Marked::Full;
            }
        }
        self.next += 1;
        self.by_key.insert(
            key,
            Mark {
                fingerprint,
                until,
                number: self.next,
            },
        );
        self.order.push_back((key, self.next));
        // Stale entries behind a live one (keys removed or marked again) are dropped once
        // they outnumber the marks, so the order stays within twice the marks.
        if self.order.len() > 2 * self.by_key.len() + 64 {
            let by_key = &self.by_key;
            self.order
                .retain(|(key, number)| by_key.get(key).is_some_and(|mark| mark.number == *number));
        }
        Marked::Kept
    }

    /// The live marks and when each ends, for an operator's listing.
    #[cfg(feature = "admin")]
    pub(super) fn live(&self, now: Instant) -> impl Iterator<Item = (&Key, Instant)> + '_ {
        self.by_key
            .iter()
            .filter(move |(_, mark)| mark.until > now)
            .map(|(key, mark)| (key, mark.until))
    }

    /// Drops the marks past their end, and stale places, at the front of the order.
    fn expire_front(&mut self, now: Instant) {
        while let Some(&(oldest, number)) = self.order.front() {
            let current = self
                .by_key
                .get(&oldest)
                .filter(|mark| mark.number == number);
            match current {
                Some(mark) if mark.until > now => break,
                Some(_) => {
                    self.by_key.remove(&oldest);
                }
                None => {}
            }
            self.order.pop_front();
        }
    }

    /// Forgets `key`'s mark (its place in the order goes stale): whether there was one.
    pub(super) fn remove(&mut self, key: &Key) -> bool {
        self.by_key.remove(key).is_some()
    }

    /// The mark of `key`, if it completed within its TTL.
    pub(super) fn get(&self, key: &Key, now: Instant) -> Option<Mark> {
        self.by_key
            .get(key)
            .filter(|mark| mark.until > now)
            .copied()
    }
}

/// That a key completed, kept for its TTL after its result may be gone.
#[derive(Clone, Copy)]
pub(super) struct Mark {
    fingerprint: Option<Fingerprint>,
    until: Instant,
    /// Its place in the shard's order of marks.
    number: u64,
}

impl Mark {
    /// What a call that finds only the mark gets: a record that replays as `Gone`.
    pub(super) fn into_claim(self) -> Claim {
        Claim::Completed {
            value: Bytes::from_static(crate::codec::GONE),
            fingerprint: self.fingerprint,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn past_the_bound_new_marks_are_refused_and_old_ones_kept() {
        let key = |i: u32| Key::derive("marks", &i).unwrap();
        let now = Instant::now();
        let later = now + Duration::from_secs(3600);
        let mut marks = Marks::default();
        assert_eq!(marks.insert(key(1), None, later, 2, now), Marked::Kept);
        assert_eq!(marks.insert(key(2), None, later, 2, now), Marked::Kept);
        assert_eq!(marks.insert(key(3), None, later, 2, now), Marked::Full);
        assert!(marks.get(&key(1), now).is_some() && marks.get(&key(2), now).is_some());
        assert!(marks.get(&key(3), now).is_none());
        // A key marked again keeps its place in the bound.
        assert_eq!(marks.insert(key(2), None, later, 2, now), Marked::Kept);
        // A mark past its end is never answered, and makes room.
        let mut short = Marks::default();
        assert_eq!(short.insert(key(5), None, now, 1, now), Marked::Kept);
        assert!(short.get(&key(5), now).is_none());
        assert_eq!(short.insert(key(6), None, later, 1, now), Marked::Kept);
        // Past its end behind a live mark at the front: found by the sweep.
        let mut behind = Marks::default();
        let soon = now + Duration::from_secs(1);
        assert_eq!(behind.insert(key(7), None, later, 2, now), Marked::Kept);
        assert_eq!(behind.insert(key(8), None, soon, 2, now), Marked::Kept);
        let after = soon + Duration::from_secs(1);
        assert_eq!(behind.insert(key(9), None, later, 2, after), Marked::Kept);
        assert!(behind.get(&key(7), after).is_some() && behind.get(&key(9), after).is_some());
        // Stale places in the order (removed keys) do not pile up behind a live mark.
        for i in 100..1000 {
            marks.insert(key(i), None, later, 10_000, now);
            marks.by_key.remove(&key(i));
        }
        assert!(marks.order.len() <= 2 * marks.by_key.len() + 64 + 1);
    }
}
