//! The fault catalogue's faults (docs/SPEC.md section 13), shared by the
//! host catalogue (`tests/fault_catalogue.rs`) and its GPU variant
//! (`tests/gpu/attention.rs`): the block geometry, bf16-like random KV, each fault
//! class (like hardware and like software) with what WEIGHTED provably
//! misses, and the direct path (one block through the crate's arithmetic).

use kvcsum::{
    slice_weight, weighted_run, Algorithm, BlockSet, LayerSpec, Region, ReplicaKey, Segment, Worker, WorkerOptions,
};

use super::Rng;

/// Layers, KV heads, tokens per block, and K then V pieces per cell: a
/// bf16 head of 32 elements is 64 bytes, 8 pieces, of K and as much of V.
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

pub const ALGORITHMS: [Algorithm; 2] = [Algorithm::Weighted, Algorithm::Mixed];

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

/// What a fault class does to one block. `prepare` shapes the clean data
/// before the clean checksum (the structure some faults need, such as two
/// tokens that differ only in high bits); `inject` changes the block, with
/// `other` another block's clean bytes (a stale page, a wrong slot), and
/// returns how many pieces it flipped where a class's expectation needs it.
pub struct Class {
    pub name: &'static str,
    pub hardware: bool,
    pub prepare: fn(&mut Rng, &mut [u8]),
    pub inject: fn(&mut Rng, &mut [u8], &[u8]) -> usize,
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

pub fn catalogue() -> Vec<Class> {
    vec![
        Class {
            name: "one bit flipped",
            hardware: true,
            prepare: no_prepare,
            inject: |rng, block, _| {
                let offset = random_piece(rng);
                set_piece(block, offset, piece(block, offset) ^ (1 << rng.below(64)));
                1
            },
            weighted_misses: Some(|_| false),
        },
        Class {
            name: "the same bit flipped in two pieces",
            hardware: true,
            prepare: no_prepare,
            inject: |rng, block, _| {
                let bit = 1u64 << rng.below(64);
                for offset in distinct_pieces(rng, 2) {
                    set_piece(block, offset, piece(block, offset) ^ bit);
                }
                2
            },
            weighted_misses: None,
        },
        Class {
            name: "bit 63 flipped in 2, 4, 6 or 8 pieces",
            hardware: true,
            prepare: no_prepare,
            inject: |rng, block, _| {
                let count = 2 * rng.range(1..5) as usize;
                for offset in distinct_pieces(rng, count) {
                    set_piece(block, offset, piece(block, offset) ^ (1 << 63));
                }
                count
            },
            weighted_misses: Some(|_| true),
        },
        Class {
            name: "bit 63 stuck over one slice",
            hardware: true,
            prepare: no_prepare,
            inject: |rng, block, _| loop {
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
            name: "a random bit stuck over one slice",
            hardware: true,
            prepare: no_prepare,
            inject: |rng, block, _| loop {
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
            name: "one byte lane garbled in 2-16 pieces",
            hardware: true,
            prepare: no_prepare,
            inject: |rng, block, _| {
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
            name: "random bytes over a range of 1-512 bytes",
            hardware: true,
            prepare: no_prepare,
            inject: |rng, block, _| {
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
            name: "a tail zeroed from an offset (partial copy)",
            hardware: false,
            prepare: no_prepare,
            inject: |rng, block, _| {
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
            name: "a stale block (the page's earlier KV)",
            hardware: false,
            prepare: no_prepare,
            inject: |rng, block, _| {
                fill_kv(rng, block);
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "another block's KV in this slot",
            hardware: false,
            prepare: no_prepare,
            inject: |_, block, other| {
                block.copy_from_slice(other);
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "two tokens swapped",
            hardware: false,
            prepare: no_prepare,
            inject: |rng, block, _| {
                let (layer, head, a, b) = two_tokens(rng);
                swap_cells(block, layer, head, a, b);
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "two tokens differing only in their top bytes, swapped",
            hardware: false,
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
            inject: |_, block, _| {
                swap_cells_differing_in(block, !(0xffu64 << 56));
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "two tokens differing only in bit 63 of each piece, swapped",
            hardware: false,
            prepare: |rng, block| {
                let (layer, head, a, b) = two_tokens(rng);
                for p in 0..PIECES {
                    let x = piece(block, at(layer, head, a, p));
                    set_piece(block, at(layer, head, b, p), x ^ (1 << 63));
                }
            },
            inject: |_, block, _| {
                swap_cells_differing_in(block, !(1u64 << 63));
                0
            },
            weighted_misses: Some(|_| true),
        },
        Class {
            name: "heads permuted (HND written as NHD)",
            hardware: false,
            prepare: no_prepare,
            inject: |rng, block, _| {
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
            name: "a GQA replica's head never sent (stale)",
            hardware: false,
            prepare: no_prepare,
            inject: |rng, block, _| {
                let (layer, head) = (rng.below(LAYERS as u64) as usize, rng.below(HEADS as u64) as usize);
                let start = at(layer, head, 0, 0);
                fill_kv(rng, &mut block[start..start + SLICE_BYTES]);
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "K and V swapped",
            hardware: false,
            prepare: no_prepare,
            inject: |rng, block, _| {
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
            name: "a layer written twice (the next one never)",
            hardware: false,
            prepare: no_prepare,
            inject: |_, block, _| {
                let (first, second) = block.split_at_mut(LAYER_BYTES);
                second[..LAYER_BYTES].copy_from_slice(first);
                0
            },
            weighted_misses: None,
        },
        Class {
            name: "values of one token negated",
            hardware: false,
            prepare: no_prepare,
            inject: |rng, block, _| {
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
            name: "fp8 bytes where bf16 was expected",
            hardware: false,
            prepare: no_prepare,
            inject: |rng, block, _| {
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
    ]
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

/// The block checksum of `block` at position `q` by the crate's own
/// arithmetic, slice by slice.
pub fn direct_checksum(block: &[u8], q: u64, algorithm: Algorithm) -> u64 {
    let mut pieces = vec![0u64; TOKENS * PIECES];
    let mut total = 0u64;
    for (layer, &layer_number) in LAYER_NUMBERS.iter().enumerate() {
        for head in 0..HEADS {
            let start = at(layer, head, 0, 0);
            for (i, value) in pieces.iter_mut().enumerate() {
                *value = piece(block, start + 8 * i);
            }
            let first_index = q * (TOKENS * PIECES) as u64;
            let slice = weighted_run(&pieces, first_index, algorithm);
            total = total.wrapping_add(slice_weight(layer_number, head as u32).wrapping_mul(slice));
        }
    }
    total
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
/// random position; per algorithm.
pub fn run_direct(rng: &mut Rng, class: &Class, trials: u64) -> [Tally; 2] {
    let mut tallies = [Tally::default(); 2];
    let mut block = vec![0u8; BLOCK_BYTES];
    let mut other = vec![0u8; BLOCK_BYTES];
    for _ in 0..trials {
        fill_kv(rng, &mut block);
        fill_kv(rng, &mut other);
        (class.prepare)(rng, &mut block);
        let q = rng.below(1 << 16);
        let clean = ALGORITHMS.map(|a| direct_checksum(&block, q, a));
        let changed = (class.inject)(rng, &mut block, &other);
        for (i, &algorithm) in ALGORITHMS.iter().enumerate() {
            let missed = direct_checksum(&block, q, algorithm) == clean[i];
            let expected = expected_miss(class, algorithm, changed);
            tallies[i].add(missed, expected);
        }
    }
    tallies
}

/// A worker (host, or device `device`) of `algorithm` over a cross-layer
/// cache of `num_blocks` blocks at `address`: [block][layer][head][token][cell].
pub fn catalogue_worker(device: Option<u32>, algorithm: Algorithm, address: u64, num_blocks: usize) -> Worker {
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
            length: (num_blocks * BLOCK_BYTES) as u64,
        })
        .unwrap();
    worker.add_group(0, TOKENS as u32).unwrap();
    for (layer, &layer_number) in LAYER_NUMBERS.iter().enumerate() {
        worker
            .add_layer(LayerSpec {
                group_id: 0,
                layer_number,
                first_head: 0,
                num_heads: HEADS as u32,
                replica: ReplicaKey {
                    replicas: 1,
                    replica_index: 0,
                },
                num_blocks: num_blocks as u32,
                kernel_blocks: 1,
                tokens_per_kernel_block: TOKENS as u32,
                segments: vec![Segment {
                    address: address + (layer * LAYER_BYTES) as u64,
                    block_stride: BLOCK_BYTES as i64,
                    kernel_block_stride: 0,
                    head_stride: SLICE_BYTES as i64,
                    token_stride: CELL_BYTES as i64,
                    bytes_per_token: CELL_BYTES as u32,
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

/// What WEIGHTED (per `class`, given `inject`'s count) or MIXED (never) is
/// expected to miss.
pub fn expected_miss(class: &Class, algorithm: Algorithm, changed: usize) -> Option<bool> {
    match algorithm {
        Algorithm::Mixed => Some(false),
        Algorithm::Weighted => class.weighted_misses.map(|rule| rule(changed)),
    }
}
