//! The fault catalogue's faults (docs/SPEC.md section 13), shared by the
//! host catalogue (`tests/it/fault_catalogue.rs`) and its GPU variant
//! (`tests/gpu/attention.rs`): the block geometries, bf16-, fp16- and
//! fp32-like random KV, each fault class (like hardware and like software)
//! with what WEIGHTED provably misses, and the direct path (one block
//! through the crate's arithmetic).

use kvcsum::{
    slice_weight, weighted_run, Algorithm, BlockSet, LayerSpec, Region, ReplicaKey, Segment, Worker, WorkerOptions,
};

use super::Rng;

/// Layers, KV heads, tokens per block, and K then V pieces per cell of the
/// standard geometry ([`Geometry::STANDARD`]): a bf16 head of 32 elements
/// is 64 bytes, 8 pieces, of K and as much of V. Every geometry has
/// `LAYERS` layers and `TOKENS` tokens per block.
pub const LAYERS: usize = 2;
pub const HEADS: usize = 4;
pub const TOKENS: usize = 16;
pub const K_PIECES: usize = 8;
pub const PIECES: usize = 2 * K_PIECES;
pub const CELL_BYTES: usize = PIECES * 8;
pub const SLICE_BYTES: usize = TOKENS * CELL_BYTES;
pub const LAYER_BYTES: usize = HEADS * SLICE_BYTES;
/// One block: [layer][head][token][cell] (a cross-layer cache's block).
pub const BLOCK_BYTES: usize = LAYERS * LAYER_BYTES;
/// Model-wide layer numbers of the two layers.
pub const LAYER_NUMBERS: [u32; LAYERS] = [7, 8];

pub const ALGORITHMS: [Algorithm; 3] = [Algorithm::Weighted, Algorithm::Mixed, Algorithm::Mixed2];

/// The element type of a geometry's KV: what its random data looks like
/// and where its sign bits are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    Fp16,
    Fp32,
}

impl Dtype {
    pub fn bytes(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp32 => "fp32",
        }
    }

    /// The sign bits of every element of a piece: what negating them XORs in.
    pub fn signs(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 0x8000_8000_8000_8000,
            Dtype::Fp32 => 0x8000_0000_8000_0000,
        }
    }
}

/// A block's shape: `LAYERS` layers of `heads` heads of `TOKENS` tokens, each
/// cell K then V of `head_size` elements of `dtype`; laid out
/// [layer][head][token][cell] (a cross-layer cache's block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub dtype: Dtype,
    pub head_size: usize,
    pub heads: usize,
}

impl Geometry {
    /// The geometry of the constants above: bf16, head size 32, 4 heads.
    pub const STANDARD: Geometry = Geometry {
        dtype: Dtype::Bf16,
        head_size: 32,
        heads: HEADS,
    };

    pub fn k_pieces(self) -> usize {
        self.head_size * self.dtype.bytes() / 8
    }

    pub fn pieces(self) -> usize {
        2 * self.k_pieces()
    }

    pub fn cell_bytes(self) -> usize {
        self.pieces() * 8
    }

    pub fn slice_bytes(self) -> usize {
        TOKENS * self.cell_bytes()
    }

    pub fn layer_bytes(self) -> usize {
        self.heads * self.slice_bytes()
    }

    pub fn block_bytes(self) -> usize {
        LAYERS * self.layer_bytes()
    }

    /// Byte offset of (layer, head, token, piece) in a block.
    pub fn at(self, layer: usize, head: usize, token: usize, piece: usize) -> usize {
        layer * self.layer_bytes() + head * self.slice_bytes() + token * self.cell_bytes() + piece * 8
    }

    /// Fills `bytes` with random elements of the geometry's dtype.
    pub fn fill(self, rng: &mut Rng, bytes: &mut [u8]) {
        match self.dtype {
            Dtype::Bf16 => fill_kv(rng, bytes),
            Dtype::Fp16 => {
                for pair in bytes.chunks_exact_mut(2) {
                    pair.copy_from_slice(&fp16_element(rng.next_u64()).to_le_bytes());
                }
            }
            Dtype::Fp32 => {
                for quad in bytes.chunks_exact_mut(4) {
                    quad.copy_from_slice(&fp32_element(rng.next_u64()).to_le_bytes());
                }
            }
        }
    }

    /// "fp32, head size 4, 2 heads", for class names.
    pub fn describe(self) -> String {
        format!("{}, head size {}", self.dtype.name(), self.head_size)
    }
}

/// One random fp16-like element: sign, exponent 2^-5 .. 2^2, mantissa.
pub fn fp16_element(bits: u64) -> u16 {
    let sign = (bits & 1) as u16;
    let exponent = 10 + ((bits >> 1) & 7) as u16;
    let mantissa = ((bits >> 4) & 0x3ff) as u16;
    (sign << 15) | (exponent << 10) | mantissa
}

/// One random fp32-like element: sign, exponent 2^-5 .. 2^2, mantissa.
pub fn fp32_element(bits: u64) -> u32 {
    let sign = (bits & 1) as u32;
    let exponent = 0x7a + ((bits >> 1) & 7) as u32;
    let mantissa = ((bits >> 4) & 0x7f_ffff) as u32;
    (sign << 31) | (exponent << 23) | mantissa
}

/// One random bf16-like element: sign, exponent 0x7a..0x81, mantissa.
pub fn element(bits: u64) -> u16 {
    let sign = (bits & 1) as u16;
    let exponent = 0x7a + ((bits >> 1) & 7) as u16;
    let mantissa = ((bits >> 4) & 0x7f) as u16;
    (sign << 15) | (exponent << 7) | mantissa
}

/// Fills `bytes` (a multiple of 8) with bf16-like elements, four per random word.
pub fn fill_kv(rng: &mut Rng, bytes: &mut [u8]) {
    for piece in bytes.chunks_exact_mut(8) {
        let bits = rng.next_u64();
        for (e, pair) in piece.chunks_exact_mut(2).enumerate() {
            pair.copy_from_slice(&element(bits >> (16 * e)).to_le_bytes());
        }
    }
}

/// Byte offset of (layer, head, token, piece) in a block.
pub fn at(layer: usize, head: usize, token: usize, piece: usize) -> usize {
    layer * LAYER_BYTES + head * SLICE_BYTES + token * CELL_BYTES + piece * 8
}

pub fn piece(block: &[u8], offset: usize) -> u64 {
    u64::from_le_bytes(block[offset..offset + 8].try_into().unwrap())
}

pub fn set_piece(block: &mut [u8], offset: usize, value: u64) {
    block[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
}

/// A random piece's offset in a block.
pub fn random_piece(rng: &mut Rng) -> usize {
    rng.below((BLOCK_BYTES / 8) as u64) as usize * 8
}

/// `count` distinct random piece offsets.
pub fn distinct_pieces(rng: &mut Rng, count: usize) -> Vec<usize> {
    let mut offsets: Vec<usize> = Vec::with_capacity(count);
    while offsets.len() < count {
        let offset = random_piece(rng);
        if !offsets.contains(&offset) {
            offsets.push(offset);
        }
    }
    offsets
}

/// What a fault class does to one block of its `geometry`. `prepare`
/// shapes the clean data before the clean checksum (the structure some
/// faults need, such as two tokens that differ only in high bits); `inject`
/// changes the block, with `other` another block's clean bytes (a stale
/// page, a wrong slot), and returns how many pieces it flipped where a
/// class's expectation needs it. Classes of the standard geometry use the
/// constants above; the others are given their geometry.
pub struct Class {
    pub name: String,
    pub hardware: bool,
    pub geometry: Geometry,
    pub prepare: fn(&mut Rng, &mut [u8]),
    pub inject: fn(&mut Rng, &mut [u8], &[u8], Geometry) -> usize,
    /// Whether the class XORs one fixed pattern into several pieces, the
    /// faults through which MIXED's fixed differential (SPEC section 13)
    /// can cancel: MIXED's misses there are measured, not asserted.
    pub fixed_pattern: bool,
    /// Whether WEIGHTED provably misses this fault, given `inject`'s count:
    /// `Some(rule)` for the classes SPEC section 13 states, `None` where it
    /// states nothing (measured only).
    pub weighted_misses: Option<fn(usize) -> bool>,
}

pub fn no_prepare(_: &mut Rng, _: &mut [u8]) {}

/// Two distinct tokens of one (layer, head).
pub fn two_tokens(rng: &mut Rng) -> (usize, usize, usize, usize) {
    let layer = rng.below(LAYERS as u64) as usize;
    let head = rng.below(HEADS as u64) as usize;
    let a = rng.below(TOKENS as u64) as usize;
    let mut b = rng.below(TOKENS as u64) as usize;
    while b == a {
        b = rng.below(TOKENS as u64) as usize;
    }
    (layer, head, a, b)
}

pub fn swap_cells(block: &mut [u8], layer: usize, head: usize, a: usize, b: usize) {
    for p in 0..PIECES {
        let (x, y) = (at(layer, head, a, p), at(layer, head, b, p));
        let (px, py) = (piece(block, x), piece(block, y));
        set_piece(block, x, py);
        set_piece(block, y, px);
    }
}

/// A random byte other than `old`.
pub fn other_byte(rng: &mut Rng, old: u8) -> u8 {
    old ^ rng.range(1..256) as u8
}

/// bf16 to fp8 e4m3 (round toward zero, saturating): what an fp8 cache
/// holds for the same values.
pub fn fp8_e4m3(bf16: u16) -> u8 {
    let sign = ((bf16 >> 15) as u8) << 7;
    let exponent = ((bf16 >> 7) & 0xff) as i32 - 127;
    let mantissa = ((bf16 >> 4) & 0x7) as u8;
    let biased = exponent + 7;
    if biased <= 0 {
        sign
    } else if biased >= 15 {
        sign | 0x7e
    } else {
        sign | ((biased as u8) << 3) | mantissa
    }
}

/// Every class: the standard geometry's, then [`fixed_pattern_classes`].
pub fn catalogue() -> Vec<Class> {
    let mut classes = vec![
        Class {
            name: "one bit flipped".into(),
            hardware: true,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                let offset = random_piece(rng);
                set_piece(block, offset, piece(block, offset) ^ (1 << rng.below(64)));
                1
            },
            weighted_misses: Some(|_| false),
        },
        Class {
            name: "the same bit flipped in two pieces".into(),
            hardware: true,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                let bit = 1u64 << rng.below(64);
                for offset in distinct_pieces(rng, 2) {
                    set_piece(block, offset, piece(block, offset) ^ bit);
                }
                2
            },
            weighted_misses: None,
        },
        Class {
            name: "bit 63 flipped in 2, 4, 6 or 8 pieces".into(),
            hardware: true,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                let count = 2 * rng.range(1..5) as usize;
                for offset in distinct_pieces(rng, count) {
                    set_piece(block, offset, piece(block, offset) ^ (1 << 63));
                }
                count
            },
            weighted_misses: Some(|_| true),
        },
        Class {
            name: "bit 63 stuck over one slice".into(),
            hardware: true,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| loop {
                let (layer, head) = (rng.below(LAYERS as u64) as usize, rng.below(HEADS as u64) as usize);
                let stuck = rng.below(2) << 63;
                let mut changed = 0;
                for t in 0..TOKENS {
                    for p in 0..PIECES {
                        let offset = at(layer, head, t, p);
                        let old = piece(block, offset);
                        let new = (old & !(1 << 63)) | stuck;
                        changed += (new != old) as usize;
                        set_piece(block, offset, new);
                    }
                }
                if changed > 0 {
                    return changed;
                }
            },
            weighted_misses: Some(|changed| changed % 2 == 0),
        },
        Class {
            name: "a random bit stuck over one slice".into(),
            hardware: true,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| loop {
                let (layer, head) = (rng.below(LAYERS as u64) as usize, rng.below(HEADS as u64) as usize);
                let bit = rng.below(64);
                let stuck = rng.below(2) << bit;
                let mut changed = 0;
                for t in 0..TOKENS {
                    for p in 0..PIECES {
                        let offset = at(layer, head, t, p);
                        let old = piece(block, offset);
                        let new = (old & !(1 << bit)) | stuck;
                        changed += (new != old) as usize;
                        set_piece(block, offset, new);
                    }
                }
                if changed > 0 {
                    return changed;
                }
            },
            weighted_misses: None,
        },
        Class {
            name: "one byte lane garbled in 2-16 pieces".into(),
            hardware: true,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                let lane = rng.below(8) as usize;
                let count = rng.range(2..17) as usize;
                let first = rng.below((BLOCK_BYTES / 8 - count) as u64) as usize;
                for p in first..first + count {
                    let byte = p * 8 + lane;
                    block[byte] = other_byte(rng, block[byte]);
                }
                count
            },
            weighted_misses: None,
        },
        Class {
            name: "random bytes over a range of 1-512 bytes".into(),
            hardware: true,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                let len = rng.range(1..513) as usize;
                let start = rng.below((BLOCK_BYTES - len) as u64) as usize;
                let first = start + rng.below(len as u64) as usize;
                for (i, byte) in block[start..start + len].iter_mut().enumerate() {
                    // At least one byte differs; the others are random.
                    *byte = if start + i == first {
                        *byte ^ rng.range(1..256) as u8
                    } else {
                        rng.next_u64() as u8
                    };
                }
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "a tail zeroed from an offset (partial copy)".into(),
            hardware: false,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                // A layer's block copied up to a random byte: the rest stays zero.
                let layer = rng.below(LAYERS as u64) as usize;
                // Up to the layer's last byte, an element's high byte,
                // which is never zero: the copy always lost something.
                let cut = rng.below(LAYER_BYTES as u64 - 1) as usize;
                block[layer * LAYER_BYTES + cut..(layer + 1) * LAYER_BYTES].fill(0);
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "a stale block (the page's earlier KV)".into(),
            hardware: false,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                fill_kv(rng, block);
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "another block's KV in this slot".into(),
            hardware: false,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |_, block, other, _| {
                block.copy_from_slice(other);
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "two tokens swapped".into(),
            hardware: false,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                let (layer, head, a, b) = two_tokens(rng);
                swap_cells(block, layer, head, a, b);
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "two tokens differing only in their top bytes, swapped".into(),
            hardware: false,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: |rng, block| {
                // Token b of a slice becomes token a with other top bytes
                // (the high byte of each piece's last element); the inject
                // step finds the pair again by comparing.
                let (layer, head, a, b) = two_tokens(rng);
                for p in 0..PIECES {
                    let x = piece(block, at(layer, head, a, p));
                    let top = other_byte(rng, (x >> 56) as u8) as u64;
                    set_piece(block, at(layer, head, b, p), (x & !(0xff << 56)) | (top << 56));
                }
            },
            inject: |_, block, _, _| {
                swap_cells_differing_in(block, !(0xffu64 << 56));
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "two tokens differing only in bit 63 of each piece, swapped".into(),
            hardware: false,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: |rng, block| {
                let (layer, head, a, b) = two_tokens(rng);
                for p in 0..PIECES {
                    let x = piece(block, at(layer, head, a, p));
                    set_piece(block, at(layer, head, b, p), x ^ (1 << 63));
                }
            },
            inject: |_, block, _, _| {
                swap_cells_differing_in(block, !(1u64 << 63));
                0
            },
            weighted_misses: Some(|_| true),
        },
        Class {
            name: "heads permuted (HND written as NHD)".into(),
            hardware: false,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                let layer = rng.below(LAYERS as u64) as usize;
                let old = block[layer * LAYER_BYTES..(layer + 1) * LAYER_BYTES].to_vec();
                for h in 0..HEADS {
                    for t in 0..TOKENS {
                        // The reader's cell (h, t) holds what the writer put
                        // at that flat place as (token, head).
                        let flat = h * TOKENS + t;
                        let (wt, wh) = (flat / HEADS, flat % HEADS);
                        let from = wh * SLICE_BYTES + wt * CELL_BYTES;
                        let to = layer * LAYER_BYTES + h * SLICE_BYTES + t * CELL_BYTES;
                        block[to..to + CELL_BYTES].copy_from_slice(&old[from..from + CELL_BYTES]);
                    }
                }
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "a GQA replica's head never sent (stale)".into(),
            hardware: false,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                let (layer, head) = (rng.below(LAYERS as u64) as usize, rng.below(HEADS as u64) as usize);
                let start = at(layer, head, 0, 0);
                fill_kv(rng, &mut block[start..start + SLICE_BYTES]);
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "K and V swapped".into(),
            hardware: false,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                let layer = rng.below(LAYERS as u64) as usize;
                for h in 0..HEADS {
                    for t in 0..TOKENS {
                        let cell = at(layer, h, t, 0);
                        let (k, v) = block[cell..cell + CELL_BYTES].split_at_mut(K_PIECES * 8);
                        k.swap_with_slice(v);
                    }
                }
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "a layer written twice (the next one never)".into(),
            hardware: false,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |_, block, _, _| {
                let (first, second) = block.split_at_mut(LAYER_BYTES);
                second[..LAYER_BYTES].copy_from_slice(first);
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "values of one token negated".into(),
            hardware: false,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                let (layer, head, t, _) = two_tokens(rng);
                for p in 0..PIECES {
                    let offset = at(layer, head, t, p);
                    set_piece(block, offset, piece(block, offset) ^ 0x8000_8000_8000_8000);
                }
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "fp8 bytes where bf16 was expected".into(),
            hardware: false,
            geometry: Geometry::STANDARD,
            fixed_pattern: false,
            prepare: no_prepare,
            inject: |rng, block, _, _| {
                // A layer's block as an fp8 cache holds it: one byte per
                // element in the first half, the rest as it was.
                let layer = rng.below(LAYERS as u64) as usize;
                let start = layer * LAYER_BYTES;
                let elements: Vec<u16> = block[start..start + LAYER_BYTES]
                    .chunks_exact(2)
                    .map(|pair| u16::from_le_bytes([pair[0], pair[1]]))
                    .collect();
                for (i, &value) in elements.iter().enumerate() {
                    block[start + i] = fp8_e4m3(value);
                }
                0
            },
            weighted_misses: None,
        },
    ];
    classes.extend(fixed_pattern_classes());
    classes
}

/// Geometry of the fixed-pattern classes at `head_size`: four heads for
/// short heads, two for long ones (so that a block stays small).
fn geometry(dtype: Dtype, head_size: usize) -> Geometry {
    Geometry {
        dtype,
        head_size,
        heads: if head_size <= 8 { 4 } else { 2 },
    }
}

/// XORs `pattern` into every piece of one random token's cell (K and V of
/// one layer and head); returns the pieces changed.
fn xor_token(rng: &mut Rng, block: &mut [u8], g: Geometry, pattern: u64) -> usize {
    let (layer, head) = (rng.below(LAYERS as u64) as usize, rng.below(g.heads as u64) as usize);
    let token = rng.below(TOKENS as u64) as usize;
    for p in 0..g.pieces() {
        let offset = g.at(layer, head, token, p);
        set_piece(block, offset, piece(block, offset) ^ pattern);
    }
    g.pieces()
}

/// XORs `pattern` into every piece of one random slice (one layer and
/// head, every token); returns the pieces changed.
fn xor_slice(rng: &mut Rng, block: &mut [u8], g: Geometry, pattern: u64) -> usize {
    let (layer, head) = (rng.below(LAYERS as u64) as usize, rng.below(g.heads as u64) as usize);
    for token in 0..TOKENS {
        for p in 0..g.pieces() {
            let offset = g.at(layer, head, token, p);
            set_piece(block, offset, piece(block, offset) ^ pattern);
        }
    }
    TOKENS * g.pieces()
}

/// The classes that XOR one pattern into many pieces: sign flips of fp32,
/// fp16 and bf16 values at several head sizes, every other element
/// negated, a bit-31 and a bit-15 line of a 32-bit bus inverted, a byte of
/// every 32-bit word garbled alike. Under MIXED the patterns with equal
/// 32-bit halves change `f` by a fixed amount (SPEC section 13), so these
/// faults cancel there at rates the table shows; MIXED2 must miss none.
pub fn fixed_pattern_classes() -> Vec<Class> {
    let mut classes = Vec::new();
    for dtype in [Dtype::Fp32, Dtype::Fp16, Dtype::Bf16] {
        for head_size in [4, 8, 64, 128] {
            let g = geometry(dtype, head_size);
            classes.push(Class {
                name: format!("values of one token negated ({}, {} heads)", g.describe(), g.heads),
                hardware: false,
                geometry: g,
                fixed_pattern: true,
                prepare: no_prepare,
                inject: |rng, block, _, g| xor_token(rng, block, g, g.dtype.signs()),
                weighted_misses: None,
            });
        }
    }
    for head_size in [8, 128] {
        let g = geometry(Dtype::Bf16, head_size);
        classes.push(Class {
            name: format!(
                "every other element of one token negated ({}, {} heads)",
                g.describe(),
                g.heads
            ),
            hardware: false,
            geometry: g,
            fixed_pattern: true,
            prepare: no_prepare,
            // Elements 1 and 3 of each piece: their sign bits are bits 31 and 63.
            inject: |rng, block, _, g| xor_token(rng, block, g, 0x8000_0000_8000_0000),
            weighted_misses: None,
        });
    }
    // Bit 31 (15) of every 32-bit word: bits 31 and 63 (15 and 47) of every piece.
    classes.push(Class {
        name: "a bit-31 line of a 32-bit bus inverted over one slice".into(),
        hardware: true,
        geometry: Geometry::STANDARD,
        fixed_pattern: true,
        prepare: no_prepare,
        inject: |rng, block, _, g| xor_slice(rng, block, g, 0x8000_0000_8000_0000),
        weighted_misses: None,
    });
    classes.push(Class {
        name: "a bit-15 line of a 32-bit bus inverted over one slice".into(),
        hardware: true,
        geometry: Geometry::STANDARD,
        fixed_pattern: true,
        prepare: no_prepare,
        inject: |rng, block, _, g| xor_slice(rng, block, g, 0x0000_8000_0000_8000),
        weighted_misses: None,
    });
    classes.push(Class {
        name: "one byte of every 32-bit word garbled alike over one slice".into(),
        hardware: true,
        geometry: Geometry::STANDARD,
        fixed_pattern: true,
        prepare: no_prepare,
        inject: |rng, block, _, g| {
            // The same nonzero byte XORed into byte `lane` of both words of every piece.
            let lane = rng.below(4);
            let garble = rng.range(1..256) << (8 * lane);
            xor_slice(rng, block, g, garble | (garble << 32))
        },
        weighted_misses: None,
    });
    classes
}

/// Swaps the one pair of cells (same layer and head) whose pieces are equal
/// under `mask` (the pair `prepare` made).
pub fn swap_cells_differing_in(block: &mut [u8], mask: u64) {
    for layer in 0..LAYERS {
        for head in 0..HEADS {
            for a in 0..TOKENS {
                for b in a + 1..TOKENS {
                    let alike = (0..PIECES).all(|p| {
                        let (x, y) = (piece(block, at(layer, head, a, p)), piece(block, at(layer, head, b, p)));
                        x != y && x & mask == y & mask
                    });
                    if alike {
                        swap_cells(block, layer, head, a, b);
                        return;
                    }
                }
            }
        }
    }
    panic!("no pair of cells alike under {mask:#x}");
}

/// The slice checksum of (layer, head) of `block` (geometry `g`) at
/// position `q`, weighted by its slice weight, by the crate's own
/// arithmetic.
fn direct_slice(
    block: &[u8],
    g: Geometry,
    layer: usize,
    head: usize,
    q: u64,
    algorithm: Algorithm,
    pieces: &mut Vec<u64>,
) -> u64 {
    let per_slice = TOKENS * g.pieces();
    pieces.clear();
    let start = g.at(layer, head, 0, 0);
    pieces.extend((0..per_slice).map(|i| piece(block, start + 8 * i)));
    let slice = weighted_run(pieces, q * per_slice as u64, algorithm);
    slice_weight(LAYER_NUMBERS[layer], head as u32).wrapping_mul(slice)
}

/// The block checksum of `block` (geometry `g`) at position `q` by the
/// crate's own arithmetic, slice by slice.
pub fn direct_checksum(block: &[u8], g: Geometry, q: u64, algorithm: Algorithm) -> u64 {
    let mut pieces = Vec::new();
    let mut total = 0u64;
    for layer in 0..LAYERS {
        for head in 0..g.heads {
            total = total.wrapping_add(direct_slice(block, g, layer, head, q, algorithm, &mut pieces));
        }
    }
    total
}

/// How much the block checksum at position `q` changes from `clean` to
/// `faulty` (geometry `g`): the sum over the slices whose bytes differ of
/// the change of their weighted slice checksums, which is exactly
/// `direct_checksum(faulty) - direct_checksum(clean)` (the other slices'
/// terms are equal), at a fraction of the work for local faults.
pub fn direct_change(clean: &[u8], faulty: &[u8], g: Geometry, q: u64, algorithm: Algorithm) -> u64 {
    let mut pieces = Vec::new();
    let mut change = 0u64;
    for layer in 0..LAYERS {
        for head in 0..g.heads {
            let start = g.at(layer, head, 0, 0);
            let range = start..start + g.slice_bytes();
            if clean[range.clone()] != faulty[range] {
                let before = direct_slice(clean, g, layer, head, q, algorithm, &mut pieces);
                let after = direct_slice(faulty, g, layer, head, q, algorithm, &mut pieces);
                change = change.wrapping_add(after.wrapping_sub(before));
            }
        }
    }
    change
}

/// Detected and missed faults of one class under one algorithm, and the
/// trials where the outcome broke the class's expectation.
#[derive(Default, Clone, Copy)]
pub struct Tally {
    pub trials: u64,
    pub missed: u64,
    pub unexpected: u64,
}

impl Tally {
    pub fn add(&mut self, missed: bool, expected_missed: Option<bool>) {
        self.trials += 1;
        self.missed += missed as u64;
        self.unexpected += expected_missed.is_some_and(|expected| expected != missed) as u64;
    }
}

pub fn env_count(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={text:?} is not a count")),
        Err(_) => default,
    }
}

/// The direct path: `trials` faults of `class`, each on a fresh block at a
/// random position; per algorithm (in the order of [`ALGORITHMS`]). A fault
/// is missed when the block checksum does not change ([`direct_change`]).
pub fn run_direct(rng: &mut Rng, class: &Class, trials: u64) -> [Tally; 3] {
    let g = class.geometry;
    let mut tallies = [Tally::default(); 3];
    let mut block = vec![0u8; g.block_bytes()];
    let mut other = vec![0u8; g.block_bytes()];
    for _ in 0..trials {
        g.fill(rng, &mut block);
        g.fill(rng, &mut other);
        (class.prepare)(rng, &mut block);
        let clean = block.clone();
        let q = rng.below(1 << 16);
        let changed = (class.inject)(rng, &mut block, &other, g);
        for (i, &algorithm) in ALGORITHMS.iter().enumerate() {
            let missed = direct_change(&clean, &block, g, q, algorithm) == 0;
            let expected = expected_miss(class, algorithm, changed);
            tallies[i].add(missed, expected);
        }
    }
    tallies
}

/// A worker (host, or device `device`) of `algorithm` over a cross-layer
/// cache of `num_blocks` blocks of geometry `g` at `address`:
/// [block][layer][head][token][cell].
pub fn catalogue_worker(
    device: Option<u32>,
    algorithm: Algorithm,
    address: u64,
    num_blocks: usize,
    g: Geometry,
) -> Worker {
    let mut worker = Worker::new(WorkerOptions {
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        device,
        num_threads: 0,
    })
    .expect("worker");
    worker.set_algorithm(algorithm).unwrap();
    worker
        .add_region(Region {
            address,
            length: (num_blocks * g.block_bytes()) as u64,
        })
        .unwrap();
    worker.add_group(0, TOKENS as u32).unwrap();
    for (layer, &layer_number) in LAYER_NUMBERS.iter().enumerate() {
        worker
            .add_layer(LayerSpec {
                group_id: 0,
                layer_number,
                first_head: 0,
                num_heads: g.heads as u32,
                replica: ReplicaKey {
                    replicas: 1,
                    replica_index: 0,
                },
                num_blocks: num_blocks as u32,
                kernel_blocks: 1,
                tokens_per_kernel_block: TOKENS as u32,
                segments: vec![Segment {
                    address: address + (layer * g.layer_bytes()) as u64,
                    block_stride: g.block_bytes() as i64,
                    kernel_block_stride: 0,
                    head_stride: g.slice_bytes() as i64,
                    token_stride: g.cell_bytes() as i64,
                    bytes_per_token: g.cell_bytes() as u32,
                }],
                identity: format!("layer {layer_number}").into_bytes(),
            })
            .unwrap();
    }
    worker
}

/// One request "catalogue" whose position q is held by block q.
pub fn catalogue_blocks(num_blocks: usize) -> BlockSet {
    let mut blocks = BlockSet::new();
    blocks.add_request("catalogue", (num_blocks * TOKENS) as u64).unwrap();
    let ids: Vec<u32> = (0..num_blocks as u32).collect();
    blocks.add_group("catalogue", 0, 0, &ids).unwrap();
    blocks
}

/// What each algorithm is expected to miss: WEIGHTED per `class` (given
/// `inject`'s count); MIXED nothing, except in the fixed-pattern classes,
/// where nothing is stated (measured only); MIXED2 nothing.
pub fn expected_miss(class: &Class, algorithm: Algorithm, changed: usize) -> Option<bool> {
    match algorithm {
        Algorithm::Mixed2 => Some(false),
        Algorithm::Mixed => (!class.fixed_pattern).then_some(false),
        Algorithm::Weighted => class.weighted_misses.map(|rule| rule(changed)),
    }
}
