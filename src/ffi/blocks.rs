//! `kvcs_blocks`: the blocks of a batch of requests.

use std::ffi::c_char;

use super::panic::ffi_boundary;
use super::status::kvcs_status;
use super::{c_array, c_str, not_null, try_engine, try_mut};
use crate::blocks::BlockSet;

/// A request block set (docs/SPEC.md#5-request-block-sets): per request its token count and,
/// per group, the block ids at consecutive positions.
///
/// Ownership: created by `kvcs_blocks_create`, freed by
/// `kvcs_blocks_destroy`; calls that take it only read it.
/// Thread safety: `kvcs_blocks *` calls need exclusive access; `const
/// kvcs_blocks *` calls (checksum, expect) may run concurrently.
#[allow(non_camel_case_types)]
pub struct kvcs_blocks {
    _private: [u8; 0],
}

/// The block set behind a handle (a `Box<BlockSet>`).
pub(crate) fn blocks_ref(blocks: *const kvcs_blocks) -> *const BlockSet {
    blocks.cast()
}

fn blocks_mut(blocks: *mut kvcs_blocks) -> *mut BlockSet {
    blocks.cast()
}

/// Creates an empty block set; `*out` owns it.
#[no_mangle]
pub extern "C" fn kvcs_blocks_create(out: *mut *mut kvcs_blocks) -> kvcs_status {
    ffi_boundary! {
        not_null!(out, "out");
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(Box::into_raw(Box::new(BlockSet::new())).cast()) };
        kvcs_status::KVCS_OK
    }
}

/// Frees a block set. NULL is a no-op.
#[no_mangle]
pub extern "C" fn kvcs_blocks_destroy(blocks: *mut kvcs_blocks) {
    ffi_boundary! {
        if !blocks.is_null() {
            // SAFETY: made by `kvcs_blocks_create` and not freed before.
            drop(unsafe { Box::from_raw(blocks_mut(blocks)) });
        }
    }
}

/// Adds request `req_id` (a non-empty UTF-8 string, new to this set) whose
/// blocks hold `num_tokens` tokens.
#[no_mangle]
pub extern "C" fn kvcs_blocks_add_request(
    blocks: *mut kvcs_blocks,
    req_id: *const c_char,
    num_tokens: u64,
) -> kvcs_status {
    ffi_boundary! {
        let blocks = try_mut!(blocks_mut(blocks), "blocks");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        try_engine!(blocks.add_request(req_id, num_tokens));
        kvcs_status::KVCS_OK
    }
}

/// Adds group `group_id`'s blocks of request `req_id`: `block_ids[i]` is at
/// position `first_position + i`. `(NULL, 0)` adds the group with no blocks.
/// Block ids are checked against the caches at checksum time.
#[no_mangle]
pub extern "C" fn kvcs_blocks_add_group(
    blocks: *mut kvcs_blocks,
    req_id: *const c_char,
    group_id: u32,
    first_position: u64,
    block_ids: *const u32,
    n: usize,
) -> kvcs_status {
    ffi_boundary! {
        let blocks = try_mut!(blocks_mut(blocks), "blocks");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        // SAFETY: the contract gives `n` readable ids.
        let block_ids = try_engine!(unsafe { c_array(block_ids, n, "block_ids") });
        try_engine!(blocks.add_group(req_id, group_id, first_position, block_ids));
        kvcs_status::KVCS_OK
    }
}
