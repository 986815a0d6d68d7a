//! The one trait a SQL database is named by: [`Dialect`], implemented for `sqlx`'s
//! [`Postgres`](sqlx::Postgres), [`MySql`](sqlx::MySql) and [`Sqlite`](sqlx::Sqlite), each
//! naming its [`Driver`] (the pool, the statements and the locking the
//! database needs).

use super::driver::Driver;
use super::rows::Reads;

/// A SQL database a [`SqlStore`](super::SqlStore) runs on: `sqlx`'s [`Postgres`](sqlx::Postgres),
/// [`MySql`](sqlx::MySql) or [`Sqlite`](sqlx::Sqlite), each with its feature.
///
/// Sealed: a dialect's statements and locking are the runtime's own. A store for another
/// database implements [`Store`](crate::Store) itself.
pub trait Dialect: Reads + Sealed {
    /// What the store keeps of this database: its pools and statements.
    type Driver: Driver<Database = Self>;
}

/// Seals [`Dialect`]: implemented for the three `sqlx` databases only.
pub trait Sealed {}
