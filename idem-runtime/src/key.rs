//! Deterministic keys and fingerprints.
//!
//! A [`Key`] is `sha256` over a canonical encoding of (format version, namespace, key value);
//! a [`Fingerprint`] is `sha256` over the same encoding of the payload, in its own domain.
//! The encoding is driven by `serde::Serialize` and streamed straight into the hasher, so a
//! key without maps derives without a heap allocation.
//!
//! # The encoding (format version 1)
//!
//! Every value starts with a one-byte tag and is self-delimiting, so the concatenation of
//! several values is unambiguous (`("ab", "c")` and `("a", "bc")` differ). Numbers and
//! lengths are unsigned LEB128 (7 bits a byte, the high bit on all bytes but the last), so a
//! typical key fits one sha256 block. The whole is prefixed with `K` and [`FORMAT_VERSION`]
//! (a fingerprint: `P` and the version), and a key's namespace follows as a string.
//!
//! | value | bytes |
//! |---|---|
//! | unsigned integer, or signed ≥ 0 | `U` + LEB128 of the value |
//! | negative integer `v` | `I` + LEB128 of `-(v + 1)` |
//! | float (`f32` widened to `f64`; `-0.0` as `0.0`; NaN is an error) | `F` + 8 bytes of bits, little-endian |
//! | `bool` | `B` + `0`/`1` |
//! | string, `char` | `s` + LEB128 length + UTF-8 |
//! | bytes | `b` + LEB128 length + bytes |
//! | `()`, unit struct | `0` |
//! | `None` / `Some(v)` | `N` / `S` + v |
//! | sequence, tuple, tuple struct | `[` + items + `]` |
//! | struct | `{` + (name, value)… + `}` |
//! | map | `M` + LEB128 count + the sorted sha256 of each encoded (key, value) entry |
//! | enum variant | `V` / `W` / `T` / `R` (unit, newtype, tuple, struct) + name + content |
//!
//! Integers are encoded by value, not by type, so widening `order.id` from `u32` to `u64`
//! keeps every key. Newtype structs are transparent. Struct and variant *names* of types are
//! not part of the key (renaming a type keeps its keys); field and variant names are.

mod encoder;

use std::fmt;

use serde::Serialize;

use crate::Error;

/// The version of the key encoding. Part of every key, so a future format can never collide
/// with this one.
pub const FORMAT_VERSION: u8 = 1;

/// The 32-byte identity of one logical operation in a store.
///
/// ```
/// use idem_runtime::Key;
///
/// let a = Key::derive("billing.charge.v1", &(42_u64, "cus_7"))?;
/// let b = Key::derive("billing.charge.v1", &(42_u32, String::from("cus_7")))?;
/// assert_eq!(a, b); // integers by value, strings by content
/// assert_ne!(a, Key::derive("billing.refund.v1", &(42_u64, "cus_7"))?);
/// # Ok::<(), idem_runtime::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key([u8; 32]);

impl Key {
    /// Derives the key of `value` in `namespace`.
    ///
    /// # Errors
    ///
    /// [`Error::Key`] when `value` cannot be encoded deterministically: a NaN float, or a
    /// `Serialize` implementation that reports an error.
    pub fn derive<V: Serialize + ?Sized>(namespace: &str, value: &V) -> Result<Self, Error> {
        let mut sink = encoder::Sink::new();
        sink.write(&[b'K', FORMAT_VERSION]);
        encoder::write_str(&mut sink, namespace);
        encoder::encode(&mut sink, value)?;
        Ok(Self(sink.finish()))
    }

    /// Wraps 32 raw bytes, for stores that read keys back.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw 32 bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The key of 64 hex digits, as [`to_hex`](Self::to_hex) wrote it: the one parser of
    /// a key's digits (an operator's, a store's notification).
    #[cfg(any(feature = "postgres", feature = "admin", feature = "dynamodb"))]
    pub(crate) fn from_hex(text: impl AsRef<[u8]>) -> Option<Self> {
        let mut bytes = [0_u8; 32];
        hex::decode_to_slice(text, &mut bytes).ok()?;
        Some(Self(bytes))
    }

    /// The key as 64 lowercase hex digits, the form network stores use in their own keys.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The first 12 hex digits: enough to correlate log lines, never the raw key value.
    pub fn short(&self) -> impl fmt::Display + '_ {
        Short(&self.0[..6])
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.short())
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Short(&self.0), f)
    }
}

/// A digest of a request payload, stored beside the key and compared on every path that
/// finds an existing record.
///
/// ```
/// use idem_runtime::Fingerprint;
///
/// let a = Fingerprint::of(&("4242", 1999_u32))?;
/// assert_eq!(a, Fingerprint::of(&("4242", 1999_u64))?);
/// assert_ne!(a, Fingerprint::of(&("4242", 2000_u32))?);
/// # Ok::<(), idem_runtime::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Computes the fingerprint of `payload`, with the key encoding in its own domain.
    ///
    /// # Errors
    ///
    /// [`Error::Key`] when `payload` cannot be encoded deterministically.
    pub fn of<V: Serialize + ?Sized>(payload: &V) -> Result<Self, Error> {
        let mut sink = encoder::Sink::new();
        sink.write(&[b'P', FORMAT_VERSION]);
        encoder::encode(&mut sink, payload)?;
        Ok(Self(sink.finish()))
    }

    /// Wraps 32 raw bytes, for stores that read fingerprints back.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw 32 bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", Short(&self.0[..6]))
    }
}

/// Hashes a [`Key`] for in-memory maps by taking 8 of its bytes: a key is a sha256 digest
/// already, so its bytes are uniformly distributed and hashing them again is wasted work.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // `Key` hashes as one write of its 32 bytes (after the length, which is constant).
        for chunk in bytes.chunks(8) {
            let mut word = [0_u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(5) ^ u64::from_le_bytes(word);
        }
    }

    fn write_usize(&mut self, _length: usize) {}
}

impl std::hash::BuildHasher for KeyHasher {
    type Hasher = Self;

    fn build_hasher(&self) -> Self {
        Self(0)
    }
}

struct Short<'a>(&'a [u8]);

impl fmt::Display for Short<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}
