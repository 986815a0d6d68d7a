//! The records' layout in Redis (see the store's documentation): how an in-progress
//! record is written and read back, and the scripts that act on a record only while it
//! still holds a given claim.

use std::sync::LazyLock;

use bytes::Bytes;
use redis::{Script, Value};

use crate::{Claim, Error, Fingerprint, Token};

/// Bytes before the fingerprint of an in-progress record: state, token, fence, length.
pub(super) const HEAD: usize = 1 + 8 + FENCE_DIGITS + 1;
pub(super) const FENCE_DIGITS: usize = 20;
pub(super) const NO_FENCE: &[u8; FENCE_DIGITS] = b"00000000000000000000";

// In every script, ARGV[1] is the holder's prefix: "p" and its 8-byte token; the
// fingerprint and what follows start at byte 30 (Lua counts from 1).

const COMPLETE_LUA: &str = r"
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 9) ~= ARGV[1] then
    return 0
end
redis.call('SET', KEYS[1], 'c' .. string.sub(record, 30) .. ARGV[2], 'PX', ARGV[3])
return 1
";

pub(super) static COMPLETE: LazyLock<Script> = LazyLock::new(|| Script::new(COMPLETE_LUA));

const RELEASE_LUA: &str = r"
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 9) ~= ARGV[1] then
    return 0
end
redis.call('DEL', KEYS[1])
return 1
";

pub(super) static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_LUA));

const RENEW_LUA: &str = r"
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 9) ~= ARGV[1] then
    return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
";

pub(super) static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW_LUA));

const FENCE_LUA: &str = r"
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 9) ~= ARGV[1] then
    return false
end
local fence = string.sub(record, 10, 29)
if fence == '00000000000000000000' then
    local now = redis.call('TIME')
    fence = string.format('%020.0f', tonumber(now[1]) * 1000000 + tonumber(now[2]))
    redis.call('SET', KEYS[1], ARGV[1] .. fence .. string.sub(record, 30), 'KEEPTTL')
end
return fence
";

pub(super) static FENCE: LazyLock<Script> = LazyLock::new(|| Script::new(FENCE_LUA));

// KEYS[2] is the call's steps: a hash of step key to value, beside the call's record.
const RECORD_STEP_LUA: &str = r"
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 9) ~= ARGV[1] then
    return 0
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return 1
";

/// Records a step while the call's claim holds the key: the check and the write in one
/// script.
pub(super) static RECORD_STEP: LazyLock<Script> = LazyLock::new(|| Script::new(RECORD_STEP_LUA));

const REMOVE_LUA: &str = r"
local removed = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2])
return removed
";

/// Removes a call's record and its steps: whether there was a record.
pub(super) static REMOVE: LazyLock<Script> = LazyLock::new(|| Script::new(REMOVE_LUA));

const LOOKUP_LUA: &str = r"
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 1) ~= 'c' then
    return false
end
return {record, redis.call('PTTL', KEYS[1])}
";

/// A completed record and the milliseconds it has left, read in one step.
pub(super) static LOOKUP: LazyLock<Script> = LazyLock::new(|| Script::new(LOOKUP_LUA));

const LEASE_LEFT_LUA: &str = r"
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 1) ~= 'p' then
    return false
end
return redis.call('PTTL', KEYS[1])
";

/// The milliseconds an in-progress record's lease has left.
pub(super) static LEASE_LEFT: LazyLock<Script> = LazyLock::new(|| Script::new(LEASE_LEFT_LUA));

/// What a record of claim `token` starts with, in progress: `p` and the token.
pub(super) fn holder(token: Token) -> [u8; 9] {
    let mut prefix = [b'p'; 9];
    prefix[1..].copy_from_slice(&token.get().to_be_bytes());
    prefix
}

/// A new in-progress record (on the stack: a claim allocates no record of its own).
pub(super) fn in_progress(token: Token, fingerprint: Option<&Fingerprint>) -> InProgress {
    let fingerprint: &[u8] = fingerprint.map_or(&[], |f| f.as_bytes());
    let mut bytes = [0; HEAD + 32];
    bytes[..9].copy_from_slice(&holder(token));
    bytes[9..HEAD - 1].copy_from_slice(NO_FENCE);
    bytes[HEAD - 1] = u8::try_from(fingerprint.len()).unwrap_or(0);
    let len = HEAD + fingerprint.len();
    bytes[HEAD..len].copy_from_slice(fingerprint);
    InProgress { bytes, len }
}

/// An in-progress record, as [`in_progress`] writes it.
pub(super) struct InProgress {
    bytes: [u8; HEAD + 32],
    len: usize,
}

impl std::ops::Deref for InProgress {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

pub(super) fn unexpected(value: &Value) -> Error {
    Error::store(format!("unexpected reply from redis: {value:?}"))
}

pub(super) fn malformed(what: &str) -> Error {
    Error::store(format!("a malformed idem record in redis: {what}"))
}

/// The fingerprint that starts `rest` (its length byte first), and what follows it.
pub(super) fn split_fingerprint(rest: &[u8]) -> Result<(Option<Fingerprint>, usize), Error> {
    match rest.first() {
        Some(0) => Ok((None, 1)),
        Some(32) => {
            let raw: [u8; 32] = rest
                .get(1..33)
                .and_then(|raw| raw.try_into().ok())
                .ok_or_else(|| malformed("a truncated fingerprint"))?;
            Ok((Some(Fingerprint::from_bytes(raw)), 33))
        }
        Some(n) => Err(malformed(&format!("a fingerprint of {n} bytes"))),
        None => Err(malformed("no fingerprint length")),
    }
}

/// What a claim found: nothing (the claim is ours) or the record that was there.
pub(super) fn parse_claim(reply: Value, token: Token) -> Result<Claim, Error> {
    let record = match reply {
        Value::Nil => return Ok(Claim::Acquired { token }),
        Value::BulkString(record) => record,
        other => return Err(unexpected(&other)),
    };
    match record.first() {
        Some(b'p') if record.get(..9) == Some(&holder(token)[..]) => Ok(Claim::Acquired { token }),
        Some(b'p') => {
            let rest = record
                .get(HEAD - 1..)
                .ok_or_else(|| malformed("a short claim"))?;
            let (fingerprint, _) = split_fingerprint(rest)?;
            Ok(Claim::InProgress { fingerprint })
        }
        Some(b'c') => {
            let (fingerprint, used) = split_fingerprint(&record[1..])?;
            // The value is the rest of the record: sliced, not copied.
            let value = Bytes::from(record).slice(1 + used..);
            Ok(Claim::Completed { value, fingerprint })
        }
        _ => Err(malformed("an unknown state")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scripts_read_the_layout_the_client_writes() {
        // Lua counts from 1: the holder's prefix is bytes 1–9, the fence 10–29, and the
        // fingerprint's length byte starts the rest, at 30.
        let record = in_progress(Token::new(0x0102_0304_0506_0708), None);
        assert_eq!(record.len(), HEAD);
        assert_eq!(record[..9], holder(Token::new(0x0102_0304_0506_0708)));
        assert_eq!(&record[9..HEAD - 1], NO_FENCE);
        for source in [
            COMPLETE_LUA,
            RELEASE_LUA,
            RENEW_LUA,
            FENCE_LUA,
            RECORD_STEP_LUA,
        ] {
            assert!(
                source.contains("string.sub(record, 1, 9) ~= ARGV[1]"),
                "{source}"
            );
        }
        for source in [COMPLETE_LUA, FENCE_LUA] {
            assert!(
                source.contains(&format!("string.sub(record, {})", HEAD)),
                "{source}"
            );
        }
        assert!(FENCE_LUA.contains(&format!("string.sub(record, 10, {})", HEAD - 1)));
        assert!(FENCE_LUA.contains(&String::from_utf8_lossy(NO_FENCE).into_owned()));
    }
}
