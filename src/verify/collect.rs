//! Collecting: each worker's part of each expected request, and the facts
//! both the producer and the consumer side read from all the parts of one
//! request (who reported, which blocks and tokens they checksummed, the
//! group fingerprint and block size).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::base::checksum::Algorithm;
use crate::base::error::{err, Result};
use crate::inputs::blocks::{GroupBlocks, RequestBlocks};
use crate::inputs::layout::ReplicaKey;
use crate::inputs::role::Role;
use crate::wire::record::{GroupInfo, Rank, RecordGroup, RecordRequest};

use super::report::{Finding, Mismatch, Policy, Reason, Report, Uncompared};

/// A condition that makes a load (or group) unverified, or a payload
/// impossible to build.
pub(super) struct Unverified(pub Reason, pub String);

/// The outcome of a step that can make a load or group unverified.
pub(super) type Judged<T> = std::result::Result<T, Unverified>;

/// What the verifier was told about producers, and how it judges.
#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub policy: Policy,
    pub producer_tp_size: Option<u32>,
    /// Shared, so that a check copies it cheaply before leaving the lock.
    pub producer_block_sizes: Arc<HashMap<u32, u32>>,
    /// Loads with uncompared positions are unverified (on by default;
    /// off is the caller's explicit opt-out).
    pub require_coverage: bool,
}

/// The consumer's load of one request, ready to be judged (against a
/// payload, or from load-check records): copies taken under the verifier's
/// lock, judged outside it.
pub(super) struct Load<'a> {
    pub req_id: &'a str,
    pub settings: Settings,
    pub pending: Pending,
    pub num_workers: u32,
}

/// A judged group's positions and mismatches.
pub(super) struct GroupOutcome {
    /// Positions compared (payload) or checked by every worker (offload).
    pub compared: u64,
    /// Loaded positions holding valid tokens that no compared run covers,
    /// or that not every worker checked: `(first position, positions)`
    /// ranges, ascending and not adjacent.
    pub uncompared: Vec<(u64, u64)>,
    pub mismatches: Vec<Mismatch>,
}

impl GroupOutcome {
    /// An outcome with nothing compared yet.
    pub fn new() -> GroupOutcome {
        GroupOutcome {
            compared: 0,
            uncompared: Vec::new(),
            mismatches: Vec::new(),
        }
    }

    /// Adds positions `first .. first + count` as uncompared; they follow
    /// every range added before (joined with the last where adjacent).
    pub fn add_uncompared(&mut self, first: u64, count: u64) {
        if count == 0 {
            return;
        }
        match self.uncompared.last_mut() {
            Some((last_first, last_count)) if *last_first + *last_count == first => *last_count += count,
            _ => self.uncompared.push((first, count)),
        }
    }

    /// The number of uncompared positions.
    pub fn uncompared_count(&self) -> u64 {
        self.uncompared.iter().map(|&(_, count)| count).sum()
    }
}

/// How a kind of load words the findings its report adds itself: a
/// payload check compares positions, an offload load check has every
/// worker check them.
pub(super) struct Wording {
    /// The finding of a group whose loaded positions were not all compared
    /// while coverage is required: (group id, uncompared, compared).
    pub uncompared: fn(u32, u64, u64) -> String,
    /// The finding when no scheduled group could be judged at all.
    pub nothing_judged: &'static str,
}

impl Load<'_> {
    /// A report unverified as a whole.
    pub(super) fn whole(&self, Unverified(reason, message): Unverified) -> Report {
        let finding = Finding {
            reason,
            group_id: None,
            message,
        };
        Report::new(
            self.req_id,
            self.settings.policy,
            (0, Vec::new()),
            Vec::new(),
            vec![finding],
        )
    }

    /// The report of a load whose scheduled groups `judge` judges one by
    /// one (`Ok(None)`: skipped on every side, nothing to judge): positions
    /// and mismatches add up, a group that cannot be judged is a finding,
    /// uncompared positions are one where coverage is required, and a load
    /// of which no group was judged is unverified.
    pub(super) fn gather(
        &self,
        mut judge: impl FnMut(&GroupBlocks) -> Judged<Option<GroupOutcome>>,
        wording: &Wording,
    ) -> Report {
        let (mut compared, mut uncompared) = (0u64, Vec::new());
        let mut mismatches = Vec::new();
        let mut findings = Vec::new();
        let mut any_group_judged = false;
        for scheduled in &self.pending.scheduled.groups {
            let group_id = scheduled.group_id;
            match judge(scheduled) {
                Ok(Some(outcome)) => {
                    any_group_judged = true;
                    compared += outcome.compared;
                    let count = outcome.uncompared_count();
                    if count > 0 && self.settings.require_coverage && outcome.mismatches.is_empty() {
                        findings.push(Finding {
                            reason: Reason::UncomparedPositions,
                            group_id: Some(group_id),
                            message: format!(
                                "{}: {}",
                                (wording.uncompared)(group_id, count, outcome.compared),
                                uncompared_ranges(&outcome.uncompared)
                            ),
                        });
                    }
                    uncompared.extend(
                        outcome
                            .uncompared
                            .iter()
                            .map(|&(first_position, num_positions)| Uncompared {
                                group_id,
                                first_position,
                                num_positions,
                            }),
                    );
                    mismatches.extend(outcome.mismatches);
                }
                Ok(None) => {}
                Err(Unverified(reason, message)) => findings.push(Finding {
                    reason,
                    group_id: Some(group_id),
                    message,
                }),
            }
        }
        if !any_group_judged && findings.is_empty() {
            findings.push(Finding {
                reason: Reason::NoCommonPosition,
                group_id: None,
                message: wording.nothing_judged.to_owned(),
            });
        }
        Report::new(
            self.req_id,
            self.settings.policy,
            (compared, uncompared),
            mismatches,
            findings,
        )
    }
}

/// A group's uncompared ranges in words, `positions a..b, c..d` (the first
/// eight, then how many more), for the finding that names them.
fn uncompared_ranges(ranges: &[(u64, u64)]) -> String {
    const SHOWN: usize = 8;
    let mut text = String::from("positions ");
    for (i, &(first, count)) in ranges.iter().take(SHOWN).enumerate() {
        if i > 0 {
            text.push_str(", ");
        }
        text.push_str(&format!("{first}..{}", first + count));
    }
    if ranges.len() > SHOWN {
        text.push_str(&format!(" and {} more ranges", ranges.len() - SHOWN));
    }
    text.push_str(" (set_require_coverage off judges the compared positions alone)");
    text
}

/// A request whose records are being collected. Cheap to clone (its parts
/// are shared), so that a check or payload works on a copy outside the
/// verifier's lock.
#[derive(Debug, Clone)]
pub(super) struct Pending {
    pub role: Role,
    pub scheduled: Arc<RequestBlocks>,
    /// Per worker (PP stage, TP rank): its part of the request.
    pub reports: BTreeMap<(u32, u32), Arc<WorkerPart>>,
}

/// One worker's part of one request, with its groups indexed by id.
#[derive(Debug)]
pub(super) struct WorkerPart {
    pub rank: Rank,
    /// The role the worker computed in.
    pub role: Role,
    pub detail: bool,
    /// The algorithm the worker computed with.
    pub algorithm: Algorithm,
    /// The record's groups, sorted by id (the record validated that).
    pub groups: Arc<[GroupInfo]>,
    pub request: RecordRequest,
    /// Group id -> index in `request.groups`.
    group_index: HashMap<u32, usize>,
    /// Group id -> index in `request.skipped`.
    skipped_index: HashMap<u32, usize>,
}

impl WorkerPart {
    /// A worker's part, indexed (the record validated that each group
    /// appears once).
    pub fn new(
        rank: Rank,
        (role, detail, algorithm): (Role, bool, Algorithm),
        groups: Arc<[GroupInfo]>,
        request: RecordRequest,
    ) -> WorkerPart {
        let group_index = request
            .groups
            .iter()
            .enumerate()
            .map(|(i, g)| (g.group_id, i))
            .collect();
        let skipped_index = request
            .skipped
            .iter()
            .enumerate()
            .map(|(i, s)| (s.group_id, i))
            .collect();
        WorkerPart {
            rank,
            role,
            detail,
            algorithm,
            groups,
            request,
            group_index,
            skipped_index,
        }
    }

    pub fn group_info(&self, group_id: u32) -> Option<&GroupInfo> {
        let index = self.groups.binary_search_by_key(&group_id, |g| g.group_id).ok()?;
        Some(&self.groups[index])
    }

    pub fn group(&self, group_id: u32) -> Option<&RecordGroup> {
        self.group_index.get(&group_id).map(|&i| &self.request.groups[i])
    }

    pub fn skipped(&self, group_id: u32) -> Option<&str> {
        self.skipped_index
            .get(&group_id)
            .map(|&i| self.request.skipped[i].reason.as_str())
    }

    pub fn name(&self) -> String {
        format!("worker (pp_rank {}, tp_rank {})", self.rank.pp_rank, self.rank.tp_rank)
    }
}

impl Pending {
    /// A request expected in `role` with the blocks it was scheduled with.
    pub fn new(role: Role, scheduled: RequestBlocks) -> Pending {
        Pending {
            role,
            scheduled: Arc::new(scheduled),
            reports: BTreeMap::new(),
        }
    }

    /// The workers' TP size (every record of a verifier has the same).
    pub fn tp_size(&self) -> Option<u32> {
        self.reports.values().next().map(|part| part.rank.tp_size)
    }

    /// Every worker computed in the role the request is expected in: a
    /// worker of the other role checksums other columns, which says nothing
    /// about the data.
    pub fn check_roles(&self) -> Judged<()> {
        match self.reports.values().find(|part| part.role != self.role) {
            None => Ok(()),
            Some(part) => Err(Unverified(
                Reason::RoleDiffers,
                format!(
                    "{} checksummed req_id {:?} as a {}, but the request is expected as a {} (a configuration error, not corrupt data)",
                    part.name(),
                    self.scheduled.req_id,
                    role_name(part.role),
                    role_name(self.role)
                ),
            )),
        }
    }

    /// The algorithm every worker computed with (SPEC section 12); workers
    /// of different algorithms make sums of values that mean nothing.
    /// Weighted when no worker reported.
    pub fn algorithm(&self) -> Judged<Algorithm> {
        let mut parts = self.reports.values();
        let Some(first) = parts.next() else {
            return Ok(Algorithm::Weighted);
        };
        match parts.find(|part| part.algorithm != first.algorithm) {
            None => Ok(first.algorithm),
            Some(other) => Err(Unverified(
                Reason::AlgorithmDiffers,
                format!(
                    "{} computed req_id {:?} with algorithm {}, {} with {} (a configuration error, not corrupt data)",
                    first.name(),
                    self.scheduled.req_id,
                    first.algorithm.name(),
                    other.name(),
                    other.algorithm.name()
                ),
            )),
        }
    }

    /// Every worker reported the request.
    pub fn check_complete(&self, num_workers: u32) -> Judged<()> {
        let reported = self.reports.len() as u64;
        if reported >= num_workers as u64 {
            return Ok(());
        }
        let tp_size = self.reports.values().next().map_or(num_workers, |p| p.rank.tp_size);
        let missing: Vec<String> = (0..num_workers)
            .map(|worker| (worker / tp_size, worker % tp_size))
            .filter(|key| !self.reports.contains_key(key))
            .take(8)
            .map(|(pp_rank, tp_rank)| format!("(pp_rank {pp_rank}, tp_rank {tp_rank})"))
            .collect();
        Err(Unverified(
            Reason::WorkersMissing,
            format!(
                "{reported} of {num_workers} workers reported; missing {}",
                missing.join(", ")
            ),
        ))
    }

    /// Every worker checksummed the request's scheduled token count.
    pub fn check_tokens(&self) -> Judged<()> {
        let scheduled = self.scheduled.num_tokens;
        match self.reports.values().find(|part| part.request.num_tokens != scheduled) {
            None => Ok(()),
            Some(part) => Err(Unverified(
                Reason::OtherBlocks,
                format!(
                    "{} checksummed {} tokens, {scheduled} were scheduled",
                    part.name(),
                    part.request.num_tokens
                ),
            )),
        }
    }

    /// The first worker that skipped `group_id`, with its reason.
    pub fn skipped_by(&self, group_id: u32) -> Option<(String, &str)> {
        self.reports
            .values()
            .find_map(|part| part.skipped(group_id).map(|reason| (part.name(), reason)))
    }

    /// Every worker's entry of a scheduled group, each at the scheduled
    /// positions.
    pub fn group_parts(&self, scheduled: &GroupBlocks) -> Judged<Vec<(&WorkerPart, &RecordGroup)>> {
        let group_id = scheduled.group_id;
        let expected = (scheduled.first_position, scheduled.block_ids.len() as u64);
        let mut parts = Vec::with_capacity(self.reports.len());
        for part in self.reports.values() {
            let Some(group) = part.group(group_id) else {
                return Err(Unverified(
                    Reason::OtherBlocks,
                    format!("{} did not checksum group {group_id}", part.name()),
                ));
            };
            if (group.first_position, group.num_positions) != expected {
                return Err(Unverified(
                    Reason::OtherBlocks,
                    format!(
                        "{} checksummed positions {}..{} of group {group_id}, {}..{} were scheduled",
                        part.name(),
                        group.first_position,
                        group.first_position + group.num_positions,
                        expected.0,
                        expected.0 + expected.1
                    ),
                ));
            }
            parts.push((&**part, group));
        }
        Ok(parts)
    }

    /// The group's fingerprint and marks (SPEC section 7) for the whole
    /// model: per PP stage the values of its TP ranks (which must agree),
    /// summed over stages.
    pub fn fingerprint(&self, group_id: u32) -> Judged<(u64, u64)> {
        let mut stages: BTreeMap<u32, ((u64, u64), &WorkerPart)> = BTreeMap::new();
        for part in self.reports.values() {
            let value = part.group_info(group_id).map_or((0, 0), |g| (g.fingerprint, g.marks));
            let &mut (first, first_part) = stages.entry(part.rank.pp_rank).or_insert((value, part));
            if first != value {
                let what = if first.0 != value.0 {
                    "fingerprints"
                } else {
                    "marks (aliases, shard-keyed state)"
                };
                let (a, b) = if first.0 != value.0 {
                    (first.0, value.0)
                } else {
                    (first.1, value.1)
                };
                return Err(Unverified(
                    Reason::FingerprintDiffers,
                    format!(
                        "{} and {} of one stage report {what} {a:#018x} and {b:#018x} for group {group_id}",
                        first_part.name(),
                        part.name()
                    ),
                ));
            }
        }
        Ok(stages.values().fold((0u64, 0u64), |(fp, marks), &(value, _)| {
            (fp.wrapping_add(value.0), marks.wrapping_add(value.1))
        }))
    }

    /// The group's block size, on which every worker must agree.
    pub fn block_size(&self, group_id: u32) -> Judged<u32> {
        let sizes: BTreeSet<u32> = self
            .reports
            .values()
            .filter_map(|part| part.group_info(group_id).map(|g| g.block_size))
            .collect();
        match sizes.len() {
            1 => Ok(*sizes.first().expect("one")),
            0 => Err(Unverified(
                Reason::OtherBlocks,
                format!("no worker registered group {group_id}"),
            )),
            _ => Err(Unverified(
                Reason::OtherBlocks,
                format!("the workers disagree on the block size of group {group_id}: {sizes:?}"),
            )),
        }
    }

    /// Some worker registered a cache of `group_id`, so the group's values
    /// come from bytes read; where none did they are sums over nothing.
    pub fn check_read(&self, group_id: u32) -> Judged<()> {
        let read = self
            .reports
            .values()
            .any(|part| part.group_info(group_id).is_some_and(|g| g.holds_caches));
        if read {
            return Ok(());
        }
        Err(Unverified(
            Reason::NothingRead,
            format!(
                "no worker of req_id {:?} registered a layer of group {group_id}, so none of its KV was read",
                self.scheduled.req_id
            ),
        ))
    }

    /// Whether group `group_id` is a state group on these workers.
    pub fn is_state(&self, group_id: u32) -> bool {
        self.reports
            .values()
            .any(|part| part.group_info(group_id).is_some_and(|g| g.state))
    }

    /// Whether every worker is in detail mode.
    pub fn all_detail(&self) -> bool {
        self.reports.values().all(|part| part.detail)
    }
}

/// Checks that a record's rank fits an engine of `num_workers` workers.
pub(super) fn check_rank(rank: Rank, num_workers: u32) -> Result<()> {
    if !num_workers.is_multiple_of(rank.tp_size) {
        return Err(err!(
            InvalidArgument,
            "record of tp_size {} does not fit num_workers {num_workers} (TP size x PP stages)",
            rank.tp_size
        ));
    }
    let stages = num_workers / rank.tp_size;
    if rank.pp_rank >= stages {
        return Err(err!(
            InvalidArgument,
            "record of pp_rank {} is not below the {stages} PP stages of num_workers {num_workers} with tp_size {}",
            rank.pp_rank,
            rank.tp_size
        ));
    }
    Ok(())
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Producer => "producer",
        Role::Consumer => "consumer",
    }
}

/// Adds `values` into `total`, wrapping, position by position.
pub(super) fn add_into(total: &mut [u64], values: &[u64]) {
    for (sum, &value) in total.iter_mut().zip(values) {
        *sum = sum.wrapping_add(value);
    }
}

/// The coverage of group `group_id`'s token shards (SPEC section 16), per
/// replica key: every worker that holds a cache of the group places its
/// tokens alike (DCP size, interleave, tokens per slot; else unverified,
/// geometry), every DCP rank `0 .. dcp_size` is held by some worker (else
/// unverified: that rank's tokens were not checksummed), and each rank's
/// workers together cover the same slices (else unverified, coverage).
/// The ranks' values then add up to the block's, and one rank's coverage
/// is the group's: what a side without DCP covers.
pub(super) fn shard_coverage(
    parts: &[(&WorkerPart, &RecordGroup)],
    group_id: u32,
) -> Judged<BTreeMap<ReplicaKey, u64>> {
    let mut first: Option<(&WorkerPart, &GroupInfo)> = None;
    let mut shards: BTreeMap<u32, BTreeMap<ReplicaKey, u64>> = BTreeMap::new();
    for (part, _) in parts {
        let Some(info) = part.group_info(group_id) else {
            continue;
        };
        if !info.holds_caches {
            continue;
        }
        let placement = info.placement;
        if let Some((first_part, first_info)) = first {
            let a = first_info.placement;
            if (a.dcp_size, a.interleave, a.tokens_per_slot)
                != (placement.dcp_size, placement.interleave, placement.tokens_per_slot)
            {
                return Err(Unverified(
                    Reason::GeometryDiffers,
                    format!(
                        "group {group_id}: {} places tokens with dcp_size {}, interleave {}, tokens_per_slot {}, {} with dcp_size {}, interleave {}, tokens_per_slot {} (a configuration error, not corrupt data)",
                        first_part.name(),
                        a.dcp_size,
                        a.interleave,
                        a.tokens_per_slot,
                        part.name(),
                        placement.dcp_size,
                        placement.interleave,
                        placement.tokens_per_slot
                    ),
                ));
            }
        } else {
            first = Some((part, info));
        }
        let shard = shards.entry(placement.dcp_rank).or_default();
        for (key, coverage) in &info.coverage {
            let total = shard.entry(*key).or_insert(0);
            *total = total.wrapping_add(*coverage);
        }
    }
    let dcp_size = first.map_or(1, |(_, info)| info.placement.dcp_size);
    if let Some(missing) = (0..dcp_size).find(|rank| !shards.contains_key(rank)) {
        return Err(Unverified(
            Reason::WorkersMissing,
            format!(
                "group {group_id}: no worker reported DCP rank {missing} of {dcp_size}, so its tokens were not checksummed"
            ),
        ));
    }
    let mut shards = shards.into_iter();
    let Some((_, covered)) = shards.next() else {
        return Ok(BTreeMap::new());
    };
    if let Some((rank, _)) = shards.find(|(_, other)| *other != covered) {
        return Err(Unverified(
            Reason::CoverageDiffers,
            format!(
                "group {group_id}: the workers of DCP rank {rank} cover other layers, heads or replicas than those of DCP rank 0 (a registration differs)"
            ),
        ));
    }
    Ok(covered)
}
