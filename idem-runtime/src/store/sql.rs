//! What the SQL stores share (features `postgres`, `sqlite` and `mysql`): table names,
//! durations and fingerprints as columns, the reading of a live row, timeouts, and the
//! purge task.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

#[cfg(any(feature = "sqlite", feature = "mysql"))]
use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::store::Recorded;
#[cfg(any(feature = "sqlite", feature = "mysql"))]
use crate::Claim;
use crate::{limits, Error, Fingerprint, Key};

/// A table or schema name: a plain identifier, so that it can never inject SQL.
pub(crate) fn is_identifier(identifier: &str) -> bool {
    let mut chars = identifier.chars();
    identifier.len() <= 50
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A duration in milliseconds, clamped to the runtime's limit: `now + duration` must not
/// overflow.
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(limits::clamp(duration).as_millis())
        .unwrap_or(i64::MAX)
        .max(1)
}

/// The keys a call's steps can have, first and last (a step's key starts with its call's
/// first 16 bytes): the range every SQL store reads a call's steps from. The call's own
/// key is in it too, and is left out by the statements.
pub(crate) fn steps_range(call: &Key) -> ([u8; 32], [u8; 32]) {
    let (mut first, mut last) = ([0; 32], [0xff; 32]);
    first[..16].copy_from_slice(&call.as_bytes()[..16]);
    last[..16].copy_from_slice(&call.as_bytes()[..16]);
    (first, last)
}

/// A call's step records, read by `statement` (whose parameters are the call's key, then the
/// first and last key of [`steps_range`]; its columns the step's key and value) on
/// `executor`: what every SQL store's [`Store::steps`](crate::Store::steps) is.
pub(crate) async fn read_steps<'e, DB, E>(
    executor: E,
    statement: &str,
    call: &Key,
) -> Result<Vec<(Key, Bytes)>, sqlx::Error>
where
    DB: sqlx::Database,
    E: sqlx::Executor<'e, Database = DB>,
    for<'q> &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'r> (Vec<u8>, Option<Vec<u8>>): sqlx::FromRow<'r, DB::Row>,
{
    let (first, last) = steps_range(call);
    let rows: Vec<(Vec<u8>, Option<Vec<u8>>)> = sqlx::query_as(statement)
        .bind(&call.as_bytes()[..])
        .bind(&first[..])
        .bind(&last[..])
        .fetch_all(executor)
        .await?;
    rows.into_iter()
        .map(|(key, value)| {
            let key: [u8; 32] = key
                .try_into()
                .map_err(|_| sqlx::Error::Protocol("a step's key is not 32 bytes".into()))?;
            Ok((Key::from_bytes(key), Bytes::from(value.unwrap_or_default())))
        })
        .collect()
}

/// A fingerprint column: 32 bytes, or NULL.
pub(crate) fn fingerprint(raw: Option<Vec<u8>>) -> Result<Option<Fingerprint>, Error> {
    raw.map(|raw| {
        let raw: [u8; 32] = raw.try_into().map_err(|raw: Vec<u8>| {
            Error::store(format!(
                "a stored fingerprint has {} bytes, not 32",
                raw.len()
            ))
        })?;
        Ok(Fingerprint::from_bytes(raw))
    })
    .transpose()
}

/// The claim a live row answers (columns: token, completed, fingerprint, value): the key is
/// held or completed.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn held<R>(row: &R) -> Result<Claim, Error>
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    let completed: bool = row.try_get(1).map_err(Error::store)?;
    let fp = fingerprint(row.try_get(2).map_err(Error::store)?)?;
    Ok(if completed {
        let value: Option<Vec<u8>> = row.try_get(3).map_err(Error::store)?;
        Claim::Completed {
            value: Bytes::from(value.unwrap_or_default()),
            fingerprint: fp,
        }
    } else {
        Claim::InProgress { fingerprint: fp }
    })
}

/// Whether a live row is in progress under `nonce`: the caller's own claim, made by a try
/// whose reply was lost. An in-progress row keeps its claim's nonce in `value`.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn is_ours<R>(row: &R, nonce: u64) -> bool
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    let completed: bool = row.try_get(1).unwrap_or(true);
    let value: Option<Vec<u8>> = row.try_get(3).unwrap_or(None);
    // SQLite marks a claim given time back with a ninth byte after the nonce.
    let held = value.as_deref().filter(|value| value.len() <= 9);
    !completed && held.and_then(|value| value.get(..8)) == Some(&nonce.to_be_bytes()[..])
}

/// The row of a `lookup` statement (fingerprint, value, milliseconds left) as a [`Recorded`].
pub(crate) type LookupRow = (Option<Vec<u8>>, Option<Vec<u8>>, i64);

pub(crate) fn recorded(row: Option<LookupRow>) -> Result<Option<Recorded>, Error> {
    let Some((fp, value, left)) = row else {
        return Ok(None);
    };
    Ok(Some(Recorded::new(
        Bytes::from(value.unwrap_or_default()),
        fingerprint(fp)?,
        Some(Duration::from_millis(u64::try_from(left).unwrap_or(0))),
    )))
}

/// The milliseconds a `lease_left` statement read, as a duration; none for no live claim.
pub(crate) fn left(millis: Option<i64>) -> Option<Duration> {
    millis
        .and_then(|millis| u64::try_from(millis).ok())
        .filter(|millis| *millis > 0)
        .map(Duration::from_millis)
}

/// Runs one operation of `database` under `timeout`.
pub(crate) async fn within<T>(
    database: &str,
    timeout: Duration,
    operation: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(timeout, operation).await {
        Ok(result) => result.map_err(Error::store),
        Err(_) => Err(Error::store(format!(
            "{database} did not answer within {timeout:?}"
        ))),
    }
}

/// Stops the purge task of a store's `purge_every` when dropped.
#[derive(Debug)]
#[must_use = "the purge task stops when this guard is dropped"]
pub struct Purger(tokio::task::JoinHandle<()>);

impl Purger {
    /// Runs `purge` of `table` every `interval` on the current tokio runtime; a failed
    /// purge is logged and retried at the next interval.
    pub(crate) fn every<F, Fut>(interval: Duration, table: String, purge: F) -> Self
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: Future<Output = Result<u64, Error>> + Send,
    {
        Self(tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                match purge().await {
                    Ok(purged) => tracing::debug!(purged, table, "purged expired records"),
                    Err(err) => {
                        tracing::warn!(error = %err, table, "purging expired records failed")
                    }
                }
            }
        }))
    }
}

impl Drop for Purger {
    fn drop(&mut self) {
        self.0.abort();
    }
}
