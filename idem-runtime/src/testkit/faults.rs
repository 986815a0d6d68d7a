//! A store whose operations fail, lose their answers, slow down and stall, as a seed says.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::{Claim, ClaimRequest, Error, Flights, Key, Recorded, Store, Token};

/// How often each kind of fault hits an operation of a [`Faulty`] store: each a share of
/// every operation, drawn independently per operation from the seed.
///
/// ```
/// let faults = idem_runtime::testkit::Faults::ten_percent();
/// assert_eq!(faults.fail_before + faults.fail_after, 0.10);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Faults {
    /// Fails before reaching the store: the store never saw it.
    pub fail_before: f64,
    /// Fails after the store acted: the write landed, the answer was lost (the ambiguous
    /// case a timeout on a live connection is).
    pub fail_after: f64,
    /// Reaches the store after a delay of up to `max_delay`.
    pub delay: f64,
    /// The longest delay.
    pub max_delay: Duration,
    /// Reaches the store only after `stall_for`: longer than a lease, a renewal that
    /// stalls lets the claim lapse under a live holder.
    pub stall: f64,
    /// How long a stalled operation waits before it reaches the store.
    pub stall_for: Duration,
}

impl Faults {
    /// No faults: the store as it is.
    pub const fn none() -> Self {
        Self {
            fail_before: 0.0,
            fail_after: 0.0,
            delay: 0.0,
            max_delay: Duration::ZERO,
            stall: 0.0,
            stall_for: Duration::ZERO,
        }
    }

    /// Every operation failing with probability 0.1, half before and half after it reached
    /// the store; 10 % delayed by up to 20 ms; none stalled.
    pub const fn ten_percent() -> Self {
        Self {
            fail_before: 0.05,
            fail_after: 0.05,
            delay: 0.10,
            max_delay: Duration::from_millis(20),
            stall: 0.0,
            stall_for: Duration::ZERO,
        }
    }

    /// These faults, and `share` of the operations stalled for `stall_for`.
    #[must_use]
    pub const fn stalling(mut self, share: f64, stall_for: Duration) -> Self {
        self.stall = share;
        self.stall_for = stall_for;
        self
    }
}

/// One fault, as drawn for one operation.
enum Fault {
    Before,
    After,
    Stall,
    Delay(Duration),
}

/// SplitMix64: a small, fast generator whose whole state is one `u64`, enough for a fault
/// schedule (no statistical claim rests on it).
#[derive(Debug)]
pub(super) struct SplitMix(u64);

impl SplitMix {
    pub(super) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `[0, 1)`.
    pub(super) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1_u64 << 53) as f64
    }

    /// A number in `0..n` (`0` when `n` is `0`).
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next().checked_rem(n).unwrap_or(0)
    }
}

/// A [`Store`] that forwards to `S` through a seeded schedule of [`Faults`]: what the
/// history checks ([`histories`](super::histories())) run every store through. Every
/// operation but [`remove`](Store::remove) (an operator's) draws its fault; the in-process
/// registry of `S` is kept (a process's own duplicates still coalesce), and a typed value
/// is not kept beside a record, so that every completion goes through the faults.
///
/// ```
/// use idem_runtime::testkit::{Faults, Faulty};
/// use idem_runtime::{MemoryStore, Operation};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::Error> {
/// let store = Faulty::new(MemoryStore::new(), 7, Faults::ten_percent());
/// let op = Operation::new("billing.charge.v1");
/// let key = op.key(&1)?;
/// // Every call fails closed, runs once or says that it ran: never anything else.
/// let _ = op.run(&store, &key, None, async { Ok::<_, idem_runtime::Error>(1) }).await;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Faulty<S> {
    inner: S,
    faults: Faults,
    rng: Arc<Mutex<SplitMix>>,
    injected: Arc<AtomicUsize>,
}

impl<S: Store> Faulty<S> {
    /// `inner` with `faults` drawn from `seed`.
    pub fn new(inner: S, seed: u64, faults: Faults) -> Self {
        Self {
            inner,
            faults,
            rng: Arc::new(Mutex::new(SplitMix::new(seed))),
            injected: Arc::default(),
        }
    }

    /// How many operations failed or stalled by the schedule so far.
    pub fn injected(&self) -> usize {
        self.injected.load(Ordering::Relaxed)
    }

    /// The store behind the faults.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn draw(&self) -> Option<Fault> {
        let f = &self.faults;
        let mut rng = self.rng.lock().unwrap_or_else(PoisonError::into_inner);
        let roll = rng.unit();
        let mut edge = f.fail_before;
        if roll < edge {
            return Some(Fault::Before);
        }
        edge += f.fail_after;
        if roll < edge {
            return Some(Fault::After);
        }
        edge += f.stall;
        if roll < edge {
            return Some(Fault::Stall);
        }
        edge += f.delay;
        if roll < edge {
            let nanos = rng.below(f.max_delay.as_nanos() as u64 + 1);
            return Some(Fault::Delay(Duration::from_nanos(nanos)));
        }
        None
    }

    /// Runs one operation of the inner store through the schedule.
    async fn apply<T>(
        &self,
        operation: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        match self.draw() {
            None => operation.await,
            Some(Fault::Delay(pause)) => {
                tokio::time::sleep(pause).await;
                operation.await
            }
            Some(Fault::Stall) => {
                self.injected.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(self.faults.stall_for).await;
                operation.await
            }
            Some(Fault::Before) => {
                self.injected.fetch_add(1, Ordering::Relaxed);
                Err(Error::store("injected: failed before reaching the store"))
            }
            Some(Fault::After) => {
                self.injected.fetch_add(1, Ordering::Relaxed);
                let _ = operation.await;
                Err(Error::store(
                    "injected: the store acted, its answer was lost",
                ))
            }
        }
    }
}

#[async_trait]
impl<S: Store + Clone> Store for Faulty<S> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        self.apply(self.inner.claim(request)).await
    }

    async fn holding(&self, key: &Key) -> Result<Option<crate::store::Holding>, Error> {
        self.apply(self.inner.holding(key)).await
    }

    async fn released_by_operator(&self, key: &Key, token: Token) -> Result<bool, Error> {
        self.apply(self.inner.released_by_operator(key, token))
            .await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.apply(self.inner.complete(key, token, value, ttl))
            .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        self.apply(self.inner.release(key, token)).await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        self.apply(self.inner.renew(key, token, lease)).await
    }

    async fn fence(&self, key: &Key, token: Token) -> Result<Option<Token>, Error> {
        self.apply(self.inner.fence(key, token)).await
    }

    async fn record_step(
        &self,
        call: &Key,
        token: Token,
        step: &Key,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.apply(self.inner.record_step(call, token, step, value, ttl))
            .await
    }

    async fn steps(&self, call: &Key) -> Result<Vec<(Key, Bytes)>, Error> {
        self.apply(self.inner.steps(call)).await
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        self.inner.remove(key).await
    }

    async fn lookup(&self, key: &Key) -> Result<Option<Recorded>, Error> {
        self.apply(self.inner.lookup(key)).await
    }

    async fn lease_left(&self, key: &Key) -> Result<Option<Duration>, Error> {
        self.apply(self.inner.lease_left(key)).await
    }

    fn claim_timeout(&self) -> Option<Duration> {
        self.inner.claim_timeout()
    }

    fn peek(&self, key: &Key) -> Option<Claim> {
        self.inner.peek(key)
    }

    fn flights(&self) -> Option<&Flights> {
        self.inner.flights()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    /// What a seed promises: the same schedule of faults, draw for draw.
    #[tokio::test]
    async fn a_seed_draws_the_same_faults_again() {
        let faults = Faults::ten_percent().stalling(0.05, Duration::from_millis(1));
        let drawn = |seed| {
            let store = Faulty::new(MemoryStore::new(), seed, faults);
            (0..1_000)
                .map(|_| match store.draw() {
                    None => 0,
                    Some(Fault::Before) => 1,
                    Some(Fault::After) => 2,
                    Some(Fault::Stall) => 3,
                    Some(Fault::Delay(pause)) => 4 + pause.as_nanos(),
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(drawn(7), drawn(7));
        assert_ne!(drawn(7), drawn(8));
        // Each kind comes at about its share (10 % fail, 5 % stall, 10 % delay of 1 000).
        let kinds = drawn(7);
        let count = |kind: u128| kinds.iter().filter(|k| **k == kind).count();
        assert!((20..=80).contains(&count(1)), "{}", count(1));
        assert!((20..=80).contains(&count(2)), "{}", count(2));
        assert!((20..=80).contains(&count(3)), "{}", count(3));
    }
}
