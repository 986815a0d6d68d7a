//! The steps' records of a [`MemoryStore`](super::MemoryStore): per call, a map of its
//! steps, kept for the call's TTL.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use moka::sync::Cache;
use moka::Expiry;

use crate::key::KeyHasher;
use crate::Key;

/// The recorded steps of calls, by call key: at most as many calls as the store keeps
/// results; past that, the least recently used call's steps go first (its next attempt
/// runs them again, under the same `attempt().key()`).
pub(super) struct Steps(Cache<Key, Arc<Book>, KeyHasher>);

/// One call's recorded steps.
pub(super) struct Book {
    records: Mutex<HashMap<Key, Bytes, KeyHasher>>,
    ttl: Duration,
}

/// A call's steps live for the TTL of the last one recorded.
struct Lifetime;

impl Expiry<Key, Arc<Book>> for Lifetime {
    fn expire_after_create(
        &self,
        _: &Key,
        book: &Arc<Book>,
        _: std::time::Instant,
    ) -> Option<Duration> {
        Some(book.ttl)
    }

    fn expire_after_update(
        &self,
        _: &Key,
        book: &Arc<Book>,
        _: std::time::Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(book.ttl)
    }
}

impl Steps {
    pub(super) fn new(calls: u64) -> Self {
        Self(
            Cache::builder()
                .max_capacity(calls.max(1))
                .expire_after(Lifetime)
                .build_with_hasher(KeyHasher::default()),
        )
    }

    /// Records step `step` of `call`. The caller holds the lock of `call`'s shard and has
    /// checked its claim, so the check and the write are one step.
    pub(super) fn record(&self, call: &Key, step: &Key, value: Bytes, ttl: Duration) {
        let book = self.0.get(call).unwrap_or_else(|| {
            Arc::new(Book {
                records: Mutex::default(),
                ttl,
            })
        });
        book.records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(*step, value);
        // Inserted again, so that the call's steps live their TTL from the last one.
        self.0.insert(*call, book);
    }

    /// Every recorded step of `call`.
    pub(super) fn of(&self, call: &Key) -> Vec<(Key, Bytes)> {
        self.0.get(call).map_or_else(Vec::new, |book| {
            let records = book.records.lock().unwrap_or_else(PoisonError::into_inner);
            records
                .iter()
                .map(|(key, value)| (*key, value.clone()))
                .collect()
        })
    }

    pub(super) fn remove(&self, call: &Key) {
        self.0.invalidate(call);
    }
}
