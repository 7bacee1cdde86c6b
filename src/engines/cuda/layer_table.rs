//! How a registered layout becomes the device's layer table: the
//! descriptors of `descriptors.rs` for every group, role, layer and state
//! tensor, and the counts of work the launch plans from.

use super::descriptors::{
    DevGroup, DevLayer, DevSegment, DevStateGroup, DevStateTensor, BATCH, MAX_SPLIT, STATE_LOADS, WARP,
};
use crate::base::checksum::{slice_weight, PIECE_BYTES};
use crate::base::error::{err, Result};
use crate::inputs::layout::{Layer, LayerSpec, Layout, Segment};
use crate::inputs::role::Role;
use crate::inputs::state::StateLayer;

/// The device tables of a whole layout: per role, a [`DevGroup`] per group
/// slot; then the layers, per group and role, in registration order; then
/// a [`DevStateGroup`] per group slot and the state groups' tensors.
#[derive(Debug, Clone, Default)]
pub struct LayerTable {
    /// Per role (producer, consumer), per group slot.
    pub groups: [Vec<DevGroup>; 2],
    /// The layer descriptors.
    pub layers: Vec<DevLayer>,
    /// Per role, per group slot: the most chunks worth cutting a kernel block
    /// into (more would leave lanes without a full batch of loads).
    pub max_split: [Vec<u32>; 2],
    /// Per role: whether some layer has two segments read alike, which
    /// `kvcs_checksum` reads as one unit (else the call runs
    /// `kvcs_checksum_unpaired`, which has fewer registers).
    pub paired: [bool; 2],
    /// Per role: whether some layer holds more than one head (see
    /// [`LayerTable::single_head`]).
    pub multi_head: [bool; 2],
    /// Per role: whether there is any attention layer.
    pub any_layer: [bool; 2],
    /// Per role: whether some layer's tokens are spread over DCP ranks
    /// (SPEC section 16), which only `kvcs_checksum_placed` and
    /// `kvcs_checksum_narrow` number.
    pub placed: [bool; 2],
    /// Per role, per group slot: whether the group has a layer of 4-byte
    /// pieces (SPEC section 1), which only `kvcs_checksum_narrow` reads:
    /// calls with rows of such a group run it.
    pub narrow: [Vec<bool>; 2],
    /// Per group slot: its state tensors (none for attention groups).
    pub state_groups: Vec<DevStateGroup>,
    /// The state tensors of every state group, by slot, layer and tensor.
    pub state_tensors: Vec<DevStateTensor>,
}

/// Index of `role` in [`LayerTable::groups`].
pub fn role_index(role: Role) -> usize {
    role.code() as usize
}

impl LayerTable {
    /// Whether every attention layer of `role` holds one head (and there is
    /// one): such calls run `kvcs_checksum_single_head`.
    pub fn single_head(&self, role: Role) -> bool {
        self.any_layer[role_index(role)] && !self.multi_head[role_index(role)]
    }

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
                let mut narrow = false;
                for layer in &group.layers {
                    let Ok(column) = columns.binary_search(&layer.spec.replica) else {
                        continue;
                    };
                    let device_layer = dev_layer(layer, column as u32, units);
                    // Only 8-byte pieces are read in pairs (`kvcs_checksum`);
                    // two segments of 4-byte pieces never read alike anyway.
                    table.paired[role_index(role)] |= layer.piece_bytes == PIECE_BYTES && pairs(&device_layer);
                    table.multi_head[role_index(role)] |= device_layer.num_heads > 1;
                    table.any_layer[role_index(role)] = true;
                    table.placed[role_index(role)] |= device_layer.dcp_size > 1;
                    narrow |= layer.piece_bytes != PIECE_BYTES;
                    for segment in &device_layer.segments[..device_layer.num_segments as usize] {
                        let tokens_per_batch = (WARP >> segment.lane_shift) * BATCH;
                        let useful = (device_layer.tokens_per_kernel_block / tokens_per_batch).max(1);
                        max_split = max_split.min(1 << useful.ilog2());
                    }
                    let these = (device_layer.num_heads >> device_layer.head_shift) as u64
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
                table.narrow[role_index(role)].push(narrow);
                table.groups[role_index(role)].push(DevGroup {
                    layers_begin: begin,
                    layers_end: table.layers.len() as u32,
                    units: units as u32,
                    layer_units: layer_units.unwrap_or(0) as u32,
                });
            }
            let tensors_begin = table.state_tensors.len() as u32;
            let mut units = 0u64;
            for state in group.states() {
                for tensor in state_tensors(state) {
                    table.state_tensors.push(DevStateTensor {
                        unit_start: units as u32,
                        ..tensor
                    });
                    units += state_tensor_units(&tensor);
                    // Units are counted in 32 bits on the device, and a
                    // warp's next unit (at most 2^31 further) must not wrap.
                    if units > MAX_STATE_UNITS {
                        return Err(err!(
                            Unsupported,
                            "state group_id {} needs {units} or more units of work per request, more than the device engine's {MAX_STATE_UNITS} (state layer_number {})",
                            group.group_id,
                            state.spec.layer_number
                        ));
                    }
                }
            }
            table.state_groups.push(DevStateGroup {
                tensors_begin,
                tensors_end: table.state_tensors.len() as u32,
                units: units as u32,
                reserved: 0,
            });
        }
        Ok(table)
    }

    /// Whether a call in `role` with `rows_per_slot[s]` rows of group slot
    /// `s` reads a layer of 4-byte pieces (and so runs `kvcs_checksum_narrow`).
    pub fn reads_narrow(&self, role: Role, rows_per_slot: &[u64]) -> bool {
        let narrow = &self.narrow[role_index(role)];
        rows_per_slot
            .iter()
            .zip(narrow)
            .any(|(&rows, &narrow)| rows > 0 && narrow)
    }

    /// Whether group slot `slot` is a state group (its rows go to the state kernel).
    pub fn is_state_slot(&self, slot: u32) -> bool {
        self.state_groups[slot as usize].units > 0
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
            bytes_of(&self.state_groups),
            bytes_of(&self.state_tensors),
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

    /// Byte offset of the state groups in [`LayerTable::to_bytes`].
    pub fn state_groups_offset(&self) -> u64 {
        self.layers_offset() + std::mem::size_of_val(self.layers.as_slice()) as u64
    }

    /// Byte offset of the state tensors in [`LayerTable::to_bytes`].
    pub fn state_tensors_offset(&self) -> u64 {
        self.state_groups_offset() + std::mem::size_of_val(self.state_groups.as_slice()) as u64
    }
}

/// Most units of one state row (a request's state in one group): 2^31, so
/// that a warp's unit index plus the grid's stride stays in 32 bits.
const MAX_STATE_UNITS: u64 = 1 << 31;

/// The device descriptors of `state`'s tensors (`unit_start` left 0):
/// the weight and index rule of its group's kind (SPEC section 6) and how
/// the kernel cuts each tensor into units.
fn state_tensors(state: &StateLayer) -> Vec<DevStateTensor> {
    let spec = &state.spec;
    let mut elements_before = 0u64;
    let mut tensors = Vec::with_capacity(spec.tensors.len());
    for (tensor, &head_base) in spec.tensors.iter().zip(&state.head_bases) {
        let element_shift = tensor.element_size.trailing_zeros();
        let elements_per_row = (tensor.bytes_per_row >> element_shift) as u64;
        let (first_weight, weight_step, first_index, index_step) = if spec.split_known {
            // Each row a slice: head number head_base + r, elements from 0.
            (slice_weight(spec.layer_number, head_base), 2, 0, 0)
        } else {
            // The shard one slice: elements numbered across rows and tensors.
            (
                slice_weight(spec.layer_number, state.shard_head),
                0,
                elements_before,
                elements_per_row,
            )
        };
        elements_before += elements_per_row * tensor.num_rows as u64;
        // The widest load (16, 8, 4 or 2 bytes, not below an element) that
        // every row of every slot starts at and fills.
        let vector_shift = (element_shift..=4)
            .rev()
            .find(|&shift| {
                [
                    tensor.address as i64,
                    tensor.block_stride,
                    tensor.row_stride,
                    tensor.bytes_per_row as i64,
                ]
                .iter()
                .all(|value| value % (1i64 << shift) == 0)
            })
            .unwrap_or(element_shift);
        let vectors_per_row = tensor.bytes_per_row >> vector_shift;
        // Lanes per row: enough to cover a row's vectors, at most a warp;
        // then loads per lane per row, at most STATE_LOADS.
        let lanes = vectors_per_row.min(WARP).next_power_of_two();
        let columns = vectors_per_row.div_ceil(lanes).min(STATE_LOADS).next_power_of_two();
        tensors.push(DevStateTensor {
            address: tensor.address,
            block_stride: tensor.block_stride,
            row_stride: tensor.row_stride,
            first_weight,
            weight_step,
            first_index,
            index_step,
            unit_start: 0,
            num_rows: tensor.num_rows,
            vectors_per_row,
            chunks_per_row: vectors_per_row.div_ceil(lanes * columns),
            vector_shift,
            element_shift,
            lane_shift: lanes.trailing_zeros(),
            column_shift: columns.trailing_zeros(),
        });
    }
    tensors
}

/// Rows of `tensor` one unit covers.
fn state_rows_per_unit(tensor: &DevStateTensor) -> u32 {
    (STATE_LOADS >> tensor.column_shift) * (WARP >> tensor.lane_shift)
}

/// Units of `tensor` in one state slot: row blocks times column chunks.
fn state_tensor_units(tensor: &DevStateTensor) -> u64 {
    (tensor.num_rows as u64).div_ceil(state_rows_per_unit(tensor) as u64) * tensor.chunks_per_row as u64
}

fn dev_layer(layer: &Layer, column: u32, unit_start: u64) -> DevLayer {
    let spec = &layer.spec;
    let piece_shift = layer.piece_bytes.trailing_zeros();
    let mut segments = [DevSegment::default(); 2];
    for (i, segment) in spec.segments.iter().enumerate() {
        segments[i] = dev_segment(
            segment,
            layer.segment_piece_offsets[i],
            layer.pieces_per_token,
            piece_shift,
        );
    }
    for segment in &mut segments {
        // The kernel counts a flat unit's vectors in 32 bits; a flat unit's
        // pieces are numbered in one run, which slots a DCP step apart
        // (interleave 1) are not.
        if spec.tokens_per_kernel_block as u64 * segment.vectors_per_token as u64 >= 1 << 31
            || layer.placement.unit_step() != 1
        {
            segment.flat = 0;
        }
    }
    let num_segments = spec.segments.len();
    let (head_shift, head_vector_shift) = match head_group(spec, &segments[..num_segments]) {
        Some(head_shift) => {
            let head_vectors = segments[0].vectors_per_token;
            for segment in &mut segments[..num_segments] {
                segment.vectors_per_token <<= head_shift;
                segment.lane_shift = segment.vectors_per_token.trailing_zeros();
            }
            (head_shift, head_vectors.trailing_zeros())
        }
        None => (0, 31),
    };
    DevLayer {
        segments,
        first_slice_weight: slice_weight(spec.layer_number, spec.first_head),
        pieces_per_token: layer.pieces_per_token,
        num_segments: num_segments as u32,
        num_heads: spec.num_heads,
        kernel_blocks: spec.kernel_blocks,
        tokens_per_kernel_block: spec.tokens_per_kernel_block,
        column,
        unit_start: unit_start as u32,
        head_shift,
        head_vector_shift,
        dcp_size: layer.placement.dcp_size,
        dcp_rank: layer.placement.dcp_rank,
        interleave: layer.placement.interleave,
        unit_step: layer.placement.unit_step() as u32,
    }
}

/// log2 of the heads one unit of `spec` reads, if more than one: a unit
/// reads a group of heads whose vectors fill up to a warp's lanes, lane `l`
/// reading vector `l & (head vectors - 1)` of head `l >> log2(head
/// vectors)` of the group (`kvcs_vector_offset` in the kernel), rather than
/// one head's short piece of each token. Where a token's heads lie side by
/// side (token-major layouts: fp8 K/V split, 128-byte pieces 1 KiB apart,
/// 0.87 of the read ceiling ungrouped) a step reads one run; in heads-outer
/// layouts (HND) it reads one piece of each head, and a unit covers the
/// group's tokens in as many steps as a block has tokens, rather than a
/// head's few (fp8 HND, 16-token blocks: 4 steps, one batch, a head).
/// Every segment must be read alike, by whole vectors, a power of two of
/// them per head, and fewer than a warp's lanes.
fn head_group(spec: &LayerSpec, segments: &[DevSegment]) -> Option<u32> {
    let first = segments.first()?;
    let head_vectors = first.vectors_per_token;
    let alike = segments.iter().zip(&spec.segments).all(|(segment, given)| {
        segment.flat == 0
            && segment.vector_shift == first.vector_shift
            && segment.vectors_per_token == head_vectors
            && (given.bytes_per_token as u64) == (head_vectors as u64) << first.vector_shift
    });
    if !alike || !head_vectors.is_power_of_two() || head_vectors >= WARP {
        return None;
    }
    // The most heads that fit the lanes and divide the layer's heads.
    let fit = (WARP / head_vectors).min(1 << spec.num_heads.trailing_zeros().min(31));
    (fit > 1).then(|| fit.trailing_zeros())
}

/// Whether the kernel reads `layer`'s two segments as one unit: read alike,
/// lane for lane (the condition of `kvcs_layer_units` in the kernel).
fn pairs(layer: &DevLayer) -> bool {
    let [first, second] = &layer.segments;
    layer.num_segments == 2
        && first.flat == 0
        && second.flat == 0
        && first.vector_shift == second.vector_shift
        && first.vectors_per_token == second.vectors_per_token
        && first.token_stride == second.token_stride
        && (layer.head_shift == 0 || first.head_stride == second.head_stride)
}

/// The device form of `segment`, whose cell has pieces of `1 <<
/// piece_shift` bytes (registration checked that its address and strides
/// are multiples of them, SPEC section 1).
fn dev_segment(segment: &Segment, piece_offset: u64, pieces_per_token: u64, piece_shift: u32) -> DevSegment {
    // The widest load, 16 bytes down to a piece, that every address the
    // segment reaches and every token's bytes are aligned to: a load never
    // straddles two tokens or leaves the segment.
    let aligned = |shift: u32| {
        [
            segment.address as i64,
            segment.block_stride,
            segment.kernel_block_stride,
            segment.head_stride,
            segment.token_stride,
            segment.bytes_per_token as i64,
        ]
        .iter()
        .all(|value| value % (1i64 << shift) == 0)
    };
    let vector_shift = (piece_shift..=4)
        .rev()
        .find(|&shift| aligned(shift))
        .unwrap_or(piece_shift);
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
        // piece j of a unit is its j-th piece of bytes, whatever the token.
        flat: (piece_offset == 0
            && segment.bytes_per_token as u64 == pieces_per_token << piece_shift
            && segment.token_stride == segment.bytes_per_token as i64) as u32,
    }
}

#[cfg(test)]
mod tests;
