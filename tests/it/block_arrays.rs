//! A block set built from arrays in one call (`BlockSet::add_arrays`, SPEC
//! section 5) is the set the per-request calls build: the same requests,
//! groups, blocks and hashes, hence the same checksums and stored values, on
//! random batches; and arrays that disagree with each other or with the set
//! are refused with nothing added.
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it block_arrays::<name>`.

use crate::support;

use kvcsum::{BlockArrays, BlockSet, Region, Role, StreamHandle};
use support::*;

const HASH_BYTES: usize = 32;
const BLOCK_SIZE: u32 = 16;
const NUM_BLOCKS: u32 = 96;

/// One request of a random batch: per group (id, first position, block ids,
/// hashes of `HASH_BYTES` bytes per block).
struct Request {
    req_id: String,
    num_tokens: u64,
    groups: Vec<(u32, u64, Vec<u32>, Vec<u8>)>,
}

fn random_batch(rng: &mut Rng, count: usize) -> Vec<Request> {
    (0..count)
        .map(|r| {
            let num_tokens = rng.range(0..200);
            // Groups 0 and 1 in random order, sometimes one of them only.
            let mut group_ids = match rng.below(3) {
                0 => vec![0],
                1 => vec![1],
                _ => vec![0, 1],
            };
            if rng.below(2) == 0 {
                group_ids.reverse();
            }
            let groups = group_ids
                .into_iter()
                .map(|g| {
                    let count = rng.below(6) as usize;
                    let first = rng.below(4);
                    let ids = (0..count).map(|_| rng.below(NUM_BLOCKS as u64) as u32).collect();
                    let hashes = (0..count * HASH_BYTES).map(|_| rng.next_u64() as u8).collect();
                    (g, first, ids, hashes)
                })
                .collect();
            Request {
                // Ids of several lengths, some not ASCII.
                req_id: format!("req-{r}-{}", "é".repeat(rng.below(3) as usize)),
                num_tokens,
                groups,
            }
        })
        .collect()
}

/// The naive path: one call per request, group and hashes.
fn per_request(batch: &[Request], with_hashes: bool) -> BlockSet {
    let mut set = BlockSet::new();
    for request in batch {
        set.add_request(&request.req_id, request.num_tokens).unwrap();
        for (g, first, ids, hashes) in &request.groups {
            set.add_group(&request.req_id, *g, *first, ids).unwrap();
            if with_hashes {
                set.set_hashes(&request.req_id, *g, hashes, HASH_BYTES).unwrap();
            }
        }
    }
    set
}

/// The batch's arrays in compressed rows.
struct Arrays {
    req_ids: Vec<u8>,
    req_id_ends: Vec<usize>,
    num_tokens: Vec<u64>,
    group_ends: Vec<usize>,
    group_ids: Vec<u32>,
    first_positions: Vec<u64>,
    block_ends: Vec<usize>,
    block_ids: Vec<u32>,
    hashes: Vec<u8>,
}

impl Arrays {
    fn of(batch: &[Request]) -> Arrays {
        let mut a = Arrays {
            req_ids: vec![],
            req_id_ends: vec![],
            num_tokens: vec![],
            group_ends: vec![],
            group_ids: vec![],
            first_positions: vec![],
            block_ends: vec![],
            block_ids: vec![],
            hashes: vec![],
        };
        for request in batch {
            a.req_ids.extend_from_slice(request.req_id.as_bytes());
            a.req_id_ends.push(a.req_ids.len());
            a.num_tokens.push(request.num_tokens);
            for (g, first, ids, hashes) in &request.groups {
                a.group_ids.push(*g);
                a.first_positions.push(*first);
                a.block_ids.extend_from_slice(ids);
                a.block_ends.push(a.block_ids.len());
                a.hashes.extend_from_slice(hashes);
            }
            a.group_ends.push(a.group_ids.len());
        }
        a
    }

    fn view(&self, with_hashes: bool) -> BlockArrays<'_> {
        BlockArrays {
            req_ids: &self.req_ids,
            req_id_ends: &self.req_id_ends,
            num_tokens: &self.num_tokens,
            group_ends: &self.group_ends,
            group_ids: &self.group_ids,
            first_positions: &self.first_positions,
            block_ends: &self.block_ends,
            block_ids: &self.block_ids,
            hashes: with_hashes.then_some((&self.hashes[..], HASH_BYTES)),
        }
    }
}

#[test]
fn arrays_build_the_set_the_per_request_calls_build() {
    let mut rng = Rng::for_test("arrays_build_the_set_the_per_request_calls_build");
    let seed = rng.seed();
    for round in 0..40 {
        let count = rng.below(20) as usize;
        let batch = random_batch(&mut rng, count);
        let with_hashes = round % 2 == 0;
        let naive = per_request(&batch, with_hashes);
        let mut bulk = BlockSet::new();
        bulk.add_arrays(&Arrays::of(&batch).view(with_hashes)).unwrap();
        assert_eq!(bulk.requests(), naive.requests(), "round {round} (seed {seed})");
        assert_eq!(bulk.num_groups(), naive.num_groups(), "round {round} (seed {seed})");
        assert_eq!(bulk.num_blocks(), naive.num_blocks(), "round {round} (seed {seed})");
        for request in &batch {
            assert!(
                bulk.request(&request.req_id).is_some(),
                "{} indexed (seed {seed})",
                request.req_id
            );
        }
    }
}

#[test]
fn arrays_added_after_requests_extend_the_set() {
    let mut rng = Rng::for_test("arrays_added_after_requests_extend_the_set");
    let seed = rng.seed();
    let batch = random_batch(&mut rng, 12);
    let naive = per_request(&batch, true);
    let (head, tail) = batch.split_at(5);
    let mut mixed = per_request(head, true);
    mixed.add_arrays(&Arrays::of(tail).view(true)).unwrap();
    assert_eq!(mixed.requests(), naive.requests(), "seed {seed}");
    assert_eq!(mixed.num_blocks(), naive.num_blocks(), "seed {seed}");
}

/// A host worker over two groups of random cache bytes, with stored-value
/// buffers.
struct Rank {
    worker: kvcsum::Worker,
    _placements: Vec<Placement>,
    stored: Vec<Vec<[u64; 2]>>,
}

fn host_rank(rng: &mut Rng) -> Rank {
    let kv = LogicalKv::random(rng, KvShape::gqa(4, 2, 32, 16));
    let mut worker = host_worker(0, 1, 0, 1);
    let mut placements = vec![];
    let mut stored = vec![];
    for group in 0..2 {
        let placement = Placement::for_shard(
            rng,
            &kv,
            &shard(&kv, 0, 1, group, 2),
            LayoutKind::Hnd,
            group,
            BLOCK_SIZE,
            NUM_BLOCKS,
        );
        register_host(&mut worker, &placement);
        placements.push(placement);
        stored.push(vec![[0u64; 2]; NUM_BLOCKS as usize]);
    }
    for (group, buffer) in stored.iter().enumerate() {
        worker
            .add_region(Region {
                address: buffer.as_ptr() as u64,
                length: std::mem::size_of_val(buffer.as_slice()) as u64,
            })
            .unwrap();
        worker
            .add_stored(group as u32, buffer.as_ptr() as u64, NUM_BLOCKS as u64)
            .unwrap();
    }
    Rank {
        worker,
        _placements: placements,
        stored,
    }
}

#[test]
fn arrays_give_the_checksums_and_stored_values_of_the_per_request_calls() {
    let mut rng = Rng::for_test("arrays_give_the_checksums_and_stored_values_of_the_per_request_calls");
    let seed = rng.seed();
    let mut rank = host_rank(&mut rng);
    let mut stored_rounds = 0;
    for round in 0..10 {
        // Distinct block ids per group: a store writes one value per id.
        let count = 1 + rng.below(10) as usize;
        let mut batch = random_batch(&mut rng, count);
        let mut allocators = [
            BlockAllocator::new(&mut rng, NUM_BLOCKS),
            BlockAllocator::new(&mut rng, NUM_BLOCKS),
        ];
        for request in &mut batch {
            for (g, _, ids, _) in &mut request.groups {
                *ids = allocators[*g as usize].take(ids.len());
            }
        }
        let naive = per_request(&batch, true);
        let mut bulk = BlockSet::new();
        bulk.add_arrays(&Arrays::of(&batch).view(true)).unwrap();
        for role in [Role::Producer, Role::Consumer] {
            let a = checksum(&rank.worker, &naive, role);
            let b = checksum(&rank.worker, &bulk, role);
            for request in &batch {
                for (g, _, _, _) in &request.groups {
                    assert_eq!(
                        columns_of(&b, &request.req_id, *g),
                        columns_of(&a, &request.req_id, *g),
                        "round {round}, {role:?}, {} group {g} (seed {seed})",
                        request.req_id
                    );
                }
            }
        }
        for buffer in &mut rank.stored {
            buffer.fill([0, 0]);
        }
        rank.worker
            .store(&naive, StreamHandle::legacy_default())
            .unwrap()
            .wait()
            .unwrap();
        let by_calls = rank.stored.clone();
        for buffer in &mut rank.stored {
            buffer.fill([0, 0]);
        }
        rank.worker
            .store(&bulk, StreamHandle::legacy_default())
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(rank.stored, by_calls, "round {round}: stored values (seed {seed})");
        stored_rounds += usize::from(by_calls.iter().flatten().any(|v| v[0] != 0));
    }
    assert!(
        stored_rounds >= 5,
        "{stored_rounds} of 10 rounds stored values (seed {seed})"
    );
}

/// Each way the arrays can disagree, with the words its message must hold.
fn broken(a: &Arrays) -> Vec<(&'static str, Arrays, &'static str)> {
    let copy = |f: &dyn Fn(&mut Arrays)| {
        let mut b = Arrays {
            req_ids: a.req_ids.clone(),
            req_id_ends: a.req_id_ends.clone(),
            num_tokens: a.num_tokens.clone(),
            group_ends: a.group_ends.clone(),
            group_ids: a.group_ids.clone(),
            first_positions: a.first_positions.clone(),
            block_ends: a.block_ends.clone(),
            block_ids: a.block_ids.clone(),
            hashes: a.hashes.clone(),
        };
        f(&mut b);
        b
    };
    let last = a.req_id_ends.len() - 1;
    vec![
        (
            "fewer token counts",
            copy(&|b| {
                b.num_tokens.pop();
            }),
            "num_tokens",
        ),
        (
            "fewer first positions",
            copy(&|b| {
                b.first_positions.pop();
            }),
            "first_positions",
        ),
        (
            "an id end past the ids",
            copy(&|b| b.req_id_ends[last] += 1),
            "req_id_ends ends at",
        ),
        (
            "a group end past the groups",
            copy(&|b| b.group_ends[last] += 1),
            "group_ends ends at",
        ),
        (
            "a block end past the blocks",
            copy(&|b| {
                b.block_ids.pop();
            }),
            "block_ends ends at",
        ),
        (
            "a missing hash byte",
            copy(&|b| {
                b.hashes.pop();
            }),
            "hash bytes are not",
        ),
        (
            "an empty last id",
            copy(&|b| b.req_id_ends[last] = b.req_id_ends[last - 1]),
            "req_id_ends ends at",
        ),
        (
            "a decreasing end",
            copy(&|b| b.req_id_ends[0] = b.req_id_ends[last] + 1),
            "is below",
        ),
        (
            "the last id not UTF-8",
            copy(&|b| *b.req_ids.last_mut().unwrap() = 0xff),
            "is not UTF-8",
        ),
        (
            "the last id twice",
            copy(&|b| {
                let start = b.req_id_ends[last - 1];
                let id: Vec<u8> = b.req_ids[start..].to_vec();
                b.req_ids.extend_from_slice(&id);
                b.req_id_ends.push(b.req_ids.len());
                b.num_tokens.push(1);
                b.group_ends.push(*b.group_ends.last().unwrap());
            }),
            "is given twice",
        ),
        (
            "a group twice",
            copy(&|b| {
                b.group_ids.push(b.group_ids[b.group_ids.len() - 1]);
                b.first_positions.push(0);
                b.block_ends.push(*b.block_ends.last().unwrap());
                b.group_ends[last] += 1;
            }),
            "is given twice for",
        ),
        (
            "a position overflow",
            copy(&|b| {
                b.group_ids.push(7);
                b.first_positions.push(u64::MAX);
                b.block_ids.push(1);
                b.hashes.extend_from_slice(&[1; HASH_BYTES]);
                b.block_ends.push(b.block_ids.len());
                b.group_ends[last] += 1;
            }),
            "overflows",
        ),
    ]
}

#[test]
fn arrays_that_disagree_are_refused_and_add_nothing() {
    let mut rng = Rng::for_test("arrays_that_disagree_are_refused_and_add_nothing");
    let seed = rng.seed();
    let mut batch = random_batch(&mut rng, 6);
    for request in &mut batch {
        if request.groups.is_empty() || request.groups[0].2.is_empty() {
            request.groups = vec![(0, 0, vec![3, 4], vec![9; 2 * HASH_BYTES])];
        }
    }
    let arrays = Arrays::of(&batch);
    let before = per_request(&batch[..1], true);
    for (what, bad, needle) in broken(&arrays) {
        let mut set = per_request(&batch[..1], true);
        // Request 0 is in the set already: build a fresh one for the other
        // cases, so that each error is the one named.
        set = if what.contains("twice") || what.contains("overflow") || what.contains("UTF") {
            BlockSet::new()
        } else {
            set
        };
        let expected = set.requests().to_vec();
        let error = set.add_arrays(&bad.view(true)).expect_err(what);
        assert!(error.to_string().contains(needle), "{what}: {error} (seed {seed})");
        assert_eq!(set.requests(), &expected[..], "{what}: nothing added (seed {seed})");
        assert_eq!(
            set.num_blocks(),
            expected
                .iter()
                .flat_map(|r| &r.groups)
                .map(|g| g.block_ids.len())
                .sum::<usize>()
        );
    }
    // A request already in the set: refused, nothing of the batch added.
    let mut set = before;
    let error = set.add_arrays(&arrays.view(true)).expect_err("request 0 twice");
    assert!(
        error.to_string().contains("is already in the block set"),
        "{error} (seed {seed})"
    );
    assert_eq!(set.requests().len(), 1, "seed {seed}");
}
