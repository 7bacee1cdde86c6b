//! Host time of a checksum call, without a GPU: `Plan::new` (checking and
//! laying out the blocks) and the host work of `Worker::checksum` besides the
//! engine's (the plan, then the result built and dropped), on gpu_bench's
//! Llama case.
//!
//! Run: `cargo run --release --example plan_bench -- [--reps N]` (default 9
//! repetitions of 2001 timed calls per case).
//!
//! The layout: a host worker with 32 layers, 8 KV heads, head size 128,
//! bf16, 16-token blocks in HND (`[num_blocks, 2, heads, 16, head_size]` per
//! layer), one group. Its region is address space reserved without access
//! (`PROT_NONE`): mapped, as a host worker's regions must be, but no call
//! here reads cache memory, so none may be made that does. The cases, as gpu_bench's: 1 request of 1 block, and 128 requests
//! of 16 distinct random blocks each.
//!
//! Times include dropping what the call made (a call drops its plan; the
//! result is dropped when the caller frees it).
//!
//! Prints per case the median over repetitions of each repetition's median
//! call time, and the lowest and highest of those medians.

use std::hint::black_box;
use std::time::Instant;

use kvcsum::{BlockSet, LayerSpec, Plan, Region, ReplicaKey, Role, Segment, Worker, WorkerOptions};

const LAYERS: u32 = 32;
const KV_HEADS: u32 = 8;
/// Head size 128 in bf16.
const HEAD_BYTES: u64 = 128 * 2;
const BLOCK_SIZE: u32 = 16;
/// K or V of one block of one layer.
const HALF_BLOCK_BYTES: u64 = BLOCK_SIZE as u64 * KV_HEADS as u64 * HEAD_BYTES;
/// Blocks per layer; more than the largest case reads, so ids are scattered.
const NUM_BLOCKS: u32 = 4096;
/// Bytes of stored checksums, just below the cache.
const STORED_BYTES: u64 = 16 * NUM_BLOCKS as u64;
/// Calls timed per repetition.
const CALLS: usize = 2001;

fn worker() -> Worker {
    let mut worker = Worker::new(WorkerOptions {
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        device: None,
        num_threads: 1,
    })
    .expect("host worker");
    let layer_bytes = 2 * HALF_BLOCK_BYTES * NUM_BLOCKS as u64;
    let cache_address = reserve(STORED_BYTES + layer_bytes * LAYERS as u64) + STORED_BYTES;
    worker
        .add_region(Region {
            address: cache_address,
            length: layer_bytes * LAYERS as u64,
        })
        .unwrap();
    worker.add_group(0, BLOCK_SIZE).unwrap();
    for layer in 0..LAYERS {
        let base = cache_address + layer as u64 * layer_bytes;
        let segments = [base, base + HALF_BLOCK_BYTES]
            .into_iter()
            .map(|address| Segment {
                address,
                block_stride: (2 * HALF_BLOCK_BYTES) as i64,
                kernel_block_stride: 0,
                head_stride: (BLOCK_SIZE as u64 * HEAD_BYTES) as i64,
                token_stride: HEAD_BYTES as i64,
                bytes_per_token: HEAD_BYTES as u32,
            })
            .collect();
        worker
            .add_layer(LayerSpec {
                group_id: 0,
                layer_number: layer,
                first_head: 0,
                num_heads: KV_HEADS,
                replica: ReplicaKey {
                    replicas: 1,
                    replica_index: 0,
                },
                num_blocks: NUM_BLOCKS,
                kernel_blocks: 1,
                tokens_per_kernel_block: BLOCK_SIZE,
                segments,
                identity: format!("layer.{layer}").into_bytes(),
            })
            .unwrap();
    }
    // A buffer of stored checksums that nothing reads here, 16 bytes per
    // block id just below the cache, in a region of its own.
    worker
        .add_region(Region {
            address: cache_address - STORED_BYTES,
            length: STORED_BYTES,
        })
        .unwrap();
    worker
        .add_stored(0, cache_address - STORED_BYTES, NUM_BLOCKS as u64)
        .unwrap();
    worker
}

/// `length` bytes of address space, mapped without access and never
/// unmapped (the process ends first): reading them would crash.
fn reserve(length: u64) -> u64 {
    // SAFETY: a fresh anonymous mapping that nothing else refers to.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            length as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(address, libc::MAP_FAILED, "reserving {length} bytes");
    address as u64
}

/// `requests` requests of `blocks_per_request` distinct random block ids.
fn blocks(requests: usize, blocks_per_request: usize, seed: u64) -> BlockSet {
    let mut state = seed | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut ids: Vec<u32> = (0..NUM_BLOCKS).collect();
    for i in 0..requests * blocks_per_request {
        let j = i + (next() % (ids.len() - i) as u64) as usize;
        ids.swap(i, j);
    }
    let mut set = BlockSet::new();
    for r in 0..requests {
        let req = format!("req-{r}");
        set.add_request(&req, (blocks_per_request * BLOCK_SIZE as usize) as u64)
            .unwrap();
        set.add_group(&req, 0, 0, &ids[r * blocks_per_request..(r + 1) * blocks_per_request])
            .unwrap();
        let hashes: Vec<u8> = (0..blocks_per_request * 32).map(|i| (i * 131 + r * 7) as u8).collect();
        set.set_hashes(&req, 0, &hashes, 32).unwrap();
    }
    set
}

/// The median of `CALLS` timings of `call`, in microseconds.
fn median_call(mut call: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..CALLS)
        .map(|_| {
            let start = Instant::now();
            call();
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[CALLS / 2]
}

fn summary(mut medians: Vec<f64>) -> String {
    medians.sort_by(f64::total_cmp);
    format!(
        "{:.2} us ({:.2} .. {:.2})",
        medians[medians.len() / 2],
        medians[0],
        medians[medians.len() - 1]
    )
}

fn main() {
    let mut reps = 9;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--reps" => reps = args.next().and_then(|n| n.parse().ok()).expect("--reps N"),
            _ => panic!("unknown argument {arg:?} (options: --reps N)"),
        }
    }
    let worker = worker();
    println!("| case | Plan::new | checksum host work without the engine |");
    println!("|---|---|---|");
    for (name, requests, per_request) in [("1 block x 32 layers", 1, 1), ("128 requests x 16 blocks", 128, 16)] {
        let set = blocks(requests, per_request, 0x5eed);
        // Warm up (and check the case is accepted).
        for _ in 0..100 {
            worker.checksum_host_overhead(&set, Role::Consumer).unwrap();
        }
        let mut plan_medians = Vec::new();
        let mut call_medians = Vec::new();
        for _ in 0..reps {
            plan_medians.push(median_call(|| {
                black_box(Plan::new(worker.layout(), black_box(&set), Role::Consumer).unwrap());
            }));
            call_medians.push(median_call(|| {
                worker.checksum_host_overhead(black_box(&set), Role::Consumer).unwrap();
            }));
        }
        println!("| {name} | {} | {} |", summary(plan_medians), summary(call_medians));
    }
    // A device worker's store and load check: the host work they add.
    println!();
    println!("| case | store host work without the engine | load check host work without the engine |");
    println!("|---|---|---|");
    for (name, requests, per_request) in [("1 block x 32 layers", 1, 1), ("128 requests x 16 blocks", 128, 16)] {
        let set = blocks(requests, per_request, 0x5eed);
        let mut store = Vec::new();
        let mut load = Vec::new();
        for _ in 0..reps {
            store.push(median_call(|| {
                worker.stored_host_overhead(black_box(&set), false).unwrap();
            }));
            load.push(median_call(|| {
                worker.stored_host_overhead(black_box(&set), true).unwrap();
            }));
        }
        println!("| {name} | {} | {} |", summary(store), summary(load));
    }
}
