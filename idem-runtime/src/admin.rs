//! Operating a store: see which keys are held and by whom, release a stuck claim, reset a
//! completed call, purge what expired — safely (feature `admin`).
//!
//! ```
//! use idem_runtime::admin::{Admin, Filter, Release, State, Verdict};
//! use idem_runtime::{MemoryStore, Operation};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idem_runtime::Error> {
//! let store = MemoryStore::new();
//! let charge = Operation::new("billing.charge.v1");
//! let key = charge.key(&17_u64)?;
//! charge.run(&store, &key, None, async { Ok::<_, idem_runtime::Error>(7) }).await?;
//!
//! let page = store.list(&Filter::namespace("billing.").completed(), None).await?;
//! assert_eq!(page.entries().len(), 1);
//! let entry = &page.entries()[0];
//! assert_eq!(entry.namespace(), Some("billing.charge.v1"));
//! assert_eq!(entry.state(), State::Completed);
//!
//! // Forget the call, so that its next call runs again.
//! assert_eq!(store.reset(&key, Release::IfSilent).await?, Verdict::Done);
//! assert!(store.inspect(&key).await?.is_none());
//! # Ok(())
//! # }
//! ```
//!
//! # Safe by construction
//!
//! - [`release`](Admin::release) frees only a claim in progress, only under the token the
//!   operator was shown, and with [`Release::IfSilent`] only when its holder is silent: no
//!   renewal for more than half its lease (a live holder renews every quarter). A holder
//!   that renews is never released by mistake.
//! - [`Release::Force`] releases a live holder too, and **fences** it: its completion and
//!   its steps are refused (they are compare-and-set on its token), and its caller is
//!   answered [`Error::Unrecorded`] ("released by force"), never `Replayed` of the value of
//!   the run that took the key after it. (The store's registry of running calls tells a
//!   holder in the releasing process so; one in another process asks the store, which
//!   keeps a trace of the release for a day, before it would claim the key again.) The forced holder's effect, if it made one, stays: reconcile it (the
//!   operator's guide says how).
//! - [`reset`](Admin::reset) forgets a completed call and its steps; a call in progress
//!   only as `release` would free it.
//!
//! Each is judged and done in one atomic step on the store (the memory store: under the
//! key's lock, by the leases' clock; the SQL stores: one conditional `DELETE`, by the
//! database's clock; Redis: one script, by the server's clock; DynamoDB, which has no
//! clock a condition can read: one `UpdateItem` conditional on the version the operator
//! watched unchanged for half a lease): a renewal that lands first makes an `IfSilent`
//! release refuse, never the other way round.
//!
//! [`MemoryStore`](crate::MemoryStore), the SQL stores
//! ([`PostgresStore`](crate::PostgresStore), [`MySqlStore`](crate::MySqlStore),
//! [`SqliteStore`](crate::SqliteStore)), [`RedisStore`](crate::RedisStore) (one server,
//! Sentinel or Cluster) and [`DynamoDbStore`](crate::DynamoDbStore) implement [`Admin`], and
//! so does [`TieredStore`](crate::TieredStore) over a durable store that does. What each store supports, and what a listing costs on it, is in the operator's
//! guide ([`crate::guide::operations`]), with the `idem` command line (the crate `idem-cli`).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::store::Holder;
use crate::{Error, Key, Token};

/// The state of a record, as a listing shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum State {
    /// A claim in progress with a live lease.
    Held,
    /// A claim whose lease ran out: its holder died or stalled; the next claim takes it.
    Lapsed,
    /// A completed call whose result is replayed.
    Completed,
    /// A completed call whose result can no longer be replayed (too large, evicted, not
    /// decodable as itself): its calls answer [`Error::Gone`].
    Gone,
}

impl State {
    const ALL: [Self; 4] = [Self::Held, Self::Lapsed, Self::Completed, Self::Gone];

    fn bit(self) -> u8 {
        match self {
            Self::Held => 1,
            Self::Lapsed => 2,
            Self::Completed => 4,
            Self::Gone => 8,
        }
    }

    /// The state's name: `held`, `lapsed`, `completed`, `gone`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Held => "held",
            Self::Lapsed => "lapsed",
            Self::Completed => "completed",
            Self::Gone => "gone",
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for State {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self, Error> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == name)
            .ok_or_else(|| {
                Error::config(format!(
                    "`{name}` is not a state: say `held`, `lapsed`, `completed` or `gone`"
                ))
            })
    }
}

/// The largest page a listing returns, whatever its filter asks.
pub const MAX_PAGE: usize = 1_000;

/// Which records a listing returns: by namespace prefix and state, a page at a time.
///
/// ```
/// use idem_runtime::admin::Filter;
///
/// let stuck = Filter::namespace("billing.").held().lapsed().limit(50);
/// # let _ = stuck;
/// ```
#[derive(Clone, Debug)]
pub struct Filter {
    prefix: Option<String>,
    label: Option<String>,
    states: u8,
    limit: usize,
    values: bool,
}

impl Filter {
    /// Every record, 100 a page.
    pub fn all() -> Self {
        Self {
            prefix: None,
            label: None,
            states: 0,
            limit: 100,
            values: false,
        }
    }

    /// The records whose namespace starts with `prefix`. Records written before the store
    /// kept namespaces have none, and are listed only by a filter without a prefix.
    pub fn namespace(prefix: impl Into<String>) -> Self {
        Self {
            prefix: Some(prefix.into()),
            ..Self::all()
        }
    }

    /// Only the records labelled exactly `label`: a call by what an operator knows of it (a
    /// webhook preset labels its claims with the delivery's id as its sender names it; the
    /// attribute's `label = …` and [`labelled`](crate::labelled) label any call).
    #[must_use]
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// Also (or only, if it is the first state named) records in `state`.
    #[must_use]
    pub fn state(mut self, state: State) -> Self {
        self.states |= state.bit();
        self
    }

    /// Claims in progress with a live lease.
    #[must_use]
    pub fn held(self) -> Self {
        self.state(State::Held)
    }

    /// Claims whose lease ran out.
    #[must_use]
    pub fn lapsed(self) -> Self {
        self.state(State::Lapsed)
    }

    /// Completed calls that replay.
    #[must_use]
    pub fn completed(self) -> Self {
        self.state(State::Completed)
    }

    /// Completed calls that answer [`Error::Gone`].
    #[must_use]
    pub fn gone(self) -> Self {
        self.state(State::Gone)
    }

    /// At most `entries` a page (1 to [`MAX_PAGE`]).
    #[must_use]
    pub fn limit(mut self, entries: usize) -> Self {
        self.limit = entries.clamp(1, MAX_PAGE);
        self
    }

    /// Carries each completed record's value in its entry ([`Entry::value`]). Off by
    /// default: results can be large and hold personal data.
    #[must_use]
    pub fn with_values(mut self) -> Self {
        self.values = true;
        self
    }

    /// The namespace prefix, if any.
    pub fn prefix(&self) -> Option<&str> {
        self.prefix.as_deref()
    }

    /// The label asked for, if any.
    pub fn label_asked(&self) -> Option<&str> {
        self.label.as_deref()
    }

    /// The page's size.
    pub fn page_size(&self) -> usize {
        self.limit
    }

    /// Whether entries carry values.
    pub fn values(&self) -> bool {
        self.values
    }

    /// Whether `entry` is listed: its namespace, its label and its state. What a store
    /// implementing [`Admin::list`] asks of each record it reads.
    pub fn admits(&self, entry: &Entry) -> bool {
        self.matches(entry.namespace(), entry.state()) && self.labelled(entry.label())
    }

    /// Whether a record labelled `label` is listed.
    pub fn labelled(&self, label: Option<&str>) -> bool {
        self.label.is_none() || self.label.as_deref() == label
    }

    /// Whether a record of `namespace` in `state` is listed, whatever its label
    /// ([`admits`](Self::admits) asks that too).
    pub fn matches(&self, namespace: Option<&str>, state: State) -> bool {
        let state_ok = self.states == 0 || self.states & state.bit() != 0;
        let namespace_ok = match (&self.prefix, namespace) {
            (None, _) => true,
            (Some(prefix), Some(namespace)) => namespace.starts_with(prefix.as_str()),
            (Some(_), None) => false,
        };
        state_ok && namespace_ok
    }
}

/// Where the next page of a listing starts. Printed and read back as text, so that a
/// script can carry it between runs of `idem list`: 64 hex digits (after this key, in key
/// order) for the stores that list in key order, or a store's own position for those that
/// do not (Redis: which node, and where its `SCAN` stands).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cursor(At);

#[derive(Clone, Debug, PartialEq, Eq)]
enum At {
    After(Key),
    Position(String),
}

impl Cursor {
    /// The page after `key`.
    pub fn after(key: Key) -> Self {
        Self(At::After(key))
    }

    /// A position of a store's own (for store implementations whose listings are not in
    /// key order): printable ASCII without spaces, and never 64 hex digits, which read back
    /// as a key.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for any other text.
    pub fn position(text: impl Into<String>) -> Result<Self, Error> {
        let text = text.into();
        if text.is_empty() || !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::config(format!(
                "a listing's position is printable ASCII without spaces, not {text:?}"
            )));
        }
        if parse_digest(&text).is_ok() {
            return Err(Error::config(
                "a listing's position of 64 hex digits would read back as a key",
            ));
        }
        Ok(Self(At::Position(text)))
    }

    /// The last key of the page before, for a listing in key order.
    pub fn key(&self) -> Option<&Key> {
        match &self.0 {
            At::After(key) => Some(key),
            At::Position(_) => None,
        }
    }

    /// The store's own position ([`position`](Self::position)).
    pub fn store_position(&self) -> Option<&str> {
        match &self.0 {
            At::After(_) => None,
            At::Position(text) => Some(text),
        }
    }

    /// The key a listing in key order starts after: [`Error::Config`] for a position of
    /// another store's listing. (For the stores that list in key order, when compiled in.)
    #[cfg_attr(
        not(any(
            feature = "memory",
            feature = "postgres",
            feature = "mysql",
            feature = "sqlite"
        )),
        allow(dead_code)
    )]
    pub(crate) fn key_order(cursor: Option<&Self>) -> Result<Option<Key>, Error> {
        match cursor.map(|cursor| &cursor.0) {
            None => Ok(None),
            Some(At::After(key)) => Ok(Some(*key)),
            Some(At::Position(text)) => Err(Error::config(format!(
                "the cursor {text:?} is not a key: it comes from another store's listing"
            ))),
        }
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            At::After(key) => f.write_str(&key.to_hex()),
            At::Position(text) => f.write_str(text),
        }
    }
}

impl FromStr for Cursor {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self, Error> {
        match parse_digest(text) {
            Ok(key) => Ok(Self::after(key)),
            Err(_) => Self::position(text),
        }
    }
}

/// A key's 64 hex digits, as listings print them.
///
/// # Errors
///
/// [`Error::Config`] for anything else.
pub fn parse_digest(text: &str) -> Result<Key, Error> {
    Key::from_hex(text.trim()).ok_or_else(|| {
        Error::config(format!(
            "`{text}` is not a key's digest: 64 hex digits, as `idem list` prints them"
        ))
    })
}

/// The key the macro derives in `namespace` for the key value written as JSON: what
/// `idem key` prints, and how `idem show`, `release` and `reset` name a call.
///
/// JSON names Rust values as they encode (`crate::key`'s table): an integer is any Rust
/// integer of that value, whatever its width; a number with a fraction or an exponent is a
/// float (`1.0` for an `f64` key of one); a string is a `String`, `&str` or `char`; `true`
/// and `false` are `bool`; an array is a `Vec`, an array, a tuple or a tuple struct (a key
/// of several arguments, `key = (order.id, order.user)`, is `[17, "ada"]`). A newtype
/// struct is what it wraps.
///
/// ```
/// use idem_runtime::admin::key_from_json;
/// use idem_runtime::Key;
///
/// let key = key_from_json("billing.charge.v1", r#"[17, "ada"]"#)?;
/// assert_eq!(key, Key::derive("billing.charge.v1", &(17_u64, "ada"))?);
/// # Ok::<(), idem_runtime::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::Config`] for JSON that is not valid, and for a value whose Rust encoding JSON
/// cannot tell: `null` (`None`, `()` or a unit struct encode differently), an object (a
/// struct and a map encode differently; and field order would matter), and an integer
/// beyond 64 bits (JSON parsers round it). Name such a call by its digest instead, which
/// `Key::derive` in Rust prints. An `Option` key and an enum variant are not expressible
/// either: `Some(5)` is not `5`, a unit variant is not its name as a string.
pub fn key_from_json(namespace: &str, json: &str) -> Result<Key, Error> {
    let json = integers(json)?;
    let value: serde_json::Value = serde_json::from_str(&json)
        .map_err(|err| Error::config(format!("the key value is not JSON: {err}")))?;
    refuse_ambiguous(&value)?;
    Key::derive(namespace, &value)
}

/// The key an HTTP layer ([`IdempotencyLayer`](crate::http::IdempotencyLayer)) derives in
/// `namespace` (its own, `idem.http` by default) for the `Idempotency-Key` value `key` sent
/// by the principal its scope named (`None` for an unscoped layer): how an operator names a
/// request by what its client sent (`idem show --http KEY --scope PRINCIPAL`).
///
/// ```
/// use idem_runtime::admin::http_key;
/// use idem_runtime::Operation;
///
/// let key = http_key("idem.http", Some("alice"), "k-1")?;
/// assert_eq!(key, Operation::new("idem.http").key(&(Some("alice"), "k-1"))?);
/// # Ok::<(), idem_runtime::Error>(())
/// ```
///
/// # Errors
///
/// None in practice: a string pair always encodes; the `Result` is the derivation's.
pub fn http_key(namespace: &str, scope: Option<&str>, key: &str) -> Result<Key, Error> {
    Key::derive(namespace, &(scope, key))
}

/// Refuses the JSON values whose Rust encoding is ambiguous (see [`key_from_json`]).
fn refuse_ambiguous(value: &serde_json::Value) -> Result<(), Error> {
    use serde_json::Value;
    match value {
        Value::Null => Err(Error::config(
            "`null` in a key value is ambiguous (`None`, `()` and a unit struct encode differently): name the call by its digest",
        )),
        Value::Object(_) => Err(Error::config(
            "an object in a key value is ambiguous (a struct and a map encode differently): write a struct's fields as an array if the key is a tuple, or name the call by its digest",
        )),
        Value::Array(items) => items.iter().try_for_each(refuse_ambiguous),
        Value::Bool(_) | Value::Number(_) | Value::String(_) => Ok(()),
    }
}

/// `json` with each integer literal checked: one beyond 64 bits is refused, since JSON
/// parsing rounds it to a float, and `-0` is written `0`, the integer it names (JSON
/// parsers read it as the float negative zero, whose key is another).
fn integers(json: &str) -> Result<String, Error> {
    let mut normal = String::with_capacity(json.len());
    let mut copied = 0;
    let (mut in_string, mut escaped) = (false, false);
    let mut chars = json.char_indices().peekable();
    while let Some((start, c)) = chars.next() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        if c == '"' {
            in_string = true;
        } else if c == '-' || c.is_ascii_digit() {
            let mut end = start + c.len_utf8();
            while let Some(&(at, next)) = chars.peek() {
                if !(next.is_ascii_digit() || matches!(next, '.' | 'e' | 'E' | '+' | '-')) {
                    break;
                }
                end = at + next.len_utf8();
                chars.next();
            }
            let token = &json[start..end];
            let integer = !token.contains(['.', 'e', 'E']);
            if integer && token.parse::<i64>().is_err() && token.parse::<u64>().is_err() {
                return Err(Error::config(format!(
                    "the integer {token} is beyond 64 bits, which JSON rounds: name the call by its digest"
                )));
            }
            if token == "-0" {
                normal.push_str(&json[copied..start]);
                normal.push('0');
                copied = end;
            }
        }
    }
    normal.push_str(&json[copied..]);
    Ok(normal)
}

/// One page of a listing.
#[derive(Clone, Debug)]
pub struct Page {
    entries: Vec<Entry>,
    next: Option<Cursor>,
}

impl Page {
    /// A page, for store implementations: `next` is where the one after it starts, `None`
    /// on the last.
    pub fn new(entries: Vec<Entry>, next: Option<Cursor>) -> Self {
        Self { entries, next }
    }

    /// The records on this page, in the store's listing order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The records, owned.
    pub fn into_entries(self) -> Vec<Entry> {
        self.entries
    }

    /// Where the next page starts; `None` on the last page.
    pub fn next(&self) -> Option<Cursor> {
        self.next.clone()
    }
}

/// One record as an operator sees it. Never the result itself unless asked for
/// ([`Filter::with_values`], and [`Admin::inspect`], which carries it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub(crate) key: Key,
    pub(crate) namespace: Option<String>,
    pub(crate) label: Option<String>,
    pub(crate) state: State,
    pub(crate) token: Option<Token>,
    pub(crate) lease: Option<Duration>,
    pub(crate) lease_left: Option<Duration>,
    pub(crate) holder: Option<Holder>,
    pub(crate) expires_in: Option<Duration>,
    pub(crate) size: Option<u64>,
    pub(crate) value: Option<Bytes>,
    pub(crate) steps: Vec<(Key, u64)>,
}

impl Entry {
    /// A record of `key` in `state`, for store implementations; the rest is set with the
    /// `with_*` methods.
    pub fn new(key: Key, state: State) -> Self {
        Self {
            key,
            namespace: None,
            label: None,
            state,
            token: None,
            lease: None,
            lease_left: None,
            holder: None,
            expires_in: None,
            size: None,
            value: None,
            steps: Vec::new(),
        }
    }

    /// With the claim's namespace and label.
    #[must_use]
    pub fn with_names(mut self, namespace: Option<String>, label: Option<String>) -> Self {
        self.namespace = namespace;
        self.label = label;
        self
    }

    /// With a claim's token, lease and what it has left (zero once lapsed), and holder.
    #[must_use]
    pub fn with_claim(
        mut self,
        token: Token,
        lease: Option<Duration>,
        lease_left: Duration,
        holder: Option<Holder>,
    ) -> Self {
        self.token = Some(token);
        self.lease = lease;
        self.lease_left = Some(lease_left);
        self.holder = holder;
        self
    }

    /// With how long the record lives, its result's size and, if asked, the result.
    #[must_use]
    pub fn with_result(
        mut self,
        expires_in: Option<Duration>,
        size: Option<u64>,
        value: Option<Bytes>,
    ) -> Self {
        self.expires_in = expires_in;
        self.size = size;
        self.value = value;
        self
    }

    /// With the call's recorded steps: each step's key and the size of its record.
    #[must_use]
    pub fn with_steps(mut self, steps: Vec<(Key, u64)>) -> Self {
        self.steps = steps;
        self
    }

    /// The call's key (its digest).
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The operation's namespace; `None` for a record written before the store kept it
    /// ("namespace unknown").
    pub fn namespace(&self) -> Option<&str> {
        self.namespace.as_deref()
    }

    /// The readable label its caller chose, if any.
    pub fn label(&self) -> Option<&str> {
        self.label.as_deref()
    }

    /// Held, lapsed, completed or gone.
    pub fn state(&self) -> State {
        self.state
    }

    /// The claim's token, for a claim: what [`Admin::release`] must be given.
    pub fn token(&self) -> Option<Token> {
        self.token
    }

    /// The lease the claim was taken with, when the store kept it.
    pub fn lease(&self) -> Option<Duration> {
        self.lease
    }

    /// How long the claim's lease has left, by the store's clock (zero once lapsed).
    pub fn lease_left(&self) -> Option<Duration> {
        self.lease_left
    }

    /// The process that holds the claim, when the store kept it.
    pub fn holder(&self) -> Option<&Holder> {
        self.holder.as_ref()
    }

    /// How long ago the holder last renewed (or took) its claim: the lease minus what it
    /// has left, when both are known.
    pub fn renewed_ago(&self) -> Option<Duration> {
        Some(self.lease?.saturating_sub(self.lease_left?))
    }

    /// Whether the holder is silent: no renewal for more than half its lease, a lease that
    /// ran out, or a holder whose process has exited ([`Holder::has_exited`]: it ran on
    /// this machine, and its process id is free). A claim of unknown lease is silent only
    /// once lapsed or exited.
    pub fn is_silent(&self) -> bool {
        match (self.state, self.renewed_ago(), self.lease) {
            (State::Lapsed, ..) => true,
            (State::Held, ..) if self.holder.as_ref().is_some_and(Holder::has_exited) => true,
            (State::Held, Some(ago), Some(lease)) => ago > lease / 2,
            _ => false,
        }
    }

    /// How long the record lives on, when the store can say.
    pub fn expires_in(&self) -> Option<Duration> {
        self.expires_in
    }

    /// The record's size in bytes, for a completed record: the result's encoding and its
    /// one tag byte.
    pub fn size(&self) -> Option<u64> {
        self.size
    }

    /// The recorded result, when asked for.
    pub fn value(&self) -> Option<&Bytes> {
        self.value.as_ref()
    }

    /// The recorded value's JSON, when the record is one (not an error cached by
    /// `cache_err`, an HTTP response or a `Gone` mark) and was asked for.
    pub fn value_json(&self) -> Option<&str> {
        match self.value.as_deref()? {
            [b'v', json @ ..] => std::str::from_utf8(json).ok(),
            _ => None,
        }
    }

    /// The call's recorded steps ([`Admin::inspect`] only): each step's key and size.
    pub fn steps(&self) -> &[(Key, u64)] {
        &self.steps
    }
}

/// How [`Admin::release`] and [`Admin::reset`] treat a claim in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// Only when its holder is silent: no renewal for more than half its lease.
    IfSilent,
    /// Whatever its holder does; the holder is fenced (its completion and steps refused,
    /// its caller answered [`Error::Unrecorded`]).
    Force,
}

/// What a release or reset did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// Done: the claim released, or the call forgotten.
    Done,
    /// Refused, and nothing was changed.
    Refused(Refusal),
}

/// What one conditional write of [`Admin::end_claim`] or [`Admin::forget_call`] came to.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ending {
    /// It was written: the claim ended, or the call was forgotten.
    Ended,
    /// The record is no longer what the operator looked at (taken again, renewed, settled
    /// or gone): nothing was written, and [`release`](Admin::release) looks again.
    Changed,
    /// The store judged the claim and refused to end it: nothing was written. (A store that
    /// judges only by its condition answers [`Changed`](Self::Changed) instead, and the
    /// next look refuses.)
    Refused(Refusal),
}

/// Why a release or reset changed nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// There is no record of the key.
    NotFound,
    /// The record is not a claim in progress (it completed, or is gone): use `reset`.
    NotHeld(State),
    /// The claim is held under another token than the one given: it was taken again since
    /// the operator looked. Look again.
    OtherToken(Token),
    /// The holder renewed its claim this long ago, within half its lease: it lives.
    Live {
        /// How long ago it renewed, when the store can say.
        renewed_ago: Option<Duration>,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotFound => f.write_str("there is no record of this key"),
            Self::NotHeld(state) => write!(f, "the record is {state}, not held: use `reset`"),
            Self::OtherToken(token) => write!(
                f,
                "the claim is held under token {} now, not the one given: look again",
                token.get()
            ),
            Self::Live {
                renewed_ago: Some(ago),
            } => write!(
                f,
                "its holder renewed it {} ms ago, within half its lease: it is alive (force it with `Release::Force`, `--force`)",
                ago.as_millis()
            ),
            Self::Live { renewed_ago: None } => f.write_str(
                "its holder renews it: it is alive (force it with `Release::Force`, `--force`)",
            ),
        }
    }
}

/// An operator's view of a store (feature `admin`): every store of this crate implements
/// it ([`MemoryStore`](crate::MemoryStore), the SQL stores, [`RedisStore`](crate::RedisStore),
/// [`DynamoDbStore`](crate::DynamoDbStore), [`TieredStore`](crate::TieredStore)).
///
/// A store implements three reads ([`list`](Self::list), [`inspect`](Self::inspect),
/// [`look`](Self::look)), two conditional writes ([`end_claim`](Self::end_claim),
/// [`forget_call`](Self::forget_call)) and [`purge`](Self::purge); the release rules
/// (the token shown, a silent holder unless forced, a completed call reset rather than
/// released) and the looking again when a write finds the record changed are
/// [`release`](Self::release) and [`reset`](Self::reset), written here once.
///
/// [`Store`](crate::Store) has a `release` of its own (a holder's, by token): with both
/// traits in scope, say which, `Admin::release(&store, &key, token, Release::IfSilent)`.
///
/// Object safe: the `idem` command line works on a `Box<dyn Admin>`.
#[async_trait]
pub trait Admin: Send + Sync {
    /// One page of the records `filter` selects after `after` (the previous page's
    /// [`next`](Page::next)): in key order, or on Redis in `SCAN`'s order (a key written
    /// or deleted during the listing may be missed or shown twice, as `SCAN` allows) and on
    /// DynamoDB in the table's.
    /// Bounded in memory by the page, whatever the store holds; each store's cost is in the
    /// operator's guide. A store that reads a bounded stretch of keys a call (the SQL
    /// stores, Redis, DynamoDB) may return a short page, even an empty one, with a `next`:
    /// the listing ends only where `next` is `None`.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store fails.
    async fn list(&self, filter: &Filter, after: Option<&Cursor>) -> Result<Page, Error>;

    /// The record of `key`, with its steps and its value: `None` when there is none.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store fails.
    async fn inspect(&self, key: &Key) -> Result<Option<Entry>, Error>;

    /// The record of `key` as it stands, without its steps and its value: what
    /// [`release`](Self::release) and [`reset`](Self::reset) judge. `None` when there is
    /// none.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store fails.
    async fn look(&self, key: &Key) -> Result<Option<Entry>, Error>;

    /// Ends the claim `entry` showed (held or lapsed under `token`) in one conditional
    /// write: only while the record still holds `token` and, unless `how` is
    /// [`Release::Force`] or the holder's process has exited, while its holder is still
    /// silent. The holder is fenced first (its completion and steps refused), and a
    /// holder of this process is told at once. A release (`forget` false) leaves the key
    /// to the next claim, which is told that it takes over a call whose outcome is
    /// unknown; a reset (`forget`) deletes the record and the call's steps.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store fails; a record that changed is
    /// [`Ending::Changed`].
    async fn end_claim(
        &self,
        entry: &Entry,
        token: Token,
        how: Release,
        forget: bool,
    ) -> Result<Ending, Error>;

    /// Deletes the completed (or gone) call `entry` showed, and its steps, in one
    /// conditional write: only while it is still completed or gone, never a claim taken
    /// since.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store fails; a record that changed is
    /// [`Ending::Changed`].
    async fn forget_call(&self, entry: &Entry) -> Result<Ending, Error>;

    /// Releases the claim of `key` held under `token` (the one a listing showed), as `how`
    /// allows, in one conditional write: the next call claims at once.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store fails, or when the record changed under every look
    /// (it is taken and settled faster than it is read); a refusal is a
    /// [`Verdict::Refused`].
    async fn release(&self, key: &Key, token: Token, how: Release) -> Result<Verdict, Error> {
        judged(self, key, Some(token), how).await
    }

    /// Forgets the call of `key` and its steps, so that its next call runs again: a
    /// completed (or gone) call at once, a claim in progress as `how` allows.
    ///
    /// # Errors
    ///
    /// As [`release`](Self::release).
    async fn reset(&self, key: &Key, how: Release) -> Result<Verdict, Error> {
        judged(self, key, None, how).await
    }

    /// Deletes the expired records: how many (as far as the store counts them).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store fails.
    async fn purge(&self) -> Result<u64, Error>;
}

/// How many times a release or reset looks again when the record changed between its look
/// and its write.
const LOOKS: usize = 3;

/// [`Admin::release`] (with the `token` shown) and [`Admin::reset`] (without): look,
/// judge, write on the condition that nothing changed, and look again if it did.
async fn judged<A: Admin + ?Sized>(
    admin: &A,
    key: &Key,
    token: Option<Token>,
    how: Release,
) -> Result<Verdict, Error> {
    for _ in 0..LOOKS {
        let Some(entry) = admin.look(key).await? else {
            return Ok(Verdict::Refused(Refusal::NotFound));
        };
        if let Some(refusal) = refusal(&entry, token, how) {
            return Ok(Verdict::Refused(refusal));
        }
        let claim = matches!(entry.state(), State::Held | State::Lapsed);
        let ending = match entry.token().or(token) {
            Some(held) if claim => admin.end_claim(&entry, held, how, token.is_none()).await?,
            _ => admin.forget_call(&entry).await?,
        };
        match ending {
            Ending::Ended => return Ok(Verdict::Done),
            Ending::Refused(refusal) => return Ok(Verdict::Refused(refusal)),
            Ending::Changed => {}
        }
    }
    let what = if token.is_some() { "release" } else { "reset" };
    Err(Error::store(format!(
        "the record changed under every look: try the {what} again"
    )))
}

/// Judges a record against a release (with the `token` shown) or a reset (without):
/// `None` when it may go.
pub(crate) fn refusal(entry: &Entry, token: Option<Token>, how: Release) -> Option<Refusal> {
    match entry.state {
        State::Completed | State::Gone if token.is_some() => {
            return Some(Refusal::NotHeld(entry.state))
        }
        State::Completed | State::Gone => return None,
        State::Held | State::Lapsed => {}
    }
    if let (Some(given), Some(held)) = (token, entry.token) {
        if given != held {
            return Some(Refusal::OtherToken(held));
        }
    }
    (how == Release::IfSilent && !entry.is_silent()).then(|| Refusal::Live {
        renewed_ago: entry.renewed_ago(),
    })
}

macro_rules! forward_admin {
    ($($ty:ty),*) => {$(
        #[async_trait]
        impl<A: Admin + ?Sized> Admin for $ty {
            async fn list(&self, filter: &Filter, after: Option<&Cursor>) -> Result<Page, Error> {
                (**self).list(filter, after).await
            }

            async fn inspect(&self, key: &Key) -> Result<Option<Entry>, Error> {
                (**self).inspect(key).await
            }

            async fn look(&self, key: &Key) -> Result<Option<Entry>, Error> {
                (**self).look(key).await
            }

            async fn end_claim(
                &self,
                entry: &Entry,
                token: Token,
                how: Release,
                forget: bool,
            ) -> Result<Ending, Error> {
                (**self).end_claim(entry, token, how, forget).await
            }

            async fn forget_call(&self, entry: &Entry) -> Result<Ending, Error> {
                (**self).forget_call(entry).await
            }

            async fn release(&self, key: &Key, token: Token, how: Release) -> Result<Verdict, Error> {
                (**self).release(key, token, how).await
            }

            async fn reset(&self, key: &Key, how: Release) -> Result<Verdict, Error> {
                (**self).reset(key, how).await
            }

            async fn purge(&self) -> Result<u64, Error> {
                (**self).purge().await
            }
        }
    )*};
}

forward_admin!(std::sync::Arc<A>, Box<A>);

#[cfg(test)]
mod tests {
    use super::*;

    fn held(lease_ms: u64, left_ms: u64) -> Entry {
        Entry::new(Key::from_bytes([1; 32]), State::Held).with_claim(
            Token::new(3),
            Some(Duration::from_millis(lease_ms)),
            Duration::from_millis(left_ms),
            None,
        )
    }

    #[test]
    fn a_holder_is_silent_past_half_its_lease() {
        assert!(!held(1_000, 600).is_silent());
        assert!(held(1_000, 400).is_silent());
        assert_eq!(
            held(1_000, 400).renewed_ago(),
            Some(Duration::from_millis(600))
        );
    }

    #[test]
    fn a_release_needs_the_token_shown_and_a_silent_holder_unless_forced() {
        let live = held(1_000, 900);
        let token = Some(Token::new(3));
        assert_eq!(
            refusal(&live, Some(Token::new(4)), Release::Force),
            Some(Refusal::OtherToken(Token::new(3)))
        );
        assert!(matches!(
            refusal(&live, token, Release::IfSilent),
            Some(Refusal::Live { .. })
        ));
        assert_eq!(refusal(&live, token, Release::Force), None);
        assert_eq!(refusal(&held(1_000, 100), token, Release::IfSilent), None);
        let done = Entry::new(Key::from_bytes([1; 32]), State::Completed);
        assert_eq!(
            refusal(&done, token, Release::Force),
            Some(Refusal::NotHeld(State::Completed))
        );
        assert_eq!(refusal(&done, None, Release::IfSilent), None);
    }

    #[test]
    fn filters_select_by_prefix_and_state() {
        let filter = Filter::namespace("billing.").held();
        assert!(filter.matches(Some("billing.charge"), State::Held));
        assert!(!filter.matches(Some("billing.charge"), State::Completed));
        assert!(!filter.matches(Some("shipping"), State::Held));
        assert!(!filter.matches(None, State::Held));
        assert!(Filter::all().matches(None, State::Gone));
        assert_eq!(Filter::all().limit(1_000_000).page_size(), MAX_PAGE);
    }

    #[test]
    fn json_names_a_key_as_the_rust_value_encodes() {
        let ns = "billing.charge.v1";
        let cases: [(&str, Key); 6] = [
            ("17", Key::derive(ns, &17_u8).unwrap()),
            ("-3", Key::derive(ns, &-3_i32).unwrap()),
            ("1.5", Key::derive(ns, &1.5_f64).unwrap()),
            (r#""ord_1""#, Key::derive(ns, "ord_1").unwrap()),
            (
                r#"[17, "ada", true]"#,
                Key::derive(ns, &(17_u64, "ada", true)).unwrap(),
            ),
            ("18446744073709551615", Key::derive(ns, &u64::MAX).unwrap()),
        ];
        for (json, key) in cases {
            assert_eq!(key_from_json(ns, json).unwrap(), key, "{json}");
        }
        for ambiguous in [
            "null",
            "[1, null]",
            r#"{"id": 1}"#,
            "18446744073709551616",
            "[-9223372036854775809]",
            "not json",
        ] {
            assert!(
                key_from_json(ns, ambiguous).is_err(),
                "{ambiguous} was accepted"
            );
        }
        // Digits inside a string are the string's.
        assert!(key_from_json(ns, r#""99999999999999999999""#).is_ok());
        // `-0` is the integer zero (a JSON parser reads the float negative zero); `-0.0`
        // is the float, and a string keeps its `-0`.
        assert_eq!(
            key_from_json(ns, "-0").unwrap(),
            Key::derive(ns, &0_i64).unwrap()
        );
        assert_eq!(
            key_from_json(ns, r#"[-0, "-0"]"#).unwrap(),
            Key::derive(ns, &(0_u8, "-0")).unwrap()
        );
        assert_eq!(
            key_from_json(ns, "-0.0").unwrap(),
            Key::derive(ns, &-0.0_f64).unwrap()
        );
        assert!(key_from_json(ns, "-00").is_err());
    }

    #[test]
    fn a_label_filter_admits_that_label_alone() {
        let entry = |label: Option<&str>| {
            Entry::new(Key::from_bytes([1; 32]), State::Held).with_names(
                Some("idem.webhook.stripe.billing".into()),
                label.map(Into::into),
            )
        };
        let filter = Filter::namespace("idem.webhook.stripe.").label("evt_1");
        assert!(filter.admits(&entry(Some("evt_1"))));
        assert!(!filter.admits(&entry(Some("evt_12"))));
        assert!(!filter.admits(&entry(None)));
        assert!(Filter::all().admits(&entry(None)));
    }

    #[test]
    fn a_cursor_reads_back_from_its_hex() {
        let cursor = Cursor::after(Key::from_bytes([0xab; 32]));
        assert_eq!(cursor.to_string().parse::<Cursor>().unwrap(), cursor);
        let position = Cursor::position("2.1234.5").unwrap();
        assert_eq!(position.to_string().parse::<Cursor>().unwrap(), position);
        assert_eq!(position.key(), None);
        assert!("a b".parse::<Cursor>().is_err());
        assert!(Cursor::position("ab".repeat(32)).is_err(), "a key's digits");
    }
}
