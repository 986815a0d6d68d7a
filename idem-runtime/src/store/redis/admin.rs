//! [`Admin`] for [`RedisStore`]: a listing walks the store's keys with `SCAN` (on every
//! primary of a cluster) and reads each record's head with a script; a release or reset is
//! one script that judges the holder's silence by the server's clock.
//!
//! Redis keeps no order of its keys: a listing goes in `SCAN`'s order, and its cursor is a
//! position (`<primary>.<scan cursor>.<the last key taken from that step, or ->`), not a
//! key.

use std::collections::HashSet;
use std::sync::LazyLock;

use async_trait::async_trait;
use bytes::Bytes;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Script, Value};

use super::record::{head, malformed, split_fingerprint, unexpected, Head, INSPECT};
use super::{within, Connection, RedisStore};
use crate::admin::{Admin, Cursor, Ending, Entry, Filter, Page, Release, State};
use crate::store::Holder;
use crate::{Error, Key, Token};

/// `SCAN` steps one page may take: a page the filter leaves short (records of other
/// namespaces) ends there, with a `next`, instead of walking the whole keyspace.
const STEPS: usize = 8;

/// The keys one `SCAN` step visits (its `COUNT`): the server's work a step, whether they
/// match the store's prefix or not.
const SCAN_COUNT: usize = 1_000;

/// How long the mark of an operator's release is kept: longer than a holder keeps trying
/// to record a refused completion (its caller's wait, its background retries).
const RELEASED_KEPT: std::time::Duration = std::time::Duration::from_secs(24 * 60 * 60);

// KEYS[1] a record, KEYS[2] its `released` mark; ARGV[1] the holder's prefix ("p" and its
// token), ARGV[2] the most milliseconds its lease may have left (a holder silent for more
// than half its lease has less), or -1 for any, ARGV[3] how long the mark is kept. Deletes
// the claim, marks its holder's prefix released by an operator, and answers 1; or answers 0.
const RELEASE_CLAIM_LUA: &str = r"
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 9) ~= ARGV[1] then
    return 0
end
local most = tonumber(ARGV[2])
if most >= 0 and redis.call('PTTL', KEYS[1]) > most then
    return 0
end
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
return 1
";

static RELEASE_CLAIM: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_CLAIM_LUA));

// KEYS[1] a record, KEYS[2] its steps, KEYS[3] its `about`: deletes them while the record
// is completed.
const FORGET_LUA: &str = r"
if redis.call('GETRANGE', KEYS[1], 0, 0) ~= 'c' then
    return 0
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
";

static FORGET: LazyLock<Script> = LazyLock::new(|| Script::new(FORGET_LUA));

/// Where a listing stands: which primary (in the order of their addresses), where its
/// `SCAN` is, and the last key a page took from that step (the next page runs the step
/// again and goes on after it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Position {
    node: usize,
    scan: u64,
    after: Option<Key>,
}

impl Position {
    fn read(cursor: Option<&Cursor>) -> Result<Self, Error> {
        let Some(cursor) = cursor else {
            return Ok(Self::default());
        };
        let parsed = cursor.store_position().and_then(|text| {
            let mut parts = text.split('.');
            let (Some(node), Some(scan), Some(after), None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                return None;
            };
            Some(Self {
                node: node.parse().ok()?,
                scan: scan.parse().ok()?,
                after: match after {
                    "-" => None,
                    digits => Some(Key::from_hex(digits)?),
                },
            })
        });
        parsed.ok_or_else(|| {
            Error::config(format!(
                "the cursor {cursor} is not a Redis listing's position (`<primary>.<scan>.<key or ->`)"
            ))
        })
    }

    fn cursor(self) -> Cursor {
        let after = self
            .after
            .map_or_else(|| "-".to_string(), |key| key.to_hex());
        // Numbers and digits with dots: never 64 hex digits alone.
        Cursor::position(format!("{}.{}.{after}", self.node, self.scan))
            .unwrap_or_else(|_| unreachable!("a position of numbers and digits is printable"))
    }
}

impl RedisStore {
    /// The `SCAN` pattern of this store's records: the prefix (its glob characters escaped)
    /// and a hash tag. Steps (`…}:steps`) do not match.
    fn pattern(&self) -> String {
        let mut pattern = String::with_capacity(self.prefix.len() + 3);
        for c in self.prefix.chars() {
            if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                pattern.push('\\');
            }
            pattern.push(c);
        }
        pattern.push_str("{*}");
        pattern
    }

    /// The key of a record's Redis key, if it is one of this store's.
    fn key_of(&self, record: &[u8]) -> Option<Key> {
        let digits = record
            .strip_prefix(self.prefix.as_bytes())?
            .strip_prefix(b"{")?
            .strip_suffix(b"}")?;
        Key::from_hex(digits)
    }

    /// The servers a listing walks: the one server, or a cluster's primaries by address.
    async fn primaries(&self) -> Result<Vec<Option<(String, u16)>>, Error> {
        if !matches!(self.connection, Connection::Cluster(_)) {
            return Ok(vec![None]);
        }
        let mut command = redis::cmd("CLUSTER");
        command.arg("NODES");
        let text = match self.send(&command).await? {
            Value::BulkString(text) => String::from_utf8_lossy(&text).into_owned(),
            Value::VerbatimString { text, .. } => text,
            other => return Err(unexpected(&other)),
        };
        let mut primaries: Vec<(String, u16)> = text
            .lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                let address = fields.nth(1)?;
                let flags = fields.next()?;
                let primary = flags.split(',').any(|flag| flag == "master")
                    && !flags
                        .split(',')
                        .any(|flag| flag == "fail" || flag == "noaddr");
                let address = address.split(['@', ',']).next()?;
                let (host, port) = address.rsplit_once(':')?;
                primary.then(|| Some((host.to_string(), port.parse().ok()?)))?
            })
            .collect();
        primaries.sort();
        Ok(primaries.into_iter().map(Some).collect())
    }

    /// One `SCAN` step on `node`: where the next starts (0 at the end) and the keys found.
    async fn scan(
        &self,
        node: Option<&(String, u16)>,
        from: u64,
        count: usize,
    ) -> Result<(u64, Vec<Vec<u8>>), Error> {
        let mut command = redis::cmd("SCAN");
        command
            .arg(from)
            .arg("MATCH")
            .arg(self.pattern())
            .arg("COUNT")
            .arg(count);
        let reply = match (&self.connection, node) {
            (Connection::Cluster(cluster), Some((host, port))) => {
                let mut cluster = cluster.clone();
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                within(self.timeout, cluster.route_command(command, routing))
                    .await?
                    .map_err(Error::store)?
            }
            _ => self.send(&command).await?,
        };
        let Value::Array(mut parts) = reply else {
            return Err(unexpected(&reply));
        };
        let (Some(Value::Array(keys)), Some(Value::BulkString(next)), None) =
            (parts.pop(), parts.pop(), parts.pop())
        else {
            return Err(malformed("a SCAN reply"));
        };
        let next = std::str::from_utf8(&next)
            .ok()
            .and_then(|next| next.parse().ok())
            .ok_or_else(|| malformed("a SCAN cursor that is not a number"))?;
        let keys = keys
            .into_iter()
            .filter_map(|key| match key {
                Value::BulkString(key) => Some(key),
                _ => None,
            })
            .collect();
        Ok((next, keys))
    }

    /// The heads of `records` (all in one pipeline on one server; one script each on a
    /// cluster, whose pipelines stay within a slot).
    async fn heads(&self, records: &[&[u8]], values: bool) -> Result<Vec<Option<Head>>, Error> {
        let whole = if values { "1" } else { "0" };
        if matches!(self.connection, Connection::Cluster(_)) {
            let mut heads = Vec::with_capacity(records.len());
            for record in records {
                let mut invocation = INSPECT.key(*record);
                invocation.key(about(record)).arg(whole);
                heads.push(head(self.run_script(invocation).await?)?);
            }
            return Ok(heads);
        }
        let mut pipeline = redis::pipe();
        pipeline.load_script(&INSPECT).ignore();
        let invocations: Vec<_> = records
            .iter()
            .map(|record| {
                let mut invocation = INSPECT.key(*record);
                invocation.key(about(record)).arg(whole);
                invocation
            })
            .collect();
        for invocation in &invocations {
            pipeline.invoke_script(invocation);
        }
        let mut connection = self.connection.clone();
        let replies: Vec<Value> = within(self.timeout, pipeline.query_async(&mut connection))
            .await?
            .map_err(Error::store)?;
        replies.into_iter().map(head).collect()
    }

    /// The record of `key` as an operator sees it, without its steps.
    async fn entry_of(&self, key: &Key, values: bool) -> Result<Option<Entry>, Error> {
        match self.head_of(key, values).await? {
            Some(head) => entry(*key, head, values).map(Some),
            None => Ok(None),
        }
    }

    /// Deletes the claim `entry` showed as `how` allows, fencing a holder of this process
    /// first: whether it was deleted. The server judges the holder's silence by its own
    /// clock, in the same script, unless the release is forced or the holder's process has
    /// exited.
    async fn delete_claim(&self, entry: &Entry, token: Token, how: Release) -> Result<bool, Error> {
        let key = entry.key();
        let unconditional = how == Release::Force || entry.holder().is_some_and(Holder::has_exited);
        // Silent: renewed more than half a lease ago, so less than half of it is left.
        let most = match (unconditional, entry.lease()) {
            (false, Some(lease)) => i64::try_from((lease - lease / 2).as_millis())
                .unwrap_or(i64::MAX)
                .saturating_sub(1),
            (false, None) => return Ok(false), // no lease known: never silent
            (true, _) => -1,
        };
        self.flights.fence(key, true);
        let mut invocation = self.script(&RELEASE_CLAIM, key, token);
        invocation
            .key(self.released_of(key))
            .arg(most)
            .arg(super::millis(RELEASED_KEPT));
        let deleted = self.fenced(invocation, "the release").await;
        if matches!(deleted, Ok(true)) {
            self.flights.released(key);
            Ok(true)
        } else {
            self.flights.fence(key, false);
            deleted
        }
    }

    /// Deletes a call's steps, and the trace of its claim: a reset forgets the call whole.
    async fn forget_steps(&self, key: &Key) -> Result<(), Error> {
        let mut command = redis::cmd("DEL");
        command.arg(self.steps_of(key)).arg(self.unsettled_of(key));
        self.send(&command).await.map(drop)
    }
}

/// The `about` beside `record` (a record's Redis key).
fn about(record: &[u8]) -> Vec<u8> {
    let mut about = record.to_vec();
    about.extend_from_slice(b":about");
    about
}

/// The entry of `key`'s record.
fn entry(key: Key, head: Head, values: bool) -> Result<Entry, Error> {
    let Head {
        bytes: record,
        left,
        length,
        about,
    } = head;
    match record.first() {
        Some(b'p') => {
            let token = record
                .get(1..9)
                .and_then(|token| token.try_into().ok())
                .map(|token| Token::new(u64::from_be_bytes(token)))
                .ok_or_else(|| malformed("a short claim"))?;
            Ok(Entry::new(key, State::Held)
                .with_names(about.namespace, about.label)
                .with_claim(token, about.lease, left.unwrap_or_default(), about.holder))
        }
        Some(b'c') => {
            let (_, used) = split_fingerprint(record.get(1..).unwrap_or_default())?;
            let start = 1 + used;
            let size = length.saturating_sub(start as u64);
            let value =
                values.then(|| Bytes::copy_from_slice(record.get(start..).unwrap_or_default()));
            Ok(Entry::new(key, State::Completed)
                .with_names(about.namespace, about.label)
                .with_result(left, Some(size), value))
        }
        _ => Err(malformed("an unknown state")),
    }
}

#[async_trait]
impl Admin for RedisStore {
    /// In `SCAN`'s order, primary by primary on a cluster: each page reads its keys' heads
    /// (one pipeline a step on one server, one script a key on a cluster) and filters them
    /// by namespace and state here. At most 8 `SCAN` steps a page, so a page may be
    /// short, or empty, with a `next`. A key may be listed twice, or missed if it was
    /// written during the listing: `SCAN`'s own terms.
    async fn list(&self, filter: &Filter, after: Option<&Cursor>) -> Result<Page, Error> {
        let size = filter.page_size();
        let mut at = Position::read(after)?;
        let primaries = self.primaries().await?;
        let mut entries: Vec<Entry> = Vec::with_capacity(size.min(128));
        let mut seen = HashSet::new();
        for _ in 0..STEPS {
            let Some(node) = primaries.get(at.node) else {
                return Ok(Page::new(entries, None));
            };
            let (next, records) = self.scan(node.as_ref(), at.scan, SCAN_COUNT).await?;
            let mut records: Vec<(Key, Vec<u8>)> = records
                .into_iter()
                .filter_map(|record| Some((self.key_of(&record)?, record)))
                .collect();
            // Where the page before stopped in this step; from the step's start if that key
            // is gone (its keys may then be listed twice: `SCAN`'s own terms).
            if let Some(after) = at.after {
                if let Some(stop) = records.iter().position(|(key, _)| *key == after) {
                    records.drain(..=stop);
                }
            }
            // Read in chunks of what the page has room for: a full page reads no further.
            let mut rest = &records[..];
            while !rest.is_empty() {
                if entries.len() == size {
                    let next = Position {
                        after: entries.last().map(|last: &Entry| *last.key()),
                        ..at
                    };
                    return Ok(Page::new(entries, Some(next.cursor())));
                }
                let (chunk, later) = rest.split_at((size - entries.len()).min(rest.len()));
                rest = later;
                let names: Vec<&[u8]> = chunk.iter().map(|(_, record)| &record[..]).collect();
                let heads = self.heads(&names, filter.values()).await?;
                for ((key, _), head) in chunk.iter().zip(heads) {
                    let Some(head) = head else {
                        continue; // gone since the scan found it
                    };
                    let entry = entry(*key, head, filter.values())?;
                    if filter.admits(&entry) && seen.insert(*key) {
                        entries.push(entry);
                    }
                }
            }
            at = if next == 0 {
                Position {
                    node: at.node + 1,
                    ..Position::default()
                }
            } else {
                Position {
                    scan: next,
                    after: None,
                    ..at
                }
            };
        }
        let more = at.node < primaries.len();
        Ok(Page::new(entries, more.then(|| at.cursor())))
    }

    async fn inspect(&self, key: &Key) -> Result<Option<Entry>, Error> {
        let Some(entry) = self.entry_of(key, true).await? else {
            return Ok(None);
        };
        let steps = crate::Store::steps(self, key)
            .await?
            .into_iter()
            .map(|(step, value)| (step, value.len() as u64))
            .collect();
        Ok(Some(entry.with_steps(steps)))
    }

    async fn look(&self, key: &Key) -> Result<Option<Entry>, Error> {
        self.entry_of(key, false).await
    }

    async fn end_claim(
        &self,
        entry: &Entry,
        token: Token,
        how: Release,
        forget: bool,
    ) -> Result<Ending, Error> {
        if !self.delete_claim(entry, token, how).await? {
            return Ok(Ending::Changed);
        }
        if forget {
            self.forget_steps(entry.key()).await?;
        }
        Ok(Ending::Ended)
    }

    async fn forget_call(&self, entry: &Entry) -> Result<Ending, Error> {
        let key = entry.key();
        let mut invocation = FORGET.key(self.record(key));
        invocation.key(self.steps_of(key)).key(self.about_of(key));
        match self.run_script(invocation).await? {
            Value::Int(1) => {
                self.forget_steps(key).await?;
                Ok(Ending::Ended)
            }
            Value::Int(_) => Ok(Ending::Changed),
            other => Err(unexpected(&other)),
        }
    }

    /// Redis expires records itself: nothing to purge.
    async fn purge(&self) -> Result<u64, Error> {
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_reads_back_and_refuses_a_key() {
        let at = Position {
            node: 2,
            scan: 123_456,
            after: Some(Key::from_bytes([7; 32])),
        };
        assert_eq!(Position::read(Some(&at.cursor())).unwrap(), at);
        let start = Position { after: None, ..at };
        assert_eq!(Position::read(Some(&start.cursor())).unwrap(), start);
        assert_eq!(Position::read(None).unwrap(), Position::default());
        let key = Cursor::after(Key::from_bytes([1; 32]));
        assert!(matches!(Position::read(Some(&key)), Err(Error::Config(_))));
        let other = Cursor::position("1.2").unwrap();
        assert!(matches!(
            Position::read(Some(&other)),
            Err(Error::Config(_))
        ));
    }
}
