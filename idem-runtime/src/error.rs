//! The one error type of the runtime.

use std::error::Error as StdError;

/// A boxed error from a store, a codec or a key encoder.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Why an idempotent call did not produce a value of its own.
///
/// Every variant says whether the body ran. The body is never run by a call that returns
/// [`Error::InProgress`], [`Error::PayloadMismatch`], [`Error::Store`], [`Error::Key`] or
/// [`Error::Config`];
/// [`Error::Codec`] says in its message which side (encode or decode) failed.
///
/// The HTTP analogue in each doc line is what a service usually answers with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another call holds the key: `in_flight = "reject"` was chosen, a waiting call gave up
    /// after its wait timeout, or the holder is this call's own enclosing call (a body that
    /// calls its own operation with its own key), which would otherwise wait for itself.
    /// The body did not run. Retry later (HTTP 409).
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

    /// The result could not be encoded for recording, or a recorded result could not be
    /// decoded as the caller's type. A decode failure never re-runs the body: change the
    /// type compatibly, or bump the operation's namespace (HTTP 500).
    #[error("idempotency record codec failed: {0}")]
    Codec(#[source] BoxError),

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

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_bounds<T: StdError + Send + Sync + 'static>() {}

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
