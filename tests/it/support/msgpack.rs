//! The one msgpack writer of the tests and fuzz targets, for hand-made
//! records and payloads: written from the msgpack format, independently of
//! the library's encoder, so that a fault in that encoder cannot hide in the
//! inputs. Values take their shortest form; a crafted header (a length the
//! bytes do not hold) goes in through [`Msgpack::raw`].
//!
//! It stands alone (no `super::`), so that the fuzz crate can include this
//! file with `#[path]` rather than copy it.

#![allow(dead_code)]

/// msgpack bytes, appended to by each call.
#[derive(Debug, Default, Clone)]
pub struct Msgpack(pub Vec<u8>);

impl Msgpack {
    /// A header of a length-prefixed type: `fix` is the fix form's base and
    /// its largest length, `codes` the 8-, 16- and 32-bit forms (0 where
    /// the type has no 8-bit form).
    fn header(&mut self, len: usize, fix: Option<(u8, usize)>, codes: [u8; 3]) -> &mut Self {
        match fix {
            Some((base, max)) if len <= max => self.0.push(base | len as u8),
            _ if len <= 0xff && codes[0] != 0 => self.0.extend([codes[0], len as u8]),
            _ if len <= 0xffff => {
                self.0.push(codes[1]);
                self.0.extend((len as u16).to_be_bytes());
            }
            _ => {
                self.0.push(codes[2]);
                self.0.extend((len as u32).to_be_bytes());
            }
        }
        self
    }

    /// The header of an array of `len` items (the items follow).
    pub fn array(&mut self, len: usize) -> &mut Self {
        self.header(len, Some((0x90, 15)), [0, 0xdc, 0xdd])
    }

    /// An unsigned integer.
    pub fn uint(&mut self, value: u64) -> &mut Self {
        match value {
            0..=0x7f => self.0.push(value as u8),
            0x80..=0xff => self.0.extend([0xcc, value as u8]),
            0x100..=0xffff => {
                self.0.push(0xcd);
                self.0.extend((value as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.0.push(0xce);
                self.0.extend((value as u32).to_be_bytes());
            }
            _ => {
                self.0.push(0xcf);
                self.0.extend(value.to_be_bytes());
            }
        }
        self
    }

    /// A signed integer in the `int 64` form.
    pub fn int64(&mut self, value: i64) -> &mut Self {
        self.0.push(0xd3);
        self.0.extend(value.to_be_bytes());
        self
    }

    /// A float in the `float 64` form.
    pub fn f64(&mut self, value: f64) -> &mut Self {
        self.0.push(0xcb);
        self.0.extend(value.to_be_bytes());
        self
    }

    /// `true` or `false`.
    pub fn bool(&mut self, value: bool) -> &mut Self {
        self.0.push(if value { 0xc3 } else { 0xc2 });
        self
    }

    /// `nil`.
    pub fn nil(&mut self) -> &mut Self {
        self.0.push(0xc0);
        self
    }

    /// A string.
    pub fn str(&mut self, text: &str) -> &mut Self {
        self.header(text.len(), Some((0xa0, 31)), [0xd9, 0xda, 0xdb]);
        self.0.extend(text.as_bytes());
        self
    }

    /// A bin of `bytes`.
    pub fn bin(&mut self, bytes: &[u8]) -> &mut Self {
        self.header(bytes.len(), None, [0xc4, 0xc5, 0xc6]);
        self.0.extend(bytes);
        self
    }

    /// A bin of `values`, 8 little-endian bytes each (how records and
    /// payloads carry checksums).
    pub fn u64s(&mut self, values: &[u64]) -> &mut Self {
        let bytes: Vec<u8> = values.iter().flat_map(|value| value.to_le_bytes()).collect();
        self.bin(&bytes)
    }

    /// `bytes` as they are (a crafted header, a value of another writer).
    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.extend(bytes);
        self
    }
}
