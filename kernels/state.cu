// The state kernel: the state (Mamba) groups of one kvcs_worker_checksum
// call (SPEC section 6), queued just before kvcs_checksum on the same stream.
//
// A state group's "block" is a request's running state: per layer, tensors
// of rows of 2- or 4-byte elements read as unsigned little-endian integers.
// Row r of a tensor contributes
//     (w0 + r * w_step) * sum_i x_i * (2 * (f0 + r * f_step + i) + 1)
// where the weight and first element index follow the group's kind: a
// known TP split makes each row a slice of its own (weight of the row's
// global head number, indices from 0), a shard-keyed group makes the
// layer's rows one slice (one weight, indices running across rows and
// tensors); the host builds w0, w_step, f0, f_step per tensor.
//
// Work is cut into units of at most KVCS_STATE_LOADS loads per lane: a unit
// is a few whole rows where rows are narrow (a row's vectors spread over a
// power of two of lanes, the warp covering several rows per step), else a
// column chunk of one row. Lanes of a row read consecutive vectors, so a
// warp's loads are coalesced. Grid y walks the call's state rows, grid x
// and the block's warps walk a row's units; a warp adds its total into the
// row's accumulator with one 64-bit atomic (exact: addition mod 2^64). It
// publishes nothing: kvcs_checksum, queued after it on the same stream, adds
// the attention groups and its last block publishes every value.
//
// Appended to checksum.cu (one NVRTC module): it uses kvcs_warp_sum and
// kvcs_last_at_or_below from there, and KVCS_STATE_LOADS from the prelude.

// Loads vector `vector` (of 1 << vector_shift bytes) at `address` into up to
// four 32-bit words; words past the vector stay zero.
__device__ __forceinline__ uint4 kvcs_state_load(kvcs_i64 address, kvcs_u32 vector_shift)
{
    uint4 words = make_uint4(0u, 0u, 0u, 0u);
    switch (vector_shift) {
    case 4: words = __ldcs((const uint4 *)address); break;
    case 3: { const uint2 pair = __ldcs((const uint2 *)address); words.x = pair.x; words.y = pair.y; break; }
    case 2: words.x = __ldcs((const unsigned int *)address); break;
    default: words.x = __ldcs((const unsigned short *)address); break;
    }
    return words;
}

// sum f(x_e) * (2 * (index + e) + 1) over the elements e of one loaded
// vector, its first element numbered `index`; f of the call's algorithm
// (SPEC section 12: MIXED and MIXED2 mix each zero-extended element; MIX is
// a KVCS_F_* value).
template <int MIX>
__device__ __forceinline__ kvcs_u64 kvcs_state_vector(uint4 words, kvcs_u32 element_shift, kvcs_u64 index)
{
    kvcs_u64 total, weighted;
    if (MIX != KVCS_F_IDENTITY) {
        // Elements e = 0 .. 7 (2-byte) or 0 .. 3 (4-byte), each mixed; words
        // not loaded are zero and mix to zero.
        const kvcs_u32 word[4] = {words.x, words.y, words.z, words.w};
        total = 0;
        weighted = 0;
        if (element_shift == 1) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const kvcs_u64 x = kvcs_piece<MIX>((word[e >> 1] >> (16 * (e & 1))) & 0xffffu);
                total += x;
                weighted += (kvcs_u64)e * x;
            }
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const kvcs_u64 x = kvcs_piece<MIX>(word[e]);
                total += x;
                weighted += (kvcs_u64)e * x;
            }
        }
    } else if (element_shift == 1) {
        // Element 2w is word w's low half, 2w + 1 its high half; both sums
        // fit 32 bits (8 elements below 2^16, weights below 8).
        const kvcs_u32 lo = (words.x & 0xffffu) + (words.y & 0xffffu) + (words.z & 0xffffu) + (words.w & 0xffffu);
        const kvcs_u32 hi = (words.x >> 16) + (words.y >> 16) + (words.z >> 16) + (words.w >> 16);
        total = (kvcs_u64)lo + hi;
        weighted = (kvcs_u64)(2u * (words.y & 0xffffu) + 4u * (words.z & 0xffffu) + 6u * (words.w & 0xffffu)
                              + (words.x >> 16) + 3u * (words.y >> 16) + 5u * (words.z >> 16) + 7u * (words.w >> 16));
    } else {
        total = (kvcs_u64)words.x + words.y + words.z + words.w;
        weighted = (kvcs_u64)words.y + 2ull * words.z + 3ull * words.w;
    }
    return (2 * index + 1) * total + 2 * weighted;
}

// This lane's share of unit `unit` of `tensor` in state slot `block_id`.
template <int MIX>
__device__ __forceinline__ kvcs_u64 kvcs_state_unit(
    const struct kvcs_dev_state_tensor &tensor, kvcs_u32 block_id, kvcs_u32 unit, kvcs_u32 lane)
{
    const kvcs_u32 lane_shift = tensor.lane_shift;
    const kvcs_u32 column_shift = tensor.column_shift;
    const kvcs_u32 lanes = 1u << lane_shift;
    const kvcs_u32 rows_per_step = KVCS_WARP >> lane_shift;
    const kvcs_u32 steps = KVCS_STATE_LOADS >> column_shift;
    const kvcs_u32 row_block = unit / tensor.chunks_per_row;
    const kvcs_u32 chunk = unit - row_block * tensor.chunks_per_row;
    const kvcs_u64 first_row = (kvcs_u64)row_block * steps * rows_per_step + (lane >> lane_shift);
    const kvcs_u32 first_vector = chunk * (lanes << column_shift) + (lane & (lanes - 1));
    const kvcs_i64 base = (kvcs_i64)tensor.address + (kvcs_i64)block_id * tensor.block_stride;
    const kvcs_u32 vector_shift = tensor.vector_shift;

    // Every load of the unit in flight before any is used.
    uint4 words[KVCS_STATE_LOADS];
#pragma unroll
    for (int k = 0; k < KVCS_STATE_LOADS; ++k) {
        const kvcs_u64 row = first_row + (kvcs_u64)(k >> column_shift) * rows_per_step;
        const kvcs_u32 vector = first_vector + ((kvcs_u32)k & ((1u << column_shift) - 1)) * lanes;
        words[k] = make_uint4(0u, 0u, 0u, 0u);
        if (row < tensor.num_rows && vector < tensor.vectors_per_row)
            words[k] = kvcs_state_load(base + (kvcs_i64)row * tensor.row_stride + ((kvcs_i64)vector << vector_shift),
                                       vector_shift);
    }
    kvcs_u64 total = 0;
    const kvcs_u32 elements_shift = vector_shift - tensor.element_shift;
#pragma unroll
    for (int k = 0; k < KVCS_STATE_LOADS; ++k) {
        // Words of items not loaded are zero and add nothing, whatever their
        // (out of range) row's weight.
        const kvcs_u64 row = first_row + (kvcs_u64)(k >> column_shift) * rows_per_step;
        const kvcs_u32 vector = first_vector + ((kvcs_u32)k & ((1u << column_shift) - 1)) * lanes;
        const kvcs_u64 index = tensor.first_index + row * tensor.index_step + ((kvcs_u64)vector << elements_shift);
        const kvcs_u64 weight = tensor.first_weight + row * tensor.weight_step;
        total += weight * kvcs_state_vector<MIX>(words[k], tensor.element_shift, index);
    }
    return total;
}

template <int MIX>
__device__ __forceinline__ void kvcs_state_call(const struct kvcs_dev_state_call &call)
{
    const kvcs_u32 lane = threadIdx.x % KVCS_WARP;
    const kvcs_u32 warps_per_block = blockDim.x / KVCS_WARP;
    const kvcs_u32 first_unit = blockIdx.x * warps_per_block + threadIdx.x / KVCS_WARP;
    const kvcs_u32 unit_stride = gridDim.x * warps_per_block;
    const struct kvcs_dev_row *rows = call.rows ? call.rows : call.inline_rows;
    const struct kvcs_dev_state_tensor *tensors = call.tensors;
    for (kvcs_u32 r = blockIdx.y; r < call.num_rows; r += gridDim.y) {
        const struct kvcs_dev_row row = rows[r];
        const struct kvcs_dev_state_group group = call.groups[row.group_slot];
        kvcs_u64 total = 0;
        kvcs_u32 t = group.tensors_begin;
        for (kvcs_u32 unit = first_unit; unit < group.units; unit += unit_stride) {
            // Units only grow: search from the last tensor on.
            t = kvcs_last_at_or_below(t, group.tensors_end - 1, unit,
                                      [=](kvcs_u32 i) { return tensors[i].unit_start; });
            const struct kvcs_dev_state_tensor &tensor = tensors[t];
            total += kvcs_state_unit<MIX>(tensor, row.block_id, unit - tensor.unit_start, lane);
        }
        total = kvcs_warp_sum(total);
        if (lane == 0 && total != 0) atomicAdd(&call.accumulators[row.out], total);
    }
}

extern "C" __global__ void __launch_bounds__(KVCS_THREADS_PER_BLOCK)
kvcs_state(const __grid_constant__ struct kvcs_dev_state_call call)
{
    if (call.algorithm == KVCS_ALGORITHM_MIXED2) kvcs_state_call<KVCS_F_MIX2>(call);
    else if (call.algorithm == KVCS_ALGORITHM_MIXED) kvcs_state_call<KVCS_F_MIX>(call);
    else kvcs_state_call<KVCS_F_IDENTITY>(call);
}
