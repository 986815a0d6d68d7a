//! The durable store on MySQL 8 or MariaDB: one InnoDB table, with `sqlx` (feature `mysql`).
//!
//! # Schema
//!
//! [`MySqlStore::migrate`] creates, if absent (`idem_records` is the default name):
//!
//! ```sql
//! CREATE TABLE idem_records (
//!     `key`       VARBINARY(32) NOT NULL PRIMARY KEY, -- sha256 of (version, namespace, key value)
//!     token       BIGINT NOT NULL AUTO_INCREMENT,     -- fencing token, taken by the row's insert
//!     completed   BOOLEAN       NOT NULL,             -- 0: in progress; 1: completed
//!     fingerprint VARBINARY(32),                      -- 32 bytes, or NULL
//!     value       LONGBLOB,                           -- the result once completed; the claim's nonce before
//!     expires_at  BIGINT        NOT NULL,             -- lease end or result expiry, Unix ms
//!     namespace   TEXT CHARACTER SET utf8mb4,        -- whose it is, for an operator (`admin`),
//!     label       TEXT CHARACTER SET utf8mb4,        -- UTF-8 whatever the database's default
//!     holder      TEXT CHARACTER SET utf8mb4,
//!     lease_ms    BIGINT, step BOOLEAN,               -- the claim's lease; a step's record
//!     ttl_ms      BIGINT, taken_over BOOLEAN,         -- how long a lapsed claim is kept; a takeover
//!     INDEX idem_records_token (token),
//!     INDEX idem_records_expires_at (expires_at)
//! ) ENGINE = InnoDB;
//! ```
//!
//! `migrate` upgrades a table of an earlier version in place: the columns it lacks are
//! added, and text columns made in a `latin1` or `utf8mb3` database are converted to
//! `utf8mb4`, so that a namespace beyond ASCII lists as written and a prefix finds it.
//!
//! A call's steps ([`step`](crate::step())) are completed rows of the same table, keyed by
//! the step's key, which starts with the call key's first 16 bytes: one range of the
//! primary key holds a call's steps, read in one statement. A step's record is one
//! `REPLACE … SELECT` from the call's row read `LOCK IN SHARE MODE` under the holder's
//! token and a live lease: a takeover waits for it, or it finds the new token.
//!
//! Expiry is judged by the server's clock (`UTC_TIMESTAMP(6)`, whatever the session's time
//! zone), which every process reads alike. A claim first reads the key's live row (a replay or
//! a held key writes nothing). A key with no row is taken by an `INSERT IGNORE`: the primary
//! key lets one insert in. A key with a row that lapsed is taken in a transaction that locks
//! that row (`SELECT … FOR UPDATE`) before it looks, then replaces it (`REPLACE`), so two
//! processes can never both take it.
//!
//! A token is the next value of the table's `AUTO_INCREMENT`, taken by the statement that
//! writes the claim's row: a first claim is one write that commits by itself, a takeover's
//! token is taken after its lock (so above the row's), and a claim in a caller's transaction
//! takes its token there. InnoDB releases that lock as soon as the value is taken (with
//! `innodb_autoinc_lock_mode` 1 or 2, every server's default since MySQL 5.1; mode 0 holds it
//! to the end of each insert, which then queues claims behind a claim that waits for a row
//! lock), and keeps the value across restarts and after the rows holding the largest are
//! deleted (MySQL from 8.0, MariaDB from 10.2.4; `migrate` refuses older servers), so tokens
//! grow across rows, processes and restarts. `TRUNCATE TABLE` starts them again from 1: delete
//! rows instead. Every other operation is one statement.
//!
//! Expired rows are deleted by [`purge_expired`](MySqlStore::purge_expired) or the task of
//! [`purge_every`](MySqlStore::purge_every), which read what to delete without a lock and
//! delete it by key, so that they never wait for a caller's open transaction; until then an
//! expired row counts as absent.
//!
//! All processes on a table should run a version that takes tokens the same way: an earlier
//! one, which drew them from a table of their own, would draw tokens the others do not follow.
//! [`migrate`](MySqlStore::migrate) upgrades such a table once; until then its claims are
//! refused ([`Error::Store`], naming `migrate`), as on a server that forgets an
//! `AUTO_INCREMENT` on restart (checked once per store, whether or not it ran `migrate`).

use std::sync::Arc;
use std::time::Duration;

use sqlx::mysql::{MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::Row;

pub use crate::store::sql::Purger;
use crate::store::sql::{self, millis, Dialect, Driver, Fenced, Sealed, SqlStore, Table};
use crate::store::Holder;
use crate::{Claim, ClaimRequest, Error, Key, Token};

mod schema;
mod statements;
mod transaction;

use statements::{Bounded, Statements};

/// The default table name.
pub const DEFAULT_TABLE: &str = sql::DEFAULT_TABLE;

/// The default time an operation may take, waiting for a pooled connection and for row
/// locks included, before it fails with [`Error::Store`].
pub const DEFAULT_TIMEOUT: Duration = sql::DEFAULT_TIMEOUT;

/// How many connections [`MySqlStore::connect`] pools.
pub const DEFAULT_CONNECTIONS: u32 = 10;

/// What [`MySqlStore::connect`] sets on each of its connections.
const SESSION: &str =
    "SET SESSION autocommit = 1; SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// How many expired rows one purge statement deletes.
const PURGE_BATCH: i64 = 1000;

/// How many times a claim looks again when a row it found to take over was purged before it
/// could lock it.
const CLAIM_LOOKS: usize = 3;

/// A store in one MySQL or MariaDB table, shared by every process that connects to it.
///
/// Cloning is cheap; clones share the pool and the in-process registry of running calls.
///
/// ```no_run
/// use idem_runtime::MySqlStore;
///
/// # async fn example() -> Result<(), idem_runtime::Error> {
/// let store = MySqlStore::connect("mysql://app@127.0.0.1/app").await?;
/// store.migrate().await?; // the table, if it is absent
/// let _purger = store.purge_every(std::time::Duration::from_secs(600));
/// # Ok(())
/// # }
/// ```
pub type MySqlStore = SqlStore<sqlx::MySql>;

/// The MySQL and MariaDB dialect of [`SqlStore`]: its pool and statements.
#[derive(Clone)]
pub struct MySqlDriver {
    pool: MySqlPool,
    sql: Arc<Statements>,
    /// The statements that wait for row locks, bounded for the server and the timeout: made
    /// at the first operation, made again after `with_timeout` or `with_table`.
    bounded: Arc<tokio::sync::OnceCell<Bounded>>,
}

impl SqlStore<sqlx::MySql> {
    /// Connects to `url` (`mysql://user:password@host/database`) with a pool of
    /// [`DEFAULT_CONNECTIONS`], using the table [`DEFAULT_TABLE`]. Call
    /// [`migrate`](Self::migrate) before the first use.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let pool = MySqlPoolOptions::new()
            .max_connections(DEFAULT_CONNECTIONS)
            .acquire_timeout(DEFAULT_TIMEOUT)
            // The store's own sessions, whatever the server's defaults: each statement
            // commits by itself, and reads see only what committed.
            .after_connect(|connection, _| {
                Box::pin(async move {
                    sqlx::Executor::execute(connection, sqlx::raw_sql(SESSION)).await?;
                    Ok(())
                })
            })
            .connect(url)
            .await
            .map_err(Error::store)?;
        Ok(Self::from_pool(pool))
    }

    /// Uses an existing pool.
    pub fn from_pool(pool: MySqlPool) -> Self {
        Self::of(MySqlDriver {
            pool,
            sql: Arc::new(Statements::of(DEFAULT_TABLE)),
            bounded: Arc::default(),
        })
    }

    /// Creates the table and its indexes if they are absent. Safe to run from several
    /// processes at once.
    ///
    /// A table made by an earlier version, whose tokens came from a table of their own, is
    /// upgraded once (its `token` column becomes the `AUTO_INCREMENT`, starting above every
    /// token already drawn). That rebuilds the table, holding its writes meanwhile, and is
    /// not bound by the store's timeout.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the statements fail (no `CREATE` privilege, say), or when the
    /// server forgets an `AUTO_INCREMENT` on restart (MySQL before 8.0, MariaDB before
    /// 10.2.4): its fencing tokens could go back, so it is refused.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.migrated().await
    }

    /// Deletes every expired row (lapsed claims, results past their TTL), in batches of
    /// 1000. Returns how many. Rows an open transaction holds (a lapsed claim taken over in
    /// a caller's transaction) are left for a later purge, never waited for: each batch is
    /// read without a lock, then its rows locked by key skipping those another transaction
    /// holds (`SKIP LOCKED`; before MariaDB 10.6, a batch with such a row waits for it at
    /// most a second and is left whole), then deleted.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the statement fails.
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        self.purged().await
    }
}

impl MySqlDriver {
    /// Takes the key if no live row holds it (or a row of the caller's own lost claim).
    async fn take(
        &self,
        bounded: &Bounded,
        request: &ClaimRequest<'_>,
    ) -> Result<Result<Claim, MySqlRow>, sqlx::Error> {
        let ClaimRequest {
            key,
            fingerprint,
            lease,
            nonce,
            claimant,
            ..
        } = *request;
        let mut conn = self.pool.acquire().await?;
        let nonce_bytes = nonce.to_be_bytes();
        // The claim's row, as `insert` and `take` write it.
        let claim_row = |statement, taken_over: bool| {
            sqlx::query(statement)
                .bind(&key.as_bytes()[..])
                .bind(fingerprint.map(|f| &f.as_bytes()[..]))
                .bind(&nonce_bytes[..])
                .bind(millis(lease))
                .bind(claimant.namespace())
                .bind(claimant.label())
                .bind(Holder::this_process_text())
                .bind(millis(lease))
                .bind(sql::kept_ms(request.ttl))
                .bind(taken_over)
        };
        for _ in 0..CLAIM_LOOKS {
            // No row: the primary key lets one insert in, which takes the next token. It
            // commits by itself, so the shared lock an ignored insert takes on the row ends
            // with it (in a transaction, claimers upgrading it below would deadlock).
            let inserted = claim_row(&bounded.insert, false)
                .execute(&mut *conn)
                .await?;
            if inserted.rows_affected() == 1 {
                return given(inserted.last_insert_id()).map(|token| Ok(Claim::acquired(token)));
            }
            // A row: locked, then looked at, then replaced if it lapsed, by a row whose
            // token is taken after the lock (so above the row's, whenever that was taken).
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            let Some(row) = sqlx::query(&bounded.lock)
                .bind(&key.as_bytes()[..])
                .fetch_optional(&mut *tx)
                .await?
            else {
                continue; // purged meanwhile: insert again (the transaction rolls back)
            };
            let live: i64 = row.try_get(4)?;
            let ours = sql::is_ours(&row, nonce);
            if live != 0 && !ours {
                return Ok(Err(row)); // the transaction rolls back when dropped
            }
            // A lapsed claim that is not the caller's own was never settled; the caller's
            // own keeps what its lost answer said.
            let completed: bool = row.try_get(1)?;
            let own_taken_over: bool = row.try_get(5)?;
            let taken_over = !completed && (!ours || own_taken_over);
            let taken = claim_row(&bounded.take, taken_over)
                .execute(&mut *tx)
                .await?;
            let token = given(taken.last_insert_id())?;
            tx.commit().await?;
            return Ok(Ok(Claim::Acquired { token, taken_over }));
        }
        Err(sqlx::Error::Protocol(
            "the key's row kept vanishing while it was claimed".into(),
        ))
    }
}

impl Sealed for sqlx::MySql {}

impl Dialect for sqlx::MySql {
    type Driver = MySqlDriver;
}

impl Driver for MySqlDriver {
    type Database = sqlx::MySql;

    const NAME: &'static str = "mysql";

    const STORE: &'static str = "MySqlStore";

    fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    fn table(&self) -> &Table {
        &self.sql.table
    }

    fn set_table(&mut self, table: &str) -> Result<(), Error> {
        self.sql = Arc::new(Statements::new(table)?);
        self.bounded = Arc::default();
        Ok(())
    }

    fn retimed(&mut self) {
        self.bounded = Arc::default();
    }

    async fn claim(&self, timeout: Duration, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        let (key, nonce) = (request.key, request.nonce);
        let bounded = self.bounded(timeout).await?;
        let claimed = sql::within("mysql", timeout, async {
            // A replay, or a key someone holds: answered by a read, which locks nothing.
            let live = sqlx::query(&self.sql.live)
                .bind(&key.as_bytes()[..])
                .fetch_optional(&self.pool)
                .await?;
            match live {
                Some(row) if !sql::is_ours(&row, nonce) => Ok(Err(row)),
                _ => self.take(bounded, request).await,
            }
        })
        .await;
        match claimed {
            Ok(claimed) => claimed.or_else(|row| sql::held(&row)),
            Err(err) if waited_out(&err) => {
                // Another transaction (a claim in a caller's transaction) holds the key's
                // row: in progress, as a committed claim would answer.
                tracing::debug!(outcome = "rejected", "a transaction holds the key");
                Err(Error::InProgress)
            }
            Err(err) => Err(err),
        }
    }

    async fn fenced(
        &self,
        timeout: Duration,
        key: &Key,
        token: Token,
        write: Fenced<'_>,
    ) -> Result<bool, Error> {
        let bounded = self.bounded(timeout).await?;
        let key = &key.as_bytes()[..];
        let query = match &write {
            Fenced::Complete { value, ttl } => sqlx::query(&bounded.complete)
                .bind(&value[..])
                .bind(millis(*ttl))
                .bind(key)
                .bind(token),
            Fenced::Release => sqlx::query(&bounded.release).bind(key).bind(token),
            Fenced::Renew { lease } => sqlx::query(&bounded.renew)
                .bind(millis(*lease))
                .bind(key)
                .bind(token),
            Fenced::Step { step, value, ttl } => sqlx::query(&bounded.record_step)
                .bind(&step.as_bytes()[..])
                .bind(&value[..])
                .bind(millis(*ttl))
                .bind(key)
                .bind(token),
        };
        let done = sql::within(Self::NAME, timeout, query.execute(&self.pool)).await?;
        Ok(match write {
            // 1: inserted; 2: an earlier record of the step replaced.
            Fenced::Step { .. } => done.rows_affected() > 0,
            _ => done.rows_affected() == 1,
        })
    }

    async fn remove(&self, timeout: Duration, key: &Key) -> Result<bool, Error> {
        let bounded = self.bounded(timeout).await?;
        sql::within(Self::NAME, timeout, async {
            let mut tx = self.pool.begin().await?;
            let live: Option<i64> = sqlx::query_scalar(&bounded.remove_lock)
                .bind(&key.as_bytes()[..])
                .fetch_optional(&mut *tx)
                .await?;
            sqlx::query(&bounded.remove)
                .bind(&key.as_bytes()[..])
                .execute(&mut *tx)
                .await?;
            let (first, last) = sql::steps_range(key);
            sqlx::query(&bounded.remove_steps)
                .bind(&first[..])
                .bind(&last[..])
                .bind(&key.as_bytes()[..])
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(live.is_some_and(|live| live != 0))
        })
        .await
    }

    async fn purge(&self, timeout: Duration) -> Result<u64, Error> {
        let server = self.checked(timeout).await?;
        let bounded = self.bounded(timeout).await?;
        let mut purged = 0;
        loop {
            let keys: Vec<Vec<u8>> = sql::within(
                Self::NAME,
                timeout,
                sqlx::query_scalar(&self.sql.expired).fetch_all(&self.pool),
            )
            .await?;
            if keys.is_empty() {
                return Ok(purged);
            }
            let batch = keys.len();
            let listed = key_list(&keys);
            let skip = if server.skips_locked {
                " SKIP LOCKED"
            } else {
                ""
            };
            let lock = format!("{}{listed} FOR UPDATE{skip}", bounded.lock_expired);
            let deleted = sql::within(Self::NAME, timeout, async {
                let mut tx = self.pool.begin().await?;
                let locked: Vec<Vec<u8>> = sqlx::query_scalar(&lock).fetch_all(&mut *tx).await?;
                if locked.is_empty() {
                    return Ok(0);
                }
                let delete = format!("{}{}", self.sql.delete_expired, key_list(&locked));
                let done = sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&delete)).await?;
                tx.commit().await?;
                Ok(done.rows_affected())
            })
            .await;
            match deleted {
                Ok(deleted) => purged += deleted,
                // A row an open transaction holds, on a server that cannot skip it.
                Err(err) if waited_out(&err) => return Ok(purged),
                Err(err) => return Err(err),
            }
            if batch < PURGE_BATCH as usize {
                return Ok(purged);
            }
        }
    }

    async fn migrate(&self, timeout: Duration) -> Result<(), Error> {
        self.migrate_table(timeout).await
    }
}

/// Keys as an SQL list of hex literals, `(X'..', X'..')`: the runtime's own bytes, never a
/// caller's text.
fn key_list(keys: &[Vec<u8>]) -> String {
    let listed: Vec<String> = keys
        .iter()
        .map(|key| format!("X'{}'", hex::encode(key)))
        .collect();
    format!("({})", listed.join(", "))
}

/// Whether `err` is the server giving up a wait the store bounded: a row lock held past
/// the lock wait (`ER_LOCK_WAIT_TIMEOUT`), or the statement past its time (MariaDB's
/// `max_statement_time`, MySQL's `max_execution_time`).
pub(super) fn waited_out(err: &Error) -> bool {
    let Error::Store(source) = err else {
        return false;
    };
    source
        .downcast_ref::<sqlx::Error>()
        .and_then(sqlx::Error::as_database_error)
        .and_then(|db| db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .is_some_and(|db| matches!(db.number(), 1205 | 1969 | 3024))
}

/// The token an insert took from the table's `AUTO_INCREMENT`: never 0, which an insert
/// gives only where the column is not one (a table changed behind the store's back).
fn given(id: u64) -> Result<Token, sqlx::Error> {
    if id == 0 {
        return Err(sqlx::Error::Protocol(
            "the claim's insert took no token: the table's token column is not its AUTO_INCREMENT; run MySqlStore::migrate()".into(),
        ));
    }
    Ok(Token::new(id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_identifiers_only() {
        assert!(Statements::new(DEFAULT_TABLE).is_ok());
        for bad in ["", "1table", "idem records", "t`; DROP TABLE x; --", "db.t"] {
            assert!(Statements::new(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
