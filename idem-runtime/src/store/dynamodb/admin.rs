//! [`Admin`] for [`DynamoDbStore`]: a listing is a `Scan` with a filter (never on the hot
//! path); a release or reset is one conditional `UpdateItem`.
//!
//! DynamoDB offers no clock to a condition, so a holder's silence is judged as the store
//! judges a lapsed lease: by watching. A release `IfSilent` refuses at once a holder whose
//! item says it renewed within half its lease (by the holder's clock), and otherwise reads
//! the item again after half a lease, by this process's clock: it releases only if the
//! item is unchanged (the same token and version) and only under that version, so that a
//! renewal in between makes it refuse.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};
use bytes::Bytes;

use super::expression::{FORGET, RELEASE_BY_OPERATOR, RELEASE_UNCHANGED};
use super::item::{
    blob, n, now_ms, number, s, steps, string, Item, COMPLETED, EXPIRES_AT, HOLDER, ID,
    IN_PROGRESS, LABEL, LEASE_MS, NAMESPACE, RELEASED, REMOVED, RENEWED_AT, STATE, TOKEN, VALUE,
    VERSION,
};
use super::{sdk_error, DynamoDbStore};
use crate::admin::{self, Admin, Cursor, Ending, Entry, Filter, Page, Refusal, Release, State};
use crate::store::Holder;
use crate::{Error, Key, Token};

/// `Scan` requests one page may send: a page the filter leaves short ends there, with a
/// `next`, instead of reading the whole table in one call.
const SCANS: usize = 8;

/// What a cursor of this store starts with, before the last item's id: never 64 hex
/// digits alone.
const POSITION: &str = "after-";

impl DynamoDbStore {
    /// The item of `key` as an operator sees it (`None`: none, or free).
    async fn entry_of(&self, key: &Key, values: bool) -> Result<Option<(Entry, Item)>, Error> {
        let Some(item) = self.get(key).await? else {
            return Ok(None);
        };
        Ok(entry(*key, &item, values, now_ms())?.map(|entry| (entry, item)))
    }

    /// Releases the claim `entry` showed, under `token`, as `how` allows (see the module's
    /// docs): `None` when it was released, else why not.
    async fn release_claim(
        &self,
        entry: &Entry,
        item: &Item,
        token: Token,
        how: Release,
    ) -> Result<Option<Refusal>, Error> {
        let key = *entry.key();
        let unconditional = how == Release::Force || entry.holder().is_some_and(Holder::has_exited);
        let mut values = vec![
            (":released", s(RELEASED)),
            (":one", n(1)),
            (":in_progress", s(IN_PROGRESS)),
            (":token", n(token.get())),
        ];
        let expression = if unconditional {
            &*RELEASE_BY_OPERATOR
        } else {
            if !entry.is_silent() {
                return Ok(Some(Refusal::Live {
                    renewed_ago: entry.renewed_ago(),
                }));
            }
            // Silent by the holder's clock: watched for half a lease by this one's.
            let version = number(item, VERSION)?;
            let lease = entry.lease().unwrap_or_default();
            let watched = Instant::now();
            tokio::time::sleep(lease / 2).await;
            let now = self.get(&key).await?;
            let unchanged = now.as_ref().is_some_and(|now| {
                number(now, TOKEN).ok() == Some(token.get())
                    && number(now, VERSION).ok() == Some(version)
                    && string(now, STATE).ok() == Some(IN_PROGRESS)
            });
            if !unchanged {
                return Ok(Some(Refusal::Live {
                    renewed_ago: Some(watched.elapsed().min(lease / 2)),
                }));
            }
            values.push((":version", n(version)));
            &*RELEASE_UNCHANGED
        };
        self.flights.fence(&key, true);
        let released = self
            .update(&key, expression, values, ReturnValue::None, None)
            .await;
        let old = match released {
            Ok(Ok(_)) => {
                self.seen.forget(&key);
                self.flights.released(&key);
                return Ok(None);
            }
            Ok(Err(old)) => old,
            Err(err) => {
                self.flights.fence(&key, false);
                return Err(err);
            }
        };
        self.flights.fence(&key, false);
        // Changed since it was read: taken again, settled, or renewed.
        let now = old
            .as_ref()
            .map(|old| self::entry(key, old, false, now_ms()))
            .transpose()?
            .flatten();
        Ok(Some(match now {
            None => Refusal::NotFound,
            Some(now) => admin::refusal(&now, Some(token), Release::Force)
                .unwrap_or(Refusal::Live { renewed_ago: None }),
        }))
    }
}

/// The entry of an item, as it stands at `now` (ms since the epoch): `None` for an item
/// that is free (released, removed, or completed and expired).
fn entry(key: Key, item: &Item, values: bool, now: u64) -> Result<Option<Entry>, Error> {
    let name = |attribute: &str| match item.get(attribute) {
        Some(AttributeValue::S(text)) => Some(text.clone()),
        _ => None,
    };
    let names = (name(NAMESPACE), name(LABEL));
    match string(item, STATE)? {
        IN_PROGRESS => {
            let token = Token::new(number(item, TOKEN)?);
            let lease = number(item, LEASE_MS).ok().map(Duration::from_millis);
            // By the holder's clock: what the item says, for an operator to read.
            let left = match (lease, number(item, RENEWED_AT)) {
                (Some(lease), Ok(renewed)) => {
                    let ends = renewed
                        .saturating_add(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX));
                    Duration::from_millis(ends.saturating_sub(now))
                }
                _ => Duration::ZERO,
            };
            let state = if left.is_zero() {
                State::Lapsed
            } else {
                State::Held
            };
            let holder = name(HOLDER).as_deref().and_then(Holder::decode);
            Ok(Some(
                Entry::new(key, state)
                    .with_names(names.0, names.1)
                    .with_claim(token, lease, left, holder),
            ))
        }
        COMPLETED => {
            let expires_at = number(item, EXPIRES_AT)?;
            if expires_at <= now {
                return Ok(None);
            }
            let value: Bytes = blob(item, VALUE)?;
            let size = value.len() as u64;
            Ok(Some(
                Entry::new(key, State::Completed)
                    .with_names(names.0, names.1)
                    .with_result(
                        Some(Duration::from_millis(expires_at - now)),
                        Some(size),
                        values.then_some(value),
                    ),
            ))
        }
        _ => Ok(None),
    }
}

/// The key of an item's id.
fn key_of(item: &Item) -> Result<Key, Error> {
    admin::parse_digest(string(item, ID)?)
}

#[async_trait]
impl Admin for DynamoDbStore {
    /// A `Scan` of the table, in its own order (by the hash of the id), filtered by
    /// namespace and state in DynamoDB (`begins_with`), strongly consistent. A `Scan`
    /// reads, and bills, every item it passes, whatever the filter keeps (one read unit
    /// per 4 KB of them); at most 8 requests a page, each asking for the page's room, so a
    /// page may be short, or empty, with a `next`.
    async fn list(&self, filter: &Filter, after: Option<&Cursor>) -> Result<Page, Error> {
        let size = filter.page_size();
        let mut start = match after {
            None => None,
            Some(cursor) => {
                let id = cursor
                    .store_position()
                    .and_then(|text| text.strip_prefix(POSITION))
                    .filter(|id| admin::parse_digest(id).is_ok())
                    .ok_or_else(|| {
                        Error::config(format!(
                            "the cursor {cursor} is not a DynamoDB listing's (`{POSITION}<id>`)"
                        ))
                    })?;
                Some(id.to_owned())
            }
        };
        let mut condition = format!("#{STATE} IN (:in_progress, :completed)");
        let mut values = vec![
            (":in_progress".to_owned(), s(IN_PROGRESS)),
            (":completed".to_owned(), s(COMPLETED)),
        ];
        if let Some(prefix) = filter.prefix() {
            condition.push_str(&format!(" AND begins_with(#{NAMESPACE}, :prefix)"));
            values.push((":prefix".to_owned(), s(prefix)));
        }
        let mut names = vec![("#state".to_owned(), STATE.to_owned())];
        if filter.prefix().is_some() {
            names.push(("#namespace".to_owned(), NAMESPACE.to_owned()));
        }
        let now = now_ms();
        let mut entries = Vec::with_capacity(size.min(128));
        for _ in 0..SCANS {
            let room = i32::try_from(size - entries.len()).unwrap_or(i32::MAX);
            let request = self
                .client
                .scan()
                .table_name(&*self.table)
                .consistent_read(true)
                .limit(room)
                .filter_expression(&condition)
                .set_expression_attribute_names(Some(names.iter().cloned().collect()))
                .set_expression_attribute_values(Some(values.iter().cloned().collect()))
                .set_exclusive_start_key(
                    start
                        .as_ref()
                        .map(|id| [(ID.to_owned(), s(id))].into_iter().collect()),
                );
            let output = self
                .within(request.send())
                .await?
                .map_err(|err| sdk_error(&err))?;
            for item in output.items() {
                let Some(entry) = entry(key_of(item)?, item, filter.values(), now)? else {
                    continue;
                };
                if filter.admits(&entry) {
                    entries.push(entry);
                }
            }
            start = match output.last_evaluated_key().and_then(|last| last.get(ID)) {
                Some(AttributeValue::S(id)) => Some(id.clone()),
                _ => return Ok(Page::new(entries, None)),
            };
            if entries.len() >= size {
                break;
            }
        }
        let next = start
            .map(|id| Cursor::position(format!("{POSITION}{id}")))
            .transpose()?;
        Ok(Page::new(entries, next))
    }

    async fn inspect(&self, key: &Key) -> Result<Option<Entry>, Error> {
        let Some((entry, item)) = self.entry_of(key, true).await? else {
            return Ok(None);
        };
        let steps = steps(Some(&item), now_ms())?
            .into_iter()
            .map(|(step, value)| (step, value.len() as u64))
            .collect();
        Ok(Some(entry.with_steps(steps)))
    }

    async fn look(&self, key: &Key) -> Result<Option<Entry>, Error> {
        Ok(self.entry_of(key, false).await?.map(|(entry, _)| entry))
    }

    /// Read again for the item's version, which the silence is watched by: the release
    /// itself is conditional on the token, and on that version unless forced.
    async fn end_claim(
        &self,
        entry: &Entry,
        token: Token,
        how: Release,
        forget: bool,
    ) -> Result<Ending, Error> {
        let Some((now, item)) = self.entry_of(entry.key(), false).await? else {
            return Ok(Ending::Changed);
        };
        if now.token() != Some(token) || !matches!(now.state(), State::Held | State::Lapsed) {
            return Ok(Ending::Changed);
        }
        Ok(match self.release_claim(&now, &item, token, how).await? {
            // Its steps go with it: the call runs again from its start.
            None if forget => {
                self.forget_item(entry.key()).await?;
                Ending::Ended
            }
            None => Ending::Ended,
            Some(refusal) => Ending::Refused(refusal),
        })
    }

    async fn forget_call(&self, entry: &Entry) -> Result<Ending, Error> {
        Ok(if self.forget_item(entry.key()).await? {
            Ending::Ended
        } else {
            Ending::Changed
        })
    }

    /// The table's TTL deletes expired items (within days; they read as absent until then):
    /// nothing to purge.
    async fn purge(&self) -> Result<u64, Error> {
        Ok(0)
    }
}

impl DynamoDbStore {
    /// Forgets a completed (or released) call: its value and steps go, and its next call
    /// runs again. Whether there was one to forget.
    async fn forget_item(&self, key: &Key) -> Result<bool, Error> {
        let values = vec![
            (":removed", s(REMOVED)),
            (":one", n(1)),
            (":completed", s(COMPLETED)),
            (":released", s(RELEASED)),
        ];
        self.seen.forget(key);
        Ok(self
            .update(key, &FORGET, values, ReturnValue::None, None)
            .await?
            .is_ok())
    }
}
