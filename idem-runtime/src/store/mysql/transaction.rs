//! Claims inside the caller's own MySQL or MariaDB transaction (see
//! [`Operation::run_in_transaction`](crate::Operation::run_in_transaction)).
//!
//! The claim is the ordinary claim's, on the caller's connection and under a savepoint: a
//! read of the transaction's snapshot answers a record or a key in progress without a lock;
//! otherwise an `INSERT IGNORE` takes a key with no row, and a row is read under a shared
//! lock (`LOCK IN SHARE MODE`, which reads the latest committed version whatever the
//! isolation level), and taken over only if it lapsed. A duplicate in another transaction
//! waits on the holder's row lock, for the operation's wait (`innodb_lock_wait_timeout`, in whole seconds, set for the
//! claim only), then sees the holder's committed record and replays it, or takes the key if
//! the holder rolled back. The token is the table's next `AUTO_INCREMENT`, taken by the
//! insert (or the takeover's `REPLACE`) in the caller's transaction (see [`MySqlStore`]'s
//! schema): it commits with the claim, and no lock is held for it past its statement. The
//! insert sets the connection's `LAST_INSERT_ID()`.
//!
//! | outcome | round trips on the caller's connection |
//! |---|---|
//! | replay | 1: the savepoint (and the probe that the connection is in a transaction) with the read |
//! | first execution | 3: that, the take with its token (with the lock wait set around it), the completion with `RELEASE SAVEPOINT` |
//!
//! InnoDB keeps the row locks a claim took when the call rolls back to its savepoint (a
//! refused claim, an `Err`): they are held until the caller's transaction ends. Two
//! transactions taking over the same lapsed row, or an InnoDB gap lock between claims of
//! neighbouring keys, can deadlock: InnoDB then rolls one transaction back whole, the call
//! fails with [`Error::Store`] and nothing of that transaction is kept (fail closed); retry it.

use std::time::Duration;

use sqlx::mysql::{MySqlDatabaseError, MySqlRow};
use sqlx::{MySqlConnection, Row};

use super::{MySqlStore, CLAIM_LOOKS};
use crate::store::sql::{self, millis};
use crate::store::transaction::{sealed::Sealed, Call, Savepoint, Transactional};
use crate::{Claim, Error, Token};

impl Sealed for MySqlStore {}

impl Transactional for MySqlStore {
    type Connection = MySqlConnection;

    /// Two round trips for a first execution (the savepoint and a read of the snapshot;
    /// the take and its token, with the lock wait set around them in the same message); one
    /// for a replay.
    async fn __claim_in(
        &self,
        connection: &mut MySqlConnection,
        call: &Call<'_>,
        first: bool,
    ) -> Result<Claim, Error> {
        // On the caller's connection: the pool's may all be held by callers. Its session is
        // the caller's, checked below (its isolation) or the caller's to set (autocommit).
        let server = self
            .driver()
            .server(self.timeout(), &mut *connection)
            .await?;
        let bound = self.timeout() + call.wait.unwrap_or_default();
        let savepoint = &call.savepoint;
        let mut look = String::new();
        if first {
            // Outside a transaction each statement commits by itself: the savepoint does not
            // exist, and the claim would commit before the body's writes.
            look = format!("SAVEPOINT {savepoint}; ROLLBACK TO SAVEPOINT {savepoint}; ");
        }
        // The transaction's isolation level, a row of one column before the key's rows.
        look += &format!("SELECT CAST({} AS CHAR); ", server.isolation());
        look += &self.driver().sql.live_literal(call.key);
        let seen = sql::within("mysql", self.timeout(), async {
            sqlx::Executor::fetch_all(&mut *connection, sqlx::raw_sql(&look)).await
        })
        .await;
        let seen = match seen {
            Ok(seen) => seen,
            Err(err) if number(&err) == Some(1305) => return Err(outside_a_transaction()),
            Err(err) => {
                end_savepoint(self, connection, savepoint).await;
                return Err(refused(err));
            }
        };
        let (isolation, seen) = seen.split_at(seen.len().min(1));
        let isolation: Option<String> = isolation.first().and_then(|row| row.try_get(0).ok());
        if isolation.is_some_and(|level| level.eq_ignore_ascii_case("READ-UNCOMMITTED")) {
            end_savepoint(self, connection, savepoint).await;
            return Err(Error::config(
                "the caller's transaction runs at READ UNCOMMITTED: its reads see results whose transaction may still roll back, and would replay them; run it at READ COMMITTED or above",
            ));
        }
        // A record, or a key an ordinary call holds, is answered from the snapshot without a
        // lock: a lock on the holder's row would keep it from recording until this
        // transaction ends. The snapshot shows only what committed (at READ COMMITTED or
        // above, checked above).
        if let Some(row) = seen.first() {
            return sql::held(row);
        }
        let claimed = sql::within("mysql", bound, self.take_in(connection, call)).await;
        match claimed {
            Ok(claimed) => Ok(claimed),
            Err(err) => {
                end_savepoint(self, connection, savepoint).await;
                Err(refused(err))
            }
        }
    }

    /// A committed claim of an ordinary call holds the key: it answers
    /// [`Error::InProgress`] at once. A claim that locked the holder's row keeps that lock
    /// until the transaction ends, so the holder could not record while this one polled.
    async fn __before_polling(&self, _: &mut MySqlConnection) -> Result<(), Error> {
        tracing::debug!(
            outcome = "rejected",
            "the key is held by a call in progress"
        );
        Err(Error::InProgress)
    }

    /// The completion and the release of the savepoint: in one message for a record of up
    /// to [`INLINE_RECORD`] bytes (its bytes written in, in hex), and otherwise the record
    /// bound to a prepared statement, then the release, so that a record is never bounded by
    /// half the server's `max_allowed_packet`, as a hex literal would be.
    async fn __complete_in(
        &self,
        connection: &mut MySqlConnection,
        call: &Call<'_>,
        token: Token,
        record: &[u8],
        ttl: Duration,
    ) -> Result<bool, Error> {
        let release = format!("RELEASE SAVEPOINT {}", call.savepoint);
        let done = sql::within("mysql", self.timeout(), async {
            if record.len() <= INLINE_RECORD {
                let message = format!(
                    "{}; {release}",
                    self.driver()
                        .sql
                        .complete_literal(call.key, token, record, millis(ttl)),
                );
                return sqlx::Executor::execute(&mut *connection, sqlx::raw_sql(&message)).await;
            }
            let done = sqlx::query(&self.driver().sql.complete_in)
                .bind(record)
                .bind(millis(ttl))
                .bind(&call.key.as_bytes()[..])
                .bind(token)
                .execute(&mut *connection)
                .await?;
            raw(connection, &release).await?;
            Ok(done)
        })
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn __roll_back(&self, connection: &mut MySqlConnection, call: &Call<'_>) {
        end_savepoint(self, connection, &call.savepoint).await;
    }
}

impl MySqlStore {
    /// Takes the key under the call's savepoint, waiting for another transaction's row up to
    /// the call's wait: a key with no row by an `INSERT IGNORE`, in one message with the
    /// lock wait set before it and put back after it; a row, read under a shared lock, only
    /// if it lapsed.
    async fn take_in(
        &self,
        connection: &mut MySqlConnection,
        call: &Call<'_>,
    ) -> Result<Claim, sqlx::Error> {
        // Whole seconds: MySQL's least is 1; MariaDB's 0 does not wait at all.
        let wait = call.wait.map_or(0, |wait| wait.as_secs_f64().ceil() as u64);
        let set_wait = format!(
            "SET @idem_lock_wait = @@SESSION.innodb_lock_wait_timeout, \
             SESSION innodb_lock_wait_timeout = {}",
            wait.min(1 << 30)
        );
        let restore = "SET SESSION innodb_lock_wait_timeout = @idem_lock_wait";
        let insert = self
            .driver()
            .sql
            .insert_literal(call.key, call.fingerprint, call.lease);
        let message = format!("{set_wait}; {insert}; {restore}");
        for _ in 0..CLAIM_LOOKS {
            match inserted(connection, &message).await {
                Ok(Some(token)) => return Ok(Claim::acquired(token)),
                Ok(None) => {}
                Err(err) => {
                    // The message stopped before its end: the wait is put back before the error.
                    raw(connection, restore).await?;
                    return Err(err);
                }
            }
            // A row: the latest committed version, under a shared lock (every duplicate that
            // waited for the holder reads its record at once; exclusive locks would each
            // wait for the others' shared ones), taken over if it lapsed.
            raw(connection, &set_wait).await?;
            let taken = self.take_lapsed(connection, call).await;
            raw(connection, restore).await?;
            if let Some(claim) = taken? {
                return Ok(claim);
            }
        }
        Err(sqlx::Error::Protocol(
            "the key's row kept vanishing while it was claimed".into(),
        ))
    }

    /// The key's row, if it is still there: held, or taken over (with a token taken after
    /// the lock) because it lapsed.
    async fn take_lapsed(
        &self,
        connection: &mut MySqlConnection,
        call: &Call<'_>,
    ) -> Result<Option<Claim>, sqlx::Error> {
        let share = self.driver().sql.share_literal(call.key);
        let row: Option<MySqlRow> =
            sqlx::Executor::fetch_optional(&mut *connection, sqlx::raw_sql(&share)).await?;
        let Some(row) = row else {
            return Ok(None); // purged since the insert found it: insert again
        };
        let live: i64 = row.try_get(4)?;
        if live != 0 {
            return sql::held(&row).map(Some).map_err(decode);
        }
        let take = self
            .driver()
            .sql
            .take_literal(call.key, call.fingerprint, call.lease);
        let taken = sqlx::Executor::execute(&mut *connection, sqlx::raw_sql(&take)).await?;
        let token = super::given(taken.last_insert_id())?;
        Ok(Some(Claim::acquired(token)))
    }
}

/// Runs `message`, the lock wait's setting, an
/// [`insert_literal`](super::Statements::insert_literal) and the setting put back, on `conn`:
/// the token of the row it inserted, if it did (both from the insert's own result, which
/// the server sends for each statement).
async fn inserted(
    conn: &mut sqlx::MySqlConnection,
    message: &str,
) -> Result<Option<Token>, sqlx::Error> {
    let mut results = sqlx::Executor::fetch_many(&mut *conn, sqlx::raw_sql(message));
    let mut done = Vec::with_capacity(3);
    while let Some(result) = std::future::poll_fn(|cx| results.as_mut().poll_next(cx)).await {
        if let sqlx::Either::Left(result) = result? {
            done.push(result);
        }
    }
    let [_, insert, _] = &done[..] else {
        return Err(sqlx::Error::Protocol(format!(
            "a claim's message of 3 statements had {} results",
            done.len()
        )));
    };
    if insert.rows_affected() == 0 {
        return Ok(None);
    }
    super::given(insert.last_insert_id()).map(Some)
}

/// The largest record completed in the same message as its savepoint's release: written in
/// as a literal, it doubles in size, and a message is bounded by the server's
/// `max_allowed_packet` (16 MiB by default on MariaDB, 4 MiB on older MySQL); a larger one is
/// bound, for one more round trip.
const INLINE_RECORD: usize = 64 * 1024;

fn decode(err: Error) -> sqlx::Error {
    sqlx::Error::Decode(err.into())
}

/// A statement of the text protocol (savepoints and settings are not all preparable).
async fn raw(connection: &mut MySqlConnection, statement: &str) -> Result<(), sqlx::Error> {
    sqlx::Executor::execute(&mut *connection, sqlx::raw_sql(statement)).await?;
    Ok(())
}

/// Rolls back to `savepoint` and releases it: whatever the call did since is undone (its
/// row locks stay until the transaction ends). A failure is logged: the transaction is
/// then unusable, and the caller's commit fails with it.
async fn end_savepoint(
    store: &MySqlStore,
    connection: &mut MySqlConnection,
    savepoint: &Savepoint,
) {
    let ended = sql::within("mysql", store.timeout(), async {
        raw(connection, &format!("ROLLBACK TO SAVEPOINT {savepoint}")).await?;
        raw(connection, &format!("RELEASE SAVEPOINT {savepoint}")).await
    })
    .await;
    if let Err(err) = ended {
        tracing::error!(error = %err, "rolling back to the call's savepoint failed; roll the transaction back");
    }
}

/// The server's error number behind `err`, if it is one.
fn number(err: &Error) -> Option<u16> {
    let Error::Store(source) = err else {
        return None;
    };
    source
        .downcast_ref::<sqlx::Error>()?
        .as_database_error()?
        .try_downcast_ref::<MySqlDatabaseError>()
        .map(MySqlDatabaseError::number)
}

/// The savepoint probe failed (`ER_SP_DOES_NOT_EXIST`): outside a transaction, nothing was
/// claimed.
fn outside_a_transaction() -> Error {
    Error::store(
        "`run_in_transaction` claims inside the caller's transaction, and this connection is not in one: begin one and pass it",
    )
}

/// The error a caller can act on, saying how.
fn refused(err: Error) -> Error {
    match number(&err) {
        // ER_LOCK_WAIT_TIMEOUT: another transaction held the key past the wait.
        Some(1205) => {
            tracing::debug!(outcome = "rejected", "another transaction holds the key");
            Error::InProgress
        }
        // ER_LOCK_DEADLOCK: InnoDB rolled the whole transaction back.
        Some(1213) => Error::store(
            "a deadlock: the server rolled the transaction back, and nothing of it was kept; retry the transaction (it replays what committed)",
        ),
        _ => err,
    }
}
