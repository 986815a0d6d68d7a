//! The distributed store, on Redis (standalone or cluster), with `redis`.
//!
//! The scripts use only `HMGET`, `HGET`, `HSET` with several fields, `PEXPIRE`, `TIME` and
//! `DEL`, all in Redis since 4.0 and kept by Valkey. The tests run against Redis 7.0; Valkey is
//! expected to work but is not tested here.
//!
//! # Layout
//!
//! One hash per record, at `<prefix>{<64 hex digits of the key>}` (the braces are a hash tag:
//! every key of a record lives in one cluster slot), with the fields:
//!
//! | field | meaning |
//! |---|---|
//! | `s` | state: `p` in progress, `c` completed, `r` released |
//! | `t` | the fencing token, in decimal |
//! | `f` | the fingerprint (32 bytes), empty when none |
//! | `v` | the recorded value, when completed |
//!
//! An absent or released record never holds a value, so a claim need not clear `v`.
//! The hash's own expiry (`PEXPIRE`, judged by the server's clock) is the lease while in
//! progress and the TTL once completed. A released record keeps its token until its lease
//! lapses, so that the next claim's token is larger. Tokens are the server's `TIME` in
//! microseconds, or the previous token plus one if that is larger: they grow even across
//! records that expired.
//!
//! Every operation is one Lua script, sent with `EVALSHA` (one round trip; the script is
//! loaded again transparently after a `NOSCRIPT`), under a per-operation timeout.

use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, Value};

use crate::{limits, Claim, Error, Fingerprint, Flights, Key, Store, Token};

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "idem:";

/// The default time an operation may take before it fails with [`Error::Store`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local record = redis.call('HMGET', KEYS[1], 's', 't', 'f', 'v')
local state = record[1]
if state == 'c' then
    return {'c', record[3], record[4]}
elseif state == 'p' then
    return {'p', record[3]}
end
local now = redis.call('TIME')
local token = tonumber(now[1]) * 1000000 + tonumber(now[2])
local previous = tonumber(record[2])
if previous and previous >= token then
    token = previous + 1
end
token = string.format('%.0f', token)
redis.call('HSET', KEYS[1], 's', 'p', 't', token, 'f', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'a', token}
",
    )
});

static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local record = redis.call('HMGET', KEYS[1], 's', 't')
if record[1] ~= 'p' or record[2] ~= ARGV[1] then
    return 0
end
redis.call('HSET', KEYS[1], 's', 'c', 'v', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
",
    )
});

static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local record = redis.call('HMGET', KEYS[1], 's', 't')
if record[1] ~= 'p' or record[2] ~= ARGV[1] then
    return 0
end
redis.call('HSET', KEYS[1], 's', 'r')
return 1
",
    )
});

static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local record = redis.call('HMGET', KEYS[1], 's', 't')
if record[1] ~= 'p' or record[2] ~= ARGV[1] then
    return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
",
    )
});

static REMOVE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local state = redis.call('HGET', KEYS[1], 's')
redis.call('DEL', KEYS[1])
if state == 'p' or state == 'c' then
    return 1
end
return 0
",
    )
});

/// A store shared by every process that connects to the same Redis server or cluster.
///
/// Cloning is cheap; clones share the connection and the in-process registry of running
/// calls.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_runtime::RedisStore;
///
/// # async fn example() -> Result<(), idem_runtime::Error> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379")
///     .await?
///     .with_prefix("billing:idem:")?
///     .with_timeout(Duration::from_secs(1));
/// # drop(store);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
    timeout: Duration,
    flights: Arc<Flights>,
}

/// The connections a store can use.
#[derive(Clone)]
enum Connection {
    Manager(ConnectionManager),
    Multiplexed(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Manager(c) => c.req_packed_command(cmd),
            Self::Multiplexed(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Manager(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Multiplexed(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Manager(c) => c.get_db(),
            Self::Multiplexed(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

impl RedisStore {
    /// Connects to one Redis server through a connection manager that reconnects on its own.
    /// The URL is `redis://[user:password@]host[:port][/db]` (or `rediss://` where the `redis`
    /// crate was built with TLS).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the URL is invalid or the server cannot be reached within
    /// [`DEFAULT_TIMEOUT`].
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let client = redis::Client::open(url).map_err(Error::store)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(DEFAULT_TIMEOUT))
            .set_response_timeout(Some(DEFAULT_TIMEOUT))
            .set_number_of_retries(2);
        let manager = within(
            DEFAULT_TIMEOUT,
            ConnectionManager::new_with_config(client, config),
        )
        .await?
        .map_err(Error::store)?;
        Ok(Self::from_manager(manager))
    }

    /// Connects to a Redis Cluster through any of its nodes (`redis://host:port` each).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when a URL is invalid or the cluster cannot be reached within
    /// [`DEFAULT_TIMEOUT`].
    pub async fn connect_cluster<'a>(
        nodes: impl IntoIterator<Item = &'a str>,
    ) -> Result<Self, Error> {
        let client = redis::cluster::ClusterClient::builder(nodes)
            .connection_timeout(DEFAULT_TIMEOUT)
            .response_timeout(DEFAULT_TIMEOUT)
            .build()
            .map_err(Error::store)?;
        let connection = within(DEFAULT_TIMEOUT, client.get_async_connection())
            .await?
            .map_err(Error::store)?;
        Ok(Self::from_cluster(connection))
    }

    /// Uses an existing connection manager.
    pub fn from_manager(manager: ConnectionManager) -> Self {
        Self::with_connection(Connection::Manager(manager))
    }

    /// Uses an existing multiplexed connection (which does not reconnect on its own).
    pub fn from_multiplexed(connection: MultiplexedConnection) -> Self {
        Self::with_connection(Connection::Multiplexed(connection))
    }

    /// Uses an existing cluster connection.
    pub fn from_cluster(connection: ClusterConnection) -> Self {
        Self::with_connection(Connection::Cluster(connection))
    }

    fn with_connection(connection: Connection) -> Self {
        Self {
            connection,
            prefix: DEFAULT_PREFIX.into(),
            timeout: DEFAULT_TIMEOUT,
            flights: Arc::default(),
        }
    }

    /// Sets the prefix of every record's key (default [`DEFAULT_PREFIX`]), to share a server
    /// between applications.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the prefix holds `{` or `}`: it would change the hash tag, and
    /// put every record of a cluster in one slot.
    pub fn with_prefix(mut self, prefix: &str) -> Result<Self, Error> {
        if prefix.contains(['{', '}']) {
            return Err(Error::store(format!(
                "the redis key prefix {prefix:?} must not contain `{{` or `}}`"
            )));
        }
        self.prefix = prefix.into();
        Ok(self)
    }

    /// Sets how long one operation may take before it fails with [`Error::Store`] (default
    /// [`DEFAULT_TIMEOUT`]). The body never runs after such a failure.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The Redis key of a record.
    fn record(&self, key: &Key) -> String {
        format!("{}{{{}}}", self.prefix, key.to_hex())
    }

    /// Runs one script under the timeout: one round trip.
    async fn invoke(&self, script: &Script, key: &Key, args: &[&[u8]]) -> Result<Value, Error> {
        let mut invocation = script.key(self.record(key));
        for arg in args {
            invocation.arg(*arg);
        }
        let mut connection = self.connection.clone();
        within(self.timeout, invocation.invoke_async(&mut connection))
            .await?
            .map_err(Error::store)
    }

    /// Runs a compare-and-set script: `1` applied, `0` refused.
    async fn fenced(&self, script: &Script, key: &Key, args: &[&[u8]]) -> Result<bool, Error> {
        match self.invoke(script, key, args).await? {
            Value::Int(applied) => Ok(applied == 1),
            other => Err(unexpected(&other)),
        }
    }
}

async fn within<T>(
    timeout: Duration,
    operation: impl std::future::Future<Output = T>,
) -> Result<T, Error> {
    tokio::time::timeout(timeout, operation)
        .await
        .map_err(|_| Error::store(format!("redis did not answer within {timeout:?}")))
}

fn millis(duration: Duration) -> Vec<u8> {
    // PEXPIRE needs at least 1 ms, and refuses (after the script's earlier writes) an expiry
    // past its clock's range: clamped to the runtime's limit.
    limits::clamp(duration)
        .as_millis()
        .max(1)
        .to_string()
        .into_bytes()
}

fn unexpected(value: &Value) -> Error {
    Error::store(format!("unexpected reply from an idem script: {value:?}"))
}

fn bytes(value: Value) -> Result<Vec<u8>, Error> {
    match value {
        Value::BulkString(bytes) => Ok(bytes),
        Value::Nil => Ok(Vec::new()),
        other => Err(unexpected(&other)),
    }
}

fn fingerprint(value: Value) -> Result<Option<Fingerprint>, Error> {
    let raw = bytes(value)?;
    if raw.is_empty() {
        return Ok(None);
    }
    let raw: [u8; 32] = raw.try_into().map_err(|raw: Vec<u8>| {
        Error::store(format!(
            "a stored fingerprint has {} bytes, not 32",
            raw.len()
        ))
    })?;
    Ok(Some(Fingerprint::from_bytes(raw)))
}

fn parse_claim(reply: Value) -> Result<Claim, Error> {
    let Value::Array(items) = reply else {
        return Err(unexpected(&reply));
    };
    let mut items = items.into_iter();
    let state = bytes(items.next().unwrap_or(Value::Nil))?;
    let mut next = || items.next().unwrap_or(Value::Nil);
    match state.as_slice() {
        b"a" => {
            let token = String::from_utf8(bytes(next())?)
                .ok()
                .and_then(|t| t.parse().ok())
                .ok_or_else(|| Error::store("a claim returned a token that is not a number"))?;
            Ok(Claim::Acquired {
                token: Token::new(token),
            })
        }
        b"p" => Ok(Claim::InProgress {
            fingerprint: fingerprint(next())?,
        }),
        b"c" => {
            let fingerprint = fingerprint(next())?;
            let value = Bytes::from(bytes(next())?);
            Ok(Claim::Completed { value, fingerprint })
        }
        _ => Err(Error::store(format!(
            "a claim returned the unknown state {:?}",
            String::from_utf8_lossy(&state)
        ))),
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.connection {
            Connection::Manager(_) => "connection manager",
            Connection::Multiplexed(_) => "multiplexed",
            Connection::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore")
            .field("connection", &kind)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish()
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(
        &self,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Claim, Error> {
        let fingerprint: &[u8] = fingerprint.map_or(&[], |f| f.as_bytes());
        let reply = self
            .invoke(&CLAIM, key, &[fingerprint, &millis(lease)])
            .await?;
        parse_claim(reply)
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        let token = token.get().to_string();
        self.fenced(&COMPLETE, key, &[token.as_bytes(), &value, &millis(ttl)])
            .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        let token = token.get().to_string();
        self.fenced(&RELEASE, key, &[token.as_bytes()]).await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        let token = token.get().to_string();
        self.fenced(&RENEW, key, &[token.as_bytes(), &millis(lease)])
            .await
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        self.fenced(&REMOVE, key, &[]).await
    }

    fn flights(&self) -> Option<&Flights> {
        Some(&self.flights)
    }
}
