//! The verifier end to end (SPEC sections 4, 7, 9, 10) on real host caches:
//! a producer and a consumer deployment of the same random logical KV, with
//! different TP sizes, PP stages, block sizes and layouts, exchange worker
//! records and the payload; every verdict and every unverified reason is
//! produced by the situation that causes it.
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it verify::<name>`.

use crate::support;

use std::sync::Arc;

use kvcsum::payload::{Payload, TRANSFER_PARAMS_KEY};
use kvcsum::record::Record;
use kvcsum::verify::{LayerDifference, Policy, Reason, Report, Verdict, Verifier};
use kvcsum::{BlockSet, Error, Role, Worker};
use sha2::{Digest, Sha256};
use support::*;

const REQ: &str = "req-7";

/// One group of a deployment.
#[derive(Clone)]
struct GroupPlan {
    group_id: u32,
    kv: LogicalKv,
    kind: LayoutKind,
    block_size: u32,
    first_position: u64,
}

/// A deployed engine (producer or consumer) holding one request.
struct Side {
    ranks: Vec<SideRank>,
    tables: Vec<GroupTable>,
    blocks: BlockSet,
    tp_size: u32,
    pp_size: u32,
}

/// One worker of a side and the caches it reads, by group.
struct SideRank {
    placements: Vec<(u32, Placement)>,
    worker: Worker,
}

/// The identity a test registers for a layer (what vLLM's repr would be).
fn identity(layer_number: u32) -> Vec<u8> {
    format!("('model.layers.{layer_number}.self_attn.attn', 'FullAttentionSpec', 'bfloat16')").into_bytes()
}

/// Deploys `groups` over `tp_size x pp_size` host workers, each group's KV
/// written at freshly allocated (scattered) blocks from its first position,
/// with identities from `identity_of(tp_rank, layer)`.
fn deploy(
    rng: &mut Rng,
    tp_size: u32,
    pp_size: u32,
    num_tokens: u64,
    groups: &[GroupPlan],
    identity_of: &dyn Fn(u32, u32) -> Vec<u8>,
) -> Side {
    let mut tables = Vec::new();
    for plan in groups {
        let count = positions_for(num_tokens, plan.block_size, plan.first_position, 0);
        let num_blocks = count as u32 + 3;
        let mut allocator = BlockAllocator::new(rng, num_blocks);
        tables.push(GroupTable {
            group_id: plan.group_id,
            first_position: plan.first_position,
            block_ids: allocator.take(count),
        });
    }
    let mut ranks = Vec::new();
    for pp_rank in 0..pp_size {
        for tp_rank in 0..tp_size {
            let mut worker = host_worker(tp_rank, tp_size, pp_rank, 1);
            let mut placements = Vec::new();
            for (plan, table) in groups.iter().zip(&tables) {
                let shard = shard(&plan.kv, tp_rank, tp_size, pp_rank, pp_size);
                worker.add_group(plan.group_id, plan.block_size).expect("add_group");
                if !shard.layer_numbers.is_empty() {
                    let num_blocks = table.block_ids.len() as u32 + 3;
                    let mut placement = Placement::for_shard(
                        rng,
                        &plan.kv,
                        &shard,
                        plan.kind,
                        plan.group_id,
                        plan.block_size,
                        num_blocks,
                    );
                    placement.write_request(&plan.kv, table.first_position, &table.block_ids);
                    for region in placement.regions(&placement.host_bases()) {
                        worker.add_region(region).expect("add_region");
                    }
                    for mut spec in placement.host_layer_specs() {
                        spec.identity = identity_of(tp_rank, spec.layer_number);
                        worker.add_layer(spec).expect("add_layer");
                    }
                    placements.push((plan.group_id, placement));
                }
            }
            ranks.push(SideRank { placements, worker });
        }
    }
    let request = TestRequest {
        req_id: REQ.to_owned(),
        num_tokens,
        tables: tables.clone(),
    };
    Side {
        ranks,
        blocks: block_set(&[request]),
        tables,
        tp_size,
        pp_size,
    }
}

fn plain_identity(_: u32, layer: u32) -> Vec<u8> {
    identity(layer)
}

fn one_group(kv: &LogicalKv, kind: LayoutKind, block_size: u32, first_position: u64) -> Vec<GroupPlan> {
    vec![GroupPlan {
        group_id: 0,
        kv: kv.clone(),
        kind,
        block_size,
        first_position,
    }]
}

impl Side {
    fn num_workers(&self) -> u32 {
        self.tp_size * self.pp_size
    }

    /// Every worker's record of `blocks` in `role`.
    fn records_of(&self, blocks: &BlockSet, role: Role) -> Vec<Vec<u8>> {
        self.ranks
            .iter()
            .map(|rank| {
                let result = checksum(&rank.worker, blocks, role);
                Record::from_checksums(&result).expect("record").encode()
            })
            .collect()
    }

    fn records(&self, role: Role) -> Vec<Vec<u8>> {
        self.records_of(&self.blocks, role)
    }

    fn table(&self, group_id: u32) -> &GroupTable {
        self.tables.iter().find(|t| t.group_id == group_id).expect("table")
    }

    /// Flips bits of one byte of the cell (layer, head, token) on the rank
    /// `(tp_rank, pp_rank)`, which must hold it.
    fn corrupt(&mut self, tp_rank: u32, pp_rank: u32, group_id: u32, layer: u32, head: u32, token: u64) {
        let table = self.table(group_id).clone();
        let index = (pp_rank * self.tp_size + tp_rank) as usize;
        let placement = &mut self.ranks[index]
            .placements
            .iter_mut()
            .find(|(g, _)| *g == group_id)
            .expect("placement")
            .1;
        let block_size = placement.spec().block_size as u64;
        let position = token / block_size;
        let block_id = table.block_ids[(position - table.first_position) as usize];
        placement.xor_byte(layer, head, block_id, (token % block_size) as u32, 3, 0x10);
    }

    fn worker(&mut self, tp_rank: u32, pp_rank: u32) -> &mut Worker {
        let index = (pp_rank * self.tp_size + tp_rank) as usize;
        &mut self.ranks[index].worker
    }
}

/// The producer's payload bytes of `side` (every worker's record added).
fn produce(side: &Side, extension: bool) -> Vec<u8> {
    let verifier = Verifier::new(side.num_workers()).unwrap();
    verifier.set_extension(extension).unwrap();
    verifier.expect(&side.blocks, Role::Producer).unwrap();
    for record in side.records(Role::Producer) {
        verifier.add_record(&record).unwrap();
    }
    verifier.payload(REQ).expect("payload").encode()
}

/// A consumer verifier of `side` with the given records added.
fn consumer_verifier(side: &Side, records: &[Vec<u8>]) -> Verifier {
    let verifier = Verifier::new(side.num_workers()).unwrap();
    verifier.expect(&side.blocks, Role::Consumer).unwrap();
    for record in records {
        verifier.add_record(record).unwrap();
    }
    verifier
}

fn check(side: &Side, payload: &[u8]) -> Report {
    consumer_verifier(side, &side.records(Role::Consumer))
        .check(REQ, Some(payload))
        .expect("check")
}

/// [`check`] by a verifier that opted out of requiring every loaded
/// position compared (`set_require_coverage(false)`): the load is judged on
/// its compared positions alone.
fn check_opted_out(side: &Side, payload: &[u8]) -> Report {
    let verifier = consumer_verifier(side, &side.records(Role::Consumer));
    verifier.set_require_coverage(false).unwrap();
    verifier.check(REQ, Some(payload)).expect("check")
}

fn assert_unverified(report: &Report, reason: Reason, seed: u64) {
    assert_eq!(report.verdict, Verdict::Unverified, "seed {seed}: {}", report.message);
    assert_eq!(report.reason(), Some(reason), "seed {seed}: {}", report.message);
    assert!(!report.passed, "fail-closed by default; seed {seed}");
    assert!(
        report.message.contains(reason.describe()),
        "seed {seed}: the message names the reason: {}",
        report.message
    );
}

fn gqa(rng: &mut Rng, layers: u32, heads: u32, num_tokens: u64) -> LogicalKv {
    LogicalKv::random(rng, KvShape::gqa(layers, heads, 16, num_tokens))
}

// ---------------------------------------------------------------------------
// Match
// ---------------------------------------------------------------------------

#[test]
fn payload_is_the_naive_sum_with_the_model_fingerprint() {
    let mut rng = Rng::for_test("payload_is_the_naive_sum_with_the_model_fingerprint");
    let seed = rng.seed();
    let kv = gqa(&mut rng, 5, 4, 70);
    // TP 2 x PP 2: each stage holds some layers, each rank half the heads.
    let producer = deploy(
        &mut rng,
        2,
        2,
        70,
        &one_group(&kv, LayoutKind::Hnd, 16, 0),
        &plain_identity,
    );
    let payload = Payload::decode(&produce(&producer, false)).unwrap();
    assert_eq!(payload.num_tokens, 70);
    // MIXED2 values (the default): the extension carries the algorithm even
    // when it is off (SPEC section 9), with no layers.
    let extension = payload
        .extension
        .as_ref()
        .expect("a MIXED2 payload carries the extension");
    assert_eq!(extension.algorithm, kvcsum::Algorithm::Mixed2);
    assert!(extension.groups.iter().all(|g| g.layers.is_empty()));
    let group = &payload.groups[0];
    assert_eq!(group.first_position, 0);
    assert_eq!(group.values, naive_full(&kv, 16, 0, 5), "seed {seed}");
    // SPEC section 7, computed here from the identities directly.
    let expected = (0..5u32).fold(0u64, |sum, layer| {
        let digest = Sha256::digest(identity(layer));
        sum.wrapping_add(u64::from_le_bytes(digest[..8].try_into().unwrap()))
    });
    assert_eq!(group.fingerprint, expected);
    assert_eq!(TRANSFER_PARAMS_KEY, "kv_checksums");
}

#[test]
fn intact_transfers_match_across_tp_pp_block_sizes_and_layouts() {
    let mut rng = Rng::for_test("intact_transfers_match_across_tp_pp_block_sizes_and_layouts");
    let seed = rng.seed();
    // (producer TP, PP, layout, block size; consumer TP, PP, layout, block
    // size, first position; heads; runs compared). 70 tokens.
    type Case = (u32, u32, LayoutKind, u32, u32, u32, LayoutKind, u32, u64, u32, u64);
    let cases: [Case; 7] = [
        // GQA replicas on the consumer (2 heads over TP 4: R = 2).
        (2, 1, LayoutKind::Hnd, 16, 4, 1, LayoutKind::Nhd, 16, 0, 2, 5),
        // 8 heads: TP 2 x PP 2 against TP 4, block sizes 16 and 32: runs of
        // 32 tokens, the last holding 6.
        (2, 2, LayoutKind::KvSplit, 16, 4, 1, LayoutKind::CrossLayer, 32, 0, 8, 3),
        // Block sizes 12 and 8 (runs of 24: 24, 24, 22 tokens).
        (
            1,
            1,
            LayoutKind::Hnd,
            12,
            2,
            2,
            LayoutKind::KernelBlocks { kernel_blocks: 2 },
            8,
            0,
            4,
            3,
        ),
        // Coarser consumer blocks the other way round.
        (
            4,
            1,
            LayoutKind::NegativeStride,
            32,
            1,
            2,
            LayoutKind::HndKvSplit,
            16,
            0,
            4,
            3,
        ),
        // The consumer loads from position 2 (its first blocks were cached).
        (2, 1, LayoutKind::Padded, 16, 1, 1, LayoutKind::Hnd, 16, 2, 4, 3),
        // Consumer starts at 16-token position 1, producer blocks of 32: run 0
        // is incomplete on the consumer, so runs 1 and 2.
        (2, 1, LayoutKind::Hnd, 32, 2, 1, LayoutKind::Nhd, 16, 1, 4, 2),
        // Unreplicated producer TP 4 against replicated consumer TP 8.
        (4, 1, LayoutKind::Nhd, 16, 8, 1, LayoutKind::Hnd, 16, 0, 4, 5),
    ];
    for (index, &(p_tp, p_pp, p_kind, p_bs, c_tp, c_pp, c_kind, c_bs, c_first, heads, runs)) in cases.iter().enumerate()
    {
        let kv = gqa(&mut rng, 4, heads, 70);
        let producer = deploy(
            &mut rng,
            p_tp,
            p_pp,
            70,
            &one_group(&kv, p_kind, p_bs, 0),
            &plain_identity,
        );
        let consumer = deploy(
            &mut rng,
            c_tp,
            c_pp,
            70,
            &one_group(&kv, c_kind, c_bs, c_first),
            &plain_identity,
        );
        // Case parity decides how the consumer learns the producer's block
        // size: from the payload extension, or told by the caller.
        let extension = index % 2 == 0;
        let payload = produce(&producer, extension);
        let verifier = consumer_verifier(&consumer, &consumer.records(Role::Consumer));
        if !extension && p_bs != c_bs {
            verifier.set_producer_block_size(0, p_bs).unwrap();
        }
        let mut report = verifier.check(REQ, Some(&payload)).unwrap();
        if report.uncompared_positions > 0 {
            // Positions nobody compared (a run the consumer holds only part
            // of) make the load not passed by default; opted out, the
            // compared runs match.
            assert_unverified(&report, Reason::UncomparedPositions, seed);
            let verifier = consumer_verifier(&consumer, &consumer.records(Role::Consumer));
            verifier.set_require_coverage(false).unwrap();
            if !extension && p_bs != c_bs {
                verifier.set_producer_block_size(0, p_bs).unwrap();
            }
            report = verifier.check(REQ, Some(&payload)).unwrap();
        }
        assert_eq!(
            report.verdict,
            Verdict::Match,
            "case {index}, seed {seed}: {}",
            report.message
        );
        assert!(report.passed);
        assert_eq!(
            report.compared_positions, runs,
            "case {index}, seed {seed}: {}",
            report.message
        );
        assert!(report.unverified.is_empty() && report.mismatches.is_empty());
    }
}

#[test]
fn mla_latents_replicated_on_every_rank_match_and_each_copy_is_checked() {
    let mut rng = Rng::for_test("mla_latents_replicated_on_every_rank_match_and_each_copy_is_checked");
    let seed = rng.seed();
    let kv = LogicalKv::random(&mut rng, KvShape::mla(3, 64, 50));
    let producer = deploy(
        &mut rng,
        2,
        1,
        50,
        &one_group(&kv, LayoutKind::Hnd, 16, 0),
        &plain_identity,
    );
    let mut consumer = deploy(
        &mut rng,
        4,
        1,
        50,
        &one_group(&kv, LayoutKind::Nhd, 16, 0),
        &plain_identity,
    );
    let payload = produce(&producer, false);
    let report = check(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
    assert_eq!(report.compared_positions, 4);
    // The copy on TP rank 3 (replica 3 of 4) is wrong at token 20.
    consumer.corrupt(3, 0, 0, 1, 0, 20);
    let report = check(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
    assert_eq!(report.mismatches.len(), 1);
    let mismatch = &report.mismatches[0];
    assert_eq!(
        (mismatch.group_id, mismatch.first_position, mismatch.num_positions),
        (0, 1, 1)
    );
    assert_eq!(mismatch.failed_checks, vec![3], "only check 3 sums copy 3");
}

// ---------------------------------------------------------------------------
// Mismatch
// ---------------------------------------------------------------------------

#[test]
fn a_flipped_bit_in_one_consumer_replica_is_a_mismatch_at_its_position() {
    let mut rng = Rng::for_test("a_flipped_bit_in_one_consumer_replica_is_a_mismatch_at_its_position");
    let seed = rng.seed();
    let kv = gqa(&mut rng, 4, 2, 70);
    let producer = deploy(
        &mut rng,
        2,
        1,
        70,
        &one_group(&kv, LayoutKind::Hnd, 16, 0),
        &plain_identity,
    );
    let mut consumer = deploy(
        &mut rng,
        4,
        1,
        70,
        &one_group(&kv, LayoutKind::Nhd, 16, 0),
        &plain_identity,
    );
    let payload = produce(&producer, false);
    // TP rank 1 holds head 0 as replica 1 of 2; token 37 is at position 2.
    consumer.corrupt(1, 0, 0, 2, 0, 37);
    let report = check(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
    assert!(!report.passed);
    assert_eq!(report.compared_positions, 5);
    let mismatch = &report.mismatches[0];
    assert_eq!(report.mismatches.len(), 1, "seed {seed}: {}", report.message);
    assert_eq!((mismatch.first_position, mismatch.num_positions), (2, 1));
    assert_eq!((mismatch.first_token, mismatch.num_tokens), (32, 16));
    assert_eq!(mismatch.failed_checks, vec![1]);
    assert!(!mismatch.localised, "no detail mode");
    assert!(report.message.contains("group 0 position 2"), "{}", report.message);
}

#[test]
fn a_mismatch_spans_the_finer_sides_positions_of_a_run() {
    let mut rng = Rng::for_test("a_mismatch_spans_the_finer_sides_positions_of_a_run");
    let seed = rng.seed();
    let kv = gqa(&mut rng, 3, 4, 70);
    let producer = deploy(
        &mut rng,
        1,
        2,
        70,
        &one_group(&kv, LayoutKind::Hnd, 32, 0),
        &plain_identity,
    );
    let mut consumer = deploy(
        &mut rng,
        2,
        1,
        70,
        &one_group(&kv, LayoutKind::Hnd, 16, 0),
        &plain_identity,
    );
    let payload = produce(&producer, true);
    // Token 40 is in 16-token position 2, which is run 1 (tokens 32..64).
    consumer.corrupt(0, 0, 0, 0, 1, 40);
    let report = check(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
    let mismatch = &report.mismatches[0];
    assert_eq!(
        (mismatch.first_position, mismatch.num_positions),
        (2, 2),
        "positions 2 and 3"
    );
    assert_eq!((mismatch.first_token, mismatch.num_tokens), (32, 32));
    assert_eq!(mismatch.failed_checks, vec![0]);
}

#[test]
fn only_positions_with_equal_valid_tokens_are_compared() {
    let mut rng = Rng::for_test("only_positions_with_equal_valid_tokens_are_compared");
    let seed = rng.seed();
    let kv = gqa(&mut rng, 3, 2, 70);
    // The producer checksummed 70 tokens, the consumer loaded 66: position 4
    // holds 6 valid tokens on one side and 2 on the other.
    let producer = deploy(
        &mut rng,
        2,
        1,
        70,
        &one_group(&kv, LayoutKind::Hnd, 16, 0),
        &plain_identity,
    );
    let mut consumer = deploy(
        &mut rng,
        2,
        1,
        66,
        &one_group(&kv, LayoutKind::Nhd, 16, 0),
        &plain_identity,
    );
    let payload = produce(&producer, false);
    // By default the position nobody compared makes the load not passed,
    // named in the report.
    let report = check(&consumer, &payload);
    assert_unverified(&report, Reason::UncomparedPositions, seed);
    assert!(
        report.message.contains("group 0: 1 loaded positions were not compared")
            && report.message.contains("positions 4..5"),
        "seed {seed}: {}",
        report.message
    );
    assert_eq!(report.compared_positions, 4, "position 4 is not compared");
    let report = check_opted_out(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
    assert_eq!(report.compared_positions, 4, "position 4 is not compared");
    // A change in position 4 (valid on the consumer) is therefore not seen:
    // never a MATCH by default, a match of the rest opted out...
    consumer.corrupt(0, 0, 0, 1, 0, 65);
    assert_unverified(&check(&consumer, &payload), Reason::UncomparedPositions, seed);
    let report = check_opted_out(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
    // ...and one in position 3 is.
    consumer.corrupt(1, 0, 0, 1, 1, 50);
    let report = check(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
    assert_eq!(report.mismatches[0].first_position, 3);
}

/// The consumer positions holding valid tokens that SPEC section 10's run
/// rule leaves uncompared where both sides hold every block, straight from
/// the rule: position `p` lies in run `p * b_c / L`, compared when both
/// sides' valid tokens in it are equal and not zero.
fn naive_uncompared(b_p: u32, n_p: u64, b_c: u32, n_c: u64) -> (u64, u64) {
    let (mut gcd, mut rest) = (b_p as u64, b_c as u64);
    while rest != 0 {
        (gcd, rest) = (rest, gcd % rest);
    }
    let run = b_p as u64 / gcd * b_c as u64;
    let run_valid = |n: u64, q: u64| n.saturating_sub(q * run).min(run);
    let (mut compared_runs, mut uncompared) = (std::collections::BTreeSet::new(), 0);
    for position in 0..n_c.div_ceil(b_c as u64) {
        let q = position * b_c as u64 / run;
        if run_valid(n_c, q) != 0 && run_valid(n_c, q) == run_valid(n_p, q) {
            compared_runs.insert(q);
        } else {
            uncompared += 1;
        }
    }
    (compared_runs.len() as u64, uncompared)
}

/// A consumer whose connector loaded one token fewer than the producer
/// computed (LMCache, sync connectors: the prompt's last token is left to
/// the engine) compares every loaded position, its last one against the
/// producer's short last value (SPEC sections 9 and 10), whatever the two
/// block sizes; the value is the naive checksum of that position over one
/// token fewer. Two tokens fewer is judged as before.
#[test]
fn a_load_of_one_token_fewer_compares_its_last_position_against_the_short_last_value() {
    let mut rng = Rng::for_test("a_load_of_one_token_fewer_compares_its_last_position_against_the_short_last_value");
    let seed = rng.seed();
    let mut pairs: Vec<(u32, u32)> = vec![
        (16, 16),
        (1, 1),
        (16, 32),
        (32, 16),
        (12, 8),
        (64, 48),
        (1, 64),
        (64, 1),
    ];
    while pairs.len() < 40 {
        let b_p = 1 + rng.below(64) as u32;
        let b_c = if rng.chance(1, 4) {
            b_p
        } else {
            1 + rng.below(64) as u32
        };
        pairs.push((b_p, b_c));
    }
    for (b_p, b_c) in pairs {
        let n = 3 + rng.below(200);
        let context = format!("seed {seed}, producer block size {b_p}, consumer {b_c}, {n} tokens");
        let kv = gqa(&mut rng, 2, 2, n);
        let kinds = [LayoutKind::Hnd, LayoutKind::Nhd];
        let (p_tp, c_tp) = (1 + rng.below(2) as u32, 1 + rng.below(2) as u32);
        let (p_kind, c_kind) = (*rng.pick(&kinds), *rng.pick(&kinds));
        let producer = deploy(&mut rng, p_tp, 1, n, &one_group(&kv, p_kind, b_p, 0), &plain_identity);
        let payload = produce(&producer, true);
        // The short last value is the producer's last position over n - 1 tokens.
        let decoded = Payload::decode(&payload).expect("payload");
        let short_last = decoded.extension_group(0).and_then(|g| g.short_last);
        let last = (n - 1) / b_p as u64;
        let naive = naive_block_checksum(
            &kv,
            &kv.layer_numbers(),
            &kv.heads(),
            last * b_p as u64,
            naive_valid_tokens(n - 1, b_p, last),
        );
        assert_eq!(short_last, Some(naive), "{context}");
        assert_eq!(decoded.extension.as_ref().map(|e| e.version()), Some(5), "{context}");

        // One token fewer, intact: every loaded position compared.
        let mut consumer = deploy(
            &mut rng,
            c_tp,
            1,
            n - 1,
            &one_group(&kv, c_kind, b_c, 0),
            &plain_identity,
        );
        let report = check(&consumer, &payload);
        assert_eq!(report.verdict, Verdict::Match, "{context}: {}", report.message);
        assert_eq!(report.uncompared_positions, 0, "{context}: {:?}", report.uncompared);
        assert_eq!(
            report.compared_positions,
            naive_uncompared(b_p, n - 1, b_c, n - 1).0,
            "{context}"
        );
        // A flipped byte in the last loaded token: a mismatch of that position.
        let token = n - 2;
        let (head, layer) = (rng.below(2) as u32, rng.below(2) as u32);
        consumer.corrupt(head % c_tp, 0, 0, layer, head, token);
        let report = check(&consumer, &payload);
        assert_eq!(report.verdict, Verdict::Mismatch, "{context}: {}", report.message);
        assert_eq!(report.mismatches.len(), 1, "{context}: {:?}", report.mismatches);
        let mismatch = &report.mismatches[0];
        let position = token / b_c as u64;
        assert!(
            (mismatch.first_position..mismatch.first_position + mismatch.num_positions).contains(&position),
            "{context}: position {position} in {mismatch:?}"
        );
        assert_eq!(
            mismatch.first_token + mismatch.num_tokens,
            n - 1,
            "{context}: {mismatch:?}"
        );

        // Two tokens fewer: the run rule over the payload's own tokens.
        let consumer = deploy(
            &mut rng,
            c_tp,
            1,
            n - 2,
            &one_group(&kv, c_kind, b_c, 0),
            &plain_identity,
        );
        let report = check(&consumer, &payload);
        let (compared, uncompared) = naive_uncompared(b_p, n, b_c, n - 2);
        if compared == 0 {
            assert_unverified(&report, Reason::NoCommonPosition, seed);
        } else {
            if uncompared > 0 {
                assert_unverified(&report, Reason::UncomparedPositions, seed);
            }
            let report = check_opted_out(&consumer, &payload);
            assert_eq!(report.verdict, Verdict::Match, "{context}: {}", report.message);
            assert_eq!(report.compared_positions, compared, "{context}");
            assert_eq!(
                report.uncompared_positions, uncompared,
                "{context}: {:?}",
                report.uncompared
            );
        }
    }
}

#[test]
fn short_last_values_are_one_per_column_and_in_producer_records_only() {
    let mut rng = Rng::for_test("short_last_values_are_one_per_column_and_in_producer_records_only");
    let kv = gqa(&mut rng, 2, 2, 40);
    let side = deploy(
        &mut rng,
        1,
        1,
        40,
        &one_group(&kv, LayoutKind::Hnd, 16, 0),
        &plain_identity,
    );
    let producer = Record::decode(&side.records(Role::Producer)[0]).unwrap();
    let group = &producer.requests[0].groups[0];
    assert_eq!(group.short_last.as_ref().map(Vec::len), Some(group.columns.len()));
    let consumer = Record::decode(&side.records(Role::Consumer)[0]).unwrap();
    assert_eq!(
        consumer.requests[0].groups[0].short_last, None,
        "consumers compute none"
    );
    let malformed = |record: &Record, needle: &str| match Record::decode(&record.encode()) {
        Err(Error::Malformed(message)) => assert!(message.contains(needle), "{message}"),
        other => panic!("expected Malformed containing {needle:?}, got {other:?}"),
    };
    let mut wrong_count = producer.clone();
    wrong_count.requests[0].groups[0].short_last = Some(vec![1, 2, 3]);
    malformed(&wrong_count, "3 short last values for 1 columns");
    let mut in_consumer = consumer.clone();
    in_consumer.requests[0].groups[0].short_last = Some(vec![1; consumer.requests[0].groups[0].columns.len()]);
    malformed(&in_consumer, "short last values in a consumer record");
}

#[test]
fn detail_mode_names_no_layers_at_the_position_compared_over_one_token_fewer() {
    // The layer partials the producer sends are over all its 70 tokens:
    // a mismatch at its last position, compared over 69, names no layers;
    // one at an earlier position still does.
    let mut rng = Rng::for_test("detail_mode_names_no_layers_at_the_position_compared_over_one_token_fewer");
    let seed = rng.seed();
    let kv = gqa(&mut rng, 2, 2, 70);
    let mut producer = deploy(
        &mut rng,
        1,
        1,
        70,
        &one_group(&kv, LayoutKind::Hnd, 16, 0),
        &plain_identity,
    );
    let mut consumer = deploy(
        &mut rng,
        1,
        1,
        69,
        &one_group(&kv, LayoutKind::Nhd, 16, 0),
        &plain_identity,
    );
    producer.worker(0, 0).set_detail(true).unwrap();
    consumer.worker(0, 0).set_detail(true).unwrap();
    let payload = produce(&producer, true);
    let report = check(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
    assert_eq!((report.compared_positions, report.uncompared_positions), (5, 0));
    consumer.corrupt(0, 0, 0, 1, 1, 66);
    let report = check(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
    let mismatch = &report.mismatches[0];
    assert_eq!((mismatch.first_position, mismatch.num_tokens), (4, 5), "seed {seed}");
    assert!(
        !mismatch.localised && mismatch.layers.is_empty(),
        "seed {seed}: {mismatch:?}"
    );
    consumer.corrupt(0, 0, 0, 1, 1, 20);
    let report = check(&consumer, &payload);
    let earlier = &report.mismatches[0];
    assert_eq!(earlier.first_position, 1, "seed {seed}");
    assert!(earlier.localised, "seed {seed}: {earlier:?}");
    assert_eq!(
        earlier.layers,
        // One worker: its layer partial covers both heads of the layer.
        vec![LayerDifference {
            layer_number: 1,
            first_head: 0,
            num_heads: 2,
            check: 0
        }],
        "seed {seed}"
    );
}

#[test]
fn detail_mode_names_the_layer_and_heads_across_tp_sizes() {
    let mut rng = Rng::for_test("detail_mode_names_the_layer_and_heads_across_tp_sizes");
    let seed = rng.seed();
    let kv = gqa(&mut rng, 4, 8, 70);
    let mut producer = deploy(
        &mut rng,
        2,
        1,
        70,
        &one_group(&kv, LayoutKind::Hnd, 16, 0),
        &plain_identity,
    );
    let mut consumer = deploy(
        &mut rng,
        4,
        1,
        70,
        &one_group(&kv, LayoutKind::KvSplit, 16, 0),
        &plain_identity,
    );
    for tp_rank in 0..2 {
        producer.worker(tp_rank, 0).set_detail(true).unwrap();
    }
    for tp_rank in 0..4 {
        consumer.worker(tp_rank, 0).set_detail(true).unwrap();
    }
    let payload = produce(&producer, true);
    let decoded = Payload::decode(&payload).unwrap();
    let extension = decoded.extension.as_ref().expect("extension");
    assert_eq!(extension.producer_tp_size, 2);
    assert_eq!(extension.groups[0].block_size, 16);
    // Producer ranks hold heads 0..4 and 4..8 of each of 4 layers.
    assert_eq!(extension.groups[0].layers.len(), 8);
    // The layer partials add up to the group's checksums.
    let mut sum = vec![0u64; 5];
    for layer in &extension.groups[0].layers {
        add_values(&mut sum, &layer.values);
    }
    assert_eq!(sum, decoded.groups[0].values, "seed {seed}");
    assert_eq!(
        extension.groups[0].layers[2].values,
        naive_positions(&kv, &[1], &[0, 1, 2, 3], 16, 0, 5),
        "layer 1 heads 0..4, seed {seed}"
    );
    assert_eq!(check(&consumer, &payload).verdict, Verdict::Match);
    // Consumer rank 2 holds heads 4..6: corrupt head 5 of layer 2 at token 20.
    consumer.corrupt(2, 0, 0, 2, 5, 20);
    let report = check(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
    let mismatch = &report.mismatches[0];
    assert_eq!(mismatch.first_position, 1);
    assert!(mismatch.localised);
    // Heads 4..8 is the finest range both TP splits can sum.
    assert_eq!(
        mismatch.layers,
        vec![LayerDifference {
            layer_number: 2,
            first_head: 4,
            num_heads: 4,
            check: 0
        }],
        "seed {seed}: {}",
        report.message
    );
    assert!(report.message.contains("layer 2 heads 4..8"), "{}", report.message);
}

#[test]
fn detail_mode_names_the_replica_copy_across_pp_and_block_sizes() {
    let mut rng = Rng::for_test("detail_mode_names_the_replica_copy_across_pp_and_block_sizes");
    let seed = rng.seed();
    let kv = gqa(&mut rng, 4, 2, 70);
    let mut producer = deploy(
        &mut rng,
        1,
        2,
        70,
        &one_group(&kv, LayoutKind::Nhd, 16, 0),
        &plain_identity,
    );
    let mut consumer = deploy(
        &mut rng,
        4,
        1,
        70,
        &one_group(&kv, LayoutKind::Hnd, 32, 0),
        &plain_identity,
    );
    for pp_rank in 0..2 {
        producer.worker(0, pp_rank).set_detail(true).unwrap();
    }
    for tp_rank in 0..4 {
        consumer.worker(tp_rank, 0).set_detail(true).unwrap();
    }
    let payload = produce(&producer, true);
    // TP rank 3 holds head 1 as replica 1 of 2; token 66 is in run 2.
    consumer.corrupt(3, 0, 0, 3, 1, 66);
    let report = check(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
    let mismatch = &report.mismatches[0];
    assert_eq!(
        (mismatch.first_position, mismatch.first_token, mismatch.num_tokens),
        (2, 64, 6)
    );
    assert_eq!(mismatch.failed_checks, vec![1]);
    assert_eq!(
        mismatch.layers,
        // The producer (TP 1) holds heads 0..2 as one range: that is the
        // finest range both sides can sum.
        vec![LayerDifference {
            layer_number: 3,
            first_head: 0,
            num_heads: 2,
            check: 1
        }]
    );
}

#[test]
fn a_mismatch_in_one_group_wins_over_another_groups_finding() {
    let mut rng = Rng::for_test("a_mismatch_in_one_group_wins_over_another_groups_finding");
    let seed = rng.seed();
    let full = gqa(&mut rng, 3, 4, 70);
    // Layers 10 and 11: a layer belongs to one group.
    let window = LogicalKv::random(
        &mut rng,
        KvShape {
            first_layer: 10,
            ..KvShape::gqa(2, 2, 16, 70)
        },
    );
    let groups = |kind| {
        vec![
            GroupPlan {
                group_id: 0,
                kv: full.clone(),
                kind,
                block_size: 16,
                first_position: 0,
            },
            // A sliding-window-like group: only its last blocks.
            GroupPlan {
                group_id: 3,
                kv: window.clone(),
                kind,
                block_size: 32,
                first_position: 1,
            },
        ]
    };
    let producer = deploy(&mut rng, 2, 1, 70, &groups(LayoutKind::Hnd), &plain_identity);
    let mut consumer = deploy(&mut rng, 2, 1, 70, &groups(LayoutKind::Nhd), &plain_identity);
    let payload = produce(&producer, false);
    let report = check(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
    assert_eq!(report.compared_positions, 5 + 2);
    consumer.corrupt(1, 0, 3, 11, 1, 40);
    let report = check(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
    assert_eq!(report.mismatches.len(), 1);
    assert_eq!(
        (report.mismatches[0].group_id, report.mismatches[0].first_position),
        (3, 1)
    );
    // Group 0 skipped on one consumer worker: one-sided, still a mismatch.
    consumer
        .worker(0, 0)
        .skip_group(0, "not supported by this kernel")
        .unwrap();
    let report = check(&consumer, &payload);
    assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
    assert_eq!(report.reason(), Some(Reason::OneSidedGroup));
    assert_eq!(report.unverified[0].group_id, Some(0));
    assert!(report.unverified[0].message.contains("not supported by this kernel"));
}

// ---------------------------------------------------------------------------
// Unverified, one reason at a time
// ---------------------------------------------------------------------------

/// A small GQA transfer: producer TP 2, consumer TP 4 with replicas.
fn transfer(rng: &mut Rng) -> (LogicalKv, Side, Side) {
    let kv = gqa(rng, 4, 2, 70);
    let producer = deploy(rng, 2, 1, 70, &one_group(&kv, LayoutKind::Hnd, 16, 0), &plain_identity);
    let consumer = deploy(rng, 4, 1, 70, &one_group(&kv, LayoutKind::Nhd, 16, 0), &plain_identity);
    (kv, producer, consumer)
}

#[test]
fn unverified_when_the_producer_sent_no_checksums() {
    let mut rng = Rng::for_test("unverified_when_the_producer_sent_no_checksums");
    let (_, _, consumer) = transfer(&mut rng);
    let report = consumer_verifier(&consumer, &consumer.records(Role::Consumer))
        .check(REQ, None)
        .unwrap();
    assert_unverified(&report, Reason::NoChecksums, rng.seed());
}

#[test]
fn unverified_when_the_checksums_are_invalid() {
    let mut rng = Rng::for_test("unverified_when_the_checksums_are_invalid");
    let seed = rng.seed();
    let (_, producer, consumer) = transfer(&mut rng);
    let payload = produce(&producer, false);
    let verifier = consumer_verifier(&consumer, &consumer.records(Role::Consumer));
    let mut other_version = payload.clone();
    other_version[1] = 2;
    let truncated = &payload[..payload.len() - 3];
    for bad in [&other_version[..], truncated, b"", b"\x93\x01"] {
        let report = verifier.check(REQ, Some(bad)).unwrap();
        assert_unverified(&report, Reason::InvalidChecksums, seed);
    }
    let report = verifier.check(REQ, Some(&other_version)).unwrap();
    assert!(report.message.contains("version 2"), "{}", report.message);
    // Corrupted base64 text of kv_transfer_params.
    let text = kvcsum::payload::encode_base64(&payload);
    let report = verifier.check_base64(REQ, text.as_bytes()).unwrap();
    assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
    let mut corrupted = text.into_bytes();
    corrupted[4] = b'*';
    let report = verifier.check_base64(REQ, &corrupted).unwrap();
    assert_unverified(&report, Reason::InvalidChecksums, seed);
    assert!(report.message.contains("base64"), "{}", report.message);
}

#[test]
fn unverified_when_not_every_worker_reported() {
    let mut rng = Rng::for_test("unverified_when_not_every_worker_reported");
    let seed = rng.seed();
    let (_, producer, consumer) = transfer(&mut rng);
    let payload = produce(&producer, false);
    let mut records = consumer.records(Role::Consumer);
    records.remove(2);
    let report = consumer_verifier(&consumer, &records)
        .check(REQ, Some(&payload))
        .unwrap();
    assert_unverified(&report, Reason::WorkersMissing, seed);
    assert!(report.message.contains("3 of 4 workers"), "{}", report.message);
    assert!(
        report.message.contains("tp_rank 2"),
        "names the missing worker: {}",
        report.message
    );
    // The producer cannot build a payload either.
    let verifier = Verifier::new(2).unwrap();
    verifier.expect(&producer.blocks, Role::Producer).unwrap();
    verifier.add_record(&producer.records(Role::Producer)[0]).unwrap();
    assert!(matches!(verifier.payload(REQ), Err(Error::NotReady(m)) if m.contains("1 of 2 workers")));
}

#[test]
fn unverified_when_a_worker_checksummed_other_blocks() {
    let mut rng = Rng::for_test("unverified_when_a_worker_checksummed_other_blocks");
    let seed = rng.seed();
    let (_, producer, consumer) = transfer(&mut rng);
    let payload = produce(&producer, false);
    // Worker 1 checksummed one block fewer (an earlier schedule, say).
    let table = consumer.table(0).clone();
    let short = block_set(&[TestRequest {
        req_id: REQ.to_owned(),
        num_tokens: 70,
        tables: vec![GroupTable {
            block_ids: table.block_ids[..table.block_ids.len() - 1].to_vec(),
            ..table.clone()
        }],
    }]);
    let mut records = consumer.records(Role::Consumer);
    records[1] = consumer.records_of(&short, Role::Consumer).swap_remove(1);
    let report = consumer_verifier(&consumer, &records)
        .check(REQ, Some(&payload))
        .unwrap();
    assert_unverified(&report, Reason::OtherBlocks, seed);
    assert!(
        report
            .message
            .contains("positions 0..4 of group 0, 0..5 were scheduled"),
        "{}",
        report.message
    );
    // Or another token count.
    let fewer_tokens = block_set(&[TestRequest {
        req_id: REQ.to_owned(),
        num_tokens: 69,
        tables: vec![table],
    }]);
    let mut records = consumer.records(Role::Consumer);
    records[3] = consumer.records_of(&fewer_tokens, Role::Consumer).swap_remove(3);
    let report = consumer_verifier(&consumer, &records)
        .check(REQ, Some(&payload))
        .unwrap();
    assert_unverified(&report, Reason::OtherBlocks, seed);
    // A producer with such a record builds no payload.
    let verifier = Verifier::new(2).unwrap();
    verifier.expect(&producer.blocks, Role::Producer).unwrap();
    let mut records = producer.records(Role::Producer);
    records[0] = producer.records_of(&short, Role::Producer).swap_remove(0);
    for record in &records {
        verifier.add_record(record).unwrap();
    }
    assert!(
        matches!(verifier.payload(REQ), Err(Error::InvalidArgument(m)) if m.contains("other blocks than scheduled"))
    );
}

#[test]
fn unverified_when_a_group_is_checksummed_by_one_side_only() {
    let mut rng = Rng::for_test("unverified_when_a_group_is_checksummed_by_one_side_only");
    let seed = rng.seed();
    let (_, mut producer, mut consumer) = transfer(&mut rng);
    let payload = produce(&producer, false);
    // The consumer skipped the group the producer sent.
    consumer.worker(2, 0).skip_group(0, "fp8 cache without scales").unwrap();
    let report = check(&consumer, &payload);
    assert_unverified(&report, Reason::OneSidedGroup, seed);
    assert!(
        report.message.contains("fp8 cache without scales"),
        "{}",
        report.message
    );
    // The producer skipped it (so it is not in the payload), the consumer not.
    producer.worker(1, 0).skip_group(0, "not supported").unwrap();
    let skipped_payload = produce(&producer, false);
    assert!(Payload::decode(&skipped_payload).unwrap().groups.is_empty());
    let (_, _, fresh_consumer) = transfer(&mut rng);
    let report = check(&fresh_consumer, &skipped_payload);
    assert_unverified(&report, Reason::OneSidedGroup, seed);
    // Both skipped it: nothing to compare at all.
    let report = check(&consumer, &skipped_payload);
    assert_unverified(&report, Reason::NoCommonPosition, seed);
}

#[test]
fn unverified_when_a_groups_fingerprint_differs() {
    let mut rng = Rng::for_test("unverified_when_a_groups_fingerprint_differs");
    let seed = rng.seed();
    let kv = gqa(&mut rng, 4, 2, 70);
    let producer = deploy(
        &mut rng,
        2,
        1,
        70,
        &one_group(&kv, LayoutKind::Hnd, 16, 0),
        &plain_identity,
    );
    let payload = produce(&producer, false);
    // Same KV bytes, but the consumer's layer 2 has another dtype.
    let other_dtype = |_: u32, layer: u32| {
        if layer == 2 {
            b"('model.layers.2.self_attn.attn', 'FullAttentionSpec', 'float8_e4m3fn')".to_vec()
        } else {
            identity(layer)
        }
    };
    let consumer = deploy(
        &mut rng,
        4,
        1,
        70,
        &one_group(&kv, LayoutKind::Nhd, 16, 0),
        &other_dtype,
    );
    let report = check(&consumer, &payload);
    assert_unverified(&report, Reason::FingerprintDiffers, seed);
    // TP ranks of one consumer stage disagreeing are caught too.
    let rank_dependent = |tp_rank: u32, layer: u32| {
        let mut bytes = identity(layer);
        if tp_rank == 3 {
            bytes.push(b'!');
        }
        bytes
    };
    let consumer = deploy(
        &mut rng,
        4,
        1,
        70,
        &one_group(&kv, LayoutKind::Nhd, 16, 0),
        &rank_dependent,
    );
    let report = check(&consumer, &payload);
    assert_unverified(&report, Reason::FingerprintDiffers, seed);
    assert!(report.message.contains("of one stage"), "{}", report.message);
}

#[test]
fn unverified_when_no_block_position_is_in_common() {
    let mut rng = Rng::for_test("unverified_when_no_block_position_is_in_common");
    let seed = rng.seed();
    let kv = gqa(&mut rng, 3, 2, 48);
    // The producer holds 40 tokens (position 2 has 8 valid), the consumer
    // loaded positions 2.. of 48 tokens (position 2 has 16 valid).
    let producer = deploy(
        &mut rng,
        2,
        1,
        40,
        &one_group(&kv, LayoutKind::Hnd, 16, 0),
        &plain_identity,
    );
    let consumer = deploy(
        &mut rng,
        2,
        1,
        48,
        &one_group(&kv, LayoutKind::Hnd, 16, 2),
        &plain_identity,
    );
    let report = check(&consumer, &produce(&producer, false));
    assert_unverified(&report, Reason::NoCommonPosition, seed);
    assert_eq!(report.unverified[0].group_id, Some(0));
}

#[test]
fn unverified_when_a_replica_was_not_checksummed() {
    let mut rng = Rng::for_test("unverified_when_a_replica_was_not_checksummed");
    let seed = rng.seed();
    let (_, producer, consumer) = transfer(&mut rng);
    // Consumer workers computed replica 0 only (their records computed as a
    // producer, relabelled as a consumer's so that the roles agree, without
    // the producer's short last values).
    let records: Vec<Vec<u8>> = consumer
        .records(Role::Producer)
        .iter()
        .map(|bytes| {
            let mut record = Record::decode(bytes).unwrap();
            record.role = Role::Consumer;
            // Only a producer's call computes short last values.
            for group in record.requests.iter_mut().flat_map(|r| r.groups.iter_mut()) {
                group.short_last = None;
            }
            record.encode()
        })
        .collect();
    let report = consumer_verifier(&consumer, &records)
        .check(REQ, Some(&produce(&producer, false)))
        .unwrap();
    assert_unverified(&report, Reason::ReplicaMissing, seed);
    assert!(report.message.contains("replica 1 of 2"), "{}", report.message);
}

#[test]
fn shard_keyed_state_is_compared_only_between_equal_tp_sizes() {
    // WEIGHTED: a plain payload (producer TP size unknown) is only
    // possible for WEIGHTED values; MIXED ones always carry the extension.
    with_algorithm(kvcsum::Algorithm::Weighted, || {
        let mut rng = Rng::for_test("shard_keyed_state_is_compared_only_between_equal_tp_sizes");
        let seed = rng.seed();
        let (_, producer, consumer) = transfer(&mut rng);
        // The engine registers no state layers yet: mark the consumer's group as
        // shard-keyed state in its records, as a state layer of unknown TP split
        // would (SPEC section 6).
        let shard_keyed = |records: Vec<Vec<u8>>| -> Vec<Record> {
            records
                .iter()
                .map(|bytes| {
                    let mut record = Record::decode(bytes).unwrap();
                    record.groups[0].shard_keyed = true;
                    record
                })
                .collect()
        };
        let verifier_with = |records: Vec<Record>| {
            let verifier = Verifier::new(4).unwrap();
            verifier.expect(&consumer.blocks, Role::Consumer).unwrap();
            for record in records {
                verifier.add(record).unwrap();
            }
            verifier
        };
        // The extension says producer TP 2, the consumer is TP 4.
        let extended = produce(&producer, true);
        let report = verifier_with(shard_keyed(consumer.records(Role::Consumer)))
            .check(REQ, Some(&extended))
            .unwrap();
        assert_unverified(&report, Reason::StateTpDiffers, seed);
        // Plain payload, producer TP unknown: unverified whatever the values
        // (equal values could hide corrupted state of another TP size, an
        // all-zero state for one), and a difference is never a mismatch.
        let plain = produce(&producer, false);
        let verifier = verifier_with(shard_keyed(consumer.records(Role::Consumer)));
        let report = verifier.check(REQ, Some(&plain)).unwrap();
        assert_unverified(&report, Reason::StateTpDiffers, seed);
        assert!(report.message.contains("unknown"), "{}", report.message);
        let mut other_payload = Payload::decode(&plain).unwrap();
        other_payload.groups[0].values[1] ^= 1;
        let report = verifier.check(REQ, Some(&other_payload.encode())).unwrap();
        assert_unverified(&report, Reason::StateTpDiffers, seed);
        // Told the producer's TP size (2, not 4): unverified before comparing.
        verifier.set_producer_tp_size(2).unwrap();
        let report = verifier.check(REQ, Some(&plain)).unwrap();
        assert_unverified(&report, Reason::StateTpDiffers, seed);
        // Equal TP sizes (and the block size, which a plain payload does
        // not say either): a plain mismatch.
        verifier.set_producer_tp_size(4).unwrap();
        verifier.set_producer_block_size(0, 16).unwrap();
        let report = verifier.check(REQ, Some(&other_payload.encode())).unwrap();
        assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
    });
}

// ---------------------------------------------------------------------------
// Policy, roles, threads
// ---------------------------------------------------------------------------

#[test]
fn fail_open_passes_unverified_loads_with_a_warning_and_never_mismatches() {
    let mut rng = Rng::for_test("fail_open_passes_unverified_loads_with_a_warning_and_never_mismatches");
    let (_, producer, mut consumer) = transfer(&mut rng);
    let payload = produce(&producer, false);
    let verifier = consumer_verifier(&consumer, &consumer.records(Role::Consumer));
    let closed = verifier.check(REQ, None).unwrap();
    assert!(!closed.passed && closed.message.contains("fail-closed"));
    verifier.set_policy(Policy::FailOpen).unwrap();
    let open = verifier.check(REQ, None).unwrap();
    assert_eq!(open.verdict, Verdict::Unverified);
    assert!(
        open.passed && open.message.contains("fail-open: the load passes (warning)"),
        "{}",
        open.message
    );
    assert!(verifier.check(REQ, Some(&payload)).unwrap().passed);
    consumer.corrupt(0, 0, 0, 0, 0, 0);
    let verifier = consumer_verifier(&consumer, &consumer.records(Role::Consumer));
    verifier.set_policy(Policy::FailOpen).unwrap();
    let report = verifier.check(REQ, Some(&payload)).unwrap();
    assert_eq!(report.verdict, Verdict::Mismatch);
    assert!(!report.passed, "a mismatch fails under any policy");
}

#[test]
fn requests_are_checked_in_their_role_and_forgotten_on_request() {
    let mut rng = Rng::for_test("requests_are_checked_in_their_role_and_forgotten_on_request");
    let (_, producer, consumer) = transfer(&mut rng);
    let payload = produce(&producer, false);
    let verifier = consumer_verifier(&consumer, &consumer.records(Role::Consumer));
    assert!(matches!(verifier.payload(REQ), Err(Error::InvalidArgument(m)) if m.contains("consumer")));
    assert!(matches!(verifier.check("other", Some(&payload)), Err(Error::NotFound(m)) if m.contains("\"other\"")));
    assert!(verifier.forget(REQ).unwrap());
    assert!(!verifier.forget(REQ).unwrap());
    assert!(matches!(verifier.check(REQ, Some(&payload)), Err(Error::NotFound(_))));
    // Records of requests not expected are ignored; of other ranks refused.
    let verifier = Verifier::new(4).unwrap();
    verifier.add_record(&consumer.records(Role::Consumer)[0]).unwrap();
    let verifier = Verifier::new(3).unwrap();
    let error = verifier.add_record(&consumer.records(Role::Consumer)[0]).unwrap_err();
    assert!(
        matches!(&error, Error::InvalidArgument(m) if m.contains("tp_size 4 does not fit num_workers 3")),
        "{error}"
    );
    let producer_records = producer.records(Role::Producer);
    let verifier = Verifier::new(4).unwrap();
    verifier.expect(&consumer.blocks, Role::Consumer).unwrap();
    verifier.add_record(&consumer.records(Role::Consumer)[0]).unwrap();
    let error = verifier.add_record(&producer_records[0]).unwrap_err();
    assert!(
        matches!(&error, Error::InvalidArgument(m) if m.contains("differs from tp_size 4")),
        "{error}"
    );
}

#[test]
fn records_may_arrive_from_many_threads_at_once() {
    let mut rng = Rng::for_test("records_may_arrive_from_many_threads_at_once");
    let seed = rng.seed();
    let kv = gqa(&mut rng, 4, 8, 70);
    let producer = deploy(
        &mut rng,
        4,
        2,
        70,
        &one_group(&kv, LayoutKind::Hnd, 16, 0),
        &plain_identity,
    );
    let sequential = produce(&producer, false);
    let verifier = Arc::new(Verifier::new(8).unwrap());
    verifier.expect(&producer.blocks, Role::Producer).unwrap();
    let records = producer.records(Role::Producer);
    std::thread::scope(|scope| {
        for record in &records {
            let verifier = verifier.clone();
            scope.spawn(move || verifier.add_record(record).unwrap());
        }
    });
    assert_eq!(verifier.payload(REQ).unwrap().encode(), sequential, "seed {seed}");
}

// ---------------------------------------------------------------------------
// Algorithms of two versions (docs/VERSIONING.md): MIXED (kvcsum 0.2's
// default, algorithm 2) and MIXED2 (0.3's, algorithm 3)
// ---------------------------------------------------------------------------

/// Values of MIXED and of MIXED2 are never compared: through a payload, a
/// load of either algorithm against a producer of the other is unverified
/// (the algorithms differ), never a mismatch, whatever the data; workers of
/// both algorithms on one side make the load unverified too, and a producer
/// verifier refuses to make a payload of their records. Two sides of one
/// algorithm, MIXED included (a 0.3 engine set to algorithm 2 against a 0.2
/// peer), still match, and still see a corrupted byte.
#[test]
fn mixed_and_mixed2_values_are_never_compared() {
    use kvcsum::Algorithm::{Mixed, Mixed2};
    let mut rng = Rng::for_test("mixed_and_mixed2_values_are_never_compared");
    let seed = rng.seed();
    let kv = gqa(&mut rng, 4, 4, 70);
    let groups = one_group(&kv, LayoutKind::Hnd, 16, 0);
    let side_of = |rng: &mut Rng, algorithm, tp_size| {
        with_algorithm(algorithm, || deploy(rng, tp_size, 1, 70, &groups, &plain_identity))
    };
    for (producer_algorithm, consumer_algorithm) in [(Mixed, Mixed2), (Mixed2, Mixed)] {
        let producer = side_of(&mut rng, producer_algorithm, 2);
        let mut consumer = side_of(&mut rng, consumer_algorithm, 4);
        for extension in [false, true] {
            let payload = produce(&producer, extension);
            let decoded = Payload::decode(&payload).unwrap();
            assert_eq!(decoded.algorithm(), producer_algorithm, "seed {seed}");
            let report = check(&consumer, &payload);
            assert_unverified(&report, Reason::AlgorithmDiffers, seed);
            assert!(report.mismatches.is_empty(), "seed {seed}: {}", report.message);
            // Corrupted consumer data: still not a mismatch (not compared).
            consumer.corrupt(1, 0, 0, 2, 1, 20);
            let report = check(&consumer, &payload);
            assert_unverified(&report, Reason::AlgorithmDiffers, seed);
            consumer.corrupt(1, 0, 0, 2, 1, 20);
        }
        // The same algorithm on both sides compares: a match, then a
        // corrupted byte's mismatch.
        let mut same = side_of(&mut rng, producer_algorithm, 4);
        let payload = produce(&producer, false);
        assert_eq!(check(&same, &payload).verdict, Verdict::Match, "seed {seed}");
        same.corrupt(3, 0, 0, 1, 3, 40);
        assert_eq!(check(&same, &payload).verdict, Verdict::Mismatch, "seed {seed}");
    }
    // One side's workers of both algorithms (records): unverified on the
    // consumer, no payload on the producer.
    let mixed = side_of(&mut rng, Mixed, 2);
    let mixed2 = side_of(&mut rng, Mixed2, 2);
    let producer = side_of(&mut rng, Mixed2, 2);
    let records = vec![
        mixed.records(Role::Consumer)[0].clone(),
        mixed2.records(Role::Consumer)[1].clone(),
    ];
    let report = consumer_verifier(&mixed2, &records)
        .check(REQ, Some(&produce(&producer, true)))
        .unwrap();
    assert_unverified(&report, Reason::AlgorithmDiffers, seed);
    let verifier = Verifier::new(2).unwrap();
    verifier.expect(&mixed2.blocks, Role::Producer).unwrap();
    verifier.add_record(&mixed.records(Role::Producer)[0]).unwrap();
    verifier.add_record(&mixed2.records(Role::Producer)[1]).unwrap();
    let error = verifier.payload(REQ).unwrap_err();
    assert!(matches!(error, Error::InvalidArgument(_)), "seed {seed}: {error:?}");
    // A record says its algorithm: 2 and 3 read back as such.
    for (side, algorithm) in [(&mixed, Mixed), (&mixed2, Mixed2)] {
        let record = Record::decode(&side.records(Role::Consumer)[0]).unwrap();
        assert_eq!(record.algorithm, algorithm, "seed {seed}");
    }
}

/// Two engines wired by hand (no identity: every layer's identity empty,
/// so the fingerprints agree) whose caches have another geometry, as a
/// misconfigured side would: head size 64 against 32 (fp16: cells of 256
/// and 128 bytes), or fp16 against fp32 elements at head size 64 (256 and
/// 512). What each side registered tells it, and the payload extension
/// and records carry it with no call: the load is UNVERIFIED
/// (`GeometryDiffers`), naming the layer, the fact and both values,
/// whether the consumer's KV is intact or corrupted, never a MISMATCH.
/// The same geometry on both sides still matches.
#[test]
fn hand_wired_engines_of_another_head_size_or_element_width_are_unverified_never_a_mismatch() {
    let mut rng =
        Rng::for_test("hand_wired_engines_of_another_head_size_or_element_width_are_unverified_never_a_mismatch");
    let seed = rng.seed();
    let no_identity = |_: u32, _: u32| Vec::new();
    let kinds = [
        LayoutKind::Hnd,
        LayoutKind::Nhd,
        LayoutKind::KvSplit,
        LayoutKind::HndKvSplit,
    ];
    // (what, the producer's K bytes per head and token, the consumer's).
    let cases = [
        ("head size 64 against 32 (fp16)", 128u32, 64u32),
        ("head size 32 against 64 (fp16)", 64, 128),
        ("fp16 against fp32 (head size 64)", 128, 256),
        ("the same geometry", 128, 128),
    ];
    for (what, producer_k, consumer_k) in cases {
        for round in 0..3 {
            let num_tokens = 20 + rng.below(60);
            let block_size = *rng.pick(&[8u32, 16, 32]);
            let (p_tp, c_tp) = (1 + rng.below(2) as u32, 1 + rng.below(2) as u32);
            let (p_kind, c_kind) = (*rng.pick(&kinds), *rng.pick(&kinds));
            let p_kv = LogicalKv::random(&mut rng, KvShape::gqa(3, 4, producer_k, num_tokens));
            // The same geometry: the same KV (a transfer); another: KV of its own shape.
            let c_kv = if producer_k == consumer_k {
                p_kv.clone()
            } else {
                LogicalKv::random(&mut rng, KvShape::gqa(3, 4, consumer_k, num_tokens))
            };
            let producer = deploy(
                &mut rng,
                p_tp,
                1,
                num_tokens,
                &one_group(&p_kv, p_kind, block_size, 0),
                &no_identity,
            );
            let mut consumer = deploy(
                &mut rng,
                c_tp,
                1,
                num_tokens,
                &one_group(&c_kv, c_kind, block_size, 0),
                &no_identity,
            );
            let context = format!("{what}, round {round}, seed {seed}: TP {p_tp} {p_kind:?} -> TP {c_tp} {c_kind:?}, block size {block_size}");
            let payload = produce(&producer, true);
            for corrupted in [false, true] {
                if corrupted {
                    consumer.corrupt(0, 0, 0, 1, rng.below(4 / c_tp as u64) as u32, rng.below(num_tokens));
                }
                let report = check(&consumer, &payload);
                if producer_k == consumer_k {
                    let expected = if corrupted { Verdict::Mismatch } else { Verdict::Match };
                    assert_eq!(report.verdict, expected, "{context}: {}", report.message);
                    continue;
                }
                assert_unverified(&report, Reason::GeometryDiffers, seed);
                assert!(report.mismatches.is_empty(), "{context}: never a mismatch");
                let (p_cell, c_cell) = (2 * producer_k, 2 * consumer_k);
                for needle in [
                    "layer 0".to_owned(),
                    "cell_bytes".to_owned(),
                    format!("the producer's {p_cell}, the consumer's {c_cell}"),
                ] {
                    assert!(
                        report.message.contains(&needle),
                        "{context}, corrupted {corrupted}: {needle:?} in {}",
                        report.message
                    );
                }
            }
        }
    }
}

/// The width of a cell's pieces follows from its bytes (SPEC section 1: 8,
/// or 4 in a cell of a multiple of 4 and not of 8), which the geometry
/// carries: an indexer cache of 132-byte cells (vLLM's: 128 key bytes then
/// a 4-byte scale, 4-byte pieces) against one of 136 (8-byte pieces), on
/// engines wired by hand with no identity, is UNVERIFIED
/// (`GeometryDiffers`) naming both cell sizes, intact or corrupted, never
/// a MISMATCH; 132 against 132 matches and a corrupted scale mismatches.
#[test]
fn sides_whose_cells_have_pieces_of_other_widths_are_unverified_never_a_mismatch() {
    let mut rng = Rng::for_test("sides_whose_cells_have_pieces_of_other_widths_are_unverified_never_a_mismatch");
    let seed = rng.seed();
    let no_identity = |_: u32, _: u32| Vec::new();
    let indexer = |k_bytes: u32, v_bytes: u32, num_tokens: u64| KvShape {
        first_layer: 0,
        num_layers: 2,
        first_head: 0,
        total_kv_heads: 1,
        k_bytes,
        v_bytes,
        num_tokens,
    };
    for (producer_cell, consumer_cell) in [
        ((128u32, 4u32), (128u32, 4u32)),
        ((128, 4), (128, 8)),
        ((128, 8), (128, 4)),
    ] {
        let num_tokens = 20 + rng.below(60);
        let block_size = 16;
        let p_kv = LogicalKv::random(&mut rng, indexer(producer_cell.0, producer_cell.1, num_tokens));
        let same = producer_cell == consumer_cell;
        let c_kv = if same {
            p_kv.clone()
        } else {
            LogicalKv::random(&mut rng, indexer(consumer_cell.0, consumer_cell.1, num_tokens))
        };
        let producer = deploy(
            &mut rng,
            1,
            1,
            num_tokens,
            &one_group(&p_kv, LayoutKind::KeysThenScales, block_size, 0),
            &no_identity,
        );
        let mut consumer = deploy(
            &mut rng,
            2,
            1,
            num_tokens,
            &one_group(&c_kv, LayoutKind::KeysThenScales, block_size, 0),
            &no_identity,
        );
        let payload = produce(&producer, true);
        let (p_bytes, c_bytes) = (producer_cell.0 + producer_cell.1, consumer_cell.0 + consumer_cell.1);
        let context = format!("seed {seed}: cells of {p_bytes} and {c_bytes} bytes");
        for corrupted in [false, true] {
            if corrupted {
                // A byte of the scale (past the 128 key bytes) of a valid token.
                let token = rng.below(num_tokens);
                let table = consumer.table(0).clone();
                let block_id = table.block_ids[(token / block_size as u64) as usize];
                let slot = (token % block_size as u64) as u32;
                for rank in 0..2 {
                    consumer.ranks[rank].placements[0]
                        .1
                        .xor_byte(1, 0, block_id, slot, 129, 0x04);
                }
            }
            let report = check(&consumer, &payload);
            if same {
                let expected = if corrupted { Verdict::Mismatch } else { Verdict::Match };
                assert_eq!(
                    report.verdict, expected,
                    "{context}, corrupted {corrupted}: {}",
                    report.message
                );
                continue;
            }
            assert_unverified(&report, Reason::GeometryDiffers, seed);
            assert!(report.mismatches.is_empty(), "{context}: never a mismatch");
            let needle = format!("the producer's {p_bytes}, the consumer's {c_bytes}");
            assert!(
                report.message.contains(&needle),
                "{context}: {needle:?} in {}",
                report.message
            );
        }
    }
}

/// A plain payload (vLLM's, WEIGHTED, no extension) carries no geometry:
/// the limit SPEC section 10 states. Such hand-wired engines then compare
/// their values, and the difference is a MISMATCH as corrupted data would
/// be; with the extension (every MIXED2 producer sends it) it is
/// UNVERIFIED.
#[test]
fn a_plain_payload_carries_no_geometry() {
    let mut rng = Rng::for_test("a_plain_payload_carries_no_geometry");
    let seed = rng.seed();
    let no_identity = |_: u32, _: u32| Vec::new();
    with_algorithm(kvcsum::Algorithm::Weighted, || {
        let p_kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 128, 40));
        let c_kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 64, 40));
        let producer = deploy(
            &mut rng,
            1,
            1,
            40,
            &one_group(&p_kv, LayoutKind::Hnd, 16, 0),
            &no_identity,
        );
        let consumer = deploy(
            &mut rng,
            1,
            1,
            40,
            &one_group(&c_kv, LayoutKind::Hnd, 16, 0),
            &no_identity,
        );
        let verifier = consumer_verifier(&consumer, &consumer.records(Role::Consumer));
        verifier.set_producer_block_size(0, 16).unwrap();
        let report = verifier.check(REQ, Some(&produce(&producer, false))).unwrap();
        assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
        let report = check(&consumer, &produce(&producer, true));
        assert_unverified(&report, Reason::GeometryDiffers, seed);
    });
}
