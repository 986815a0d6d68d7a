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
//!     expires_at  timestamptz NOT NULL              -- lease end, or result expiry
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
//! [`remove`](Store::remove) deletes the call's row and that range. Completed, released and expired rows are deleted by
//! [`purge_expired`](PostgresStore::purge_expired) or the task of
//! [`purge_every`](PostgresStore::purge_every); until then an expired row is treated as absent.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::postgres::{PgPool, PgPoolOptions, PgRow};
use sqlx::Row;
use tokio::sync::Semaphore;

pub use crate::store::sql::Purger;
use crate::store::sql::{self, fingerprint, is_identifier, millis, LookupRow};
use crate::store::Recorded;
use crate::{Claim, Error, Fingerprint, Flights, Key, Store, Token};

mod hosts;
mod schema;
mod transaction;

use self::schema::Schema;

/// How many expired rows one purge statement deletes: each batch is a transaction of its
/// own, short enough that claims never queue behind a purge.
const PURGE_BATCH: i64 = 1000;

/// The default table name.
pub const DEFAULT_TABLE: &str = "idem_records";

/// How long `connect` waits for a pooled connection before an operation fails with
/// [`Error::Store`].
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// The default time an operation may take, waiting for a connection included, before it
/// fails with [`Error::Store`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

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
#[derive(Clone)]
pub struct PostgresStore {
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
    timeout: Duration,
    flights: Arc<Flights>,
    /// The hosts of a multi-host URL: the pools follow the one that takes writes.
    hosts: Option<Arc<hosts::Hosts>>,
}

/// How many connections the renewals' pool may open, beside the store's pool.
pub const RENEWAL_CONNECTIONS: u32 = 2;

/// The statements of one table, written once.
struct Statements {
    schema: Schema,
    /// The ordinary claim: the fast one first, then the whole one ([`ordinary_claim`]).
    claim: [String; 2],
    /// The statements of claims in the caller's transaction (`transaction.rs`).
    pub(super) transaction: transaction::Statements,
    complete: String,
    release: String,
    renew: String,
    record_step: String,
    steps: String,
    remove: String,
    lookup: String,
    lease_left: String,
    purge: String,
}

impl Statements {
    /// The statements of `table` (`name` or `schema.name`), after checking the name.
    fn new(table: &str) -> Result<Self, Error> {
        Ok(match table.split_once('.') {
            Some((schema, name)) => Self::of(Some(validate(schema)?), validate(name)?),
            None => Self::of(None, validate(table)?),
        })
    }

    /// The statements of a checked table name.
    fn of(schema: Option<&str>, name: &str) -> Self {
        let objects = Schema::new(schema, name);
        let t = objects.quoted.clone();
        let sequence = objects.sequence.clone();
        let function = objects.function.clone();
        Self {
            transaction: transaction::Statements::new(&function, &t),
            claim: [
                ordinary_claim(&t, &sequence, Conflict::Skip),
                ordinary_claim(&t, &sequence, Conflict::TakeOver),
            ],
            complete: format!(
                "UPDATE {t} SET completed = true, value = $3, expires_at = now() + $4 * interval '1 millisecond' \
                 WHERE key = $1 AND token = $2 AND NOT completed AND expires_at > now()"
            ),
            release: format!(
                "DELETE FROM {t} WHERE key = $1 AND token = $2 AND NOT completed AND expires_at > now()"
            ),
            renew: format!(
                "UPDATE {t} SET expires_at = now() + $3 * interval '1 millisecond' \
                 WHERE key = $1 AND token = $2 AND NOT completed AND expires_at > now()"
            ),
            // The call's row is locked (`FOR SHARE`) by the statement that reads it, so a
            // takeover waits for the step's record, or the record finds the new token.
            record_step: format!(
                "WITH held AS (\
                    SELECT token FROM {t} \
                    WHERE key = $1 AND token = $2 AND NOT completed AND expires_at > now() FOR SHARE) \
                 INSERT INTO {t} (key, token, completed, fingerprint, value, expires_at) \
                 SELECT $5, token, true, NULL, $3, now() + $4 * interval '1 millisecond' FROM held \
                 ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token, completed = true, \
                    fingerprint = NULL, value = EXCLUDED.value, expires_at = EXCLUDED.expires_at"
            ),
            steps: format!(
                "SELECT key, value FROM {t} \
                 WHERE key BETWEEN $2 AND $3 AND key <> $1 AND completed AND expires_at > now()"
            ),
            remove: format!(
                "WITH steps AS (DELETE FROM {t} WHERE key BETWEEN $2 AND $3 AND key <> $1), \
                 removed AS (DELETE FROM {t} WHERE key = $1 RETURNING expires_at > now() AS live) \
                 SELECT coalesce(bool_or(live), false) FROM removed"
            ),
            // Rounded down: the time a copy of the record may live must not exceed the row's.
            lookup: format!(
                "SELECT fingerprint, value, floor(extract(epoch FROM expires_at - now()) * 1000)::bigint \
                 FROM {t} WHERE key = $1 AND completed AND expires_at > now()"
            ),
            // Rounded up: a client told to come back then finds the lease over.
            lease_left: format!(
                "SELECT ceil(extract(epoch FROM expires_at - now()) * 1000)::bigint \
                 FROM {t} WHERE key = $1 AND NOT completed AND expires_at > now()"
            ),
            // One batch: expired rows that no one holds a lock on (a claim taking an expired
            // key over, say) are skipped, never waited for.
            purge: format!(
                "DELETE FROM {t} WHERE key = ANY(ARRAY(\
                    SELECT key FROM {t} WHERE expires_at <= now() \
                    LIMIT $1 FOR UPDATE SKIP LOCKED))"
            ),
            schema: objects,
        }
    }
}

/// What a claim's insert does with a row of the key that is not live.
#[derive(Clone, Copy)]
enum Conflict {
    /// Takes it over when it is expired (or, with a nonce, the caller's own).
    TakeOver,
    /// Leaves it: the statement then returns nothing.
    Skip,
}

/// The claim: one statement that returns the live row if there is one (a replay or a held
/// key writes nothing), and otherwise takes the key (absent, or its row expired). A row
/// inserted by a concurrent claim after this statement's snapshot is in neither branch:
/// the statement then returns nothing, and is asked once more.
///
/// `now` is how the statement reads the clock, `params` the key, the fingerprint and the
/// lease in milliseconds. With [`Conflict::Skip`], a key that has a row which is not live
/// is not taken over: the statement returns nothing, as in the race above (the fast claim
/// of [`ordinary_claim`]). With a `nonce` (ordinary claims), an in-progress row keeps it in
/// its `value` (empty until the row completes), and a row in progress under this very
/// nonce is the caller's own claim, made by a try whose reply was lost: it is taken again
/// like a lapsed one, with a new token and a whole lease, so the caller never holds a claim
/// whose lease was spent while the reply was lost.
fn claim_query(
    t: &str,
    sequence: &str,
    now: &str,
    params: [&str; 3],
    nonce: Option<&str>,
    conflict: Conflict,
) -> String {
    let [key, fingerprint, lease] = params;
    let (value, not_ours, ours) = match nonce {
        Some(nonce) => (
            nonce.to_string(),
            format!(" AND (completed OR value IS DISTINCT FROM {nonce})"),
            format!(" OR (NOT r.completed AND r.value = {nonce})"),
        ),
        None => ("NULL".to_string(), String::new(), String::new()),
    };
    let on_conflict = match conflict {
        Conflict::TakeOver => format!(
            "DO UPDATE SET \
                token = EXCLUDED.token, completed = false, fingerprint = EXCLUDED.fingerprint, \
                value = EXCLUDED.value, expires_at = EXCLUDED.expires_at \
            WHERE r.expires_at <= {now}{ours}"
        ),
        Conflict::Skip => "DO NOTHING".to_string(),
    };
    format!(
        "WITH live AS (\
            SELECT token, completed, fingerprint, value FROM {t} \
            WHERE key = {key} AND expires_at > {now}{not_ours}), \
         claimed AS (\
            INSERT INTO {t} AS r (key, token, completed, fingerprint, value, expires_at) \
            SELECT {key}, nextval('{sequence}'), false, {fingerprint}, {value}, {now} + {lease} * interval '1 millisecond' \
            WHERE NOT EXISTS (SELECT 1 FROM live) \
            ON CONFLICT (key) {on_conflict} \
            RETURNING r.token, r.completed, r.fingerprint, r.value) \
         SELECT true, token, completed, fingerprint, value FROM claimed \
         UNION ALL \
         SELECT false, token, completed, fingerprint, value FROM live"
    )
}

/// The claim of an ordinary call. Its only wait is for a row lock: a claim of the same key
/// inserted by an open transaction (`run_in_transaction`). That wait is bounded on the
/// server by `lock_timeout`, set for this statement only (`$4` milliseconds, within the
/// client's own timeout), before the insert runs: a server still waiting after the client
/// gave up would insert a claim nobody holds, and block the key for its lease.
///
/// An ordinary claim sends the statement with [`Conflict::Skip`] first: a replay, a held
/// key and a fresh key (almost every call) are settled by it, and it costs the server less
/// than the whole claim even when the insert does nothing (`BENCHMARKS.md`, throughput:
/// PostgreSQL plans and starts the `DO UPDATE` branch whether or not it runs). Only a key
/// whose row is not live (expired, or in progress under the caller's own nonce), or a race
/// with a concurrent claim, needs the whole claim after it.
fn ordinary_claim(t: &str, sequence: &str, conflict: Conflict) -> String {
    claim_query(
        t,
        sequence,
        "now()",
        ["$1", "$2", "$3"],
        Some("$5"),
        conflict,
    )
    .replacen(
        "WHERE NOT EXISTS (SELECT 1 FROM live)",
        "WHERE NOT EXISTS (SELECT 1 FROM live) \
         AND (SELECT set_config('lock_timeout', $4::text, true)) IS NOT NULL",
        1,
    )
}

/// A table or schema name: a plain identifier, so that it can never inject SQL.
fn validate(identifier: &str) -> Result<&str, Error> {
    if is_identifier(identifier) {
        Ok(identifier)
    } else {
        Err(Error::store(format!(
            "invalid table name {identifier:?}: use letters, digits and `_` (at most 50, not starting with a digit), optionally `schema.table`"
        )))
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
        Claim::Acquired {
            token: Token::new(token),
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

impl PostgresStore {
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
        let mut store = Self::from_pool(pool);
        store.hosts = Some(Arc::new(hosts));
        Ok(store)
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
            timeout: DEFAULT_TIMEOUT,
            flights: Arc::default(),
            hosts: None,
        }
    }

    /// Sets how long one operation may take, waiting for a pooled connection included,
    /// before it fails with [`Error::Store`] (default [`DEFAULT_TIMEOUT`]). A locked table
    /// or a stalled server then costs a call this long, never more; the body never runs
    /// after such a failure.
    ///
    /// The bound is the client's: a statement already sent may still run on the server
    /// later (each is fenced by its token, so a late one changes nothing it should not).
    /// To have the server give up too, set `statement_timeout` or `lock_timeout` for the
    /// role the pool connects as.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Runs one operation under the timeout.
    async fn within<T>(
        &self,
        operation: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, Error> {
        let done = sql::within("postgresql", self.timeout, operation).await;
        if let Err(err) = &done {
            self.after_failure(err);
        }
        done
    }

    /// With several hosts: after a failure that may mean the primary is gone (no answer, a
    /// lost connection, a standby's refusal to write), has the hosts probed again.
    fn after_failure(&self, err: &Error) {
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
            hosts.follow([&self.pool, &self.renewals], self.timeout);
        }
    }

    /// Uses the table `table` (`name` or `schema.name`) instead of [`DEFAULT_TABLE`].
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the name is not a plain identifier: names are checked, never
    /// quoted into SQL as they come.
    pub fn with_table(mut self, table: &str) -> Result<Self, Error> {
        self.sql = Arc::new(Statements::new(table)?);
        Ok(self)
    }

    /// The pool this store runs its statements on: begin the transactions of
    /// [`Operation::run_in_transaction`](crate::Operation::run_in_transaction) on it, or on
    /// any pool of the same database.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table this store uses.
    pub fn table(&self) -> &str {
        &self.sql.schema.table
    }

    /// Creates the table, its index and its token sequence if they are absent. Safe to run
    /// from several processes at once: a transaction-scoped advisory lock serialises them.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the database fails or refuses (for example without the right to
    /// create tables).
    pub async fn migrate(&self) -> Result<(), Error> {
        schema::migrate(&self.pool, &self.sql.schema).await
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
        let mut purged = 0;
        loop {
            let done = sqlx::query(&self.sql.purge)
                .bind(PURGE_BATCH)
                .execute(&self.pool)
                .await
                .map_err(Error::store)?;
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

    async fn fenced(
        &self,
        pool: &PgPool,
        statement: &str,
        key: &Key,
        token: Token,
        millis: Option<i64>,
        value: Option<&[u8]>,
    ) -> Result<bool, Error> {
        let mut query = sqlx::query(statement).bind(&key.as_bytes()[..]).bind(token);
        if let Some(value) = value {
            query = query.bind(value);
        }
        if let Some(millis) = millis {
            query = query.bind(millis);
        }
        let done = self.within(query.execute(pool)).await?;
        Ok(done.rows_affected() == 1)
    }
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.sql.schema.table)
            .field("timeout", &self.timeout)
            .field("pool_size", &self.pool.size())
            .finish()
    }
}

#[async_trait]
impl Store for PostgresStore {
    /// The nonce is kept in the in-progress row's `value` (empty until it completes); a row
    /// in progress under it is taken again with a new token and a whole lease.
    async fn claim_with_nonce(
        &self,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
        nonce: u64,
    ) -> Result<Claim, Error> {
        // Another attempt only when a concurrent claim inserted the row after this
        // statement's snapshot (or deleted the row it saw): the next statement sees it.
        // Under churn on one key that can repeat; each miss means another call made
        // progress, so the attempts go on as long as the timeout allows.
        let deadline = tokio::time::Instant::now() + self.timeout;
        let claimed = tokio::time::timeout(self.timeout, async {
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
            Err(_) => Error::store(format!(
                "postgresql did not answer within {:?}",
                self.timeout
            )),
        };
        self.after_failure(&failed);
        Err(failed)
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.fenced(
            &self.pool,
            &self.sql.complete,
            key,
            token,
            Some(millis(ttl)),
            Some(&value),
        )
        .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        self.fenced(&self.pool, &self.sql.release, key, token, None, None)
            .await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        self.fenced(
            &self.renewals,
            &self.sql.renew,
            key,
            token,
            Some(millis(lease)),
            None,
        )
        .await
    }

    /// Claim tokens already grow here (they come from a sequence): the claim's own token is
    /// its fencing token.
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
        let done = self
            .within(
                sqlx::query(&self.sql.record_step)
                    .bind(&call.as_bytes()[..])
                    .bind(token)
                    .bind(&value[..])
                    .bind(millis(ttl))
                    .bind(&step.as_bytes()[..])
                    .execute(&self.pool),
            )
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn steps(&self, call: &Key) -> Result<Vec<(Key, Bytes)>, Error> {
        self.within(sql::read_steps(&self.pool, &self.sql.steps, call))
            .await
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        let (first, last) = sql::steps_range(key);
        self.within(
            sqlx::query_scalar(&self.sql.remove)
                .bind(&key.as_bytes()[..])
                .bind(&first[..])
                .bind(&last[..])
                .fetch_one(&self.pool),
        )
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
        assert!(Statements::new("idem_records").is_ok());
        assert!(Statements::new("billing.idem_v2").is_ok());
        for bad in [
            "",
            "1table",
            "idem records",
            "t\"; DROP TABLE x; --",
            "a.b.c",
            "a-b",
            &"x".repeat(51),
        ] {
            assert!(Statements::new(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn the_default_table_name_is_valid() {
        assert!(validate(DEFAULT_TABLE).is_ok());
    }

    #[test]
    fn statements_quote_the_checked_name() {
        let sql = Statements::new("billing.idem").unwrap();
        for claim in &sql.claim {
            assert!(claim.contains("\"billing\".\"idem\""));
            assert!(claim.contains("nextval('\"billing\".\"idem_token\"')"));
        }
    }
}
