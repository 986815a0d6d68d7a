//! The serverless store: one DynamoDB table, with `aws-sdk-dynamodb`.
//!
//! # Table
//!
//! [`DynamoDbStore::migrate`] creates the table if it is missing (partition key `id`, a
//! string; on-demand billing) and turns on DynamoDB's TTL on `expiration`. One item per
//! call, readable in the console:
//!
//! | attribute | holds |
//! |---|---|
//! | `id` | the key's 64 hex digits (sha256 of the format version, namespace and key value) |
//! | `state` | `IN_PROGRESS`, `COMPLETED`, `RELEASED` or `REMOVED` |
//! | `token` | the fencing token: the first claimer's clock in microseconds, one more each claim |
//! | `version` | how many claims, renewals and settlements the item has had |
//! | `nonce`, `lease_ms`, `renewed_at` | the claim in progress: its nonce, its lease, when it was last renewed (holder's clock, ms; informational) |
//! | `released_token` | the token of the last claim an operator released: that holder, or an older one, does not claim the item again to record its result |
//! | `namespace`, `label`, `holder` | whose the call is: its operation's namespace and a label if the caller chose one (`NULL` for none), and the process that claimed it (`host/pid/started@machine`); for an operator's listing, never in a condition of the hot path |
//! | `fingerprint` | 32 bytes, absent for none |
//! | `value`, `expires_at` | the recorded result, and when it stops being replayed (ms since the epoch) |
//! | `steps` | each recorded step's value and expiry, by the step's key in hex |
//! | `expiration` | DynamoDB's TTL attribute (seconds): when the table may delete the item |
//! | `written` | the id of the last write, so that a write the SDK sent again knows it landed |
//! | `prior_state`, `prior_nonce` | what the item was when the claim in progress took it (`NONE`: no item): a claim that took over one in progress under another nonce, or one an operator released just before, says so ([`Claim::Acquired`]'s `taken_over`) |
//!
//! # Writes
//!
//! Every claim, renewal, completion, release, step and removal is **one conditional
//! `UpdateItem`**, and a condition that fails returns the item as it was
//! (`ReturnValuesOnConditionCheckFailure = ALL_OLD`), so a replay or a key in progress costs
//! one round trip. Completion, release, renewal and a step's record act only while the item
//! is in progress under the caller's token; a claim acts only on an absent, released or
//! removed item, a completed one whose `expires_at` has passed, one in progress under the
//! caller's own nonce (a claim whose reply was lost), or one this process has watched
//! unchanged for its whole lease. The token only grows (`if_not_exists(token, :now_µs) + 1`):
//! it is the fencing token too, and a holder that lost the key cannot write anything. A
//! claim's reply is the whole item (`ALL_NEW`), the attributes that say what it was before
//! among them. An item in progress may be deleted by the table's TTL a day past its lease at
//! the earliest, or its call's TTL if longer, so that the claim that takes a lapsed one
//! over is told.
//!
//! # Sizes
//!
//! An item holds 400 KB, names and values together. A result whose encoding is over
//! [`MAX_RESULT_BYTES`] is recorded as gone, at once: its caller gets its value, and every
//! retry [`Error::Gone`]. A call's steps live in its item until it completes, so its steps
//! together must fit too: a step that would not is refused ([`Error::Store`], with
//! DynamoDB's reason), and the body is told before it goes on.
//!
//! # Operations
//!
//! [`Admin`](crate::admin::Admin) (feature `admin`) lists with a filtered, strongly
//! consistent `Scan` (the hot path never scans); a release or reset is one conditional
//! `UpdateItem`. A holder's silence is watched, not compared (see below): the release of a
//! silent holder reads its item again after half its lease and acts only on the version
//! it watched.
//!
//! # Clocks
//!
//! DynamoDB offers no clock to a condition, so **leases are waited out, not compared**: a
//! claim in progress is taken over once this process has seen it unchanged (same `token`,
//! same `version`) for its `lease_ms`, by its own monotonic clock. A live holder's renewal
//! changes `version`, so no wall clock, however wrong, lets a live claim be taken; a dead
//! holder's key frees a lease after a process first finds it held (a process that saw the
//! holder claim it frees it a lease after that). A completed record's expiry
//! (`expires_at`) is judged by the caller's wall clock: a clock ahead by a minute replays a
//! 24-hour result for a minute less. DynamoDB deletes items past `expiration` only "within a
//! few days", and they are read until then: no condition trusts that deletion.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use aws_sdk_dynamodb::error::{DisplayErrorContext, SdkError};
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType, ReturnValue,
    ReturnValuesOnConditionCheckFailure, ScalarAttributeType, TimeToLiveSpecification,
};
use aws_sdk_dynamodb::Client;
use bytes::Bytes;

use self::expression::{Expression, COMPLETE, OWN, RECORD_STEP, RELEASE, REMOVE, RENEW};
use self::item::{
    b, millis, n, now_ms, number, s, state, Item, State, COMPLETED, EXPIRATION, ID, IN_PROGRESS,
    NONCE, RELEASED, RELEASED_TOKEN, REMOVED, STATE, VERSION, WRITTEN,
};
use self::seen::{Held, Seen};
use crate::store::{Holder, Recorded};
use crate::{Claim, ClaimRequest, Error, Flights, Key, Store, Token};

#[cfg(feature = "admin")]
mod admin;
mod expression;
mod item;
mod seen;

/// The default time an operation may take before it fails with [`Error::Store`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long an item in progress, or one holding steps, is kept past its lease before the
/// table may delete it: a released call's steps wait this long for its retry.
const KEPT: Duration = Duration::from_secs(24 * 60 * 60);

/// The largest result this store records, in bytes of its encoding: an item holds 400 KB
/// (409 600 bytes, its attributes' names and values together), and a completed item's other
/// attributes take at most 12 KiB (a namespace and a label of at most 4 KiB each are kept;
/// longer ones are kept as none). A larger result is recorded as gone, at once: its caller
/// gets its value, and every retry [`Error::Gone`], never a second run and never a
/// completion sent again for a write DynamoDB can never take.
pub const MAX_RESULT_BYTES: usize = 409_600 - 12 * 1_024;

/// The longest namespace or label an item keeps (longer: kept as none, and listed as
/// unknown).
const NAME_BYTES: usize = 4 * 1_024;

/// How many times a claim reads the item again when it changed between the write and the
/// read (a claim racing a completion that has just expired, say) before it gives up.
const CLAIM_ROUNDS: usize = 4;

/// A store on one DynamoDB table, shared by every process, container and Lambda function
/// that uses the same table.
///
/// Cloning is cheap; clones share the client, the registry of running calls and what this
/// process has seen of other holders' claims.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_runtime::DynamoDbStore;
///
/// # async fn example(config: aws_sdk_dynamodb::Config) -> Result<(), idem_runtime::Error> {
/// let client = aws_sdk_dynamodb::Client::from_conf(config);
/// let store = DynamoDbStore::new(client, "idem").with_timeout(Duration::from_secs(1));
/// store.migrate().await?; // once, at deployment
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct DynamoDbStore {
    client: Client,
    table: Arc<str>,
    timeout: Duration,
    flights: Arc<Flights>,
    seen: Arc<Seen>,
}

impl DynamoDbStore {
    /// A store on `table`, through `client` (whose configuration says the region, the
    /// credentials and the endpoint). Nothing is sent until the first call; create the
    /// table with [`migrate`](Self::migrate) or your infrastructure code.
    pub fn new(client: Client, table: impl Into<Arc<str>>) -> Self {
        Self {
            client,
            table: table.into(),
            timeout: DEFAULT_TIMEOUT,
            flights: Arc::default(),
            seen: Arc::default(),
        }
    }

    /// Sets how long one operation may take, the SDK's own retries included, before it
    /// fails with [`Error::Store`] (default [`DEFAULT_TIMEOUT`]). The body never runs after
    /// such a failure. A write whose reply has not come after three quarters of it is read
    /// back in the rest: a write that landed is then known to have landed, and a stalled
    /// table still fails the operation after one timeout.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Creates the table if it is missing (partition key `id`, a string; on-demand
    /// billing), waits until it is active, and turns on DynamoDB's TTL on `expiration` so
    /// that the table deletes expired items (within days; they are treated as absent until
    /// then). Safe to run from several processes at once.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when the table exists with another key (this store needs a
    /// partition key `id` of type S and no sort key) or with its TTL on another attribute;
    /// [`Error::Store`] when DynamoDB refuses or cannot be reached, or the table does not
    /// become active within a minute.
    pub async fn migrate(&self) -> Result<(), Error> {
        let created = self
            .client
            .create_table()
            .table_name(&*self.table)
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name(ID)
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .map_err(Error::store)?,
            )
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name(ID)
                    .key_type(KeyType::Hash)
                    .build()
                    .map_err(Error::store)?,
            )
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await;
        match created {
            Ok(_) => {}
            Err(err)
                if err
                    .as_service_error()
                    .is_some_and(|err| err.is_resource_in_use_exception()) => {}
            Err(err) => return Err(sdk_error(&err)),
        }
        self.wait_until_active().await?;
        match self.ttl_attribute().await? {
            Some(attribute) if attribute == EXPIRATION => return Ok(()),
            Some(other) => {
                return Err(Error::config(format!(
                    "the DynamoDB table `{}` expires items by `{other}`; DynamoDbStore's items expire by `{EXPIRATION}` (seconds since the epoch), and a table has one TTL attribute: use a table of its own",
                    self.table
                )))
            }
            None => {}
        }
        let enabled = self
            .client
            .update_time_to_live()
            .table_name(&*self.table)
            .time_to_live_specification(
                TimeToLiveSpecification::builder()
                    .enabled(true)
                    .attribute_name(EXPIRATION)
                    .build()
                    .map_err(Error::store)?,
            )
            .send()
            .await;
        match enabled {
            Ok(_) => Ok(()),
            // AWS refuses a second change of a table's TTL within an hour of the first
            // (`ValidationException`): another process's migrate turned it on in the
            // meantime. What the table says now is the answer, whatever the error's text.
            // It is read a few times, a second apart: the description may lag the change.
            Err(err) => {
                for _ in 0..5 {
                    if self.ttl_attribute().await?.as_deref() == Some(EXPIRATION) {
                        return Ok(());
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(Error::store(format!(
                    "DynamoDB refused to turn on the TTL of the table `{}` on `{EXPIRATION}` (it allows one change an hour: after turning it off, run migrate again within the hour's end): {}",
                    self.table,
                    DisplayErrorContext(&err)
                )))
            }
        }
    }

    /// Waits until the table is active, and refuses one whose key is not `id`, a string,
    /// alone: every request of this store would fail on it.
    async fn wait_until_active(&self) -> Result<(), Error> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let described = self
                .client
                .describe_table()
                .table_name(&*self.table)
                .send()
                .await;
            let described = match described {
                Ok(described) => Some(described),
                // `DescribeTable` reads eventually consistently: just after `CreateTable` it
                // may not find the table yet (AWS documents this).
                Err(err)
                    if err
                        .as_service_error()
                        .is_some_and(|err| err.is_resource_not_found_exception())
                        && Instant::now() < deadline =>
                {
                    None
                }
                Err(err) => return Err(sdk_error(&err)),
            };
            let Some(described) = described else {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            let table = described.table();
            let keys: Vec<_> = table
                .map(|table| table.key_schema())
                .unwrap_or_default()
                .iter()
                .map(|key| (key.attribute_name(), key.key_type().as_str()))
                .collect();
            let id_type = table
                .map(|table| table.attribute_definitions())
                .unwrap_or_default()
                .iter()
                .find(|attribute| attribute.attribute_name() == ID)
                .map(|attribute| attribute.attribute_type().as_str());
            if keys != [(ID, "HASH")] || id_type != Some("S") {
                return Err(Error::config(format!(
                    "the DynamoDB table `{}` has the key {keys:?} ({id_type:?}); DynamoDbStore needs a partition key `{ID}` of type S and no sort key: use a table of its own",
                    self.table
                )));
            }
            let status = table.and_then(|table| table.table_status());
            if status.is_some_and(|status| status.as_str() == "ACTIVE") {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::store(format!(
                    "the DynamoDB table `{}` did not become active within a minute ({status:?})",
                    self.table
                )));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The attribute the table's TTL is on, if it is on (or being turned on).
    async fn ttl_attribute(&self) -> Result<Option<String>, Error> {
        let described = self
            .client
            .describe_time_to_live()
            .table_name(&*self.table)
            .send()
            .await
            .map_err(|err| sdk_error(&err))?;
        Ok(described
            .time_to_live_description()
            .filter(|ttl| {
                ttl.time_to_live_status()
                    .is_some_and(|status| matches!(status.as_str(), "ENABLED" | "ENABLING"))
            })
            .and_then(|ttl| ttl.attribute_name())
            .map(str::to_owned))
    }

    /// How long the item of this process's claim of `key` is kept past its lease, should it
    /// lapse unsettled: the call's TTL, at least [`KEPT`].
    fn kept(&self, key: &Key) -> Duration {
        self.seen.kept(key).unwrap_or(KEPT).max(KEPT)
    }

    /// One conditional `UpdateItem` on the item of `key`, `values` bound to its
    /// placeholders (`:written` added): `Ok(Ok(new))` with the attributes `returns` asks
    /// for, or `Ok(Err(old))` with the item as it was when the condition failed (`None`: no
    /// item). Where the endpoint does not return that item, it is read, so that every write
    /// can tell whether an earlier try of its own landed.
    async fn update(
        &self,
        key: &Key,
        expression: &Expression,
        mut values: Vec<(&'static str, AttributeValue)>,
        returns: ReturnValue,
        step: Option<String>,
    ) -> Result<Result<Item, Option<Item>>, Error> {
        let written = crate::store::nonce();
        values.push((":written", n(written)));
        let request = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(ID, s(&key.to_hex()))
            .update_expression(&expression.update)
            .condition_expression(&expression.condition)
            .set_expression_attribute_names(Some(expression.names(step)))
            .set_expression_attribute_values(Some(
                values
                    .into_iter()
                    .map(|(name, value)| (name.to_owned(), value))
                    .collect(),
            ))
            .return_values(returns)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        // The write and, if its reply is late, its read-back share one timeout: the reply is
        // waited for three quarters of it, the read the rest, so that a stalled table fails
        // the operation after one timeout, as every store's does.
        let deadline = tokio::time::Instant::now() + self.timeout;
        let sent = match self
            .within_until(deadline - self.timeout / 4, request.send())
            .await
        {
            Ok(sent) => sent,
            // No reply in time, but the write may have landed all the same (a request that
            // times out may still have succeeded): read back, once, whether it did.
            Err(timed_out) => {
                return match self.get_until(key, deadline).await {
                    Ok(Some(item)) if number(&item, WRITTEN).ok() == Some(written) => Ok(Ok(item)),
                    _ => Err(timed_out),
                };
            }
        };
        let failed = match sent {
            Ok(output) => return Ok(Ok(output.attributes.unwrap_or_default())),
            Err(err) => match err.as_service_error() {
                Some(UpdateItemError::ConditionalCheckFailedException(failed)) => {
                    failed.item().cloned()
                }
                _ => return Err(sdk_error(&err)),
            },
        };
        let old = match failed {
            Some(old) => Some(old),
            None => self.get(key).await?,
        };
        // The SDK sent the request again after losing the reply of one that landed: the
        // condition now fails on this very write.
        match old {
            Some(old) if number(&old, WRITTEN).ok() == Some(written) => Ok(Ok(old)),
            old => Ok(Err(old)),
        }
    }

    /// The item of `key`, read consistently (`None`: none).
    async fn get(&self, key: &Key) -> Result<Option<Item>, Error> {
        self.get_until(key, tokio::time::Instant::now() + self.timeout)
            .await
    }

    /// [`get`](Self::get), answered by `deadline`.
    async fn get_until(
        &self,
        key: &Key,
        deadline: tokio::time::Instant,
    ) -> Result<Option<Item>, Error> {
        let request = self
            .client
            .get_item()
            .table_name(&*self.table)
            .key(ID, s(&key.to_hex()))
            .consistent_read(true);
        let output = self
            .within_until(deadline, request.send())
            .await?
            .map_err(|err| sdk_error(&err))?;
        Ok(output.item)
    }

    /// One compare-and-set on the claim `token`: the attributes it set when it applied,
    /// `None` when the item is not in progress under `token`.
    async fn fenced(
        &self,
        key: &Key,
        token: Token,
        expression: &Expression,
        mut values: Vec<(&'static str, AttributeValue)>,
        step: Option<String>,
    ) -> Result<Option<Item>, Error> {
        values.push((":in_progress", s(IN_PROGRESS)));
        values.push((":token", n(token.get())));
        let done = self
            .update(key, expression, values, ReturnValue::UpdatedNew, step)
            .await?;
        Ok(done.ok())
    }

    /// A key this process has seen held by another claim, not yet for a whole lease, is read
    /// before a claim is written: a waiter's poll costs a consistent read (billed in read
    /// units, by 4 KB), not a failed conditional write (billed in write units, by 1 KB).
    /// `None`: the claim is written (the key changed, or the claim in progress is this
    /// caller's own, under its nonce).
    async fn read_while_held(&self, key: &Key, nonce: u64) -> Result<Option<Claim>, Error> {
        if !self.seen.held(key) {
            return Ok(None);
        }
        let item = self.get(key).await?;
        if item
            .as_ref()
            .is_some_and(|item| number(item, NONCE).ok() == Some(nonce))
        {
            return Ok(None);
        }
        Ok(match state(item.as_ref())? {
            State::InProgress { held, fingerprint }
                if self.seen.saw(key, held, Instant::now()) < held.lease =>
            {
                Some(Claim::InProgress { fingerprint })
            }
            State::Completed {
                value,
                fingerprint,
                expires_at,
            } if expires_at > now_ms() => {
                self.seen.forget(key);
                Some(Claim::Completed { value, fingerprint })
            }
            _ => None,
        })
    }

    /// `operation`'s output, or [`Error::Store`] once the store's timeout passes.
    #[cfg(feature = "admin")]
    async fn within<T>(&self, operation: impl std::future::Future<Output = T>) -> Result<T, Error> {
        self.within_until(tokio::time::Instant::now() + self.timeout, operation)
            .await
    }

    /// `operation`'s output, or [`Error::Store`] once `deadline` passes (a part of the
    /// store's timeout, which the message names).
    async fn within_until<T>(
        &self,
        deadline: tokio::time::Instant,
        operation: impl std::future::Future<Output = T>,
    ) -> Result<T, Error> {
        let timeout = self.timeout;
        tokio::time::timeout_at(deadline, operation)
            .await
            .map_err(|_| Error::store(format!("DynamoDB did not answer within {timeout:?}")))
    }
}

fn sdk_error<E, R>(err: &SdkError<E, R>) -> Error
where
    E: std::error::Error + 'static,
    R: fmt::Debug,
{
    Error::store(format!("DynamoDB: {}", DisplayErrorContext(err)))
}

/// Seconds since the epoch `after` from now, for DynamoDB's TTL attribute.
fn expiration(now_ms: u64, after: Duration) -> u64 {
    (now_ms.saturating_add(millis(after))).div_ceil(1000)
}

impl fmt::Debug for DynamoDbStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoDbStore")
            .field("table", &self.table)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Store for DynamoDbStore {
    /// A claim found in progress under this nonce is this call's own (a reply was lost):
    /// it is taken again under the next token, with a whole lease. The item says whose the
    /// claim is: its namespace, label and holder, for an operator's listing; and what the
    /// item was before it, so that the claim tells whether it took an unsettled one over.
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        let ClaimRequest {
            key,
            fingerprint,
            lease,
            nonce,
            claimant,
            ..
        } = *request;
        let named = |name: Option<&str>| {
            name.filter(|name| name.len() <= NAME_BYTES)
                .map_or(AttributeValue::Null(true), s)
        };
        for _ in 0..CLAIM_ROUNDS {
            if let Some(found) = self.read_while_held(key, nonce).await? {
                return Ok(found);
            }
            let now = now_ms();
            let lapsed = self.seen.lapsed(key);
            let mut values = vec![
                (":released", s(RELEASED)),
                (":removed", s(REMOVED)),
                (":completed", s(COMPLETED)),
                (":in_progress", s(IN_PROGRESS)),
                (":now", n(now)),
                (":nonce", n(nonce)),
                (":start", n(now.saturating_mul(1000))),
                (":zero", n(0)),
                (":one", n(1)),
                (":lease", n(millis(lease))),
                (
                    ":expiration",
                    n(expiration(now, lease + request.ttl.max(KEPT))),
                ),
                (":none", s(item::NONE)),
                (":no_steps", AttributeValue::M(HashMap::new())),
                (":namespace", named(claimant.namespace())),
                (":label", named(claimant.label())),
                (":holder", s(Holder::this_process_text())),
            ];
            if let Some(held) = lapsed {
                values.push((":seen_token", n(held.token.get())));
                values.push((":seen_version", n(held.version)));
            }
            if let Some(fingerprint) = fingerprint {
                values.push((":fingerprint", b(fingerprint.as_bytes())));
            }
            let expression = expression::claim(fingerprint.is_some(), lapsed.is_some());
            // The whole item as the claim left it: what it was before is in it too, as
            // `UPDATED_NEW` would leave out an attribute set to the value it had.
            let claimed = self
                .update(key, expression, values, ReturnValue::AllNew, None)
                .await?;
            let old = match claimed {
                Ok(new) => {
                    let held = item::acquired(&new, lease)?;
                    // This process's own claim: seen from the moment it was answered.
                    self.seen.saw(key, held, Instant::now());
                    self.seen.claimed(key, request.ttl);
                    return Ok(Claim::Acquired {
                        token: held.token,
                        taken_over: item::taken_over(&new, nonce),
                    });
                }
                Err(old) => old,
            };
            let own = old
                .as_ref()
                .is_some_and(|old| number(old, NONCE).ok() == Some(nonce));
            if own && matches!(state(old.as_ref())?, State::InProgress { .. }) {
                // This caller's own claim, whose answer was lost: taken again.
                let values = vec![
                    (":in_progress", s(IN_PROGRESS)),
                    (":nonce", n(nonce)),
                    (":one", n(1)),
                    (":now", n(now)),
                    (":lease", n(millis(lease))),
                    (
                        ":expiration",
                        n(expiration(now, lease + request.ttl.max(KEPT))),
                    ),
                    (":namespace", named(claimant.namespace())),
                    (":label", named(claimant.label())),
                    (":holder", s(Holder::this_process_text())),
                ];
                if let Ok(new) = self
                    .update(key, &OWN, values, ReturnValue::AllNew, None)
                    .await?
                {
                    let held = item::acquired(&new, lease)?;
                    self.seen.saw(key, held, Instant::now());
                    self.seen.claimed(key, request.ttl);
                    return Ok(Claim::Acquired {
                        token: held.token,
                        taken_over: item::taken_over(&new, nonce),
                    });
                }
                continue; // changed since: the next round sees it as it is now
            }
            match state(old.as_ref())? {
                State::InProgress {
                    held, fingerprint, ..
                } => {
                    if self.seen.saw(key, held, Instant::now()) < held.lease {
                        return Ok(Claim::InProgress { fingerprint });
                    }
                    // Seen unchanged for a whole lease: claimed again, over exactly it.
                }
                State::Completed {
                    value,
                    fingerprint,
                    expires_at,
                } if expires_at > now => {
                    self.seen.forget(key);
                    return Ok(Claim::Completed { value, fingerprint });
                }
                // Changed since: the next round sees it as it is now.
                State::Completed { .. } | State::Free => {}
            }
        }
        Err(Error::store(format!(
            "the DynamoDB item of key {} changed under {CLAIM_ROUNDS} claims in a row",
            key.short()
        )))
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        let value = if value.len() > MAX_RESULT_BYTES {
            tracing::warn!(
                outcome = "gone",
                bytes = value.len(),
                max_bytes = MAX_RESULT_BYTES,
                "the result is larger than a DynamoDB item holds: its key is recorded as gone, and retries get `Error::Gone`"
            );
            Bytes::from_static(crate::codec::GONE)
        } else {
            value
        };
        let now = now_ms();
        let values = vec![
            (":completed", s(COMPLETED)),
            (":value", b(&value)),
            (":expires_at", n(now.saturating_add(millis(ttl)))),
            (":expiration", n(expiration(now, ttl))),
            (":one", n(1)),
        ];
        let done = self.fenced(key, token, &COMPLETE, values, None).await?;
        self.seen.forget(key);
        Ok(done.is_some())
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        let values = vec![(":released", s(RELEASED)), (":one", n(1))];
        let done = self.fenced(key, token, &RELEASE, values, None).await?;
        self.seen.forget(key);
        Ok(done.is_some())
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        let now = now_ms();
        let values = vec![
            (":one", n(1)),
            (":lease", n(millis(lease))),
            (":now", n(now)),
            (":expiration", n(expiration(now, lease + self.kept(key)))),
        ];
        let Some(new) = self.fenced(key, token, &RENEW, values, None).await? else {
            return Ok(false);
        };
        if let Ok(version) = number(&new, VERSION) {
            let held = Held {
                token,
                version,
                lease,
            };
            self.seen.saw(key, held, Instant::now());
        }
        Ok(true)
    }

    /// Claim tokens grow on this store: a claim's fence is its token, without a round trip.
    /// A holder that lost the key gets its own, smaller token, which downstream fences refuse.
    async fn fence(&self, _key: &Key, token: Token) -> Result<Option<Token>, Error> {
        Ok(Some(token))
    }

    async fn record_step(
        &self,
        call: &Key,
        token: Token,
        step: &Key,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        let now = now_ms();
        let values = vec![
            (":step", item::step(&value, now.saturating_add(millis(ttl)))),
            (":expiration", n(expiration(now, ttl.max(KEPT)))),
        ];
        let recorded = self
            .fenced(call, token, &RECORD_STEP, values, Some(step.to_hex()))
            .await?;
        Ok(recorded.is_some())
    }

    async fn steps(&self, call: &Key) -> Result<Vec<(Key, Bytes)>, Error> {
        item::steps(self.get(call).await?.as_ref(), now_ms())
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        let values = vec![(":removed", s(REMOVED)), (":zero", n(0)), (":one", n(1))];
        self.seen.forget(key);
        match self
            .update(key, &REMOVE, values, ReturnValue::AllOld, None)
            .await?
        {
            Ok(old) => Ok(matches!(
                item::string(&old, STATE),
                Ok(IN_PROGRESS | COMPLETED)
            )),
            Err(_) => Ok(false),
        }
    }

    async fn lookup(&self, key: &Key) -> Result<Option<Recorded>, Error> {
        let now = now_ms();
        match state(self.get(key).await?.as_ref())? {
            State::Completed {
                value,
                fingerprint,
                expires_at,
            } if expires_at > now => Ok(Some(Recorded::new(
                value,
                fingerprint,
                Some(Duration::from_millis(expires_at - now)),
            ))),
            State::InProgress { held, .. } => {
                self.seen.saw(key, held, Instant::now());
                Ok(None)
            }
            State::Completed { .. } | State::Free => Ok(None),
        }
    }

    /// By what this process has seen of the claim: its lease, less how long it has been
    /// seen unchanged (a whole lease the first time this process sees it).
    async fn lease_left(&self, key: &Key) -> Result<Option<Duration>, Error> {
        match state(self.get(key).await?.as_ref())? {
            State::InProgress { held, .. } => Ok(self.seen.left(key, held)),
            State::Completed { .. } | State::Free => Ok(None),
        }
    }

    /// One consistent read: the token an operator last released (tokens only grow, so an
    /// older holder's is released too).
    async fn released_by_operator(&self, key: &Key, token: Token) -> Result<bool, Error> {
        let item = self.get(key).await?;
        Ok(item
            .as_ref()
            .and_then(|item| number(item, RELEASED_TOKEN).ok())
            .is_some_and(|released| token.get() <= released))
    }

    fn claim_timeout(&self) -> Option<Duration> {
        Some(self.timeout)
    }

    fn flights(&self) -> Option<&Flights> {
        Some(&self.flights)
    }
}
