//! How results are recorded: one tag byte, then the value's encoding.
//!
//! The tag tells a recorded value from a recorded error (`e`, only with an [`ErrorPolicy`]
//! that caches errors) and from a completion whose result was not kept (`g`, [`GONE`]), so the presence of a record, never its content, says that the
//! operation completed: `()`, `0`, `false`, `None` and `[]` replay like any value. Values are
//! `serde_json` ([`Json`], tag `v`) unless a surface records its own format (the HTTP layer's
//! responses, tag `h`): the engine runs with either, through [`ValueCodec`].

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::Error;

const VALUE: u8 = b'v';
const ERROR: u8 = b'e';
const GONE_TAG: u8 = b'g';

/// The record of a call that completed but whose result is not kept (too large, or
/// evicted from memory): every store keeps it like any record, and its replay is
/// [`Error::Gone`], never a second run.
pub(crate) const GONE: &[u8] = &[GONE_TAG];

/// What a record decodes to: the recorded `Ok` value, or a recorded error.
pub(crate) type Replayed<T, E> = Result<T, E>;

/// How the `Ok` values of `T` are recorded: behind their own tag byte, in their own format.
pub(crate) trait ValueCodec<T> {
    /// The tag byte of these records; never `e`, the tag of recorded errors.
    const TAG: u8;

    /// Appends the encoding of `value` to `buf`, which holds the tag already.
    fn encode_into(value: &T, buf: &mut Vec<u8>) -> Result<(), Error>;

    /// Decodes what follows the tag: a slice of the record, which a value may share
    /// instead of copying (the HTTP layer's bodies do).
    fn decode(payload: &Bytes) -> Result<T, Error>;

    /// The record of `value`, tag included.
    fn record(value: &T) -> Result<Bytes, Error> {
        encode_value::<Self, T>(value)
    }

    /// [`record`](Self::record), with the value its replays decode to where making the
    /// record decoded it anyway (`None` where it did not).
    fn record_decoded(value: &T) -> (Result<Bytes, Error>, Option<T>) {
        (Self::record(value), None)
    }

    /// What a caller whose body returned `value` is answered when the value could not be
    /// recorded: `None` (the default), [`Error::Unrecorded`]; or the value itself, marked
    /// as not recorded (the HTTP layer's responses).
    fn unrecorded(value: T) -> Option<T> {
        let _ = value;
        None
    }
}

/// Values as `serde_json`: the format of every operation but the HTTP layer's.
pub(crate) struct Json;

impl<T: Serialize + DeserializeOwned> ValueCodec<T> for Json {
    const TAG: u8 = VALUE;

    fn encode_into(value: &T, buf: &mut Vec<u8>) -> Result<(), Error> {
        serde_json::to_writer(buf, value).map_err(|e| Error::codec(EncodeError(e)))
    }

    fn decode(payload: &Bytes) -> Result<T, Error> {
        serde_json::from_slice(payload).map_err(|e| Error::codec(DecodeError(e)))
    }

    /// A value is recorded only if its encoding decodes back as `T`: JSON has no NaN or
    /// infinity (`serde_json` writes `null`), and a map key must be a string. A value that
    /// cannot make the trip is recorded as [`GONE`] instead: its caller gets the value, and
    /// every retry [`Error::Gone`], never a second run and never a record that cannot be
    /// replayed until its TTL. (`Some(None)` encodes as `None` does and decodes as `None`:
    /// no check at run time can see it; the attribute refuses such a type.)
    fn record(value: &T) -> Result<Bytes, Error> {
        Self::record_decoded(value).0
    }

    /// The decoding that checks the record is its replays' value: a store that keeps values
    /// beside their records keeps this one, so that a replay in memory is what a replay
    /// from the record is (a field `serde` skips comes back as its default in both).
    fn record_decoded(value: &T) -> (Result<Bytes, Error>, Option<T>) {
        let faithful =
            encode_value::<Self, T>(value).and_then(|record| {
                match serde_json::from_slice::<T>(&record[1..]) {
                    Ok(decoded) => Ok((record, decoded)),
                    Err(err) => Err(Error::codec(UnfaithfulError(err))),
                }
            });
        match faithful {
            Ok((record, decoded)) => (Ok(record), Some(decoded)),
            Err(err) => (Ok(unrecordable(&err)), None),
        }
    }
}

/// The record of a body's value that has no record of itself (`err` says why): [`GONE`].
/// The body ran, so its caller gets the value and every retry [`Error::Gone`]: never a
/// second run, and never a record that cannot be replayed until its TTL.
pub(crate) fn unrecordable(err: &Error) -> Bytes {
    tracing::error!(
        outcome = "gone",
        error = %err,
        "the result cannot be recorded as itself: its key is recorded as gone, and retries get `Error::Gone`"
    );
    Bytes::from_static(GONE)
}

fn encode<V: Serialize + ?Sized>(tag: u8, value: &V) -> Result<Bytes, Error> {
    let mut buf = Vec::with_capacity(128);
    buf.push(tag);
    serde_json::to_writer(&mut buf, value).map_err(|e| Error::codec(EncodeError(e)))?;
    Ok(buf.into())
}

pub(crate) fn encode_value<C: ValueCodec<T> + ?Sized, T>(value: &T) -> Result<Bytes, Error> {
    let mut buf = Vec::with_capacity(128);
    buf.push(C::TAG);
    C::encode_into(value, &mut buf)?;
    Ok(buf.into())
}

pub(crate) fn decode<C, T, E, P>(record: &Bytes, policy: &P) -> Result<Replayed<T, E>, Error>
where
    C: ValueCodec<T>,
    P: ErrorPolicy<E> + ?Sized,
{
    match record.split_first() {
        Some((&GONE_TAG, _)) => Err(Error::Gone),
        Some((&ERROR, json)) => policy.decode(json).map(Err),
        Some((&tag, _)) if tag == C::TAG => C::decode(&record.slice(1..)).map(Ok),
        Some((&(VALUE | HTTP), _)) => Err(Error::codec(
            "the record was made by another kind of call (an HTTP response, or a function's value)",
        )),
        _ => Err(Error::codec("the record is not in the idem format")),
    }
}

/// The tag of recorded HTTP responses (`crate::http`), named here so that every tag is in
/// one place.
pub(crate) const HTTP: u8 = b'h';

/// The result could not be encoded as JSON.
#[derive(Debug, thiserror::Error)]
#[error("encoding the result failed: {0}")]
struct EncodeError(#[source] serde_json::Error);

/// The encoding of a result does not decode back as its own type.
#[derive(Debug, thiserror::Error)]
#[error("the result's encoding does not decode back as its type (a NaN or infinite float?): {0}")]
struct UnfaithfulError(#[source] serde_json::Error);

/// The record could not be decoded as the caller's type.
#[derive(Debug, thiserror::Error)]
#[error("the recorded result does not decode as this call's type (did the type change since it was recorded? `Store::remove` of the call's key resets it, steps included): {0}")]
struct DecodeError(#[source] serde_json::Error);

/// What happens to an `Err` returned by the body.
///
/// [`ReleaseErrors`] (the default) releases the key so that a retry runs the body again;
/// [`CacheErrors`] records the errors its predicate accepts and replays them like values.
pub trait ErrorPolicy<E> {
    /// Encodes `err` for recording when it is final, or returns `None` to release the key.
    fn encode(&self, err: &E) -> Option<Result<Bytes, Error>>;

    /// Decodes a recorded error (its JSON, without the tag byte).
    ///
    /// # Errors
    ///
    /// [`Error::Codec`] when the bytes do not decode as `E`, or this policy never records
    /// errors.
    fn decode(&self, json: &[u8]) -> Result<E, Error>;
}

/// Every `Err` releases the key; see [`ErrorPolicy`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ReleaseErrors;

impl<E> ErrorPolicy<E> for ReleaseErrors {
    fn encode(&self, _: &E) -> Option<Result<Bytes, Error>> {
        None
    }

    fn decode(&self, _: &[u8]) -> Result<E, Error> {
        Err(Error::codec(
            "the record holds an error, but this call does not cache errors (`cache_err`)",
        ))
    }
}

/// Errors accepted by the predicate are final: recorded and replayed; see [`ErrorPolicy`].
#[derive(Clone, Copy, Debug)]
pub struct CacheErrors<F>(pub F);

impl<E, F> ErrorPolicy<E> for CacheErrors<F>
where
    E: Serialize + DeserializeOwned,
    F: Fn(&E) -> bool,
{
    fn encode(&self, err: &E) -> Option<Result<Bytes, Error>> {
        (self.0)(err).then(|| encode(ERROR, err))
    }

    fn decode(&self, json: &[u8]) -> Result<E, Error> {
        serde_json::from_slice(json).map_err(|e| Error::codec(DecodeError(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_and_falsy_values_have_non_empty_records() {
        for record in [
            encode_value::<Json, _>(&()).unwrap(),
            encode_value::<Json, _>(&0).unwrap(),
            encode_value::<Json, _>(&false).unwrap(),
            encode_value::<Json, _>(&None::<u8>).unwrap(),
            encode_value::<Json, _>(&Vec::<u8>::new()).unwrap(),
        ] {
            assert!(record.len() > 1, "{record:?}");
        }
        let back: Replayed<(), ()> =
            decode::<Json, _, _, _>(&encode_value::<Json, _>(&()).unwrap(), &ReleaseErrors)
                .unwrap();
        assert_eq!(back, Ok(()));
    }

    #[test]
    fn errors_round_trip_only_with_a_caching_policy() {
        let policy = CacheErrors(|e: &String| e.starts_with("declined"));
        assert!(policy.encode(&"timeout".to_string()).is_none());
        let record = policy
            .encode(&"declined: card".to_string())
            .unwrap()
            .unwrap();
        let back: Replayed<u32, String> = decode::<Json, _, _, _>(&record, &policy).unwrap();
        assert_eq!(back, Err("declined: card".to_string()));

        let err = decode::<Json, u32, String, _>(&record, &ReleaseErrors).unwrap_err();
        assert!(matches!(err, Error::Codec(_)), "{err}");
    }

    #[test]
    fn a_gone_record_replays_as_gone_whatever_the_type() {
        let err =
            decode::<Json, u64, (), _>(&Bytes::from_static(GONE), &ReleaseErrors).unwrap_err();
        assert!(matches!(err, Error::Gone), "{err}");
        let policy = CacheErrors(|_: &String| true);
        let err =
            decode::<Json, String, String, _>(&Bytes::from_static(GONE), &policy).unwrap_err();
        assert!(matches!(err, Error::Gone), "{err}");
    }

    #[test]
    fn a_record_of_another_type_is_a_codec_error() {
        let record = encode_value::<Json, _>(&"text".to_string()).unwrap();
        let err = decode::<Json, u64, (), _>(&record, &ReleaseErrors).unwrap_err();
        assert!(matches!(err, Error::Codec(_)));
        let err = decode::<Json, u64, (), _>(&Bytes::new(), &ReleaseErrors).unwrap_err();
        assert!(matches!(err, Error::Codec(_)));
    }
}
