//! Layer decodings (SPEC section 7, "Decoding"): the same KV bytes read
//! back as other numbers (another element type, head size, K or V scale)
//! checksum alike, so a load whose two sides declare such a fact
//! differently is unverified (`DecodingDiffers`, naming the layer, the fact
//! and both values), never a match; a fact declared on one side only is
//! not compared; a side's workers that disagree are unverified, and a
//! producer's make no payload.
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it decoding::`.

use crate::support;

use kvcsum::payload::Payload;
use kvcsum::record::Record;
use kvcsum::verify::{Reason, Report, Verdict, Verifier};
use kvcsum::{Algorithm, BlockSet, Error, LayerDecoding, Role};
use support::*;

const REQ: &str = "req-decoding";

fn fp8(k_scale: f64, v_scale: f64) -> LayerDecoding {
    LayerDecoding::from_parts("fp8_e4m3", 128, k_scale.to_bits(), v_scale.to_bits()).unwrap()
}

/// The model: 3 layers (numbers 0..3) of 4 KV heads, 16-token blocks.
fn model(rng: &mut Rng, num_tokens: u64) -> (LogicalKv, GroupTable) {
    let kv = LogicalKv::random(rng, KvShape::gqa(3, 4, 64, num_tokens));
    let count = positions_for(num_tokens, 16, 0, 0);
    let table = GroupTable {
        group_id: 0,
        first_position: 0,
        block_ids: BlockAllocator::new(rng, count as u32 + 3).take(count),
    };
    (kv, table)
}

/// One side: host workers of TP `tp_size` x PP `pp_size` over `kv`.
struct Side {
    ranks: Vec<HostRank>,
    blocks: BlockSet,
}

fn side(rng: &mut Rng, kv: &LogicalKv, table: &GroupTable, tp_size: u32, pp_size: u32, kind: LayoutKind) -> Side {
    let deploy = Deploy {
        tp_size,
        pp_size,
        kind,
        group_id: 0,
        block_size: 16,
        num_blocks: table.block_ids.len() as u32 + 3,
        num_threads: 1,
    };
    let ranks = deploy_host(rng, deploy, &[(kv, table)]);
    let blocks = block_set(&[TestRequest {
        req_id: REQ.to_owned(),
        num_tokens: kv.num_tokens(),
        tables: vec![table.clone()],
    }]);
    Side { ranks, blocks }
}

impl Side {
    /// Declares `decoding` for `layer_number` on every worker that holds it.
    fn declare(&mut self, layer_number: u32, decoding: &LayerDecoding) {
        for rank in &mut self.ranks {
            if rank.shard.layer_numbers.contains(&layer_number) {
                rank.worker
                    .set_layer_decoding(0, layer_number, decoding.clone())
                    .unwrap();
            }
        }
    }

    fn verifier(&self, role: Role) -> Verifier {
        let verifier = Verifier::new(self.ranks.len() as u32).unwrap();
        verifier.expect(&self.blocks, role).unwrap();
        for rank in &self.ranks {
            let record = Record::from_checksums(&checksum(&rank.worker, &self.blocks, role)).unwrap();
            verifier.add_record(&record.encode()).unwrap();
        }
        verifier
    }

    fn payload(&self) -> kvcsum::Result<Vec<u8>> {
        Ok(self.verifier(Role::Producer).payload(REQ)?.encode())
    }

    fn check(&self, payload: &[u8]) -> Report {
        let verifier = self.verifier(Role::Consumer);
        // Both sides have 16-token blocks, which a plain payload does not
        // say (SPEC section 10, reason 14).
        verifier.set_producer_block_size(0, 16).unwrap();
        verifier.check(REQ, Some(payload)).unwrap()
    }
}

fn unverified_decoding(report: &Report, needles: &[&str], seed: u64) {
    assert_eq!(report.verdict, Verdict::Unverified, "seed {seed}: {}", report.message);
    assert_eq!(
        report.reason(),
        Some(Reason::DecodingDiffers),
        "seed {seed}: {}",
        report.message
    );
    for needle in needles {
        assert!(
            report.message.contains(needle),
            "seed {seed}: {needle:?} in {}",
            report.message
        );
    }
}

#[test]
fn differing_scales_are_unverified_not_a_match() {
    // The KV bytes are the same on both sides (so the checksums match);
    // the consumer reads layer 1's K with twice the scale.
    for_each_algorithm(|algorithm| {
        let mut rng = Rng::for_test("differing_scales_are_unverified_not_a_match");
        let seed = rng.seed();
        let (kv, table) = model(&mut rng, 70);
        let mut producer = side(&mut rng, &kv, &table, 2, 1, LayoutKind::Hnd);
        let mut consumer = side(&mut rng, &kv, &table, 4, 1, LayoutKind::KvSplit);
        for layer in 0..3 {
            producer.declare(layer, &fp8(0.0125, 0.5));
            consumer.declare(layer, &fp8(0.0125, 0.5));
        }
        let verifier = producer.verifier(Role::Producer);
        verifier.set_extension(true).unwrap();
        let payload = verifier.payload(REQ).unwrap().encode();
        let report = consumer.check(&payload);
        assert_eq!(
            report.verdict,
            Verdict::Match,
            "{algorithm:?}, seed {seed}: {}",
            report.message
        );
        consumer.declare(1, &fp8(0.025, 0.5));
        let report = consumer.check(&payload);
        unverified_decoding(
            &report,
            &[
                "group 0, layer 1: k_scale differs",
                "the producer's 0.0125 (bits 0x3f8999999999999a)",
                "the consumer's 0.025 (bits 0x3f9999999999999a)",
            ],
            seed,
        );
        // The smallest difference of a scale is one too.
        consumer.declare(1, &fp8(0.0125, f64::from_bits(0.5f64.to_bits() + 1)));
        unverified_decoding(&consumer.check(&payload), &["layer 1: v_scale differs"], seed);
        // Another element type of the same size, another head size.
        let e5m2 = LayerDecoding::from_parts("fp8_e5m2", 128, 0.0125f64.to_bits(), 0.5f64.to_bits()).unwrap();
        consumer.declare(1, &e5m2);
        unverified_decoding(
            &consumer.check(&payload),
            &["layer 1: dtype differs: the producer's \"fp8_e4m3\", the consumer's \"fp8_e5m2\""],
            seed,
        );
        let head_64 = LayerDecoding::from_parts("fp8_e4m3", 64, 0.0125f64.to_bits(), 0.5f64.to_bits()).unwrap();
        consumer.declare(1, &head_64);
        unverified_decoding(&consumer.check(&payload), &["layer 1: head_size differs"], seed);
    });
}

#[test]
fn a_fact_declared_on_one_side_only_compares_as_before() {
    let mut rng = Rng::for_test("a_fact_declared_on_one_side_only_compares_as_before");
    let seed = rng.seed();
    let (kv, table) = model(&mut rng, 50);
    let mut producer = side(&mut rng, &kv, &table, 1, 1, LayoutKind::Nhd);
    let mut consumer = side(&mut rng, &kv, &table, 2, 1, LayoutKind::Hnd);
    let undeclared = producer.payload().unwrap();
    producer.declare(0, &fp8(0.5, 0.25));
    // Only the element type on the consumer: the scales are not compared.
    consumer.declare(0, &LayerDecoding::from_parts("fp8_e4m3", 0, 0, 0).unwrap());
    consumer.declare(2, &fp8(1.0, 1.0));
    let declared = producer.payload().unwrap();
    for payload in [&undeclared, &declared] {
        let report = consumer.check(payload);
        assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
    }
    // Declarations never hide corruption: a flipped byte still mismatches.
    let position = rng.below(table.block_ids.len() as u64 - 1) as usize;
    let first_head = consumer.ranks[1].placements[0].spec().first_head;
    consumer.ranks[1].placements[0].xor_byte(2, first_head, table.block_ids[position], 1, 9, 0x10);
    let report = consumer.check(&declared);
    assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
    assert_eq!(report.mismatches[0].first_position, position as u64, "seed {seed}");
}

#[test]
fn a_plain_payload_carries_no_decodings() {
    // vLLM's plain payload (WEIGHTED, no extension) says nothing of how the
    // producer decodes: the consumer's declarations are not compared (SPEC
    // section 7 says so).
    with_algorithm(Algorithm::Weighted, || {
        let mut rng = Rng::for_test("a_plain_payload_carries_no_decodings");
        let seed = rng.seed();
        let (kv, table) = model(&mut rng, 40);
        let mut producer = side(&mut rng, &kv, &table, 1, 1, LayoutKind::Nhd);
        let mut consumer = side(&mut rng, &kv, &table, 1, 1, LayoutKind::Hnd);
        producer.declare(0, &fp8(0.5, 0.5));
        consumer.declare(0, &fp8(0.25, 0.5));
        let plain = producer.payload().unwrap();
        assert!(Payload::decode(&plain).unwrap().extension.is_none());
        let report = consumer.check(&plain);
        assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
        // The same WEIGHTED producer with the extension says it.
        let verifier = producer.verifier(Role::Producer);
        verifier.set_extension(true).unwrap();
        let extended = verifier.payload(REQ).unwrap().encode();
        unverified_decoding(&consumer.check(&extended), &["layer 0: k_scale differs"], seed);
    });
}

#[test]
fn workers_of_one_side_that_disagree_are_unverified_and_make_no_payload() {
    let mut rng = Rng::for_test("workers_of_one_side_that_disagree_are_unverified_and_make_no_payload");
    let seed = rng.seed();
    let (kv, table) = model(&mut rng, 45);
    let mut producer = side(&mut rng, &kv, &table, 2, 1, LayoutKind::Nhd);
    let payload = producer.payload().unwrap();
    let mut consumer = side(&mut rng, &kv, &table, 2, 1, LayoutKind::Hnd);
    consumer.ranks[0]
        .worker
        .set_layer_decoding(0, 2, fp8(0.5, 0.5))
        .unwrap();
    consumer.ranks[1]
        .worker
        .set_layer_decoding(0, 2, fp8(0.5, 0.75))
        .unwrap();
    unverified_decoding(
        &consumer.check(&payload),
        &[
            "layer 2: worker (pp_rank 0, tp_rank 0) declares v_scale 0.5",
            "tp_rank 1) declares 0.75",
        ],
        seed,
    );
    producer.ranks[1]
        .worker
        .set_layer_decoding(0, 0, fp8(0.5, 0.5))
        .unwrap();
    producer.ranks[0]
        .worker
        .set_layer_decoding(0, 0, fp8(0.25, 0.5))
        .unwrap();
    match producer.payload() {
        Err(Error::InvalidArgument(message)) => {
            assert!(message.contains("decode a layer's bytes differently"), "{message}");
            assert!(message.contains("layer 0"), "{message}");
        }
        other => panic!("seed {seed}: expected no payload, got {other:?}"),
    }
}

#[test]
fn facts_of_several_workers_and_stages_travel_together() {
    // PP 2 x TP 2: each stage declares its own layers, and the two ranks of
    // stage 0 declare different facts of layer 0; the payload carries each
    // layer's facts once, merged.
    let mut rng = Rng::for_test("facts_of_several_workers_and_stages_travel_together");
    let (kv, table) = model(&mut rng, 33);
    let mut producer = side(&mut rng, &kv, &table, 2, 2, LayoutKind::Nhd);
    let stage_of = |layer: u32| {
        producer_stage_layers(&producer)
            .iter()
            .position(|layers| layers.contains(&layer))
            .unwrap()
    };
    let (stage_0, stage_1) = (stage_of(0), stage_of(2));
    assert_ne!(stage_0, stage_1, "the layers are split over the stages");
    producer.ranks[stage_0 * 2]
        .worker
        .set_layer_decoding(0, 0, LayerDecoding::from_parts("fp8_e4m3", 0, 0, 0).unwrap())
        .unwrap();
    producer.ranks[stage_0 * 2 + 1]
        .worker
        .set_layer_decoding(0, 0, LayerDecoding::from_parts("", 128, 0.5f64.to_bits(), 0).unwrap())
        .unwrap();
    producer.declare(2, &LayerDecoding::from_parts("bfloat16", 128, 0, 0).unwrap());
    let payload = Payload::decode(&producer.payload().unwrap()).unwrap();
    let decodings = &payload.extension.as_ref().unwrap().groups[0].decodings;
    assert_eq!(
        decodings
            .iter()
            .map(|(layer, d)| (*layer, d.parts()))
            .collect::<Vec<_>>(),
        vec![
            (0, ("fp8_e4m3", 128, 0.5f64.to_bits(), 0)),
            (2, ("bfloat16", 128, 0, 0)),
        ]
    );
}

/// The layer numbers of each PP stage of a side (stage by stage).
fn producer_stage_layers(side: &Side) -> Vec<Vec<u32>> {
    side.ranks
        .chunks(2)
        .map(|stage| stage[0].shard.layer_numbers.clone())
        .collect()
}

#[test]
fn declarations_replace_earlier_ones_and_bad_ones_change_nothing() {
    let mut rng = Rng::for_test("declarations_replace_earlier_ones_and_bad_ones_change_nothing");
    let (kv, table) = model(&mut rng, 20);
    let mut producer = side(&mut rng, &kv, &table, 1, 1, LayoutKind::Nhd);
    producer.declare(1, &fp8(0.5, 0.5));
    producer.declare(1, &fp8(0.125, 0.5));
    let record =
        |side: &Side| Record::from_checksums(&checksum(&side.ranks[0].worker, &side.blocks, Role::Producer)).unwrap();
    let before = record(&producer);
    assert_eq!(
        before.groups[0].decodings,
        vec![(1, fp8(0.125, 0.5))],
        "the later declaration"
    );
    let worker = &mut producer.ranks[0].worker;
    let error = worker.set_layer_decoding(0, 7, fp8(1.0, 1.0)).unwrap_err();
    assert!(
        matches!(&error, Error::NotFound(m) if m.contains("layer_number 7")),
        "{error}"
    );
    let error = worker.set_layer_decoding(3, 1, fp8(1.0, 1.0)).unwrap_err();
    assert!(
        matches!(&error, Error::NotFound(m) if m.contains("group_id 3")),
        "{error}"
    );
    assert_eq!(
        record(&producer).encode(),
        before.encode(),
        "failed calls changed nothing"
    );
    assert_eq!(
        Record::decode(&before.encode()).unwrap(),
        before,
        "records carry decodings"
    );
}

#[test]
fn a_tier_stored_under_other_decodings_reads_back_as_another_configuration() {
    // Stored checksums (SPEC section 8) are stamped with the worker's
    // declarations too: a block stored while layer 1 was read with one
    // scale and checked while it is read with another is not compared
    // (other fingerprint), and with the same declarations again it matches.
    let mut rng = Rng::for_test("a_tier_stored_under_other_decodings_reads_back_as_another_configuration");
    let seed = rng.seed();
    let (kv, table) = model(&mut rng, 37);
    let mut producer = side(&mut rng, &kv, &table, 1, 1, LayoutKind::Nhd);
    let count = table.block_ids.len();
    let num_blocks = count as u64 + 3;
    let stored: Vec<[u64; 2]> = (0..num_blocks).map(|_| [rng.next_u64(), rng.next_u64()]).collect();
    let worker = &mut producer.ranks[0].worker;
    let region = kvcsum::Region {
        address: stored.as_ptr() as u64,
        length: std::mem::size_of_val(stored.as_slice()) as u64,
    };
    worker.add_region(region).unwrap();
    worker.add_stored(0, stored.as_ptr() as u64, num_blocks).unwrap();
    let mut blocks = producer.blocks.clone();
    let hashes: Vec<u8> = (0..count * 32).map(|_| rng.next_u64() as u8).collect();
    blocks.set_hashes(REQ, 0, &hashes, 32).unwrap();
    let outcomes = |worker: &kvcsum::Worker| {
        let result = worker
            .check_stored(&blocks, kvcsum::StreamHandle::legacy_default())
            .unwrap();
        result.stored_outcomes(REQ, 0).unwrap()
    };
    worker.set_layer_decoding(0, 1, fp8(0.5, 0.5)).unwrap();
    worker.store(&blocks, kvcsum::StreamHandle::legacy_default()).unwrap();
    let matched = vec![kvcsum::StoredOutcome::Matched; count];
    assert_eq!(outcomes(worker), matched, "seed {seed}");
    worker.set_layer_decoding(0, 1, fp8(0.25, 0.5)).unwrap();
    assert_eq!(
        outcomes(worker),
        vec![kvcsum::StoredOutcome::OtherFingerprint; count],
        "seed {seed}: another scale is another configuration, never a match or a failure"
    );
    worker.set_layer_decoding(0, 1, fp8(0.5, 0.5)).unwrap();
    assert_eq!(outcomes(worker), matched, "seed {seed}");
}

/// A side of one TP rank with a buffer of stored checksums for group 0
/// (junk, so that a value never written cannot pass) and `blocks` with
/// block hashes.
struct TierSide {
    side: Side,
    stored: Vec<[u64; 2]>,
    blocks: BlockSet,
}

fn tier_side(rng: &mut Rng, kv: &LogicalKv, table: &GroupTable, hashes: &[u8]) -> TierSide {
    let mut side = side(rng, kv, table, 1, 1, LayoutKind::Nhd);
    let num_blocks = table.block_ids.len() as u64 + 3;
    let stored: Vec<[u64; 2]> = (0..num_blocks).map(|_| [rng.next_u64(), rng.next_u64()]).collect();
    let worker = &mut side.ranks[0].worker;
    worker
        .add_region(kvcsum::Region {
            address: stored.as_ptr() as u64,
            length: std::mem::size_of_val(stored.as_slice()) as u64,
        })
        .unwrap();
    worker.add_stored(0, stored.as_ptr() as u64, num_blocks).unwrap();
    let mut blocks = side.blocks.clone();
    blocks.set_hashes(REQ, 0, hashes, 32).unwrap();
    TierSide { side, stored, blocks }
}

impl TierSide {
    fn worker(&self) -> &kvcsum::Worker {
        &self.side.ranks[0].worker
    }

    /// The entries a connector keeps (`kvcs_result_entries` of a consumer
    /// checksum).
    fn kept_entries(&self) -> Vec<(u64, u64)> {
        let result = checksum(self.worker(), &self.blocks, Role::Consumer);
        kvcsum::result_entries(&result, REQ, 0).unwrap()
    }

    /// `kvcs_result_check_entries` of kept `entries`.
    fn check_kept(&self, entries: &[(u64, u64)]) -> Vec<kvcsum::StoredOutcome> {
        let result = checksum(self.worker(), &self.blocks, Role::Consumer);
        kvcsum::check_result_entries(&result, REQ, 0, entries).unwrap()
    }

    /// The entries in the buffer at the table's block ids.
    fn buffer_entries(&self, table: &GroupTable) -> Vec<(u64, u64)> {
        table
            .block_ids
            .iter()
            .map(|&id| (self.stored[id as usize][0], self.stored[id as usize][1]))
            .collect()
    }

    /// A load check of the buffer (`kvcs_worker_check_stored`).
    fn check_buffer(&self) -> Vec<kvcsum::StoredOutcome> {
        self.worker()
            .check_stored(&self.blocks, kvcsum::StreamHandle::legacy_default())
            .unwrap()
            .stored_outcomes(REQ, 0)
            .unwrap()
    }
}

/// Entries a connector keeps (`kvcs_result_entries`,
/// `kvcs_result_check_entries`) follow the rule stores follow (SPEC
/// section 8: the marked fingerprint plus the digest of the declared
/// decodings): an entry made while a layer was read as bfloat16, with K
/// scale 0.5 or head size 64, or with a fact declared on one side only,
/// reads back as another configuration (never a match, never a failure)
/// when checked while it is read as fp8_e4m3, with K scale 1.0 or head
/// size 128, on either path; and what `entries()` gives is byte for byte
/// what a store writes, declarations or not.
#[test]
fn kept_entries_never_pass_across_a_change_of_decoding() {
    let mut rng = Rng::for_test("kept_entries_never_pass_across_a_change_of_decoding");
    let seed = rng.seed();
    let decl = |dtype: &str, head_size: u32, k_scale: f64| {
        Some(LayerDecoding::from_parts(dtype, head_size, if k_scale > 0.0 { k_scale.to_bits() } else { 0 }, 0).unwrap())
    };
    let cases: [(&str, Option<LayerDecoding>, Option<LayerDecoding>); 6] = [
        ("dtype", decl("bfloat16", 0, 0.0), decl("fp8_e4m3", 0, 0.0)),
        ("k_scale", decl("fp8_e4m3", 0, 0.5), decl("fp8_e4m3", 0, 1.0)),
        ("head_size", decl("bfloat16", 64, 0.0), decl("bfloat16", 128, 0.0)),
        ("declared when stored only", decl("bfloat16", 0, 0.0), None),
        ("declared when checked only", None, decl("fp8_e4m3", 0, 0.0)),
        ("the same", decl("fp8_e4m3", 128, 0.5), decl("fp8_e4m3", 128, 0.5)),
    ];
    for (what, stored_under, checked_under) in cases {
        let num_tokens = 20 + rng.below(40);
        let (kv, table) = model(&mut rng, num_tokens);
        let count = table.block_ids.len();
        let hashes: Vec<u8> = (0..count * 32).map(|_| rng.next_u64() as u8).collect();
        let mut storer = tier_side(&mut rng, &kv, &table, &hashes);
        let mut checker = tier_side(&mut rng, &kv, &table, &hashes);
        if let Some(decoding) = &stored_under {
            storer.side.declare(1, decoding);
        }
        if let Some(decoding) = &checked_under {
            checker.side.declare(1, decoding);
        }
        let kept = storer.kept_entries();
        storer
            .worker()
            .store(&storer.blocks, kvcsum::StreamHandle::legacy_default())
            .unwrap();
        assert_eq!(
            kept,
            storer.buffer_entries(&table),
            "{what}: entries() is what a store writes (seed {seed})"
        );
        // The same entries, kept or carried in the buffer, checked by the
        // other side over the same KV.
        checker.stored.copy_from_slice(&storer.stored);
        let expected = if stored_under == checked_under {
            kvcsum::StoredOutcome::Matched
        } else {
            kvcsum::StoredOutcome::OtherFingerprint
        };
        assert_eq!(
            checker.check_kept(&kept),
            vec![expected; count],
            "{what}: kept entries checked under {checked_under:?}, stored under {stored_under:?} (seed {seed})"
        );
        assert_eq!(
            checker.check_buffer(),
            vec![expected; count],
            "{what}: stored entries (seed {seed})"
        );
    }
}
