//! The distributed store, on Redis (standalone or cluster), with `redis`.
//!
//! It needs Redis 7.0 or later (for `SET … NX GET`); [`RedisStore::connect`] checks the
//! server's version. Valkey keeps these commands and is expected to work, but is not tested
//! here.
//!
//! # Layout
//!
//! One string per record, at `<prefix>{<64 hex digits of the key>}` (the braces are a hash
//! tag: every key of a record lives in one cluster slot):
//!
//! ```text
//! in progress:  "p" | token (8 bytes) | fence (20 ASCII digits, all 0 until taken) | n | fingerprint (n bytes) | about
//! completed:    "c" | n | fingerprint (n bytes) | value
//! about:        1 | lease in ms (8 bytes) | namespace | label | holder (each a 2-byte length and UTF-8; 0xFFFF: none)
//! ```
//!
//! where `n` is one byte, 0 or 32. `about` is what the claim says of itself
//! ([`ClaimRequest::claimant`]: what an operator's listing shows); a claim an earlier version
//! wrote ends at its fingerprint, and lists as namespace unknown. A completed record keeps
//! its claim's `about` beside it, at the record's key followed by `:about`, with the same
//! expiry, so that the record itself stays as every version reads it. An operator's release
//! leaves the released holder's prefix at the record's key followed by `:released` (kept
//! for a day), so that the holder, in whatever process, does not claim the key again to
//! record its result. A call's steps are a
//! hash beside its record, at the record's key followed by `:steps` (the same hash tag),
//! from each step's key to its value, expiring with the TTL of the last one recorded. The
//! key's own expiry (`PX`, judged by the server's clock) is the lease while in progress and
//! the TTL once completed. A claim leaves a trace at the record's key followed by
//! `:unsettled` (its value the call's TTL), which its completion or release deletes and
//! which lives the call's TTL past the claim's lease: a claim that finds the key free and
//! the trace there took over a claim that lapsed (or that an operator released) unsettled,
//! and says so ([`Claim::Acquired`]'s `taken_over`).
//!
//! # Commands
//!
//! - **Claim, and so every replay:** one script around the native `SET key <in progress> NX
//!   GET PX <lease>`. It writes the claim if the key is absent (never, or expired, or
//!   released) and otherwise returns the record that is there, unchanged; a claim that took
//!   the key writes its trace (`SET … GET`, which says whether an unsettled one was there).
//!   No clock reading: the claim's token is a nonce this process draws (64 bits, `SipHash`
//!   of a per-process random key and a counter), so claims of one key differ without
//!   asking the server.
//! - **Complete, release, renew:** a short script each, because Redis 7 has no native
//!   compare-and-set: it acts only if the record still starts with `p` and this token. The
//!   completion also writes the claim's `about` beside the record (in the same script);
//!   completion and release delete the claim's trace, renewal extends it.
//! - **Fence** ([`Store::fence`], for [`Attempt::token`](crate::Attempt::token)): a script
//!   that, while the claim is held, stamps the server's `TIME` in microseconds into the record
//!   once and returns it. A later holder can only claim after this holder's record is gone,
//!   and takes its own fence after its claim, so fences grow as long as the server's clock
//!   does not go back (the assumption every expiry already makes).
//! - **Record a step:** a script that writes the step into the call's hash only while the
//!   call's record starts with `p` and this token; **read the steps:** one `HGETALL`.
//! - **Remove:** a script that deletes the record, its steps, its `about` and its trace.
//! - **Operate** ([`Admin`](crate::admin::Admin), feature `admin`): a listing walks the
//!   prefix's records with `SCAN … MATCH <prefix>{*}` (never `KEYS`), on every primary of a
//!   cluster, and reads each record's head with a script; a release is one script that
//!   deletes the claim only under the token shown and, unless forced, only while its lease
//!   has less than half left (by the server's clock).
//!
//! Scripts are sent with `EVALSHA` (one round trip; loaded again transparently after a
//! `NOSCRIPT`); every operation runs under a per-operation timeout.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, ScriptInvocation, Value};

use self::record::{
    head, holder, in_progress, malformed, parse_claim, unexpected, Head, CLAIM, COMPLETE, FENCE,
    INSPECT, LEASE_LEFT, LOOKUP, RECORD_STEP, RELEASE, REMOVE, RENEW,
};
use self::sentinel::Primary;
use crate::store::{Holding, Recorded};
use crate::{limits, Claim, ClaimRequest, Error, Flights, Key, Store, Token};

#[cfg(feature = "admin")]
mod admin;
mod record;
mod sentinel;

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "idem:";

/// The default time an operation may take before it fails with [`Error::Store`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

/// The oldest server this store works with: `SET` with both `NX` and `GET` came in 7.0.
const MIN_VERSION: (u32, u32) = (7, 0);

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
    /// How many replicas must acknowledge each write, and how long to wait for them.
    replicas: Option<(u32, Duration)>,
}

/// The connections a store can use.
#[derive(Clone)]
enum Connection {
    Manager(ConnectionManager),
    Multiplexed(MultiplexedConnection),
    Cluster(ClusterConnection),
    Sentinel(Primary),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Manager(c) => c.req_packed_command(cmd),
            Self::Multiplexed(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
            Self::Sentinel(c) => c.req_packed_command(cmd),
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
            Self::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Manager(c) => c.get_db(),
            Self::Multiplexed(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
            Self::Sentinel(c) => c.get_db(),
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
    /// [`Error::Store`] when the URL is invalid, the server cannot be reached within
    /// [`DEFAULT_TIMEOUT`], or it is older than Redis 7.0.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let client = redis::Client::open(url).map_err(Error::store)?;
        // No response timeout of the connection's own: every operation runs under the
        // store's (`with_timeout`), which a shorter one here would cut short (a `WAIT` for
        // replicas longer than it), and a second timer per command costs a replay's client
        // 4 % of its instructions.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(DEFAULT_TIMEOUT))
            .set_response_timeout(None)
            .set_number_of_retries(2);
        let manager = within(
            DEFAULT_TIMEOUT,
            ConnectionManager::new_with_config(client, config),
        )
        .await?
        .map_err(Error::store)?;
        Self::from_manager(manager).checked().await
    }

    /// Connects to a Redis Cluster through any of its nodes (`redis://host:port` each).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when a URL is invalid, the cluster cannot be reached within
    /// [`DEFAULT_TIMEOUT`], or a node it asks is older than Redis 7.0.
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
        Self::from_cluster(connection).checked().await
    }

    /// Connects to the primary of the master named `master`, as the Redis Sentinels at
    /// `sentinels` (`redis://host:port` each) name it, and follows a failover: after a
    /// command finds the primary gone (the connection dropped, refused or timed out) or
    /// demoted (a write refused with `READONLY`), that command fails with [`Error::Store`]
    /// and the next one asks the sentinels again. The application needs no restart.
    ///
    /// Replication is asynchronous: a claim or a record the old primary acknowledged may be
    /// missing on the new one. [`with_replicas`](Self::with_replicas) makes each write wait
    /// for replicas first.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when no sentinel answers, none knows `master`, its primary cannot
    /// be reached within [`DEFAULT_TIMEOUT`], or it is older than Redis 7.0.
    pub async fn connect_sentinel<'a>(
        sentinels: impl IntoIterator<Item = &'a str>,
        master: &str,
    ) -> Result<Self, Error> {
        let sentinels = sentinels.into_iter().map(str::to_string).collect();
        let primary = within(
            DEFAULT_TIMEOUT * 2,
            Primary::connect(sentinels, master, DEFAULT_TIMEOUT),
        )
        .await?
        .map_err(Error::store)?;
        Self::with_connection(Connection::Sentinel(primary))
            .checked()
            .await
    }

    /// Makes every claim, completion, renewal and fence wait until `replicas` replicas
    /// have it (Redis `WAIT`), at most `timeout`. A claim they do not acknowledge in time is
    /// released and fails with [`Error::Store`]: the body does not run on a claim that a
    /// failover could lose. A completion, renewal or fence they do not acknowledge fails with
    /// [`Error::Store`] too (it was applied on the primary; the caller retries it, as after
    /// any store failure).
    ///
    /// `WAIT` blocks the connection it is sent on until the replicas answer, so the writes of
    /// every task sharing the connection queue behind it: the cost per call is in
    /// `BENCHMARKS.md`. It narrows the window in which a failover loses an acknowledged write;
    /// it does not close it (Redis may still promote a replica that missed a write
    /// acknowledged by another one).
    #[must_use]
    pub fn with_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.replicas = (replicas > 0).then_some((replicas, timeout));
        self
    }

    /// Waits for the replicas after a write on this store's connection, if the store asks
    /// for them: `Ok` when enough acknowledged it.
    async fn replicated(&self, what: &str) -> Result<(), Error> {
        let Some((replicas, timeout)) = self.replicas else {
            return Ok(());
        };
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas)
            .arg(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
        let mut connection = self.connection.clone();
        let acknowledged = within(self.timeout + timeout, connection.req_packed_command(&wait))
            .await?
            .map_err(Error::store)?;
        match acknowledged {
            Value::Int(acknowledged) if acknowledged >= i64::from(replicas) => Ok(()),
            Value::Int(acknowledged) => Err(Error::store(format!(
                "{what} was acknowledged by {acknowledged} of the {replicas} replicas asked for within {timeout:?}"
            ))),
            other => Err(unexpected(&other)),
        }
    }

    /// The store, once the server it talks to is new enough (the stores made from an
    /// existing connection are not checked: an older server refuses the first claim with
    /// a syntax error, as [`Error::Store`]).
    async fn checked(self) -> Result<Self, Error> {
        let mut connection = self.connection.clone();
        let info: Value = within(
            self.timeout,
            redis::cmd("INFO")
                .arg("server")
                .query_async(&mut connection),
        )
        .await?
        .map_err(Error::store)?;
        // One server answers with its text; a cluster connection asks every node and
        // answers with a map of them: each must be new enough.
        let mut versions = Vec::new();
        collect_versions(&info, &mut versions);
        let too_old = versions.iter().find(|version| {
            let mut parts = version.split('.').map(|part| part.parse::<u32>().ok());
            !matches!(
                (parts.next().flatten(), parts.next().flatten()),
                (Some(major), Some(minor)) if (major, minor) >= MIN_VERSION
            )
        });
        match (too_old, versions.is_empty()) {
            (None, false) => Ok(self),
            (found, _) => Err(Error::store(format!(
                "idem needs Redis 7.0 or later (for SET with NX and GET); the server runs {}",
                found.map_or("an unknown version", String::as_str)
            ))),
        }
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
            replicas: None,
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

    /// The Redis key of a record: the prefix, then the key's hex digits in braces.
    fn record(&self, key: &Key) -> Vec<u8> {
        let mut digits = [0; 64];
        // 32 bytes always fit 64 digits: the encoding cannot fail.
        let _ = hex::encode_to_slice(key.as_bytes(), &mut digits);
        let mut record = Vec::with_capacity(self.prefix.len() + digits.len() + 2);
        record.extend_from_slice(self.prefix.as_bytes());
        record.push(b'{');
        record.extend_from_slice(&digits);
        record.push(b'}');
        record
    }

    /// The Redis key of the steps of the call `key`: beside its record, in its slot.
    fn steps_of(&self, key: &Key) -> Vec<u8> {
        let mut steps = self.record(key);
        steps.extend_from_slice(b":steps");
        steps
    }

    /// The Redis key of what a completed call's claim said of itself (its namespace, label,
    /// holder and lease): beside its record, in its slot, with its expiry.
    fn about_of(&self, key: &Key) -> Vec<u8> {
        let mut about = self.record(key);
        about.extend_from_slice(b":about");
        about
    }

    /// The Redis key of the trace of `key`'s claim while it is unsettled: written by the
    /// claim, deleted by its completion or release, it outlives a claim that lapsed (or that
    /// an operator released) by the call's TTL, so that the claim taking the key over is
    /// told. Beside the record, in its slot.
    fn unsettled_of(&self, key: &Key) -> Vec<u8> {
        let mut unsettled = self.record(key);
        unsettled.extend_from_slice(b":unsettled");
        unsettled
    }

    /// The Redis key of the mark an operator's release leaves ([`Admin`](crate::admin::Admin)):
    /// the released holder's prefix, so that it claims the key no more to record its
    /// result.
    fn released_of(&self, key: &Key) -> Vec<u8> {
        let mut released = self.record(key);
        released.extend_from_slice(b":released");
        released
    }

    /// Sends one command under the timeout: one round trip.
    async fn send(&self, command: &Cmd) -> Result<Value, Error> {
        let mut connection = self.connection.clone();
        within(self.timeout, connection.req_packed_command(command))
            .await?
            .map_err(Error::store)
    }

    /// An invocation of one of the holder's scripts on `key`: its first argument is the
    /// holder's prefix; the caller adds the rest.
    fn script<'a>(&self, script: &'a Script, key: &Key, token: Token) -> ScriptInvocation<'a> {
        let mut invocation = script.key(self.record(key));
        invocation.arg(&holder(token)[..]);
        invocation
    }

    /// Runs a script invocation under the timeout: one round trip.
    async fn run_script(&self, invocation: ScriptInvocation<'_>) -> Result<Value, Error> {
        let mut connection = self.connection.clone();
        within(self.timeout, invocation.invoke_async(&mut connection))
            .await?
            .map_err(Error::store)
    }

    /// The record of `key` (its head, or all of it with `values`), as [`INSPECT`] reads it.
    async fn head_of(&self, key: &Key, values: bool) -> Result<Option<Head>, Error> {
        let mut invocation = INSPECT.key(self.record(key));
        invocation
            .key(self.about_of(key))
            .arg(if values { "1" } else { "0" });
        head(self.run_script(invocation).await?)
    }

    /// Runs a compare-and-set script: `1` applied, `0` refused. A write the store asks
    /// replicas for (`with_replicas`) waits for them.
    async fn fenced(&self, invocation: ScriptInvocation<'_>, what: &str) -> Result<bool, Error> {
        match self.run_script(invocation).await? {
            Value::Int(1) => {
                self.replicated(what).await?;
                Ok(true)
            }
            Value::Int(_) => Ok(false),
            other => Err(unexpected(&other)),
        }
    }
}

/// The `redis_version` of every `INFO` text in `info`: one server's, or each node's.
fn collect_versions(info: &Value, versions: &mut Vec<String>) {
    match info {
        Value::BulkString(text) => versions.extend(
            String::from_utf8_lossy(text)
                .lines()
                .filter_map(|line| line.strip_prefix("redis_version:"))
                .map(|version| version.trim().to_string()),
        ),
        Value::VerbatimString { text, .. } => {
            collect_versions(&Value::BulkString(text.clone().into_bytes()), versions);
        }
        Value::Map(nodes) => nodes
            .iter()
            .for_each(|(_, node)| collect_versions(node, versions)),
        Value::Array(nodes) => nodes
            .iter()
            .for_each(|node| collect_versions(node, versions)),
        _ => {}
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

fn millis(duration: Duration) -> u64 {
    // PX and PEXPIRE need at least 1 ms, and refuse an expiry past the server clock's range:
    // clamped to the runtime's limit.
    u64::try_from(limits::clamp(duration).as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.connection {
            Connection::Manager(_) => "connection manager",
            Connection::Multiplexed(_) => "multiplexed",
            Connection::Cluster(_) => "cluster",
            Connection::Sentinel(_) => "sentinel",
        };
        f.debug_struct("RedisStore")
            .field("connection", &kind)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("replicas", &self.replicas)
            .finish()
    }
}

#[async_trait]
impl Store for RedisStore {
    /// The nonce is the claim's token: a retry that finds an in-progress record with its
    /// own token finds the claim its lost reply made, and renews it to a whole lease before
    /// answering `Acquired` (a second round trip, on this rare path only). The record says
    /// whose the claim is (namespace, label, this process) and its lease, after the
    /// fingerprint: what an operator's listing shows.
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        let (key, lease) = (request.key, request.lease);
        let token = Token::new(request.nonce);
        let claim = in_progress(token, request.fingerprint, millis(lease), &request.claimant);
        let ttl = millis(request.ttl);
        let (record, unsettled) = (self.record(key), self.unsettled_of(key));
        loop {
            let mut invocation = CLAIM.key(&record[..]);
            invocation
                .key(&unsettled[..])
                .arg(&claim)
                .arg(millis(lease))
                .arg(ttl)
                .arg(millis(lease).saturating_add(ttl));
            let reply = self.run_script(invocation).await?;
            let own = matches!(&reply, Value::Array(own) if own.len() == 2);
            let claim = parse_claim(reply, token)?;
            if matches!(claim, Claim::Acquired { .. }) {
                if let Err(err) = self.replicated("the claim").await {
                    // Not run on a claim a failover could lose; freed for the next call.
                    let _ = self.release(key, token).await;
                    return Err(err);
                }
            }
            // Our own claim, from a try whose reply was lost: its lease may be nearly spent.
            // Renewed, it is ours for a whole lease; lapsed meanwhile, the key is claimed anew.
            if !own || self.renew(key, token, lease).await? {
                return Ok(claim);
            }
        }
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        let mut invocation = self.script(&COMPLETE, key, token);
        invocation
            .key(self.about_of(key))
            .key(self.unsettled_of(key))
            .arg(&value[..])
            .arg(millis(ttl));
        self.fenced(invocation, "the completion").await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        // A release that a failover loses leaves the claim to lapse: nothing to wait for.
        let mut invocation = self.script(&RELEASE, key, token);
        invocation.key(self.unsettled_of(key));
        match self.run_script(invocation).await? {
            Value::Int(applied) => Ok(applied == 1),
            other => Err(unexpected(&other)),
        }
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        let mut invocation = self.script(&RENEW, key, token);
        invocation.key(self.unsettled_of(key)).arg(millis(lease));
        self.fenced(invocation, "the renewal").await
    }

    async fn fence(&self, key: &Key, token: Token) -> Result<Option<Token>, Error> {
        let fence = match self.run_script(self.script(&FENCE, key, token)).await? {
            Value::Nil => return Ok(None),
            Value::BulkString(digits) => std::str::from_utf8(&digits)
                .ok()
                .and_then(|digits| digits.parse().ok())
                .map(Token::new)
                .ok_or_else(|| malformed("a fence that is not a number"))?,
            other => return Err(unexpected(&other)),
        };
        self.replicated("the fence").await?;
        Ok(Some(fence))
    }

    async fn lookup(&self, key: &Key) -> Result<Option<Recorded>, Error> {
        let reply = self.run_script(LOOKUP.key(self.record(key))).await?;
        let (record, left) = match reply {
            Value::Nil => return Ok(None),
            Value::Array(mut parts) if parts.len() == 2 => {
                let left = parts.pop();
                (parts.pop(), left)
            }
            other => return Err(unexpected(&other)),
        };
        let expires_in = match left {
            Some(Value::Int(left)) => u64::try_from(left).ok().map(Duration::from_millis),
            Some(other) => return Err(unexpected(&other)),
            None => None,
        };
        match record.map(|record| parse_claim(record, Token::new(0))) {
            Some(Ok(Claim::Completed { value, fingerprint })) => {
                Ok(Some(Recorded::new(value, fingerprint, expires_in)))
            }
            Some(Ok(_)) | None => Err(malformed("a lookup that found no completed record")),
            Some(Err(err)) => Err(err),
        }
    }

    async fn lease_left(&self, key: &Key) -> Result<Option<Duration>, Error> {
        match self.run_script(LEASE_LEFT.key(self.record(key))).await? {
            Value::Nil => Ok(None),
            Value::Int(left) => Ok(u64::try_from(left)
                .ok()
                .filter(|left| *left > 0)
                .map(Duration::from_millis)),
            other => Err(unexpected(&other)),
        }
    }

    /// One script: the record's claim, what it says of its holder, and the lease left.
    async fn holding(&self, key: &Key) -> Result<Option<Holding>, Error> {
        let Some(head) = self.head_of(key, false).await? else {
            return Ok(None);
        };
        if head.bytes.first() != Some(&b'p') {
            return Ok(None);
        }
        let left = head.left.filter(|left| !left.is_zero());
        Ok(left.map(|left| Holding::new(left, head.about.holder)))
    }

    /// One `GET` of the mark an operator's release left, if any.
    async fn released_by_operator(&self, key: &Key, token: Token) -> Result<bool, Error> {
        let mut command = redis::cmd("GET");
        command.arg(self.released_of(key));
        match self.send(&command).await? {
            Value::Nil => Ok(false),
            Value::BulkString(mark) => Ok(mark[..] == holder(token)[..]),
            other => Err(unexpected(&other)),
        }
    }

    async fn record_step(
        &self,
        call: &Key,
        token: Token,
        step: &Key,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        let mut invocation = self.script(&RECORD_STEP, call, token);
        invocation
            .key(self.steps_of(call))
            .arg(&step.as_bytes()[..])
            .arg(&value[..])
            .arg(millis(ttl));
        self.fenced(invocation, "the step's record").await
    }

    async fn steps(&self, call: &Key) -> Result<Vec<(Key, Bytes)>, Error> {
        let mut command = redis::cmd("HGETALL");
        command.arg(self.steps_of(call));
        let pairs = match self.send(&command).await? {
            Value::Map(pairs) => pairs,
            Value::Array(flat) => {
                let mut flat = flat.into_iter();
                std::iter::from_fn(|| Some((flat.next()?, flat.next()?))).collect()
            }
            other => return Err(unexpected(&other)),
        };
        pairs
            .into_iter()
            .map(|pair| match pair {
                (Value::BulkString(step), Value::BulkString(value)) => {
                    let step: [u8; 32] = step
                        .try_into()
                        .map_err(|_| malformed("a step key that is not 32 bytes"))?;
                    Ok((Key::from_bytes(step), Bytes::from(value)))
                }
                (step, _) => Err(unexpected(&step)),
            })
            .collect()
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        let mut invocation = REMOVE.key(self.record(key));
        invocation
            .key(self.steps_of(key))
            .key(self.about_of(key))
            .key(self.unsettled_of(key));
        match self.run_script(invocation).await? {
            Value::Int(removed) => Ok(removed > 0),
            other => Err(unexpected(&other)),
        }
    }

    /// The command's timeout, and with [`with_replicas`](Self::with_replicas) the wait for
    /// the replicas after it.
    fn claim_timeout(&self) -> Option<Duration> {
        let replicas = self
            .replicas
            .map_or(Duration::ZERO, |(_, wait)| self.timeout + wait);
        Some(self.timeout + replicas)
    }

    fn flights(&self) -> Option<&Flights> {
        Some(&self.flights)
    }
}
