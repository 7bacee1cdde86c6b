//! The arithmetic of SPEC sections 2 and 3, in one place.
//!
//! A slice's checksum is `sum_j x_j * (2j + 1)` over its pieces, and a block's
//! is `sum m * s` over slices with `m = 2 * (layer * H + head) + 1`. All
//! arithmetic is modulo 2^64 (wrapping), so any order of accumulation gives the
//! same value.

/// Bytes per piece: a piece is 8 bytes read as a little-endian `u64`.
pub(crate) const PIECE_BYTES: u64 = 8;

/// The algorithm of SPEC sections 2 and 3 as first defined (`KVCS_ALGORITHM_WEIGHTED`).
pub(crate) const ALGORITHM_WEIGHTED: u32 = 1;

/// The algorithm ids this library knows.
pub(crate) const KNOWN_ALGORITHMS: [u32; 1] = [ALGORITHM_WEIGHTED];

/// `H` of docs/SPEC.md#3-block-checksum: no layer may have more heads than this.
pub(crate) const MAX_KV_HEADS_PER_LAYER: u64 = 65536;

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
/// consecutive from `first_index`: `sum_i pieces[i] * (2 * (first_index + i) + 1)`.
///
/// Computed as `(2 * first_index + 1) * S0 + 2 * S1` with `S0 = sum x_i` and
/// `S1 = sum i * x_i`; `S1` comes from running sums (adds only), which
/// vectorises and keeps pace with memory.
#[inline]
pub fn weighted_run(pieces: &[u64], first_index: u64) -> u64 {
    let (sum, index_weighted) = run_sums(pieces);
    piece_weight(first_index)
        .wrapping_mul(sum)
        .wrapping_add(index_weighted.wrapping_mul(2))
}

/// `(sum x_i, sum i * x_i)` over `pieces`, modulo 2^64.
#[inline]
fn run_sums(pieces: &[u64]) -> (u64, u64) {
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
            sum[lane] = sum[lane].wrapping_add(chunk[lane]);
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
            let plain = pieces.iter().enumerate().fold(0u64, |acc, (i, &x)| {
                acc.wrapping_add(x.wrapping_mul(piece_weight(first.wrapping_add(i as u64))))
            });
            assert_eq!(weighted_run(&pieces, first), plain, "len {len}");
        }
    }

    #[test]
    fn weights_are_odd() {
        assert_eq!(slice_weight(0, 0), 1);
        assert_eq!(slice_weight(1, 0), 2 * 65536 + 1);
        assert_eq!(slice_weight(3, 7) % 2, 1);
        assert_eq!(piece_weight(5), 11);
    }
}
