//! Helpers shared by the integration tests of the idem workspace (see the `[[test]]` targets).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::store::Claim;
use idem_runtime::{async_trait, Bytes, Error, Fingerprint, Flights, Key, Store, Token};

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

/// Forwards to a store but never renews and never coalesces: a holder that behaves like a
/// process paused past its lease, and calls that behave like other processes.
#[derive(Clone, Debug)]
pub struct Frozen<S>(pub S);

#[async_trait]
impl<S: Store + Clone> Store for Frozen<S> {
    async fn claim(
        &self,
        key: &Key,
        fp: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Claim, Error> {
        self.0.claim(key, fp, lease).await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.0.complete(key, token, value, ttl).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        self.0.release(key, token).await
    }

    async fn renew(&self, _: &Key, _: Token, _: Duration) -> Result<bool, Error> {
        Ok(true) // pretends to renew, so the holder does not notice it lost the lease
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        self.0.remove(key).await
    }

    fn flights(&self) -> Option<&Flights> {
        None
    }
}

/// A store whose server is down: every operation fails.
#[derive(Clone, Debug, Default)]
pub struct Down;

#[async_trait]
impl Store for Down {
    async fn claim(&self, _: &Key, _: Option<&Fingerprint>, _: Duration) -> Result<Claim, Error> {
        Err(Error::store("connection refused"))
    }

    async fn complete(&self, _: &Key, _: Token, _: Bytes, _: Duration) -> Result<bool, Error> {
        Err(Error::store("connection refused"))
    }

    async fn release(&self, _: &Key, _: Token) -> Result<bool, Error> {
        Err(Error::store("connection refused"))
    }

    async fn renew(&self, _: &Key, _: Token, _: Duration) -> Result<bool, Error> {
        Err(Error::store("connection refused"))
    }

    async fn remove(&self, _: &Key) -> Result<bool, Error> {
        Err(Error::store("connection refused"))
    }
}

/// Forwards to a store and counts its claims: the store traffic of the calls.
#[derive(Clone, Debug)]
pub struct Counting<S> {
    /// The wrapped store.
    pub inner: S,
    claims: Runs,
}

impl<S> Counting<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            claims: Runs::default(),
        }
    }

    /// How many claims reached the store.
    pub fn claims(&self) -> usize {
        self.claims.count()
    }
}

#[async_trait]
impl<S: Store + Clone> Store for Counting<S> {
    async fn claim(
        &self,
        key: &Key,
        fp: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Claim, Error> {
        self.claims.hit();
        self.inner.claim(key, fp, lease).await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.inner.complete(key, token, value, ttl).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        self.inner.release(key, token).await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        self.inner.renew(key, token, lease).await
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        self.inner.remove(key).await
    }

    fn flights(&self) -> Option<&Flights> {
        self.inner.flights()
    }
}

/// The README's Rust examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

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
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
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
            .stdout(std::process::Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) => return unavailable("redis-server (to start a private server)", e),
        };
        let server = Self {
            child,
            url: format!("redis://127.0.0.1:{port}"),
            port,
        };
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(server);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        unavailable(
            "a private redis-server",
            "it did not start listening within 2 s",
        )
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
