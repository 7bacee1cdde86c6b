//! `#[repr(C)]` twins of `kernels/descriptors.cuh` and the constants the
//! kernel shares with the host.
//!
//! The constants are defined here only: `kernel_prelude.rs` writes them as
//! `#define`s before the kernel source, and after `descriptors.cuh` it
//! writes a `static_assert` of every descriptor's size and of every field's
//! offset, taken from these definitions with `offset_of!`. A field added,
//! removed, resized or reordered on one side only fails the kernel's
//! compilation (`tests/kernels.rs` runs NVRTC without a GPU). How a
//! registered layout fills these descriptors is `layer_table.rs`.

use crate::plan::Row;

/// Rows that travel inside the launch parameters (`KVCS_INLINE_ROWS`).
pub(crate) const INLINE_ROWS: usize = 24;

/// Tokens a lane loads before it adds them (`KVCS_BATCH` of the kernel).
pub(crate) const BATCH: u32 = 4;

/// Group descriptors that travel inside the launch parameters (`KVCS_INLINE_GROUPS`).
pub(crate) const INLINE_GROUPS: usize = 8;

/// Threads per block of the checksum kernel (`KVCS_THREADS_PER_BLOCK`, its
/// `__launch_bounds__`).
pub(crate) const THREADS_PER_BLOCK: u32 = 256;

/// Threads per warp (`KVCS_WARP`).
pub(crate) const WARP: u32 = 32;

/// Most chunks a call cuts a kernel block into (`KVCS_MAX_SPLIT`): the
/// kernel counts a row's units in 32 bits, which the layer table checks
/// at this split.
pub(crate) const MAX_SPLIT: u32 = 8;

/// Loads per lane in one unit of the state kernel (`KVCS_STATE_LOADS`, a
/// power of two): all in flight before any is used.
pub(crate) const STATE_LOADS: u32 = 8;

/// State rows that travel inside the state kernel's launch parameters
/// (`KVCS_INLINE_STATE_ROWS`).
pub(crate) const INLINE_STATE_ROWS: usize = 16;

/// Device form of a [`Segment`](crate::inputs::layout::Segment) (`struct kvcs_dev_segment`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DevSegment {
    pub address: u64,
    pub block_stride: i64,
    pub kernel_block_stride: i64,
    pub head_stride: i64,
    pub token_stride: i64,
    pub piece_offset: u64,
    pub vectors_per_token: u32,
    pub vector_shift: u32,
    pub lane_shift: u32,
    pub flat: u32,
}

/// Device form of a [`Layer`](crate::inputs::layout::Layer) as one (group, role) computes it (`struct kvcs_dev_layer`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DevLayer {
    pub segments: [DevSegment; 2],
    pub first_slice_weight: u64,
    pub pieces_per_token: u64,
    pub num_segments: u32,
    pub num_heads: u32,
    pub kernel_blocks: u32,
    pub tokens_per_kernel_block: u32,
    pub column: u32,
    pub unit_start: u32,
    /// log2 of the heads a unit reads (see `head_group` in `layer_table.rs`).
    pub head_shift: u32,
    /// log2 of one head's vectors per token where heads are grouped, else 31.
    pub head_vector_shift: u32,
    /// The group's DCP size (SPEC section 16); 1: slots are numbered
    /// consecutively from the row's first unit (every kernel but
    /// `kvcs_checksum_placed` assumes it).
    pub dcp_size: u32,
    /// This worker's DCP rank.
    pub dcp_rank: u32,
    /// The group's interleave.
    pub interleave: u32,
    /// The step between the units of consecutive slots of one run: the DCP
    /// size where the interleave is 1, else 1.
    pub unit_step: u32,
}

/// A group's layers in one role (`struct kvcs_dev_group`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DevGroup {
    pub layers_begin: u32,
    pub layers_end: u32,
    pub units: u32,
    pub layer_units: u32,
}

/// The kernel's one parameter (`struct kvcs_dev_call`). Rows are
/// [`crate::plan::Row`]s, whose layout is `struct kvcs_dev_row`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DevCall {
    pub layers: u64,
    pub groups: u64,
    pub rows: u64,
    pub row_starts: u64,
    pub accumulators: u64,
    pub host_values: u64,
    pub finished_blocks: u64,
    pub total_units: u64,
    pub num_rows: u32,
    pub num_values: u32,
    pub split: u32,
    pub row_units: u32,
    /// The call's algorithm, `KVCS_ALGORITHM_*` (SPEC section 12).
    pub algorithm: u32,
    pub reserved: u32,
    pub inline_groups: [DevGroup; INLINE_GROUPS],
    pub inline_rows: [Row; INLINE_ROWS],
}

/// One block position of a stored-checksum launch (`struct kvcs_dev_stored_item`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DevStoredItem {
    /// Store: the tag XORed into the sum (SPEC section 8).
    pub tag: u64,
    /// The block's 16 bytes of stored checksum (device or mapped host
    /// memory): the value, then the stamp.
    pub address: u64,
    /// Store: the key that binds the entry to its block hash and digest
    /// (SPEC section 8): the stamp's check is `f(f(value) ^ key) >> 32`.
    pub key: u64,
    /// Store: value index of column 0.
    pub out: u32,
    /// Store: value distance between columns.
    pub column_stride: u32,
    /// Store: columns summed.
    pub num_columns: u32,
    /// Store: the digest (configuration and valid tokens), the stamp's low
    /// 32 bits.
    pub digest: u32,
}

/// The stored-checksum kernel's one parameter (`struct kvcs_dev_stored_call`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DevStoredCall {
    pub items: u64,
    pub values: u64,
    pub gathered: u64,
    pub num_items: u32,
    pub gather: u32,
}

/// Device form of one tensor of a state layer (`struct kvcs_dev_state_tensor`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DevStateTensor {
    pub address: u64,
    pub block_stride: i64,
    pub row_stride: i64,
    pub first_weight: u64,
    pub weight_step: u64,
    pub first_index: u64,
    pub index_step: u64,
    pub unit_start: u32,
    pub num_rows: u32,
    pub vectors_per_row: u32,
    pub chunks_per_row: u32,
    pub vector_shift: u32,
    pub element_shift: u32,
    pub lane_shift: u32,
    pub column_shift: u32,
}

/// A state group's tensors, by group slot (`struct kvcs_dev_state_group`);
/// zeros for attention groups.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DevStateGroup {
    pub tensors_begin: u32,
    pub tensors_end: u32,
    pub units: u32,
    pub reserved: u32,
}

/// The state kernel's one parameter (`struct kvcs_dev_state_call`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DevStateCall {
    pub tensors: u64,
    pub groups: u64,
    pub rows: u64,
    pub accumulators: u64,
    pub num_rows: u32,
    /// The call's algorithm, `KVCS_ALGORITHM_*` (SPEC section 12).
    pub algorithm: u32,
    pub inline_rows: [Row; INLINE_STATE_ROWS],
}
