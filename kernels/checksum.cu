// The checksum kernel: one launch per kvcs_worker_checksum call.
//
// Work is cut into units of (row, layer, head, chunk of tokens) of about
// 2 KiB; every warp takes a contiguous range of units, so a small call still
// spreads over the whole card while a large one streams long runs per warp.
// Each lane accumulates sum(x_j * (2j + 1)) over its pieces, weighted per head
// by m (SPEC sections 2-3); a warp adds its total to the output with one
// 64-bit atomic whenever its output slot changes (exact: addition mod 2^64).
// The last block to finish copies the values to mapped host memory and
// re-zeroes the accumulators, so one launch is all a call needs.
//
// descriptors.cuh is prepended to this file by the library.

#define KVCS_WARP 32
// Loads each lane keeps in flight before it uses them.
#define KVCS_BATCH 4

__device__ __forceinline__ kvcs_u32 kvcs_divide(kvcs_u32 value, kvcs_u64 divisor) {
    // Exact for value * d < 2^32, which unit sizes guarantee (see cuda/mod.rs).
    return (kvcs_u32)(((kvcs_u64)value * divisor) >> 32);
}

__device__ __forceinline__ kvcs_u64 kvcs_warp_sum(kvcs_u64 value) {
    for (int offset = KVCS_WARP / 2; offset > 0; offset /= 2)
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

// sum over the unit's pieces in one segment of x_j * (2j + 1), this lane's share.
__device__ __forceinline__ kvcs_u64 kvcs_segment_unit(
    const struct kvcs_dev_layer *layer, const struct kvcs_dev_segment *segment,
    const struct kvcs_dev_row *row, kvcs_u32 head, kvcs_u32 first_token_in_block,
    kvcs_u32 tokens, kvcs_u32 lane)
{
    const kvcs_u32 per_token = segment->vectors_per_token;
    const kvcs_u32 count = tokens * per_token;
    const kvcs_i64 head_base = (kvcs_i64)segment->address
        + (kvcs_i64)row->block_id * segment->block_stride
        + (kvcs_i64)head * segment->head_stride;
    const kvcs_u32 pieces_per_vector = 1u << (segment->vector_shift - 3);
    kvcs_u64 sum = 0;
    for (kvcs_u32 first = lane; first < count; first += KVCS_WARP * KVCS_BATCH) {
        kvcs_u64 lo[KVCS_BATCH], hi[KVCS_BATCH], index[KVCS_BATCH];
#pragma unroll
        for (int b = 0; b < KVCS_BATCH; ++b) {
            const kvcs_u32 i = first + b * KVCS_WARP;
            lo[b] = 0; hi[b] = 0; index[b] = 0;
            if (i < count) {
                const kvcs_u32 token_in_unit = kvcs_divide(i, segment->vector_divisor);
                const kvcs_u32 vector = i - token_in_unit * per_token;
                const kvcs_u32 token = first_token_in_block + token_in_unit;
                const kvcs_u32 kernel_block = kvcs_divide(token, layer->kernel_block_divisor);
                const kvcs_u32 slot = token - kernel_block * layer->tokens_per_kernel_block;
                const kvcs_i64 address = head_base
                    + (kvcs_i64)kernel_block * segment->kernel_block_stride
                    + (kvcs_i64)slot * segment->token_stride
                    + ((kvcs_i64)vector << segment->vector_shift);
                if (segment->vector_shift == 4) {
                    const ulonglong2 v = __ldcs((const ulonglong2 *)address);
                    lo[b] = v.x; hi[b] = v.y;
                } else {
                    lo[b] = __ldcs((const kvcs_u64 *)address);
                }
                index[b] = (row->first_token + token) * layer->pieces_per_token
                    + segment->piece_offset + (kvcs_u64)vector * pieces_per_vector;
            }
        }
#pragma unroll
        for (int b = 0; b < KVCS_BATCH; ++b) {
            // Weights 2j + 1 and 2j + 3; absent pieces are zero.
            sum += lo[b] * (2 * index[b] + 1) + hi[b] * (2 * index[b] + 3);
        }
    }
    return sum;
}

extern "C" __global__ void __launch_bounds__(256)
kvcs_checksum(const __grid_constant__ struct kvcs_dev_call call)
{
    const kvcs_u32 lane = threadIdx.x % KVCS_WARP;
    const kvcs_u64 warps = (kvcs_u64)gridDim.x * (blockDim.x / KVCS_WARP);
    const kvcs_u64 warp = (kvcs_u64)blockIdx.x * (blockDim.x / KVCS_WARP) + threadIdx.x / KVCS_WARP;
    const struct kvcs_dev_row *rows = call.rows ? call.rows : call.inline_rows;

    kvcs_u64 unit = call.total_units * warp / warps;
    const kvcs_u64 end = call.total_units * (warp + 1) / warps;

    if (unit < end) {
        // The row holding `unit`: the last whose unit_start <= unit.
        kvcs_u32 low = 0, high = call.num_rows - 1;
        while (low < high) {
            const kvcs_u32 mid = (low + high + 1) / 2;
            if (rows[mid].unit_start <= unit) low = mid; else high = mid - 1;
        }
        kvcs_u32 row_index = low;
        kvcs_u64 total = 0;
        kvcs_u64 out = ~0ull;
        while (unit < end) {
            const struct kvcs_dev_row *row = &rows[row_index];
            kvcs_u64 in_row = unit - row->unit_start;
            kvcs_u32 layer_index = row->layers_begin;
            while (layer_index + 1 < row->layers_end && call.layers[layer_index + 1].unit_start <= in_row)
                ++layer_index;
            for (; layer_index < row->layers_end && unit < end; ++layer_index) {
                const struct kvcs_dev_layer *layer = &call.layers[layer_index];
                const kvcs_u64 layer_out = row->out + (kvcs_u64)layer->column * row->column_stride;
                if (layer_out != out) {
                    total = kvcs_warp_sum(total);
                    if (lane == 0 && out != ~0ull && total != 0) atomicAdd(&call.accumulators[out], total);
                    total = 0;
                    out = layer_out;
                }
                const kvcs_u32 in_layer = (kvcs_u32)(unit - row->unit_start - layer->unit_start);
                kvcs_u32 head = in_layer / layer->chunks;
                kvcs_u32 chunk = in_layer - head * layer->chunks;
                for (; head < layer->num_heads && unit < end; ++head, chunk = 0) {
                    kvcs_u64 head_sum = 0;
                    for (; chunk < layer->chunks && unit < end; ++chunk, ++unit) {
                        const kvcs_u32 first = chunk * layer->tokens_per_unit;
                        if (first >= row->valid_tokens) continue;
                        const kvcs_u32 tokens = min(layer->tokens_per_unit, row->valid_tokens - first);
                        for (kvcs_u32 s = 0; s < layer->num_segments; ++s)
                            head_sum += kvcs_segment_unit(layer, &layer->segments[s], row, head, first, tokens, lane);
                    }
                    total += (layer->first_slice_weight + 2ull * head) * head_sum;
                }
            }
            ++row_index;
        }
        total = kvcs_warp_sum(total);
        if (lane == 0 && total != 0) atomicAdd(&call.accumulators[out], total);
    }

    // The last block to finish publishes the values and leaves zeros behind.
    __shared__ bool last_block;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last_block = atomicAdd(call.finished_blocks, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last_block) return;
    __threadfence();
    for (kvcs_u32 i = threadIdx.x; i < call.num_values; i += blockDim.x)
        call.host_values[i] = atomicExch(&call.accumulators[i], 0ull);
    if (threadIdx.x == 0) *call.finished_blocks = 0;
}
