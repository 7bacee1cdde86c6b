//! How a registered layout becomes the device's layer table: the
//! descriptors of `descriptors.rs` for every group, role, layer and state
//! tensor, and the counts of work the launch plans from.

use super::descriptors::{
    DevGroup, DevLayer, DevSegment, DevStateGroup, DevStateTensor, BATCH, MAX_SPLIT, STATE_LOADS, WARP,
};
use crate::base::checksum::slice_weight;
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
    /// (SPEC section 16), which only `kvcs_checksum_placed` numbers.
    pub placed: [bool; 2],
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
                for layer in &group.layers {
                    let Ok(column) = columns.binary_search(&layer.spec.replica) else {
                        continue;
                    };
                    let device_layer = dev_layer(layer, column as u32, units);
                    table.paired[role_index(role)] |= pairs(&device_layer);
                    table.multi_head[role_index(role)] |= device_layer.num_heads > 1;
                    table.any_layer[role_index(role)] = true;
                    table.placed[role_index(role)] |= device_layer.dcp_size > 1;
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
    let mut segments = [DevSegment::default(); 2];
    for (i, segment) in spec.segments.iter().enumerate() {
        segments[i] = dev_segment(segment, layer.segment_piece_offsets[i], layer.pieces_per_token);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The heads a unit reads: grouped where every segment reads whole
    /// vectors, a power of two per head, fewer than a warp's lanes, whether
    /// a token's heads lie side by side or heads-outer; as many as fit a
    /// warp and divide the layer's heads.
    #[test]
    fn heads_are_grouped_where_whole_vectors_of_a_power_of_two_of_them_fit_a_warp() {
        // (heads, head bytes, K and V apart, heads side by side) -> head_shift.
        let cases = [
            ((8, 128, true, true), Some(2)), // fp8 K/V split: 4 heads of 8 vectors
            ((8, 256, true, true), Some(1)), // bf16: 2 heads of 16 vectors
            ((8, 256, false, true), Some(1)),
            ((6, 64, true, true), Some(1)), // 4 vectors a head, 6 heads: groups of 2
            ((12, 16, true, true), Some(2)),
            ((4, 8, true, true), Some(2)),     // 8-byte vectors: 1 a head, 4 heads
            ((3, 64, true, true), None),       // no power of two divides 3 heads but 1
            ((2, 24, true, true), None),       // 3 vectors a head
            ((4, 512, true, true), None),      // a head fills the warp
            ((8, 128, true, false), Some(2)),  // heads-outer (HND): 4 heads, one piece of each a step
            ((8, 256, false, false), Some(1)), // bf16 HND, K and V in one block
            ((2, 512, true, false), None),     // a head fills the warp
            ((1, 128, true, true), None),
        ];
        for ((heads, head_bytes, split, side_by_side), expected) in cases {
            let token_stride = if side_by_side { heads * head_bytes } else { head_bytes } as i64;
            let head_stride = if side_by_side { head_bytes } else { 16 * head_bytes } as i64;
            let segment = |address: u64| Segment {
                address,
                block_stride: 16 * (heads * head_bytes) as i64 * if split { 1 } else { 2 },
                kernel_block_stride: 0,
                head_stride,
                token_stride,
                bytes_per_token: head_bytes,
            };
            let spec = LayerSpec {
                group_id: 0,
                layer_number: 0,
                first_head: 0,
                num_heads: heads,
                replica: crate::inputs::layout::ReplicaKey {
                    replicas: 1,
                    replica_index: 0,
                },
                num_blocks: 4,
                kernel_blocks: 1,
                tokens_per_kernel_block: 16,
                segments: vec![segment(1 << 20), segment(1 << 24)],
                identity: Vec::new(),
            };
            let pieces = (2 * head_bytes / 8) as u64;
            let segments: Vec<DevSegment> = spec
                .segments
                .iter()
                .zip([0, pieces / 2])
                .map(|(segment, offset)| dev_segment(segment, offset, pieces))
                .collect();
            assert_eq!(
                head_group(&spec, &segments),
                expected,
                "{heads} heads of {head_bytes} bytes, split {split}, side by side {side_by_side}"
            );
        }
    }

    /// The state kernel's arithmetic, lane by lane as `kernels/state.cu`
    /// does it (units, rows and vectors per lane, loads, weights), run over
    /// host memory: it gives `StateLayer::block_checksum` (the host
    /// engine, checked against the naive reference in tests/it/state.rs) for
    /// narrow and wide rows, every load width, both group kinds.
    mod state_kernel {
        use super::super::*;
        use crate::base::checksum::Algorithm;
        use crate::inputs::state::{StateLayer, StateSpec, StateTensor};

        fn load(address: i64, vector_shift: u32) -> [u32; 4] {
            let bytes = |n: usize| {
                // SAFETY: the test's buffers hold every vector a unit loads.
                unsafe { std::slice::from_raw_parts(address as usize as *const u8, n) }
            };
            let mut words = [0u32; 4];
            if vector_shift == 1 {
                let b = bytes(2);
                words[0] = u16::from_le_bytes([b[0], b[1]]) as u32;
            } else {
                for (w, quad) in bytes(1 << vector_shift).chunks_exact(4).enumerate() {
                    words[w] = u32::from_le_bytes([quad[0], quad[1], quad[2], quad[3]]);
                }
            }
            words
        }

        fn vector(words: [u32; 4], element_shift: u32, index: u64, algorithm: Algorithm) -> u64 {
            let (total, weighted) = if algorithm != Algorithm::Weighted {
                // Each element mixed, as kvcs_state_vector does for MIXED and MIXED2.
                let elements: Vec<u64> = if element_shift == 1 {
                    (0..8)
                        .map(|e| ((words[e >> 1] >> (16 * (e & 1))) & 0xffff) as u64)
                        .collect()
                } else {
                    words.iter().map(|&w| w as u64).collect()
                };
                elements.iter().enumerate().fold((0u64, 0u64), |(t, w), (e, &x)| {
                    let x = algorithm.piece(x);
                    (t.wrapping_add(x), w.wrapping_add((e as u64).wrapping_mul(x)))
                })
            } else if element_shift == 1 {
                let lo: Vec<u64> = words.iter().map(|&w| (w & 0xffff) as u64).collect();
                let hi: Vec<u64> = words.iter().map(|&w| (w >> 16) as u64).collect();
                let total = lo.iter().chain(&hi).sum::<u64>();
                let weighted = (0..4)
                    .map(|w| 2 * w as u64 * lo[w] + (2 * w as u64 + 1) * hi[w])
                    .sum::<u64>();
                (total, weighted)
            } else {
                let total = words.iter().map(|&w| w as u64).sum::<u64>();
                let weighted = (0..4).map(|w| w as u64 * words[w] as u64).sum::<u64>();
                (total, weighted)
            };
            index
                .wrapping_mul(2)
                .wrapping_add(1)
                .wrapping_mul(total)
                .wrapping_add(weighted.wrapping_mul(2))
        }

        /// `kvcs_state_unit` for every lane of a warp, summed.
        fn unit_sum(tensor: &DevStateTensor, block_id: u32, unit: u32, algorithm: Algorithm) -> u64 {
            let lanes = 1u32 << tensor.lane_shift;
            let rows_per_step = WARP >> tensor.lane_shift;
            let steps = STATE_LOADS >> tensor.column_shift;
            let row_block = unit / tensor.chunks_per_row;
            let chunk = unit - row_block * tensor.chunks_per_row;
            let base = tensor.address as i64 + block_id as i64 * tensor.block_stride;
            let mut total = 0u64;
            for lane in 0..WARP {
                let first_row =
                    row_block as u64 * steps as u64 * rows_per_step as u64 + (lane >> tensor.lane_shift) as u64;
                let first_vector = chunk * (lanes << tensor.column_shift) + (lane & (lanes - 1));
                for k in 0..STATE_LOADS {
                    let row = first_row + (k >> tensor.column_shift) as u64 * rows_per_step as u64;
                    let vector_index = first_vector + (k & ((1 << tensor.column_shift) - 1)) * lanes;
                    let mut words = [0u32; 4];
                    if row < tensor.num_rows as u64 && vector_index < tensor.vectors_per_row {
                        let address =
                            base + row as i64 * tensor.row_stride + ((vector_index as i64) << tensor.vector_shift);
                        words = load(address, tensor.vector_shift);
                    }
                    let index = tensor
                        .first_index
                        .wrapping_add(row.wrapping_mul(tensor.index_step))
                        .wrapping_add((vector_index as u64) << (tensor.vector_shift - tensor.element_shift));
                    let weight = tensor.first_weight.wrapping_add(row.wrapping_mul(tensor.weight_step));
                    total =
                        total.wrapping_add(weight.wrapping_mul(vector(words, tensor.element_shift, index, algorithm)));
                }
            }
            total
        }

        #[test]
        fn the_kernels_units_give_the_host_engines_state_checksum() {
            let mut state = 0x51ed_2701_a3f9_44c3u64;
            let mut next = |bound: u64| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state % bound
            };
            let mut buffers: Vec<Vec<u64>> = Vec::new();
            let mut seen_shifts = [[false; 5]; 33];
            for case in 0..300 {
                let split_known = case % 2 == 0;
                let num_blocks = 1 + next(3) as u32;
                let block_id = next(num_blocks as u64) as u32;
                let mut tensors = Vec::new();
                let mut rows_before = 0;
                for _ in 0..1 + next(3) {
                    let element_size = [2u32, 4][next(2) as usize];
                    // Narrow rows (a few elements) to wide ones (several chunks).
                    let elements = match next(3) {
                        0 => 1 + next(6) as u32,
                        1 => 1 + next(200) as u32,
                        _ => 1 + next(3000) as u32,
                    };
                    let bytes_per_row = elements * element_size;
                    let num_rows = 1 + next(70) as u32;
                    // Pitches aligned to the element, sometimes to 16.
                    let align = [element_size, 16][next(2) as usize] as u64;
                    let row_stride = (bytes_per_row as u64).div_ceil(align) * align + align * next(3);
                    let block_stride = num_rows as u64 * row_stride + align * next(3);
                    let skew = element_size as u64 * next(8 / element_size as u64 + 1) % 16;
                    let words = (num_blocks as u64 * block_stride + skew).div_ceil(8) as usize;
                    let buffer: Vec<u64> = (0..words).map(|_| next(u64::MAX)).collect();
                    let address = buffer.as_ptr() as u64 + skew;
                    buffers.push(buffer);
                    let total_rows = num_rows + next(3) as u32;
                    let first_row = next((total_rows - num_rows + 1) as u64) as u32;
                    tensors.push(StateTensor {
                        address,
                        block_stride: block_stride as i64,
                        row_stride: row_stride as i64,
                        first_row,
                        num_rows,
                        total_rows,
                        bytes_per_row,
                        element_size,
                    });
                    rows_before += total_rows;
                }
                assert!(rows_before < 65536);
                let spec = StateSpec {
                    group_id: 0,
                    layer_number: next(100) as u32,
                    split_known,
                    num_blocks,
                    tensors,
                    identity: Vec::new(),
                };
                let layer = StateLayer::new(spec, next(8) as u32, |_, _| true).expect("state layer");
                let algorithm = Algorithm::all()[case / 2 % 3];
                let mut sum = 0u64;
                for tensor in state_tensors(&layer) {
                    seen_shifts[tensor.lane_shift as usize][tensor.vector_shift as usize] = true;
                    for unit in 0..state_tensor_units(&tensor) as u32 {
                        sum = sum.wrapping_add(unit_sum(&tensor, block_id, unit, algorithm));
                    }
                }
                assert_eq!(
                    sum,
                    layer.block_checksum(block_id, algorithm),
                    "case {case}, {algorithm:?}: {:?}",
                    layer.spec
                );
            }
            for vector_shift in 1..=4 {
                assert!(
                    seen_shifts.iter().any(|lanes| lanes[vector_shift]),
                    "no case loaded {} bytes at a time",
                    1 << vector_shift
                );
            }
            assert!(seen_shifts[5].iter().any(|&seen| seen), "no wide rows");
            assert!(seen_shifts[..5].iter().flatten().any(|&seen| seen), "no narrow rows");
        }
    }
}
