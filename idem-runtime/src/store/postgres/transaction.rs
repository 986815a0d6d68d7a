//! Claims inside the caller's own PostgreSQL transaction: the claim, the body's writes and
//! the record commit together, or not at all.
//!
//! What a call sends on the caller's connection, beside the caller's own statements:
//!
//! | outcome | statements | round trips |
//! |---|---|---|
//! | replay | `SAVEPOINT`, the claim | 1 |
//! | first execution, `Ok` | `SAVEPOINT`, the claim, the completion | 2 |
//! | first execution, `Err` | `SAVEPOINT`, the claim, `ROLLBACK TO SAVEPOINT` | 2 |
//!
//! The savepoint comes first, in the same message as the claim (the simple query protocol,
//! the claim's arguments written as literals: bytes in hex and numbers, all of them the
//! runtime's own). Everything the call writes, the claim and the body's writes, is inside
//! it, so an `Err` is one `ROLLBACK TO SAVEPOINT` away from leaving nothing, and a failed
//! claim (a serialization failure, say) leaves the caller's transaction usable. The savepoint
//! is not released: it ends with the caller's transaction, which commits or rolls back
//! everything in it.
//!
//! The claim is one call of a function that [`PostgresStore::migrate`] creates beside the
//! table: it sets `lock_timeout` for its own duration only (the caller's setting is back when
//! it returns), so that waiting for a concurrent holder's transaction is bounded by the
//! operation's wait timeout, or, with [`InFlight::Reject`], does not happen. A holder's
//! uncommitted claim is invisible to everyone else; a duplicate's `INSERT` waits for the
//! holder's transaction to end, then sees its committed record (a replay) or nothing (the
//! holder rolled back: the duplicate claims). A crash needs no lease: the server rolls the
//! holder's transaction back, and the key is free at once. No statement commits: the caller
//! decides, and until it commits no other caller can see the record.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::PgConnection;
use tokio::time::Instant;
use tracing::Instrument;

use super::{millis, parse_claim, PostgresStore};
use crate::codec::{self, ErrorPolicy, Json};
use crate::engine::attempt::{self, Attempt};
use crate::engine::{pause_before_polling, Settings, Settled};
use crate::meter::{self, Event};
use crate::{limits, Claim, Error, Fingerprint, InFlight, Key, Operation, Outcome, Token};

/// The lock timeout of [`InFlight::Reject`]: long enough for a lock that is free, far too
/// short for a holder's transaction.
const REJECT_WITHIN: &str = "1ms";

/// The statements of claims in a transaction, for one table.
pub(in crate::store) struct Statements {
    function: String,
    claim: String,
    table: String,
}

/// Each call's savepoint has a name of its own, so that a call nested in another's body
/// (on the same connection) rolls back to its own savepoint, never to its parent's.
static SAVEPOINTS: AtomicU64 = AtomicU64::new(0);

/// The name of one call's savepoint.
struct Savepoint(u64);

impl Savepoint {
    fn new() -> Self {
        Self(SAVEPOINTS.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for Savepoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "idem_{}", self.0)
    }
}

impl Statements {
    /// The statements for `table`, whose claim function is `function`.
    pub(super) fn new(function: &str, table: &str) -> Self {
        Self {
            function: function.to_string(),
            claim: format!("SELECT * FROM {function}($1, $2, $3, $4)"),
            table: table.to_string(),
        }
    }

    /// The completion, and the release of the call's savepoint, in one message: the row is
    /// this transaction's own, invisible to others until commit, so there is no expiry to
    /// check; the TTL starts at the completion. Released, the savepoint's work joins the
    /// enclosing level, so that calls after it do not nest one level deeper each.
    fn complete_and_release(
        &self,
        savepoint: &Savepoint,
        key: &Key,
        token: i64,
        record: &[u8],
        ttl: i64,
    ) -> String {
        format!(
            "UPDATE {} SET completed = true, value = decode('{}', 'hex'), \
             expires_at = clock_timestamp() + {ttl} * interval '1 millisecond' \
             WHERE key = decode('{}', 'hex') AND token = {token} AND NOT completed RETURNING true; \
             RELEASE SAVEPOINT {savepoint}",
            self.table,
            hex::encode(record),
            hex::encode(key.as_bytes()),
        )
    }

    /// The first claim of a call: its savepoint, then the claim, in one message. The
    /// arguments are literals: the key and the fingerprint in hex, the numbers as digits.
    fn savepoint_and_claim(
        &self,
        savepoint: &Savepoint,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: i64,
        lock_timeout: &str,
    ) -> String {
        let fingerprint = fingerprint.map_or("NULL".to_string(), |f| {
            format!("decode('{}', 'hex')", hex::encode(f.as_bytes()))
        });
        format!(
            "SAVEPOINT {savepoint}; SELECT * FROM {}(decode('{}', 'hex'), {fingerprint}, {lease}, '{lock_timeout}')",
            self.function,
            hex::encode(key.as_bytes()),
        )
    }

    /// The body of the claim function (see [`function`](Self::function)): the store's claim
    /// with the transaction's clock (`clock_timestamp()`, as `now()` is when the
    /// transaction began), under the `lock_timeout` it is handed.
    pub(super) fn function_source(table: &str, sequence: &str) -> String {
        let claim = super::claim_query(
            table,
            sequence,
            "clock_timestamp()",
            ["p_key", "p_fingerprint", "p_lease"],
            None,
        );
        format!(
            "\n#variable_conflict use_column\n\
             BEGIN\n\
                 PERFORM set_config('lock_timeout', p_lock_timeout, true);\n\
                 FOR attempt IN 1..1000 LOOP\n\
                     RETURN QUERY {claim};\n\
                     IF FOUND THEN RETURN; END IF;\n\
                 END LOOP;\n\
                 RAISE EXCEPTION 'idem: the claim of a key did not settle after 1000 attempts';\n\
             END\n"
        )
    }

    /// The claim function, of `source`. Its own `SET` clause puts the caller's
    /// `lock_timeout` back when it returns. A lock wait that runs out fails the statement
    /// (`lock_not_available`), and the caller rolls back to the savepoint the claim was sent
    /// after.
    pub(super) fn function(function: &str, source: &str) -> String {
        format!(
            "CREATE OR REPLACE FUNCTION {function}(\
                p_key bytea, p_fingerprint bytea, p_lease bigint, p_lock_timeout text) \
             RETURNS TABLE (acquired boolean, token bigint, completed boolean, fingerprint bytea, value bytea) \
             LANGUAGE plpgsql SET lock_timeout = 0 AS $idem${source}$idem$"
        )
    }
}

impl<P> Operation<P> {
    /// Runs `body` at most once per `key`, inside the caller's transaction on `connection`:
    /// the key is claimed in it, `body` runs in it (it is handed the connection), and the
    /// result is recorded in it. The body's writes and the record commit together when the
    /// caller commits, or not at all.
    ///
    /// - A replay is one round trip (`SAVEPOINT` and the claim) and never runs the body; a
    ///   first execution is two (that, then the completion).
    /// - `Ok` is recorded (for the TTL) but not committed: the caller commits. A caller that
    ///   rolls back leaves nothing, and the next call runs.
    /// - `Err` (unless the error policy records it) rolls the body's writes and the claim
    ///   back together, to a savepoint; the caller's transaction stays usable.
    /// - A concurrent call in another transaction waits for this one to end, then replays
    ///   its result, or runs if it rolled back: with [`InFlight::Wait`] for at most the wait
    ///   timeout (the lease by default), with [`InFlight::Reject`] not at all. No caller is
    ///   ever handed a result whose transaction has not committed.
    /// - A crash needs no lease: the server rolls the transaction back and the key is free.
    ///
    /// Records of calls in transactions and of [`run`](Self::run) on the same
    /// [`PostgresStore`] share its table and honour each other.
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
    /// # Isolation levels
    ///
    /// Under `READ COMMITTED` (PostgreSQL's default) a duplicate waits and replays. Under
    /// `REPEATABLE READ` and `SERIALIZABLE`, a duplicate whose transaction began before the
    /// holder committed cannot see the record: PostgreSQL refuses its claim with a
    /// serialization failure, returned as [`Error::Store`], and its transaction must be
    /// retried (it then replays). Never does a duplicate run the body.
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
    pub async fn run_in_transaction<T, E, F>(
        &self,
        store: &PostgresStore,
        connection: &mut PgConnection,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        body: F,
    ) -> Result<Outcome<T>, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        P: ErrorPolicy<E>,
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
    {
        let span = self.settings.span(key);
        async {
            let savepoint = Savepoint::new();
            let token = match self
                .settings
                .settle_in(store, connection, &savepoint, key, fingerprint)
                .await?
            {
                Settled::Replay(record) => return self.replay::<Json, _, _>(&record),
                Settled::Run(token) => token,
            };
            let tx = Claimed {
                store,
                key,
                token,
                savepoint,
            };
            let attempt = Attempt::enter_fenced(store, *key, token);
            let result = attempt.scope(body(&mut *connection)).await;
            let recorded = match result {
                Ok(value) => match codec::encode_value::<Json, T>(&value) {
                    Ok(record) => tx.complete(connection, record, self.settings.ttl).await.map(|()| Ok(value)),
                    Err(codec) => {
                        tracing::error!(outcome = "released", error = %codec, "the result cannot be recorded");
                        Err(codec)
                    }
                },
                Err(err) => match self.errors.encode(&err) {
                    Some(Ok(record)) => tx.complete(connection, record, self.settings.ttl).await.map(|()| Err(err)),
                    Some(Err(codec)) => {
                        tracing::error!(outcome = "released", error = %codec, "the final error cannot be recorded");
                        meter::count(&self.settings.namespace, Event::Released);
                        tx.roll_back(connection).await;
                        return Err(err);
                    }
                    None => {
                        tracing::debug!(outcome = "released", "the body failed; its writes are rolled back");
                        meter::count(&self.settings.namespace, Event::Released);
                        tx.roll_back(connection).await;
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
                    tx.roll_back(connection).await;
                    Err(err.into())
                }
            }
        }
        .instrument(span)
        .await
    }
}

impl Settings {
    /// Claims `key` in the transaction under `savepoint`: the record to replay, or the
    /// token of the claim. Only a claim keeps the savepoint; any other outcome ends it (a
    /// replay wrote nothing; a refused claim rolls back to it), so that a transaction of
    /// many calls does not nest one level deeper per call.
    async fn settle_in(
        &self,
        store: &PostgresStore,
        connection: &mut PgConnection,
        savepoint: &Savepoint,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Settled, Error> {
        let started = meter::start();
        let settled = self
            .settle_under(store, connection, savepoint, key, fingerprint)
            .await;
        meter::settled(&self.namespace, started, &settled, |settled| {
            matches!(settled, Settled::Replay(_))
        });
        settled
    }

    /// [`settle_in`](Self::settle_in), unmeasured.
    async fn settle_under(
        &self,
        store: &PostgresStore,
        connection: &mut PgConnection,
        savepoint: &Savepoint,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Settled, Error> {
        limits::check(self.ttl, self.lease, self.wait_timeout)?;
        // Before any statement: the enclosing call's uncommitted claim would make a claim on
        // another connection wait for the very transaction that waits for it.
        attempt::refuse_recursion(store, key)?;
        let mut taken = false;
        let settled = self
            .claim_under(store, connection, savepoint, &mut taken, key, fingerprint)
            .await;
        if taken && !matches!(settled, Ok(Settled::Run(_))) {
            end_savepoint(store, connection, savepoint).await;
        }
        settled
    }

    /// The claim and its polls; `taken` tells whether the savepoint was established.
    async fn claim_under(
        &self,
        store: &PostgresStore,
        connection: &mut PgConnection,
        savepoint: &Savepoint,
        taken: &mut bool,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Settled, Error> {
        let wait = self.wait_timeout.unwrap_or(self.lease);
        let lock_timeout = match self.in_flight {
            InFlight::Reject => REJECT_WITHIN.to_string(),
            _ => lock_timeout(wait),
        };
        let deadline = Instant::now() + wait;
        let statements = &store.sql.transaction;
        let mut polls = 0;
        loop {
            let claimed = if polls == 0 {
                let first = statements.savepoint_and_claim(
                    savepoint,
                    key,
                    fingerprint,
                    millis(self.lease),
                    &lock_timeout,
                );
                let claimed =
                    within(store.timeout + wait, simple_query(&mut *connection, &first)).await;
                // The savepoint is taken unless the message failed at it: in a transaction
                // already aborted by the caller's own statement, or outside of one. Then
                // nothing of this call is there to roll back, and an aborted transaction
                // stays aborted.
                *taken = claimed.as_ref().err().is_none_or(Failed::savepoint_taken);
                claimed
            } else {
                // Polls run inside the savepoint of the first claim, which wrote nothing.
                within(
                    store.timeout + wait,
                    sqlx::query(&statements.claim)
                        .bind(&key.as_bytes()[..])
                        .bind(fingerprint.map(|f| &f.as_bytes()[..]))
                        .bind(millis(self.lease))
                        .bind(&lock_timeout)
                        .fetch_one(&mut *connection),
                )
                .await
            };
            let row = claimed.map_err(Failed::into_error)?;
            match parse_claim(&row)? {
                Claim::Acquired { token } => return Ok(Settled::Run(token)),
                Claim::Completed {
                    value,
                    fingerprint: recorded,
                } => return Settled::replay(value, recorded.as_ref(), fingerprint),
                // Held by a committed claim of `run` (a lease), not by a transaction: poll.
                Claim::InProgress {
                    fingerprint: holder,
                } => {
                    self.found_in_progress(store, key, holder.as_ref(), fingerprint)?;
                    if polls == 0 {
                        refuse_a_snapshot_that_cannot_see_the_end(store, connection).await?;
                    }
                    pause_before_polling(deadline, polls).await?;
                    polls += 1;
                }
            }
        }
    }
}

/// A claim held by an ordinary call, found from a transaction whose snapshot is fixed
/// (`REPEATABLE READ`, `SERIALIZABLE`): the snapshot will never show the holder's
/// completion, so polling would only wait out the whole wait. The transaction must be
/// retried, as when it finds a transaction's claim committed after it began.
async fn refuse_a_snapshot_that_cannot_see_the_end(
    store: &PostgresStore,
    connection: &mut PgConnection,
) -> Result<(), Error> {
    let isolation: String = within(
        store.timeout,
        sqlx::query_scalar("SELECT current_setting('transaction_isolation')")
            .fetch_one(&mut *connection),
    )
    .await
    .map_err(Failed::into_error)?;
    if isolation == "read committed" {
        return Ok(());
    }
    Err(Error::store(format!(
        "the key is held by a call in progress, and under {} this transaction's snapshot \
         will never see its result; roll back and retry the transaction (it will replay)",
        isolation.to_uppercase()
    )))
}

/// The `lock_timeout` of a claim that waits up to `wait`: PostgreSQL counts it in
/// milliseconds in a 32-bit integer (at most 24.8 days). A longer wait waits that long on
/// each lock, and the wait's own deadline still bounds the whole.
fn lock_timeout(wait: Duration) -> String {
    format!("{}ms", millis(wait).min(i64::from(i32::MAX)))
}

/// Rolls back to `savepoint` and releases it, in one message: whatever the call did since
/// is undone, and the transaction is one level shallower again. A failure is logged: the
/// transaction is then unusable, and the caller's commit fails with it.
async fn end_savepoint(
    store: &PostgresStore,
    connection: &mut PgConnection,
    savepoint: &Savepoint,
) {
    let statements = format!("ROLLBACK TO SAVEPOINT {savepoint}; RELEASE SAVEPOINT {savepoint}");
    let ended = within(
        store.timeout,
        sqlx::Executor::execute(&mut *connection, sqlx::raw_sql(&statements)),
    )
    .await;
    if let Err(err) = ended {
        tracing::error!(error = %err.into_error(), "rolling back to the call's savepoint failed; roll the transaction back");
    }
}

/// A claim taken in the caller's transaction, and what can still be done with it.
struct Claimed<'a> {
    store: &'a PostgresStore,
    key: &'a Key,
    token: Token,
    savepoint: Savepoint,
}

impl Claimed<'_> {
    /// Records the result beside the body's writes, and releases the call's savepoint.
    async fn complete(
        &self,
        connection: &mut PgConnection,
        record: Bytes,
        ttl: Duration,
    ) -> Result<(), Error> {
        let statements = self.store.sql.transaction.complete_and_release(
            &self.savepoint,
            self.key,
            i64::try_from(self.token.get())
                .map_err(|_| Error::store("a fencing token out of PostgreSQL's bigint range"))?,
            &record,
            millis(ttl),
        );
        let done = within(
            self.store.timeout,
            sqlx::Executor::fetch_all(&mut *connection, sqlx::raw_sql(&statements)),
        )
        .await
        .map_err(Failed::into_error)?;
        if done.len() == 1 {
            Ok(())
        } else {
            Err(Error::store(
                "the claim in this transaction is gone: did the body roll back to a savepoint taken before the call? Roll the transaction back",
            ))
        }
    }

    /// Rolls the claim and the body's writes back to the call's savepoint, and releases it.
    async fn roll_back(&self, connection: &mut PgConnection) {
        end_savepoint(self.store, connection, &self.savepoint).await;
    }
}

/// Why a statement of a transactional call failed.
enum Failed {
    /// PostgreSQL did not answer within the bound.
    Timeout(Duration),
    Sql(sqlx::Error),
}

impl fmt::Display for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Timeout(timeout) => write!(f, "postgresql did not answer within {timeout:?}"),
            Self::Sql(err) => err.fmt(f),
        }
    }
}

impl Failed {
    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        match self {
            Self::Sql(err) => err.as_database_error().and_then(|db| db.code()),
            Self::Timeout(_) => None,
        }
    }

    /// Whether a message that began with `SAVEPOINT` got past it.
    fn savepoint_taken(&self) -> bool {
        !matches!(self.code().as_deref(), Some("25P02" | "25P01"))
    }

    /// The error a caller can act on, saying how.
    fn into_error(self) -> Error {
        let err = match self {
            Self::Timeout(timeout) => {
                return Error::store(format!(
                    "postgresql did not answer within {timeout:?}; roll the transaction back"
                ))
            }
            Self::Sql(err) => err,
        };
        if super::lock_not_available(&err) {
            tracing::debug!(outcome = "rejected", "another transaction holds the key");
            return Error::InProgress;
        }
        let code = err
            .as_database_error()
            .and_then(|db| db.code())
            .map(|code| code.into_owned());
        match code.as_deref() {
            Some("40001") => Error::store(format!(
                "{err}: under REPEATABLE READ or SERIALIZABLE, a concurrent call committed this key \
                 after the transaction began; roll back and retry the transaction (it will replay)"
            )),
            Some("25P01") => Error::store(format!(
                "{err}: `run_in_transaction` claims inside the caller's transaction; begin one and pass it"
            )),
            Some("25P02") => Error::store(format!(
                "{err}: the transaction was already aborted by an earlier statement, and nothing was \
                 claimed; roll it back"
            )),
            Some("42883") => Error::store(format!(
                "{err}: the claim function is not visible on this connection; run \
                 `PostgresStore::migrate()`, which creates it beside the table, or, if it ran, \
                 name the table with its schema (`with_table(\"schema.table\")`) when that schema \
                 is not on this connection's `search_path`"
            )),
            _ => Error::store(err),
        }
    }
}

/// Runs a statement under `timeout`.
async fn within<T>(
    timeout: Duration,
    operation: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, Failed> {
    match tokio::time::timeout(timeout, operation).await {
        Ok(result) => result.map_err(Failed::Sql),
        Err(_) => Err(Failed::Timeout(timeout)),
    }
}

/// A message of several statements (the simple query protocol), and the first row it returns.
fn simple_query<'c>(
    connection: &'c mut PgConnection,
    statements: &'c str,
) -> impl std::future::Future<Output = Result<PgRow, sqlx::Error>> + Send + 'c {
    // Through `Executor` itself: `RawSql::fetch_one`'s future is not `Send` for every
    // lifetime its bound introduces, which would make every caller's future not `Send`.
    sqlx::Executor::fetch_one(connection, sqlx::raw_sql(statements))
}
