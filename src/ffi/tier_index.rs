//! `kvcs_tier_index`: the values of a worker's full blocks by block hash,
//! for checking loads from offload tiers (docs/vllm-tiers.md).

use std::ffi::c_void;

use super::buffer::write_named;
use super::c_enum::c_enum;
use super::handle::{free, handle, into_handle, try_handle, try_handle_mut};
use super::panic::ffi_boundary;
use super::status::kvcs_status;
use super::worker::kvcs_worker;
use super::{c_array, not_null, try_engine, write_out};
use crate::base::error::{err, Result};
use crate::inputs::stream::StreamHandle;
use crate::tier_index::{TierArrays, TierIndex, TierOutcome};

/// A bounded index of block values by (group, block hash), one per worker:
/// a tier store keeps the values of the blocks a step filled, a tier check
/// compares loaded blocks with them. At most `capacity` entries (block
/// hashes), each with its position and up to 4 values; the least recently
/// stored or matched goes first when it is full. Memory: at most
/// `KVCS_TIER_INDEX_ENTRY_BYTES` per entry of its capacity, growing with
/// the entries kept (`kvcs_tier_index_info` gives the bytes held), nothing
/// allocated up front.
///
/// Ownership: created by `kvcs_tier_index_create`, freed by
/// `kvcs_tier_index_destroy`; it may outlive the workers it was used with
/// (a queued store keeps what it reads alive).
/// Thread safety: `kvcs_tier_index *` calls need exclusive access; `const
/// kvcs_tier_index *` calls may run concurrently with each other.
#[allow(non_camel_case_types)]
pub struct kvcs_tier_index {
    _private: [u8; 0],
}

handle!(kvcs_tier_index => TierIndex);

/// The most bytes a tier index holds per entry of its capacity (a slot of
/// 96 bytes and at most four 4-byte buckets of its table): an index of
/// `capacity` entries never holds more than `capacity` times this plus 64
/// bytes (its smallest table), and holds less while it is not full (`kvcs_tier_index_info` gives the bytes
/// held).
pub const KVCS_TIER_INDEX_ENTRY_BYTES: u32 = 112;

const _: () = assert!(crate::tier_index::ENTRY_BYTES + 16 <= KVCS_TIER_INDEX_ENTRY_BYTES as usize);

/// The outcome of one block of a tier check (`kvcs_tier_index_check`).
#[allow(non_camel_case_types)]
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvcs_tier_outcome {
    /// Its value is one of those kept for its hash at its position.
    KVCS_TIER_MATCHED = 1,
    /// Values are kept for its hash at its position and its value is none of them.
    KVCS_TIER_MISMATCHED = 2,
    /// Unknown: the block has no hash (a partial block; `hashed[i]` 0).
    KVCS_TIER_NO_BLOCK_HASH = 3,
    /// Unknown: no value is kept for its hash (never stored, or dropped).
    KVCS_TIER_UNKNOWN_BLOCK = 4,
    /// Unknown: its hash was stored with more than 4 values, or at two positions.
    KVCS_TIER_TOO_MANY_VALUES = 5,
    /// Unknown: its hash was stored at another position.
    KVCS_TIER_OTHER_POSITION = 6,
    /// Unknown: the worker does not checksum the block's group (it skips it).
    KVCS_TIER_NOT_CHECKSUMMED = 7,
}

c_enum!(kvcs_tier_outcome {
    KVCS_TIER_MATCHED,
    KVCS_TIER_MISMATCHED,
    KVCS_TIER_NO_BLOCK_HASH,
    KVCS_TIER_UNKNOWN_BLOCK,
    KVCS_TIER_TOO_MANY_VALUES,
    KVCS_TIER_OTHER_POSITION,
    KVCS_TIER_NOT_CHECKSUMMED
});

impl From<TierOutcome> for kvcs_tier_outcome {
    fn from(outcome: TierOutcome) -> Self {
        match outcome {
            TierOutcome::Matched => kvcs_tier_outcome::KVCS_TIER_MATCHED,
            TierOutcome::Mismatched => kvcs_tier_outcome::KVCS_TIER_MISMATCHED,
            TierOutcome::NoBlockHash => kvcs_tier_outcome::KVCS_TIER_NO_BLOCK_HASH,
            TierOutcome::UnknownBlock => kvcs_tier_outcome::KVCS_TIER_UNKNOWN_BLOCK,
            TierOutcome::TooManyValues => kvcs_tier_outcome::KVCS_TIER_TOO_MANY_VALUES,
            TierOutcome::OtherPosition => kvcs_tier_outcome::KVCS_TIER_OTHER_POSITION,
            TierOutcome::NotChecksummed => kvcs_tier_outcome::KVCS_TIER_NOT_CHECKSUMMED,
        }
    }
}

/// Creates an empty tier index of at most `capacity` entries (1 to
/// 4294967294; `KVCS_ERR_INVALID_ARGUMENT` otherwise); `*out` owns it.
#[no_mangle]
pub extern "C" fn kvcs_tier_index_create(capacity: u64, out: *mut *mut kvcs_tier_index) -> kvcs_status {
    ffi_boundary! {
        not_null!(out, "out");
        let index = try_engine!(TierIndex::new(capacity));
        // SAFETY: `out` is non-NULL (checked above) and writable per the contract.
        unsafe { out.write(into_handle(index)) };
        kvcs_status::KVCS_OK
    }
}

/// Frees a tier index. NULL is a no-op.
#[no_mangle]
pub extern "C" fn kvcs_tier_index_destroy(index: *mut kvcs_tier_index) {
    ffi_boundary! {
        // SAFETY: NULL, or made by `kvcs_tier_index_create` and not freed before (the contract).
        unsafe { free(index) };
    }
}

/// The blocks of a store or check: `num_blocks` entries of `group_ids`,
/// `positions`, `block_ids` and `hash_bytes`-byte rows of `hashes`, and
/// optionally `hashed` (a flag per block).
///
/// # Safety
/// Each pointer is NULL or gives the entries its length says (the contract).
#[allow(clippy::too_many_arguments)]
unsafe fn tier_blocks<'a>(
    num_blocks: usize,
    group_ids: *const u32,
    positions: *const u64,
    block_ids: *const u32,
    hashes: *const u8,
    hash_bytes: usize,
    hashed: *const u8,
) -> Result<TierArrays<'a>> {
    // SAFETY: the contract gives `num_blocks` readable entries.
    let group_ids = unsafe { c_array(group_ids, num_blocks, "group_ids") }?;
    // SAFETY: as above.
    let positions = unsafe { c_array(positions, num_blocks, "positions") }?;
    // SAFETY: as above.
    let block_ids = unsafe { c_array(block_ids, num_blocks, "block_ids") }?;
    // NULL means every block has a hash.
    let hashed = if hashed.is_null() {
        None
    } else {
        // SAFETY: the contract gives `num_blocks` readable flags.
        Some(unsafe { c_array(hashed, num_blocks, "hashed") }?)
    };
    if num_blocks > 0 {
        TierArrays::check_hash_bytes(hash_bytes)?;
    }
    let total = num_blocks.checked_mul(hash_bytes).ok_or_else(|| {
        err!(
            InvalidArgument,
            "num_blocks {num_blocks} x hash_bytes {hash_bytes} overflows"
        )
    })?;
    // SAFETY: the contract gives `num_blocks * hash_bytes` readable bytes.
    let hashes = unsafe { c_array(hashes, total, "hashes") }?;
    TierArrays::new(group_ids, positions, block_ids, hashes, hash_bytes, hashed)
}

/// A tier store, in one call: checksums `num_blocks` full blocks (every
/// column, as `KVCS_ROLE_CONSUMER`), block `i` being `block_ids[i]` at
/// position `positions[i]` of group `group_ids[i]` with the block hash of
/// row `i` of `hashes` (`hash_bytes` bytes each, 8 to 32), and keeps each
/// block's value (the sum of its columns) for its hash. A host worker keeps
/// them before it returns; a device worker queues the checksums on
/// `cuda_stream` (as `kvcs_worker_checksum`) and the index reads them in a
/// later call once they are done (a check waits for them). Blocks of a
/// group the worker skips are checksummed by no one and not kept. Every
/// argument is checked before anything is computed or kept
/// (`KVCS_ERR_INVALID_ARGUMENT` naming the argument and entry: a group the
/// worker does not have, a bad hash length; `KVCS_ERR_OUT_OF_BOUNDS` for a
/// block id past its cache). `num_blocks` 0 reads finished stores only.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvcs_tier_index_store(
    index: *mut kvcs_tier_index,
    worker: *mut kvcs_worker,
    num_blocks: usize,
    group_ids: *const u32,
    positions: *const u64,
    block_ids: *const u32,
    hashes: *const u8,
    hash_bytes: usize,
    cuda_stream: *mut c_void,
) -> kvcs_status {
    ffi_boundary! {
        let index = try_handle_mut!(index, "index");
        let worker = try_handle!(worker.cast_const(), "worker");
        // SAFETY: the contract gives the arrays their lengths.
        let blocks = try_engine!(unsafe {
            tier_blocks(num_blocks, group_ids, positions, block_ids, hashes, hash_bytes, std::ptr::null())
        });
        try_engine!(index.store_arrays(worker, &blocks, StreamHandle(cuda_stream)));
        kvcs_status::KVCS_OK
    }
}

/// A tier check, in one call: checksums the loaded blocks (as
/// `kvcs_tier_index_store` gives them; `hashed`, NULL or a flag 0/1 per
/// block, says which have a hash: a block without one is not checksummed),
/// waits for them and for every queued store, and writes each block's
/// `kvcs_tier_outcome` to `outcomes[i]` (`num_blocks` bytes). A matched
/// entry becomes the most recently used. On a device worker the checksums
/// are queued on `cuda_stream` and waited for. Every argument is checked
/// before anything is computed; on an error `outcomes` is not written.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvcs_tier_index_check(
    index: *mut kvcs_tier_index,
    worker: *mut kvcs_worker,
    num_blocks: usize,
    group_ids: *const u32,
    positions: *const u64,
    block_ids: *const u32,
    hashes: *const u8,
    hash_bytes: usize,
    hashed: *const u8,
    cuda_stream: *mut c_void,
    outcomes: *mut u8,
) -> kvcs_status {
    ffi_boundary! {
        let index = try_handle_mut!(index, "index");
        let worker = try_handle!(worker.cast_const(), "worker");
        if outcomes.is_null() && num_blocks > 0 {
            return super::status::fail(&err!(InvalidArgument, "outcomes is NULL for {num_blocks} blocks"));
        }
        // SAFETY: the contract gives the arrays their lengths.
        let blocks = try_engine!(unsafe {
            tier_blocks(num_blocks, group_ids, positions, block_ids, hashes, hash_bytes, hashed)
        });
        let found = try_engine!(index.check_arrays(worker, &blocks, StreamHandle(cuda_stream)));
        for (i, outcome) in found.into_iter().enumerate() {
            // SAFETY: the contract gives `num_blocks` writable bytes.
            unsafe { outcomes.add(i).write(kvcs_tier_outcome::from(outcome) as u8) };
        }
        kvcs_status::KVCS_OK
    }
}

/// The index's counts: `*entries` kept now, `*dropped` pushed out by the
/// bound so far, `*lost_stores` stores whose device work failed (their
/// blocks stay unknown), `*memory_bytes` held now. Any out-pointer may be
/// NULL.
#[no_mangle]
pub extern "C" fn kvcs_tier_index_info(
    index: *const kvcs_tier_index,
    entries: *mut u64,
    dropped: *mut u64,
    lost_stores: *mut u64,
    memory_bytes: *mut u64,
) -> kvcs_status {
    ffi_boundary! {
        let index = try_handle!(index, "index");
        let info = index.info();
        // SAFETY: each is NULL or writable per the contract.
        unsafe {
            write_out(entries, info.entries);
            write_out(dropped, info.dropped);
            write_out(lost_stores, info.lost_stores);
            write_out(memory_bytes, info.memory_bytes);
        }
        kvcs_status::KVCS_OK
    }
}

/// The values kept for block hash `hash` (`hash_bytes` bytes, 8 to 32) of
/// group `group_id`: `*len` gets how many (0: none kept, or too many to
/// compare), `*position` (may be NULL) the position they were stored at, and
/// `values` (room for `cap`) the values; `KVCS_ERR_BUFFER_TOO_SMALL` with
/// `*len` set when `cap` is short. For tests and tools: stores still queued
/// on a device are not read.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvcs_tier_index_values(
    index: *const kvcs_tier_index,
    group_id: u32,
    hash: *const u8,
    hash_bytes: usize,
    position: *mut u64,
    values: *mut u64,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let index = try_handle!(index, "index");
        // SAFETY: the contract gives `hash_bytes` readable bytes.
        let hash = try_engine!(unsafe { c_array(hash, hash_bytes, "hash") });
        let found = try_engine!(index.values(group_id, hash));
        let (at, kept) = found.unwrap_or((0, Vec::new()));
        // SAFETY: `values` holds `cap` writable entries or is NULL, `len` is writable (the contract).
        let status = unsafe { write_named(&kept, (values, "values"), cap, len, "values") };
        if status != kvcs_status::KVCS_OK {
            return status;
        }
        // SAFETY: NULL or writable per the contract.
        unsafe { write_out(position, at) };
        kvcs_status::KVCS_OK
    }
}
