//! State (Mamba) groups, SPEC section 6, against a naive reference that
//! loops over logical indices: a layer's tensors (conv, ssm) as rows of 2-
//! or 4-byte elements, split over TP ranks by rows; the known split sums to
//! the unsplit checksum, the shard-keyed form is the TP rank's one slice,
//! and a verifier reports a TP-size difference of shard-keyed state as
//! unverified, never as a mismatch.
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it state::<name>`.

use crate::support;

use kvcsum::record::Record;
use kvcsum::verify::{Reason, Verdict, Verifier};
use kvcsum::{BlockSet, Error, Role, StateSpec, Worker};
use support::state::*;
use support::*;

/// A deployment of one state group over `tp_size` host ranks.
struct StateSide {
    workers: Vec<Worker>,
    _caches: Vec<RankCaches>,
}

fn deploy(rng: &mut Rng, state: &LogicalState, tp_size: u32, split_known: bool, block_id: u32) -> StateSide {
    let mut workers = Vec::new();
    let mut caches = Vec::new();
    for tp_rank in 0..tp_size {
        let mut worker = host_worker(tp_rank, tp_size, 0, 1 + rng.below(3) as u32);
        let rank = place_rank(rng, state, tp_rank, tp_size, 3, split_known, block_id + 2, block_id);
        register(&mut worker, &rank, 3);
        workers.push(worker);
        caches.push(rank);
    }
    StateSide {
        workers,
        _caches: caches,
    }
}

#[test]
fn known_split_ranks_sum_to_the_unsplit_checksum_for_tp_1_2_4() {
    let mut rng = Rng::for_test("known_split_ranks_sum_to_the_unsplit_checksum_for_tp_1_2_4");
    let seed = rng.seed();
    for round in 0..4 {
        let state = random_state(&mut rng, &[2, 5, 9]);
        let expected = naive_unsplit(&state);
        for tp_size in [1, 2, 4] {
            let block_id = rng.below(6) as u32;
            let side = deploy(&mut rng, &state, tp_size, true, block_id);
            // num_tokens does not limit a state group: 0 tokens still checksum.
            let blocks = state_blocks("r", rng.below(3) * 40, 3, block_id);
            for role in [Role::Producer, Role::Consumer] {
                let total = side
                    .workers
                    .iter()
                    .fold(0u64, |sum, w| sum.wrapping_add(rank_value(w, &blocks, "r", 3, role)));
                assert_eq!(
                    total, expected,
                    "round {round}, TP {tp_size}, {role:?}: ranks sum to the unsplit checksum (seed {seed})"
                );
            }
        }
    }
}

/// A tier store of a state group's block keeps the naive state checksum
/// (its one block at position 0), a check of it matches, and a state
/// block at another position is refused, naming it.
#[test]
fn a_tier_store_of_a_state_block_keeps_its_naive_checksum() {
    use kvcsum::{StreamHandle, TierBlock, TierIndex, TierOutcome};
    let mut rng = Rng::for_test("a_tier_store_of_a_state_block_keeps_its_naive_checksum");
    let seed = rng.seed();
    let state = random_state(&mut rng, &[2, 5, 9]);
    let block_id = rng.below(6) as u32;
    let side = deploy(&mut rng, &state, 1, true, block_id);
    let hash = [7u8; 32];
    let block = |position| TierBlock {
        group_id: 3,
        position,
        block_id,
        hash: Some(&hash[..]),
    };
    let mut index = TierIndex::new(8).unwrap();
    index
        .store(&side.workers[0], &[block(0)], StreamHandle::legacy_default())
        .unwrap();
    assert_eq!(
        index.values(3, &hash).unwrap(),
        Some((0, vec![naive_unsplit(&state)])),
        "seed {seed}"
    );
    let outcomes = index
        .check(&side.workers[0], &[block(0)], StreamHandle::legacy_default())
        .unwrap();
    assert_eq!(outcomes, vec![TierOutcome::Matched], "seed {seed}");
    let error = index
        .store(&side.workers[0], &[block(1)], StreamHandle::legacy_default())
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("positions[0] 1 of group_id 3, a state group"),
        "{error} (seed {seed})"
    );
    assert_eq!(index.info().entries, 1, "seed {seed}");
}

#[test]
fn shard_keyed_state_is_the_ranks_one_slice() {
    let mut rng = Rng::for_test("shard_keyed_state_is_the_ranks_one_slice");
    let seed = rng.seed();
    let state = random_state(&mut rng, &[0, 7]);
    for tp_size in [1, 2, 4] {
        let side = deploy(&mut rng, &state, tp_size, false, 1);
        let blocks = state_blocks("r", 5, 3, 1);
        for (tp_rank, worker) in side.workers.iter().enumerate() {
            assert_eq!(
                rank_value(worker, &blocks, "r", 3, Role::Consumer),
                naive_shard(&state, tp_rank as u32, tp_size),
                "TP {tp_size} rank {tp_rank} (seed {seed})"
            );
        }
    }
}

#[test]
fn each_element_size_alone_matches_the_reference() {
    let mut rng = Rng::for_test("each_element_size_alone_matches_the_reference");
    let seed = rng.seed();
    for element_size in [2, 4] {
        let state = LogicalState {
            layers: vec![(4, vec![random_tensor(&mut rng, element_size, 8, 33)])],
        };
        let side = deploy(&mut rng, &state, 2, true, 0);
        let blocks = state_blocks("r", 1, 3, 0);
        let total = side.workers.iter().fold(0u64, |sum, w| {
            sum.wrapping_add(rank_value(w, &blocks, "r", 3, Role::Producer))
        });
        assert_eq!(
            total,
            naive_unsplit(&state),
            "element size {element_size} (seed {seed})"
        );
    }
}

#[test]
fn a_changed_element_or_a_write_outside_the_state_is_seen_or_ignored() {
    let mut rng = Rng::for_test("a_changed_element_or_a_write_outside_the_state_is_seen_or_ignored");
    let seed = rng.seed();
    let state = random_state(&mut rng, &[1]);
    let mut side = deploy(&mut rng, &state, 2, true, 2);
    let blocks = state_blocks("r", 9, 3, 2);
    let before = rank_value(&side.workers[1], &blocks, "r", 3, Role::Producer);
    // Another slot (block 3) is not the request's: writing it changes nothing.
    let spec = side._caches[1].specs[0].tensors[1];
    let other_slot = (spec.address as i64 + 3 * spec.block_stride) as usize as *mut u8;
    // SAFETY: the first byte of block 3 of a state tensor this test
    // allocated (`side._caches`, alive), which no worker call reads now.
    unsafe { *other_slot ^= 0x40 };
    assert_eq!(
        rank_value(&side.workers[1], &blocks, "r", 3, Role::Producer),
        before,
        "seed {seed}"
    );
    // One bit of the request's last ssm element changes the value.
    let last = (spec.address as i64 + 2 * spec.block_stride + (spec.num_rows as i64 - 1) * spec.row_stride) as usize
        + spec.bytes_per_row as usize
        - 1;
    // SAFETY: the last byte of block 2's last row, inside the tensor this
    // test allocated (`side._caches`, alive), which no worker call reads now.
    unsafe { *(last as *mut u8) ^= 0x01 };
    assert_ne!(
        rank_value(&side.workers[1], &blocks, "r", 3, Role::Producer),
        before,
        "seed {seed}"
    );
    side.workers.truncate(1);
}

#[test]
fn a_hybrid_model_checksums_attention_and_state_in_one_call() {
    let mut rng = Rng::for_test("a_hybrid_model_checksums_attention_and_state_in_one_call");
    let seed = rng.seed();
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(3, 4, 64, 75));
    let state = random_state(&mut rng, &[10, 11]);
    let count = positions_for(75, 16, 0, 0);
    let block_ids = BlockAllocator::new(&mut rng, count as u32 + 2).take(count);
    let mut total_state = 0u64;
    let mut total_kv = vec![0u64; count];
    for tp_rank in 0..2 {
        let mut worker = host_worker(tp_rank, 2, 0, 2);
        let shard = shard(&kv, tp_rank, 2, 0, 1);
        let mut placement = Placement::for_shard(&mut rng, &kv, &shard, LayoutKind::Nhd, 0, 16, count as u32 + 2);
        placement.write_request(&kv, 0, &block_ids);
        register_host(&mut worker, &placement);
        let caches = place_rank(&mut rng, &state, tp_rank, 2, 3, true, 4, 3);
        register(&mut worker, &caches, 3);
        let mut blocks = BlockSet::new();
        blocks.add_request("h", 75).unwrap();
        blocks.add_group("h", 0, 0, &block_ids).unwrap();
        blocks.add_group("h", 3, 0, &[3]).unwrap();
        let result = checksum(&worker, &blocks, Role::Consumer);
        let (_, state_values) = result.column("h", 3, 0).unwrap();
        total_state = total_state.wrapping_add(state_values[0]);
        let (_, kv_values) = result.column("h", 0, 0).unwrap();
        add_values(&mut total_kv, kv_values);
    }
    assert_eq!(total_state, naive_unsplit(&state), "state group (seed {seed})");
    assert_eq!(total_kv, naive_full(&kv, 16, 0, count), "attention group (seed {seed})");
}

/// Producer and consumer verifiers over state sides; the consumer's report.
fn verify(producer: &StateSide, consumer: &StateSide, blocks: &BlockSet) -> kvcsum::verify::Report {
    let records = |side: &StateSide, role| -> Vec<Vec<u8>> {
        side.workers
            .iter()
            .map(|w| Record::from_checksums(&checksum(w, blocks, role)).unwrap().encode())
            .collect()
    };
    let sender = Verifier::new(producer.workers.len() as u32).unwrap();
    sender.set_extension(true).unwrap();
    sender.expect(blocks, Role::Producer).unwrap();
    for record in records(producer, Role::Producer) {
        sender.add_record(&record).unwrap();
    }
    let payload = sender.payload("r").unwrap().encode();
    let receiver = Verifier::new(consumer.workers.len() as u32).unwrap();
    receiver.expect(blocks, Role::Consumer).unwrap();
    for record in records(consumer, Role::Consumer) {
        receiver.add_record(&record).unwrap();
    }
    receiver.check("r", Some(&payload)).unwrap()
}

#[test]
fn verifier_matches_known_splits_across_tp_and_reports_shard_keyed_tp_differences_as_unverified() {
    let mut rng =
        Rng::for_test("verifier_matches_known_splits_across_tp_and_reports_shard_keyed_tp_differences_as_unverified");
    let seed = rng.seed();
    let state = random_state(&mut rng, &[3, 4]);
    let blocks = state_blocks("r", 30, 3, 1);
    // Known split: TP 2 against TP 4 matches, a flipped bit mismatches at 0.
    let producer = deploy(&mut rng, &state, 2, true, 1);
    let consumer = deploy(&mut rng, &state, 4, true, 1);
    let report = verify(&producer, &consumer, &blocks);
    assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
    let spec = consumer._caches[2].specs[1].tensors[0];
    // SAFETY: the first byte of block 1 of a state tensor this test
    // allocated (`consumer._caches`, alive), which no worker call reads now.
    unsafe { *((spec.address as i64 + spec.block_stride) as usize as *mut u8) ^= 0x04 };
    let report = verify(&producer, &consumer, &blocks);
    assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
    assert_eq!(report.mismatches.len(), 1, "seed {seed}: {}", report.message);
    let mismatch = &report.mismatches[0];
    assert_eq!(
        (mismatch.group_id, mismatch.first_position, mismatch.num_positions),
        (3, 0, 1)
    );
    // Shard-keyed: equal TP sizes match, different ones are unverified.
    let producer = deploy(&mut rng, &state, 2, false, 1);
    let same = deploy(&mut rng, &state, 2, false, 1);
    let report = verify(&producer, &same, &blocks);
    assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
    let other = deploy(&mut rng, &state, 4, false, 1);
    let report = verify(&producer, &other, &blocks);
    assert_eq!(report.verdict, Verdict::Unverified, "seed {seed}: {}", report.message);
    assert_eq!(report.reason(), Some(Reason::StateTpDiffers), "{}", report.message);
}

#[test]
fn bad_state_registrations_are_rejected_and_change_nothing() {
    let mut rng = Rng::for_test("bad_state_registrations_are_rejected_and_change_nothing");
    let state = random_state(&mut rng, &[2]);
    let caches = place_rank(&mut rng, &state, 0, 1, 3, true, 2, 0);
    let mut worker = host_worker(0, 1, 0, 1);
    register(&mut worker, &caches, 3);
    worker.add_group(4, 16).unwrap();
    let good = caches.specs[0].clone();
    let with = |change: &dyn Fn(&mut StateSpec)| {
        let mut spec = good.clone();
        spec.layer_number = 20;
        change(&mut spec);
        spec
    };
    type Check = fn(&Error) -> bool;
    let invalid: Check = |e| matches!(e, Error::InvalidArgument(_));
    let cases: Vec<(StateSpec, Check, &str)> = vec![
        (with(&|s| s.tensors[0].element_size = 3), invalid, "element_size is 3"),
        (with(&|s| s.tensors[1].bytes_per_row = 6), invalid, "bytes_per_row 6"),
        (with(&|s| s.tensors[0].num_rows = 0), invalid, "num_rows is 0"),
        (with(&|s| s.tensors.clear()), invalid, "num_tensors is 0"),
        (with(&|s| s.num_blocks = 0), invalid, "num_blocks is 0"),
        (with(&|s| s.tensors[1].first_row = 1), invalid, "exceeds total_rows"),
        (
            with(&|s| s.tensors[0].address = 4096),
            |e| matches!(e, Error::OutOfBounds(_)),
            "no registered region",
        ),
        (
            with(&|s| s.tensors[1].row_stride = 6),
            |e| matches!(e, Error::Unsupported(_)),
            "row_stride 6",
        ),
        (
            with(&|s| s.tensors[0].total_rows = 70000),
            |e| matches!(e, Error::Unsupported(_)),
            "65536",
        ),
        (
            with(&|s| s.num_blocks = 1000),
            |e| matches!(e, Error::OutOfBounds(_)),
            "no registered region",
        ),
        (with(&|s| s.split_known = false), invalid, "split_known is 0"),
        (
            with(&|s| s.group_id = 9),
            |e| matches!(e, Error::NotFound(_)),
            "group_id 9",
        ),
        (with(&|s| s.layer_number = 2), invalid, "already registered"),
    ];
    let blocks = state_blocks("r", 1, 3, 0);
    let before = rank_value(&worker, &blocks, "r", 3, Role::Producer);
    for (spec, kind, names) in cases {
        let error = worker.add_state(spec).unwrap_err();
        assert!(kind(&error), "{error}");
        assert!(error.to_string().contains(names), "{error} should name {names}");
    }
    assert_eq!(
        rank_value(&worker, &blocks, "r", 3, Role::Producer),
        before,
        "nothing changed"
    );
    // Attention layers and state layers do not share a group.
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(1, 1, 64, 16));
    let placement = Placement::for_shard(&mut rng, &kv, &shard(&kv, 0, 1, 0, 1), LayoutKind::Hnd, 3, 16, 2);
    for region in placement.regions(&placement.host_bases()) {
        worker.add_region(region).unwrap();
    }
    let error = worker.add_layer(placement.host_layer_specs()[0].clone()).unwrap_err();
    assert!(error.to_string().contains("state group"), "{error}");
    let mut spec = placement.host_layer_specs()[0].clone();
    spec.group_id = 4;
    worker.add_layer(spec).unwrap();
    let error = worker.add_state(with(&|s| s.group_id = 4)).unwrap_err();
    assert!(error.to_string().contains("holds attention layers"), "{error}");
    // A state group's blocks: one, at position 0.
    let mut blocks = BlockSet::new();
    blocks.add_request("r", 10).unwrap();
    blocks.add_group("r", 3, 1, &[0]).unwrap();
    let error = worker.checksum(&blocks, Role::Producer, kvcsum::StreamHandle::legacy_default());
    let error = error.err().expect("position 1 is refused");
    assert!(matches!(error, Error::InvalidArgument(_)), "{error}");
    assert!(error.to_string().contains("state group"), "{error}");
}

/// A state entry a connector keeps (`kvcs_result_entries`) or a store
/// writes while the state's split is known reads back as another
/// configuration (the marks differ, SPEC section 7) when checked as
/// shard-keyed state over the same bytes, and the other way round: never
/// a match, never a failure. Under the same convention it matches, and
/// `entries()` is what the store wrote.
#[test]
fn kept_state_entries_never_pass_between_split_known_and_shard_keyed() {
    let mut rng = Rng::for_test("kept_state_entries_never_pass_between_split_known_and_shard_keyed");
    let seed = rng.seed();
    let state = random_state(&mut rng, &[1, 4]);
    let block_id = rng.below(4) as u32;
    let hash: Vec<u8> = (0..32).map(|_| rng.next_u64() as u8).collect();
    let mut blocks = state_blocks("r", 1 + rng.below(100), 3, block_id);
    blocks.set_hashes("r", 3, &hash, 32).unwrap();
    // One TP rank per convention, each with a buffer of stored checksums.
    let side = |rng: &mut Rng, split_known: bool| {
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
    for (stored_known, checked_known) in [(true, false), (false, true), (true, true), (false, false)] {
        let (storer, _storer_caches, stored) = side(&mut rng, stored_known);
        let (checker, _checker_caches, mut checker_stored) = side(&mut rng, checked_known);
        let kept = kvcsum::result_entries(&checksum(&storer, &blocks, Role::Consumer), "r", 3).unwrap();
        storer.store(&blocks, kvcsum::StreamHandle::legacy_default()).unwrap();
        let written = (stored[block_id as usize][0], stored[block_id as usize][1]);
        assert_eq!(kept, vec![written], "entries() is what a store writes (seed {seed})");
        checker_stored.copy_from_slice(&stored);
        let expected = if stored_known == checked_known {
            kvcsum::StoredOutcome::Matched
        } else {
            kvcsum::StoredOutcome::OtherFingerprint
        };
        let kept_outcome =
            kvcsum::check_result_entries(&checksum(&checker, &blocks, Role::Consumer), "r", 3, &kept).unwrap();
        let buffer_outcome = checker
            .check_stored(&blocks, kvcsum::StreamHandle::legacy_default())
            .unwrap()
            .stored_outcomes("r", 3)
            .unwrap();
        for (path, outcome) in [("kept", kept_outcome), ("stored", buffer_outcome)] {
            assert_eq!(
                outcome,
                vec![expected],
                "{path}: stored split known {stored_known}, checked split known {checked_known} (seed {seed})"
            );
        }
        drop(checker);
    }
}
