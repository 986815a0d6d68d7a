//! Helpers shared by the integration tests of the idem workspace (see the `[[test]]` targets).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::store::Claim;
use idem_runtime::{async_trait, Bytes, Error, Fingerprint, Flights, Key, Store, Token};

pub mod netns;

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
    claims: Runs,
    /// `complete` calls.
    completes: Runs,
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
            completes: Runs::default(),
            claims: Runs::default(),
        }
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
    async fn claim(
        &self,
        key: &Key,
        fp: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Claim, Error> {
        self.claims.hit();
        self.apply(self.inner.claim(key, fp, lease)).await
    }

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
        self.inner.fence(key, token).await
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
    async fn claim(&self, _: &Key, _: Option<&Fingerprint>, _: Duration) -> Result<Claim, Error> {
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
    println!(
        "skipped: {what} is unavailable ({detail}); set IDEM_REQUIRE_SERVICES=1 to fail instead"
    );
    None
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

/// A `redis-server` of the test's own on a free loopback port, stopped when dropped: for
/// tests that read its counters or kill it.
pub struct PrivateRedis {
    child: std::process::Child,
    /// Its URL.
    pub url: String,
    /// Its port.
    pub port: u16,
}

impl PrivateRedis {
    /// Starts one, or `None` (skipped) when `redis-server` cannot run here.
    pub fn start() -> Option<Self> {
        Self::start_on_a_free_port(Some, |_| Vec::new())
    }

    /// Starts one on a free port with extra `redis-server` arguments (`--replicaof …`).
    pub fn start_with_args(extra: &[String]) -> Option<Self> {
        Self::start_on_a_free_port(Some, |_| extra.to_vec())
    }

    /// Starts one on `port` with extra `redis-server` arguments: a killed server back on
    /// its port in another role.
    pub fn start_on_with_args(port: u16, extra: &[String]) -> Option<Self> {
        match Self::start_with(port, extra.to_vec()) {
            Ok(server) => server,
            Err(Taken) => unavailable("a private redis-server", format!("port {port} is taken")),
        }
    }

    /// Starts one on `port` (a server that comes back after [`kill`](Self::kill)).
    pub fn start_on(port: u16) -> Option<Self> {
        match Self::start_with(port, Vec::new()) {
            Ok(server) => server,
            Err(Taken) => unavailable("a private redis-server", format!("port {port} is taken")),
        }
    }

    /// Starts one on a free port that `accept` agrees to, with the extra arguments `extra`
    /// makes for it. "Free" is only what the port was a moment ago: a port another test took
    /// meanwhile is tried again with another.
    fn start_on_a_free_port(
        accept: impl Fn(u16) -> Option<u16>,
        extra: impl Fn(u16) -> Vec<String>,
    ) -> Option<Self> {
        for _ in 0..50 {
            let Some(port) = free_port().and_then(&accept) else {
                continue;
            };
            match Self::start_with(port, extra(port)) {
                Ok(server) => return server,
                Err(Taken) => continue,
            }
        }
        unavailable("a private redis-server", "no free port in 50 tries")
    }

    /// Starts one on `port` with extra `redis-server` arguments: `Err(Taken)` when another
    /// process serves that port, which a connection alone cannot tell from this one.
    fn start_with(port: u16, extra: Vec<String>) -> Result<Option<Self>, Taken> {
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) => return Ok(unavailable("redis-server (to start a private server)", e)),
        };
        let pid = child.id();
        let mut server = Self {
            child,
            url: format!("redis://127.0.0.1:{port}"),
            port,
        };
        for _ in 0..250 {
            if let Ok(Some(_)) = server.child.try_wait() {
                return Err(Taken); // it could not bind: another process has the port
            }
            match serving_pid(port) {
                Some(serving) if serving == pid => return Ok(Some(server)),
                Some(_) => {
                    server.kill();
                    return Err(Taken);
                }
                None => {}
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(unavailable(
            "a private redis-server",
            "it did not start listening within 5 s",
        ))
    }

    /// Kills the server at once.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A port another process serves.
struct Taken;

/// The process id of the Redis server on `port`, from its `INFO server`, if one answers.
fn serving_pid(port: u16) -> Option<u32> {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    socket.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    socket.write_all(b"INFO server\r\n").ok()?;
    let mut reply = Vec::new();
    let mut buf = [0; 4096];
    loop {
        let n = socket.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        reply.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&reply);
        if let Some(rest) = text.split("process_id:").nth(1) {
            if let Some(line) = rest.split("\r\n").next().filter(|_| rest.contains("\r\n")) {
                return line.trim().parse().ok();
            }
        }
    }
}

/// A 3-master Redis Cluster of the test's own, on free loopback ports, stopped and deleted
/// when dropped: `cargo test` needs no cluster started by hand.
pub struct PrivateRedisCluster {
    nodes: Vec<PrivateRedis>,
    dir: std::path::PathBuf,
}

impl PrivateRedisCluster {
    /// Starts the masters, joins them with `redis-cli --cluster create`, and waits until the
    /// cluster answers `cluster_state:ok`; or `None` (skipped) when that cannot be done here.
    pub fn start() -> Option<Self> {
        static CLUSTERS: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idem-redis-cluster-{}-{}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).ok()?;
        let mut cluster = Self {
            nodes: Vec::new(),
            dir,
        };
        let dir = cluster.dir.to_str()?.to_string();
        for _ in 0..3 {
            // A node also listens on its port + 10000, the cluster bus: both must be free.
            let bus_free = |port: u16| {
                (port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok())
                    .then_some(port)
            };
            let node = PrivateRedis::start_on_a_free_port(bus_free, |port| {
                let config = format!("{dir}/nodes-{port}.conf");
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &config,
                    "--cluster-node-timeout",
                    "2000",
                    "--dir",
                    &dir,
                ]
                .map(str::to_string)
                .to_vec()
            })?;
            cluster.nodes.push(node);
        }
        let mut create = std::process::Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        create.args(["--cluster-replicas", "0", "--cluster-yes"]);
        match create.output() {
            Ok(out) if out.status.success() => {}
            other => return unavailable("redis-cli --cluster create", format!("{other:?}")),
        }
        // Joining is asynchronous: wait (bounded) until every slot is served.
        for _ in 0..500 {
            let info = std::process::Command::new("redis-cli")
                .args(["-p", &cluster.nodes[0].port.to_string(), "cluster", "info"])
                .output()
                .ok()?;
            if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                return Some(cluster);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        unavailable(
            "a private redis cluster",
            "it did not reach cluster_state:ok within 10 s",
        )
    }

    /// The URLs of its masters.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|node| node.url.clone()).collect()
    }
}

impl Drop for PrivateRedisCluster {
    fn drop(&mut self) {
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
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

/// A PostgreSQL server of the test's own (initdb in a temporary folder, a free loopback port,
/// `pg_stat_statements` preloaded), stopped and deleted when dropped: for tests that count
/// its statements or restart it.
pub struct PrivatePostgres {
    bin: std::path::PathBuf,
    dir: std::path::PathBuf,
    port: u16,
    /// Server settings beyond the defaults, as `-c name=value` options.
    settings: Vec<String>,
    /// The command its programs run under: nothing, or `ip netns exec <host>`.
    within: Vec<String>,
    /// The addresses it listens on.
    listen: &'static str,
    /// Its URL.
    pub url: String,
}

impl PrivatePostgres {
    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Starts one, or `None` (skipped) when PostgreSQL's server programs are not here.
    pub fn start() -> Option<Self> {
        Self::start_with(&[])
    }

    /// Starts one with server `settings` (`("synchronous_standby_names", "standby")`).
    pub fn start_with(settings: &[(&str, &str)]) -> Option<Self> {
        Self::initialised(Self::prepared()?, settings)
    }

    /// Starts one in a host of the test's own (`within`: [`netns::Network::within`]),
    /// listening on every address there; its `url` is the loopback one, which only that
    /// host reaches.
    pub fn start_within(within: Vec<String>) -> Option<Self> {
        let mut server = Self::prepared()?;
        server.within = within;
        server.listen = "*";
        Self::initialised(server, &[])
    }

    fn initialised(mut server: Self, settings: &[(&str, &str)]) -> Option<Self> {
        server.settings = settings
            .iter()
            .map(|(k, v)| format!("-c {k}={v}"))
            .collect();
        let data = server.dir.join("data");
        let initdb = server.bin.join("initdb");
        if let Err(e) = server.postgres(
            &initdb,
            &[
                "-D",
                data.to_str()?,
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        ) {
            return unavailable("initdb (to start a private postgresql)", e);
        }
        if server.listen != "127.0.0.1" {
            // Clients from other hosts, trusted as on loopback.
            let hba = data.join("pg_hba.conf");
            let rules = std::fs::read_to_string(&hba).ok()?;
            std::fs::write(&hba, rules + "host all all 0.0.0.0/0 trust\n").ok()?;
        }
        if let Err(e) = server.ctl("start") {
            return unavailable("a private postgresql", e);
        }
        Some(server)
    }

    /// A streaming standby of `primary`, copied with `pg_basebackup` and started on a port of
    /// its own; it connects as `application_name=standby`.
    pub fn standby_of(primary: &Self) -> Option<Self> {
        let server = Self::prepared()?;
        let data = server.dir.join("data");
        let conninfo = format!(
            "host=127.0.0.1 port={} user=postgres application_name=standby",
            primary.port
        );
        let basebackup = server.bin.join("pg_basebackup");
        if let Err(e) = server.postgres(
            &basebackup,
            &[
                "-d",
                &conninfo,
                "-D",
                data.to_str()?,
                "-R",
                "-X",
                "stream",
                "--no-sync",
            ],
        ) {
            return unavailable("pg_basebackup (to start a standby)", e);
        }
        if let Err(e) = server.ctl("start") {
            return unavailable("a private standby", e);
        }
        Some(server)
    }

    /// Stops the server as a crash would (`pg_ctl stop -m immediate`): no shutdown
    /// checkpoint, and no more WAL for its standbys.
    pub fn crash(&self) {
        let data = self.dir.join("data").display().to_string();
        let ctl = self.bin.join("pg_ctl");
        self.postgres(&ctl, &["-D", &data, "-m", "immediate", "-w", "stop"])
            .expect("stop the private postgresql");
    }

    /// Promotes a standby to a primary, and waits until it is one.
    pub fn promote(&self) {
        let data = self.dir.join("data").display().to_string();
        let ctl = self.bin.join("pg_ctl");
        self.postgres(&ctl, &["-D", &data, "-w", "promote"])
            .expect("promote the private standby");
    }

    /// A server's directory and port, before anything runs there.
    fn prepared() -> Option<Self> {
        let bin = match std::process::Command::new("pg_config")
            .arg("--bindir")
            .output()
        {
            Ok(out) if out.status.success() => {
                std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
            }
            other => {
                return unavailable(
                    "pg_config (to start a private postgresql)",
                    format!("{other:?}"),
                )
            }
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
        let dir = std::env::temp_dir().join(format!("idem-pg-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let server = Self {
            bin,
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            dir,
            port,
            settings: Vec::new(),
            within: Vec::new(),
            listen: "127.0.0.1",
        };
        if as_root() {
            run("chown", &["postgres:postgres", server.dir.to_str()?]).ok()?;
        }
        Some(server)
    }

    /// The server's log so far (with `log_statement = 'all'` set in a session, every
    /// statement that session runs, as the server received it).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// Restarts the server (a fast shutdown, then a start): what a deploy or a crash does.
    pub fn restart(&self) {
        self.ctl("restart").expect("restart the private postgresql");
    }

    fn ctl(&self, action: &str) -> Result<(), String> {
        let data = self.dir.join("data");
        let options = format!(
            "-p {} -k {} -c listen_addresses={} -c shared_preload_libraries=pg_stat_statements -c fsync=off {}",
            self.port,
            self.dir.display(),
            self.listen,
            self.settings.join(" ")
        );
        let log = self.dir.join("log");
        let ctl = self.bin.join("pg_ctl");
        self.postgres(
            &ctl,
            &[
                "-D",
                &data.display().to_string(),
                "-l",
                &log.display().to_string(),
                "-o",
                &options,
                "-m",
                "fast",
                "-w",
                action,
            ],
        )
    }

    /// Runs a server program as `postgres` (it refuses to run as root).
    fn postgres(&self, program: &std::path::Path, args: &[&str]) -> Result<(), String> {
        let program = program.display().to_string();
        let mut all: Vec<&str> = self.within.iter().map(String::as_str).collect();
        if as_root() {
            all.extend(["runuser", "-u", "postgres", "--"]);
        }
        all.push(&program);
        all.extend_from_slice(args);
        run(all[0], &all[1..])
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let data = self.dir.join("data").display().to_string();
        let ctl = self.bin.join("pg_ctl");
        let _ = self.postgres(&ctl, &["-D", &data, "-m", "immediate", "-w", "stop"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// A child process of this test binary, running one of its ignored tests (a holder to kill,
/// a server to restart): its stdout read line by line, and SIGKILLed and reaped on drop, so
/// that no test leaves one behind.
pub struct Child {
    process: std::process::Child,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl Child {
    /// Starts the ignored test `test` of this binary, with `env` set.
    pub fn start(test: &str, env: &[(&str, &str)]) -> Self {
        Self::start_as(
            std::process::Command::new(std::env::current_exe().unwrap()),
            test,
            env,
        )
    }

    /// Starts the ignored test `test` of this binary through `command`, a command that runs
    /// this binary (in a host of its own: [`netns::Network::command`]), with `env` set.
    pub fn start_as(mut command: std::process::Command, test: &str, env: &[(&str, &str)]) -> Self {
        use std::io::{BufRead, BufReader};

        command
            .args(["--ignored", "--exact", test, "--nocapture"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        for (name, value) in env {
            command.env(name, value);
        }
        let mut process = command.spawn().unwrap();
        let stdout = process.stdout.take().unwrap();
        let (send, lines) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Self { process, lines }
    }

    /// Writes `line` to the child's standard input (its instructions).
    pub fn say(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.process.stdin.as_mut().expect("the child's stdin");
        writeln!(stdin, "{line}").expect("the child reads its stdin");
    }

    /// Waits until the child prints a line containing `what` (its signal, never a sleep).
    /// Panics if it exits first, or says nothing for a minute.
    pub async fn wait_for(&mut self, what: &str) {
        self.line_with(what).await;
    }

    /// Waits until the child prints a line containing `what`, and returns that line. Panics
    /// if it exits first, or says nothing for a minute.
    pub async fn line_with(&mut self, what: &str) -> String {
        loop {
            let line = self.next_line().await;
            if line.contains(what) {
                return line;
            }
        }
    }

    /// The next line the child prints. Panics if it exits first, or says nothing for a
    /// minute.
    pub async fn next_line(&mut self) -> String {
        let line = tokio::time::timeout(Duration::from_secs(60), self.lines.recv()).await;
        line.expect("the child stalled").expect("the child exited")
    }

    /// SIGKILL: no destructor runs, nothing is released. Returns how many of the lines it
    /// printed that the test has not read contain `what`.
    pub fn kill(&mut self, what: &str) -> usize {
        let _ = self.process.kill();
        let _ = self.process.wait();
        let mut count = 0;
        while let Ok(line) = self.lines.try_recv() {
            count += usize::from(line.contains(what));
        }
        count
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
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

/// Scenarios across processes that every shared backend must pass, generic over the store:
/// the backend suites (`redis.rs`, `postgres.rs`) run the same code.
pub mod scenarios {
    use std::sync::Arc;
    use std::time::Duration;

    use idem_runtime::{Error, InFlight, Key, Operation, Outcome, Store};
    use tokio::time::Instant;

    use crate::{Probe, Runs};

    /// A namespace of its own for each run, so that runs never see each other's records.
    pub fn namespace(test: &str) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("scenario.{test}.{nanos}")
    }

    /// Two stores on separate connections (two processes, in effect), 200 concurrent callers
    /// each on one key: the body runs once and all 400 get its value.
    pub async fn two_stores_200_callers_each<S: Store + Clone>(first: S, second: S) {
        let op = Arc::new(Operation::new(namespace("two_stores")));
        let key = op.key(&"order-1").unwrap();
        let runs = Runs::default();
        let mut calls = Vec::new();
        for store in [first, second] {
            for i in 0..200_u32 {
                let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
                calls.push(tokio::spawn(async move {
                    op.run(&store, &key, None, async move {
                        runs.hit();
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Ok::<_, Error>(format!("receipt-{i}"))
                    })
                    .await
                }));
            }
        }
        let mut values = Vec::new();
        for call in calls {
            values.push(call.await.unwrap().unwrap().into_inner());
        }
        assert_eq!(runs.count(), 1, "one body for 400 callers on two stores");
        assert_eq!(values.len(), 400);
        assert!(
            values.iter().all(|v| *v == values[0]),
            "all 400 got the same value"
        );
    }

    /// A holder that stopped renewing (paused past its lease) is taken over; its own
    /// completion is refused and the new owner's result stands.
    pub async fn zombie_cannot_overwrite_the_new_owner<S: Store + Clone>(store: S) {
        let lease = Duration::from_millis(200);
        let op = Operation::new(namespace("zombie")).lease(lease);
        let key = op.key(&1).unwrap();
        let (claimed, has_claimed) = tokio::sync::oneshot::channel();
        let (owner_done, wake_zombie) = tokio::sync::oneshot::channel::<()>();
        let zombie = {
            let (op, store) = (op.clone(), Probe::frozen(store.clone()));
            tokio::spawn(async move {
                op.run(&store, &key, None, async {
                    let _ = claimed.send(());
                    // Paused until another process owns the key and recorded its result.
                    let _ = wake_zombie.await;
                    Ok::<_, Error>("zombie".to_string())
                })
                .await
            })
        };
        has_claimed.await.unwrap();
        // The zombie never renews: a lease after its claim, the store lets the key go.
        tokio::time::sleep(lease + Duration::from_millis(100)).await;
        let other_process = Probe::frozen(store.clone());
        let owner = op.run(&other_process, &key, None, async {
            Ok::<_, Error>("owner".to_string())
        });
        assert_eq!(owner.await.unwrap(), Outcome::Executed("owner".to_string()));
        owner_done.send(()).unwrap();
        // The zombie's body did run, but its result is not the key's: its caller gets the
        // owner's record, the one value every caller of the key gets.
        assert_eq!(
            zombie.await.unwrap().unwrap(),
            Outcome::Replayed("owner".to_string())
        );
        let replay = op.run(&store, &key, None, async {
            Ok::<_, Error>("third".to_string())
        });
        assert_eq!(
            replay.await.unwrap(),
            Outcome::Replayed("owner".to_string())
        );
    }

    /// Waits until the claim on `key` has lapsed in `store`: its holder never renews.
    async fn lapsed<S: Store>(store: &S, key: &Key) {
        while store.lease_left(key).await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A holder paused past its lease whose body then returns: it never answers a result
    /// that is not the key's. If nobody took the key, its result is recorded and answered;
    /// if another holder runs the key, it gets `InProgress` (and the retry replays the other
    /// holder's record). The case where another holder recorded first is
    /// [`zombie_cannot_overwrite_the_new_owner`].
    pub async fn a_lapsed_holder_answers_only_what_the_key_records<S: Store + Clone>(store: S) {
        let lease = Duration::from_millis(200);
        let op = Operation::new(namespace("lapsed-holder")).lease(lease);
        let frozen = Probe::frozen(store.clone());
        let paused_past_its_lease = |key: Key, value: &'static str| {
            let (op, frozen) = (op.clone(), frozen.clone());
            let (claimed, has_claimed) = tokio::sync::oneshot::channel();
            let (wake, woken) = tokio::sync::oneshot::channel::<()>();
            let call = tokio::spawn(async move {
                op.run(&frozen, &key, None, async {
                    let _ = claimed.send(());
                    let _ = woken.await;
                    Ok::<_, Error>(value.to_string())
                })
                .await
            });
            (call, has_claimed, wake)
        };

        // Nobody took the key: the late result is recorded, and replayed after.
        let key = op.key(&(1, std::process::id())).unwrap();
        let (call, claimed, wake) = paused_past_its_lease(key, "late");
        claimed.await.unwrap();
        lapsed(&store, &key).await;
        wake.send(()).unwrap();
        assert_eq!(
            call.await.unwrap().unwrap(),
            Outcome::Executed("late".to_string())
        );
        let replay = op.run(&store, &key, None, async {
            Ok::<_, Error>("again".to_string())
        });
        assert_eq!(replay.await.unwrap(), Outcome::Replayed("late".to_string()));

        // Another holder runs the key: InProgress, never the late value as if recorded.
        let key = op.key(&(2, std::process::id())).unwrap();
        let (call, claimed, wake) = paused_past_its_lease(key, "late");
        claimed.await.unwrap();
        lapsed(&store, &key).await;
        let (owner, owner_claimed, finish_owner) = {
            let op = op.clone().lease(Duration::from_secs(30));
            let other_process = Probe::frozen(store.clone());
            let (claimed, has_claimed) = tokio::sync::oneshot::channel();
            let (finish, finished) = tokio::sync::oneshot::channel::<()>();
            let call = tokio::spawn(async move {
                op.run(&other_process, &key, None, async {
                    let _ = claimed.send(());
                    let _ = finished.await;
                    Ok::<_, Error>("owner".to_string())
                })
                .await
            });
            (call, has_claimed, finish)
        };
        owner_claimed.await.unwrap();
        wake.send(()).unwrap();
        let err = call.await.unwrap().unwrap_err();
        assert!(matches!(err, Error::InProgress), "{err}");
        finish_owner.send(()).unwrap();
        assert_eq!(
            owner.await.unwrap().unwrap(),
            Outcome::Executed("owner".to_string())
        );
        let replay = op.run(&store, &key, None, async {
            Ok::<_, Error>("again".to_string())
        });
        assert_eq!(
            replay.await.unwrap(),
            Outcome::Replayed("owner".to_string())
        );
    }

    /// A downstream resource fenced by tokens: a write lands only with a token larger than
    /// the last one that landed.
    #[derive(Default)]
    struct Fenced(std::sync::Mutex<(u64, &'static str)>);

    impl Fenced {
        fn write(&self, token: idem_runtime::Token, note: &'static str) -> bool {
            let mut last = self.0.lock().unwrap();
            if token.get() <= last.0 {
                return false;
            }
            *last = (token.get(), note);
            true
        }
    }

    /// Two holders of one key, the first paused past its lease: the fencing token each gets
    /// from `attempt().token()` lets the newer holder's downstream write land and refuses the
    /// zombie's, whether the zombie took its token before it was taken over or asks after.
    pub async fn zombie_fences_are_refused_downstream<S: Store + Clone>(store: S) {
        let lease = Duration::from_millis(300);
        let op = Operation::new(namespace("zombie-fence")).lease(lease);
        let downstream = Arc::new(Fenced::default());
        for asks_late in [false, true] {
            let key = op.key(&asks_late).unwrap();
            let (claimed, has_claimed) = tokio::sync::oneshot::channel();
            let (taken_over, resume) = tokio::sync::oneshot::channel::<()>();
            // What the zombie's fenced write did: its answer is the owner's record.
            let (wrote, zombie_wrote) = tokio::sync::oneshot::channel();
            let zombie = {
                let (op, store, downstream) =
                    (op.clone(), Probe::frozen(store.clone()), downstream.clone());
                tokio::spawn(async move {
                    op.run(&store, &key, None, async move {
                        let attempt = idem_runtime::attempt().expect("inside the body");
                        let early = if asks_late {
                            None
                        } else {
                            Some(attempt.token().await?)
                        };
                        let _ = claimed.send(early);
                        let _ = resume.await;
                        // Asked again, or for the first time, after the takeover. `None`:
                        // a store that checks the claim refused to fence a lost one.
                        let token = match attempt.token().await {
                            Ok(token) => Some(token),
                            Err(Error::Store(_)) if asks_late => None,
                            Err(err) => return Err(err),
                        };
                        if let (Some(early), Some(token)) = (early, token) {
                            assert_eq!(early, token, "one claim, one fence");
                        }
                        let _ = wrote.send(token.map(|token| downstream.write(token, "zombie")));
                        Ok::<_, Error>((0, false))
                    })
                    .await
                })
            };
            let early = has_claimed.await.unwrap();
            // Another process waits out the zombie's lease, takes the key over and writes.
            let owner = op
                .clone()
                .wait_timeout(Duration::from_secs(20))
                .run(&Probe::frozen(store.clone()), &key, None, async {
                    let token = idem_runtime::attempt().unwrap().token().await?;
                    Ok::<_, Error>((token.get(), downstream.write(token, "owner")))
                })
                .await
                .unwrap();
            let Outcome::Executed((owner_token, landed)) = owner else {
                panic!("the owner must run its body: {owner:?}");
            };
            assert!(landed, "the owner's fenced write lands");
            if let Some(early) = early {
                assert!(owner_token > early.get(), "{owner_token} after {early:?}");
            }
            taken_over.send(()).unwrap();
            assert_ne!(
                zombie_wrote.await.unwrap(),
                Some(true),
                "the zombie's fenced write must be refused"
            );
            assert_eq!(
                zombie.await.unwrap().unwrap(),
                Outcome::Replayed((owner_token, true)),
                "the zombie answers the owner's record"
            );
            assert_eq!(downstream.0.lock().unwrap().1, "owner");
        }
    }

    /// The child of [`a_crashed_holder_frees_its_key_within_seconds`]: claims the key with
    /// the default lease, prints `claimed`, renews (printing `renewed` each time) and hangs
    /// until it is killed.
    pub async fn default_lease_crash_child<S: Store + Clone>(store: S) {
        let namespace = std::env::var(CRASH_NAMESPACE).expect("run by the crash test");
        let op = Operation::new(namespace);
        let key = op.key(&"crash").unwrap();
        let _ = op
            .run(&Probe::announcing_renewals(store), &key, None, async {
                println!("claimed");
                std::future::pending::<()>().await;
                Ok::<_, Error>(0_u32)
            })
            .await;
    }

    /// What a user gets from the defaults after a crash: the test `child` of this test binary
    /// claims a key with the default lease and renews it; it is SIGKILLed right after a
    /// renewal (the worst moment: a whole lease left), and a retry of the key from this
    /// process must run its body within 10 s of the kill. Returns how long that took.
    pub async fn a_crashed_holder_frees_its_key_within_seconds<S: Store + Clone>(
        store: S,
        child: &str,
    ) -> Duration {
        let namespace = namespace("default_lease_crash");
        let mut process = crate::Child::start(child, &[(CRASH_NAMESPACE, &namespace)]);
        process.wait_for("claimed").await;
        process.wait_for("renewed").await;
        process.kill("");
        let killed = Instant::now();

        let op = Operation::new(namespace);
        let key = op.key(&"crash").unwrap();
        let rejected = op
            .clone()
            .in_flight(InFlight::Reject)
            .run(&store, &key, None, async { Ok::<_, Error>(1_u32) })
            .await;
        assert!(
            matches!(rejected, Err(Error::InProgress)),
            "the key is still held right after the kill: {rejected:?}"
        );
        // The retry waits as long as it must, so that a key stuck past 10 s shows as a
        // measured time, not as a timeout.
        let retried = op
            .wait_timeout(Duration::from_secs(60))
            .run(&store, &key, None, async { Ok::<_, Error>(2_u32) })
            .await
            .unwrap();
        let elapsed = killed.elapsed();
        assert_eq!(retried, Outcome::Executed(2));
        println!("a holder SIGKILLed right after a renewal: its key ran again {elapsed:?} later");
        assert!(
            elapsed <= Duration::from_secs(10),
            "the default lease must free a crashed holder's key within 10 s: {elapsed:?}"
        );
        elapsed
    }

    /// The environment variable that hands the crash test's namespace to its child.
    pub const CRASH_NAMESPACE: &str = "IDEM_CRASH_NAMESPACE";
    const CRASH_LEASE: Duration = Duration::from_secs(1);

    /// The child of [`crash_frees_the_key_after_the_lease`]: claims the key with a 1 s lease
    /// that it never renews, prints `claimed`, and hangs until it is killed.
    pub async fn crash_child<S: Store + Clone>(store: S) {
        let namespace = std::env::var(CRASH_NAMESPACE).expect("run by the crash test");
        let op = Operation::new(namespace).lease(CRASH_LEASE);
        let key = op.key(&"crash").unwrap();
        let _ = op
            .run(&Probe::frozen(store), &key, None, async {
                println!("claimed");
                std::future::pending::<()>().await;
                Ok::<_, Error>(0_u32)
            })
            .await;
    }

    /// Runs the test `child` of this test binary as a process that claims a key, kills it with
    /// SIGKILL, and checks that another process is refused before the lease ends and runs the
    /// body after it.
    pub async fn crash_frees_the_key_after_the_lease<S: Store + Clone>(store: S, child: &str) {
        let namespace = namespace("crash");
        let mut process = crate::Child::start(child, &[(CRASH_NAMESPACE, &namespace)]);
        process.wait_for("claimed").await;
        // The child claimed before it printed: its lease ends at most this long from here.
        let seen = Instant::now();
        process.kill("");

        let op = Operation::new(namespace).lease(CRASH_LEASE);
        let key = op.key(&"crash").unwrap();
        let refused = op
            .clone()
            .in_flight(InFlight::Reject)
            .run(&store, &key, None, async { Ok::<_, Error>(1_u32) })
            .await;
        // Refused while the lease lasts; a machine so busy that the lease ran out meanwhile
        // may have let this call take over, which is right too.
        match refused {
            Err(Error::InProgress) => {}
            Ok(Outcome::Executed(1)) if seen.elapsed() >= CRASH_LEASE => return,
            other => panic!("before the lease ended: {other:?}"),
        }

        // A waiting call polls until the lease runs out, then claims and runs. It waits far
        // longer than the lease if it must: a key stuck past its lease would make it fail.
        let out = op
            .wait_timeout(Duration::from_secs(20))
            .run(&store, &key, None, async { Ok::<_, Error>(2_u32) })
            .await
            .unwrap();
        assert_eq!(out, Outcome::Executed(2));
        println!(
            "the crashed holder's key ran again {:?} after it was seen claimed",
            seen.elapsed()
        );
    }
}
