//! The purge task of `purge_every`.

use std::future::Future;
use std::time::Duration;

use crate::Error;

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
