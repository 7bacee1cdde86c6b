// Descriptors shared by the host (src/engines/cuda/descriptors.rs, #[repr(C)] twins
// of these) and the kernels. The library prepends this file to each kernel
// source before NVRTC compiles it, so kernels do not #include it. Before it
// come the shared constants (KVCS_WARP, KVCS_THREADS_PER_BLOCK,
// KVCS_MAX_SPLIT, KVCS_INLINE_ROWS, KVCS_INLINE_GROUPS, KVCS_BATCH,
// KVCS_STATE_LOADS, KVCS_INLINE_STATE_ROWS, KVCS_ALGORITHM_WEIGHTED,
// KVCS_ALGORITHM_MIXED, KVCS_ALGORITHM_MIXED2, KVCS_MIX_MULTIPLIER,
// KVCS_MIX2_MULTIPLIER_1..3) and
// after it static_asserts of every struct's size and field offsets, both
// generated from the Rust definitions (kernel_prelude in descriptors.rs).
#ifndef KVCS_DESCRIPTORS_CUH
#define KVCS_DESCRIPTORS_CUH

typedef unsigned long long kvcs_u64;
typedef long long kvcs_i64;
typedef unsigned int kvcs_u32;

// f of SPEC section 12 for the MIXED algorithm: g = (x ^ (x >> 32)) * C,
// f = g ^ (g >> 32). The shifts by 32 move words; the product is three
// 32-bit multiply-adds. Shared by both kernels.
__device__ __forceinline__ kvcs_u64 kvcs_mix(kvcs_u64 x) {
    const kvcs_u64 g = (x ^ (x >> 32)) * KVCS_MIX_MULTIPLIER;
    return g ^ (g >> 32);
}

// One round of MIXED2's f (SPEC section 12): (hi << 32) + lo * k, its
// halves swapped. The product-and-add is one 32x32->64 multiply-add
// (IMAD.WIDE.U32); the swap only renames the two words.
__device__ __forceinline__ kvcs_u64 kvcs_mix2_round(kvcs_u64 v, kvcs_u32 k) {
    kvcs_u64 s;
    // mad.wide.u32 rather than C's 64-bit product of a zero-extended word,
    // which NVVM writes as mul.lo.s64 and leaves ptxas to narrow.
    asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(s) : "r"((kvcs_u32)v), "r"(k), "l"(v & 0xffffffff00000000ull));
    return (s << 32) | (s >> 32);
}

// f of SPEC section 12 for the MIXED2 algorithm: three rounds, a fold
// (v ^ (v >> 32), one 32-bit XOR) after the second and the third.
__device__ __forceinline__ kvcs_u64 kvcs_mix2(kvcs_u64 x) {
    kvcs_u64 v = kvcs_mix2_round(x, KVCS_MIX2_MULTIPLIER_1);
    v = kvcs_mix2_round(v, KVCS_MIX2_MULTIPLIER_2);
    v ^= v >> 32;
    v = kvcs_mix2_round(v, KVCS_MIX2_MULTIPLIER_3);
    return v ^ (v >> 32);
}

// Which f a kernel instance computes, fixed at compile time.
#define KVCS_F_IDENTITY 0
#define KVCS_F_MIX 1
#define KVCS_F_MIX2 2

// f of the call's algorithm (a KVCS_F_* value), fixed at compile time.
template <int MIX>
__device__ __forceinline__ kvcs_u64 kvcs_piece(kvcs_u64 x) {
    return MIX == KVCS_F_MIX2 ? kvcs_mix2(x) : MIX == KVCS_F_MIX ? kvcs_mix(x) : x;
}

// One region of a layer's cache (SPEC: a cell is K then V, maybe in two regions).
// A warp reads a unit's tokens `tokens_per_step` at a time: lane l reads
// token (l >> lane_shift) of the step, vectors (l & (lanes - 1)) + i * lanes.
struct kvcs_dev_segment {
    kvcs_u64 address;             // block 0, kernel block 0, head 0, token 0
    kvcs_i64 block_stride;        // bytes between logical blocks
    kvcs_i64 kernel_block_stride; // bytes between kernel blocks of a block
    kvcs_i64 head_stride;         // bytes between heads
    kvcs_i64 token_stride;        // bytes between tokens of a kernel block
    kvcs_u64 piece_offset;        // index of the segment's first piece in a token's cell
    kvcs_u32 vectors_per_token;   // bytes_per_token >> vector_shift
    kvcs_u32 vector_shift;        // 4: 16-byte loads; 3: 8-byte loads; 2: 4-byte loads (4-byte pieces only)
    kvcs_u32 lane_shift;          // log2(lanes per token): min(32, next power of 2 of vectors_per_token)
    kvcs_u32 flat;                // 1: tokens are contiguous whole cells, so a unit is one run of pieces
};

// An attention layer as one (group, role) computes it. Its units are
// (head group, kernel block, chunk, segment): a call cuts each kernel block
// into `split` chunks; a unit reads one segment of one chunk of one group of
// 2^head_shift heads. Heads are grouped where a head's vectors are fewer
// than a warp's lanes (`head_group` in layer_table.rs): its segments'
// vectors_per_token and lane_shift are then the group's; lane l's vectors
// belong to the group's head (l & (lanes - 1)) >> head_vector_shift, at that
// head's own address (kvcs_vector_offset: side by side in token-major
// layouts, head_stride apart in heads-outer ones).
struct kvcs_dev_layer {
    struct kvcs_dev_segment segments[2];
    kvcs_u64 first_slice_weight;  // 2 * (layer * 65536 + first_head) + 1; head h adds 2h
    kvcs_u64 pieces_per_token;    // P of SPEC section 2
    kvcs_u32 num_segments;
    kvcs_u32 num_heads;
    kvcs_u32 kernel_blocks;
    kvcs_u32 tokens_per_kernel_block;
    kvcs_u32 column;              // column of this layer's replica key in the role
    kvcs_u32 unit_start;          // units (at split 1) of the group's layers before this one
    kvcs_u32 head_shift;          // log2(heads per unit); num_heads is a multiple
    kvcs_u32 head_vector_shift;   // log2(one head's vectors per token) when heads are grouped, else 31
    kvcs_u32 dcp_size;            // SPEC section 16; 1: slots numbered consecutively (all kernels but kvcs_checksum_placed)
    kvcs_u32 dcp_rank;
    kvcs_u32 interleave;
    kvcs_u32 unit_step;           // units between consecutive slots of a run: dcp_size where interleave is 1, else 1
};

// A group's layers in one role, by group slot.
struct kvcs_dev_group {
    kvcs_u32 layers_begin;        // in the layer table
    kvcs_u32 layers_end;
    kvcs_u32 units;               // units of one row at split 1
    kvcs_u32 layer_units;         // units of each layer at split 1 when all are equal, else 0
};

// One block position of one call (the host's plan::Row, uploaded as is).
struct kvcs_dev_row {
    kvcs_u64 first_token;         // request position of the block's first token
    kvcs_u32 block_id;
    kvcs_u32 valid_tokens;
    kvcs_u32 out;                 // value index of column 0
    kvcs_u32 column_stride;       // value distance between columns
    kvcs_u32 group_slot;
    kvcs_u32 reserved;
};

// KVCS_INLINE_ROWS rows pass inside the launch's parameters, so a small call
// needs no copy; so do KVCS_INLINE_GROUPS group descriptors (the rest are
// read from `groups`), saving a dependent load at the start of every warp.

// The one parameter of the checksum kernel.
struct kvcs_dev_call {
    const struct kvcs_dev_layer *layers;
    const struct kvcs_dev_group *groups;  // this role's, by slot
    const struct kvcs_dev_row *rows;      // device or mapped host memory; NULL: use inline_rows
    const kvcs_u64 *row_starts;           // first unit of each row; NULL when row_units is set
    kvcs_u64 *accumulators;               // num_values zeros; left zeroed after the call
    kvcs_u64 *host_values;                // mapped pinned host memory receiving the values
    kvcs_u32 *finished_blocks;            // zero; left zero after the call
    kvcs_u64 total_units;
    kvcs_u32 num_rows;
    kvcs_u32 num_values;
    kvcs_u32 split;                       // chunks per kernel block
    kvcs_u32 row_units;                   // units of every row (split included) when equal, else 0
    kvcs_u32 algorithm;                   // KVCS_ALGORITHM_*: f of SPEC section 12
    kvcs_u32 reserved;
    struct kvcs_dev_group inline_groups[KVCS_INLINE_GROUPS];  // slots below KVCS_INLINE_GROUPS
    struct kvcs_dev_row inline_rows[KVCS_INLINE_ROWS];
};

// One block position of a stored-checksum launch (kvcs_store, SPEC section 8).
struct kvcs_dev_stored_item {
    kvcs_u64 tag;                         // store: block hash ^ group fingerprint, XORed into the sum
    kvcs_u64 address;                     // the block's 16 bytes of stored checksum: value, stamp (device or mapped host memory)
    kvcs_u64 key;                         // store: binds the entry to its block hash and digest (the stamp's check)
    kvcs_u32 out;                         // store: value index of column 0
    kvcs_u32 column_stride;               // store: value distance between columns
    kvcs_u32 num_columns;                 // store: columns summed
    kvcs_u32 digest;                      // store: the stamp's low 32 bits (configuration and valid tokens)
};

// The one parameter of the stored-checksum kernel.
struct kvcs_dev_stored_call {
    const struct kvcs_dev_stored_item *items; // mapped pinned host memory
    const kvcs_u64 *values;               // store: the values kvcs_checksum published
    kvcs_u64 *gathered;                   // gather: two words per item, value and stamp (mapped pinned host memory)
    kvcs_u32 num_items;
    kvcs_u32 gather;                      // 0: write the entry (sum ^ tag, then the stamp) to each item's address; 1: read both into gathered
};

// A state tensor of one state layer (SPEC section 6) as this worker holds
// it. Row r weighs first_weight + r * weight_step and its first element is
// numbered first_index + r * index_step. Its units: row blocks (rows_per_unit
// = (KVCS_STATE_LOADS >> column_shift) * (KVCS_WARP >> lane_shift) rows) times
// column chunks (lanes << column_shift vectors) of a row.
struct kvcs_dev_state_tensor {
    kvcs_u64 address;             // block (state slot) 0, row 0
    kvcs_i64 block_stride;        // bytes between state slots
    kvcs_i64 row_stride;          // bytes between rows
    kvcs_u64 first_weight;        // slice weight of row 0
    kvcs_u64 weight_step;         // 2 (split known: a slice per row) or 0 (shard-keyed)
    kvcs_u64 first_index;         // index of row 0's first element: 0, or (shard-keyed) elements before it
    kvcs_u64 index_step;          // 0, or (shard-keyed) elements per row
    kvcs_u32 unit_start;          // units of the group's tensors before this one
    kvcs_u32 num_rows;
    kvcs_u32 vectors_per_row;     // bytes_per_row >> vector_shift
    kvcs_u32 chunks_per_row;      // column chunks of a row
    kvcs_u32 vector_shift;        // log2 bytes per load: 1 to 4
    kvcs_u32 element_shift;       // log2 element size: 1 or 2
    kvcs_u32 lane_shift;          // log2 lanes per row: min(32, next power of 2 of vectors_per_row)
    kvcs_u32 column_shift;        // log2 loads per lane per row in a unit
};

// A state group's tensors (all its layers', in order), by group slot; zeros
// for attention groups.
struct kvcs_dev_state_group {
    kvcs_u32 tensors_begin;       // in the state tensor table
    kvcs_u32 tensors_end;
    kvcs_u32 units;               // units of one state row
    kvcs_u32 reserved;
};

// The one parameter of the state kernel: the call's rows of state groups
// (their out is the value index of their one column).
struct kvcs_dev_state_call {
    const struct kvcs_dev_state_tensor *tensors;
    const struct kvcs_dev_state_group *groups;   // by slot
    const struct kvcs_dev_row *rows;             // device memory; NULL: use inline_rows
    kvcs_u64 *accumulators;                      // the slot's, added into; kvcs_checksum publishes them
    kvcs_u32 num_rows;
    kvcs_u32 algorithm;                          // KVCS_ALGORITHM_*: f of SPEC section 12
    struct kvcs_dev_row inline_rows[KVCS_INLINE_STATE_ROWS];
};

#endif
