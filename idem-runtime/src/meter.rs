//! Where the engine reports outcomes to the `metrics` facade; nothing without the feature.

use std::time::Duration;

use crate::engine::Namespace;

/// How a keyed call ended, as [`crate::metrics`] counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    Executed,
    Replayed,
    Released,
    Rejected,
    Mismatched,
}

impl Event {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::Released => "released",
            Self::Rejected => "rejected",
            Self::Mismatched => "mismatched",
        }
    }

    /// The event of a call's error, if it is one.
    pub(crate) fn of(error: &crate::Error) -> Option<Self> {
        match error {
            crate::Error::InProgress => Some(Self::Rejected),
            crate::Error::PayloadMismatch => Some(Self::Mismatched),
            _ => None,
        }
    }
}

/// Counts one call of `namespace` that ended with `event`.
#[cfg(feature = "metrics")]
pub(crate) fn count(namespace: &Namespace, event: Event) {
    ::metrics::counter!(
        crate::metrics::CALLS,
        "namespace" => namespace.label(),
        "outcome" => event.as_str(),
    )
    .increment(1);
}

/// Records how long a call of `namespace` took to settle its claim.
#[cfg(feature = "metrics")]
pub(crate) fn claimed(namespace: &Namespace, took: Duration) {
    ::metrics::histogram!(crate::metrics::CLAIM_DURATION, "namespace" => namespace.label())
        .record(took.as_secs_f64());
}

/// The start of a claim, when its latency is measured.
pub(crate) fn start() -> Option<tokio::time::Instant> {
    cfg!(feature = "metrics").then(tokio::time::Instant::now)
}

/// Reports how a call's claim settled: its latency since `started`, and its event if the
/// settling decided it (a replay, a rejection, a mismatch).
pub(crate) fn settled<T>(
    namespace: &Namespace,
    started: Option<tokio::time::Instant>,
    result: &Result<T, crate::Error>,
    replayed: impl FnOnce(&T) -> bool,
) {
    if let Some(started) = started {
        claimed(namespace, started.elapsed());
    }
    decided(namespace, result, replayed);
}

/// Reports a claim settled without waiting, from a record in this process's memory: its
/// latency is recorded as zero. It is a fraction of a microsecond, below any histogram's
/// first bucket, and reading the clock twice to measure it would cost the replay more than
/// all of its own work but the key's hash and the cache lookup.
pub(crate) fn settled_at_once<T>(namespace: &Namespace, result: &Result<T, crate::Error>) {
    claimed(namespace, Duration::ZERO);
    decided(namespace, result, |_| true);
}

fn decided<T>(
    namespace: &Namespace,
    result: &Result<T, crate::Error>,
    replayed: impl FnOnce(&T) -> bool,
) {
    let event = match result {
        Ok(settled) => replayed(settled).then_some(Event::Replayed),
        Err(error) => Event::of(error),
    };
    if let Some(event) = event {
        count(namespace, event);
    }
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn count(_: &Namespace, _: Event) {}

#[cfg(not(feature = "metrics"))]
pub(crate) fn claimed(_: &Namespace, _: Duration) {}
