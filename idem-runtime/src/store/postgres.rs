//! The durable store: one table in PostgreSQL, with `sqlx`.
//!
//! # Schema
//!
//! [`PostgresStore::migrate`] creates, if absent (`idem_records` is the default name):
//!
//! ```sql
//! CREATE TABLE idem_records (
//!     key         bytea       PRIMARY KEY,          -- sha256 of (version, namespace, key value)
//!     token       bigint      NOT NULL,             -- fencing token, from idem_records_token
//!     completed   boolean     NOT NULL,             -- false: in progress; true: completed
//!     fingerprint bytea,                            -- 32 bytes, or NULL
//!     value       bytea,                            -- the recorded result, once completed
//!     expires_at  timestamptz NOT NULL,             -- lease end, or result expiry
//!     namespace   text, label text, holder text,    -- whose it is, for an operator (`admin`)
//!     lease_ms    bigint, step boolean              -- the claim's lease; a step's record
//! );
//! CREATE INDEX idem_records_expires_at ON idem_records (expires_at);
//! CREATE SEQUENCE idem_records_token;
//! ```
//!
//! Every operation is one statement, but the claim of a key whose row is not live, which is
//! two; expiry is judged by the database's `now()`. A claim is one statement that returns
//! the live row if there is one (a replay writes nothing), and otherwise takes a fresh key
//! with `INSERT … ON CONFLICT DO NOTHING RETURNING`; a key whose row is not live (expired)
//! takes a second statement, `… ON CONFLICT … DO UPDATE … WHERE expires_at <= now()
//! RETURNING` (`ordinary_claim`). Tokens come from the sequence, so they grow across rows
//! and restarts.
//!
//! A call's steps ([`step`](crate::step())) are completed rows of the same table, keyed by
//! the step's key, which starts with the call key's first 16 bytes: one range of the
//! primary key holds a call's steps, read in one statement when a retry resumes. A step's
//! record is one `INSERT … SELECT` from the call's row locked `FOR SHARE`, under the
//! holder's token and a live lease: a takeover waits for it or it finds the new token.
//! [`remove`](crate::Store::remove) deletes the call's row and that range. Completed, released and expired rows are deleted by
//! [`purge_expired`](PostgresStore::purge_expired) or the task of
//! [`purge_every`](PostgresStore::purge_every); until then an expired row is treated as absent.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::{PgPool, PgPoolOptions, PgRow};
use sqlx::Row;
use tokio::sync::Semaphore;

pub use crate::store::sql::Purger;
use crate::store::sql::{
    self, fingerprint, millis, Dialect, Driver, Fenced, Sealed, SqlStore, Table,
};
use crate::store::Holder;
use crate::{Claim, ClaimRequest, Error, Key, Token};

mod hosts;
mod removals;
mod schema;
mod statements;
mod transaction;

use self::statements::Statements;

/// How many expired rows one purge statement deletes: each batch is a transaction of its
/// own, short enough that claims never queue behind a purge.
const PURGE_BATCH: i64 = 1000;

/// The default table name.
pub const DEFAULT_TABLE: &str = sql::DEFAULT_TABLE;

/// How long `connect` waits for a pooled connection before an operation fails with
/// [`Error::Store`].
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// The default time an operation may take, waiting for a connection included, before it
/// fails with [`Error::Store`].
pub const DEFAULT_TIMEOUT: Duration = sql::DEFAULT_TIMEOUT;

/// How many connections the renewals' pool may open, beside the store's pool.
pub const RENEWAL_CONNECTIONS: u32 = 2;

/// A store in a PostgreSQL table, shared by every process that uses the same database, and
/// kept across restarts.
///
/// Cloning is cheap; clones share the pool and the in-process registry of running calls.
///
/// ```no_run
/// use idem_runtime::PostgresStore;
///
/// # async fn example() -> Result<(), idem_runtime::Error> {
/// let store = PostgresStore::connect("postgres://app@127.0.0.1/app").await?;
/// store.migrate().await?; // creates the table if it is absent
/// let _purger = store.purge_every(std::time::Duration::from_secs(600));
/// # Ok(())
/// # }
/// ```
///
/// # Transactions
///
/// [`Operation::run_in_transaction`](crate::Operation::run_in_transaction) (`transaction =
/// tx` with a `&mut PgConnection`) claims in the caller's transaction: a replay is one
/// round trip, a first execution two. A duplicate's claim waits on the holder's row lock.
/// Under `READ COMMITTED` (PostgreSQL's default) it then replays. Under `REPEATABLE READ`
/// and `SERIALIZABLE`, a duplicate whose transaction began before the holder committed
/// cannot see the record: PostgreSQL refuses its claim with a serialization failure,
/// returned as [`Error::Store`], and its transaction must be retried (it then replays).
/// Never does a duplicate run the body.
pub type PostgresStore = SqlStore<sqlx::Postgres>;

/// The PostgreSQL dialect of [`SqlStore`]: its pools and statements.
#[derive(Clone)]
pub struct PostgresDriver {
    /// The pool of every statement but renewals: claims, completions, releases, removals.
    pool: PgPool,
    /// One permit per connection of `pool`, taken by an ordinary claim before it asks the
    /// pool for a connection. The pool hands out connections in the order they were asked
    /// for, so a holder's completion or release waits behind at most one pool's worth of
    /// claims, however large the crowd of callers: the rest of the crowd waits here.
    claims: Arc<Semaphore>,
    /// A pool of its own for renewals, opened when a body first outlives a quarter of its
    /// lease: to the others, a holder that cannot renew is a dead one, and its key would
    /// be taken over and run twice. Isolated from `pool`, which the application may also
    /// crowd with its own transactions.
    renewals: PgPool,
    sql: Arc<Statements>,
    /// The hosts of a multi-host URL: the pools follow the one that takes writes.
    hosts: Option<Arc<hosts::Hosts>>,
}

impl SqlStore<sqlx::Postgres> {
    /// Connects a pool to `url` (`postgres://user[:password]@host[:port]/database`), using the
    /// table [`DEFAULT_TABLE`]. Call [`migrate`](Self::migrate) before the first use.
    ///
    /// `url` may name several hosts, as libpq's do
    /// (`postgres://app@db1:5432,db2:5432/app?target_session_attrs=read-write`): the store
    /// connects to the one that takes writes (reachable, and not in recovery), and when a
    /// statement fails on a connection (the primary gone), it looks again and follows the
    /// promoted standby by itself, so that a completion retried within its lease lands
    /// there. Whatever `target_session_attrs` says, the store wants writes.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the URL is invalid or the database cannot be reached within
    /// [`DEFAULT_ACQUIRE_TIMEOUT`] (with several hosts: when none takes writes).
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let options = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(DEFAULT_ACQUIRE_TIMEOUT);
        let Some(hosts) = hosts::Hosts::parse(url)? else {
            let pool = options.connect(url).await.map_err(Error::store)?;
            return Ok(Self::from_pool(pool));
        };
        hosts.find_writable(DEFAULT_ACQUIRE_TIMEOUT).await?;
        let pool = options
            .after_connect(|connection, _| Box::pin(hosts::refuse_standby(connection)))
            .connect_with(hosts.current())
            .await
            .map_err(Error::store)?;
        Ok(Self::of(PostgresDriver::on(pool, Some(Arc::new(hosts)))))
    }

    /// Uses an existing pool; its acquire timeout bounds how long an operation waits when the
    /// database is unreachable.
    ///
    /// Claims, completions and releases share `pool`, and a completion or a release waits
    /// behind at most one pool's worth of new claims however many callers crowd in.
    /// Renewals run on a pool of their own of at most [`RENEWAL_CONNECTIONS`], opened only
    /// when a body first outlives a quarter of its lease, so that neither a crowd of claims
    /// nor the application's own long transactions on `pool` can starve a holder of its
    /// renewals until its lease lapses and another caller runs the body again. The server
    /// sees at most the pool's connections plus [`RENEWAL_CONNECTIONS`].
    pub fn from_pool(pool: PgPool) -> Self {
        Self::of(PostgresDriver::on(pool, None))
    }

    /// Creates the table, its index and its token sequence if they are absent. Safe to run
    /// from several processes at once: a transaction-scoped advisory lock serialises them.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the database fails or refuses (for example without the right to
    /// create tables).
    pub async fn migrate(&self) -> Result<(), Error> {
        self.migrated().await
    }

    /// Deletes every expired row (lapsed claims, results past their TTL). Returns how many.
    ///
    /// It deletes in batches of 1000, one short statement each, so that claims never queue
    /// behind a long purge; a row another transaction holds at that moment is skipped, not
    /// waited for, and left to the next purge.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the database fails.
    pub async fn purge_expired(&self) -> Result<u64, Error> {
        self.purged().await
    }
}

impl PostgresDriver {
    /// The dialect on `pool` (following `hosts`, with several), with its renewals' pool.
    fn on(pool: PgPool, hosts: Option<Arc<hosts::Hosts>>) -> Self {
        let size = pool.options().get_max_connections();
        let renewals = PgPoolOptions::new()
            .max_connections(RENEWAL_CONNECTIONS)
            .min_connections(0)
            .acquire_timeout(DEFAULT_ACQUIRE_TIMEOUT)
            .connect_lazy_with((*pool.connect_options()).clone());
        Self {
            pool,
            claims: Arc::new(Semaphore::new(size.max(1) as usize)),
            renewals,
            sql: Arc::new(Statements::of(None, DEFAULT_TABLE)),
            hosts,
        }
    }
}

impl Sealed for sqlx::Postgres {}

impl Dialect for sqlx::Postgres {
    type Driver = PostgresDriver;
}

impl Driver for PostgresDriver {
    type Database = sqlx::Postgres;

    const NAME: &'static str = "postgresql";

    const STORE: &'static str = "PostgresStore";

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn table(&self) -> &Table {
        &self.sql.table
    }

    fn set_table(&mut self, table: &str) -> Result<(), Error> {
        self.sql = Arc::new(Statements::new(table)?);
        Ok(())
    }

    /// Listens on the table's channel, on a connection of its own, for as long as `watch`
    /// wants: every completed record removed is told there, in the removal's transaction.
    fn watch_removals(&self, watch: crate::store::RemovalWatch) -> bool {
        if tokio::runtime::Handle::try_current().is_err() {
            return false;
        }
        let channel = self.sql.removals.clone();
        tokio::spawn(removals::listen(self.clone(), channel, watch));
        true
    }

    /// With several hosts: after a failure that may mean the primary is gone (no answer, a
    /// lost connection, a standby's refusal to write), has the hosts probed again.
    fn failed(&self, err: &Error, timeout: Duration) {
        let Some(hosts) = &self.hosts else {
            return;
        };
        let Error::Store(source) = err else {
            return;
        };
        let database = source
            .downcast_ref::<sqlx::Error>()
            .and_then(sqlx::Error::as_database_error);
        // SQLSTATE classes 08 (connection), 25 (read-only transaction), 57 (shut down).
        let lost = database.is_none_or(|db| {
            db.code().is_some_and(|code| {
                ["08", "25", "57"]
                    .iter()
                    .any(|class| code.starts_with(class))
            })
        });
        if lost {
            hosts.follow([&self.pool, &self.renewals], timeout);
        }
    }

    /// The nonce is kept in the in-progress row's `value` (empty until it completes); a row
    /// in progress under it is taken again with a new token and a whole lease.
    async fn claim(&self, timeout: Duration, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        let ClaimRequest {
            key,
            fingerprint,
            lease,
            nonce,
            claimant,
            ..
        } = *request;
        // Another attempt only when a concurrent claim inserted the row after this
        // statement's snapshot (or deleted the row it saw): the next statement sees it.
        // Under churn on one key that can repeat; each miss means another call made
        // progress, so the attempts go on as long as the timeout allows.
        let deadline = tokio::time::Instant::now() + timeout;
        let claimed = tokio::time::timeout(timeout, async {
            // The semaphore is never closed: the permit is always granted.
            let _turn = self.claims.acquire().await;
            loop {
                for claim in &self.sql.claim {
                    // The server's lock wait ends before the client's deadline: at 9/10
                    // of what is left of it when the statement is sent.
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    let lock_timeout = i64::try_from((left * 9 / 10).as_millis())
                        .unwrap_or(i64::MAX)
                        .clamp(1, i64::from(i32::MAX));
                    let row = sqlx::query(claim)
                        .bind(&key.as_bytes()[..])
                        .bind(fingerprint.map(|f| &f.as_bytes()[..]))
                        .bind(millis(lease))
                        .bind(lock_timeout)
                        .bind(&nonce.to_be_bytes()[..])
                        .bind(claimant.namespace())
                        .bind(claimant.label())
                        .bind(Holder::this_process_text())
                        .bind(sql::kept_ms(request.ttl))
                        .fetch_optional(&self.pool)
                        .await?;
                    if let Some(row) = row {
                        return Ok(row);
                    }
                }
                tokio::task::yield_now().await;
            }
        });
        let failed = match claimed.await {
            Ok(Ok(row)) => return parse_claim(&row),
            Ok(Err(err)) if lock_not_available(&err) => {
                // An open transaction's claim of this key held the row past the bound.
                tracing::debug!(outcome = "rejected", "a transaction holds the key");
                return Err(Error::InProgress);
            }
            Ok(Err(err)) => Error::store(err),
            Err(_) => Error::store(format!("postgresql did not answer within {:?}", timeout)),
        };
        Err(failed)
    }

    async fn fenced(
        &self,
        timeout: Duration,
        key: &Key,
        token: Token,
        write: Fenced<'_>,
    ) -> Result<bool, Error> {
        let key = &key.as_bytes()[..];
        let (pool, query) = match &write {
            Fenced::Complete { value, ttl } => (
                &self.pool,
                sqlx::query(&self.sql.complete)
                    .bind(key)
                    .bind(token)
                    .bind(&value[..])
                    .bind(millis(*ttl)),
            ),
            Fenced::Release => (
                &self.pool,
                sqlx::query(&self.sql.release).bind(key).bind(token),
            ),
            Fenced::Renew { lease } => (
                &self.renewals,
                sqlx::query(&self.sql.renew)
                    .bind(key)
                    .bind(token)
                    .bind(millis(*lease)),
            ),
            Fenced::Step { step, value, ttl } => (
                &self.pool,
                sqlx::query(&self.sql.record_step)
                    .bind(key)
                    .bind(token)
                    .bind(&value[..])
                    .bind(millis(*ttl))
                    .bind(&step.as_bytes()[..]),
            ),
        };
        let done = sql::within(Self::NAME, timeout, query.execute(pool)).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn remove(&self, timeout: Duration, key: &Key) -> Result<bool, Error> {
        let (first, last) = sql::steps_range(key);
        let removed = sqlx::query_scalar(&self.sql.remove)
            .bind(&key.as_bytes()[..])
            .bind(&first[..])
            .bind(&last[..])
            .fetch_one(&self.pool);
        sql::within(Self::NAME, timeout, removed).await
    }

    async fn purge(&self, timeout: Duration) -> Result<u64, Error> {
        let mut purged = 0;
        loop {
            let done = sqlx::query(&self.sql.purge)
                .bind(PURGE_BATCH)
                .execute(&self.pool);
            let done = sql::within(Self::NAME, timeout, done).await?;
            purged += done.rows_affected();
            if done.rows_affected() < PURGE_BATCH as u64 {
                return Ok(purged);
            }
        }
    }

    async fn migrate(&self, _: Duration) -> Result<(), Error> {
        schema::migrate(&self.pool, &self.sql.schema).await
    }
}

/// A lock wait that ran out (`lock_timeout`), also when PostgreSQL reports it as a cancel
/// because the lock was granted as the timeout fired.
fn lock_not_available(err: &sqlx::Error) -> bool {
    let Some(db) = err.as_database_error() else {
        return false;
    };
    match db.code().as_deref() {
        Some("55P03") => true,
        Some("57014") => db.message().contains("user request"),
        _ => false,
    }
}

fn parse_claim(row: &PgRow) -> Result<Claim, Error> {
    let acquired: bool = row.try_get(0).map_err(Error::store)?;
    let raw_token: i64 = row.try_get(1).map_err(Error::store)?;
    let completed: bool = row.try_get(2).map_err(Error::store)?;
    let fp = fingerprint(row.try_get(3).map_err(Error::store)?)?;
    Ok(if acquired {
        let token =
            u64::try_from(raw_token).map_err(|_| Error::store("a negative fencing token"))?;
        // Ordinary claims say whether they took an unsettled claim over; a claim in a
        // transaction's function does not.
        let taken_over = match row.len() > 5 {
            true => row.try_get(5).map_err(Error::store)?,
            false => false,
        };
        Claim::Acquired {
            token: Token::new(token),
            taken_over,
        }
    } else if completed {
        let value: Option<Vec<u8>> = row.try_get(4).map_err(Error::store)?;
        Claim::Completed {
            value: Bytes::from(value.unwrap_or_default()),
            fingerprint: fp,
        }
    } else {
        Claim::InProgress { fingerprint: fp }
    })
}
