//! An operator's view of the memory store: every record is in this process, so a listing
//! walks its claims, results and marks and keeps the page's worth of keys after the cursor
//! (memory bounded by the page; time by the records).

use std::collections::BTreeMap;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{ClaimRecord, MemoryStore, ResultRecord};
use crate::admin::{self, Admin, Cursor, Ending, Entry, Filter, Page, Release, State};
use crate::store::Holder;
use crate::{Error, Key, Token};

impl ClaimRecord {
    fn state(&self, now: Instant) -> State {
        if self.until <= now {
            State::Lapsed
        } else {
            State::Held
        }
    }

    fn entry(&self, key: Key, now: Instant) -> Entry {
        let left = self.until.saturating_duration_since(now);
        Entry::new(key, self.state(now))
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
    fn state(&self) -> State {
        if self.kept.value[..] == *crate::codec::GONE {
            State::Gone
        } else {
            State::Completed
        }
    }

    fn entry(&self, key: Key, now: Instant, value: bool) -> Entry {
        Entry::new(key, self.state())
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

    /// Whether the page takes `key` in `state` of `namespace`: after the cursor, selected
    /// by the filter, not taken yet, and among the smallest so far. Asked before an entry
    /// is made, so that a walk over many records makes a page's worth of entries.
    fn takes(&self, key: &Key, names: (Option<&str>, Option<&str>), state: State) -> bool {
        let (namespace, label) = names;
        !(self.after.is_some_and(|after| *key <= after)
            || !self.filter.matches(namespace, state)
            || !self.filter.labelled(label)
            // A key seen twice (a claim that completed while the walk went on) keeps its
            // first entry, and costs the page no other key.
            || self.entries.contains_key(key)
            || self.entries.len() > self.filter.page_size()
                && self.entries.last_key_value().is_some_and(|(last, _)| last < key))
    }

    /// Takes `entry`, which [`takes`](Self::takes) said the page takes.
    fn take(&mut self, entry: Entry) {
        if self.entries.len() > self.filter.page_size() {
            self.entries.pop_last();
        }
        self.entries.insert(*entry.key(), entry);
    }

    /// Offers `key`: its entry is made only if the page takes it.
    fn offer(
        &mut self,
        key: &Key,
        names: (Option<&str>, Option<&str>),
        state: State,
        entry: impl FnOnce() -> Entry,
    ) {
        if self.takes(key, names, state) {
            self.take(entry());
        }
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
        for shard in &self.inner.claims {
            let claims = shard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (key, claim) in &claims.live {
                let names = (
                    claim.about.namespace.as_deref(),
                    claim.about.label.as_deref(),
                );
                page.offer(key, names, claim.state(now), || claim.entry(*key, now));
            }
        }
        for (key, result) in &self.inner.results {
            let names = (
                result.about.namespace.as_deref(),
                result.about.label.as_deref(),
            );
            page.offer(&key, names, result.state(), || {
                result.entry(*key, now, filter.values())
            });
        }
        // Under the marks' lock, no shard's held: the marks are locked after a shard's
        // claims, never before. A mark whose result lives was offered as that result (the
        // results are asked only for a key the page would take).
        for (key, _) in self.marks().live(now) {
            if page.takes(key, (None, None), State::Gone) && !self.inner.results.contains_key(key) {
                page.take(Entry::new(*key, State::Gone));
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

    async fn look(&self, key: &Key) -> Result<Option<Entry>, Error> {
        let claims = self.claims(key);
        Ok(self.entry(&claims, key, Instant::now(), false))
    }

    /// Judged again under the key's shard lock, which every claim, renewal and completion
    /// of the key takes: nothing changes between the judging and the write.
    async fn end_claim(
        &self,
        entry: &Entry,
        token: Token,
        how: Release,
        forget: bool,
    ) -> Result<Ending, Error> {
        let key = entry.key();
        let now = Instant::now();
        let mut claims = self.claims(key);
        let still = self.entry(&claims, key, now, false).filter(|now| {
            matches!(now.state(), State::Held | State::Lapsed)
                && now.token() == Some(token)
                && admin::refusal(now, Some(token), how).is_none()
        });
        if still.is_none() {
            return Ok(Ending::Changed);
        }
        // Fenced before the claim lapses or goes: the holder's completion is refused only
        // after this, so it always finds itself fenced. A released claim lapses rather
        // than goes: its body's outcome is unknown, and the next claim is told so.
        self.inner.flights.released(key);
        if forget {
            self.forget(&mut claims, key);
        } else if let Some(claim) = claims.live.get_mut(key) {
            claim.until = claim.until.min(now);
        }
        Ok(Ending::Ended)
    }

    async fn forget_call(&self, entry: &Entry) -> Result<Ending, Error> {
        let key = entry.key();
        let mut claims = self.claims(key);
        let still = self
            .entry(&claims, key, Instant::now(), false)
            .is_some_and(|now| matches!(now.state(), State::Completed | State::Gone));
        if !still {
            return Ok(Ending::Changed);
        }
        self.inner.flights.released(key);
        self.forget(&mut claims, key);
        Ok(Ending::Ended)
    }

    /// Claims lapsed longer than their call's TTL go; expired results and marks are moka's
    /// and the marks' own to drop, so only the claims are counted.
    async fn purge(&self) -> Result<u64, Error> {
        let now = Instant::now();
        let mut purged = 0;
        for shard in &self.inner.claims {
            let mut claims = shard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let before = claims.live.len();
            claims.live.retain(|_, claim| claim.remembered(now));
            purged += (before - claims.live.len()) as u64;
        }
        self.inner.results.run_pending_tasks();
        Ok(purged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Offers the completed record whose key is `byte` repeated.
    fn offer(page: &mut Smallest<'_>, byte: u8) {
        let key = Key::from_bytes([byte; 32]);
        page.offer(&key, (None, None), State::Completed, || {
            Entry::new(key, State::Completed)
        });
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
            offer(&mut page, byte);
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
            offer(&mut page, byte);
        }
        let page = page.finish();
        assert_eq!(keys(&page), [1, 2]);
        assert!(page.next().is_some(), "key 3 is still to come");
    }

    #[test]
    fn an_entry_is_made_only_for_a_key_the_page_takes() {
        let filter = Filter::namespace("billing.").limit(1);
        let mut page = Smallest::new(&filter, None);
        let mut made = Vec::new();
        for (byte, namespace) in [
            (5, "billing.a"),
            (1, "orders.a"),
            (3, "billing.b"),
            (9, "billing.c"),
            (4, "billing.d"),
        ] {
            let key = Key::from_bytes([byte; 32]);
            page.offer(&key, (Some(namespace), None), State::Completed, || {
                made.push(byte);
                Entry::new(key, State::Completed)
            });
        }
        // 1 is of another namespace; 9 comes after the page's two smallest (5, then 3).
        assert_eq!(made, [5, 3, 4]);
        assert_eq!(keys(&page.finish()), [3]);
    }
}
