//! The small part of msgpack that records and payloads use: arrays, unsigned
//! integers, booleans, strings and `bin`, written in the shortest form (as
//! Python's `msgspec.msgpack.encode` writes them) and read strictly.
//!
//! The reader is driven by the caller's schema, so it never recurses on
//! untrusted structure, and it checks every declared length against the
//! bytes that are left before using it, and decoders reserve room for
//! arrays through [`initial_capacity`], not the declared length: a decoder
//! allocates at most in proportion to its input, whatever lengths the input
//! declares.

use crate::base::error::{err, Error, Result};

/// Builds msgpack bytes.
#[derive(Debug, Default)]
pub(crate) struct Writer {
    bytes: Vec<u8>,
}

impl Writer {
    /// An empty writer.
    pub fn new() -> Self {
        Self::default()
    }

    /// The bytes written.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// The header of an array of `len` elements (fixarray, array 16 or array 32).
    pub fn array(&mut self, len: usize) {
        match len {
            0..=15 => self.bytes.push(0x90 | len as u8),
            16..=0xffff => {
                self.bytes.push(0xdc);
                self.bytes.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                self.bytes.push(0xdd);
                self.bytes.extend_from_slice(&checked_u32(len).to_be_bytes());
            }
        }
    }

    /// A non-negative integer in its shortest form.
    pub fn uint(&mut self, value: u64) {
        match value {
            0..=0x7f => self.bytes.push(value as u8),
            0x80..=0xff => self.bytes.extend_from_slice(&[0xcc, value as u8]),
            0x100..=0xffff => {
                self.bytes.push(0xcd);
                self.bytes.extend_from_slice(&(value as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.bytes.push(0xce);
                self.bytes.extend_from_slice(&(value as u32).to_be_bytes());
            }
            _ => {
                self.bytes.push(0xcf);
                self.bytes.extend_from_slice(&value.to_be_bytes());
            }
        }
    }

    /// `true` or `false`.
    pub fn bool(&mut self, value: bool) {
        self.bytes.push(if value { 0xc3 } else { 0xc2 });
    }

    /// A UTF-8 string (fixstr, str 8, str 16 or str 32).
    pub fn str(&mut self, text: &str) {
        let len = text.len();
        match len {
            0..=31 => self.bytes.push(0xa0 | len as u8),
            32..=0xff => self.bytes.extend_from_slice(&[0xd9, len as u8]),
            0x100..=0xffff => {
                self.bytes.push(0xda);
                self.bytes.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                self.bytes.push(0xdb);
                self.bytes.extend_from_slice(&checked_u32(len).to_be_bytes());
            }
        }
        self.bytes.extend_from_slice(text.as_bytes());
    }

    /// `nil`.
    pub fn nil(&mut self) {
        self.bytes.push(0xc0);
    }

    /// A `bin` holding `bytes`.
    pub fn bin(&mut self, bytes: &[u8]) {
        self.bin_header(bytes.len());
        self.bytes.extend_from_slice(bytes);
    }

    /// A `bin` holding `values` as little-endian `u64`s.
    pub fn u64s(&mut self, values: &[u64]) {
        let len = values.len() * 8;
        self.bin_header(len);
        self.bytes.reserve(len);
        for value in values {
            self.bytes.extend_from_slice(&value.to_le_bytes());
        }
    }

    /// The header of a `bin` of `len` bytes (bin 8, bin 16 or bin 32).
    fn bin_header(&mut self, len: usize) {
        match len {
            0..=0xff => self.bytes.extend_from_slice(&[0xc4, len as u8]),
            0x100..=0xffff => {
                self.bytes.push(0xc5);
                self.bytes.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                self.bytes.push(0xc6);
                self.bytes.extend_from_slice(&checked_u32(len).to_be_bytes());
            }
        }
    }
}

/// msgpack cannot say a length past `u32::MAX`; nothing kvcsum writes is
/// that large (a 4 GiB record or payload), so this is a broken invariant.
fn checked_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or_else(|_| panic!("msgpack length {len} exceeds u32::MAX"))
}

/// What a marker byte starts, for error messages.
fn kind(marker: u8) -> &'static str {
    match marker {
        0x00..=0x7f => "an integer",
        0x80..=0x8f | 0xde | 0xdf => "a map",
        0x90..=0x9f | 0xdc | 0xdd => "an array",
        0xa0..=0xbf | 0xd9..=0xdb => "a string",
        0xc0 => "nil",
        0xc1 => "the unused marker 0xc1",
        0xc2 | 0xc3 => "a boolean",
        0xc4..=0xc6 => "a bin",
        0xc7..=0xc9 | 0xd4..=0xd8 => "an ext",
        0xca | 0xcb => "a float",
        0xcc..=0xcf => "an integer",
        0xd0..=0xd3 => "an integer",
        0xe0..=0xff => "a negative integer",
    }
}

/// Elements to reserve for an array whose header declares `len`. A declared
/// length is a claim, not a fact: reserving it would let a few bytes ask for
/// gigabytes (an element struct is larger than its smallest encoding), so a
/// decoder reserves at most a few and grows with the elements it really
/// reads, each of which takes input bytes.
pub(crate) fn initial_capacity(len: usize) -> usize {
    len.min(16)
}

/// Reads msgpack bytes against a schema the caller walks.
#[derive(Debug)]
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// What is being decoded ("record", "payload"), for messages.
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader of `bytes`, called `what` in error messages.
    pub fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Reader { bytes, pos: 0, what }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// Whether every byte has been read.
    pub fn at_end(&self) -> bool {
        self.pos == self.bytes.len()
    }

    /// A `Malformed` error about `field` at the current position.
    pub fn error(&self, field: &str, problem: impl std::fmt::Display) -> Error {
        err!(Malformed, "{}: {field} (byte {}): {problem}", self.what, self.pos)
    }

    /// Fails unless every byte has been read.
    pub fn finish(&self) -> Result<()> {
        if self.at_end() {
            Ok(())
        } else {
            Err(err!(
                Malformed,
                "{}: {} trailing bytes after the end (byte {})",
                self.what,
                self.remaining(),
                self.pos
            ))
        }
    }

    fn take(&mut self, field: &str, len: usize) -> Result<&'a [u8]> {
        if len > self.remaining() {
            return Err(self.error(
                field,
                format_args!("truncated: needs {len} bytes, {} left", self.remaining()),
            ));
        }
        let taken = &self.bytes[self.pos..self.pos + len];
        self.pos += len;
        Ok(taken)
    }

    fn marker(&mut self, field: &str) -> Result<u8> {
        if self.at_end() {
            return Err(self.error(field, "truncated: the input ends here"));
        }
        let marker = self.bytes[self.pos];
        self.pos += 1;
        Ok(marker)
    }

    fn big_endian(&mut self, field: &str, len: usize) -> Result<u64> {
        let bytes = self.take(field, len)?;
        Ok(bytes.iter().fold(0u64, |acc, &b| (acc << 8) | b as u64))
    }

    /// An error naming the unexpected kind of the value at `start`.
    fn wrong_kind(&mut self, field: &str, start: usize, marker: u8, expected: &str) -> Error {
        self.pos = start;
        self.error(
            field,
            format_args!("expected {expected}, found {} (0x{marker:02x})", kind(marker)),
        )
    }

    /// The header of an array; gives its declared length, checked against
    /// the bytes left (each element takes at least one byte).
    pub fn array(&mut self, field: &str) -> Result<usize> {
        let start = self.pos;
        let marker = self.marker(field)?;
        let len = match marker {
            0x90..=0x9f => (marker & 0x0f) as usize,
            0xdc => self.big_endian(field, 2)? as usize,
            0xdd => self.big_endian(field, 4)? as usize,
            _ => return Err(self.wrong_kind(field, start, marker, "an array")),
        };
        let left = self.remaining();
        if len > left {
            self.pos = start;
            return Err(self.error(
                field,
                format_args!("truncated: an array of {len} elements cannot fit in the {left} bytes left"),
            ));
        }
        Ok(len)
    }

    /// An array header of exactly `len` elements.
    pub fn array_of(&mut self, field: &str, len: usize) -> Result<()> {
        let start = self.pos;
        let found = self.array(field)?;
        if found != len {
            self.pos = start;
            return Err(self.error(
                field,
                format_args!("expected an array of {len} elements, found {found}"),
            ));
        }
        Ok(())
    }

    /// A non-negative integer in any msgpack integer form.
    pub fn uint(&mut self, field: &str) -> Result<u64> {
        let start = self.pos;
        let marker = self.marker(field)?;
        let value: i128 = match marker {
            0x00..=0x7f => marker as i128,
            0xe0..=0xff => (marker as i8) as i128,
            0xcc => self.big_endian(field, 1)? as i128,
            0xcd => self.big_endian(field, 2)? as i128,
            0xce => self.big_endian(field, 4)? as i128,
            0xcf => self.big_endian(field, 8)? as i128,
            0xd0 => self.big_endian(field, 1)? as u8 as i8 as i128,
            0xd1 => self.big_endian(field, 2)? as u16 as i16 as i128,
            0xd2 => self.big_endian(field, 4)? as u32 as i32 as i128,
            0xd3 => self.big_endian(field, 8)? as i64 as i128,
            _ => return Err(self.wrong_kind(field, start, marker, "an integer")),
        };
        if value < 0 {
            self.pos = start;
            return Err(self.error(field, format_args!("{value} is negative")));
        }
        Ok(value as u64)
    }

    /// A non-negative integer that fits in a `u32`.
    pub fn u32(&mut self, field: &str) -> Result<u32> {
        let start = self.pos;
        let value = self.uint(field)?;
        u32::try_from(value).map_err(|_| {
            self.pos = start;
            self.error(field, format_args!("{value} does not fit in 32 bits"))
        })
    }

    /// `true` or `false`.
    pub fn bool(&mut self, field: &str) -> Result<bool> {
        let start = self.pos;
        match self.marker(field)? {
            0xc2 => Ok(false),
            0xc3 => Ok(true),
            marker => Err(self.wrong_kind(field, start, marker, "a boolean")),
        }
    }

    /// A UTF-8 string.
    pub fn str(&mut self, field: &str) -> Result<&'a str> {
        let start = self.pos;
        let marker = self.marker(field)?;
        let len = match marker {
            0xa0..=0xbf => (marker & 0x1f) as usize,
            0xd9 => self.big_endian(field, 1)? as usize,
            0xda => self.big_endian(field, 2)? as usize,
            0xdb => self.big_endian(field, 4)? as usize,
            _ => return Err(self.wrong_kind(field, start, marker, "a string")),
        };
        let bytes = self.take(field, len)?;
        std::str::from_utf8(bytes).map_err(|e| {
            self.pos = start;
            self.error(field, format_args!("the string is not UTF-8: {e}"))
        })
    }

    /// A `bin`.
    pub fn bin(&mut self, field: &str) -> Result<&'a [u8]> {
        let start = self.pos;
        let marker = self.marker(field)?;
        let len = match marker {
            0xc4 => self.big_endian(field, 1)? as usize,
            0xc5 => self.big_endian(field, 2)? as usize,
            0xc6 => self.big_endian(field, 4)? as usize,
            _ => return Err(self.wrong_kind(field, start, marker, "a bin")),
        };
        self.take(field, len)
    }

    /// `nil` (`None`) or a `bin`.
    pub fn nil_or_bin(&mut self, field: &str) -> Result<Option<&'a [u8]>> {
        if self.bytes.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            return Ok(None);
        }
        match self.bytes.get(self.pos) {
            Some(&marker) if !(0xc4..=0xc6).contains(&marker) => {
                let start = self.pos;
                Err(self.wrong_kind(field, start, marker, "nil or a bin"))
            }
            _ => self.bin(field).map(Some),
        }
    }

    /// A `bin` of little-endian `u64`s.
    pub fn u64s(&mut self, field: &str) -> Result<Vec<u64>> {
        let start = self.pos;
        let bytes = self.bin(field)?;
        if bytes.len() % 8 != 0 {
            self.pos = start;
            return Err(self.error(
                field,
                format_args!("a bin of {} bytes is not a whole number of 8-byte values", bytes.len()),
            ));
        }
        Ok(bytes
            .chunks_exact(8)
            .map(|chunk| u64::from_le_bytes(chunk.try_into().expect("chunks of 8")))
            .collect())
    }

    /// The position of the next byte, for messages about a value just read.
    pub fn position(&self) -> usize {
        self.pos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_round_trip_in_every_width() {
        for value in [
            0u64,
            1,
            127,
            128,
            255,
            256,
            65535,
            65536,
            u32::MAX as u64,
            1 << 32,
            u64::MAX,
        ] {
            let mut writer = Writer::new();
            writer.uint(value);
            let bytes = writer.into_bytes();
            let mut reader = Reader::new(&bytes, "test");
            assert_eq!(reader.uint("value").unwrap(), value);
            reader.finish().unwrap();
        }
    }

    #[test]
    fn signed_forms_of_non_negative_values_are_read_and_negatives_are_not() {
        let mut reader = Reader::new(&[0xd3, 0, 0, 0, 0, 0, 0, 0, 5], "test");
        assert_eq!(reader.uint("value").unwrap(), 5);
        let error = Reader::new(&[0xff], "test").uint("value").unwrap_err();
        assert!(
            matches!(&error, Error::Malformed(m) if m.contains("-1 is negative")),
            "{error}"
        );
    }

    #[test]
    fn declared_lengths_past_the_input_are_rejected_before_use() {
        let error = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff], "test")
            .array("list")
            .unwrap_err();
        assert!(
            matches!(&error, Error::Malformed(m) if m.contains("cannot fit")),
            "{error}"
        );
        let error = Reader::new(&[0xc6, 0xff, 0xff, 0xff, 0xff, 1], "test")
            .bin("values")
            .unwrap_err();
        assert!(
            matches!(&error, Error::Malformed(m) if m.contains("truncated")),
            "{error}"
        );
    }
}
