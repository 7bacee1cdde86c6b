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
            .map(|(segment, offset)| dev_segment(segment, offset, pieces, 3))
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
            let first_row = row_block as u64 * steps as u64 * rows_per_step as u64 + (lane >> tensor.lane_shift) as u64;
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
                total = total.wrapping_add(weight.wrapping_mul(vector(words, tensor.element_shift, index, algorithm)));
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

/// A layout of one group holding vLLM's indexer cells (128 key bytes then a
/// 4-byte scale, SPEC section 1) at `indexer_at`, as keys then scales (two
/// segments) or one 132-byte segment, beside an MLA-like layer of 8-byte
/// pieces (576 bytes a token).
fn indexer_and_mla(indexer_at: u64, two_segments: bool) -> Layout {
    let mut layout = Layout::default();
    layout
        .add_region(crate::inputs::layout::Region {
            address: 1 << 20,
            length: 1 << 20,
        })
        .unwrap();
    layout.add_group(3, 16).unwrap();
    let block = 16 * 132;
    let segment = |address: u64, block_stride: i64, token_stride: i64, bytes_per_token: u32| Segment {
        address,
        block_stride,
        kernel_block_stride: 0,
        head_stride: 0,
        token_stride,
        bytes_per_token,
    };
    let layer = |layer_number: u32, segments: Vec<Segment>| LayerSpec {
        group_id: 3,
        layer_number,
        first_head: 0,
        num_heads: 1,
        replica: crate::inputs::layout::ReplicaKey {
            replicas: 1,
            replica_index: 0,
        },
        num_blocks: 4,
        kernel_blocks: 1,
        tokens_per_kernel_block: 16,
        segments,
        identity: Vec::new(),
    };
    let indexer = if two_segments {
        vec![
            segment(indexer_at, block, 128, 128),
            segment(indexer_at + 16 * 128, block, 4, 4),
        ]
    } else {
        vec![segment(indexer_at, block, 132, 132)]
    };
    layout.add_layer(layer(5, indexer)).unwrap();
    layout
        .add_layer(layer(6, vec![segment((1 << 20) + (1 << 19), 16 * 576, 576, 576)]))
        .unwrap();
    layout
}

/// A layer of 4-byte pieces (vLLM's indexer cells) gets descriptors whose
/// loads are whole pieces at the widest width every address of its
/// segment is aligned to (the keys in 16-byte loads where their addresses
/// allow, the 4-byte scales one piece a load), and marks its group as one
/// that `kvcs_checksum_narrow` reads; a layer of 8-byte pieces beside it
/// keeps the descriptor it had (16-byte loads).
#[test]
fn a_layer_of_4_byte_pieces_loads_whole_pieces_and_marks_its_group_narrow() {
    for (indexer_at, keys_shift) in [(1u64 << 20, 4u32), ((1 << 20) + 8, 3), ((1 << 20) + 4, 2)] {
        let table = LayerTable::new(&indexer_and_mla(indexer_at, true)).expect("a layer of 4-byte pieces");
        let context = format!("keys at {indexer_at:#x}");
        for role in [Role::Producer, Role::Consumer] {
            assert_eq!(table.narrow[role_index(role)], vec![true], "{context}");
            assert!(table.reads_narrow(role, &[3]), "{context}");
            assert!(!table.reads_narrow(role, &[0]), "{context}");
            assert!(!table.paired[role_index(role)], "{context}");
        }
        // Layers of the consumer role, in registration order.
        let [indexer, mla] = [table.layers[2], table.layers[3]];
        let shifts = |layer: &DevLayer| {
            layer.segments[..layer.num_segments as usize]
                .iter()
                .map(|s| (s.vector_shift, s.vectors_per_token, s.flat))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            shifts(&indexer),
            vec![(keys_shift, 128 >> keys_shift, 0), (2, 1, 0)],
            "{context}"
        );
        assert_eq!(indexer.pieces_per_token, 33, "{context}");
        assert_eq!(indexer.segments[1].piece_offset, 32, "{context}");
        assert_eq!(shifts(&mla), vec![(4, 36, 1)], "{context}");
    }
    // One 132-byte segment: 4-byte loads (132 is no multiple of 8), flat.
    let table = LayerTable::new(&indexer_and_mla(1 << 20, false)).expect("one 132-byte segment");
    let indexer = table.layers[2];
    assert_eq!(
        (
            indexer.num_segments,
            indexer.segments[0].vector_shift,
            indexer.segments[0].vectors_per_token,
            indexer.segments[0].flat
        ),
        (1, 2, 33, 1)
    );
}

/// `kvcs_checksum_narrow`'s arithmetic (kernels/checksum.cu), lane by lane
/// as the kernel does it, over host memory: the call's units cut among
/// warps, `kvcs_layer_units` (chunks, kernel blocks, head groups, DCP runs),
/// and each unit as `kvcs_narrow_unit` reads a layer of 4-byte pieces and
/// `kvcs_segment_unit` (or `kvcs_flat_unit`) one of 8-byte pieces, which
/// layer being read from the descriptor as the kernel decides it. On
/// random layouts of cells of 4-byte pieces (vLLM's indexer keys then
/// scales, 4-, 12-, 20- and 132-byte cells, K and V apart or side by side,
/// HND and NHD, padded, 4-byte aligned), beside layers of 8-byte pieces,
/// with DCP placements, kernel blocks and partial last blocks, under every
/// algorithm, it gives the host engine's values and a naive reference's,
/// and every load it makes lies inside one valid cell of its segment and
/// is aligned to its width (what compute-sanitizer checks on a GPU).
mod narrow_kernel {
    use std::collections::BTreeMap;

    use super::super::*;
    use crate::base::checksum::{slice_weight, Algorithm};
    use crate::engines::host::HostEngine;
    use crate::inputs::layout::{Region, ReplicaKey};
    use crate::inputs::placement::GroupPlacement;
    use crate::plan::Row;

    /// Seeded random numbers (xorshift64), the seed from the clock.
    struct Random(u64);

    impl Random {
        fn below(&mut self, bound: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % bound
        }

        fn pick<T: Copy>(&mut self, items: &[T]) -> T {
            items[self.below(items.len() as u64) as usize]
        }
    }

    /// The byte ranges of every valid cell part the call may read, by start.
    #[derive(Default)]
    struct Readable(BTreeMap<i64, i64>);

    impl Readable {
        /// The `bytes` bytes at `address` as little-endian pieces of
        /// `piece_bytes` bytes, zero-extended; panics unless they lie in
        /// one readable range and `address` is aligned to `bytes`.
        fn load(&self, address: i64, bytes: i64, piece_bytes: i64) -> Vec<u64> {
            let inside = self.0.range(..=address).next_back();
            assert!(
                inside.is_some_and(|(_, &end)| address + bytes <= end),
                "a load of {bytes} bytes at {address:#x} leaves every valid cell"
            );
            assert_eq!(address % bytes, 0, "a load of {bytes} bytes at {address:#x}");
            // SAFETY: the bytes lie in a valid cell of a registered buffer,
            // which the test keeps alive.
            let bytes = unsafe { std::slice::from_raw_parts(address as usize as *const u8, bytes as usize) };
            bytes
                .chunks_exact(piece_bytes as usize)
                .map(|piece| piece.iter().rev().fold(0u64, |value, &byte| value << 8 | byte as u64))
                .collect()
        }
    }

    /// What a unit reads, as the kernel's arguments.
    struct Unit {
        address: i64,
        first_token: u64,
        tokens: u32,
        lane: u32,
        head_vector_shift: u32,
        token_pieces: u64,
    }

    /// `kvcs_reads_4_byte_pieces`: the cell the descriptor holds is no
    /// multiple of 8 bytes.
    fn reads_4_byte_pieces(layer: &DevLayer) -> bool {
        let cell_bytes: u32 = layer.segments[..layer.num_segments as usize]
            .iter()
            .map(|s| (s.vectors_per_token << s.vector_shift) >> layer.head_shift)
            .sum();
        !cell_bytes.is_multiple_of(8)
    }

    /// One lane's share of a unit: `kvcs_narrow_unit` for `piece_bytes` 4,
    /// `kvcs_segment_unit` (`kvcs_flat_unit` where flat) for 8, the same
    /// sums (total, the pieces' places in their vectors, rounds, steps)
    /// and the same closed form.
    fn unit_sum(
        segment: &DevSegment,
        piece_bytes: u32,
        pieces_per_token: u64,
        unit: &Unit,
        algorithm: Algorithm,
        readable: &Readable,
    ) -> u64 {
        let vector_shift = segment.vector_shift;
        let vector_bytes = 1i64 << vector_shift;
        let pieces_per_vector = (vector_bytes as u64) / piece_bytes as u64;
        let lane = unit.lane;
        let (lanes, first_vector, vectors, steps, lane_address, step_bytes, j0, step_pieces);
        if segment.flat != 0 {
            let count = unit.tokens * segment.vectors_per_token;
            if lane >= count {
                return 0;
            }
            (lanes, first_vector, vectors) = (1u32, 0u32, 1u32);
            steps = (count - lane).div_ceil(WARP);
            lane_address = unit.address + ((lane as i64) << vector_shift);
            step_bytes = (WARP as i64) << vector_shift;
            j0 = unit
                .first_token
                .wrapping_mul(pieces_per_token)
                .wrapping_add(lane as u64 * pieces_per_vector);
            step_pieces = WARP as u64 * pieces_per_vector;
        } else {
            lanes = 1u32 << segment.lane_shift;
            let tokens_per_step = WARP >> segment.lane_shift;
            let token = lane >> segment.lane_shift;
            first_vector = lane & (lanes - 1);
            vectors = segment.vectors_per_token;
            if token >= unit.tokens || first_vector >= vectors {
                return 0;
            }
            steps = (unit.tokens - token + tokens_per_step - 1) >> (5 - segment.lane_shift);
            step_bytes = tokens_per_step as i64 * segment.token_stride;
            // kvcs_vector_offset: a group's heads head_stride apart.
            let head_vector_mask = (1u32 << unit.head_vector_shift).wrapping_sub(1);
            let in_head = first_vector & head_vector_mask;
            let vector_offset = (first_vector >> unit.head_vector_shift) as i64 * segment.head_stride
                + ((in_head as i64) << vector_shift);
            lane_address = unit.address + token as i64 * segment.token_stride + vector_offset;
            j0 = unit
                .first_token
                .wrapping_mul(pieces_per_token)
                .wrapping_add(token as u64 * unit.token_pieces)
                .wrapping_add(segment.piece_offset)
                .wrapping_add(in_head as u64 * pieces_per_vector);
            step_pieces = tokens_per_step as u64 * unit.token_pieces;
        }
        let (mut total, mut high, mut round_weighted, mut step_weighted) = (0u64, 0u64, 0u64, 0u64);
        for k in 0..steps {
            let (mut vector, mut round) = (first_vector, 0u64);
            while vector < vectors {
                let at = lane_address + k as i64 * step_bytes + (vector - first_vector) as i64 * vector_bytes;
                let mut y = 0u64;
                for (h, &x) in readable.load(at, vector_bytes, piece_bytes as i64).iter().enumerate() {
                    let x = algorithm.piece(x);
                    y = y.wrapping_add(x);
                    high = high.wrapping_add((h as u64).wrapping_mul(x));
                }
                total = total.wrapping_add(y);
                round_weighted = round_weighted.wrapping_add(round.wrapping_mul(y));
                step_weighted = step_weighted.wrapping_add((k as u64).wrapping_mul(y));
                vector += lanes;
                round += 1;
            }
        }
        j0.wrapping_mul(2)
            .wrapping_add(1)
            .wrapping_mul(total)
            .wrapping_add(high.wrapping_mul(2))
            .wrapping_add((2 * lanes as u64 * pieces_per_vector).wrapping_mul(round_weighted))
            .wrapping_add(step_pieces.wrapping_mul(2).wrapping_mul(step_weighted))
    }

    /// `kvcs_segment_address`.
    fn segment_address(segment: &DevSegment, block_id: u32, kernel_block: u32, head: u32, slot: u32) -> i64 {
        segment.address as i64
            + block_id as i64 * segment.block_stride
            + kernel_block as i64 * segment.kernel_block_stride
            + head as i64 * segment.head_stride
            + slot as i64 * segment.token_stride
    }

    /// `kvcs_layer_units` of `kvcs_checksum_narrow` (no pairs, placed, narrow)
    /// for one lane: this lane's units of `layer` in `row` from the layer's
    /// unit `in_layer` while `unit` is below `end`, added to `total`.
    #[allow(clippy::too_many_arguments)]
    fn layer_units(
        layer: &DevLayer,
        row: &Row,
        split: u32,
        in_layer: u32,
        unit: &mut u64,
        end: u64,
        lane: u32,
        total: &mut u64,
        algorithm: Algorithm,
        readable: &Readable,
    ) {
        let segments = layer.num_segments;
        let kernel_blocks = layer.kernel_blocks;
        let per_head = kernel_blocks * split * segments;
        let heads = layer.num_heads >> layer.head_shift;
        let lane_head = (lane & ((1u32 << layer.segments[0].lane_shift) - 1)) >> layer.head_vector_shift;
        let mut head = in_layer / per_head;
        let mut rest = in_layer - head * per_head;
        let mut s = rest % segments;
        rest /= segments;
        let mut chunk = rest % split;
        let mut kernel_block = rest / split;
        let per_kernel_block = layer.tokens_per_kernel_block;
        let per_unit = per_kernel_block.div_ceil(split);
        let piece_bytes = if reads_4_byte_pieces(layer) { 4 } else { 8 };
        let weight = |head: u32| {
            layer
                .first_slice_weight
                .wrapping_add(2 * (head as u64 + lane_head as u64))
        };
        let mut head_sum = 0u64;
        while head < heads && *unit < end {
            let first_head = head << layer.head_shift;
            let slot = chunk * per_unit;
            let first = kernel_block * per_kernel_block + slot;
            if slot < per_kernel_block && first < row.valid_tokens {
                let tokens = per_unit.min(per_kernel_block - slot).min(row.valid_tokens - first);
                let segment = &layer.segments[s as usize];
                let mut add = |slot: u32, first_token: u64, tokens: u32, token_pieces: u64| {
                    let read = Unit {
                        address: segment_address(segment, row.block_id, kernel_block, first_head, slot),
                        first_token,
                        tokens,
                        lane,
                        head_vector_shift: layer.head_vector_shift,
                        token_pieces,
                    };
                    let sum = unit_sum(segment, piece_bytes, layer.pieces_per_token, &read, algorithm, readable);
                    head_sum = head_sum.wrapping_add(sum);
                };
                if layer.dcp_size == 1 {
                    add(slot, row.first_token + first as u64, tokens, layer.pieces_per_token);
                } else {
                    let interleave = layer.interleave;
                    let token_pieces = layer.pieces_per_token * layer.unit_step as u64;
                    let mut done = 0;
                    while done < tokens {
                        let t = first + done;
                        let run = if interleave == 1 {
                            tokens - done
                        } else {
                            (tokens - done).min(interleave - t % interleave)
                        };
                        let unit_offset = (t / interleave) as u64 * layer.dcp_size as u64 * interleave as u64
                            + layer.dcp_rank as u64 * interleave as u64
                            + (t % interleave) as u64;
                        add(slot + done, row.first_token + unit_offset, run, token_pieces);
                        done += run;
                    }
                }
            }
            *unit += 1;
            s += 1;
            if s < segments {
                continue;
            }
            s = 0;
            chunk += 1;
            if chunk < split {
                continue;
            }
            chunk = 0;
            kernel_block += 1;
            if kernel_block < kernel_blocks {
                continue;
            }
            kernel_block = 0;
            *total = total.wrapping_add(weight(first_head).wrapping_mul(head_sum));
            head_sum = 0;
            head += 1;
        }
        *total = total.wrapping_add(weight(head << layer.head_shift).wrapping_mul(head_sum));
    }

    /// `kvcs_checksum_call` of `kvcs_checksum_narrow` over `rows` in `role`
    /// at `split`, its units cut among `warps` warps, each lane's total
    /// added to its output slot.
    #[allow(clippy::too_many_arguments)]
    fn checksum_call(
        table: &LayerTable,
        role: Role,
        rows: &[Row],
        split: u32,
        warps: u64,
        algorithm: Algorithm,
        readable: &Readable,
        values: &mut [u64],
    ) {
        let groups = &table.groups[role_index(role)];
        let row_units = |row: &Row| groups[row.group_slot as usize].units as u64 * split as u64;
        let mut row_starts = Vec::with_capacity(rows.len());
        let mut total_units = 0u64;
        for row in rows {
            row_starts.push(total_units);
            total_units += row_units(row);
        }
        for warp in 0..warps {
            let first_unit = total_units * warp / warps;
            let end = total_units * (warp + 1) / warps;
            for lane in 0..WARP {
                let mut unit = first_unit;
                if unit >= end {
                    continue;
                }
                let (mut total, mut out) = (0u64, u64::MAX);
                // kvcs_row_of: the last row starting at or before the unit.
                let mut row_index = row_starts.partition_point(|&start| start <= unit) - 1;
                while unit < end {
                    let row = &rows[row_index];
                    let group = groups[row.group_slot as usize];
                    let row_start = row_starts[row_index];
                    let in_row = (unit - row_start) as u32;
                    // kvcs_layer_of: the last layer starting at or before it.
                    let mut layer_index = (group.layers_begin..group.layers_end)
                        .rev()
                        .find(|&i| table.layers[i as usize].unit_start * split <= in_row)
                        .expect("a layer holds the unit");
                    while layer_index < group.layers_end && unit < end {
                        let layer = &table.layers[layer_index as usize];
                        let layer_out = row.out as u64 + layer.column as u64 * row.column_stride as u64;
                        if layer_out != out {
                            if out != u64::MAX {
                                values[out as usize] = values[out as usize].wrapping_add(total);
                            }
                            total = 0;
                            out = layer_out;
                        }
                        let in_layer = (unit - row_start) as u32 - layer.unit_start * split;
                        layer_units(
                            layer, row, split, in_layer, &mut unit, end, lane, &mut total, algorithm, readable,
                        );
                        layer_index += 1;
                    }
                    row_index += 1;
                }
                values[out as usize] = values[out as usize].wrapping_add(total);
            }
        }
    }

    /// The naive value of every row: for each layer and head, each valid
    /// local slot's pieces read one by one at their addresses, numbered by
    /// the slot's unit in the request (SPEC sections 2, 3 and 16).
    fn naive_values(layout: &Layout, rows: &[Row], role: Role, algorithm: Algorithm) -> Vec<u64> {
        let mut values = vec![0u64; rows.len()];
        for row in rows {
            let group = layout.group_in_slot(row.group_slot);
            let placement = group.placement();
            for layer in group.layers() {
                let Ok(column) = group.columns(role).binary_search(&layer.spec.replica) else {
                    continue;
                };
                let spec = &layer.spec;
                let piece_bytes = layer.piece_bytes as i64;
                let mut value = 0u64;
                for head in 0..spec.num_heads {
                    let mut slice = 0u64;
                    for t in 0..row.valid_tokens {
                        let unit = row.first_token + placement.unit_offset(t);
                        let (kernel_block, slot) = (t / spec.tokens_per_kernel_block, t % spec.tokens_per_kernel_block);
                        for (segment, &offset) in spec.segments.iter().zip(&layer.segment_piece_offsets) {
                            for p in 0..segment.bytes_per_token as i64 / piece_bytes {
                                let at = segment.address as i64
                                    + row.block_id as i64 * segment.block_stride
                                    + kernel_block as i64 * segment.kernel_block_stride
                                    + head as i64 * segment.head_stride
                                    + slot as i64 * segment.token_stride
                                    + p * piece_bytes;
                                // SAFETY: a valid cell of a registered buffer.
                                let bytes = unsafe {
                                    std::slice::from_raw_parts(at as usize as *const u8, piece_bytes as usize)
                                };
                                let x = bytes.iter().rev().fold(0u64, |x, &byte| x << 8 | byte as u64);
                                let j = unit * layer.pieces_per_token + offset + p as u64;
                                slice = slice.wrapping_add(algorithm.piece(x).wrapping_mul(2 * j + 1));
                            }
                        }
                    }
                    value =
                        value.wrapping_add(slice_weight(spec.layer_number, spec.first_head + head).wrapping_mul(slice));
                }
                let out = row.out as usize + column * row.column_stride as usize;
                values[out] = values[out].wrapping_add(value);
            }
        }
        values
    }

    /// The cells (K bytes, V bytes: 0 for one segment) a random layer has:
    /// mostly of 4-byte pieces, some of 8-byte ones.
    const CELLS: [(u32, u32); 12] = [
        (128, 4),
        (64, 4),
        (8, 4),
        (4, 8),
        (16, 4),
        (12, 0),
        (4, 0),
        (20, 0),
        (132, 0),
        (16, 0),
        (8, 8),
        (64, 64),
    ];

    /// A random layer of group `group_id` (placement `placement`, local
    /// blocks of `local` slots): its cell, heads, layout (heads outer or
    /// tokens outer, K and V in one buffer block by block or apart,
    /// padding, a skewed start) in buffers pushed onto `buffers`.
    fn random_layer(
        random: &mut Random,
        group_id: u32,
        layer_number: u32,
        local: u32,
        buffers: &mut Vec<Vec<u64>>,
        regions: &mut Vec<Region>,
    ) -> LayerSpec {
        let (k, v) = random.pick(&CELLS);
        let align = if (k + v).is_multiple_of(8) { 8 } else { 4 };
        let heads = random.pick(&[1u32, 1, 2, 4, 8]);
        let kernel_blocks = if local.is_multiple_of(2) {
            random.pick(&[1u32, 2])
        } else {
            1
        };
        let per_kernel_block = local / kernel_blocks;
        let num_blocks = 5u32;
        let heads_outer = random.below(2) == 0;
        let side_by_side = random.below(2) == 0;
        let pad = |random: &mut Random| random.pick(&[0i64, 0, 1, 2]) * align;
        // Strides of one part of `bytes` bytes a token, without the block's.
        let part = |random: &mut Random, bytes: u32| {
            let cell = bytes as i64 + pad(random);
            let (head_stride, token_stride, kernel_block_stride) = if heads_outer {
                let head = per_kernel_block as i64 * cell + pad(random);
                (head, cell, heads as i64 * head + pad(random))
            } else {
                let token = heads as i64 * cell + pad(random);
                (cell, token, per_kernel_block as i64 * token + pad(random))
            };
            (
                head_stride,
                token_stride,
                kernel_block_stride,
                kernel_blocks as i64 * kernel_block_stride,
            )
        };
        let parts: Vec<u32> = if v == 0 { vec![k] } else { vec![k, v] };
        let shapes: Vec<_> = parts.iter().map(|&bytes| part(random, bytes)).collect();
        let mut buffer = |random: &mut Random, bytes: i64| {
            let skew = random.below(16 / align as u64) as i64 * align;
            let words: Vec<u64> = (0..(bytes + skew + 16) as usize / 8 + 1)
                .map(|_| random.below(u64::MAX))
                .collect();
            let base = words.as_ptr() as u64;
            regions.push(Region {
                address: base,
                length: words.len() as u64 * 8,
            });
            buffers.push(words);
            base + skew as u64
        };
        let segments: Vec<Segment> = if side_by_side || parts.len() == 1 {
            // One buffer, each block its parts one after the other.
            let block_stride = shapes.iter().map(|shape| shape.3).sum::<i64>() + pad(random);
            let base = buffer(random, num_blocks as i64 * block_stride);
            let mut offset = 0;
            parts
                .iter()
                .zip(&shapes)
                .map(
                    |(&bytes, &(head_stride, token_stride, kernel_block_stride, block_bytes))| {
                        let segment = Segment {
                            address: base + offset as u64,
                            block_stride,
                            kernel_block_stride,
                            head_stride,
                            token_stride,
                            bytes_per_token: bytes,
                        };
                        offset += block_bytes;
                        segment
                    },
                )
                .collect()
        } else {
            parts
                .iter()
                .zip(&shapes)
                .map(
                    |(&bytes, &(head_stride, token_stride, kernel_block_stride, block_bytes))| {
                        let block_stride = block_bytes + pad(random);
                        Segment {
                            address: buffer(random, num_blocks as i64 * block_stride),
                            block_stride,
                            kernel_block_stride,
                            head_stride,
                            token_stride,
                            bytes_per_token: bytes,
                        }
                    },
                )
                .collect()
        };
        LayerSpec {
            group_id,
            layer_number,
            first_head: random.below(4) as u32 * heads,
            num_heads: heads,
            replica: ReplicaKey {
                replicas: 1,
                replica_index: 0,
            },
            num_blocks,
            kernel_blocks,
            tokens_per_kernel_block: per_kernel_block,
            segments,
            identity: Vec::new(),
        }
    }

    #[test]
    fn the_narrow_kernels_units_give_the_host_engine_and_the_naive_reference() {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(7, |d| d.as_nanos() as u64)
            | 1;
        let mut random = Random(seed);
        let host = HostEngine::new(1).expect("a host engine");
        let mut seen = [0usize; 4];
        for case in 0..400 {
            let mut layout = Layout::default();
            let mut buffers = Vec::new();
            let mut regions = Vec::new();
            let mut specs = Vec::new();
            let num_groups = 1 + random.below(2) as u32;
            let mut placements = Vec::new();
            for group_id in 0..num_groups {
                let block_size = random.pick(&[4u32, 8, 16, 32, 64]);
                let dcp_size = random.pick(&[1u32, 1, 2, 4]).min(block_size);
                let local = block_size / dcp_size;
                let interleave = if local.is_multiple_of(2) {
                    random.pick(&[1u32, 2])
                } else {
                    1
                };
                let placement = GroupPlacement {
                    dcp_size,
                    dcp_rank: random.below(dcp_size as u64) as u32,
                    interleave,
                    tokens_per_slot: 1,
                };
                layout.add_group(group_id, block_size).unwrap();
                layout.set_group_placement(group_id, placement).unwrap();
                placements.push((block_size, placement));
                for l in 0..1 + random.below(3) as u32 {
                    specs.push(random_layer(
                        &mut random,
                        group_id,
                        10 * group_id + l,
                        local,
                        &mut buffers,
                        &mut regions,
                    ));
                }
            }
            for region in regions {
                layout.add_region(region).unwrap();
            }
            for spec in specs {
                let context = format!("seed {seed}, case {case}: {spec:?}");
                layout.add_layer(spec).unwrap_or_else(|e| panic!("{context}: {e}"));
            }
            let table = LayerTable::new(&layout).unwrap();
            // Rows: a request per group, a random run of its blocks, the
            // last partial, every local slot's cell readable.
            let mut rows = Vec::new();
            let mut readable = Readable::default();
            for (group_id, &(block_size, placement)) in placements.iter().enumerate() {
                let positions = 1 + random.below(4);
                let num_tokens = random.below(positions * block_size as u64) + 1;
                for position in 0..positions {
                    let row = Row {
                        first_token: placement.first_unit(block_size, position),
                        block_id: random.below(5) as u32,
                        valid_tokens: placement.valid_slots(block_size, num_tokens, position),
                        out: rows.len() as u32,
                        column_stride: 1,
                        group_slot: group_id as u32,
                        reserved: 0,
                    };
                    for layer in layout.group_in_slot(row.group_slot).layers() {
                        let spec = &layer.spec;
                        for head in 0..spec.num_heads {
                            for t in 0..row.valid_tokens {
                                let (kernel_block, slot) =
                                    (t / spec.tokens_per_kernel_block, t % spec.tokens_per_kernel_block);
                                for segment in &spec.segments {
                                    let start = segment.address as i64
                                        + row.block_id as i64 * segment.block_stride
                                        + kernel_block as i64 * segment.kernel_block_stride
                                        + head as i64 * segment.head_stride
                                        + slot as i64 * segment.token_stride;
                                    readable.0.insert(start, start + segment.bytes_per_token as i64);
                                }
                            }
                        }
                    }
                    rows.push(row);
                }
            }
            // The kernel's rule of the piece width, from the descriptor
            // alone, is the layout's.
            for (slot, group) in layout.groups().enumerate() {
                let described = table.groups[role_index(Role::Consumer)][slot];
                let described = &table.layers[described.layers_begin as usize..described.layers_end as usize];
                for (layer, device) in group.layers().iter().zip(described) {
                    let narrow = layer.piece_bytes == 4;
                    assert_eq!(
                        reads_4_byte_pieces(device),
                        narrow,
                        "seed {seed}, case {case}: the kernel's rule of the piece width, {device:?}"
                    );
                    seen[narrow as usize * 2 + (device.head_shift > 0) as usize] += 1;
                }
            }
            let role = if random.below(2) == 0 {
                Role::Producer
            } else {
                Role::Consumer
            };
            let r = role_index(role);
            let max_split = rows
                .iter()
                .map(|row| table.max_split[r][row.group_slot as usize])
                .min()
                .unwrap();
            let split = 1 << random.below(max_split.trailing_zeros() as u64 + 1);
            let warps = 1 + random.below(40);
            for algorithm in Algorithm::all() {
                let context = format!(
                    "seed {seed}, case {case}, {algorithm:?}, split {split}, {warps} warps, rows {rows:?}, layers {:?}",
                    table.layers
                );
                let mut kernel = vec![0u64; rows.len()];
                checksum_call(&table, role, &rows, split, warps, algorithm, &readable, &mut kernel);
                let mut engine = vec![0u64; rows.len()];
                host.compute_into(&layout, &rows, role, algorithm, &mut engine);
                assert_eq!(kernel, engine, "the host engine: {context}");
                assert_eq!(
                    kernel,
                    naive_values(&layout, &rows, role, algorithm),
                    "the naive reference: {context}"
                );
            }
        }
        assert!(
            seen.iter().all(|&n| n > 20),
            "layers drawn (8-byte, grouped 8-byte, 4-byte, grouped 4-byte): {seen:?}, seed {seed}"
        );
    }
}
