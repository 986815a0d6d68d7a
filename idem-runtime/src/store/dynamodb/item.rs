//! A record as a DynamoDB item: its attributes, and the item read back into a state.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use bytes::Bytes;

use super::seen::Held;
use crate::{Error, Fingerprint, Key, Token};

/// The table's partition key: the key's 64 hex digits.
pub(super) const ID: &str = "id";
/// `IN_PROGRESS`, `COMPLETED`, `RELEASED` or `REMOVED`.
pub(super) const STATE: &str = "state";
/// The fencing token: starts at the first claimer's clock in microseconds, one more each
/// claim; kept by releases and removals, so it only grows while the item lives.
pub(super) const TOKEN: &str = "token";
/// How many claims and renewals the item has had: what a waiter watches for a whole lease.
pub(super) const VERSION: &str = "version";
/// The nonce of the claim in progress, so that a claim sent again finds its own.
pub(super) const NONCE: &str = "nonce";
/// The lease the holder asked for, in milliseconds.
pub(super) const LEASE_MS: &str = "lease_ms";
/// When the holder last claimed or renewed, by its clock, in milliseconds since the epoch:
/// for an operator reading the item; no condition compares it.
pub(super) const RENEWED_AT: &str = "renewed_at";
/// The fingerprint (32 bytes), absent for none.
pub(super) const FINGERPRINT: &str = "fingerprint";
/// The recorded value, once completed.
pub(super) const VALUE: &str = "value";
/// When a completed record expires, by the completing process's clock, in milliseconds
/// since the epoch: a claim after it runs the body again.
pub(super) const EXPIRES_AT: &str = "expires_at";
/// DynamoDB's TTL attribute (seconds since the epoch): when the table may delete the item.
pub(super) const EXPIRATION: &str = "expiration";
/// A map from each recorded step's key (hex) to a map of its value (`v`) and when it
/// expires (`e`, milliseconds since the epoch, by the recording process's clock).
pub(super) const STEPS: &str = "steps";
/// The operation's namespace of the claim (`NULL` for a claim that named none), kept once
/// completed: what an operator's listing filters by.
pub(super) const NAMESPACE: &str = "namespace";
/// A readable label the caller chose (`NULL`: none, the default).
pub(super) const LABEL: &str = "label";
/// The process that claimed (`host/pid/started@machine`, nothing secret).
pub(super) const HOLDER: &str = "holder";
/// The token of the last claim an operator released: its holder, and any older one, must
/// not claim the item again to record a result (tokens only grow).
pub(super) const RELEASED_TOKEN: &str = "released_token";
/// The id of the last write, drawn per request: a write sent again by the SDK after a lost
/// reply finds it and knows it landed.
pub(super) const WRITTEN: &str = "written";
/// The state the item was in when the claim in progress took it (`NONE`: no item), the
/// nonce it was in progress under and its token, if any: whether that claim took an
/// unsettled one over.
pub(super) const PRIOR_STATE: &str = "prior_state";
pub(super) const PRIOR_NONCE: &str = "prior_nonce";
pub(super) const PRIOR_TOKEN: &str = "prior_token";
/// [`PRIOR_STATE`] of a claim that found no item.
pub(super) const NONE: &str = "NONE";

pub(super) const IN_PROGRESS: &str = "IN_PROGRESS";
pub(super) const COMPLETED: &str = "COMPLETED";
pub(super) const RELEASED: &str = "RELEASED";
pub(super) const REMOVED: &str = "REMOVED";

/// What an item holds, as a claim sees it.
#[derive(Debug)]
pub(super) enum State {
    /// No item, or one released or removed.
    Free,
    InProgress {
        held: Held,
        fingerprint: Option<Fingerprint>,
    },
    Completed {
        value: Bytes,
        fingerprint: Option<Fingerprint>,
        /// Milliseconds since the epoch.
        expires_at: u64,
    },
}

pub(super) type Item = HashMap<String, AttributeValue>;

/// Whether the claim of nonce `nonce`, whose item is `new` as the claim left it, took the
/// key over from a claim that was never settled: one in progress under another nonce
/// (lapsed, since the claim could take it), or one an operator released (its token the
/// released one).
pub(super) fn taken_over(new: &Item, nonce: u64) -> bool {
    match new.get(PRIOR_STATE) {
        Some(AttributeValue::S(prior)) if prior == IN_PROGRESS => {
            number(new, PRIOR_NONCE).ok() != Some(nonce)
        }
        Some(AttributeValue::S(prior)) if prior == RELEASED => {
            let released = number(new, RELEASED_TOKEN).ok();
            released.is_some() && released == number(new, PRIOR_TOKEN).ok()
        }
        _ => false,
    }
}

/// Reads an item (or its absence) into the state a claim acts on.
pub(super) fn state(item: Option<&Item>) -> Result<State, Error> {
    let Some(item) = item else {
        return Ok(State::Free);
    };
    match string(item, STATE)? {
        IN_PROGRESS => Ok(State::InProgress {
            held: Held {
                token: Token::new(number(item, TOKEN)?),
                version: number(item, VERSION)?,
                lease: Duration::from_millis(number(item, LEASE_MS)?),
            },
            fingerprint: fingerprint(item)?,
        }),
        COMPLETED => Ok(State::Completed {
            value: blob(item, VALUE)?,
            fingerprint: fingerprint(item)?,
            expires_at: number(item, EXPIRES_AT)?,
        }),
        RELEASED | REMOVED => Ok(State::Free),
        other => Err(malformed(&format!("a state `{other}`"))),
    }
}

/// The claim a claim's `ALL_NEW` reply (or its item read back) says was taken, under the
/// `lease` it asked for: the lease is the one the claim sent, never read back.
pub(super) fn acquired(reply: &Item, lease: Duration) -> Result<Held, Error> {
    Ok(Held {
        token: Token::new(number(reply, TOKEN)?),
        version: number(reply, VERSION)?,
        lease: Duration::from_millis(millis(lease)),
    })
}

pub(super) fn number(item: &Item, name: &str) -> Result<u64, Error> {
    match item.get(name) {
        Some(AttributeValue::N(digits)) => digits
            .parse()
            .map_err(|_| malformed(&format!("`{name}` = {digits}, not a whole number"))),
        _ => Err(malformed(&format!("no number `{name}`"))),
    }
}

pub(super) fn string<'a>(item: &'a Item, name: &str) -> Result<&'a str, Error> {
    match item.get(name) {
        Some(AttributeValue::S(text)) => Ok(text),
        _ => Err(malformed(&format!("no string `{name}`"))),
    }
}

pub(super) fn blob(item: &Item, name: &str) -> Result<Bytes, Error> {
    match item.get(name) {
        Some(AttributeValue::B(blob)) => Ok(Bytes::copy_from_slice(blob.as_ref())),
        _ => Err(malformed(&format!("no binary `{name}`"))),
    }
}

fn fingerprint(item: &Item) -> Result<Option<Fingerprint>, Error> {
    match item.get(FINGERPRINT) {
        None | Some(AttributeValue::Null(_)) => Ok(None),
        Some(AttributeValue::B(blob)) => <[u8; 32]>::try_from(blob.as_ref())
            .map(|bytes| Some(Fingerprint::from_bytes(bytes)))
            .map_err(|_| malformed("a fingerprint that is not 32 bytes")),
        Some(_) => Err(malformed("a fingerprint that is not binary")),
    }
}

/// The steps in an item that have not expired at `now_ms`.
pub(super) fn steps(item: Option<&Item>, now_ms: u64) -> Result<Vec<(Key, Bytes)>, Error> {
    let Some(AttributeValue::M(steps)) = item.and_then(|item| item.get(STEPS)) else {
        return Ok(Vec::new());
    };
    let mut live = Vec::with_capacity(steps.len());
    for (step, entry) in steps {
        let AttributeValue::M(entry) = entry else {
            return Err(malformed("a step that is not a map"));
        };
        if number(entry, "e")? <= now_ms {
            continue;
        }
        let step =
            Key::from_hex(step).ok_or_else(|| malformed("a step key that is not 64 hex digits"))?;
        live.push((step, blob(entry, "v")?));
    }
    Ok(live)
}

/// A step's entry in [`STEPS`].
pub(super) fn step(value: &[u8], expires_at: u64) -> AttributeValue {
    AttributeValue::M(HashMap::from([
        ("v".to_owned(), b(value)),
        ("e".to_owned(), n(expires_at)),
    ]))
}

pub(super) fn n(value: u64) -> AttributeValue {
    AttributeValue::N(value.to_string())
}

pub(super) fn s(value: &str) -> AttributeValue {
    AttributeValue::S(value.to_owned())
}

pub(super) fn b(value: &[u8]) -> AttributeValue {
    AttributeValue::B(Blob::new(value))
}

/// The wall clock in milliseconds since the epoch (0 before it).
pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// `duration` in whole milliseconds, at least 1.
pub(super) fn millis(duration: Duration) -> u64 {
    u64::try_from(crate::limits::clamp(duration).as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

pub(super) fn malformed(what: &str) -> Error {
    Error::store(format!("malformed idem item in DynamoDB: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply of an update that set `lease_ms` to the value it had: AWS leaves open
    /// whether it is in `UPDATED_NEW`, and moto leaves it out.
    #[test]
    fn a_claim_taken_is_read_without_the_lease_from_its_reply() {
        let reply: Item = [(TOKEN, n(7)), (VERSION, n(3))]
            .into_iter()
            .map(|(name, value)| (name.to_owned(), value))
            .collect();
        let held = acquired(&reply, Duration::from_secs(30)).unwrap();
        assert_eq!(held.token, Token::new(7));
        assert_eq!(held.version, 3);
        assert_eq!(held.lease, Duration::from_secs(30));
    }
}
