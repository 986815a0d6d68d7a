//! The durable embedded store: one SQLite file, with `sqlx` (feature `sqlite`).
//!
//! # Schema
//!
//! [`SqliteStore::migrate`] switches the file to WAL and creates, if absent (`idem_records`
//! is the default name):
//!
//! ```sql
//! CREATE TABLE idem_records (
//!     key         BLOB    PRIMARY KEY NOT NULL,  -- sha256 of (version, namespace, key value)
//!     token       INTEGER NOT NULL,              -- fencing token, from idem_records_token
//!     completed   INTEGER NOT NULL,              -- 0: in progress; 1: completed
//!     fingerprint BLOB,                          -- 32 bytes, or NULL
//!     value       BLOB,                          -- the recorded result, once completed
//!     expires_at  INTEGER NOT NULL,              -- lease end or result expiry, Unix ms
//!     namespace   TEXT, label TEXT, holder TEXT, -- whose it is, for an operator (`admin`)
//!     lease_ms    INTEGER, step INTEGER          -- the claim's lease; a step's record
//! ) WITHOUT ROWID;
//! CREATE INDEX idem_records_expires_at ON idem_records (expires_at);
//! CREATE TABLE idem_records_token (id INTEGER PRIMARY KEY CHECK (id = 1), last INTEGER NOT NULL);
//! -- the counter follows every token a row is given, in the statement that gives it
//! CREATE TRIGGER idem_records_token_inserted AFTER INSERT ON idem_records BEGIN
//!     UPDATE idem_records_token SET last = NEW.token WHERE id = 1 AND last < NEW.token; END;
//! CREATE TRIGGER idem_records_token_updated AFTER UPDATE OF token ON idem_records BEGIN
//!     UPDATE idem_records_token SET last = NEW.token WHERE id = 1 AND last < NEW.token; END;
//! ```
//!
//! A call's steps ([`step`](crate::step())) are completed rows of the same table, keyed by
//! the step's key, which starts with the call key's first 16 bytes: one range of keys
//! holds a call's steps, read in one statement. A step's record is one `INSERT … SELECT`
//! from the call's row under the holder's token (as a completion asks), so it is written
//! only while that claim is the row's.
//!
//! Expiry is judged by SQLite's clock (`julianday('now')`), the host's: every process on
//! the file reads the same one. A claim first reads the key's live row, which in WAL mode
//! waits for no writer (a replay or a held key writes nothing); otherwise it takes the key
//! with one statement, which holds the file's write lock while it looks and writes, so two
//! processes can never both take one key. Its token is the counter's next, and the triggers
//! move the counter up to it, so tokens grow across rows, processes and restarts. A table
//! made before the triggers existed is refused (`Error::Store`, naming
//! [`migrate`](SqliteStore::migrate)) until `migrate` has added them. Every other write is
//! one statement too; the writes queued in a process commit together in a `BEGIN IMMEDIATE`
//! transaction (see below), and a lone one commits by itself: a lone take only when it got
//! the lock before its caller stopped waiting and before leases were owed time back (the
//! statement itself checks, by SQLite's clock), and in that transaction otherwise. Expired
//! rows are deleted by [`purge_expired`](SqliteStore::purge_expired) or the task of
//! [`purge_every`](SqlStore::purge_every); until then an expired row counts as absent.
//!
//! Commits are durable (`synchronous = FULL` with [`open`](SqliteStore::open)): a result the
//! caller was given survives a power loss, so its retry replays it.
//!
//! # When the write lock is scarce
//!
//! Writers take turns on one lock per file, across every process on it. So:
//!
//! - **The store's timeout bounds every wait**: a write looks for the lock again until what
//!   is left of [`with_timeout`](SqlStore::with_timeout), and the pool's wait for a
//!   connection counts against it too.
//! - **A lock free for milliseconds is found.** SQLite's own busy handler sleeps longer each
//!   time (up to 100 ms) and misses a gap shorter than that: beside a process that holds the
//!   lock for seconds and lets go of it for 20 ms, a write would miss most gaps. A write
//!   looks at least every 5 ms.
//! - **A process takes one turn for all its writes**: every claim, renewal,
//!   completion, release and removal of a store waiting when the lock comes free commits in
//!   one transaction, on a connection of the store's own. SQLite's lock is no queue, so a
//!   renewal on a connection of its own could lose the race for it for longer than a lease;
//!   here it waits behind at most one transaction of its process. The application's use of
//!   the pool never delays a holder either.
//! - **A holder's own statements ask for its token, not for a live lease.** A lease that ran
//!   out while nobody took the key over is still its holder's (a takeover writes another
//!   token): a renewal or a completion held up past the lease still lands.
//! - **Time the file was locked out is given back, once.** When a claim finds that this
//!   process has not got the lock for a quarter of its lease or more (since it began to ask,
//!   over failed tries too, or the claim's own wait if longer), or that another process on
//!   the file has not (a process that waits for the lock notes since when in a file beside
//!   the database, `<file>-idem-dark`, while it waits), every claim in progress
//!   whose lease ran out within that dark time, or runs out within it, gets a lease that
//!   ends that long from now (a lease at most), and is marked: it gets no more until its
//!   holder renews. A live holder, whose renewal waited for the lock too, renews as soon as
//!   it is free, however long the freeze, and is covered again at the next lockout; a dead
//!   one's key frees once the time given back is over, within two leases of its last
//!   renewal when the lock is free now and then (for 20 ms in 2.5 s, say). An idle file,
//!   whose lock nobody waited for, gives nothing back: a dead holder's key frees a lease
//!   after its last renewal.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::Sqlite as Database;
use tokio::time::Instant;

pub use crate::store::sql::Purger;
use crate::store::sql::{self, Dialect, Driver, Fenced, Sealed, SqlStore, Table};
use crate::{Claim, ClaimRequest, Error, Key, Token};
use beacon::Beacon;
use statements::Statements;
use writes::{Answered, Job, Writes};

mod beacon;
mod schema;
mod statements;
mod transaction;
mod writes;

/// The default table name.
pub const DEFAULT_TABLE: &str = sql::DEFAULT_TABLE;

/// The default time an operation may take, waiting for the file's write lock and for a
/// pooled connection included, before it fails with [`Error::Store`].
pub const DEFAULT_TIMEOUT: Duration = sql::DEFAULT_TIMEOUT;

/// How many connections [`SqliteStore::open`] pools: readers run side by side in WAL mode,
/// writers take turns on the file's lock.
pub const DEFAULT_CONNECTIONS: u32 = 8;

/// The pool's own bound on a wait for a connection, far above any store timeout: the
/// store's timeout bounds each operation, that wait included.
const ACQUIRE_BOUND: Duration = Duration::from_secs(3600);

/// Whether the store's own connection for writes is pinged before each write: it is not.
/// It is a SQLite connection, a thread of this process, not a socket that a server or a
/// network could have closed; the pool pings it anyway when a write gives it back, and
/// closes it then if its thread died. A ping before every write was a round trip to that
/// thread for nothing, a tenth of a claim.
const PING_BEFORE_WRITE: bool = false;

/// The shortest wait for the file's write lock that a claim takes as a lockout (see
/// [`locked_out`]).
const LOCKED_OUT_FLOOR: Duration = Duration::from_millis(100);

/// Whether a claim of `lease` that waited `waited` for the file's write lock takes it as a
/// sign that the file was locked out (a writer paused or slow while it held the lock):
/// holders renew every quarter of their lease, so a wait that long may have cost one a
/// renewal, and the claim gives leases time back before it looks. A shorter wait cannot
/// have cost a live holder its lease by itself.
fn locked_out(waited: Duration, lease: Duration) -> bool {
    waited >= lockout(lease)
}

/// How long a claim of `lease` waits before it takes the wait as a lockout ([`locked_out`]).
fn lockout(lease: Duration) -> Duration {
    (lease / 4).max(LOCKED_OUT_FLOOR)
}

/// How many expired rows one purge statement deletes: writers wait for the file's lock, so
/// each batch is kept short.
const PURGE_BATCH: i64 = 1000;

/// SQLite's clock in Unix milliseconds; one value for the whole statement.
const NOW: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";

/// A store in one SQLite file, shared by every process on the host that opens it, and kept
/// across restarts: durability without a server.
///
/// Cloning is cheap; clones share the pool and the in-process registry of running calls.
///
/// ```no_run
/// use idem_runtime::SqliteStore;
///
/// # async fn example() -> Result<(), idem_runtime::Error> {
/// let store = SqliteStore::open("idem.db").await?; // created if absent
/// store.migrate().await?; // WAL, and the table if it is absent
/// let _purger = store.purge_every(std::time::Duration::from_secs(600));
/// # Ok(())
/// # }
/// ```
///
/// # Transactions
///
/// [`Operation::run_in_transaction`](crate::Operation::run_in_transaction) (`transaction =
/// tx` with a `&mut SqliteConnection`) claims in the caller's transaction on the same file:
/// the claim, the body's writes and the record commit together. SQLite has one writer per
/// file, so the claim takes the file's write lock first (waiting up to the operation's wait
/// timeout, or not at all with [`InFlight::Reject`](crate::InFlight::Reject)), then reads
/// the key: a duplicate in another transaction waits for the holder's commit and replays.
///
/// - **Begin with `BEGIN IMMEDIATE`** (`pool.begin_with("BEGIN IMMEDIATE")`): a deferred
///   transaction that read the file before the holder committed cannot take the lock after
///   it (`SQLITE_BUSY_SNAPSHOT`); its claim fails with [`Error::Store`], and a retry of the
///   transaction replays. Never does a duplicate run the body.
/// - A connection outside a transaction works too: the call's savepoint is then its
///   transaction, and the record commits with the body's writes when the call returns.
/// - A key held by an ordinary call ([`run`](crate::Operation::run), a lease) answers
///   [`Error::InProgress`] at once: its holder cannot record while this transaction holds
///   the lock.
/// - Inside the body, call other idempotent functions with `transaction =` on the same
///   connection: an ordinary call on the same file would wait for this transaction's lock.
pub type SqliteStore = SqlStore<sqlx::Sqlite>;

/// The SQLite dialect of [`SqlStore`]: its pool, its queue of writes and its statements.
#[derive(Clone)]
pub struct SqliteDriver {
    pool: SqlitePool,
    /// The queue of this store's writes, committed together on a connection of their own
    /// ([`writes`]).
    writes: Arc<Writes>,
    sql: Arc<Statements>,
}

/// A connection of `pool` for a write, whose busy handler waits for the file's write lock at
/// most until `deadline`: the store's timeout bounds that wait too, whatever busy timeout
/// the connection was opened with.
async fn writer(
    pool: &SqlitePool,
    deadline: Instant,
) -> Result<PoolConnection<Database>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .as_millis()
        .clamp(1, i32::MAX as u128);
    sqlx::query(&format!("PRAGMA busy_timeout = {left}"))
        .persistent(false)
        .execute(&mut *conn)
        .await?;
    Ok(conn)
}

/// Whether `path` names an in-memory database (`:memory:`, an empty path, or a `file:` URI
/// in memory mode), which SQLite opens anew for every connection.
fn in_memory(path: &Path) -> bool {
    let text = path.to_string_lossy();
    text.is_empty()
        || text == ":memory:"
        || (text.starts_with("file:")
            && (text.contains(":memory:") || text.contains("mode=memory")))
}

impl SqlStore<sqlx::Sqlite> {
    /// Opens (creating it if absent) the SQLite file at `path`, in WAL mode with durable
    /// commits, with a pool of [`DEFAULT_CONNECTIONS`], using the table [`DEFAULT_TABLE`].
    /// Call [`migrate`](Self::migrate) before the first use.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the file cannot be opened or created; [`Error::Config`] for an
    /// in-memory database (`:memory:`, an empty path, a `file:` URI in memory mode), which
    /// SQLite makes anew for every pooled connection, so that claims would not be shared:
    /// use [`MemoryStore`](crate::MemoryStore) for records in memory.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        if in_memory(path) {
            return Err(Error::config(format!(
                "SqliteStore::open needs a file, not {path:?}: an in-memory SQLite database is one per connection, so each pooled connection would see a database of its own; use `MemoryStore` for records in memory"
            )));
        }
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(DEFAULT_TIMEOUT);
        // Each operation bounds its own wait for a connection (the store's timeout).
        let pool = SqlitePoolOptions::new()
            .max_connections(DEFAULT_CONNECTIONS)
            .acquire_timeout(ACQUIRE_BOUND)
            .connect_with(options)
            .await
            .map_err(Error::store)?;
        Ok(Self::from_pool(pool))
    }

    /// Uses an existing pool. [`migrate`](Self::migrate) switches its file to WAL (a
    /// setting the file keeps). Each write waits for the file's lock at most what is left of
    /// the store's timeout; the pool's own `acquire_timeout` still applies to the wait for a
    /// connection. The store's own connection for writes is opened with the pool's
    /// options, and a busy handler of its own that waits 10 ms before it looks again.
    pub fn from_pool(pool: SqlitePool) -> Self {
        let writes = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(ACQUIRE_BOUND)
            .test_before_acquire(PING_BEFORE_WRITE)
            .connect_lazy_with((*pool.connect_options()).clone().busy_timeout(writes::POLL));
        let beacon = Beacon::beside(pool.connect_options().get_filename());
        Self::of(SqliteDriver {
            pool,
            writes: Arc::new(Writes::new(writes, beacon)),
            sql: Arc::new(Statements::of(DEFAULT_TABLE)),
        })
    }

    /// Switches the file to WAL, and creates the table, its index, its token counter and the
    /// counter's triggers if they are absent (a table made by an earlier version gets the
    /// triggers it lacks). Safe to run from several processes at once: the creation is one
    /// `BEGIN IMMEDIATE` transaction.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the file cannot be written.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.migrated().await
    }

    /// Deletes every expired row (lapsed claims, results past their TTL), in batches of
    /// 1000. Returns how many.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the file cannot be written.
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        self.purged().await
    }
}

impl SqliteDriver {
    /// Runs a write in the store's next transaction of queued writes ([`writes`]), waiting
    /// for the file's lock until `deadline`.
    async fn write<T>(&self, job: (Job, Answered<T>), deadline: Instant) -> Result<T, sqlx::Error> {
        self.writes.run(&self.sql, job, deadline).await
    }
}

impl Sealed for sqlx::Sqlite {}

impl Dialect for sqlx::Sqlite {
    type Driver = SqliteDriver;
}

impl Driver for SqliteDriver {
    type Database = Database;

    const NAME: &'static str = "sqlite";

    const STORE: &'static str = "SqliteStore";

    fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    fn table(&self) -> &Table {
        &self.sql.table
    }

    fn set_table(&mut self, table: &str) -> Result<(), Error> {
        self.sql = Arc::new(Statements::new(table)?);
        Ok(())
    }

    async fn claim(&self, timeout: Duration, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        let (key, nonce) = (request.key, request.nonce);
        let started = Instant::now();
        let deadline = started + timeout;
        sql::within(Self::NAME, timeout, async {
            // A replay, or a key someone holds: answered by a read, which waits for no writer.
            let live = sqlx::query(&self.sql.live)
                .bind(&key.as_bytes()[..])
                .fetch_optional(&self.pool)
                .await?;
            match live {
                Some(row) if !sql::is_ours(&row, nonce) => Ok(Err(row)),
                _ => {
                    self.sql.checked(&self.pool).await?;
                    let job = Job::take(request, started);
                    self.write(job, deadline).await
                }
            }
        })
        .await?
        .or_else(|row| sql::held(&row))
    }

    async fn fenced(
        &self,
        timeout: Duration,
        key: &Key,
        token: Token,
        write: Fenced<'_>,
    ) -> Result<bool, Error> {
        let job = Job::fenced(key, token, write);
        sql::within(
            Self::NAME,
            timeout,
            self.write(job, Instant::now() + timeout),
        )
        .await
    }

    async fn remove(&self, timeout: Duration, key: &Key) -> Result<bool, Error> {
        let deadline = Instant::now() + timeout;
        let live = sql::within(Self::NAME, timeout, self.write(Job::remove(key), deadline)).await?;
        Ok(live.unwrap_or(false))
    }

    async fn purge(&self, timeout: Duration) -> Result<u64, Error> {
        let mut purged = 0;
        loop {
            let deadline = Instant::now() + timeout;
            let done = sql::within(Self::NAME, timeout, async {
                let mut conn = writer(&self.pool, deadline).await?;
                sqlx::query(&self.sql.purge)
                    .bind(PURGE_BATCH)
                    .execute(&mut *conn)
                    .await
            })
            .await?;
            purged += done.rows_affected();
            if done.rows_affected() < PURGE_BATCH as u64 {
                return Ok(purged);
            }
        }
    }

    async fn migrate(&self, timeout: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + timeout;
        sql::within(
            Self::NAME,
            timeout,
            schema::migrate(&self.pool, &self.sql, deadline),
        )
        .await
    }
}
