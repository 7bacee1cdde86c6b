//! State (Mamba) layers for tests, SPEC section 6: a logical model of a
//! layer's tensors (conv, ssm) as rows of 2- or 4-byte elements, a
//! deliberately naive reference that loops over logical indices, and
//! placements of one TP rank's rows into byte buffers (random pitches and
//! alignments, random junk around), which tests register on host workers
//! or copy to device memory and register there.

use kvcsum::{BlockSet, Region, Role, StateSpec, StateTensor, Worker};

use super::{checksum, Rng};

/// One state tensor of the whole model layer: `rows` rows of `elements`
/// elements of `element_size` bytes (values already zero-extended).
#[derive(Clone, Debug)]
pub struct LogicalTensor {
    pub element_size: u32,
    pub rows: Vec<Vec<u64>>,
}

/// One request's state: per layer number, its tensors in order.
#[derive(Clone, Debug)]
pub struct LogicalState {
    pub layers: Vec<(u32, Vec<LogicalTensor>)>,
}

/// A tensor of `rows` rows of `elements` random elements, never all zero.
pub fn random_tensor(rng: &mut Rng, element_size: u32, rows: usize, elements: usize) -> LogicalTensor {
    let mask = if element_size == 2 { 0xffff } else { 0xffff_ffff };
    LogicalTensor {
        element_size,
        rows: (0..rows)
            .map(|_| (0..elements).map(|_| (rng.next_u64() & mask).max(1)).collect())
            .collect(),
    }
}

/// Mamba-like layers: a conv tensor of 2-byte elements and an ssm tensor of
/// 4-byte elements, rows divisible by 4 so that TP 1, 2, 4 split them.
pub fn random_state(rng: &mut Rng, layer_numbers: &[u32]) -> LogicalState {
    LogicalState {
        layers: layer_numbers
            .iter()
            .map(|&layer| {
                let conv_rows = 4 * rng.range(1..5) as usize;
                let ssm_rows = 4 * rng.range(1..4) as usize;
                let (conv_elements, ssm_elements) = (rng.range(1..9) as usize, rng.range(1..40) as usize);
                let tensors = vec![
                    random_tensor(rng, 2, conv_rows, conv_elements),
                    random_tensor(rng, 4, ssm_rows, ssm_elements),
                ];
                (layer, tensors)
            })
            .collect(),
    }
}

pub fn naive_weight(layer: u32, head: u64) -> u64 {
    (layer as u64 * 65536 + head).wrapping_mul(2).wrapping_add(1)
}

/// `sum_j f(x_j) * (2j + 1)` from `first_index`, one element at a time,
/// each zero-extended element through `f` of the thread's algorithm.
pub fn naive_slice(elements: &[u64], first_index: u64) -> u64 {
    let algorithm = super::algorithm();
    elements.iter().enumerate().fold(0u64, |sum, (i, &x)| {
        sum.wrapping_add(super::naive_piece(algorithm, x).wrapping_mul(2 * (first_index + i as u64) + 1))
    })
}

/// The whole model's state checksum (split known): every global row a slice,
/// rows numbered across the layer's tensors.
pub fn naive_unsplit(state: &LogicalState) -> u64 {
    let mut sum = 0u64;
    for (layer, tensors) in &state.layers {
        let mut head = 0u64;
        for tensor in tensors {
            for row in &tensor.rows {
                sum = sum.wrapping_add(naive_weight(*layer, head).wrapping_mul(naive_slice(row, 0)));
                head += 1;
            }
        }
    }
    sum
}

/// Rank `tp_rank`'s shard-keyed checksum: its rows of every tensor, in
/// order, as one slice with head number `tp_rank`.
pub fn naive_shard(state: &LogicalState, tp_rank: u32, tp_size: u32) -> u64 {
    let mut sum = 0u64;
    for (layer, tensors) in &state.layers {
        let mut index = 0u64;
        let mut slice = 0u64;
        for tensor in tensors {
            let per_rank = tensor.rows.len() / tp_size as usize;
            for row in &tensor.rows[tp_rank as usize * per_rank..(tp_rank as usize + 1) * per_rank] {
                slice = slice.wrapping_add(naive_slice(row, index));
                index += row.len() as u64;
            }
        }
        sum = sum.wrapping_add(naive_weight(*layer, tp_rank as u64).wrapping_mul(slice));
    }
    sum
}

/// One rank's state caches in host memory: per layer and tensor a buffer of
/// `num_blocks` slots of its rows (padded pitches, random junk around), the
/// request's state written at `block_id`. `specs` address the host buffers;
/// [`RankCaches::specs_at`] moves them to copies elsewhere.
pub struct RankCaches {
    /// One buffer per tensor, layer by layer.
    pub buffers: Vec<Vec<u64>>,
    pub specs: Vec<StateSpec>,
}

impl RankCaches {
    /// The buffers as bytes, in order.
    pub fn byte_buffers(&self) -> Vec<&[u8]> {
        self.buffers
            .iter()
            // SAFETY: a u64 buffer read as its bytes.
            .map(|b| unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u8>(), b.len() * 8) })
            .collect()
    }

    /// `specs` with each tensor's address moved from its host buffer to
    /// `bases[k]`, the copy of buffer `k` (same offsets within it).
    pub fn specs_at(&self, bases: &[u64]) -> Vec<StateSpec> {
        let mut buffer = 0;
        self.specs
            .iter()
            .map(|spec| {
                let mut spec = spec.clone();
                for tensor in &mut spec.tensors {
                    let host = self.buffers[buffer].as_ptr() as u64;
                    tensor.address = bases[buffer] + (tensor.address - host);
                    buffer += 1;
                }
                spec
            })
            .collect()
    }

    /// The host buffers' addresses.
    pub fn host_bases(&self) -> Vec<u64> {
        self.buffers.iter().map(|b| b.as_ptr() as u64).collect()
    }
}

/// Places rank `tp_rank`'s rows of `state` (of `tp_size` ranks) at
/// `block_id`. Pitches and the first row's offset are multiples of the
/// element size, of 8 or of 16 at random, so that every load width is used.
#[allow(clippy::too_many_arguments)] // a test helper: each argument is one knob of the placement
pub fn place_rank(
    rng: &mut Rng,
    state: &LogicalState,
    tp_rank: u32,
    tp_size: u32,
    group_id: u32,
    split_known: bool,
    num_blocks: u32,
    block_id: u32,
) -> RankCaches {
    place_requests(
        rng,
        &[(state, block_id)],
        tp_rank,
        tp_size,
        group_id,
        split_known,
        num_blocks,
    )
}

/// [`place_rank`] for several requests' states (all of one shape), each at
/// its own block id.
pub fn place_requests(
    rng: &mut Rng,
    states: &[(&LogicalState, u32)],
    tp_rank: u32,
    tp_size: u32,
    group_id: u32,
    split_known: bool,
    num_blocks: u32,
) -> RankCaches {
    let mut buffers = Vec::new();
    let mut shapes = Vec::new();
    for (l, (layer, tensors)) in states[0].0.layers.iter().enumerate() {
        let mut layer_tensors = Vec::new();
        for (t, tensor) in tensors.iter().enumerate() {
            let per_rank = tensor.rows.len() / tp_size as usize;
            let elements = tensor.rows[0].len();
            let size = tensor.element_size as usize;
            let align = [size, 8, 16][rng.below(3) as usize];
            let row_pitch = (elements * size).div_ceil(align) * align + align * rng.below(3) as usize;
            let slot_pitch = per_rank * row_pitch + align * rng.below(3) as usize;
            let skew = size * rng.below(16 / size as u64) as usize;
            let mut buffer: Vec<u64> = (0..(skew + num_blocks as usize * slot_pitch).div_ceil(8))
                .map(|_| rng.next_u64())
                .collect();
            // SAFETY: the buffer read as its bytes.
            let bytes: &mut [u8] =
                unsafe { std::slice::from_raw_parts_mut(buffer.as_mut_ptr().cast(), buffer.len() * 8) };
            let first_row = tp_rank as usize * per_rank;
            for &(state, block_id) in states {
                let rows = &state.layers[l].1[t].rows;
                for r in 0..per_rank {
                    for (e, &x) in rows[first_row + r].iter().enumerate() {
                        let at = skew + block_id as usize * slot_pitch + r * row_pitch + e * size;
                        bytes[at..at + size].copy_from_slice(&x.to_le_bytes()[..size]);
                    }
                }
            }
            layer_tensors.push(StateTensor {
                address: buffer.as_ptr() as u64 + skew as u64,
                block_stride: slot_pitch as i64,
                row_stride: row_pitch as i64,
                first_row: first_row as u32,
                num_rows: per_rank as u32,
                total_rows: tensor.rows.len() as u32,
                bytes_per_row: (elements * size) as u32,
                element_size: tensor.element_size,
            });
            buffers.push(buffer);
        }
        shapes.push(StateSpec {
            group_id,
            layer_number: *layer,
            split_known,
            num_blocks,
            tensors: layer_tensors,
            identity: format!("('model.layers.{layer}.mixer', 'MambaSpec', 'float32')").into_bytes(),
        });
    }
    RankCaches { buffers, specs: shapes }
}

/// Another request's state of the shape of `state`: new random elements.
pub fn random_like(rng: &mut Rng, state: &LogicalState) -> LogicalState {
    LogicalState {
        layers: state
            .layers
            .iter()
            .map(|(layer, tensors)| {
                let tensors = tensors
                    .iter()
                    .map(|t| random_tensor(rng, t.element_size, t.rows.len(), t.rows[0].len()))
                    .collect();
                (*layer, tensors)
            })
            .collect(),
    }
}

/// Registers group `group_id` (block size 16), `caches`' buffers as copied
/// to `bases` (lengths as on the host) and its state layers there.
pub fn register_state_at(worker: &mut Worker, caches: &RankCaches, group_id: u32, bases: &[u64]) -> kvcsum::Result<()> {
    worker.add_group(group_id, 16)?;
    for (buffer, &base) in caches.buffers.iter().zip(bases) {
        worker.add_region(Region {
            address: base,
            length: buffer.len() as u64 * 8,
        })?;
    }
    for spec in caches.specs_at(bases) {
        worker.add_state(spec)?;
    }
    Ok(())
}

/// [`register_state_at`] at the host buffers; panics on error.
pub fn register(worker: &mut Worker, caches: &RankCaches, group_id: u32) {
    register_state_at(worker, caches, group_id, &caches.host_bases()).expect("register state");
}

/// One request's state: block `block_id` at position 0 of `group_id`.
pub fn state_blocks(req_id: &str, num_tokens: u64, group_id: u32, block_id: u32) -> BlockSet {
    let mut blocks = BlockSet::new();
    blocks.add_request(req_id, num_tokens).unwrap();
    blocks.add_group(req_id, group_id, 0, &[block_id]).unwrap();
    blocks
}

/// One rank's value at position 0 (its single column).
pub fn rank_value(worker: &Worker, blocks: &BlockSet, req_id: &str, group_id: u32, role: Role) -> u64 {
    let result = checksum(worker, blocks, role);
    let (key, values) = result.column(req_id, group_id, 0).expect("column");
    assert_eq!((key.replicas, key.replica_index), (1, 0));
    assert_eq!(values.len(), 1);
    values[0]
}
