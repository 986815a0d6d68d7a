//! An operator's view of the memory store: every record is in this process, so a listing
//! walks its claims, results and marks and keeps the page's worth of keys after the cursor
//! (memory bounded by the page; time by the records).

use std::collections::BTreeMap;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{ClaimRecord, MemoryStore, ResultRecord};
use crate::admin::{self, Admin, Cursor, Entry, Filter, Page, Refusal, Release, State, Verdict};
use crate::store::Holder;
use crate::{Error, Key, Token};

impl ClaimRecord {
    fn entry(&self, key: Key, now: Instant) -> Entry {
        let left = self.until.saturating_duration_since(now);
        let state = if left.is_zero() {
            State::Lapsed
        } else {
            State::Held
        };
        Entry::new(key, state)
            .with_names(
                self.about.namespace.as_deref().map(str::to_owned),
                self.about.label.as_deref().map(str::to_owned),
            )
            .with_claim(
                self.token,
                (!self.about.lease.is_zero()).then_some(self.about.lease),
                left,
                Some(Holder::this_process().clone()),
            )
    }
}

impl ResultRecord {
    fn entry(&self, key: Key, now: Instant, value: bool) -> Entry {
        let gone = self.kept.value[..] == *crate::codec::GONE;
        let state = if gone { State::Gone } else { State::Completed };
        Entry::new(key, state)
            .with_names(
                self.about.namespace.as_deref().map(str::to_owned),
                self.about.label.as_deref().map(str::to_owned),
            )
            .with_result(
                Some(self.until.saturating_duration_since(now)),
                Some(self.kept.value.len() as u64),
                value.then(|| self.kept.value.clone()),
            )
    }
}

impl MemoryStore {
    /// The record of `key` as an operator sees it, read under its shard's lock.
    fn entry(&self, claims: &super::Claims, key: &Key, now: Instant, value: bool) -> Option<Entry> {
        if let Some(claim) = claims.live.get(key) {
            return Some(claim.entry(*key, now));
        }
        if let Some(result) = self.live_result(key) {
            return Some(result.entry(*key, now, value));
        }
        self.marks()
            .get(key, now)
            .map(|_| Entry::new(*key, State::Gone))
    }

    /// Forgets `key`'s claim, result, mark and steps, under its shard's lock.
    fn forget(&self, claims: &mut super::Claims, key: &Key) {
        claims.live.remove(key);
        self.inner.results.remove(key);
        self.marks().remove(key);
        self.inner.steps.remove(key);
    }
}

#[async_trait]
impl Admin for MemoryStore {
    async fn list(&self, filter: &Filter, after: Option<&Cursor>) -> Result<Page, Error> {
        let now = Instant::now();
        let limit = filter.page_size();
        // The smallest `limit + 1` keys after the cursor: one more says there is a next page.
        let mut page: BTreeMap<Key, Entry> = BTreeMap::new();
        let mut offer = |entry: Entry| {
            if after.is_some_and(|cursor| entry.key() <= cursor.key())
                || !filter.matches(entry.namespace(), entry.state())
            {
                return;
            }
            if page.len() > limit {
                match page.last_key_value() {
                    Some((last, _)) if last > entry.key() => {
                        page.pop_last();
                    }
                    _ => return,
                }
            }
            page.entry(*entry.key()).or_insert(entry);
        };
        for shard in &self.inner.claims {
            let claims = shard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (key, claim) in &claims.live {
                offer(claim.entry(*key, now));
            }
        }
        for (key, result) in &self.inner.results {
            offer(result.entry(*key, now, filter.values()));
        }
        let marked: Vec<Key> = {
            let marks = self.marks();
            marks.live(now).map(|(key, _)| *key).collect()
        };
        for key in marked {
            if !self.inner.results.contains_key(&key) {
                offer(Entry::new(key, State::Gone));
            }
        }
        let next = (page.len() > limit).then(|| {
            page.pop_last();
            page.last_key_value().map(|(key, _)| Cursor::after(*key))
        });
        Ok(Page::new(page.into_values().collect(), next.flatten()))
    }

    async fn inspect(&self, key: &Key) -> Result<Option<Entry>, Error> {
        let now = Instant::now();
        let entry = {
            let claims = self.claims(key);
            self.entry(&claims, key, now, true)
        };
        Ok(entry.map(|entry| {
            let steps = self.inner.steps.of(key);
            entry.with_steps(
                steps
                    .into_iter()
                    .map(|(step, value)| (step, value.len() as u64))
                    .collect(),
            )
        }))
    }

    async fn release(&self, key: &Key, token: Token, how: Release) -> Result<Verdict, Error> {
        let now = Instant::now();
        let mut claims = self.claims(key);
        let Some(entry) = self.entry(&claims, key, now, false) else {
            return Ok(Verdict::Refused(Refusal::NotFound));
        };
        if let Some(refusal) = admin::refusal(&entry, Some(token), how) {
            return Ok(Verdict::Refused(refusal));
        }
        claims.live.remove(key);
        drop(claims);
        self.inner.flights.released(key);
        Ok(Verdict::Done)
    }

    async fn reset(&self, key: &Key, how: Release) -> Result<Verdict, Error> {
        let now = Instant::now();
        let mut claims = self.claims(key);
        let Some(entry) = self.entry(&claims, key, now, false) else {
            return Ok(Verdict::Refused(Refusal::NotFound));
        };
        if let Some(refusal) = admin::refusal(&entry, None, how) {
            return Ok(Verdict::Refused(refusal));
        }
        self.forget(&mut claims, key);
        drop(claims);
        self.inner.flights.released(key);
        Ok(Verdict::Done)
    }

    /// Lapsed claims go; expired results and marks are moka's and the marks' own to drop,
    /// so only the claims are counted.
    async fn purge(&self) -> Result<u64, Error> {
        let now = Instant::now();
        let mut purged = 0;
        for shard in &self.inner.claims {
            let mut claims = shard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let before = claims.live.len();
            claims.live.retain(|_, claim| claim.until > now);
            purged += (before - claims.live.len()) as u64;
        }
        self.inner.results.run_pending_tasks();
        Ok(purged)
    }
}
