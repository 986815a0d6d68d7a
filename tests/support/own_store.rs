//! A store written from the `Store` and `Admin` docs alone, as a third party would: one
//! "server" (a map behind a lock, with its clock) and instances over it, each with state of
//! its own. It keeps the contract, or breaks it one way ([`Mutation`]) for the tests to show
//! that `idem_runtime::testkit` catches the breakage and names the check.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem_runtime::admin::{Admin, Cursor, Ending, Entry, Filter, Page, Release, State};
use idem_runtime::store::{Claim, ClaimRequest, Holder, Recorded};
use idem_runtime::{Bytes, Error, Fingerprint, Key, Store, Token};

/// How the store breaks the contract, if it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// None: the store keeps the contract.
    Kept,
    /// A takeover reads the claim lapsed, then writes without checking again that it is
    /// still the claim it read: a renewal in between is lost, and two holders run.
    TakeoverSkipsRecheck,
    /// An instance takes over, on first sight, a live claim it did not make itself (it
    /// judges liveness by what its own process saw).
    TakeoverOnFirstSight,
}

enum Row {
    Held {
        token: Token,
        fingerprint: Option<Fingerprint>,
        until: Instant,
        /// How long a lapsed claim is remembered after `until`, so that a takeover is told.
        remembered: Duration,
        lease: Duration,
        namespace: Option<String>,
    },
    Completed {
        value: Bytes,
        fingerprint: Option<Fingerprint>,
        until: Instant,
        namespace: Option<String>,
    },
}

#[derive(Default)]
struct Server {
    rows: HashMap<Key, Row>,
    steps: HashMap<Key, HashMap<Key, (Bytes, Instant)>>,
    tokens: u64,
    /// The claims an operator released, so that their holders are told so.
    released: HashSet<(Key, Token)>,
}

/// What a key holds at `now`.
enum Seen {
    Free,
    Lapsed,
    Live,
    Completed,
}

impl Server {
    fn seen(&self, key: &Key, now: Instant) -> Seen {
        match self.rows.get(key) {
            Some(Row::Held { until, .. }) if *until > now => Seen::Live,
            Some(Row::Held {
                until, remembered, ..
            }) if *until + *remembered > now => Seen::Lapsed,
            Some(Row::Completed { until, .. }) if *until > now => Seen::Completed,
            _ => Seen::Free,
        }
    }

    fn take(&mut self, request: &ClaimRequest<'_>, now: Instant) -> Token {
        self.tokens += 1;
        let token = Token::new(self.tokens);
        self.rows.insert(
            *request.key,
            Row::Held {
                token,
                fingerprint: request.fingerprint.copied(),
                until: now + request.lease,
                remembered: request.ttl,
                lease: request.lease,
                namespace: request.claimant.namespace().map(str::to_owned),
            },
        );
        token
    }

    /// The live steps of `call`.
    fn steps_of(&self, call: &Key, now: Instant) -> Vec<(Key, Bytes)> {
        let steps = self.steps.get(call).into_iter().flatten();
        let live = steps.filter(|(_, (_, until))| *until > now);
        live.map(|(step, (value, _))| (*step, value.clone()))
            .collect()
    }

    /// The row of `key` when it is held under `token` with a live lease.
    fn held(&mut self, key: &Key, token: Token, now: Instant) -> Option<&mut Row> {
        self.rows.get_mut(key).filter(|row| {
            matches!(row, Row::Held { token: held, until, .. } if *held == token && *until > now)
        })
    }
}

/// One instance of the store: clones share its per-process state, [`instance`] makes
/// another over the same server.
///
/// [`instance`]: OwnStore::instance
#[derive(Clone)]
pub struct OwnStore {
    server: Arc<Mutex<Server>>,
    /// The keys this instance claimed: per-process state, as a real store's cache is.
    claimed: Arc<Mutex<HashSet<Key>>>,
    mutation: Mutation,
}

impl OwnStore {
    pub fn new(mutation: Mutation) -> Self {
        Self {
            server: Arc::default(),
            claimed: Arc::default(),
            mutation,
        }
    }

    /// Another instance over the same server, as another process would have.
    pub fn instance(&self) -> Self {
        Self {
            server: Arc::clone(&self.server),
            claimed: Arc::default(),
            mutation: self.mutation,
        }
    }

    fn server(&self) -> MutexGuard<'_, Server> {
        self.server.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn claimed(&self) -> MutexGuard<'_, HashSet<Key>> {
        self.claimed.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait]
impl Store for OwnStore {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, Error> {
        let key = request.key;
        let now = Instant::now();
        let judged = self.server().seen(key, now);
        if matches!(judged, Seen::Lapsed) && self.mutation == Mutation::TakeoverSkipsRecheck {
            // Judged lapsed, then written later without looking again.
            tokio::task::yield_now().await;
            self.claimed().insert(*key);
            return Ok(Claim::taken_over(self.server().take(request, now)));
        }
        let claim = {
            let mut server = self.server();
            match server.seen(key, now) {
                Seen::Free => Claim::acquired(server.take(request, now)),
                Seen::Live
                    if self.mutation == Mutation::TakeoverOnFirstSight
                        && !self.claimed().contains(key) =>
                {
                    Claim::taken_over(server.take(request, now))
                }
                Seen::Lapsed => Claim::taken_over(server.take(request, now)),
                Seen::Live => match server.rows.get(key) {
                    Some(Row::Held { fingerprint, .. }) => Claim::InProgress {
                        fingerprint: *fingerprint,
                    },
                    _ => unreachable!("a live key is held"),
                },
                Seen::Completed => match server.rows.get(key) {
                    Some(Row::Completed {
                        value, fingerprint, ..
                    }) => Claim::Completed {
                        value: value.clone(),
                        fingerprint: *fingerprint,
                    },
                    _ => unreachable!("a completed key is completed"),
                },
            }
        };
        if matches!(claim, Claim::Acquired { .. }) {
            self.claimed().insert(*key);
        }
        Ok(claim)
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, Error> {
        let now = Instant::now();
        let mut server = self.server();
        let Some(row) = server.held(key, token, now) else {
            return Ok(false);
        };
        let Row::Held {
            fingerprint,
            namespace,
            ..
        } = row
        else {
            return Ok(false);
        };
        *row = Row::Completed {
            value,
            fingerprint: *fingerprint,
            until: now + ttl,
            namespace: namespace.take(),
        };
        Ok(true)
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, Error> {
        let mut server = self.server();
        let ours =
            matches!(server.rows.get(key), Some(Row::Held { token: held, .. }) if *held == token);
        if ours {
            server.rows.remove(key);
        }
        Ok(ours)
    }

    /// A claim is renewed while it is its holder's: lapsed, but not taken over, included.
    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, Error> {
        let now = Instant::now();
        let mut server = self.server();
        match server.rows.get_mut(key) {
            Some(Row::Held {
                token: held, until, ..
            }) if *held == token => {
                *until = now + lease;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Tokens grow (one counter for the server): a claim's token is its fence.
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
        let now = Instant::now();
        let mut server = self.server();
        if server.held(call, token, now).is_none() {
            return Ok(false);
        }
        server
            .steps
            .entry(*call)
            .or_default()
            .insert(*step, (value, now + ttl));
        Ok(true)
    }

    async fn steps(&self, call: &Key) -> Result<Vec<(Key, Bytes)>, Error> {
        Ok(self.server().steps_of(call, Instant::now()))
    }

    async fn remove(&self, key: &Key) -> Result<bool, Error> {
        let now = Instant::now();
        let mut server = self.server();
        let there = !matches!(server.seen(key, now), Seen::Free);
        server.rows.remove(key);
        server.steps.remove(key);
        Ok(there)
    }

    async fn lookup(&self, key: &Key) -> Result<Option<Recorded>, Error> {
        let now = Instant::now();
        Ok(match self.server().rows.get(key) {
            Some(Row::Completed {
                value,
                fingerprint,
                until,
                ..
            }) if *until > now => Some(Recorded::new(
                value.clone(),
                *fingerprint,
                Some(*until - now),
            )),
            _ => None,
        })
    }

    async fn lease_left(&self, key: &Key) -> Result<Option<Duration>, Error> {
        let now = Instant::now();
        Ok(match self.server().rows.get(key) {
            Some(Row::Held { until, .. }) if *until > now => Some(*until - now),
            _ => None,
        })
    }

    async fn released_by_operator(&self, key: &Key, token: Token) -> Result<bool, Error> {
        Ok(self.server().released.contains(&(*key, token)))
    }
}

impl Server {
    /// What an operator sees of `key` at `now`.
    fn entry(&self, key: &Key, now: Instant, values: bool) -> Option<Entry> {
        let entry = match (self.rows.get(key)?, self.seen(key, now)) {
            (_, Seen::Free) => return None,
            (
                Row::Held {
                    token,
                    until,
                    lease,
                    namespace,
                    ..
                },
                seen,
            ) => {
                let state = if matches!(seen, Seen::Live) {
                    State::Held
                } else {
                    State::Lapsed
                };
                Entry::new(*key, state)
                    .with_names(namespace.clone(), None)
                    .with_claim(
                        *token,
                        Some(*lease),
                        until.saturating_duration_since(now),
                        Some(Holder::this_process().clone()),
                    )
            }
            (
                Row::Completed {
                    value,
                    until,
                    namespace,
                    ..
                },
                _,
            ) => Entry::new(*key, State::Completed)
                .with_names(namespace.clone(), None)
                .with_result(
                    Some(until.saturating_duration_since(now)),
                    Some(value.len() as u64),
                    values.then(|| value.clone()),
                ),
        };
        Some(entry)
    }
}

/// The operator's view: three reads, two conditional writes and a purge; `release` and
/// `reset` are the trait's own.
#[async_trait]
impl Admin for OwnStore {
    async fn list(&self, filter: &Filter, after: Option<&Cursor>) -> Result<Page, Error> {
        let now = Instant::now();
        let server = self.server();
        let mut keys: Vec<&Key> = server.rows.keys().collect();
        keys.sort();
        let from = after.and_then(Cursor::key);
        let mut entries = Vec::new();
        for key in keys
            .into_iter()
            .filter(|key| from.is_none_or(|from| *key > from))
        {
            let Some(entry) = server.entry(key, now, filter.values()) else {
                continue;
            };
            if !filter.admits(&entry) {
                continue;
            }
            if entries.len() == filter.page_size() {
                let next = entries
                    .last()
                    .map(|last: &Entry| Cursor::after(*last.key()));
                return Ok(Page::new(entries, next));
            }
            entries.push(entry);
        }
        Ok(Page::new(entries, None))
    }

    async fn inspect(&self, key: &Key) -> Result<Option<Entry>, Error> {
        let now = Instant::now();
        let server = self.server();
        let steps = server.steps_of(key, now).into_iter();
        let sizes = steps
            .map(|(step, value)| (step, value.len() as u64))
            .collect();
        Ok(server
            .entry(key, now, true)
            .map(|entry| entry.with_steps(sizes)))
    }

    async fn look(&self, key: &Key) -> Result<Option<Entry>, Error> {
        Ok(self.server().entry(key, Instant::now(), false))
    }

    async fn end_claim(
        &self,
        entry: &Entry,
        token: Token,
        how: Release,
        forget: bool,
    ) -> Result<Ending, Error> {
        let key = entry.key();
        let now = Instant::now();
        let mut server = self.server();
        // Judged again in the write: the same token, and still silent unless forced.
        let still = server.entry(key, now, false).filter(|now| {
            now.token() == Some(token)
                && matches!(now.state(), State::Held | State::Lapsed)
                && (how == Release::Force || now.is_silent())
        });
        if still.is_none() {
            return Ok(Ending::Changed);
        }
        server.released.insert((*key, token));
        if forget {
            server.rows.remove(key);
            server.steps.remove(key);
            return Ok(Ending::Ended);
        }
        // Lapsed now, under a token nobody holds: the holder's writes are refused, and the
        // next claim is told it takes the key over.
        server.tokens += 1;
        let unheld = Token::new(server.tokens);
        if let Some(Row::Held {
            token: held, until, ..
        }) = server.rows.get_mut(key)
        {
            *held = unheld;
            *until = now;
        }
        Ok(Ending::Ended)
    }

    async fn forget_call(&self, entry: &Entry) -> Result<Ending, Error> {
        let key = entry.key();
        let mut server = self.server();
        if !matches!(server.seen(key, Instant::now()), Seen::Completed) {
            return Ok(Ending::Changed);
        }
        server.rows.remove(key);
        server.steps.remove(key);
        Ok(Ending::Ended)
    }

    async fn purge(&self) -> Result<u64, Error> {
        let now = Instant::now();
        let mut server = self.server();
        let gone: Vec<Key> = server
            .rows
            .keys()
            .filter(|key| matches!(server.seen(key, now), Seen::Free))
            .copied()
            .collect();
        for key in &gone {
            server.rows.remove(key);
            server.steps.remove(key);
        }
        Ok(gone.len() as u64)
    }
}
