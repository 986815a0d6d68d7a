//! In-process coalescing: calls that find a key in progress in this process wait for the
//! running call's outcome instead of asking the store again.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::key::KeyHasher;
use crate::{Fingerprint, Key};

const SHARDS: usize = 16;

/// The calls of one store that are running in this process, by key.
///
/// A store returns its registry from [`Store::flights`](crate::Store::flights); a third-party
/// store gets coalescing by holding one `Flights::default()` beside its connection and
/// returning it. It is otherwise opaque: the engine alone registers and lands flights.
pub struct Flights {
    shards: [Mutex<HashMap<Key, Arc<Flight>, KeyHasher>>; SHARDS],
    /// Number of registered flights, so that the common case (nothing running) costs one
    /// atomic load instead of a lock.
    active: AtomicUsize,
}

impl Default for Flights {
    fn default() -> Self {
        Self {
            shards: std::array::from_fn(|_| Mutex::default()),
            active: AtomicUsize::new(0),
        }
    }
}

impl fmt::Debug for Flights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Flights")
            .field("active", &self.active.load(Ordering::Relaxed))
            .finish()
    }
}

/// How a running call ended, as its waiters see it.
#[derive(Clone, Debug)]
pub(crate) enum Landing {
    /// The result was recorded: these are the recorded bytes.
    Completed(Bytes),
    /// The claim was released (error, panic, cancel, or a lost lease): claim again.
    Released,
}

/// One running call.
#[derive(Debug)]
pub(crate) struct Flight {
    fingerprint: Option<Fingerprint>,
    landing: OnceLock<Landing>,
    landed: Notify,
}

impl Flight {
    pub(crate) fn fingerprint(&self) -> Option<&Fingerprint> {
        self.fingerprint.as_ref()
    }

    /// Waits until the flight lands, or `deadline` passes (`None`).
    pub(crate) async fn wait(&self, deadline: Instant) -> Option<Landing> {
        let notified = self.landed.notified();
        let mut notified = std::pin::pin!(notified);
        // Registered before the check, so a landing between the two still wakes this waiter.
        notified.as_mut().enable();
        if let Some(landing) = self.landing.get() {
            return Some(landing.clone());
        }
        tokio::time::timeout_at(deadline, notified).await.ok()?;
        self.landing.get().cloned()
    }
}

impl Flights {
    fn shard(&self, key: &Key) -> &Mutex<HashMap<Key, Arc<Flight>, KeyHasher>> {
        // The key is a sha256 digest already: any byte of it is uniformly distributed.
        &self.shards[usize::from(key.as_bytes()[0]) % SHARDS]
    }

    /// The running flight of `key`, if any.
    pub(crate) fn get(&self, key: &Key) -> Option<Arc<Flight>> {
        if self.active.load(Ordering::Acquire) == 0 {
            return None;
        }
        let shard = self
            .shard(key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        shard.get(key).cloned()
    }

    /// Registers the call that just claimed `key`.
    pub(crate) fn start(&self, key: Key, fingerprint: Option<Fingerprint>) -> Arc<Flight> {
        let flight = Arc::new(Flight {
            fingerprint,
            landing: OnceLock::new(),
            landed: Notify::new(),
        });
        let mut shard = self
            .shard(&key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // A previous flight of this key can only still be here if its holder lost the lease
        // and has not landed yet; it lands as released on its own.
        if shard.insert(key, Arc::clone(&flight)).is_none() {
            self.active.fetch_add(1, Ordering::AcqRel);
        }
        flight
    }

    /// Unregisters `flight` and wakes its waiters with `landing`.
    pub(crate) fn land(&self, key: &Key, flight: &Arc<Flight>, landing: Landing) {
        {
            let mut shard = self
                .shard(key)
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if shard.get(key).is_some_and(|f| Arc::ptr_eq(f, flight)) {
                shard.remove(key);
                self.active.fetch_sub(1, Ordering::AcqRel);
            }
        }
        // A flight lands once; a second landing (there is none) would change nothing.
        let _ = flight.landing.set(landing);
        flight.landed.notify_waiters();
    }
}
