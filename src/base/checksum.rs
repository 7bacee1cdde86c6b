//! The arithmetic of SPEC sections 2, 3 and 12, in one place.
//!
//! A slice's checksum is `sum_j f(x_j) * (2j + 1)` over its pieces, and a
//! block's is `sum m * s` over slices with `m = 2 * (layer * H + head) + 1`.
//! `f` is the identity for [`Algorithm::Weighted`], [`mix`] for
//! [`Algorithm::Mixed`] and [`mix2`] for [`Algorithm::Mixed2`]. All
//! arithmetic is modulo 2^64 (wrapping), so any order of accumulation gives
//! the same value.

/// Bytes per piece: a piece is 8 bytes read as a little-endian `u64`
/// (SPEC section 1), except in a cell whose bytes are a multiple of 4 and
/// not of 8.
pub(crate) const PIECE_BYTES: u64 = 8;

/// Bytes per piece of a cell whose bytes are a multiple of 4 and not of 8
/// (SPEC section 1): 4 bytes read as a little-endian `u32`, zero-extended.
pub(crate) const NARROW_PIECE_BYTES: u64 = 4;

/// The bytes of each piece of a cell of `cell_bytes` bytes (SPEC section
/// 1): [`PIECE_BYTES`] where they are a multiple of 8, else
/// [`NARROW_PIECE_BYTES`]; `None` for a size of neither kind (or 0).
pub fn piece_bytes_of(cell_bytes: u64) -> Option<u64> {
    if cell_bytes == 0 {
        None
    } else if cell_bytes.is_multiple_of(PIECE_BYTES) {
        Some(PIECE_BYTES)
    } else if cell_bytes.is_multiple_of(NARROW_PIECE_BYTES) {
        Some(NARROW_PIECE_BYTES)
    } else {
        None
    }
}

/// `H` of docs/SPEC.md#3-block-checksum: no layer may have more heads than this.
pub(crate) const MAX_KV_HEADS_PER_LAYER: u64 = 65536;

/// Which function each piece passes through before it is weighted (SPEC
/// section 12). Numbered as `KVCS_ALGORITHM_*` in the C API and in records
/// and payloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// SPEC sections 2-3 as first defined: `f(x) = x`. vLLM computes this one.
    Weighted,
    /// Each piece mixed by [`mix`] first (SPEC section 12), as kvcsum 0.2
    /// computed by default. Kept so that a worker can still verify against
    /// a 0.2 peer; it has a fixed differential (a piece XORed with
    /// `0x8000000080000000` always changes `f` by the same amount), so
    /// structured faults can cancel (SPEC section 13).
    Mixed,
    /// Each piece mixed by [`mix2`] first: no fixed differential, no
    /// structural blind spot (SPEC sections 12-13). The default.
    #[default]
    Mixed2,
}

impl Algorithm {
    /// Every algorithm, in the order of their numbers.
    pub fn all() -> [Algorithm; 3] {
        [Algorithm::Weighted, Algorithm::Mixed, Algorithm::Mixed2]
    }

    /// The algorithm's number (`KVCS_ALGORITHM_*`): 1 weighted, 2 mixed,
    /// 3 mixed2.
    pub fn code(self) -> u32 {
        match self {
            Algorithm::Weighted => 1,
            Algorithm::Mixed => 2,
            Algorithm::Mixed2 => 3,
        }
    }

    /// The algorithm numbered `code` (see [`Algorithm::code`]), or `None`.
    pub fn from_code(code: u64) -> Option<Algorithm> {
        match code {
            1 => Some(Algorithm::Weighted),
            2 => Some(Algorithm::Mixed),
            3 => Some(Algorithm::Mixed2),
            _ => None,
        }
    }

    /// Its name, as the C constants have it: "WEIGHTED", "MIXED" or "MIXED2".
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Weighted => "WEIGHTED",
            Algorithm::Mixed => "MIXED",
            Algorithm::Mixed2 => "MIXED2",
        }
    }

    /// `f` of the algorithm (SPEC section 12) applied to one piece: the
    /// identity, [`mix`] or [`mix2`].
    #[inline]
    pub fn piece(self, x: u64) -> u64 {
        match self {
            Algorithm::Weighted => x,
            Algorithm::Mixed => mix(x),
            Algorithm::Mixed2 => mix2(x),
        }
    }
}

/// What the known algorithm numbers are, for messages: "1 (weighted), 2
/// (mixed) or 3 (mixed2)".
pub(crate) const KNOWN_ALGORITHMS: &str = "1 (weighted), 2 (mixed) or 3 (mixed2)";

/// The odd multiplier `C` of the MIXED algorithm's `f`
/// (docs/SPEC.md#12-the-mixed-algorithm): 2^64 divided by the golden ratio,
/// rounded to odd.
pub const MIX_MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;

/// The mixing function of SPEC section 12: `g = (x ^ (x >> 32)) * C`,
/// `f = g ^ (g >> 32)`. Each step is a bijection of 64-bit words (an
/// xorshift, a product by an odd number), so `f` is one: a changed piece
/// always changes `f(x)`. The first fold lets the product carry a piece's
/// high half into every bit; the second brings the product's high half
/// back into the low bits, so that an error's lowest changed bit is no
/// longer its lowest bit in the sum (the 2-adic blind spot of
/// [`Algorithm::Weighted`]). On a GPU it is one 64-bit product (three
/// 32-bit multiply-adds) and two 32-bit XORs; shifts by 32 move words.
#[inline(always)]
pub fn mix(x: u64) -> u64 {
    let g = (x ^ (x >> 32)).wrapping_mul(MIX_MULTIPLIER);
    g ^ (g >> 32)
}

/// The odd 32-bit multiplier `K1` of the MIXED2 algorithm's first round
/// (docs/SPEC.md#12-the-mixing-functions).
pub const MIX2_MULTIPLIER_1: u32 = 0x9E37_79B1;
/// The odd 32-bit multiplier `K2` of the MIXED2 algorithm's second round.
pub const MIX2_MULTIPLIER_2: u32 = 0x85EB_CA77;
/// The odd 32-bit multiplier `K3` of the MIXED2 algorithm's third round.
pub const MIX2_MULTIPLIER_3: u32 = 0xC2B2_AE3D;

/// `K1, K2, K3`, one per round of [`mix2`].
pub(crate) const MIX2_MULTIPLIERS: [u32; 3] = [MIX2_MULTIPLIER_1, MIX2_MULTIPLIER_2, MIX2_MULTIPLIER_3];

/// The MIXED2 algorithm's `f` (SPEC section 12): three rounds on the halves
/// `(lo, hi)` of `x`. A round multiplies `lo` by an odd 32-bit `K` into a
/// 64-bit product `p` and adds `hi` to `p`'s high half, then swaps the
/// halves: `(lo, hi) -> (hi + high32(p), low32(p))`, which is
/// [`mix2_round`]. After the second and the third round the high half is
/// XORed into the low one (a fold, `v ^ (v >> 32)`).
///
/// Each step is a bijection of 64-bit words (`lo * K mod 2^32` is undone by
/// `K`'s inverse, which then gives `high32(p)` and so `hi`; a fold is its
/// own inverse), so `f` is one, and `f(0) = 0`. Unlike [`mix`] it has no
/// fixed differential: for every XOR pattern `e` the difference
/// `f(x ^ e) - f(x)` is spread over its low 32 bits (tests/it/avalanche.rs
/// measures every 1- and 2-bit pattern, every set of element sign bits and
/// byte lanes, and random ones). A round is one 32x32->64 multiply-add: one
/// `IMAD.WIDE.U32` on a GPU, one `vpmuludq` and one add per four pieces
/// with AVX2 (using `lo * K + (hi << 32) = v + lo * (K - 1)`).
#[inline(always)]
pub fn mix2(x: u64) -> u64 {
    let [k1, k2, k3] = MIX2_MULTIPLIERS;
    let v = mix2_round(x, k1);
    let v = mix2_round(v, k2);
    let v = v ^ (v >> 32);
    let v = mix2_round(v, k3);
    v ^ (v >> 32)
}

/// One round of [`mix2`]: `p = lo * k` (64-bit), then `(lo, hi) -> (hi +
/// high32(p), low32(p))`, i.e. `((hi << 32) + p)` with its halves swapped.
#[inline(always)]
pub fn mix2_round(v: u64, k: u32) -> u64 {
    let product = (v & 0xFFFF_FFFF) * k as u64;
    (v & 0xFFFF_FFFF_0000_0000).wrapping_add(product).rotate_left(32)
}

/// A function `f` of SPEC section 12, fixed at compile time, applied to one
/// piece or to eight consecutive pieces (one cache line) at a time, so that
/// an engine can give the eight-piece step a SIMD form. The methods take a
/// value of the type, so that a SIMD form can be a type whose values exist
/// only where the CPU runs its instructions (the host engine's
/// `host/lanes.rs`); the portable forms are unit structs.
pub(crate) trait PieceFn: Copy {
    /// `f(x)`.
    fn value(self, x: u64) -> u64;

    /// `f` of each of the eight pieces.
    #[inline(always)]
    fn lanes(self, pieces: &[u64; 8]) -> [u64; 8] {
        pieces.map(|x| self.value(x))
    }

    /// For each chunk of eight pieces in turn: `sum[l] += f(chunk[l])`,
    /// then `running[l] += sum[l]` (the lane sums of [`run_checksum`] and
    /// of the host engine's rows). `pieces.len()` is a multiple of 8.
    #[inline(always)]
    // One index walks the lane arrays in step; this is what vectorises.
    #[allow(clippy::needless_range_loop)]
    fn accumulate(self, pieces: &[u64], sum: &mut [u64; 8], running: &mut [u64; 8]) {
        debug_assert!(pieces.len().is_multiple_of(8));
        for chunk in pieces.chunks_exact(8) {
            let values = self.lanes(chunk.try_into().expect("chunks of 8 pieces"));
            for lane in 0..8 {
                sum[lane] = sum[lane].wrapping_add(values[lane]);
                running[lane] = running[lane].wrapping_add(sum[lane]);
            }
        }
    }
}

/// `f` of WEIGHTED: the identity.
#[derive(Clone, Copy)]
pub(crate) struct Identity;

impl PieceFn for Identity {
    #[inline(always)]
    fn value(self, x: u64) -> u64 {
        x
    }
}

/// `f` of MIXED: [`mix`].
#[derive(Clone, Copy)]
pub(crate) struct Mix;

impl PieceFn for Mix {
    #[inline(always)]
    fn value(self, x: u64) -> u64 {
        mix(x)
    }
}

/// `f` of MIXED2: [`mix2`], portable (the host engine has SIMD forms:
/// `host/lanes.rs`).
#[derive(Clone, Copy)]
pub(crate) struct Mix2;

impl PieceFn for Mix2 {
    #[inline(always)]
    fn value(self, x: u64) -> u64 {
        mix2(x)
    }
}

/// The odd weight `m` of slice (layer, head) in a block checksum.
#[inline]
pub fn slice_weight(layer_number: u32, head: u32) -> u64 {
    let slice_number = (layer_number as u64)
        .wrapping_mul(MAX_KV_HEADS_PER_LAYER)
        .wrapping_add(head as u64);
    slice_number.wrapping_mul(2).wrapping_add(1)
}

/// The odd weight `2j + 1` of the piece with request-wide index `j`.
#[inline]
pub fn piece_weight(piece_index: u64) -> u64 {
    piece_index.wrapping_mul(2).wrapping_add(1)
}

/// The slice-checksum contribution of a run of pieces whose indices are
/// consecutive from `first_index`: `sum_i f(pieces[i]) * (2 * (first_index + i) + 1)`,
/// `f` that of `algorithm`.
#[inline]
pub fn weighted_run(pieces: &[u64], first_index: u64, algorithm: Algorithm) -> u64 {
    match algorithm {
        Algorithm::Weighted => run_checksum(Identity, pieces, first_index),
        Algorithm::Mixed => run_checksum(Mix, pieces, first_index),
        Algorithm::Mixed2 => run_checksum(Mix2, pieces, first_index),
    }
}

/// [`weighted_run`] with `f` fixed at compile time.
///
/// Computed as `(2 * first_index + 1) * S0 + 2 * S1` with `S0 = sum f(x_i)` and
/// `S1 = sum i * f(x_i)`; `S1` comes from running sums (adds only), which
/// vectorises and keeps pace with memory.
#[inline(always)]
pub(crate) fn run_checksum<F: PieceFn>(f: F, pieces: &[u64], first_index: u64) -> u64 {
    let (sum, index_weighted) = run_sums(f, pieces);
    piece_weight(first_index)
        .wrapping_mul(sum)
        .wrapping_add(index_weighted.wrapping_mul(2))
}

/// `(sum f(x_i), sum i * f(x_i))` over `pieces`, modulo 2^64.
#[inline(always)]
fn run_sums<F: PieceFn>(f: F, pieces: &[u64]) -> (u64, u64) {
    const LANES: usize = 8;
    // Lane `l` sees pieces `k * LANES + l`. After `steps` steps its `sum` is
    // `sum_k x` and its `running` is `sum_k x * (steps - k)`, so
    // `sum_k k * x = steps * sum - running`.
    let mut sum = [0u64; LANES];
    let mut running = [0u64; LANES];
    let chunks = pieces.chunks_exact(LANES);
    let tail = chunks.remainder();
    let steps = chunks.len() as u64;
    f.accumulate(&pieces[..pieces.len() - tail.len()], &mut sum, &mut running);
    let mut total = 0u64;
    let mut index_weighted = 0u64;
    for lane in 0..LANES {
        let lane_k_weighted = steps.wrapping_mul(sum[lane]).wrapping_sub(running[lane]);
        // Piece index i = k * LANES + lane.
        index_weighted = index_weighted
            .wrapping_add(lane_k_weighted.wrapping_mul(LANES as u64))
            .wrapping_add((lane as u64).wrapping_mul(sum[lane]));
        total = total.wrapping_add(sum[lane]);
    }
    let tail_start = steps * LANES as u64;
    for (offset, &piece) in tail.iter().enumerate() {
        let piece = f.value(piece);
        total = total.wrapping_add(piece);
        index_weighted = index_weighted.wrapping_add(piece.wrapping_mul(tail_start + offset as u64));
    }
    (total, index_weighted)
}

#[cfg(test)]
mod tests;
