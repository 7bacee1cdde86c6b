//! Cells of 4-byte pieces on a device worker (SPEC section 1: a cell of a
//! multiple of 4 and not of 8 bytes, each piece `LE_u32` zero-extended;
//! vLLM's indexer cells, 128 key bytes then a 4-byte scale), read by
//! `kvcs_checksum_narrow`: the device's values equal the host engine's
//! and the naive reference's under every algorithm, for vLLM's keys then
//! scales (16-, 64- and 17-token blocks, the last making every other
//! block's keys 4 modulo 8), 12-, 68-, 132- and 4-byte cells in every
//! layout of the tests' support (K and V apart, kernel blocks, cross-layer,
//! negative strides, padding; heads read in groups), partial last blocks,
//! TP shards; beside layers of 8-byte pieces in one call and in one group;
//! under DCP placements (sizes 1, 2 and 4, interleaves 1 and 2) and
//! compressed slots; and through a tier store. The host engine's own
//! checks against the reference are tests/it/four_byte_pieces.rs.

use cudarc::driver::{result as cu, CudaContext};
use kvcsum::{BlockSet, GroupPlacement, Role, StreamHandle, TierBlock, TierIndex, TierOutcome, Worker};

use crate::common::*;
use crate::support::*;

/// vLLM's indexer cell: 128 fp8 key bytes, then one fp32 scale.
fn indexer_shape(num_layers: u32, num_tokens: u64) -> KvShape {
    KvShape {
        first_layer: 0,
        num_layers,
        first_head: 0,
        total_kv_heads: 1,
        k_bytes: 128,
        v_bytes: 4,
        num_tokens,
    }
}

/// A token count that leaves the last of `block_size`-token blocks partial.
fn partial_tokens(rng: &mut Rng, block_size: u32, blocks: u64) -> u64 {
    let tokens = rng.range(block_size as u64 + 1..blocks * block_size as u64);
    if tokens.is_multiple_of(block_size as u64) {
        tokens + 1
    } else {
        tokens
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_indexer_keys_then_scales_equal_the_reference() {
    for_each_algorithm(|algorithm| {
        let mut rng = Rng::for_test("device_indexer_keys_then_scales_equal_the_reference");
        println!("seed {} ({NEEDS_GPU}), {algorithm:?}", rng.seed());
        // 17-token blocks: a block of 17 * 132 bytes, so the keys of every
        // other block start 4 modulo 8 (4-byte loads throughout).
        for (block_size, blocks) in [(16u32, 5u64), (64, 2), (17, 4)] {
            let tokens = partial_tokens(&mut rng, block_size, blocks);
            let mut shape = indexer_shape(3, tokens);
            shape.first_layer = rng.below(60) as u32;
            let kv = LogicalKv::random(&mut rng, shape);
            let what = format!("indexer, {block_size}-token blocks, {tokens} tokens");
            assert_device_matches_reference_in_blocks_of(
                &mut rng,
                &kv,
                (0, 1),
                LayoutKind::KeysThenScales,
                block_size,
                3,
                &what,
            );
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_cells_of_4_byte_pieces_in_every_layout_equal_the_reference() {
    for_each_algorithm(|algorithm| {
        let mut rng = Rng::for_test("device_cells_of_4_byte_pieces_in_every_layout_equal_the_reference");
        println!("seed {} ({NEEDS_GPU}), {algorithm:?}", rng.seed());
        let kv_split = [LayoutKind::HndKvSplit, LayoutKind::KeysThenScales];
        // (K bytes, V bytes, KV heads, layouts): 12-byte cells whole or
        // split 8 + 4 and 4 + 8, vLLM's MXFP4 indexer (64 + 4), a 132-byte
        // cell in one segment (whole tokens: flat), 4-byte cells of 8 heads
        // (one piece a head: heads read in groups where side by side).
        let cases: [(u32, u32, u32, Vec<LayoutKind>); 6] = [
            (12, 0, 4, single_segment_kinds()),
            (8, 4, 4, kv_split.to_vec()),
            (4, 8, 2, vec![LayoutKind::HndKvSplit]),
            (64, 4, 1, kv_split.to_vec()),
            (132, 0, 1, single_segment_kinds()),
            (4, 0, 8, vec![LayoutKind::Nhd, LayoutKind::Hnd, LayoutKind::Padded]),
        ];
        for (k_bytes, v_bytes, heads, kinds) in cases {
            for kind in kinds {
                let shape = KvShape {
                    first_layer: 1 + rng.below(20) as u32,
                    num_layers: 2,
                    first_head: 0,
                    total_kv_heads: heads,
                    k_bytes,
                    v_bytes,
                    num_tokens: partial_tokens(&mut rng, 16, 4),
                };
                let kv = LogicalKv::random(&mut rng, shape);
                for tp_size in [1, 2].into_iter().filter(|&tp| tp <= heads) {
                    let what = format!("{k_bytes} + {v_bytes} bytes, {heads} heads, {kind:?}, TP {tp_size}");
                    assert_device_matches_reference(&mut rng, &kv, (tp_size - 1, tp_size), kind, 2, &what);
                }
            }
        }
    });
}

/// vLLM's DeepSeek V3.2 group: an MLA cache (8-byte pieces, head 0) and its
/// indexer's keys then scales (4-byte pieces, head 1) of the same layers in
/// one group, so one call reads both kinds of layer in one row; and a
/// worker with them in two groups, whose calls read either or both.
#[test]
#[ignore = "needs a CUDA device"]
fn device_4_byte_and_8_byte_piece_layers_in_one_call_equal_the_reference() {
    for_each_algorithm(|algorithm| {
        let mut rng = Rng::for_test("device_4_byte_and_8_byte_piece_layers_in_one_call_equal_the_reference");
        let seed = rng.seed();
        println!("seed {seed} ({NEEDS_GPU}), {algorithm:?}");
        let block_size = 64;
        let num_blocks = 20;
        let tokens = partial_tokens(&mut rng, block_size, 3);
        let mla = LogicalKv::random(&mut rng, KvShape::mla(3, 1152, tokens));
        let indexer = LogicalKv::random(
            &mut rng,
            KvShape {
                first_head: 1,
                ..indexer_shape(3, tokens)
            },
        );
        for two_groups in [false, true] {
            let indexer_group = two_groups as u32;
            let mut latents = Placement::for_shard(
                &mut rng,
                &mla,
                &shard(&mla, 0, 1, 0, 1),
                LayoutKind::Nhd,
                0,
                block_size,
                num_blocks,
            );
            let mut keys = Placement::for_shard(
                &mut rng,
                &indexer,
                &shard(&indexer, 0, 1, 0, 1),
                LayoutKind::KeysThenScales,
                indexer_group,
                block_size,
                num_blocks,
            );
            let mut allocator = BlockAllocator::new(&mut rng, num_blocks);
            let mut requests = Vec::new();
            for r in 0..3u64 {
                let first_position = r % 2;
                let positions = positions_for(tokens, block_size, first_position, 0);
                let latent_ids = allocator.take(positions);
                let key_ids = if two_groups {
                    allocator.take(positions)
                } else {
                    latent_ids.clone()
                };
                latents.write_request(&mla, first_position, &latent_ids);
                keys.write_request(&indexer, first_position, &key_ids);
                let mut tables = vec![GroupTable {
                    group_id: 0,
                    first_position,
                    block_ids: latent_ids,
                }];
                if two_groups {
                    tables.push(GroupTable {
                        group_id: 1,
                        first_position,
                        block_ids: key_ids,
                    });
                }
                requests.push(TestRequest {
                    req_id: format!("r{r}"),
                    num_tokens: tokens,
                    tables,
                });
            }
            let pair = Pair::new(0, 1, &[&latents, &keys]);
            let what = format!(
                "MLA and indexer, {} (seed {seed})",
                if two_groups { "two groups" } else { "one group" }
            );
            let naive = |kv: &LogicalKv, table: &GroupTable| {
                naive_full(kv, block_size, table.first_position, table.block_ids.len())
            };
            let replica = shard(&mla, 0, 1, 0, 1).replica;
            let values = pair.compare(&block_set(&requests), Role::Consumer, &what);
            for request in &requests {
                let column = |group_id: u32| &values[&(request.req_id.clone(), group_id)][&replica];
                if two_groups {
                    assert_eq!(column(0), &naive(&mla, request.table(0)), "{what}: the MLA group");
                    assert_eq!(
                        column(1),
                        &naive(&indexer, request.table(1)),
                        "{what}: the indexer group"
                    );
                } else {
                    let mut expected = naive(&mla, request.table(0));
                    add_values(&mut expected, &naive(&indexer, request.table(0)));
                    assert_eq!(column(0), &expected, "{what}");
                }
            }
            if two_groups {
                // Calls of one group each: the MLA group alone reads no
                // 4-byte pieces (another kernel), the indexer group alone.
                for group_id in [0, 1] {
                    let alone: Vec<TestRequest> = requests
                        .iter()
                        .map(|request| TestRequest {
                            tables: vec![request.table(group_id).clone()],
                            ..request.clone()
                        })
                        .collect();
                    let values = pair.compare(&block_set(&alone), Role::Producer, &what);
                    let kv = if group_id == 0 { &mla } else { &indexer };
                    for request in &alone {
                        assert_eq!(
                            values[&(request.req_id.clone(), group_id)][&replica],
                            naive(kv, request.table(group_id)),
                            "{what}: group {group_id} alone"
                        );
                    }
                }
            }
        }
    });
}

/// Each DCP rank's device values of 12-byte cells (DCP sizes 1, 2 and 4,
/// interleaves 1 and 2, 1 and 4 tokens a slot) equal the host engine's and
/// the naive partial that walks vLLM's forward map.
#[test]
#[ignore = "needs a CUDA device"]
fn device_4_byte_pieces_under_token_placement_equal_the_reference() {
    use crate::support::token_placement::narrow::*;
    let mut rng = Rng::for_test("device_4_byte_pieces_under_token_placement_equal_the_reference");
    let seed = rng.seed();
    println!("seed {seed} ({NEEDS_GPU})");
    let column = |worker: &Worker, blocks: &BlockSet, role: Role| {
        let result = worker.checksum(blocks, role, StreamHandle::legacy_default()).unwrap();
        result.wait().unwrap();
        result.column(REQ, GROUP, 0).unwrap().1.to_vec()
    };
    let context = CudaContext::new(0).expect("primary context of device 0");
    context.bind_to_thread().expect("bind");
    for_each_algorithm(|algorithm| {
        for dcp_size in [1u32, 2, 4] {
            for interleave in [1u32, 2] {
                for tokens_per_slot in [1u32, 4] {
                    let p = GroupPlacement {
                        dcp_size,
                        dcp_rank: 0,
                        interleave,
                        tokens_per_slot,
                    };
                    let size = 8 * dcp_size * tokens_per_slot;
                    for _ in 0..2 {
                        let positions = 1 + rng.below(4) as usize;
                        let num_tokens = rng.range(1..positions as u64 * size as u64 + 1);
                        let units = Units::random(&mut rng, num_tokens.div_ceil(tokens_per_slot as u64) + 1);
                        let mut ids: Vec<u32> = (0..NUM_BLOCKS).collect();
                        rng.shuffle(&mut ids);
                        let ids = &ids[..positions];
                        let mut blocks = BlockSet::new();
                        blocks.add_request(REQ, num_tokens).unwrap();
                        blocks.add_group(REQ, GROUP, 0, ids).unwrap();
                        for (rank, cache) in rank_caches(&mut rng, &units, p, size, ids).iter().enumerate() {
                            let rank = rank as u32;
                            let host = rank_worker(cache, p, size, rank);
                            let bytes = cache.bytes();
                            // SAFETY: a fresh allocation of the cache's length, filled from it.
                            let base = unsafe {
                                let base = cu::malloc_sync(bytes.len()).expect("cuMemAlloc");
                                cu::memcpy_htod_sync(base, &bytes).expect("copy to device");
                                base
                            };
                            let mut device = device_worker(rank, dcp_size);
                            register_rank(&mut device, base, cache, p, size, rank);
                            let naive: Vec<u64> = (0..positions as u64)
                                .map(|q| naive_partial(&units, p, size, num_tokens, q, Some(rank)))
                                .collect();
                            for role in [Role::Producer, Role::Consumer] {
                                let context = format!(
                                    "{p:?} rank {rank}, {algorithm:?}, {role:?}, num_tokens {num_tokens}, seed {seed}"
                                );
                                assert_eq!(column(&host, &blocks, role), naive, "host: {context}");
                                assert_eq!(column(&device, &blocks, role), naive, "device: {context}");
                            }
                            drop(device);
                            // SAFETY: allocated above; the worker that read it is gone.
                            unsafe { cu::free_sync(base).expect("cuMemFree") };
                        }
                    }
                }
            }
        }
    });
}

/// The tier index's full-block path on a device worker (`Worker::full_block_sums`,
/// one launch of the call's full blocks) keeps each full block's naive
/// value for vLLM's indexer cells, as the host's does, and a check of the
/// intact blocks matches.
#[test]
#[ignore = "needs a CUDA device"]
fn device_tier_store_of_4_byte_piece_blocks_keeps_the_naive_value() {
    for_each_algorithm(|algorithm| {
        let mut rng = Rng::for_test("device_tier_store_of_4_byte_piece_blocks_keeps_the_naive_value");
        let seed = rng.seed();
        println!("seed {seed} ({NEEDS_GPU}), {algorithm:?}");
        let block_size = 64;
        let positions = 4u64;
        let kv = LogicalKv::random(&mut rng, indexer_shape(3, positions * block_size as u64));
        let num_blocks = positions as u32 + 4;
        let block_ids = BlockAllocator::new(&mut rng, num_blocks).take(positions as usize);
        let mut placement = Placement::for_shard(
            &mut rng,
            &kv,
            &shard(&kv, 0, 1, 0, 1),
            LayoutKind::KeysThenScales,
            0,
            block_size,
            num_blocks,
        );
        placement.write_request(&kv, 0, &block_ids);
        let pair = Pair::new(0, 1, &[&placement]);
        let hashes: Vec<[u8; 32]> = (0..positions).map(|p| [p as u8 + 1; 32]).collect();
        let blocks: Vec<TierBlock<'_>> = (0..positions)
            .map(|p| TierBlock {
                group_id: 0,
                position: p,
                block_id: block_ids[p as usize],
                hash: Some(&hashes[p as usize]),
            })
            .collect();
        let naive = naive_full(&kv, block_size, 0, positions as usize);
        for (worker, what) in [(&pair.host, "host"), (&pair.device, "device")] {
            let mut index = TierIndex::new(64).unwrap();
            index.store(worker, &blocks, StreamHandle::legacy_default()).unwrap();
            // A device worker's stores are queued: the check waits for them
            // and reads their values (the host's are kept at once).
            let outcomes = index.check(worker, &blocks, StreamHandle::legacy_default()).unwrap();
            assert_eq!(
                outcomes,
                vec![TierOutcome::Matched; positions as usize],
                "{what} (seed {seed})"
            );
            for p in 0..positions {
                assert_eq!(
                    index.values(0, &hashes[p as usize]).unwrap(),
                    Some((p, vec![naive[p as usize]])),
                    "{what}, position {p} (seed {seed})"
                );
            }
        }
    });
}
