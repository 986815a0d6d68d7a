//! The one error type of the runtime.

use std::error::Error as StdError;

/// The delay [`Error::retry_after`] suggests for a transient error: one second, what
/// `Retry-After` says for a `409` or `503` when the store cannot tell more.
pub const RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// A boxed error from a store, a codec or a key encoder.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Why an idempotent call did not produce a value of its own.
///
/// Every variant says whether the body ran. The body is never run by a call that returns
/// [`Error::InProgress`], [`Error::PayloadMismatch`], [`Error::Gone`], [`Error::Store`],
/// [`Error::Key`] or [`Error::Config`]; it **did** run for [`Error::Unrecorded`];
/// [`Error::Codec`] says in its message which side (encode or decode) failed.
///
/// The HTTP analogue in each doc line is what a service usually answers with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another call holds the key: `in_flight = "reject"` was chosen, a waiting call gave up
    /// after its wait timeout, or the holder is this call's own enclosing call (a body that
    /// calls its own operation with its own key), which would otherwise wait for itself.
    /// The body did not run. Retry later (HTTP 409): when the holder's lease ends, which
    /// [`Store::lease_left`](crate::Store::lease_left) tells by the store's clock (the HTTP
    /// layer sends it as `Retry-After`).
    ///
    /// ```
    /// use idem_runtime::{Error, InFlight, MemoryStore, Operation, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Error> {
    /// let store = MemoryStore::new();
    /// let op = Operation::new("billing.charge.v1").in_flight(InFlight::Reject);
    /// let key = op.key(&"order-17")?;
    /// let held = op.run(&store, &key, None, async {
    ///     // A duplicate while this body runs is refused, and told when to come back.
    ///     let duplicate = op.run(&store, &key, None, async { Ok::<_, Error>(2) }).await;
    ///     assert!(matches!(duplicate, Err(Error::InProgress)));
    ///     let left = store.lease_left(&key).await?;
    ///     assert!(left.is_some_and(|left| left <= idem_runtime::DEFAULT_LEASE));
    ///     Ok::<_, Error>(1)
    /// });
    /// # let _ = held.await;
    /// # Ok(())
    /// # }
    /// ```
    #[error("another call with this idempotency key is in progress")]
    InProgress,

    /// The key was used before with a different fingerprint (a different request payload).
    /// The body did not run. This is a client bug: do not retry with the same key (HTTP 422).
    #[error("the idempotency key was used before with a different payload")]
    PayloadMismatch,

    /// The store could not be reached, timed out or failed. The body did not run (the
    /// runtime fails closed). Retry when the store is back (HTTP 503).
    #[error("the idempotency store failed: {0}")]
    Store(#[source] BoxError),

    /// A recorded result could not be decoded as the caller's type (the type changed since
    /// it was recorded), or a recorded error as the error type. It never re-runs the body:
    /// change the type compatibly, bump the operation's namespace, or reset the call with
    /// [`Store::remove`](crate::Store::remove) of its key, which removes its steps too (HTTP
    /// 500). (A value that cannot be encoded as itself is recorded as gone instead.)
    #[error("idempotency record codec failed: {0}")]
    Codec(#[source] BoxError),

    /// The key completed within its TTL, but its result can no longer be replayed: the
    /// store evicted it (the memory store under its bounds), it was larger than the store
    /// keeps, an HTTP response was over the recording limit, or the value's encoding did not
    /// decode back as itself (a NaN, a map with non-string keys: the first caller got the
    /// value, and a step's body its step's). The body did **not** run
    /// again: a second run could repeat an effect (a charge) without a word. Look the
    /// outcome up elsewhere, or use a new key for a new operation (HTTP 410).
    #[error("the idempotency key completed, but its result can no longer be replayed")]
    Gone,

    /// The body **ran**, but its result could not be recorded: the store failed on every
    /// try until the claim's lease ran out (a server gone in a failover that did not come
    /// back in time, a partition, a full disk), or the lease ran out while the body ran and
    /// another call took the key (it recorded first, or runs it now: the source says
    /// which). It is the one error a call answers after its body ran (a step answers it too,
    /// when the step ran and its record could not be written). The call is not answered
    /// `Executed` with a value that a retry would not replay. This process goes on recording the result in the
    /// background, for as long as it would be replayed (its TTL): once the store takes it,
    /// every call of the key replays it, and this process's own calls of the key wait for
    /// it meanwhile. A call from another process after the claim lapsed and before the
    /// record landed, or after this process exited, runs the body again: reconcile the
    /// effect before retrying (look it up downstream, or fence it with the attempt's token)
    /// (HTTP 500: the request was processed, its answer is not recorded yet).
    #[error("the body ran, but its result could not be recorded before its lease ran out: {0}")]
    Unrecorded(#[source] BoxError),

    /// The key or fingerprint value could not be encoded deterministically (for example a
    /// NaN float). The body did not run (HTTP 400).
    #[error("the idempotency key could not be encoded: {0}")]
    Key(#[source] BoxError),

    /// The operation is configured outside the runtime's limits (a lease shorter than
    /// [`MIN_LEASE`](crate::MIN_LEASE), a duration longer than
    /// [`MAX_DURATION`](crate::MAX_DURATION)), or `on_cancel = "complete"` was called outside
    /// a tokio runtime. The body did not run. Fix the code (HTTP 500).
    #[error("invalid idempotency configuration: {0}")]
    Config(#[source] BoxError),
}

impl Error {
    /// Wraps a backend failure as [`Error::Store`]; for authors of [`Store`](crate::Store)
    /// implementations.
    ///
    /// ```
    /// let err = idem_runtime::Error::store("connection refused");
    /// assert!(matches!(err, idem_runtime::Error::Store(_)));
    /// ```
    pub fn store(source: impl Into<BoxError>) -> Self {
        Self::Store(source.into())
    }

    /// Wraps an encoding or decoding failure as [`Error::Codec`].
    ///
    /// ```
    /// let err = idem_runtime::Error::codec("truncated record");
    /// assert!(matches!(err, idem_runtime::Error::Codec(_)));
    /// ```
    pub fn codec(source: impl Into<BoxError>) -> Self {
        Self::Codec(source.into())
    }

    pub(crate) fn config(source: impl Into<BoxError>) -> Self {
        Self::Config(source.into())
    }
}

impl Error {
    /// Whether the same call may succeed later, unchanged: the one classification the HTTP
    /// layer's answers and the client's retries share, and the one a queue consumer's
    /// requeues should follow.
    ///
    /// | transient (retry later, with the same key) | final (retrying changes nothing) |
    /// |---|---|
    /// | [`Store`](Self::Store): the store is down or slow | [`PayloadMismatch`](Self::PayloadMismatch), [`Gone`](Self::Gone), [`Codec`](Self::Codec), [`Key`](Self::Key), [`Config`](Self::Config) |
    /// | [`InProgress`](Self::InProgress): the holder runs, or a wait timed out | [`Unrecorded`](Self::Unrecorded): the body ran; reconcile its effect before any retry |
    ///
    /// `Unrecorded` is final on purpose: a retry after the claim lapsed could run the body
    /// again, so a consumer dead-letters it and an operator looks (the operator's guide).
    ///
    /// ```
    /// use idem_runtime::Error;
    ///
    /// assert!(Error::InProgress.is_transient());
    /// assert!(Error::store("connection refused").is_transient());
    /// assert!(!Error::PayloadMismatch.is_transient());
    /// ```
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::InProgress | Self::Store(_))
    }

    /// How long to wait before retrying a transient error, when nothing better is known:
    /// [`RETRY_AFTER`] for a transient error, `None` for a final one. The HTTP layer
    /// answers a `409` with the holder's lease left instead, when the store can say
    /// ([`Store::lease_left`](crate::Store::lease_left)).
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        self.is_transient().then_some(RETRY_AFTER)
    }

    /// The variant's stable name, as serialized: `in_progress`, `payload_mismatch`, `gone`,
    /// `store`, `codec`, `key`, `config` or `unrecorded`.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::PayloadMismatch => "payload_mismatch",
            Self::Gone => "gone",
            Self::Store(_) => "store",
            Self::Codec(_) => "codec",
            Self::Key(_) => "key",
            Self::Config(_) => "config",
            Self::Unrecorded(_) => "unrecorded",
        }
    }

    fn source_text(&self) -> Option<String> {
        match self {
            Self::InProgress | Self::PayloadMismatch | Self::Gone => None,
            Self::Store(source)
            | Self::Codec(source)
            | Self::Key(source)
            | Self::Config(source)
            | Self::Unrecorded(source) => Some(source.to_string()),
        }
    }
}

/// The serialized form of an [`Error`]: its variant and, for those that have one, its
/// source's message.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename = "Error")]
struct Serialized {
    kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    source: Option<String>,
}

/// An `Error` serializes as `{"kind": "store", "source": "connection refused"}`, so that an
/// error type holding one can derive `Serialize` and `Deserialize`, as `cache_err` needs.
/// The source's chain is kept as its message only.
///
/// ```
/// let err = idem_runtime::Error::store("connection refused");
/// let json = serde_json::to_string(&err).unwrap();
/// assert_eq!(json, r#"{"kind":"store","source":"connection refused"}"#);
/// let back: idem_runtime::Error = serde_json::from_str(&json).unwrap();
/// assert_eq!(back.to_string(), err.to_string());
/// ```
impl serde::Serialize for Error {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        Serialized {
            kind: self.kind().to_owned(),
            source: self.source_text(),
        }
        .serialize(serializer)
    }
}

impl<'de> serde::Deserialize<'de> for Error {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let Serialized { kind, source } = Serialized::deserialize(deserializer)?;
        let source = || BoxError::from(source.clone().unwrap_or_default());
        Ok(match kind.as_str() {
            "in_progress" => Self::InProgress,
            "payload_mismatch" => Self::PayloadMismatch,
            "gone" => Self::Gone,
            "store" => Self::Store(source()),
            "codec" => Self::Codec(source()),
            "key" => Self::Key(source()),
            "config" => Self::Config(source()),
            "unrecorded" => Self::Unrecorded(source()),
            other => {
                return Err(serde::de::Error::unknown_variant(
                    other,
                    &[
                        "in_progress",
                        "payload_mismatch",
                        "gone",
                        "store",
                        "codec",
                        "key",
                        "config",
                        "unrecorded",
                    ],
                ))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_survives_serialization() {
        for err in [
            Error::InProgress,
            Error::PayloadMismatch,
            Error::Gone,
            Error::store("down"),
            Error::codec("truncated"),
            Error::Key("NaN".into()),
            Error::config("too long"),
        ] {
            let json = serde_json::to_string(&err).unwrap();
            let back: Error = serde_json::from_str(&json).unwrap();
            assert_eq!(back.kind(), err.kind(), "{json}");
            assert_eq!(back.to_string(), err.to_string(), "{json}");
        }
        let unknown = serde_json::from_str::<Error>(r#"{"kind":"lost"}"#).unwrap_err();
        assert!(
            unknown.to_string().contains("unknown variant `lost`"),
            "{unknown}"
        );
    }

    fn assert_bounds<T: StdError + Send + Sync + 'static>() {}

    #[test]
    fn only_a_store_failure_and_a_held_key_are_transient() {
        let transient = [Error::InProgress, Error::store("down")];
        let final_ = [
            Error::PayloadMismatch,
            Error::Gone,
            Error::codec("truncated"),
            Error::Key("NaN".into()),
            Error::config("too long"),
            Error::Unrecorded("lost".into()),
        ];
        for err in &transient {
            assert!(err.is_transient(), "{err}");
            assert_eq!(err.retry_after(), Some(RETRY_AFTER), "{err}");
        }
        for err in &final_ {
            assert!(!err.is_transient(), "{err}");
            assert_eq!(err.retry_after(), None, "{err}");
        }
    }

    #[test]
    fn error_is_send_sync_static() {
        assert_bounds::<Error>();
    }

    #[test]
    fn display_is_lowercase_and_names_the_cause() {
        let err = Error::store("connection refused");
        assert_eq!(
            err.to_string(),
            "the idempotency store failed: connection refused"
        );
        assert!(err.source().is_some());
    }
}
