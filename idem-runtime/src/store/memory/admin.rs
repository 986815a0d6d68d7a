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

/// A page in the making: the smallest `limit + 1` keys after the cursor that the filter
/// selects, whatever order they are offered in (one more says there is a next page).
struct Smallest<'a> {
    filter: &'a Filter,
    after: Option<Key>,
    entries: BTreeMap<Key, Entry>,
}

impl<'a> Smallest<'a> {
    fn new(filter: &'a Filter, after: Option<Key>) -> Self {
        Self {
            filter,
            after,
            entries: BTreeMap::new(),
        }
    }

    fn offer(&mut self, entry: Entry) {
        let key = *entry.key();
        if self.after.is_some_and(|after| key <= after)
            || !self.filter.matches(entry.namespace(), entry.state())
            // A key seen twice (a claim that completed while the walk went on) keeps its
            // first entry, and costs the page no other key.
            || self.entries.contains_key(&key)
        {
            return;
        }
        if self.entries.len() > self.filter.page_size() {
            match self.entries.last_key_value() {
                Some((last, _)) if *last > key => {
                    self.entries.pop_last();
                }
                _ => return,
            }
        }
        self.entries.insert(key, entry);
    }

    fn finish(mut self) -> Page {
        let more = self.entries.len() > self.filter.page_size();
        if more {
            self.entries.pop_last();
        }
        let next = more
            .then(|| {
                self.entries
                    .last_key_value()
                    .map(|(key, _)| Cursor::after(*key))
            })
            .flatten();
        Page::new(self.entries.into_values().collect(), next)
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
        let mut page = Smallest::new(filter, Cursor::key_order(after)?);
        let mut offer = |entry: Entry| page.offer(entry);
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
        // Under the marks' lock, no shard's held: the marks are locked after a shard's
        // claims, never before.
        for (key, _) in self.marks().live(now) {
            if !self.inner.results.contains_key(key) {
                offer(Entry::new(*key, State::Gone));
            }
        }
        Ok(page.finish())
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
        // Fenced before the claim goes, under its shard's lock: the holder's completion
        // is refused only after this, so it always finds itself fenced.
        self.inner.flights.released(key);
        claims.live.remove(key);
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
        // As in `release`: fenced before the claim goes.
        self.inner.flights.released(key);
        self.forget(&mut claims, key);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(byte: u8) -> Entry {
        Entry::new(Key::from_bytes([byte; 32]), State::Completed)
    }

    fn keys(page: &Page) -> Vec<u8> {
        page.entries()
            .iter()
            .map(|e| e.key().as_bytes()[0])
            .collect()
    }

    #[test]
    fn a_page_keeps_the_smallest_keys_after_its_cursor_in_any_order() {
        let filter = Filter::all().limit(2);
        let mut page = Smallest::new(&filter, Some(Key::from_bytes([1; 32])));
        for byte in [9, 1, 4, 0, 7, 3] {
            page.offer(entry(byte));
        }
        let page = page.finish();
        assert_eq!(keys(&page), [3, 4]);
        assert_eq!(page.next(), Some(Cursor::after(Key::from_bytes([4; 32]))));
    }

    #[test]
    fn a_key_offered_twice_costs_the_page_no_other_key() {
        let filter = Filter::all().limit(2);
        let mut page = Smallest::new(&filter, None);
        for byte in [1, 2, 3, 2] {
            page.offer(entry(byte));
        }
        let page = page.finish();
        assert_eq!(keys(&page), [1, 2]);
        assert!(page.next().is_some(), "key 3 is still to come");
    }
}
