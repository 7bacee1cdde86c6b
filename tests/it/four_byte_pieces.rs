//! Cells of a multiple of 4 bytes and not of 8 are read in 4-byte pieces
//! (SPEC section 1): each a little-endian `u32` zero-extended to 64 bits,
//! `P` = cell bytes / 4, every weight as for 8-byte pieces. The host engine
//! gives the naive reference's value for vLLM's sparse-attention indexer
//! cache (132-byte cells: 128 fp8 key bytes, then a 4-byte scale, each
//! block its keys then their scales) and for plain 12-byte cells, in every
//! layout, under every algorithm, with partial last blocks; so for the
//! cells the device tests read (tests/gpu/four_byte_pieces.rs), and under
//! DCP placements; shards add up, block sizes do not matter, and one
//! changed piece (a key's or a scale's) changes the value. Registration
//! takes 4-byte aligned cells of 4-byte pieces and refuses what is no cell
//! of whole pieces.
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it four_byte_pieces::<name>`.

use crate::support;

use kvcsum::{LayerSpec, Region, ReplicaKey, Role, Segment, StreamHandle, TierBlock, TierIndex};
use support::*;

/// vLLM's indexer cell: 128 fp8 key bytes, then one fp32 scale.
const INDEXER_KEY_BYTES: u32 = 128;
const INDEXER_SCALE_BYTES: u32 = 4;

fn request(num_tokens: u64, table: &GroupTable) -> TestRequest {
    TestRequest {
        req_id: "r".to_owned(),
        num_tokens,
        tables: vec![table.clone()],
    }
}

/// An MLA-like indexer cache: one head of 128 key bytes and 4 scale bytes
/// per token.
fn indexer_shape(num_layers: u32, num_tokens: u64) -> KvShape {
    KvShape {
        first_layer: 0,
        num_layers,
        first_head: 0,
        total_kv_heads: 1,
        k_bytes: INDEXER_KEY_BYTES,
        v_bytes: INDEXER_SCALE_BYTES,
        num_tokens,
    }
}

/// The summed values of `kv` deployed as `deploy` (every rank checked
/// against the naive value of its own shard, in both roles).
fn deployed_total(rng: &mut Rng, context: &str, kv: &LogicalKv, deploy: Deploy, table: &GroupTable) -> Vec<u64> {
    let ranks = deploy_host(rng, deploy, &[(kv, table)]);
    let blocks = block_set(&[request(kv.num_tokens(), table)]);
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

fn deploy(kind: LayoutKind, tp_size: u32, block_size: u32, num_blocks: u32) -> Deploy {
    Deploy {
        tp_size,
        pp_size: 1,
        kind,
        group_id: 2,
        block_size,
        num_blocks,
        num_threads: 1,
    }
}

#[test]
fn vllms_indexer_cells_keys_then_scales_give_the_reference() {
    let mut rng = Rng::for_test("vllms_indexer_cells_keys_then_scales_give_the_reference");
    let seed = rng.seed();
    for_each_algorithm(|algorithm| {
        for block_size in [16u32, 32, 64] {
            // Never a whole number of blocks: the last one is partial.
            let mut num_tokens = rng.range(block_size as u64 + 1..5 * block_size as u64);
            if num_tokens.is_multiple_of(block_size as u64) {
                num_tokens += 1;
            }
            let mut shape = indexer_shape(3, num_tokens);
            shape.first_layer = rng.below(60) as u32;
            let kv = LogicalKv::random(&mut rng, shape);
            let first_position = rng.below(2);
            let num_positions = positions_for(num_tokens, block_size, first_position, 1);
            let num_blocks = num_positions as u32 + 3;
            let table = GroupTable {
                group_id: 2,
                first_position,
                block_ids: BlockAllocator::new(&mut rng, num_blocks).take(num_positions),
            };
            let context = format!("seed {seed}, {algorithm:?}, block size {block_size}, {num_tokens} tokens");
            let total = deployed_total(
                &mut rng,
                &context,
                &kv,
                deploy(LayoutKind::KeysThenScales, 1, block_size, num_blocks),
                &table,
            );
            assert_eq!(
                total,
                naive_full(&kv, block_size, first_position, num_positions),
                "{context}"
            );
            // The partial last position holds values of its valid tokens only.
            assert_ne!(total[num_positions - 2], 0, "{context}");
        }
    });
}

#[test]
fn twelve_byte_cells_in_every_layout_give_the_reference_and_shards_add_up() {
    let mut rng = Rng::for_test("twelve_byte_cells_in_every_layout_give_the_reference_and_shards_add_up");
    let seed = rng.seed();
    let block_size = 16;
    for_each_algorithm(|algorithm| {
        // K of 8 bytes and V of 4 where the layout splits them, else one
        // 12-byte cell; 4 heads over TP 1, 2 and 4.
        for (k_bytes, v_bytes, kinds) in [
            (8u32, 4u32, vec![LayoutKind::HndKvSplit, LayoutKind::KeysThenScales]),
            (12, 0, single_segment_kinds()),
        ] {
            let shape = KvShape {
                first_layer: 1 + rng.below(20) as u32,
                num_layers: 2,
                first_head: 0,
                total_kv_heads: 4,
                k_bytes,
                v_bytes,
                num_tokens: rng.range(17..90) | 1,
            };
            let kv = LogicalKv::random(&mut rng, shape);
            let num_positions = positions_for(kv.num_tokens(), block_size, 0, 0);
            let full = naive_full(&kv, block_size, 0, num_positions);
            for kind in kinds {
                for tp_size in [1, 2, 4] {
                    let num_blocks = num_positions as u32 + 2;
                    let table = GroupTable {
                        group_id: 2,
                        first_position: 0,
                        block_ids: BlockAllocator::new(&mut rng, num_blocks).take(num_positions),
                    };
                    let context =
                        format!("seed {seed}, {algorithm:?}, {k_bytes}+{v_bytes} bytes, {kind:?}, TP {tp_size}");
                    let total = deployed_total(
                        &mut rng,
                        &context,
                        &kv,
                        deploy(kind, tp_size, block_size, num_blocks),
                        &table,
                    );
                    assert_eq!(total, full, "{context}: the shards do not add up to c");
                }
            }
        }
    });
}

/// The cells the device tests read (tests/gpu/four_byte_pieces.rs), on host
/// workers: 4 + 8 bytes apart, vLLM's MXFP4 indexer (64 + 4), a 132-byte
/// cell in one segment in every layout, 4-byte cells of 8 heads, and the
/// indexer in 17-token blocks (a block of 2244 bytes: every other block's
/// keys 4 modulo 8).
#[test]
fn cells_of_4_68_and_132_bytes_and_odd_block_sizes_give_the_reference() {
    let mut rng = Rng::for_test("cells_of_4_68_and_132_bytes_and_odd_block_sizes_give_the_reference");
    let seed = rng.seed();
    let kv_split = [LayoutKind::HndKvSplit, LayoutKind::KeysThenScales];
    for_each_algorithm(|algorithm| {
        let cases: [(u32, u32, u32, u32, Vec<LayoutKind>); 6] = [
            (4, 8, 2, 16, vec![LayoutKind::HndKvSplit]),
            (64, 4, 1, 16, kv_split.to_vec()),
            (132, 0, 1, 16, single_segment_kinds()),
            (4, 0, 8, 16, vec![LayoutKind::Nhd, LayoutKind::Hnd, LayoutKind::Padded]),
            (128, 4, 1, 17, vec![LayoutKind::KeysThenScales]),
            (128, 4, 1, 64, vec![LayoutKind::KeysThenScales]),
        ];
        for (k_bytes, v_bytes, heads, block_size, kinds) in cases {
            let shape = KvShape {
                first_layer: rng.below(20) as u32,
                num_layers: 2,
                first_head: 0,
                total_kv_heads: heads,
                k_bytes,
                v_bytes,
                num_tokens: rng.range(block_size as u64 + 1..4 * block_size as u64) | 1,
            };
            let kv = LogicalKv::random(&mut rng, shape);
            let num_positions = positions_for(kv.num_tokens(), block_size, 0, 0);
            let full = naive_full(&kv, block_size, 0, num_positions);
            for kind in kinds {
                for tp_size in [1, 2].into_iter().filter(|&tp| tp <= heads) {
                    let num_blocks = num_positions as u32 + 2;
                    let table = GroupTable {
                        group_id: 2,
                        first_position: 0,
                        block_ids: BlockAllocator::new(&mut rng, num_blocks).take(num_positions),
                    };
                    let context = format!(
                        "seed {seed}, {algorithm:?}, {k_bytes}+{v_bytes} bytes, {heads} heads, {block_size}-token blocks, {kind:?}, TP {tp_size}"
                    );
                    let total = deployed_total(
                        &mut rng,
                        &context,
                        &kv,
                        deploy(kind, tp_size, block_size, num_blocks),
                        &table,
                    );
                    assert_eq!(total, full, "{context}: the shards do not add up to c");
                }
            }
        }
    });
}

/// Token placement (SPEC section 16) of cells of 4-byte pieces: each DCP
/// rank's values (sizes 1, 2 and 4, interleaves 1 and 2; 1 and 4 tokens a
/// slot) are the naive partials that walk vLLM's forward map, and the
/// ranks' partials add up to the unsharded value.
#[test]
fn dcp_placed_cells_of_4_byte_pieces_give_the_naive_partials_and_add_up() {
    use kvcsum::{BlockSet, GroupPlacement};
    use support::token_placement::narrow::*;

    let mut rng = Rng::for_test("dcp_placed_cells_of_4_byte_pieces_give_the_naive_partials_and_add_up");
    let seed = rng.seed();
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
                    let positions = 1 + rng.below(4) as usize;
                    let num_tokens = rng.range(1..positions as u64 * size as u64 + 1);
                    let units = Units::random(&mut rng, num_tokens.div_ceil(tokens_per_slot as u64) + 1);
                    let mut ids: Vec<u32> = (0..NUM_BLOCKS).collect();
                    rng.shuffle(&mut ids);
                    let ids = &ids[..positions];
                    let mut blocks = BlockSet::new();
                    blocks.add_request(REQ, num_tokens).unwrap();
                    blocks.add_group(REQ, GROUP, 0, ids).unwrap();
                    let mut sum = vec![0u64; positions];
                    for (rank, cache) in rank_caches(&mut rng, &units, p, size, ids).iter().enumerate() {
                        let rank = rank as u32;
                        let worker = rank_worker(cache, p, size, rank);
                        let result = worker
                            .checksum(&blocks, Role::Consumer, StreamHandle::legacy_default())
                            .unwrap();
                        result.wait().unwrap();
                        let got = result.column(REQ, GROUP, 0).unwrap().1.to_vec();
                        let naive: Vec<u64> = (0..positions as u64)
                            .map(|q| naive_partial(&units, p, size, num_tokens, q, Some(rank)))
                            .collect();
                        let context = format!("{p:?} rank {rank}, {algorithm:?}, num_tokens {num_tokens}, seed {seed}");
                        assert_eq!(got, naive, "{context}");
                        add_values(&mut sum, &got);
                    }
                    let whole: Vec<u64> = (0..positions as u64)
                        .map(|q| naive_partial(&units, p, size, num_tokens, q, None))
                        .collect();
                    assert_eq!(sum, whole, "{p:?}, {algorithm:?}: the ranks' sum, seed {seed}");
                }
            }
        }
    });
}

/// Property 2 of SPEC section 3: two 16-token positions sum to the 32-token
/// position over the same tokens, with 4-byte pieces as with 8-byte ones.
#[test]
fn two_16_token_positions_of_4_byte_pieces_sum_to_the_32_token_one() {
    let mut rng = Rng::for_test("two_16_token_positions_of_4_byte_pieces_sum_to_the_32_token_one");
    let seed = rng.seed();
    for_each_algorithm(|algorithm| {
        let kv = LogicalKv::random(&mut rng, indexer_shape(2, 4 * 32));
        let value_at = |rng: &mut Rng, block_size: u32| {
            let num_positions = positions_for(kv.num_tokens(), block_size, 0, 0);
            let table = GroupTable {
                group_id: 2,
                first_position: 0,
                block_ids: BlockAllocator::new(rng, num_positions as u32 + 1).take(num_positions),
            };
            let context = format!("seed {seed}, {algorithm:?}, block size {block_size}");
            deployed_total(
                rng,
                &context,
                &kv,
                deploy(LayoutKind::KeysThenScales, 1, block_size, num_positions as u32 + 1),
                &table,
            )
        };
        let small = value_at(&mut rng, 16);
        let large = value_at(&mut rng, 32);
        for (q, &value) in large.iter().enumerate() {
            assert_eq!(
                small[2 * q].wrapping_add(small[2 * q + 1]),
                value,
                "seed {seed}, {algorithm:?}, 32-token position {q}"
            );
        }
    });
}

/// Any single changed piece changes `c` (SPEC section 3, property 4): one
/// byte of a key or of a scale, in a valid slot, changes the host worker's
/// value to the naive value of the changed KV; a byte past `num_tokens`
/// changes nothing.
#[test]
fn a_changed_key_byte_or_scale_byte_changes_the_value() {
    let mut rng = Rng::for_test("a_changed_key_byte_or_scale_byte_changes_the_value");
    let seed = rng.seed();
    let block_size = 64;
    for_each_algorithm(|algorithm| {
        let num_tokens = rng.range(65..190);
        let kv = LogicalKv::random(&mut rng, indexer_shape(2, num_tokens));
        let num_positions = positions_for(num_tokens, block_size, 0, 0);
        let num_blocks = num_positions as u32 + 2;
        let table = GroupTable {
            group_id: 2,
            first_position: 0,
            block_ids: BlockAllocator::new(&mut rng, num_blocks).take(num_positions),
        };
        let shard = shard(&kv, 0, 1, 0, 1);
        let mut placement = Placement::for_shard(
            &mut rng,
            &kv,
            &shard,
            LayoutKind::KeysThenScales,
            2,
            block_size,
            num_blocks,
        );
        placement.write_request(&kv, 0, &table.block_ids);
        let blocks = block_set(&[request(num_tokens, &table)]);
        for (what, bytes) in [
            ("key", 0..INDEXER_KEY_BYTES),
            ("scale", INDEXER_KEY_BYTES..INDEXER_KEY_BYTES + INDEXER_SCALE_BYTES),
        ] {
            let token = rng.below(num_tokens);
            let byte = rng.range(bytes.start as u64..bytes.end as u64) as u32;
            let layer = rng.below(2) as u32;
            let mask = 1u8 << rng.below(8);
            let (position, slot) = (token / block_size as u64, (token % block_size as u64) as u32);
            let mut changed = kv.clone();
            changed.cell_mut(layer, 0, token)[byte as usize] ^= mask;
            let mut faulty = placement.clone();
            faulty.xor_byte(layer, 0, table.block_ids[position as usize], slot, byte, mask);
            let mut worker = host_worker(0, 1, 0, 1);
            register_host(&mut worker, &faulty);
            let values = &columns_of(&checksum(&worker, &blocks, Role::Consumer), "r", 2)[&shard.replica];
            let context = format!("seed {seed}, {algorithm:?}, {what} byte {byte} of token {token}, layer {layer}");
            let clean = naive_full(&kv, block_size, 0, num_positions);
            assert_eq!(values, &naive_full(&changed, block_size, 0, num_positions), "{context}");
            assert_ne!(
                values[position as usize], clean[position as usize],
                "{context}: not seen"
            );
            for q in (0..num_positions).filter(|&q| q as u64 != position) {
                assert_eq!(values[q], clean[q], "{context}: position {q} changed");
            }
        }
        // A scale byte past num_tokens (the last block's tail) is never read.
        let last = num_positions - 1;
        let tail_slot = (num_tokens % block_size as u64) as u32;
        if tail_slot != 0 {
            let mut faulty = placement.clone();
            faulty.xor_byte(0, 0, table.block_ids[last], tail_slot, INDEXER_KEY_BYTES, 0x10);
            let mut worker = host_worker(0, 1, 0, 1);
            register_host(&mut worker, &faulty);
            let values = &columns_of(&checksum(&worker, &blocks, Role::Consumer), "r", 2)[&shard.replica];
            assert_eq!(
                values,
                &naive_full(&kv, block_size, 0, num_positions),
                "seed {seed}, {algorithm:?}: a scale past num_tokens changed c"
            );
        }
    });
}

/// The tier index's full-block path (`Worker::full_block_sums`) keeps each
/// full block's naive value for cells of 4-byte pieces too.
#[test]
fn a_tier_store_keeps_the_naive_value_of_4_byte_piece_blocks() {
    let mut rng = Rng::for_test("a_tier_store_keeps_the_naive_value_of_4_byte_piece_blocks");
    let seed = rng.seed();
    let block_size = 16;
    let positions = 5u64;
    for_each_algorithm(|algorithm| {
        let kv = LogicalKv::random(&mut rng, indexer_shape(3, positions * block_size as u64));
        let num_blocks = positions as u32 + 4;
        let block_ids = BlockAllocator::new(&mut rng, num_blocks).take(positions as usize);
        let shard = shard(&kv, 0, 1, 0, 1);
        let mut placement = Placement::for_shard(
            &mut rng,
            &kv,
            &shard,
            LayoutKind::KeysThenScales,
            0,
            block_size,
            num_blocks,
        );
        placement.write_request(&kv, 0, &block_ids);
        let mut worker = host_worker(0, 1, 0, 1);
        register_host(&mut worker, &placement);
        let hashes: Vec<[u8; 32]> = (0..positions).map(|p| [p as u8 + 1; 32]).collect();
        let blocks: Vec<TierBlock<'_>> = (0..positions)
            .map(|p| TierBlock {
                group_id: 0,
                position: p,
                block_id: block_ids[p as usize],
                hash: Some(&hashes[p as usize]),
            })
            .collect();
        let mut index = TierIndex::new(64).unwrap();
        index.store(&worker, &blocks, StreamHandle::legacy_default()).unwrap();
        let naive = naive_full(&kv, block_size, 0, positions as usize);
        for p in 0..positions {
            assert_eq!(
                index.values(0, &hashes[p as usize]).unwrap(),
                Some((p, vec![naive[p as usize]])),
                "seed {seed}, {algorithm:?}, position {p}"
            );
        }
    });
}

fn replica() -> ReplicaKey {
    ReplicaKey {
        replicas: 1,
        replica_index: 0,
    }
}

/// A one-head layer of `segments` over a registered buffer of `len` bytes.
fn register(segments: Vec<Segment>, base: u64, len: u64) -> kvcsum::Result<()> {
    let mut worker = host_worker(0, 1, 0, 1);
    worker.add_region(Region {
        address: base,
        length: len,
    })?;
    worker.add_group(0, 16)?;
    worker.add_layer(LayerSpec {
        group_id: 0,
        layer_number: 7,
        first_head: 0,
        num_heads: 1,
        replica: replica(),
        num_blocks: 4,
        kernel_blocks: 1,
        tokens_per_kernel_block: 16,
        segments,
        identity: b"layer 7".to_vec(),
    })
}

fn segment(address: u64, block_stride: i64, token_stride: i64, bytes_per_token: u32) -> Segment {
    Segment {
        address,
        block_stride,
        kernel_block_stride: 0,
        head_stride: 0,
        token_stride,
        bytes_per_token,
    }
}

/// Registration: a cell of 4-byte pieces needs 4-byte alignment only
/// (addresses 4 modulo 8 are taken); a cell that is no multiple of 4, a
/// segment no multiple of its cell's pieces, and 4-byte pieces off their
/// alignment are refused, naming the layer and the value.
#[test]
fn registration_takes_4_byte_aligned_cells_of_4_byte_pieces_and_refuses_the_rest() {
    let mut rng = Rng::for_test("registration_takes_4_byte_aligned_cells_of_4_byte_pieces_and_refuses_the_rest");
    let buffer = Buffer::random(&mut rng, 4 * 16 * 140 + 64);
    let base = buffer.address();
    let len = buffer.len() as u64;
    let block = 16 * 132;
    // vLLM's split at an address 4 modulo 8.
    let keys_then_scales = |at: u64| vec![segment(at, block, 128, 128), segment(at + 16 * 128, block, 4, 4)];
    register(keys_then_scales(base + 4), base, len).expect("4-byte aligned indexer cells");
    register(vec![segment(base + 4, block, 132, 132)], base, len).expect("one 132-byte cell segment");
    let refused = |segments: Vec<Segment>, needle: &str| {
        let error = register(segments, base, len).expect_err(needle);
        let message = error.to_string();
        assert!(
            message.contains(needle) && message.contains("layer_number 7"),
            "{message:?} does not say {needle:?}"
        );
    };
    refused(keys_then_scales(base + 2), "address");
    refused(
        vec![segment(base, 16 * 130, 130, 130)],
        "segments[0].bytes_per_token 130 is not a positive multiple of 4",
    );
    refused(
        vec![segment(base, block, 128, 126), segment(base + 16 * 128, block, 8, 6)],
        "not a positive multiple of 4",
    );
    // A 16-byte cell is read in 8-byte pieces, which a 12 + 4 split cuts.
    refused(
        vec![segment(base, 16 * 16, 12, 12), segment(base + 16 * 12, 16 * 16, 4, 4)],
        "segments[0].bytes_per_token 12 is not a positive multiple of 8",
    );
    // An 8-byte piece cell keeps its 8-byte alignment.
    refused(vec![segment(base + 4, 16 * 16, 16, 16)], "address");
}

/// The layout string's call (SPEC section 14) takes vLLM's indexer cache
/// as it is stored, each block's keys `[blocks, tokens, 128]` then their
/// scales `[blocks, tokens, 4]` (`v`), of one block stride: two segments,
/// the cell 132 bytes, the segments the hand-built ones the host engine
/// checks against the reference above; and a `D` of 132 one-byte
/// elements as one 132-byte cell. Both register on a host worker.
#[test]
fn the_layout_string_call_takes_indexer_keys_then_scales_and_one_132_byte_cell() {
    use kvcsum::ffi::layout_string::*;
    use kvcsum::ffi::status::kvcs_status::KVCS_OK;
    use kvcsum::ffi::worker::{kvcs_layer, kvcs_segment};
    use std::ffi::CString;

    let mut rng = Rng::for_test("the_layout_string_call_takes_indexer_keys_then_scales_and_one_132_byte_cell");
    let seed = rng.seed();
    let (blocks, tokens) = (5i64, 16i64);
    let kv = LogicalKv::random(&mut rng, indexer_shape(1, 1));
    let placement = Placement::for_shard(
        &mut rng,
        &kv,
        &shard(&kv, 0, 1, 0, 1),
        LayoutKind::KeysThenScales,
        0,
        tokens as u32,
        blocks as u32,
    );
    let base = placement.host_bases()[0];
    let page = tokens * 132;
    let from_layout = |cache: kvcs_tensor, v: Option<kvcs_tensor>| {
        let layout = CString::new("BTD").unwrap();
        // SAFETY: an all-zero kvcs_layer and kvcs_segment are valid values.
        let mut layer: kvcs_layer = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut segments: [kvcs_segment; 2] = unsafe { std::mem::zeroed() };
        let v_ptr = v.as_ref().map_or(std::ptr::null(), |v| v as *const kvcs_tensor);
        let status = kvcs_layer_from_layout(layout.as_ptr(), &cache, v_ptr, 1, &mut layer, segments.as_mut_ptr());
        assert_eq!(status, KVCS_OK, "seed {seed}");
        segments[..layer.num_segments as usize]
            .iter()
            .map(|s| Segment {
                address: s.address,
                block_stride: s.block_stride,
                kernel_block_stride: s.kernel_block_stride,
                head_stride: s.head_stride,
                token_stride: s.token_stride,
                bytes_per_token: s.bytes_per_token,
            })
            .collect::<Vec<_>>()
    };
    let keys_shape = [blocks, tokens, 128];
    let keys_strides = [page, 128, 1];
    let scales_shape = [blocks, tokens, 4];
    let scales_strides = [page, 4, 1];
    let tensor = |address: u64, shape: &[i64; 3], strides: &[i64; 3]| kvcs_tensor {
        address,
        shape: shape.as_ptr(),
        strides: strides.as_ptr(),
        ndim: 3,
        element_size: 1,
    };
    let split = from_layout(
        tensor(base, &keys_shape, &keys_strides),
        Some(tensor(base + tokens as u64 * 128, &scales_shape, &scales_strides)),
    );
    // One head and one kernel block: their strides are never used.
    let used = |segments: &[Segment]| -> Vec<(u64, i64, i64, u32)> {
        segments
            .iter()
            .map(|s| (s.address, s.block_stride, s.token_stride, s.bytes_per_token))
            .collect()
    };
    let hand = &placement.host_layer_specs()[0].segments;
    assert_eq!(
        used(&split),
        used(hand),
        "seed {seed}: the split's segments are the hand-built ones"
    );
    let cell_shape = [blocks, tokens, 132];
    let cell_strides = [page, 132, 1];
    let whole = from_layout(tensor(base, &cell_shape, &cell_strides), None);
    assert_eq!(whole.len(), 1, "seed {seed}");
    assert_eq!(whole[0].bytes_per_token, 132, "seed {seed}");
    for segments in [split, whole] {
        let mut spec = placement.host_layer_specs()[0].clone();
        spec.segments = segments;
        let mut worker = host_worker(0, 1, 0, 1);
        for region in placement.regions(&placement.host_bases()) {
            worker.add_region(region).unwrap();
        }
        worker.add_group(0, tokens as u32).unwrap();
        worker.add_layer(spec).expect("registers");
    }
}
