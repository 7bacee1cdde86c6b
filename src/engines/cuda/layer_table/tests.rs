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

/// The kernel reads 8-byte pieces only: a layout holding a layer of 4-byte
/// pieces (vLLM's indexer cells: 128 key bytes then a 4-byte scale, SPEC
/// section 1) is refused, naming the layer and its cell size, rather than
/// given a value of other pieces.
#[test]
fn a_layer_of_4_byte_pieces_is_refused_naming_the_layer_and_cell_size() {
    let mut layout = Layout::default();
    layout
        .add_region(crate::inputs::layout::Region {
            address: 1 << 20,
            length: 1 << 20,
        })
        .unwrap();
    layout.add_group(3, 16).unwrap();
    let block = 16 * 132;
    let segment = |address: u64, token_stride: i64, bytes_per_token: u32| Segment {
        address,
        block_stride: block,
        kernel_block_stride: 0,
        head_stride: 0,
        token_stride,
        bytes_per_token,
    };
    layout
        .add_layer(LayerSpec {
            group_id: 3,
            layer_number: 5,
            first_head: 0,
            num_heads: 1,
            replica: crate::inputs::layout::ReplicaKey {
                replicas: 1,
                replica_index: 0,
            },
            num_blocks: 4,
            kernel_blocks: 1,
            tokens_per_kernel_block: 16,
            segments: vec![segment(1 << 20, 128, 128), segment((1 << 20) + 16 * 128, 4, 4)],
            identity: Vec::new(),
        })
        .unwrap();
    let Err(error) = LayerTable::new(&layout) else {
        panic!("a layer of 4-byte pieces was taken")
    };
    let message = error.to_string();
    for needle in ["layer_number 5", "group_id 3", "132 bytes", "4-byte pieces"] {
        assert!(message.contains(needle), "{needle:?} in {message:?}");
    }
}
