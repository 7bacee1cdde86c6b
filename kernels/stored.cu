// Stored checksums for offloaded KV (SPEC section 8), queued on the caller's
// stream after kvcs_checksum in the same call.
//
// Store: one thread per item adds the item's columns of the values that
// kvcs_checksum published (mapped host memory, written by the previous
// kernel of the stream, so read past the caches) and writes the entry of
// SPEC section 8 to the item's 16 bytes: value = sum ^ tag, then stamp =
// check << 32 | digest with check = f(f(value) ^ key) >> 32 (f = kvcs_mix;
// src/base/stored_entry.rs computes the same on the host). The GPU is
// little-endian, as SPEC's stored values are.
//
// Gather (a load check): one thread per item copies the stored value and
// stamp at the item's address into `gathered` (two words per item); the host
// compares once the call's event completed.
extern "C" __global__ void __launch_bounds__(KVCS_THREADS_PER_BLOCK)
kvcs_store(const __grid_constant__ struct kvcs_dev_stored_call call)
{
    const kvcs_u64 i = (kvcs_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= call.num_items) return;
    const struct kvcs_dev_stored_item item = call.items[i];
    kvcs_u64 *stored = (kvcs_u64 *)item.address;
    if (call.gather) {
        call.gathered[2 * i] = __ldcv(stored);
        call.gathered[2 * i + 1] = __ldcv(stored + 1);
        return;
    }
    kvcs_u64 sum = 0;
    for (kvcs_u32 c = 0; c < item.num_columns; ++c)
        sum += __ldcv(&call.values[item.out + (kvcs_u64)c * item.column_stride]);
    const kvcs_u64 value = sum ^ item.tag;
    const kvcs_u64 check = kvcs_mix(kvcs_mix(value) ^ item.key) >> 32;
    stored[0] = value;
    stored[1] = (check << 32) | item.digest;
}
