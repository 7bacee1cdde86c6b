//! Attention caches on the device: every layout, TP split, replica and
//! role, detail mode, aliases, flat cells, bad input, the caller's stream,
//! and the fault catalogue in device memory.

use std::collections::BTreeMap;

use cudarc::driver::{result as cu, sys, CudaContext};
use kvcsum::record::Record;
use kvcsum::{Error, ReplicaKey, Role, StreamHandle, Worker};

use super::common::*;
use super::streams::*;
use crate::support::*;

#[test]
#[ignore = "needs a CUDA device"]
fn device_equals_host_and_reference_on_every_layout() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_equals_host_and_reference_on_every_layout");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        for kind in all_kinds() {
            let kv = LogicalKv::random(&mut rng, KvShape::gqa(3, 4, 64, 71));
            for tp_size in [1, 2] {
                let tp_rank = tp_size - 1;
                let what = format!("{kind:?} tp {tp_size}");
                assert_device_matches_reference(&mut rng, &kv, (tp_rank, tp_size), kind, 2, &what);
            }
        }
    });
}

/// Token-major layouts (a token's heads side by side) whose heads the
/// kernel reads in groups of 2-32, and shapes it must not group (heads not a
/// power-of-two multiple, heads of 24 bytes, of 512 bytes, 8-byte
/// vectors), on TP 1 and 2, against the naive reference and the host.
#[test]
#[ignore = "needs a CUDA device"]
fn device_grouped_heads_equal_the_reference() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_grouped_heads_equal_the_reference");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        // (KV heads, head bytes): fp8 and bf16 heads of 128 and 256 bytes, 6
        // heads of 64 (groups of 2), 12 of 16 (groups of 4), 4 of 8 (8-byte
        // vectors), 3 heads, 24-byte heads, 512-byte heads (no groups).
        let shapes = [
            (8, 128),
            (8, 256),
            (6, 64),
            (12, 16),
            (4, 8),
            (3, 64),
            (2, 24),
            (4, 512),
        ];
        for (heads, head_bytes) in shapes {
            for kind in [LayoutKind::Nhd, LayoutKind::KvSplit, LayoutKind::Hnd] {
                let num_tokens = 1 + rng.below(60);
                let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, heads, head_bytes, num_tokens));
                for tp_size in [1, 2] {
                    if heads % tp_size != 0 {
                        continue;
                    }
                    let tp_rank = rng.below(tp_size as u64) as u32;
                    let count = 1 + rng.below(3) as usize;
                    let what = format!("{kind:?} {heads} heads of {head_bytes} bytes, tp {tp_rank}/{tp_size}");
                    assert_device_matches_reference(&mut rng, &kv, (tp_rank, tp_size), kind, count, &what);
                }
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_equals_host_for_tp_splits_replicas_and_roles() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_equals_host_for_tp_splits_replicas_and_roles");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        // GQA with 2 KV heads over TP 1, 2, 4, 8 (replicated from 4 on), and an
        // MLA-like latent (576 bf16 elements) replicated on every rank of TP 4.
        let cases = [
            (KvShape::gqa(2, 2, 128, 40), LayoutKind::Nhd, vec![1, 2, 4, 8]),
            (KvShape::mla(3, 1152, 37), LayoutKind::Hnd, vec![4]),
        ];
        for (shape, kind, tp_sizes) in cases {
            let kv = LogicalKv::random(&mut rng, shape);
            for tp_size in tp_sizes {
                let mut checks = BTreeMap::new();
                let mut producer_total: Option<Vec<u64>> = None;
                let mut first_position = 0;
                let mut num_positions = 0;
                for tp_rank in 0..tp_size {
                    let shard = shard(&kv, tp_rank, tp_size, 0, 1);
                    let mut placement = Placement::for_shard(&mut rng, &kv, &shard, kind, 0, 16, 8);
                    first_position = 1;
                    let positions = positions_for(kv.num_tokens(), 16, first_position, 0);
                    num_positions = positions;
                    let block_ids = BlockAllocator::new(&mut rng, 8).take(positions);
                    placement.write_request(&kv, first_position, &block_ids);
                    let requests = [TestRequest {
                        req_id: "r".to_owned(),
                        num_tokens: kv.num_tokens(),
                        tables: vec![GroupTable {
                            group_id: 0,
                            first_position,
                            block_ids,
                        }],
                    }];
                    let pair = Pair::new(tp_rank, tp_size, &[&placement]);
                    let what = format!("{kind:?} tp {tp_rank}/{tp_size}");
                    let consumer = pair.compare(&block_set(&requests), Role::Consumer, &what);
                    let producer = pair.compare(&block_set(&requests), Role::Producer, &what);
                    add_columns(&mut checks, &consumer[&("r".to_owned(), 0)]);
                    let produced = &producer[&("r".to_owned(), 0)];
                    assert!(
                        produced.keys().all(|k| k.replica_index == 0),
                        "{what}: producer computed a replica column"
                    );
                    let sum = sum_of_columns(produced, positions);
                    match &mut producer_total {
                        Some(total) => add_values(total, &sum),
                        None => producer_total = Some(sum),
                    }
                }
                let c = naive_full(&kv, 16, first_position, num_positions);
                assert_eq!(
                    producer_total.as_ref(),
                    Some(&c),
                    "tp {tp_size}: producers do not sum to c (seed {})",
                    rng.seed()
                );
                // SPEC section 4: check k sums key (R, k % R) over the distinct R.
                let max_replicas = checks.keys().map(|k| k.replicas).max().unwrap();
                for k in 0..max_replicas {
                    let mut check = vec![0u64; num_positions];
                    let mut counts: Vec<u32> = checks.keys().map(|key| key.replicas).collect();
                    counts.dedup();
                    for r in counts {
                        add_values(
                            &mut check,
                            &checks[&ReplicaKey {
                                replicas: r,
                                replica_index: k % r,
                            }],
                        );
                    }
                    assert_eq!(
                        check,
                        c,
                        "tp {tp_size}: consumer check {k} differs from c (seed {})",
                        rng.seed()
                    );
                }
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_handles_many_requests_and_groups_in_one_call() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_handles_many_requests_and_groups_in_one_call");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        // Two groups (block sizes 16 and 32, different layouts); 40 requests give
        // rows well past the inline limit, 1 request stays inside it.
        let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 64, 45));
        // The second group's layers are other layers of the model.
        let kv2 = LogicalKv::random(
            &mut rng,
            KvShape {
                first_layer: 10,
                ..KvShape::gqa(2, 2, 64, 45)
            },
        );
        let shard = shard(&kv, 0, 1, 0, 1);
        let shard2 = crate::support::shard(&kv2, 0, 1, 0, 1);
        let mut first = Placement::for_shard(&mut rng, &kv, &shard, LayoutKind::HndKvSplit, 0, 16, 160);
        let mut second = Placement::for_shard(
            &mut rng,
            &kv2,
            &shard2,
            LayoutKind::KernelBlocks { kernel_blocks: 2 },
            1,
            32,
            90,
        );
        let mut requests = requests_for(&mut rng, &kv, &mut [&mut first], 40);
        let mut allocator = BlockAllocator::new(&mut rng, 90);
        for request in &mut requests {
            let block_ids = allocator.take(positions_for(kv2.num_tokens(), 32, 0, 0));
            second.write_request(&kv2, 0, &block_ids);
            request.tables.push(GroupTable {
                group_id: 1,
                first_position: 0,
                block_ids,
            });
        }
        let pair = Pair::new(0, 1, &[&first, &second]);
        let values = pair.compare(&block_set(&requests), Role::Consumer, "40 requests, 2 groups");
        pair.compare(&block_set(&requests[..1]), Role::Producer, "1 request, 2 groups");
        for request in &requests {
            let t = request.table(1);
            let naive = naive_full(&kv2, 32, t.first_position, t.block_ids.len());
            assert_eq!(
                values[&(request.req_id.clone(), 1)][&shard.replica],
                naive,
                "group 1 (seed {})",
                rng.seed()
            );
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_runs_on_the_callers_stream_and_survives_early_destroy() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_runs_on_the_callers_stream_and_survives_early_destroy");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let kv = LogicalKv::random(&mut rng, KvShape::gqa(4, 2, 128, 500));
        let shard = shard(&kv, 0, 1, 0, 1);
        let mut placement = Placement::for_shard(&mut rng, &kv, &shard, LayoutKind::Hnd, 0, 16, 80);
        let requests = requests_for(&mut rng, &kv, &mut [&mut placement], 2);
        let pair = Pair::new(0, 1, &[&placement]);
        let blocks = block_set(&requests);
        let expected = pair.compare(&blocks, Role::Consumer, "reference call");
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).expect("stream");
        for round in 0..20 {
            // Drop pending results at once: their buffers must outlive the work.
            for _ in 0..3 {
                drop(
                    pair.device
                        .checksum(&blocks, Role::Consumer, StreamHandle(stream.cast()))
                        .expect("checksum"),
                );
            }
            let result = pair
                .device
                .checksum(&blocks, Role::Consumer, StreamHandle(stream.cast()))
                .expect("checksum");
            result.wait().expect("wait");
            assert!(result.is_ready().unwrap());
            assert_eq!(
                all_columns(&result),
                expected,
                "round {round} on the caller's stream (seed {})",
                rng.seed()
            );
        }
        // SAFETY: our stream, no work left on it after the waits.
        unsafe { cu::stream::synchronize(stream).unwrap() };
        // SAFETY: our stream, synchronized above; nothing uses it after this.
        let _ = unsafe { cu::stream::destroy(stream as sys::CUstream) };
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_gives_zeros_where_nothing_is_valid() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_gives_zeros_where_nothing_is_valid");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let kv = LogicalKv::random(&mut rng, KvShape::gqa(1, 1, 64, 16));
        let shard = shard(&kv, 0, 1, 0, 1);
        let placement = Placement::for_shard(&mut rng, &kv, &shard, LayoutKind::Hnd, 0, 16, 8);
        let pair = Pair::new(0, 1, &[&placement]);
        let requests = [TestRequest {
            req_id: "past-the-end".to_owned(),
            num_tokens: 16,
            tables: vec![GroupTable {
                group_id: 0,
                first_position: 3,
                block_ids: vec![2, 5],
            }],
        }];
        let values = pair.compare(&block_set(&requests), Role::Consumer, "positions past num_tokens");
        assert_eq!(values[&("past-the-end".to_owned(), 0)][&shard.replica], vec![0, 0]);
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_rejects_bad_input_like_the_host() {
    let mut rng = Rng::for_test("device_rejects_bad_input_like_the_host");
    println!("seed {} ({NEEDS_GPU})", rng.seed());
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(1, 2, 64, 20));
    let shard = shard(&kv, 0, 1, 0, 1);
    let placement = Placement::for_shard(&mut rng, &kv, &shard, LayoutKind::Nhd, 0, 16, 8);
    let mut pair = Pair::new(0, 1, &[&placement]);
    let bad_blocks = [
        TestRequest {
            req_id: "r".into(),
            num_tokens: 20,
            tables: vec![GroupTable {
                group_id: 0,
                first_position: 0,
                block_ids: vec![1, 8],
            }],
        },
        TestRequest {
            req_id: "r".into(),
            num_tokens: 20,
            tables: vec![GroupTable {
                group_id: 7,
                first_position: 0,
                block_ids: vec![1],
            }],
        },
    ];
    for requests in bad_blocks {
        let blocks = block_set(&[requests]);
        let host = pair
            .host
            .checksum(&blocks, Role::Consumer, StreamHandle::legacy_default())
            .err()
            .expect("host rejects");
        let device = pair
            .device
            .checksum(&blocks, Role::Consumer, StreamHandle::legacy_default())
            .err()
            .expect("device rejects");
        assert_eq!(device, host, "same error on both engines");
        assert!(
            matches!(device, Error::OutOfBounds(_) | Error::NotFound(_)),
            "{device:?}"
        );
    }
    // Registration errors: unaligned address, reach outside every region.
    let mut layer = placement.host_layer_specs().remove(0);
    layer.layer_number = 99;
    let mut unaligned = layer.clone();
    unaligned.segments[0].address += 4;
    let mut outside = layer.clone();
    outside.num_blocks += 1000;
    for (bad, what) in [(unaligned, "unaligned"), (outside, "outside")] {
        let host = pair.host.add_layer(bad.clone()).expect_err("host rejects");
        let device = pair.device.add_layer(bad).expect_err("device rejects");
        assert_eq!(
            std::mem::discriminant(&device),
            std::mem::discriminant(&host),
            "{what}: {device:?} vs {host:?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_handles_unlike_layers_in_one_group() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_handles_unlike_layers_in_one_group");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        // One group holding an attention cache (2 heads, K and V) and, for the
        // same layers, a one-head K-only cache numbered after it (an indexer):
        // layers of the group differ in heads and segments.
        let kv = LogicalKv::random(&mut rng, KvShape::gqa(3, 2, 32, 50));
        let indexer = LogicalKv::random(
            &mut rng,
            KvShape {
                first_head: 2,
                total_kv_heads: 1,
                v_bytes: 0,
                k_bytes: 16,
                ..kv.shape
            },
        );
        let shard_kv = shard(&kv, 0, 1, 0, 1);
        let shard_indexer = shard(&indexer, 0, 1, 0, 1);
        let mut attention = Placement::for_shard(&mut rng, &kv, &shard_kv, LayoutKind::KvSplit, 0, 16, 64);
        let mut index = Placement::for_shard(&mut rng, &indexer, &shard_indexer, LayoutKind::Nhd, 0, 16, 64);
        let mut allocator = BlockAllocator::new(&mut rng, 64);
        let mut requests = Vec::new();
        for r in 0..12 {
            let first_position = r % 2;
            let block_ids = allocator.take(positions_for(kv.num_tokens(), 16, first_position, 0));
            attention.write_request(&kv, first_position, &block_ids);
            index.write_request(&indexer, first_position, &block_ids);
            requests.push(TestRequest {
                req_id: format!("r{r}"),
                num_tokens: kv.num_tokens(),
                tables: vec![GroupTable {
                    group_id: 0,
                    first_position,
                    block_ids,
                }],
            });
        }
        let pair = Pair::new(0, 1, &[&attention, &index]);
        for count in [1, requests.len()] {
            let values = pair.compare(&block_set(&requests[..count]), Role::Consumer, "unlike layers");
            for request in &requests[..count] {
                let t = request.table(0);
                let mut expected = naive_full(&kv, 16, t.first_position, t.block_ids.len());
                add_values(
                    &mut expected,
                    &naive_full(&indexer, 16, t.first_position, t.block_ids.len()),
                );
                assert_eq!(
                    values[&(request.req_id.clone(), 0)][&shard_kv.replica],
                    expected,
                    "seed {}",
                    rng.seed()
                );
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_worker_rejects_memory_it_cannot_read() {
    let mut worker = device_worker(0, 1);
    // A plain host allocation is not memory the device can read.
    let host = vec![7u64; 1024];
    let error = worker
        .add_region(kvcsum::Region {
            address: host.as_ptr() as u64,
            length: 8192,
        })
        .expect_err("host memory on a device worker");
    assert!(matches!(error, Error::InvalidArgument(_)), "{error:?}");
    assert!(error.to_string().contains("address"), "{error}");
    // A range running far past its allocation, over memory nothing maps
    // (64 TiB: more than any neighbouring allocations can cover).
    let context = CudaContext::new(0).expect("context");
    context.bind_to_thread().expect("bind");
    // SAFETY: a fresh allocation, freed below.
    let base = unsafe { cu::malloc_sync(4096).expect("cuMemAlloc") };
    let error = worker
        .add_region(kvcsum::Region {
            address: base,
            length: 1 << 46,
        })
        .expect_err("past the allocation");
    assert!(matches!(error, Error::OutOfBounds(_)), "{error:?}");
    // The allocation itself, and a range inside it, are accepted.
    worker
        .add_region(kvcsum::Region {
            address: base,
            length: 4096,
        })
        .expect("whole allocation");
    worker
        .add_region(kvcsum::Region {
            address: base + 1024,
            length: 512,
        })
        .expect("inside");
    drop(worker);
    // SAFETY: allocated above; the worker that registered it is gone.
    unsafe { cu::free_sync(base).expect("free") };
}

#[test]
#[ignore = "needs a CUDA device"]
fn host_worker_rejects_device_memory() {
    // Device memory, which CUDA's unified addressing reserves in the host
    // process: a host worker took it as mapped before (mincore), and its
    // checksum then died reading it. Now the mapping's missing read
    // permission refuses it; pinned host memory stays accepted.
    let mut worker = host_worker(0, 1, 0, 1);
    let context = CudaContext::new(0).expect("context");
    context.bind_to_thread().expect("bind");
    // SAFETY: fresh allocations, freed below.
    let (device, pinned) = unsafe {
        (
            cu::malloc_sync(1 << 20).expect("cuMemAlloc"),
            cu::malloc_host(1 << 20, 0).expect("cuMemHostAlloc") as u64,
        )
    };
    let error = worker
        .add_region(kvcsum::Region {
            address: device,
            length: 1 << 20,
        })
        .expect_err("device memory on a host worker");
    eprintln!("a host worker on device memory: {error}");
    assert!(matches!(error, Error::InvalidArgument(_)), "{error:?}");
    assert!(
        error.to_string().contains("without read permission") || error.to_string().contains("not mapped"),
        "{error}"
    );
    worker
        .add_region(kvcsum::Region {
            address: pinned,
            length: 1 << 20,
        })
        .expect("pinned host memory on a host worker");
    drop(worker);
    // SAFETY: allocated above; the worker that registered them is gone.
    unsafe {
        cu::free_sync(device).expect("free");
        cu::free_host(pinned as *mut std::ffi::c_void).expect("free host");
    }
}

/// The stream rule: the checksum runs after everything already queued on the
/// stream the caller names, which is the KV being written there behind a
/// long kernel. NULL is the legacy default stream, 0x2 the per-thread
/// default stream; an explicit stream is the third case. Were the work put
/// on any other stream, it would read the stale bytes the cache held before.
#[test]
#[ignore = "needs a CUDA device"]
fn device_orders_after_work_queued_on_the_callers_stream() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_orders_after_work_queued_on_the_callers_stream");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let kv = LogicalKv::random(&mut rng, KvShape::gqa(4, 2, 128, 500));
        let shard = shard(&kv, 0, 1, 0, 1);
        let mut placement = Placement::for_shard(&mut rng, &kv, &shard, LayoutKind::Hnd, 0, 16, 80);
        let requests = requests_for(&mut rng, &kv, &mut [&mut placement], 2);
        let pair = Pair::new(0, 1, &[&placement]);
        let blocks = block_set(&requests);
        let expected = pair.compare(&blocks, Role::Consumer, "reference call");

        // The true KV is written back on each case's stream, late.
        let cache = &pair._copies[0];
        let contents: Vec<&[u8]> = placement.buffers().iter().map(|b| b.bytes()).collect();
        let writer = LateWriter::new(&cache.context, &cache.bases, &contents);
        let seed = rng.seed();
        checksum_behind_late_writes(writer, &mut rng, &pair.device, &blocks, |name, result| {
            assert_eq!(
                all_columns(result),
                expected,
                "{name}: the checksum did not see the KV written on the caller's stream (seed {seed})"
            );
        });
    });
}

/// Detail mode on a device worker (one more launch over the shadow layout,
/// on the same stream) gives the host engine's per-layer partials, so the
/// records are equal, on every layout, with replicas, in both roles; also
/// when detail mode is turned on before the layers are registered.
#[test]
#[ignore = "needs a CUDA device"]
fn device_detail_mode_gives_the_host_layer_partials() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_detail_mode_gives_the_host_layer_partials");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        for kind in all_kinds() {
            // 2 KV heads on TP 4: every head on 2 ranks (replica keys (2, k)).
            let kv = LogicalKv::random(&mut rng, KvShape::gqa(4, 2, 64, 150));
            let tp_rank = rng.below(4) as u32;
            let shard = shard(&kv, tp_rank, 4, 0, 1);
            let mut placement = Placement::for_shard(&mut rng, &kv, &shard, kind, 0, 16, 64);
            let requests = requests_for(&mut rng, &kv, &mut [&mut placement], 3);
            let blocks = block_set(&requests);
            let mut pair = Pair::new(tp_rank, 4, &[&placement]);
            pair.host.set_detail(true).expect("host detail");
            pair.device.set_detail(true).expect("device detail");
            // Detail mode first, layers after: the shadow follows each layer.
            let copy = DeviceCopy::new(&placement);
            let mut early = device_worker(tp_rank, 4);
            early.set_detail(true).expect("detail before layers");
            register_at(&mut early, &placement, &copy.bases).expect("register after detail");
            for role in [Role::Producer, Role::Consumer] {
                let host = Record::from_checksums(&checksum(&pair.host, &blocks, role)).expect("host record");
                // A producer computes only the first copy of replicated heads.
                let computes_layers = role == Role::Consumer || shard.replica.replica_index == 0;
                assert_eq!(
                    host.requests
                        .iter()
                        .all(|r| r.groups.iter().all(|g| !g.layers.is_empty())),
                    computes_layers,
                    "{kind:?} {role:?} rank {tp_rank}: detail records carry layer partials where columns are computed"
                );
                for (name, worker) in [("device", &pair.device), ("device, detail first", &early)] {
                    let result = worker
                        .checksum(&blocks, role, StreamHandle::legacy_default())
                        .expect("checksum");
                    result.wait().expect("wait");
                    let device = Record::from_checksums(&result).expect("device record");
                    assert_eq!(
                        device,
                        host,
                        "{kind:?} {role:?} {name}: records differ (seed {})",
                        rng.seed()
                    );
                }
            }
        }
    });
}

/// Aliases (layers reading another layer's cache) on a device worker: the
/// record's fingerprint counts them and the values ignore them, exactly as
/// on the host.
#[test]
#[ignore = "needs a CUDA device"]
fn device_aliases_count_in_the_fingerprint_only() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_aliases_count_in_the_fingerprint_only");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let kv = LogicalKv::random(&mut rng, KvShape::gqa(3, 2, 64, 90));
        let shard = shard(&kv, 0, 1, 0, 1);
        let mut placement = Placement::for_shard(&mut rng, &kv, &shard, LayoutKind::Nhd, 0, 16, 24);
        let requests = requests_for(&mut rng, &kv, &mut [&mut placement], 2);
        let blocks = block_set(&requests);
        let mut pair = Pair::new(0, 1, &[&placement]);
        let plain = Record::from_checksums(&checksum(&pair.host, &blocks, Role::Consumer)).expect("record");
        for worker in [&mut pair.host, &mut pair.device] {
            for (layer_number, target) in [(7, 0), (8, 2)] {
                let alias = kvcsum::Alias {
                    layer_number,
                    target_layer_number: target,
                    identity: format!("('model.layers.{layer_number}.attn', 'FullAttentionSpec', 'bf16')").into_bytes(),
                };
                worker.add_alias(0, alias).expect("alias");
            }
        }
        let host = Record::from_checksums(&checksum(&pair.host, &blocks, Role::Consumer)).expect("host record");
        let result = pair
            .device
            .checksum(&blocks, Role::Consumer, StreamHandle::legacy_default())
            .expect("checksum");
        result.wait().expect("wait");
        let device = Record::from_checksums(&result).expect("device record");
        assert_eq!(device, host, "seed {}", rng.seed());
        assert_ne!(
            host.groups[0].fingerprint, plain.groups[0].fingerprint,
            "the aliases count"
        );
        assert_eq!(host.requests, plain.requests, "and add no checksum");
    });
}

/// Caches whose tokens are whole contiguous cells (MLA latents, one
/// segment) take the kernel's flat path: every layout of one segment, wide
/// (16-byte) and narrow (8-byte) loads, partial blocks, against the reference.
#[test]
#[ignore = "needs a CUDA device"]
fn device_flat_cells_equal_the_reference() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_flat_cells_equal_the_reference");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        for kind in single_segment_kinds() {
            for latent_bytes in [1152u32, 1160, 64, 24] {
                let kv = LogicalKv::random(&mut rng, KvShape::mla(3, latent_bytes, 53));
                let what = format!("{kind:?} latent {latent_bytes}");
                assert_device_matches_reference(&mut rng, &kv, (0, 1), kind, 2, &what);
            }
        }
    });
}

/// The fault catalogue (docs/SPEC.md section 13, `tests/it/fault_catalogue.rs`)
/// in device memory: each class injected into fresh random KV of its
/// geometry on the host, copied to the device, one fault per block of a
/// 512-block cache; device workers of every algorithm checksum it before
/// and after, and must equal host workers over the host copy. MIXED2 must
/// miss nothing, MIXED nothing outside the fixed-pattern classes, WEIGHTED
/// exactly what SPEC section 13 states. `KVCS_CATALOGUE_ENGINE_TRIALS`
/// faults per class (default 4096). Prints the table.
#[test]
#[ignore = "needs a CUDA device"]
fn device_fault_catalogue() {
    use crate::support::faults::*;
    let mut rng = Rng::for_test("device_fault_catalogue");
    let seed = rng.seed();
    println!("seed {seed} ({NEEDS_GPU})");
    let trials = env_count("KVCS_CATALOGUE_ENGINE_TRIALS", 4096);
    let num_blocks = 512;
    let classes = catalogue();
    // One buffer of the largest geometry's cache, on the host and the device.
    let capacity = classes.iter().map(|c| c.geometry.block_bytes()).max().unwrap() * num_blocks;
    let mut host = vec![0u64; capacity / 8];
    let host_address = host.as_ptr() as u64;
    let context = CudaContext::new(0).expect("primary context of device 0");
    context.bind_to_thread().expect("bind");
    // SAFETY: a fresh allocation of `capacity` bytes, freed at the end of the test.
    let device = unsafe { cu::malloc_sync(capacity).expect("cuMemAlloc") };
    let blocks = catalogue_blocks(num_blocks);
    let values = |worker: &Worker| -> Vec<u64> {
        checksum(worker, &blocks, Role::Producer)
            .column("catalogue", 0, 0)
            .unwrap()
            .1
            .to_vec()
    };
    println!(
        "| kind | fault class | trials | WEIGHTED detected | WEIGHTED missed | MIXED detected | MIXED missed | MIXED2 \
         detected | MIXED2 missed |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut failures = Vec::new();
    for class in classes {
        let g = class.geometry;
        let block_bytes = g.block_bytes();
        let bytes = num_blocks * block_bytes;
        let device_workers: Vec<Worker> = ALGORITHMS
            .iter()
            .map(|&a| catalogue_worker(Some(0), a, device, num_blocks, g))
            .collect();
        let host_workers: Vec<Worker> = ALGORITHMS
            .iter()
            .map(|&a| catalogue_worker(None, a, host_address, num_blocks, g))
            .collect();
        let as_bytes = |host: &mut Vec<u64>| {
            assert!(bytes <= host.len() * 8);
            // SAFETY: the first `bytes` (asserted within it) of the u64
            // cache, borrowed mutably, viewed as bytes (any bit pattern is a u8).
            unsafe { std::slice::from_raw_parts_mut(host.as_mut_ptr().cast::<u8>(), bytes) }
        };
        let upload = |host: &[u64]| {
            // SAFETY: the device buffer holds `capacity` >= `bytes` bytes,
            // and the copy is synchronous.
            unsafe { cu::memcpy_htod_sync(device, &host[..bytes / 8]).expect("copy to device") }
        };
        // Both engines' values under each algorithm, asserted equal.
        let both = |host: &[u64], what: &str| -> Vec<Vec<u64>> {
            upload(host);
            device_workers
                .iter()
                .zip(&host_workers)
                .map(|(d, h)| {
                    let device_values = values(d);
                    assert_eq!(device_values, values(h), "{what}: device and host differ (seed {seed})");
                    device_values
                })
                .collect()
        };
        let mut tallies = [Tally::default(); 3];
        while tallies[0].trials < trials {
            g.fill(&mut rng, as_bytes(&mut host));
            for block in as_bytes(&mut host).chunks_exact_mut(block_bytes) {
                (class.prepare)(&mut rng, block);
            }
            let clean_bytes = as_bytes(&mut host).to_vec();
            let clean = both(&host, &class.name);
            let mut changed = Vec::with_capacity(num_blocks);
            for (b, block) in as_bytes(&mut host).chunks_exact_mut(block_bytes).enumerate() {
                let other = (b + 1 + rng.below(num_blocks as u64 - 1) as usize) % num_blocks;
                changed.push((class.inject)(
                    &mut rng,
                    block,
                    &clean_bytes[other * block_bytes..(other + 1) * block_bytes],
                    g,
                ));
            }
            let faulty = both(&host, &class.name);
            for (i, &algorithm) in ALGORITHMS.iter().enumerate() {
                for b in 0..num_blocks {
                    let expected = expected_miss(&class, algorithm, changed[b]);
                    tallies[i].add(faulty[i][b] == clean[i][b], expected);
                }
            }
        }
        let [weighted, mixed, mixed2] = tallies;
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            if class.hardware { "hardware" } else { "software" },
            class.name,
            weighted.trials,
            weighted.trials - weighted.missed,
            weighted.missed,
            mixed.trials - mixed.missed,
            mixed.missed,
            mixed2.trials - mixed2.missed,
            mixed2.missed
        );
        if mixed2.missed > 0 || mixed.unexpected > 0 || weighted.unexpected > 0 {
            failures.push(format!(
                "\"{}\": MIXED2 missed {}, MIXED missed {} where it should not have, WEIGHTED broke SPEC section \
                 13 {} times",
                class.name, mixed2.missed, mixed.unexpected, weighted.unexpected
            ));
        }
    }
    // SAFETY: allocated above; every worker that read it is dropped.
    unsafe { cu::free_sync(device).expect("cuMemFree") };
    assert!(failures.is_empty(), "seed {seed}: {failures:#?}");
}
