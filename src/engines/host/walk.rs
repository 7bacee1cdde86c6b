//! The walk of one (block position, layer) item over host memory, `f` of
//! SPEC section 12 fixed at compile time: [`item_checksum`], inlined into
//! each of its callers so that the AVX2 and AVX-512F builds
//! (`avx2.rs`, `avx512.rs`) build the whole walk with their instructions.

use crate::base::checksum::{piece_weight, run_checksum, slice_weight, PieceFn, NARROW_PIECE_BYTES, PIECE_BYTES};
use crate::inputs::layout::{Layer, Segment};
use crate::plan::Row;

/// `sum over heads of m * s` for one block position of one layer, `f` of
/// SPEC section 12 fixed at compile time (`F`). Inlined into its callers,
/// so that an AVX2 caller (`host/avx2.rs`) builds it with AVX2. The layer's
/// pieces are 8 bytes (see [`narrow_item_checksum`] for 4-byte ones).
#[inline(always)]
pub(super) fn item_checksum<F: PieceFn>(f: F, row: &Row, layer: &Layer, scratch: &mut Vec<RowSums>) -> u64 {
    debug_assert_eq!(layer.piece_bytes, PIECE_BYTES);
    token_runs(row, layer, |segment, tokens| {
        segment_heads(f, layer, segment, tokens, scratch)
    })
}

/// `visit`'s sum over the runs of `row`'s valid tokens that are
/// consecutive in one kernel block and numbered alike, segment by segment.
#[inline(always)]
fn token_runs(row: &Row, layer: &Layer, mut visit: impl FnMut(&Segment, &TokenRun) -> u64) -> u64 {
    let spec = &layer.spec;
    let per_kernel_block = spec.tokens_per_kernel_block;
    let mut sum = 0u64;
    let mut token = 0u32;
    // Under a placement (SPEC section 16) local slots are numbered by their
    // unit in the request: runs of slots whose numbers step alike.
    let placement = layer.placement;
    let index_stride = layer.pieces_per_token.wrapping_mul(placement.unit_step());
    // Walk the valid tokens kernel block by kernel block.
    while token < row.valid_tokens {
        let kernel_block = token / per_kernel_block;
        let first_slot = token % per_kernel_block;
        let count = placement.run_length(token, (per_kernel_block - first_slot).min(row.valid_tokens - token));
        let first_index = (row.first_token + placement.unit_offset(token)).wrapping_mul(layer.pieces_per_token);
        for (segment, &piece_offset) in spec.segments.iter().zip(&layer.segment_piece_offsets) {
            let base = segment.address as i64
                + row.block_id as i64 * segment.block_stride
                + kernel_block as i64 * segment.kernel_block_stride
                + first_slot as i64 * segment.token_stride;
            let tokens = TokenRun {
                address: base,
                count,
                first_index: first_index + piece_offset,
                index_stride,
            };
            sum = sum.wrapping_add(visit(segment, &tokens));
        }
        token += count;
    }
    sum
}

/// [`item_checksum`] of a layer of 4-byte pieces (a cell of a multiple of
/// 4 and not of 8 bytes, SPEC section 1): each piece a little-endian `u32`
/// zero-extended to 64 bits, then through `f`. Rows are widened into a
/// stack buffer and summed as runs of 8-byte pieces are, so the
/// arithmetic is `run_checksum`'s, the definition's.
pub(super) fn narrow_item_checksum<F: PieceFn>(f: F, row: &Row, layer: &Layer) -> u64 {
    debug_assert_eq!(layer.piece_bytes, NARROW_PIECE_BYTES);
    let spec = &layer.spec;
    token_runs(row, layer, |segment, tokens| {
        let pieces = (segment.bytes_per_token as u64 / NARROW_PIECE_BYTES) as usize;
        let mut widened = [0u64; NARROW_CHUNK];
        let mut sum = 0u64;
        for head in 0..spec.num_heads {
            let weight = slice_weight(spec.layer_number, spec.first_head + head);
            let mut slice = 0u64;
            for slot in 0..tokens.count {
                let address = tokens.address + head as i64 * segment.head_stride + slot as i64 * segment.token_stride;
                // SAFETY: the head is below `num_heads` and the slot below the
                // run's count, and registration checked that every (block,
                // kernel block, head, token) cell of this segment lies in a
                // registered region (readable host memory, by the promise of
                // `add_region`'s caller) at 4-byte aligned addresses.
                let cell = unsafe { std::slice::from_raw_parts(address as usize as *const u32, pieces) };
                let row_index = tokens
                    .first_index
                    .wrapping_add((slot as u64).wrapping_mul(tokens.index_stride));
                for (chunk, part) in cell.chunks(NARROW_CHUNK).enumerate() {
                    for (wide, &piece) in widened.iter_mut().zip(part) {
                        *wide = u32::from_le(piece) as u64;
                    }
                    let first = row_index.wrapping_add((chunk * NARROW_CHUNK) as u64);
                    slice = slice.wrapping_add(run_checksum(f, &widened[..part.len()], first));
                }
            }
            sum = sum.wrapping_add(weight.wrapping_mul(slice));
        }
        sum
    })
}

/// 4-byte pieces widened at a time by [`narrow_item_checksum`].
const NARROW_CHUNK: usize = 64;

/// `count` consecutive tokens of one kernel block in one segment: head 0's
/// first token at `address`, its first piece numbered `first_index`, each
/// next token's `index_stride` further (`P`, or `P` times the placement's
/// unit step).
struct TokenRun {
    address: i64,
    count: u32,
    first_index: u64,
    index_stride: u64,
}

/// `sum over heads of m * (the slice contribution of the tokens)` for one
/// segment.
///
/// Memory is read in the order it is laid out, so that the hardware
/// prefetchers stream it: heads outer when a head's tokens are closer
/// together than a token's heads (HND), tokens outer otherwise (NHD; reading
/// NHD heads outer ran at 0.6-0.7 of the read ceiling). Each (head, token)
/// row of pieces is added into per-head [`RowSums`], reduced once per head
/// rather than once per row.
#[inline(always)]
fn segment_heads<F: PieceFn>(
    f: F,
    layer: &Layer,
    segment: &Segment,
    tokens: &TokenRun,
    scratch: &mut Vec<RowSums>,
) -> u64 {
    let spec = &layer.spec;
    let pieces = (segment.bytes_per_token as u64 / PIECE_BYTES) as usize;
    let token_stride = segment.token_stride;
    let head_stride = segment.head_stride;
    let heads_outer = token_stride.unsigned_abs() <= head_stride.unsigned_abs();
    let weight = |head: u32| slice_weight(spec.layer_number, spec.first_head + head);
    let row = |head: u32, slot: u32| {
        // SAFETY: every call below passes a head below `num_heads` and a
        // slot below the run's count, and registration checked that every
        // (block, kernel block, head, token) cell of this segment lies in a
        // registered region, which the caller of `add_region` promised is
        // readable host memory.
        unsafe {
            host_pieces(
                tokens.address + head as i64 * head_stride + slot as i64 * token_stride,
                pieces as u64,
            )
        }
    };
    let slice_sum = |sums: &RowSums| sums.weighted(pieces as u64, tokens.first_index, tokens.index_stride);
    let mut sum = 0u64;
    if spec.segments.len() == 1
        && token_stride == segment.bytes_per_token as i64
        && tokens.index_stride == layer.pieces_per_token
    {
        // A head's tokens are one run of consecutive pieces.
        for head in 0..spec.num_heads {
            // SAFETY: as above; the run is the head's `count` cells.
            let run = unsafe {
                host_pieces(
                    tokens.address + head as i64 * head_stride,
                    (pieces * tokens.count as usize) as u64,
                )
            };
            sum = sum.wrapping_add(weight(head).wrapping_mul(run_checksum(f, run, tokens.first_index)));
        }
    } else if !pieces.is_multiple_of(LANES) {
        // Rows that do not fill whole lanes: reduce each row on its own.
        let row_index = |slot: u32| {
            tokens
                .first_index
                .wrapping_add((slot as u64).wrapping_mul(tokens.index_stride))
        };
        let row_sum =
            |head: u32, slot: u32| weight(head).wrapping_mul(run_checksum(f, row(head, slot), row_index(slot)));
        if heads_outer {
            for head in 0..spec.num_heads {
                for slot in 0..tokens.count {
                    sum = sum.wrapping_add(row_sum(head, slot));
                }
            }
        } else {
            for slot in 0..tokens.count {
                for head in 0..spec.num_heads {
                    sum = sum.wrapping_add(row_sum(head, slot));
                }
            }
        }
    } else if heads_outer {
        for head in 0..spec.num_heads {
            let mut sums = RowSums::default();
            // The next head's rows, one head ahead (see PREFETCH_TOKENS).
            let prefetch = head + 1 < spec.num_heads;
            for slot in 0..tokens.count {
                let pieces = row(head, slot);
                if prefetch {
                    prefetch_row(pieces, head_stride);
                }
                sums.add_row(f, pieces);
            }
            sum = sum.wrapping_add(weight(head).wrapping_mul(slice_sum(&sums)));
        }
    } else {
        scratch.clear();
        scratch.resize(spec.num_heads as usize, RowSums::default());
        for slot in 0..tokens.count {
            let prefetch = slot + PREFETCH_TOKENS < tokens.count;
            for (head, sums) in scratch.iter_mut().enumerate() {
                let pieces = row(head as u32, slot);
                if prefetch {
                    prefetch_row(pieces, PREFETCH_TOKENS as i64 * token_stride);
                }
                sums.add_row(f, pieces);
            }
        }
        for (head, sums) in scratch.iter().enumerate() {
            sum = sum.wrapping_add(weight(head as u32).wrapping_mul(slice_sum(sums)));
        }
    }
    sum
}

/// How many tokens ahead a token-outer walk prefetches. A token's heads
/// are one short contiguous stretch (2 KiB for 8 heads of 256 bytes), too
/// short for the hardware prefetchers to run far enough ahead on their own;
/// fetching two tokens ahead lifted NHD from about 0.88 to 0.97 of the read
/// ceiling in `benches/host_bench.rs`. Heads-outer walks over rows of whole
/// lanes prefetch the same row of the next head (4 KiB ahead for 16 tokens
/// of 256 bytes): on the 2-core AMD machine that changed nothing, but on
/// the GPU host's Xeon one thread went from 0.77 to 1.05 of the read (HND,
/// K and V apart), where the hardware prefetchers alone did not keep enough
/// lines in flight.
const PREFETCH_TOKENS: u32 = 2;

/// Asks for the cache lines of `row`'s cells in `layer` without reading
/// them, and gives the bytes its walk reads. A step's full blocks are small
/// scattered chunks (one block of one layer: a few KiB), too short for the
/// hardware prefetchers to ramp up on, so each chunk would cost a memory
/// latency; asked for ahead of the walk, their misses overlap. Each
/// segment's cells lie between the corners of its (kernel block, slot,
/// head) box; where that box is no more than [`PREFETCH_SPREAD`] times the
/// bytes read (a sparse layout would fetch more than it reads) nothing is
/// asked for that segment.
pub(super) fn prefetch_item(row: &Row, layer: &Layer) -> u64 {
    let spec = &layer.spec;
    let valid = row.valid_tokens;
    if valid == 0 {
        return 0;
    }
    let per_kernel_block = spec.tokens_per_kernel_block;
    let kernel_blocks = valid.div_ceil(per_kernel_block) as i64;
    let slots = valid.min(per_kernel_block) as i64;
    let heads = spec.num_heads as i64;
    let mut bytes = 0u64;
    for segment in &spec.segments {
        let read = valid as u64 * spec.num_heads as u64 * segment.bytes_per_token as u64;
        bytes += read;
        let (mut low, mut high) = (0i64, 0i64);
        for (count, stride) in [
            (kernel_blocks, segment.kernel_block_stride),
            (slots, segment.token_stride),
            (heads, segment.head_stride),
        ] {
            let reach = (count - 1).wrapping_mul(stride);
            low += reach.min(0);
            high += reach.max(0);
        }
        let span = (high - low) as u64 + segment.bytes_per_token as u64;
        if span > PREFETCH_SPREAD * read {
            continue;
        }
        let base = (segment.address as i64 + row.block_id as i64 * segment.block_stride + low) as usize as *const u8;
        for line in (0..span as usize).step_by(64) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a prefetch is a hint that never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(base.wrapping_add(line).cast());
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = base.wrapping_add(line);
        }
    }
    bytes
}

/// How many times the bytes it reads a segment's box of cells may span and
/// still be asked for whole by [`prefetch_item`].
const PREFETCH_SPREAD: u64 = 2;

/// Asks for the cache lines of the row that lies `offset` bytes past `row`.
#[inline(always)]
fn prefetch_row(row: &[u64], offset: i64) {
    let ahead = row.as_ptr().wrapping_byte_offset(offset as isize);
    for line in (0..row.len()).step_by(LANES) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is a hint that never faults, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ahead.wrapping_add(line).cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = ahead.wrapping_add(line);
    }
}

/// Lanes of [`RowSums`]: eight pieces, one cache line.
const LANES: usize = 8;

/// Running sums over the rows (one head's pieces of one token) of a slice,
/// from which [`RowSums::weighted`] gives their slice-checksum contribution
/// with one reduction for all rows. The same identity as
/// `checksum::run_checksum`, extended by a row index: within lane `l`,
/// after each chunk `running += sum`, so `sum_k k * x = chunks * sum -
/// running`; after each row `row_running += sum`, so `sum_r r * x = rows *
/// sum - row_running`. Adds only, so the chunk loop vectorises.
#[derive(Clone, Copy, Default)]
pub(super) struct RowSums {
    sum: [u64; LANES],
    running: [u64; LANES],
    row_running: [u64; LANES],
    chunks: u64,
    rows: u64,
}

impl RowSums {
    /// Adds the next row (each piece through `f`: [`PieceFn`]); its
    /// length is a multiple of [`LANES`] and the same for every row.
    #[inline(always)]
    // One index walks three lane arrays in step; this is what vectorises.
    #[allow(clippy::needless_range_loop)]
    fn add_row<F: PieceFn>(&mut self, f: F, row: &[u64]) {
        let chunks = row.chunks_exact(LANES);
        debug_assert!(chunks.remainder().is_empty());
        self.chunks += chunks.len() as u64;
        f.accumulate(row, &mut self.sum, &mut self.running);
        for lane in 0..LANES {
            self.row_running[lane] = self.row_running[lane].wrapping_add(self.sum[lane]);
        }
        self.rows += 1;
    }

    /// `sum over rows r, pieces p of x * (2 * (first_index + r * row_index_stride + p) + 1)`
    /// for rows of `row_len` pieces.
    fn weighted(&self, row_len: u64, first_index: u64, row_index_stride: u64) -> u64 {
        let mut total = 0u64;
        // sum_i i * x over the rows laid end to end, and sum_r r * x.
        let mut flat_weighted = 0u64;
        let mut row_weighted = 0u64;
        for lane in 0..LANES {
            let sum = self.sum[lane];
            total = total.wrapping_add(sum);
            let chunk_weighted = self.chunks.wrapping_mul(sum).wrapping_sub(self.running[lane]);
            flat_weighted = flat_weighted
                .wrapping_add(chunk_weighted.wrapping_mul(LANES as u64))
                .wrapping_add((lane as u64).wrapping_mul(sum));
            row_weighted = row_weighted.wrapping_add(self.rows.wrapping_mul(sum).wrapping_sub(self.row_running[lane]));
        }
        // Piece p of row r is flat piece i = r * row_len + p; its index is
        // first_index + i + r * (row_index_stride - row_len).
        piece_weight(first_index)
            .wrapping_mul(total)
            .wrapping_add(flat_weighted.wrapping_mul(2))
            .wrapping_add(
                row_index_stride
                    .wrapping_sub(row_len)
                    .wrapping_mul(row_weighted)
                    .wrapping_mul(2),
            )
    }
}

/// The `count` pieces at host address `address`.
///
/// # Safety
/// `address .. address + 8 * count` must be readable memory, 8-byte aligned,
/// not written while the returned slice is alive.
unsafe fn host_pieces<'a>(address: i64, count: u64) -> &'a [u64] {
    // SAFETY: the caller's promise above.
    unsafe { std::slice::from_raw_parts(address as usize as *const u64, count as usize) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::checksum::{Algorithm, Identity, Mix, Mix2};

    /// `RowSums` gives what `weighted_run` (the definition) gives row by
    /// row, under both algorithms.
    #[test]
    fn row_sums_equal_rows_of_weighted_runs() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for row_len in [8usize, 16, 32, 72] {
            for rows in [1usize, 2, 5, 16] {
                for extra_stride in [0u64, 8, 29] {
                    let pieces: Vec<u64> = (0..row_len * rows).map(|_| next()).collect();
                    let first_index = next() >> 4;
                    let row_index_stride = row_len as u64 + extra_stride;
                    for algorithm in Algorithm::all() {
                        let mut sums = RowSums::default();
                        let mut expected = 0u64;
                        for (r, row) in pieces.chunks_exact(row_len).enumerate() {
                            match algorithm {
                                Algorithm::Weighted => sums.add_row(Identity, row),
                                Algorithm::Mixed => sums.add_row(Mix, row),
                                Algorithm::Mixed2 => sums.add_row(Mix2, row),
                            }
                            let index = first_index.wrapping_add(r as u64 * row_index_stride);
                            expected =
                                expected.wrapping_add(crate::base::checksum::weighted_run(row, index, algorithm));
                        }
                        assert_eq!(
                            sums.weighted(row_len as u64, first_index, row_index_stride),
                            expected,
                            "row_len {row_len}, rows {rows}, row_index_stride {row_index_stride}, {algorithm:?}"
                        );
                    }
                }
            }
        }
    }
}
