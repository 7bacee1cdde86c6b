// The checksum kernel: one launch per kvcs_worker_checksum call.
//
// Work is cut into units of (row, layer, head or group of heads side by side,
// kernel block, chunk, segment);
// the call picks the chunks per kernel block (`split`) so that small calls
// still spread over the whole card while large ones read long runs. Every warp
// takes a contiguous range of units. Within a unit a lane's pieces have
// indices that advance by a fixed step per token, so the inner loop mostly
// adds: it keeps a few sums from which `sum f(x_j) (2j + 1)` (SPEC sections 2
// and 12; f the call's algorithm, applied as each piece is used) is
// rebuilt once per unit, then weighs the unit by its head's m (section 3). A warp adds its total to the
// output with one 64-bit atomic whenever its output slot changes (exact:
// addition mod 2^64). The last block to finish copies the values to mapped
// host memory and re-zeroes the accumulators, so a call is one launch.
//
// descriptors.cuh is prepended to this file by the library, with the shared
// constants generated from src/engines/cuda/descriptors.rs: KVCS_WARP,
// KVCS_THREADS_PER_BLOCK, KVCS_MAX_SPLIT (a row's units at that split fit in
// 32 bits), KVCS_INLINE_ROWS, KVCS_INLINE_GROUPS and KVCS_BATCH (tokens a
// lane loads before it adds any of them: loads in flight; overridable by -D).
// Units with at least this many steps batch this many loads (tuning; equal to
// KVCS_BATCH by default: measured no faster for bf16, slower for fp8).
#ifndef KVCS_WIDE_BATCH
#define KVCS_WIDE_BATCH KVCS_BATCH
#endif
// A layer's two segments (K and V) read alike, lane for lane, are read as
// one unit when a warp holds both: 0 = never, 1 = one after the other
// (one unit's bookkeeping for both), 2 = their loads in flight together.
#ifndef KVCS_PAIR_MODE
#define KVCS_PAIR_MODE 2
#endif
// Whether units whose steps are a whole number of batches take a loop with
// no per-load bound check (1) or the checked one (0). Measured on an H200:
// fp8 HND 0.942 -> 0.949, fp8 K/V split 0.863 -> 0.870, the rest within noise.
#ifndef KVCS_FULL_BATCHES
#define KVCS_FULL_BATCHES 1
#endif
// The paired form's per-step sums (tuning variant, measured on no device
// yet): 1 = both segments' values of a step added first, weighed by the
// step through suffix sums (fewer integer adds per 16-byte vector, for
// layouts whose units are one batch long, as fp8 HND's 16-token blocks
// are); 0 = each segment's weighed on its own.
#ifndef KVCS_PAIR_SUMS
#define KVCS_PAIR_SUMS 0
#endif
// Loads a lane has in flight in kvcs_checksum_narrow, the kernel of calls
// with a layer of 4-byte pieces (tuning; measured on no device yet).
#ifndef KVCS_NARROW_BATCH
#define KVCS_NARROW_BATCH KVCS_BATCH
#endif
// Blocks per SM the compiler must leave room for (registers), 0 = its choice.
#ifndef KVCS_MIN_BLOCKS
#define KVCS_MIN_BLOCKS 0
#endif

// Counts this block finished and returns how many had before it, as one
// acquire-release atomic: it orders the block's accumulator updates (made
// before it by the block's barrier) before the count, and, in the last
// block, its reads of the accumulators (after the barrier that follows)
// after every other block's count. Measured on an H200: 0.3 us less per
// small call than an acquire-release fence before a relaxed count and
// another after it in every thread of the last block (which in turn was
// 0.8 us less than __threadfence, a sequentially consistent fence).
__device__ __forceinline__ kvcs_u32 kvcs_count_finished(kvcs_u32 *finished_blocks) {
    kvcs_u32 before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(finished_blocks) : "memory");
    return before;
}

__device__ __forceinline__ kvcs_u64 kvcs_warp_sum(kvcs_u64 value) {
    for (int offset = KVCS_WARP / 2; offset > 0; offset /= 2)
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

// Sums over one lane's vectors of a unit, from which sum x_j (2j + 1) follows.
struct kvcs_lane_sums {
    kvcs_u64 total;          // sum of y = lo + hi (the vector's two pieces)
    kvcs_u64 high;           // sum of hi
    kvcs_u64 round_weighted; // sum of i * y, i = the vector's round within a token
    kvcs_u64 step_weighted;  // sum of k * y, k = the token's step
};

// Reads a lane's vectors BATCH steps at a time: all loads of a batch are in
// flight before any is used. Products by b are by constants; the rest is one
// multiply per batch. MIX (a KVCS_F_* value) passes each piece through f as
// it is used (pieces not loaded stay 0: f(0) = 0 for every f).
template <int BATCH, bool FULL, int MIX>
__device__ __forceinline__ void kvcs_accumulate(
    struct kvcs_lane_sums &sums, kvcs_i64 lane_address, kvcs_i64 step_bytes, kvcs_u32 steps,
    kvcs_u32 first_vector, kvcs_u32 vectors, kvcs_u32 lanes, kvcs_u32 vector_shift)
{
    const bool wide = vector_shift == 4;
    for (kvcs_u32 k = 0; k < steps; k += BATCH) {
        kvcs_u32 round = 0;
        for (kvcs_u32 vector = first_vector; vector < vectors; vector += lanes, ++round) {
            const kvcs_i64 base = lane_address + (kvcs_i64)k * step_bytes
                + ((kvcs_i64)(vector - first_vector) << vector_shift);
            kvcs_u64 lo[BATCH], hi[BATCH];
#pragma unroll
            for (int b = 0; b < BATCH; ++b) {
                lo[b] = 0; hi[b] = 0;
                if (FULL || k + b < steps) {
                    if (wide) {
                        const ulonglong2 v = __ldcs((const ulonglong2 *)(base + b * step_bytes));
                        lo[b] = v.x; hi[b] = v.y;
                    } else {
                        lo[b] = __ldcs((const kvcs_u64 *)(base + b * step_bytes));
                    }
                }
            }
            kvcs_u64 batch_total = 0;
#pragma unroll
            for (int b = 0; b < BATCH; ++b) {
                const kvcs_u64 high = kvcs_piece<MIX>(hi[b]);
                const kvcs_u64 y = kvcs_piece<MIX>(lo[b]) + high;
                sums.high += high;
                batch_total += y;
                // Step k + b weighs (k + b) * y: b * y here, k * y below.
                sums.step_weighted += (kvcs_u64)b * y;
            }
            sums.total += batch_total;
            sums.round_weighted += (kvcs_u64)round * batch_total;
            sums.step_weighted += (kvcs_u64)k * batch_total;
        }
    }
}

// As kvcs_accumulate over two segments read alike (same vectors, lanes and
// token stride) at once: each batch's loads of both are in flight together.
// (Kept apart from kvcs_accumulate: one template over the number of
// segments measured 100 registers instead of 80 for the one-segment kernel,
// and MLA fell from 0.966 to 0.931 of the read ceiling.)
// The per-segment totals are kept apart (their pieces start at different
// offsets); the other sums are shared.
template <int BATCH, bool FULL, int MIX>
__device__ __forceinline__ void kvcs_accumulate_pair(
    struct kvcs_lane_sums &sums, kvcs_u64 &first_total, kvcs_i64 first_address, kvcs_i64 second_address,
    kvcs_i64 step_bytes, kvcs_u32 steps, kvcs_u32 first_vector, kvcs_u32 vectors, kvcs_u32 lanes,
    kvcs_u32 vector_shift)
{
    const bool wide = vector_shift == 4;
    for (kvcs_u32 k = 0; k < steps; k += BATCH) {
        kvcs_u32 round = 0;
        for (kvcs_u32 vector = first_vector; vector < vectors; vector += lanes, ++round) {
            const kvcs_i64 offset = (kvcs_i64)k * step_bytes + ((kvcs_i64)(vector - first_vector) << vector_shift);
            kvcs_u64 lo[2][BATCH], hi[2][BATCH];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const kvcs_i64 base = (h ? second_address : first_address) + offset;
#pragma unroll
                for (int b = 0; b < BATCH; ++b) {
                    lo[h][b] = 0; hi[h][b] = 0;
                    if (FULL || k + b < steps) {
                        if (wide) {
                            const ulonglong2 v = __ldcs((const ulonglong2 *)(base + b * step_bytes));
                            lo[h][b] = v.x; hi[h][b] = v.y;
                        } else {
                            lo[h][b] = __ldcs((const kvcs_u64 *)(base + b * step_bytes));
                        }
                    }
                }
            }
#if KVCS_PAIR_SUMS
            // Both segments' y of step b added first, then weighed by b once
            // per step through suffix sums: sum_b b Y_b = sum_{b >= 1}
            // sum_{c >= b} Y_c (exact, mod 2^64), fewer 64-bit adds and no
            // products by b.
            kvcs_u64 first_batch = 0, batch_total = 0, weighted = 0;
#pragma unroll
            for (int b = BATCH - 1; b >= 0; --b) {
                const kvcs_u64 high0 = kvcs_piece<MIX>(hi[0][b]);
                const kvcs_u64 high1 = kvcs_piece<MIX>(hi[1][b]);
                const kvcs_u64 y0 = kvcs_piece<MIX>(lo[0][b]) + high0;
                const kvcs_u64 y1 = kvcs_piece<MIX>(lo[1][b]) + high1;
                sums.high += high0 + high1;
                first_batch += y0;
                batch_total += y0 + y1;
                if (b > 0) weighted += batch_total;
            }
            first_total += first_batch;
            sums.step_weighted += weighted;
#else
            kvcs_u64 batch_total = 0;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                kvcs_u64 segment_total = 0;
#pragma unroll
                for (int b = 0; b < BATCH; ++b) {
                    const kvcs_u64 high = kvcs_piece<MIX>(hi[h][b]);
                    const kvcs_u64 y = kvcs_piece<MIX>(lo[h][b]) + high;
                    sums.high += high;
                    segment_total += y;
                    sums.step_weighted += (kvcs_u64)b * y;
                }
                if (h == 0) first_total += segment_total;
                batch_total += segment_total;
            }
#endif
            sums.total += batch_total;
            sums.round_weighted += (kvcs_u64)round * batch_total;
            sums.step_weighted += (kvcs_u64)k * batch_total;
        }
    }
}

// Byte offset of vector `vector` of a token's (grouped) vectors: a group's
// heads lie head_stride apart (side by side in token-major layouts, where
// head_stride is one head's bytes and this is vector << vector_shift;
// heads-outer layouts are grouped the same way: see `head_group` in
// layer_table.rs), each head's vectors side by side.
__device__ __forceinline__ kvcs_i64 kvcs_vector_offset(
    const struct kvcs_dev_segment *segment, kvcs_u32 vector, kvcs_u32 head_vector_shift)
{
    const kvcs_u32 in_head = vector & ((1u << head_vector_shift) - 1);
    return (kvcs_i64)(vector >> head_vector_shift) * segment->head_stride + ((kvcs_i64)in_head << segment->vector_shift);
}

// This lane's share of sum x_j (2j + 1) over the same `tokens` tokens of one
// head in both segments of a layer whose segments read alike (see
// kvcs_segment_unit), the first segment's first token at `first_address`,
// the second's at `second_address`.
template <int MIX>
__device__ __forceinline__ kvcs_u64 kvcs_segment_pair(
    const struct kvcs_dev_segment *first, const struct kvcs_dev_segment *second, kvcs_u64 pieces_per_token,
    kvcs_i64 first_address, kvcs_i64 second_address, kvcs_u64 first_token, kvcs_u32 tokens, kvcs_u32 lane,
    kvcs_u32 head_vector_shift)
{
    const kvcs_u32 head_vector_mask = (1u << head_vector_shift) - 1;
    const kvcs_u32 lanes = 1u << first->lane_shift;
    const kvcs_u32 tokens_per_step = KVCS_WARP >> first->lane_shift;
    const kvcs_u32 token = lane >> first->lane_shift;
    const kvcs_u32 first_vector = lane & (lanes - 1);
    const kvcs_u32 vectors = first->vectors_per_token;
    if (token >= tokens || first_vector >= vectors) return 0;
    const kvcs_u32 steps = (tokens - token + tokens_per_step - 1) >> (5 - first->lane_shift);
    const kvcs_u64 pieces_per_vector = first->vector_shift == 4 ? 2 : 1;
    const kvcs_i64 step_bytes = (kvcs_i64)tokens_per_step * first->token_stride;
    // Both segments hold their heads alike (kvcs_layer_units' condition
    // includes the head stride where heads are grouped).
    const kvcs_i64 lane_offset = (kvcs_i64)token * first->token_stride + kvcs_vector_offset(first, first_vector, head_vector_shift);

    struct kvcs_lane_sums sums = {0, 0, 0, 0};
    kvcs_u64 first_total = 0;
#if KVCS_PAIR_MODE == 2
#if KVCS_FULL_BATCHES
    if (steps % KVCS_BATCH == 0)
        kvcs_accumulate_pair<KVCS_BATCH, true, MIX>(sums, first_total, first_address + lane_offset,
                                               second_address + lane_offset, step_bytes, steps, first_vector, vectors,
                                               lanes, first->vector_shift);
    else
#endif
        kvcs_accumulate_pair<KVCS_BATCH, false, MIX>(sums, first_total, first_address + lane_offset,
                                                second_address + lane_offset, step_bytes, steps, first_vector, vectors,
                                                lanes, first->vector_shift);
#else
    kvcs_accumulate<KVCS_BATCH, false, MIX>(sums, first_address + lane_offset, step_bytes, steps, first_vector, vectors,
                                       lanes, first->vector_shift);
    first_total = sums.total;
    kvcs_accumulate<KVCS_BATCH, false, MIX>(sums, second_address + lane_offset, step_bytes, steps, first_vector, vectors,
                                       lanes, first->vector_shift);
#endif
    // As in kvcs_segment_unit, each segment's pieces starting at its own offset.
    const kvcs_u64 j0 = (first_token + token) * pieces_per_token + (first_vector & head_vector_mask) * pieces_per_vector;
    const kvcs_u64 step_pieces = (kvcs_u64)tokens_per_step * pieces_per_token;
    return (2 * (j0 + first->piece_offset) + 1) * first_total
        + (2 * (j0 + second->piece_offset) + 1) * (sums.total - first_total) + 2 * sums.high
        + 2 * (kvcs_u64)lanes * pieces_per_vector * sums.round_weighted
        + 2 * step_pieces * sums.step_weighted;
}

// This lane's share of sum x_j (2j + 1) over a flat segment's `tokens`
// tokens from `address` (request token `first_token`): one run of
// `tokens * vectors_per_token` vectors whose pieces are numbered in order, so
// lane l reads vectors l, l + 32, ... with every lane busy, BATCH at a time.
template <int MIX, int BATCH>
__device__ __forceinline__ kvcs_u64 kvcs_flat_unit(
    const struct kvcs_dev_segment *segment, kvcs_u64 pieces_per_token,
    kvcs_i64 address, kvcs_u64 first_token, kvcs_u32 tokens, kvcs_u32 lane)
{
    const kvcs_u32 vectors = tokens * segment->vectors_per_token;
    if (lane >= vectors) return 0;
    const kvcs_u32 count = (vectors - lane + KVCS_WARP - 1) / KVCS_WARP;
    const bool wide = segment->vector_shift == 4;
    const kvcs_i64 lane_address = address + ((kvcs_i64)lane << segment->vector_shift);
    const kvcs_i64 step_bytes = (kvcs_i64)KVCS_WARP << segment->vector_shift;
    kvcs_u64 total = 0, high = 0, index_weighted = 0;
    for (kvcs_u32 i = 0; i < count; i += BATCH) {
        kvcs_u64 lo[BATCH], hi[BATCH];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            lo[b] = 0; hi[b] = 0;
            if (i + b < count) {
                const kvcs_i64 at = lane_address + (kvcs_i64)(i + b) * step_bytes;
                if (wide) {
                    const ulonglong2 v = __ldcs((const ulonglong2 *)at);
                    lo[b] = v.x; hi[b] = v.y;
                } else {
                    lo[b] = __ldcs((const kvcs_u64 *)at);
                }
            }
        }
        kvcs_u64 batch_total = 0;
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const kvcs_u64 piece_high = kvcs_piece<MIX>(hi[b]);
            const kvcs_u64 y = kvcs_piece<MIX>(lo[b]) + piece_high;
            high += piece_high;
            batch_total += y;
            index_weighted += (kvcs_u64)b * y;
        }
        total += batch_total;
        index_weighted += (kvcs_u64)i * batch_total;
    }
    // Vector lane + 32 i starts at piece j0 + 32 ppv i, j0 = the lane's first.
    const kvcs_u64 pieces_per_vector = wide ? 2 : 1;
    const kvcs_u64 j0 = first_token * pieces_per_token + lane * pieces_per_vector;
    return (2 * j0 + 1) * total + 2 * high + 2 * (kvcs_u64)KVCS_WARP * pieces_per_vector * index_weighted;
}

// This lane's share of sum x_j (2j + 1) over `tokens` tokens of one head in
// one segment, the first at `address` (kernel block and slot resolved) with
// request token `first_token`.
// `token_pieces` is the piece distance between consecutive tokens: P, or
// under a DCP placement of interleave 1 P times the DCP size (SPEC section
// 16); `first_token` is the first slot's unit in the request.
template <int MIX, int BATCH>
__device__ __forceinline__ kvcs_u64 kvcs_segment_unit(
    const struct kvcs_dev_segment *segment, kvcs_u64 pieces_per_token,
    kvcs_i64 address, kvcs_u64 first_token, kvcs_u32 tokens, kvcs_u32 lane, kvcs_u32 head_vector_shift,
    kvcs_u64 token_pieces)
{
    const kvcs_u32 head_vector_mask = (1u << head_vector_shift) - 1;
    if (segment->flat) return kvcs_flat_unit<MIX, BATCH>(segment, pieces_per_token, address, first_token, tokens, lane);
    const kvcs_u32 lanes = 1u << segment->lane_shift;
    const kvcs_u32 tokens_per_step = KVCS_WARP >> segment->lane_shift;
    const kvcs_u32 token = lane >> segment->lane_shift;
    const kvcs_u32 first_vector = lane & (lanes - 1);
    const kvcs_u32 vectors = segment->vectors_per_token;
    if (token >= tokens || first_vector >= vectors) return 0;
    const kvcs_u32 steps = (tokens - token + tokens_per_step - 1) >> (5 - segment->lane_shift);
    const kvcs_u64 pieces_per_vector = segment->vector_shift == 4 ? 2 : 1;
    const kvcs_i64 step_bytes = (kvcs_i64)tokens_per_step * segment->token_stride;
    const kvcs_i64 lane_address = address + (kvcs_i64)token * segment->token_stride
        + kvcs_vector_offset(segment, first_vector, head_vector_shift);

    struct kvcs_lane_sums sums = {0, 0, 0, 0};
#if KVCS_WIDE_BATCH != KVCS_BATCH
    if (BATCH == KVCS_BATCH && steps >= KVCS_WIDE_BATCH)
        kvcs_accumulate<KVCS_WIDE_BATCH, false, MIX>(sums, lane_address, step_bytes, steps, first_vector, vectors, lanes, segment->vector_shift);
    else
#endif
#if KVCS_FULL_BATCHES
    if (steps % BATCH == 0)
        kvcs_accumulate<BATCH, true, MIX>(sums, lane_address, step_bytes, steps, first_vector, vectors, lanes, segment->vector_shift);
    else
#endif
        kvcs_accumulate<BATCH, false, MIX>(sums, lane_address, step_bytes, steps, first_vector, vectors, lanes, segment->vector_shift);

    // Piece index of (step k, round i, half h):
    //   j = j0 + k * P * tokens_per_step + i * lanes * pieces_per_vector + h,
    // so sum x_j (2j + 1) = (2 j0 + 1) total + 2 high + 2 lanes ppv round_weighted
    //                       + 2 P tokens_per_step step_weighted.
    // The lane's vectors within its head (the unit's one head, or its
    // head in a group: see struct kvcs_dev_layer).
    const kvcs_u64 j0 = first_token * pieces_per_token + token * token_pieces + segment->piece_offset
        + (first_vector & head_vector_mask) * pieces_per_vector;
    const kvcs_u64 step_pieces = (kvcs_u64)tokens_per_step * token_pieces;
    return (2 * j0 + 1) * sums.total + 2 * sums.high
        + 2 * (kvcs_u64)lanes * pieces_per_vector * sums.round_weighted
        + 2 * step_pieces * sums.step_weighted;
}

// Cells of 4-byte pieces (SPEC section 1: a cell of a multiple of 4 and not
// of 8 bytes, vLLM's indexer keys then their scales), read by
// kvcs_checksum_narrow only: the other kernels are compiled without this
// code, so calls without such a layer run exactly what they ran before.
// A vector holds PIECES whole pieces (1, 2 or 4: a 4-, 8- or 16-byte load,
// the widest every address of the segment is aligned to, so that no load
// straddles two tokens or leaves the segment), each LE_u32 zero-extended
// to 64 bits before f.

// As kvcs_accumulate, for vectors of PIECES 4-byte pieces: `high` sums,
// over the vectors, sum_h h f(piece h) (a piece's place in its vector; for
// 2 pieces the high one, as kvcs_accumulate's `high`).
template <int BATCH, bool FULL, int MIX, int PIECES>
__device__ __forceinline__ void kvcs_accumulate_narrow(
    struct kvcs_lane_sums &sums, kvcs_i64 lane_address, kvcs_i64 step_bytes, kvcs_u32 steps,
    kvcs_u32 first_vector, kvcs_u32 vectors, kvcs_u32 lanes)
{
    for (kvcs_u32 k = 0; k < steps; k += BATCH) {
        kvcs_u32 round = 0;
        for (kvcs_u32 vector = first_vector; vector < vectors; vector += lanes, ++round) {
            const kvcs_i64 base = lane_address + (kvcs_i64)k * step_bytes + (kvcs_i64)(vector - first_vector) * (4 * PIECES);
            kvcs_u32 piece[BATCH][PIECES];
#pragma unroll
            for (int b = 0; b < BATCH; ++b) {
#pragma unroll
                for (int h = 0; h < PIECES; ++h) piece[b][h] = 0;
                if (FULL || k + b < steps) {
                    const kvcs_i64 at = base + b * step_bytes;
                    if constexpr (PIECES == 4) {
                        const uint4 v = __ldcs((const uint4 *)at);
                        piece[b][0] = v.x; piece[b][1] = v.y; piece[b][2] = v.z; piece[b][3] = v.w;
                    } else if constexpr (PIECES == 2) {
                        const uint2 v = __ldcs((const uint2 *)at);
                        piece[b][0] = v.x; piece[b][1] = v.y;
                    } else {
                        piece[b][0] = __ldcs((const kvcs_u32 *)at);
                    }
                }
            }
            kvcs_u64 batch_total = 0;
#pragma unroll
            for (int b = 0; b < BATCH; ++b) {
                kvcs_u64 y = 0;
#pragma unroll
                for (int h = 0; h < PIECES; ++h) {
                    const kvcs_u64 x = kvcs_piece<MIX>((kvcs_u64)piece[b][h]);
                    y += x;
                    sums.high += (kvcs_u64)h * x;
                }
                batch_total += y;
                sums.step_weighted += (kvcs_u64)b * y;
            }
            sums.total += batch_total;
            sums.round_weighted += (kvcs_u64)round * batch_total;
            sums.step_weighted += (kvcs_u64)k * batch_total;
        }
    }
}

// kvcs_accumulate_narrow with no per-load bound check where the steps are
// a whole number of batches.
template <int BATCH, int MIX, int PIECES>
__device__ __forceinline__ void kvcs_accumulate_narrow_steps(
    struct kvcs_lane_sums &sums, kvcs_i64 lane_address, kvcs_i64 step_bytes, kvcs_u32 steps,
    kvcs_u32 first_vector, kvcs_u32 vectors, kvcs_u32 lanes)
{
#if KVCS_FULL_BATCHES
    if (steps % BATCH == 0)
        kvcs_accumulate_narrow<BATCH, true, MIX, PIECES>(sums, lane_address, step_bytes, steps, first_vector, vectors, lanes);
    else
#endif
        kvcs_accumulate_narrow<BATCH, false, MIX, PIECES>(sums, lane_address, step_bytes, steps, first_vector, vectors, lanes);
}

// kvcs_segment_unit of a segment of 4-byte pieces (same arguments, same
// lanes and steps). A flat segment's unit, one run of `tokens *
// vectors_per_token` vectors numbered in order (kvcs_flat_unit), is read as
// that many one-vector tokens of one lane each: lane l reads vectors l,
// l + 32, ..., every lane busy.
template <int MIX, int BATCH>
__device__ __forceinline__ kvcs_u64 kvcs_narrow_unit(
    const struct kvcs_dev_segment *segment, kvcs_u64 pieces_per_token,
    kvcs_i64 address, kvcs_u64 first_token, kvcs_u32 tokens, kvcs_u32 lane, kvcs_u32 head_vector_shift,
    kvcs_u64 token_pieces)
{
    const kvcs_u32 vector_shift = segment->vector_shift;
    const kvcs_u64 pieces_per_vector = 1ull << (vector_shift - 2);
    kvcs_u32 lanes, first_vector, vectors, steps;
    kvcs_i64 lane_address, step_bytes;
    kvcs_u64 j0, step_pieces;
    if (segment->flat) {
        const kvcs_u32 count = tokens * segment->vectors_per_token;
        if (lane >= count) return 0;
        lanes = 1;
        first_vector = 0;
        vectors = 1;
        steps = (count - lane + KVCS_WARP - 1) / KVCS_WARP;
        lane_address = address + ((kvcs_i64)lane << vector_shift);
        step_bytes = (kvcs_i64)KVCS_WARP << vector_shift;
        j0 = first_token * pieces_per_token + lane * pieces_per_vector;
        step_pieces = KVCS_WARP * pieces_per_vector;
    } else {
        lanes = 1u << segment->lane_shift;
        const kvcs_u32 tokens_per_step = KVCS_WARP >> segment->lane_shift;
        const kvcs_u32 token = lane >> segment->lane_shift;
        first_vector = lane & (lanes - 1);
        vectors = segment->vectors_per_token;
        if (token >= tokens || first_vector >= vectors) return 0;
        steps = (tokens - token + tokens_per_step - 1) >> (5 - segment->lane_shift);
        step_bytes = (kvcs_i64)tokens_per_step * segment->token_stride;
        lane_address = address + (kvcs_i64)token * segment->token_stride
            + kvcs_vector_offset(segment, first_vector, head_vector_shift);
        const kvcs_u32 head_vector_mask = (1u << head_vector_shift) - 1;
        j0 = first_token * pieces_per_token + token * token_pieces + segment->piece_offset
            + (first_vector & head_vector_mask) * pieces_per_vector;
        step_pieces = (kvcs_u64)tokens_per_step * token_pieces;
    }

    struct kvcs_lane_sums sums = {0, 0, 0, 0};
    if (vector_shift == 4)
        kvcs_accumulate_narrow_steps<BATCH, MIX, 4>(sums, lane_address, step_bytes, steps, first_vector, vectors, lanes);
    else if (vector_shift == 3)
        kvcs_accumulate_narrow_steps<BATCH, MIX, 2>(sums, lane_address, step_bytes, steps, first_vector, vectors, lanes);
    else
        kvcs_accumulate_narrow_steps<BATCH, MIX, 1>(sums, lane_address, step_bytes, steps, first_vector, vectors, lanes);

    // Piece index of (step k, round i, piece h of the vector):
    //   j = j0 + k * step_pieces + i * lanes * pieces_per_vector + h,
    // as in kvcs_segment_unit, `high` holding the h terms.
    return (2 * j0 + 1) * sums.total + 2 * sums.high
        + 2 * (kvcs_u64)lanes * pieces_per_vector * sums.round_weighted
        + 2 * step_pieces * sums.step_weighted;
}

// Whether `layer`'s pieces are 4 bytes: its cell (one head's bytes of a
// token, K then V) is not a multiple of 8 bytes (SPEC section 1). The
// descriptor holds the cell's size as each segment's vectors per token,
// of 2^vector_shift bytes over the unit's 2^head_shift heads; it has no
// field of its own, so that the other kernels' descriptors, and so their
// code, stay as they were.
__device__ __forceinline__ bool kvcs_reads_4_byte_pieces(const struct kvcs_dev_layer *layer)
{
    kvcs_u32 cell_bytes = 0;
    for (kvcs_u32 s = 0; s < layer->num_segments; ++s)
        cell_bytes += (layer->segments[s].vectors_per_token << layer->segments[s].vector_shift) >> layer->head_shift;
    return cell_bytes % 8 != 0;
}

// kvcs_segment_unit, or where NARROW (kvcs_checksum_narrow) and the
// unit's layer is of 4-byte pieces (`narrow`), kvcs_narrow_unit. Without
// NARROW it is kvcs_segment_unit's very code.
template <int MIX, int BATCH, bool NARROW>
__device__ __forceinline__ kvcs_u64 kvcs_unit(
    bool narrow, const struct kvcs_dev_segment *segment, kvcs_u64 pieces_per_token,
    kvcs_i64 address, kvcs_u64 first_token, kvcs_u32 tokens, kvcs_u32 lane, kvcs_u32 head_vector_shift,
    kvcs_u64 token_pieces)
{
    if constexpr (NARROW) {
        if (narrow)
            return kvcs_narrow_unit<MIX, BATCH>(segment, pieces_per_token, address, first_token, tokens, lane,
                                                head_vector_shift, token_pieces);
    }
    return kvcs_segment_unit<MIX, BATCH>(segment, pieces_per_token, address, first_token, tokens, lane,
                                         head_vector_shift, token_pieces);
}

// The last index i of [low, high] with key(i) <= value, for keys ascending in
// i and key(low) <= value: the one search over rows (their first units) and
// over a group's layers (theirs).
template <typename T, typename Key>
__device__ __forceinline__ kvcs_u32 kvcs_last_at_or_below(kvcs_u32 low, kvcs_u32 high, T value, Key key) {
    while (low < high) {
        const kvcs_u32 mid = (low + high + 1) / 2;
        if (key(mid) <= value) low = mid; else high = mid - 1;
    }
    return low;
}

// The row holding `unit`: a division when every row has `row_units` units,
// else a search of the rows' first units.
__device__ __forceinline__ kvcs_u32 kvcs_row_of(
    const kvcs_u64 *row_starts, kvcs_u32 num_rows, kvcs_u32 row_units, kvcs_u64 unit)
{
    if (row_units) return (kvcs_u32)(unit / row_units);
    return kvcs_last_at_or_below(0u, num_rows - 1, unit, [=](kvcs_u32 i) { return row_starts[i]; });
}

// The layer of `group` holding the row's unit `in_row`: a division when the
// group's layers are alike.
__device__ __forceinline__ kvcs_u32 kvcs_layer_of(
    const struct kvcs_dev_layer *layers, const struct kvcs_dev_group &group, kvcs_u32 split, kvcs_u32 in_row)
{
    if (group.layer_units) return group.layers_begin + in_row / (group.layer_units * split);
    return kvcs_last_at_or_below(group.layers_begin, group.layers_end - 1, in_row,
                                 [=](kvcs_u32 i) { return layers[i].unit_start * split; });
}

// Address of token `slot` of kernel block `kernel_block` of block `block_id`,
// head `head`, in `segment`.
__device__ __forceinline__ kvcs_i64 kvcs_segment_address(
    const struct kvcs_dev_segment *segment, kvcs_u32 block_id, kvcs_u32 kernel_block, kvcs_u32 head, kvcs_u32 slot)
{
    return (kvcs_i64)segment->address
        + (kvcs_i64)block_id * segment->block_stride
        + (kvcs_i64)kernel_block * segment->kernel_block_stride
        + (kvcs_i64)head * segment->head_stride
        + (kvcs_i64)slot * segment->token_stride;
}

// Adds to `total` this warp's units of `layer` in `row`, from the layer's
// unit `in_layer` on, while `unit` is below `end` (`unit` advances past
// them): each head's share weighed by its slice weight (SPEC section 3).
template <bool PAIRS, int MIX, int BATCH, bool PLACED, bool NARROW>
__device__ __forceinline__ void kvcs_layer_units(
    const struct kvcs_dev_layer *layer, const struct kvcs_dev_row &row, kvcs_u32 split, kvcs_u32 in_layer,
    kvcs_u64 &unit, kvcs_u64 end, kvcs_u32 lane, kvcs_u64 &total)
{
    const kvcs_u32 segments = layer->num_segments;
    const kvcs_u32 kernel_blocks = layer->kernel_blocks;
    const kvcs_u32 per_head = kernel_blocks * split * segments;
    // Head groups (one head each where heads are not grouped), and this
    // lane's head within a group.
    const kvcs_u32 heads = layer->num_heads >> layer->head_shift;
    const kvcs_u32 lane_head = (lane & ((1u << layer->segments[0].lane_shift) - 1)) >> layer->head_vector_shift;
    // in_layer = ((head * kernel_blocks + kernel_block) * split + chunk) * segments + s,
    // head counting head groups;
    // divide once, then count.
    kvcs_u32 head = in_layer / per_head;
    kvcs_u32 rest = in_layer - head * per_head;
    kvcs_u32 s = rest % segments;
    rest /= segments;
    kvcs_u32 chunk = rest % split;
    kvcs_u32 kernel_block = rest / split;
    const kvcs_u32 per_kernel_block = layer->tokens_per_kernel_block;
    const kvcs_u32 per_unit = (per_kernel_block + split - 1) / split;
    const bool narrow = NARROW && kvcs_reads_4_byte_pieces(layer);
    kvcs_u64 head_sum = 0;
#if KVCS_PAIR_MODE > 0
    const struct kvcs_dev_segment *pair = layer->segments;
    const bool pairs = PAIRS && segments == 2 && !pair[0].flat && !pair[1].flat
        && pair[0].vector_shift == pair[1].vector_shift && pair[0].vectors_per_token == pair[1].vectors_per_token
        && pair[0].token_stride == pair[1].token_stride
        && (layer->head_shift == 0 || pair[0].head_stride == pair[1].head_stride);
#endif
    while (head < heads && unit < end) {
        const kvcs_u32 first_head = head << layer->head_shift;
        const kvcs_u32 slot = chunk * per_unit;
        const kvcs_u32 first = kernel_block * per_kernel_block + slot;
#if KVCS_PAIR_MODE > 0
        // Both segments of this (head, kernel block, chunk) in this warp's range.
        if (pairs && s == 0 && unit + 1 < end) {
            if (slot < per_kernel_block && first < row.valid_tokens) {
                const kvcs_u32 tokens = min(min(per_unit, per_kernel_block - slot), row.valid_tokens - first);
                head_sum += kvcs_segment_pair<MIX>(&pair[0], &pair[1], layer->pieces_per_token,
                                              kvcs_segment_address(&pair[0], row.block_id, kernel_block, first_head, slot),
                                              kvcs_segment_address(&pair[1], row.block_id, kernel_block, first_head, slot),
                                              row.first_token + first, tokens, lane, layer->head_vector_shift);
            }
            unit += 2;
            s = 1;
        } else
#endif
        {
            if (slot < per_kernel_block && first < row.valid_tokens) {
                const kvcs_u32 tokens = min(min(per_unit, per_kernel_block - slot), row.valid_tokens - first);
                const struct kvcs_dev_segment *segment = &layer->segments[s];
                if (!PLACED || layer->dcp_size == 1) {
                    head_sum += kvcs_unit<MIX, BATCH, NARROW>(narrow, segment, layer->pieces_per_token,
                                                  kvcs_segment_address(segment, row.block_id, kernel_block, first_head, slot),
                                                  row.first_token + first, tokens, lane, layer->head_vector_shift,
                                                  layer->pieces_per_token);
                } else {
                    // SPEC section 16: local slot t of the block holds unit
                    // (t / I) * (D * I) + r * I + t % I. Runs of slots whose
                    // units step alike: the whole chunk at interleave 1
                    // (step D), else up to each interleave run's end (step 1).
                    const kvcs_u32 interleave = layer->interleave;
                    const kvcs_u64 token_pieces = layer->pieces_per_token * layer->unit_step;
                    for (kvcs_u32 done = 0; done < tokens;) {
                        const kvcs_u32 t = first + done;
                        const kvcs_u32 run = interleave == 1 ? tokens - done : min(tokens - done, interleave - t % interleave);
                        const kvcs_u64 unit_offset = (kvcs_u64)(t / interleave) * layer->dcp_size * interleave
                            + (kvcs_u64)layer->dcp_rank * interleave + t % interleave;
                        head_sum += kvcs_unit<MIX, BATCH, NARROW>(narrow, segment, layer->pieces_per_token,
                                                      kvcs_segment_address(segment, row.block_id, kernel_block, first_head, slot + done),
                                                      row.first_token + unit_offset, run, lane, layer->head_vector_shift,
                                                      token_pieces);
                        done += run;
                    }
                }
            }
            ++unit;
        }
        if (++s < segments) continue;
        s = 0;
        if (++chunk < split) continue;
        chunk = 0;
        if (++kernel_block < kernel_blocks) continue;
        kernel_block = 0;
        total += (layer->first_slice_weight + 2ull * (first_head + lane_head)) * head_sum;
        head_sum = 0;
        ++head;
    }
    // A head (group) this warp only began: its share so far.
    total += (layer->first_slice_weight + 2ull * ((head << layer->head_shift) + lane_head)) * head_sum;
}

// The last block to finish publishes the values to mapped host memory and
// leaves zeros behind (accumulators and the finished-block count).
__device__ __forceinline__ void kvcs_publish(
    kvcs_u64 *host_values, kvcs_u64 *accumulators, kvcs_u32 *finished_blocks, kvcs_u32 num_values)
{
    __shared__ bool last_block;
    __syncthreads();
    if (threadIdx.x == 0) last_block = kvcs_count_finished(finished_blocks) == gridDim.x - 1;
    __syncthreads();
    if (!last_block) return;
    // The accumulators are read by atomics, at L2, after the count.
    for (kvcs_u32 i = threadIdx.x; i < num_values; i += blockDim.x)
        host_values[i] = atomicExch(&accumulators[i], 0ull);
    if (threadIdx.x == 0) *finished_blocks = 0;
}

// The kernel's work: PAIRS says whether a layer's two segments may be read
// as one unit (more registers: see kvcs_checksum_unpaired), MIX which f
// (KVCS_F_*) pieces pass through (the call's algorithm).
template <bool PAIRS, int MIX, int BATCH, bool PLACED = false, bool NARROW = false>
__device__ __forceinline__ void kvcs_checksum_call(const struct kvcs_dev_call &call)
{
    const kvcs_u32 lane = threadIdx.x % KVCS_WARP;
    const kvcs_u64 warps = (kvcs_u64)gridDim.x * (blockDim.x / KVCS_WARP);
    const kvcs_u64 warp = (kvcs_u64)blockIdx.x * (blockDim.x / KVCS_WARP) + threadIdx.x / KVCS_WARP;
    const struct kvcs_dev_row *rows = call.rows ? call.rows : call.inline_rows;
    const kvcs_u32 split = call.split;

    kvcs_u64 unit = call.total_units * warp / warps;
    const kvcs_u64 end = call.total_units * (warp + 1) / warps;

    if (unit < end) {
        kvcs_u64 total = 0;
        kvcs_u64 out = ~0ull;
        for (kvcs_u32 row_index = kvcs_row_of(call.row_starts, call.num_rows, call.row_units, unit); unit < end; ++row_index) {
            const struct kvcs_dev_row row = rows[row_index];
            const struct kvcs_dev_group group = row.group_slot < KVCS_INLINE_GROUPS
                ? call.inline_groups[row.group_slot] : call.groups[row.group_slot];
            const kvcs_u64 row_start = call.row_units ? (kvcs_u64)row_index * call.row_units : call.row_starts[row_index];
            for (kvcs_u32 layer_index = kvcs_layer_of(call.layers, group, split, (kvcs_u32)(unit - row_start));
                 layer_index < group.layers_end && unit < end; ++layer_index) {
                const struct kvcs_dev_layer *layer = &call.layers[layer_index];
                // A warp adds its total with one atomic whenever its output slot changes.
                const kvcs_u64 layer_out = row.out + (kvcs_u64)layer->column * row.column_stride;
                if (layer_out != out) {
                    total = kvcs_warp_sum(total);
                    if (lane == 0 && out != ~0ull && total != 0) atomicAdd(&call.accumulators[out], total);
                    total = 0;
                    out = layer_out;
                }
                const kvcs_u32 in_layer = (kvcs_u32)(unit - row_start) - layer->unit_start * split;
                kvcs_layer_units<PAIRS, MIX, BATCH, PLACED, NARROW>(layer, row, split, in_layer, unit, end, lane, total);
            }
        }
        total = kvcs_warp_sum(total);
        if (lane == 0 && total != 0) atomicAdd(&call.accumulators[out], total);
    }
    kvcs_publish(call.host_values, call.accumulators, call.finished_blocks, call.num_values);
}

// Calls with layers whose K and V segments read alike.
extern "C" __global__ void __launch_bounds__(KVCS_THREADS_PER_BLOCK, KVCS_MIN_BLOCKS)
kvcs_checksum(const __grid_constant__ struct kvcs_dev_call call)
{
    // One branch per launch, uniform over the grid: each algorithm's loop
    // is compiled on its own, so WEIGHTED runs the code it ran before.
    if (call.algorithm == KVCS_ALGORITHM_MIXED2) kvcs_checksum_call<true, KVCS_F_MIX2, KVCS_BATCH>(call);
    else if (call.algorithm == KVCS_ALGORITHM_MIXED) kvcs_checksum_call<true, KVCS_F_MIX, KVCS_BATCH>(call);
    else kvcs_checksum_call<true, KVCS_F_IDENTITY, KVCS_BATCH>(call);
}

// Calls without such layers (MLA latents, say): fewer registers, so more
// warps per SM.
extern "C" __global__ void __launch_bounds__(KVCS_THREADS_PER_BLOCK, KVCS_MIN_BLOCKS)
kvcs_checksum_unpaired(const __grid_constant__ struct kvcs_dev_call call)
{
    if (call.algorithm == KVCS_ALGORITHM_MIXED2) kvcs_checksum_call<false, KVCS_F_MIX2, KVCS_BATCH>(call);
    else if (call.algorithm == KVCS_ALGORITHM_MIXED) kvcs_checksum_call<false, KVCS_F_MIX, KVCS_BATCH>(call);
    else kvcs_checksum_call<false, KVCS_F_IDENTITY, KVCS_BATCH>(call);
}

// Calls whose layers all hold one head (MLA latents, say) and none two
// segments read alike: each warp reads long runs of one slice, where more
// loads in flight per lane hide MIXED's mixing between one batch and the
// next (MLA 61x576 on an H200: MIXED 0.93 -> 0.96 of the read ceiling); the
// extra registers would cost the other layouts their occupancy, so it is a
// kernel of its own.
#ifndef KVCS_SINGLE_HEAD_BATCH
#define KVCS_SINGLE_HEAD_BATCH 8
#endif
extern "C" __global__ void __launch_bounds__(KVCS_THREADS_PER_BLOCK, KVCS_MIN_BLOCKS)
kvcs_checksum_single_head(const __grid_constant__ struct kvcs_dev_call call)
{
    if (call.algorithm == KVCS_ALGORITHM_MIXED2) kvcs_checksum_call<false, KVCS_F_MIX2, KVCS_SINGLE_HEAD_BATCH>(call);
    else if (call.algorithm == KVCS_ALGORITHM_MIXED) kvcs_checksum_call<false, KVCS_F_MIX, KVCS_SINGLE_HEAD_BATCH>(call);
    else kvcs_checksum_call<false, KVCS_F_IDENTITY, KVCS_SINGLE_HEAD_BATCH>(call);
}

// Calls with a layer whose tokens are spread over DCP ranks (SPEC section
// 16): each chunk's slots are read in runs whose units step alike (K and V
// apart). The other kernels are compiled without that code, so calls
// without DCP run exactly what they ran before.
extern "C" __global__ void __launch_bounds__(KVCS_THREADS_PER_BLOCK, KVCS_MIN_BLOCKS)
kvcs_checksum_placed(const __grid_constant__ struct kvcs_dev_call call)
{
    if (call.algorithm == KVCS_ALGORITHM_MIXED2) kvcs_checksum_call<false, KVCS_F_MIX2, KVCS_BATCH, true>(call);
    else if (call.algorithm == KVCS_ALGORITHM_MIXED) kvcs_checksum_call<false, KVCS_F_MIX, KVCS_BATCH, true>(call);
    else kvcs_checksum_call<false, KVCS_F_IDENTITY, KVCS_BATCH, true>(call);
}

// Calls with a layer of 4-byte pieces (SPEC section 1) in a group they
// read: such layers take kvcs_narrow_unit, chosen per layer; the call's
// other layers read as in kvcs_checksum_placed (K and V apart, DCP
// placements numbered), which this kernel also covers.
extern "C" __global__ void __launch_bounds__(KVCS_THREADS_PER_BLOCK, KVCS_MIN_BLOCKS)
kvcs_checksum_narrow(const __grid_constant__ struct kvcs_dev_call call)
{
    if (call.algorithm == KVCS_ALGORITHM_MIXED2) kvcs_checksum_call<false, KVCS_F_MIX2, KVCS_NARROW_BATCH, true, true>(call);
    else if (call.algorithm == KVCS_ALGORITHM_MIXED) kvcs_checksum_call<false, KVCS_F_MIX, KVCS_NARROW_BATCH, true, true>(call);
    else kvcs_checksum_call<false, KVCS_F_IDENTITY, KVCS_NARROW_BATCH, true, true>(call);
}
