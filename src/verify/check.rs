//! Checking: a consumer's finished load against the producer's payload
//! (SPEC sections 4 and 10), group by group.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::base::error::Result;
use crate::inputs::blocks::GroupBlocks;
use crate::inputs::layout::ReplicaKey;
use crate::wire::payload::{ExtensionGroup, FingerprintConvention, Payload, PayloadGroup};
use crate::wire::record::{LayerPartial, RecordGroup};

use super::collect::{add_into, shard_coverage, GroupOutcome, Judged, Load, Unverified, Wording, WorkerPart};
use super::compare::{consumer_ranges, differing_ranges, producer_ranges, run_tokens, Series};
use super::decoding::{compare_decodings, compare_geometry};
use super::report::{LayerDifference, Mismatch, Reason, Report};

/// The payload's groups and extension groups by id.
struct SentGroups<'p> {
    groups: HashMap<u32, &'p PayloadGroup>,
    extension: HashMap<u32, &'p ExtensionGroup>,
}

impl<'p> SentGroups<'p> {
    /// The payload validated that each id appears once.
    fn of(payload: &'p Payload) -> SentGroups<'p> {
        SentGroups {
            groups: payload.groups.iter().map(|g| (g.group_id, g)).collect(),
            extension: payload
                .extension
                .iter()
                .flat_map(|e| e.groups.iter())
                .map(|g| (g.group_id, g))
                .collect(),
        }
    }
}

/// Both sides' facts of one group that decide how it is compared.
struct GroupSides<'a> {
    scheduled: &'a GroupBlocks,
    sent: &'a PayloadGroup,
    extension: Option<&'a ExtensionGroup>,
    parts: Vec<(&'a WorkerPart, &'a RecordGroup)>,
    consumer_block_size: u32,
    /// The producer's block size where it was sent (the extension) or set
    /// (`Verifier::set_producer_block_size`); a plain payload says nothing
    /// of it.
    producer_block_size: Option<u32>,
    shard_keyed: bool,
    producer_tp_size: Option<u32>,
}

impl Load<'_> {
    /// The report on the load, given the decoded payload (`None`: none sent).
    pub fn judge(&self, decoded: Option<Result<Payload>>) -> Report {
        let whole_load = self
            .pending
            .check_complete(self.num_workers)
            .and_then(|()| self.pending.check_roles())
            .and_then(|()| self.pending.algorithm());
        let algorithm = match whole_load {
            Ok(algorithm) => algorithm,
            Err(unverified) => return self.whole(unverified),
        };
        let payload = match decoded {
            None => {
                return self.whole(Unverified(
                    Reason::NoChecksums,
                    "no payload was given for the request".to_owned(),
                ))
            }
            Some(Err(error)) => return self.whole(Unverified(Reason::InvalidChecksums, error.to_string())),
            Some(Ok(payload)) => payload,
        };
        if payload.algorithm() != algorithm {
            return self.whole(Unverified(
                Reason::AlgorithmDiffers,
                format!(
                    "the producer's checksums are {}{}, the consumer's workers computed {} (set one algorithm on both sides; a configuration error, not corrupt data)",
                    payload.algorithm().name(),
                    if payload.extension.is_none() { " (a plain payload)" } else { "" },
                    algorithm.name()
                ),
            ));
        }
        if let Err(unverified) = self.pending.check_tokens() {
            return self.whole(unverified);
        }
        self.compare(&payload)
    }

    /// Compares every scheduled group and gathers the outcomes.
    fn compare(&self, payload: &Payload) -> Report {
        let sent = SentGroups::of(payload);
        let wording = Wording {
            uncompared: |group_id, uncompared, compared| {
                format!("group {group_id}: {uncompared} loaded positions were not compared ({compared} compared)")
            },
            nothing_judged: "no loaded group can be checksummed (every group is skipped on both sides)",
        };
        self.gather(|scheduled| self.compare_group(payload, &sent, scheduled), &wording)
    }

    /// Compares one scheduled group; `Ok(None)` when it is skipped on both
    /// sides (nothing to compare, nothing wrong).
    fn compare_group(
        &self,
        payload: &Payload,
        sent: &SentGroups<'_>,
        scheduled: &GroupBlocks,
    ) -> Judged<Option<GroupOutcome>> {
        // A group the consumer computed but read nothing of is unverified
        // for that, whether or not the producer sent it (a producer that
        // read nothing of it either leaves it out).
        if self.pending.skipped_by(scheduled.group_id).is_none() {
            self.pending.check_read(scheduled.group_id)?;
        }
        let Some(sent_group) = self.sent_group(sent, scheduled.group_id)? else {
            return Ok(None);
        };
        let extension = sent.extension.get(&scheduled.group_id).copied();
        let sides = self.group_sides(payload, scheduled, sent_group, extension)?;
        sides.check_state_tp(self.pending.tp_size().unwrap_or(1))?;
        // Before the replica checks: a DCP rank missing is no replica missing.
        let covered = shard_coverage(&sides.parts, scheduled.group_id)?;
        let checks = replica_checks(&sides.parts, scheduled.block_ids.len())?;
        sides.check_coverage(covered)?;
        if self.pending.is_state(scheduled.group_id) {
            return sides
                .compare_state(self.pending.scheduled.num_tokens, &checks)
                .map(Some);
        }
        let producer_block_size = sides.producer_block_size.ok_or_else(|| sides.block_size_unknown())?;
        let tokens = (self.pending.scheduled.num_tokens, payload.num_tokens);
        let short = sides.one_token_fewer(producer_block_size, tokens);
        let outcome = sides.compare_runs(producer_block_size, tokens, &checks, short.as_ref());
        if outcome.compared == 0 {
            return Err(sides.no_common_position(producer_block_size, tokens));
        }
        Ok(Some(outcome))
    }

    /// The producer's entry of the group; `None` when both sides skipped it,
    /// unverified when only one side has it.
    fn sent_group<'p>(&self, sent: &SentGroups<'p>, group_id: u32) -> Judged<Option<&'p PayloadGroup>> {
        let skipped_by = self.pending.skipped_by(group_id);
        match (skipped_by, sent.groups.get(&group_id).copied()) {
            (Some(_), None) => Ok(None),
            (Some((worker, reason)), Some(_)) => Err(Unverified(
                Reason::OneSidedGroup,
                format!("the producer sent group {group_id}, which {worker} skipped: {reason}"),
            )),
            (None, None) => Err(Unverified(
                Reason::OneSidedGroup,
                format!("the consumer checksummed group {group_id}, which the producer did not send"),
            )),
            (None, Some(sent)) => Ok(Some(sent)),
        }
    }

    /// Gathers both sides' facts of a group both sides checksummed; the
    /// fingerprints must agree.
    fn group_sides<'a>(
        &'a self,
        payload: &'a Payload,
        scheduled: &'a GroupBlocks,
        sent: &'a PayloadGroup,
        extension: Option<&'a ExtensionGroup>,
    ) -> Judged<GroupSides<'a>> {
        let group_id = scheduled.group_id;
        let parts = self.pending.group_parts(scheduled)?;
        let ours = self.pending.fingerprint(group_id)?;
        check_fingerprint(
            group_id,
            sent.fingerprint,
            payload.fingerprint_convention(group_id),
            ours,
        )?;
        if let Some(extension) = extension {
            compare_decodings(group_id, &extension.decodings, &self.pending.decodings(group_id)?)?;
            compare_geometry(group_id, &extension.geometry, &self.pending.geometry(group_id)?)?;
        }
        let consumer_block_size = self.pending.block_size(group_id)?;
        let producer_block_size = extension
            .map(|e| e.block_size)
            .or_else(|| self.settings.producer_block_sizes.get(&group_id).copied());
        let shard_keyed = parts
            .iter()
            .any(|(part, _)| part.group_info(group_id).is_some_and(|g| g.shard_keyed));
        let producer_tp_size = payload
            .extension
            .as_ref()
            .map(|e| e.producer_tp_size)
            .or(self.settings.producer_tp_size);
        Ok(GroupSides {
            scheduled,
            sent,
            extension,
            parts,
            consumer_block_size,
            producer_block_size,
            shard_keyed,
            producer_tp_size,
        })
    }
}

impl GroupSides<'_> {
    /// Shard-keyed state is comparable only between TP sizes known to be
    /// equal.
    fn check_state_tp(&self, consumer_tp_size: u32) -> Judged<()> {
        if !self.shard_keyed {
            return Ok(());
        }
        match self.producer_tp_size {
            Some(producer_tp_size) if producer_tp_size == consumer_tp_size => Ok(()),
            Some(producer_tp_size) => Err(Unverified(
                Reason::StateTpDiffers,
                format!(
                    "group {} is shard-keyed state; producer TP size {producer_tp_size}, consumer {consumer_tp_size}",
                    self.scheduled.group_id
                ),
            )),
            None => Err(Unverified(
                Reason::StateTpDiffers,
                format!(
                    "group {} is shard-keyed state and the producer's TP size is unknown (a plain payload; kvcs_verifier_set_producer_tp_size sets it)",
                    self.scheduled.group_id
                ),
            )),
        }
    }

    /// Where the producer sent the coverage of its slices (the extension),
    /// each replica check of the consumer must cover the same layers and
    /// heads: a side that checksums other slices (a head left out, a
    /// replica declared wrongly) is a configuration difference, not
    /// corrupt data.
    /// `totals` is the consumer's coverage per key ([`shard_coverage`]: one
    /// DCP token shard's, each shard's alike).
    fn check_coverage(&self, totals: BTreeMap<ReplicaKey, u64>) -> Judged<()> {
        let Some(expected) = self.extension.and_then(|e| e.coverage) else {
            return Ok(());
        };
        let group_id = self.scheduled.group_id;
        // The record's keys of its registered layers, not only those of the
        // call's columns: complete, or the sides' coverages cannot agree
        // (and the checks stay bounded by the keys).
        if let Some((missing, replicas)) = first_missing_key(&totals) {
            return Err(Unverified(
                Reason::CoverageDiffers,
                format!("group {group_id}: no worker covers replica {missing} of {replicas}"),
            ));
        }
        for (check, keys) in check_keys(totals.keys().copied()) {
            let covered = keys
                .iter()
                .fold(0u64, |sum, key| sum.wrapping_add(totals.get(key).copied().unwrap_or(0)));
            if covered != expected {
                return Err(Unverified(
                    Reason::CoverageDiffers,
                    format!(
                        "group {group_id}: the consumer's check {check} covers other layers or heads than the producer checksummed (coverage {covered:#018x}, the producer's {expected:#018x}): a registration differs"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Why a group of a plain payload, whose producer block size nobody
    /// gave, is unverified. Its positions cannot be lined up with the
    /// consumer's: no count or value of them tells the producer's block
    /// size (48 and 32 give 64 tokens two positions each, and a position
    /// past the tokens sums to 0 whatever its size), so the library never
    /// takes it to be the consumer's.
    fn block_size_unknown(&self) -> Unverified {
        let group_id = self.scheduled.group_id;
        Unverified(
            Reason::BlockSizeUnknown,
            format!(
                "group {group_id}: the producer's block size is unknown (the payload does not carry it, as a plain payload never does, and kvcs_verifier_set_producer_block_size was not called for group {group_id}), so its positions {}..{} cannot be lined up with the consumer's of block size {}",
                self.sent.first_position,
                self.sent.first_position + self.sent.values.len() as u64,
                self.consumer_block_size,
            ),
        )
    }

    /// A state group (SPEC section 6) holds one block per request at
    /// position 0 that `num_tokens` does not limit: positions both sides
    /// hold are compared whatever the token counts and block sizes.
    fn compare_state(&self, num_tokens: u64, checks: &[(u32, Vec<u64>)]) -> Judged<GroupOutcome> {
        let first = self.scheduled.first_position;
        let mut outcome = GroupOutcome::new();
        for index in 0..self.scheduled.block_ids.len() {
            let position = first + index as u64;
            let sent = position
                .checked_sub(self.sent.first_position)
                .and_then(|at| self.sent.values.get(at as usize));
            let Some(&expected) = sent else {
                outcome.add_uncompared(position, 1);
                continue;
            };
            outcome.compared += 1;
            let failed_checks: Vec<u32> = checks
                .iter()
                .filter(|(_, values)| values[index] != expected)
                .map(|&(check, _)| check)
                .collect();
            if !failed_checks.is_empty() {
                outcome.mismatches.push(Mismatch {
                    group_id: self.scheduled.group_id,
                    first_position: position,
                    num_positions: 1,
                    first_token: 0,
                    num_tokens,
                    state: true,
                    block_size: self.consumer_block_size,
                    failed_checks,
                    localised: false,
                    layers: Vec::new(),
                    failed_workers: Vec::new(),
                });
            }
        }
        if outcome.compared == 0 {
            return Err(Unverified(
                Reason::NoCommonPosition,
                format!(
                    "state group {}: the consumer's positions {first}..{} and the producer's {}..{} share none",
                    self.scheduled.group_id,
                    first + self.scheduled.block_ids.len() as u64,
                    self.sent.first_position,
                    self.sent.first_position + self.sent.values.len() as u64,
                ),
            ));
        }
        Ok(outcome)
    }

    /// Whether both sides sent per-layer partials, so mismatches name layers.
    fn localised(&self) -> bool {
        self.parts.iter().all(|(part, _)| part.detail) && self.extension.is_some_and(|e| !e.layers.is_empty())
    }

    /// Where the consumer holds exactly one token fewer than the producer
    /// and the extension sent the group's short last value (SPEC section
    /// 10): the producer's values over the consumer's tokens, its position
    /// holding the last token replaced by that value. Only that position
    /// differs from the values over one token fewer: every other position
    /// keeps its valid tokens.
    fn one_token_fewer(
        &self,
        producer_block_size: u32,
        (consumer_tokens, producer_tokens): (u64, u64),
    ) -> Option<OneTokenFewer> {
        let short_last = self.extension?.short_last?;
        if consumer_tokens.checked_add(1) != Some(producer_tokens) {
            return None;
        }
        // The payload validated that the group holds this position.
        let position = consumer_tokens / producer_block_size as u64;
        let mut values = self.sent.values.clone();
        *values.get_mut(position.checked_sub(self.sent.first_position)? as usize)? = short_last;
        Some(OneTokenFewer { values, position })
    }

    /// Compares every run both sides hold with equal valid tokens; with
    /// `short`, against the producer's values over one token fewer.
    fn compare_runs(
        &self,
        producer_block_size: u32,
        (consumer_tokens, producer_tokens): (u64, u64),
        checks: &[(u32, Vec<u64>)],
        short: Option<&OneTokenFewer>,
    ) -> GroupOutcome {
        let consumer = Series {
            block_size: self.consumer_block_size,
            first_position: self.scheduled.first_position,
            values: &[],
            num_tokens: consumer_tokens,
        };
        let producer = match short {
            Some(short) => Series {
                block_size: producer_block_size,
                first_position: self.sent.first_position,
                values: &short.values,
                num_tokens: consumer_tokens,
            },
            None => Series {
                block_size: producer_block_size,
                first_position: self.sent.first_position,
                values: &self.sent.values,
                num_tokens: producer_tokens,
            },
        };
        let run = run_tokens(producer_block_size, self.consumer_block_size);
        let (q_lo, q_hi) = consumer.with_values(&checks[0].1).runs(run);
        let localised = self.localised();
        let mut outcome = GroupOutcome::new();
        // The consumer's loaded positions holding valid tokens: `start ..
        // loaded_end`; compared runs cover some of them, in ascending
        // order, and the gaps between are uncompared.
        let start = consumer.first_position as u128;
        let loaded_end = start + consumer_loaded(consumer, self.scheduled.block_ids.len());
        let mut cursor = start;
        let mut namer = localised.then(|| LayerNamer::new(self, producer, consumer, run));
        for q in q_lo..q_hi {
            let valid = consumer.run_valid_tokens(run, q);
            if valid == 0 || valid != producer.run_valid_tokens(run, q) {
                continue;
            }
            let Some(expected) = producer.run_value(run, q) else {
                continue;
            };
            let Some(failed_checks) = failed_checks(consumer, checks, expected, run, q) else {
                continue;
            };
            outcome.compared += 1;
            let (lo, hi) = consumer.blocks_of_run(run, q);
            if lo > cursor {
                outcome.add_uncompared(cursor as u64, (lo - cursor) as u64);
            }
            cursor = cursor.max(hi);
            if failed_checks.is_empty() {
                continue;
            }
            // The producer's layer partials of its short position are over
            // all its tokens: a run holding it names no layers.
            let (p_lo, p_hi) = producer.blocks_of_run(run, q);
            let short_in_run = short.is_some_and(|s| (p_lo..p_hi).contains(&(s.position as u128)));
            let layers = match short_in_run {
                true => None,
                false => namer.as_mut().and_then(|namer| namer.name(&failed_checks, q)),
            };
            outcome.mismatches.push(Mismatch {
                group_id: self.scheduled.group_id,
                first_position: lo as u64,
                num_positions: (hi - lo) as u64,
                first_token: (q * run) as u64,
                num_tokens: valid as u64,
                state: false,
                block_size: self.consumer_block_size,
                failed_checks,
                localised: layers.is_some(),
                layers: layers.unwrap_or_default(),
                failed_workers: Vec::new(),
            });
        }
        if loaded_end > cursor {
            outcome.add_uncompared(cursor as u64, (loaded_end - cursor) as u64);
        }
        outcome
    }

    /// Why a group with no compared run is unverified.
    fn no_common_position(
        &self,
        producer_block_size: u32,
        (consumer_tokens, producer_tokens): (u64, u64),
    ) -> Unverified {
        let scheduled = self.scheduled;
        Unverified(
            Reason::NoCommonPosition,
            format!(
                "group {}: the consumer's positions {}..{} (block size {}, {consumer_tokens} tokens) and the producer's {}..{} (block size {}, {producer_tokens} tokens) share no position with equal valid tokens",
                scheduled.group_id,
                scheduled.first_position,
                scheduled.first_position + scheduled.block_ids.len() as u64,
                self.consumer_block_size,
                self.sent.first_position,
                self.sent.first_position + self.sent.values.len() as u64,
                producer_block_size,
            ),
        )
    }
}

/// The producer's fingerprint of a group against the consumer's
/// `(fingerprint, marks)` (SPEC section 7), by what the payload's
/// fingerprint counts: with the marks sent beside it (extension version
/// 3) both must agree, so that a side where a layer is an alias (or
/// shard-keyed state) never compares with one where it is not; a
/// version-2 fingerprint (kvcsum 0.2.0) included the marks; a version-1
/// one had none. A group the extension does not describe (a plain
/// payload) may come from vLLM (no marks) or from kvcsum 0.2.0 without
/// extension (marks included): either matches, and which conventions a
/// plain payload cannot tell apart is SPEC section 10's limit.
fn check_fingerprint(
    group_id: u32,
    sent: u64,
    convention: FingerprintConvention,
    (fingerprint, marks): (u64, u64),
) -> Judged<()> {
    let marked = fingerprint.wrapping_add(marks);
    let fits = match convention {
        FingerprintConvention::Separate { .. } | FingerprintConvention::Unmarked => sent == fingerprint,
        FingerprintConvention::Marked => sent == marked,
        FingerprintConvention::Unknown => sent == fingerprint || sent == marked,
    };
    if !fits {
        let ours = if convention == FingerprintConvention::Marked {
            marked
        } else {
            fingerprint
        };
        let counted = match convention {
            FingerprintConvention::Marked => " (a version-2 extension: marks included)",
            _ => "",
        };
        return Err(Unverified(
            Reason::FingerprintDiffers,
            format!(
                "group {group_id}: the producer's fingerprint is {sent:#018x}, the consumer's {ours:#018x}{counted} (other layers or identities)"
            ),
        ));
    }
    if let FingerprintConvention::Separate { marks: sent_marks } = convention {
        if sent_marks != marks {
            return Err(Unverified(
                Reason::FingerprintDiffers,
                format!(
                    "group {group_id}: the fingerprints agree but their marks differ, the producer's {sent_marks:#018x}, the consumer's {marks:#018x}: a layer is an alias (KV sharing) or shard-keyed state on one side and not on the other, or the group's slots summarise another number of tokens (tokens_per_slot, SPEC section 16), so the sides checksum the same layers differently"
                ),
            ));
        }
    }
    Ok(())
}

/// The producer's values of a group over one token fewer than it
/// computed ([`GroupSides::one_token_fewer`]).
struct OneTokenFewer {
    /// Its values, the one at `position` replaced by the short last value.
    values: Vec<u64>,
    /// The producer's position holding its last token.
    position: u64,
}

/// The consumer's positions holding valid tokens among the `count` it
/// loaded from its first position.
fn consumer_loaded(consumer: Series<'_>, count: usize) -> u128 {
    let start = consumer.first_position as u128;
    let valid_end = (consumer.num_tokens as u128).div_ceil(consumer.block_size as u128);
    valid_end.min(start + count as u128).saturating_sub(start)
}

/// Names the layer head ranges that differ at mismatching runs (detail
/// mode), within a budget of work in proportion to the layer values both
/// sides sent: each run costs a pass over both sides' layers per failed
/// check, and replica checks could multiply that past the input's size.
struct LayerNamer<'a> {
    producer_layers: &'a [LayerPartial],
    consumer_layers: Vec<&'a LayerPartial>,
    producer: Series<'a>,
    consumer: Series<'a>,
    run: u128,
    budget: u64,
}

impl<'a> LayerNamer<'a> {
    fn new(sides: &'a GroupSides<'a>, producer: Series<'a>, consumer: Series<'a>, run: u128) -> LayerNamer<'a> {
        let producer_layers = &sides.extension.expect("localised needs it").layers;
        let consumer_layers: Vec<&LayerPartial> =
            sides.parts.iter().flat_map(|(_, group)| group.layers.iter()).collect();
        let values: u64 = producer_layers
            .iter()
            .map(|l| l.values.len() as u64)
            .chain(consumer_layers.iter().map(|l| l.values.len() as u64))
            .sum();
        LayerNamer {
            producer_layers,
            consumer_layers,
            producer,
            consumer,
            run,
            budget: 16 * values + (1 << 20),
        }
    }

    /// The differing ranges at run `q` per failed check; `None` once the
    /// budget is spent.
    fn name(&mut self, failed_checks: &[u32], q: u128) -> Option<Vec<LayerDifference>> {
        let per_check = (self.producer_layers.len() + self.consumer_layers.len()) as u64 + 1;
        let cost = per_check.saturating_mul(failed_checks.len() as u64 + 1);
        if cost > self.budget {
            self.budget = 0;
            return None;
        }
        self.budget -= cost;
        let producer_layers = producer_ranges(self.producer_layers, self.producer, self.run, q);
        let mut layers = Vec::new();
        for &check in failed_checks {
            let consumer = self.consumer;
            let consumer_layers = consumer_ranges(
                self.consumer_layers.iter().map(|&layer| (layer, consumer)),
                check,
                self.run,
                q,
            );
            layers.extend(differing_ranges(&producer_layers, &consumer_layers, check));
        }
        Some(layers)
    }
}

/// The checks that differ from `expected` at run `q`, ascending; `None`
/// when some check does not hold the whole run.
fn failed_checks(
    consumer: Series<'_>,
    checks: &[(u32, Vec<u64>)],
    expected: u64,
    run: u128,
    q: u128,
) -> Option<Vec<u32>> {
    let mut failed = Vec::new();
    for (check, values) in checks {
        if consumer.with_values(values).run_value(run, q)? != expected {
            failed.push(*check);
        }
    }
    Some(failed)
}

/// The consumer's checks of SPEC section 4, at its positions: check `k` sums,
/// over the distinct replica counts `R`, the total of key `(R, k % R)`.
fn replica_checks(parts: &[(&WorkerPart, &RecordGroup)], num_positions: usize) -> Judged<Vec<(u32, Vec<u64>)>> {
    let mut totals: BTreeMap<ReplicaKey, Vec<u64>> = BTreeMap::new();
    for (_, group) in parts {
        for column in &group.columns {
            let total = totals
                .entry(column.replica)
                .or_insert_with(|| vec![0u64; num_positions]);
            add_into(total, &column.values);
        }
    }
    // Checking this first also bounds the number of checks by the number
    // of columns.
    if let Some((missing, replicas)) = first_missing_key(&totals) {
        return Err(Unverified(
            Reason::ReplicaMissing,
            format!("no worker checksummed replica {missing} of {replicas}"),
        ));
    }
    let checks = check_keys(totals.keys().copied())
        .into_iter()
        .map(|(check, keys)| {
            let mut values = vec![0u64; num_positions];
            for key in keys {
                add_into(&mut values, &totals[&key]);
            }
            (check, values)
        })
        .collect();
    Ok(checks)
}

/// The first key `(R, i)` missing among `keys` where some key has `R`
/// replicas: each count needs keys `(R, 0) .. (R, R-1)`. Looked up per key
/// present, so the work is bounded by them whatever `R` says.
fn first_missing_key<T>(keys: &BTreeMap<ReplicaKey, T>) -> Option<(u32, u32)> {
    let replica_counts: BTreeSet<u32> = keys.keys().map(|k| k.replicas).collect();
    replica_counts.into_iter().find_map(|replicas| {
        let present = keys.range(
            ReplicaKey {
                replicas,
                replica_index: 0,
            }..ReplicaKey {
                replicas,
                replica_index: replicas,
            },
        );
        // Sorted and distinct: complete exactly when the i-th is index i.
        let mut expected = 0u32;
        for (key, _) in present {
            if key.replica_index != expected {
                return Some((expected, replicas));
            }
            expected += 1;
        }
        (expected < replicas).then_some((expected, replicas))
    })
}

/// The replica checks of SPEC section 4 over the keys present: check `k`
/// sums, over the distinct replica counts `R`, key `(R, k % R)`. As many
/// checks as the largest `R`; a caller first makes sure every key of each
/// count is present, which bounds them by the number of keys.
fn check_keys(keys: impl Iterator<Item = ReplicaKey>) -> Vec<(u32, Vec<ReplicaKey>)> {
    let replica_counts: BTreeSet<u32> = keys.map(|k| k.replicas).collect();
    let max_replicas = replica_counts.last().copied().unwrap_or(1);
    (0..max_replicas)
        .map(|check| {
            let keys = replica_counts
                .iter()
                .map(|&replicas| ReplicaKey {
                    replicas,
                    replica_index: check % replicas,
                })
                .collect();
            (check, keys)
        })
        .collect()
}
