//! The records' layout in Redis (see the store's documentation): how an in-progress
//! record is written and read back, and the scripts that act on a record only while it
//! still holds a given claim.

use std::sync::LazyLock;

use std::io::Write as _;
use std::time::Duration;

use bytes::Bytes;
use redis::{RedisWrite, Script, ToRedisArgs, Value};

use crate::store::{Claimant, Holder};
use crate::{Claim, Error, Fingerprint, Token};

/// Bytes before the fingerprint of an in-progress record: state, token, fence, length.
pub(super) const HEAD: usize = 1 + 8 + FENCE_DIGITS + 1;
pub(super) const FENCE_DIGITS: usize = 20;
pub(super) const NO_FENCE: &[u8; FENCE_DIGITS] = b"00000000000000000000";

// In every script, ARGV[1] is the holder's prefix: "p" and its 8-byte token; the
// fingerprint and what follows start at byte 30 (Lua counts from 1).

// KEYS[1] a record, KEYS[2] the trace of its claim while unsettled; ARGV[1] the claim,
// ARGV[2] its lease, ARGV[3] how long the trace lives once the lease ran out (the call's
// TTL), ARGV[4] the two together (milliseconds). The native `SET … NX GET` writes the
// claim if the key is free and answers the record that is there otherwise. A claim that
// took the key writes its trace, `T` or `F` and the TTL: whether a trace was there (a
// trace outlives its claim only when the claim lapsed, or an operator released it,
// unsettled), which it answers (1 or 0); the trace is written `F` with `GET`, and again
// `T` only on a takeover, so that a first claim is one write. The caller's own claim, found again after its
// answer was lost, answers with the record what its trace says.
const CLAIM_LUA: &str = r"
local found = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'GET', 'PX', ARGV[2])
if found then
    if string.sub(found, 1, 9) == string.sub(ARGV[1], 1, 9) then
        local trace = redis.call('GET', KEYS[2])
        if trace and string.sub(trace, 1, 1) == 'T' then
            return {found, 1}
        end
        return {found, 0}
    end
    return found
end
local taken = redis.call('SET', KEYS[2], 'F' .. ARGV[3], 'PX', ARGV[4], 'GET')
if taken then
    redis.call('SET', KEYS[2], 'T' .. ARGV[3], 'PX', ARGV[4])
    return 1
end
return 0
";

/// The claim: the record that is there, or the key taken and whether it was taken over.
pub(super) static CLAIM: LazyLock<Script> = LazyLock::new(|| Script::new(CLAIM_LUA));

// KEYS[2] is the call's `about`: what its claim said of itself (after the fingerprint),
// kept beside the completed record with the same expiry, so that the record stays as every
// version reads it. KEYS[3] is the trace of the claim, which a settled claim deletes.
const COMPLETE_LUA: &str = r"
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 9) ~= ARGV[1] then
    return 0
end
local n = string.byte(record, 30)
redis.call('SET', KEYS[1], 'c' .. string.sub(record, 30, 30 + n) .. ARGV[2], 'PX', ARGV[3])
local about = string.sub(record, 31 + n)
if #about > 0 then
    redis.call('SET', KEYS[2], about, 'PX', ARGV[3])
end
redis.call('DEL', KEYS[3])
return 1
";

pub(super) static COMPLETE: LazyLock<Script> = LazyLock::new(|| Script::new(COMPLETE_LUA));

// KEYS[2] is the trace of the claim, which a settled claim deletes.
const RELEASE_LUA: &str = r"
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 9) ~= ARGV[1] then
    return 0
end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
";

pub(super) static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_LUA));

// KEYS[2] is the trace of the claim: it lives the call's TTL (after its first byte) past
// the lease.
const RENEW_LUA: &str = r"
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 9) ~= ARGV[1] then
    return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local trace = redis.call('GET', KEYS[2])
if trace then
    redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2]) + tonumber(string.sub(trace, 2)))
end
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
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
return removed
";

/// Removes a call's record, its steps, its `about` and the trace of its claim: whether
/// there was a record.
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

/// A new in-progress record (on the stack: a claim allocates no record of its own): the
/// head and fingerprint, then what the claim says of itself ([`About`]), written straight
/// into the command.
pub(super) fn in_progress<'a>(
    token: Token,
    fingerprint: Option<&Fingerprint>,
    lease_ms: u64,
    claimant: &'a Claimant<'a>,
) -> InProgress<'a> {
    let fingerprint: &[u8] = fingerprint.map_or(&[], |f| f.as_bytes());
    let mut bytes = [0; HEAD + 32];
    bytes[..9].copy_from_slice(&holder(token));
    bytes[9..HEAD - 1].copy_from_slice(NO_FENCE);
    bytes[HEAD - 1] = u8::try_from(fingerprint.len()).unwrap_or(0);
    let len = HEAD + fingerprint.len();
    bytes[HEAD..len].copy_from_slice(fingerprint);
    InProgress {
        bytes,
        len,
        lease_ms,
        claimant,
    }
}

/// An in-progress record, as [`in_progress`] writes it.
pub(super) struct InProgress<'a> {
    bytes: [u8; HEAD + 32],
    len: usize,
    lease_ms: u64,
    claimant: &'a Claimant<'a>,
}

impl InProgress<'_> {
    /// The namespace, the label and the holder, as written (each `None` beyond
    /// [`About::LONGEST`]).
    fn names(&self) -> [Option<&[u8]>; 3] {
        [
            self.claimant.namespace(),
            self.claimant.label(),
            Some(Holder::this_process_text()),
        ]
        .map(|name| {
            name.map(str::as_bytes)
                .filter(|name| name.len() <= About::LONGEST)
        })
    }
}

impl ToRedisArgs for InProgress<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut arg = out.writer_for_next_arg();
        // Writes into the command's own buffer: they cannot fail.
        let _ = arg.write_all(&self.bytes[..self.len]);
        let _ = arg.write_all(&[About::VERSION]);
        let _ = arg.write_all(&self.lease_ms.to_be_bytes());
        for name in self.names() {
            // At most `LONGEST` bytes: the length fits two bytes.
            let len = name.map_or(About::NONE, |name| name.len() as u16);
            let _ = arg.write_all(&len.to_be_bytes());
            let _ = arg.write_all(name.unwrap_or_default());
        }
    }
}

/// What a claim says of itself, after its fingerprint (its claimant): a version byte, the
/// lease in milliseconds (8 bytes), then the namespace, the label and the holder, each a
/// 2-byte length and its UTF-8 (`0xFFFF`: none). A completed record keeps it (tagged `d`);
/// records an earlier version wrote have none and list as namespace unknown.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct About {
    pub(super) lease: Option<Duration>,
    pub(super) namespace: Option<String>,
    pub(super) label: Option<String>,
    pub(super) holder: Option<Holder>,
}

impl About {
    const VERSION: u8 = 1;
    const NONE: u16 = u16::MAX;
    /// The longest name kept: a longer one is written as none.
    const LONGEST: usize = 4096;

    /// Reads what [`InProgress`] wrote: anything else (an unknown version, a short or
    /// malformed text) says nothing.
    pub(super) fn read(bytes: &[u8]) -> Self {
        Self::parse(bytes).unwrap_or_default()
    }

    /// What the in-progress `record` says of its claim.
    pub(super) fn of_claim(record: &[u8]) -> Self {
        let n = usize::from(record.get(HEAD - 1).copied().unwrap_or(0));
        Self::read(record.get(HEAD + n..).unwrap_or_default())
    }

    fn parse(bytes: &[u8]) -> Option<Self> {
        let (&version, rest) = bytes.split_first()?;
        if version != Self::VERSION {
            return None;
        }
        let lease = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
        let mut rest = &rest[8..];
        let mut names = [None, None, None];
        for name in &mut names {
            let len = u16::from_be_bytes(rest.get(..2)?.try_into().ok()?);
            rest = &rest[2..];
            if len != Self::NONE {
                let len = usize::from(len);
                *name = Some(String::from_utf8(rest.get(..len)?.to_vec()).ok()?);
                rest = &rest[len..];
            }
        }
        let [namespace, label, holder] = names;
        Some(Self {
            lease: Some(Duration::from_millis(lease)),
            namespace,
            label,
            holder: holder.as_deref().and_then(Holder::decode),
        })
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

// KEYS[1] a record, KEYS[2] its `about`; ARGV[1] "1" for the whole record, else its head
// (all of a claim; a completed record without its value). Answers the bytes, the
// milliseconds it has left, its whole length, and a completed record's `about` (or false).
pub(super) const INSPECT_LUA: &str = r"
local record = redis.call('GET', KEYS[1])
if not record then
    return false
end
local left = redis.call('PTTL', KEYS[1])
local head = record
local about = false
if string.sub(record, 1, 1) == 'c' then
    if ARGV[1] ~= '1' then
        head = string.sub(record, 1, 2 + string.byte(record, 2))
    end
    about = redis.call('GET', KEYS[2])
end
return {head, left, #record, about}
";

/// A record's head (or all of it), the milliseconds it has left, its length and what a
/// completed record's claim said of itself.
pub(super) static INSPECT: LazyLock<Script> = LazyLock::new(|| Script::new(INSPECT_LUA));

/// A record as [`INSPECT`] reads it.
pub(super) struct Head {
    pub(super) bytes: Vec<u8>,
    pub(super) left: Option<Duration>,
    #[cfg_attr(not(feature = "admin"), allow(dead_code))]
    pub(super) length: u64,
    /// What the claim said of itself: in a claim's record, after its fingerprint; beside a
    /// completed record, in its `about`.
    pub(super) about: About,
}

/// A record from [`INSPECT`]'s reply: `None` for no record.
pub(super) fn head(reply: Value) -> Result<Option<Head>, Error> {
    let parts = match reply {
        Value::Nil => return Ok(None),
        Value::Array(parts) if parts.len() == 4 => parts,
        other => return Err(unexpected(&other)),
    };
    let mut parts = parts.into_iter();
    let (Some(Value::BulkString(bytes)), Some(Value::Int(left)), Some(Value::Int(length))) =
        (parts.next(), parts.next(), parts.next())
    else {
        return Err(malformed("an inspection"));
    };
    let about = match parts.next() {
        Some(Value::BulkString(about)) => About::read(&about),
        _ if bytes.first() == Some(&b'p') => About::of_claim(&bytes),
        _ => About::default(),
    };
    Ok(Some(Head {
        bytes,
        // -1: no expiry (a record written by hand); -2: gone meanwhile.
        left: u64::try_from(left).ok().map(Duration::from_millis),
        length: u64::try_from(length).unwrap_or(0),
        about,
    }))
}

/// What a claim found: the key taken (and whether it was taken over from an unsettled
/// claim), or the record that was there.
pub(super) fn parse_claim(reply: Value, token: Token) -> Result<Claim, Error> {
    let record = match reply {
        Value::Nil => return Ok(Claim::acquired(token)),
        Value::Int(taken_over) => {
            return Ok(Claim::Acquired {
                token,
                taken_over: taken_over == 1,
            })
        }
        // The caller's own claim, whose answer was lost, and what its trace says.
        Value::Array(mut own) if own.len() == 2 => {
            return match (own.pop(), own.pop()) {
                (Some(Value::Int(taken_over)), Some(Value::BulkString(record)))
                    if record.get(..9) == Some(&holder(token)[..]) =>
                {
                    Ok(Claim::Acquired {
                        token,
                        taken_over: taken_over == 1,
                    })
                }
                _ => Err(malformed("an own claim's answer")),
            };
        }
        Value::BulkString(record) => record,
        other => return Err(unexpected(&other)),
    };
    match record.first() {
        // This caller's own claim (from a script of an earlier version).
        Some(b'p') if record.get(..9) == Some(&holder(token)[..]) => Ok(Claim::acquired(token)),
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

    /// The record a claim of `claimant` writes.
    fn written(
        token: Token,
        fingerprint: Option<&Fingerprint>,
        claimant: &Claimant<'_>,
    ) -> Vec<u8> {
        let record = in_progress(token, fingerprint, 60_000, claimant);
        let mut args = record.to_redis_args();
        assert_eq!(args.len(), 1, "one argument");
        args.pop().unwrap()
    }

    #[test]
    fn the_scripts_read_the_layout_the_client_writes() {
        // Lua counts from 1: the holder's prefix is bytes 1–9, the fence 10–29, and the
        // fingerprint's length byte starts the rest, at 30.
        let token = Token::new(0x0102_0304_0506_0708);
        let record = written(token, None, &Claimant::new("billing.charge"));
        assert_eq!(record[..9], holder(token));
        assert_eq!(&record[9..HEAD - 1], NO_FENCE);
        assert_eq!(record[HEAD - 1], 0, "no fingerprint");
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
        assert!(FENCE_LUA.contains(&format!("string.sub(record, {})", HEAD)));
        assert!(COMPLETE_LUA.contains(&format!("string.byte(record, {})", HEAD)));
        // A completed record is `c`, the fingerprint (its length first) and the value: the
        // claim's own words go to its `about`.
        assert!(COMPLETE_LUA.contains(&format!(
            "'c' .. string.sub(record, {HEAD}, {HEAD} + n) .. ARGV[2]"
        )));
        assert!(COMPLETE_LUA.contains(&format!("string.sub(record, {} + n)", HEAD + 1)));
        assert!(FENCE_LUA.contains(&format!("string.sub(record, 10, {})", HEAD - 1)));
        assert!(FENCE_LUA.contains(&String::from_utf8_lossy(NO_FENCE).into_owned()));
    }

    #[test]
    fn a_claim_says_whose_it_is() {
        let fingerprint = Fingerprint::of(&7_u32).unwrap();
        let claimant = Claimant::new("billing.charge").labelled("order 7");
        let record = written(Token::new(9), Some(&fingerprint), &claimant);
        let about = About::read(&record[HEAD + 32..]);
        assert_eq!(about.lease, Some(Duration::from_secs(60)));
        assert_eq!(about.namespace.as_deref(), Some("billing.charge"));
        assert_eq!(about.label.as_deref(), Some("order 7"));
        assert_eq!(about.holder.as_ref(), Some(Holder::this_process()));

        // An unnamed claim keeps its lease and holder; a name too long is kept as none.
        let long = "n".repeat(5_000);
        let record = written(Token::new(9), None, &Claimant::new(&long));
        let about = About::read(&record[HEAD..]);
        assert_eq!(about.namespace, None);
        assert_eq!(about.holder.as_ref(), Some(Holder::this_process()));
        assert_eq!(
            About::read(b""),
            About::default(),
            "an earlier record says nothing"
        );
    }
}
