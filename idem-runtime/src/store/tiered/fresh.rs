//! What a tier knows of the removals made elsewhere: a durable store that tells them
//! ([`Store::watch_removals`]: PostgreSQL, through `LISTEN`/`NOTIFY`) has each removed
//! record's copy forgotten at once, in every process, and while its feed is lost the fast
//! tier is neither read nor written, so that an operator's reset is never answered from a
//! copy.
//!
//! - A removal told marks its key *forgetting* (synchronously, in the feed's task), and its
//!   copy is removed from the fast tier; until that is done, the key's copy is not read and
//!   no copy of it is begun. A copy begun before holds a claim in the fast tier, which the
//!   removal deletes, so its completion is refused.
//! - While the feed is lost, copies are neither read nor made: replays go to the durable
//!   store. When it listens again, the tier's *generation* moves on: every copy is kept in
//!   the fast tier under its key mixed with the generation, so that the copies made before
//!   (of records that may have been removed meanwhile, unseen) are never read again; they
//!   expire by themselves.
//! - A durable store that cannot tell leaves the tier as it was: copies are read until
//!   they expire (see [`TieredStore`](super::TieredStore)).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use crate::store::{Removal, RemovalWatch};
use crate::{Key, Store};

/// The tier's view of removals elsewhere; shared by every clone of the tier.
#[derive(Default)]
pub(super) struct Freshness {
    /// Whether the durable store tells removals; unset until the watch is started (within a
    /// runtime).
    watched: OnceLock<bool>,
    /// Whether the durable store's feed is listening now.
    listening: AtomicBool,
    /// Whether it listened before: a later `Listening` moves the generation on.
    listened: AtomicBool,
    /// Mixed into every key of the fast tier.
    generation: AtomicU64,
    /// Keys whose copy is being removed after a removal elsewhere, with how many removals
    /// of each are in flight.
    forgetting: Mutex<HashMap<Key, usize>>,
    /// How many keys `forgetting` holds: a replay looks at the map only when it is not 0.
    pending: AtomicUsize,
    /// Told when the feed listens.
    heard: tokio::sync::Notify,
}

impl Freshness {
    /// Starts watching `durable`'s removals, once, if this runs within a tokio runtime (a
    /// tier made outside one starts at its first call, which runs within one).
    pub(super) fn start<F: Store, D: Store>(self: &Arc<Self>, fast: &Arc<F>, durable: &D) {
        if self.watched.get().is_some() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        self.watched
            .get_or_init(|| durable.watch_removals(self.watch(Arc::clone(fast))));
    }

    /// Waits, at most `bound`, for a feed that was never heard yet to listen, so that a
    /// tier made just before its first call uses its fast tier from that call on.
    pub(super) async fn first_heard(&self, bound: std::time::Duration) {
        if self.watched.get() != Some(&true) || self.listened.load(Ordering::Acquire) {
            return;
        }
        let notified = self.heard.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.listening.load(Ordering::Acquire) {
            return;
        }
        let _ = tokio::time::timeout(bound, notified).await;
    }

    /// The key of `key`'s copy in the fast tier, when a copy may be read or begun now:
    /// `None` until the watch started, while the feed is lost, and while the key's copy is
    /// being forgotten.
    pub(super) fn fast_key(&self, key: &Key) -> Option<Key> {
        match self.watched.get() {
            None => None,
            Some(false) => Some(*key),
            Some(true) => {
                if !self.listening.load(Ordering::Acquire) || self.forgetting(key) {
                    return None;
                }
                Some(self.mapped(key))
            }
        }
    }

    /// The key of `key`'s copy in the fast tier in this generation, whether or not a copy
    /// may be read: what a removal removes.
    pub(super) fn mapped(&self, key: &Key) -> Key {
        mixed(key, self.generation.load(Ordering::Acquire))
    }

    fn forgetting(&self, key: &Key) -> bool {
        self.pending.load(Ordering::Acquire) != 0
            && self
                .forgetting
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains_key(key)
    }

    /// What the durable store's feed tells, acted on: for as long as the tier lives.
    fn watch<F: Store>(self: &Arc<Self>, fast: Arc<F>) -> RemovalWatch {
        let fresh = Arc::downgrade(self);
        Arc::new(move |removal| {
            let Some(fresh) = fresh.upgrade() else {
                return false; // the tier is gone
            };
            match removal {
                // Told again while it listens (a heartbeat): only a return from a loss
                // moves the generation on.
                Removal::Listening if !fresh.listening.load(Ordering::Acquire) => {
                    if fresh.listened.swap(true, Ordering::AcqRel) {
                        // Whatever was copied before the feed was lost is never read again.
                        fresh.generation.fetch_add(1, Ordering::AcqRel);
                    }
                    fresh.listening.store(true, Ordering::Release);
                    fresh.heard.notify_waiters();
                }
                Removal::Listening => {}
                Removal::Lost => {
                    if fresh.listening.swap(false, Ordering::AcqRel) {
                        tracing::warn!(
                            "the durable store's feed of removals was lost: replays skip the fast tier until it is back"
                        );
                    }
                }
                Removal::Removed(key) => fresh.forget(*key, Arc::clone(&fast)),
            }
            true
        })
    }

    /// Marks `key` forgetting, now, and removes its copy from the fast tier; a fast tier
    /// that fails to remove it moves the generation on instead, so that no copy of it is
    /// read again.
    fn forget<F: Store>(self: Arc<Self>, key: Key, fast: Arc<F>) {
        {
            let mut forgetting = self
                .forgetting
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            *forgetting.entry(key).or_insert(0) += 1;
            self.pending.store(forgetting.len(), Ordering::Release);
        }
        let copy = self.mapped(&key);
        tokio::spawn(async move {
            let removed = super::within(super::REMOVAL_TIMEOUT, fast.remove(&copy)).await;
            if let Err(err) = removed {
                tracing::warn!(error = %err, "the fast tier failed to forget a copy removed elsewhere: every copy is set aside");
                self.generation.fetch_add(1, Ordering::AcqRel);
            }
            let mut forgetting = self
                .forgetting
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some(count) = forgetting.get_mut(&key) {
                *count -= 1;
                if *count == 0 {
                    forgetting.remove(&key);
                }
            }
            self.pending.store(forgetting.len(), Ordering::Release);
        });
    }
}

/// `key` mixed with `generation` (itself in generation 0): another key of the fast tier,
/// which no other key's mix meets (it would take 24 of 32 bytes of two digests alike).
fn mixed(key: &Key, generation: u64) -> Key {
    if generation == 0 {
        return *key;
    }
    let mut bytes = *key.as_bytes();
    for (byte, mix) in bytes.iter_mut().zip(generation.to_le_bytes()) {
        *byte ^= mix;
    }
    Key::from_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generation_mixes_into_another_key() {
        let key = Key::from_bytes([7; 32]);
        assert_eq!(mixed(&key, 0), key);
        assert_ne!(mixed(&key, 1), key);
        assert_ne!(mixed(&key, 1), mixed(&key, 2));
    }
}
