//! Rows and columns as every dialect reads and writes them: table names, durations and
//! fingerprints as columns, a live row as a claim, and the three reads the dialects share
//! ([`Table`]: a result, a lease, a call's steps), generic over the database.

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

/// How long a claim that lapses unsettled is kept, in milliseconds as a row keeps it: its
/// call's TTL, zero included (a claim not to be remembered).
pub(crate) fn kept_ms(ttl: Duration) -> i64 {
    i64::try_from(limits::clamp(ttl).as_millis()).unwrap_or(i64::MAX)
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

/// The key of the row that traces an operator's release of `call`'s claim: a digest of
/// its own, outside every call's range of steps as surely as two calls' keys differ.
pub(crate) fn trace_key(call: &Key) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut digest = Sha256::new();
    digest.update(b"idem.released-by-operator\0");
    digest.update(call.as_bytes());
    digest.finalize().into()
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

/// A store's table as the core knows it: its name, and the statements of the three reads
/// every dialect runs alike, on its pool, each with the key (`$1`/`?1`) first. `steps` then
/// takes the first and last key of [`steps_range`], and returns the step's key and value;
/// `lookup` returns (fingerprint, value, milliseconds left) of a completed row, `lease_left`
/// the milliseconds left of a claim in progress, `holding` those and the holder's text.
pub struct Table {
    /// The table as the user named it, for messages.
    pub(crate) name: String,
    pub(crate) lookup: String,
    pub(crate) lease_left: String,
    pub(crate) holding: String,
    /// The token an operator's release traced for a call (the trace's key).
    pub(crate) released: String,
    pub(crate) steps: String,
    /// What an operator runs ([`Admin`](crate::admin::Admin)).
    #[cfg(feature = "admin")]
    pub(crate) admin: super::AdminSql,
}

/// A database the SQL core reads in one way: the blanket implementation holds, once, the
/// bounds that `sqlx` asks of a generic query, so that the store's code states none.
pub trait Reads: sqlx::Database {
    /// The completed record of `key`, read by `table.lookup`.
    fn lookup<'a>(
        pool: &'a sqlx::Pool<Self>,
        table: &'a Table,
        key: &'a Key,
    ) -> impl Future<Output = Result<Option<LookupRow>, sqlx::Error>> + Send + 'a;

    /// What is left of the lease of `key`, read by `table.lease_left`; none for no live
    /// claim.
    fn lease_left<'a>(
        pool: &'a sqlx::Pool<Self>,
        table: &'a Table,
        key: &'a Key,
    ) -> impl Future<Output = Result<Option<Duration>, sqlx::Error>> + Send + 'a;

    /// What is left of the lease of `key` and who holds it, read by `table.holding`; none
    /// for no live claim.
    fn holding<'a>(
        pool: &'a sqlx::Pool<Self>,
        table: &'a Table,
        key: &'a Key,
    ) -> impl Future<Output = Result<Option<(Duration, Option<String>)>, sqlx::Error>> + Send + 'a;

    /// The token an operator last released of `call`'s claims, read by `table.released`.
    fn released<'a>(
        pool: &'a sqlx::Pool<Self>,
        table: &'a Table,
        call: &'a Key,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;

    /// The step records of `call`, read by `table.steps`.
    fn steps<'a>(
        pool: &'a sqlx::Pool<Self>,
        table: &'a Table,
        call: &'a Key,
    ) -> impl Future<Output = Result<Vec<(Key, Bytes)>, sqlx::Error>> + Send + 'a;
}

/// The row of a `lookup` statement: fingerprint, value, milliseconds left.
pub(crate) type LookupRow = (Option<Vec<u8>>, Option<Vec<u8>>, i64);

/// A `lookup` row as the record it is.
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

impl<DB> Reads for DB
where
    DB: sqlx::Database,
    for<'q> &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'r> LookupRow: sqlx::FromRow<'r, DB::Row>,
    for<'r> (i64,): sqlx::FromRow<'r, DB::Row>,
    for<'r> (i64, Option<String>): sqlx::FromRow<'r, DB::Row>,
    for<'r> (Vec<u8>, Option<Vec<u8>>): sqlx::FromRow<'r, DB::Row>,
{
    async fn lookup<'a>(
        pool: &'a sqlx::Pool<Self>,
        table: &'a Table,
        key: &'a Key,
    ) -> Result<Option<LookupRow>, sqlx::Error> {
        sqlx::query_as(&table.lookup)
            .bind(&key.as_bytes()[..])
            .fetch_optional(pool)
            .await
    }

    async fn lease_left<'a>(
        pool: &'a sqlx::Pool<Self>,
        table: &'a Table,
        key: &'a Key,
    ) -> Result<Option<Duration>, sqlx::Error> {
        let row: Option<(i64,)> = sqlx::query_as(&table.lease_left)
            .bind(&key.as_bytes()[..])
            .fetch_optional(pool)
            .await?;
        Ok(row
            .and_then(|(millis,)| u64::try_from(millis).ok())
            .filter(|millis| *millis > 0)
            .map(Duration::from_millis))
    }

    async fn holding<'a>(
        pool: &'a sqlx::Pool<Self>,
        table: &'a Table,
        key: &'a Key,
    ) -> Result<Option<(Duration, Option<String>)>, sqlx::Error> {
        let row: Option<(i64, Option<String>)> = sqlx::query_as(&table.holding)
            .bind(&key.as_bytes()[..])
            .fetch_optional(pool)
            .await?;
        Ok(row.and_then(|(millis, holder)| {
            u64::try_from(millis)
                .ok()
                .filter(|millis| *millis > 0)
                .map(|millis| (Duration::from_millis(millis), holder))
        }))
    }

    async fn released<'a>(
        pool: &'a sqlx::Pool<Self>,
        table: &'a Table,
        call: &'a Key,
    ) -> Result<Option<i64>, sqlx::Error> {
        let row: Option<(i64,)> = sqlx::query_as(&table.released)
            .bind(&trace_key(call)[..])
            .fetch_optional(pool)
            .await?;
        Ok(row.map(|(token,)| token))
    }

    async fn steps<'a>(
        pool: &'a sqlx::Pool<Self>,
        table: &'a Table,
        call: &'a Key,
    ) -> Result<Vec<(Key, Bytes)>, sqlx::Error> {
        let (first, last) = steps_range(call);
        let rows: Vec<(Vec<u8>, Option<Vec<u8>>)> = sqlx::query_as(&table.steps)
            .bind(&call.as_bytes()[..])
            .bind(&first[..])
            .bind(&last[..])
            .fetch_all(pool)
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
}
