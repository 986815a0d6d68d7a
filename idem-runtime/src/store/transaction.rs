//! What a store implements to claim inside the caller's own database transaction
//! (features `postgres`, `sqlite`, `mysql`): the [`Transactional`] statements, each
//! database's own. The call that drives them, a savepoint, the claim, the body and the
//! record, is the engine's
//! ([`Operation::run_in_transaction`](crate::Operation::run_in_transaction)).

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;

use crate::{Claim, Error, Fingerprint, Key, Store, Token};

/// A store that claims keys inside the caller's own transaction, on its connection:
/// [`PostgresStore`](crate::PostgresStore) on a `PgConnection`,
/// [`SqliteStore`](crate::SqliteStore) on a `SqliteConnection`. See
/// [`Operation::run_in_transaction`](crate::Operation::run_in_transaction).
///
/// Sealed: the statements that make a claim transactional are each database's own.
pub trait Transactional: Store + Clone + sealed::Sealed {
    /// The connection the caller's transaction runs on.
    type Connection: Send;

    /// A completed record of `key` at hand outside the database (a tier's fast copy): a
    /// replay answered with it takes no savepoint and sends nothing on the connection.
    #[doc(hidden)]
    fn __recorded(
        &self,
        key: &Key,
    ) -> impl Future<Output = Option<(Bytes, Option<Fingerprint>)>> + Send {
        let _ = key;
        std::future::ready(None)
    }

    /// Takes the call's savepoint (on the `first` claim only) and claims the key under it.
    /// On an error, whatever the call did on the connection is rolled back first.
    #[doc(hidden)]
    fn __claim_in(
        &self,
        connection: &mut Self::Connection,
        call: &Call<'_>,
        first: bool,
    ) -> impl Future<Output = Result<Claim, Error>> + Send;

    /// Before polling a key held by an ordinary call (a committed claim with a lease):
    /// whether this transaction can ever see its end, or must fail now.
    #[doc(hidden)]
    fn __before_polling(
        &self,
        connection: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Records the result under the call's claim, beside the body's writes, and releases
    /// the savepoint: whether the claim was there to complete.
    #[doc(hidden)]
    fn __complete_in(
        &self,
        connection: &mut Self::Connection,
        call: &Call<'_>,
        token: Token,
        record: &[u8],
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Rolls back to the call's savepoint and releases it. A failure is logged: the
    /// transaction is then unusable, and the caller's commit fails with it.
    #[doc(hidden)]
    fn __roll_back(
        &self,
        connection: &mut Self::Connection,
        call: &Call<'_>,
    ) -> impl Future<Output = ()> + Send;
}

pub(crate) mod sealed {
    pub trait Sealed {}
}

/// One call in a transaction, as its store's statements need it.
#[doc(hidden)]
#[derive(Debug)]
pub struct Call<'a> {
    pub savepoint: Savepoint,
    pub key: &'a Key,
    pub fingerprint: Option<&'a Fingerprint>,
    pub lease: Duration,
    /// How long a claim may wait for another transaction that holds the key: `None` with
    /// [`InFlight::Reject`], not at all.
    pub wait: Option<Duration>,
}

/// The name of one call's savepoint. Each call has a name of its own, so that a call
/// nested in another's body (on the same connection) rolls back to its own savepoint,
/// never to its parent's.
#[doc(hidden)]
#[derive(Debug)]
pub struct Savepoint(u64);

static SAVEPOINTS: AtomicU64 = AtomicU64::new(0);

impl Savepoint {
    pub(crate) fn new() -> Self {
        Self(SAVEPOINTS.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for Savepoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "idem_{}", self.0)
    }
}
