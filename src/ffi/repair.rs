//! The repair plan (docs/SPEC.md#15-repair-plan): the consumer blocks to load
//! again after a MISMATCH, from a report or from mismatch entries.

use std::ffi::c_char;

use super::blocks::kvcs_blocks;
use super::buffer::write_entries;
use super::handle::try_handle;
use super::panic::ffi_boundary;
use super::report::{kvcs_mismatch, kvcs_report};
use super::status::kvcs_status;
use super::{c_array, c_str, try_engine};
use crate::base::error::{err, Result};
use crate::inputs::blocks::{BlockSet, RequestBlocks};
use crate::repair::{repair_plan, report_repair_plan, DifferingRun, RepairBlock};

/// A consumer block to load again: its group, position and block id, and
/// the request tokens `[start_token, end_token)` of it (half-open) that
/// were compared and differ.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_repair_block {
    /// The group.
    pub group_id: u32,
    /// The consumer's block id.
    pub block_id: u32,
    /// The block's position in the request.
    pub position: u64,
    /// First request token to load again.
    pub start_token: u64,
    /// One past the last request token to load again.
    pub end_token: u64,
}

impl From<RepairBlock> for kvcs_repair_block {
    fn from(block: RepairBlock) -> kvcs_repair_block {
        kvcs_repair_block {
            group_id: block.group_id,
            block_id: block.block_id,
            position: block.position,
            start_token: block.start_token,
            end_token: block.end_token,
        }
    }
}

/// The request `req_id` of `blocks` and the pairs `(group_ids[i],
/// block_sizes[i])`.
///
/// # Safety
/// `req_id` is NULL or a NUL-terminated string; `group_ids` and
/// `block_sizes` are NULL or point to `num_groups` readable values.
unsafe fn consumer_args(
    blocks: &BlockSet,
    req_id: *const c_char,
    group_ids: *const u32,
    block_sizes: *const u32,
    num_groups: usize,
) -> Result<(&RequestBlocks, Vec<(u32, u32)>)> {
    // SAFETY: the caller's contract.
    let req_id = unsafe { c_str(req_id, "req_id")? };
    let request = blocks
        .request(req_id)
        .ok_or_else(|| err!(NotFound, "req_id \"{req_id}\" is not in consumer_blocks"))?;
    // SAFETY: the caller's contract.
    let group_ids = unsafe { c_array(group_ids, num_groups, "group_ids")? };
    // SAFETY: the caller's contract.
    let block_sizes = unsafe { c_array(block_sizes, num_groups, "block_sizes")? };
    Ok((
        request,
        group_ids.iter().copied().zip(block_sizes.iter().copied()).collect(),
    ))
}

/// Writes `plan` to `(buf, cap, len)`.
///
/// # Safety
/// As [`write_entries`].
unsafe fn write_plan(plan: Vec<RepairBlock>, buf: *mut kvcs_repair_block, cap: usize, len: *mut usize) -> kvcs_status {
    let entries: Vec<kvcs_repair_block> = plan.into_iter().map(kvcs_repair_block::from).collect();
    // SAFETY: the caller's contract.
    unsafe { write_entries(&entries, buf, cap, len) }
}

/// The consumer blocks to load again (docs/SPEC.md#15-repair-plan) after
/// the MISMATCH `report` of request `req_id`, whose consumer block ids per
/// group are in `consumer_blocks` (what the consumer gave
/// `kvcs_verifier_expect`), with the consumer's tokens per block of group
/// `group_ids[i]` in `block_sizes[i]` (a group at most once; groups without
/// a mismatch may be left out).
///
/// Writes the entries to `(buf, cap, *len)` sorted by group and position,
/// each position once; each names the request tokens `[start_token,
/// end_token)` of its block that were compared and differ. Where the two
/// sides' block sizes differ, a mismatch spans a run of their least common
/// multiple of tokens, and every consumer block of the run is named. A
/// MATCH gives none. Too small a `cap` gives `KVCS_ERR_BUFFER_TOO_SMALL`
/// with `*len` the number needed (`buf` may be NULL with `cap` 0 to ask).
///
/// A state group's mismatch (docs/SPEC.md#6-state-mamba-groups) names its
/// block with the tokens `[0, num_tokens)` whose state it holds, which are
/// none for a request of no tokens.
///
/// `KVCS_ERR_INVALID_ARGUMENT` where a plan would not make the load
/// verified, so it must be repeated whole: an UNVERIFIED report, or a
/// MISMATCH that also has findings (a group, or the whole load, not
/// compared); for a report of another request than `req_id` (the message
/// names both); for a block size of a mismatching group other than the one
/// the report counted its positions in; and for a mismatch that does not
/// fit the blocks: a group with no blocks in `consumer_blocks` or no block
/// size, a position without a block id, a block size of 0, a group twice in
/// `group_ids`. `KVCS_ERR_NOT_FOUND` when `req_id` is not in
/// `consumer_blocks`.
#[no_mangle]
pub extern "C" fn kvcs_report_repair_plan(
    report: *const kvcs_report,
    consumer_blocks: *const kvcs_blocks,
    req_id: *const c_char,
    group_ids: *const u32,
    block_sizes: *const u32,
    num_groups: usize,
    buf: *mut kvcs_repair_block,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        let blocks = try_handle!(consumer_blocks, "consumer_blocks");
        // SAFETY: the contract gives a string and `num_groups` readable values.
        let (request, sizes) =
            try_engine!(unsafe { consumer_args(blocks, req_id, group_ids, block_sizes, num_groups) });
        let plan = try_engine!(report_repair_plan(&handle.report, request, &sizes));
        // SAFETY: `buf` has `cap` writable entries and `len` is writable per the contract.
        unsafe { write_plan(plan, buf, cap, len) }
    }
}

/// The consumer blocks to load again for `mismatches` (entries of
/// `kvcs_report_mismatch`, say, carried to another process; only
/// `group_id`, `first_position`, `num_positions`, `first_token` and
/// `num_tokens` are read), as `kvcs_report_repair_plan` gives them for a
/// report. The entries carry no findings, no request id, no block size and
/// no group kind, so this call cannot refuse a report with unverified
/// groups or of another request: those checks are the caller's. It refuses
/// (`KVCS_ERR_INVALID_ARGUMENT`) an entry whose positions are not exactly
/// the blocks of its tokens under the group's block size (the first token
/// starts the first position, the last lies in the last position): a block
/// size other than the one the report was made with, wherever an entry
/// shows it, and a state group's entry whose tokens do not fit its block
/// (plan those with `kvcs_report_repair_plan`). Entries of one group must
/// not overlap, and each names at least one position and one token
/// (`KVCS_ERR_INVALID_ARGUMENT`); the other errors are
/// `kvcs_report_repair_plan`'s.
#[no_mangle]
pub extern "C" fn kvcs_repair_plan(
    mismatches: *const kvcs_mismatch,
    num_mismatches: usize,
    consumer_blocks: *const kvcs_blocks,
    req_id: *const c_char,
    group_ids: *const u32,
    block_sizes: *const u32,
    num_groups: usize,
    buf: *mut kvcs_repair_block,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: the contract gives `num_mismatches` readable entries.
        let mismatches = try_engine!(unsafe { c_array(mismatches, num_mismatches, "mismatches") });
        let blocks = try_handle!(consumer_blocks, "consumer_blocks");
        // SAFETY: the contract gives a string and `num_groups` readable values.
        let (request, sizes) =
            try_engine!(unsafe { consumer_args(blocks, req_id, group_ids, block_sizes, num_groups) });
        let runs: Vec<DifferingRun> = mismatches
            .iter()
            .map(|m| DifferingRun {
                group_id: m.group_id,
                first_position: m.first_position,
                num_positions: m.num_positions,
                first_token: m.first_token,
                num_tokens: m.num_tokens,
                state: false,
                block_size: None,
            })
            .collect();
        let plan = try_engine!(repair_plan(&runs, request, &sizes));
        // SAFETY: `buf` has `cap` writable entries and `len` is writable per the contract.
        unsafe { write_plan(plan, buf, cap, len) }
    }
}
