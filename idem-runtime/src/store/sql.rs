//! The SQL stores' core (features `postgres`, `sqlite`, `mysql`): one store, [`SqlStore`],
//! whose [`Dialect`] says how its statements are written and run.
//! [`PostgresStore`](crate::PostgresStore), [`MySqlStore`](crate::MySqlStore) and
//! [`SqliteStore`](crate::SqliteStore) are its three kinds.
//!
//! The core holds what the three share, written once: the [`Store`] implementation, the
//! store's timeout, the reads (a result, a lease, a call's steps), fencing by the claim's
//! token, the registry of running calls and the purge task. A dialect brings its pool, its
//! statements, and the operations whose locking differs: the claim (PostgreSQL: one
//! statement; MySQL: a read, then an insert or a locked takeover; SQLite: the store's queue
//! of writes), the holder's writes, removal, purging and migration.
//!
//! The core's own files: `sql/dialect.rs` ([`Dialect`], the one trait a database is
//! named by), `sql/driver.rs` (`Driver`, what a dialect implements: its pool, statements
//! and locking), `sql/rows.rs` (rows and columns, and the reads the core runs itself),
//! `sql/admin.rs` (the operator's statements) and `sql/purger.rs`. Each dialect's folder
//! has the same files: `<dialect>.rs` (the dialect, its driver and its constructors),
//! `statements.rs`, `schema.rs` (migration and the checks of the table), and
//! `transaction.rs` (claims in the caller's transaction,
//! [`Transactional`](crate::store::Transactional)).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

#[cfg(feature = "admin")]
mod admin;
mod dialect;
mod driver;
mod purger;
mod rows;

#[cfg(feature = "admin")]
pub(crate) use self::admin::{AdminSql, Spelling};
pub use self::dialect::Dialect;
pub(crate) use self::dialect::Sealed;
pub(crate) use self::driver::{Driver, Fenced};
pub use self::purger::Purger;
#[cfg(feature = "postgres")]
pub(crate) use self::rows::fingerprint;
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) use self::rows::{held, is_ours};
pub(crate) use self::rows::{is_identifier, kept_ms, millis, steps_range, Table};
use crate::store::{Holder, Holding, Recorded};
use crate::{Claim, ClaimRequest, Error, Flights, Key, Store, Token};

/// The default table name of every SQL store.
pub(crate) const DEFAULT_TABLE: &str = "idem_records";

/// The default time an operation of a SQL store may take.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

/// A store in one table of a SQL database, shared by every process that uses it, and kept
/// across restarts. Use it by the name of its dialect: [`PostgresStore`](crate::PostgresStore),
/// [`MySqlStore`](crate::MySqlStore), [`SqliteStore`](crate::SqliteStore).
///
/// Cloning is cheap; clones share the pool and the in-process registry of running calls.
pub struct SqlStore<D: Dialect> {
    driver: D::Driver,
    timeout: Duration,
    flights: Arc<Flights>,
}

impl<D: Dialect> Clone for SqlStore<D> {
    fn clone(&self) -> Self {
        Self {
            driver: self.driver.clone(),
            timeout: self.timeout,
            flights: Arc::clone(&self.flights),
        }
    }
}

impl<D: Dialect> SqlStore<D> {
    /// The store of `driver`, with the default timeout.
    pub(crate) fn of(driver: D::Driver) -> Self {
        Self {
            driver,
            timeout: DEFAULT_TIMEOUT,
            flights: Arc::default(),
        }
    }

    /// Sets how long one operation may take before it fails with [`Error::Store`] (default 3
    /// s): waiting for a pooled connection included, and for a row lock (PostgreSQL, MySQL)
    /// or the file's write lock (SQLite). A locked table or a stalled server then costs a
    /// call this long, never more; the body never runs after such a failure.
    ///
    /// The bound is the client's: on PostgreSQL a statement already sent may still run on
    /// the server later (each is fenced by its token, so a late one changes nothing it
    /// should not); set `statement_timeout` or `lock_timeout` for the role the pool
    /// connects as to have the server give up too. MySQL's statements carry the bound to
    /// the server themselves.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self.driver.retimed();
        self
    }

    /// Uses the table `table` instead of the default `idem_records` (on PostgreSQL, `name`
    /// or `schema.name`).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the name is not a plain identifier: names are checked, never
    /// quoted into SQL as they come.
    pub fn with_table(mut self, table: &str) -> Result<Self, Error> {
        self.driver.set_table(table)?;
        Ok(self)
    }

    /// The pool this store runs its statements on: begin the transactions of
    /// [`Operation::run_in_transaction`](crate::Operation::run_in_transaction) on it, or on
    /// any pool of the same database.
    pub fn pool(&self) -> &sqlx::Pool<D> {
        self.driver.pool()
    }

    /// The table this store uses.
    pub fn table(&self) -> &str {
        &self.driver.table().name
    }

    /// Runs `purge_expired` every `interval` on the current tokio runtime, until the
    /// returned guard is dropped. A failed purge is logged and retried at the next interval.
    pub fn purge_every(&self, interval: Duration) -> Purger {
        let store = self.clone();
        Purger::every(interval, self.table().to_string(), move || {
            let store = store.clone();
            async move { store.purged().await }
        })
    }

    /// The dialect's state.
    pub(crate) fn driver(&self) -> &D::Driver {
        &self.driver
    }

    /// How long one operation may take.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Deletes the expired rows: what every dialect's `purge_expired` is.
    pub(crate) async fn purged(&self) -> Result<u64, Error> {
        self.watched(self.driver.purge(self.timeout)).await
    }

    /// Creates the table: what every dialect's `migrate` is.
    pub(crate) async fn migrated(&self) -> Result<(), Error> {
        self.watched(self.driver.migrate(self.timeout)).await
    }

    /// `operation`, whose failure the dialect is told of.
    async fn watched<T>(
        &self,
        operation: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        let done = operation.await;
        if let Err(err) = &done {
            self.driver.failed(err, self.timeout);
        }
        done
    }

    /// A read of `sqlx` under the timeout, whose failure the dialect is told of.
    async fn read<T>(
        &self,
        operation: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, Error> {
        self.watched(within(D::Driver::NAME, self.timeout, operation))
            .await
    }

    async fn fenced(&self, key: &Key, token: Token, write: Fenced<'_>) -> Result<bool, Error> {
        self.watched(self.driver.fenced(self.timeout, key, token, write))
            .await
    }
}

impl<D: Dialect> fmt::Debug for SqlStore<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(D::Driver::STORE)
            .field("table", &self.table())
            .field("timeout", &self.timeout)
            .field("pool_size", &self.pool().size())
            .finish()
    }
}

#[async_trait]
impl<D: Dialect> Store for SqlStore<D> {
    /// The nonce is kept in the in-progress row's `value` (the result replaces it); a row in
    /// progress under it is taken again with a new token and a whole lease. The row keeps
    /// the claimant's namespace and label, this process as its holder, and the lease, for
    /// [`Admin`](crate::admin::Admin) to show, and the call's TTL: a row that lapses
    /// unsettled is purged only that long after its lease ran out.
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        self.watched(self.driver.claim(self.timeout, request)).await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.fenced(key, token, Fenced::Complete { value, ttl })
            .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        self.fenced(key, token, Fenced::Release).await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        self.fenced(key, token, Fenced::Renew { lease }).await
    }

    /// Claim tokens already grow here (a sequence on PostgreSQL, the table's
    /// `AUTO_INCREMENT` on MySQL, a counter table on SQLite): the claim's own token is its
    /// fencing token.
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
        self.fenced(call, token, Fenced::Step { step, value, ttl })
            .await
    }

    async fn steps(&self, call: &Key) -> Result<Vec<(Key, Bytes)>, Error> {
        let table = self.driver.table();
        self.read(D::steps(self.pool(), table, call)).await
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        self.watched(self.driver.remove(self.timeout, key)).await
    }

    async fn lookup(&self, key: &Key) -> Result<Option<Recorded>, Error> {
        let table = self.driver.table();
        let row = self.read(D::lookup(self.pool(), table, key)).await?;
        rows::recorded(row)
    }

    async fn lease_left(&self, key: &Key) -> Result<Option<Duration>, Error> {
        let table = self.driver.table();
        self.read(D::lease_left(self.pool(), table, key)).await
    }

    async fn holding(&self, key: &Key) -> Result<Option<Holding>, Error> {
        let table = self.driver.table();
        let held = self.read(D::holding(self.pool(), table, key)).await?;
        Ok(held
            .map(|(left, holder)| Holding::new(left, holder.as_deref().and_then(Holder::decode))))
    }

    /// One read of the trace an operator's release left (tokens grow, so an older
    /// holder's is released too).
    async fn released_by_operator(&self, key: &Key, token: Token) -> Result<bool, Error> {
        let table = self.driver.table();
        let released = self.read(D::released(self.pool(), table, key)).await?;
        let token = i64::try_from(token.get()).unwrap_or(i64::MAX);
        Ok(released.is_some_and(|released| token <= released))
    }

    fn claim_timeout(&self) -> Option<Duration> {
        Some(self.timeout)
    }

    fn flights(&self) -> Option<&Flights> {
        Some(&self.flights)
    }

    fn watch_removals(&self, watch: crate::store::RemovalWatch) -> bool {
        self.driver.watch_removals(watch)
    }
}

/// Runs one operation of `database` under `timeout`.
pub(crate) async fn within<T>(
    database: &str,
    timeout: Duration,
    operation: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(timeout, operation).await {
        Ok(result) => result.map_err(Error::store),
        Err(_) => Err(Error::store(format!(
            "{database} did not answer within {timeout:?}"
        ))),
    }
}
