//! State (Mamba) groups on the device (SPEC section 6).

use cudarc::driver::{result as cu, sys, CudaContext};
use kvcsum::record::Record;
use kvcsum::{BlockSet, ReplicaKey, Role, StreamHandle, Worker};

use super::common::*;
use super::streams::*;
use crate::support::*;

use crate::support::state::*;

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
        let shard2 = crate::support::shard(&kv2, 0, 1, 0, 1);
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
        let seed = rng.seed();
        checksum_behind_late_writes(writer, &mut rng, &pair.device, &blocks, |name, result| {
            let (_, values) = result.column("r", 3, 0).expect("column");
            assert_eq!(
                values,
                &[expected],
                "{name}: the state checksum did not see the state written on the caller's stream (seed {seed})"
            );
        });
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

/// A tier store of a state group's block on the device (one row, queued
/// as one launch) keeps the naive state checksum, as the host's does, and
/// a check of it matches.
#[test]
#[ignore = "needs a CUDA device"]
fn device_tier_store_of_a_state_block_keeps_the_naive_value() {
    use kvcsum::{TierBlock, TierIndex, TierOutcome};
    let mut rng = Rng::for_test("device_tier_store_of_a_state_block_keeps_the_naive_value");
    println!("seed {} ({NEEDS_GPU})", rng.seed());
    let seed = rng.seed();
    let state = mixed_state(&mut rng, &[1, 4, 6]);
    let block_id = rng.below(5) as u32;
    let caches = place_rank(&mut rng, &state, 0, 1, 3, true, block_id + 2, block_id);
    let pair = StatePair::new(&caches, 0, 1, 3);
    let hash = [9u8; 32];
    let block = [TierBlock {
        group_id: 3,
        position: 0,
        block_id,
        hash: Some(&hash[..]),
    }];
    for (worker, what) in [(&pair.host, "host"), (&pair.device, "device")] {
        let mut index = TierIndex::new(4).unwrap();
        index.store(worker, &block, StreamHandle::legacy_default()).unwrap();
        let outcomes = index.check(worker, &block, StreamHandle::legacy_default()).unwrap();
        assert_eq!(outcomes, vec![TierOutcome::Matched], "{what} (seed {seed})");
        assert_eq!(
            index.values(3, &hash).unwrap(),
            Some((0, vec![naive_unsplit(&state)])),
            "{what} (seed {seed})"
        );
    }
    let _ = &pair.copy;
}
