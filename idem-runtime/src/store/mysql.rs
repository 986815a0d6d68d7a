//! The durable store on MySQL 8 or MariaDB: one InnoDB table, with `sqlx` (feature `mysql`).
//!
//! # Schema
//!
//! [`MySqlStore::migrate`] creates, if absent (`idem_records` is the default name):
//!
//! ```sql
//! CREATE TABLE idem_records (
//!     `key`       VARBINARY(32) NOT NULL PRIMARY KEY, -- sha256 of (version, namespace, key value)
//!     token       BIGINT        NOT NULL,             -- fencing token, from idem_records_tokens
//!     completed   BOOLEAN       NOT NULL,             -- 0: in progress; 1: completed
//!     fingerprint VARBINARY(32),                      -- 32 bytes, or NULL
//!     value       LONGBLOB,                           -- the result once completed; the claim's nonce before
//!     expires_at  BIGINT        NOT NULL,             -- lease end or result expiry, Unix ms
//!     INDEX idem_records_expires_at (expires_at)
//! ) ENGINE = InnoDB;
//! -- tokens: the next value of its AUTO_INCREMENT (the purge deletes its rows but the newest)
//! CREATE TABLE idem_records_tokens (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY) ENGINE = InnoDB;
//! -- the counter of earlier versions, which the tokens start above
//! CREATE TABLE idem_records_token (id TINYINT PRIMARY KEY, last BIGINT NOT NULL) ENGINE = InnoDB;
//! ```
//!
//! Expiry is judged by the server's clock (`UTC_TIMESTAMP(6)`, whatever the session's time
//! zone), which every process reads alike. A claim first reads the key's live row (a replay or
//! a held key writes nothing). A key with no row is taken by an `INSERT IGNORE`: the primary
//! key lets one insert in. A key with a row that lapsed is taken in a transaction that locks
//! that row (`SELECT … FOR UPDATE`) before it looks and writes, so two processes can never
//! both take it. A token is a row inserted into the token table, which takes the next value
//! of its `AUTO_INCREMENT`: InnoDB releases that lock at the end of the insert and keeps the
//! value across restarts (MySQL from 8.0, MariaDB from 10.2.4; `migrate` refuses older
//! servers), so tokens grow across rows, processes and restarts and no claim waits for
//! another's token. An ordinary claim draws it in a statement of its own before its insert
//! (two short statements: under 64 callers, one transaction around both served 16 % fewer
//! claims); a takeover draws it after it locked the row, in its transaction; a claim in a
//! caller's transaction draws it there, so it costs no commit of its own. Every other
//! operation is one statement. Expired rows, and the token table's rows but its newest, are
//! deleted by [`purge_expired`](MySqlStore::purge_expired) or the task of
//! [`purge_every`](MySqlStore::purge_every), which read what to delete without a lock and
//! delete it by key, so that they never wait for a caller's open transaction; until then an
//! expired row counts as absent.
//!
//! All processes on a table should run a version that draws tokens the same way: one that
//! still bumps the counter would draw tokens the others' do not follow.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::Row;

pub use crate::store::sql::Purger;
use crate::store::sql::{self, millis, LookupRow};
use crate::store::Recorded;
use crate::{Claim, Error, Fingerprint, Flights, Key, Store, Token};

mod statements;
mod transaction;

use statements::Statements;

/// The default table name.
pub const DEFAULT_TABLE: &str = "idem_records";

/// The default time an operation may take, waiting for a pooled connection and for row
/// locks included, before it fails with [`Error::Store`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

/// How many connections [`MySqlStore::connect`] pools.
pub const DEFAULT_CONNECTIONS: u32 = 10;

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
#[derive(Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    sql: Arc<Statements>,
    timeout: Duration,
    flights: Arc<Flights>,
}

impl MySqlStore {
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
            .connect(url)
            .await
            .map_err(Error::store)?;
        Ok(Self::from_pool(pool))
    }

    /// Uses an existing pool.
    pub fn from_pool(pool: MySqlPool) -> Self {
        Self {
            pool,
            sql: Arc::new(Statements::of(DEFAULT_TABLE)),
            timeout: DEFAULT_TIMEOUT,
            flights: Arc::default(),
        }
    }

    /// Sets how long one operation may take, waiting for a pooled connection and for row
    /// locks included, before it fails with [`Error::Store`] (default [`DEFAULT_TIMEOUT`]).
    /// The body never runs after such a failure.
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
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The table this store uses.
    pub fn table(&self) -> &str {
        &self.sql.table
    }

    /// Creates the table, its index and its token tables if they are absent. Safe to run
    /// from several processes at once.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the statements fail (no `CREATE` privilege, say), or when the
    /// server forgets an `AUTO_INCREMENT` on restart (MySQL before 8.0, MariaDB before
    /// 10.2.4): its fencing tokens could go back, so it is refused.
    pub async fn migrate(&self) -> Result<(), Error> {
        let version: String = self
            .within(sqlx::query_scalar("SELECT VERSION()").fetch_one(&self.pool))
            .await?;
        if !keeps_auto_increment(&version) {
            return Err(Error::store(format!(
                "MySQL {version} forgets an AUTO_INCREMENT on restart, so fencing tokens could go back: use MySQL 8.0 or MariaDB 10.2.4 or later"
            )));
        }
        self.within(async {
            for statement in &self.sql.create {
                sqlx::query(statement).execute(&self.pool).await?;
            }
            Ok(())
        })
        .await
    }

    /// Deletes every expired row (lapsed claims, results past their TTL), in batches of
    /// 1000, and the token table's rows but its newest. Returns how many expired rows. Rows
    /// an open transaction holds are left for a later purge, never waited for.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the statement fails.
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        let purged = self
            .purge(
                &self.sql.expired,
                &self.sql.delete_expired,
                |key: Vec<u8>| format!("X'{}'", hex::encode(key)),
            )
            .await?;
        self.purge(&self.sql.old_tokens, &self.sql.delete_tokens, |id: i64| {
            id.to_string()
        })
        .await?;
        Ok(purged)
    }

    /// Deletes, a batch at a time, the rows `select` names (by a read that locks nothing),
    /// with `delete` and their keys written in as `literal` writes them. Returns how many.
    async fn purge<K>(
        &self,
        select: &str,
        delete: &str,
        literal: impl Fn(K) -> String,
    ) -> Result<u64, Error>
    where
        K: for<'r> sqlx::Decode<'r, sqlx::MySql> + sqlx::Type<sqlx::MySql> + Send + Unpin,
    {
        let mut purged = 0;
        loop {
            let keys: Vec<K> = self
                .within(sqlx::query_scalar(select).fetch_all(&self.pool))
                .await?;
            if keys.is_empty() {
                return Ok(purged);
            }
            let batch = keys.len();
            let listed: Vec<String> = keys.into_iter().map(&literal).collect();
            let statement = format!("{delete}({})", listed.join(", "));
            let done = self
                .within(sqlx::Executor::execute(
                    &self.pool,
                    sqlx::raw_sql(&statement),
                ))
                .await?;
            purged += done.rows_affected();
            if batch < PURGE_BATCH as usize {
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
        sql::within("mysql", self.timeout, operation).await
    }

    /// A token, drawn on `conn` (in its transaction, if it is in one).
    async fn draw(&self, conn: &mut sqlx::MySqlConnection) -> Result<Token, sqlx::Error> {
        let drawn = sqlx::query(&self.sql.draw).execute(&mut *conn).await?;
        Ok(Token::new(drawn.last_insert_id()))
    }

    /// Takes the key if no live row holds it (or a row of the caller's own lost claim).
    async fn take(
        &self,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
        nonce: u64,
    ) -> Result<Result<Token, MySqlRow>, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        let fingerprint = fingerprint.map(|f| &f.as_bytes()[..]);
        let nonce_bytes = nonce.to_be_bytes();
        for _ in 0..CLAIM_LOOKS {
            // No row: the primary key lets one insert in. Two statements that commit by
            // themselves (the token's draw, the insert): cheaper under a crowd than one
            // transaction around both, which costs two more round trips.
            let token = self.draw(&mut conn).await?;
            let inserted = sqlx::query(&self.sql.insert)
                .bind(&key.as_bytes()[..])
                .bind(token)
                .bind(fingerprint)
                .bind(&nonce_bytes[..])
                .bind(millis(lease))
                .execute(&mut *conn)
                .await?;
            if inserted.rows_affected() == 1 {
                return Ok(Ok(token));
            }
            // A row: locked, then looked at, then taken over if it lapsed, with a token
            // drawn after the lock (so above the row's, whenever that was drawn).
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            let Some(row) = sqlx::query(&self.sql.lock)
                .bind(&key.as_bytes()[..])
                .fetch_optional(&mut *tx)
                .await?
            else {
                continue; // purged meanwhile: insert again (the transaction rolls back)
            };
            let live: i64 = row.try_get(4)?;
            if live != 0 && !sql::is_ours(&row, nonce) {
                return Ok(Err(row)); // the transaction rolls back when dropped
            }
            let token = self.draw(&mut tx).await?;
            sqlx::query(&self.sql.take)
                .bind(token)
                .bind(fingerprint)
                .bind(&nonce_bytes[..])
                .bind(millis(lease))
                .bind(&key.as_bytes()[..])
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            return Ok(Ok(token));
        }
        Err(sqlx::Error::Protocol(
            "the key's row kept vanishing while it was claimed".into(),
        ))
    }

    async fn fenced(
        &self,
        query: sqlx::query::Query<'_, sqlx::MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<bool, Error> {
        let done = self.within(query.execute(&self.pool)).await?;
        Ok(done.rows_affected() == 1)
    }
}

/// Whether a server of `version` (`SELECT VERSION()`: `8.0.36`, `10.11.6-MariaDB-0+deb12u1`)
/// keeps a table's `AUTO_INCREMENT` across restarts: MySQL from 8.0, MariaDB from 10.2.4.
fn keeps_auto_increment(version: &str) -> bool {
    let maria = version.contains("MariaDB");
    // MariaDB's handshake (and some proxies) prefix its version with `5.5.5-`.
    let version = match version.strip_prefix("5.5.5-") {
        Some(rest) if maria => rest,
        _ => version,
    };
    let numbers: Vec<u32> = version
        .split(|c: char| !c.is_ascii_digit())
        .take(3)
        .map(|n| n.parse().unwrap_or(0))
        .collect();
    let at_least = |least: [u32; 3]| numbers.as_slice() >= &least[..];
    if maria {
        at_least([10, 2, 4])
    } else {
        at_least([8, 0, 0])
    }
}

impl fmt::Debug for MySqlStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlStore")
            .field("table", &self.sql.table)
            .field("timeout", &self.timeout)
            .field("pool_size", &self.pool.size())
            .finish()
    }
}

#[async_trait]
impl Store for MySqlStore {
    async fn claim(
        &self,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Claim, Error> {
        self.claim_with_nonce(key, fingerprint, lease, crate::store::nonce())
            .await
    }

    /// The nonce is kept in the in-progress row's `value` (the result replaces it); a row in
    /// progress under it is taken again with a new token and a whole lease.
    async fn claim_with_nonce(
        &self,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
        nonce: u64,
    ) -> Result<Claim, Error> {
        self.within(async {
            // A replay, or a key someone holds: answered by a read, which locks nothing.
            let live = sqlx::query(&self.sql.live)
                .bind(&key.as_bytes()[..])
                .fetch_optional(&self.pool)
                .await?;
            match live {
                Some(row) if !sql::is_ours(&row, nonce) => Ok(Err(row)),
                _ => self.take(key, fingerprint, lease, nonce).await,
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
        self.fenced(
            sqlx::query(&self.sql.complete)
                .bind(&value[..])
                .bind(millis(ttl))
                .bind(&key.as_bytes()[..])
                .bind(token),
        )
        .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        self.fenced(
            sqlx::query(&self.sql.release)
                .bind(&key.as_bytes()[..])
                .bind(token),
        )
        .await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        self.fenced(
            sqlx::query(&self.sql.renew)
                .bind(millis(lease))
                .bind(&key.as_bytes()[..])
                .bind(token),
        )
        .await
    }

    /// Claim tokens already grow here (they come from the token table's `AUTO_INCREMENT`):
    /// the claim's own token is its fencing token.
    async fn fence(&self, _: &Key, token: Token) -> Result<Option<Token>, Error> {
        Ok(Some(token))
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        self.within(async {
            let mut tx = self.pool.begin().await?;
            let live: Option<i64> = sqlx::query_scalar(&self.sql.remove_lock)
                .bind(&key.as_bytes()[..])
                .fetch_optional(&mut *tx)
                .await?;
            sqlx::query(&self.sql.remove)
                .bind(&key.as_bytes()[..])
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(live.is_some_and(|live| live != 0))
        })
        .await
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
        for bad in ["", "1table", "idem records", "t`; DROP TABLE x; --", "db.t"] {
            assert!(Statements::new(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn servers_that_forget_auto_increment_on_restart_are_known() {
        for kept in [
            "8.0.36",
            "8.4.0",
            "9.1.0-commercial",
            "10.2.4-MariaDB",
            "10.11.6-MariaDB-0+deb12u1",
            "11.4.2-MariaDB-ubu2404",
            "5.5.5-10.11.6-MariaDB",
        ] {
            assert!(keeps_auto_increment(kept), "{kept}");
        }
        for forgotten in [
            "5.7.44",
            "5.7.44-log",
            "10.2.3-MariaDB",
            "10.1.48-MariaDB",
            "5.5.5-10.1.2-MariaDB",
        ] {
            assert!(!keeps_auto_increment(forgotten), "{forgotten}");
        }
    }
}
