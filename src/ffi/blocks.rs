//! `kvcs_blocks`: the blocks of a batch of requests.

use std::ffi::c_char;

use super::handle::{free, handle, into_handle, try_handle_mut};
use super::panic::ffi_boundary;
use super::status::kvcs_status;
use super::{c_array, c_str, not_null, try_engine};
use crate::inputs::blocks::{BlockArrays, BlockSet};

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
            return super::status::fail(&crate::base::error::Error::InvalidArgument(format!(
                "n {n} x hash_bytes {hash_bytes} overflows"
            )));
        };
        // SAFETY: the contract gives `n * hash_bytes` readable bytes.
        let hashes = try_engine!(unsafe { c_array(hashes, total, "hashes") });
        try_engine!(blocks.set_hashes(req_id, group_id, hashes, hash_bytes));
        kvcs_status::KVCS_OK
    }
}

/// Adds `num_requests` requests with their groups and blocks in one call,
/// from arrays in compressed rows (docs/SPEC.md#5-request-block-sets), as
/// `kvcs_blocks_add_request`, `kvcs_blocks_add_group` and
/// `kvcs_blocks_set_hashes` would one request and group at a time:
///
/// - request `i`'s id is bytes `req_id_ends[i - 1] .. req_id_ends[i]` of
///   `req_ids` (from 0 for `i = 0`; UTF-8 without NUL, non-empty, new to
///   this set and to these arrays; no terminating NUL), its token count `num_tokens[i]`, its
///   groups `group_ends[i - 1] .. group_ends[i]` of the group arrays;
/// - group `g` (of `num_groups`) is `group_ids[g]` (once per request), its
///   first block at position `first_positions[g]`, its blocks
///   `block_ends[g - 1] .. block_ends[g]` of `block_ids` (of
///   `num_block_ids`);
/// - `hashes`, NULL or `num_block_ids * hash_bytes` bytes: a block hash per
///   block id, as `kvcs_blocks_set_hashes` gives them (`hash_bytes` at
///   least 8), for every group; with NULL `hash_bytes` is ignored.
///
/// Each `*_ends` array never decreases and its last entry is the length of
/// what it divides (`req_id_ends[num_requests - 1]` the bytes of `req_ids`,
/// `group_ends[num_requests - 1] == num_groups`, `block_ends[num_groups -
/// 1] == num_block_ids`). An array of length 0 may be NULL. Every argument
/// is checked before the set changes: on an error (`KVCS_ERR_INVALID_ARGUMENT`,
/// the message naming the argument and entry) nothing is added.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvcs_blocks_add_arrays(
    blocks: *mut kvcs_blocks,
    num_requests: usize,
    req_ids: *const c_char,
    req_id_ends: *const usize,
    num_tokens: *const u64,
    group_ends: *const usize,
    num_groups: usize,
    group_ids: *const u32,
    first_positions: *const u64,
    block_ends: *const usize,
    num_block_ids: usize,
    block_ids: *const u32,
    hashes: *const u8,
    hash_bytes: usize,
) -> kvcs_status {
    ffi_boundary! {
        let blocks = try_handle_mut!(blocks, "blocks");
        // SAFETY: the contract gives `num_requests` readable entries.
        let req_id_ends = try_engine!(unsafe { c_array(req_id_ends, num_requests, "req_id_ends") });
        let id_bytes = req_id_ends.last().copied().unwrap_or(0);
        // SAFETY: the contract gives the bytes `req_id_ends`' last entry says.
        let req_ids = try_engine!(unsafe { c_array(req_ids.cast::<u8>(), id_bytes, "req_ids") });
        // SAFETY: the contract gives `num_requests` readable entries.
        let num_tokens = try_engine!(unsafe { c_array(num_tokens, num_requests, "num_tokens") });
        // SAFETY: the contract gives `num_requests` readable entries.
        let group_ends = try_engine!(unsafe { c_array(group_ends, num_requests, "group_ends") });
        // SAFETY: the contract gives `num_groups` readable entries.
        let group_ids = try_engine!(unsafe { c_array(group_ids, num_groups, "group_ids") });
        // SAFETY: the contract gives `num_groups` readable entries.
        let first_positions = try_engine!(unsafe { c_array(first_positions, num_groups, "first_positions") });
        // SAFETY: the contract gives `num_groups` readable entries.
        let block_ends = try_engine!(unsafe { c_array(block_ends, num_groups, "block_ends") });
        let hashes = if hashes.is_null() {
            None
        } else {
            if hash_bytes < 8 {
                return super::status::fail(&crate::base::error::Error::InvalidArgument(format!(
                    "hash_bytes is {hash_bytes}; a block hash has at least 8 bytes"
                )));
            }
            let Some(total) = num_block_ids.checked_mul(hash_bytes) else {
                return super::status::fail(&crate::base::error::Error::InvalidArgument(format!(
                    "num_block_ids {num_block_ids} x hash_bytes {hash_bytes} overflows"
                )));
            };
            // SAFETY: the contract gives `num_block_ids * hash_bytes` readable bytes.
            Some((try_engine!(unsafe { c_array(hashes, total, "hashes") }), hash_bytes))
        };
        // SAFETY: the contract gives `num_block_ids` readable entries.
        let block_ids = try_engine!(unsafe { c_array(block_ids, num_block_ids, "block_ids") });
        try_engine!(blocks.add_arrays(&BlockArrays {
            req_ids,
            req_id_ends,
            num_tokens,
            group_ends,
            group_ids,
            first_positions,
            block_ends,
            block_ids,
            hashes,
        }));
        kvcs_status::KVCS_OK
    }
}
