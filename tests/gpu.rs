//! GPU tests: the device engine gives the host engine's values bit for bit
//! (and so the naive reference's) on every layout, TP split, replica and
//! role, and rejects bad input as the host engine does.
//!
//! They need a CUDA device, so they are `#[ignore]`d and reported as ignored
//! where none is; on a GPU machine run `cargo test --release --test gpu --
//! --include-ignored` (scripts/gpu-run.sh also runs them under
//! compute-sanitizer memcheck and racecheck).

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::{result as cu, sys, CudaContext};
use kvcsum::record::Record;
use kvcsum::{BlockSet, Error, ReplicaKey, Role, StreamHandle, Worker, WorkerOptions};
use support::*;

const NEEDS_GPU: &str = "needs a CUDA device";

/// A placement's buffers copied to device memory (freed on drop).
struct DeviceCopy {
    context: Arc<CudaContext>,
    bases: Vec<u64>,
}

impl DeviceCopy {
    fn new(placement: &Placement) -> DeviceCopy {
        let context = CudaContext::new(0).expect("primary context of device 0");
        context.bind_to_thread().expect("bind");
        let bases = placement
            .buffers()
            .iter()
            .map(|buffer| {
                // Keep the host buffer's address modulo 16, so layouts that are 8-
                // but not 16-byte aligned stay that way on the device.
                let skew = buffer.address() % 16;
                // SAFETY: a fresh allocation, filled from a host buffer of the same length.
                unsafe {
                    let base = cu::malloc_sync(buffer.len() + 16).expect("cuMemAlloc") + skew;
                    cu::memcpy_htod_sync(base, buffer.bytes()).expect("copy to device");
                    base
                }
            })
            .collect();
        DeviceCopy { context, bases }
    }
}

impl Drop for DeviceCopy {
    fn drop(&mut self) {
        let _ = self.context.bind_to_thread();
        for &base in &self.bases {
            // SAFETY: allocated in `new` (minus its skew); no call reads it any more.
            let _ = unsafe { cu::free_sync(base - base % 16) };
        }
    }
}

/// A device worker of this thread's algorithm (`support::algorithm`).
fn device_worker(tp_rank: u32, tp_size: u32) -> Worker {
    let mut worker = Worker::new(WorkerOptions {
        tp_rank,
        tp_size,
        pp_rank: 0,
        device: Some(0),
        num_threads: 0,
    })
    .expect("device worker");
    worker
        .set_algorithm(algorithm())
        .expect("a new worker takes an algorithm");
    worker
}

/// Every column of every request and group of a result.
fn all_columns(result: &kvcsum::Checksums) -> BTreeMap<(String, u32), BTreeMap<ReplicaKey, Vec<u64>>> {
    let mut all = BTreeMap::new();
    for request in result.requests() {
        for group in &request.groups {
            all.insert(
                (request.req_id.clone(), group.group_id),
                columns_of(result, &request.req_id, group.group_id),
            );
        }
    }
    all
}

/// Host and device workers over the same placements (host buffers / device copies).
struct Pair {
    host: Worker,
    device: Worker,
    _copies: Vec<DeviceCopy>,
}

impl Pair {
    fn new(tp_rank: u32, tp_size: u32, placements: &[&Placement]) -> Pair {
        let mut host = host_worker(tp_rank, tp_size, 0, 2);
        let mut device = device_worker(tp_rank, tp_size);
        let mut copies = Vec::new();
        for placement in placements {
            register_host(&mut host, placement);
            let copy = DeviceCopy::new(placement);
            register_at(&mut device, placement, &copy.bases).expect("register on the device worker");
            copies.push(copy);
        }
        Pair {
            host,
            device,
            _copies: copies,
        }
    }

    /// Both engines' values for `blocks` in `role`, asserted equal.
    fn compare(
        &self,
        blocks: &BlockSet,
        role: Role,
        what: &str,
    ) -> BTreeMap<(String, u32), BTreeMap<ReplicaKey, Vec<u64>>> {
        let host = all_columns(&checksum(&self.host, blocks, role));
        let device = all_columns(&checksum(&self.device, blocks, role));
        assert_eq!(
            device,
            host,
            "{what}: device and host values differ (seed {})",
            run_seed_note()
        );
        host
    }
}

fn run_seed_note() -> String {
    std::env::var("KVCS_TEST_SEED").unwrap_or_else(|_| "printed at the start of the test".to_owned())
}

/// Requests over `placement`'s group: non-zero first positions, partial last
/// blocks, positions past num_tokens, the cache's last block id in use.
fn requests_for(rng: &mut Rng, kv: &LogicalKv, placements: &mut [&mut Placement], count: usize) -> Vec<TestRequest> {
    let spec = placements[0].spec().clone();
    let mut allocator = BlockAllocator::new(rng, spec.num_blocks);
    let last = allocator.reserve(spec.num_blocks - 1);
    let mut requests = Vec::new();
    for r in 0..count {
        let first_position = rng.below(2);
        let positions = positions_for(kv.num_tokens(), spec.block_size, first_position, 1);
        let mut block_ids = allocator.take(positions);
        if r == 0 {
            block_ids[0] = last;
        }
        for placement in placements.iter_mut() {
            placement.write_request(kv, first_position, &block_ids);
        }
        requests.push(TestRequest {
            req_id: format!("req-{r}"),
            num_tokens: kv.num_tokens(),
            tables: vec![GroupTable {
                group_id: spec.group_id,
                first_position,
                block_ids,
            }],
        });
    }
    requests
}

/// Lays `kv`'s shard of rank `tp_rank` of `tp_size` out as `kind` (16-token
/// blocks), writes `count` random requests into it, checksums them on a host
/// and a device worker of that rank, and asserts the two equal and each
/// request's values equal to the naive reference.
fn assert_device_matches_reference(
    rng: &mut Rng,
    kv: &LogicalKv,
    (tp_rank, tp_size): (u32, u32),
    kind: LayoutKind,
    count: usize,
    what: &str,
) {
    let seed = rng.seed();
    let shard = shard(kv, tp_rank, tp_size, 0, 1);
    let mut placement = Placement::for_shard(rng, kv, &shard, kind, 0, 16, 24);
    let requests = &requests_for(rng, kv, &mut [&mut placement], count);
    let placement = &placement;
    let pair = Pair::new(shard.tp_rank, shard.tp_size, &[placement]);
    let values = pair.compare(&block_set(requests), Role::Consumer, what);
    for request in requests {
        let table = request.table(0);
        let naive = naive_positions(
            kv,
            &shard.layer_numbers,
            &shard.heads(),
            16,
            table.first_position,
            table.block_ids.len(),
        );
        assert_eq!(
            values[&(request.req_id.clone(), 0)][&shard.replica],
            naive,
            "{what} {}: not the naive reference (seed {seed})",
            request.req_id
        );
    }
}

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
        let shard2 = support::shard(&kv2, 0, 1, 0, 1);
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

/// A kernel that keeps a stream busy: one thread spins for `cycles` clocks.
const SPIN_KERNEL: &str = r#"
extern "C" __global__ void spin(unsigned long long cycles) {
    long long start = clock64();
    while ((unsigned long long)(clock64() - start) < cycles) {
    }
}
"#;

/// Writes device buffers late on a stream: holds their true bytes aside in
/// device memory, overwrites them with stale random bytes (`stale`), and
/// queues on a stream a kernel spinning about 200 ms, then the copies of the
/// true bytes back (`queue`). Work the library queues on that stream after
/// `queue` sees the true bytes; work it put anywhere else, the stale ones.
struct LateWriter {
    _module: Arc<cudarc::driver::CudaModule>,
    spin: sys::CUfunction,
    clock_khz: u64,
    /// (device buffer, its true bytes aside, length)
    buffers: Vec<(u64, u64, usize)>,
}

impl LateWriter {
    /// For device buffers `bases` whose true contents are `contents`.
    fn new(context: &Arc<CudaContext>, bases: &[u64], contents: &[&[u8]]) -> LateWriter {
        context.bind_to_thread().expect("bind");
        let (major, minor) = context.compute_capability().expect("capability");
        let options = cudarc::nvrtc::CompileOptions {
            options: vec![format!("--gpu-architecture=sm_{major}{minor}")],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(SPIN_KERNEL, options).expect("compile spin kernel");
        let module = context.load_module(ptx).expect("load spin kernel");
        let spin = module.load_function("spin").expect("spin").cu_function();
        let clock_khz = context
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
            .expect("clock rate") as u64;
        let buffers = bases
            .iter()
            .zip(contents)
            .map(|(&base, bytes)| {
                // SAFETY: a fresh allocation of the contents' length, filled from them.
                let source = unsafe {
                    let source = cu::malloc_sync(bytes.len()).expect("cuMemAlloc");
                    cu::memcpy_htod_sync(source, bytes).expect("copy aside");
                    source
                };
                (base, source, bytes.len())
            })
            .collect();
        LateWriter {
            _module: module,
            spin,
            clock_khz,
            buffers,
        }
    }

    /// Overwrites the buffers with random bytes (synchronously).
    fn stale(&self, rng: &mut Rng) {
        for &(base, _, len) in &self.buffers {
            let stale: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            // SAFETY: `base` holds `len` bytes; the copy is synchronous.
            unsafe { cu::memcpy_htod_sync(base, &stale).expect("stale bytes") };
        }
    }

    /// Queues on `stream` the spin kernel, then the true bytes' copies.
    fn queue(&self, stream: sys::CUstream) {
        // SAFETY: the spin kernel takes one u64 by value; the copies stay in
        // allocations that outlive the work (freed on drop, after a sync).
        unsafe {
            let mut cycles = self.clock_khz * 200; // about 200 ms
            let mut params = [(&mut cycles as *mut u64).cast::<std::ffi::c_void>()];
            cu::launch_kernel(self.spin, (1, 1, 1), (1, 1, 1), 0, stream, &mut params).expect("spin");
            for &(base, source, len) in &self.buffers {
                sys::cuMemcpyDtoDAsync_v2(base, source, len, stream)
                    .result()
                    .expect("write the true bytes on the stream");
            }
        }
    }
}

impl Drop for LateWriter {
    fn drop(&mut self) {
        // SAFETY: waits for everything queued, then frees what is ours.
        unsafe {
            let _ = cu::ctx::synchronize();
            for &(_, source, _) in &self.buffers {
                let _ = cu::free_sync(source);
            }
        }
    }
}

/// The streams a caller may name: the legacy default stream (NULL), the
/// per-thread default stream (0x2) and `explicit`.
fn stream_cases(explicit: sys::CUstream) -> [(&'static str, sys::CUstream); 3] {
    [
        ("NULL (legacy default stream)", std::ptr::null_mut()),
        ("CU_STREAM_PER_THREAD", 0x2 as sys::CUstream),
        ("an explicit non-blocking stream", explicit),
    ]
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
        let explicit = cu::stream::create(cu::stream::StreamKind::NonBlocking).expect("stream");
        for (name, stream) in stream_cases(explicit) {
            writer.stale(&mut rng);
            writer.queue(stream);
            let result = pair
                .device
                .checksum(&blocks, Role::Consumer, StreamHandle(stream.cast()))
                .expect("checksum");
            assert!(
                !result.is_ready().expect("query"),
                "{name}: the result was ready while the stream was still busy"
            );
            result.wait().expect("wait");
            assert_eq!(
                all_columns(&result),
                expected,
                "{name}: the checksum did not see the KV written on the caller's stream (seed {})",
                rng.seed()
            );
            // SAFETY: the stream's work is done once synchronised.
            unsafe { cu::stream::synchronize(stream).expect("sync") };
        }
        drop(writer);
        // SAFETY: nothing is queued any more; ours.
        unsafe {
            let _ = cu::stream::destroy(explicit);
        }
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

// ---- stored checksums on the device

const STORED_REQ: &str = "offload-1";
const HASH_BYTES: usize = 32;

/// Where a device worker's buffer of stored checksums lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoredMemory {
    Device,
    Pinned,
}

/// A buffer of stored checksums in device or pinned host memory, two words
/// (value, stamp) per block id, filled with `junk` (freed on drop).
struct StoredBuffer {
    context: Arc<CudaContext>,
    memory: StoredMemory,
    address: u64,
    /// Words in the buffer (two per block id).
    num_words: usize,
}

impl StoredBuffer {
    fn new(memory: StoredMemory, junk: &[u64]) -> StoredBuffer {
        let context = CudaContext::new(0).expect("primary context of device 0");
        context.bind_to_thread().expect("bind");
        let bytes = junk.len() * 8;
        // SAFETY: fresh allocations of `bytes`, filled from `junk`.
        let address = unsafe {
            match memory {
                StoredMemory::Device => {
                    let address = cu::malloc_sync(bytes).expect("cuMemAlloc");
                    cu::memcpy_htod_sync(address, junk).expect("fill");
                    address
                }
                StoredMemory::Pinned => {
                    let host = cu::malloc_host(bytes, 0).expect("cuMemHostAlloc").cast::<u64>();
                    std::ptr::copy_nonoverlapping(junk.as_ptr(), host, junk.len());
                    host as u64
                }
            }
        };
        StoredBuffer {
            context,
            memory,
            address,
            num_words: junk.len(),
        }
    }

    /// The buffer's words, after the device work that wrote them completed.
    fn read(&self) -> Vec<u64> {
        let mut values = vec![0u64; self.num_words];
        self.context.bind_to_thread().expect("bind");
        // SAFETY: the buffer holds `num_words` words; nothing writes it now.
        unsafe {
            match self.memory {
                StoredMemory::Device => cu::memcpy_dtoh_sync(&mut values, self.address).expect("read back"),
                StoredMemory::Pinned => {
                    std::ptr::copy_nonoverlapping(self.address as *const u64, values.as_mut_ptr(), self.num_words)
                }
            }
        }
        values
    }

    /// Copies the stored value and stamp of block `from` to block `to` on
    /// the device (as an offload connector moves them with the block).
    fn copy_on_device(&self, from: u32, to: u32) {
        self.context.bind_to_thread().expect("bind");
        // SAFETY: both lie inside the buffer (unified addressing covers pinned memory).
        unsafe {
            sys::cuMemcpy(self.address + 16 * to as u64, self.address + 16 * from as u64, 16)
                .result()
                .expect("cuMemcpy");
        }
    }
}

impl Drop for StoredBuffer {
    fn drop(&mut self) {
        let _ = self.context.bind_to_thread();
        // SAFETY: allocated in `new`; the workers' work is done.
        unsafe {
            let _ = cu::ctx::synchronize();
            match self.memory {
                StoredMemory::Device => {
                    let _ = cu::free_sync(self.address);
                }
                StoredMemory::Pinned => {
                    let _ = cu::free_host(self.address as *mut std::ffi::c_void);
                }
            }
        }
    }
}

/// One TP rank: a host worker (the reference) and a device worker over the
/// same cache, each with its buffer of stored checksums.
struct StoredRank {
    host: Worker,
    device: Worker,
    placement: Placement,
    copy: DeviceCopy,
    host_stored: Vec<u64>,
    stored: StoredBuffer,
}

impl StoredRank {
    /// Copies the host cache to the device copy (after it was rewritten).
    fn upload(&self) {
        self.copy.context.bind_to_thread().expect("bind");
        for (buffer, &base) in self.placement.buffers().iter().zip(&self.copy.bases) {
            // SAFETY: the copy holds the buffer's length at `base`.
            unsafe { cu::memcpy_htod_sync(base, buffer.bytes()).expect("upload") };
        }
    }
}

fn stored_ranks(rng: &mut Rng, kv: &LogicalKv, tp_size: u32, num_blocks: u32, memory: StoredMemory) -> Vec<StoredRank> {
    (0..tp_size)
        .map(|tp_rank| {
            let placement = Placement::for_shard(
                rng,
                kv,
                &shard(kv, tp_rank, tp_size, 0, 1),
                LayoutKind::Hnd,
                0,
                16,
                num_blocks,
            );
            let mut host = host_worker(tp_rank, tp_size, 0, 2);
            register_host(&mut host, &placement);
            let copy = DeviceCopy::new(&placement);
            let mut device = device_worker(tp_rank, tp_size);
            register_at(&mut device, &placement, &copy.bases).expect("register on the device worker");
            // Junk, so that a value never written cannot pass by chance.
            let junk: Vec<u64> = (0..2 * num_blocks).map(|_| rng.next_u64()).collect();
            let host_stored = junk.clone();
            host.add_region(kvcsum::Region {
                address: host_stored.as_ptr() as u64,
                length: 8 * host_stored.len() as u64,
            })
            .expect("host stored region");
            host.add_stored(0, host_stored.as_ptr() as u64, num_blocks as u64)
                .expect("host add_stored");
            let stored = StoredBuffer::new(memory, &junk);
            device
                .add_stored(0, stored.address, num_blocks as u64)
                .unwrap_or_else(|e| panic!("device add_stored ({memory:?}): {e}"));
            StoredRank {
                host,
                device,
                placement,
                copy,
                host_stored,
                stored,
            }
        })
        .collect()
}

fn stored_blocks(num_tokens: u64, block_ids: &[u32], hashes: &[u8]) -> BlockSet {
    let mut blocks = BlockSet::new();
    blocks.add_request(STORED_REQ, num_tokens).unwrap();
    blocks.add_group(STORED_REQ, 0, 0, block_ids).unwrap();
    blocks.set_hashes(STORED_REQ, 0, hashes, HASH_BYTES).unwrap();
    blocks
}

/// The group fingerprint (SPEC section 7) of the placements' layers,
/// computed naively from `Placement::layer_specs`' identities.
fn naive_fingerprint(placement: &Placement) -> u64 {
    use sha2::{Digest, Sha256};
    placement.host_layer_specs().iter().fold(0u64, |sum, spec| {
        let digest = Sha256::digest(&spec.identity);
        sum.wrapping_add(u64::from_le_bytes(digest[..8].try_into().unwrap()))
    })
}

/// Per rank, a device load check's verdicts (waited for).
fn device_load_check(ranks: &[StoredRank], blocks: &BlockSet) -> Vec<Vec<kvcsum::StoredOutcome>> {
    ranks
        .iter()
        .map(|rank| {
            let result = rank
                .device
                .check_stored(blocks, StreamHandle::legacy_default())
                .expect("check_stored");
            result.wait().expect("wait");
            result.stored_outcomes(STORED_REQ, 0).expect("outcomes")
        })
        .collect()
}

fn failed_at(outcomes: &[Vec<kvcsum::StoredOutcome>]) -> Vec<usize> {
    (0..outcomes[0].len())
        .filter(|&q| outcomes.iter().any(|rank| rank[q] == kvcsum::StoredOutcome::Failed))
        .collect()
}

struct StoredScenario {
    kv: LogicalKv,
    ranks: Vec<StoredRank>,
    block_ids: Vec<u32>,
    hashes: Vec<u8>,
    count: usize,
}

/// Stores a random request's blocks on host and device workers (TP 2),
/// checks the device's values against the host's and the naive reference,
/// then "offloads and loads them back" into fresh block ids: the KV written
/// there and each block's stored value copied on the device.
fn device_stored_and_reloaded(rng: &mut Rng, num_tokens: u64, memory: StoredMemory) -> StoredScenario {
    let kv = LogicalKv::random(rng, KvShape::gqa(3, 4, 64, num_tokens));
    let count = positions_for(num_tokens, 16, 0, 0);
    let num_blocks = 2 * count as u32 + 2;
    let mut ranks = stored_ranks(rng, &kv, 2, num_blocks, memory);
    let mut allocator = BlockAllocator::new(rng, num_blocks);
    let first_ids = allocator.take(count);
    let hashes: Vec<u8> = (0..count * HASH_BYTES).map(|_| rng.next_u64() as u8).collect();
    for rank in &mut ranks {
        rank.placement.write_request(&kv, 0, &first_ids);
        rank.upload();
    }
    let blocks = stored_blocks(num_tokens, &first_ids, &hashes);
    let fingerprint = naive_fingerprint(&ranks[0].placement);
    let expected = naive_full(&kv, 16, 0, count);
    let mut total = vec![0u64; count];
    for rank in &ranks {
        rank.host
            .store(&blocks, StreamHandle::legacy_default())
            .expect("host store");
        let result = rank
            .device
            .store(&blocks, StreamHandle::legacy_default())
            .expect("device store");
        result.wait().expect("wait");
        let device = rank.stored.read();
        assert_eq!(
            device,
            rank.host_stored,
            "{memory:?}: the device stored other values than the host (seed {})",
            rng.seed()
        );
        for (i, &block_id) in first_ids.iter().enumerate() {
            let tag = u64::from_le_bytes(hashes[i * HASH_BYTES..i * HASH_BYTES + 8].try_into().unwrap()) ^ fingerprint;
            total[i] = total[i].wrapping_add(device[2 * block_id as usize] ^ tag);
        }
    }
    assert_eq!(
        total,
        expected,
        "{memory:?}: untagged stored values do not add up to the naive checksums (seed {})",
        rng.seed()
    );
    let block_ids = allocator.take(count);
    for rank in &mut ranks {
        rank.placement.write_request(&kv, 0, &block_ids);
        rank.upload();
        for (&from, &to) in first_ids.iter().zip(&block_ids) {
            rank.stored.copy_on_device(from, to);
        }
    }
    StoredScenario {
        kv,
        ranks,
        block_ids,
        hashes,
        count,
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_stored_round_trip_matches_in_device_and_pinned_memory() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        use kvcsum::verify::{Verdict, Verifier};
        let mut rng = Rng::for_test("device_stored_round_trip_matches_in_device_and_pinned_memory");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        for memory in [StoredMemory::Device, StoredMemory::Pinned] {
            for num_tokens in [16, 75, 300] {
                let s = device_stored_and_reloaded(&mut rng, num_tokens, memory);
                let blocks = stored_blocks(num_tokens, &s.block_ids, &s.hashes);
                let outcomes = device_load_check(&s.ranks, &blocks);
                for rank in &outcomes {
                    assert!(
                        rank.iter().all(|&o| o == kvcsum::StoredOutcome::Matched),
                        "{memory:?} {num_tokens} tokens: {rank:?} (seed {})",
                        rng.seed()
                    );
                }
                // NotReady before the values are, not a read of device memory.
                let busy = s.ranks[0]
                    .device
                    .check_stored(&blocks, StreamHandle::legacy_default())
                    .expect("check_stored");
                match busy.stored_outcomes(STORED_REQ, 0) {
                    Ok(o) => assert!(busy.is_ready().unwrap(), "outcomes {o:?} before ready"),
                    Err(e) => assert!(matches!(e, Error::NotReady(_)), "{e}"),
                }
                busy.wait().unwrap();
                // The device load checks' records pass the verifier.
                let verifier = Verifier::new(2).unwrap();
                verifier.expect(&blocks, Role::Consumer).unwrap();
                for rank in &s.ranks {
                    let result = rank
                        .device
                        .check_stored(&blocks, StreamHandle::legacy_default())
                        .expect("check_stored");
                    result.wait().unwrap();
                    let record = Record::from_checksums(&result).expect("record").encode();
                    verifier.add_record(&record).expect("add_record");
                }
                let report = verifier.check_stored(STORED_REQ).unwrap();
                assert_eq!(report.verdict, Verdict::Match, "{memory:?}: {}", report.message);
                assert_eq!(report.compared_positions, s.count as u64);
                // The load check's values are the plain checksums.
                let mut total = vec![0u64; s.count];
                for rank in &s.ranks {
                    let result = checksum(&rank.device, &blocks, Role::Consumer);
                    add_values(&mut total, &result.position_sums(STORED_REQ, 0).unwrap());
                }
                assert_eq!(total, naive_full(&s.kv, 16, 0, s.count), "seed {}", rng.seed());
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_stored_faults_fail_at_their_position_only() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_stored_faults_fail_at_their_position_only");
        let seed = rng.seed();
        println!("seed {seed} ({NEEDS_GPU})");
        let num_tokens = 120;
        for memory in [StoredMemory::Device, StoredMemory::Pinned] {
            // A corrupted byte in one loaded block.
            let mut s = device_stored_and_reloaded(&mut rng, num_tokens, memory);
            let q = rng.below(s.count as u64) as usize;
            let (layer, head) = (rng.below(3) as u32, s.ranks[1].placement.spec().first_head);
            s.ranks[1].placement.xor_byte(layer, head, s.block_ids[q], 0, 5, 0x20);
            s.ranks[1].upload();
            let blocks = stored_blocks(num_tokens, &s.block_ids, &s.hashes);
            assert_eq!(
                failed_at(&device_load_check(&s.ranks, &blocks)),
                vec![q],
                "{memory:?}: corrupted byte (seed {seed})"
            );

            // Two blocks' KV loaded into each other's slots.
            let mut s = device_stored_and_reloaded(&mut rng, num_tokens, memory);
            let (a, b) = (1, 4);
            let mut swapped = s.block_ids.clone();
            swapped.swap(a, b);
            for rank in &mut s.ranks {
                rank.placement.write_request(&s.kv, 0, &swapped);
                rank.upload();
            }
            let blocks = stored_blocks(num_tokens, &s.block_ids, &s.hashes);
            assert_eq!(
                failed_at(&device_load_check(&s.ranks, &blocks)),
                vec![a, b],
                "{memory:?}: swapped blocks (seed {seed})"
            );

            // Another shard's KV: rank 1's cache bytes in rank 0's cache.
            let mut s = device_stored_and_reloaded(&mut rng, num_tokens, memory);
            let other: Vec<Vec<u8>> = s.ranks[1]
                .placement
                .buffers()
                .iter()
                .map(|b| b.bytes().to_vec())
                .collect();
            for (buffer, bytes) in s.ranks[0].placement.buffers_mut().iter_mut().zip(&other) {
                buffer.bytes_mut().copy_from_slice(bytes);
            }
            s.ranks[0].upload();
            let blocks = stored_blocks(num_tokens, &s.block_ids, &s.hashes);
            let outcomes = device_load_check(&s.ranks, &blocks);
            assert!(
                outcomes[0].iter().all(|&o| o == kvcsum::StoredOutcome::Failed),
                "{memory:?}: another shard fails everywhere on rank 0: {:?} (seed {seed})",
                outcomes[0]
            );
            assert!(
                outcomes[1].iter().all(|&o| o == kvcsum::StoredOutcome::Matched),
                "seed {seed}"
            );

            // A wrong block hash for one position.
            let s = device_stored_and_reloaded(&mut rng, num_tokens, memory);
            let q = rng.below(s.count as u64) as usize;
            let mut hashes = s.hashes.clone();
            hashes[q * HASH_BYTES + rng.below(8) as usize] ^= 0x01;
            let blocks = stored_blocks(num_tokens, &s.block_ids, &hashes);
            assert_eq!(
                failed_at(&device_load_check(&s.ranks, &blocks)),
                vec![q],
                "{memory:?}: wrong hash (seed {seed})"
            );
        }
    });
}

/// A store queued behind busy work on the caller's stream writes after the
/// KV it checksums was written there, without the library waiting: the
/// buffer read after a stream sync holds the values of the new KV.
#[test]
#[ignore = "needs a CUDA device"]
fn device_stored_write_runs_after_work_queued_on_the_stream() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_stored_write_runs_after_work_queued_on_the_stream");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let num_tokens = 200;
        let kv = LogicalKv::random(&mut rng, KvShape::gqa(4, 2, 128, num_tokens));
        let count = positions_for(num_tokens, 16, 0, 0);
        let mut ranks = stored_ranks(&mut rng, &kv, 1, count as u32 + 3, StoredMemory::Device);
        let rank = &mut ranks[0];
        let block_ids = BlockAllocator::new(&mut rng, count as u32 + 3).take(count);
        rank.placement.write_request(&kv, 0, &block_ids);
        let hashes: Vec<u8> = (0..count * HASH_BYTES).map(|_| rng.next_u64() as u8).collect();
        let blocks = stored_blocks(num_tokens, &block_ids, &hashes);
        rank.host
            .store(&blocks, StreamHandle::legacy_default())
            .expect("host store");

        // The true KV is written on the stream behind a long kernel.
        let contents: Vec<&[u8]> = rank.placement.buffers().iter().map(|b| b.bytes()).collect();
        let writer = LateWriter::new(&rank.copy.context, &rank.copy.bases, &contents);
        writer.stale(&mut rng);
        let before = rank.stored.read();
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).expect("stream");
        writer.queue(stream);
        let result = rank.device.store(&blocks, StreamHandle(stream.cast())).expect("store");
        assert!(
            !result.is_ready().expect("query"),
            "the store returned after the stream's work: the library waited"
        );
        assert_eq!(
            rank.stored.read(),
            before,
            "the store wrote before the stream got to it"
        );
        // SAFETY: our stream.
        unsafe { cu::stream::synchronize(stream).expect("sync") };
        assert!(result.is_ready().unwrap());
        assert_eq!(
            rank.stored.read(),
            rank.host_stored,
            "the stored values are not those of the KV written on the stream (seed {})",
            rng.seed()
        );
        drop(result);
        drop(writer);
        // SAFETY: nothing is queued any more; ours.
        unsafe {
            let _ = cu::stream::destroy(stream);
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_stored_rejects_bad_buffers() {
    let mut rng = Rng::for_test("device_stored_rejects_bad_buffers");
    println!("seed {} ({NEEDS_GPU})", rng.seed());
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 64, 64));
    let mut ranks = stored_ranks(&mut rng, &kv, 1, 8, StoredMemory::Device);
    let rank = &mut ranks[0];
    // Host pageable memory is not memory the device can write.
    let pageable = [0u64; 8];
    let error = rank
        .device
        .add_stored(0, pageable.as_ptr() as u64, 8)
        .expect_err("pageable memory");
    assert!(
        matches!(error, Error::InvalidArgument(_)) && error.to_string().contains("address"),
        "{error:?}"
    );
    assert!(error.to_string().contains("stored checksums of group_id 0"), "{error}");
    // Misaligned.
    let error = rank
        .device
        .add_stored(0, rank.stored.address + 4, 4)
        .expect_err("misaligned");
    assert!(
        matches!(error, Error::Unsupported(_)) && error.to_string().contains("multiple of 8"),
        "{error:?}"
    );
    // Too small: 8 blocks allocated, 1 << 40 claimed.
    let error = rank
        .device
        .add_stored(0, rank.stored.address, 1 << 40)
        .expect_err("too small");
    assert!(matches!(error, Error::OutOfBounds(_)), "{error:?}");
    // Nothing of those replaced the registered buffer: a block id past its 8
    // values fails before anything is queued, and a store into it works.
    rank.placement.write_request(&kv, 0, &[0, 1, 2, 3]);
    rank.upload();
    let hashes: Vec<u8> = (0..4 * HASH_BYTES).map(|_| rng.next_u64() as u8).collect();
    let error = rank
        .device
        .store(
            &stored_blocks(64, &[0, 1, 2, 8], &hashes),
            StreamHandle::legacy_default(),
        )
        .err()
        .expect("block id past the buffer");
    assert!(matches!(error, Error::OutOfBounds(_)), "{error:?}");
    let blocks = stored_blocks(64, &[0, 1, 2, 3], &hashes);
    rank.device
        .store(&blocks, StreamHandle::legacy_default())
        .expect("store")
        .wait()
        .unwrap();
    rank.host.store(&blocks, StreamHandle::legacy_default()).unwrap();
    assert_eq!(rank.stored.read(), rank.host_stored, "seed {}", rng.seed());
}

// ---- state groups on the device

use support::state::*;

/// Byte buffers copied to device memory, each keeping its host address
/// modulo 16 (`host_addresses`), so that tensors placed 2, 4 or 8 bytes off
/// a 16-byte boundary stay so.
fn device_copy_of(buffers: &[&[u8]], host_addresses: &[u64]) -> DeviceCopy {
    let context = CudaContext::new(0).expect("primary context of device 0");
    context.bind_to_thread().expect("bind");
    let bases = buffers
        .iter()
        .zip(host_addresses)
        .map(|(bytes, &host)| {
            // SAFETY: a fresh allocation, filled from a host buffer of the same length.
            unsafe {
                let base = cu::malloc_sync(bytes.len() + 16).expect("cuMemAlloc") + host % 16;
                cu::memcpy_htod_sync(base, bytes).expect("copy to device");
                base
            }
        })
        .collect();
    DeviceCopy { context, bases }
}

/// One rank's state caches on a host worker and, copied to the device, on
/// a device worker; group `group_id` holds them.
struct StatePair {
    host: Worker,
    device: Worker,
    copy: DeviceCopy,
}

impl StatePair {
    fn new(caches: &RankCaches, tp_rank: u32, tp_size: u32, group_id: u32) -> StatePair {
        let mut host = host_worker(tp_rank, tp_size, 0, 2);
        register(&mut host, caches, group_id);
        let copy = device_copy_of(&caches.byte_buffers(), &caches.host_bases());
        let mut device = device_worker(tp_rank, tp_size);
        register_state_at(&mut device, caches, group_id, &copy.bases).expect("register state on the device");
        StatePair { host, device, copy }
    }

    /// Both workers' value of `req_id`'s state, asserted equal.
    fn value(&self, blocks: &BlockSet, req_id: &str, group_id: u32, role: Role, what: &str) -> u64 {
        let host = rank_value(&self.host, blocks, req_id, group_id, role);
        let device = rank_value(&self.device, blocks, req_id, group_id, role);
        assert_eq!(device, host, "{what}: device and host state values differ");
        host
    }
}

/// Layers of two tensors each, of random element sizes, from narrow rows
/// (a few elements, like conv state) to wide ones (thousands of elements,
/// like ssm state), rows divisible by 4 (TP 1, 2, 4).
fn mixed_state(rng: &mut Rng, layer_numbers: &[u32]) -> LogicalState {
    LogicalState {
        layers: layer_numbers
            .iter()
            .map(|&layer| {
                let tensors = (0..2)
                    .map(|_| {
                        let element_size = [2, 4][rng.below(2) as usize];
                        let elements = match rng.below(3) {
                            0 => rng.range(1..8),
                            1 => rng.range(8..300),
                            _ => rng.range(300..5000),
                        } as usize;
                        let rows = 4 * rng.range(1..9) as usize;
                        random_tensor(rng, element_size, rows, elements)
                    })
                    .collect();
                (layer, tensors)
            })
            .collect(),
    }
}

/// A Mamba2-like layer at TP 1: conv state of 2-byte elements (rows of 3)
/// and an ssm state of 4-byte elements, 1 MiB per request.
fn mamba2_layer(rng: &mut Rng, layer: u32) -> (u32, Vec<LogicalTensor>) {
    (
        layer,
        vec![random_tensor(rng, 2, 1024, 3), random_tensor(rng, 4, 64, 4096)],
    )
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_state_equals_host_and_reference() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_state_equals_host_and_reference");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let seed = rng.seed();
        for round in 0..6 {
            let mut state = match round {
                0 => random_state(&mut rng, &[2, 5, 9]),
                _ => mixed_state(&mut rng, &[1, 4, 6, 30]),
            };
            if round == 1 {
                state.layers.push(mamba2_layer(&mut rng, 40));
            }
            for split_known in [true, false] {
                let block_id = rng.below(5) as u32;
                let num_blocks = block_id + 1 + rng.below(3) as u32;
                let caches = place_rank(&mut rng, &state, 0, 1, 3, split_known, num_blocks, block_id);
                let pair = StatePair::new(&caches, 0, 1, 3);
                let expected = if split_known {
                    naive_unsplit(&state)
                } else {
                    naive_shard(&state, 0, 1)
                };
                // num_tokens does not limit a state group: 0 tokens still checksum.
                let blocks = state_blocks("r", rng.below(3) * 40, 3, block_id);
                for role in [Role::Producer, Role::Consumer] {
                    let what = format!("round {round}, split_known {split_known}, {role:?} (seed {seed})");
                    assert_eq!(
                        pair.value(&blocks, "r", 3, role, &what),
                        expected,
                        "{what}: not the naive reference"
                    );
                }
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_state_ranks_of_a_known_split_sum_to_the_unsplit_checksum() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_state_ranks_of_a_known_split_sum_to_the_unsplit_checksum");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let seed = rng.seed();
        for round in 0..3 {
            let state = mixed_state(&mut rng, &[0, 3, 8]);
            let expected = naive_unsplit(&state);
            for tp_size in [1, 2, 4] {
                let block_id = rng.below(4) as u32;
                let blocks = state_blocks("r", 7, 3, block_id);
                let mut total = 0u64;
                for tp_rank in 0..tp_size {
                    let caches = place_rank(&mut rng, &state, tp_rank, tp_size, 3, true, block_id + 2, block_id);
                    let pair = StatePair::new(&caches, tp_rank, tp_size, 3);
                    let what = format!("round {round}, TP {tp_rank}/{tp_size} (seed {seed})");
                    total = total.wrapping_add(pair.value(&blocks, "r", 3, Role::Consumer, &what));
                }
                assert_eq!(
                    total, expected,
                    "round {round}, TP {tp_size}: device ranks sum to the unsplit checksum (seed {seed})"
                );
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_shard_keyed_state_equals_the_host() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_shard_keyed_state_equals_the_host");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let seed = rng.seed();
        let state = mixed_state(&mut rng, &[2, 7, 11]);
        for tp_size in [1, 2, 4] {
            let blocks = state_blocks("r", 5, 3, 1);
            for tp_rank in 0..tp_size {
                let caches = place_rank(&mut rng, &state, tp_rank, tp_size, 3, false, 3, 1);
                let pair = StatePair::new(&caches, tp_rank, tp_size, 3);
                let what = format!("TP {tp_rank}/{tp_size} shard-keyed (seed {seed})");
                assert_eq!(
                    pair.value(&blocks, "r", 3, Role::Producer, &what),
                    naive_shard(&state, tp_rank, tp_size),
                    "{what}: not the naive reference"
                );
            }
        }
    });
}

/// A hybrid model on one TP rank: two attention groups (0 and 1) and a
/// state group (3), each request with its own state. Calls of every mix
/// (state rows inline or staged, attention rows of one group or two, or
/// none) give the host's values, the state values the naive reference's,
/// and in detail mode the host's records.
#[test]
#[ignore = "needs a CUDA device"]
fn device_hybrid_model_checksums_attention_and_state_in_one_call() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_hybrid_model_checksums_attention_and_state_in_one_call");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let seed = rng.seed();
        let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 64, 45));
        let kv2 = LogicalKv::random(
            &mut rng,
            KvShape {
                first_layer: 10,
                ..KvShape::gqa(2, 2, 64, 45)
            },
        );
        let shard = shard(&kv, 0, 1, 0, 1);
        let shard2 = support::shard(&kv2, 0, 1, 0, 1);
        let mut first = Placement::for_shard(&mut rng, &kv, &shard, LayoutKind::Nhd, 0, 16, 160);
        let mut second = Placement::for_shard(&mut rng, &kv2, &shard2, LayoutKind::Hnd, 1, 32, 90);
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
        // Layers 20.. are state layers; request r's state sits in slot ids[r].
        let shape = mixed_state(&mut rng, &[20, 21, 22]);
        let states: Vec<LogicalState> = (0..requests.len()).map(|_| random_like(&mut rng, &shape)).collect();
        let state_ids = BlockAllocator::new(&mut rng, 50).take(requests.len());
        let placed: Vec<(&LogicalState, u32)> = states.iter().zip(state_ids.iter().copied()).collect();
        let caches = place_requests(&mut rng, &placed, 0, 1, 3, true, 50);
        let mut pair = Pair::new(0, 1, &[&first, &second]);
        register(&mut pair.host, &caches, 3);
        let copy = device_copy_of(&caches.byte_buffers(), &caches.host_bases());
        register_state_at(&mut pair.device, &caches, 3, &copy.bases).expect("register state on the device");
        let with_groups = |groups: &[u32], count: usize| -> Vec<TestRequest> {
            requests[..count]
                .iter()
                .zip(&state_ids)
                .map(|(request, &state_id)| {
                    let mut request = request.clone();
                    request.tables.retain(|t| groups.contains(&t.group_id));
                    if groups.contains(&3) {
                        request.tables.push(GroupTable {
                            group_id: 3,
                            first_position: 0,
                            block_ids: vec![state_id],
                        });
                    }
                    request
                })
                .collect()
        };
        let cases: [(&[u32], usize, &str); 6] = [
            (&[0, 1, 3], 1, "one request, every group (all inline)"),
            (&[0, 1, 3], 40, "two attention groups and staged state rows"),
            (&[0, 3], 40, "one attention group and staged state rows"),
            (&[0, 3], 5, "one attention group and inline state rows"),
            (&[3], 40, "state rows only, staged"),
            (&[3], 3, "state rows only, inline"),
        ];
        for detail in [false, true] {
            pair.host.set_detail(detail).expect("host detail");
            pair.device.set_detail(detail).expect("device detail");
            for (groups, count, what) in cases {
                let what = format!("{what}, detail {detail} (seed {seed})");
                let subset = with_groups(groups, count);
                let blocks = block_set(&subset);
                let values = pair.compare(&blocks, Role::Consumer, &what);
                for (request, state) in subset.iter().zip(&states) {
                    let key = ReplicaKey {
                        replicas: 1,
                        replica_index: 0,
                    };
                    assert_eq!(
                        values[&(request.req_id.clone(), 3)][&key],
                        vec![naive_unsplit(state)],
                        "{what}, {}: state value",
                        request.req_id
                    );
                    if groups.contains(&1) {
                        let t = request.table(1);
                        assert_eq!(
                            values[&(request.req_id.clone(), 1)][&shard2.replica],
                            naive_full(&kv2, 32, t.first_position, t.block_ids.len()),
                            "{what}, {}: group 1",
                            request.req_id
                        );
                    }
                }
                if detail {
                    let host = Record::from_checksums(&checksum(&pair.host, &blocks, Role::Producer)).expect("record");
                    let device =
                        Record::from_checksums(&checksum(&pair.device, &blocks, Role::Producer)).expect("record");
                    assert_eq!(device, host, "{what}: detail records differ");
                }
            }
        }
        drop(pair);
        drop(copy);
    });
}

/// A bad state layer is refused by a device worker as by the host (tensor
/// outside every region, unaligned), and nothing changes.
#[test]
#[ignore = "needs a CUDA device"]
fn device_rejects_bad_state_layers_like_the_host() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_rejects_bad_state_layers_like_the_host");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let state = random_state(&mut rng, &[2]);
        let caches = place_rank(&mut rng, &state, 0, 1, 3, true, 2, 0);
        let mut pair = StatePair::new(&caches, 0, 1, 3);
        let blocks = state_blocks("r", 1, 3, 0);
        let before = pair.value(&blocks, "r", 3, Role::Producer, "before");
        let device_spec = caches.specs_at(&pair.copy.bases).remove(0);
        let host_spec = caches.specs[0].clone();
        type Change = fn(&mut kvcsum::StateSpec);
        let changes: [(Change, &str); 3] = [
            (|s| s.num_blocks = 1000, "no registered region"),
            (|s| s.tensors[1].address += 2, "not a multiple of element_size"),
            (|s| s.tensors[0].element_size = 3, "element_size is 3"),
        ];
        for (change, names) in changes {
            let (mut on_host, mut on_device) = (host_spec.clone(), device_spec.clone());
            for spec in [&mut on_host, &mut on_device] {
                spec.layer_number = 30;
                change(spec);
            }
            let host = pair.host.add_state(on_host).expect_err("host rejects");
            let device = pair.device.add_state(on_device).expect_err("device rejects");
            assert_eq!(
                std::mem::discriminant(&device),
                std::mem::discriminant(&host),
                "{names}: {device:?} vs {host:?}"
            );
            assert!(device.to_string().contains(names), "{device}");
        }
        assert_eq!(
            pair.value(&blocks, "r", 3, Role::Producer, "after"),
            before,
            "nothing changed"
        );
    });
}

/// The stream rule for state: the state kernel runs after the state written
/// on the caller's stream behind a long kernel, on the legacy and
/// per-thread default streams and an explicit one, with no host sync.
#[test]
#[ignore = "needs a CUDA device"]
fn device_state_orders_after_work_queued_on_the_callers_stream() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_state_orders_after_work_queued_on_the_callers_stream");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let mut state = mixed_state(&mut rng, &[1, 2]);
        state.layers.push(mamba2_layer(&mut rng, 3));
        let caches = place_rank(&mut rng, &state, 0, 1, 3, true, 4, 2);
        let pair = StatePair::new(&caches, 0, 1, 3);
        let blocks = state_blocks("r", 1, 3, 2);
        let expected = pair.value(&blocks, "r", 3, Role::Consumer, "reference call");
        assert_eq!(expected, naive_unsplit(&state), "seed {}", rng.seed());

        // The true state is written back on each case's stream, late.
        let writer = LateWriter::new(&pair.copy.context, &pair.copy.bases, &caches.byte_buffers());
        let explicit = cu::stream::create(cu::stream::StreamKind::NonBlocking).expect("stream");
        for (name, stream) in stream_cases(explicit) {
            writer.stale(&mut rng);
            writer.queue(stream);
            let result = pair
                .device
                .checksum(&blocks, Role::Consumer, StreamHandle(stream.cast()))
                .expect("checksum");
            assert!(
                !result.is_ready().expect("query"),
                "{name}: the result was ready while the stream was still busy"
            );
            result.wait().expect("wait");
            let (_, values) = result.column("r", 3, 0).expect("column");
            assert_eq!(
                values,
                &[expected],
                "{name}: the state checksum did not see the state written on the caller's stream (seed {})",
                rng.seed()
            );
            // SAFETY: the stream's work is done once synchronised.
            unsafe { cu::stream::synchronize(stream).expect("sync") };
        }
        drop(writer);
        // SAFETY: nothing is queued any more; ours.
        unsafe {
            let _ = cu::stream::destroy(explicit);
        }
    });
}

/// A large state (Mamba2-like layers of 4 MiB of ssm state each, and conv
/// state of 6-byte rows) gives the host's value; prints the rate at which
/// the device reads it, beside a device-to-device copy of as many bytes.
#[test]
#[ignore = "needs a CUDA device"]
fn device_state_reads_a_large_state_at_a_memory_rate() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_state_reads_a_large_state_at_a_memory_rate");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let state = LogicalState {
            layers: (0..8)
                .map(|layer| {
                    (
                        layer,
                        vec![
                            random_tensor(&mut rng, 2, 2048, 3),
                            random_tensor(&mut rng, 4, 256, 4096),
                        ],
                    )
                })
                .collect(),
        };
        let caches = place_rank(&mut rng, &state, 0, 1, 3, true, 2, 1);
        let pair = StatePair::new(&caches, 0, 1, 3);
        let blocks = state_blocks("r", 1, 3, 1);
        let expected = pair.value(&blocks, "r", 3, Role::Consumer, "large state");
        assert_eq!(expected, naive_unsplit(&state), "seed {}", rng.seed());
        let bytes: u64 = caches
            .specs
            .iter()
            .flat_map(|spec| &spec.tensors)
            .map(|t| t.num_rows as u64 * t.bytes_per_row as u64)
            .sum();
        let rounds = 10;
        let start = std::time::Instant::now();
        let results: Vec<_> = (0..rounds)
            .map(|_| {
                pair.device
                    .checksum(&blocks, Role::Consumer, StreamHandle::legacy_default())
                    .expect("checksum")
            })
            .collect();
        for result in &results {
            result.wait().expect("wait");
            assert_eq!(result.column("r", 3, 0).expect("column").1, &[expected]);
        }
        let seconds = start.elapsed().as_secs_f64() / rounds as f64;
        // A device-to-device copy of the ssm buffer of layer 0, as often.
        let len = caches.buffers[1].len() * 8;
        let context = pair.copy.context.clone();
        context.bind_to_thread().expect("bind");
        // SAFETY: a fresh allocation of `len` bytes, freed below after a sync.
        let copy_seconds = unsafe {
            let target = cu::malloc_sync(len).expect("cuMemAlloc");
            let start = std::time::Instant::now();
            for _ in 0..rounds {
                sys::cuMemcpyDtoDAsync_v2(target, pair.copy.bases[1], len, std::ptr::null_mut())
                    .result()
                    .expect("copy");
            }
            sys::cuStreamSynchronize(std::ptr::null_mut()).result().expect("sync");
            let seconds = start.elapsed().as_secs_f64() / rounds as f64;
            cu::free_sync(target).expect("free");
            seconds
        };
        println!(
            "state of {:.1} MiB: {:.1} us per call, {:.0} GB/s read; a device copy of {:.1} MiB reads {:.0} GB/s",
            bytes as f64 / (1 << 20) as f64,
            seconds * 1e6,
            bytes as f64 / seconds / 1e9,
            len as f64 / (1 << 20) as f64,
            len as f64 / copy_seconds / 1e9
        );
    });
}

/// The fault catalogue (docs/SPEC.md section 13, `tests/fault_catalogue.rs`)
/// in device memory: each class injected into fresh random KV on the host,
/// copied to the device, one fault per block of a 512-block cache; device
/// workers of both algorithms checksum it before and after, and must equal
/// host workers over the host copy. MIXED must miss nothing, WEIGHTED
/// exactly what SPEC section 13 states. `KVCS_CATALOGUE_ENGINE_TRIALS`
/// faults per class (default 4096). Prints the table.
#[test]
#[ignore = "needs a CUDA device"]
fn device_fault_catalogue() {
    use support::faults::*;
    let mut rng = Rng::for_test("device_fault_catalogue");
    let seed = rng.seed();
    println!("seed {seed} ({NEEDS_GPU})");
    let trials = env_count("KVCS_CATALOGUE_ENGINE_TRIALS", 4096);
    let num_blocks = 512;
    let bytes = num_blocks * BLOCK_BYTES;
    let mut host = vec![0u64; bytes / 8];
    let host_address = host.as_ptr() as u64;
    let context = CudaContext::new(0).expect("primary context of device 0");
    context.bind_to_thread().expect("bind");
    // SAFETY: a fresh allocation of `bytes`, freed at the end of the test.
    let device = unsafe { cu::malloc_sync(bytes).expect("cuMemAlloc") };
    let device_workers: Vec<Worker> = ALGORITHMS
        .iter()
        .map(|&a| catalogue_worker(Some(0), a, device, num_blocks))
        .collect();
    let host_workers: Vec<Worker> = ALGORITHMS
        .iter()
        .map(|&a| catalogue_worker(None, a, host_address, num_blocks))
        .collect();
    let blocks = catalogue_blocks(num_blocks);
    let values = |worker: &Worker| -> Vec<u64> {
        checksum(worker, &blocks, Role::Producer)
            .column("catalogue", 0, 0)
            .unwrap()
            .1
            .to_vec()
    };
    // SAFETY (both closures): the u64 cache viewed as bytes; the device
    // buffer holds `bytes` bytes.
    let as_bytes =
        |host: &mut Vec<u64>| unsafe { std::slice::from_raw_parts_mut(host.as_mut_ptr().cast::<u8>(), bytes) };
    let upload = |host: &[u64]| unsafe { cu::memcpy_htod_sync(device, host).expect("copy to device") };
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
    println!("| kind | fault class | trials | WEIGHTED detected | WEIGHTED missed | MIXED detected | MIXED missed |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    let mut failures = Vec::new();
    for class in catalogue() {
        let mut tallies = [Tally::default(); 2];
        while tallies[0].trials < trials {
            fill_kv(&mut rng, as_bytes(&mut host));
            for block in as_bytes(&mut host).chunks_exact_mut(BLOCK_BYTES) {
                (class.prepare)(&mut rng, block);
            }
            let clean_bytes = as_bytes(&mut host).to_vec();
            let clean = both(&host, class.name);
            let mut changed = Vec::with_capacity(num_blocks);
            for (b, block) in as_bytes(&mut host).chunks_exact_mut(BLOCK_BYTES).enumerate() {
                let other = (b + 1 + rng.below(num_blocks as u64 - 1) as usize) % num_blocks;
                changed.push((class.inject)(
                    &mut rng,
                    block,
                    &clean_bytes[other * BLOCK_BYTES..(other + 1) * BLOCK_BYTES],
                ));
            }
            let faulty = both(&host, class.name);
            for (i, &algorithm) in ALGORITHMS.iter().enumerate() {
                for b in 0..num_blocks {
                    let expected = expected_miss(&class, algorithm, changed[b]);
                    tallies[i].add(faulty[i][b] == clean[i][b], expected);
                }
            }
        }
        let [weighted, mixed] = tallies;
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            if class.hardware { "hardware" } else { "software" },
            class.name,
            weighted.trials,
            weighted.trials - weighted.missed,
            weighted.missed,
            mixed.trials - mixed.missed,
            mixed.missed
        );
        if mixed.missed > 0 || weighted.unexpected > 0 {
            failures.push(format!(
                "\"{}\": MIXED missed {}, WEIGHTED broke SPEC section 13 {} times",
                class.name, mixed.missed, weighted.unexpected
            ));
        }
    }
    drop(device_workers);
    // SAFETY: allocated above; no worker reads it any more.
    unsafe { cu::free_sync(device).expect("cuMemFree") };
    assert!(failures.is_empty(), "seed {seed}: {failures:#?}");
}
