//! Roles and replicas (SPEC section 4) on the host engine, against the naive
//! reference: GQA with more TP ranks than KV heads, an MLA-like latent head
//! replicated on every rank, producer and consumer columns, and the consumer
//! checks that must equal the producer's `c`.

use crate::support;

use std::collections::BTreeMap;

use kvcsum::{Error, ReplicaKey, Role, Worker};
use support::*;

fn key(replicas: u32, replica_index: u32) -> ReplicaKey {
    ReplicaKey {
        replicas,
        replica_index,
    }
}

fn request(req_id: &str, num_tokens: u64, table: &GroupTable) -> TestRequest {
    TestRequest {
        req_id: req_id.to_owned(),
        num_tokens,
        tables: vec![table.clone()],
    }
}

/// Checks one group of one model deployed over `tp_size` ranks: every rank's
/// columns in both roles, producer totals and consumer checks against `full`.
fn check_replicated_group(
    seed: u64,
    context: &str,
    ranks: &[HostRank],
    kv: &LogicalKv,
    table: &GroupTable,
    block_size: u32,
) {
    let num_positions = table.block_ids.len();
    let blocks = block_set(&[request("r", kv.num_tokens(), table)]);
    let full = naive_full(kv, block_size, table.first_position, num_positions);
    let mut producer_total = vec![0u64; num_positions];
    let mut consumer_totals = BTreeMap::new();
    for rank in ranks {
        let shard = &rank.shard;
        let expected_key = shard.replica;
        let own = naive_positions(
            kv,
            &shard.layer_numbers,
            &shard.heads(),
            block_size,
            table.first_position,
            num_positions,
        );
        let rank_context = format!("seed {seed}, {context}, TP rank {} of {}", shard.tp_rank, shard.tp_size);

        let consumer = checksum(&rank.worker, &blocks, Role::Consumer);
        let columns = columns_of(&consumer, "r", table.group_id);
        assert_eq!(
            columns.keys().copied().collect::<Vec<_>>(),
            vec![expected_key],
            "{rank_context}: consumer columns"
        );
        assert_eq!(columns[&expected_key], own, "{rank_context}: consumer values");
        add_columns(&mut consumer_totals, &columns);

        let producer = checksum(&rank.worker, &blocks, Role::Producer);
        let reported = &producer.requests()[0];
        assert_eq!(reported.req_id, "r", "{rank_context}");
        let group = producer.group("r", table.group_id).expect("producer reports the group");
        assert_eq!(group.num_positions, num_positions, "{rank_context}");
        if expected_key.replica_index == 0 {
            assert_eq!(
                group.columns.to_vec(),
                vec![expected_key],
                "{rank_context}: producer columns"
            );
            let (_, values) = producer.column("r", table.group_id, 0).unwrap();
            assert_eq!(values, own.as_slice(), "{rank_context}: producer values");
            add_values(&mut producer_total, values);
        } else {
            // Not replica 0: the request is still reported, with no columns.
            assert!(
                group.columns.is_empty(),
                "{rank_context}: producer computed {:?}",
                group.columns
            );
            let error = producer.column("r", table.group_id, 0).unwrap_err();
            assert!(matches!(error, Error::OutOfBounds(_)), "{rank_context}: {error:?}");
        }
    }
    assert_eq!(producer_total, full, "seed {seed}, {context}: producer total is not c");
    for (k, check) in replica_checks(&consumer_totals, num_positions).iter().enumerate() {
        assert_eq!(check, &full, "seed {seed}, {context}: consumer check {k} is not c");
    }
}

#[test]
fn gqa_replicas_when_tp_exceeds_kv_heads() {
    let mut rng = Rng::for_test("gqa_replicas_when_tp_exceeds_kv_heads");
    let seed = rng.seed();
    let kinds = all_kinds();
    for (total_kv_heads, tp_size) in [(2u32, 4u32), (2, 8), (4, 8), (1, 2)] {
        let block_size = 16;
        let mut shape = KvShape::gqa(3, total_kv_heads, 16, rng.range(20..60));
        shape.first_layer = rng.below(20) as u32;
        let kv = LogicalKv::random(&mut rng, shape);
        let first_position = rng.below(2);
        let num_positions = positions_for(kv.num_tokens(), block_size, first_position, 1);
        let table = GroupTable {
            group_id: 2,
            first_position,
            block_ids: BlockAllocator::new(&mut rng, 8).take(num_positions),
        };
        let kind = *rng.pick(&kinds);
        let deploy = Deploy {
            tp_size,
            pp_size: 1,
            kind,
            group_id: 2,
            block_size,
            num_blocks: 8,
            num_threads: 1,
        };
        let ranks = deploy_host(&mut rng, deploy, &[(&kv, &table)]);
        let replicas = tp_size / total_kv_heads;
        for rank in &ranks {
            let shard = &rank.shard;
            assert_eq!(shard.replica, key(replicas, shard.tp_rank % replicas));
            assert_eq!(shard.first_head, shard.tp_rank / replicas);
        }
        let context = format!("{total_kv_heads} KV heads, TP {tp_size}, {kind:?}");
        check_replicated_group(seed, &context, &ranks, &kv, &table, block_size);
    }
}

#[test]
fn mla_latent_head_replicated_on_every_rank() {
    let mut rng = Rng::for_test("mla_latent_head_replicated_on_every_rank");
    let seed = rng.seed();
    let kinds = single_segment_kinds();
    for tp_size in [1u32, 2, 4, 8] {
        let block_size = *rng.pick(&[16u32, 32]);
        // 576 bf16 elements: one 1152-byte latent row per token.
        let mut shape = KvShape::mla(2, 1152, rng.range(10..70));
        shape.first_layer = rng.below(60) as u32;
        let kv = LogicalKv::random(&mut rng, shape);
        let first_position = rng.below(2);
        let num_positions = positions_for(kv.num_tokens(), block_size, first_position, 0);
        let table = GroupTable {
            group_id: 0,
            first_position,
            block_ids: BlockAllocator::new(&mut rng, 6).take(num_positions),
        };
        let kind = *rng.pick(&kinds);
        let deploy = Deploy {
            tp_size,
            pp_size: 1,
            kind,
            group_id: 0,
            block_size,
            num_blocks: 6,
            num_threads: 1,
        };
        let ranks = deploy_host(&mut rng, deploy, &[(&kv, &table)]);
        for rank in &ranks {
            assert_eq!(rank.shard.replica, key(tp_size, rank.shard.tp_rank));
            assert_eq!(rank.shard.heads(), vec![0]);
        }
        let context = format!("MLA latent, TP {tp_size}, {kind:?}, block size {block_size}");
        check_replicated_group(seed, &context, &ranks, &kv, &table, block_size);
    }
}

/// Caches of several logical KVs (one group, different layers and replica
/// counts) over `tp_size` ranks, all written at `table`.
fn deploy_mixed(
    rng: &mut Rng,
    kvs: &[&LogicalKv],
    tp_size: u32,
    block_size: u32,
    num_blocks: u32,
    table: &GroupTable,
) -> Vec<(Worker, Vec<Placement>)> {
    let kinds = all_kinds();
    let latent_kinds = single_segment_kinds();
    (0..tp_size)
        .map(|tp_rank| {
            let mut worker = host_worker(tp_rank, tp_size, 0, 1);
            let mut placements = Vec::new();
            for kv in kvs {
                let shard = shard(kv, tp_rank, tp_size, 0, 1);
                let kind = if kv.shape.v_bytes == 0 {
                    *rng.pick(&latent_kinds)
                } else {
                    *rng.pick(&kinds)
                };
                let mut placement = Placement::for_shard(rng, kv, &shard, kind, table.group_id, block_size, num_blocks);
                placement.write_request(kv, table.first_position, &table.block_ids);
                register_host(&mut worker, &placement);
                placements.push(placement);
            }
            (worker, placements)
        })
        .collect()
}

#[test]
fn consumer_checks_equal_producer_c_with_mixed_replica_counts() {
    let mut rng = Rng::for_test("consumer_checks_equal_producer_c_with_mixed_replica_counts");
    let seed = rng.seed();
    let block_size = 16;
    let num_tokens = rng.range(30..80);
    // Layers 0-1: 2 KV heads; layers 2-3: 8 KV heads; layer 4: an MLA latent.
    let few = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 16, num_tokens));
    let mut many_shape = KvShape::gqa(2, 8, 8, num_tokens);
    many_shape.first_layer = 2;
    let many = LogicalKv::random(&mut rng, many_shape);
    let mut latent_shape = KvShape::mla(1, 72, num_tokens);
    latent_shape.first_layer = 4;
    let latent = LogicalKv::random(&mut rng, latent_shape);
    let kvs = [&few, &many, &latent];
    let first_position = rng.below(2);
    let num_positions = positions_for(num_tokens, block_size, first_position, 0);
    let mut full = vec![0u64; num_positions];
    for kv in kvs {
        add_values(&mut full, &naive_full(kv, block_size, first_position, num_positions));
    }

    // Producer: TP 2 (keys (1,0) and (2,0) computed; (2,1) not).
    let producer_table = GroupTable {
        group_id: 5,
        first_position,
        block_ids: BlockAllocator::new(&mut rng, 10).take(num_positions),
    };
    let producers = deploy_mixed(&mut rng, &kvs, 2, block_size, 10, &producer_table);
    let producer_blocks = block_set(&[request("r", num_tokens, &producer_table)]);
    let mut producer_c = vec![0u64; num_positions];
    for (tp_rank, (worker, _)) in producers.iter().enumerate() {
        let columns = columns_of(&checksum(worker, &producer_blocks, Role::Producer), "r", 5);
        let expected_keys = if tp_rank == 0 {
            vec![key(1, 0), key(2, 0)]
        } else {
            vec![key(1, 0)]
        };
        assert_eq!(
            columns.keys().copied().collect::<Vec<_>>(),
            expected_keys,
            "seed {seed}, producer rank {tp_rank}"
        );
        add_values(&mut producer_c, &sum_of_columns(&columns, num_positions));
    }
    assert_eq!(producer_c, full, "seed {seed}: producer c");

    // Consumer: TP 4 (keys (1,0), (2,0..1), (4,0..3)), other layouts and blocks.
    let consumer_table = GroupTable {
        group_id: 5,
        first_position,
        block_ids: BlockAllocator::new(&mut rng, 12).take(num_positions),
    };
    let mut consumers = deploy_mixed(&mut rng, &kvs, 4, block_size, 12, &consumer_table);
    let consumer_blocks = block_set(&[request("r", num_tokens, &consumer_table)]);
    let consumer_totals = |consumers: &[(Worker, Vec<Placement>)]| {
        let mut totals = BTreeMap::new();
        for (tp_rank, (worker, _)) in consumers.iter().enumerate() {
            let columns = columns_of(&checksum(worker, &consumer_blocks, Role::Consumer), "r", 5);
            let tp_rank = tp_rank as u32;
            let expected_keys = vec![key(1, 0), key(2, tp_rank % 2), key(4, tp_rank)];
            assert_eq!(
                columns.keys().copied().collect::<Vec<_>>(),
                expected_keys,
                "seed {seed}, consumer rank {tp_rank}"
            );
            add_columns(&mut totals, &columns);
        }
        totals
    };
    let checks = replica_checks(&consumer_totals(&consumers), num_positions);
    assert_eq!(checks.len(), 4);
    for (k, check) in checks.iter().enumerate() {
        assert_eq!(
            check, &producer_c,
            "seed {seed}: consumer check {k} differs from the producer's c"
        );
    }

    // One bit of rank 3's latent copy: only check 3 sees it, at that position.
    let position = rng.below(num_positions as u64) as usize;
    let valid = naive_valid_tokens(num_tokens, block_size, first_position + position as u64);
    let slot = rng.below(valid as u64) as u32;
    let block_id = consumer_table.block_ids[position];
    consumers[3].1[2].xor_byte(4, 0, block_id, slot, rng.below(72) as u32, 0x01);
    let checks = replica_checks(&consumer_totals(&consumers), num_positions);
    for (k, check) in checks.iter().enumerate() {
        for p in 0..num_positions {
            let differs = check[p] != producer_c[p];
            assert_eq!(
                differs,
                k == 3 && p == position,
                "seed {seed}: latent copy of rank 3 corrupted at position {position}; check {k} position {p}"
            );
        }
    }

    // One bit of rank 1's copy of the 2-head layers (key (2,1)): checks 1 and 3.
    let head = consumers[1].1[0].spec().first_head;
    consumers[1].1[0].xor_byte(1, head, block_id, slot, 3, 0x80);
    let checks = replica_checks(&consumer_totals(&consumers), num_positions);
    for (k, check) in checks.iter().enumerate() {
        let expect_differs = k == 1 || k == 3;
        assert_eq!(
            check[position] != producer_c[position],
            expect_differs,
            "seed {seed}: check {k} at position {position} after corrupting key (2,1)"
        );
    }
}

#[test]
fn one_worker_with_several_replica_keys_sorts_its_columns() {
    let mut rng = Rng::for_test("one_worker_with_several_replica_keys_sorts_its_columns");
    let seed = rng.seed();
    // TP rank 3 of 4 holding a latent (4,3), a 2-head GQA layer (2,1) and an
    // 8-head one (1,0), registered in that order.
    let num_tokens = rng.range(5..40);
    let mut latent_shape = KvShape::mla(1, 64, num_tokens);
    latent_shape.first_layer = 9;
    let latent = LogicalKv::random(&mut rng, latent_shape);
    let few = LogicalKv::random(&mut rng, KvShape::gqa(1, 2, 8, num_tokens));
    let mut many_shape = KvShape::gqa(1, 8, 8, num_tokens);
    many_shape.first_layer = 4;
    let many = LogicalKv::random(&mut rng, many_shape);
    let block_size = 8;
    let num_positions = positions_for(num_tokens, block_size, 0, 0);
    let table = GroupTable {
        group_id: 0,
        first_position: 0,
        block_ids: BlockAllocator::new(&mut rng, 8).take(num_positions),
    };
    let mut worker = host_worker(3, 4, 0, 1);
    let mut placements = Vec::new();
    let mut expected: BTreeMap<ReplicaKey, Vec<u64>> = BTreeMap::new();
    for kv in [&latent, &few, &many] {
        let shard = shard(kv, 3, 4, 0, 1);
        let mut placement = Placement::for_shard(&mut rng, kv, &shard, LayoutKind::Nhd, 0, block_size, 8);
        placement.write_request(kv, 0, &table.block_ids);
        register_host(&mut worker, &placement);
        placements.push(placement);
        let values = naive_positions(kv, &shard.layer_numbers, &shard.heads(), block_size, 0, num_positions);
        expected.insert(shard.replica, values);
    }
    let blocks = block_set(&[request("r", num_tokens, &table)]);
    let consumer = checksum(&worker, &blocks, Role::Consumer);
    let group = consumer.group("r", 0).unwrap();
    assert_eq!(
        group.columns.to_vec(),
        vec![key(1, 0), key(2, 1), key(4, 3)],
        "seed {seed}"
    );
    assert_eq!(columns_of(&consumer, "r", 0), expected, "seed {seed}");
    let producer = checksum(&worker, &blocks, Role::Producer);
    let produced = columns_of(&producer, "r", 0);
    assert_eq!(
        produced.keys().copied().collect::<Vec<_>>(),
        vec![key(1, 0)],
        "seed {seed}"
    );
    assert_eq!(produced[&key(1, 0)], expected[&key(1, 0)], "seed {seed}");
}
