//! The properties of SPEC section 3 and the request block sets of section 5,
//! on the host engine, each against the naive reference on fresh random KV.

use crate::support;

use kvcsum::{ReplicaKey, Role};
use support::*;

const UNREPLICATED: ReplicaKey = ReplicaKey {
    replicas: 1,
    replica_index: 0,
};

/// A single-worker placement of all of `kv` in `kind`, with `kv` written at
/// `table`, and its registered worker.
fn one_worker(
    rng: &mut Rng,
    kv: &LogicalKv,
    kind: LayoutKind,
    block_size: u32,
    num_blocks: u32,
    table: &GroupTable,
) -> HostRank {
    let deploy = Deploy {
        tp_size: 1,
        pp_size: 1,
        kind,
        group_id: table.group_id,
        block_size,
        num_blocks,
        num_threads: 1,
    };
    deploy_host(rng, deploy, &[(kv, table)]).pop().unwrap()
}

fn request(req_id: &str, kv: &LogicalKv, tables: Vec<GroupTable>) -> TestRequest {
    TestRequest {
        req_id: req_id.to_owned(),
        num_tokens: kv.num_tokens(),
        tables,
    }
}

/// The values of the single unreplicated column of (`req_id`, `group_id`).
fn only_column(result: &kvcsum::Checksums, req_id: &str, group_id: u32) -> Vec<u64> {
    let mut columns = columns_of(result, req_id, group_id);
    assert_eq!(columns.keys().copied().collect::<Vec<_>>(), vec![UNREPLICATED]);
    columns.remove(&UNREPLICATED).unwrap()
}

#[test]
fn shards_add_up_over_tp_ranks_and_pp_stages() {
    let mut rng = Rng::for_test("shards_add_up_over_tp_ranks_and_pp_stages");
    let seed = rng.seed();
    let kinds = all_kinds();
    for (tp_size, pp_size) in [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 3), (4, 2), (8, 4)] {
        let block_size = *rng.pick(&[8u32, 16]);
        let mut shape = KvShape::gqa(5, 8, 16, rng.range(20..70));
        shape.first_layer = rng.below(40) as u32;
        let kv = LogicalKv::random(&mut rng, shape);
        let kind = *rng.pick(&kinds);
        let num_blocks = 16;
        let first_position = rng.below(2);
        let num_positions = positions_for(kv.num_tokens(), block_size, first_position, 1);
        let table = GroupTable {
            group_id: 3,
            first_position,
            block_ids: BlockAllocator::new(&mut rng, num_blocks).take(num_positions),
        };
        let deploy = Deploy {
            tp_size,
            pp_size,
            kind,
            group_id: 3,
            block_size,
            num_blocks,
            num_threads: 1,
        };
        let ranks = deploy_host(&mut rng, deploy, &[(&kv, &table)]);
        let blocks = block_set(&[request("r", &kv, vec![table.clone()])]);
        let context = format!("seed {seed}, TP {tp_size}, PP {pp_size}, {kind:?}, block size {block_size}");
        let mut total = vec![0u64; num_positions];
        for rank in &ranks {
            let result = checksum(&rank.worker, &blocks, Role::Producer);
            let partial = only_column(&result, "r", 3);
            // Each partial is already the reference over that rank's slices.
            let shard = &rank.shard;
            let expected = naive_positions(
                &kv,
                &shard.layer_numbers,
                &shard.heads(),
                block_size,
                first_position,
                num_positions,
            );
            assert_eq!(partial, expected, "{context}, rank {shard:?}");
            add_values(&mut total, &partial);
        }
        let full = naive_full(&kv, block_size, first_position, num_positions);
        assert_eq!(total, full, "{context}: partials of all ranks do not sum to c");
        // A single shard alone is not c (guards against every rank reading everything).
        if ranks.len() > 1 {
            let first = only_column(&checksum(&ranks[0].worker, &blocks, Role::Producer), "r", 3);
            assert_ne!(first, full, "{context}: rank 0 alone gave c");
        }
    }
}

#[test]
fn block_size_does_not_matter() {
    let mut rng = Rng::for_test("block_size_does_not_matter");
    let seed = rng.seed();
    for trial in 0..4 {
        let shape = KvShape::gqa(3, 2, 16, rng.range(33..140));
        let kv = LogicalKv::random(&mut rng, shape);
        let first_32 = rng.below(2);
        let num_32 = positions_for(kv.num_tokens(), 32, first_32, 1);
        let num_16 = 2 * num_32;
        let table_32 = GroupTable {
            group_id: 0,
            first_position: first_32,
            block_ids: BlockAllocator::new(&mut rng, 12).take(num_32),
        };
        let table_16 = GroupTable {
            group_id: 0,
            first_position: 2 * first_32,
            block_ids: BlockAllocator::new(&mut rng, 20).take(num_16),
        };
        let kinds = all_kinds();
        let (kind_32, kind_16) = (*rng.pick(&kinds), *rng.pick(&kinds));
        let rank_32 = one_worker(&mut rng, &kv, kind_32, 32, 12, &table_32);
        let rank_16 = one_worker(&mut rng, &kv, kind_16, 16, 20, &table_16);
        let values_32 = only_column(
            &checksum(
                &rank_32.worker,
                &block_set(&[request("r", &kv, vec![table_32])]),
                Role::Producer,
            ),
            "r",
            0,
        );
        let values_16 = only_column(
            &checksum(
                &rank_16.worker,
                &block_set(&[request("r", &kv, vec![table_16])]),
                Role::Producer,
            ),
            "r",
            0,
        );
        let context = format!(
            "seed {seed}, trial {trial}, {} tokens, 32-token {kind_32:?}, 16-token {kind_16:?}",
            kv.num_tokens()
        );
        assert_eq!(values_32, naive_full(&kv, 32, first_32, num_32), "{context}");
        assert_eq!(values_16, naive_full(&kv, 16, 2 * first_32, num_16), "{context}");
        for i in 0..num_32 {
            assert_eq!(
                values_32[i],
                values_16[2 * i].wrapping_add(values_16[2 * i + 1]),
                "{context}: 32-token position {} is not the sum of its two 16-token halves",
                first_32 + i as u64
            );
        }
    }
}

#[test]
fn any_single_changed_piece_changes_c() {
    let mut rng = Rng::for_test("any_single_changed_piece_changes_c");
    let seed = rng.seed();
    let kinds = all_kinds();
    for trial in 0..24 {
        let kind = *rng.pick(&kinds);
        let mut shape = KvShape::gqa(3, 4, 8 * rng.range(1..4) as u32, rng.range(10..60));
        shape.first_layer = rng.below(100) as u32;
        let mut kv = LogicalKv::random(&mut rng, shape);
        let block_size = 8;
        let num_positions = positions_for(kv.num_tokens(), block_size, 0, 0);
        let table = GroupTable {
            group_id: 1,
            first_position: 0,
            block_ids: BlockAllocator::new(&mut rng, 12).take(num_positions),
        };
        let mut rank = one_worker(&mut rng, &kv, kind, block_size, 12, &table);
        let blocks = block_set(&[request("r", &kv, vec![table.clone()])]);
        let before = only_column(&checksum(&rank.worker, &blocks, Role::Producer), "r", 1);
        assert_eq!(
            before,
            naive_full(&kv, block_size, 0, num_positions),
            "seed {seed}, trial {trial}, {kind:?}"
        );

        // One random bit of one random valid piece, in memory and in the model.
        let token = rng.below(kv.num_tokens());
        let position = (token / block_size as u64) as usize;
        let slot = (token % block_size as u64) as u32;
        let layer = *rng.pick(&kv.layer_numbers());
        let head = *rng.pick(&kv.heads());
        let byte = rng.below(kv.cell_bytes() as u64) as u32;
        let mask = 1u8 << rng.below(8);
        rank.placements[0].xor_byte(layer, head, table.block_ids[position], slot, byte, mask);
        kv.cell_mut(layer, head, token)[byte as usize] ^= mask;
        let after = only_column(&checksum(&rank.worker, &blocks, Role::Producer), "r", 1);
        let context = format!(
            "seed {seed}, trial {trial}, {kind:?}: bit {mask:#x} of byte {byte}, layer {layer}, head {head}, token {token}"
        );
        assert_ne!(after[position], before[position], "{context}: c did not change");
        for other in (0..num_positions).filter(|&p| p != position) {
            assert_eq!(after[other], before[other], "{context}: position {other} changed");
        }
        assert_eq!(after, naive_full(&kv, block_size, 0, num_positions), "{context}");
    }
}

#[test]
fn misplaced_data_changes_c() {
    let mut rng = Rng::for_test("misplaced_data_changes_c");
    let seed = rng.seed();
    let block_size = 16;
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 4, 16, 64));
    let table = GroupTable {
        group_id: 0,
        first_position: 0,
        block_ids: BlockAllocator::new(&mut rng, 8).take(4),
    };
    let mut rank = one_worker(&mut rng, &kv, LayoutKind::Nhd, block_size, 8, &table);
    let blocks = block_set(&[request("r", &kv, vec![table.clone()])]);
    let before = only_column(&checksum(&rank.worker, &blocks, Role::Producer), "r", 0);
    assert_eq!(before, naive_full(&kv, block_size, 0, 4), "seed {seed}");

    // Blocks in the wrong order: the table names them swapped.
    let mut swapped = table.clone();
    swapped.block_ids.swap(1, 2);
    let swapped_blocks = block_set(&[request("r", &kv, vec![swapped])]);
    let values = only_column(&checksum(&rank.worker, &swapped_blocks, Role::Producer), "r", 0);
    assert_ne!(
        values[1], before[1],
        "seed {seed}: swapped blocks gave the same c at position 1"
    );
    assert_ne!(
        values[2], before[2],
        "seed {seed}: swapped blocks gave the same c at position 2"
    );

    // Two tokens of one block swapped in memory.
    let cell = kv.cell_bytes();
    let block_id = table.block_ids[3];
    let placement = &mut rank.placements[0];
    for byte in 0..cell {
        let (buffer_a, a) = placement.locate(1, 2, block_id, 4, byte);
        let (buffer_b, b) = placement.locate(1, 2, block_id, 9, byte);
        assert_eq!(buffer_a, buffer_b);
        placement.buffers_mut()[buffer_a].bytes_mut().swap(a, b);
    }
    let values = only_column(&checksum(&rank.worker, &blocks, Role::Producer), "r", 0);
    assert_ne!(values[3], before[3], "seed {seed}: swapped tokens gave the same c");
    assert_eq!(&values[..3], &before[..3], "seed {seed}: other blocks changed");
}

#[test]
fn writes_past_num_tokens_are_invisible() {
    let mut rng = Rng::for_test("writes_past_num_tokens_are_invisible");
    let seed = rng.seed();
    let kinds = all_kinds();
    for trial in 0..9 {
        let kind = kinds[trial % kinds.len()];
        let block_size = 16;
        // A partial last block, then one position wholly past num_tokens.
        let num_tokens = 16 * rng.range(1..4) + rng.range(1..16);
        let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 16, num_tokens));
        let first_position = rng.below(2);
        let num_positions = positions_for(num_tokens, block_size, first_position, 1);
        let table = GroupTable {
            group_id: 0,
            first_position,
            block_ids: BlockAllocator::new(&mut rng, 10).take(num_positions),
        };
        let mut rank = one_worker(&mut rng, &kv, kind, block_size, 10, &table);
        let blocks = block_set(&[request("r", &kv, vec![table.clone()])]);
        let before = only_column(&checksum(&rank.worker, &blocks, Role::Producer), "r", 0);
        let context =
            format!("seed {seed}, trial {trial}, {kind:?}, {num_tokens} tokens from position {first_position}");
        assert_eq!(
            before,
            naive_full(&kv, block_size, first_position, num_positions),
            "{context}"
        );
        assert_eq!(
            before[num_positions - 1],
            0,
            "{context}: position past num_tokens is not 0"
        );

        // Decode tokens written past num_tokens: the last partial block's free
        // slots and the block wholly past the end.
        let last = num_positions - 2;
        let valid = naive_valid_tokens(num_tokens, block_size, first_position + last as u64);
        assert!(valid > 0 && valid < block_size, "{context}: valid {valid}");
        let placement = &mut rank.placements[0];
        for (index, first_slot) in [(last, valid), (num_positions - 1, 0)] {
            for slot in first_slot..block_size {
                for layer in kv.layer_numbers() {
                    for head in kv.heads() {
                        for byte in 0..kv.cell_bytes() {
                            let mask = rng.range(1..256) as u8;
                            placement.xor_byte(layer, head, table.block_ids[index], slot, byte, mask);
                        }
                    }
                }
            }
        }
        let after = only_column(&checksum(&rank.worker, &blocks, Role::Producer), "r", 0);
        assert_eq!(after, before, "{context}: writes past num_tokens changed c");

        // A write to the last valid slot does change it.
        let byte = rng.below(kv.cell_bytes() as u64) as u32;
        placement.xor_byte(kv.layer_numbers()[0], 1, table.block_ids[last], valid - 1, byte, 0x10);
        let after = only_column(&checksum(&rank.worker, &blocks, Role::Producer), "r", 0);
        assert_ne!(
            after[last], before[last],
            "{context}: a write to the last valid slot went unseen"
        );
    }
}

/// One request's KV over two caches: layers 0..6 GQA (groups 0 and 1 hold
/// the even and odd layers) and layers 6..8 MLA-like (group 7).
struct HybridRequest {
    gqa: LogicalKv,
    mla: LogicalKv,
    request: TestRequest,
}

#[test]
fn many_requests_and_groups_in_one_call() {
    let mut rng = Rng::for_test("many_requests_and_groups_in_one_call");
    let seed = rng.seed();
    let kinds = all_kinds();
    let latent_kinds = single_segment_kinds();
    // (group, block size, layers, blocks in cache)
    let groups: [(u32, u32, Vec<u32>, u32); 3] = [
        (0, 16, vec![0, 2, 4], 48),
        (1, 32, vec![1, 3, 5], 28),
        (7, 8, vec![6, 7], 80),
    ];
    let mut allocators: Vec<BlockAllocator> = groups.iter().map(|g| BlockAllocator::new(&mut rng, g.3)).collect();
    let mut requests = Vec::new();
    for r in 0..6 {
        let num_tokens = rng.range(1..90);
        let gqa = LogicalKv::random(&mut rng, KvShape::gqa(6, 4, 16, num_tokens));
        let mut mla_shape = KvShape::mla(2, 72, num_tokens);
        mla_shape.first_layer = 6;
        let mla = LogicalKv::random(&mut rng, mla_shape);
        let mut tables = Vec::new();
        for (g, (group_id, block_size, _, _)) in groups.iter().enumerate() {
            // Request 2 has no group 1; others have every group.
            if r == 2 && *group_id == 1 {
                continue;
            }
            let first_position = rng.below(3);
            let extra = rng.below(2) as usize;
            let count = positions_for(num_tokens, *block_size, first_position, extra);
            tables.push(GroupTable {
                group_id: *group_id,
                first_position,
                block_ids: allocators[g].take(count),
            });
        }
        // Groups in a different order per request.
        rng.shuffle(&mut tables);
        let request = TestRequest {
            req_id: format!("req-{r}"),
            num_tokens,
            tables,
        };
        requests.push(HybridRequest { gqa, mla, request });
    }

    let mut worker = host_worker(0, 1, 0, 2);
    let mut placements = Vec::new();
    for (group_id, block_size, layers, num_blocks) in &groups {
        let is_latent = *group_id == 7;
        let (k_bytes, v_bytes, num_heads) = if is_latent { (72, 0, 1) } else { (16, 16, 4) };
        // Half the layers in one layout, half in another: layouts may differ within a group.
        let (first, second) = layers.split_at(layers.len() / 2);
        for part in [first, second] {
            if part.is_empty() {
                continue;
            }
            let kind = if is_latent {
                *rng.pick(&latent_kinds)
            } else {
                *rng.pick(&kinds)
            };
            let spec = CacheSpec {
                kind,
                group_id: *group_id,
                block_size: *block_size,
                num_blocks: *num_blocks,
                layer_numbers: part.to_vec(),
                first_head: 0,
                num_heads,
                replica: UNREPLICATED,
                k_bytes,
                v_bytes,
            };
            let mut placement = Placement::new(&mut rng, spec);
            for hybrid in &requests {
                if let Some(table) = hybrid.request.tables.iter().find(|t| t.group_id == *group_id) {
                    let kv = if is_latent { &hybrid.mla } else { &hybrid.gqa };
                    placement.write_request(kv, table.first_position, &table.block_ids);
                }
            }
            register_host(&mut worker, &placement);
            placements.push(placement);
        }
    }

    let test_requests: Vec<TestRequest> = requests.iter().map(|h| h.request.clone()).collect();
    let result = checksum(&worker, &block_set(&test_requests), Role::Producer);
    let order: Vec<&str> = result.requests().iter().map(|r| r.req_id.as_str()).collect();
    let expected_order: Vec<&str> = test_requests.iter().map(|r| r.req_id.as_str()).collect();
    assert_eq!(order, expected_order, "seed {seed}: requests out of order");
    for (hybrid, reported) in requests.iter().zip(result.requests()) {
        let request = &hybrid.request;
        assert_eq!(reported.num_tokens, request.num_tokens);
        assert!(reported.skipped.is_empty());
        let reported_groups: Vec<u32> = reported.groups.iter().map(|g| g.group_id).collect();
        let expected_groups: Vec<u32> = request.tables.iter().map(|t| t.group_id).collect();
        assert_eq!(
            reported_groups, expected_groups,
            "seed {seed}: groups of {}",
            request.req_id
        );
        for table in &request.tables {
            let (_, block_size, layers, _) = groups.iter().find(|g| g.0 == table.group_id).unwrap();
            let kv = if table.group_id == 7 { &hybrid.mla } else { &hybrid.gqa };
            let group = result.group(&request.req_id, table.group_id).unwrap();
            assert_eq!(group.first_position, table.first_position);
            assert_eq!(group.num_positions, table.block_ids.len());
            let expected = naive_positions(
                kv,
                layers,
                &kv.heads(),
                *block_size,
                table.first_position,
                table.block_ids.len(),
            );
            assert_eq!(
                only_column(&result, &request.req_id, table.group_id),
                expected,
                "seed {seed}: {} group {} ({} tokens from position {})",
                request.req_id,
                table.group_id,
                request.num_tokens,
                table.first_position
            );
        }
    }
    // A group the request lacks is not found.
    let error = result.group("req-2", 1).unwrap_err();
    assert!(matches!(error, kvcsum::Error::NotFound(_)), "{error:?}");
}

#[test]
fn thread_count_does_not_change_values() {
    let mut rng = Rng::for_test("thread_count_does_not_change_values");
    let seed = rng.seed();
    // 16 MiB of valid cells: enough that the host engine really splits the
    // work over the threads it is given (it keeps small calls on one thread).
    let block_size = 16;
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(4, 8, 128, 2048 - 5));
    let num_positions = positions_for(kv.num_tokens(), block_size, 0, 0);
    let num_blocks = num_positions as u32 + 8;
    let table = GroupTable {
        group_id: 0,
        first_position: 0,
        block_ids: BlockAllocator::new(&mut rng, num_blocks).take(num_positions),
    };
    let shard = shard(&kv, 0, 1, 0, 1);
    let mut placement = Placement::for_shard(&mut rng, &kv, &shard, LayoutKind::Nhd, 0, block_size, num_blocks);
    placement.write_request(&kv, 0, &table.block_ids);
    let blocks = block_set(&[request("r", &kv, vec![table])]);
    let expected = naive_full(&kv, block_size, 0, num_positions);
    for threads in [1, 2, 3] {
        let mut worker = host_worker(0, 1, 0, threads);
        register_host(&mut worker, &placement);
        for role in [Role::Producer, Role::Consumer] {
            let values = only_column(&checksum(&worker, &blocks, role), "r", 0);
            assert_eq!(values, expected, "seed {seed}: {threads} threads, {role:?}");
        }
    }
}

#[test]
fn block_ids_at_the_end_of_the_cache() {
    let mut rng = Rng::for_test("block_ids_at_the_end_of_the_cache");
    let seed = rng.seed();
    for kind in all_kinds() {
        let num_blocks = 6;
        let block_size = 8;
        let shape = KvShape::gqa(2, 2, 8, rng.range(17..40));
        let kv = LogicalKv::random(&mut rng, shape);
        let num_positions = positions_for(kv.num_tokens(), block_size, 0, 0);
        // The last and first block ids hold the request's first and last blocks.
        let mut allocator = BlockAllocator::new(&mut rng, num_blocks);
        let (end, start) = (allocator.reserve(num_blocks - 1), allocator.reserve(0));
        let mut block_ids = vec![end];
        block_ids.extend(allocator.take(num_positions - 2));
        block_ids.push(start);
        let table = GroupTable {
            group_id: 0,
            first_position: 0,
            block_ids,
        };
        let rank = one_worker(&mut rng, &kv, kind, block_size, num_blocks, &table);
        let blocks = block_set(&[request("r", &kv, vec![table])]);
        let values = only_column(&checksum(&rank.worker, &blocks, Role::Consumer), "r", 0);
        assert_eq!(
            values,
            naive_full(&kv, block_size, 0, num_positions),
            "seed {seed}, {kind:?}"
        );
    }
}

#[test]
fn positions_past_num_tokens_are_zero() {
    let mut rng = Rng::for_test("positions_past_num_tokens_are_zero");
    let seed = rng.seed();
    let block_size = 16;
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 16, 40));
    let mut allocator = BlockAllocator::new(&mut rng, 16);
    // Positions 1..6 of a 40-token request: 1 and 2 hold tokens, 3..5 none.
    let live = GroupTable {
        group_id: 0,
        first_position: 1,
        block_ids: allocator.take(5),
    };
    let rank = one_worker(&mut rng, &kv, LayoutKind::Hnd, block_size, 16, &live);
    // A request with no tokens, and one whose blocks all lie past its end.
    let empty = TestRequest {
        req_id: "empty".into(),
        num_tokens: 0,
        tables: vec![GroupTable {
            group_id: 0,
            first_position: 0,
            block_ids: allocator.take(2),
        }],
    };
    let beyond = TestRequest {
        req_id: "beyond".into(),
        num_tokens: 40,
        tables: vec![GroupTable {
            group_id: 0,
            first_position: 3,
            block_ids: allocator.take(3),
        }],
    };
    let blocks = block_set(&[request("live", &kv, vec![live]), empty, beyond]);
    let result = checksum(&rank.worker, &blocks, Role::Producer);
    let values = only_column(&result, "live", 0);
    assert_eq!(values, naive_full(&kv, block_size, 1, 5), "seed {seed}");
    assert!(
        values[0] != 0 && values[1] != 0,
        "seed {seed}: live positions are 0: {values:?}"
    );
    assert_eq!(&values[2..], &[0, 0, 0], "seed {seed}");
    assert_eq!(only_column(&result, "empty", 0), vec![0, 0], "seed {seed}");
    assert_eq!(only_column(&result, "beyond", 0), vec![0, 0, 0], "seed {seed}");
}

/// The test vectors of SPEC section 12: `f` of MIXED and of MIXED2 at a few
/// inputs, and the checksums of a small block under every algorithm,
/// through a real worker and the naive reference.
#[test]
fn mixed_test_vectors() {
    let mixed2_vectors: [(u64, u64); 7] = [
        (0x0000_0000_0000_0000, 0x0000_0000_0000_0000),
        (0x0000_0000_0000_0001, 0x2700_4d2d_5f54_3557),
        (0x0000_0000_8000_0000, 0x2e74_11df_8400_1e4d),
        (0x0000_0001_0000_0000, 0x218a_205b_ca4f_d2a5),
        (0x8000_0000_0000_0000, 0xaf6b_b90f_bb2d_d26e),
        (0xffff_ffff_ffff_ffff, 0x4e5b_6ad9_6ab7_fcc7),
        (0x0123_4567_89ab_cdef, 0x4f20_4e65_0a0d_4f1e),
    ];
    for (x, fx) in mixed2_vectors {
        assert_eq!(kvcsum::mix2(x), fx, "MIXED2 f({x:#018x})");
        assert_eq!(
            naive_piece(kvcsum::Algorithm::Mixed2, x),
            fx,
            "the reference's MIXED2 f({x:#018x})"
        );
    }
    let vectors: [(u64, u64); 7] = [
        (0x0000_0000_0000_0000, 0x0000_0000_0000_0000),
        (0x0000_0000_0000_0001, 0x9e37_79b9_e17d_05ac),
        (0x0000_0000_8000_0000, 0xbfa5_3e0a_3fa5_3e0a),
        (0x0000_0001_0000_0000, 0x1d81_f5ce_62cb_89db),
        (0x8000_0000_0000_0000, 0x3fa5_3e0a_bfa5_3e0a),
        (0xffff_ffff_ffff_ffff, 0x80b5_83eb_80b5_83eb),
        (0x0123_4567_89ab_cdef, 0x1296_fd1b_5633_ee33),
    ];
    for (x, fx) in vectors {
        assert_eq!(kvcsum::mix(x), fx, "f({x:#018x})");
        assert_eq!(
            naive_piece(kvcsum::Algorithm::Mixed, x),
            fx,
            "the reference's f({x:#018x})"
        );
    }
    // Layer 3, heads 0 and 1, 2-token blocks, 2 pieces per token, 3 tokens:
    // piece p of head h, token t is (16h + 4t + p + 1) * 0x0101010101010101
    // with bit 63 flipped. Block q of the request is block id q, laid out
    // [block][head][token][piece].
    let piece = |h: u64, t: u64, p: u64| (16 * h + 4 * t + p + 1).wrapping_mul(0x0101_0101_0101_0101) ^ (1 << 63);
    let mut cache = [0u64; 2 * 2 * 2 * 2];
    for q in 0..2u64 {
        for h in 0..2u64 {
            for i in 0..2u64 {
                for p in 0..2u64 {
                    cache[(((q * 2 + h) * 2 + i) * 2 + p) as usize] = piece(h, q * 2 + i, p);
                }
            }
        }
    }
    assert_eq!((cache[0], cache[13]), (0x8101_0101_0101_0101, 0x9a1a_1a1a_1a1a_1a1a));
    let expected = [
        (
            kvcsum::Algorithm::Weighted,
            [0xadad_adad_ada4_2c28u64, 0x4747_4747_4736_c2bc],
        ),
        (kvcsum::Algorithm::Mixed, [0xd09c_8cd8_d03a_81c8, 0xf9d4_fc41_f92c_6c8c]),
        (
            kvcsum::Algorithm::Mixed2,
            [0xea2b_7962_98ef_605f, 0x23fe_4bc3_ca07_4ae9],
        ),
    ];
    for (algorithm, values) in expected {
        let mut worker = kvcsum::Worker::new(kvcsum::WorkerOptions {
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            device: None,
            num_threads: 1,
        })
        .unwrap();
        worker.set_algorithm(algorithm).unwrap();
        let address = cache.as_ptr() as u64;
        worker
            .add_region(kvcsum::Region {
                address,
                length: 8 * cache.len() as u64,
            })
            .unwrap();
        worker.add_group(0, 2).unwrap();
        worker
            .add_layer(kvcsum::LayerSpec {
                group_id: 0,
                layer_number: 3,
                first_head: 0,
                num_heads: 2,
                replica: UNREPLICATED,
                num_blocks: 2,
                kernel_blocks: 1,
                tokens_per_kernel_block: 2,
                segments: vec![kvcsum::Segment {
                    address,
                    block_stride: 64,
                    kernel_block_stride: 0,
                    head_stride: 32,
                    token_stride: 16,
                    bytes_per_token: 16,
                }],
                identity: Vec::new(),
            })
            .unwrap();
        let mut blocks = kvcsum::BlockSet::new();
        blocks.add_request("v", 3).unwrap();
        blocks.add_group("v", 0, 0, &[0, 1]).unwrap();
        let result = checksum(&worker, &blocks, Role::Producer);
        assert_eq!(only_column(&result, "v", 0), values.to_vec(), "{algorithm:?}");
        // The naive reference: SPEC sections 2-3 with f, one piece at a time.
        let naive: Vec<u64> = (0..2u64)
            .map(|q| {
                let mut c = 0u64;
                for h in 0..2u64 {
                    let mut s = 0u64;
                    for t in (2 * q..2 * q + 2).filter(|&t| t < 3) {
                        for p in 0..2u64 {
                            let j = t * 2 + p;
                            s = s.wrapping_add(naive_piece(algorithm, piece(h, t, p)).wrapping_mul(2 * j + 1));
                        }
                    }
                    c = c.wrapping_add((2 * (3 * 65536 + h) + 1).wrapping_mul(s));
                }
                c
            })
            .collect();
        assert_eq!(naive, values.to_vec(), "{algorithm:?}: the naive reference");
    }
    // Setting the algorithm after a computation is refused.
    let mut worker = host_worker(0, 1, 0, 1);
    worker.add_group(0, 2).unwrap();
    let mut blocks = kvcsum::BlockSet::new();
    blocks.add_request("v", 0).unwrap();
    checksum(&worker, &blocks, Role::Producer);
    let error = worker.set_algorithm(kvcsum::Algorithm::Weighted).unwrap_err();
    assert!(matches!(error, kvcsum::Error::InvalidArgument(_)), "{error:?}");
}

/// The properties of SPEC section 3 under WEIGHTED and MIXED too (the tests
/// above run the default, MIXED2): shards add up, block size and layout do not matter,
/// any single changed piece changes `c`.
#[test]
fn the_properties_hold_under_every_algorithm() {
    for_each_algorithm(|_| {
        shards_add_up_over_tp_ranks_and_pp_stages();
        block_size_does_not_matter();
        any_single_changed_piece_changes_c();
        writes_past_num_tokens_are_invisible();
    });
}

/// SPEC section 12's small block again with 12-byte cells, read in 4-byte
/// pieces (SPEC section 1): layer 3, heads 0 and 1, 2-token blocks, `P` =
/// 3, 3 tokens; piece `p` of head `h` at token `t` is
/// `(16h + 4t + p + 1) * 0x01010101` with bit 31 flipped, as `LE_u32`
/// bytes. The worker's values are the table's, and the naive reference's.
#[test]
fn four_byte_piece_test_vectors() {
    let piece = |h: u64, t: u64, p: u64| ((16 * h + 4 * t + p + 1) as u32).wrapping_mul(0x0101_0101) ^ (1 << 31);
    // [block][head][token][piece], block q of the request is block id q.
    let mut cache = [0u32; 2 * 2 * 2 * 3];
    for q in 0..2u64 {
        for h in 0..2u64 {
            for i in 0..2u64 {
                for p in 0..3u64 {
                    cache[(((q * 2 + h) * 2 + i) * 3 + p) as usize] = piece(h, q * 2 + i, p).to_le();
                }
            }
        }
    }
    assert_eq!((cache[0], cache[23]), (0x8101_0101, 0x9f1f_1f1f));
    let expected = [
        (
            kvcsum::Algorithm::Weighted,
            [0x00ee_66b8_2009_b9b0u64, 0x0134_4eb7_e5bf_9788],
        ),
        (kvcsum::Algorithm::Mixed, [0xdaae_4d11_c957_725c, 0x7ff3_64e2_a02b_e13d]),
        (
            kvcsum::Algorithm::Mixed2,
            [0xa5dc_bf8f_cb95_9bf0, 0x1b7f_1207_9334_1f3e],
        ),
    ];
    for (algorithm, values) in expected {
        let mut worker = kvcsum::Worker::new(kvcsum::WorkerOptions {
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            device: None,
            num_threads: 1,
        })
        .unwrap();
        worker.set_algorithm(algorithm).unwrap();
        let address = cache.as_ptr() as u64;
        worker
            .add_region(kvcsum::Region {
                address,
                length: 4 * cache.len() as u64,
            })
            .unwrap();
        worker.add_group(0, 2).unwrap();
        worker
            .add_layer(kvcsum::LayerSpec {
                group_id: 0,
                layer_number: 3,
                first_head: 0,
                num_heads: 2,
                replica: UNREPLICATED,
                num_blocks: 2,
                kernel_blocks: 1,
                tokens_per_kernel_block: 2,
                segments: vec![kvcsum::Segment {
                    address,
                    block_stride: 48,
                    kernel_block_stride: 0,
                    head_stride: 24,
                    token_stride: 12,
                    bytes_per_token: 12,
                }],
                identity: Vec::new(),
            })
            .unwrap();
        let mut blocks = kvcsum::BlockSet::new();
        blocks.add_request("v", 3).unwrap();
        blocks.add_group("v", 0, 0, &[0, 1]).unwrap();
        let result = checksum(&worker, &blocks, Role::Producer);
        let computed = only_column(&result, "v", 0);
        // The naive reference: SPEC sections 2-3 with f, one piece at a time.
        let naive: Vec<u64> = (0..2u64)
            .map(|q| {
                let mut c = 0u64;
                for h in 0..2u64 {
                    let mut s = 0u64;
                    for t in (2 * q..2 * q + 2).filter(|&t| t < 3) {
                        for p in 0..3u64 {
                            let j = t * 3 + p;
                            s = s.wrapping_add(naive_piece(algorithm, piece(h, t, p) as u64).wrapping_mul(2 * j + 1));
                        }
                    }
                    c = c.wrapping_add((2 * (3 * 65536 + h) + 1).wrapping_mul(s));
                }
                c
            })
            .collect();
        assert_eq!(computed, naive, "{algorithm:?}: the naive reference");
        assert_eq!(computed, values.to_vec(), "{algorithm:?}: {computed:#018x?}");
    }
}
