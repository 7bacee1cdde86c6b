//! Token placement (SPEC section 16): DCP token shards and compressed
//! slots, against a naive reference that walks vLLM's forward map (each
//! in-block unit offset to its rank and local slot) and numbers every
//! slot by its unit in the request.

use kvcsum::record::Record;
use kvcsum::verify::{Reason, Verdict, Verifier};
use kvcsum::{BlockSet, GroupPlacement, Role, StreamHandle, TierBlock, TierIndex, TierOutcome, Worker};

use crate::support::token_placement::*;
use crate::support::{host_worker, Rng};

fn blocks(num_tokens: u64, block_ids: &[u32]) -> BlockSet {
    let mut blocks = BlockSet::new();
    blocks.add_request(REQ, num_tokens).unwrap();
    blocks.add_group(REQ, GROUP, 0, block_ids).unwrap();
    blocks
}

fn values(worker: &Worker, blocks: &BlockSet, role: Role) -> (Vec<u64>, Vec<u8>) {
    let result = worker.checksum(blocks, role, StreamHandle::legacy_default()).unwrap();
    result.wait().unwrap();
    let (_, column) = result.column(REQ, GROUP, 0).unwrap();
    (column.to_vec(), Record::from_checksums(&result).unwrap().encode())
}

/// The cases: DCP sizes 1, 2 and 4 with interleaves 1 and 2, and
/// compressed slots of 4 tokens (alone and under DCP 2).
fn cases() -> Vec<GroupPlacement> {
    let mut cases = Vec::new();
    for dcp_size in [1u32, 2, 4] {
        for interleave in [1u32, 2] {
            cases.push(GroupPlacement {
                dcp_size,
                dcp_rank: 0,
                interleave,
                tokens_per_slot: 1,
            });
        }
    }
    cases.push(GroupPlacement {
        tokens_per_slot: 4,
        ..GroupPlacement::DEFAULT
    });
    cases.push(GroupPlacement {
        dcp_size: 2,
        dcp_rank: 0,
        interleave: 2,
        tokens_per_slot: 4,
    });
    cases
}

/// Block size of a case: local blocks of 8 slots.
fn block_size(p: GroupPlacement) -> u32 {
    8 * p.dcp_size * p.tokens_per_slot
}

#[test]
fn dcp_ranks_partials_sum_to_the_unsharded_value_of_the_naive_reference() {
    let mut rng = Rng::for_test("dcp_ranks_partials_sum_to_the_unsharded_value_of_the_naive_reference");
    let seed = rng.seed();
    for p in cases() {
        let size = block_size(p);
        for _ in 0..4 {
            let positions = 1 + rng.below(4) as usize;
            let num_tokens = rng.range(1..positions as u64 * size as u64 + 1);
            let units = Units::random(&mut rng, num_tokens.div_ceil(p.tokens_per_slot as u64) + 1);
            let mut ids: Vec<u32> = (0..NUM_BLOCKS).collect();
            rng.shuffle(&mut ids);
            let ids = &ids[..positions];
            let caches = rank_caches(&mut rng, &units, p, size, ids);
            let set = blocks(num_tokens, ids);
            let mut sum = vec![0u64; positions];
            for (rank, cache) in caches.iter().enumerate() {
                let worker = rank_worker(cache, p, size, rank as u32);
                let (got, _) = values(&worker, &set, Role::Consumer);
                let naive: Vec<u64> = (0..positions as u64)
                    .map(|q| naive_partial(&units, p, size, num_tokens, q, Some(rank as u32)))
                    .collect();
                assert_eq!(got, naive, "{p:?} rank {rank}, num_tokens {num_tokens}, seed {seed}");
                for (total, value) in sum.iter_mut().zip(&got) {
                    *total = total.wrapping_add(*value);
                }
            }
            let whole: Vec<u64> = (0..positions as u64)
                .map(|q| naive_partial(&units, p, size, num_tokens, q, None))
                .collect();
            assert_eq!(
                sum, whole,
                "{p:?}: the ranks' sum, num_tokens {num_tokens}, seed {seed}"
            );
            if p.tokens_per_slot == 1 {
                // The same logical KV on one rank without DCP, in blocks of
                // the same scheduler size.
                let single = GroupPlacement::DEFAULT;
                let one = rank_caches(&mut rng, &units, single, size, ids);
                let worker = rank_worker(&one[0], single, size, 0);
                assert_eq!(
                    values(&worker, &set, Role::Consumer).0,
                    sum,
                    "{p:?} against DCP 1, seed {seed}"
                );
            }
        }
    }
}

/// A tier store on a placed group keeps each full block's value as the
/// naive reference gives this rank's share of it, and a check of those
/// blocks matches (a host worker computes both at once).
#[test]
fn a_tier_store_of_placed_blocks_keeps_the_naive_share_of_each() {
    let mut rng = Rng::for_test("a_tier_store_of_placed_blocks_keeps_the_naive_share_of_each");
    let seed = rng.seed();
    for p in cases() {
        let size = block_size(p);
        let positions = 1 + rng.below(4) as usize;
        let num_tokens = positions as u64 * size as u64;
        let units = Units::random(&mut rng, num_tokens.div_ceil(p.tokens_per_slot as u64) + 1);
        let mut ids: Vec<u32> = (0..NUM_BLOCKS).collect();
        rng.shuffle(&mut ids);
        let ids = &ids[..positions];
        let caches = rank_caches(&mut rng, &units, p, size, ids);
        let hashes: Vec<[u8; 8]> = (0..positions as u64).map(|q| (q * 7919 + 13).to_le_bytes()).collect();
        for (rank, cache) in caches.iter().enumerate() {
            let worker = rank_worker(cache, p, size, rank as u32);
            let blocks: Vec<TierBlock<'_>> = (0..positions)
                .rev()
                .map(|q| TierBlock {
                    group_id: GROUP,
                    position: q as u64,
                    block_id: ids[q],
                    hash: Some(&hashes[q]),
                })
                .collect();
            let mut index = TierIndex::new(16).unwrap();
            index.store(&worker, &blocks, StreamHandle::legacy_default()).unwrap();
            for (q, hash) in hashes.iter().enumerate() {
                let naive = naive_partial(&units, p, size, num_tokens, q as u64, Some(rank as u32));
                assert_eq!(
                    index.values(GROUP, hash).unwrap(),
                    Some((q as u64, vec![naive])),
                    "{p:?} rank {rank} position {q}, seed {seed}"
                );
            }
            let outcomes = index.check(&worker, &blocks, StreamHandle::legacy_default()).unwrap();
            assert!(
                outcomes.iter().all(|&o| o == TierOutcome::Matched),
                "{p:?} rank {rank}: {outcomes:?}, seed {seed}"
            );
        }
    }
}

/// Producer DCP 1, consumer DCP `D`: through records and the verifier,
/// MATCH intact, MISMATCH naming the block with one byte flipped on one
/// DCP rank, UNVERIFIED with a rank's records missing or two workers
/// claiming one DCP rank.
#[test]
fn verifier_sums_dcp_shards_and_never_passes_a_missing_one() {
    let mut rng = Rng::for_test("verifier_sums_dcp_shards_and_never_passes_a_missing_one");
    let seed = rng.seed();
    for p in cases().into_iter().filter(|p| p.tokens_per_slot == 1 && p.dcp_size > 1) {
        let size = block_size(p);
        let positions = 3usize;
        let num_tokens = rng.range(2 * size as u64 + 1..3 * size as u64 + 1);
        let units = Units::random(&mut rng, num_tokens + 1);
        let mut ids: Vec<u32> = (0..NUM_BLOCKS).collect();
        rng.shuffle(&mut ids);
        let ids = &ids[..positions];
        let set = blocks(num_tokens, ids);
        // Producer: one worker, no DCP.
        let producer_cache = rank_caches(&mut rng, &units, GroupPlacement::DEFAULT, size, ids);
        let producer = rank_worker(&producer_cache[0], GroupPlacement::DEFAULT, size, 0);
        let (_, producer_record) = values(&producer, &set, Role::Producer);
        let verifier = Verifier::new(1).unwrap();
        verifier.expect(&set, Role::Producer).unwrap();
        verifier.add_record(&producer_record).unwrap();
        let payload = verifier.payload(REQ).unwrap().encode();
        let mut caches = rank_caches(&mut rng, &units, p, size, ids);
        let judge = |records: &[Vec<u8>]| {
            let verifier = Verifier::new(p.dcp_size).unwrap();
            verifier.expect(&set, Role::Consumer).unwrap();
            for record in records {
                verifier.add_record(record).unwrap();
            }
            verifier.check(REQ, Some(&payload)).unwrap()
        };
        let records = |caches: &[RankCache]| -> Vec<Vec<u8>> {
            caches
                .iter()
                .enumerate()
                .map(|(rank, cache)| values(&rank_worker(cache, p, size, rank as u32), &set, Role::Consumer).1)
                .collect()
        };
        let intact = records(&caches);
        let report = judge(&intact);
        assert_eq!(report.verdict, Verdict::Match, "{p:?} seed {seed}: {}", report.message);
        // A rank's records missing.
        let report = judge(&intact[1..]);
        assert_eq!(
            report.verdict,
            Verdict::Unverified,
            "{p:?} seed {seed}: {}",
            report.message
        );
        assert_eq!(report.reason(), Some(Reason::WorkersMissing), "{p:?} seed {seed}");
        // Two workers claiming DCP rank 0 (the second's placement wrong):
        // its tokens counted twice, rank 1's never.
        let wrong = {
            let worker = rank_worker(&caches[0], p, size, 0);
            let mut record = Record::decode(&values(&worker, &set, Role::Consumer).1).unwrap();
            record.rank.tp_rank = 1;
            record.encode()
        };
        let mut claimed = intact.clone();
        claimed[1] = wrong;
        let report = judge(&claimed);
        assert_eq!(
            report.verdict,
            Verdict::Unverified,
            "{p:?} seed {seed}: {}",
            report.message
        );
        assert_eq!(
            report.reason(),
            Some(Reason::WorkersMissing),
            "{p:?} seed {seed}: {}",
            report.message
        );
        // One byte flipped on the last DCP rank, in a slot holding a valid
        // token of position 1.
        let rank = p.dcp_size - 1;
        let (_, slot) = forward(rank as u64 * p.interleave as u64, p.dcp_size, p.interleave);
        let cache = &mut caches[rank as usize];
        let at = cache.index(ids[1], slot, 1, 1, 2);
        cache.words[at] ^= 1 << (8 * rng.below(8));
        let report = judge(&records(&caches));
        assert_eq!(
            report.verdict,
            Verdict::Mismatch,
            "{p:?} seed {seed}: {}",
            report.message
        );
        let positions: Vec<(u64, u64)> = report
            .mismatches
            .iter()
            .map(|m| (m.first_position, m.num_positions))
            .collect();
        assert_eq!(positions, vec![(1, 1)], "{p:?} seed {seed}: {}", report.message);
    }
}

/// Sides whose slots summarise other numbers of tokens never compare: the
/// marks differ (UNVERIFIED), though a consumer with one slot per token
/// holding the same words would sum otherwise anyway.
#[test]
fn a_tokens_per_slot_difference_is_unverified() {
    let mut rng = Rng::for_test("a_tokens_per_slot_difference_is_unverified");
    let seed = rng.seed();
    let compressed = GroupPlacement {
        tokens_per_slot: 4,
        ..GroupPlacement::DEFAULT
    };
    let size = 32u32;
    let num_tokens = 70u64;
    let ids = [3u32, 5, 6];
    let set = blocks(num_tokens, &ids);
    let units = Units::random(&mut rng, num_tokens);
    let producer_cache = rank_caches(&mut rng, &units, compressed, size, &ids);
    let producer = rank_worker(&producer_cache[0], compressed, size, 0);
    let (_, record) = values(&producer, &set, Role::Producer);
    let verifier = Verifier::new(1).unwrap();
    verifier.expect(&set, Role::Producer).unwrap();
    verifier.add_record(&record).unwrap();
    let payload = verifier.payload(REQ).unwrap().encode();
    for k in [4u32, 2] {
        let placement = GroupPlacement {
            tokens_per_slot: k,
            ..GroupPlacement::DEFAULT
        };
        let caches = rank_caches(&mut rng, &units, placement, size, &ids);
        let consumer = rank_worker(&caches[0], placement, size, 0);
        let verifier = Verifier::new(1).unwrap();
        verifier.expect(&set, Role::Consumer).unwrap();
        verifier.add_record(&values(&consumer, &set, Role::Consumer).1).unwrap();
        let report = verifier.check(REQ, Some(&payload)).unwrap();
        if k == 4 {
            assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
        } else {
            assert_eq!(report.verdict, Verdict::Unverified, "seed {seed}: {}", report.message);
            assert_eq!(
                report.reason(),
                Some(Reason::FingerprintDiffers),
                "seed {seed}: {}",
                report.message
            );
        }
    }
}

#[test]
fn placement_errors_name_the_argument_and_leave_the_worker_unchanged() {
    let mut worker = host_worker(0, 1, 0, 1);
    let set = |w: &mut Worker, p: GroupPlacement| w.set_group_placement(GROUP, p).unwrap_err().to_string();
    assert!(set(&mut worker, GroupPlacement::DEFAULT).contains("group_id 0 is not registered"));
    worker.add_group(GROUP, 16).unwrap();
    let p = |dcp_size, dcp_rank, interleave, tokens_per_slot| GroupPlacement {
        dcp_size,
        dcp_rank,
        interleave,
        tokens_per_slot,
    };
    assert!(set(&mut worker, p(2, 2, 1, 1)).contains("dcp_rank 2 is not below placement.dcp_size 2"));
    assert!(set(&mut worker, p(0, 0, 1, 1)).contains("dcp_size is 0"));
    assert!(set(&mut worker, p(1, 0, 1, 3)).contains("tokens_per_slot 3"));
    assert!(set(&mut worker, p(2, 0, 3, 1)).contains("interleave 3 does not divide"));
    assert_eq!(
        worker.layout().group(GROUP).unwrap().placement(),
        GroupPlacement::DEFAULT
    );
    // A cache registered: its tiling is the default's, so no placement after.
    let cache = RankCache {
        words: vec![1u64; (NUM_BLOCKS * 16 * LAYERS * HEADS * PIECES) as usize],
        local: 16,
    };
    let mut worker = rank_worker(&cache, GroupPlacement::DEFAULT, 16, 0);
    assert!(set(&mut worker, p(2, 0, 1, 1)).contains("set its placement before registering them"));
}
