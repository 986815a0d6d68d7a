//! The canonical encoding of key values, as a `serde::Serializer` that writes into a hasher.
//!
//! The table of tags is in the parent module's documentation; every tag below refers to it.

use std::fmt;

use serde::ser::{self, Serialize};
use sha2::{Digest, Sha256};

use crate::Error;

/// Gathers the encoding on the stack and hashes it at the end, in one call: a typical key
/// never starts a hasher before it is complete. A longer encoding is hashed in buffer-sized
/// pieces as it grows.
pub(super) struct Sink {
    /// Started only once the encoding outgrows the buffer.
    hasher: Option<Sha256>,
    buffer: [u8; 128],
    len: usize,
}

impl Sink {
    #[inline]
    pub(super) fn new() -> Self {
        Self {
            hasher: None,
            buffer: [0; 128],
            len: 0,
        }
    }

    #[inline]
    pub(super) fn write(&mut self, bytes: &[u8]) {
        let end = self.len + bytes.len();
        match self.buffer.get_mut(self.len..end) {
            Some(room) => {
                copy_short(room, bytes);
                self.len = end;
            }
            None => self.spill(bytes),
        }
    }

    /// `bytes` do not fit beside what is gathered: hash that, then gather them, or hash them
    /// too when they would not fit on their own.
    #[cold]
    fn spill(&mut self, bytes: &[u8]) {
        self.flush();
        match self.buffer.get_mut(..bytes.len()) {
            Some(room) => {
                room.copy_from_slice(bytes);
                self.len = bytes.len();
            }
            None => self.hasher.get_or_insert_with(Sha256::new).update(bytes),
        }
    }

    #[inline]
    fn byte(&mut self, byte: u8) {
        if self.len == self.buffer.len() {
            self.flush();
        }
        self.buffer[self.len] = byte;
        self.len += 1;
    }

    /// An unsigned LEB128 number: 7 bits a byte, the high bit set on all but the last.
    fn leb128(&mut self, n: u128) {
        match u64::try_from(n) {
            Ok(small) => self.leb128_u64(small),
            Err(_) => self.leb128_u128(n),
        }
    }

    /// The common case, in 64-bit arithmetic: a number under 128 is one byte, a larger one
    /// is gathered on the stack and written at once.
    #[inline]
    fn leb128_u64(&mut self, mut n: u64) {
        if n < 0x80 {
            return self.byte(n as u8);
        }
        let mut bytes = [0_u8; 10];
        let mut len = 0;
        while n >= 0x80 {
            bytes[len] = (n as u8) | 0x80;
            n >>= 7;
            len += 1;
        }
        bytes[len] = n as u8;
        self.write(&bytes[..=len]);
    }

    fn leb128_u128(&mut self, mut n: u128) {
        loop {
            let low = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                return self.byte(low);
            }
            self.byte(low | 0x80);
        }
    }

    fn flush(&mut self) {
        let gathered = &self.buffer[..self.len];
        self.hasher.get_or_insert_with(Sha256::new).update(gathered);
        self.len = 0;
    }

    #[inline]
    pub(super) fn finish(self) -> [u8; 32] {
        let gathered = &self.buffer[..self.len];
        match self.hasher {
            None => Sha256::digest(gathered).into(),
            Some(mut hasher) => {
                hasher.update(gathered);
                hasher.finalize().into()
            }
        }
    }
}

/// `room.copy_from_slice(bytes)` (of the same length) without a call to `memcpy` for up to
/// 16 bytes, the length of most names and identifiers in a key: two overlapping copies of a
/// fixed size each, which compile to moves (a call was a tenth of a key's derivation).
#[inline]
fn copy_short(room: &mut [u8], bytes: &[u8]) {
    let n = bytes.len();
    debug_assert_eq!(room.len(), n);
    match n {
        0 => {}
        1..=3 => {
            room[0] = bytes[0];
            room[n / 2] = bytes[n / 2];
            room[n - 1] = bytes[n - 1];
        }
        4..=7 => {
            copy_fixed::<4>(&mut room[..4], &bytes[..4]);
            copy_fixed::<4>(&mut room[n - 4..], &bytes[n - 4..]);
        }
        8..=16 => {
            copy_fixed::<8>(&mut room[..8], &bytes[..8]);
            copy_fixed::<8>(&mut room[n - 8..], &bytes[n - 8..]);
        }
        _ => room.copy_from_slice(bytes),
    }
}

/// Copies `N` bytes: both slices are `N` long.
#[inline(always)]
fn copy_fixed<const N: usize>(room: &mut [u8], bytes: &[u8]) {
    let bytes: [u8; N] = bytes.try_into().expect("N bytes");
    room.copy_from_slice(&bytes);
}

/// Encodes `value` into `sink`.
#[inline]
pub(super) fn encode<V: Serialize + ?Sized>(sink: &mut Sink, value: &V) -> Result<(), Error> {
    value
        .serialize(Encoder { out: sink })
        .map_err(|e| Error::Key(Box::new(e)))
}

/// Writes a length-prefixed string (tag `s`).
#[inline]
pub(super) fn write_str(out: &mut Sink, s: &str) {
    write_bytes(out, b's', s.as_bytes());
}

#[inline]
fn write_bytes(out: &mut Sink, tag: u8, bytes: &[u8]) {
    out.byte(tag);
    out.leb128_u64(bytes.len() as u64);
    out.write(bytes);
}

/// `U` + LEB128 of a non-negative integer: every integer type up to 64 bits takes this path,
/// in 64-bit arithmetic, and writes the same bytes as [`write_int`].
#[inline]
fn write_u64(out: &mut Sink, v: u64) {
    out.byte(b'U');
    out.leb128_u64(v);
}

/// [`write_int`] for a signed integer of up to 64 bits.
#[inline]
fn write_i64(out: &mut Sink, v: i64) {
    if v < 0 {
        out.byte(b'I');
        out.leb128_u64(!v as u64);
    } else {
        write_u64(out, v as u64);
    }
}

/// `U` + LEB128 of a non-negative integer; `I` + LEB128 of `-(v + 1)` for a negative one.
fn write_int(out: &mut Sink, v: i128) {
    if v < 0 {
        out.byte(b'I');
        out.leb128(!v as u128);
    } else {
        out.byte(b'U');
        out.leb128(v as u128);
    }
}

/// Why a key value could not be encoded.
#[derive(Debug)]
pub(crate) struct KeyError(String);

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KeyError {}

impl ser::Error for KeyError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self(msg.to_string())
    }
}

struct Encoder<'h> {
    out: &'h mut Sink,
}

impl Encoder<'_> {
    #[inline]
    fn reborrow(&mut self) -> Encoder<'_> {
        Encoder { out: self.out }
    }

    #[inline]
    fn tag(&mut self, tag: u8) {
        self.out.byte(tag);
    }

    #[inline]
    fn variant(&mut self, tag: u8, name: &str) {
        self.tag(tag);
        write_str(self.out, name);
    }
}

type Result<T = (), E = KeyError> = std::result::Result<T, E>;

impl<'h> ser::Serializer for Encoder<'h> {
    type Ok = ();
    type Error = KeyError;
    type SerializeSeq = Self;
    type SerializeTuple = Self;
    type SerializeTupleStruct = Self;
    type SerializeTupleVariant = Self;
    type SerializeMap = MapEncoder<'h>;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    #[inline]
    fn serialize_bool(mut self, v: bool) -> Result {
        self.tag(b'B');
        self.tag(u8::from(v));
        Ok(())
    }

    #[inline]
    fn serialize_i8(self, v: i8) -> Result {
        write_i64(self.out, v.into());
        Ok(())
    }

    #[inline]
    fn serialize_i16(self, v: i16) -> Result {
        write_i64(self.out, v.into());
        Ok(())
    }

    #[inline]
    fn serialize_i32(self, v: i32) -> Result {
        write_i64(self.out, v.into());
        Ok(())
    }

    #[inline]
    fn serialize_i64(self, v: i64) -> Result {
        write_i64(self.out, v);
        Ok(())
    }

    #[inline]
    fn serialize_i128(self, v: i128) -> Result {
        write_int(self.out, v);
        Ok(())
    }

    #[inline]
    fn serialize_u8(self, v: u8) -> Result {
        write_u64(self.out, v.into());
        Ok(())
    }

    #[inline]
    fn serialize_u16(self, v: u16) -> Result {
        write_u64(self.out, v.into());
        Ok(())
    }

    #[inline]
    fn serialize_u32(self, v: u32) -> Result {
        write_u64(self.out, v.into());
        Ok(())
    }

    #[inline]
    fn serialize_u64(self, v: u64) -> Result {
        write_u64(self.out, v);
        Ok(())
    }

    #[inline]
    fn serialize_u128(mut self, v: u128) -> Result {
        // The same form as every other non-negative integer, for values above i128::MAX too.
        self.tag(b'U');
        self.out.leb128(v);
        Ok(())
    }

    #[inline]
    fn serialize_f32(self, v: f32) -> Result {
        self.serialize_f64(v.into())
    }

    #[inline]
    fn serialize_f64(mut self, v: f64) -> Result {
        if v.is_nan() {
            return Err(KeyError(
                "NaN has no stable encoding; use a finite float or an integer".into(),
            ));
        }
        // -0.0 == 0.0, so they must give the same key.
        let v = if v == 0.0 { 0.0 } else { v };
        self.tag(b'F');
        self.out.write(&v.to_bits().to_le_bytes());
        Ok(())
    }

    #[inline]
    fn serialize_char(self, v: char) -> Result {
        self.serialize_str(v.encode_utf8(&mut [0; 4]))
    }

    #[inline]
    fn serialize_str(self, v: &str) -> Result {
        write_str(self.out, v);
        Ok(())
    }

    #[inline]
    fn serialize_bytes(self, v: &[u8]) -> Result {
        write_bytes(self.out, b'b', v);
        Ok(())
    }

    #[inline]
    fn serialize_none(mut self) -> Result {
        self.tag(b'N');
        Ok(())
    }

    #[inline]
    fn serialize_some<T: Serialize + ?Sized>(mut self, value: &T) -> Result {
        self.tag(b'S');
        value.serialize(self)
    }

    #[inline]
    fn serialize_unit(mut self) -> Result {
        self.tag(b'0');
        Ok(())
    }

    #[inline]
    fn serialize_unit_struct(self, _name: &'static str) -> Result {
        self.serialize_unit()
    }

    #[inline]
    fn serialize_unit_variant(mut self, _: &'static str, _: u32, variant: &'static str) -> Result {
        self.variant(b'V', variant);
        Ok(())
    }

    #[inline]
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, value: &T) -> Result {
        value.serialize(self)
    }

    #[inline]
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        mut self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result {
        self.variant(b'W', variant);
        value.serialize(self)
    }

    #[inline]
    fn serialize_seq(mut self, _len: Option<usize>) -> Result<Self> {
        self.tag(b'[');
        Ok(self)
    }

    #[inline]
    fn serialize_tuple(self, len: usize) -> Result<Self> {
        self.serialize_seq(Some(len))
    }

    #[inline]
    fn serialize_tuple_struct(self, _: &'static str, len: usize) -> Result<Self> {
        self.serialize_seq(Some(len))
    }

    #[inline]
    fn serialize_tuple_variant(
        mut self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Self> {
        self.variant(b'T', variant);
        self.tag(b'[');
        Ok(self)
    }

    #[inline]
    fn serialize_map(self, len: Option<usize>) -> Result<MapEncoder<'h>> {
        Ok(MapEncoder {
            out: self.out,
            entries: Vec::with_capacity(len.unwrap_or(0)),
            current: None,
        })
    }

    #[inline]
    fn serialize_struct(mut self, _: &'static str, _len: usize) -> Result<Self> {
        self.tag(b'{');
        Ok(self)
    }

    #[inline]
    fn serialize_struct_variant(
        mut self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Self> {
        self.variant(b'R', variant);
        self.tag(b'{');
        Ok(self)
    }
}

impl ser::SerializeSeq for Encoder<'_> {
    type Ok = ();
    type Error = KeyError;

    #[inline]
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result {
        value.serialize(self.reborrow())
    }

    #[inline]
    fn end(mut self) -> Result {
        self.tag(b']');
        Ok(())
    }
}

impl ser::SerializeTuple for Encoder<'_> {
    type Ok = ();
    type Error = KeyError;

    #[inline]
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result {
        ser::SerializeSeq::serialize_element(self, value)
    }

    #[inline]
    fn end(self) -> Result {
        ser::SerializeSeq::end(self)
    }
}

impl ser::SerializeTupleStruct for Encoder<'_> {
    type Ok = ();
    type Error = KeyError;

    #[inline]
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result {
        ser::SerializeSeq::serialize_element(self, value)
    }

    #[inline]
    fn end(self) -> Result {
        ser::SerializeSeq::end(self)
    }
}

impl ser::SerializeTupleVariant for Encoder<'_> {
    type Ok = ();
    type Error = KeyError;

    #[inline]
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result {
        ser::SerializeSeq::serialize_element(self, value)
    }

    #[inline]
    fn end(self) -> Result {
        ser::SerializeSeq::end(self)
    }
}

impl ser::SerializeStruct for Encoder<'_> {
    type Ok = ();
    type Error = KeyError;

    #[inline]
    fn serialize_field<T: Serialize + ?Sized>(&mut self, name: &'static str, value: &T) -> Result {
        write_str(self.out, name);
        value.serialize(self.reborrow())
    }

    #[inline]
    fn end(mut self) -> Result {
        self.tag(b'}');
        Ok(())
    }
}

impl ser::SerializeStructVariant for Encoder<'_> {
    type Ok = ();
    type Error = KeyError;

    #[inline]
    fn serialize_field<T: Serialize + ?Sized>(&mut self, name: &'static str, value: &T) -> Result {
        ser::SerializeStruct::serialize_field(self, name, value)
    }

    #[inline]
    fn end(self) -> Result {
        ser::SerializeStruct::end(self)
    }
}

/// Encodes a map independently of its iteration order: each entry is hashed on its own, and
/// the entry digests are written sorted. The only place the encoder allocates.
pub(crate) struct MapEncoder<'h> {
    out: &'h mut Sink,
    entries: Vec<[u8; 32]>,
    current: Option<Sink>,
}

impl ser::SerializeMap for MapEncoder<'_> {
    type Ok = ();
    type Error = KeyError;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result {
        let entry = self.current.insert(Sink::new());
        key.serialize(Encoder { out: entry })
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result {
        let mut entry = self
            .current
            .take()
            .ok_or_else(|| KeyError("map value serialized before its key".into()))?;
        value.serialize(Encoder { out: &mut entry })?;
        self.entries.push(entry.finish());
        Ok(())
    }

    fn end(mut self) -> Result {
        self.entries.sort_unstable();
        self.out.byte(b'M');
        self.out.leb128_u64(self.entries.len() as u64);
        for entry in &self.entries {
            self.out.write(entry);
        }
        Ok(())
    }
}
