//! `#[repr(C)]` twins of `kernels/descriptors.cuh`, the constants the kernel
//! shares with the host, and how a registered layout becomes the device's
//! layer table.
//!
//! The constants are defined here only: [`kernel_prelude`] writes them as
//! `#define`s before the kernel source, and after `descriptors.cuh` it
//! writes a `static_assert` of every descriptor's size and of every field's
//! offset, taken from these definitions with `offset_of!`. A field added,
//! removed, resized or reordered on one side only fails the kernel's
//! compilation (`tests/kernels.rs` runs NVRTC without a GPU).

use std::fmt::Write;
use std::mem::{offset_of, size_of};

use crate::checksum::slice_weight;
use crate::error::{err, Result};
use crate::layout::{Layer, Layout, Role, Segment};
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

/// Device form of a [`Segment`] (`struct kvcs_dev_segment`).
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

/// Device form of a [`Layer`] as one (group, role) computes it (`struct kvcs_dev_layer`).
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
    pub inline_groups: [DevGroup; INLINE_GROUPS],
    pub inline_rows: [Row; INLINE_ROWS],
}

/// One block position of a stored-checksum launch (`struct kvcs_dev_stored_item`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DevStoredItem {
    /// Store: the tag XORed into the sum (SPEC section 8).
    pub tag: u64,
    /// The block's 8-byte stored checksum (device or mapped host memory).
    pub address: u64,
    /// Store: value index of column 0.
    pub out: u32,
    /// Store: value distance between columns.
    pub column_stride: u32,
    /// Store: columns summed.
    pub num_columns: u32,
    /// Zero.
    pub reserved: u32,
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

/// The device tables of a whole layout: per role, a [`DevGroup`] per group
/// slot; then the layers, per group and role, in registration order.
#[derive(Debug, Clone, Default)]
pub struct LayerTable {
    /// Per role (producer, consumer), per group slot.
    pub groups: [Vec<DevGroup>; 2],
    /// The layer descriptors.
    pub layers: Vec<DevLayer>,
    /// Per role, per group slot: the most chunks worth cutting a kernel block
    /// into (more would leave lanes without a full batch of loads).
    pub max_split: [Vec<u32>; 2],
}

/// Index of `role` in [`LayerTable::groups`].
pub fn role_index(role: Role) -> usize {
    role.code() as usize
}

impl LayerTable {
    /// Builds the tables of `layout`.
    pub fn new(layout: &Layout) -> Result<LayerTable> {
        let mut table = LayerTable::default();
        for group in layout.groups() {
            for role in [Role::Producer, Role::Consumer] {
                let columns = group.columns(role);
                let begin = table.layers.len() as u32;
                let mut units = 0u64;
                let mut layer_units = None;
                let mut max_split = u32::MAX;
                for layer in &group.layers {
                    let Ok(column) = columns.binary_search(&layer.spec.replica) else {
                        continue;
                    };
                    let device_layer = dev_layer(layer, column as u32, units);
                    for segment in &device_layer.segments[..device_layer.num_segments as usize] {
                        let tokens_per_batch = (WARP >> segment.lane_shift) * BATCH;
                        let useful = (device_layer.tokens_per_kernel_block / tokens_per_batch).max(1);
                        max_split = max_split.min(1 << useful.ilog2());
                    }
                    let these = device_layer.num_heads as u64
                        * device_layer.kernel_blocks as u64
                        * device_layer.num_segments as u64;
                    layer_units = match layer_units {
                        None => Some(these),
                        Some(same) if same == these => Some(same),
                        Some(_) => Some(0),
                    };
                    units += these;
                    table.layers.push(device_layer);
                }
                // Units are counted in 32 bits on the device, times a split of at most MAX_SPLIT.
                if units * MAX_SPLIT as u64 > u32::MAX as u64 {
                    return Err(err!(
                        Unsupported,
                        "group_id {} has too many (head, kernel block) pairs for the device engine",
                        group.group_id
                    ));
                }
                table.max_split[role_index(role)].push(max_split.min(MAX_SPLIT));
                table.groups[role_index(role)].push(DevGroup {
                    layers_begin: begin,
                    layers_end: table.layers.len() as u32,
                    units: units as u32,
                    layer_units: layer_units.unwrap_or(0) as u32,
                });
            }
        }
        Ok(table)
    }

    /// The bytes to upload: producer groups, consumer groups, layers.
    pub fn to_bytes(&self) -> Vec<u8> {
        fn bytes_of<T: Copy>(items: &[T]) -> &[u8] {
            // SAFETY: T is a repr(C) descriptor of plain integers.
            unsafe { std::slice::from_raw_parts(items.as_ptr().cast::<u8>(), std::mem::size_of_val(items)) }
        }
        [
            bytes_of(&self.groups[0]),
            bytes_of(&self.groups[1]),
            bytes_of(&self.layers),
        ]
        .concat()
    }

    /// Byte offset of `role`'s groups in [`LayerTable::to_bytes`].
    pub fn groups_offset(&self, role: Role) -> u64 {
        (role_index(role) * self.groups[0].len() * std::mem::size_of::<DevGroup>()) as u64
    }

    /// Byte offset of the layers in [`LayerTable::to_bytes`].
    pub fn layers_offset(&self) -> u64 {
        (2 * self.groups[0].len() * std::mem::size_of::<DevGroup>()) as u64
    }
}

fn dev_layer(layer: &Layer, column: u32, unit_start: u64) -> DevLayer {
    let spec = &layer.spec;
    let mut segments = [DevSegment::default(); 2];
    for (i, segment) in spec.segments.iter().enumerate() {
        segments[i] = dev_segment(segment, layer.segment_piece_offsets[i], layer.pieces_per_token);
    }
    for segment in &mut segments {
        // The kernel counts a flat unit's vectors in 32 bits.
        if spec.tokens_per_kernel_block as u64 * segment.vectors_per_token as u64 >= 1 << 31 {
            segment.flat = 0;
        }
    }
    DevLayer {
        segments,
        first_slice_weight: slice_weight(spec.layer_number, spec.first_head),
        pieces_per_token: layer.pieces_per_token,
        num_segments: spec.segments.len() as u32,
        num_heads: spec.num_heads,
        kernel_blocks: spec.kernel_blocks,
        tokens_per_kernel_block: spec.tokens_per_kernel_block,
        column,
        unit_start: unit_start as u32,
    }
}

fn dev_segment(segment: &Segment, piece_offset: u64, pieces_per_token: u64) -> DevSegment {
    // 16-byte loads need every address the segment reaches 16-byte aligned.
    let wide = [
        segment.address as i64,
        segment.block_stride,
        segment.kernel_block_stride,
        segment.head_stride,
        segment.token_stride,
        segment.bytes_per_token as i64,
    ]
    .iter()
    .all(|value| value % 16 == 0);
    let vector_shift = if wide { 4 } else { 3 };
    let vectors_per_token = segment.bytes_per_token >> vector_shift;
    // Lanes per token: enough to cover a token's vectors, at most a warp.
    let lane_shift = vectors_per_token.next_power_of_two().min(32).trailing_zeros();
    DevSegment {
        address: segment.address,
        block_stride: segment.block_stride,
        kernel_block_stride: segment.kernel_block_stride,
        head_stride: segment.head_stride,
        token_stride: segment.token_stride,
        piece_offset,
        vectors_per_token,
        vector_shift,
        lane_shift,
        // The segment is the whole cell and its tokens follow each other:
        // piece j of a unit is its j-th 8 bytes, whatever the token.
        flat: (piece_offset == 0
            && segment.bytes_per_token as u64 == pieces_per_token * 8
            && segment.token_stride == segment.bytes_per_token as i64) as u32,
    }
}

/// Writes `static_assert`s of the size of `$rust` and of each field's offset
/// as `struct $c` of the kernel.
macro_rules! assert_layout {
    ($out:expr, $rust:ty => $c:literal { $($field:ident),* $(,)? }) => {{
        let out: &mut String = $out;
        let size = size_of::<$rust>();
        writeln!(
            out,
            "static_assert(sizeof(struct {c}) == {size}, \"struct {c}: {size} bytes in src/cuda/descriptors.rs\");",
            c = $c
        )
        .unwrap();
        $(
            let offset = offset_of!($rust, $field);
            writeln!(
                out,
                "static_assert(KVCS_OFFSETOF(struct {c}, {f}) == {offset}, \"struct {c}: field {f} is at byte {offset} in src/cuda/descriptors.rs\");",
                c = $c,
                f = stringify!($field)
            )
            .unwrap();
        )*
    }};
}

/// The constants the kernel shares with the host, as `#define`s that come
/// before `descriptors.cuh` (`KVCS_BATCH` stays overridable by `-D` for
/// tuning experiments).
pub fn kernel_constants() -> String {
    format!(
        "// Generated by src/cuda/descriptors.rs: constants shared with the host.\n\
         #define KVCS_WARP {WARP}\n\
         #define KVCS_THREADS_PER_BLOCK {THREADS_PER_BLOCK}\n\
         #define KVCS_MAX_SPLIT {MAX_SPLIT}\n\
         #define KVCS_INLINE_ROWS {INLINE_ROWS}\n\
         #define KVCS_INLINE_GROUPS {INLINE_GROUPS}\n\
         #ifndef KVCS_BATCH\n\
         #define KVCS_BATCH {BATCH}\n\
         #endif\n"
    )
}

/// `static_assert`s that every descriptor of `descriptors.cuh` has the size
/// and field offsets of its `#[repr(C)]` twin here; they come after it.
pub fn layout_asserts() -> String {
    // NVRTC has no <cstddef>, so no offsetof; its front end (EDG) takes a
    // member's address from a null base as a constant through __INTADDR__.
    let mut out = String::from(
        "// Generated by src/cuda/descriptors.rs: the descriptors' layout as the host has it.\n\
         #define KVCS_OFFSETOF(type, field) ((unsigned long long)__INTADDR__(&(((type *)0)->field)))\n",
    );
    assert_layout!(&mut out, DevSegment => "kvcs_dev_segment" {
        address, block_stride, kernel_block_stride, head_stride, token_stride, piece_offset,
        vectors_per_token, vector_shift, lane_shift, flat,
    });
    assert_layout!(&mut out, DevLayer => "kvcs_dev_layer" {
        segments, first_slice_weight, pieces_per_token, num_segments, num_heads, kernel_blocks,
        tokens_per_kernel_block, column, unit_start,
    });
    assert_layout!(&mut out, DevGroup => "kvcs_dev_group" { layers_begin, layers_end, units, layer_units });
    assert_layout!(&mut out, Row => "kvcs_dev_row" {
        first_token, block_id, valid_tokens, out, column_stride, group_slot, reserved,
    });
    assert_layout!(&mut out, DevCall => "kvcs_dev_call" {
        layers, groups, rows, row_starts, accumulators, host_values, finished_blocks, total_units,
        num_rows, num_values, split, row_units, inline_groups, inline_rows,
    });
    assert_layout!(&mut out, DevStoredItem => "kvcs_dev_stored_item" {
        tag, address, out, column_stride, num_columns, reserved,
    });
    assert_layout!(&mut out, DevStoredCall => "kvcs_dev_stored_call" { items, values, gathered, num_items, gather });
    out
}

/// The prelude NVRTC compiles with the kernel, around `descriptors`
/// (`kernels/descriptors.cuh`): the constants, the descriptors, then the
/// layout checks.
pub fn kernel_prelude(descriptors: &str) -> String {
    [
        kernel_constants().as_str(),
        descriptors,
        "\n",
        layout_asserts().as_str(),
    ]
    .concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prelude_checks_every_field() {
        let asserts = layout_asserts();
        // One size check per struct and one offset check per field.
        let fields = 10 + 9 + 4 + 7 + 14 + 6 + 5;
        assert_eq!(asserts.matches("static_assert(sizeof").count(), 7, "{asserts}");
        assert_eq!(
            asserts.matches("static_assert(KVCS_OFFSETOF").count(),
            fields,
            "{asserts}"
        );
        assert!(asserts.contains(&format!(
            "KVCS_OFFSETOF(struct kvcs_dev_call, inline_rows) == {}",
            offset_of!(DevCall, inline_rows)
        )));
        let constants = kernel_constants();
        assert!(constants.contains(&format!("#define KVCS_THREADS_PER_BLOCK {THREADS_PER_BLOCK}\n")));
        assert!(constants.contains(&format!("#define KVCS_INLINE_ROWS {INLINE_ROWS}\n")));
    }
}
