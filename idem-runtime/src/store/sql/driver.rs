//! What a dialect gives the SQL core: its pool and statements, and the operations whose
//! statements or locking differ between databases. Everything else, and the [`Store`]
//! implementation itself, is the core's ([`SqlStore`](super::SqlStore)).
//!
//! [`Store`]: crate::Store

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

use super::rows::{Reads, Table};
use crate::{Claim, ClaimRequest, Error, Key, Token};

/// A holder's write, found by its token: whether the row was there to write is the answer.
#[derive(Debug)]
pub enum Fenced<'a> {
    /// Records `value` for `ttl`.
    Complete { value: Bytes, ttl: Duration },
    /// Deletes the claim.
    Release,
    /// Extends the lease to `lease` from now.
    Renew { lease: Duration },
    /// Records one step of the call under its claim.
    Step {
        step: &'a Key,
        value: Bytes,
        ttl: Duration,
    },
}

/// The dialect's side of a SQL store. Each operation gets the store's `timeout`, and
/// bounds by it every wait it makes (for a connection, a lock, the server).
///
/// Public only in name (its module is private), as [`Sealed`](super::Sealed) is.
pub trait Driver: Clone + Send + Sync + 'static {
    /// The `sqlx` database.
    type Database: Reads;

    /// The database's name in errors (`"postgresql"`).
    const NAME: &'static str;

    /// The store's type name, for `Debug` (`"PostgresStore"`).
    const STORE: &'static str;

    /// The pool the store runs its statements on.
    fn pool(&self) -> &sqlx::Pool<Self::Database>;

    /// The table: its name, and the reads the core runs itself.
    fn table(&self) -> &Table;

    /// Uses `table` from now on, after checking its name.
    fn set_table(&mut self, table: &str) -> Result<(), Error>;

    /// The store's timeout changed: what was made for the old one is made again.
    fn retimed(&mut self) {}

    /// After an operation failed with `err`: what the dialect learns from it (PostgreSQL
    /// with several hosts looks for the primary again).
    fn failed(&self, _err: &Error, _timeout: Duration) {}

    /// Tells `watch` of the completed records removed from the table by any process, as
    /// [`Store::watch_removals`](crate::Store::watch_removals): `false` (the default) for
    /// a database that cannot (PostgreSQL can, through `LISTEN`/`NOTIFY`).
    fn watch_removals(&self, _watch: crate::store::RemovalWatch) -> bool {
        false
    }

    /// Claims as [`Store::claim`](crate::Store::claim): the row keeps the claimant's
    /// namespace and label, this process as its holder, the lease, and the call's TTL
    /// (how long a claim that lapses unsettled is kept).
    fn claim(
        &self,
        timeout: Duration,
        request: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, Error>> + Send;

    /// Runs a holder's `write` under `token`: whether its row was there.
    fn fenced(
        &self,
        timeout: Duration,
        key: &Key,
        token: Token,
        write: Fenced<'_>,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Deletes the record of `key` and its steps: whether a live one was there.
    fn remove(
        &self,
        timeout: Duration,
        key: &Key,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Deletes the expired rows, in batches: how many.
    fn purge(&self, timeout: Duration) -> impl Future<Output = Result<u64, Error>> + Send;

    /// Creates (or upgrades) the table and what it needs.
    fn migrate(&self, timeout: Duration) -> impl Future<Output = Result<(), Error>> + Send;
}
