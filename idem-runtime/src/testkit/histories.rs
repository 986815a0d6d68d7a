//! The contract as a checker over histories: what every call answered, and what every
//! body did, judged against the error table.
//!
//! A [`History`] records, for every call, its key, when it started and ended, its
//! [`Answer`], and every body execution (when it started, whether it finished and with
//! what). [`History::check`] holds every history to the same rules, whatever made it: the
//! seeded runs of [`histories`], an HTTP service's requests, processes killed mid-call.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::faults::{Faults, Faulty, SplitMix};
use crate::{
    attempt, reconcile, step, Claim, ClaimRequest, Error, Fingerprint, Operation, Outcome, Store,
};

/// What a call answered, as the checker sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Answer {
    /// `Outcome::Executed(v)`: `v` is the value its body returned (in [`histories`], the
    /// body's [`BodyId`]).
    Executed(u64),
    /// `Outcome::Replayed(v)`.
    Replayed(u64),
    /// An [`Error`] of the runtime, by its variant's name: `in_progress`,
    /// `payload_mismatch`, `gone`, `store`, `codec`, `key`, `config`, `unrecorded`.
    Failed(&'static str),
    /// The body's own error: its body ran and returned it.
    BodyFailed,
    /// The caller stopped waiting (it dropped the call's future) before the call answered:
    /// it says nothing of the body.
    Cancelled,
    /// The caller's process was killed (SIGKILL) before the call answered: it says nothing
    /// of the body, which may have returned while its record was not yet written, so its
    /// key may run again once the claim's lease is over, with nobody told anything.
    Killed,
}

impl Answer {
    /// The answer of a call's result, where the body's own errors are `body` and the
    /// runtime's are converted into `E` (`idem` is how to tell one back).
    pub fn of<E>(result: &Result<Outcome<u64>, E>, idem: impl Fn(&E) -> Option<&Error>) -> Self {
        match result {
            Ok(Outcome::Executed(v)) => Self::Executed(*v),
            Ok(Outcome::Replayed(v)) => Self::Replayed(*v),
            Err(err) => match idem(err) {
                Some(err) => Self::Failed(err.kind()),
                None => Self::BodyFailed,
            },
        }
    }
}

impl Answer {
    /// The answer of a call whose body's errors are [`Failure`]s.
    pub fn of_call(result: &Result<Outcome<u64>, Failure>) -> Self {
        Self::of(result, |failure| match failure {
            Failure::Idem(err) => Some(err),
            Failure::Body => None,
        })
    }
}

/// Whether a call whose answer is `answer` may have run its body, by the README's error
/// table: `Some(true)` it must have, `Some(false)` it must not have, `None` the answer
/// says nothing by itself (a value, checked against the body it names).
pub fn body_ran(answer: &Answer) -> Option<bool> {
    match answer {
        Answer::Cancelled | Answer::Killed => None,
        Answer::Executed(_) | Answer::BodyFailed => Some(true),
        Answer::Replayed(_) => Some(false),
        Answer::Failed("unrecorded") => Some(true),
        // `in_progress`, `payload_mismatch`, `gone`, `store`, `codec` (a record that does
        // not decode; the values of a history always encode), `key`, `config`.
        Answer::Failed(_) => Some(false),
    }
}

/// A call in a [`History`].
pub type CallId = usize;
/// A body execution in a [`History`].
pub type BodyId = u64;

#[derive(Clone, Debug)]
struct CallEntry {
    key: u64,
    started: Duration,
    ended: Option<Duration>,
    bound: Duration,
    answer: Option<Answer>,
    /// The fingerprint the call sent (histories vary it to reach `payload_mismatch`).
    payload: u64,
    /// Whether the caller's transaction rolled back after the call (see
    /// [`History::rolled_back`]).
    rolled_back: bool,
}

#[derive(Clone, Debug)]
struct BodyEntry {
    call: CallId,
    key: u64,
    started: Duration,
    ended: Option<(Duration, Result<u64, ()>)>,
    /// Steps this execution ran to their end (each by its index), recorded or not.
    steps: Vec<u32>,
    /// Whether a step of this execution was answered `Unrecorded`.
    step_unrecorded: bool,
    /// Whether this execution's effect landed outside the store ([`History::effect`]).
    effect: bool,
    /// The value [`reconcile`](crate::reconcile()) found for this execution: the effect of
    /// an earlier one, which this one answered instead of running.
    reconciled: Option<u64>,
    /// Whether its claim took the key over from one never settled ([`History::taken_over`]).
    taken_over: bool,
}

#[derive(Default, Debug)]
struct Entries {
    calls: Vec<CallEntry>,
    bodies: Vec<BodyEntry>,
    /// Whether every key's effect must land at most once, with no excuse
    /// ([`History::effects_exactly_once`]).
    effects_once: bool,
}

/// The record of a run: every call and every body execution. Cheap to clone (shared).
///
/// ```
/// use idem_runtime::testkit::{Answer, History};
/// use std::time::Duration;
///
/// let history = History::new();
/// let call = history.begin(1, 0, Duration::from_secs(5));
/// let body = history.body_started(call);
/// history.body_ended(body, Ok(body));
/// history.end(call, Answer::Executed(body));
/// let replay = history.begin(1, 0, Duration::from_secs(5));
/// history.end(replay, Answer::Replayed(body));
/// assert!(history.check().is_ok());
/// ```
#[derive(Clone, Debug)]
pub struct History {
    epoch: Instant,
    entries: Arc<Mutex<Entries>>,
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

impl History {
    /// An empty history, its clock starting now.
    pub fn new() -> Self {
        Self {
            epoch: Instant::now(),
            entries: Arc::default(),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A call of `key` with the fingerprint `payload` starts; it must end within `bound`.
    pub fn begin(&self, key: u64, payload: u64, bound: Duration) -> CallId {
        let started = self.epoch.elapsed();
        let mut entries = self.entries();
        entries.calls.push(CallEntry {
            key,
            started,
            ended: None,
            bound,
            answer: None,
            payload,
            rolled_back: false,
        });
        entries.calls.len() - 1
    }

    /// The call `call` ran in the caller's transaction (`transaction =`), which then rolled
    /// back: the caller aborted it, its commit failed, or the call was cancelled and the
    /// transaction dropped. Its body's writes and its record went with it, so its bodies do
    /// not count as runs of the key, its `Executed` value is not the key's, and its answer
    /// says nothing of the body; a `Replayed` value it was given is still checked.
    pub fn rolled_back(&self, call: CallId) {
        self.entries().calls[call].rolled_back = true;
    }

    /// The call `call` ended with `answer`.
    pub fn end(&self, call: CallId, answer: Answer) {
        let ended = self.epoch.elapsed();
        let mut entries = self.entries();
        let entry = &mut entries.calls[call];
        entry.ended = Some(ended);
        entry.answer = Some(answer);
    }

    /// The body of `call` starts: its id, which a body in [`histories`] returns as its
    /// value, so that every value names the execution that made it.
    pub fn body_started(&self, call: CallId) -> BodyId {
        let started = self.epoch.elapsed();
        let mut entries = self.entries();
        let key = entries.calls[call].key;
        entries.bodies.push(BodyEntry {
            call,
            key,
            started,
            ended: None,
            steps: Vec::new(),
            step_unrecorded: false,
            effect: false,
            reconciled: None,
            taken_over: false,
        });
        (entries.bodies.len() - 1) as BodyId
    }

    /// The body `body` runs under a claim that took its key over from a claim never
    /// settled (its store said so): shown in a broken history, where a second effect
    /// whose body was not told is the store's fault, and one that was told the body's.
    pub fn taken_over(&self, body: BodyId) {
        self.entries().bodies[body as usize].taken_over = true;
    }

    /// The body `body` had its effect outside the store (a row in another database, a
    /// request to an API): [`check`](Self::check) counts every key's effects.
    pub fn effect(&self, body: BodyId) {
        self.entries().bodies[body as usize].effect = true;
    }

    /// The body `body` found, by [`reconcile`](crate::reconcile()), the effect of the body
    /// whose value is `value`, and answered it instead of running: it is no run of the key,
    /// and `value` is the key's.
    pub fn reconciled(&self, body: BodyId, value: u64) {
        let ended = self.epoch.elapsed();
        let mut entries = self.entries();
        let body = &mut entries.bodies[body as usize];
        body.reconciled = Some(value);
        body.ended = Some((ended, Ok(value)));
    }

    /// Holds every key of this history to one effect at most, with no excuse: what the
    /// bodies' effects promise when they are reconciled (and fenced) or committed with the
    /// record. Without it, a key's second effect is excused as a second run is, and counted
    /// ([`Report::effects_twice`]).
    #[must_use]
    pub fn effects_exactly_once(self) -> Self {
        self.entries().effects_once = true;
        self
    }

    /// The body `body` returned: `Ok(value)` or an error.
    pub fn body_ended(&self, body: BodyId, result: Result<u64, ()>) {
        let ended = self.epoch.elapsed();
        self.entries().bodies[body as usize].ended = Some((ended, result));
    }

    /// The body `body` ran its step `index` to its end (whether or not it was recorded).
    pub fn step_ran(&self, body: BodyId, index: u32) {
        self.entries().bodies[body as usize].steps.push(index);
    }

    /// A step of the body `body` was answered `Unrecorded`: it ran, its record was not
    /// written.
    pub fn step_unrecorded(&self, body: BodyId) {
        self.entries().bodies[body as usize].step_unrecorded = true;
    }

    /// Holds the history to every rule; the first broken one, with the history of its key.
    ///
    /// - each answer's "body ran?" column of the error table ([`body_ran`]), exactly: a
    ///   call answered an error that says its body did not run has no execution, and one
    ///   answered `Unrecorded` or the body's own error has one that finished;
    /// - `Executed(v)`: this call's own body ran and returned `Ok(v)`;
    /// - every `Executed(v)` and `Replayed(v)` of a key is the one value of that key, a
    ///   value some body of that key returned (the TTL of a history outlasts it);
    /// - at most one body of a key returns `Ok`, and at most one execution of each step of
    ///   a key and payload runs to its end (a step's key holds its call's fingerprint),
    ///   except for keys where some caller or step was told `Unrecorded` or `Gone`, or
    ///   some caller was [`Killed`](Answer::Killed) (counted in the [`Report`]); the bodies
    ///   of calls whose transaction [rolled back](History::rolled_back) do not count;
    /// - every call ended, within its bound.
    ///
    /// # Errors
    ///
    /// The [`Violation`]: the rule, the key, and that key's calls and bodies in order.
    pub fn check(&self) -> Result<Report, Violation> {
        let entries = self.entries();
        let mut report = Report::default();
        let mut keys: BTreeMap<u64, (Vec<CallId>, Vec<BodyId>)> = BTreeMap::new();
        for (id, call) in entries.calls.iter().enumerate() {
            keys.entry(call.key).or_default().0.push(id);
        }
        for (id, body) in entries.bodies.iter().enumerate() {
            keys.entry(body.key).or_default().1.push(id as BodyId);
        }
        for (&key, (calls, bodies)) in &keys {
            let violation = |rule: String| Violation::of(&entries, key, rule);
            let mut values = BTreeSet::new();
            let mut excused = false;
            for &id in calls {
                let call = &entries.calls[id];
                report.calls += 1;
                let (Some(answer), Some(ended)) = (&call.answer, call.ended) else {
                    return Err(violation(format!("call {id} never ended")));
                };
                *report.answers.entry(answer.label()).or_default() += 1;
                if ended - call.started > call.bound {
                    return Err(violation(format!(
                        "call {id} took {:?}, past its bound of {:?}",
                        ended - call.started,
                        call.bound
                    )));
                }
                let own: Vec<&BodyEntry> = bodies
                    .iter()
                    .map(|&b| &entries.bodies[b as usize])
                    .filter(|b| b.call == id)
                    .collect();
                let finished = |ok: bool| {
                    own.iter()
                        .any(|b| matches!(b.ended, Some((_, ref r)) if r.is_ok() == ok))
                };
                match body_ran(answer).filter(|_| !call.rolled_back) {
                    // A body that found an earlier effect answers it as a replay.
                    Some(false) if own.iter().any(|b| b.reconciled.is_none()) => {
                        return Err(violation(format!(
                            "call {id} answered {answer:?}, which says its body did not run, but it ran"
                        )));
                    }
                    Some(true) if !matches!(answer, Answer::Executed(_)) => {
                        let ended_as = matches!(answer, Answer::Failed(_));
                        if !finished(ended_as) {
                            return Err(violation(format!(
                                "call {id} answered {answer:?}, which says its body ran and {}, but it did not",
                                if ended_as { "returned a value" } else { "failed" }
                            )));
                        }
                    }
                    _ => {}
                }
                match answer {
                    Answer::Executed(v) => {
                        let body = entries.bodies.get(*v as usize);
                        if !body.is_some_and(|b| {
                            b.call == id && b.ended.as_ref().is_some_and(|(_, r)| *r == Ok(*v))
                        }) {
                            return Err(violation(format!(
                                "call {id} answered Executed({v}), but its own body did not return Ok({v})"
                            )));
                        }
                        if !call.rolled_back {
                            values.insert(*v);
                        }
                    }
                    Answer::Replayed(v) => {
                        // A value of a body whose transaction rolled back was never recorded.
                        let from_key = bodies.iter().any(|&b| {
                            let body = &entries.bodies[b as usize];
                            !entries.calls[body.call].rolled_back
                                && body.ended.as_ref().is_some_and(|(_, r)| *r == Ok(*v))
                        });
                        if !from_key {
                            return Err(violation(format!(
                                "call {id} answered Replayed({v}), which no body of this key returned"
                            )));
                        }
                        values.insert(*v);
                    }
                    Answer::Failed("unrecorded" | "gone") | Answer::Killed => excused = true,
                    _ => {}
                }
            }
            if values.len() > 1 {
                return Err(violation(format!(
                    "the key answered {} values: {values:?}",
                    values.len()
                )));
            }
            // A step is one per payload: the call's fingerprint is part of its key.
            let mut steps: BTreeMap<(u64, u32), usize> = BTreeMap::new();
            let mut ok = 0;
            let mut effects = 0;
            for &b in bodies {
                let body = &entries.bodies[b as usize];
                report.bodies += 1;
                if entries.calls[body.call].rolled_back {
                    continue; // its writes went with its transaction
                }
                excused |= body.step_unrecorded;
                effects += usize::from(body.effect);
                // A body that answered an earlier effect did not run to a value of its own.
                ok += usize::from(
                    body.reconciled.is_none() && matches!(body.ended, Some((_, Ok(_)))),
                );
                report.reconciled += usize::from(body.reconciled.is_some());
                let payload = entries.calls[body.call].payload;
                for &index in &body.steps {
                    *steps.entry((payload, index)).or_default() += 1;
                }
            }
            report.effects += effects;
            if effects > 1 && entries.effects_once {
                return Err(violation(format!(
                    "the key's effect landed {effects} times, and its effects are exactly once (reconciled, or committed with the record)"
                )));
            }
            if effects > 1 && !excused {
                return Err(violation(format!(
                    "the key's effect landed {effects} times, and no caller was told Unrecorded or Gone, or killed"
                )));
            }
            let twice = ok > 1 || steps.values().any(|&n| n > 1);
            if twice && !excused {
                return Err(violation(format!(
                    "the key ran {ok} bodies to a value (steps run, by payload and step: {steps:?}), and no caller was told Unrecorded or Gone, or killed"
                )));
            }
            report.keys += 1;
            if twice {
                report.excused += 1;
            }
            if effects > 1 {
                report.effects_twice += 1;
            }
        }
        Ok(report)
    }
}

impl Answer {
    fn label(&self) -> &'static str {
        match self {
            Self::Executed(_) => "executed",
            Self::Replayed(_) => "replayed",
            Self::Failed(kind) => kind,
            Self::BodyFailed => "body failed",
            Self::Cancelled => "cancelled",
            Self::Killed => "killed",
        }
    }
}

/// What a history that kept every rule holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// Calls.
    pub calls: usize,
    /// Body executions.
    pub bodies: usize,
    /// Keys called.
    pub keys: usize,
    /// Keys whose body (or a step) ran more than once, each with a caller told
    /// `Unrecorded` or `Gone`, or killed: the runs the contract allows, counted so they
    /// show.
    pub excused: usize,
    /// Answers by kind: `executed`, `replayed`, `body failed`, and each error's name.
    pub answers: BTreeMap<&'static str, usize>,
    /// Faults injected ([`histories`] fills it in).
    pub faults: usize,
    /// Claims an operator released while the calls ran ([`histories_with_operator`]).
    pub released: usize,
    /// Effects that landed outside the store ([`History::effect`]).
    pub effects: usize,
    /// Keys whose effect landed more than once (each excused: a caller killed or told
    /// `Unrecorded`); always 0 when the history's effects are exactly once.
    pub effects_twice: usize,
    /// Bodies that found an earlier attempt's effect by `reconcile` and answered it.
    pub reconciled: usize,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} calls, {} bodies, {} keys, {} faults injected, {} claims released by an operator; keys run twice with an Unrecorded or Gone said or a caller killed: {}; effects {} (keys with two or more: {}, reconciled bodies: {}); answers:",
            self.calls,
            self.bodies,
            self.keys,
            self.faults,
            self.released,
            self.excused,
            self.effects,
            self.effects_twice,
            self.reconciled
        )?;
        for (kind, n) in &self.answers {
            write!(f, " {kind} {n},")?;
        }
        Ok(())
    }
}

/// A broken rule: which, and the shortest history that shows it (the calls and bodies of
/// its key alone, in the order they started).
#[derive(Clone, Debug)]
pub struct Violation {
    /// The rule, as broken.
    pub rule: String,
    /// The key's events, one a line.
    pub history: Vec<String>,
}

impl Violation {
    fn of(entries: &Entries, key: u64, rule: String) -> Self {
        let mut events: Vec<(Duration, String)> = Vec::new();
        for (id, call) in entries
            .calls
            .iter()
            .enumerate()
            .filter(|(_, c)| c.key == key)
        {
            events.push((
                call.started,
                format!(
                    "call {id} (payload {}) starts; ends after {:?} with {:?}",
                    call.payload,
                    call.ended.map(|e| e - call.started),
                    call.answer
                ),
            ));
        }
        for (id, body) in entries
            .bodies
            .iter()
            .enumerate()
            .filter(|(_, b)| b.key == key)
        {
            events.push((
                body.started,
                format!(
                    "body {id} of call {} starts{}; steps run {:?}{}{}{}; ends {:?}",
                    body.call,
                    if body.taken_over {
                        " (its claim took the key over)"
                    } else {
                        ""
                    },
                    body.steps,
                    if body.step_unrecorded {
                        " (a step unrecorded)"
                    } else {
                        ""
                    },
                    if body.effect {
                        "; its effect landed"
                    } else {
                        ""
                    },
                    body.reconciled
                        .map(|v| format!("; reconciled the effect of {v}"))
                        .unwrap_or_default(),
                    body.ended.as_ref().map(|(at, r)| (*at - body.started, r))
                ),
            ));
        }
        events.sort_by_key(|(at, _)| *at);
        let history = events
            .into_iter()
            .map(|(at, event)| format!("{at:>12.3?}  {event}"))
            .collect();
        Self {
            rule: format!("key {key}: {rule}"),
            history,
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.rule)?;
        for line in &self.history {
            writeln!(f, "  {line}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Violation {}

/// A seeded run for [`histories`]: how many calls, on how many keys, with which faults.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Plan {
    /// The seed of the calls (keys, payloads, bodies) and of each store's faults.
    pub seed: u64,
    /// Calls in all.
    pub calls: usize,
    /// Concurrent callers; caller `i` calls through store handle `i % handles`.
    pub callers: usize,
    /// Keys the calls are spread over.
    pub keys: u64,
    /// The operation's lease.
    pub lease: Duration,
    /// The faults of every store operation.
    pub faults: Faults,
    /// The share of bodies that fail (their error releases the key).
    pub body_errors: f64,
    /// The share of calls sent with another fingerprint than their key's.
    pub other_payloads: f64,
    /// Whether each body runs two steps (`step`) before it returns.
    pub steps: bool,
    /// What a call may take past its bound (the store's timeout, the wait, the completion's
    /// retries and the stalls): time a loaded machine adds.
    pub slack: Duration,
    /// Whether bodies have an effect outside the store, and callers die between it and
    /// the record ([`Effects`]).
    pub effects: Option<Effects>,
}

/// Bodies with an effect outside the store: a ledger beside it, which each body that runs
/// to its end writes under its call's fencing token (a write under a token smaller than
/// one the ledger has seen is refused, as a fenced destination refuses a holder whose key
/// was taken over); and callers whose process dies after their claim, half of them after
/// their effect too, before the record (their claims lapse, and the next claim of the key
/// takes them over).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Effects {
    /// Whether each body asks the ledger first, by [`reconcile`](crate::reconcile())
    /// (which raises the ledger's fence to the call's token): each key's effect then lands
    /// exactly once, which the history holds it to. Without, a caller killed after its
    /// effect lets the next one have it again, and the report counts those keys.
    pub reconcile: bool,
    /// The share of calls whose process dies mid-call.
    pub crashes: f64,
}

impl Plan {
    /// 2 000 calls of 50 callers on 200 keys, 10 % faults ([`Faults::ten_percent`]), a
    /// 300 ms lease, 5 % of bodies failing, 2 % of calls with another payload, no steps.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            calls: 2_000,
            callers: 50,
            keys: 200,
            lease: Duration::from_millis(300),
            faults: Faults::ten_percent(),
            body_errors: 0.05,
            other_payloads: 0.02,
            steps: false,
            slack: Duration::from_secs(10),
            effects: None,
        }
    }

    /// This plan with `calls` calls on `keys` keys.
    #[must_use]
    pub fn calls(mut self, calls: usize, keys: u64) -> Self {
        self.calls = calls;
        self.keys = keys;
        self
    }

    /// This plan with other faults.
    #[must_use]
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }

    /// This plan with another lease.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// This plan with bodies that run two steps each.
    #[must_use]
    pub fn with_steps(mut self) -> Self {
        self.steps = true;
        self
    }

    /// This plan with bodies that have an effect outside the store, reconciled or not,
    /// and 5 % of the calls dying mid-call ([`Effects`]).
    #[must_use]
    pub fn with_effects(mut self, reconcile: bool) -> Self {
        self.effects = Some(Effects {
            reconcile,
            crashes: 0.05,
        });
        self
    }
}

/// The effects' destination of [`Effects`]: per key, the fence (the largest token it was
/// asked or written under) and the bodies whose effect landed.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<LedgerEntries>>);

/// Each key's fence and landed effects.
type LedgerEntries = std::collections::HashMap<u64, (crate::Token, Vec<BodyId>)>;

impl Ledger {
    fn entries(&self) -> std::sync::MutexGuard<'_, LedgerEntries> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What `reconcile` asks under `token`: the effect of `key` that landed, if one did;
    /// no write under a smaller token lands after this.
    fn ask(&self, key: u64, token: crate::Token) -> Option<BodyId> {
        let mut entries = self.entries();
        let (fence, landed) = entries.entry(key).or_insert((token, Vec::new()));
        *fence = (*fence).max(token);
        landed.first().copied()
    }

    /// Lands the effect of `body` on `key` under `token`, unless a larger token came first:
    /// whether it landed.
    fn write(&self, key: u64, token: crate::Token, body: BodyId) -> bool {
        let mut entries = self.entries();
        let (fence, landed) = entries.entry(key).or_insert((token, Vec::new()));
        if token < *fence {
            return false;
        }
        *fence = token;
        landed.push(body);
        true
    }
}

/// The error of a call in a history: the runtime's, or the body's own (a body that
/// failed). A history's bodies return it, so that [`Answer::of_call`] tells the two apart.
#[derive(Debug)]
pub enum Failure {
    /// The runtime's error.
    Idem(Error),
    /// The body's own error.
    Body,
}

impl From<Error> for Failure {
    fn from(err: Error) -> Self {
        Self::Idem(err)
    }
}

/// Runs `plan` against `stores` (handles of one storage: two handles are two processes,
/// in effect), each behind a [`Faulty`] store seeded from the plan, records the history,
/// and checks it ([`History::check`]). Panics with the seed and the shortest history that
/// shows a broken rule; returns the report otherwise.
///
/// ```no_run
/// # async fn my_store() -> idem_runtime::MemoryStore { idem_runtime::MemoryStore::new() }
/// #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
/// async fn my_store_keeps_the_error_table_under_faults() {
///     let store = my_store().await;
///     let plan = idem_runtime::testkit::Plan::new(1);
///     let report = idem_runtime::testkit::histories(&[store.clone(), store], &plan).await;
///     println!("{report}");
/// }
/// ```
pub async fn histories<S: Store + Clone>(stores: &[S], plan: &Plan) -> Report {
    let (history, faulty, _) = record(stores, plan, None).await;
    checked(&history, &faulty, plan, 0)
}

/// [`histories`] with an operator beside the callers (feature `admin`). Some bodies
/// (one call in four, by the seed) hand their key to the operator after their first step
/// and wait for it: it inspects the claim through the first store (without faults) and
/// releases it with the token shown, by force one time in two and otherwise only if
/// silent. Between handovers it also lists the plan's claims and releases some at random,
/// wherever their calls are. The same rules hold: a holder released by force is told `Unrecorded` (its
/// body ran, its result is not the key's), never a value of the run that took the key
/// after it, and no key answers two values.
#[cfg(feature = "admin")]
pub async fn histories_with_operator<S>(stores: &[S], plan: &Plan) -> Report
where
    S: Store + crate::admin::Admin + Clone,
{
    let store = stores.first().expect("histories need a store").clone();
    let seed = plan.seed;
    let operator: Operator = Box::new(move |namespace, handovers| {
        tokio::spawn(operate(store, namespace, handovers, seed))
    });
    let (history, faulty, released) = record(stores, plan, Some(operator)).await;
    checked(&history, &faulty, plan, released)
}

/// A body's key handed to the operator, and how the operator says it is done with it.
type Handover = (crate::Key, tokio::sync::oneshot::Sender<()>);

/// The operator of [`histories_with_operator`]: how many claims it released. It ends when
/// every caller has ended (the handovers' channel closes). Each handover is answered by a
/// task of its own, so that no body waits for another's.
#[cfg(feature = "admin")]
async fn operate<S>(
    store: S,
    namespace: String,
    mut handovers: tokio::sync::mpsc::UnboundedReceiver<Handover>,
    seed: u64,
) -> usize
where
    S: crate::admin::Admin + Clone + 'static,
{
    use crate::admin::{Filter, Release};
    let mut rng = SplitMix::new(seed ^ 0x6f70_6572_6174_6f72);
    let filter = Filter::namespace(namespace).held().lapsed();
    let mut released = 0;
    let mut answering = tokio::task::JoinSet::new();
    let how = |rng: &mut SplitMix| {
        if rng.unit() < 0.5 {
            Release::Force
        } else {
            Release::IfSilent
        }
    };
    loop {
        // The operator's pace between handovers, not a synchronisation.
        let pace = Duration::from_millis(1 + rng.below(10));
        match tokio::time::timeout(pace, handovers.recv()).await {
            Ok(None) => break,
            Ok(Some((key, done))) => {
                // The body waits on `done`: its claim is held (or lapsed) meanwhile.
                let (store, how) = (store.clone(), how(&mut rng));
                answering.spawn(async move {
                    let released = match held_token(&store, &key).await {
                        Some(token) => released_by(&store, &key, token, how).await,
                        None => false,
                    };
                    let _ = done.send(());
                    usize::from(released)
                });
            }
            Err(_) => {
                let Ok(page) = crate::admin::Admin::list(&store, &filter, None).await else {
                    continue;
                };
                for entry in page.entries() {
                    let Some(token) = entry.token().filter(|_| rng.unit() < 0.3) else {
                        continue;
                    };
                    let how = how(&mut rng);
                    released += usize::from(released_by(&store, entry.key(), token, how).await);
                }
            }
        }
        while let Some(answered) = answering.try_join_next() {
            released += answered.unwrap_or_else(|err| std::panic::resume_unwind(err.into_panic()));
        }
    }
    while let Some(answered) = answering.join_next().await {
        released += answered.unwrap_or_else(|err| std::panic::resume_unwind(err.into_panic()));
    }
    released
}

/// The token `key` is held with (or lapsed), as the store shows it.
#[cfg(feature = "admin")]
async fn held_token<S: crate::admin::Admin>(store: &S, key: &crate::Key) -> Option<crate::Token> {
    use crate::admin::State;
    let entry = store.inspect(key).await.ok()??;
    matches!(entry.state(), State::Held | State::Lapsed)
        .then(|| entry.token())
        .flatten()
}

/// Whether the operator's release of `key` was done.
#[cfg(feature = "admin")]
async fn released_by<S: crate::admin::Admin>(
    store: &S,
    key: &crate::Key,
    token: crate::Token,
    how: crate::admin::Release,
) -> bool {
    matches!(
        crate::admin::Admin::release(store, key, token, how).await,
        Ok(crate::admin::Verdict::Done)
    )
}

/// `history` checked, with the faults injected and the releases made; panics with the seed
/// and the shortest history that shows a broken rule.
fn checked<S: Store>(
    history: &History,
    faulty: &[Faulty<S>],
    plan: &Plan,
    released: usize,
) -> Report {
    match history.check() {
        Ok(mut report) => {
            report.faults = faulty.iter().map(Faulty::injected).sum();
            report.released = released;
            report
        }
        Err(violation) => panic!(
            "seed {}: {violation}(replay it with the same plan and seed {})",
            plan.seed, plan.seed
        ),
    }
}

/// What runs beside the callers of [`record`]: given the plan's namespace and the bodies'
/// handovers (the channel closes once every call has answered), a task whose result is how
/// many claims it released.
type Operator = Box<
    dyn FnOnce(
            String,
            tokio::sync::mpsc::UnboundedReceiver<Handover>,
        ) -> tokio::task::JoinHandle<usize>
        + Send,
>;

/// Runs `plan` and returns its history unchecked, with the faulty stores it ran through
/// and what the operator released, if there was one.
async fn record<S: Store + Clone>(
    stores: &[S],
    plan: &Plan,
    operator: Option<Operator>,
) -> (History, Vec<Faulty<S>>, usize) {
    assert!(!stores.is_empty(), "histories need a store");
    let history = match plan.effects {
        Some(Effects {
            reconcile: true, ..
        }) => History::new().effects_exactly_once(),
        _ => History::new(),
    };
    let ledger = Ledger::default();
    let namespace = format!(
        "idem.testkit.histories.{}.{}",
        plan.seed,
        super::Keys::new().run
    );
    let op = Arc::new(
        Operation::new(namespace.clone())
            .lease(plan.lease)
            .ttl(Duration::from_secs(3600)),
    );
    let faulty: Vec<Faulty<S>> = stores
        .iter()
        .enumerate()
        .map(|(i, store)| {
            Faulty::new(
                store.clone(),
                plan.seed.wrapping_add(i as u64 + 1),
                plan.faults,
            )
        })
        .collect();
    let timeout = stores[0].claim_timeout().unwrap_or(Duration::from_secs(3));
    let bound = timeout + plan.lease * 3 + plan.faults.stall_for * 2 + plan.slack;
    // A body handed to the operator waits for its look and its release: two more of the
    // store's operations, and half a lease where the store watches a silent holder.
    let bound = match operator {
        Some(_) => bound + timeout * 2 + plan.lease / 2,
        None => bound,
    };
    let (handover, handovers) = tokio::sync::mpsc::unbounded_channel();
    let handover = operator.is_some().then_some(handover);
    let operating = operator.map(|operator| operator(namespace.clone(), handovers));
    let mut tasks = tokio::task::JoinSet::new();
    let per_caller = plan.calls.div_ceil(plan.callers.max(1));
    for caller in 0..plan.callers.max(1) {
        let store = faulty[caller % faulty.len()].clone();
        let (op, history, plan) = (Arc::clone(&op), history.clone(), plan.clone());
        let (handover, ledger) = (handover.clone(), ledger.clone());
        let mut rng =
            SplitMix::new(plan.seed ^ (caller as u64).wrapping_mul(0xA24B_AED4_963E_E407));
        tasks.spawn(async move {
            for _ in 0..per_caller {
                let key = rng.below(plan.keys.max(1));
                let payload = u64::from(rng.unit() < plan.other_payloads);
                let fails = rng.unit() < plan.body_errors;
                let work = Duration::from_micros(rng.below(1_000));
                let k = op.key(&key).expect("integers always encode");
                let fp = Fingerprint::of(&payload).expect("integers always encode");
                // Drawn only with an operator, so that the plain histories keep their seeds.
                let handed = handover
                    .as_ref()
                    .filter(|_| rng.unit() < 0.25)
                    .map(|to| (to.clone(), k));
                let call = history.begin(key, payload, bound);
                // Drawn only with effects, as the handovers are.
                let effects = plan.effects.map(|effects| {
                    let dies = rng.unit() < effects.crashes;
                    (effects, dies, rng.unit() < 0.5)
                });
                if let Some((effects, true, after_effect)) = effects {
                    let ttl = op.settings.ttl;
                    let request = ClaimRequest::new(&k, plan.lease)
                        .fingerprint(Some(&fp))
                        .ttl(ttl);
                    let reconciles = effects.reconcile;
                    crash(
                        &store,
                        &request,
                        &history,
                        call,
                        &ledger,
                        key,
                        after_effect,
                        reconciles,
                    )
                    .await;
                    history.end(call, Answer::Killed);
                    continue;
                }
                let effect = effects.map(|(effects, _, _)| Effect {
                    ledger: ledger.clone(),
                    key,
                    reconcile: effects.reconcile,
                });
                let body = body(&history, call, fails, work, plan.steps, handed, effect);
                let result = op.run(&store, &k, Some(&fp), body).await;
                let answer = Answer::of_call(&result);
                history.end(call, answer);
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        if let Err(err) = done {
            std::panic::resume_unwind(err.into_panic());
        }
    }
    drop(handover);
    let released = match operating {
        Some(task) => task
            .await
            .unwrap_or_else(|err| std::panic::resume_unwind(err.into_panic())),
        None => 0,
    };
    // What the calls left to finish in the background (completions that failed within the
    // lease) is not waited for: the history is what the callers saw.
    (history, faulty, released)
}

/// A caller whose process dies mid-call: it claims `key` through `store`, lands its
/// effect too if `after_effect` (its body's value is then its id; a taker that
/// `reconciles` asks the ledger first), and never settles the claim, which lapses.
#[allow(clippy::too_many_arguments)]
async fn crash<S: Store>(
    store: &S,
    request: &ClaimRequest<'_>,
    history: &History,
    call: CallId,
    ledger: &Ledger,
    key: u64,
    after_effect: bool,
    reconciles: bool,
) {
    let Ok(Claim::Acquired { token, taken_over }) = store.claim(request).await else {
        return; // died before it had the key
    };
    let id = history.body_started(call);
    if taken_over {
        history.taken_over(id);
    }
    if !after_effect {
        return;
    }
    let Ok(Some(fence)) = store.fence(request.key, token).await else {
        return;
    };
    // It runs the body every caller runs: a taker asks the ledger first, and dies after
    // what it found, which it has no effect of its own to add to.
    if reconciles && taken_over && ledger.ask(key, fence).is_some() {
        return;
    }
    if ledger.write(key, fence, id) {
        history.effect(id);
        // Its effect is its value, though nobody was told: it died before the record.
        history.body_ended(id, Ok(id));
    }
}

/// A body's effect outside the store: the ledger, the key, and whether the body asks the
/// ledger first.
struct Effect {
    ledger: Ledger,
    key: u64,
    reconcile: bool,
}

/// The body of `call`: recorded on the way in and out, two steps if `steps`, `work` long,
/// failing if `fails`, its key handed to the operator (after its first step) if `handed`,
/// its effect landed in a ledger beside the store if it has one (asked first by
/// `reconcile`, if it reconciles). Its value is its own id, or the id of the earlier body
/// whose effect it found.
fn body(
    history: &History,
    call: CallId,
    fails: bool,
    work: Duration,
    steps: bool,
    mut handed: Option<(tokio::sync::mpsc::UnboundedSender<Handover>, crate::Key)>,
    effect: Option<Effect>,
) -> impl std::future::Future<Output = Result<u64, Failure>> + Send + 'static {
    let history = history.clone();
    async move {
        let id = history.body_started(call);
        if attempt().is_some_and(|attempt| attempt.taken_over()) {
            history.taken_over(id);
        }
        // The token the effect is fenced by; a store that fails to give it ends the body.
        let fence = match &effect {
            Some(_) => match attempt() {
                Some(attempt) => match attempt.token().await {
                    Ok(fence) => Some(fence),
                    Err(_) => {
                        history.body_ended(id, Err(()));
                        return Err(Failure::Body);
                    }
                },
                None => None,
            },
            None => None,
        };
        if let (Some(effect), Some(fence)) = (&effect, fence) {
            if effect.reconcile {
                let asked = async { Ok::<_, Failure>(effect.ledger.ask(effect.key, fence)) };
                if let Some(found) = reconcile(asked).await? {
                    history.reconciled(id, found);
                    return Ok(found);
                }
            }
        }
        if steps {
            for index in 0..2_u32 {
                if index == 1 {
                    hand_over(&mut handed).await;
                }
                let ran = step(&format!("step-{index}"), async {
                    history.step_ran(id, index);
                    Ok::<_, Failure>(index)
                })
                .await;
                if let Err(err) = ran {
                    if matches!(err, Failure::Idem(Error::Unrecorded(_))) {
                        history.step_unrecorded(id);
                    }
                    history.body_ended(id, Err(()));
                    return Err(Failure::Body);
                }
            }
        }
        hand_over(&mut handed).await;
        tokio::time::sleep(work).await;
        if fails {
            history.body_ended(id, Err(()));
            return Err(Failure::Body);
        }
        if let (Some(effect), Some(fence)) = (&effect, fence) {
            if !effect.ledger.write(effect.key, fence, id) {
                // Fenced: a claim that took the key over asked or wrote under a larger token.
                history.body_ended(id, Err(()));
                return Err(Failure::Body);
            }
            history.effect(id);
        }
        history.body_ended(id, Ok(id));
        Ok(id)
    }
}

/// Hands the body's key to the operator, once, and waits until it is done with it.
async fn hand_over(
    handed: &mut Option<(tokio::sync::mpsc::UnboundedSender<Handover>, crate::Key)>,
) {
    if let Some((to, key)) = handed.take() {
        let (done, operated) = tokio::sync::oneshot::channel();
        if to.send((key, done)).is_ok() {
            // The operator always answers, or drops `done` when it stops.
            let _ = operated.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_secs(5);

    fn executed(history: &History, key: u64) -> BodyId {
        let call = history.begin(key, 0, BOUND);
        let body = history.body_started(call);
        history.body_ended(body, Ok(body));
        history.end(call, Answer::Executed(body));
        body
    }

    fn answered(history: &History, key: u64, answer: Answer) {
        let call = history.begin(key, 0, BOUND);
        history.end(call, answer);
    }

    fn broken(history: &History) -> String {
        history.check().expect_err("a broken rule").rule
    }

    #[test]
    fn a_store_error_after_the_body_ran_breaks_the_table() {
        let history = History::new();
        let call = history.begin(1, 0, BOUND);
        let body = history.body_started(call);
        history.body_ended(body, Ok(body));
        history.end(call, Answer::Failed("store"));
        assert!(broken(&history).contains("says its body did not run"));
    }

    #[test]
    fn unrecorded_without_a_body_breaks_the_table() {
        let history = History::new();
        answered(&history, 1, Answer::Failed("unrecorded"));
        assert!(broken(&history).contains("says its body ran"));
    }

    #[test]
    fn executed_names_its_own_body() {
        let history = History::new();
        let first = executed(&history, 1);
        answered(&history, 1, Answer::Executed(first));
        assert!(broken(&history).contains("its own body did not return"));
    }

    #[test]
    fn a_key_answers_one_value() {
        let history = History::new();
        let first = executed(&history, 1);
        answered(&history, 1, Answer::Replayed(first));
        assert!(history.check().is_ok());
        // A second body of the key that returned, with nobody told Unrecorded.
        let second = executed(&history, 1);
        answered(&history, 1, Answer::Replayed(second));
        assert!(broken(&history).contains("values"));
        // Another key's value is never this key's.
        let history = History::new();
        let other = executed(&history, 2);
        answered(&history, 1, Answer::Replayed(other));
        assert!(broken(&history).contains("no body of this key"));
    }

    #[test]
    fn a_second_run_is_excused_only_by_unrecorded_or_gone() {
        let history = History::new();
        let call = history.begin(1, 0, BOUND);
        let body = history.body_started(call);
        history.body_ended(body, Ok(body));
        history.end(call, Answer::BodyFailed);
        assert!(broken(&history).contains("its body ran and failed"));

        let history = History::new();
        let call = history.begin(1, 0, BOUND);
        let body = history.body_started(call);
        history.body_ended(body, Ok(body));
        history.end(call, Answer::Failed("unrecorded"));
        let again = executed(&history, 1);
        answered(&history, 1, Answer::Replayed(again));
        let report = history.check().expect("excused");
        assert_eq!(report.excused, 1);

        let history = History::new();
        let first = history.begin(1, 0, BOUND);
        let body = history.body_started(first);
        history.body_ended(body, Ok(body));
        history.end(first, Answer::Failed("in_progress"));
        assert!(broken(&history).contains("says its body did not run"));
    }

    #[test]
    fn a_step_run_twice_needs_an_unrecorded() {
        let history = History::new();
        for _ in 0..2 {
            let call = history.begin(1, 0, BOUND);
            let body = history.body_started(call);
            history.step_ran(body, 0);
            history.body_ended(body, Err(()));
            history.end(call, Answer::BodyFailed);
        }
        assert!(broken(&history).contains("steps run"));
    }

    #[test]
    fn a_killed_caller_excuses_a_second_run_and_a_cancelled_one_does_not() {
        for (answer, excused) in [(Answer::Killed, true), (Answer::Cancelled, false)] {
            let history = History::new();
            let call = history.begin(1, 0, BOUND);
            let body = history.body_started(call);
            history.body_ended(body, Ok(body)); // returned; its record never written
            history.end(call, answer.clone());
            let again = executed(&history, 1);
            answered(&history, 1, Answer::Replayed(again));
            assert_eq!(history.check().is_ok(), excused, "{answer:?}");
        }
    }

    #[test]
    fn a_rolled_back_call_is_no_run_and_no_value() {
        // Executed, then its transaction rolled back; the key runs again and commits.
        let history = History::new();
        let call = history.begin(1, 0, BOUND);
        let body = history.body_started(call);
        history.body_ended(body, Ok(body));
        history.end(call, Answer::Executed(body));
        history.rolled_back(call);
        let again = executed(&history, 1);
        answered(&history, 1, Answer::Replayed(again));
        let report = history.check().expect("one committed run");
        assert_eq!(report.excused, 0);
        // A replay of the rolled-back value was never recorded.
        answered(&history, 1, Answer::Replayed(body));
        assert!(broken(&history).contains("no body of this key"));
    }

    /// A caller killed after its effect: the history of its key, then of a taker that
    /// found the effect (`reconciled`) or ran the body blind.
    fn killed_then_taken(once: bool, reconciled: bool) -> History {
        let history = if once {
            History::new().effects_exactly_once()
        } else {
            History::new()
        };
        let killed = history.begin(1, 0, BOUND);
        let first = history.body_started(killed);
        history.effect(first);
        history.body_ended(first, Ok(first));
        history.end(killed, Answer::Killed);
        let taker = history.begin(1, 0, BOUND);
        let body = history.body_started(taker);
        if reconciled {
            history.reconciled(body, first);
            history.end(taker, Answer::Replayed(first));
        } else {
            history.effect(body);
            history.body_ended(body, Ok(body));
            history.end(taker, Answer::Executed(body));
        }
        history
    }

    /// A key's second effect is excused as a second run is (a caller killed), unless the
    /// history's effects are exactly once; a body that found an earlier effect answers it
    /// as a replay, and is no run.
    #[test]
    fn effects_are_counted_and_held_to_once_when_reconciled() {
        for once in [false, true] {
            let report = killed_then_taken(once, true).check().expect("one effect");
            assert_eq!(
                (report.effects, report.reconciled, report.excused),
                (1, 1, 0)
            );
        }
        let report = killed_then_taken(false, false).check().expect("excused");
        assert_eq!((report.effects, report.effects_twice), (2, 1));
        assert!(broken(&killed_then_taken(true, false)).contains("landed 2 times"));
        // Without a killed caller, a second effect is a violation anyway.
        let history = History::new();
        for _ in 0..2 {
            let call = history.begin(1, 0, BOUND);
            let body = history.body_started(call);
            history.effect(body);
            history.body_ended(body, Err(()));
            history.end(call, Answer::BodyFailed);
        }
        assert!(broken(&history).contains("landed 2 times"));
    }

    #[test]
    fn a_call_past_its_bound_or_unended_is_a_violation() {
        let history = History::new();
        history.begin(1, 0, BOUND);
        assert!(broken(&history).contains("never ended"));
        let history = History::new();
        let call = history.begin(1, 0, Duration::ZERO);
        std::thread::sleep(Duration::from_millis(2));
        history.end(call, Answer::Failed("store"));
        assert!(broken(&history).contains("past its bound"));
    }
}
