//! Claims inside the caller's own database transaction (features `postgres`, `sqlite`,
//! `mysql`): the claim, the body's writes and the record commit together, or not at all.
//!
//! A call takes a savepoint of its own on the caller's connection, claims the key under it,
//! runs the body on the connection and records the result beside the body's writes. An
//! `Err` rolls back to the savepoint: the claim and the body's writes go together, and the
//! caller's transaction stays usable. Nothing here commits: the caller does, and until then
//! no other caller sees the record. What differs between databases (the statements, how a
//! duplicate waits for the holder's transaction) is each store's [`Transactional`] impl.

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use super::attempt::{Attempt, Journal};
use super::settle::Settled;
use crate::codec::{ErrorPolicy, Json, ValueCodec};
use crate::meter::{self, Event};
use crate::store::{Call, Savepoint, Transactional};
use crate::{Error, Fingerprint, InFlight, Key, Operation, Outcome, Token};

impl<P> Operation<P> {
    /// Runs `body` at most once per `key`, inside the caller's transaction on `connection`:
    /// the key is claimed in it, `body` runs in it (it is handed the connection), and the
    /// result is recorded in it. The body's writes and the record commit together when the
    /// caller commits, or not at all. `store` is a [`Transactional`] store, `connection` its
    /// kind: a [`PostgresStore`](crate::PostgresStore) with a `PgConnection`, a
    /// [`SqliteStore`](crate::SqliteStore) with a `SqliteConnection`.
    ///
    /// - A replay never runs the body; it writes nothing.
    /// - `Ok` is recorded (for the TTL) but not committed: the caller commits. A caller that
    ///   rolls back leaves nothing, and the next call runs.
    /// - `Err` (unless the error policy records it) rolls the body's writes and the claim
    ///   back together, to a savepoint; the caller's transaction stays usable.
    /// - A concurrent call in another transaction waits for this one to end, then replays
    ///   its result, or runs if it rolled back; with [`InFlight::Reject`] it does not wait.
    ///   No caller is ever handed a result whose transaction has not committed.
    /// - A crash needs no lease: the database rolls the transaction back and the key is free.
    ///
    /// Records of calls in transactions and of [`run`](Self::run) on the same store share
    /// its table and honour each other. How each database waits, and what it asks of the
    /// caller's transaction, is on its store: PostgreSQL's
    /// [isolation levels](crate::PostgresStore#transactions), SQLite's
    /// [`BEGIN IMMEDIATE`](crate::SqliteStore#transactions).
    ///
    /// ```no_run
    /// use idem_runtime::{Operation, PostgresStore};
    ///
    /// # async fn transfer(store: &PostgresStore) -> Result<(), idem_runtime::Error> {
    /// let op = Operation::new("ledger.transfer.v1");
    /// let key = op.key(&"transfer-42")?;
    /// let mut tx = store.pool().begin().await.map_err(idem_runtime::Error::store)?;
    /// let moved = op
    ///     .run_in_transaction(store, &mut tx, &key, None, async |tx| {
    ///         sqlx::query("UPDATE accounts SET balance = balance - 100 WHERE id = 1")
    ///             .execute(&mut *tx)
    ///             .await
    ///             .map_err(idem_runtime::Error::store)?;
    ///         Ok::<_, idem_runtime::Error>(100_u64)
    ///     })
    ///     .await?;
    /// tx.commit().await.map_err(idem_runtime::Error::store)?;
    /// # let _ = moved;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Cancellation
    ///
    /// If this future is dropped mid-body, the savepoint stays open on the connection. A
    /// caller that then rolls back leaves nothing; one that commits anyway commits the
    /// body's writes so far and a claim that, like a crashed holder's, lapses after the
    /// lease.
    ///
    /// # Errors
    ///
    /// `body`'s own errors, and [`Error`]s converted with `E: From<Error>`:
    /// [`Error::InProgress`] (the key is held by another transaction past the wait, or by
    /// this call's own enclosing call), [`Error::PayloadMismatch`], [`Error::Store`] and
    /// [`Error::Codec`]. After an [`Error::Store`] the transaction may be aborted: roll it
    /// back.
    pub async fn run_in_transaction<S, T, E, F>(
        &self,
        store: &S,
        connection: &mut S::Connection,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        body: F,
    ) -> Result<Outcome<T>, E>
    where
        S: Transactional,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        P: ErrorPolicy<E>,
        F: AsyncFnOnce(&mut S::Connection) -> Result<T, E>,
    {
        let span = self.settings.span(key);
        async {
            let call = Call {
                savepoint: Savepoint::new(),
                key,
                fingerprint,
                lease: self.settings.lease,
                wait: match self.settings.in_flight {
                    InFlight::Reject => None,
                    _ => Some(self.settings.wait()),
                },
            };
            let token = match self.settings.settle_in(store, connection, &call).await? {
                Settled::Replay(record) => return self.replay::<Json, _, _>(&record),
                Settled::Run(granted) => granted.token,
            };
            let journal = Journal::in_transaction(*key, &self.settings, fingerprint.copied());
            let attempt = Attempt::enter_fenced(store, *key, token, journal);
            let result = attempt.scope(body(&mut *connection)).await;
            let ttl = self.settings.ttl;
            let recorded = match result {
                Ok(value) => match <Json as ValueCodec<T>>::record(&value) {
                    Ok(record) => complete(store, connection, &call, token, &record, ttl)
                        .await
                        .map(|()| Ok(value)),
                    Err(codec) => {
                        tracing::error!(outcome = "released", error = %codec, "the result cannot be recorded");
                        Err(codec)
                    }
                },
                Err(err) => match self.errors.encode(&err) {
                    Some(Ok(record)) => complete(store, connection, &call, token, &record, ttl)
                        .await
                        .map(|()| Err(err)),
                    Some(Err(codec)) => {
                        tracing::error!(outcome = "released", error = %codec, "the final error cannot be recorded");
                        meter::count(&self.settings.namespace, Event::Released);
                        store.__roll_back(connection, &call).await;
                        return Err(err);
                    }
                    None => {
                        tracing::debug!(outcome = "released", "the body failed; its writes are rolled back");
                        meter::count(&self.settings.namespace, Event::Released);
                        store.__roll_back(connection, &call).await;
                        return Err(err);
                    }
                },
            };
            let namespace = &self.settings.namespace;
            match recorded {
                Ok(outcome) => {
                    meter::count(namespace, Event::Executed);
                    tracing::debug!(outcome = "executed", "recorded in the caller's transaction");
                    outcome.map(Outcome::Executed)
                }
                Err(err) => {
                    meter::count(namespace, Event::Released);
                    store.__roll_back(connection, &call).await;
                    Err(err.into())
                }
            }
        }
        .instrument(span)
        .await
    }
}

/// Records the result under the call's claim: an error if the claim is gone.
async fn complete<S: Transactional>(
    store: &S,
    connection: &mut S::Connection,
    call: &Call<'_>,
    token: Token,
    record: &[u8],
    ttl: Duration,
) -> Result<(), Error> {
    if store
        .__complete_in(connection, call, token, record, ttl)
        .await?
    {
        Ok(())
    } else {
        Err(Error::store(
            "the claim in this transaction is gone: did the body roll back to a savepoint taken before the call? Roll the transaction back",
        ))
    }
}
