//! The limits of every duration the runtime accepts, checked in one place.

use std::time::Duration;

use crate::Error;

/// The shortest lease an operation accepts: 100 ms. A claim must outlive the round trips
/// that renew it; a shorter lease could lapse while its body still runs, and let a second
/// call take the key over.
pub const MIN_LEASE: Duration = Duration::from_millis(100);

/// The longest TTL, lease or wait timeout an operation accepts: 365 days. Stores clamp what
/// they are handed directly to it, so that no expiry overflows a clock or a column.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// Checks the durations of one operation; the error names the setting and its limits. A
/// TTL shorter than the lease is refused too. Every call checks, so the test that passes
/// is inline and the error is built out of line.
#[inline]
pub(crate) fn check(
    ttl: Duration,
    lease: Duration,
    wait_timeout: Option<Duration>,
) -> Result<(), Error> {
    let fits = |value: Duration, min: Duration| min <= value && value <= MAX_DURATION;
    if fits(ttl, Duration::from_millis(1))
        && fits(lease, MIN_LEASE)
        && lease <= ttl
        && wait_timeout.is_none_or(|wait| fits(wait, Duration::ZERO))
    {
        return Ok(());
    }
    refuse(ttl, lease, wait_timeout)
}

/// Why [`check`] refuses these durations.
#[cold]
fn refuse(ttl: Duration, lease: Duration, wait_timeout: Option<Duration>) -> Result<(), Error> {
    within("ttl", ttl, Duration::from_millis(1))?;
    within("lease", lease, MIN_LEASE)?;
    if ttl < lease {
        return Err(Error::config(format!(
            "the ttl of {ttl:?} is shorter than the lease of {lease:?}: a result must be kept at least as long as a call may hold its key, or its steps could expire while it runs; raise the ttl or shorten the lease"
        )));
    }
    match wait_timeout {
        Some(wait) => within("wait timeout", wait, Duration::ZERO),
        None => Ok(()),
    }
}

fn within(name: &str, value: Duration, min: Duration) -> Result<(), Error> {
    if value < min {
        return Err(Error::config(format!(
            "the {name} of {value:?} is shorter than the minimum of {min:?}"
        )));
    }
    if value > MAX_DURATION {
        return Err(Error::config(format!(
            "the {name} of {value:?} is longer than the maximum of 365 days"
        )));
    }
    Ok(())
}

/// What a store does with a duration it is handed: never past [`MAX_DURATION`].
#[cfg_attr(
    not(any(feature = "memory", feature = "redis", feature = "postgres")),
    allow(dead_code)
)]
pub(crate) fn clamp(duration: Duration) -> Duration {
    duration.min(MAX_DURATION)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bound_is_enforced_and_named() {
        let day = Duration::from_secs(86_400);
        assert!(check(day, MIN_LEASE, None).is_ok());
        assert!(check(MAX_DURATION, MAX_DURATION, Some(MAX_DURATION)).is_ok());
        for (ttl, lease, wait, named) in [
            (Duration::ZERO, MIN_LEASE, None, "ttl"),
            (Duration::MAX, MIN_LEASE, None, "ttl"),
            (day, Duration::from_millis(1), None, "lease"),
            (day, Duration::MAX, None, "lease"),
            (day, MIN_LEASE, Some(Duration::MAX), "wait timeout"),
            (
                Duration::from_secs(1),
                Duration::from_secs(2),
                None,
                "shorter than the lease",
            ),
        ] {
            let err = check(ttl, lease, wait).unwrap_err();
            assert!(matches!(err, Error::Config(_)), "{err}");
            assert!(err.to_string().contains(named), "{err}");
        }
    }

    #[test]
    fn stores_clamp_to_the_maximum() {
        assert_eq!(clamp(Duration::MAX), MAX_DURATION);
        assert_eq!(clamp(MIN_LEASE), MIN_LEASE);
    }
}
