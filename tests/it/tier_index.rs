//! The tier index (`TierIndex`, docs/vllm-tiers.md): a store keeps, per
//! block hash, the naive SPEC checksum of the block at its position (every
//! column of the worker), a check compares loaded blocks with what was kept,
//! and random sequences of stores and checks against a small index give the
//! outcomes of a deliberately naive model (a list in use order, searched
//! linearly): matched, mismatched, and each unknown reason, with the least
//! recently used entry dropped when full. Bad arguments change nothing.
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it tier_index::<name>`.

use crate::support;

use kvcsum::{StreamHandle, TierBlock, TierIndex, TierOutcome};
use support::*;

const BLOCK_SIZE: u32 = 16;
const POSITIONS: u64 = 6;
const VERSIONS: u32 = 3;
const NUM_BLOCKS: u32 = 1 + VERSIONS * POSITIONS as u32 + 8;
const MAX_VALUES: usize = 4;

/// A host worker whose cache holds `VERSIONS` random KVs of `POSITIONS`
/// full blocks each, version `v`'s position `p` in block id
/// `block_of(v, p)`; and the naive value of each.
struct Fixture {
    worker: kvcsum::Worker,
    _placement: Placement,
    values: Vec<Vec<u64>>,
}

fn block_of(version: u32, position: u64) -> u32 {
    1 + version * POSITIONS as u32 + position as u32
}

fn fixture(rng: &mut Rng) -> Fixture {
    fixture_in(rng, LayoutKind::Hnd)
}

/// [`fixture`] with the caches laid out as `kind`.
fn fixture_in(rng: &mut Rng, kind: LayoutKind) -> Fixture {
    let shape = KvShape::gqa(3, 2, 32, POSITIONS * BLOCK_SIZE as u64);
    let kvs: Vec<LogicalKv> = (0..VERSIONS).map(|_| LogicalKv::random(rng, shape)).collect();
    let mut worker = host_worker(0, 1, 0, 1);
    let mut placement = Placement::for_shard(
        rng,
        &kvs[0],
        &shard(&kvs[0], 0, 1, 0, 1),
        kind,
        0,
        BLOCK_SIZE,
        NUM_BLOCKS,
    );
    for (v, kv) in kvs.iter().enumerate() {
        let ids: Vec<u32> = (0..POSITIONS).map(|p| block_of(v as u32, p)).collect();
        placement.write_request(kv, 0, &ids);
    }
    register_host(&mut worker, &placement);
    let values = kvs
        .iter()
        .map(|kv| naive_full(kv, BLOCK_SIZE, 0, POSITIONS as usize))
        .collect();
    Fixture {
        worker,
        _placement: placement,
        values,
    }
}

fn hash_of(n: u64) -> [u8; 32] {
    let mut hash = [0u8; 32];
    hash[..8].copy_from_slice(&(n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555).to_le_bytes());
    hash[31] = n as u8;
    hash
}

/// The naive model of the index: entries in use order (most recent last),
/// each (hash number, position, values, too many).
struct Model {
    capacity: usize,
    entries: Vec<(u64, u64, Vec<u64>, bool)>,
}

impl Model {
    fn remember(&mut self, hash: u64, position: u64, value: u64) {
        if let Some(i) = self.entries.iter().position(|e| e.0 == hash) {
            let mut entry = self.entries.remove(i);
            if !entry.3 {
                if entry.1 != position {
                    entry.3 = true;
                } else if !entry.2.contains(&value) {
                    if entry.2.len() >= MAX_VALUES {
                        entry.3 = true;
                    } else {
                        entry.2.push(value);
                    }
                }
            }
            self.entries.push(entry);
            return;
        }
        self.entries.push((hash, position, vec![value], false));
        if self.entries.len() > self.capacity {
            self.entries.remove(0);
        }
    }

    fn compare(&mut self, hash: Option<u64>, position: u64, value: u64) -> TierOutcome {
        let Some(hash) = hash else {
            return TierOutcome::NoBlockHash;
        };
        let Some(i) = self.entries.iter().position(|e| e.0 == hash) else {
            return TierOutcome::UnknownBlock;
        };
        let entry = &self.entries[i];
        if entry.3 {
            return TierOutcome::TooManyValues;
        }
        if entry.1 != position {
            return TierOutcome::OtherPosition;
        }
        if entry.2.contains(&value) {
            let entry = self.entries.remove(i);
            self.entries.push(entry);
            TierOutcome::Matched
        } else {
            TierOutcome::Mismatched
        }
    }
}

/// In every layout kind, a store keeps each block's naive checksum and a
/// check of the same blocks matches (a host worker computes both at once,
/// `Worker::full_block_sums`), and a check of other blocks under those
/// hashes mismatches.
#[test]
fn a_store_keeps_the_naive_checksum_of_each_block_by_its_hash() {
    let mut rng = Rng::for_test("a_store_keeps_the_naive_checksum_of_each_block_by_its_hash");
    let seed = rng.seed();
    for kind in all_kinds() {
        let f = fixture_in(&mut rng, kind);
        let mut index = TierIndex::new(64).unwrap();
        let hashes: Vec<[u8; 32]> = (0..POSITIONS).map(hash_of).collect();
        // Positions in a shuffled order, some runs consecutive: every block is kept.
        let mut order: Vec<u64> = (0..POSITIONS).collect();
        rng.shuffle(&mut order);
        let blocks_of = |version: u32| -> Vec<TierBlock<'_>> {
            order
                .iter()
                .map(|&p| TierBlock {
                    group_id: 0,
                    position: p,
                    block_id: block_of(version, p),
                    hash: Some(&hashes[p as usize]),
                })
                .collect()
        };
        index
            .store(&f.worker, &blocks_of(1), StreamHandle::legacy_default())
            .unwrap();
        for p in 0..POSITIONS {
            let kept = index.values(0, &hashes[p as usize]).unwrap();
            assert_eq!(
                kept,
                Some((p, vec![f.values[1][p as usize]])),
                "{kind:?} position {p} (seed {seed})"
            );
        }
        assert_eq!(index.info().entries, POSITIONS, "{kind:?} seed {seed}");
        // The same hash in another group is another entry.
        assert_eq!(index.values(1, &hashes[0]).unwrap(), None, "{kind:?} seed {seed}");
        let same = index
            .check(&f.worker, &blocks_of(1), StreamHandle::legacy_default())
            .unwrap();
        assert!(
            same.iter().all(|&o| o == TierOutcome::Matched),
            "{kind:?} {same:?} seed {seed}"
        );
        let other = index
            .check(&f.worker, &blocks_of(2), StreamHandle::legacy_default())
            .unwrap();
        assert!(
            other.iter().all(|&o| o == TierOutcome::Mismatched),
            "{kind:?} {other:?} seed {seed}"
        );
    }
}

#[test]
fn random_stores_and_checks_give_the_naive_models_outcomes() {
    let mut rng = Rng::for_test("random_stores_and_checks_give_the_naive_models_outcomes");
    let seed = rng.seed();
    let f = fixture(&mut rng);
    let mut counts = [0usize; 8];
    for round in 0..30 {
        let capacity = 1 + rng.below(6) as usize;
        let mut index = TierIndex::new(capacity as u64).unwrap();
        let mut model = Model {
            capacity,
            entries: vec![],
        };
        let hashes: Vec<[u8; 32]> = (0..10).map(|n| hash_of(n + 100 * round)).collect();
        for step in 0..40 {
            // A batch of blocks: a hash number, a version and a position each
            // (mostly the hash's own position, sometimes another).
            let count = 1 + rng.below(5) as usize;
            let picks: Vec<(u64, u32, u64, bool)> = (0..count)
                .map(|_| {
                    let hash = rng.below(hashes.len() as u64);
                    let version = rng.below(VERSIONS as u64) as u32;
                    let position = if rng.below(8) == 0 {
                        rng.below(POSITIONS)
                    } else {
                        hash % POSITIONS
                    };
                    (hash, version, position, rng.below(6) != 0)
                })
                .collect();
            let blocks: Vec<TierBlock<'_>> = picks
                .iter()
                .map(|&(hash, version, position, hashed)| TierBlock {
                    group_id: 0,
                    position,
                    block_id: block_of(version, position),
                    hash: hashed.then_some(&hashes[hash as usize][..]),
                })
                .collect();
            if rng.below(2) == 0 {
                let stored: Vec<TierBlock<'_>> = blocks.iter().copied().filter(|b| b.hash.is_some()).collect();
                index.store(&f.worker, &stored, StreamHandle::legacy_default()).unwrap();
                for &(hash, version, position, hashed) in &picks {
                    if hashed {
                        model.remember(hash, position, f.values[version as usize][position as usize]);
                    }
                }
            } else {
                let got = index.check(&f.worker, &blocks, StreamHandle::legacy_default()).unwrap();
                let want: Vec<TierOutcome> = picks
                    .iter()
                    .map(|&(hash, version, position, hashed)| {
                        model.compare(
                            hashed.then_some(hash),
                            position,
                            f.values[version as usize][position as usize],
                        )
                    })
                    .collect();
                assert_eq!(got, want, "round {round} step {step}: {picks:?} (seed {seed})");
                for outcome in got {
                    counts[outcome as usize] += 1;
                }
            }
            let info = index.info();
            assert_eq!(
                info.entries as usize,
                model.entries.len(),
                "round {round} step {step} (seed {seed})"
            );
        }
    }
    // Every outcome but NOT_CHECKSUMMED (no skipped group here) came up.
    for outcome in [
        TierOutcome::Matched,
        TierOutcome::Mismatched,
        TierOutcome::NoBlockHash,
        TierOutcome::UnknownBlock,
        TierOutcome::TooManyValues,
        TierOutcome::OtherPosition,
    ] {
        assert!(
            counts[outcome as usize] > 0,
            "{outcome:?} never came up: {counts:?} (seed {seed})"
        );
    }
}

#[test]
fn a_full_index_holds_at_most_its_stated_bytes_per_entry() {
    let mut rng = Rng::for_test("a_full_index_holds_at_most_its_stated_bytes_per_entry");
    let f = fixture(&mut rng);
    for capacity in [1u64, 7, 16, 1000, 4096, 5000] {
        let mut index = TierIndex::new(capacity).unwrap();
        let hashes: Vec<[u8; 32]> = (0..capacity + 300).map(hash_of).collect();
        for chunk in hashes.chunks(256) {
            let blocks: Vec<TierBlock<'_>> = chunk
                .iter()
                .enumerate()
                .map(|(i, hash)| TierBlock {
                    group_id: 0,
                    position: i as u64,
                    block_id: 1,
                    hash: Some(&hash[..]),
                })
                .collect();
            index.store(&f.worker, &blocks, StreamHandle::legacy_default()).unwrap();
        }
        let info = index.info();
        assert_eq!(info.entries, capacity);
        assert_eq!(info.dropped, 300);
        let bound = capacity * kvsum_entry_bytes() + 64;
        assert!(
            info.memory_bytes <= bound,
            "capacity {capacity}: {} bytes held, more than {bound}",
            info.memory_bytes
        );
    }
}

fn kvsum_entry_bytes() -> u64 {
    kvcsum::ffi::tier_index::KVCS_TIER_INDEX_ENTRY_BYTES as u64
}

#[test]
fn bad_arguments_are_refused_and_change_nothing() {
    let mut rng = Rng::for_test("bad_arguments_are_refused_and_change_nothing");
    let f = fixture(&mut rng);
    assert!(TierIndex::new(0).is_err());
    assert!(TierIndex::new(u64::MAX).is_err());
    let mut index = TierIndex::new(16).unwrap();
    let good = hash_of(1);
    let short = [7u8; 7];
    let long = [7u8; 33];
    let stream = StreamHandle::legacy_default();
    let block = |hash: Option<&'static [u8]>, group_id, block_id| TierBlock {
        group_id,
        position: 0,
        block_id,
        hash,
    };
    let good: &'static [u8] = Box::leak(Box::new(good));
    let short: &'static [u8] = Box::leak(Box::new(short));
    let long: &'static [u8] = Box::leak(Box::new(long));
    let cases: Vec<(&str, Vec<TierBlock<'static>>, &str)> = vec![
        (
            "a short hash",
            vec![block(Some(good), 0, 1), block(Some(short), 0, 2)],
            "hash_bytes is 7",
        ),
        ("a long hash", vec![block(Some(long), 0, 1)], "hash_bytes is 33"),
        (
            "an unknown group",
            vec![block(Some(good), 0, 1), block(Some(good), 9, 1)],
            "group_ids[1] 9",
        ),
        (
            "a block past the cache",
            vec![block(Some(good), 0, NUM_BLOCKS + 5)],
            "block",
        ),
        ("no hash in a store", vec![block(None, 0, 1)], "no block hash"),
    ];
    for (what, blocks, words) in cases {
        let error = index.store(&f.worker, &blocks, stream).expect_err(what).to_string();
        assert!(error.contains(words), "{what}: {error}");
        assert_eq!(index.info().entries, 0, "{what}: something was kept");
    }
    let error = index
        .check(&f.worker, &[block(Some(good), 9, 1)], stream)
        .expect_err("check of an unknown group")
        .to_string();
    assert!(error.contains("group_ids[0] 9"), "{error}");
}

/// The arrays of a C caller are refused, naming the argument, where their
/// lengths disagree, the hash length is one the index does not take, or a
/// `hashed` flag is neither 0 nor 1; arrays that agree read in place.
#[test]
fn tier_arrays_refuse_arrays_that_disagree() {
    use kvcsum::TierArrays;
    let groups = [0u32, 0];
    let positions = [0u64, 1];
    let ids = [1u32, 2];
    let hashes = [5u8; 64];
    let refused = |r: kvcsum::Result<TierArrays<'_>>| r.unwrap_err().to_string();
    assert!(refused(TierArrays::new(&groups, &positions[..1], &ids, &hashes, 32, None)).contains("positions 1"));
    assert!(refused(TierArrays::new(&groups, &positions, &ids[..1], &hashes, 32, None)).contains("block_ids 1"));
    assert!(refused(TierArrays::new(&groups, &positions, &ids, &hashes, 32, Some(&[1]))).contains("hashed 1"));
    assert!(
        refused(TierArrays::new(&groups, &positions, &ids, &hashes[..40], 32, None)).contains("hashes has 40 bytes")
    );
    assert!(refused(TierArrays::new(&groups, &positions, &ids, &hashes[..8], 4, None)).contains("hash_bytes is 4"));
    assert!(refused(TierArrays::new(&groups, &positions, &ids, &hashes, 32, Some(&[1, 2]))).contains("hashed[1] is 2"));
    let arrays = TierArrays::new(&groups, &positions, &ids, &hashes, 32, Some(&[1, 0])).unwrap();
    assert_eq!(arrays.len(), 2);
    assert_eq!(arrays.get(0).hash, Some(&hashes[..32]));
    assert_eq!(arrays.get(1).hash, None);
    assert_eq!((arrays.get(1).position, arrays.get(1).block_id), (1, 2));
    // No blocks: nothing to check of the hash length.
    assert!(TierArrays::new(&[], &[], &[], &[], 0, None).unwrap().is_empty());
}
