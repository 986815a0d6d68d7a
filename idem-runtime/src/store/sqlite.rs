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
//!     expires_at  INTEGER NOT NULL               -- lease end or result expiry, Unix ms
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
//! [`purge_every`](SqliteStore::purge_every); until then an expired row counts as absent.
//!
//! Commits are durable (`synchronous = FULL` with [`open`](SqliteStore::open)): a result the
//! caller was given survives a power loss, so its retry replays it.
//!
//! # When the write lock is scarce
//!
//! Writers take turns on one lock per file, across every process on it. So:
//!
//! - **The store's timeout bounds every wait**: a write looks for the lock again until what
//!   is left of [`with_timeout`](SqliteStore::with_timeout), and the pool's wait for a
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

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Connection, Sqlite};
use tokio::time::Instant;

pub use crate::store::sql::Purger;
use crate::store::sql::{self, is_identifier, millis, LookupRow};
use crate::store::Recorded;
use crate::{Claim, Error, Fingerprint, Flights, Key, Store, Token};
use beacon::Beacon;
use writes::{Answered, Fence, Job, Writes};

mod beacon;
mod transaction;
mod writes;

/// The default table name.
pub const DEFAULT_TABLE: &str = "idem_records";

/// The default time an operation may take, waiting for the file's write lock and for a
/// pooled connection included, before it fails with [`Error::Store`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

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
#[derive(Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    /// The queue of this store's writes, committed together on a connection of their own
    /// ([`writes`]).
    writes: Arc<Writes>,
    sql: Arc<Statements>,
    timeout: Duration,
    flights: Arc<Flights>,
}

/// The statements of one table, written once.
struct Statements {
    table: String,
    create: [String; 6],
    /// How many of the triggers that keep the token counter ahead of every row exist.
    triggers: String,
    /// Whether `triggers` found both, once per store (see [`Statements::checked`]).
    checked: tokio::sync::OnceCell<()>,
    live: String,
    /// The key's row, whatever its expiry: the one a take left as it was.
    held: String,
    take: String,
    /// `take` for a claim that runs by itself, outside a transaction: only before a moment
    /// (see [`Statements::of`]).
    take_in_time: String,
    complete: String,
    release: String,
    renew: String,
    record_step: String,
    steps: String,
    credit: String,
    remove_steps: String,
    remove: String,
    lookup: String,
    lease_left: String,
    purge: String,
}

impl Statements {
    /// Checks, once, that the table's token triggers exist: a table made by a version
    /// without them would give every take the same token, so its claims are refused until
    /// [`migrate`](SqliteStore::migrate) has run. `on` is the pool, or the caller's own
    /// connection for a claim in its transaction: one that waited for another connection of
    /// the pool while it held one could wait for itself (callers holding every connection
    /// in transactions, each waiting for the write lock it holds).
    async fn checked<'c>(
        &self,
        on: impl sqlx::Executor<'c, Database = Sqlite>,
    ) -> Result<(), sqlx::Error> {
        self.checked
            .get_or_try_init(|| async {
                let found: i64 = sqlx::query_scalar(&self.triggers).fetch_one(on).await?;
                if found == 2 {
                    Ok(())
                } else {
                    Err(sqlx::Error::Configuration(
                        format!(
                            "the table {:?} lacks the triggers that make its fencing tokens grow: run SqliteStore::migrate()",
                            self.table
                        )
                        .into(),
                    ))
                }
            })
            .await
            .map(|_| ())
    }

    /// The statements of `table`, after checking the name.
    fn new(table: &str) -> Result<Self, Error> {
        Ok(Self::of(validate(table)?))
    }

    /// The statements of a checked table name.
    fn of(name: &str) -> Self {
        let t = format!("\"{name}\"");
        let counter = format!("\"{name}_token\"");
        let index = format!("\"{name}_expires_at\"");
        // One statement: the token is the counter's next (the triggers move the counter up
        // to it), and a row is taken over when it lapsed or is the caller's own claim (its
        // nonce in `value`); a live row of another caller is left as it is, and nothing is
        // returned. `row` is where the new row's values come from.
        let take = |row: &str| {
            format!(
                "INSERT INTO {t} (key, token, completed, fingerprint, value, expires_at) {row} \
                 ON CONFLICT (key) DO UPDATE SET token = excluded.token, completed = 0, \
                 fingerprint = excluded.fingerprint, value = excluded.value, expires_at = excluded.expires_at \
                 WHERE {t}.expires_at <= {NOW} \
                    OR (NOT {t}.completed AND substr({t}.value, 1, 8) = excluded.value) \
                 RETURNING token"
            )
        };
        let values =
            format!("?1, (SELECT last + 1 FROM {counter} WHERE id = 1), 0, ?2, ?4, {NOW} + ?3");
        let insert_trigger = format!("\"{name}_token_inserted\"");
        let update_trigger = format!("\"{name}_token_updated\"");
        Self {
            table: name.to_string(),
            create: [
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                        key BLOB PRIMARY KEY NOT NULL, \
                        token INTEGER NOT NULL, \
                        completed INTEGER NOT NULL, \
                        fingerprint BLOB, \
                        value BLOB, \
                        expires_at INTEGER NOT NULL) WITHOUT ROWID"
                ),
                format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (expires_at)"),
                format!(
                    "CREATE TABLE IF NOT EXISTS {counter} (\
                        id INTEGER PRIMARY KEY CHECK (id = 1), last INTEGER NOT NULL)"
                ),
                format!("INSERT OR IGNORE INTO {counter} (id, last) VALUES (1, 0)"),
                // A take draws its token from the counter in its own statement; these move the
                // counter up to every token a row is given, inside that statement.
                format!(
                    "CREATE TRIGGER IF NOT EXISTS {insert_trigger} AFTER INSERT ON {t} BEGIN \
                     UPDATE {counter} SET last = NEW.token WHERE id = 1 AND last < NEW.token; END"
                ),
                format!(
                    "CREATE TRIGGER IF NOT EXISTS {update_trigger} AFTER UPDATE OF token ON {t} BEGIN \
                     UPDATE {counter} SET last = NEW.token WHERE id = 1 AND last < NEW.token; END"
                ),
            ],
            // SQLite's names are case-insensitive: `IDEM_RECORDS` is `idem_records`, whose
            // triggers a migrate of either name made.
            triggers: format!(
                "SELECT count(*) FROM sqlite_master WHERE type = 'trigger' \
                 AND tbl_name = '{name}' COLLATE NOCASE \
                 AND name COLLATE NOCASE IN ('{name}_token_inserted', '{name}_token_updated')"
            ),
            checked: tokio::sync::OnceCell::new(),
            live: format!(
                "SELECT token, completed, fingerprint, value FROM {t} \
                 WHERE key = ?1 AND expires_at > {NOW}"
            ),
            held: format!("SELECT token, completed, fingerprint, value FROM {t} WHERE key = ?1"),
            take: take(&format!("VALUES ({values})")),
            // `NOW` is read once the statement holds the file's write lock: it writes
            // nothing unless that is before `?5`, when its caller stops waiting or would
            // have waited long enough that leases get time back first (see `writes.rs`).
            take_in_time: take(&format!("SELECT {values} WHERE {NOW} < ?5")),
            // The holder's own statements ask for its token in the row, not for a live lease:
            // a lease that ran out while nobody took the key over is still the holder's (a
            // takeover writes another token), so a renewal or a completion that was held up
            // past the lease still lands.
            complete: format!(
                "UPDATE {t} SET completed = 1, value = ?3, expires_at = {NOW} + ?4 \
                 WHERE key = ?1 AND token = ?2 AND NOT completed"
            ),
            release: format!("DELETE FROM {t} WHERE key = ?1 AND token = ?2 AND NOT completed"),
            // A renewal clears the mark of time given back (see `credit`): the holder is alive.
            renew: format!(
                "UPDATE {t} SET expires_at = {NOW} + ?3, value = substr(value, 1, 8) \
                 WHERE key = ?1 AND token = ?2 AND NOT completed"
            ),
            // Like `complete`, it asks for the holder's token in the call's row, not for a
            // live lease: a takeover writes another token.
            record_step: format!(
                "INSERT INTO {t} (key, token, completed, fingerprint, value, expires_at) \
                 SELECT ?5, token, 1, NULL, ?3, {NOW} + ?4 FROM {t} \
                 WHERE key = ?1 AND token = ?2 AND NOT completed \
                 ON CONFLICT (key) DO UPDATE SET token = excluded.token, completed = 1, \
                 fingerprint = NULL, value = excluded.value, expires_at = excluded.expires_at"
            ),
            steps: format!(
                "SELECT key, value FROM {t} \
                 WHERE key BETWEEN ?2 AND ?3 AND key <> ?1 AND completed AND expires_at > {NOW}"
            ),
            // The dark time `?1` given back to the claims in progress whose lease ran out
            // within it or runs out within a lease `?2`, to a lease from now at most, once: a
            // claim's value is its nonce (8 bytes), and a ninth byte marks it as given time
            // back until its holder renews.
            credit: format!(
                "UPDATE {t} SET expires_at = {NOW} + ?1, value = value || X'01' \
                 WHERE NOT completed AND length(value) = 8 \
                 AND expires_at > {NOW} - ?2 AND expires_at < {NOW} + ?1"
            ),
            remove_steps: format!("DELETE FROM {t} WHERE key BETWEEN ?2 AND ?3 AND key <> ?1"),
            remove: format!("DELETE FROM {t} WHERE key = ?1 RETURNING expires_at > {NOW}"),
            // Rounded down: `NOW` truncates to the millisecond, so the difference could be a
            // fraction over what is left, and a copy must never outlive the row.
            lookup: format!(
                "SELECT fingerprint, value, expires_at - {NOW} - 1 FROM {t} \
                 WHERE key = ?1 AND completed AND expires_at > {NOW}"
            ),
            lease_left: format!(
                "SELECT expires_at - {NOW} FROM {t} \
                 WHERE key = ?1 AND NOT completed AND expires_at > {NOW}"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE key IN \
                 (SELECT key FROM {t} WHERE expires_at <= {NOW} LIMIT ?1)"
            ),
        }
    }
}

/// A connection of `pool` for a write, whose busy handler waits for the file's write lock at
/// most until `deadline`: the store's timeout bounds that wait too, whatever busy timeout
/// the connection was opened with.
async fn writer(
    pool: &SqlitePool,
    deadline: Instant,
) -> Result<PoolConnection<Sqlite>, sqlx::Error> {
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

/// A table name: a plain identifier, so that it can never inject SQL.
fn validate(identifier: &str) -> Result<&str, Error> {
    if is_identifier(identifier) {
        Ok(identifier)
    } else {
        Err(Error::store(format!(
            "invalid table name {identifier:?}: use letters, digits and `_` (at most 50, not starting with a digit)"
        )))
    }
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

impl SqliteStore {
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
        Self {
            pool,
            writes: Arc::new(Writes::new(writes, beacon)),
            sql: Arc::new(Statements::of(DEFAULT_TABLE)),
            timeout: DEFAULT_TIMEOUT,
            flights: Arc::default(),
        }
    }

    /// Sets how long one operation may take, waiting for the file's write lock and for a
    /// pooled connection included, before it fails with [`Error::Store`] (default
    /// [`DEFAULT_TIMEOUT`]). The body never runs after such a failure.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Uses the table `table` instead of [`DEFAULT_TABLE`].
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the name is not a plain identifier: names are checked, never
    /// quoted into SQL as they come.
    pub fn with_table(mut self, table: &str) -> Result<Self, Error> {
        self.sql = Arc::new(Statements::new(table)?);
        Ok(self)
    }

    /// The pool this store runs its statements on.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The table this store uses.
    pub fn table(&self) -> &str {
        &self.sql.table
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
        let deadline = Instant::now() + self.timeout;
        self.within(async {
            let mut conn = writer(&self.pool, deadline).await?;
            sqlx::query("PRAGMA journal_mode = WAL")
                .execute(&mut *conn)
                .await?;
            let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
            for statement in &self.sql.create {
                sqlx::query(statement).execute(&mut *tx).await?;
            }
            tx.commit().await
        })
        .await
    }

    /// Deletes every expired row (lapsed claims, results past their TTL), in batches of
    /// 1000. Returns how many.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the file cannot be written.
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        let mut purged = 0;
        loop {
            let deadline = Instant::now() + self.timeout;
            let done = self
                .within(async {
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

    /// Runs [`purge_expired`](Self::purge_expired) every `interval` on the current tokio
    /// runtime, until the returned guard is dropped. A failed purge is logged and retried at
    /// the next interval.
    pub fn purge_every(&self, interval: Duration) -> Purger {
        let store = self.clone();
        Purger::every(interval, self.table().to_string(), move || {
            let store = store.clone();
            async move { store.purge_expired().await }
        })
    }

    /// Runs one operation under the timeout.
    async fn within<T>(
        &self,
        operation: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, Error> {
        sql::within("sqlite", self.timeout, operation).await
    }

    /// Runs a write in the store's next transaction of queued writes ([`writes`]), waiting
    /// for the file's lock until `deadline`.
    async fn write<T>(&self, job: (Job, Answered<T>), deadline: Instant) -> Result<T, sqlx::Error> {
        self.writes.run(&self.sql, job, deadline).await
    }

    /// A holder's statement, which finds its row by its token: whether it did.
    async fn fenced(
        &self,
        statement: Fence,
        key: &Key,
        token: Token,
        value: Option<Bytes>,
        millis: Option<i64>,
    ) -> Result<bool, Error> {
        let job = Job::fenced(statement, key, token, value, millis);
        self.within(self.write(job, Instant::now() + self.timeout))
            .await
    }
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("table", &self.sql.table)
            .field("timeout", &self.timeout)
            .field("pool_size", &self.pool.size())
            .finish()
    }
}

#[async_trait]
impl Store for SqliteStore {
    /// The nonce is kept in the in-progress row's `value` (empty until it completes); a row
    /// in progress under it is taken again with a new token and a whole lease.
    async fn claim_with_nonce(
        &self,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
        nonce: u64,
    ) -> Result<Claim, Error> {
        let started = Instant::now();
        let deadline = started + self.timeout;
        self.within(async {
            // A replay, or a key someone holds: answered by a read, which waits for no writer.
            let live = sqlx::query(&self.sql.live)
                .bind(&key.as_bytes()[..])
                .fetch_optional(&self.pool)
                .await?;
            match live {
                Some(row) if !sql::is_ours(&row, nonce) => Ok(Err(row)),
                _ => {
                    self.sql.checked(&self.pool).await?;
                    let job = Job::take(key, fingerprint, lease, nonce, started);
                    self.write(job, deadline).await
                }
            }
        })
        .await?
        .map_or_else(|row| sql::held(&row), |token| Ok(Claim::Acquired { token }))
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.fenced(Fence::Complete, key, token, Some(value), Some(millis(ttl)))
            .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        self.fenced(Fence::Release, key, token, None, None).await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        self.fenced(Fence::Renew, key, token, None, Some(millis(lease)))
            .await
    }

    /// Claim tokens already grow here (they come from the counter table): the claim's own
    /// token is its fencing token.
    async fn fence(&self, _: &Key, token: Token) -> Result<Option<Token>, Error> {
        Ok(Some(token))
    }

    async fn record_step(
        &self,
        call: &Key,
        token: Token,
        step: &Key,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.fenced(
            Fence::RecordStep(*step),
            call,
            token,
            Some(value),
            Some(millis(ttl)),
        )
        .await
    }

    async fn steps(&self, call: &Key) -> Result<Vec<(Key, Bytes)>, Error> {
        self.within(sql::read_steps(&self.pool, &self.sql.steps, call))
            .await
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        let deadline = Instant::now() + self.timeout;
        let live = self.within(self.write(Job::remove(key), deadline)).await?;
        Ok(live.unwrap_or(false))
    }

    async fn lookup(&self, key: &Key) -> Result<Option<Recorded>, Error> {
        let row: Option<LookupRow> = self
            .within(
                sqlx::query_as(&self.sql.lookup)
                    .bind(&key.as_bytes()[..])
                    .fetch_optional(&self.pool),
            )
            .await?;
        sql::recorded(row)
    }

    async fn lease_left(&self, key: &Key) -> Result<Option<Duration>, Error> {
        let left: Option<i64> = self
            .within(
                sqlx::query_scalar(&self.sql.lease_left)
                    .bind(&key.as_bytes()[..])
                    .fetch_optional(&self.pool),
            )
            .await?;
        Ok(sql::left(left))
    }

    fn claim_timeout(&self) -> Option<Duration> {
        Some(self.timeout)
    }

    fn flights(&self) -> Option<&Flights> {
        Some(&self.flights)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_identifiers_only() {
        assert!(Statements::new(DEFAULT_TABLE).is_ok());
        for bad in [
            "",
            "1table",
            "idem records",
            "t\"; DROP TABLE x; --",
            "main.t",
            &"x".repeat(51),
        ] {
            assert!(Statements::new(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
