//! A connection to the primary that Redis Sentinel names, found again after a failover.
//!
//! The sentinels are asked for the primary of a named master (and its `ROLE` checked) when
//! the store first connects, and again after a command fails in a way that says the server
//! is gone or no longer the primary: the connection dropped or timed out, or a write was
//! refused with `READONLY` (a primary demoted to replica). The failed command is not sent
//! again here: it fails with [`Error::Store`](crate::Error::Store) like any store failure,
//! and the next command goes to the primary the sentinels name then.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult,
    ServerErrorKind, Value,
};

/// A handle to the primary of one master, shared by every clone of the store.
#[derive(Clone)]
pub(super) struct Primary(Arc<Shared>);

struct Shared {
    /// Asks the sentinels; one task at a time, so that a failover finds one new connection.
    sentinels: tokio::sync::Mutex<SentinelClient>,
    /// The connection to the primary as last found, until a command says it is stale.
    current: Mutex<Option<MultiplexedConnection>>,
    config: AsyncConnectionConfig,
}

impl Primary {
    /// The primary of `master`, as the sentinels at `sentinels` (`redis://host:port` each)
    /// name it; each step is bounded by `timeout`.
    pub(super) async fn connect(
        sentinels: Vec<String>,
        master: &str,
        timeout: Duration,
    ) -> RedisResult<Self> {
        let client = SentinelClient::build(
            sentinels,
            master.to_string(),
            None,
            SentinelServerType::Master,
        )?;
        let primary = Self(Arc::new(Shared {
            sentinels: tokio::sync::Mutex::new(client),
            current: Mutex::new(None),
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout)),
        }));
        primary.connection().await?;
        Ok(primary)
    }

    /// The connection to the primary: the current one, or a new one to the server the
    /// sentinels name now.
    async fn connection(&self) -> RedisResult<MultiplexedConnection> {
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let mut sentinels = self.0.sentinels.lock().await;
        // Another task may have found the primary while this one waited.
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let found = sentinels
            .get_async_connection_with_config(&self.0.config)
            .await?;
        *self
            .0
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(found.clone());
        tracing::debug!("connected to the primary the sentinels name");
        Ok(found)
    }

    fn current(&self) -> Option<MultiplexedConnection> {
        self.0
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Forgets the current connection after `error`, if it says that the server is gone or
    /// is no longer the primary.
    fn after<T>(&self, result: RedisResult<T>) -> RedisResult<T> {
        if let Err(error) = &result {
            if is_stale(error) {
                tracing::warn!(%error, "the primary is gone or demoted: the sentinels are asked again");
                *self
                    .0
                    .current
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = None;
            }
        }
        result
    }
}

/// Whether `error` says that the connection leads nowhere useful any more.
fn is_stale(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || error.is_timeout()
        || matches!(error.kind(), ErrorKind::Server(ServerErrorKind::ReadOnly))
}

impl ConnectionLike for Primary {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let mut connection = self.connection().await?;
            let result = connection.req_packed_command(cmd).await;
            self.after(result)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let mut connection = self.connection().await?;
            let result = connection
                .req_packed_commands(pipeline, offset, count)
                .await;
            self.after(result)
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}
