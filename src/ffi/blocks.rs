//! `kvcs_blocks`: the blocks of a batch of requests.

use std::ffi::c_char;

use super::handle::{free, handle, into_handle, try_handle_mut};
use super::panic::ffi_boundary;
use super::status::kvcs_status;
use super::{c_array, c_str, not_null, try_engine};
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

handle!(kvcs_blocks => BlockSet);

/// Creates an empty block set; `*out` owns it.
#[no_mangle]
pub extern "C" fn kvcs_blocks_create(out: *mut *mut kvcs_blocks) -> kvcs_status {
    ffi_boundary! {
        not_null!(out, "out");
        // SAFETY: `out` is non-NULL (checked above) and writable per the contract.
        unsafe { out.write(into_handle(BlockSet::new())) };
        kvcs_status::KVCS_OK
    }
}

/// Frees a block set. NULL is a no-op.
#[no_mangle]
pub extern "C" fn kvcs_blocks_destroy(blocks: *mut kvcs_blocks) {
    ffi_boundary! {
        // SAFETY: NULL, or made by `kvcs_blocks_create` and not freed before (the contract).
        unsafe { free(blocks) };
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
        let blocks = try_handle_mut!(blocks, "blocks");
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
        let blocks = try_handle_mut!(blocks, "blocks");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        // SAFETY: the contract gives `n` readable ids.
        let block_ids = try_engine!(unsafe { c_array(block_ids, n, "block_ids") });
        try_engine!(blocks.add_group(req_id, group_id, first_position, block_ids));
        kvcs_status::KVCS_OK
    }
}

/// Gives the block hashes of group `group_id`'s blocks in request `req_id`
/// (added before with `kvcs_blocks_add_group`): `n` hashes, one per block id
/// in order, of `hash_bytes` bytes each (at least 8; only the first 8 are
/// used), for stored checksums (docs/SPEC.md#8-stored-checksums-for-offloaded-kv). `n` must equal the group's
/// number of block ids. A later call replaces them.
#[no_mangle]
pub extern "C" fn kvcs_blocks_set_hashes(
    blocks: *mut kvcs_blocks,
    req_id: *const c_char,
    group_id: u32,
    hashes: *const u8,
    hash_bytes: usize,
    n: usize,
) -> kvcs_status {
    ffi_boundary! {
        let blocks = try_handle_mut!(blocks, "blocks");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        let Some(total) = n.checked_mul(hash_bytes) else {
            return super::status::fail(&crate::error::Error::InvalidArgument(format!(
                "n {n} x hash_bytes {hash_bytes} overflows"
            )));
        };
        // SAFETY: the contract gives `n * hash_bytes` readable bytes.
        let hashes = try_engine!(unsafe { c_array(hashes, total, "hashes") });
        try_engine!(blocks.set_hashes(req_id, group_id, hashes, hash_bytes));
        kvcs_status::KVCS_OK
    }
}
