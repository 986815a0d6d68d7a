//! Claims inside the caller's own SQLite transaction (see
//! [`Operation::run_in_transaction`](crate::Operation::run_in_transaction)).
//!
//! SQLite has one writer at a time per file, so a transaction that claims holds the file's
//! write lock until it ends, and a duplicate's claim waits for that lock. The claim
//! therefore writes first: one statement takes the key if it is free (which takes the lock,
//! waiting up to the operation's wait) with a token from the counter, in a snapshot that
//! includes every transaction committed before it got the lock; when the key was not free,
//! the row that stayed is read: a duplicate that waited sees the holder's record and replays
//! it. A transaction that read the file before the holder committed cannot take the lock at
//! all (`SQLITE_BUSY_SNAPSHOT`): its claim fails, and a retry of the transaction replays.
//! `BEGIN IMMEDIATE` avoids that by taking the lock first.
//!
//! What a call sends on the caller's connection, beside the caller's own statements:
//!
//! | outcome | statements |
//! |---|---|
//! | replay | `SAVEPOINT` with a read of the busy timeout and the call's busy timeout, the take (which takes nothing), the caller's busy timeout, the read, `ROLLBACK TO` and `RELEASE` |
//! | first execution, `Ok` | `SAVEPOINT` with a read of the busy timeout and the call's busy timeout, the take, the caller's busy timeout, the completion, `RELEASE` |
//! | first execution, `Err` | the same up to the take, then `ROLLBACK TO` and `RELEASE` |

use std::time::Duration;

use sqlx::{Row, SqliteConnection};

use super::{SqliteStore, Statements};
use crate::store::sql::{self, millis};
use crate::store::transaction::{sealed::Sealed, Call, Savepoint, Transactional};
use crate::{Claim, Error, Token};

impl Sealed for SqliteStore {}

impl Transactional for SqliteStore {
    type Connection = SqliteConnection;

    async fn __claim_in(
        &self,
        connection: &mut SqliteConnection,
        call: &Call<'_>,
        _first: bool,
    ) -> Result<Claim, Error> {
        let bound = self.timeout() + call.wait.unwrap_or_default();
        let savepoint = &call.savepoint;
        sql::within(
            "sqlite",
            self.timeout(),
            self.driver().sql.checked(&mut *connection),
        )
        .await?;
        let taken = sql::within("sqlite", bound, async {
            // With the savepoint, the caller's busy timeout is read and the call's set (the
            // take waits for the file's lock up to the call's wait); the caller's is put
            // back once the lock is ours (or the take failed).
            let wait = call.wait.map_or(0, millis).min(i64::from(i32::MAX));
            let opened =
                format!("SAVEPOINT {savepoint}; PRAGMA busy_timeout; PRAGMA busy_timeout = {wait}");
            // All of it: a stream read to its first row would leave the last statement unrun.
            let read = sqlx::Executor::fetch_all(&mut *connection, sqlx::raw_sql(&opened)).await?;
            let caller: i64 = read.first().ok_or(sqlx::Error::RowNotFound)?.try_get(0)?;
            let claimed = claim(&self.driver().sql, connection, call, caller).await;
            if claimed.is_err() {
                set_busy_timeout(connection, caller).await?;
            }
            claimed
        })
        .await;
        match taken {
            Ok(claimed) => Ok(claimed),
            Err(err) => {
                end_savepoint(self, connection, savepoint).await;
                Err(refused(err, call))
            }
        }
    }

    /// A committed claim of an ordinary call holds the key: its holder writes its result
    /// through the file's lock, which this transaction holds, so waiting would only wait
    /// out the wait. The transaction should end, and a retry replays.
    async fn __before_polling(&self, _: &mut SqliteConnection) -> Result<(), Error> {
        tracing::debug!(
            outcome = "rejected",
            "the key is held by a call in progress, whose result cannot land while this transaction holds the file's lock"
        );
        Err(Error::InProgress)
    }

    async fn __complete_in(
        &self,
        connection: &mut SqliteConnection,
        call: &Call<'_>,
        token: Token,
        record: &[u8],
        ttl: Duration,
    ) -> Result<bool, Error> {
        let savepoint = &call.savepoint;
        sql::within("sqlite", self.timeout(), async {
            let done = sqlx::query(&self.driver().sql.complete)
                .bind(&call.key.as_bytes()[..])
                .bind(token)
                .bind(record)
                .bind(millis(ttl))
                .execute(&mut *connection)
                .await?;
            if done.rows_affected() == 1 {
                sqlx::Executor::execute(
                    &mut *connection,
                    sqlx::raw_sql(&format!("RELEASE SAVEPOINT {savepoint}")),
                )
                .await?;
            }
            Ok(done.rows_affected() == 1)
        })
        .await
    }

    async fn __roll_back(&self, connection: &mut SqliteConnection, call: &Call<'_>) {
        end_savepoint(self, connection, &call.savepoint).await;
    }
}

/// The claim under the call's savepoint, with the busy timeout set to the call's wait: one
/// statement takes the key if it is free, in the transaction's write lock (so it sees every
/// transaction committed before), with a token from the counter; then the caller's busy
/// timeout is put back. When the key was not free, the row that stayed is the answer.
async fn claim(
    sql: &Statements,
    connection: &mut SqliteConnection,
    call: &Call<'_>,
    caller: i64,
) -> Result<Claim, sqlx::Error> {
    let taken: Option<(i64, bool)> = sqlx::query_as(&sql.take)
        .bind(&call.key.as_bytes()[..])
        .bind(call.fingerprint.map(|f| &f.as_bytes()[..]))
        .bind(millis(call.lease))
        .bind(None::<&[u8]>) // no nonce: a claim in a transaction is never taken again
        .bind(None::<&str>) // and no claimant: its namespace is not the store's to know
        .bind(None::<&str>)
        .bind(None::<&str>)
        .bind(None::<i64>) // and no TTL: it never lapses unsettled (a crash rolls it back)
        .fetch_optional(&mut *connection)
        .await?;
    set_busy_timeout(connection, caller).await?;
    if let Some((token, _)) = taken {
        // Not told as a takeover: the transaction's claim commits with the effect, so its
        // body has nothing to reconcile.
        return Ok(Claim::acquired(Token::new(token.unsigned_abs())));
    }
    let held = sqlx::query(&sql.held)
        .bind(&call.key.as_bytes()[..])
        .fetch_one(&mut *connection)
        .await?;
    sql::held(&held).map_err(|err| sqlx::Error::Decode(err.into()))
}

async fn set_busy_timeout(
    connection: &mut SqliteConnection,
    millis: i64,
) -> Result<(), sqlx::Error> {
    sqlx::Executor::execute(
        &mut *connection,
        sqlx::raw_sql(&format!("PRAGMA busy_timeout = {millis}")),
    )
    .await?;
    Ok(())
}

/// Rolls back to `savepoint` and releases it: whatever the call did since is undone, and
/// the transaction is one level shallower again. A failure is logged: the transaction is
/// then unusable, and the caller's commit fails with it.
async fn end_savepoint(
    store: &SqliteStore,
    connection: &mut SqliteConnection,
    savepoint: &Savepoint,
) {
    let statements = format!("ROLLBACK TO SAVEPOINT {savepoint}; RELEASE SAVEPOINT {savepoint}");
    let ended = sql::within("sqlite", store.timeout(), async {
        sqlx::Executor::execute(&mut *connection, sqlx::raw_sql(&statements)).await
    })
    .await;
    if let Err(err) = ended {
        tracing::error!(error = %err, "rolling back to the call's savepoint failed; roll the transaction back");
    }
}

/// The error a caller can act on, saying how.
fn refused(err: Error, call: &Call<'_>) -> Error {
    let Error::Store(source) = &err else {
        return err;
    };
    let code = source
        .downcast_ref::<sqlx::Error>()
        .and_then(sqlx::Error::as_database_error)
        .and_then(|db| db.code())
        .map(|code| code.into_owned());
    match code.as_deref() {
        // SQLITE_BUSY_SNAPSHOT: another transaction committed after this one first read.
        Some("517") => Error::store(format!(
            "{source}: this transaction read the file before another one committed; roll back and retry the transaction (it will replay), and begin transactions that call idempotent functions with BEGIN IMMEDIATE"
        )),
        // SQLITE_BUSY: another transaction kept the file's write lock past the wait.
        Some("5") => {
            tracing::debug!(
                outcome = "rejected",
                wait_ms = call.wait.map_or(0, millis),
                "another transaction holds the file's write lock"
            );
            Error::InProgress
        }
        _ => err,
    }
}
