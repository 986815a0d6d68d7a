//! Helpers shared by the integration tests of the idem workspace (see the `[[test]]` targets).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::store::Claim;
use idem_runtime::{async_trait, Bytes, Error, Fingerprint, Flights, Key, Store, Token};

mod child;
mod dynamodb_server;
pub mod failover;
mod mariadb_server;
pub mod netns;
pub mod scenarios;
mod servers;

pub use child::Child;
pub use dynamodb_server::{
    dynamodb_client, dynamodb_endpoint, dynamodb_store, dynamodb_url, TABLE as DYNAMODB_TABLE,
};
pub use mariadb_server::PrivateMariaDb;
pub use servers::{PrivatePostgres, PrivateRedis, PrivateRedisCluster};

/// Counts how many times a body ran.
#[derive(Clone, Debug, Default)]
pub struct Runs(Arc<AtomicUsize>);

impl Runs {
    /// Records one run and returns how many there were before it.
    pub fn hit(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst)
    }

    /// How many runs so far.
    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

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
    faults: Option<Faults>,
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

/// Failures and delays drawn from a seed: a failure either before the inner call (the
/// store never saw it) or after it (the store acted, but the answer was lost: the ambiguous
/// case).
#[derive(Clone, Debug)]
struct Faults {
    /// The share of operations that fail, half before and half after the inner call.
    fail: f64,
    /// The share of operations delayed, by up to `max_delay`.
    delay: f64,
    max_delay: Duration,
    rng: Arc<std::sync::Mutex<rand_xorshift::XorShiftRng>>,
    injected: Runs,
}

enum Fault {
    Before,
    After,
    Delay(Duration),
}

impl Faults {
    fn draw(&self) -> Option<Fault> {
        use rand::RngExt;
        let mut rng = self.rng.lock().unwrap();
        let roll: f64 = rng.random();
        if roll < self.fail / 2.0 {
            Some(Fault::Before)
        } else if roll < self.fail {
            Some(Fault::After)
        } else if roll < self.fail + self.delay {
            let nanos = rng.random_range(0..=self.max_delay.as_nanos() as u64);
            Some(Fault::Delay(Duration::from_nanos(nanos)))
        } else {
            None
        }
    }
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

impl<S> Probe<S> {
    /// Forwards everything; counts claims.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            renews: true,
            coalesces: true,
            records: true,
            gate: None,
            faults: None,
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

    /// Fails `fail` of the operations (half before, half after the inner call) and delays
    /// `delay` of them by up to `max_delay`, drawn from `seed`.
    pub fn faulty(inner: S, seed: u64, fail: f64, delay: f64, max_delay: Duration) -> Self {
        use rand::SeedableRng;
        let faults = Faults {
            fail,
            delay,
            max_delay,
            rng: Arc::new(std::sync::Mutex::new(
                rand_xorshift::XorShiftRng::seed_from_u64(seed),
            )),
            injected: Runs::default(),
        };
        Self {
            faults: Some(faults),
            ..Self::new(inner)
        }
    }

    /// How many failures were injected.
    pub fn injected(&self) -> usize {
        self.faults.as_ref().map_or(0, |f| f.injected.count())
    }

    /// Runs one inner operation through the seeded faults, if any.
    async fn apply<T>(
        &self,
        operation: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        self.trips.hit();
        let Some(faults) = &self.faults else {
            return operation.await;
        };
        match faults.draw() {
            None => operation.await,
            Some(Fault::Delay(delay)) => {
                tokio::time::sleep(delay).await;
                operation.await
            }
            Some(Fault::Before) => {
                faults.injected.hit();
                Err(Error::store("injected: failed before reaching the store"))
            }
            Some(Fault::After) => {
                faults.injected.hit();
                let _ = operation.await;
                Err(Error::store(
                    "injected: the store acted, the answer was lost",
                ))
            }
        }
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

#[async_trait]
impl<S: Store + Clone> Store for Probe<S> {
    async fn claim_with_nonce(
        &self,
        key: &Key,
        fp: Option<&Fingerprint>,
        lease: Duration,
        nonce: u64,
    ) -> Result<Claim, Error> {
        self.claims.hit();
        let claimed = self
            .apply(self.inner.claim_with_nonce(key, fp, lease, nonce))
            .await;
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

/// What every operation of [`Down`] fails with: as a driver says it, with the server's
/// address and credentials, which no answer to a client may carry.
pub const DOWN: &str = "connection refused: postgres://app:hunter2@db.internal:5432/payments";

/// A store whose server is down: every operation fails with [`DOWN`].
#[derive(Clone, Debug, Default)]
pub struct Down;

#[async_trait]
impl Store for Down {
    async fn claim_with_nonce(
        &self,
        _: &Key,
        _: Option<&Fingerprint>,
        _: Duration,
        _: u64,
    ) -> Result<Claim, Error> {
        Err(Error::store(DOWN))
    }

    async fn complete(&self, _: &Key, _: Token, _: Bytes, _: Duration) -> Result<bool, Error> {
        Err(Error::store(DOWN))
    }

    async fn release(&self, _: &Key, _: Token) -> Result<bool, Error> {
        Err(Error::store(DOWN))
    }

    async fn renew(&self, _: &Key, _: Token, _: Duration) -> Result<bool, Error> {
        Err(Error::store(DOWN))
    }

    async fn fence(&self, _: &Key, _: Token) -> Result<Option<Token>, Error> {
        Err(Error::store(DOWN))
    }

    async fn remove(&self, _: &Key) -> Result<bool, Error> {
        Err(Error::store(DOWN))
    }

    async fn lookup(&self, _: &Key) -> Result<Option<idem_runtime::Recorded>, Error> {
        Err(Error::store(DOWN))
    }
}

/// Whether a missing server fails the test (`IDEM_REQUIRE_SERVICES=1`, as in CI) instead of
/// skipping it.
pub fn services_required() -> bool {
    std::env::var("IDEM_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// Reports a server that is not there: one clear `skipped:` line, or a failure in CI.
pub fn unavailable<T>(what: &str, detail: impl std::fmt::Display) -> Option<T> {
    assert!(
        !services_required(),
        "{what} is required (IDEM_REQUIRE_SERVICES=1) but unavailable: {detail}"
    );
    skipped(format_args!(
        "{what} is unavailable ({detail}); set IDEM_REQUIRE_SERVICES=1 to fail instead"
    ));
    None
}

/// Says that the running test skipped something, and why, in the test command's own
/// output: `skipped: <test> (<n> in this binary): <why>`. Written to the process's
/// standard error itself, past libtest's capture (which takes only `print!`'s output, and
/// shows a passing test's only with `--nocapture`), so a passing test that skipped shows.
pub fn skipped(why: std::fmt::Arguments<'_>) {
    use std::io::Write;
    static SKIPS: AtomicUsize = AtomicUsize::new(0);
    let n = SKIPS.fetch_add(1, Ordering::Relaxed) + 1;
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    let line = format!("skipped: {test} ({n} in this binary): {why}\n");
    // One write of the whole line, so that lines of tests running beside it do not mix.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// The Redis server of `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`).
pub fn redis_url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A store on the Redis server of [`redis_url`], or `None` (skipped) when it is unreachable.
pub async fn redis_store() -> Option<idem_runtime::RedisStore> {
    let url = redis_url();
    match idem_runtime::RedisStore::connect(&url).await {
        Ok(store) => Some(store),
        Err(e) => unavailable(&format!("redis at {url}"), e),
    }
}

pub fn free_port() -> Option<u16> {
    Some(
        std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port(),
    )
}

/// The PostgreSQL database of `IDEM_POSTGRES_URL` (default
/// `postgres://postgres@127.0.0.1:5432/test`).
pub fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Drops what `migrate` created for a store on `table` (a plain name, in the default
/// schema): the table, its token sequence and its claim function.
pub async fn drop_store_objects(pool: &sqlx::PgPool, table: &str) {
    sqlx::raw_sql(&format!(
        "DROP TABLE \"{table}\"; DROP SEQUENCE \"{table}_token\"; \
         DROP FUNCTION \"{table}_claim_in_transaction\""
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// A migrated store on the database of [`postgres_url`], or `None` (skipped) when it is
/// unreachable. Its pool has 8 connections, so that the tests of one binary, which run in
/// parallel, stay within the server's `max_connections`.
pub async fn postgres_store() -> Option<idem_runtime::PostgresStore> {
    let url = postgres_url();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(3))
        .connect(&url)
        .await;
    let store = match pool {
        Ok(pool) => idem_runtime::PostgresStore::from_pool(pool),
        Err(e) => return unavailable(&format!("postgresql at {url}"), e),
    };
    store.migrate().await.expect("migrate");
    Some(store)
}

/// The MySQL or MariaDB database of `IDEM_MYSQL_URL` (default
/// `mysql://root@127.0.0.1:3306/test`).
pub fn mysql_url() -> String {
    std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// Waits until `key`'s claim has lapsed by the store's own clock (the judge of leases),
/// polling it; fails after a minute.
pub async fn until_lapsed<S: idem_runtime::Store + ?Sized>(store: &S, key: &idem_runtime::Key) {
    failover::until("the claim's lease lapses", || async {
        store.lease_left(key).await.unwrap().is_none()
    })
    .await;
}

/// A migrated store on the database of [`mysql_url`], or `None` (skipped) when it is
/// unreachable. Its pool has 8 connections.
pub async fn mysql_store() -> Option<idem_runtime::MySqlStore> {
    let url = mysql_url();
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(3))
        .connect(&url)
        .await;
    let store = match pool {
        Ok(pool) => idem_runtime::MySqlStore::from_pool(pool),
        Err(e) => return unavailable(&format!("mysql at {url}"), e),
    };
    store.migrate().await.expect("migrate");
    Some(store)
}

/// A global allocator that counts the heap bytes in use: a test binary that measures memory
/// installs it (`#[global_allocator] static A: CountingAllocator = CountingAllocator;`) and
/// reads [`heap_bytes`] in a test run alone in a process of its own
/// ([`measured_in_child`]): allocators and epoch collectors free memory on whichever thread
/// passes by, so a count in a busy process mixes in the other tests.
pub struct CountingAllocator;

static HEAP: std::sync::atomic::AtomicIsize = std::sync::atomic::AtomicIsize::new(0);

// SAFETY: every call forwards to the system allocator with the caller's own arguments; the
// counter is only arithmetic beside it.
unsafe impl std::alloc::GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        HEAP.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        HEAP.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        HEAP.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

/// The heap bytes in use, as [`CountingAllocator`] counts them.
pub fn heap_bytes() -> isize {
    HEAP.load(Ordering::Relaxed)
}

/// Runs the ignored test `test` of this binary alone in a process of its own and returns
/// the number it printed after `label` (`"{label} {n}"`).
pub fn measured_in_child(test: &str, label: &str) -> isize {
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            test,
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    let prefix = format!("{label} ");
    stdout
        .lines()
        .find_map(|line| line.split(prefix.as_str()).nth(1))
        .unwrap_or_else(|| panic!("{test} printed no `{label}`: {stdout}"))
        .trim()
        .parse()
        .unwrap()
}
