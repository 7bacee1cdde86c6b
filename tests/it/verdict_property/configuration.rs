//! Configuration changes the verdict rule must hold under without help
//! from the caller, on the Rust API over host workers:
//!
//! - **geometry**: two sides with no identity of their own (layer
//!   identities that do not name the head size or element type), random TP
//!   sizes, layouts and block sizes, and caches of the same or another
//!   cell size (head size, element width). Intact KV is never MISMATCH (a
//!   geometry difference is UNVERIFIED `GeometryDiffers`); a corrupted
//!   byte the consumer reads is never MATCH.
//! - **uncompared**: the same KV loaded with random token counts and block
//!   sizes. By default a load with positions nobody compared is never
//!   MATCH (UNVERIFIED `UncomparedPositions`, unless nothing was compared);
//!   opted out (`set_require_coverage(false)`) intact KV matches; the
//!   report counts exactly the naive rule's uncompared positions.
//! - **entries**: entries a connector keeps (`result_entries`,
//!   `check_result_entries`) against a store and a load check of the same
//!   blocks, under random decodings (none, equal, one-sided, different),
//!   cache geometry and, for state groups, `split_known` (marks). The kept
//!   entries are the stored bytes, both paths give the same outcomes, an
//!   entry of another configuration is `OtherFingerprint` (never matched,
//!   never failed), one of the same configuration matches, and a corrupted
//!   position of the same configuration fails.

use std::collections::BTreeMap;

use kvcsum::verify::{Reason, Report, Verdict, Verifier};
use kvcsum::{BlockSet, LayerDecoding, Role, StoredOutcome, StreamHandle};

use crate::support::state::*;
use crate::support::*;

const REQ: &str = "configuration";

/// What a case checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Family {
    Geometry,
    Uncompared,
    Entries,
    StateEntries,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Geometry => "geometry, no identity",
            Family::Uncompared => "uncompared positions",
            Family::Entries => "kept entries vs store (decodings, geometry)",
            Family::StateEntries => "kept entries vs store (state marks)",
        }
    }
}

/// One case's outcome: its family, whether its configuration differed,
/// whether KV was corrupted, the outcome in words, and the rule broken.
pub struct ConfigResult {
    pub family: Family,
    pub changed: bool,
    pub corrupted: bool,
    pub outcome: String,
    pub violation: Option<String>,
}

fn label(report: &Report) -> String {
    match report.verdict {
        Verdict::Match => "MATCH".to_owned(),
        Verdict::Mismatch => "MISMATCH".to_owned(),
        Verdict::Unverified => format!("UNVERIFIED {:?}", report.reason().expect("a reason")),
    }
}

/// A side of one group over `kv`.
struct Side {
    ranks: Vec<HostRank>,
    blocks: BlockSet,
}

fn side(rng: &mut Rng, kv: &LogicalKv, tp_size: u32, kind: LayoutKind, block_size: u32, num_tokens: u64) -> Side {
    let count = positions_for(num_tokens, block_size, 0, 0);
    let table = GroupTable {
        group_id: 0,
        first_position: 0,
        block_ids: BlockAllocator::new(rng, count as u32 + 2).take(count),
    };
    side_at(rng, kv, tp_size, kind, block_size, num_tokens, table)
}

/// [`side`] over the block table `table`.
fn side_at(
    rng: &mut Rng,
    kv: &LogicalKv,
    tp_size: u32,
    kind: LayoutKind,
    block_size: u32,
    num_tokens: u64,
    table: GroupTable,
) -> Side {
    let count = table.block_ids.len();
    let deploy = Deploy {
        tp_size,
        pp_size: 1,
        kind,
        group_id: 0,
        block_size,
        num_blocks: count as u32 + 2,
        num_threads: 1,
    };
    let ranks = deploy_host(rng, deploy, &[(kv, &table)]);
    let blocks = block_set(&[TestRequest {
        req_id: REQ.to_owned(),
        num_tokens,
        tables: vec![table],
    }]);
    Side { ranks, blocks }
}

impl Side {
    fn verifier(&self, role: Role) -> Verifier {
        let verifier = Verifier::new(self.ranks.len() as u32).unwrap();
        verifier.expect(&self.blocks, role).unwrap();
        for rank in &self.ranks {
            let record = kvcsum::record::Record::from_checksums(&checksum(&rank.worker, &self.blocks, role)).unwrap();
            verifier.add_record(&record.encode()).unwrap();
        }
        verifier
    }

    fn payload(&self) -> Vec<u8> {
        self.verifier(Role::Producer).payload(REQ).unwrap().encode()
    }

    fn check(&self, payload: &[u8], opted_out: bool) -> Report {
        let verifier = self.verifier(Role::Consumer);
        if opted_out {
            verifier.set_require_coverage(false).unwrap();
        }
        verifier.check(REQ, Some(payload)).unwrap()
    }

    /// Flips a bit of a random valid token's cell on a random rank; the
    /// position it lies in.
    fn corrupt(&mut self, rng: &mut Rng, num_tokens: u64, block_size: u32) -> u64 {
        let token = rng.below(num_tokens);
        let position = token / block_size as u64;
        let block_id = self.blocks.requests()[0].groups[0].block_ids[position as usize];
        let which = rng.below(self.ranks.len() as u64) as usize;
        let rank = &mut self.ranks[which];
        let layer = *rng.pick(&rank.shard.layer_numbers);
        let head = rank.shard.first_head + rng.below(rank.shard.num_heads as u64) as u32;
        let cell = {
            let spec = rank.placements[0].spec();
            spec.k_bytes + spec.v_bytes
        };
        let placement = &mut rank.placements[0];
        placement.xor_byte(
            layer,
            head,
            block_id,
            (token % block_size as u64) as u32,
            rng.below(cell as u64) as u32,
            1 << rng.below(8),
        );
        position
    }
}

fn tp_for(rng: &mut Rng, heads: u32) -> u32 {
    let sizes: Vec<u32> = [1u32, 2, 4].into_iter().filter(|t| heads.is_multiple_of(*t)).collect();
    *rng.pick(&sizes)
}

const KINDS: [LayoutKind; 5] = [
    LayoutKind::Hnd,
    LayoutKind::Nhd,
    LayoutKind::KvSplit,
    LayoutKind::HndKvSplit,
    LayoutKind::Padded,
];

fn geometry_case(rng: &mut Rng) -> ConfigResult {
    let (layers, heads) = (1 + rng.below(3) as u32, *rng.pick(&[1u32, 2, 4]));
    let p_bytes = *rng.pick(&[32u32, 64, 128, 256]);
    let changed = rng.chance(2, 3);
    let c_bytes = if changed {
        *rng.pick(
            &[32u32, 64, 128, 256]
                .into_iter()
                .filter(|&b| b != p_bytes)
                .collect::<Vec<_>>(),
        )
    } else {
        p_bytes
    };
    let num_tokens = 1 + rng.below(90);
    let (p_block, c_block) = (*rng.pick(&[4u32, 8, 16, 32]), *rng.pick(&[4u32, 8, 16, 32]));
    let p_kv = LogicalKv::random(rng, KvShape::gqa(layers, heads, p_bytes, num_tokens));
    let c_kv = if changed {
        LogicalKv::random(rng, KvShape::gqa(layers, heads, c_bytes, num_tokens))
    } else {
        p_kv.clone()
    };
    let (p_tp, c_tp) = (tp_for(rng, heads), tp_for(rng, heads));
    let (p_kind, c_kind) = (*rng.pick(&KINDS), *rng.pick(&KINDS));
    let producer = side(rng, &p_kv, p_tp, p_kind, p_block, num_tokens);
    let mut consumer = side(rng, &c_kv, c_tp, c_kind, c_block, num_tokens);
    let corrupted = rng.chance(1, 2);
    if corrupted {
        consumer.corrupt(rng, num_tokens, c_block);
    }
    let report = consumer.check(&producer.payload(), false);
    let context = format!(
        "{layers} layers x {heads} heads, K bytes {p_bytes} -> {c_bytes}, TP {p_tp} {p_kind:?} -> TP {c_tp} {c_kind:?}, blocks {p_block} -> {c_block}, {num_tokens} tokens: {}",
        report.message
    );
    let violation = if !corrupted && report.verdict == Verdict::Mismatch {
        Some(format!("intact KV is MISMATCH: {context}"))
    } else if corrupted && report.verdict == Verdict::Match {
        Some(format!("a corrupted byte is MATCH: {context}"))
    } else if changed && !(report.verdict == Verdict::Unverified && report.reason() == Some(Reason::GeometryDiffers)) {
        Some(format!("another geometry is not GeometryDiffers: {context}"))
    } else {
        None
    };
    ConfigResult {
        family: Family::Geometry,
        changed,
        corrupted,
        outcome: label(&report),
        violation,
    }
}

/// SPEC section 10's run rule where both sides hold every block holding
/// valid tokens (and a load of one token fewer compared whole against the
/// short last value): (compared runs, uncompared consumer positions).
fn naive_uncompared(b_p: u32, n_p: u64, b_c: u32, n_c: u64) -> (u64, u64) {
    let n_p = if n_c + 1 == n_p { n_c } else { n_p };
    let (mut gcd, mut rest) = (b_p as u64, b_c as u64);
    while rest != 0 {
        (gcd, rest) = (rest, gcd % rest);
    }
    let run = b_p as u64 / gcd * b_c as u64;
    let run_valid = |n: u64, q: u64| n.saturating_sub(q * run).min(run);
    let (mut compared, mut uncompared) = (std::collections::BTreeSet::new(), 0);
    for position in 0..n_c.div_ceil(b_c as u64) {
        let q = position * b_c as u64 / run;
        if run_valid(n_c, q) != 0 && run_valid(n_c, q) == run_valid(n_p, q) {
            compared.insert(q);
        } else {
            uncompared += 1;
        }
    }
    (compared.len() as u64, uncompared)
}

fn uncompared_case(rng: &mut Rng) -> ConfigResult {
    let n_p = 2 + rng.below(100);
    let n_c = match rng.below(4) {
        0 => n_p,
        1 => n_p - 1,
        2 => n_p.saturating_sub(1 + rng.below(20)).max(1),
        _ => n_p + 1 + rng.below(10),
    };
    let (b_p, b_c) = (
        *rng.pick(&[1u32, 4, 8, 12, 16, 32]),
        *rng.pick(&[1u32, 4, 8, 12, 16, 32]),
    );
    let kv = LogicalKv::random(rng, KvShape::gqa(2, 2, 16, n_p.max(n_c)));
    let tp = tp_for(rng, 2);
    // Each side's blocks hold its own tokens of the same KV.
    let (p_kind, c_kind, c_tp) = (*rng.pick(&KINDS), *rng.pick(&KINDS), tp_for(rng, 2));
    let producer = side(rng, &kv, tp, p_kind, b_p, n_p);
    let mut consumer = side(rng, &kv, c_tp, c_kind, b_c, n_c);
    let (compared, uncompared) = naive_uncompared(b_p, n_p, b_c, n_c);
    let corrupted = rng.chance(1, 3);
    if corrupted {
        consumer.corrupt(rng, n_c, b_c);
    }
    let payload = producer.payload();
    let default = consumer.check(&payload, false);
    let opted_out = consumer.check(&payload, true);
    let context = format!(
        "blocks {b_p} -> {b_c}, tokens {n_p} -> {n_c} (naive: {compared} runs compared, {uncompared} positions not): default {}; opted out {}",
        default.message, opted_out.message
    );
    let violation = if default.uncompared_positions != uncompared && compared > 0 {
        Some(format!(
            "the report counts {} uncompared positions: {context}",
            default.uncompared_positions
        ))
    } else if uncompared > 0 && default.verdict == Verdict::Match {
        Some(format!("uncompared positions are MATCH by default: {context}"))
    } else if uncompared > 0
        && compared > 0
        && default.verdict == Verdict::Unverified
        && default.reason() != Some(Reason::UncomparedPositions)
    {
        Some(format!("uncompared positions are not UncomparedPositions: {context}"))
    } else if corrupted && default.verdict == Verdict::Match {
        Some(format!("a corrupted byte is MATCH by default: {context}"))
    } else if !corrupted && (default.verdict == Verdict::Mismatch || opted_out.verdict == Verdict::Mismatch) {
        Some(format!("intact KV is MISMATCH: {context}"))
    } else if !corrupted && compared > 0 && opted_out.verdict != Verdict::Match {
        Some(format!("intact KV opted out is not MATCH: {context}"))
    } else {
        None
    };
    ConfigResult {
        family: Family::Uncompared,
        changed: uncompared > 0,
        corrupted,
        outcome: format!("{} / opted out {}", label(&default), label(&opted_out)),
        violation,
    }
}

/// A side of `side` with a buffer of stored checksums and block hashes.
struct Tier {
    side: Side,
    stored: Vec<[u64; 2]>,
}

fn tier(
    rng: &mut Rng,
    kv: &LogicalKv,
    kind: LayoutKind,
    block_size: u32,
    num_tokens: u64,
    table: &GroupTable,
    hashes: &[u8],
) -> Tier {
    let mut side = side_at(rng, kv, 1, kind, block_size, num_tokens, table.clone());
    let num_blocks = side.blocks.requests()[0].groups[0].block_ids.len() as u64 + 2;
    let stored: Vec<[u64; 2]> = (0..num_blocks).map(|_| [rng.next_u64(), rng.next_u64()]).collect();
    let worker = &mut side.ranks[0].worker;
    worker
        .add_region(kvcsum::Region {
            address: stored.as_ptr() as u64,
            length: std::mem::size_of_val(stored.as_slice()) as u64,
        })
        .unwrap();
    worker.add_stored(0, stored.as_ptr() as u64, num_blocks).unwrap();
    side.blocks.set_hashes(REQ, 0, hashes, 32).unwrap();
    Tier { side, stored }
}

/// A random declaration of layer 0, or none.
fn random_decoding(rng: &mut Rng) -> Option<LayerDecoding> {
    let dtype = *rng.pick(&["", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"]);
    let head_size = *rng.pick(&[0u32, 64, 128]);
    let k_scale = *rng.pick(&[0.0f64, 0.5, 1.0]);
    let bits = if k_scale > 0.0 { k_scale.to_bits() } else { 0 };
    LayerDecoding::from_parts(dtype, head_size, bits, 0).ok()
}

/// Per position: the kept entries' outcomes, the buffer's, whether the
/// kept entries were the stored bytes.
fn entry_paths(
    storer: &Tier,
    checker: &mut Tier,
    group_id: u32,
    blocks: &BlockSet,
) -> (Vec<StoredOutcome>, Vec<StoredOutcome>, bool) {
    let storing = &storer.side.ranks[0].worker;
    let kept = kvcsum::result_entries(&checksum(storing, blocks, Role::Consumer), REQ, group_id).unwrap();
    storing.store(blocks, StreamHandle::legacy_default()).unwrap();
    let ids = &blocks.requests()[0].groups[0].block_ids;
    let written: Vec<(u64, u64)> = ids
        .iter()
        .map(|&id| (storer.stored[id as usize][0], storer.stored[id as usize][1]))
        .collect();
    checker.stored.copy_from_slice(&storer.stored);
    let checking = &checker.side.ranks[0].worker;
    let by_kept =
        kvcsum::check_result_entries(&checksum(checking, blocks, Role::Consumer), REQ, group_id, &kept).unwrap();
    let by_buffer = checking
        .check_stored(blocks, StreamHandle::legacy_default())
        .unwrap()
        .stored_outcomes(REQ, group_id)
        .unwrap();
    (by_kept, by_buffer, kept == written)
}

fn judge_entries(
    family: Family,
    changed: bool,
    corrupted: Option<u64>,
    (by_kept, by_buffer, same_bytes): (Vec<StoredOutcome>, Vec<StoredOutcome>, bool),
    context: String,
) -> ConfigResult {
    let expected = |position: usize| match (changed, corrupted) {
        (true, _) => StoredOutcome::OtherFingerprint,
        (false, Some(bad)) if bad == position as u64 => StoredOutcome::Failed,
        _ => StoredOutcome::Matched,
    };
    let wanted: Vec<StoredOutcome> = (0..by_kept.len()).map(expected).collect();
    let violation = if !same_bytes {
        Some(format!("entries() is not what the store wrote: {context}"))
    } else if by_kept != by_buffer {
        Some(format!("kept {by_kept:?} but stored {by_buffer:?}: {context}"))
    } else if by_kept != wanted {
        Some(format!("outcomes {by_kept:?}, expected {wanted:?}: {context}"))
    } else {
        None
    };
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for outcome in &by_kept {
        *counts.entry(format!("{outcome:?}")).or_default() += 1;
    }
    ConfigResult {
        family,
        changed,
        corrupted: corrupted.is_some(),
        outcome: counts.keys().cloned().collect::<Vec<_>>().join("+"),
        violation,
    }
}

fn entries_case(rng: &mut Rng) -> ConfigResult {
    let num_tokens = 1 + rng.below(70);
    let block_size = *rng.pick(&[4u32, 8, 16]);
    let k_bytes = *rng.pick(&[32u32, 64]);
    let kv = LogicalKv::random(rng, KvShape::gqa(2, 2, k_bytes, num_tokens));
    let count = positions_for(num_tokens, block_size, 0, 0);
    let hashes: Vec<u8> = (0..count * 32).map(|_| rng.next_u64() as u8).collect();
    let (stored_under, checked_under) = (random_decoding(rng), random_decoding(rng));
    let (stored_under, checked_under) = if rng.chance(1, 3) {
        (stored_under.clone(), stored_under)
    } else {
        (stored_under, checked_under)
    };
    // Another cell size on the checking side, now and then (its own KV).
    let reshaped = rng.chance(1, 5);
    let checker_kv = if reshaped {
        LogicalKv::random(rng, KvShape::gqa(2, 2, 2 * k_bytes, num_tokens))
    } else {
        kv.clone()
    };
    let (s_kind, c_kind) = (*rng.pick(&KINDS), *rng.pick(&KINDS));
    // Both sides hold the request at the same block ids: the buffer
    // travels with the blocks.
    let table = GroupTable {
        group_id: 0,
        first_position: 0,
        block_ids: BlockAllocator::new(rng, count as u32 + 2).take(count),
    };
    let mut storer = tier(rng, &kv, s_kind, block_size, num_tokens, &table, &hashes);
    let mut checker = tier(rng, &checker_kv, c_kind, block_size, num_tokens, &table, &hashes);
    for (tier, decoding) in [(&mut storer, &stored_under), (&mut checker, &checked_under)] {
        if let Some(decoding) = decoding {
            tier.side.ranks[0]
                .worker
                .set_layer_decoding(0, 0, decoding.clone())
                .unwrap();
        }
    }
    let changed = reshaped || stored_under != checked_under;
    let corrupted = rng
        .chance(1, 3)
        .then(|| checker.side.corrupt(rng, num_tokens, block_size));
    let blocks = storer.side.blocks.clone();
    let paths = entry_paths(&storer, &mut checker, 0, &blocks);
    let context = format!(
        "stored under {stored_under:?}, checked under {checked_under:?}, reshaped {reshaped}, block size {block_size}, {num_tokens} tokens, corrupted {corrupted:?}"
    );
    judge_entries(Family::Entries, changed, corrupted, paths, context)
}

fn state_entries_case(rng: &mut Rng) -> ConfigResult {
    let state = random_state(rng, &[1, 4]);
    let block_id = rng.below(4) as u32;
    let hash: Vec<u8> = (0..32).map(|_| rng.next_u64() as u8).collect();
    let mut blocks = state_blocks(REQ, 1 + rng.below(100), 3, block_id);
    blocks.set_hashes(REQ, 3, &hash, 32).unwrap();
    let (stored_known, checked_known) = (rng.chance(1, 2), rng.chance(1, 2));
    let make = |rng: &mut Rng, split_known: bool| {
        let mut worker = host_worker(0, 1, 0, 1);
        let caches = place_rank(rng, &state, 0, 1, 3, split_known, block_id + 2, block_id);
        register(&mut worker, &caches, 3);
        let stored: Vec<[u64; 2]> = (0..block_id + 2).map(|_| [rng.next_u64(), rng.next_u64()]).collect();
        worker
            .add_region(kvcsum::Region {
                address: stored.as_ptr() as u64,
                length: std::mem::size_of_val(stored.as_slice()) as u64,
            })
            .unwrap();
        worker
            .add_stored(3, stored.as_ptr() as u64, stored.len() as u64)
            .unwrap();
        (worker, caches, stored)
    };
    let (storer, _storer_caches, stored) = make(rng, stored_known);
    let (checker, _checker_caches, mut checker_stored) = make(rng, checked_known);
    let kept = kvcsum::result_entries(&checksum(&storer, &blocks, Role::Consumer), REQ, 3).unwrap();
    storer.store(&blocks, StreamHandle::legacy_default()).unwrap();
    let same_bytes = kept == vec![(stored[block_id as usize][0], stored[block_id as usize][1])];
    checker_stored.copy_from_slice(&stored);
    let by_kept = kvcsum::check_result_entries(&checksum(&checker, &blocks, Role::Consumer), REQ, 3, &kept).unwrap();
    let by_buffer = checker
        .check_stored(&blocks, StreamHandle::legacy_default())
        .unwrap()
        .stored_outcomes(REQ, 3)
        .unwrap();
    let changed = stored_known != checked_known;
    let context = format!("state stored split known {stored_known}, checked {checked_known}");
    judge_entries(
        Family::StateEntries,
        changed,
        None,
        (by_kept, by_buffer, same_bytes),
        context,
    )
}

/// Case `index` of the run of `seed`.
pub fn run_configuration_case(seed: u64, index: u64) -> ConfigResult {
    let mut rng = Rng::from_seed_and_name(seed, &format!("configuration property case {index}"));
    match index % 4 {
        0 => geometry_case(&mut rng),
        1 => uncompared_case(&mut rng),
        2 => entries_case(&mut rng),
        _ => state_entries_case(&mut rng),
    }
}

/// Counts per (family, changed, corrupted, outcome).
#[derive(Default)]
pub struct ConfigTally {
    pub cases: u64,
    counts: BTreeMap<(Family, bool, bool, String), u64>,
}

impl ConfigTally {
    pub fn add(&mut self, result: &ConfigResult) {
        self.cases += 1;
        *self
            .counts
            .entry((result.family, result.changed, result.corrupted, result.outcome.clone()))
            .or_default() += 1;
    }

    pub fn table(&self, seed: u64) -> String {
        let mut out = format!(
            "configuration property, seed {seed}: {} cases\n  {:>6}  {:<44} {:<8} {:<10} outcome\n",
            self.cases, "count", "family", "changed", "corrupted"
        );
        for ((family, changed, corrupted, outcome), count) in &self.counts {
            out += &format!(
                "  {count:>6}  {:<44} {:<8} {:<10} {outcome}\n",
                family.name(),
                changed,
                corrupted
            );
        }
        out
    }
}
