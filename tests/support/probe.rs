//! [`Probe`]: a store between a test and the store it tests, that counts what reaches the
//! store and injects the faults the test asks for.

use idem_runtime::ClaimRequest;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::store::Claim;
use idem_runtime::testkit::{Faults, Faulty};
use idem_runtime::{async_trait, Bytes, Error, Flights, Key, Store, Token};

use crate::Runs;

/// Forwards to a store, with the faults a test injects and the claims it counts. One type
/// for every scenario; the constructors name them.
#[derive(Clone, Debug)]
pub struct Probe<S> {
    inner: S,
    /// `false`: pretends to renew without renewing, as a holder paused past its lease.
    renews: bool,
    /// `false`: no in-process registry, so calls behave like other processes.
    coalesces: bool,
    /// `false`: every `complete` fails, as a store that went away after the claim.
    records: bool,
    /// Holds every `complete` until the test opens it.
    gate: Option<Gate>,
    /// Seeded failures and delays of every operation but `remove`.
    /// Prints `renewed` on stdout after each renewal the store accepted, for a parent process.
    announces_renewals: bool,
    /// How many of the next `renew` calls fail.
    failing_renewals: Arc<AtomicUsize>,
    /// How many of the next `complete` calls fail (before the gate, if there is one).
    failing_completes: Arc<AtomicUsize>,
    /// How many of the next claims are applied by the store and then fail, their reply
    /// lost.
    lost_claim_replies: Arc<AtomicUsize>,
    /// How long after the store applied a claim its reply arrives.
    late_claim_replies: Option<Duration>,
    claims: Runs,
    /// `renew` calls.
    renewals: Runs,
    /// `complete` calls.
    completes: Runs,
    /// Holds every `record_step` until the test opens it.
    step_gate: Option<Gate>,
    /// Holds every `steps` read until the test opens it.
    steps_gate: Option<Gate>,
    /// Every operation that reached the store: its round trips.
    trips: Runs,
}

/// Where a [`Probe::gated`] store holds its completions: the test learns that one was
/// reached, and lets them through.
#[derive(Clone, Debug)]
pub struct Gate {
    reached: Arc<tokio::sync::Notify>,
    open: Arc<tokio::sync::Semaphore>,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            reached: Arc::default(),
            open: Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }
}

impl Gate {
    /// Waits until a `complete` reached the gate: the body has returned.
    pub async fn reached(&self) {
        self.reached.notified().await;
    }

    /// Lets every held and later `complete` through.
    pub fn open(&self) {
        self.open
            .add_permits(tokio::sync::Semaphore::MAX_PERMITS / 2);
    }

    async fn pass(&self) {
        self.reached.notify_one();
        let _ = self
            .open
            .acquire()
            .await
            .map(tokio::sync::SemaphorePermit::forget);
    }
}

impl<S: Store> Probe<Faulty<S>> {
    /// Fails `fail` of the operations (half before, half after the inner call) and delays
    /// `delay` of them by up to `max_delay`, drawn from `seed`: the testkit's [`Faulty`]
    /// store, behind a probe.
    pub fn faulty(inner: S, seed: u64, fail: f64, delay: f64, max_delay: Duration) -> Self {
        let mut faults = Faults::none();
        faults.fail_before = fail / 2.0;
        faults.fail_after = fail / 2.0;
        faults.delay = delay;
        faults.max_delay = max_delay;
        Self::new(Faulty::new(inner, seed, faults))
    }

    /// How many failures were injected.
    pub fn injected(&self) -> usize {
        self.inner.injected()
    }
}

impl<S> Probe<S> {
    /// Forwards everything; counts claims.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            renews: true,
            coalesces: true,
            records: true,
            gate: None,
            announces_renewals: false,
            failing_renewals: Arc::default(),
            failing_completes: Arc::default(),
            lost_claim_replies: Arc::default(),
            late_claim_replies: None,
            completes: Runs::default(),
            claims: Runs::default(),
            renewals: Runs::default(),
            step_gate: None,
            steps_gate: None,
            trips: Runs::default(),
        }
    }

    /// Another process paused past its lease (its renewals faked: it believes it holds the
    /// key) with a step's record on the way: its records wait at a gate until the test
    /// opens it.
    pub fn frozen_step_gated(inner: S) -> (Self, Gate) {
        let gate = Gate::default();
        let probe = Self {
            step_gate: Some(gate.clone()),
            ..Self::frozen(inner)
        };
        (probe, gate)
    }

    /// Another process whose reads of a call's steps wait at a gate until the test opens
    /// it: the answer of the round trip before a step is late.
    pub fn steps_gated(inner: S) -> (Self, Gate) {
        let gate = Gate::default();
        let probe = Self {
            steps_gate: Some(gate.clone()),
            ..Self::apart(inner)
        };
        (probe, gate)
    }

    /// How many operations reached the store so far (each one round trip on a network
    /// store); `remove` is not counted.
    pub fn trips(&self) -> usize {
        self.trips.count()
    }

    /// Counts one round trip of an inner operation, and runs it.
    async fn apply<T>(
        &self,
        operation: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        self.trips.hit();
        operation.await
    }

    /// Forwards everything, and prints `renewed` after each accepted renewal: a child
    /// process tells its parent that its lease was just extended.
    pub fn announcing_renewals(inner: S) -> Self {
        Self {
            announces_renewals: true,
            coalesces: false,
            ..Self::new(inner)
        }
    }

    /// A store that applies the next `n` claims and then loses their replies (a timeout
    /// after the store acted): the caller sees a failure, the store holds its claim.
    pub fn loses_claim_replies(inner: S, n: usize) -> Self {
        let probe = Self::new(inner);
        probe.lost_claim_replies.store(n, Ordering::SeqCst);
        probe
    }

    /// A store whose claims' replies arrive `late` after the store applied them (a slow
    /// network, a busy process): the lease began before the caller hears of it.
    pub fn answers_claims_late(inner: S, late: Duration) -> Self {
        Self {
            late_claim_replies: Some(late),
            ..Self::new(inner)
        }
    }

    /// How many `renew` calls reached the probe.
    pub fn renewals(&self) -> usize {
        self.renewals.count()
    }

    /// A store whose next `n` renewals fail, as a store that is briefly unreachable.
    pub fn renewals_fail(inner: S, n: usize) -> Self {
        let probe = Self::new(inner);
        probe.failing_renewals.store(n, Ordering::SeqCst);
        probe
    }

    /// Holds every `complete` at a gate until the test opens it.
    pub fn gated(inner: S) -> (Self, Gate) {
        let gate = Gate::default();
        let probe = Self {
            gate: Some(gate.clone()),
            ..Self::new(inner)
        };
        (probe, gate)
    }

    /// A store that goes away while a body runs and comes back when the test says: the next
    /// `failures` completes fail, and later ones wait at the gate.
    pub fn outage(inner: S, failures: usize) -> (Self, Gate) {
        let (probe, gate) = Self::gated(inner);
        probe.failing_completes.store(failures, Ordering::SeqCst);
        (probe, gate)
    }

    /// Another process: forwards everything, shares no registry.
    pub fn apart(inner: S) -> Self {
        Self {
            coalesces: false,
            ..Self::new(inner)
        }
    }

    /// Makes the next `n` renewals fail (`0`: none), from now on.
    pub fn fail_renewals(&self, n: usize) {
        self.failing_renewals.store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` completions fail (`0`: none), from now on.
    pub fn fail_completes(&self, n: usize) {
        self.failing_completes.store(n, Ordering::SeqCst);
    }

    /// How many `complete` calls reached the probe.
    pub fn completes(&self) -> usize {
        self.completes.count()
    }

    /// Another process paused past its lease: never renews, shares no registry.
    pub fn frozen(inner: S) -> Self {
        Self {
            renews: false,
            coalesces: false,
            ..Self::new(inner)
        }
    }

    /// A holder in this process paused past its lease: never renews; its local waiters wait
    /// on it.
    pub fn paused(inner: S) -> Self {
        Self {
            renews: false,
            ..Self::new(inner)
        }
    }

    /// A store that went away after the claim: every `complete` fails.
    pub fn complete_fails(inner: S) -> Self {
        Self {
            records: false,
            ..Self::new(inner)
        }
    }

    /// How many claims reached the store.
    pub fn claims(&self) -> usize {
        self.claims.count()
    }
}

impl<S: Store + Clone> Probe<S> {
    /// What every claim's reply meets on its way back: a late reply, a lost one.
    async fn after_claim(&self, claimed: Result<Claim, Error>) -> Result<Claim, Error> {
        if let Some(late) = self.late_claim_replies {
            tokio::time::sleep(late).await;
        }
        let failing = |n: usize| n.checked_sub(1);
        if self
            .lost_claim_replies
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, failing)
            .is_ok()
        {
            return Err(Error::store(
                "injected: the store claimed, the reply was lost",
            ));
        }
        claimed
    }
}

#[async_trait]
impl<S: Store + Clone> Store for Probe<S> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        self.claims.hit();
        let claimed = self.apply(self.inner.claim(request)).await;
        self.after_claim(claimed).await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.completes.hit();
        if !self.records {
            return Err(Error::store("connection reset"));
        }
        let failing = |n: usize| n.checked_sub(1);
        if self
            .failing_completes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, failing)
            .is_ok()
        {
            return Err(Error::store("injected: the store went away"));
        }
        if let Some(gate) = &self.gate {
            gate.pass().await;
        }
        self.apply(self.inner.complete(key, token, value, ttl))
            .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        self.apply(self.inner.release(key, token)).await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        self.renewals.hit();
        if !self.renews {
            return Ok(true); // so the holder does not notice it lost the lease
        }
        let failing = |n: usize| n.checked_sub(1);
        if self
            .failing_renewals
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, failing)
            .is_ok()
        {
            return Err(Error::store("injected: the renewal failed"));
        }
        let renewed = self.apply(self.inner.renew(key, token, lease)).await;
        if self.announces_renewals && matches!(renewed, Ok(true)) {
            println!("renewed");
        }
        renewed
    }

    async fn fence(&self, key: &Key, token: Token) -> Result<Option<Token>, Error> {
        self.trips.hit();
        self.inner.fence(key, token).await
    }

    async fn record_step(
        &self,
        call: &Key,
        token: Token,
        step: &Key,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        if let Some(gate) = &self.step_gate {
            gate.pass().await;
        }
        self.apply(self.inner.record_step(call, token, step, value, ttl))
            .await
    }

    async fn steps(&self, call: &Key) -> Result<Vec<(Key, Bytes)>, Error> {
        if let Some(gate) = &self.steps_gate {
            gate.pass().await;
        }
        self.apply(self.inner.steps(call)).await
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        self.inner.remove(key).await
    }

    async fn lookup(&self, key: &Key) -> Result<Option<idem_runtime::Recorded>, Error> {
        self.apply(self.inner.lookup(key)).await
    }

    async fn lease_left(&self, key: &Key) -> Result<Option<Duration>, Error> {
        self.apply(self.inner.lease_left(key)).await
    }

    fn claim_timeout(&self) -> Option<Duration> {
        self.inner.claim_timeout()
    }

    fn flights(&self) -> Option<&Flights> {
        if self.coalesces {
            self.inner.flights()
        } else {
            None
        }
    }
}
