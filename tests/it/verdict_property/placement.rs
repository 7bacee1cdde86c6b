//! Group placements (SPEC section 16) as configuration changes: random
//! producer/consumer pairs of one group whose workers place their tokens
//! by `(dcp_size, dcp_rank, interleave, tokens_per_slot)`, with one change
//! of one side:
//!
//! - another DCP size, every rank present (the ranks' sums add up to the
//!   value of one worker holding every unit): MATCH intact;
//! - another interleave (tokens are numbered by their place in the
//!   request, whatever rank holds them): MATCH intact;
//! - a DCP rank's records missing: UNVERIFIED (WORKERS_MISSING);
//! - a worker registered as another DCP rank than its cache holds (two
//!   workers claim one rank, none the other): UNVERIFIED (WORKERS_MISSING);
//! - one worker placing its tokens unlike the others of its side (its
//!   interleave): UNVERIFIED (GEOMETRY_DIFFERS);
//! - another `tokens_per_slot`: UNVERIFIED (FINGERPRINT_DIFFERS: `k`
//!   travels in the marks).
//!
//! Each case runs the base pair (intact: MATCH; one flipped byte a worker
//! reads: MISMATCH) and the changed pair (intact: never MISMATCH; the
//! flipped byte: never MATCH), every outcome against the naive rule above,
//! and every correctly registered worker's values against the naive
//! reference (`support::token_placement::naive_partial`, which walks
//! vLLM's forward DCP map over logical units).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use kvcsum::record::Record;
use kvcsum::verify::{Reason, Verdict, Verifier};
use kvcsum::{BlockSet, GroupPlacement, Role, StreamHandle};

use crate::support::token_placement::*;
use crate::support::Rng;

/// The scheduler's block: 32 units of 4 tokens, 128 of 1.
const BLOCK_SIZE: u32 = 128;
const DCP_SIZES: [u32; 3] = [1, 2, 4];
const TOKENS_PER_SLOT: [u32; 3] = [1, 2, 4];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PlacementKind {
    DcpSize,
    Interleave,
    RankMissing,
    RankClaimed,
    Unlike,
    TokensPerSlot,
}

pub const PLACEMENT_KINDS: [PlacementKind; 6] = [
    PlacementKind::DcpSize,
    PlacementKind::Interleave,
    PlacementKind::RankMissing,
    PlacementKind::RankClaimed,
    PlacementKind::Unlike,
    PlacementKind::TokensPerSlot,
];

impl PlacementKind {
    pub fn name(self) -> &'static str {
        match self {
            PlacementKind::DcpSize => "DCP size, every rank present",
            PlacementKind::Interleave => "interleave",
            PlacementKind::RankMissing => "a DCP rank's records missing",
            PlacementKind::RankClaimed => "a worker claims another DCP rank",
            PlacementKind::Unlike => "one worker's interleave unlike",
            PlacementKind::TokensPerSlot => "tokens_per_slot",
        }
    }

    /// The naive rule: the outcome of the changed pair (None: as the base
    /// pair's, MATCH intact and MISMATCH corrupted).
    fn unverified_reason(self) -> Option<Reason> {
        match self {
            PlacementKind::DcpSize | PlacementKind::Interleave => None,
            PlacementKind::RankMissing | PlacementKind::RankClaimed => Some(Reason::WorkersMissing),
            PlacementKind::Unlike => Some(Reason::GeometryDiffers),
            PlacementKind::TokensPerSlot => Some(Reason::FingerprintDiffers),
        }
    }
}

/// One side: its placement (dcp_rank unused) and its misconfigurations.
#[derive(Clone, Copy, Debug)]
pub struct PlacedSide {
    pub placement: GroupPlacement,
    /// A DCP rank whose worker's record never arrives.
    pub missing_rank: Option<u32>,
    /// (worker, the DCP rank it is registered as) where it differs.
    pub claimed: Option<(u32, u32)>,
    /// (worker, its interleave) where it differs from the side's.
    pub unlike: Option<(u32, u32)>,
}

impl PlacedSide {
    fn plain(placement: GroupPlacement) -> PlacedSide {
        PlacedSide {
            placement,
            missing_rank: None,
            claimed: None,
            unlike: None,
        }
    }

    /// The placement worker `rank` registers.
    fn worker_placement(&self, rank: u32) -> GroupPlacement {
        let mut p = GroupPlacement {
            dcp_rank: rank,
            ..self.placement
        };
        if let Some((worker, claimed)) = self.claimed {
            if worker == rank {
                p.dcp_rank = claimed;
            }
        }
        if let Some((worker, interleave)) = self.unlike {
            if worker == rank {
                p.interleave = interleave;
            }
        }
        p
    }

    fn describe(&self) -> String {
        let p = self.placement;
        let mut out = format!("DCP {} I {} k {}", p.dcp_size, p.interleave, p.tokens_per_slot);
        if let Some(rank) = self.missing_rank {
            let _ = write!(out, ", rank {rank}'s records missing");
        }
        if let Some((worker, rank)) = self.claimed {
            let _ = write!(out, ", worker {worker} registered as rank {rank}");
        }
        if let Some((worker, interleave)) = self.unlike {
            let _ = write!(out, ", worker {worker} with interleave {interleave}");
        }
        out
    }
}

#[derive(Clone, Debug)]
pub struct PlacementCase {
    pub num_tokens: u64,
    pub positions: usize,
    pub base: [PlacedSide; 2],
    pub changed: [PlacedSide; 2],
    pub kind: PlacementKind,
    /// The side changed: 0 the producer, 1 the consumer.
    pub side: usize,
    pub change: String,
}

fn random_placement(rng: &mut Rng, tokens_per_slot: u32) -> GroupPlacement {
    let dcp_size = *rng.pick(&DCP_SIZES);
    GroupPlacement {
        dcp_size,
        dcp_rank: 0,
        interleave: if dcp_size > 1 { *rng.pick(&[1u32, 2]) } else { 1 },
        tokens_per_slot,
    }
}

fn other<T: Copy + PartialEq>(rng: &mut Rng, choices: &[T], not: T) -> T {
    let others: Vec<T> = choices.iter().copied().filter(|&c| c != not).collect();
    *rng.pick(&others)
}

impl PlacementCase {
    pub fn random(rng: &mut Rng) -> PlacementCase {
        let k = *rng.pick(&TOKENS_PER_SLOT);
        // At least 8 units of 4 tokens: every rank of DCP 4 holds a valid one.
        let num_tokens = rng.range(32..3 * BLOCK_SIZE as u64 + 1);
        let positions = num_tokens.div_ceil(BLOCK_SIZE as u64) as usize;
        let base = [
            PlacedSide::plain(random_placement(rng, k)),
            PlacedSide::plain(random_placement(rng, k)),
        ];
        let kind = *rng.pick(&PLACEMENT_KINDS);
        let s = rng.below(2) as usize;
        let mut changed = base;
        let side = &mut changed[s];
        let sharded = |side: &mut PlacedSide, rng: &mut Rng| {
            // A change among DCP ranks needs some (a DCP size change too,
            // one that alone keeps MATCH).
            if side.placement.dcp_size == 1 {
                side.placement.dcp_size = *rng.pick(&[2u32, 4]);
                side.placement.interleave = *rng.pick(&[1u32, 2]);
            }
        };
        let change = match kind {
            PlacementKind::DcpSize => {
                let to = other(rng, &DCP_SIZES, side.placement.dcp_size);
                side.placement.dcp_size = to;
                side.placement.interleave = if to > 1 { *rng.pick(&[1u32, 2]) } else { 1 };
                format!("DCP size {to}, interleave {}", side.placement.interleave)
            }
            PlacementKind::Interleave => {
                sharded(side, rng);
                side.placement.interleave = 3 - side.placement.interleave;
                format!(
                    "DCP {} interleave {}",
                    side.placement.dcp_size, side.placement.interleave
                )
            }
            PlacementKind::RankMissing => {
                sharded(side, rng);
                let rank = rng.below(side.placement.dcp_size as u64) as u32;
                side.missing_rank = Some(rank);
                format!("DCP {}, rank {rank}'s records missing", side.placement.dcp_size)
            }
            PlacementKind::RankClaimed => {
                sharded(side, rng);
                let d = side.placement.dcp_size;
                let worker = rng.below(d as u64) as u32;
                let claimed = other(rng, &(0..d).collect::<Vec<_>>(), worker);
                side.claimed = Some((worker, claimed));
                format!("DCP {d}, worker {worker} registered as rank {claimed}")
            }
            PlacementKind::Unlike => {
                sharded(side, rng);
                let worker = rng.below(side.placement.dcp_size as u64) as u32;
                let interleave = 3 - side.placement.interleave;
                side.unlike = Some((worker, interleave));
                format!(
                    "DCP {}, worker {worker} with interleave {interleave}, the others {}",
                    side.placement.dcp_size, side.placement.interleave
                )
            }
            PlacementKind::TokensPerSlot => {
                let to = other(rng, &TOKENS_PER_SLOT, k);
                side.placement.tokens_per_slot = to;
                format!("tokens_per_slot {k} -> {to}")
            }
        };
        PlacementCase {
            num_tokens,
            positions,
            base,
            changed,
            kind,
            side: s,
            change: format!("{} on the {}: {change}", kind.name(), ["producer", "consumer"][s]),
        }
    }

    pub fn summary(&self) -> String {
        format!(
            "{} tokens over {} blocks of {BLOCK_SIZE}; base producer {}, consumer {}; changed producer {}, consumer {}",
            self.num_tokens,
            self.positions,
            self.base[0].describe(),
            self.base[1].describe(),
            self.changed[0].describe(),
            self.changed[1].describe()
        )
    }
}

/// One side deployed: its workers' caches (by DCP rank) and records.
struct SideRun {
    caches: Vec<RankCache>,
}

/// What a judged pair gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlacedOutcome {
    Report {
        verdict: Verdict,
        reason: Option<Reason>,
        message: String,
    },
    /// A call refused (the producer's payload could not be built, for
    /// the reason a consumer's verifier gives UNVERIFIED): never a verdict
    /// on the KV.
    Refused(String),
}

impl PlacedOutcome {
    fn label(&self) -> String {
        match self {
            PlacedOutcome::Report { verdict, reason, .. } => match reason {
                Some(reason) => format!("{verdict:?} {reason:?}"),
                None => format!("{verdict:?}"),
            },
            PlacedOutcome::Refused(_) => "refused".to_string(),
        }
    }

    fn verdict(&self) -> Option<Verdict> {
        match self {
            PlacedOutcome::Report { verdict, .. } => Some(*verdict),
            PlacedOutcome::Refused(_) => None,
        }
    }
}

fn block_set(num_tokens: u64, ids: &[u32]) -> BlockSet {
    let mut blocks = BlockSet::new();
    blocks.add_request(REQ, num_tokens).unwrap();
    blocks.add_group(REQ, GROUP, 0, ids).unwrap();
    blocks
}

/// The records of a side's workers (`caches[r]` is DCP rank `r`'s), each
/// worker's values checked against the naive reference where it is
/// registered as the rank its cache holds and its data is intact.
#[allow(clippy::too_many_arguments)] // a side of a case: each argument a piece of it
fn records(
    side: &PlacedSide,
    run: &SideRun,
    units: &Units,
    set: &BlockSet,
    role: Role,
    num_tokens: u64,
    positions: usize,
    check_naive: bool,
    naive_errors: &mut Vec<String>,
) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (rank, cache) in run.caches.iter().enumerate() {
        let rank = rank as u32;
        if side.missing_rank == Some(rank) {
            continue;
        }
        let p = side.worker_placement(rank);
        // The worker of TP rank `rank` (vLLM's DCP ranks are TP ranks),
        // registered with its placement (its dcp_rank as claimed).
        let mut worker = crate::support::host_worker(rank, side.placement.dcp_size, 0, 1);
        register_rank(
            &mut worker,
            cache.words.as_ptr() as u64,
            cache,
            p,
            BLOCK_SIZE,
            p.dcp_rank,
        );
        let result = worker.checksum(set, role, StreamHandle::legacy_default()).unwrap();
        result.wait().unwrap();
        let (_, column) = result.column(REQ, GROUP, 0).unwrap();
        if check_naive && side.claimed.is_none_or(|(w, _)| w != rank) && side.unlike.is_none_or(|(w, _)| w != rank) {
            let naive: Vec<u64> = (0..positions as u64)
                .map(|q| naive_partial(units, p, BLOCK_SIZE, num_tokens, q, Some(rank)))
                .collect();
            if column != naive.as_slice() {
                naive_errors.push(format!(
                    "rank {rank} of {}: values {column:?}, the naive reference {naive:?}",
                    side.describe()
                ));
            }
        }
        out.push(Record::from_checksums(&result).unwrap().encode());
    }
    out
}

fn judge(
    pair: &[PlacedSide; 2],
    runs: &[SideRun; 2],
    units: &[Units; 3],
    case: &PlacementCase,
    check_naive: bool,
    naive_errors: &mut Vec<String>,
) -> PlacedOutcome {
    let set = block_set(case.num_tokens, &ids(case.positions));
    let (n, q) = (case.num_tokens, case.positions);
    let producer = Verifier::new(pair[0].placement.dcp_size).unwrap();
    producer.expect(&set, Role::Producer).unwrap();
    let (producer_units, consumer_units) = (units_for(units, pair[0].placement), units_for(units, pair[1].placement));
    for record in records(
        &pair[0],
        &runs[0],
        producer_units,
        &set,
        Role::Producer,
        n,
        q,
        check_naive,
        naive_errors,
    ) {
        producer.add_record(&record).unwrap();
    }
    let payload = match producer.payload(REQ) {
        Ok(payload) => payload.encode(),
        Err(error) => return PlacedOutcome::Refused(format!("the producer's payload: {error}")),
    };
    let consumer = Verifier::new(pair[1].placement.dcp_size).unwrap();
    consumer.expect(&set, Role::Consumer).unwrap();
    for record in records(
        &pair[1],
        &runs[1],
        consumer_units,
        &set,
        Role::Consumer,
        n,
        q,
        check_naive,
        naive_errors,
    ) {
        consumer.add_record(&record).unwrap();
    }
    match consumer.check(REQ, Some(&payload)) {
        Ok(report) => PlacedOutcome::Report {
            verdict: report.verdict,
            reason: report.reason(),
            message: report.message.clone(),
        },
        Err(error) => PlacedOutcome::Refused(format!("the consumer's check: {error}")),
    }
}

/// The request's blocks (the same ids on both sides: other caches).
fn ids(positions: usize) -> Vec<u32> {
    (0..positions as u32).map(|q| (q * 3 + 1) % NUM_BLOCKS).collect()
}

/// Flips one byte a worker of side `side` reads: a slot holding a valid
/// unit, on a rank whose records arrive, of a correctly registered worker.
fn corrupt(
    rng: &mut Rng,
    pair: &[PlacedSide; 2],
    runs: &mut [SideRun; 2],
    case: &PlacementCase,
    side: usize,
) -> String {
    let s = &pair[side];
    let p = s.placement;
    let per_block = (BLOCK_SIZE / p.tokens_per_slot) as u64;
    let valid = case.num_tokens / p.tokens_per_slot as u64;
    let candidates: Vec<u64> = (0..valid)
        .filter(|&u| {
            let (rank, _) = forward(u % per_block, p.dcp_size, p.interleave);
            s.missing_rank != Some(rank)
                && s.claimed.is_none_or(|(w, _)| w != rank)
                && s.unlike.is_none_or(|(w, _)| w != rank)
        })
        .collect();
    let unit = *rng.pick(&candidates);
    let (q, o) = (unit / per_block, unit % per_block);
    let (rank, slot) = forward(o, p.dcp_size, p.interleave);
    let block = ids(case.positions)[q as usize];
    let (layer, head, piece) = (
        rng.below(LAYERS as u64) as u32,
        rng.below(HEADS as u64) as u32,
        rng.below(PIECES as u64) as u32,
    );
    let cache = &mut runs[side].caches[rank as usize];
    let at = cache.index(block, slot, layer, head, piece);
    cache.words[at] ^= 1 << (8 * rng.below(8) + rng.below(8));
    format!(
        "{}'s rank {rank}: unit {unit} (block {q}, slot {slot}), layer {layer} head {head} piece {piece}",
        ["producer", "consumer"][side]
    )
}

pub struct PlacementResult {
    pub case: PlacementCase,
    pub seed: u64,
    pub index: u64,
    pub base_intact: PlacedOutcome,
    pub base_corrupted: PlacedOutcome,
    pub changed_intact: PlacedOutcome,
    pub changed_corrupted: PlacedOutcome,
    pub corrupted_at: [String; 2],
    pub naive_errors: Vec<String>,
}

fn deploy(rng: &mut Rng, units: &[Units; 3], pair: &[PlacedSide; 2], case: &PlacementCase) -> [SideRun; 2] {
    pair.map(|side| SideRun {
        caches: rank_caches(
            rng,
            units_for(units, side.placement),
            side.placement,
            BLOCK_SIZE,
            &ids(case.positions),
        ),
    })
}

/// The logical units of a side: per tokens_per_slot, the request's.
fn units_for(units: &[Units; 3], p: GroupPlacement) -> &Units {
    &units[TOKENS_PER_SLOT.iter().position(|&k| k == p.tokens_per_slot).unwrap()]
}

pub fn run_placement_case(seed: u64, index: u64) -> PlacementResult {
    let mut rng = Rng::from_seed_and_name(seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15), "placement property");
    let case = PlacementCase::random(&mut rng);
    // One request's logical KV as each tokens_per_slot summarises it
    // (units past the request's last are junk in the caches).
    let units = TOKENS_PER_SLOT.map(|k| Units::random(&mut rng, case.num_tokens / k as u64 + 1));
    let mut naive_errors = Vec::new();
    let mut arm = |rng: &mut Rng, pair: &[PlacedSide; 2], flip: Option<usize>| {
        let mut runs = deploy(rng, &units, pair, &case);
        let at = flip
            .map(|side| corrupt(rng, pair, &mut runs, &case, side))
            .unwrap_or_default();
        (judge(pair, &runs, &units, &case, flip.is_none(), &mut naive_errors), at)
    };
    let flip_side = rng.below(2) as usize;
    let (base_intact, _) = arm(&mut rng, &case.base, None);
    let (base_corrupted, at_base) = arm(&mut rng, &case.base, Some(flip_side));
    let (changed_intact, _) = arm(&mut rng, &case.changed, None);
    let (changed_corrupted, at_changed) = arm(&mut rng, &case.changed, Some(flip_side));
    PlacementResult {
        case,
        seed,
        index,
        base_intact,
        base_corrupted,
        changed_intact,
        changed_corrupted,
        corrupted_at: [at_base, at_changed],
        naive_errors,
    }
}

impl PlacementResult {
    /// (rule, details) of each violation.
    pub fn violations(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        let details = |what: &str, outcome: &PlacedOutcome| {
            format!(
                "case {} (KVCS_TEST_SEED={} KVCS_PROPERTY_CASE={}): {}: {what} gave {} ({}); {}",
                self.index,
                self.seed,
                self.index,
                self.case.change,
                outcome.label(),
                match outcome {
                    PlacedOutcome::Report { message, .. } => message.as_str(),
                    PlacedOutcome::Refused(why) => why.as_str(),
                },
                self.case.summary()
            )
        };
        if self.base_intact.verdict() != Some(Verdict::Match) {
            out.push((
                "base pair intact not MATCH",
                details("the base pair, intact", &self.base_intact),
            ));
        }
        if self.base_corrupted.verdict() != Some(Verdict::Mismatch) {
            out.push((
                "base pair corrupted not MISMATCH",
                details(
                    &format!("the base pair, flipped at {}", self.corrupted_at[0]),
                    &self.base_corrupted,
                ),
            ));
        }
        if self.changed_intact.verdict() == Some(Verdict::Mismatch) {
            out.push((
                "intact MISMATCH under a configuration change",
                details("the changed pair, intact", &self.changed_intact),
            ));
        }
        let flipped = format!("the changed pair, flipped at {}", self.corrupted_at[1]);
        if self.changed_corrupted.verdict() == Some(Verdict::Match) {
            out.push(("corrupted MATCH", details(&flipped, &self.changed_corrupted)));
        }
        // The naive rule: a producer's verifier refuses to build the
        // payload for a reason within its side that a consumer's gives
        // UNVERIFIED; a difference between the sides (tokens_per_slot) is
        // the consumer's UNVERIFIED whichever side changed.
        let producer = self.case.side == 0 && self.case.kind != PlacementKind::TokensPerSlot;
        let expect = |outcome: &PlacedOutcome, intact: bool| match (self.case.kind.unverified_reason(), outcome) {
            (None, _) => outcome.verdict() == Some(if intact { Verdict::Match } else { Verdict::Mismatch }),
            (Some(reason), PlacedOutcome::Refused(why)) => producer && why.contains(reason.describe()),
            (
                Some(reason),
                PlacedOutcome::Report {
                    verdict, reason: got, ..
                },
            ) => !producer && *verdict == Verdict::Unverified && *got == Some(reason),
        };
        if !expect(&self.changed_intact, true) {
            out.push((
                "differs from the naive rule",
                details("the changed pair, intact", &self.changed_intact),
            ));
        }
        if !expect(&self.changed_corrupted, false) {
            out.push((
                "differs from the naive rule",
                details(&flipped, &self.changed_corrupted),
            ));
        }
        for error in &self.naive_errors {
            out.push((
                "a worker's values differ from the naive reference",
                format!(
                    "case {} (seed {}): {}: {error}",
                    self.index, self.seed, self.case.change
                ),
            ));
        }
        out
    }
}

/// Outcomes per change kind.
#[derive(Default)]
pub struct PlacementTally {
    pub cases: u64,
    outcomes: BTreeMap<(&'static str, &'static str, String), u64>,
}

impl PlacementTally {
    pub fn add(&mut self, result: &PlacementResult) {
        self.cases += 1;
        let name = result.case.kind.name();
        for (arm, outcome) in [
            ("base intact", &result.base_intact),
            ("base flipped", &result.base_corrupted),
            ("changed intact", &result.changed_intact),
            ("changed flipped", &result.changed_corrupted),
        ] {
            *self.outcomes.entry((name, arm, outcome.label())).or_default() += 1;
        }
    }

    pub fn table(&self, seed: u64) -> String {
        let mut out = format!("[placement property] seed {seed}: {} cases\n", self.cases);
        for ((kind, arm, label), count) in &self.outcomes {
            let _ = writeln!(out, "  {count:>6}  {kind:<34} {arm:<16} {label}");
        }
        out
    }
}
