//! What `#[idempotent]` expands to (reached through `__private`). Not a public API: no
//! stability promise.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::codec::Json;
use crate::engine::Found;
pub use crate::engine::{Started, Typing};
use crate::{Error, Fingerprint, Key, Store};
pub use crate::{ErrorPolicy, InFlight, Operation};

/// The store of a function without a `store` argument.
pub fn default_store() -> &'static Arc<dyn Store> {
    crate::default_store()
}

/// Takes a `store = <expr>` value by reference through method auto-ref: `MemoryStore`,
/// `&MemoryStore` and `Arc<dyn Store>` values all become `&S`.
pub trait StoreArg {
    #[doc(hidden)]
    fn __idem_store(&self) -> &Self {
        self
    }
}

impl<T: ?Sized> StoreArg for T {}

/// An owned handle to the store, so that the body may still move or mutably borrow what the
/// store expression borrowed (`self`). Stores are cheap handles: this is an `Arc` clone.
pub fn owned_store<S: StoreValue>(store: &S) -> S {
    store.clone()
}

/// A `store = …` value: a `Store + Clone`, as one bound with one message.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotency store",
    label = "`store =` needs a `Store + Clone` value, or a reference to one",
    note = "use `MemoryStore` or a store of a backend feature (`cargo doc` lists every `impl Store`), an `Arc<dyn Store>`, or implement `idem_runtime::Store` and `Clone` (a cheap handle)"
)]
pub trait StoreValue: Store + Clone {}

#[diagnostic::do_not_recommend]
impl<S: Store + Clone> StoreValue for S {}

/// The shape every `#[idempotent]` function returns: `Result<T, E>`, or an alias of it.
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` functions must return `Result<T, E>`, not `{Self}`",
    label = "this must be a `Result`",
    note = "the `Ok` value is recorded and replayed; an `Err` releases the key, e.g. `-> Result<Receipt, PayError>`"
)]
pub trait IdemResult: Sized {
    /// The recorded value type.
    type Ok;
    /// The error type.
    type Err;
    /// Into a `Result`.
    fn into_result(self) -> Result<Self::Ok, Self::Err>;
    /// From a `Result`.
    fn from_result(result: Result<Self::Ok, Self::Err>) -> Self;
}

impl<T, E> IdemResult for Result<T, E> {
    type Ok = T;
    type Err = E;

    fn into_result(self) -> Self {
        self
    }

    fn from_result(result: Self) -> Self {
        result
    }
}

/// What an `#[idempotent]` function's `Ok` type must be: one bound, with one message, for
/// the two serde traits the record needs.
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` records the `Ok` value, so `{Self}` must be `Serialize` and `Deserialize`",
    label = "`{Self}` is not `Serialize + Deserialize`",
    note = "derive both: `#[derive(serde::Serialize, serde::Deserialize)]`; the value is recorded with serde_json and replayed to every retry"
)]
pub trait Recordable: Serialize + DeserializeOwned {}

#[diagnostic::do_not_recommend]
impl<T: Serialize + DeserializeOwned> Recordable for T {}

/// What an `#[idempotent]` function's error type must be: convertible from the runtime's
/// errors, which the call returns through it (a store that is down, a reused key).
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` returns its own errors through `{Self}`, so it needs `impl From<idem_runtime::Error> for {Self}`",
    label = "`{Self}` has no `From<idem_runtime::Error>`",
    note = "add a variant for them, e.g. `Idem(idem_runtime::Error)`, and `impl From<idem_runtime::Error>` that wraps it (or use `idem_runtime::Error` itself as the error type)"
)]
pub trait FromIdemError: From<Error> {}

#[diagnostic::do_not_recommend]
impl<E: From<Error>> FromIdemError for E {}

/// Checks a `cache_err` predicate where it is written: its error type must be serializable.
pub fn cache_err<E>(is_final: fn(&E) -> bool) -> fn(&E) -> bool
where
    E: Serialize + DeserializeOwned,
{
    is_final
}

/// The fingerprint of a `fingerprint = <expr>` value.
pub fn fingerprint<V: Serialize + ?Sized>(payload: &V) -> Result<Fingerprint, Error> {
    Fingerprint::of(payload)
}

/// A `key = <expr>` value, wrapped so that the two `__idem_key` methods below can tell an
/// `Option` apart at compile time: method resolution tries [`OptionalKey`] (on `KeyArg`)
/// before [`RequiredKey`] (on `&KeyArg`), and only an `Option` (or a reference to one) has
/// the former.
pub struct KeyArg<'a, T: ?Sized>(pub &'a T);

/// An optional key: `None` runs the body with no claim.
pub trait OptionalKey<'a> {
    /// The value to key on: the `Option` itself, or `None` when it is `None`.
    type Value: ?Sized;
    #[doc(hidden)]
    fn __idem_key(&self) -> Option<&'a Self::Value>;
}

impl<'a, T> OptionalKey<'a> for KeyArg<'a, Option<T>> {
    type Value = Option<T>;
    fn __idem_key(&self) -> Option<&'a Option<T>> {
        // Keyed on the `Option` itself, as before optional keys: recorded keys stay valid.
        self.0.as_ref().map(|_| self.0)
    }
}

impl<'a, T> OptionalKey<'a> for KeyArg<'a, &'a Option<T>> {
    type Value = Option<T>;
    fn __idem_key(&self) -> Option<&'a Option<T>> {
        KeyArg(*self.0).__idem_key()
    }
}

/// Every other key: always present.
pub trait RequiredKey<'a> {
    /// The value to key on.
    type Value: ?Sized;
    #[doc(hidden)]
    fn __idem_key(&self) -> Option<&'a Self::Value>;
}

impl<'a, T: ?Sized> RequiredKey<'a> for &KeyArg<'a, T> {
    type Value = T;
    fn __idem_key(&self) -> Option<&'a T> {
        Some(self.0)
    }
}

/// The key of a `key = <expr>` value, `None` for an absent optional key.
#[inline]
pub fn key<P, V: Serialize + ?Sized>(
    operation: &Operation<P>,
    value: Option<&V>,
) -> Result<Option<Key>, Error> {
    value.map(|value| operation.key(value)).transpose()
}

/// The key and fingerprint an expansion derived: the first error deriving them is the
/// function's error (the body never runs); an absent optional key runs the body with no
/// claim.
#[inline]
fn derived(
    key: Result<Option<Key>, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
) -> crate::engine::Derived {
    match key? {
        Some(key) => Ok(Some((key, fingerprint.transpose()?))),
        None => Ok(None),
    }
}

/// The bare return value of an `#[idempotent]` function.
#[inline]
pub fn bare<R: IdemResult>(outcome: Result<crate::Outcome<R::Ok>, R::Err>) -> R {
    R::from_result(outcome.map(crate::Outcome::into_inner))
}

/// What the entry points answer: the outcome (`name_outcome`), which `name` makes bare.
pub type Answered<R> = Result<crate::Outcome<<R as IdemResult>::Ok>, <R as IdemResult>::Err>;

fn answered<R: IdemResult>(outcome: Answered<R>) -> Answered<R> {
    outcome
}

/// Asks, where the function's return type `R` is known, whether its success type can be
/// kept and replayed as itself (it is `Clone`): `(&TypeProbe::<R>::new()).__idem_typing()`
/// is a [`Typing`] then, through [`TypedByClone`], and a [`NoTyping`] otherwise, through
/// [`TypedByCodec`] (the method that needs one autoref fewer wins where its bounds hold).
pub struct TypeProbe<R>(PhantomData<fn() -> R>);

impl<R> TypeProbe<R> {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

/// A success type that is replayed by decoding its record.
pub struct NoTyping;

pub trait TypedByClone {
    type Typing;
    fn __idem_typing(&self) -> Self::Typing;
}

impl<R> TypedByClone for TypeProbe<R>
where
    R: IdemResult,
    R::Ok: Clone + Send + Sync + 'static,
{
    type Typing = Typing<R::Ok>;
    fn __idem_typing(&self) -> Typing<R::Ok> {
        Typing::cloned()
    }
}

pub trait TypedByCodec {
    fn __idem_typing(&self) -> NoTyping;
}

impl<R> TypedByCodec for &TypeProbe<R> {
    fn __idem_typing(&self) -> NoTyping {
        NoTyping
    }
}

/// What [`run`] takes of a probe's answer.
pub trait IntoTyping<T> {
    fn into_typing(self) -> Option<Typing<T>>;
}

impl<T> IntoTyping<T> for NoTyping {
    fn into_typing(self) -> Option<Typing<T>> {
        None
    }
}

impl<T> IntoTyping<T> for Typing<T> {
    fn into_typing(self) -> Option<Typing<T>> {
        Some(self)
    }
}

/// `Operation::run`, after [`look`] (made before the body borrowed its arguments): the
/// answer at once when the look found the record, or the call to await. Generic over the
/// function's return type, so that a return type that is not a `Result` fails one bound,
/// with its own message. `typing` says whether a replay from a
/// store in this process may hand back the value itself.
#[inline]
pub fn run<'a, P, S, R, F, Y>(
    operation: &'a Operation<P>,
    store: Looked<S>,
    body: F,
    typing: Y,
) -> Started<Answered<R>, Pin<Box<impl Future<Output = Answered<R>> + use<'a, P, S, R, F, Y>>>>
where
    R: IdemResult,
    R::Ok: Recordable,
    R::Err: FromIdemError,
    P: ErrorPolicy<R::Err>,
    S: StoreValue,
    F: Future<Output = R>,
    Y: IntoTyping<R::Ok>,
{
    let typing = typing.into_typing();
    let (store, derived) = match store.0 {
        Look::Found(Ok(found)) => {
            return Started::Now(operation.replayed::<Json, R>(&found, typing));
        }
        Look::Found(Err(err)) => return Started::Now(Err(err.into())),
        Look::Store(store, derived) => (store, derived),
    };
    // The future owns the store's handle, which the call borrows. Boxed: the call's state
    // (about a kilobyte) would otherwise sit inline in every `#[idempotent]` function's
    // future, and a replay answered at once would still move it wherever its future goes.
    Started::Later(Box::pin(async move {
        let call = operation.call::<Json, S, R, F, Answered<R>>(
            &store,
            derived,
            body,
            answered::<R>,
            typing,
            true,
        );
        call.await
    }))
}

/// A call's store after its look for the call's record ([`look`]).
pub struct Looked<S>(Look<S>);

enum Look<S> {
    /// The record, at hand: the call is answered by it.
    Found(Result<Found, Error>),
    /// No record at hand (or no key to look for): an owned handle to the store to run the
    /// call in, and the call's key and fingerprint.
    Store(S, crate::engine::Derived),
}

/// The store of a `store = <expr>` value, looked at first: the record of the call's key, if
/// the store has it at hand (a replay from memory then takes nothing else of the store),
/// else an owned handle to it, so that the body may still move or mutably borrow what the
/// store expression borrowed (`self`). Stores are cheap handles: this is an `Arc` clone.
#[inline]
pub fn look<P, S: StoreValue>(
    operation: &Operation<P>,
    store: &S,
    key: Result<Option<Key>, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
) -> Looked<S> {
    // A call without a key, or with a derivation error, is answered by the call itself. The
    // look borrows the key and the fingerprint where they are: a replay moves neither.
    if let Ok(Some(key)) = &key {
        if let Ok(fingerprint) = fingerprint.as_ref().map(Result::as_ref).transpose() {
            if let Some(found) = operation.settings.replay_at_once(store, key, fingerprint) {
                return Looked(Look::Found(found));
            }
        }
    }
    Looked(Look::Store(store.clone(), derived(key, fingerprint)))
}

/// [`look`], in the default store.
pub fn look_default<P>(
    operation: &Operation<P>,
    key: Result<Option<Key>, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
) -> Looked<Arc<dyn Store>> {
    look(operation, default_store(), key, fingerprint)
}

/// `Operation::run_to_completion`, as [`run`].
#[inline]
pub fn run_to_completion<'a, P, S, R, F>(
    operation: &'a Operation<P>,
    store: Looked<S>,
    body: F,
) -> Started<Answered<R>, Pin<Box<impl Future<Output = Answered<R>> + use<'a, P, S, R, F>>>>
where
    R: IdemResult,
    R::Ok: Recordable + Send + 'static,
    R::Err: FromIdemError + Send + 'static,
    P: ErrorPolicy<R::Err> + Clone + Send + Sync + 'static,
    S: StoreValue,
    F: Future<Output = R> + Send + 'static,
{
    let (store, derived) = match store.0 {
        Look::Found(found) => {
            // Refused outside a tokio runtime, as a call that runs is: replay or not.
            let replayed = crate::engine::spawner()
                .and(found)
                .map_err(Into::into)
                .and_then(|found| operation.replayed::<Json, R>(&found, None));
            return Started::Now(replayed);
        }
        Look::Store(store, derived) => (store, derived),
    };
    // Boxed, as in [`run`].
    Started::Later(Box::pin(async move {
        operation
            .run_to_completion_as::<Json, S, R, F>(&store, derived, body, true)
            .await
    }))
}

/// `Operation::run_in_transaction`, as [`run`]: `transaction = tx`.
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
    message = "`transaction =` needs a `PostgresStore`, `SqliteStore` or `MySqlStore`, not `{Self}`",
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
    note = "each store claims in a connection to its own database: a `PostgresStore` in a `&mut sqlx::PgConnection`, a `SqliteStore` in a `&mut sqlx::SqliteConnection`, a `MySqlStore` in a `&mut sqlx::MySqlConnection` (callers pass `&mut transaction`)"
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

/// One part of a key or fingerprint value (the value itself, or an element of a tuple),
/// wrapped so that the two `__idem_order` methods below can tell a `HashSet` apart at
/// compile time: method resolution tries `Unordered` (on `KeyPart`) before `Ordered` (on
/// `&KeyPart`), and only a `HashSet` has the former.
pub struct KeyPart<'a, T: ?Sized>(pub &'a T);

/// What a `HashSet` part yields: refused by [`ordered`]. Generic over the set's elements
/// (see [`NeverInKey`]).
pub struct HashSetInKey<T>(std::marker::PhantomData<T>);

/// Chosen for `HashSet` parts.
pub trait Unordered<T> {
    #[doc(hidden)]
    fn __idem_order(&self) -> HashSetInKey<T> {
        HashSetInKey(std::marker::PhantomData)
    }
}

impl<T, S> Unordered<T> for KeyPart<'_, std::collections::HashSet<T, S>> {}
impl<T, S> Unordered<T> for KeyPart<'_, &std::collections::HashSet<T, S>> {}
impl<T, S> Unordered<T> for KeyPart<'_, &mut std::collections::HashSet<T, S>> {}

/// Chosen for every other part.
pub trait Ordered {
    #[doc(hidden)]
    fn __idem_order(&self) {}
}

impl<T: ?Sized> Ordered for &KeyPart<'_, T> {}

/// A key part whose encoding is the same in every process.
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` keys and fingerprints cannot hold a `HashSet`: its order differs from one process (and one call) to the next, so the call would never replay",
    label = "this is a `HashSet`",
    note = "use a `BTreeSet`, or a sorted `Vec`"
)]
pub trait DeterministicOrder {}

#[diagnostic::do_not_recommend]
impl DeterministicOrder for () {}

/// Never met: a `HashSet` part fails on it. Only through this bound, so that a part whose
/// type is unknown because of an earlier error (a misspelled field) leaves the bound
/// undecided, which the compiler does not report after that error, instead of refused.
pub trait NeverInKey {}

#[diagnostic::do_not_recommend]
impl<T: NeverInKey> DeterministicOrder for HashSetInKey<T> {}

/// Type-checks one key part (never called at run time).
pub fn ordered<O: DeterministicOrder>(_: O) {}
