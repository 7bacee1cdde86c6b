//! What the tests pass through the C ABI and read back, in one place: the
//! strings it returns (`last_error()`, `text()`), the C form of a layer
//! spec (`c_segments()`, `c_layer()`), the options of a one-thread TP=1
//! host worker (`host_options()`) and what a report holds
//! (`report_message()`, `report_compared()`, `report_mismatches()`), for the
//! owning wrappers of each test binary.

use std::ffi::{c_char, CStr};
use std::ptr::null;

use kvcsum::ffi::constants::KVCS_HOST;
use kvcsum::ffi::report::*;
use kvcsum::ffi::status::kvcs_last_error;
use kvcsum::ffi::status::kvcs_status::KVCS_OK;
use kvcsum::ffi::worker::{kvcs_layer, kvcs_segment, kvcs_worker_options};
use kvcsum::LayerSpec;

/// `kvcs_last_error()` of this thread.
pub fn last_error() -> String {
    text(kvcs_last_error())
}

/// A NUL-terminated string the library returned (it must not be NULL).
pub fn text(ptr: *const c_char) -> String {
    assert!(!ptr.is_null(), "the library returned a NULL string");
    // SAFETY: the library's strings are NUL-terminated and live at least
    // until the next call on this thread or the owning handle's destruction.
    unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
}

/// The C form of `spec`'s segments.
pub fn c_segments(spec: &LayerSpec) -> Vec<kvcs_segment> {
    spec.segments
        .iter()
        .map(|s| kvcs_segment {
            address: s.address,
            block_stride: s.block_stride,
            kernel_block_stride: s.kernel_block_stride,
            head_stride: s.head_stride,
            token_stride: s.token_stride,
            bytes_per_token: s.bytes_per_token,
        })
        .collect()
}

/// The C form of a layer spec, borrowing its segments and identity.
pub fn c_layer(spec: &LayerSpec, segments: &[kvcs_segment]) -> kvcs_layer {
    kvcs_layer {
        group_id: spec.group_id,
        layer_number: spec.layer_number,
        first_head: spec.first_head,
        num_heads: spec.num_heads,
        replicas: spec.replica.replicas,
        replica_index: spec.replica.replica_index,
        num_blocks: spec.num_blocks,
        kernel_blocks: spec.kernel_blocks,
        tokens_per_kernel_block: spec.tokens_per_kernel_block,
        num_segments: segments.len() as u32,
        segments: segments.as_ptr(),
        identity: if spec.identity.is_empty() {
            null()
        } else {
            spec.identity.as_ptr()
        },
        identity_len: spec.identity.len(),
    }
}

/// `kvcs_report_message` of a live report.
pub fn report_message(report: *const kvcs_report) -> String {
    let mut message = null();
    assert_eq!(kvcs_report_message(report, &mut message), KVCS_OK);
    text(message)
}

/// `kvcs_report_compared_positions` of a live report.
pub fn report_compared(report: *const kvcs_report) -> u64 {
    let mut n = u64::MAX;
    assert_eq!(kvcs_report_compared_positions(report, &mut n), KVCS_OK);
    n
}

/// Every mismatch of a live report, in order.
pub fn report_mismatches(report: *const kvcs_report) -> Vec<kvcs_mismatch> {
    let mut count = 0usize;
    assert_eq!(kvcs_report_num_mismatches(report, &mut count), KVCS_OK);
    (0..count)
        .map(|i| {
            // SAFETY: all-zero bytes are a valid kvcs_mismatch (integers only).
            let mut entry: kvcs_mismatch = unsafe { std::mem::zeroed() };
            assert_eq!(kvcs_report_mismatch(report, i, &mut entry), KVCS_OK);
            entry
        })
        .collect()
}

/// The options of a host worker of TP rank 0 of 1, PP rank 0, one thread.
pub fn host_options() -> kvcs_worker_options {
    kvcs_worker_options {
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        device: KVCS_HOST,
        num_threads: 1,
    }
}
