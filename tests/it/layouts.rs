//! "Layout does not matter" (SPEC section 3, property 3): the same logical KV
//! in every supported memory layout gives the naive reference's `c`, on the
//! host engine. Also cells split over K and V regions of different sizes,
//! kernel-block splits, one layer with two caches, and extreme layer and head
//! numbers.

use crate::support;

use kvcsum::{ReplicaKey, Role};
use support::*;

const UNREPLICATED: ReplicaKey = ReplicaKey {
    replicas: 1,
    replica_index: 0,
};

fn request(num_tokens: u64, tables: Vec<GroupTable>) -> TestRequest {
    TestRequest {
        req_id: "r".to_owned(),
        num_tokens,
        tables,
    }
}

/// Sum over TP ranks (each checked against its shard) of `kv` deployed in
/// `kind`; returns the total.
fn deployed_total(rng: &mut Rng, context: &str, kv: &LogicalKv, deploy: Deploy, table: &GroupTable) -> Vec<u64> {
    let ranks = deploy_host(rng, deploy, &[(kv, table)]);
    let blocks = block_set(&[request(kv.num_tokens(), vec![table.clone()])]);
    let num_positions = table.block_ids.len();
    let mut total = vec![0u64; num_positions];
    for rank in &ranks {
        let shard = &rank.shard;
        let own = naive_positions(
            kv,
            &shard.layer_numbers,
            &shard.heads(),
            deploy.block_size,
            table.first_position,
            num_positions,
        );
        for role in [Role::Producer, Role::Consumer] {
            let columns = columns_of(&checksum(&rank.worker, &blocks, role), "r", table.group_id);
            assert_eq!(columns.len(), 1, "{context}, rank {}: {columns:?}", shard.tp_rank);
            assert_eq!(
                columns[&shard.replica], own,
                "{context}, TP rank {}, {role:?}",
                shard.tp_rank
            );
        }
        add_values(&mut total, &own);
    }
    total
}

#[test]
fn every_layout_gives_the_reference() {
    let mut rng = Rng::for_test("every_layout_gives_the_reference");
    let seed = rng.seed();
    let block_size = 16;
    let mut shape = KvShape::gqa(3, 4, 16, rng.range(40..100));
    shape.first_layer = rng.below(30) as u32;
    let kv = LogicalKv::random(&mut rng, shape);
    let first_position = rng.range(1..3);
    let num_positions = positions_for(kv.num_tokens(), block_size, first_position, 1);
    let full = naive_full(&kv, block_size, first_position, num_positions);
    for kind in all_kinds() {
        for tp_size in [1, 2, 4] {
            let num_blocks = 12;
            let table = GroupTable {
                group_id: 4,
                first_position,
                block_ids: BlockAllocator::new(&mut rng, num_blocks).take(num_positions),
            };
            let deploy = Deploy {
                tp_size,
                pp_size: 1,
                kind,
                group_id: 4,
                block_size,
                num_blocks,
                num_threads: 1,
            };
            let context = format!("seed {seed}, {kind:?}, TP {tp_size}");
            let total = deployed_total(&mut rng, &context, &kv, deploy, &table);
            assert_eq!(total, full, "{context}: c differs from the reference");
        }
    }
}

#[test]
fn mla_latent_in_every_single_segment_layout() {
    let mut rng = Rng::for_test("mla_latent_in_every_single_segment_layout");
    let seed = rng.seed();
    let block_size = 32;
    let mut shape = KvShape::mla(2, 1152, rng.range(20..90));
    shape.first_layer = 1 + rng.below(60) as u32;
    let kv = LogicalKv::random(&mut rng, shape);
    let num_positions = positions_for(kv.num_tokens(), block_size, 0, 0);
    let full = naive_full(&kv, block_size, 0, num_positions);
    for kind in single_segment_kinds() {
        let table = GroupTable {
            group_id: 0,
            first_position: 0,
            block_ids: BlockAllocator::new(&mut rng, 5).take(num_positions),
        };
        let deploy = Deploy {
            tp_size: 1,
            pp_size: 1,
            kind,
            group_id: 0,
            block_size,
            num_blocks: 5,
            num_threads: 1,
        };
        let context = format!("seed {seed}, MLA latent, {kind:?}");
        assert_eq!(
            deployed_total(&mut rng, &context, &kv, deploy, &table),
            full,
            "{context}"
        );
    }
}

#[test]
fn k_and_v_of_different_sizes_in_separate_regions() {
    let mut rng = Rng::for_test("k_and_v_of_different_sizes_in_separate_regions");
    let seed = rng.seed();
    let block_size = 8;
    // The cell is K then V even when V lives elsewhere and is smaller.
    let shape = KvShape {
        first_layer: 2,
        num_layers: 2,
        first_head: 0,
        total_kv_heads: 2,
        k_bytes: 24,
        v_bytes: 8,
        num_tokens: rng.range(9..40),
    };
    let kv = LogicalKv::random(&mut rng, shape);
    let num_positions = positions_for(kv.num_tokens(), block_size, 0, 1);
    let full = naive_full(&kv, block_size, 0, num_positions);
    for kind in [
        LayoutKind::HndKvSplit,
        LayoutKind::Hnd,
        LayoutKind::Padded,
        LayoutKind::NegativeStride,
    ] {
        let table = GroupTable {
            group_id: 0,
            first_position: 0,
            block_ids: BlockAllocator::new(&mut rng, 8).take(num_positions),
        };
        let deploy = Deploy {
            tp_size: 2,
            pp_size: 1,
            kind,
            group_id: 0,
            block_size,
            num_blocks: 8,
            num_threads: 1,
        };
        let context = format!("seed {seed}, K 24 + V 8 bytes, {kind:?}");
        assert_eq!(
            deployed_total(&mut rng, &context, &kv, deploy, &table),
            full,
            "{context}"
        );
    }
}

#[test]
fn kernel_blocks_split_a_logical_block() {
    let mut rng = Rng::for_test("kernel_blocks_split_a_logical_block");
    let seed = rng.seed();
    let block_size = 32;
    let shape = KvShape::gqa(2, 2, 16, 32 * 3 + rng.range(1..32));
    let kv = LogicalKv::random(&mut rng, shape);
    let first_position = rng.below(2);
    let num_positions = positions_for(kv.num_tokens(), block_size, first_position, 0);
    let full = naive_full(&kv, block_size, first_position, num_positions);
    let mut previous: Option<Vec<u64>> = None;
    for kernel_blocks in [1, 2, 4, 8, 32] {
        let table = GroupTable {
            group_id: 0,
            first_position,
            block_ids: BlockAllocator::new(&mut rng, 6).take(num_positions),
        };
        let deploy = Deploy {
            tp_size: 1,
            pp_size: 1,
            kind: LayoutKind::KernelBlocks { kernel_blocks },
            group_id: 0,
            block_size,
            num_blocks: 6,
            num_threads: 1,
        };
        let context = format!("seed {seed}, {kernel_blocks} kernel blocks per 32-token block");
        let total = deployed_total(&mut rng, &context, &kv, deploy, &table);
        assert_eq!(total, full, "{context}");
        if let Some(previous) = &previous {
            assert_eq!(&total, previous, "{context}");
        }
        previous = Some(total);
    }
}

#[test]
fn one_layer_with_two_caches_numbers_heads_consecutively() {
    let mut rng = Rng::for_test("one_layer_with_two_caches_numbers_heads_consecutively");
    let seed = rng.seed();
    let block_size = 16;
    let num_tokens = rng.range(10..60);
    // An attention KV (heads 0..3) and an indexer cache (head 4) per layer.
    let attention = LogicalKv::random(&mut rng, KvShape::gqa(3, 4, 16, num_tokens));
    let mut indexer_shape = KvShape::mla(3, 40, num_tokens);
    indexer_shape.first_head = 4;
    let indexer = LogicalKv::random(&mut rng, indexer_shape);
    let num_positions = positions_for(num_tokens, block_size, 0, 0);
    let table = GroupTable {
        group_id: 0,
        first_position: 0,
        block_ids: BlockAllocator::new(&mut rng, 6).take(num_positions),
    };
    let mut worker = host_worker(0, 1, 0, 1);
    let mut placements = Vec::new();
    for (kv, kind) in [(&attention, LayoutKind::KvSplit), (&indexer, LayoutKind::Nhd)] {
        let shard = shard(kv, 0, 1, 0, 1);
        let mut placement = Placement::for_shard(&mut rng, kv, &shard, kind, 0, block_size, 6);
        placement.write_request(kv, 0, &table.block_ids);
        register_host(&mut worker, &placement);
        placements.push(placement);
    }
    let result = checksum(&worker, &block_set(&[request(num_tokens, vec![table])]), Role::Producer);
    let mut expected = naive_full(&attention, block_size, 0, num_positions);
    add_values(&mut expected, &naive_full(&indexer, block_size, 0, num_positions));
    assert_eq!(columns_of(&result, "r", 0)[&UNREPLICATED], expected, "seed {seed}");
    // Numbering the indexer as head 0 would give another value.
    let mut as_head_zero = naive_full(&attention, block_size, 0, num_positions);
    let mut misnumbered = indexer.clone();
    misnumbered.shape.first_head = 0;
    add_values(
        &mut as_head_zero,
        &naive_full(&misnumbered, block_size, 0, num_positions),
    );
    assert_ne!(as_head_zero, expected, "seed {seed}: head numbers do not weigh in");
}

/// An MLA latent cache and its indexer's cache under one layer number
/// (DeepSeek V3.2: heads 0 and 1), replicated on every rank of TP 2: each
/// rank's consumer column of its replica key, and its producer column on
/// rank 0 only, equal the naive reference of both caches.
#[test]
fn mla_and_indexer_caches_of_one_layer_under_tp_replicas_match_the_reference() {
    let mut rng = Rng::for_test("mla_and_indexer_caches_of_one_layer_under_tp_replicas_match_the_reference");
    let seed = rng.seed();
    let block_size = 16;
    let num_tokens = rng.range(10..60);
    let latent = LogicalKv::random(&mut rng, KvShape::mla(2, 72, num_tokens));
    let mut indexer_shape = KvShape::mla(2, 24, num_tokens);
    indexer_shape.first_head = 1;
    let indexer = LogicalKv::random(&mut rng, indexer_shape);
    let num_positions = positions_for(num_tokens, block_size, 0, 0);
    let table = GroupTable {
        group_id: 0,
        first_position: 0,
        block_ids: BlockAllocator::new(&mut rng, 6).take(num_positions),
    };
    let mut expected = naive_full(&latent, block_size, 0, num_positions);
    add_values(&mut expected, &naive_full(&indexer, block_size, 0, num_positions));
    let blocks = block_set(&[request(num_tokens, vec![table.clone()])]);
    for tp_rank in 0..2 {
        let mut worker = host_worker(tp_rank, 2, 0, 1);
        let mut placements = Vec::new();
        for (kv, kind) in [(&latent, LayoutKind::Nhd), (&indexer, LayoutKind::Nhd)] {
            let shard = shard(kv, tp_rank, 2, 0, 1);
            assert_eq!(shard.replica.replicas, 2, "seed {seed}: the one head is on both ranks");
            let mut placement = Placement::for_shard(&mut rng, kv, &shard, kind, 0, block_size, 6);
            placement.write_request(kv, 0, &table.block_ids);
            register_host(&mut worker, &placement);
            placements.push(placement);
        }
        let key = ReplicaKey {
            replicas: 2,
            replica_index: tp_rank,
        };
        let consumer = columns_of(&checksum(&worker, &blocks, Role::Consumer), "r", 0);
        assert_eq!(consumer.keys().copied().collect::<Vec<_>>(), vec![key], "seed {seed}");
        assert_eq!(consumer[&key], expected, "rank {tp_rank}, seed {seed}");
        let producer = columns_of(&checksum(&worker, &blocks, Role::Producer), "r", 0);
        if tp_rank == 0 {
            assert_eq!(producer[&key], expected, "seed {seed}");
        } else {
            assert!(
                producer.is_empty(),
                "seed {seed}: a replica's producer computes no column"
            );
        }
    }
}

#[test]
fn extreme_layer_and_head_numbers() {
    let mut rng = Rng::for_test("extreme_layer_and_head_numbers");
    let seed = rng.seed();
    let block_size = 8;
    // Layer numbers up to u32::MAX and heads up to 65535, the last allowed:
    // weights must be computed in 64 bits.
    let shape = KvShape {
        first_layer: u32::MAX - 1,
        num_layers: 2,
        first_head: 65534,
        total_kv_heads: 2,
        k_bytes: 8,
        v_bytes: 8,
        num_tokens: rng.range(5..30),
    };
    let kv = LogicalKv::random(&mut rng, shape);
    let num_positions = positions_for(kv.num_tokens(), block_size, 0, 0);
    let full = naive_full(&kv, block_size, 0, num_positions);
    for tp_size in [1, 2] {
        let table = GroupTable {
            group_id: u32::MAX,
            first_position: 0,
            block_ids: BlockAllocator::new(&mut rng, 5).take(num_positions),
        };
        let deploy = Deploy {
            tp_size,
            pp_size: 1,
            kind: LayoutKind::Nhd,
            group_id: u32::MAX,
            block_size,
            num_blocks: 5,
            num_threads: 1,
        };
        let context = format!("seed {seed}, TP {tp_size}");
        assert_eq!(
            deployed_total(&mut rng, &context, &kv, deploy, &table),
            full,
            "{context}"
        );
    }
}

#[test]
fn a_large_first_position_numbers_pieces_from_the_request_start() {
    let mut rng = Rng::for_test("a_large_first_position_numbers_pieces_from_the_request_start");
    let seed = rng.seed();
    // Positions far into a long request: piece indices j = t * P + p are large
    // and the weights wrap modulo 2^64 only through the products.
    let block_size = 16;
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(1, 1, 64, 16 * 40 + 7));
    let first_position = 37;
    let num_positions = positions_for(kv.num_tokens(), block_size, first_position, 1);
    let table = GroupTable {
        group_id: 0,
        first_position,
        block_ids: BlockAllocator::new(&mut rng, 6).take(num_positions),
    };
    let deploy = Deploy {
        tp_size: 1,
        pp_size: 1,
        kind: LayoutKind::Hnd,
        group_id: 0,
        block_size,
        num_blocks: 6,
        num_threads: 1,
    };
    let context = format!("seed {seed}");
    let total = deployed_total(&mut rng, &context, &kv, deploy, &table);
    assert_eq!(
        total,
        naive_full(&kv, block_size, first_position, num_positions),
        "{context}"
    );
}
