//! The verifier (SPEC sections 4, 7, 9 and 10): the scheduler-side object
//! that collects every worker's record of a request, builds the producer's
//! payload, and judges a consumer's finished load against it.
//!
//! # Flow
//!
//! 1. [`Verifier::expect`] registers requests with the blocks they were
//!    scheduled with (per group: first position and block ids) and a role.
//! 2. [`Verifier::add_record`] takes each worker's record (bytes from
//!    `kvcs_result_encode`, possibly from another process) and keeps, per
//!    expected request, that worker's part. Requests not expected are
//!    ignored; a worker's later record of a request replaces its earlier one.
//! 3. Producer: [`Verifier::payload`] sums the `replica_index == 0` columns
//!    of all `num_workers` workers per group and position, with the group
//!    fingerprints summed over PP stages (one TP rank per stage).
//! 4. Consumer: [`Verifier::check`] forms the replica checks of SPEC section
//!    4 from every worker's columns and compares each with the payload,
//!    giving a [`Report`].
//!
//! A request's state stays until [`Verifier::forget`] or a new `expect` of
//! the same id.
//!
//! # Locking
//!
//! One mutex inside guards all state: every method takes `&self`, so a
//! verifier can be shared across threads (`Arc<Verifier>`, or one C handle
//! used from several threads). Each call holds the lock for its whole
//! duration and never calls out while holding it, so calls are serialised
//! and cannot deadlock; decoding a record happens before taking the lock.

mod compare;
pub mod report;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::blocks::{BlockSet, GroupBlocks, RequestBlocks};
use crate::error::{err, Result};
use crate::layout::{ReplicaKey, Role};
use crate::payload::{Extension, ExtensionGroup, Payload, PayloadGroup, PayloadLayer};
use crate::record::{Record, RecordGroup, RecordRequest};
use crate::result::{GroupInfo, Rank};

use compare::{consumer_ranges, differing_ranges, producer_ranges, run_tokens, Series};
pub use report::{Finding, LayerDifference, Mismatch, Policy, Reason, Report, Verdict};

/// Collects worker records and verifies loads; see the module documentation.
#[derive(Debug)]
pub struct Verifier {
    num_workers: u32,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    policy: Policy,
    extension: bool,
    producer_tp_size: Option<u32>,
    producer_block_sizes: HashMap<u32, u32>,
    /// The TP size of the first record; every later record must agree.
    tp_size: Option<u32>,
    requests: HashMap<String, Pending>,
}

/// A request whose records are being collected.
#[derive(Debug)]
struct Pending {
    role: Role,
    scheduled: RequestBlocks,
    /// Per worker (PP stage, TP rank): its part of the request.
    reports: BTreeMap<(u32, u32), WorkerPart>,
}

/// One worker's part of one request.
#[derive(Debug)]
struct WorkerPart {
    rank: Rank,
    detail: bool,
    groups: Arc<[GroupInfo]>,
    request: RecordRequest,
}

impl WorkerPart {
    fn group_info(&self, group_id: u32) -> Option<&GroupInfo> {
        self.groups.iter().find(|g| g.group_id == group_id)
    }

    fn group(&self, group_id: u32) -> Option<&RecordGroup> {
        self.request.groups.iter().find(|g| g.group_id == group_id)
    }

    fn skipped(&self, group_id: u32) -> Option<&str> {
        self.request
            .skipped
            .iter()
            .find(|s| s.group_id == group_id)
            .map(|s| s.reason.as_str())
    }

    fn name(&self) -> String {
        format!("worker (pp_rank {}, tp_rank {})", self.rank.pp_rank, self.rank.tp_rank)
    }
}

/// A condition that makes a load (or group) unverified, or a payload
/// impossible to build.
struct Unverified(Reason, String);

impl Verifier {
    /// A verifier for an engine of `num_workers` workers (TP size x PP
    /// stages), fail-closed, without payload extension.
    pub fn new(num_workers: u32) -> Result<Verifier> {
        if num_workers == 0 {
            return Err(err!(InvalidArgument, "num_workers is 0"));
        }
        Ok(Verifier {
            num_workers,
            state: Mutex::new(State {
                policy: Policy::FailClosed,
                extension: false,
                producer_tp_size: None,
                producer_block_sizes: HashMap::new(),
                tp_size: None,
                requests: HashMap::new(),
            }),
        })
    }

    /// Workers per engine, as created.
    pub fn num_workers(&self) -> u32 {
        self.num_workers
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| err!(Internal, "the verifier's lock is poisoned by an earlier panic"))
    }

    /// What unverified loads do (default: fail-closed).
    pub fn set_policy(&self, policy: Policy) -> Result<()> {
        self.lock()?.policy = policy;
        Ok(())
    }

    /// Producer: whether payloads carry the kvcsum extension (TP size, block
    /// sizes, and per-layer partials where every record has them). Off by
    /// default: the plain payload is what vLLM reads.
    pub fn set_extension(&self, on: bool) -> Result<()> {
        self.lock()?.extension = on;
        Ok(())
    }

    /// Consumer: the producer's TP size, where payloads do not say it (plain
    /// payloads); needed to compare shard-keyed state groups.
    pub fn set_producer_tp_size(&self, tp_size: u32) -> Result<()> {
        if tp_size == 0 {
            return Err(err!(InvalidArgument, "tp_size is 0"));
        }
        self.lock()?.producer_tp_size = Some(tp_size);
        Ok(())
    }

    /// Consumer: the producer's block size of `group_id`, where payloads do
    /// not say it (plain payloads). Without it the producer's block size is
    /// taken to equal the consumer's.
    pub fn set_producer_block_size(&self, group_id: u32, block_size: u32) -> Result<()> {
        if block_size == 0 {
            return Err(err!(InvalidArgument, "block_size is 0 (group_id {group_id})"));
        }
        self.lock()?.producer_block_sizes.insert(group_id, block_size);
        Ok(())
    }

    /// Registers every request of `scheduled` in `role`, with the blocks its
    /// workers were scheduled to checksum. A request expected before starts
    /// over (its records are dropped).
    pub fn expect(&self, scheduled: &BlockSet, role: Role) -> Result<()> {
        let mut state = self.lock()?;
        for request in scheduled.requests() {
            state.requests.insert(
                request.req_id.clone(),
                Pending {
                    role,
                    scheduled: request.clone(),
                    reports: BTreeMap::new(),
                },
            );
        }
        Ok(())
    }

    /// Drops a request's state; whether it was there.
    pub fn forget(&self, req_id: &str) -> Result<bool> {
        Ok(self.lock()?.requests.remove(req_id).is_some())
    }

    /// Decodes a worker's record (`Error::Malformed` for bad bytes) and adds it.
    pub fn add_record(&self, bytes: &[u8]) -> Result<()> {
        let record = Record::decode(bytes)?;
        self.add(record)
    }

    /// Adds a decoded record: each expected request's part is kept for its
    /// worker. Fails, keeping nothing, when the record does not validate or
    /// its rank does not fit this engine.
    pub fn add(&self, record: Record) -> Result<()> {
        record.validate()?;
        let rank = record.rank;
        if self.num_workers % rank.tp_size != 0 {
            return Err(err!(
                InvalidArgument,
                "record of tp_size {} does not fit num_workers {} (TP size x PP stages)",
                rank.tp_size,
                self.num_workers
            ));
        }
        let stages = self.num_workers / rank.tp_size;
        if rank.pp_rank >= stages {
            return Err(err!(
                InvalidArgument,
                "record of pp_rank {} is not below the {stages} PP stages of num_workers {} with tp_size {}",
                rank.pp_rank,
                self.num_workers,
                rank.tp_size
            ));
        }
        let mut state = self.lock()?;
        match state.tp_size {
            Some(tp_size) if tp_size != rank.tp_size => {
                return Err(err!(
                    InvalidArgument,
                    "record of tp_size {} differs from tp_size {tp_size} of earlier records",
                    rank.tp_size
                ));
            }
            _ => state.tp_size = Some(rank.tp_size),
        }
        let groups: Arc<[GroupInfo]> = record.groups.into();
        for request in record.requests {
            if let Some(pending) = state.requests.get_mut(&request.req_id) {
                pending.reports.insert(
                    (rank.pp_rank, rank.tp_rank),
                    WorkerPart {
                        rank,
                        detail: record.detail,
                        groups: groups.clone(),
                        request,
                    },
                );
            }
        }
        Ok(())
    }

    /// Producer: the payload of `req_id` (encode it with
    /// [`Payload::encode`]). `NotReady` until every worker reported it;
    /// `InvalidArgument` when the records cannot make a payload (a worker
    /// checksummed other blocks than scheduled, fingerprints or block sizes
    /// of one stage disagree); `NotFound` for a request not expected.
    pub fn payload(&self, req_id: &str) -> Result<Payload> {
        let state = self.lock()?;
        let pending = state.pending(req_id)?;
        if pending.role != Role::Producer {
            return Err(err!(
                InvalidArgument,
                "req_id {req_id:?} is expected as a consumer; payloads are built for producers"
            ));
        }
        if let Err(Unverified(reason, message)) = self.check_complete(pending) {
            return Err(err!(
                NotReady,
                "no payload for req_id {req_id:?}: {}: {message}",
                reason.describe()
            ));
        }
        let fail = |Unverified(reason, message): Unverified| {
            err!(
                InvalidArgument,
                "no payload for req_id {req_id:?}: {}: {message}",
                reason.describe()
            )
        };
        check_tokens(pending).map_err(fail)?;
        let mut groups = Vec::new();
        let mut extension_groups = Vec::new();
        let detail = pending.reports.values().all(|part| part.detail);
        for scheduled in &pending.scheduled.groups {
            let group_id = scheduled.group_id;
            if pending.reports.values().any(|part| part.skipped(group_id).is_some()) {
                continue;
            }
            let parts = group_parts(pending, scheduled).map_err(fail)?;
            let mut values = vec![0u64; scheduled.block_ids.len()];
            let mut layers = Vec::new();
            for (_, group) in &parts {
                for column in group.columns.iter().filter(|c| c.replica.replica_index == 0) {
                    add_into(&mut values, &column.values);
                }
                layers.extend(
                    group
                        .layers
                        .iter()
                        .filter(|l| l.replica.replica_index == 0)
                        .map(|l| PayloadLayer {
                            layer_number: l.layer_number,
                            first_head: l.first_head,
                            num_heads: l.num_heads,
                            values: l.values.clone(),
                        }),
                );
            }
            let fingerprint = fingerprint(pending, group_id).map_err(fail)?;
            let block_size = block_size(pending, group_id).map_err(fail)?;
            groups.push(PayloadGroup {
                group_id,
                fingerprint,
                first_position: scheduled.first_position,
                values,
            });
            layers.sort_by_key(|l| (l.layer_number, l.first_head));
            extension_groups.push(ExtensionGroup {
                group_id,
                block_size,
                layers: if detail { layers } else { Vec::new() },
            });
        }
        let extension = state.extension.then(|| Extension {
            producer_tp_size: state.tp_size.unwrap_or(1),
            groups: extension_groups,
        });
        let payload = Payload {
            num_tokens: pending.scheduled.num_tokens,
            groups,
            extension,
        };
        payload.validate().map_err(|e| {
            err!(
                InvalidArgument,
                "no payload for req_id {req_id:?}: the records give an invalid payload: {e}"
            )
        })?;
        Ok(payload)
    }

    /// Consumer: judges the finished load of `req_id` against the producer's
    /// payload bytes (`None`: the producer sent none). Bad payload bytes make
    /// the load unverified, not an error; `NotFound` for a request not
    /// expected, `InvalidArgument` for one expected as a producer.
    pub fn check(&self, req_id: &str, payload: Option<&[u8]>) -> Result<Report> {
        self.check_decoded(req_id, payload.map(Payload::decode))
    }

    /// Like [`Verifier::check`], with the payload as the base64 text of
    /// `kv_transfer_params["kv_checksums"]`; text that is not standard padded
    /// base64 makes the load unverified (invalid checksums).
    pub fn check_base64(&self, req_id: &str, text: &[u8]) -> Result<Report> {
        let decoded = crate::payload::decode_base64(text).and_then(|bytes| Payload::decode(&bytes));
        self.check_decoded(req_id, Some(decoded))
    }

    fn check_decoded(&self, req_id: &str, decoded: Option<Result<Payload>>) -> Result<Report> {
        let state = self.lock()?;
        let pending = state.pending(req_id)?;
        if pending.role != Role::Consumer {
            return Err(err!(
                InvalidArgument,
                "req_id {req_id:?} is expected as a producer; loads are checked for consumers"
            ));
        }
        let whole = |reason, message| {
            Report::new(
                req_id,
                state.policy,
                0,
                Vec::new(),
                vec![Finding {
                    reason,
                    group_id: None,
                    message,
                }],
            )
        };
        if let Err(Unverified(reason, message)) = self.check_complete(pending) {
            return Ok(whole(reason, message));
        }
        let payload = match decoded {
            None => {
                return Ok(whole(
                    Reason::NoChecksums,
                    "no payload was given for the request".to_owned(),
                ))
            }
            Some(Err(error)) => return Ok(whole(Reason::InvalidChecksums, error.to_string())),
            Some(Ok(payload)) => payload,
        };
        if let Err(Unverified(reason, message)) = check_tokens(pending) {
            return Ok(whole(reason, message));
        }
        let mut compared = 0u64;
        let mut mismatches = Vec::new();
        let mut findings = Vec::new();
        let mut any_group_compared = false;
        for scheduled in &pending.scheduled.groups {
            let group_id = scheduled.group_id;
            match self.compare_group(&state, pending, &payload, scheduled) {
                Ok(Some(outcome)) => {
                    any_group_compared = true;
                    compared += outcome.compared;
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
        if !any_group_compared && findings.is_empty() {
            findings.push(Finding {
                reason: Reason::NoCommonPosition,
                group_id: None,
                message: "no loaded group can be checksummed (every group is skipped on both sides)".to_owned(),
            });
        }
        Ok(Report::new(req_id, state.policy, compared, mismatches, findings))
    }

    /// Every worker reported the request.
    fn check_complete(&self, pending: &Pending) -> std::result::Result<(), Unverified> {
        let reported = pending.reports.len() as u64;
        if reported < self.num_workers as u64 {
            let missing: Vec<String> = (0..self.num_workers)
                .filter_map(|worker| {
                    let tp_size = pending
                        .reports
                        .values()
                        .next()
                        .map_or(self.num_workers, |p| p.rank.tp_size);
                    let key = (worker / tp_size, worker % tp_size);
                    (!pending.reports.contains_key(&key)).then(|| format!("(pp_rank {}, tp_rank {})", key.0, key.1))
                })
                .take(8)
                .collect();
            return Err(Unverified(
                Reason::WorkersMissing,
                format!(
                    "{reported} of {} workers reported; missing {}",
                    self.num_workers,
                    missing.join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// Compares one scheduled group; `Ok(None)` when it is skipped on both
    /// sides (nothing to compare, nothing wrong).
    fn compare_group(
        &self,
        state: &State,
        pending: &Pending,
        payload: &Payload,
        scheduled: &GroupBlocks,
    ) -> std::result::Result<Option<GroupOutcome>, Unverified> {
        let group_id = scheduled.group_id;
        let skipped_by = pending
            .reports
            .values()
            .find_map(|part| part.skipped(group_id).map(|reason| (part.name(), reason)));
        let sent = payload.group(group_id);
        match (&skipped_by, sent) {
            (Some(_), None) => return Ok(None),
            (Some((worker, reason)), Some(_)) => {
                return Err(Unverified(
                    Reason::OneSidedGroup,
                    format!("the producer sent group {group_id}, which {worker} skipped: {reason}"),
                ))
            }
            (None, None) => {
                return Err(Unverified(
                    Reason::OneSidedGroup,
                    format!("the consumer checksummed group {group_id}, which the producer did not send"),
                ))
            }
            (None, Some(_)) => {}
        }
        let sent = sent.expect("matched above");
        let parts = group_parts(pending, scheduled)?;
        let ours = fingerprint(pending, group_id)?;
        if ours != sent.fingerprint {
            return Err(Unverified(
                Reason::FingerprintDiffers,
                format!(
                    "group {group_id}: the producer's fingerprint is {:#018x}, the consumer's {ours:#018x} (other layers or identities)",
                    sent.fingerprint
                ),
            ));
        }
        let consumer_block_size = block_size(pending, group_id)?;
        let extension = payload.extension_group(group_id);
        let producer_block_size = extension
            .map(|e| e.block_size)
            .or_else(|| state.producer_block_sizes.get(&group_id).copied())
            .unwrap_or(consumer_block_size);
        let shard_keyed = parts
            .iter()
            .any(|(part, _)| part.group_info(group_id).is_some_and(|g| g.shard_keyed));
        let consumer_tp_size = state.tp_size.unwrap_or(1);
        let producer_tp_size = payload
            .extension
            .as_ref()
            .map(|e| e.producer_tp_size)
            .or(state.producer_tp_size);
        if shard_keyed {
            if let Some(producer_tp_size) = producer_tp_size {
                if producer_tp_size != consumer_tp_size {
                    return Err(Unverified(
                        Reason::StateTpDiffers,
                        format!(
                            "group {group_id} is shard-keyed state; producer TP size {producer_tp_size}, consumer {consumer_tp_size}"
                        ),
                    ));
                }
            }
        }
        let checks = replica_checks(&parts, scheduled.block_ids.len())?;
        let consumer = Series {
            block_size: consumer_block_size,
            first_position: scheduled.first_position,
            values: &[],
            num_tokens: pending.scheduled.num_tokens,
        };
        let producer = Series {
            block_size: producer_block_size,
            first_position: sent.first_position,
            values: &sent.values,
            num_tokens: payload.num_tokens,
        };
        let run = run_tokens(producer_block_size, consumer_block_size);
        let (q_lo, q_hi) = consumer.with_values(&checks[0].1).runs(run);
        let localised = parts.iter().all(|(part, _)| part.detail) && extension.is_some_and(|e| !e.layers.is_empty());
        let mut compared = 0u64;
        let mut mismatches = Vec::new();
        for q in q_lo..q_hi {
            let valid = consumer.run_valid_tokens(run, q);
            if valid == 0 || valid != producer.run_valid_tokens(run, q) {
                continue;
            }
            let Some(expected) = producer.run_value(run, q) else {
                continue;
            };
            let mut failed_checks = Vec::new();
            let mut defined = true;
            for (check, values) in &checks {
                match consumer.with_values(values).run_value(run, q) {
                    Some(value) if value != expected => failed_checks.push(*check),
                    Some(_) => {}
                    None => defined = false,
                }
            }
            if !defined {
                continue;
            }
            compared += 1;
            if failed_checks.is_empty() {
                continue;
            }
            let (lo, hi) = consumer.blocks_of_run(run, q);
            let mut layers = Vec::new();
            if localised {
                let sent_layers = &extension.expect("localised needs it").layers;
                let producer_layers = producer_ranges(sent_layers, producer, run, q);
                for &check in &failed_checks {
                    let consumer_layers = consumer_ranges(
                        parts
                            .iter()
                            .flat_map(|(_, group)| group.layers.iter().map(move |layer| (layer, consumer))),
                        check,
                        run,
                        q,
                    );
                    layers.extend(differing_ranges(&producer_layers, &consumer_layers, check));
                }
            }
            mismatches.push(Mismatch {
                group_id,
                first_position: lo as u64,
                num_positions: (hi - lo) as u64,
                first_token: (q * run) as u64,
                num_tokens: valid as u64,
                failed_checks,
                localised,
                layers,
            });
        }
        if compared == 0 {
            return Err(Unverified(
                Reason::NoCommonPosition,
                format!(
                    "group {group_id}: the consumer's positions {}..{} (block size {consumer_block_size}, {} tokens) and the producer's {}..{} (block size {producer_block_size}, {} tokens) share no position with equal valid tokens",
                    scheduled.first_position,
                    scheduled.first_position + scheduled.block_ids.len() as u64,
                    pending.scheduled.num_tokens,
                    sent.first_position,
                    sent.first_position + sent.values.len() as u64,
                    payload.num_tokens
                ),
            ));
        }
        if shard_keyed && producer_tp_size.is_none() && !mismatches.is_empty() {
            // Shard-keyed state of another TP size checksums differently; with
            // the producer's TP size unknown a difference proves nothing.
            return Err(Unverified(
                Reason::StateTpDiffers,
                format!(
                    "group {group_id} is shard-keyed state, differs at {} positions, and the producer's TP size is unknown",
                    mismatches.len()
                ),
            ));
        }
        Ok(Some(GroupOutcome { compared, mismatches }))
    }
}

impl State {
    fn pending(&self, req_id: &str) -> Result<&Pending> {
        self.requests
            .get(req_id)
            .ok_or_else(|| err!(NotFound, "req_id {req_id:?} is not expected by this verifier"))
    }
}

/// A compared group's positions and mismatches.
struct GroupOutcome {
    compared: u64,
    mismatches: Vec<Mismatch>,
}

fn add_into(total: &mut [u64], values: &[u64]) {
    for (sum, &value) in total.iter_mut().zip(values) {
        *sum = sum.wrapping_add(value);
    }
}

/// Every worker checksummed the request's scheduled token count.
fn check_tokens(pending: &Pending) -> std::result::Result<(), Unverified> {
    let scheduled = pending.scheduled.num_tokens;
    for part in pending.reports.values() {
        if part.request.num_tokens != scheduled {
            return Err(Unverified(
                Reason::OtherBlocks,
                format!(
                    "{} checksummed {} tokens, {scheduled} were scheduled",
                    part.name(),
                    part.request.num_tokens
                ),
            ));
        }
    }
    Ok(())
}

/// Every worker's entry of a scheduled group, each at the scheduled positions.
fn group_parts<'a>(
    pending: &'a Pending,
    scheduled: &GroupBlocks,
) -> std::result::Result<Vec<(&'a WorkerPart, &'a RecordGroup)>, Unverified> {
    let group_id = scheduled.group_id;
    let expected = (scheduled.first_position, scheduled.block_ids.len() as u64);
    let mut parts = Vec::with_capacity(pending.reports.len());
    for part in pending.reports.values() {
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
        parts.push((part, group));
    }
    Ok(parts)
}

/// The group's fingerprint for the whole model: per PP stage the value of
/// its TP ranks (which must agree), summed over stages.
fn fingerprint(pending: &Pending, group_id: u32) -> std::result::Result<u64, Unverified> {
    let mut stages: BTreeMap<u32, (u64, &WorkerPart)> = BTreeMap::new();
    for part in pending.reports.values() {
        let value = part.group_info(group_id).map_or(0, |g| g.fingerprint);
        match stages.get(&part.rank.pp_rank) {
            None => {
                stages.insert(part.rank.pp_rank, (value, part));
            }
            Some(&(first, first_part)) if first != value => {
                return Err(Unverified(
                    Reason::FingerprintDiffers,
                    format!(
                        "{} and {} of one stage report fingerprints {first:#018x} and {value:#018x} for group {group_id}",
                        first_part.name(),
                        part.name()
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(stages.values().fold(0u64, |sum, &(value, _)| sum.wrapping_add(value)))
}

/// The group's block size, on which every worker must agree.
fn block_size(pending: &Pending, group_id: u32) -> std::result::Result<u32, Unverified> {
    let sizes: BTreeSet<u32> = pending
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

/// The consumer's checks of SPEC section 4, at its positions: check `k` sums,
/// over the distinct replica counts `R`, the total of key `(R, k % R)`.
fn replica_checks(
    parts: &[(&WorkerPart, &RecordGroup)],
    num_positions: usize,
) -> std::result::Result<Vec<(u32, Vec<u64>)>, Unverified> {
    let mut totals: BTreeMap<ReplicaKey, Vec<u64>> = BTreeMap::new();
    for (_, group) in parts {
        for column in &group.columns {
            let total = totals
                .entry(column.replica)
                .or_insert_with(|| vec![0u64; num_positions]);
            add_into(total, &column.values);
        }
    }
    let replica_counts: BTreeSet<u32> = totals.keys().map(|k| k.replicas).collect();
    // Each count R needs keys (R, 0) .. (R, R-1); checking that first also
    // bounds the number of checks by the number of columns.
    for &replicas in &replica_counts {
        if let Some(missing) = (0..replicas).find(|&i| {
            !totals.contains_key(&ReplicaKey {
                replicas,
                replica_index: i,
            })
        }) {
            return Err(Unverified(
                Reason::ReplicaMissing,
                format!("no worker checksummed replica {missing} of {replicas}"),
            ));
        }
    }
    let max_replicas = replica_counts.last().copied().unwrap_or(1);
    let mut checks = Vec::with_capacity(max_replicas as usize);
    for check in 0..max_replicas {
        let mut values = vec![0u64; num_positions];
        for &replicas in &replica_counts {
            let key = ReplicaKey {
                replicas,
                replica_index: check % replicas,
            };
            add_into(&mut values, &totals[&key]);
        }
        checks.push((check, values));
    }
    Ok(checks)
}
