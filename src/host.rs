//! The host engine: computes a plan's partial checksums from host memory,
//! split over threads. Every slice is read once; contributions are added
//! with wrapping arithmetic, so the order (and the thread count) does not
//! change any value.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::checksum::{slice_weight, weighted_run, PIECE_BYTES};
use crate::layout::{Layer, Layout, Role, Segment};
use crate::plan::{Plan, Row};

/// Work items handed to a thread at a time.
const ITEMS_PER_GRAB: usize = 16;

/// Below this many bytes a call runs on the calling thread alone.
const MIN_BYTES_PER_THREAD: u64 = 4 << 20;

/// One (row, layer) pair: a block position in one layer.
#[derive(Clone, Copy)]
struct Item<'a> {
    row: &'a Row,
    layer: &'a Layer,
    column: usize,
}

/// Computes the values of `plan` on `num_threads` threads (at least 1).
///
/// The layout's registration checks guarantee every address read lies in a
/// registered region; the caller of [`crate::Worker::add_region`] promised
/// those are readable host memory.
pub fn compute(layout: &Layout, plan: &Plan, role: Role, num_threads: usize) -> Vec<u64> {
    let mut items = Vec::new();
    let mut total_bytes = 0u64;
    for row in &plan.rows {
        let group = layout.group(row.group_id).expect("plan checked the group");
        let columns = group.columns(role);
        for layer in &group.layers {
            if let Ok(column) = columns.binary_search(&layer.spec.replica) {
                items.push(Item { row, layer, column });
                total_bytes +=
                    row.valid_tokens as u64 * layer.spec.num_heads as u64 * layer.pieces_per_token * PIECE_BYTES;
            }
        }
    }
    let values: Vec<AtomicU64> = (0..plan.num_values).map(|_| AtomicU64::new(0)).collect();
    let useful_threads = (total_bytes / MIN_BYTES_PER_THREAD).max(1) as usize;
    let threads = num_threads.clamp(1, useful_threads);
    let next = AtomicUsize::new(0);
    let work = || loop {
        let start = next.fetch_add(ITEMS_PER_GRAB, Ordering::Relaxed);
        if start >= items.len() {
            break;
        }
        for item in &items[start..(start + ITEMS_PER_GRAB).min(items.len())] {
            let sum = item_checksum(item.row, item.layer);
            let out = item.row.out + item.column * item.row.column_stride;
            values[out].fetch_add(sum, Ordering::Relaxed);
        }
    };
    if threads == 1 {
        work();
    } else {
        std::thread::scope(|scope| {
            for _ in 1..threads {
                scope.spawn(work);
            }
            work();
        });
    }
    values.into_iter().map(AtomicU64::into_inner).collect()
}

/// `sum over heads of m * s` for one block position of one layer.
fn item_checksum(row: &Row, layer: &Layer) -> u64 {
    let spec = &layer.spec;
    let per_kernel_block = spec.tokens_per_kernel_block;
    let mut sum = 0u64;
    let mut token = 0u32;
    // Walk the valid tokens kernel block by kernel block.
    while token < row.valid_tokens {
        let kernel_block = token / per_kernel_block;
        let first_slot = token % per_kernel_block;
        let count = (per_kernel_block - first_slot).min(row.valid_tokens - token);
        let first_index = (row.first_token + token as u64).wrapping_mul(layer.pieces_per_token);
        for (segment, &piece_offset) in spec.segments.iter().zip(&layer.segment_piece_offsets) {
            let base = segment.address as i64
                + row.block_id as i64 * segment.block_stride
                + kernel_block as i64 * segment.kernel_block_stride
                + first_slot as i64 * segment.token_stride;
            for head in 0..spec.num_heads {
                let weight = slice_weight(spec.layer_number, spec.first_head + head);
                let head_base = base + head as i64 * segment.head_stride;
                let s = segment_tokens(layer, segment, head_base, count, first_index + piece_offset);
                sum = sum.wrapping_add(weight.wrapping_mul(s));
            }
        }
        token += count;
    }
    sum
}

/// The slice-checksum contribution of `count` consecutive tokens of one head
/// in one segment, the first at `address` with piece index `first_index`.
fn segment_tokens(layer: &Layer, segment: &Segment, address: i64, count: u32, first_index: u64) -> u64 {
    let pieces = segment.bytes_per_token as u64 / PIECE_BYTES;
    let cell_is_segment = layer.spec.segments.len() == 1;
    if cell_is_segment && segment.token_stride == segment.bytes_per_token as i64 {
        // The tokens' cells are one contiguous run of consecutive pieces.
        // SAFETY: registration checked that every (block, kernel block, head,
        // token) cell of this segment lies in a registered region.
        let run = unsafe { host_pieces(address, pieces * count as u64) };
        return weighted_run(run, first_index);
    }
    let mut sum = 0u64;
    for slot in 0..count as i64 {
        // SAFETY: as above, this token's bytes lie in a registered region.
        let run = unsafe { host_pieces(address + slot * segment.token_stride, pieces) };
        let index = first_index.wrapping_add((slot as u64).wrapping_mul(layer.pieces_per_token));
        sum = sum.wrapping_add(weighted_run(run, index));
    }
    sum
}

/// The `count` pieces at host address `address`.
///
/// # Safety
/// `address .. address + 8 * count` must be readable memory, 8-byte aligned,
/// not written while the returned slice is alive.
unsafe fn host_pieces<'a>(address: i64, count: u64) -> &'a [u64] {
    std::slice::from_raw_parts(address as usize as *const u64, count as usize)
}
