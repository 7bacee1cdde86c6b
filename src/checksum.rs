//! The arithmetic of SPEC sections 2, 3 and 12, in one place.
//!
//! A slice's checksum is `sum_j f(x_j) * (2j + 1)` over its pieces, and a
//! block's is `sum m * s` over slices with `m = 2 * (layer * H + head) + 1`.
//! `f` is the identity for [`Algorithm::Weighted`] and [`mix`] for
//! [`Algorithm::Mixed`]. All arithmetic is modulo 2^64 (wrapping), so any
//! order of accumulation gives the same value.

/// Bytes per piece: a piece is 8 bytes read as a little-endian `u64`.
pub(crate) const PIECE_BYTES: u64 = 8;

/// `H` of docs/SPEC.md#3-block-checksum: no layer may have more heads than this.
pub(crate) const MAX_KV_HEADS_PER_LAYER: u64 = 65536;

/// Which function each piece passes through before it is weighted (SPEC
/// section 12). Numbered as `KVCS_ALGORITHM_*` in the C API and in records
/// and payloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// SPEC sections 2-3 as first defined: `f(x) = x`. vLLM computes this one.
    Weighted,
    /// Each piece mixed by [`mix`] first: no structural blind spot (SPEC
    /// section 13). The default.
    #[default]
    Mixed,
}

impl Algorithm {
    /// The algorithm's number (`KVCS_ALGORITHM_*`): 1 weighted, 2 mixed.
    pub fn code(self) -> u32 {
        match self {
            Algorithm::Weighted => 1,
            Algorithm::Mixed => 2,
        }
    }

    /// The algorithm numbered `code` (see [`Algorithm::code`]), or `None`.
    pub fn from_code(code: u64) -> Option<Algorithm> {
        match code {
            1 => Some(Algorithm::Weighted),
            2 => Some(Algorithm::Mixed),
            _ => None,
        }
    }

    /// Its name, as the C constants have it: "WEIGHTED" or "MIXED".
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Weighted => "WEIGHTED",
            Algorithm::Mixed => "MIXED",
        }
    }
}

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

/// `f` of `algorithm` at compile time: `mix` when `MIXED`, else the identity.
#[inline(always)]
pub(crate) fn piece_value<const MIXED: bool>(x: u64) -> u64 {
    if MIXED {
        mix(x)
    } else {
        x
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
        Algorithm::Weighted => run_checksum::<false>(pieces, first_index),
        Algorithm::Mixed => run_checksum::<true>(pieces, first_index),
    }
}

/// [`weighted_run`] with `f` fixed at compile time.
///
/// Computed as `(2 * first_index + 1) * S0 + 2 * S1` with `S0 = sum f(x_i)` and
/// `S1 = sum i * f(x_i)`; `S1` comes from running sums (adds only), which
/// vectorises and keeps pace with memory.
#[inline(always)]
pub(crate) fn run_checksum<const MIXED: bool>(pieces: &[u64], first_index: u64) -> u64 {
    let (sum, index_weighted) = run_sums::<MIXED>(pieces);
    piece_weight(first_index)
        .wrapping_mul(sum)
        .wrapping_add(index_weighted.wrapping_mul(2))
}

/// `(sum f(x_i), sum i * f(x_i))` over `pieces`, modulo 2^64.
#[inline(always)]
fn run_sums<const MIXED: bool>(pieces: &[u64]) -> (u64, u64) {
    const LANES: usize = 8;
    // Lane `l` sees pieces `k * LANES + l`. After `steps` steps its `sum` is
    // `sum_k x` and its `running` is `sum_k x * (steps - k)`, so
    // `sum_k k * x = steps * sum - running`.
    let mut sum = [0u64; LANES];
    let mut running = [0u64; LANES];
    let chunks = pieces.chunks_exact(LANES);
    let tail = chunks.remainder();
    let steps = chunks.len() as u64;
    for chunk in chunks {
        for lane in 0..LANES {
            sum[lane] = sum[lane].wrapping_add(piece_value::<MIXED>(chunk[lane]));
            running[lane] = running[lane].wrapping_add(sum[lane]);
        }
    }
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
        let piece = piece_value::<MIXED>(piece);
        total = total.wrapping_add(piece);
        index_weighted = index_weighted.wrapping_add(piece.wrapping_mul(tail_start + offset as u64));
    }
    (total, index_weighted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_run_is_the_plain_sum() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for len in 0..70usize {
            let pieces: Vec<u64> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state
                })
                .collect();
            let first = state >> 3;
            for algorithm in [Algorithm::Weighted, Algorithm::Mixed] {
                let f = |x: u64| if algorithm == Algorithm::Mixed { mix(x) } else { x };
                let plain = pieces.iter().enumerate().fold(0u64, |acc, (i, &x)| {
                    acc.wrapping_add(f(x).wrapping_mul(piece_weight(first.wrapping_add(i as u64))))
                });
                assert_eq!(
                    weighted_run(&pieces, first, algorithm),
                    plain,
                    "len {len}, {algorithm:?}"
                );
            }
        }
    }

    /// `mix` undoes step by step: it is a bijection (SPEC section 12).
    #[test]
    fn mix_is_a_bijection() {
        // The inverse of the odd multiplier modulo 2^64, by Newton's iteration.
        let mut inverse = MIX_MULTIPLIER;
        for _ in 0..6 {
            inverse = inverse.wrapping_mul(2u64.wrapping_sub(MIX_MULTIPLIER.wrapping_mul(inverse)));
        }
        assert_eq!(MIX_MULTIPLIER.wrapping_mul(inverse), 1);
        let unmix = |f: u64| {
            // x ^ (x >> 32) is its own inverse.
            let g = f ^ (f >> 32);
            let u = g.wrapping_mul(inverse);
            u ^ (u >> 32)
        };
        let mut state = 0x0123_4567_89ab_cdefu64;
        for _ in 0..10_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            assert_eq!(unmix(mix(state)), state);
        }
        assert_eq!(mix(0), 0);
    }

    #[test]
    fn weights_are_odd() {
        assert_eq!(slice_weight(0, 0), 1);
        assert_eq!(slice_weight(1, 0), 2 * 65536 + 1);
        assert_eq!(slice_weight(3, 7) % 2, 1);
        assert_eq!(piece_weight(5), 11);
    }
}
