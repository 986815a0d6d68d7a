//! What the engine's core knows of an operation ([`Settings`]), and the span of a call.

use std::time::Duration;

use crate::namespace::Namespace;
use crate::Key;

/// What a call does when it finds its key in progress.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum InFlight {
    /// Wait for the running call and share its outcome: its recorded result, or, if it
    /// released the key, a fresh claim. Bounded by the wait timeout (the lease by default),
    /// after which the call fails with [`Error::InProgress`](crate::Error::InProgress).
    #[default]
    Wait,
    /// Fail at once with [`Error::InProgress`](crate::Error::InProgress).
    Reject,
}

/// Everything about an operation but its error policy: what the engine's core needs, so
/// that the core is compiled once, in this crate, and not once per `#[idempotent]`
/// function in the user's (`scripts/build_time.py` measures what that saves).
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    pub(crate) namespace: Namespace,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) in_flight: InFlight,
    pub(crate) wait_timeout: Option<Duration>,
    /// How long the caller waits for a completion that failed before it is answered
    /// [`Error::Unrecorded`](crate::Error::Unrecorded) (the guard goes on retrying within the lease without it);
    /// `None`: until the lease runs out.
    pub(crate) record_wait: Option<Duration>,
}

impl Settings {
    /// How long a duplicate waits for the holder: as told, else [`DEFAULT_WAIT`](super::DEFAULT_WAIT).
    pub(crate) fn wait(&self) -> std::time::Duration {
        self.wait_timeout.unwrap_or(super::DEFAULT_WAIT)
    }

    /// The span of one call: the namespace and a short digest of the key, never its value.
    /// A disabled span when nothing could see it: building and entering one that no
    /// subscriber takes still cost a memory replay a tenth of its time.
    pub(crate) fn span(&self, key: &Key) -> tracing::Span {
        if traced() {
            self.traced_span(key)
        } else {
            tracing::Span::none()
        }
    }

    /// The span itself, for a caller that asked [`traced`] already.
    pub(super) fn traced_span(&self, key: &Key) -> tracing::Span {
        tracing::debug_span!("idempotent", namespace = %&*self.namespace, key = %key.short())
    }
}

/// Whether a call's span can be seen: a subscriber may take debug spans, or, with no
/// subscriber, a `log` logger may take debug records (`tracing`'s `log` feature writes
/// spans to it). Two atomic loads; the span macro checks its callsite's interest after.
#[inline]
pub(super) fn traced() -> bool {
    use tracing::level_filters::{LevelFilter, STATIC_MAX_LEVEL};
    (STATIC_MAX_LEVEL >= LevelFilter::DEBUG && LevelFilter::current() >= LevelFilter::DEBUG)
        || log::max_level() >= log::LevelFilter::Debug
}
