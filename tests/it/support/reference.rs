//! Logical KV and the deliberately naive reference of SPEC sections 2-3
//! (and the per-thread algorithm the reference and the helpers' workers use).

use std::cell::Cell;

pub use kvcsum::Algorithm;

use super::Rng;

/// `H` of SPEC section 3, written here again so that the reference does not
/// depend on the crate's constant.
pub const HEADS_PER_LAYER: u64 = 65536;

/// The shape of a logical KV cache of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Model-wide number of the first layer.
    pub first_layer: u32,
    /// Layers `first_layer .. first_layer + num_layers`.
    pub num_layers: u32,
    /// Global number of head 0 of this cache (non-zero for a layer's second
    /// cache, such as an indexer, whose heads follow the first cache's).
    pub first_head: u32,
    /// KV heads of the whole model (across TP).
    pub total_kv_heads: u32,
    /// K bytes of a cell (the whole latent row for MLA); a multiple of 8,
    /// or of 4 in a cell of 4-byte pieces (SPEC section 1).
    pub k_bytes: u32,
    /// V bytes of a cell (0 for MLA; the scales of an fp8 indexer's keys);
    /// a multiple of 8, or of 4 in a cell of 4-byte pieces.
    pub v_bytes: u32,
    /// Tokens whose KV the request holds.
    pub num_tokens: u64,
}

impl KvShape {
    /// A GQA cache: `head_bytes` of K and of V per head and token.
    pub fn gqa(num_layers: u32, total_kv_heads: u32, head_bytes: u32, num_tokens: u64) -> KvShape {
        KvShape {
            first_layer: 0,
            num_layers,
            first_head: 0,
            total_kv_heads,
            k_bytes: head_bytes,
            v_bytes: head_bytes,
            num_tokens,
        }
    }

    /// An MLA-like cache: one latent head of `latent_bytes` per token, no V.
    pub fn mla(num_layers: u32, latent_bytes: u32, num_tokens: u64) -> KvShape {
        KvShape {
            first_layer: 0,
            num_layers,
            first_head: 0,
            total_kv_heads: 1,
            k_bytes: latent_bytes,
            v_bytes: 0,
            num_tokens,
        }
    }

    /// Bytes of one cell (K then V).
    pub fn cell_bytes(&self) -> u32 {
        self.k_bytes + self.v_bytes
    }
}

/// A request's logical KV: random, never-zero cell bytes per (layer, head,
/// token), independent of any memory layout.
#[derive(Debug, Clone)]
pub struct LogicalKv {
    /// Its shape.
    pub shape: KvShape,
    /// `[layer][head][token][cell byte]`.
    cells: Vec<u8>,
}

impl LogicalKv {
    /// Fresh random KV of `shape`.
    pub fn random(rng: &mut Rng, shape: KvShape) -> LogicalKv {
        let piece = naive_piece_bytes(shape.cell_bytes());
        assert!(
            shape.k_bytes > 0 && shape.k_bytes.is_multiple_of(piece) && shape.v_bytes.is_multiple_of(piece),
            "k_bytes {} and v_bytes {} must be multiples of the cell's {piece}-byte pieces",
            shape.k_bytes,
            shape.v_bytes
        );
        let len = shape.num_layers as usize
            * shape.total_kv_heads as usize
            * shape.num_tokens as usize
            * shape.cell_bytes() as usize;
        let mut cells = vec![0u8; len];
        rng.fill_nonzero(&mut cells);
        LogicalKv { shape, cells }
    }

    /// Bytes of one cell.
    pub fn cell_bytes(&self) -> u32 {
        self.shape.cell_bytes()
    }

    /// Tokens whose KV the request holds.
    pub fn num_tokens(&self) -> u64 {
        self.shape.num_tokens
    }

    /// Model-wide layer numbers, in order.
    pub fn layer_numbers(&self) -> Vec<u32> {
        (0..self.shape.num_layers).map(|i| self.shape.first_layer + i).collect()
    }

    /// Global head numbers, in order.
    pub fn heads(&self) -> Vec<u32> {
        (0..self.shape.total_kv_heads)
            .map(|i| self.shape.first_head + i)
            .collect()
    }

    fn cell_start(&self, layer_number: u32, head: u32, token: u64) -> usize {
        let s = &self.shape;
        // u64, so that layer numbers up to u32::MAX work.
        let first_layer = s.first_layer as u64;
        assert!(
            (first_layer..first_layer + s.num_layers as u64).contains(&(layer_number as u64)),
            "layer_number {layer_number} is not in this KV"
        );
        let first_head = s.first_head as u64;
        assert!(
            (first_head..first_head + s.total_kv_heads as u64).contains(&(head as u64)),
            "head {head} is not in this KV"
        );
        assert!(
            token < s.num_tokens,
            "token {token} is not below num_tokens {}",
            s.num_tokens
        );
        let layer = (layer_number - s.first_layer) as usize;
        let head = (head - s.first_head) as usize;
        ((layer * s.total_kv_heads as usize + head) * s.num_tokens as usize + token as usize) * s.cell_bytes() as usize
    }

    /// The cell of (layer, global head, token): K bytes then V bytes.
    pub fn cell(&self, layer_number: u32, head: u32, token: u64) -> &[u8] {
        let start = self.cell_start(layer_number, head, token);
        &self.cells[start..start + self.cell_bytes() as usize]
    }

    /// The cell of (layer, global head, token), writable.
    pub fn cell_mut(&mut self, layer_number: u32, head: u32, token: u64) -> &mut [u8] {
        let start = self.cell_start(layer_number, head, token);
        let len = self.cell_bytes() as usize;
        &mut self.cells[start..start + len]
    }
}

thread_local! {
    static ALGORITHM: Cell<Algorithm> = const { Cell::new(Algorithm::Mixed2) };
}

/// The algorithm of this thread's tests: the naive reference computes it
/// and the workers the helpers make ([`host_worker`], the GPU tests'
/// device workers) are set to it. MIXED2, the library's default, unless a
/// test runs its cases under each ([`for_each_algorithm`]).
pub fn algorithm() -> Algorithm {
    ALGORITHM.with(Cell::get)
}

/// Runs `body` once per algorithm, WEIGHTED, MIXED then MIXED2, with
/// [`algorithm`] set to it; back to MIXED2 after.
pub fn for_each_algorithm(mut body: impl FnMut(Algorithm)) {
    for algorithm in [Algorithm::Weighted, Algorithm::Mixed, Algorithm::Mixed2] {
        ALGORITHM.with(|cell| cell.set(algorithm));
        body(algorithm);
    }
    ALGORITHM.with(|cell| cell.set(Algorithm::Mixed2));
}

/// Runs `body` with [`algorithm`] set to `algorithm`; back to MIXED2 after.
pub fn with_algorithm<T>(algorithm: Algorithm, body: impl FnOnce() -> T) -> T {
    ALGORITHM.with(|cell| cell.set(algorithm));
    let out = body();
    ALGORITHM.with(|cell| cell.set(Algorithm::Mixed2));
    out
}

/// `f` of SPEC section 12, written here again from the definition: WEIGHTED
/// takes a piece as it is; MIXED folds its high half into the low one,
/// multiplies by the constant and folds the product's high half back;
/// MIXED2 runs three rounds on the 32-bit halves (each: the low half times
/// the round's multiplier as a 64-bit product, the high half added to the
/// product's high half, the halves swapped), folding the high half into
/// the low one after the second and the third.
pub fn naive_piece(algorithm: Algorithm, x: u64) -> u64 {
    match algorithm {
        Algorithm::Weighted => x,
        Algorithm::Mixed => {
            let folded = x ^ (x >> 32);
            let product = folded.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            product ^ (product >> 32)
        }
        Algorithm::Mixed2 => {
            let (mut lo, mut hi) = (x as u32, (x >> 32) as u32);
            for (round, k) in [0x9E37_79B1u32, 0x85EB_CA77, 0xC2B2_AE3D].into_iter().enumerate() {
                let product = lo as u64 * k as u64;
                let new_lo = hi.wrapping_add((product >> 32) as u32);
                let new_hi = product as u32;
                lo = new_lo;
                hi = new_hi;
                if round >= 1 {
                    lo ^= hi;
                }
            }
            ((hi as u64) << 32) | lo as u64
        }
    }
}

/// The bytes of each piece of a cell of `cell_bytes` (SPEC section 1): 8
/// where the cell is a multiple of 8 bytes, 4 where it is a multiple of 4
/// and not of 8. Panics on any other size.
pub fn naive_piece_bytes(cell_bytes: u32) -> u32 {
    if cell_bytes.is_multiple_of(8) {
        8
    } else {
        assert!(
            cell_bytes.is_multiple_of(4),
            "a cell of {cell_bytes} bytes has no pieces"
        );
        4
    }
}

/// Valid tokens of the block at `position`, straight from SPEC section 5.
pub fn naive_valid_tokens(num_tokens: u64, block_size: u32, position: u64) -> u32 {
    let start = position as u128 * block_size as u128;
    if start >= num_tokens as u128 {
        0
    } else {
        (num_tokens as u128 - start).min(block_size as u128) as u32
    }
}

/// The block checksum of SPEC sections 2-3 (and 12, under [`algorithm`])
/// over the given layers and global heads of `kv`, for tokens
/// `first_token .. first_token + valid_tokens`, computed the slow obvious
/// way, one piece at a time.
pub fn naive_block_checksum(
    kv: &LogicalKv,
    layer_numbers: &[u32],
    heads: &[u32],
    first_token: u64,
    valid_tokens: u32,
) -> u64 {
    let piece_bytes = naive_piece_bytes(kv.cell_bytes()) as usize;
    let pieces_per_token = (kv.cell_bytes() as usize / piece_bytes) as u64;
    let algorithm = algorithm();
    let mut block = 0u64;
    for &layer in layer_numbers {
        for &head in heads {
            let mut slice = 0u64;
            for token in first_token..first_token + valid_tokens as u64 {
                let cell = kv.cell(layer, head, token);
                for piece in 0..pieces_per_token {
                    // The piece's bytes as a little-endian unsigned number
                    // (zero-extended when it has 4 of them), byte by byte.
                    let at = piece as usize * piece_bytes;
                    let value = (0..piece_bytes).fold(0u64, |value, i| value | (cell[at + i] as u64) << (8 * i));
                    let x = naive_piece(algorithm, value);
                    let j = token.wrapping_mul(pieces_per_token).wrapping_add(piece);
                    let weight = j.wrapping_mul(2).wrapping_add(1);
                    slice = slice.wrapping_add(x.wrapping_mul(weight));
                }
            }
            let m = (layer as u64)
                .wrapping_mul(HEADS_PER_LAYER)
                .wrapping_add(head as u64)
                .wrapping_mul(2)
                .wrapping_add(1);
            block = block.wrapping_add(m.wrapping_mul(slice));
        }
    }
    block
}

/// The naive checksums of positions `first_position ..` (`num_positions` of
/// them) over the given layers and heads, with `block_size`-token blocks.
pub fn naive_positions(
    kv: &LogicalKv,
    layer_numbers: &[u32],
    heads: &[u32],
    block_size: u32,
    first_position: u64,
    num_positions: usize,
) -> Vec<u64> {
    (0..num_positions as u64)
        .map(|i| {
            let position = first_position + i;
            let valid = naive_valid_tokens(kv.num_tokens(), block_size, position);
            naive_block_checksum(kv, layer_numbers, heads, position * block_size as u64, valid)
        })
        .collect()
}

/// The full `c` (every layer and head of `kv`) of the given positions.
pub fn naive_full(kv: &LogicalKv, block_size: u32, first_position: u64, num_positions: usize) -> Vec<u64> {
    naive_positions(
        kv,
        &kv.layer_numbers(),
        &kv.heads(),
        block_size,
        first_position,
        num_positions,
    )
}

/// Element-wise wrapping sum.
pub fn add_values(total: &mut [u64], part: &[u64]) {
    assert_eq!(total.len(), part.len(), "value counts differ");
    for (t, p) in total.iter_mut().zip(part) {
        *t = t.wrapping_add(*p);
    }
}
