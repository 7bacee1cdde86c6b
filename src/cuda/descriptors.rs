//! `#[repr(C)]` twins of `kernels/descriptors.cuh`, and how a registered
//! layout becomes the device's layer table.

use std::collections::HashMap;

use crate::checksum::{slice_weight, PIECE_BYTES};
use crate::error::{err, Result};
use crate::layout::{Layer, Layout, Role, Segment};

/// Rows that travel inside the launch parameters (`KVCS_INLINE_ROWS`).
pub const INLINE_ROWS: usize = 48;

/// Bytes a unit of work (one head, a chunk of tokens) aims to read.
const UNIT_BYTES: u64 = 2048;

/// Device form of a [`Segment`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DevSegment {
    pub address: u64,
    pub block_stride: i64,
    pub kernel_block_stride: i64,
    pub head_stride: i64,
    pub token_stride: i64,
    pub vectors_per_token: u32,
    pub vector_shift: u32,
    pub vector_divisor: u64,
    pub piece_offset: u64,
}

/// Device form of a [`Layer`] as one (group, role) computes it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DevLayer {
    pub segments: [DevSegment; 2],
    pub first_slice_weight: u64,
    pub pieces_per_token: u64,
    pub kernel_block_divisor: u64,
    pub num_segments: u32,
    pub num_heads: u32,
    pub tokens_per_kernel_block: u32,
    pub tokens_per_unit: u32,
    pub chunks: u32,
    pub column: u32,
    pub unit_start: u32,
    pub reserved: u32,
}

/// Device form of a [`crate::plan::Row`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DevRow {
    pub first_token: u64,
    pub unit_start: u64,
    pub block_id: u32,
    pub valid_tokens: u32,
    pub out: u32,
    pub column_stride: u32,
    pub layers_begin: u32,
    pub layers_end: u32,
}

/// The kernel's one parameter (`struct kvcs_dev_call`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DevCall {
    pub layers: u64,
    pub rows: u64,
    pub accumulators: u64,
    pub host_values: u64,
    pub finished_blocks: u64,
    pub total_units: u64,
    pub num_rows: u32,
    pub num_values: u32,
    pub inline_rows: [DevRow; INLINE_ROWS],
}

/// Where one (group, role)'s layers sit in the layer table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRange {
    /// First layer in the table.
    pub begin: u32,
    /// One past the last.
    pub end: u32,
    /// Units of one row (block position) of this group in this role.
    pub units_per_row: u64,
}

/// The layer table of a whole layout: for each group and role, its active
/// layers in registration order.
#[derive(Debug, Clone, Default)]
pub struct LayerTable {
    /// The descriptors, uploaded as one array.
    pub layers: Vec<DevLayer>,
    /// Per (group id, role), its range.
    pub ranges: HashMap<(u32, Role), LayerRange>,
}

/// `ceil(2^32 / divisor)`: `(value * d) >> 32` is `value / divisor` while
/// `value * divisor < 2^32`.
fn reciprocal(divisor: u32) -> u64 {
    (1u64 << 32).div_ceil(divisor as u64)
}

impl LayerTable {
    /// Builds the table of `layout`.
    pub fn new(layout: &Layout) -> Result<LayerTable> {
        let mut table = LayerTable::default();
        for group in layout.groups() {
            if group.block_size >= 1 << 16 {
                return Err(err!(
                    Unsupported,
                    "block_size {} of group_id {} is too large for the device engine (at most 65535)",
                    group.block_size,
                    group.group_id
                ));
            }
            for role in [Role::Producer, Role::Consumer] {
                let columns = group.columns(role);
                let begin = table.layers.len() as u32;
                let mut units = 0u64;
                for layer in &group.layers {
                    let Ok(column) = columns.binary_search(&layer.spec.replica) else {
                        continue;
                    };
                    let device_layer = dev_layer(layer, group.block_size, column as u32, units)?;
                    units += device_layer.num_heads as u64 * device_layer.chunks as u64;
                    table.layers.push(device_layer);
                }
                if units > u32::MAX as u64 {
                    return Err(err!(Unsupported, "group_id {} has too many heads for one row", group.group_id));
                }
                let range = LayerRange {
                    begin,
                    end: table.layers.len() as u32,
                    units_per_row: units,
                };
                table.ranges.insert((group.group_id, role), range);
            }
        }
        Ok(table)
    }
}

fn dev_layer(layer: &Layer, block_size: u32, column: u32, unit_start: u64) -> Result<DevLayer> {
    let spec = &layer.spec;
    let cell_bytes = layer.pieces_per_token * PIECE_BYTES;
    let tokens_per_unit = (UNIT_BYTES / cell_bytes).clamp(1, block_size as u64) as u32;
    let chunks = block_size.div_ceil(tokens_per_unit);
    let mut segments = [DevSegment::default(); 2];
    for (i, segment) in spec.segments.iter().enumerate() {
        // The kernel's reciprocal division is exact below this (see `reciprocal`).
        if segment.bytes_per_token > 1 << 18 {
            return Err(err!(
                Unsupported,
                "segments[{i}].bytes_per_token {} of layer_number {} is too large for the device engine (at most 262144)",
                segment.bytes_per_token,
                spec.layer_number
            ));
        }
        segments[i] = dev_segment(segment, layer.segment_piece_offsets[i]);
    }
    Ok(DevLayer {
        segments,
        first_slice_weight: slice_weight(spec.layer_number, spec.first_head),
        pieces_per_token: layer.pieces_per_token,
        kernel_block_divisor: reciprocal(spec.tokens_per_kernel_block),
        num_segments: spec.segments.len() as u32,
        num_heads: spec.num_heads,
        tokens_per_kernel_block: spec.tokens_per_kernel_block,
        tokens_per_unit,
        chunks,
        column,
        unit_start: unit_start as u32,
        reserved: 0,
    })
}

fn dev_segment(segment: &Segment, piece_offset: u64) -> DevSegment {
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
    DevSegment {
        address: segment.address,
        block_stride: segment.block_stride,
        kernel_block_stride: segment.kernel_block_stride,
        head_stride: segment.head_stride,
        token_stride: segment.token_stride,
        vectors_per_token,
        vector_shift,
        vector_divisor: reciprocal(vectors_per_token),
        piece_offset,
    }
}
