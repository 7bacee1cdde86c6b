//! State (Mamba) groups, SPEC section 6: a request's running state, one
//! "block" at position 0, checksummed row by row.
//!
//! Where the TP split is known, each global row along the split dimension is
//! one slice whose head number is the row's global index, the rows of a
//! layer's tensors (conv, then ssm, say) numbered consecutively; a row's
//! pieces are its 2- or 4-byte elements read as unsigned little-endian
//! integers, `j` being the element's index within the row. Otherwise the
//! worker's whole shard of a layer is one slice with head number `tp_rank`,
//! its elements numbered across the layer's rows and tensors in order, and
//! the checksums compare only between equal TP sizes (the group is
//! shard-keyed).

use crate::base::checksum::{piece_weight, slice_weight, Algorithm, MAX_KV_HEADS_PER_LAYER};
use crate::base::error::{err, Result};

/// Most tensors one state layer may have (Mamba layers have two: conv, ssm).
pub(crate) const MAX_STATE_TENSORS: usize = 16;

/// One state tensor of a layer as this worker holds it. Strides in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateTensor {
    /// Address of block 0, row 0 (the first row held here).
    pub address: u64,
    /// Between blocks (state slots).
    pub block_stride: i64,
    /// Between rows held here.
    pub row_stride: i64,
    /// Global index of the first row held here among the tensor's rows
    /// across TP (split known only).
    pub first_row: u32,
    /// Rows held here.
    pub num_rows: u32,
    /// The tensor's rows across all TP ranks (split known only): the next
    /// tensor's rows are numbered after them.
    pub total_rows: u32,
    /// Bytes of one row: a positive multiple of `element_size`.
    pub bytes_per_row: u32,
    /// 2 or 4: elements are read as unsigned little-endian integers.
    pub element_size: u32,
}

/// A state layer's tensors on this worker, as a caller registers them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateSpec {
    /// The state group.
    pub group_id: u32,
    /// Model-wide layer number.
    pub layer_number: u32,
    /// Whether rows are slices along a known TP split (else shard-keyed).
    pub split_known: bool,
    /// Blocks (state slots) in the tensors.
    pub num_blocks: u32,
    /// The layer's tensors, in the order their rows are numbered.
    pub tensors: Vec<StateTensor>,
    /// Bytes hashed into the group fingerprint (SPEC section 7).
    pub identity: Vec<u8>,
}

/// A registered state layer.
#[derive(Debug, Clone)]
pub struct StateLayer {
    /// As registered.
    pub spec: StateSpec,
    /// Per tensor, the head number of its first row held here (split
    /// known); unused when shard-keyed.
    pub head_bases: Vec<u32>,
    /// Head number of the shard's one slice when shard-keyed: the TP rank.
    pub shard_head: u32,
}

impl StateLayer {
    /// Checks `spec` for a worker of TP rank `tp_rank`; `readable(low, high)`
    /// says whether the bytes `low .. high` lie in one registered region.
    pub fn new(spec: StateSpec, tp_rank: u32, readable: impl Fn(i128, i128) -> bool) -> Result<StateLayer> {
        let layer_number = spec.layer_number;
        if spec.tensors.is_empty() || spec.tensors.len() > MAX_STATE_TENSORS {
            return Err(err!(
                InvalidArgument,
                "num_tensors is {}, not 1 to {MAX_STATE_TENSORS} (state layer_number {layer_number})",
                spec.tensors.len()
            ));
        }
        if spec.num_blocks == 0 {
            return Err(err!(
                InvalidArgument,
                "num_blocks is 0 (state layer_number {layer_number})"
            ));
        }
        let mut head_bases = Vec::with_capacity(spec.tensors.len());
        let mut rows_before = 0u64;
        for (index, tensor) in spec.tensors.iter().enumerate() {
            check_tensor(&spec, index, tensor, &readable)?;
            if spec.split_known {
                let end = tensor.first_row as u64 + tensor.num_rows as u64;
                if end > tensor.total_rows as u64 {
                    return Err(err!(
                        InvalidArgument,
                        "tensors[{index}]: first_row {} + num_rows {} exceeds total_rows {} (state layer_number {layer_number})",
                        tensor.first_row,
                        tensor.num_rows,
                        tensor.total_rows
                    ));
                }
                head_bases.push((rows_before + tensor.first_row as u64) as u32);
                rows_before += tensor.total_rows as u64;
                if rows_before > MAX_KV_HEADS_PER_LAYER {
                    return Err(err!(
                        Unsupported,
                        "the tensors' total_rows add up to {rows_before}, more than {MAX_KV_HEADS_PER_LAYER} rows per layer (state layer_number {layer_number})"
                    ));
                }
            } else {
                head_bases.push(0);
            }
        }
        Ok(StateLayer {
            spec,
            head_bases,
            shard_head: tp_rank,
        })
    }

    /// This layer's partial checksum of the state in block `block_id`
    /// (below `num_blocks`, which the plan checked) under `algorithm`.
    pub fn block_checksum(&self, block_id: u32, algorithm: Algorithm) -> u64 {
        let layer_number = self.spec.layer_number;
        let mut sum = 0u64;
        // Shard-keyed: one slice over every row of every tensor.
        let mut shard_slice = 0u64;
        let mut shard_index = 0u64;
        for (tensor, &head_base) in self.spec.tensors.iter().zip(&self.head_bases) {
            let elements = (tensor.bytes_per_row / tensor.element_size) as u64;
            for row in 0..tensor.num_rows {
                let address =
                    tensor.address as i64 + block_id as i64 * tensor.block_stride + row as i64 * tensor.row_stride;
                // SAFETY: registration checked that every row of every block
                // lies in a registered region, aligned to the element size.
                let bytes =
                    unsafe { std::slice::from_raw_parts(address as usize as *const u8, tensor.bytes_per_row as usize) };
                if self.spec.split_known {
                    let weight = slice_weight(layer_number, head_base + row);
                    sum = sum.wrapping_add(weight.wrapping_mul(elements_run(bytes, tensor.element_size, 0, algorithm)));
                } else {
                    shard_slice =
                        shard_slice.wrapping_add(elements_run(bytes, tensor.element_size, shard_index, algorithm));
                    shard_index += elements;
                }
            }
        }
        if !self.spec.split_known {
            sum = slice_weight(layer_number, self.shard_head).wrapping_mul(shard_slice);
        }
        sum
    }
}

/// `sum_i f(x_i) * (2 * (first_index + i) + 1)` over the row's elements of
/// `element_size` bytes, read as unsigned little-endian integers and
/// zero-extended to 64 bits, `f` that of `algorithm` (SPEC section 12).
fn elements_run(bytes: &[u8], element_size: u32, first_index: u64, algorithm: Algorithm) -> u64 {
    // (2 * first_index + 1) * S0 + 2 * S1 with S0 = sum f(x_i), S1 = sum i * f(x_i).
    let (mut total, mut index_weighted) = (0u64, 0u64);
    let mut add = |i: usize, x: u64| {
        let x = algorithm.piece(x);
        total = total.wrapping_add(x);
        index_weighted = index_weighted.wrapping_add(x.wrapping_mul(i as u64));
    };
    if element_size == 2 {
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            add(i, u16::from_le_bytes([pair[0], pair[1]]) as u64);
        }
    } else {
        for (i, quad) in bytes.chunks_exact(4).enumerate() {
            add(i, u32::from_le_bytes([quad[0], quad[1], quad[2], quad[3]]) as u64);
        }
    }
    piece_weight(first_index)
        .wrapping_mul(total)
        .wrapping_add(index_weighted.wrapping_mul(2))
}

fn check_tensor(
    spec: &StateSpec,
    index: usize,
    tensor: &StateTensor,
    readable: &impl Fn(i128, i128) -> bool,
) -> Result<()> {
    let layer_number = spec.layer_number;
    let size = tensor.element_size;
    if size != 2 && size != 4 {
        return Err(err!(
            InvalidArgument,
            "tensors[{index}].element_size is {size}, not 2 or 4 (state layer_number {layer_number})"
        ));
    }
    if tensor.num_rows == 0 {
        return Err(err!(
            InvalidArgument,
            "tensors[{index}].num_rows is 0 (state layer_number {layer_number})"
        ));
    }
    if tensor.bytes_per_row == 0 || !tensor.bytes_per_row.is_multiple_of(size) {
        return Err(err!(
            InvalidArgument,
            "tensors[{index}].bytes_per_row {} is not a positive multiple of element_size {size} (state layer_number {layer_number})",
            tensor.bytes_per_row
        ));
    }
    let fields = [
        ("address", tensor.address as i128),
        ("block_stride", tensor.block_stride as i128),
        ("row_stride", tensor.row_stride as i128),
    ];
    for (name, value) in fields {
        if value % size as i128 != 0 {
            return Err(err!(
                Unsupported,
                "tensors[{index}].{name} {value} is not a multiple of element_size {size} (state layer_number {layer_number})"
            ));
        }
    }
    let (low, high) = tensor_bytes(spec, tensor);
    if !readable(low, high) {
        return Err(err!(
            OutOfBounds,
            "tensors[{index}] of state layer_number {layer_number} reaches bytes {}..{}, which no registered region holds",
            signed_hex(low),
            signed_hex(high)
        ));
    }
    Ok(())
}

/// The half-open byte range `[low, high)` that `tensor` of `spec` can reach.
pub(crate) fn tensor_bytes(spec: &StateSpec, tensor: &StateTensor) -> (i128, i128) {
    let mut low = tensor.address as i128;
    let mut high = low + tensor.bytes_per_row as i128;
    for (stride, count) in [
        (tensor.block_stride, spec.num_blocks),
        (tensor.row_stride, tensor.num_rows),
    ] {
        let span = stride as i128 * (count as i128 - 1);
        if span < 0 {
            low += span;
        } else {
            high += span;
        }
    }
    (low, high)
}

/// A byte address for a message, negative ones with a sign.
fn signed_hex(value: i128) -> String {
    if value < 0 {
        format!("-{:#x}", value.unsigned_abs())
    } else {
        format!("{value:#x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_run_is_the_weighted_sum_of_zero_extended_elements() {
        let bytes = [0xff, 0xff, 0x01, 0x00, 0x34, 0x12, 0x00, 0x80];
        // 2-byte: 0xffff, 1, 0x1234, 0x8000 at j = 5, 6, 7, 8.
        let expected = [0xffffu64, 1, 0x1234, 0x8000]
            .iter()
            .enumerate()
            .fold(0u64, |s, (i, &x)| {
                s.wrapping_add(x.wrapping_mul(2 * (5 + i as u64) + 1))
            });
        assert_eq!(elements_run(&bytes, 2, 5, Algorithm::Weighted), expected);
        // 4-byte: 0x0001ffff, 0x80001234 at j = 0, 1.
        assert_eq!(
            elements_run(&bytes, 4, 0, Algorithm::Weighted),
            0x0001ffff + 3 * 0x80001234u64
        );
        // Mixed and Mixed2: each zero-extended element through its f first.
        assert_eq!(
            elements_run(&bytes, 4, 0, Algorithm::Mixed),
            crate::base::checksum::mix(0x0001ffff)
                .wrapping_add(3u64.wrapping_mul(crate::base::checksum::mix(0x80001234)))
        );
        assert_eq!(
            elements_run(&bytes, 4, 0, Algorithm::Mixed2),
            crate::base::checksum::mix2(0x0001ffff)
                .wrapping_add(3u64.wrapping_mul(crate::base::checksum::mix2(0x80001234)))
        );
    }
}
