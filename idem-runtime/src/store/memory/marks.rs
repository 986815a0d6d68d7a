//! The marks of completed keys: that a key completed, kept for its TTL after its result may
//! have been evicted, so that a call on it answers [`Error::Gone`](crate::Error::Gone)
//! instead of running again.

use std::collections::HashMap;

use bytes::Bytes;
use tokio::time::Instant;

use crate::key::KeyHasher;
use crate::{Claim, Fingerprint, Key};

/// The marks of one shard's completed keys, oldest first. They live beside the claims, not
/// in a cache of their own: a mark is written by every completion, under the shard's lock
/// the completion holds anyway, and a second cache's insert doubled a first execution's
/// time (`BENCHMARKS.md`, P2).
#[derive(Default)]
pub(super) struct Marks {
    by_key: HashMap<Key, Mark, KeyHasher>,
    /// Keys in the order they were marked, with the mark's number: an entry whose key was
    /// marked again since (or removed) is stale, and skipped.
    order: std::collections::VecDeque<(Key, u64)>,
    next: u64,
}

impl Marks {
    /// Marks `key`; drops the oldest marks beyond `bound`, and those past their end at the
    /// front. Returns the keys of dropped marks still within their TTL.
    pub(super) fn insert(
        &mut self,
        key: Key,
        fingerprint: Option<Fingerprint>,
        until: Instant,
        bound: usize,
        now: Instant,
    ) -> Vec<Key> {
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
        let mut dropped = Vec::new();
        while let Some(&(oldest, number)) = self.order.front() {
            let current = self
                .by_key
                .get(&oldest)
                .filter(|mark| mark.number == number);
            match current {
                None => {}
                Some(mark) if mark.until <= now => {
                    self.by_key.remove(&oldest);
                }
                Some(_) if self.by_key.len() > bound => {
                    self.by_key.remove(&oldest);
                    dropped.push(oldest);
                }
                Some(_) => break,
            }
            self.order.pop_front();
        }
        // Stale entries behind a live one (keys removed or marked again) are dropped once
        // they outnumber the marks, so the order stays within twice the marks.
        if self.order.len() > 2 * self.by_key.len() + 64 {
            let by_key = &self.by_key;
            self.order
                .retain(|(key, number)| by_key.get(key).is_some_and(|mark| mark.number == *number));
        }
        dropped
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
    fn marks_go_oldest_first_and_never_a_newer_mark_of_a_key_marked_again() {
        let key = |i: u32| Key::derive("marks", &i).unwrap();
        let now = Instant::now();
        let later = now + Duration::from_secs(3600);
        let mut marks = Marks::default();
        assert!(marks.insert(key(1), None, later, 2, now).is_empty());
        assert!(marks.insert(key(2), None, later, 2, now).is_empty());
        assert_eq!(marks.insert(key(3), None, later, 2, now), [key(1)]);
        assert!(marks.get(&key(1), now).is_none());
        // Marked again, key 2 is newer than key 3: key 3 goes first.
        assert!(marks.insert(key(2), None, later, 2, now).is_empty());
        assert_eq!(marks.insert(key(4), None, later, 2, now), [key(3)]);
        assert!(marks.get(&key(2), now).is_some() && marks.get(&key(4), now).is_some());
        // A mark past its end is never answered, and goes without counting as dropped.
        assert!(marks.insert(key(5), None, now, 3, now).is_empty());
        assert!(marks.get(&key(5), now).is_none());
        // Stale places in the order (removed keys) do not pile up behind a live mark.
        for i in 100..1000 {
            marks.insert(key(i), None, later, 10_000, now);
            marks.by_key.remove(&key(i));
        }
        assert!(marks.order.len() <= 2 * marks.by_key.len() + 64 + 1);
    }
}
