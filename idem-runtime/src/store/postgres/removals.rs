//! Removals told to the tiers in front of the table ([`Store::watch_removals`]): a
//! completed record removed (an operator's reset, [`Store::remove`]) is told on the
//! table's channel with `pg_notify`, in the removal's own transaction; a tier's listener
//! hears it on a connection of its own.
//!
//! [`Store::watch_removals`]: crate::Store::watch_removals
//! [`Store::remove`]: crate::Store::remove

use std::time::Duration;

use sqlx::postgres::{PgListener, PgPoolOptions};

use super::PostgresDriver;
use crate::store::{Removal, RemovalWatch};

/// How often a listener with nothing to hear says it still listens: how long a listener
/// outlives the tier it told, at most.
const HEARTBEAT: Duration = Duration::from_secs(10);

/// The longest pause between two attempts to listen again.
const MOST_BACKOFF: Duration = Duration::from_secs(5);

/// Listens on `channel` for as long as `watch` wants, telling it each removal, and when the
/// feed is lost and back: on a connection of its own (a pool of one, to whichever server
/// the store's pool connects to now), made again after each loss.
pub(super) async fn listen(driver: PostgresDriver, channel: String, watch: RemovalWatch) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .acquire_timeout(super::DEFAULT_ACQUIRE_TIMEOUT)
            .connect_lazy_with((*driver.pool.connect_options()).clone());
        let listener = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            // A lost connection is told at once, before anything listens again: the tier
            // stops reading copies first.
            listener.eager_reconnect(false);
            listener.listen(&channel).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match listener.await {
            Ok(mut listener) => {
                backoff = Duration::from_millis(50);
                if !watch(Removal::Listening) {
                    return;
                }
                loop {
                    let heard = tokio::time::timeout(HEARTBEAT, listener.try_recv()).await;
                    let told = match heard {
                        // Nothing for a while: still listening, and still wanted?
                        Err(_) => watch(Removal::Listening),
                        Ok(Ok(Some(notification))) => {
                            match crate::Key::from_hex(notification.payload()) {
                                Some(key) => watch(Removal::Removed(&key)),
                                None => true, // not the runtime's: nothing of ours
                            }
                        }
                        // The connection was lost: removals may be missed until a new
                        // one listens.
                        Ok(Ok(None)) => {
                            if !watch(Removal::Lost) {
                                return;
                            }
                            break;
                        }
                        Ok(Err(err)) => {
                            tracing::debug!(error = %err, "the listener for removals failed; listening again");
                            if !watch(Removal::Lost) {
                                return;
                            }
                            break;
                        }
                    };
                    if !told {
                        return;
                    }
                }
            }
            Err(err) => {
                tracing::debug!(error = %err, "cannot listen for removals yet");
                if !watch(Removal::Lost) {
                    return;
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MOST_BACKOFF);
    }
}
