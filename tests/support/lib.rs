//! Helpers shared by the integration tests of the idem workspace (see the `[[test]]` targets).

use idem_runtime::ClaimRequest;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::store::Claim;
use idem_runtime::{async_trait, Bytes, Error, Key, Store, Token};

mod child;
pub mod dynamodb_conformance;
mod dynamodb_server;
pub mod failover;
mod kafka_server;
mod mariadb_server;
pub mod netns;
pub mod own_store;
mod probe;
pub mod scenarios;
pub mod sentinel;
mod servers;
mod sqs_server;
pub mod tied;

pub use child::Child;
pub use dynamodb_server::{
    conformance as dynamodb_conformance_proxy, dynamodb_client, dynamodb_endpoint, dynamodb_lacks,
    dynamodb_store, dynamodb_url, TABLE as DYNAMODB_TABLE,
};
pub use kafka_server::{
    kafka_brokers, kafka_committed, kafka_produce, kafka_read_all, kafka_topic,
};
pub use mariadb_server::PrivateMariaDb;
pub use probe::{Gate, Probe};
pub use servers::{PrivatePostgres, PrivateRedis, PrivateRedisCluster};
pub use sqs_server::{sqs_client, sqs_endpoint};

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

/// What every operation of [`Down`] fails with: as a driver says it, with the server's
/// address and credentials, which no answer to a client may carry.
pub const DOWN: &str = "connection refused: postgres://app:hunter2@db.internal:5432/payments";

/// A store whose server is down: every operation fails with [`DOWN`].
#[derive(Clone, Debug, Default)]
pub struct Down;

#[async_trait]
impl Store for Down {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        let _ = request;
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
