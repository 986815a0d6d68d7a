//! The durable store on MySQL 8 or MariaDB: one InnoDB table, with `sqlx` (feature `mysql`).
//!
//! # Schema
//!
//! [`MySqlStore::migrate`] creates, if absent (`idem_records` is the default name):
//!
//! ```sql
//! CREATE TABLE idem_records (
//!     `key`       VARBINARY(32) NOT NULL PRIMARY KEY, -- sha256 of (version, namespace, key value)
//!     token       BIGINT        NOT NULL,             -- fencing token, from idem_records_token
//!     completed   BOOLEAN       NOT NULL,             -- 0: in progress; 1: completed
//!     fingerprint VARBINARY(32),                      -- 32 bytes, or NULL
//!     value       LONGBLOB,                           -- the result once completed; the claim's nonce before
//!     expires_at  BIGINT        NOT NULL,             -- lease end or result expiry, Unix ms
//!     INDEX idem_records_expires_at (expires_at)
//! ) ENGINE = InnoDB;
//! CREATE TABLE idem_records_token (id TINYINT PRIMARY KEY, last BIGINT NOT NULL) ENGINE = InnoDB;
//! ```
//!
//! Expiry is judged by the server's clock (`UTC_TIMESTAMP(6)`, whatever the session's time
//! zone), which every process reads alike. A claim first reads the key's live row (a replay or
//! a held key writes nothing). A key with no row is taken by one `INSERT IGNORE`: the primary
//! key lets one insert in. A key with a row that lapsed is taken in a transaction that locks
//! that row (`SELECT … FOR UPDATE`) before it looks and writes, so two processes can never
//! both take it. Tokens come from a one-row counter, bumped in a statement of its own
//! (`LAST_INSERT_ID(last + 1)`), so the counter's lock is held for one statement, not for a
//! claim: tokens grow across rows, processes and restarts. Every other operation is one
//! statement. Expired rows are deleted by [`purge_expired`](MySqlStore::purge_expired) or
//! the task of [`purge_every`](MySqlStore::purge_every); until then an expired row counts
//! as absent.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::Row;

pub use crate::store::sql::Purger;
use crate::store::sql::{self, is_identifier, millis, LookupRow};
use crate::store::Recorded;
use crate::{Claim, Error, Fingerprint, Flights, Key, Store, Token};

mod transaction;

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

/// The server's clock in Unix milliseconds, independent of the session's time zone.
const NOW: &str = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";

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

/// The statements of one table, written once.
struct Statements {
    table: String,
    create: [String; 3],
    live: String,
    bump: String,
    insert: String,
    lock: String,
    /// The key's row under a shared lock, for claims in the caller's transaction.
    share: String,
    take: String,
    complete: String,
    release: String,
    renew: String,
    remove_lock: String,
    remove: String,
    lookup: String,
    lease_left: String,
    purge: String,
}

impl Statements {
    /// `live` with the key written in, for a message of several statements (claims in a
    /// transaction, `transaction.rs`). Every literal is the runtime's own: bytes in hex,
    /// numbers in digits.
    fn live_literal(&self, key: &Key) -> String {
        format!(
            "SELECT token, completed, fingerprint, value FROM `{}` \
             WHERE `key` = X'{}' AND expires_at > {NOW}",
            self.table,
            hex::encode(key.as_bytes())
        )
    }

    /// `insert`, with the claim's values written in.
    fn insert_literal(&self, call: &crate::store::Call<'_>, token: i64) -> String {
        let fingerprint = call.fingerprint.map_or("NULL".to_string(), |f| {
            format!("X'{}'", hex::encode(f.as_bytes()))
        });
        format!(
            "INSERT IGNORE INTO `{}` (`key`, token, completed, fingerprint, value, expires_at) \
             VALUES (X'{}', {token}, FALSE, {fingerprint}, NULL, {NOW} + {})",
            self.table,
            hex::encode(call.key.as_bytes()),
            millis(call.lease)
        )
    }

    /// The completion of a claim in the caller's transaction: its own row, whatever the
    /// lease says, with its values written in.
    fn complete_literal(&self, key: &Key, token: Token, record: &[u8], ttl: i64) -> String {
        format!(
            "UPDATE `{}` SET completed = TRUE, value = X'{}', expires_at = {NOW} + {ttl} \
             WHERE `key` = X'{}' AND token = {} AND NOT completed",
            self.table,
            hex::encode(record),
            hex::encode(key.as_bytes()),
            token.get()
        )
    }

    /// The statements of `table`, after checking the name.
    fn new(table: &str) -> Result<Self, Error> {
        if is_identifier(table) {
            Ok(Self::of(table))
        } else {
            Err(Error::store(format!(
                "invalid table name {table:?}: use letters, digits and `_` (at most 50, not starting with a digit)"
            )))
        }
    }

    /// The statements of a checked table name.
    fn of(name: &str) -> Self {
        let t = format!("`{name}`");
        let counter = format!("`{name}_token`");
        let index = format!("`{name}_expires_at`");
        let live_row = format!("`key` = ? AND expires_at > {NOW}");
        Self {
            table: name.to_string(),
            create: [
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                        `key` VARBINARY(32) NOT NULL PRIMARY KEY, \
                        token BIGINT NOT NULL, \
                        completed BOOLEAN NOT NULL, \
                        fingerprint VARBINARY(32) NULL, \
                        value LONGBLOB NULL, \
                        expires_at BIGINT NOT NULL, \
                        INDEX {index} (expires_at)) ENGINE = InnoDB"
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {counter} (\
                        id TINYINT NOT NULL PRIMARY KEY, last BIGINT NOT NULL) ENGINE = InnoDB"
                ),
                format!("INSERT IGNORE INTO {counter} (id, last) VALUES (1, 0)"),
            ],
            live: format!("SELECT token, completed, fingerprint, value FROM {t} WHERE {live_row}"),
            bump: format!("UPDATE {counter} SET last = LAST_INSERT_ID(last + 1) WHERE id = 1"),
            insert: format!(
                "INSERT IGNORE INTO {t} (`key`, token, completed, fingerprint, value, expires_at) \
                 VALUES (?, ?, FALSE, ?, ?, {NOW} + ?)"
            ),
            lock: format!(
                "SELECT token, completed, fingerprint, value, expires_at > {NOW} FROM {t} \
                 WHERE `key` = ? FOR UPDATE"
            ),
            share: format!(
                "SELECT token, completed, fingerprint, value, expires_at > {NOW} FROM {t} \
                 WHERE `key` = ? LOCK IN SHARE MODE"
            ),
            take: format!(
                "UPDATE {t} SET token = ?, completed = FALSE, fingerprint = ?, value = ?, \
                 expires_at = {NOW} + ? WHERE `key` = ?"
            ),
            complete: format!(
                "UPDATE {t} SET completed = TRUE, value = ?, expires_at = {NOW} + ? \
                 WHERE `key` = ? AND token = ? AND NOT completed AND expires_at > {NOW}"
            ),
            release: format!(
                "DELETE FROM {t} WHERE `key` = ? AND token = ? AND NOT completed AND expires_at > {NOW}"
            ),
            renew: format!(
                "UPDATE {t} SET expires_at = {NOW} + ? \
                 WHERE `key` = ? AND token = ? AND NOT completed AND expires_at > {NOW}"
            ),
            remove_lock: format!("SELECT expires_at > {NOW} FROM {t} WHERE `key` = ? FOR UPDATE"),
            remove: format!("DELETE FROM {t} WHERE `key` = ?"),
            // Rounded down by a millisecond: `NOW` truncates, and a copy in a fast tier must
            // never outlive the row.
            lookup: format!(
                "SELECT fingerprint, value, expires_at - {NOW} - 1 FROM {t} \
                 WHERE {live_row} AND completed"
            ),
            lease_left: format!(
                "SELECT expires_at - {NOW} FROM {t} WHERE {live_row} AND NOT completed"
            ),
            purge: format!("DELETE FROM {t} WHERE expires_at <= {NOW} LIMIT ?"),
        }
    }
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

    /// Creates the table, its index and its token counter if they are absent. Safe to run
    /// from several processes at once.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the statements fail (no `CREATE` privilege, say).
    pub async fn migrate(&self) -> Result<(), Error> {
        self.within(async {
            for statement in &self.sql.create {
                sqlx::query(statement).execute(&self.pool).await?;
            }
            Ok(())
        })
        .await
    }

    /// Deletes every expired row (lapsed claims, results past their TTL), in batches of
    /// 1000. Returns how many.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the statement fails.
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        let mut purged = 0;
        loop {
            let done = self
                .within(
                    sqlx::query(&self.sql.purge)
                        .bind(PURGE_BATCH)
                        .execute(&self.pool),
                )
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
        sql::within("mysql", self.timeout, operation).await
    }

    /// The next token: one statement, so that the counter's row lock is never held for
    /// longer than it.
    async fn next_token(&self, conn: &mut sqlx::MySqlConnection) -> Result<i64, sqlx::Error> {
        let bumped = sqlx::query(&self.sql.bump).execute(&mut *conn).await?;
        Ok(i64::try_from(bumped.last_insert_id()).unwrap_or(i64::MAX))
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
            let token = self.next_token(&mut conn).await?;
            // No row: the primary key lets one insert in.
            let inserted = sqlx::query(&self.sql.insert)
                .bind(&key.as_bytes()[..])
                .bind(token)
                .bind(fingerprint)
                .bind(&nonce_bytes[..])
                .bind(millis(lease))
                .execute(&mut *conn)
                .await?;
            if inserted.rows_affected() == 1 {
                return Ok(Ok(Token::new(token.unsigned_abs())));
            }
            // A row: locked, then looked at, then taken over if it lapsed.
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            let Some(row) = sqlx::query(&self.sql.lock)
                .bind(&key.as_bytes()[..])
                .fetch_optional(&mut *tx)
                .await?
            else {
                continue; // purged meanwhile: insert again
            };
            let live: i64 = row.try_get(4)?;
            if live != 0 && !sql::is_ours(&row, nonce) {
                return Ok(Err(row)); // the transaction rolls back when dropped
            }
            sqlx::query(&self.sql.take)
                .bind(token)
                .bind(fingerprint)
                .bind(&nonce_bytes[..])
                .bind(millis(lease))
                .bind(&key.as_bytes()[..])
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            return Ok(Ok(Token::new(token.unsigned_abs())));
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

    /// Claim tokens already grow here (they come from the counter table): the claim's own
    /// token is its fencing token.
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
}
