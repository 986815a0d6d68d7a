//! `transaction = tx`: the store and the connection of a call in the caller's transaction.

use super::run::Answered;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
use super::{run::derived, FromIdemError, Recordable};
use crate::engine::IdemResult;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
use crate::ErrorPolicy;
use crate::{Error, Fingerprint, Key, Operation};

/// `Operation::run_in_transaction`, as [`run`](super::run::run): `transaction = tx`.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub async fn run_in_transaction<P, S, R, F>(
    operation: &Operation<P>,
    store: &S,
    connection: &mut S::Connection,
    key: Result<Option<Key>, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
    body: F,
) -> Answered<R>
where
    S: crate::store::Transactional,
    R: IdemResult,
    R::Ok: Recordable,
    R::Err: FromIdemError,
    P: ErrorPolicy<R::Err>,
    F: AsyncFnOnce(&mut S::Connection) -> R,
{
    match derived(key, fingerprint) {
        Ok(Some((key, fingerprint))) => {
            let body =
                async move |connection: &mut S::Connection| body(connection).await.into_result();
            operation
                .run_in_transaction(store, connection, &key, fingerprint.as_ref(), body)
                .await
        }
        Ok(None) => {
            crate::engine::unkeyed();
            crate::engine::attempt::scope_unkeyed(body(connection))
                .await
                .into_result()
                .map(crate::Outcome::Executed)
        }
        Err(err) => Err(err.into()),
    }
}

/// `transaction = tx` in a crate built without a feature of a transactional store: the
/// store check fails first, with its own message ([`InTransaction`]); this only lets the
/// rest of the expansion type-check, so that the check's error is the only one.
#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
pub async fn run_in_transaction<P, S: Uninhabited, R: IdemResult, F>(
    _: &Operation<P>,
    store: &S,
    _: &mut dyn std::any::Any,
    _: Result<Option<Key>, Error>,
    _: Option<Result<Fingerprint, Error>>,
    _: F,
) -> Answered<R> {
    match store.never() {}
}

/// No store holds claims in the caller's transaction without the `postgres`, `sqlite` or
/// `mysql` feature.
#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
pub enum NoTransactions {}

/// A type with no values ([`NoTransactions`]).
#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
pub trait Uninhabited {
    #[doc(hidden)]
    fn never(&self) -> std::convert::Infallible;
}

#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
impl Uninhabited for NoTransactions {
    fn never(&self) -> std::convert::Infallible {
        match *self {}
    }
}

/// The stores `transaction =` works with: none without the `postgres`, `sqlite` or `mysql`
/// feature.
#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
#[diagnostic::on_unimplemented(
    message = "`transaction =` needs the `postgres`, `sqlite` or `mysql` feature of `idem-runtime`, and `store =` a `PostgresStore`, `SqliteStore` or `MySqlStore`",
    label = "no store of this build can claim inside the caller's transaction",
    note = "enable one: `idem-runtime = {{ version = \"…\", features = [\"postgres\"] }}` (or `\"sqlite\"`, `\"mysql\"`); the claim, the body's writes and the record then commit together in that database"
)]
pub trait InTransaction {
    #[doc(hidden)]
    fn __idem_transactional(&self) -> &NoTransactions;
}

/// The store of `transaction =`, or the error that says it must be one.
#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
pub fn transactional<S: InTransaction>(store: &S) -> &NoTransactions {
    store.__idem_transactional()
}

/// The stores `transaction =` works with: PostgreSQL's, SQLite's and MySQL's.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
#[diagnostic::on_unimplemented(
    message = "`transaction =` needs a `PostgresStore`, `SqliteStore` or `MySqlStore` (or a `TieredStore` over one), not `{Self}`",
    label = "not a store that claims inside a transaction",
    note = "the claim, the body's writes and the record commit together only in a SQL database: use `store = <a PostgresStore>` with `&mut PgConnection`, `<a SqliteStore>` with `&mut SqliteConnection`, or `<a MySqlStore>` with `&mut MySqlConnection`; or remove `transaction =` to use this store without a transaction"
)]
pub trait InTransaction {
    /// The store itself, as the transactional store it is.
    type Transactional: crate::store::Transactional;
    #[doc(hidden)]
    fn __idem_transactional(&self) -> &Self::Transactional;
}

#[cfg(feature = "postgres")]
impl InTransaction for crate::PostgresStore {
    type Transactional = Self;
    fn __idem_transactional(&self) -> &Self {
        self
    }
}

#[cfg(feature = "sqlite")]
impl InTransaction for crate::SqliteStore {
    type Transactional = Self;
    fn __idem_transactional(&self) -> &Self {
        self
    }
}

#[cfg(feature = "mysql")]
impl InTransaction for crate::MySqlStore {
    type Transactional = Self;
    fn __idem_transactional(&self) -> &Self {
        self
    }
}

// A tier over a store of each: the claim is its durable store's, in the caller's
// transaction; replays come from its fast tier once a copy is there.
#[cfg(feature = "postgres")]
impl<F: crate::Store + Clone> InTransaction for crate::TieredStore<F, crate::PostgresStore> {
    type Transactional = Self;
    fn __idem_transactional(&self) -> &Self {
        self
    }
}

#[cfg(feature = "sqlite")]
impl<F: crate::Store + Clone> InTransaction for crate::TieredStore<F, crate::SqliteStore> {
    type Transactional = Self;
    fn __idem_transactional(&self) -> &Self {
        self
    }
}

#[cfg(feature = "mysql")]
impl<F: crate::Store + Clone> InTransaction for crate::TieredStore<F, crate::MySqlStore> {
    type Transactional = Self;
    fn __idem_transactional(&self) -> &Self {
        self
    }
}

/// The store of `transaction =`, or the error that says it must be one.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub fn transactional<S: InTransaction>(store: &S) -> &S::Transactional {
    store.__idem_transactional()
}

/// The connection of `transaction =`, or the error that names the pair it must be.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
#[diagnostic::on_unimplemented(
    message = "`transaction =` is a `&mut {Self}`, and a `{S}` cannot claim in it",
    label = "not the connection of the store's database",
    note = "each store claims in a connection to its own database: a `PostgresStore` (`SqlStore<Postgres>`) in a `&mut sqlx::PgConnection`, a `SqliteStore` (`SqlStore<Sqlite>`) in a `&mut sqlx::SqliteConnection`, a `MySqlStore` (`SqlStore<MySql>`) in a `&mut sqlx::MySqlConnection`, a `TieredStore` in its durable store's (callers pass `&mut transaction`)"
)]
pub trait ConnectionOf<S: crate::store::Transactional> {
    #[doc(hidden)]
    fn __idem_connection(&mut self) -> &mut S::Connection;
}

#[cfg(feature = "postgres")]
impl ConnectionOf<crate::PostgresStore> for sqlx::PgConnection {
    fn __idem_connection(&mut self) -> &mut Self {
        self
    }
}

#[cfg(feature = "sqlite")]
impl ConnectionOf<crate::SqliteStore> for sqlx::SqliteConnection {
    fn __idem_connection(&mut self) -> &mut Self {
        self
    }
}

#[cfg(feature = "mysql")]
impl ConnectionOf<crate::MySqlStore> for sqlx::MySqlConnection {
    fn __idem_connection(&mut self) -> &mut Self {
        self
    }
}

#[cfg(feature = "postgres")]
impl<F: crate::Store + Clone> ConnectionOf<crate::TieredStore<F, crate::PostgresStore>>
    for sqlx::PgConnection
{
    fn __idem_connection(&mut self) -> &mut Self {
        self
    }
}

#[cfg(feature = "sqlite")]
impl<F: crate::Store + Clone> ConnectionOf<crate::TieredStore<F, crate::SqliteStore>>
    for sqlx::SqliteConnection
{
    fn __idem_connection(&mut self) -> &mut Self {
        self
    }
}

#[cfg(feature = "mysql")]
impl<F: crate::Store + Clone> ConnectionOf<crate::TieredStore<F, crate::MySqlStore>>
    for sqlx::MySqlConnection
{
    fn __idem_connection(&mut self) -> &mut Self {
        self
    }
}

/// The connection of `transaction =` for `store`.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub fn connection_of<'c, S, C>(_: &S, connection: &'c mut C) -> &'c mut S::Connection
where
    S: crate::store::Transactional,
    C: ConnectionOf<S> + ?Sized,
{
    connection.__idem_connection()
}

/// The connection of `transaction =` in a build without transactional stores: the store
/// check has failed already.
#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
pub fn connection_of<'c, S, C: std::any::Any>(
    _: &S,
    connection: &'c mut C,
) -> &'c mut dyn std::any::Any {
    connection
}
