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
//! operation's wait timeout, or, with [`InFlight::Reject`](crate::InFlight::Reject), does not happen. A holder's
//! uncommitted claim is invisible to everyone else; a duplicate's `INSERT` waits for the
//! holder's transaction to end, then sees its committed record (a replay) or nothing (the
//! holder rolled back: the duplicate claims). A crash needs no lease: the server rolls the
//! holder's transaction back, and the key is free at once. No statement commits: the caller
//! decides, and until it commits no other caller can see the record.

use std::fmt;
use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::PgConnection;

use super::{millis, parse_claim, PostgresStore};
use crate::store::transaction::{sealed::Sealed, Call, Savepoint, Transactional};
use crate::{Claim, Error, Token};

/// The lock timeout of [`InFlight::Reject`](crate::InFlight::Reject): long enough for a lock that is free, far too
/// short for a holder's transaction.
const REJECT_WITHIN: &str = "1ms";

impl Sealed for PostgresStore {}

impl Transactional for PostgresStore {
    type Connection = PgConnection;

    async fn __claim_in(
        &self,
        connection: &mut PgConnection,
        call: &Call<'_>,
        first: bool,
    ) -> Result<Claim, Error> {
        let lock_timeout = call.wait.map_or(REJECT_WITHIN.to_string(), lock_timeout);
        let bound = self.timeout() + call.wait.unwrap_or_default();
        let statements = &self.driver().sql.transaction;
        let claimed = if first {
            let first = statements.savepoint_and_claim(
                &call.savepoint,
                call.key,
                call.fingerprint,
                millis(call.lease),
                &lock_timeout,
            );
            within(bound, simple_query(&mut *connection, &first)).await
        } else {
            // Polls run inside the savepoint of the first claim, which wrote nothing.
            within(
                bound,
                sqlx::query(&statements.claim)
                    .bind(&call.key.as_bytes()[..])
                    .bind(call.fingerprint.map(|f| &f.as_bytes()[..]))
                    .bind(millis(call.lease))
                    .bind(&lock_timeout)
                    .fetch_one(&mut *connection),
            )
            .await
        };
        match claimed {
            Ok(row) => parse_claim(&row),
            Err(failed) => {
                // The savepoint is taken unless the first message failed at it: in a
                // transaction already aborted by the caller's own statement, or outside of
                // one. Then nothing of this call is there to roll back, and an aborted
                // transaction stays aborted.
                if !first || failed.savepoint_taken() {
                    end_savepoint(self, connection, &call.savepoint).await;
                }
                Err(failed.into_error())
            }
        }
    }

    async fn __before_polling(&self, connection: &mut PgConnection) -> Result<(), Error> {
        refuse_a_snapshot_that_cannot_see_the_end(self, connection).await
    }

    /// The completion and the release of the savepoint, in one message.
    async fn __complete_in(
        &self,
        connection: &mut PgConnection,
        call: &Call<'_>,
        token: Token,
        record: &[u8],
        ttl: Duration,
    ) -> Result<bool, Error> {
        let statements = self.driver().sql.transaction.complete_and_release(
            &call.savepoint,
            call.key,
            i64::try_from(token.get())
                .map_err(|_| Error::store("a fencing token out of PostgreSQL's bigint range"))?,
            record,
            millis(ttl),
        );
        let done = within(
            self.timeout(),
            sqlx::Executor::fetch_all(&mut *connection, sqlx::raw_sql(&statements)),
        )
        .await
        .map_err(Failed::into_error)?;
        Ok(done.len() == 1)
    }

    async fn __roll_back(&self, connection: &mut PgConnection, call: &Call<'_>) {
        end_savepoint(self, connection, &call.savepoint).await;
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
        store.timeout(),
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
        store.timeout(),
        sqlx::Executor::execute(&mut *connection, sqlx::raw_sql(&statements)),
    )
    .await;
    if let Err(err) = ended {
        tracing::error!(error = %err.into_error(), "rolling back to the call's savepoint failed; roll the transaction back");
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
