//! What `#[idempotent]` expands to. Not a public API: no stability promise.

use std::future::Future;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;

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
pub fn owned_store<S: Store + Clone>(store: &S) -> S {
    store.clone()
}

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

/// What every expansion does around its `Operation` call: the first error deriving the key
/// or the fingerprint is the function's error (the body never runs); otherwise `call` runs
/// with them, and its outcome becomes the function's bare return value.
async fn call<R, Fut>(
    key: Result<Key, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
    call: impl FnOnce(Key, Option<Fingerprint>) -> Fut,
) -> R
where
    R: IdemResult,
    R::Err: From<Error>,
    Fut: Future<Output = Result<crate::Outcome<R::Ok>, R::Err>>,
{
    let derived = key.and_then(|key| Ok((key, fingerprint.transpose()?)));
    match derived {
        Ok((key, fingerprint)) => {
            R::from_result(call(key, fingerprint).await.map(crate::Outcome::into_inner))
        }
        Err(err) => R::from_result(Err(err.into())),
    }
}

/// `Operation::run`, after the key and fingerprint were derived (before the body borrowed
/// its arguments), returning the bare value. Generic over the function's return type, so that
/// a return type that is not a `Result` fails one bound, with its own message.
pub async fn run<P, S, R, F>(
    operation: &Operation<P>,
    store: &S,
    key: Result<Key, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
    body: F,
) -> R
where
    R: IdemResult,
    R::Ok: Serialize + DeserializeOwned,
    R::Err: From<Error>,
    P: ErrorPolicy<R::Err>,
    S: Store + Clone,
    F: Future<Output = R>,
{
    call(key, fingerprint, |key, fingerprint| async move {
        let body = async { body.await.into_result() };
        operation.run(store, &key, fingerprint.as_ref(), body).await
    })
    .await
}

/// `Operation::run_to_completion`, as [`run`].
pub async fn run_to_completion<P, S, R, F>(
    operation: &Operation<P>,
    store: &S,
    key: Result<Key, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
    body: F,
) -> R
where
    R: IdemResult,
    R::Ok: Serialize + DeserializeOwned + Send + 'static,
    R::Err: From<Error> + Send + 'static,
    P: ErrorPolicy<R::Err> + Clone + Send + Sync + 'static,
    S: Store + Clone,
    F: Future<Output = R> + Send + 'static,
{
    call(key, fingerprint, |key, fingerprint| async move {
        let body = async { body.await.into_result() };
        operation
            .run_to_completion(store, &key, fingerprint.as_ref(), body)
            .await
    })
    .await
}

/// `Operation::run_in_transaction`, as [`run`]: `transaction = tx`.
#[cfg(feature = "postgres")]
pub async fn run_in_transaction<P, R, F>(
    operation: &Operation<P>,
    store: &crate::PostgresStore,
    connection: &mut sqlx::PgConnection,
    key: Result<Key, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
    body: F,
) -> R
where
    R: IdemResult,
    R::Ok: Serialize + DeserializeOwned,
    R::Err: From<Error>,
    P: ErrorPolicy<R::Err>,
    F: AsyncFnOnce(&mut sqlx::PgConnection) -> R,
{
    call(key, fingerprint, |key, fingerprint| async move {
        let body =
            async move |connection: &mut sqlx::PgConnection| body(connection).await.into_result();
        operation
            .run_in_transaction(store, connection, &key, fingerprint.as_ref(), body)
            .await
    })
    .await
}

/// The stores `transaction =` works with: PostgreSQL's.
#[cfg(feature = "postgres")]
#[diagnostic::on_unimplemented(
    message = "`transaction =` needs a `PostgresStore`, not `{Self}`",
    label = "not a `PostgresStore`",
    note = "the claim, the body's writes and the record commit together only in PostgreSQL: use `store = <a PostgresStore>`, or remove `transaction =` to use this store without a transaction"
)]
pub trait InTransaction {
    #[doc(hidden)]
    fn __idem_postgres(&self) -> &crate::PostgresStore;
}

#[cfg(feature = "postgres")]
impl InTransaction for crate::PostgresStore {
    fn __idem_postgres(&self) -> &crate::PostgresStore {
        self
    }
}

/// The `PostgresStore` of `transaction =`, or the error that says it must be one.
#[cfg(feature = "postgres")]
pub fn postgres_store<S: InTransaction>(store: &S) -> &crate::PostgresStore {
    store.__idem_postgres()
}

/// One part of a key or fingerprint value (the value itself, or an element of a tuple),
/// wrapped so that the two `__idem_order` methods below can tell a `HashSet` apart at
/// compile time: method resolution tries `Unordered` (on `KeyPart`) before `Ordered` (on
/// `&KeyPart`), and only a `HashSet` has the former.
pub struct KeyPart<'a, T: ?Sized>(pub &'a T);

/// What a `HashSet` part yields: refused by [`ordered`].
pub struct HashSetInKey;

/// Chosen for `HashSet` parts.
pub trait Unordered {
    #[doc(hidden)]
    fn __idem_order(&self) -> HashSetInKey {
        HashSetInKey
    }
}

impl<T, S> Unordered for KeyPart<'_, std::collections::HashSet<T, S>> {}
impl<T, S> Unordered for KeyPart<'_, &std::collections::HashSet<T, S>> {}
impl<T, S> Unordered for KeyPart<'_, &mut std::collections::HashSet<T, S>> {}

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

/// Type-checks one key part (never called at run time).
pub fn ordered<O: DeterministicOrder>(_: O) {}
