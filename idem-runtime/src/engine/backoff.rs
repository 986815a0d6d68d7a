//! The backoff of a call polling a key another process holds.

use std::hash::BuildHasher;
use std::time::Duration;

/// Exponential backoff with jitter for polling a key held by another process: 5 ms doubling
/// up to 250 ms, each delay drawn from its upper half so that waiters spread out.
pub(super) fn backoff(polls: u32) -> Duration {
    let ceiling = Duration::from_millis(5)
        .saturating_mul(1 << polls.min(6))
        .min(Duration::from_millis(250));
    let half = ceiling / 2;
    let jitter = std::collections::hash_map::RandomState::new().hash_one(polls);
    half + Duration::from_nanos(jitter % (half.as_nanos() as u64).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_stays_bounded() {
        for polls in 0..20 {
            let ceiling = Duration::from_millis((5_u64 << polls.min(6)).min(250));
            let delay = backoff(polls);
            assert!(
                delay >= ceiling / 2 && delay <= ceiling,
                "{polls}: {delay:?}"
            );
        }
    }
}
