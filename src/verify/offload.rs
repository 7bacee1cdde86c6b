//! Judging an offload load (SPEC section 8) from its workers' load-check
//! records alone: no producer payload exists for an offload, each worker
//! compared the blocks it loaded with the stored checksums copied with them,
//! and its record says, per block position, whether they matched.

use crate::inputs::blocks::{valid_tokens, GroupBlocks};
use crate::results::checksums::StoredOutcome;
use crate::wire::record::Rank;

use super::collect::{GroupOutcome, Judged, Load, Unverified, Wording};
use super::report::{Mismatch, Reason, Report};

impl Load<'_> {
    /// The report on an offload load, from its workers' load-check records.
    pub fn judge_stored(&self) -> Report {
        let whole_load = self
            .pending
            .check_complete(self.num_workers)
            .and_then(|()| self.pending.check_roles())
            .and_then(|()| self.pending.algorithm().map(|_| ()))
            .and_then(|()| self.check_load_checks())
            .and_then(|()| self.pending.check_tokens());
        if let Err(unverified) = whole_load {
            return self.whole(unverified);
        }
        let wording = Wording {
            uncompared: |group_id, uncompared, compared| {
                format!("group {group_id}: {uncompared} loaded positions were not checked by every worker ({compared} were)")
            },
            nothing_judged: "no loaded group was checked (every group is skipped by every worker)",
        };
        self.gather(|scheduled| self.judge_group(scheduled), &wording)
    }

    /// Every worker's record of the request is a load check's: a plain
    /// checksum call's record says nothing about stored checksums.
    fn check_load_checks(&self) -> Judged<()> {
        let plain = self
            .pending
            .reports
            .values()
            .find(|part| part.request.groups.iter().any(|group| group.stored.is_none()));
        match plain {
            None => Ok(()),
            Some(part) => Err(Unverified(
                Reason::NotLoadCheck,
                format!(
                    "{} sent the record of a plain checksum call for req_id {:?}, not of a load check (kvcs_worker_check_stored)",
                    part.name(),
                    self.req_id
                ),
            )),
        }
    }

    /// Judges one scheduled group; `Ok(None)` when every worker skipped it
    /// (nothing was stored or checked, nothing wrong).
    fn judge_group(&self, scheduled: &GroupBlocks) -> Judged<Option<GroupOutcome>> {
        let group_id = scheduled.group_id;
        if let Some((worker, reason)) = self.pending.skipped_by(group_id) {
            let all_skipped = self
                .pending
                .reports
                .values()
                .all(|part| part.skipped(group_id).is_some());
            if all_skipped {
                return Ok(None);
            }
            return Err(Unverified(
                Reason::OtherBlocks,
                format!("{worker} skipped group {group_id} ({reason}), which other workers checked"),
            ));
        }
        let parts = self.pending.group_parts(scheduled)?;
        self.pending.check_read(group_id)?;
        let block_size = self.pending.block_size(group_id)?;
        let state = self.pending.is_state(group_id);
        let num_tokens = self.pending.scheduled.num_tokens;
        // Each worker's outcomes; the record validated one per position, and
        // `check_load_checks` that every computed group has them.
        let workers: Vec<(Rank, &[StoredOutcome])> = parts
            .iter()
            .map(|(part, group)| (part.rank, group.stored.as_deref().unwrap_or_default()))
            .collect();
        let mut outcome = GroupOutcome::new();
        if let Some(other) = workers
            .iter()
            .find_map(|&(rank, outcomes)| other_configuration(outcomes).map(|reason| (rank, reason)))
        {
            let (rank, (reason, what)) = other;
            let why = if reason == Reason::InvalidChecksums {
                "this release does not compare them"
            } else {
                "they were stored under another configuration and say nothing about the data"
            };
            return Err(Unverified(
                reason,
                format!(
                    "group {group_id}: worker (pp_rank {}, tp_rank {}) read back stored checksums of {what}; {why}",
                    rank.pp_rank, rank.tp_rank
                ),
            ));
        }
        for index in 0..scheduled.block_ids.len() {
            let position = scheduled.first_position + index as u64;
            let failed: Vec<Rank> = workers
                .iter()
                .filter(|(_, outcomes)| outcomes.get(index) == Some(&StoredOutcome::Failed))
                .map(|&(rank, _)| rank)
                .collect();
            // A state block holds the whole request's state, whatever its tokens.
            let tokens = if state {
                num_tokens
            } else {
                valid_tokens(num_tokens, block_size, position) as u64
            };
            if !failed.is_empty() {
                // A failed position was compared, as a payload check counts
                // the positions that mismatch.
                outcome.compared += 1;
                let first_token = position as u128 * block_size as u128;
                outcome.mismatches.push(Mismatch {
                    group_id,
                    first_position: position,
                    num_positions: 1,
                    first_token: if state {
                        0
                    } else {
                        u64::try_from(first_token).unwrap_or(u64::MAX)
                    },
                    num_tokens: tokens,
                    state,
                    block_size,
                    failed_checks: Vec::new(),
                    localised: false,
                    layers: Vec::new(),
                    failed_workers: failed,
                });
                continue;
            }
            // A position some worker read as stored for other tokens
            // (a partial block) is not compared: it counts as uncompared.
            let checked = workers
                .iter()
                .filter(|(_, outcomes)| outcomes.get(index) == Some(&StoredOutcome::Matched))
                .count();
            if checked == workers.len() {
                outcome.compared += 1;
            } else if checked > 0 || tokens > 0 || state {
                // Some worker did not check a position that holds tokens.
                outcome.add_uncompared(position, 1);
            }
        }
        if outcome.compared == 0 {
            let other_tokens = workers
                .iter()
                .any(|(_, outcomes)| outcomes.contains(&StoredOutcome::OtherTokens));
            return Err(Unverified(
                Reason::NoCommonPosition,
                format!(
                    "group {group_id}: no position of {}..{} was checked against its stored checksum by every worker{}",
                    scheduled.first_position,
                    scheduled.first_position + scheduled.block_ids.len() as u64,
                    if other_tokens {
                        " (some were stored holding another number of valid tokens: a partial block)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        Ok(Some(outcome))
    }
}

/// The reason, and what differs in words, when a worker read back a value
/// stored under another configuration at some position.
fn other_configuration(outcomes: &[StoredOutcome]) -> Option<(Reason, &'static str)> {
    outcomes.iter().find_map(|outcome| match outcome {
        StoredOutcome::OtherFingerprint => Some((
            Reason::FingerprintDiffers,
            "another group fingerprint (other layers, identities, heads or block size)",
        )),
        StoredOutcome::OtherAlgorithm => Some((Reason::AlgorithmDiffers, "another checksum algorithm")),
        StoredOutcome::OtherFormat => Some((
            Reason::InvalidChecksums,
            "kvcsum 0.2.0's format (no check, no token count), whose value does not match",
        )),
        // Other tokens leave that position uncompared, not the group.
        StoredOutcome::OtherTokens | StoredOutcome::Failed | StoredOutcome::Matched | StoredOutcome::NotChecked => None,
    })
}
