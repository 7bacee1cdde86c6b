//! Stored checksums for offloaded KV (SPEC section 8): a store writes `sum
//! XOR tag` per block into the group's buffer, the buffer travels with the
//! blocks, and a load check recomputes the loaded blocks and names each
//! position whose stored value does not match: a corrupted byte, a block in
//! another block's slot, another shard's KV, a wrong block hash. Compared
//! with the naive reference of SPEC sections 2 and 3, on random data. The
//! load checks' records carry the verdicts to the verifier, which judges an
//! offload load from them alone (`Verifier::check_stored`).
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it stored::<name>`.

use crate::support;

use std::collections::BTreeMap;
use std::ffi::CString;

use kvcsum::ffi::blocks::*;
use kvcsum::ffi::result::*;
use kvcsum::ffi::status::kvcs_status::*;
use kvcsum::ffi::worker::*;
use kvcsum::record::{self, Record};
use kvcsum::verify::{Policy, Reason, Verdict, Verifier};
use kvcsum::{BlockSet, Error, Region, Role, StoredOutcome, StreamHandle, Worker};
use sha2::{Digest, Sha256};
use support::handles::{c_layer, c_segments, last_error};
use support::*;

const REQ: &str = "offload-1";
const HASH_BYTES: usize = 32;

/// One TP rank: its worker, its cache and its buffer of stored checksums.
struct Rank {
    worker: Worker,
    placement: Placement,
    stored: Vec<[u64; 2]>,
}

/// A TP deployment of one group with stored-checksum buffers.
struct Side {
    ranks: Vec<Rank>,
}

fn identity(layer: u32) -> Vec<u8> {
    format!("('model.layers.{layer}.self_attn.attn', 'FullAttentionSpec', 'bfloat16')").into_bytes()
}

fn deploy(rng: &mut Rng, kv: &LogicalKv, tp_size: u32, kind: LayoutKind, num_blocks: u32) -> Side {
    let ranks = (0..tp_size)
        .map(|tp_rank| {
            let mut worker = host_worker(tp_rank, tp_size, 0, 2);
            let placement = Placement::for_shard(rng, kv, &shard(kv, tp_rank, tp_size, 0, 1), kind, 0, 16, num_blocks);
            worker.add_group(0, 16).unwrap();
            for region in placement.regions(&placement.host_bases()) {
                worker.add_region(region).unwrap();
            }
            for mut spec in placement.host_layer_specs() {
                spec.identity = identity(spec.layer_number);
                worker.add_layer(spec).unwrap();
            }
            // Junk, so that a value never written cannot pass by chance.
            let stored: Vec<[u64; 2]> = (0..num_blocks).map(|_| [rng.next_u64(), rng.next_u64()]).collect();
            worker
                .add_region(Region {
                    address: stored.as_ptr() as u64,
                    length: std::mem::size_of_val(stored.as_slice()) as u64,
                })
                .unwrap();
            worker
                .add_stored(0, stored.as_ptr() as u64, num_blocks as u64)
                .expect("add_stored");
            Rank {
                worker,
                placement,
                stored,
            }
        })
        .collect();
    Side { ranks }
}

fn random_hashes(rng: &mut Rng, count: usize) -> Vec<u8> {
    (0..count * HASH_BYTES).map(|_| rng.next_u64() as u8).collect()
}

fn blocks_with_hashes(num_tokens: u64, block_ids: &[u32], hashes: &[u8]) -> BlockSet {
    let mut blocks = BlockSet::new();
    blocks.add_request(REQ, num_tokens).unwrap();
    blocks.add_group(REQ, 0, 0, block_ids).unwrap();
    blocks.set_hashes(REQ, 0, hashes, HASH_BYTES).unwrap();
    blocks
}

/// The group fingerprint of a rank (every rank registers the same layers).
fn naive_fingerprint(kv: &LogicalKv) -> u64 {
    (0..kv.shape.num_layers).fold(0u64, |sum, layer| {
        let digest = Sha256::digest(identity(layer));
        sum.wrapping_add(u64::from_le_bytes(digest[..8].try_into().unwrap()))
    })
}

fn hash_of(hashes: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(hashes[i * HASH_BYTES..i * HASH_BYTES + 8].try_into().unwrap())
}

/// Per position, the verdicts of every rank's load check.
fn load_check(side: &Side, blocks: &BlockSet) -> Vec<Vec<StoredOutcome>> {
    side.ranks
        .iter()
        .map(|rank| {
            let result = rank
                .worker
                .check_stored(blocks, StreamHandle::legacy_default())
                .expect("check_stored");
            result.stored_outcomes(REQ, 0).expect("outcomes")
        })
        .collect()
}

/// Positions where some rank failed.
fn failed_positions(outcomes: &[Vec<StoredOutcome>]) -> Vec<usize> {
    let positions = outcomes[0].len();
    (0..positions)
        .filter(|&q| outcomes.iter().any(|rank| rank[q] == StoredOutcome::Failed))
        .collect()
}

struct Scenario {
    kv: LogicalKv,
    side: Side,
    block_ids: Vec<u32>,
    hashes: Vec<u8>,
    count: usize,
}

/// Stores a random request's blocks, then "offloads and loads them back"
/// into fresh block ids: the KV written again there and each block's stored
/// value copied with it.
fn stored_and_reloaded(rng: &mut Rng, num_tokens: u64) -> Scenario {
    let kv = LogicalKv::random(rng, KvShape::gqa(3, 4, 64, num_tokens));
    let count = positions_for(num_tokens, 16, 0, 0);
    let num_blocks = 2 * count as u32 + 2;
    let mut side = deploy(rng, &kv, 2, LayoutKind::Hnd, num_blocks);
    let mut allocator = BlockAllocator::new(rng, num_blocks);
    let first_ids = allocator.take(count);
    let hashes = random_hashes(rng, count);
    for rank in &mut side.ranks {
        rank.placement.write_request(&kv, 0, &first_ids);
    }
    let blocks = blocks_with_hashes(num_tokens, &first_ids, &hashes);
    for rank in &side.ranks {
        rank.worker
            .store(&blocks, StreamHandle::legacy_default())
            .expect("store");
    }
    // The ranks' stored values, untagged, add up to the naive block checksums.
    let tag = |i: usize| hash_of(&hashes, i) ^ naive_fingerprint(&kv);
    let expected = naive_full(&kv, 16, 0, count);
    for (i, &block_id) in first_ids.iter().enumerate() {
        let total = side.ranks.iter().fold(0u64, |sum, rank| {
            sum.wrapping_add(rank.stored[block_id as usize][0] ^ tag(i))
        });
        assert_eq!(total, expected[i], "stored value of position {i}");
    }
    // Load back elsewhere: the KV rewritten at new ids, stored values copied.
    let block_ids = allocator.take(count);
    for rank in &mut side.ranks {
        rank.placement.write_request(&kv, 0, &block_ids);
        for (&from, &to) in first_ids.iter().zip(&block_ids) {
            rank.stored[to as usize] = rank.stored[from as usize];
        }
    }
    Scenario {
        kv,
        side,
        block_ids,
        hashes,
        count,
    }
}

#[test]
fn a_round_trip_matches_at_every_position() {
    let mut rng = Rng::for_test("a_round_trip_matches_at_every_position");
    let seed = rng.seed();
    for num_tokens in [16, 75, 160] {
        let s = stored_and_reloaded(&mut rng, num_tokens);
        let blocks = blocks_with_hashes(num_tokens, &s.block_ids, &s.hashes);
        let outcomes = load_check(&s.side, &blocks);
        for rank in &outcomes {
            assert!(
                rank.iter().all(|&o| o == StoredOutcome::Matched),
                "{num_tokens} tokens: {rank:?} (seed {seed})"
            );
        }
        // The load check's values are the plain checksums.
        let mut total = vec![0u64; s.count];
        for rank in &s.side.ranks {
            let result = checksum(&rank.worker, &blocks, Role::Consumer);
            add_values(&mut total, &result.position_sums(REQ, 0).unwrap());
        }
        assert_eq!(total, naive_full(&s.kv, 16, 0, s.count), "seed {seed}");
    }
}

#[test]
fn each_fault_fails_at_its_position_and_nowhere_else() {
    let mut rng = Rng::for_test("each_fault_fails_at_its_position_and_nowhere_else");
    let seed = rng.seed();
    let num_tokens = 120;

    // A corrupted byte in one loaded block.
    let mut s = stored_and_reloaded(&mut rng, num_tokens);
    let q = rng.below(s.count as u64) as usize;
    let (layer, head) = (rng.below(3) as u32, s.side.ranks[1].placement.spec().first_head);
    s.side.ranks[1]
        .placement
        .xor_byte(layer, head, s.block_ids[q], 0, 5, 0x20);
    let blocks = blocks_with_hashes(num_tokens, &s.block_ids, &s.hashes);
    assert_eq!(
        failed_positions(&load_check(&s.side, &blocks)),
        vec![q],
        "corrupted byte (seed {seed})"
    );

    // Two blocks' KV loaded into each other's slots.
    let mut s = stored_and_reloaded(&mut rng, num_tokens);
    let (a, b) = (1, 4);
    let mut swapped = s.block_ids.clone();
    swapped.swap(a, b);
    for rank in &mut s.side.ranks {
        rank.placement.write_request(&s.kv, 0, &swapped);
    }
    let blocks = blocks_with_hashes(num_tokens, &s.block_ids, &s.hashes);
    assert_eq!(
        failed_positions(&load_check(&s.side, &blocks)),
        vec![a, b],
        "swapped blocks (seed {seed})"
    );

    // Another shard's KV: rank 1's cache bytes in rank 0's cache.
    let mut s = stored_and_reloaded(&mut rng, num_tokens);
    let other: Vec<Vec<u8>> = s.side.ranks[1]
        .placement
        .buffers()
        .iter()
        .map(|b| b.bytes().to_vec())
        .collect();
    for (buffer, bytes) in s.side.ranks[0].placement.buffers_mut().iter_mut().zip(&other) {
        buffer.bytes_mut().copy_from_slice(bytes);
    }
    let blocks = blocks_with_hashes(num_tokens, &s.block_ids, &s.hashes);
    let outcomes = load_check(&s.side, &blocks);
    assert!(
        outcomes[0].iter().all(|&o| o == StoredOutcome::Failed),
        "another shard fails everywhere on rank 0: {:?} (seed {seed})",
        outcomes[0]
    );
    assert!(outcomes[1].iter().all(|&o| o == StoredOutcome::Matched), "seed {seed}");

    // A wrong block hash for one position.
    let s = stored_and_reloaded(&mut rng, num_tokens);
    let q = rng.below(s.count as u64) as usize;
    let mut hashes = s.hashes.clone();
    hashes[q * HASH_BYTES + rng.below(8) as usize] ^= 0x01;
    let blocks = blocks_with_hashes(num_tokens, &s.block_ids, &hashes);
    assert_eq!(
        failed_positions(&load_check(&s.side, &blocks)),
        vec![q],
        "wrong hash (seed {seed})"
    );
    // Bytes of the hash past the first 8 are not used.
    let mut hashes = s.hashes.clone();
    hashes[q * HASH_BYTES + 8 + rng.below(24) as usize] ^= 0x01;
    let blocks = blocks_with_hashes(num_tokens, &s.block_ids, &hashes);
    assert!(
        failed_positions(&load_check(&s.side, &blocks)).is_empty(),
        "seed {seed}"
    );
}

// ---------------------------------------------------------------------------
// The entry's format (SPEC section 8), written out from the SPEC's text

/// The coverage of a shard's slices (SPEC section 10): `f(m)` summed over
/// its (layer, head), `f` the MIXED function of section 12.
fn naive_coverage(layers: &[u32], heads: &[u32]) -> u64 {
    let mut coverage = 0u64;
    for &layer in layers {
        for &head in heads {
            let m = 2 * (layer as u64 * 65536 + head as u64) + 1;
            coverage = coverage.wrapping_add(kvcsum::mix(m));
        }
    }
    coverage
}

/// What one worker's configuration of a group is, for its entries.
#[derive(Clone, Copy)]
struct NaiveConfig {
    fingerprint: u64,
    geometry: u64,
    coverage: u64,
    block_size: u32,
    algorithm: u32,
}

impl NaiveConfig {
    /// SPEC section 8: `config = f(f(f(fingerprint + geometry) XOR
    /// coverage) XOR (block_size * 2^32 + algorithm))`, `digest = (config
    /// >> 32) XOR tokens`.
    fn digest(&self, tokens: u32) -> u32 {
        let f = kvcsum::mix;
        let fingerprint = self.fingerprint.wrapping_add(self.geometry);
        let config = f(f(f(fingerprint) ^ self.coverage) ^ ((self.block_size as u64) << 32 | self.algorithm as u64));
        (config >> 32) as u32 ^ tokens
    }

    /// The entry `[value, stamp]` for a position of `tokens` valid tokens
    /// whose worker's columns add up to `sum`, for block hash `hash`.
    fn entry(&self, sum: u64, hash: u64, tokens: u32) -> [u64; 2] {
        let f = kvcsum::mix;
        let value = sum ^ hash ^ self.fingerprint;
        let digest = self.digest(tokens);
        let key = f(hash ^ f(digest as u64));
        let check = f(f(value) ^ key) >> 32;
        [value, check << 32 | digest as u64]
    }
}

/// SPEC section 8's geometry digest of the layers a rank registered (each
/// one run of its heads: a rank's layers never join), per layer
/// `LE_u64(SHA-256("kvcsum geometry" || LE_u32(layer_number) ||
/// LE_u32(first_head) || LE_u32(num_heads) || LE_u32(cell_bytes))[0..8])`,
/// the cell the sum of its segments' bytes per token.
fn naive_geometry(specs: &[kvcsum::LayerSpec]) -> u64 {
    specs.iter().fold(0u64, |sum, spec| {
        let cell: u32 = spec.segments.iter().map(|segment| segment.bytes_per_token).sum();
        let mut bytes = b"kvcsum geometry".to_vec();
        for word in [spec.layer_number, spec.first_head, spec.num_heads, cell] {
            bytes.extend(word.to_le_bytes());
        }
        let digest = Sha256::digest(&bytes);
        sum.wrapping_add(u64::from_le_bytes(digest[..8].try_into().unwrap()))
    })
}

/// Rank `r`'s configuration of group 0 in a [`stored_and_reloaded`] scenario.
fn rank_config(s: &Scenario, r: usize) -> NaiveConfig {
    let spec = s.side.ranks[r].placement.spec();
    let heads: Vec<u32> = (spec.first_head..spec.first_head + spec.num_heads).collect();
    NaiveConfig {
        fingerprint: naive_fingerprint(&s.kv),
        geometry: naive_geometry(&s.side.ranks[r].placement.host_layer_specs()),
        coverage: naive_coverage(&spec.layer_numbers, &heads),
        block_size: 16,
        algorithm: algorithm().code(),
    }
}

/// Rank `r`'s naive partial checksum of position `q`.
fn rank_sum(s: &Scenario, r: usize, q: usize) -> u64 {
    let spec = s.side.ranks[r].placement.spec();
    let heads: Vec<u32> = (spec.first_head..spec.first_head + spec.num_heads).collect();
    naive_positions(&s.kv, &spec.layer_numbers, &heads, 16, 0, s.count)[q]
}

/// Every stored entry is SPEC section 8's formula: the value (the rank's
/// sum XOR the tag), then the stamp (the check over the value and the
/// digest, keyed by the block hash; the digest of the configuration and the
/// position's valid tokens), under each algorithm.
#[test]
fn stored_entries_are_the_spec_formula_of_value_and_stamp() {
    for_each_algorithm(|_| {
        let mut rng = Rng::for_test("stored_entries_are_the_spec_formula_of_value_and_stamp");
        let seed = rng.seed();
        for num_tokens in [16, 75, 160] {
            let s = stored_and_reloaded(&mut rng, num_tokens);
            for r in 0..2 {
                let config = rank_config(&s, r);
                for (q, &block_id) in s.block_ids.iter().enumerate() {
                    let tokens = valid_tokens_at(num_tokens, q);
                    let expected = config.entry(rank_sum(&s, r, q), hash_of(&s.hashes, q), tokens);
                    assert_eq!(
                        s.side.ranks[r].stored[block_id as usize], expected,
                        "rank {r} position {q} ({tokens} tokens, seed {seed})"
                    );
                }
            }
        }
    });
}

/// A damaged entry fails at its position and nowhere else, whatever is
/// damaged: a bit of the value or of the stamp (its check or its digest),
/// several bits, either word or both replaced by random words, the entry
/// zeroed, another position's entry copied over it. None reads as another
/// configuration, algorithm or token count (which would let a fail-open
/// load pass unchecked); the offload load is MISMATCH.
#[test]
fn a_damaged_entry_fails_and_never_reads_as_another_configuration() {
    let mut rng = Rng::for_test("a_damaged_entry_fails_and_never_reads_as_another_configuration");
    let seed = rng.seed();
    let num_tokens = 75;
    let mut s = stored_and_reloaded(&mut rng, num_tokens);
    let blocks = blocks_with_hashes(num_tokens, &s.block_ids, &s.hashes);
    let faults = [
        "one bit of the value",
        "one bit of the check",
        "one bit of the digest",
        "2-8 bits anywhere",
        "a random value",
        "a random stamp",
        "a random entry",
        "the entry zeroed",
        "another position's entry",
    ];
    let mut failed = 0;
    let trials = 900;
    for trial in 0..trials {
        let fault = faults[trial % faults.len()];
        let (r, q) = (rng.below(2) as usize, rng.below(s.count as u64) as usize);
        let block = s.block_ids[q] as usize;
        let intact = s.side.ranks[r].stored[block];
        let mut entry = intact;
        match fault {
            "one bit of the value" => entry[0] ^= 1 << rng.below(64),
            "one bit of the check" => entry[1] ^= 1 << (32 + rng.below(32)),
            "one bit of the digest" => entry[1] ^= 1 << rng.below(32),
            "2-8 bits anywhere" => {
                while entry == intact || rng.chance(2, 3) {
                    let bit = rng.below(128);
                    entry[(bit / 64) as usize] ^= 1 << (bit % 64);
                }
            }
            "a random value" => entry[0] = rng.next_u64(),
            "a random stamp" => entry[1] = rng.next_u64(),
            "a random entry" => entry = [rng.next_u64(), rng.next_u64()],
            "the entry zeroed" => entry = [0, 0],
            _ => {
                let other = (q + 1 + rng.below(s.count as u64 - 1) as usize) % s.count;
                entry = s.side.ranks[r].stored[s.block_ids[other] as usize];
            }
        }
        if entry == intact {
            continue;
        }
        s.side.ranks[r].stored[block] = entry;
        let outcomes = load_check(&s.side, &blocks);
        let context = format!("seed {seed}, trial {trial}: {fault} at rank {r} position {q}");
        for (rank, rank_outcomes) in outcomes.iter().enumerate() {
            for (position, &outcome) in rank_outcomes.iter().enumerate() {
                let want = if (rank, position) == (r, q) {
                    StoredOutcome::Failed
                } else {
                    StoredOutcome::Matched
                };
                assert_eq!(outcome, want, "{context}: rank {rank} position {position}");
            }
        }
        failed += 1;
        if trial % 100 == 0 {
            let report = verifier_holding(2, &blocks, &load_check_records(&s.side, &blocks));
            report.set_policy(Policy::FailOpen).unwrap();
            let report = report.check_stored(REQ).unwrap();
            assert_eq!(report.verdict, Verdict::Mismatch, "{context}: {}", report.message);
            assert!(!report.passed, "{context}: a fail-open load passed a damaged entry");
        }
        s.side.ranks[r].stored[block] = intact;
    }
    assert!(failed > trials * 9 / 10, "seed {seed}: only {failed} damaged entries");
}

/// A partial last block stored (11 of 16 tokens) and load-checked when the
/// request holds more tokens in it is OTHER_TOKENS, not FAILED: the entry
/// says how many valid tokens it covers. The other positions match; the
/// verifier counts that one as uncompared (MATCH, or UNVERIFIED where full
/// coverage is required). The other way round (stored full, checked
/// shorter) reads the same, and a load of the partial block alone is
/// UNVERIFIED, no position in common.
#[test]
fn a_partial_block_checked_with_other_valid_tokens_is_other_tokens_not_failed() {
    let mut rng = Rng::for_test("a_partial_block_checked_with_other_valid_tokens_is_other_tokens_not_failed");
    let seed = rng.seed();
    let longer = 80;
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(3, 4, 64, longer));
    let mut side = deploy(&mut rng, &kv, 2, LayoutKind::Nhd, 8);
    let block_ids = [6, 2, 7, 0, 3];
    for rank in &mut side.ranks {
        rank.placement.write_request(&kv, 0, &block_ids);
    }
    let hashes = random_hashes(&mut rng, block_ids.len());
    use StoredOutcome::*;
    for (stored_tokens, checked_tokens) in [(75u64, longer), (longer, 75u64)] {
        let stored_blocks = blocks_with_hashes(stored_tokens, &block_ids, &hashes);
        for rank in &side.ranks {
            rank.worker
                .store(&stored_blocks, StreamHandle::legacy_default())
                .expect("store");
        }
        let checked = blocks_with_hashes(checked_tokens, &block_ids, &hashes);
        let outcomes = load_check(&side, &checked);
        let context = format!("seed {seed}: stored with {stored_tokens} tokens, checked with {checked_tokens}");
        for rank in &outcomes {
            assert_eq!(
                rank,
                &vec![Matched, Matched, Matched, Matched, OtherTokens],
                "{context}"
            );
        }
        let records = load_check_records(&side, &checked);
        // By default the position nobody compared makes the load not
        // passed, and the finding names it.
        let report = verifier_holding(2, &checked, &records).check_stored(REQ).unwrap();
        assert_eq!(report.verdict, Verdict::Unverified, "{context}: {}", report.message);
        assert_eq!(report.reason(), Some(Reason::UncomparedPositions), "{context}");
        assert!(!report.passed, "{context}");
        assert!(
            report.message.contains("positions 4..5"),
            "{context}: {}",
            report.message
        );
        // The explicit opt-out judges the compared positions alone.
        let verifier = verifier_holding(2, &checked, &records);
        verifier.set_require_coverage(false).unwrap();
        let report = verifier.check_stored(REQ).unwrap();
        assert_eq!(report.verdict, Verdict::Match, "{context}: {}", report.message);
        assert_eq!(
            (report.compared_positions, report.uncompared_positions),
            (4, 1),
            "{context}"
        );
        // The partial block alone (position 4, its own request): nothing in common.
        let mut alone = BlockSet::new();
        alone.add_request(REQ, checked_tokens).unwrap();
        alone.add_group(REQ, 0, 4, &block_ids[4..]).unwrap();
        alone.set_hashes(REQ, 0, &hashes[4 * HASH_BYTES..], HASH_BYTES).unwrap();
        let report = verifier_holding(2, &alone, &load_check_records(&side, &alone))
            .check_stored(REQ)
            .unwrap();
        assert_eq!(report.verdict, Verdict::Unverified, "{context}: {}", report.message);
        assert_eq!(report.reason(), Some(Reason::NoCommonPosition), "{context}");
        assert!(
            report.message.contains("another number of valid tokens"),
            "{context}: {}",
            report.message
        );
    }
}

/// Entries in the format kvcsum 0.2.0 stored (the value, then
/// `(fingerprint + coverage) XOR algorithm`, no check, no token count) under this
/// configuration: MATCHED where the value matches, OTHER_FORMAT where it does
/// not (that format cannot tell corruption from a partial block), never
/// FAILED; the verifier calls such a load UNVERIFIED (INVALID_CHECKSUMS).
/// Under another algorithm they are OTHER_FORMAT too.
#[test]
fn entries_of_the_0_2_0_format_match_or_read_as_their_format_never_failed() {
    let mut rng = Rng::for_test("entries_of_the_0_2_0_format_match_or_read_as_their_format_never_failed");
    let seed = rng.seed();
    let num_tokens = 75;
    let mut s = stored_and_reloaded(&mut rng, num_tokens);
    let blocks = blocks_with_hashes(num_tokens, &s.block_ids, &s.hashes);
    for r in 0..2 {
        let config = rank_config(&s, r);
        for q in 0..s.count {
            let sum = rank_sum(&s, r, q);
            let value = sum ^ hash_of(&s.hashes, q) ^ config.fingerprint;
            let stamp = config.fingerprint.wrapping_add(config.coverage) ^ config.algorithm as u64;
            s.side.ranks[r].stored[s.block_ids[q] as usize] = [value, stamp];
        }
    }
    use StoredOutcome::*;
    for rank in load_check(&s.side, &blocks) {
        assert!(rank.iter().all(|&o| o == Matched), "{rank:?} (seed {seed})");
    }
    let report = verifier_holding(2, &blocks, &load_check_records(&s.side, &blocks))
        .check_stored(REQ)
        .unwrap();
    assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
    // A corrupted byte under a 0.2.0 entry: its format cannot say.
    let q = rng.below(s.count as u64) as usize;
    let head = s.side.ranks[0].placement.spec().first_head;
    let token = rng.below(valid_tokens_at(num_tokens, q) as u64) as u32;
    s.side.ranks[0].placement.xor_byte(
        rng.below(3) as u32,
        head,
        s.block_ids[q],
        token,
        rng.below(64) as u32,
        0x08,
    );
    let outcomes = load_check(&s.side, &blocks);
    let mut expected = vec![Matched; s.count];
    expected[q] = OtherFormat;
    assert_eq!(outcomes[0], expected, "seed {seed}");
    assert!(outcomes[1].iter().all(|&o| o == Matched), "seed {seed}");
    let report = verifier_holding(2, &blocks, &load_check_records(&s.side, &blocks))
        .check_stored(REQ)
        .unwrap();
    assert_eq!(report.verdict, Verdict::Unverified, "seed {seed}: {}", report.message);
    assert_eq!(report.reason(), Some(Reason::InvalidChecksums), "{}", report.message);
    assert!(report.message.contains("0.2.0"), "{}", report.message);
    // Stamped with the other algorithm by 0.2.0.
    let other = if algorithm().code() == 1 { 2 } else { 1 };
    let config = rank_config(&s, 1);
    let block = s.block_ids[0] as usize;
    s.side.ranks[1].stored[block][1] = config.fingerprint.wrapping_add(config.coverage) ^ other;
    assert_eq!(load_check(&s.side, &blocks)[1][0], OtherFormat, "seed {seed}");
}

#[test]
fn positions_without_valid_tokens_are_neither_stored_nor_checked() {
    let mut rng = Rng::for_test("positions_without_valid_tokens_are_neither_stored_nor_checked");
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 64, 40));
    let mut side = deploy(&mut rng, &kv, 1, LayoutKind::Nhd, 6);
    let block_ids = [4, 1, 3, 0]; // 40 tokens hold positions 0..2; 3 is empty
    side.ranks[0].placement.write_request(&kv, 0, &block_ids[..3]);
    let hashes = random_hashes(&mut rng, 4);
    let blocks = blocks_with_hashes(40, &block_ids, &hashes);
    let junk = side.ranks[0].stored[0];
    side.ranks[0]
        .worker
        .store(&blocks, StreamHandle::legacy_default())
        .unwrap();
    assert_eq!(side.ranks[0].stored[0], junk, "block 0 (position 3) is not written");
    let outcomes = load_check(&side, &blocks);
    use StoredOutcome::*;
    assert_eq!(outcomes[0], vec![Matched, Matched, Matched, NotChecked]);
}

#[test]
fn bad_stores_fail_before_writing_anything() {
    let mut rng = Rng::for_test("bad_stores_fail_before_writing_anything");
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 64, 64));
    let mut side = deploy(&mut rng, &kv, 1, LayoutKind::Hnd, 8);
    side.ranks[0].placement.write_request(&kv, 0, &[0, 1, 2, 3]);
    let before = side.ranks[0].stored.clone();
    let stream = StreamHandle::legacy_default();
    // No hashes.
    let mut blocks = BlockSet::new();
    blocks.add_request(REQ, 64).unwrap();
    blocks.add_group(REQ, 0, 0, &[0, 1, 2, 3]).unwrap();
    let error = side.ranks[0].worker.store(&blocks, stream).err().expect("no hashes");
    assert!(
        matches!(error, Error::InvalidArgument(_)) && error.to_string().contains("block hashes"),
        "{error}"
    );
    // Hashes of the wrong count or size.
    let error = blocks
        .set_hashes(REQ, 0, &random_hashes(&mut rng, 3), HASH_BYTES)
        .unwrap_err();
    assert!(error.to_string().contains("not 4 hashes"), "{error}");
    let error = blocks.set_hashes(REQ, 0, &[0; 28], 7).unwrap_err();
    assert!(error.to_string().contains("hash_bytes is 7"), "{error}");
    // A second request's block id past the buffer: nothing of the first is written.
    blocks
        .set_hashes(REQ, 0, &random_hashes(&mut rng, 4), HASH_BYTES)
        .unwrap();
    let mut two = blocks.clone();
    two.add_request("r2", 16).unwrap();
    two.add_group("r2", 0, 0, &[7]).unwrap();
    two.set_hashes("r2", 0, &random_hashes(&mut rng, 1), HASH_BYTES)
        .unwrap();
    let address = side.ranks[0].stored.as_ptr() as u64;
    side.ranks[0].worker.add_stored(0, address, 7).unwrap();
    let error = side.ranks[0]
        .worker
        .store(&two, stream)
        .err()
        .expect("block 7 is outside");
    assert!(
        matches!(error, Error::OutOfBounds(_)) && error.to_string().contains("block id 7"),
        "{error}"
    );
    assert_eq!(side.ranks[0].stored, before, "nothing written");
    // No buffer registered for the group.
    let mut bare = host_worker(0, 1, 0, 1);
    bare.add_group(0, 16).unwrap();
    let error = bare.store(&blocks, stream).err().expect("no buffer");
    assert!(
        matches!(error, Error::NotFound(_)) && error.to_string().contains("kvcs_worker_add_stored"),
        "{error}"
    );
    // A plain result is no load check.
    let result = checksum(&side.ranks[0].worker, &blocks, Role::Consumer);
    assert!(matches!(result.stored_outcomes(REQ, 0), Err(Error::NotFound(_))));
    // Registration errors.
    let worker = &mut side.ranks[0].worker;
    assert!(matches!(worker.add_stored(5, 4096, 8), Err(Error::NotFound(_))));
    assert!(matches!(worker.add_stored(0, 4100, 8), Err(Error::Unsupported(_))));
    assert!(matches!(worker.add_stored(0, 4096, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        worker.add_stored(0, u64::MAX - 7, 2),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn c_api_round_trip_tags_and_outcomes() {
    let mut rng = Rng::for_test("c_api_round_trip_tags_and_outcomes");
    let seed = rng.seed();
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 64, 50));
    let mut placement = Placement::for_shard(&mut rng, &kv, &shard(&kv, 0, 1, 0, 1), LayoutKind::Hnd, 0, 16, 6);
    let block_ids = [5u32, 2, 0, 3];
    placement.write_request(&kv, 0, &block_ids);
    let options = kvcs_worker_options {
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        device: -1,
        num_threads: 1,
    };
    let mut worker = std::ptr::null_mut();
    assert_eq!(kvcs_worker_create(&options, &mut worker), KVCS_OK);
    let mut host = host_worker(0, 1, 0, 1);
    register_host(&mut host, &placement);
    // Register the same layout through the C API.
    for region in placement.regions(&placement.host_bases()) {
        assert_eq!(kvcs_worker_add_region(worker, region.address, region.length), KVCS_OK);
    }
    assert_eq!(kvcs_worker_add_group(worker, 0, 16), KVCS_OK);
    let identities: Vec<Vec<u8>> = placement
        .host_layer_specs()
        .iter()
        .map(|s| s.identity.clone())
        .collect();
    for (spec, identity) in placement.host_layer_specs().iter().zip(&identities) {
        let segments = c_segments(spec);
        let layer = kvcs_layer {
            group_id: 0,
            identity: identity.as_ptr(),
            identity_len: identity.len(),
            ..c_layer(spec, &segments)
        };
        assert_eq!(kvcs_worker_add_layer(worker, &layer), KVCS_OK, "{}", last_error());
    }
    let mut stored = vec![[0u64; 2]; 6];
    assert_eq!(
        kvcs_worker_add_stored(worker, 0, stored.as_mut_ptr() as u64, 6),
        KVCS_ERR_OUT_OF_BOUNDS,
        "a host buffer outside every region"
    );
    assert!(last_error().contains("no registered region"), "{}", last_error());
    assert_eq!(
        kvcs_worker_add_region(worker, stored.as_mut_ptr() as u64, 6 * 16),
        KVCS_OK
    );
    assert_eq!(
        kvcs_worker_add_stored(worker, 0, stored.as_mut_ptr() as u64, 6),
        KVCS_OK
    );
    let mut blocks = std::ptr::null_mut();
    assert_eq!(kvcs_blocks_create(&mut blocks), KVCS_OK);
    let req = CString::new(REQ).unwrap();
    assert_eq!(kvcs_blocks_add_request(blocks, req.as_ptr(), 50), KVCS_OK);
    assert_eq!(
        kvcs_blocks_add_group(blocks, req.as_ptr(), 0, 0, block_ids.as_ptr(), 4),
        KVCS_OK
    );
    let hashes = random_hashes(&mut rng, 4);
    assert_eq!(
        kvcs_blocks_set_hashes(blocks, req.as_ptr(), 0, hashes.as_ptr(), HASH_BYTES, 3),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("not 4 hashes"), "{}", last_error());
    assert_eq!(
        kvcs_blocks_set_hashes(blocks, req.as_ptr(), 0, hashes.as_ptr(), HASH_BYTES, 4),
        KVCS_OK
    );
    // Tags: the hash's first 8 bytes XOR the fingerprint of the layers' identities.
    let fingerprint = identities.iter().fold(0u64, |sum, identity| {
        sum.wrapping_add(u64::from_le_bytes(Sha256::digest(identity)[..8].try_into().unwrap()))
    });
    let mut tags = [0u64; 4];
    assert_eq!(
        kvcs_block_tags(worker, 0, hashes.as_ptr(), HASH_BYTES, 4, tags.as_mut_ptr()),
        KVCS_OK
    );
    for (i, &tag) in tags.iter().enumerate() {
        assert_eq!(tag, hash_of(&hashes, i) ^ fingerprint);
    }
    assert_eq!(
        kvcs_block_tags(worker, 0, hashes.as_ptr(), 4, 4, tags.as_mut_ptr()),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        kvcs_block_tags(worker, 9, hashes.as_ptr(), HASH_BYTES, 4, tags.as_mut_ptr()),
        KVCS_ERR_NOT_FOUND
    );
    // Store, check, corrupt, check again.
    let mut result = std::ptr::null_mut();
    assert_eq!(
        kvcs_worker_store(worker, blocks, std::ptr::null_mut(), &mut result),
        KVCS_OK
    );
    kvcs_result_destroy(result);
    let expected = naive_full(&kv, 16, 0, 4);
    for (i, &block_id) in block_ids.iter().enumerate() {
        assert_eq!(
            stored[block_id as usize][0] ^ tags[i],
            expected[i],
            "position {i} (seed {seed})"
        );
    }
    let mut outcomes = [9u8; 4];
    assert_eq!(
        kvcs_worker_check_stored(worker, blocks, std::ptr::null_mut(), &mut result),
        KVCS_OK
    );
    assert_eq!(
        kvcs_result_stored(result, req.as_ptr(), 0, outcomes.as_mut_ptr()),
        KVCS_OK
    );
    assert_eq!(outcomes, [1, 1, 1, 1]);
    assert_eq!(
        kvcs_result_stored(result, req.as_ptr(), 0, std::ptr::null_mut()),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        kvcs_result_stored(result, req.as_ptr(), 7, outcomes.as_mut_ptr()),
        KVCS_ERR_NOT_FOUND
    );
    kvcs_result_destroy(result);
    placement.xor_byte(1, 0, block_ids[2], 3, 0, 0x80);
    assert_eq!(
        kvcs_worker_check_stored(worker, blocks, std::ptr::null_mut(), &mut result),
        KVCS_OK
    );
    assert_eq!(
        kvcs_result_stored(result, req.as_ptr(), 0, outcomes.as_mut_ptr()),
        KVCS_OK
    );
    assert_eq!(outcomes, [1, 1, 0, 1], "seed {seed}");
    kvcs_result_destroy(result);
    kvcs_blocks_destroy(blocks);
    kvcs_worker_destroy(worker);
    drop(host);
}

/// Each rank's load-check record of `blocks`, as bytes.
fn load_check_records(side: &Side, blocks: &BlockSet) -> Vec<Vec<u8>> {
    side.ranks
        .iter()
        .map(|rank| {
            let result = rank
                .worker
                .check_stored(blocks, StreamHandle::legacy_default())
                .expect("check_stored");
            Record::from_checksums(&result).expect("record").encode()
        })
        .collect()
}

/// A verifier of `num_workers` expecting `blocks` as a consumer, holding `records`.
fn verifier_holding(num_workers: u32, blocks: &BlockSet, records: &[Vec<u8>]) -> Verifier {
    let verifier = Verifier::new(num_workers).unwrap();
    verifier.expect(blocks, Role::Consumer).unwrap();
    for record in records {
        verifier.add_record(record).expect("add_record");
    }
    verifier
}

fn tp_rank(tp_rank: u32, tp_size: u32) -> record::Rank {
    record::Rank {
        tp_rank,
        tp_size,
        pp_rank: 0,
    }
}

#[test]
fn offload_loads_are_judged_from_load_check_records() {
    let mut rng = Rng::for_test("offload_loads_are_judged_from_load_check_records");
    let seed = rng.seed();
    for num_tokens in [16, 75, 160] {
        // Intact: every position of every rank matched.
        let mut s = stored_and_reloaded(&mut rng, num_tokens);
        let blocks = blocks_with_hashes(num_tokens, &s.block_ids, &s.hashes);
        let report = verifier_holding(2, &blocks, &load_check_records(&s.side, &blocks))
            .check_stored(REQ)
            .unwrap();
        assert_eq!(report.verdict, Verdict::Match, "{} (seed {seed})", report.message);
        assert!(report.passed && report.mismatches.is_empty() && report.unverified.is_empty());
        assert_eq!(
            (report.compared_positions, report.uncompared_positions),
            (s.count as u64, 0),
            "seed {seed}"
        );

        // One byte of rank 1's KV at position q corrupted.
        let q = rng.below(s.count as u64) as usize;
        let (layer, head) = (rng.below(3) as u32, s.side.ranks[1].placement.spec().first_head);
        let token = rng.below(valid_tokens_at(num_tokens, q) as u64) as u32;
        s.side.ranks[1]
            .placement
            .xor_byte(layer, head, s.block_ids[q], token, rng.below(64) as u32, 0x10);
        let report = verifier_holding(2, &blocks, &load_check_records(&s.side, &blocks))
            .check_stored(REQ)
            .unwrap();
        assert_eq!(report.verdict, Verdict::Mismatch, "{} (seed {seed})", report.message);
        assert!(!report.passed);
        assert_eq!(report.mismatches.len(), 1, "{} (seed {seed})", report.message);
        let mismatch = &report.mismatches[0];
        assert_eq!(
            (mismatch.group_id, mismatch.first_position, mismatch.num_positions),
            (0, q as u64, 1),
            "seed {seed}"
        );
        assert_eq!(
            (mismatch.first_token, mismatch.num_tokens),
            (16 * q as u64, valid_tokens_at(num_tokens, q) as u64),
            "seed {seed}"
        );
        assert_eq!(mismatch.failed_workers, vec![tp_rank(1, 2)], "seed {seed}");
        assert!(mismatch.failed_checks.is_empty() && !mismatch.localised);
        assert_eq!(
            report.compared_positions, s.count as u64,
            "the failed one too (seed {seed})"
        );
        assert!(
            report.message.contains(&format!("position {q} (tokens {}..", 16 * q)),
            "{}",
            report.message
        );
        assert!(report.message.contains("(pp_rank 0, tp_rank 1)"), "{}", report.message);

        // And rank 0's KV at another position: both named, each with its rank.
        if s.count > 1 {
            let other = (q + 1 + rng.below(s.count as u64 - 1) as usize) % s.count;
            let head = s.side.ranks[0].placement.spec().first_head;
            s.side.ranks[0]
                .placement
                .xor_byte(0, head, s.block_ids[other], 0, 0, 0x01);
            let report = verifier_holding(2, &blocks, &load_check_records(&s.side, &blocks))
                .check_stored(REQ)
                .unwrap();
            let mut expected = vec![(q as u64, vec![tp_rank(1, 2)]), (other as u64, vec![tp_rank(0, 2)])];
            expected.sort();
            let found: Vec<(u64, Vec<record::Rank>)> = report
                .mismatches
                .iter()
                .map(|m| (m.first_position, m.failed_workers.clone()))
                .collect();
            assert_eq!(found, expected, "seed {seed}");
        }
    }
}

/// An offload load's report counts the positions whose load check failed
/// among those compared, as a payload check counts the positions that
/// mismatch: every position failing gives MISMATCH with every position
/// compared (never "0 compared"), and the same corruption judged against a
/// producer's payload gives the same count.
#[test]
fn failed_positions_count_as_compared_as_in_a_payload_check() {
    let mut rng = Rng::for_test("failed_positions_count_as_compared_as_in_a_payload_check");
    let seed = rng.seed();
    for num_tokens in [16, 75, 160] {
        let mut s = stored_and_reloaded(&mut rng, num_tokens);
        let blocks = blocks_with_hashes(num_tokens, &s.block_ids, &s.hashes);
        // The producer's payload of the intact KV (the same blocks and layout).
        let producer = Verifier::new(2).unwrap();
        producer.expect(&blocks, Role::Producer).unwrap();
        for rank in &s.side.ranks {
            let result = checksum(&rank.worker, &blocks, Role::Producer);
            producer
                .add_record(&Record::from_checksums(&result).unwrap().encode())
                .unwrap();
        }
        let payload = producer.payload(REQ).expect("payload").encode();
        // Corrupt a random set of positions (at least one, up to all) on a random rank.
        let corrupted: Vec<usize> = (0..s.count).filter(|_| rng.chance(1, 2)).collect();
        let corrupted = if corrupted.is_empty() || rng.chance(1, 3) {
            (0..s.count).collect()
        } else {
            corrupted
        };
        for &q in &corrupted {
            let r = rng.below(2) as usize;
            let head = s.side.ranks[r].placement.spec().first_head;
            let token = rng.below(valid_tokens_at(num_tokens, q) as u64) as u32;
            s.side.ranks[r].placement.xor_byte(
                rng.below(3) as u32,
                head,
                s.block_ids[q],
                token,
                rng.below(64) as u32,
                0x20,
            );
        }
        let stored = verifier_holding(2, &blocks, &load_check_records(&s.side, &blocks))
            .check_stored(REQ)
            .unwrap();
        let context = format!("seed {seed}, {num_tokens} tokens, positions {corrupted:?} corrupted");
        assert_eq!(stored.verdict, Verdict::Mismatch, "{context}: {}", stored.message);
        let failed: Vec<u64> = stored.mismatches.iter().map(|m| m.first_position).collect();
        assert_eq!(
            failed,
            corrupted.iter().map(|&q| q as u64).collect::<Vec<_>>(),
            "{context}"
        );
        assert_eq!(
            (stored.compared_positions, stored.uncompared_positions),
            (s.count as u64, 0),
            "{context}: {}",
            stored.message
        );
        let consumer = Verifier::new(2).unwrap();
        consumer.expect(&blocks, Role::Consumer).unwrap();
        for rank in &s.side.ranks {
            let result = checksum(&rank.worker, &blocks, Role::Consumer);
            consumer
                .add_record(&Record::from_checksums(&result).unwrap().encode())
                .unwrap();
        }
        let checked = consumer.check(REQ, Some(&payload)).unwrap();
        assert_eq!(checked.verdict, Verdict::Mismatch, "{context}: {}", checked.message);
        assert_eq!(
            (checked.compared_positions, checked.uncompared_positions),
            (stored.compared_positions, stored.uncompared_positions),
            "{context}: the payload check and the load check count alike"
        );
    }
}

/// Valid tokens of position `q` of a request of `num_tokens` (block size 16).
fn valid_tokens_at(num_tokens: u64, q: usize) -> u32 {
    num_tokens.saturating_sub(16 * q as u64).min(16) as u32
}

#[test]
fn offload_loads_without_every_load_check_are_unverified() {
    let mut rng = Rng::for_test("offload_loads_without_every_load_check_are_unverified");
    let seed = rng.seed();
    let num_tokens = 90;
    let s = stored_and_reloaded(&mut rng, num_tokens);
    let blocks = blocks_with_hashes(num_tokens, &s.block_ids, &s.hashes);
    let load_checks = load_check_records(&s.side, &blocks);
    let plain: Vec<Vec<u8>> = s
        .side
        .ranks
        .iter()
        .map(|rank| {
            let result = checksum(&rank.worker, &blocks, Role::Consumer);
            Record::from_checksums(&result).unwrap().encode()
        })
        .collect();

    // Rank 1's record missing.
    let verifier = verifier_holding(2, &blocks, &load_checks[..1]);
    let report = verifier.check_stored(REQ).unwrap();
    assert_eq!(report.verdict, Verdict::Unverified, "seed {seed}");
    assert_eq!(report.reason(), Some(Reason::WorkersMissing), "{}", report.message);
    assert!(report.message.contains("(pp_rank 0, tp_rank 1)"), "{}", report.message);
    assert!(!report.passed, "fail-closed by default");
    verifier.set_policy(Policy::FailOpen).unwrap();
    assert!(verifier.check_stored(REQ).unwrap().passed, "fail-open passes");

    // Plain checksum records, and one plain record beside a load check.
    for (records, who) in [
        (plain.clone(), "tp_rank 0"),
        (vec![load_checks[0].clone(), plain[1].clone()], "tp_rank 1"),
    ] {
        let report = verifier_holding(2, &blocks, &records).check_stored(REQ).unwrap();
        assert_eq!(report.verdict, Verdict::Unverified, "seed {seed}");
        assert_eq!(report.reason(), Some(Reason::NotLoadCheck), "{}", report.message);
        assert!(report.message.contains(who), "{}", report.message);
        assert!(report.message.contains("not of a load check"), "{}", report.message);
    }

    // Producers' records say nothing of a consumer's load.
    let verifier = Verifier::new(2).unwrap();
    verifier.expect(&blocks, Role::Producer).unwrap();
    let error = verifier.check_stored(REQ).unwrap_err();
    assert!(matches!(error, Error::InvalidArgument(_)), "{error}");
    let error = verifier.check_stored("never-expected").unwrap_err();
    assert!(matches!(error, Error::NotFound(_)), "{error}");
}

#[test]
fn load_check_records_round_trip_with_their_outcomes() {
    let mut rng = Rng::for_test("load_check_records_round_trip_with_their_outcomes");
    let seed = rng.seed();
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 64, 40));
    let mut side = deploy(&mut rng, &kv, 1, LayoutKind::Nhd, 6);
    let block_ids = [4, 1, 3, 0]; // 40 tokens hold positions 0..2; 3 is empty
    side.ranks[0].placement.write_request(&kv, 0, &block_ids[..3]);
    let blocks = blocks_with_hashes(40, &block_ids, &random_hashes(&mut rng, 4));
    side.ranks[0]
        .worker
        .store(&blocks, StreamHandle::legacy_default())
        .unwrap();
    side.ranks[0].placement.xor_byte(1, 0, block_ids[2], 7, 3, 0x04);
    let worker = &side.ranks[0].worker;
    let result = worker.check_stored(&blocks, StreamHandle::legacy_default()).unwrap();
    use StoredOutcome::*;
    assert_eq!(
        result.stored_outcomes(REQ, 0).unwrap(),
        vec![Matched, Matched, Failed, NotChecked],
        "seed {seed}"
    );
    let record = Record::from_checksums(&result).unwrap();
    assert_eq!(
        record.requests[0].groups[0].stored,
        Some(vec![Matched, Matched, Failed, NotChecked])
    );
    let bytes = record.encode();
    assert_eq!(Record::decode(&bytes).unwrap(), record, "round trip");
    // The outcomes are the last group's last element: bin of 4, then no
    // skipped groups, then the record's algorithm (3, MIXED2).
    assert_eq!(&bytes[bytes.len() - 8..], &[0xc4, 4, 1, 1, 0, 2, 0x90, 3]);
    // The verifier names position 2 (tokens 32..40), compared like 0 and 1;
    // position 3 is neither compared nor not.
    let report = verifier_holding(1, &blocks, std::slice::from_ref(&bytes))
        .check_stored(REQ)
        .unwrap();
    assert_eq!(report.verdict, Verdict::Mismatch, "{}", report.message);
    assert_eq!(
        (report.compared_positions, report.uncompared_positions),
        (3, 0),
        "{}",
        report.message
    );
    let m = &report.mismatches[0];
    assert_eq!((m.first_position, m.first_token, m.num_tokens), (2, 32, 8));

    // A plain call's record carries none: nil, not an empty bin.
    let plain = Record::from_checksums(&checksum(worker, &blocks, Role::Consumer)).unwrap();
    assert_eq!(plain.requests[0].groups[0].stored, None);
    let plain_bytes = plain.encode();
    assert_eq!(&plain_bytes[plain_bytes.len() - 3..], &[0xc0, 0x90, 3]);
    assert_eq!(Record::decode(&plain_bytes).unwrap(), plain);

    // Malformed: an outcome number that is none, a wrong count, nil in the
    // place of a bin's type, outcomes in a producer record, and a load
    // check's group beside a plain one.
    let mut bad = bytes.clone();
    let at = bad.len() - 4;
    bad[at] = 7;
    malformed(Record::decode(&bad), "outcome 2 is 7");
    let mut bad = bytes.clone();
    let at = bad.len() - 8;
    bad[at] = 0xc2; // a boolean where the outcomes start
    bad.drain(at + 1..bad.len() - 2);
    malformed(Record::decode(&bad), "expected nil or a bin");
    let mut short = record.clone();
    short.requests[0].groups[0].stored.as_mut().unwrap().pop();
    malformed(Record::decode(&short.encode()), "3 stored outcomes for num_positions 4");
    let mut long = record.clone();
    long.requests[0].groups[0].stored.as_mut().unwrap().push(Matched);
    malformed(Record::decode(&long.encode()), "5 stored outcomes for num_positions 4");
    let mut producer = Record::from_checksums(&checksum(worker, &blocks, Role::Producer)).unwrap();
    producer.requests[0].groups[0].stored = Some(vec![Matched; 4]);
    malformed(Record::decode(&producer.encode()), "producer record");
    let mut mixed = record.clone();
    let mut other = mixed.requests[0].clone();
    other.req_id = "other".to_owned();
    other.groups[0].stored = None;
    mixed.requests.push(other);
    malformed(Record::decode(&mixed.encode()), "has no stored outcomes");
    assert!(matches!(mixed.validate(), Err(Error::Malformed(_))));
}

fn malformed(result: kvcsum::Result<Record>, needle: &str) {
    match result {
        Err(Error::Malformed(message)) => assert!(message.contains(needle), "{message:?} lacks {needle:?}"),
        other => panic!("expected Malformed containing {needle:?}, got {other:?}"),
    }
}

/// Random damage to entries kept by a connector (`kvcs_result_entries`,
/// judged by `kvcs_result_check_entries`): each damaged entry must fail. A
/// damaged entry passes the check only by a chance of about 2^-32 (SPEC
/// section 8), so any escape in this many trials is a defect.
/// `KVCS_STORED_DAMAGE_TRIALS` sets the number of damaged entries (default
/// 2^16; SPEC section 8 records a run of 10^8); the counts are printed:
/// `cargo test --release --test it stored::random_damage -- --nocapture`.
#[test]
fn random_damage_to_kept_entries_always_fails() {
    let mut rng = Rng::for_test("random_damage_to_kept_entries_always_fails");
    let seed = rng.seed();
    let trials: u64 = std::env::var("KVCS_STORED_DAMAGE_TRIALS")
        .ok()
        .map_or(1 << 16, |text| text.trim().parse().expect("a number of trials"));
    // 64 positions of 4 tokens, one layer of one head: a cheap checksum.
    let (positions, block_size) = (64usize, 4u32);
    let num_tokens = positions as u64 * block_size as u64 - 1; // the last block partial
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(1, 1, 16, num_tokens));
    let mut placement = Placement::for_shard(
        &mut rng,
        &kv,
        &shard(&kv, 0, 1, 0, 1),
        LayoutKind::Hnd,
        0,
        block_size,
        positions as u32,
    );
    let block_ids: Vec<u32> = rng.permutation(positions as u32);
    placement.write_request(&kv, 0, &block_ids);
    let worker = CWorkerHandle::over(&placement, block_size);
    let hashes = random_hashes(&mut rng, positions);
    let req = CString::new(REQ).unwrap();
    let mut blocks = std::ptr::null_mut();
    assert_eq!(kvcs_blocks_create(&mut blocks), KVCS_OK);
    assert_eq!(kvcs_blocks_add_request(blocks, req.as_ptr(), num_tokens), KVCS_OK);
    assert_eq!(
        kvcs_blocks_add_group(blocks, req.as_ptr(), 0, 0, block_ids.as_ptr(), positions),
        KVCS_OK
    );
    assert_eq!(
        kvcs_blocks_set_hashes(blocks, req.as_ptr(), 0, hashes.as_ptr(), HASH_BYTES, positions),
        KVCS_OK
    );
    let mut result = std::ptr::null_mut();
    assert_eq!(
        kvcs_worker_checksum(worker.0, blocks, 1, std::ptr::null_mut(), &mut result),
        KVCS_OK
    );
    let mut entries = vec![0u64; 2 * positions];
    assert_eq!(
        kvcs_result_entries(result, req.as_ptr(), 0, entries.as_mut_ptr()),
        KVCS_OK,
        "{}",
        last_error()
    );
    let mut outcomes = vec![9u8; positions];
    assert_eq!(
        kvcs_result_check_entries(result, req.as_ptr(), 0, entries.as_ptr(), outcomes.as_mut_ptr()),
        KVCS_OK
    );
    assert!(
        outcomes
            .iter()
            .all(|&o| o == kvcs_stored_outcome::KVCS_STORED_MATCHED as u8),
        "{outcomes:?}"
    );
    let faults = [
        "one bit",
        "2-8 bits",
        "a random value word",
        "a random stamp word",
        "a random entry",
        "another position's entry",
    ];
    let mut escaped: BTreeMap<(&str, u8), u64> = BTreeMap::new();
    let mut damaged_count = [0u64; 6];
    let mut done = 0u64;
    while done < trials {
        let mut damaged = entries.clone();
        let mut kinds = Vec::with_capacity(positions);
        for q in 0..positions {
            let kind = rng.below(faults.len() as u64) as usize;
            let intact = [entries[2 * q], entries[2 * q + 1]];
            let mut entry = intact;
            while entry == intact {
                match kind {
                    0 => {
                        let bit = rng.below(128);
                        entry[(bit / 64) as usize] ^= 1 << (bit % 64);
                    }
                    1 => {
                        for _ in 0..rng.range(2..9) {
                            let bit = rng.below(128);
                            entry[(bit / 64) as usize] ^= 1 << (bit % 64);
                        }
                    }
                    2 => entry[0] = rng.next_u64(),
                    3 => entry[1] = rng.next_u64(),
                    4 => entry = [rng.next_u64(), rng.next_u64()],
                    _ => {
                        let other = rng.below(positions as u64) as usize;
                        entry = [entries[2 * other], entries[2 * other + 1]];
                    }
                }
            }
            damaged[2 * q] = entry[0];
            damaged[2 * q + 1] = entry[1];
            kinds.push(kind);
        }
        assert_eq!(
            kvcs_result_check_entries(result, req.as_ptr(), 0, damaged.as_ptr(), outcomes.as_mut_ptr()),
            KVCS_OK
        );
        for (q, &outcome) in outcomes.iter().enumerate() {
            damaged_count[kinds[q]] += 1;
            if outcome != kvcs_stored_outcome::KVCS_STORED_FAILED as u8 {
                *escaped.entry((faults[kinds[q]], outcome)).or_default() += 1;
            }
        }
        done += positions as u64;
    }
    eprintln!("[random damage] seed {seed}: {done} damaged entries");
    for (kind, name) in faults.iter().enumerate() {
        let missed: u64 = escaped.iter().filter(|((f, _), _)| f == name).map(|(_, n)| n).sum();
        eprintln!("  {name}: {} damaged, {missed} not failed", damaged_count[kind]);
    }
    kvcs_result_destroy(result);
    kvcs_blocks_destroy(blocks);
    assert!(
        escaped.is_empty(),
        "seed {seed}: damaged entries that did not fail: {escaped:?}"
    );
}

/// An owned C host worker over a placement's buffers (one thread).
struct CWorkerHandle(*mut kvcs_worker);

impl CWorkerHandle {
    fn over(placement: &Placement, block_size: u32) -> CWorkerHandle {
        let options = kvcs_worker_options {
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            device: -1,
            num_threads: 1,
        };
        let mut worker = std::ptr::null_mut();
        assert_eq!(kvcs_worker_create(&options, &mut worker), KVCS_OK);
        for region in placement.regions(&placement.host_bases()) {
            assert_eq!(kvcs_worker_add_region(worker, region.address, region.length), KVCS_OK);
        }
        assert_eq!(kvcs_worker_add_group(worker, 0, block_size), KVCS_OK);
        for spec in placement.host_layer_specs() {
            let segments = c_segments(&spec);
            assert_eq!(
                kvcs_worker_add_layer(worker, &c_layer(&spec, &segments)),
                KVCS_OK,
                "{}",
                last_error()
            );
        }
        CWorkerHandle(worker)
    }
}

impl Drop for CWorkerHandle {
    fn drop(&mut self) {
        kvcs_worker_destroy(self.0);
    }
}

/// A worker of `algorithm` over `rank`'s cache and stored-checksum buffer,
/// registered as `deploy` registers the rank's own.
fn twin(rank: &Rank, tp_rank: u32, tp_size: u32, algorithm: kvcsum::Algorithm) -> Worker {
    with_algorithm(algorithm, || {
        let mut worker = host_worker(tp_rank, tp_size, 0, 2);
        worker.add_group(0, 16).unwrap();
        for region in rank.placement.regions(&rank.placement.host_bases()) {
            worker.add_region(region).unwrap();
        }
        for mut spec in rank.placement.host_layer_specs() {
            spec.identity = identity(spec.layer_number);
            worker.add_layer(spec).unwrap();
        }
        worker
            .add_region(Region {
                address: rank.stored.as_ptr() as u64,
                length: std::mem::size_of_val(rank.stored.as_slice()) as u64,
            })
            .unwrap();
        worker
            .add_stored(0, rank.stored.as_ptr() as u64, rank.stored.len() as u64)
            .unwrap();
        worker
    })
}

/// Values stored under MIXED (kvcsum 0.2's default, algorithm 2) and
/// load-checked under MIXED2 (0.3's, algorithm 3), and the other way round,
/// are never judged: every position reads "other algorithm", and the
/// verifier calls the load unverified (the algorithms differ), never a
/// mismatch, even where the loaded KV is corrupted. A load check under the
/// storing algorithm still matches, and still fails the corrupted position.
#[test]
fn values_stored_under_another_mixing_function_are_other_algorithm() {
    use kvcsum::Algorithm::{Mixed, Mixed2};
    let mut rng = Rng::for_test("values_stored_under_another_mixing_function_are_other_algorithm");
    let seed = rng.seed();
    for (stored_under, checked_under) in [(Mixed, Mixed2), (Mixed2, Mixed)] {
        let num_tokens = 75;
        let mut s = with_algorithm(stored_under, || stored_and_reloaded(&mut rng, num_tokens));
        let blocks = blocks_with_hashes(num_tokens, &s.block_ids, &s.hashes);
        let same = load_check(&s.side, &blocks);
        assert!(
            same.iter().flatten().all(|&o| o == StoredOutcome::Matched),
            "{stored_under:?}: {same:?} (seed {seed})"
        );
        for corrupt in [false, true] {
            if corrupt {
                let head = s.side.ranks[1].placement.spec().first_head;
                s.side.ranks[1].placement.xor_byte(1, head, s.block_ids[2], 5, 9, 0x40);
                assert_eq!(failed_positions(&load_check(&s.side, &blocks)), vec![2], "seed {seed}");
            }
            let twins: Vec<Worker> = s
                .side
                .ranks
                .iter()
                .enumerate()
                .map(|(tp_rank, rank)| twin(rank, tp_rank as u32, 2, checked_under))
                .collect();
            let mut records = Vec::new();
            for worker in &twins {
                let result = worker
                    .check_stored(&blocks, StreamHandle::legacy_default())
                    .expect("check_stored");
                let outcomes = result.stored_outcomes(REQ, 0).unwrap();
                assert!(
                    outcomes.iter().all(|&o| o == StoredOutcome::OtherAlgorithm),
                    "stored under {stored_under:?}, checked under {checked_under:?}: {outcomes:?} (seed {seed})"
                );
                records.push(Record::from_checksums(&result).unwrap().encode());
            }
            let report = verifier_holding(2, &blocks, &records).check_stored(REQ).unwrap();
            assert_eq!(report.verdict, Verdict::Unverified, "{} (seed {seed})", report.message);
            assert_eq!(
                report.reason(),
                Some(Reason::AlgorithmDiffers),
                "{} (seed {seed})",
                report.message
            );
            assert!(report.mismatches.is_empty(), "seed {seed}");
        }
    }
}
