//! In-process coalescing: calls that find a key in progress in this process wait for the
//! running call's outcome instead of asking the store again.
//!
//! The registry and the hand-off between a holder and its waiters are model-checked with
//! `loom` (`RUSTFLAGS="--cfg idem_loom" cargo test -p idem-runtime --no-default-features --lib --target-dir target/loom loom`):
//! every interleaving of landing, cancelling, waiting and giving up is explored in the
//! `loom_model` module below.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::ops::DerefMut;
use std::pin::Pin;
use std::sync::PoisonError;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use tokio::time::Instant;

use self::sync::{Arc, AtomicUsize, Mutex, Ordering};
use crate::key::KeyHasher;
use crate::{Fingerprint, Key};

/// The primitives the registry is built on: `std`'s, or `loom`'s under `--cfg idem_loom`.
mod sync {
    #[cfg(idem_loom)]
    pub(crate) use loom::sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    };
    #[cfg(not(idem_loom))]
    pub(crate) use std::sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    };
}

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
            shards: std::array::from_fn(|_| Mutex::new(HashMap::default())),
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
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Landing {
    /// The result was recorded: these are the recorded bytes.
    Completed(Bytes),
    /// The claim was released (error, panic, cancel, or a lost lease), or its outcome is not
    /// known here: ask the store.
    Released,
}

/// A shared handle to a [`Flight`] (`loom`'s `Arc` under the model).
pub(crate) type FlightRef = Arc<Flight>;

/// One running call.
pub(crate) struct Flight {
    fingerprint: Option<Fingerprint>,
    state: Mutex<State>,
    /// The end of the holder's lease as the holder last knew it: a holder that stopped
    /// making progress (frozen, or its future leaked) is waited for no longer than this.
    /// Time is not part of the model, so this is `std`'s mutex even under loom.
    expires: std::sync::Mutex<Instant>,
}

/// A flight's landing, or the wakers of the calls waiting for it.
#[derive(Default)]
struct State {
    landing: Option<Landing>,
    /// Whether an operator released the claim by force: its holder must not record.
    fenced: bool,
    /// Indexed by a waiter's slot; a waiter that gives up empties its own.
    waiters: Vec<Option<Waker>>,
}

impl fmt::Debug for Flight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Flight")
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl Flight {
    pub(crate) fn fingerprint(&self) -> Option<&Fingerprint> {
        self.fingerprint.as_ref()
    }

    /// Waits until the flight lands. Dropping the future gives up the wait.
    pub(crate) fn wait(&self) -> Wait<'_> {
        Wait {
            flight: self,
            slot: None,
        }
    }

    fn state(&self) -> impl DerefMut<Target = State> + '_ {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether an operator released this flight's claim by force
    /// ([`Flights::released`]): its holder's result is not recorded, even under a new claim.
    pub(crate) fn fenced(&self) -> bool {
        self.state().fenced
    }

    /// When the holder's lease runs out, as far as this process knows.
    pub(crate) fn expires(&self) -> Instant {
        *self.expires.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The holder renewed its lease until `until`.
    pub(crate) fn extend(&self, until: Instant) {
        *self.expires.lock().unwrap_or_else(PoisonError::into_inner) = until;
    }
}

/// The future of [`Flight::wait`].
pub(crate) struct Wait<'a> {
    flight: &'a Flight,
    /// This waiter's slot among the flight's wakers, once registered.
    slot: Option<usize>,
}

impl Future for Wait<'_> {
    type Output = Landing;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Landing> {
        let flight = self.flight;
        let mut state = flight.state();
        if let Some(landing) = &state.landing {
            return Poll::Ready(landing.clone());
        }
        // Registered under the same lock that a landing takes: no wake-up can be lost.
        match self.slot {
            Some(slot) => match &mut state.waiters[slot] {
                Some(waker) if waker.will_wake(cx.waker()) => {}
                waker => *waker = Some(cx.waker().clone()),
            },
            None => {
                state.waiters.push(Some(cx.waker().clone()));
                self.slot = Some(state.waiters.len() - 1);
            }
        }
        Poll::Pending
    }
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            let mut state = self.flight.state();
            // After a landing the wakers are gone already.
            if let Some(waker) = state.waiters.get_mut(slot) {
                *waker = None;
            }
        }
    }
}

impl Flights {
    fn shard(
        &self,
        key: &Key,
    ) -> impl DerefMut<Target = HashMap<Key, Arc<Flight>, KeyHasher>> + '_ {
        // The key is a sha256 digest already: any byte of it is uniformly distributed.
        self.shards[usize::from(key.as_bytes()[0]) % SHARDS]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The running flight of `key`, if any.
    pub(crate) fn get(&self, key: &Key) -> Option<Arc<Flight>> {
        if self.active.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.shard(key).get(key).cloned()
    }

    /// Registers the call that just claimed `key`, with a lease that runs out at `expires`.
    pub(crate) fn start(
        &self,
        key: Key,
        fingerprint: Option<Fingerprint>,
        expires: Instant,
    ) -> Arc<Flight> {
        let flight = Arc::new(Flight {
            fingerprint,
            state: Mutex::new(State::default()),
            expires: std::sync::Mutex::new(expires),
        });
        // A previous flight of this key can only still be here if its holder lost the lease
        // and has not landed yet; it lands as released on its own, and its landing leaves
        // this one in place.
        if self.shard(&key).insert(key, Arc::clone(&flight)).is_none() {
            self.active.fetch_add(1, Ordering::AcqRel);
        }
        flight
    }

    /// Marks the key's flight, if there is one, as fenced by an operator (or clears the
    /// mark of a release that did not land): set before a shared store's release, so that
    /// the holder's completion, refused once the row is gone, finds it.
    #[cfg(all(
        feature = "admin",
        any(
            feature = "postgres",
            feature = "mysql",
            feature = "sqlite",
            feature = "redis",
            feature = "dynamodb"
        )
    ))]
    pub(crate) fn fence(&self, key: &Key, fenced: bool) {
        if let Some(flight) = self.get(key) {
            flight.state().fenced = fenced;
        }
    }

    /// Lands the running flight of `key` as released and fences it, if there is one: an
    /// operator released its claim (`idem_runtime::admin`), so its waiters in this process
    /// ask the store again instead of waiting out the holder, and the holder, whose
    /// completion the store then refuses, does not take the key again to record it.
    #[cfg(all(
        feature = "admin",
        any(
            feature = "memory",
            feature = "postgres",
            feature = "mysql",
            feature = "sqlite",
            feature = "redis",
            feature = "dynamodb"
        )
    ))]
    pub(crate) fn released(&self, key: &Key) {
        if let Some(flight) = self.get(key) {
            flight.state().fenced = true;
            self.land(key, &flight, Landing::Released);
        }
    }

    /// Unregisters `flight` and wakes its waiters with `landing`. A flight lands once: a
    /// second landing changes nothing.
    pub(crate) fn land(&self, key: &Key, flight: &Arc<Flight>, landing: Landing) {
        {
            let mut shard = self.shard(key);
            if shard.get(key).is_some_and(|f| Arc::ptr_eq(f, flight)) {
                shard.remove(key);
                self.active.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let waiters = {
            let mut state = flight.state();
            if state.landing.is_some() {
                return;
            }
            state.landing = Some(landing);
            std::mem::take(&mut state.waiters)
        };
        for waker in waiters.into_iter().flatten() {
            waker.wake();
        }
    }
}

#[cfg(all(test, idem_loom))]
mod loom_model {
    //! Exhaustive interleavings of the registry and the hand-off, with `loom`.

    use loom::future::block_on;
    use loom::thread;

    use super::*;

    /// Every interleaving with up to three preemptions: loom's usual bound, which finds the
    /// known bugs of this kind while keeping each model to seconds.
    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(f);
    }

    fn key(n: u8) -> Key {
        Key::derive("loom", &n).unwrap()
    }

    fn far() -> Instant {
        Instant::now() + std::time::Duration::from_secs(3600)
    }

    fn done() -> Landing {
        Landing::Completed(Bytes::from_static(b"v"))
    }

    /// A waiter that found the flight always gets its landing: no wake-up is lost, whether
    /// the holder lands before, during or after the waiter registers.
    #[test]
    fn a_waiter_always_sees_the_landing() {
        model(|| {
            let flights = Arc::new(Flights::default());
            let k = key(1);
            let flight = flights.start(k, None, far());
            let holder = {
                let flights = Arc::clone(&flights);
                thread::spawn(move || flights.land(&k, &flight, done()))
            };
            if let Some(found) = flights.get(&k) {
                assert_eq!(block_on(found.wait()), done());
            }
            holder.join().unwrap();
            assert!(
                flights.get(&k).is_none(),
                "a landed flight stays registered"
            );
        });
    }

    /// A holder that is cancelled lands as released, and two waiters both see it.
    #[test]
    fn a_cancelled_holder_releases_every_waiter() {
        model(|| {
            let flights = Arc::new(Flights::default());
            let k = key(2);
            let flight = flights.start(k, None, far());
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    let flights = Arc::clone(&flights);
                    thread::spawn(move || flights.get(&k).map(|f| block_on(f.wait())))
                })
                .collect();
            flights.land(&k, &flight, Landing::Released);
            for waiter in waiters {
                let seen = waiter.join().unwrap();
                assert!(matches!(seen, None | Some(Landing::Released)), "{seen:?}");
            }
        });
    }

    /// A stale holder landing late never unregisters the flight of the holder that took the
    /// key over, and the count of active flights stays exact.
    #[test]
    fn a_stale_landing_leaves_the_new_flight() {
        model(|| {
            let flights = Arc::new(Flights::default());
            let k = key(3);
            let stale = flights.start(k, None, far());
            let stale_holder = {
                let flights = Arc::clone(&flights);
                thread::spawn(move || flights.land(&k, &stale, Landing::Released))
            };
            let fresh = flights.start(k, None, far());
            stale_holder.join().unwrap();
            let found = flights
                .get(&k)
                .expect("the new holder's flight is registered");
            assert!(Arc::ptr_eq(&found, &fresh));
            flights.land(&k, &fresh, done());
            assert!(flights.get(&k).is_none());
            assert_eq!(flights.active.load(Ordering::SeqCst), 0);
        });
    }

    /// A waiter that gives up (its future dropped) while the holder lands neither blocks the
    /// landing nor disturbs the other waiter.
    #[test]
    fn giving_up_races_the_landing_safely() {
        model(|| {
            let flights = Arc::new(Flights::default());
            let k = key(4);
            let flight = flights.start(k, None, far());
            let quitter = {
                let flight = Arc::clone(&flight);
                thread::spawn(move || {
                    let mut wait = Box::pin(flight.wait());
                    let waker = futures_waker();
                    let _ = wait.as_mut().poll(&mut Context::from_waker(&waker));
                    drop(wait);
                })
            };
            let stayer = {
                let flight = Arc::clone(&flight);
                thread::spawn(move || block_on(flight.wait()))
            };
            flights.land(&k, &flight, done());
            quitter.join().unwrap();
            assert_eq!(stayer.join().unwrap(), done());
        });
    }

    fn futures_waker() -> Waker {
        struct Noop;
        impl std::task::Wake for Noop {
            fn wake(self: std::sync::Arc<Self>) {}
        }
        Waker::from(std::sync::Arc::new(Noop))
    }
}
