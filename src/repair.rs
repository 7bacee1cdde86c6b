//! The repair plan (SPEC section 15): from the block positions a
//! consumer's MISMATCH names to the consumer's blocks to load again, each
//! with the request tokens `[start_token, end_token)` of it that were
//! compared and differ.

use std::collections::BTreeMap;

use crate::base::error::{err, Result};
use crate::inputs::blocks::{GroupBlocks, RequestBlocks};
use crate::verify::{Mismatch, Report, Verdict};

/// What a repair plan reads of a mismatch: consumer positions
/// `[first_position, first_position + num_positions)` of a group whose
/// tokens `[first_token, first_token + num_tokens)` differ; or, for a state
/// group, its position holding the state after those tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DifferingRun {
    /// The group.
    pub group_id: u32,
    /// The consumer's first block position of the run.
    pub first_position: u64,
    /// Consecutive consumer positions in the run.
    pub num_positions: u64,
    /// Request position of the first token compared.
    pub first_token: u64,
    /// Tokens compared.
    pub num_tokens: u64,
    /// A state group's run (SPEC section 6): each of its positions holds
    /// the state after its tokens, whatever the block size, so it is named
    /// with all of them (none for a request of no tokens).
    pub state: bool,
    /// The consumer block size the positions were counted in, where the
    /// run says it (a report's mismatch); `None` where it does not (entries
    /// carried as `kvcs_mismatch`).
    pub block_size: Option<u32>,
}

impl From<&Mismatch> for DifferingRun {
    fn from(m: &Mismatch) -> DifferingRun {
        DifferingRun {
            group_id: m.group_id,
            first_position: m.first_position,
            num_positions: m.num_positions,
            first_token: m.first_token,
            num_tokens: m.num_tokens,
            state: m.state,
            block_size: Some(m.block_size),
        }
    }
}

/// A consumer block to load again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RepairBlock {
    /// The group.
    pub group_id: u32,
    /// The block's position in the request.
    pub position: u64,
    /// The consumer's block id at that position.
    pub block_id: u32,
    /// First request token of the block to load again.
    pub start_token: u64,
    /// One past the last.
    pub end_token: u64,
}

/// The repair plan of a report: [`repair_plan`] of its mismatches, after
/// refusing a report that a repair cannot make verified. An UNVERIFIED
/// report names no positions; a MISMATCH with findings has groups (or the
/// whole load) that were not compared, and reloading blocks cannot make
/// them comparable. Both are `InvalidArgument`: the load must be repeated
/// whole. So is a report of another request than `consumer`'s (its
/// positions are not that request's blocks), and a block size of a
/// mismatching group other than the one the report counted its positions
/// in. A MATCH gives an empty plan.
pub fn report_repair_plan(
    report: &Report,
    consumer: &RequestBlocks,
    block_sizes: &[(u32, u32)],
) -> Result<Vec<RepairBlock>> {
    if report.req_id != consumer.req_id {
        return Err(err!(
            InvalidArgument,
            "report judged req_id {:?}, but the plan was asked for req_id {:?}: a plan names the blocks of the request its report judged",
            report.req_id,
            consumer.req_id
        ));
    }
    if report.verdict == Verdict::Unverified {
        return Err(err!(
            InvalidArgument,
            "report is unverified ({}); it names no positions to repair",
            report.message
        ));
    }
    if !report.unverified.is_empty() {
        let findings: Vec<String> = report
            .unverified
            .iter()
            .map(|f| {
                let whom = f.group_id.map_or("the whole load".to_owned(), |g| format!("group {g}"));
                format!("{whom} is unverified ({}: {})", f.reason.describe(), f.message)
            })
            .collect();
        return Err(err!(
            InvalidArgument,
            "{}: repairing the differing blocks cannot make this load verified; load the request again whole",
            findings.join("; ")
        ));
    }
    let runs: Vec<DifferingRun> = report.mismatches.iter().map(DifferingRun::from).collect();
    repair_plan(&runs, consumer, block_sizes)
}

/// The consumer blocks to load again for `runs`, sorted by group and
/// position, each position once.
///
/// `consumer` holds the request's consumer block ids per group;
/// `block_sizes` pairs each group id (at most once) with the consumer's
/// tokens per block in it. Block position `q` of a run covers tokens
/// `[q * block_size, (q + 1) * block_size)`; its entry keeps those of them
/// inside the run's tokens. Where the two sides' block sizes differ a run
/// spans their least common multiple, so every consumer block of it is
/// named. A state group's run names its position with all the run's
/// tokens, whose state it holds (none for a request of no tokens).
///
/// A run's positions are exactly the blocks of its tokens (the verifier
/// compares whole blocks): its first token starts its first position
/// (`first_token == first_position * block_size`) and its last token lies
/// in its last position. A block size under which a run breaks this, or
/// other than the one a run says it was counted in, is not the one the
/// mismatch was made with, and is refused rather than planned.
///
/// Refused (`InvalidArgument`): a run's group without a block size or
/// blocks in `consumer`, a position without a block id, a run of no
/// positions or (not a state group's) of no tokens, a run that is not the
/// blocks of its tokens under the group's block size, a block size other
/// than the run's, runs overlapping in one group, a block size of 0 or a
/// group twice in `block_sizes`. Work and memory are linear in the inputs:
/// the runs of a group cannot overlap, so they name at most as many
/// positions as the group has block ids.
pub fn repair_plan(
    runs: &[DifferingRun],
    consumer: &RequestBlocks,
    block_sizes: &[(u32, u32)],
) -> Result<Vec<RepairBlock>> {
    let mut sizes = BTreeMap::new();
    for (index, &(group_id, block_size)) in block_sizes.iter().enumerate() {
        if block_size == 0 {
            return Err(err!(
                InvalidArgument,
                "block_size of group {group_id} is 0 (block_sizes[{index}]); it must be at least 1"
            ));
        }
        if sizes.insert(group_id, block_size).is_some() {
            return Err(err!(
                InvalidArgument,
                "group_ids[{index}] is {group_id}, a group already given a block size"
            ));
        }
    }
    let req_id = &consumer.req_id;
    let tables: BTreeMap<u32, &GroupBlocks> = consumer.groups.iter().map(|g| (g.group_id, g)).collect();
    let mut order: Vec<&DifferingRun> = runs.iter().collect();
    order.sort_by_key(|run| (run.group_id, run.first_position));
    let mut plan = Vec::new();
    let mut previous: Option<&DifferingRun> = None;
    for run in order {
        let group_id = run.group_id;
        let end_position = run.first_position.checked_add(run.num_positions).ok_or_else(|| {
            err!(
                InvalidArgument,
                "group {group_id}: first_position {} + num_positions {} overflows",
                run.first_position,
                run.num_positions
            )
        })?;
        let end_token = run.first_token.checked_add(run.num_tokens).ok_or_else(|| {
            err!(
                InvalidArgument,
                "group {group_id}: first_token {} + num_tokens {} overflows",
                run.first_token,
                run.num_tokens
            )
        })?;
        if let Some(before) = previous.filter(|p| p.group_id == group_id) {
            if before.first_position + before.num_positions > run.first_position {
                return Err(err!(
                    InvalidArgument,
                    "group {group_id}: the differing positions {}..{} and {}..{end_position} overlap",
                    before.first_position,
                    before.first_position + before.num_positions,
                    run.first_position
                ));
            }
        }
        previous = Some(run);
        let table = tables.get(&group_id).ok_or_else(|| {
            err!(
                InvalidArgument,
                "group {group_id} differs but consumer_blocks has no blocks of it in req_id \"{req_id}\""
            )
        })?;
        let block_size = *sizes.get(&group_id).ok_or_else(|| {
            err!(
                InvalidArgument,
                "group {group_id} differs but block_sizes has no entry for it"
            )
        })?;
        if let Some(counted_in) = run.block_size.filter(|&size| size != block_size) {
            return Err(err!(
                InvalidArgument,
                "block_sizes gives group {group_id} block size {block_size}, but the report counted its positions in blocks of {counted_in} tokens: give the consumer's block size the report was made with"
            ));
        }
        if !run.state {
            check_whole_blocks(run, block_size)?;
        }
        let table_end = table.first_position + table.block_ids.len() as u64;
        if run.first_position < table.first_position || end_position > table_end {
            let outside = if run.first_position < table.first_position {
                run.first_position
            } else {
                end_position - 1
            };
            return Err(err!(
                InvalidArgument,
                "group {group_id} position {outside} differs but consumer_blocks holds positions {}..{table_end} of it",
                table.first_position
            ));
        }
        for position in run.first_position..end_position {
            let (start, end) = if run.state {
                (run.first_token, end_token)
            } else {
                // Not empty: the run is the blocks of its tokens.
                let block_start = position as u128 * block_size as u128;
                let start = block_start.max(run.first_token as u128);
                let end = (block_start + block_size as u128).min(end_token as u128);
                // Both fit: start < end <= end_token, a u64.
                (start as u64, end as u64)
            };
            plan.push(RepairBlock {
                group_id,
                position,
                block_id: table.block_ids[(position - table.first_position) as usize],
                start_token: start,
                end_token: end,
            });
        }
    }
    Ok(plan)
}

/// Checks that `run`'s positions are exactly the blocks of `block_size`
/// tokens holding its tokens: the first token starts the first position,
/// and the last lies in the last position.
fn check_whole_blocks(run: &DifferingRun, block_size: u32) -> Result<()> {
    let size = block_size as u128;
    let (p, n) = (run.first_position as u128, run.num_positions as u128);
    let (t, k) = (run.first_token as u128, run.num_tokens as u128);
    let group_id = run.group_id;
    if n == 0 || k == 0 {
        return Err(err!(
            InvalidArgument,
            "group {group_id}: a differing run of {n} positions and {k} tokens (from position {p}, token {t}) names nothing to repair"
        ));
    }
    if t != p * size || k > n * size || k <= (n - 1) * size {
        return Err(err!(
            InvalidArgument,
            "group {group_id}: positions {p}..{} in blocks of {block_size} tokens (tokens {}..{}) are not the blocks of the differing tokens {t}..{}: block size {block_size} is not the one the mismatch was made with (or the run is a state group's, which only its report can plan)",
            p + n,
            p * size,
            (p + n) * size,
            t + k
        ));
    }
    Ok(())
}
