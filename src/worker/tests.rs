//! The device store's and load check's items, checked without a device:
//! a host worker's values run through the items as `kvcs_store` does
//! must give the host store's bytes, and gathered values must give the
//! host load check's verdicts.

use super::*;
use crate::inputs::layout::{ReplicaKey, Segment};
use crate::plan::{Row, RowRoom};
use crate::results::checksums::{StoredOutcome, StoredValues};

const HEADS: u32 = 2;
const BLOCK: u32 = 16;
const TOKEN_BYTES: u32 = 64;
const BLOCKS: u32 = 12;

/// xorshift64: seeded random data, never zeros.
fn random(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Words of a stored buffer per block id: the value and the stamp.
const WORDS: usize = (StoredBuffer::BYTES_PER_BLOCK / 8) as usize;

/// A host worker with two groups over `cache` (HND, 2 heads, 2 layers
/// each) and a stored buffer per group ([`WORDS`] per block id).
fn worker(cache: &[u64], stored: [&mut [u64]; 2]) -> Worker {
    let mut worker = Worker::new(WorkerOptions {
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        device: None,
        num_threads: 1,
    })
    .unwrap();
    let bytes = std::mem::size_of_val(cache) as u64;
    worker
        .add_region(Region {
            address: cache.as_ptr() as u64,
            length: bytes,
        })
        .unwrap();
    let layer_bytes = (HEADS * BLOCK * TOKEN_BYTES * BLOCKS) as u64;
    for (group_id, buffer) in (0..2u32).zip(stored) {
        worker.add_group(group_id, BLOCK).unwrap();
        for l in 0..2u32 {
            let layer_number = group_id * 2 + l;
            worker
                .add_layer(LayerSpec {
                    group_id,
                    layer_number,
                    first_head: 0,
                    num_heads: HEADS,
                    replica: ReplicaKey {
                        replicas: 1,
                        replica_index: 0,
                    },
                    num_blocks: BLOCKS,
                    kernel_blocks: 1,
                    tokens_per_kernel_block: BLOCK,
                    segments: vec![Segment {
                        address: cache.as_ptr() as u64 + layer_number as u64 * layer_bytes,
                        block_stride: (HEADS * BLOCK * TOKEN_BYTES) as i64,
                        kernel_block_stride: 0,
                        head_stride: (BLOCK * TOKEN_BYTES) as i64,
                        token_stride: TOKEN_BYTES as i64,
                        bytes_per_token: TOKEN_BYTES,
                    }],
                    identity: format!("layer {layer_number}").into_bytes(),
                })
                .unwrap();
        }
        let bytes = std::mem::size_of_val(buffer) as u64;
        worker
            .add_region(Region {
                address: buffer.as_ptr() as u64,
                length: bytes,
            })
            .unwrap();
        worker
            .add_stored(group_id, buffer.as_ptr() as u64, (buffer.len() / WORDS) as u64)
            .unwrap();
    }
    worker
}

/// The plan's rows are those of a naive walk over the positions, and
/// rows streamed past the caches (a device call's pinned memory) are the
/// rows written plainly, on random sets of blocks: many requests, both
/// groups, positions with and without tokens.
#[test]
fn plan_rows_are_the_naive_rows_streamed_or_not() {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(7, |d| d.as_nanos() as u64)
        | 1;
    let mut state = seed;
    let layer_bytes = (HEADS * BLOCK * TOKEN_BYTES * BLOCKS) as usize;
    let cache = vec![1u64; 4 * layer_bytes / 8];
    let (mut stored0, mut stored1) = (vec![0u64; WORDS * BLOCKS as usize], vec![0u64; WORDS * BLOCKS as usize]);
    let worker = worker(&cache, [&mut stored0, &mut stored1]);
    for _ in 0..20 {
        let mut blocks = BlockSet::new();
        let requests = 1 + random(&mut state) % 40;
        for r in 0..requests {
            let req_id = format!("r{r}");
            let num_tokens = random(&mut state) % (BLOCK as u64 * 8);
            blocks.add_request(&req_id, num_tokens).unwrap();
            for group_id in 0..2u32 {
                let count = random(&mut state) % 9;
                let ids: Vec<u32> = (0..count)
                    .map(|_| (random(&mut state) % BLOCKS as u64) as u32)
                    .collect();
                let first = random(&mut state) % 3;
                blocks.add_group(&req_id, group_id, first, &ids).unwrap();
            }
        }
        let (plan, rows) = Plan::new(&worker.layout, &blocks, Role::Consumer).unwrap();
        let mut room = vec![std::mem::MaybeUninit::<Row>::uninit(); blocks.num_blocks()];
        let streamed = Plan::write(
            &worker.layout,
            &blocks,
            Role::Consumer,
            RowRoom {
                rows: &mut room,
                streaming: true,
            },
        )
        .unwrap();
        assert_eq!(streamed.num_rows, plan.num_rows, "seed {seed}");
        assert_eq!(streamed.num_values, plan.num_values, "seed {seed}");
        assert_eq!(streamed.rows_per_slot, plan.rows_per_slot, "seed {seed}");
        // The rows, position by position: one per position with valid
        // tokens, values placed column-major per (request, group).
        let mut naive = Vec::new();
        let mut values_offset = 0u32;
        for request in blocks.requests() {
            for group_blocks in &request.groups {
                let group = worker.layout.group(group_blocks.group_id).unwrap();
                let n = group_blocks.block_ids.len() as u32;
                for (i, &block_id) in group_blocks.block_ids.iter().enumerate() {
                    let position = group_blocks.first_position + i as u64;
                    let valid = crate::inputs::blocks::valid_tokens(request.num_tokens, group.block_size, position);
                    if valid > 0 {
                        naive.push(Row {
                            first_token: position * group.block_size as u64,
                            block_id,
                            valid_tokens: valid,
                            out: values_offset + i as u32,
                            column_stride: n,
                            group_slot: group.slot,
                            reserved: 0,
                        });
                    }
                }
                values_offset += n * group.columns(Role::Consumer).len() as u32;
            }
        }
        assert_eq!(rows, naive, "seed {seed}");
        assert_eq!(plan.num_values, values_offset as usize, "seed {seed}");
        for slot in 0..2u32 {
            let count = naive.iter().filter(|row| row.group_slot == slot).count() as u64;
            assert_eq!(plan.rows_per_slot[slot as usize], count, "seed {seed}");
        }
        for (i, row) in rows.iter().enumerate() {
            // SAFETY: the first num_rows rows were written.
            assert_eq!(unsafe { room[i].assume_init() }, *row, "row {i}, seed {seed}");
        }
    }
}

#[test]
fn device_items_give_the_host_store_and_load_check() {
    let mut state = 0x5eed_0000_0000_0001u64;
    let layer_bytes = (HEADS * BLOCK * TOKEN_BYTES * BLOCKS) as usize;
    let cache: Vec<u64> = (0..4 * layer_bytes / 8).map(|_| random(&mut state)).collect();
    let junk: Vec<u64> = (0..WORDS * BLOCKS as usize).map(|_| random(&mut state)).collect();
    let (mut stored0, mut stored1) = (junk.clone(), junk.clone());
    let worker = worker(&cache, [&mut stored0, &mut stored1]);
    // Two requests; the first's last position holds no token, the second
    // starts at position 1.
    let mut blocks = BlockSet::new();
    let mut hash_bytes = |n: usize| (0..n * 8).map(|_| random(&mut state) as u8).collect::<Vec<u8>>();
    blocks.add_request("a", 40).unwrap();
    blocks.add_group("a", 0, 0, &[3, 7, 1, 9]).unwrap();
    blocks.add_group("a", 1, 0, &[2, 5, 11]).unwrap();
    blocks.set_hashes("a", 0, &hash_bytes(4), 8).unwrap();
    blocks.set_hashes("a", 1, &hash_bytes(3), 8).unwrap();
    blocks.add_request("b", 50).unwrap();
    blocks.add_group("b", 1, 1, &[0, 4]).unwrap();
    blocks.set_hashes("b", 1, &hash_bytes(2), 8).unwrap();
    let stream = StreamHandle::legacy_default();
    worker.store(&blocks, stream).unwrap();
    let host_stored = [stored0.clone(), stored1.clone()];
    // What kvcs_store writes, from the host values and the items.
    let (plan, _) = Plan::new(&worker.layout, &blocks, Role::Consumer).unwrap();
    let values = worker.checksum(&blocks, Role::Consumer, stream).unwrap();
    let values = values.values().unwrap();
    let (work, expectations) = stored::device_work(
        &worker.layout,
        &worker.infos(),
        &blocks,
        worker.algorithm,
        &plan.shape,
        cuda::StoredMode::Store,
    )
    .unwrap();
    assert!(expectations.is_empty(), "a store expects nothing");
    // A load check's items are the store's; it also gives expectations.
    let (gather, expectations) = stored::device_work(
        &worker.layout,
        &worker.infos(),
        &blocks,
        worker.algorithm,
        &plan.shape,
        cuda::StoredMode::Gather,
    )
    .unwrap();
    // A load check's items are the store's places; it needs no key or digest.
    let place = |item: &cuda::DevStoredItem| (item.address, item.out, item.column_stride, item.num_columns);
    assert_eq!(
        gather.items.iter().map(place).collect::<Vec<_>>(),
        work.items.iter().map(place).collect::<Vec<_>>()
    );
    assert_eq!(work.items.len(), 3 + 3 + 2, "positions holding tokens");
    let mut device = [junk.clone(), junk.clone()];
    for item in &work.items {
        let sum = (0..item.num_columns as u64).fold(0u64, |sum, c| {
            sum.wrapping_add(values[(item.out as u64 + c * item.column_stride as u64) as usize])
        });
        let (group, block) = [&stored0, &stored1]
            .iter()
            .enumerate()
            .find_map(|(g, buffer)| {
                let start = buffer.as_ptr() as u64;
                (start..start + StoredBuffer::BYTES_PER_BLOCK * BLOCKS as u64)
                    .contains(&item.address)
                    .then(|| (g, ((item.address - start) / 8) as usize))
            })
            .expect("an address inside a stored buffer");
        // kvcs_store's arithmetic, written out.
        let value = sum ^ item.tag;
        let check = crate::base::checksum::mix(crate::base::checksum::mix(value) ^ item.key) >> 32;
        device[group][block] = value;
        device[group][block + 1] = (check << 32) | item.digest as u64;
    }
    assert_eq!(device, host_stored, "the items give the host store's values");
    // A load check from gathered values: all match; a changed one fails
    // at its position only.
    let gathered: Vec<u64> = work
        .items
        .iter()
        // SAFETY: every address lies in stored0 or stored1 (found
        // above), with its stamp in the next word.
        .flat_map(|item| unsafe {
            [
                (item.address as *const u64).read(),
                (item.address as *const u64).add(1).read(),
            ]
        })
        .collect();
    let check = |gathered: Vec<u64>| {
        worker
            .checksum(&blocks, Role::Consumer, stream)
            .unwrap()
            .with_stored(expectations.clone(), StoredValues::Read(gathered))
    };
    use StoredOutcome::*;
    let result = check(gathered.clone());
    assert_eq!(
        result.stored_outcomes("a", 0).unwrap(),
        vec![Matched, Matched, Matched, NotChecked]
    );
    assert_eq!(result.stored_outcomes("a", 1).unwrap(), vec![Matched, Matched, Matched]);
    assert_eq!(result.stored_outcomes("b", 1).unwrap(), vec![Matched, Matched]);
    let mut bad = gathered.clone();
    bad[2 * 7] ^= 1 << 40; // "b", group 1, position 2 (its second)
    let result = check(bad);
    assert_eq!(result.stored_outcomes("b", 1).unwrap(), vec![Matched, Failed]);
    // A damaged stamp (its digest or its check) fails too: it does not
    // read as another configuration.
    let mut restamped = gathered.clone();
    restamped[2 * 6 + 1] ^= 1 << 20; // "b", group 1, position 1: the digest
    restamped[2 * 2 + 1] ^= 1 << 50; // "a", group 0, position 2: the check
    let result = check(restamped);
    assert_eq!(result.stored_outcomes("b", 1).unwrap(), vec![Failed, Matched]);
    assert_eq!(
        result.stored_outcomes("a", 0).unwrap(),
        vec![Matched, Matched, Failed, NotChecked]
    );
    assert_eq!(result.stored_outcomes("a", 1).unwrap(), vec![Matched, Matched, Matched]);
    assert_eq!(
        check(gathered.clone()).stored_outcomes("a", 0).unwrap(),
        worker
            .check_stored(&blocks, stream)
            .unwrap()
            .stored_outcomes("a", 0)
            .unwrap()
    );
}
