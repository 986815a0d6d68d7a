//! An operator's view of a SQL store ([`Admin`], feature `admin`), written once for the
//! three dialects: each spells its statements ([`Spelling`]), the core runs them.
//!
//! A listing reads the table in key order after the cursor, a bounded batch at a time
//! (`LIMIT`, on the primary key's index), and keeps what the filter selects; a release is
//! one conditional `UPDATE` that ends the claim's lease now (the claim stays, lapsed, so
//! that the next claim is told it takes over a call whose outcome is unknown), and a reset
//! one conditional `DELETE`, each judged by the database's clock.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::rows::steps_range;
use super::{Dialect, Driver, SqlStore};
use crate::admin::{Admin, Cursor, Ending, Entry, Filter, Page, Release, State};
use crate::store::Holder;
use crate::{Error, Key, Token};

/// How many batches of a page's size one listing call reads at most, when the filter
/// leaves most rows out: the page then comes back short, with its cursor.
const BATCHES: usize = 8;

/// The columns every admin read returns, in this order: key, token, completed, the value's
/// size, namespace, label, holder, lease (ms), milliseconds left (negative once lapsed), and
/// the value (or its first byte, enough to tell a `Gone` mark).
pub(crate) type EntryRow = (
    Vec<u8>,
    i64,
    bool,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i64>,
    i64,
    Option<Vec<u8>>,
);

/// How a dialect spells the admin statements' parts.
pub(crate) struct Spelling<'a> {
    /// The table, quoted.
    pub(crate) table: &'a str,
    /// The key column, quoted as the dialect needs (`key`, or MySQL's backticks).
    pub(crate) key: &'a str,
    /// The `n`th parameter (from 1). MySQL's are positional: each statement below uses each
    /// of its parameters once, in order.
    pub(crate) param: fn(usize) -> String,
    /// Whether a row's expiry is in the future.
    pub(crate) live: &'a str,
    /// The database's clock, as `expires_at` counts it.
    pub(crate) now: &'a str,
    /// The milliseconds left until the row's expiry, as a signed 64-bit integer.
    pub(crate) left_ms: &'a str,
    /// The value's size in bytes, as a signed 64-bit integer.
    pub(crate) size: &'a str,
    /// The value's first byte.
    pub(crate) head: &'a str,
    /// Whether the row is not a step's record.
    pub(crate) not_step: &'a str,
    /// The row's namespace's first `len` characters equal `prefix` (NULL as empty).
    pub(crate) prefix: fn(len: &str, prefix: &str) -> String,
    /// Whether the claim's token is `param`, whether or not an operator released it (a
    /// release negates the row's token, so that its holder's writes find it no more).
    pub(crate) token_is: fn(param: &str) -> String,
    /// Whether the claim's holder is silent: its lease ran out, or less than half of it
    /// (`lease_ms`) is left.
    pub(crate) silent: &'a str,
    /// Writes, or moves forward, the trace of an operator's release (its key, the released
    /// token): a step's row (never listed), kept for a day.
    pub(crate) trace: &'a str,
    /// How a completed record forgotten is told to the tiers in front of the table, an
    /// expression of the deleted row's `key` (PostgreSQL's `pg_notify`); `None`: not told.
    pub(crate) told: Option<&'a str>,
}

/// The admin statements of one table.
pub(crate) struct AdminSql {
    /// A batch after a key (cursor, namespace prefix length and prefix, limit): the first
    /// byte of each value, or the whole value.
    page: [String; 2],
    /// One record, whole (key).
    entry: String,
    /// Ends the lease of a claim under a token now, and negates its token so that its
    /// holder writes nothing more (key, token, whether forced).
    release: String,
    /// Deletes a claim in progress under a token (key, token, whether forced).
    drop_claim: String,
    /// Deletes a completed record (key).
    forget: String,
    /// Deletes a call's steps (first and last key of its range, the call's key).
    forget_steps: String,
    /// Leaves the trace of an operator's release (the trace's key, the released token).
    trace: String,
}

impl AdminSql {
    pub(crate) fn new(s: &Spelling<'_>) -> Self {
        let (t, key, p) = (s.table, s.key, s.param);
        let columns = |value: &str| {
            format!(
                "SELECT {key}, token, completed, {}, namespace, label, holder, lease_ms, {}, {value} FROM {t}",
                s.size, s.left_ms
            )
        };
        let page = |value: &str| {
            format!(
                "{} WHERE {key} > {} AND {} AND (NOT completed OR {}) AND {} ORDER BY {key} LIMIT {}",
                columns(value),
                p(1),
                s.not_step,
                s.live,
                (s.prefix)(&p(2), &p(3)),
                p(4)
            )
        };
        Self {
            page: [page(s.head), page("value")],
            entry: format!(
                "{} WHERE {key} = {} AND {} AND (NOT completed OR {})",
                columns("value"),
                p(1),
                s.not_step,
                s.live
            ),
            release: format!(
                "UPDATE {t} SET expires_at = CASE WHEN {} THEN {} ELSE expires_at END, token = -abs(token) \
                 WHERE {key} = {} AND {} AND NOT completed AND ({} OR {})",
                s.live,
                s.now,
                p(1),
                (s.token_is)(&p(2)),
                p(3),
                s.silent
            ),
            drop_claim: format!(
                "DELETE FROM {t} WHERE {key} = {} AND {} AND NOT completed AND ({} OR {})",
                p(1),
                (s.token_is)(&p(2)),
                p(3),
                s.silent
            ),
            trace: s.trace.to_string(),
            // Counted as the rows it returns, one per row deleted, where it is told.
            forget: match s.told {
                Some(told) => format!(
                    "WITH gone AS (DELETE FROM {t} WHERE {key} = {} AND completed RETURNING {key}) \
                     SELECT {told} FROM gone",
                    p(1)
                ),
                None => format!("DELETE FROM {t} WHERE {key} = {} AND completed", p(1)),
            },
            forget_steps: format!(
                "DELETE FROM {t} WHERE {key} BETWEEN {} AND {} AND {key} <> {}",
                p(1),
                p(2),
                p(3)
            ),
        }
    }
}

/// How many rows a statement changed, whatever the database.
pub trait Affected {
    fn affected(&self) -> u64;
}

#[cfg(feature = "postgres")]
impl Affected for sqlx::postgres::PgQueryResult {
    fn affected(&self) -> u64 {
        self.rows_affected()
    }
}

#[cfg(feature = "mysql")]
impl Affected for sqlx::mysql::MySqlQueryResult {
    fn affected(&self) -> u64 {
        self.rows_affected()
    }
}

#[cfg(feature = "sqlite")]
impl Affected for sqlx::sqlite::SqliteQueryResult {
    fn affected(&self) -> u64 {
        self.rows_affected()
    }
}

/// A database whose admin statements the core runs in one way (the bounds `sqlx` asks of
/// them, stated once).
pub trait AdminQueries: sqlx::Database {
    fn rows<'a>(
        pool: &'a sqlx::Pool<Self>,
        statement: &'a str,
        binds: Binds<'a>,
    ) -> impl std::future::Future<Output = Result<Vec<EntryRow>, sqlx::Error>> + Send + 'a;

    fn delete<'a>(
        pool: &'a sqlx::Pool<Self>,
        statement: &'a str,
        binds: Binds<'a>,
    ) -> impl std::future::Future<Output = Result<u64, sqlx::Error>> + Send + 'a;
}

/// A statement's parameters, in order.
#[derive(Clone, Copy)]
pub enum Binds<'a> {
    Key(&'a [u8]),
    Page(&'a [u8], i64, &'a str, i64),
    Release(&'a [u8], i64, bool),
    Steps(&'a [u8], &'a [u8], &'a [u8]),
    Trace(&'a [u8], i64),
}

impl<DB> AdminQueries for DB
where
    DB: sqlx::Database,
    DB::QueryResult: Affected,
    for<'q> &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> bool: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'r> EntryRow: sqlx::FromRow<'r, DB::Row>,
{
    async fn rows<'a>(
        pool: &'a sqlx::Pool<Self>,
        statement: &'a str,
        binds: Binds<'a>,
    ) -> Result<Vec<EntryRow>, sqlx::Error> {
        let query = sqlx::query_as(statement);
        let query = match binds {
            Binds::Key(key) => query.bind(key),
            Binds::Page(after, len, prefix, limit) => {
                query.bind(after).bind(len).bind(prefix).bind(limit)
            }
            Binds::Release(key, token, force) => query.bind(key).bind(token).bind(force),
            Binds::Steps(first, last, key) => query.bind(first).bind(last).bind(key),
            Binds::Trace(key, token) => query.bind(key).bind(token),
        };
        query.fetch_all(pool).await
    }

    async fn delete<'a>(
        pool: &'a sqlx::Pool<Self>,
        statement: &'a str,
        binds: Binds<'a>,
    ) -> Result<u64, sqlx::Error> {
        let query = sqlx::query(statement);
        let query = match binds {
            Binds::Key(key) => query.bind(key),
            Binds::Page(after, len, prefix, limit) => {
                query.bind(after).bind(len).bind(prefix).bind(limit)
            }
            Binds::Release(key, token, force) => query.bind(key).bind(token).bind(force),
            Binds::Steps(first, last, key) => query.bind(first).bind(last).bind(key),
            Binds::Trace(key, token) => query.bind(key).bind(token),
        };
        Ok(query.execute(pool).await?.affected())
    }
}

/// A row as the entry an operator sees; `value` whether its column is the whole value.
fn entry(row: EntryRow, value: bool) -> Result<Entry, Error> {
    let (key, token, completed, size, namespace, label, holder, lease_ms, left_ms, bytes) = row;
    let key: [u8; 32] = key
        .try_into()
        .map_err(|_| Error::store("a stored key is not 32 bytes"))?;
    let key = Key::from_bytes(key);
    let left = Duration::from_millis(u64::try_from(left_ms).unwrap_or(0));
    let size = size.and_then(|size| u64::try_from(size).ok());
    let entry = if completed {
        let gone = size == Some(crate::codec::GONE.len() as u64)
            && bytes
                .as_deref()
                .is_some_and(|b| b.starts_with(crate::codec::GONE));
        let state = if gone { State::Gone } else { State::Completed };
        Entry::new(key, state).with_result(
            Some(left),
            size,
            bytes.filter(|_| value).map(Bytes::from),
        )
    } else {
        let state = if left.is_zero() {
            State::Lapsed
        } else {
            State::Held
        };
        let lease = lease_ms
            .and_then(|ms| u64::try_from(ms).ok())
            .filter(|ms| *ms > 0)
            .map(Duration::from_millis);
        let token = Token::new(token.unsigned_abs());
        Entry::new(key, state).with_claim(
            token,
            lease,
            left,
            holder.as_deref().and_then(Holder::decode),
        )
    };
    Ok(entry.with_names(namespace, label))
}

impl<D: Dialect + AdminQueries> SqlStore<D> {
    fn admin_sql(&self) -> &AdminSql {
        &self.driver.table().admin
    }

    async fn rows(&self, statement: &str, binds: Binds<'_>) -> Result<Vec<EntryRow>, Error> {
        self.read(D::rows(self.pool(), statement, binds)).await
    }

    async fn delete(&self, statement: &str, binds: Binds<'_>) -> Result<u64, Error> {
        self.read(D::delete(self.pool(), statement, binds)).await
    }

    /// The record of `key` as it is now, without its steps.
    async fn entry_of(&self, key: &Key) -> Result<Option<Entry>, Error> {
        let rows = self
            .rows(&self.admin_sql().entry, Binds::Key(&key.as_bytes()[..]))
            .await?;
        rows.into_iter()
            .next()
            .map(|row| entry(row, true))
            .transpose()
    }

    /// Deletes the call's steps.
    async fn forget_steps(&self, key: &Key) -> Result<(), Error> {
        let (first, last) = steps_range(key);
        self.delete(
            &self.admin_sql().forget_steps,
            Binds::Steps(&first, &last, &key.as_bytes()[..]),
        )
        .await
        .map(drop)
    }

    /// Ends the claim `entry` showed as `how` allows, fencing a holder of this process
    /// first: whether it ended. The database judges the holder's silence by its own clock,
    /// in the same statement, unless the release is forced or the holder's process has
    /// exited (it can renew no more). A release (`forget` false) ends the lease now and
    /// keeps the row, lapsed, so that the next claim is told it takes an unsettled call
    /// over, its token negated so that its holder's writes (which look for the token, and
    /// on SQLite for nothing else) find it no more; a reset (`forget`) deletes it.
    async fn ended(
        &self,
        entry: &Entry,
        token: Token,
        how: Release,
        forget: bool,
    ) -> Result<bool, Error> {
        let key = entry.key();
        let unconditional = how == Release::Force || entry.holder().is_some_and(Holder::has_exited);
        let token = i64::try_from(token.get()).unwrap_or(i64::MAX);
        self.flights.fence(key, true);
        // The trace first: a holder in another process that finds its completion refused
        // finds the trace too, and does not claim the key again to record its result. A
        // release refused below leaves a trace of a live claim: its holder, if its lease
        // lapses later, records nothing either (it fails closed).
        if let Err(err) = self
            .delete(
                &self.admin_sql().trace,
                Binds::Trace(&super::rows::trace_key(key)[..], token),
            )
            .await
        {
            self.flights.fence(key, false);
            return Err(err);
        }
        let statement = if forget {
            &self.admin_sql().drop_claim
        } else {
            &self.admin_sql().release
        };
        let deleted = self
            .delete(
                statement,
                Binds::Release(&key.as_bytes()[..], token, unconditional),
            )
            .await;
        if matches!(deleted, Ok(1)) {
            self.flights.released(key);
            Ok(true)
        } else {
            self.flights.fence(key, false);
            deleted.map(|_| false)
        }
    }
}

#[async_trait]
impl<D: Dialect + AdminQueries> Admin for SqlStore<D> {
    async fn list(&self, filter: &Filter, after: Option<&Cursor>) -> Result<Page, Error> {
        let size = filter.page_size();
        let prefix = filter.prefix().unwrap_or("");
        let prefix_len = i64::try_from(prefix.chars().count()).unwrap_or(i64::MAX);
        let batch = i64::try_from(size + 1).unwrap_or(i64::MAX);
        let statement = &self.admin_sql().page[usize::from(filter.values())];
        let mut from = Cursor::key_order(after)?;
        let mut entries = Vec::with_capacity(size.min(128));
        for _ in 0..BATCHES {
            let start = from.as_ref().map_or(&[][..], |key| &key.as_bytes()[..]);
            let rows = self
                .rows(statement, Binds::Page(start, prefix_len, prefix, batch))
                .await?;
            let ended = rows.len() < size + 1;
            for row in rows {
                let entry = entry(row, filter.values())?;
                from = Some(*entry.key());
                if !filter.admits(&entry) {
                    continue;
                }
                if entries.len() == size {
                    let next = entries
                        .last()
                        .map(|last: &Entry| Cursor::after(*last.key()));
                    return Ok(Page::new(entries, next));
                }
                entries.push(entry);
            }
            if ended {
                return Ok(Page::new(entries, None));
            }
        }
        Ok(Page::new(entries, from.map(Cursor::after)))
    }

    async fn inspect(&self, key: &Key) -> Result<Option<Entry>, Error> {
        let Some(entry) = self.entry_of(key).await? else {
            return Ok(None);
        };
        let steps = self
            .read(D::steps(self.pool(), self.driver.table(), key))
            .await?
            .into_iter()
            .map(|(step, value)| (step, value.len() as u64))
            .collect();
        Ok(Some(entry.with_steps(steps)))
    }

    async fn look(&self, key: &Key) -> Result<Option<Entry>, Error> {
        self.entry_of(key).await
    }

    async fn end_claim(
        &self,
        entry: &Entry,
        token: Token,
        how: Release,
        forget: bool,
    ) -> Result<Ending, Error> {
        if !self.ended(entry, token, how, forget).await? {
            return Ok(Ending::Changed);
        }
        if forget {
            self.forget_steps(entry.key()).await?;
        }
        Ok(Ending::Ended)
    }

    async fn forget_call(&self, entry: &Entry) -> Result<Ending, Error> {
        let key = entry.key();
        let forgotten = self
            .delete(&self.admin_sql().forget, Binds::Key(&key.as_bytes()[..]))
            .await?;
        if forgotten != 1 {
            return Ok(Ending::Changed);
        }
        self.forget_steps(key).await?;
        Ok(Ending::Ended)
    }

    async fn purge(&self) -> Result<u64, Error> {
        self.purged().await
    }
}
