//! Host engine benchmark: the host engine against a plain single-thread read
//! of the same bytes (the ceiling), on a Llama-3.1-8B-like KV cache.
//!
//! Run: `cargo run --release --example host_bench` (or `make bench`);
//! `-- --reps N` sets the repetitions (default 9), `-- --read-blocks N` the
//! blocks read (default 512). Prints one table row per
//! (layout, threads): the median GB/s over the repetitions and its fraction
//! of the median ceiling. Each repetition measures the ceiling and the
//! engine back to back, so that load from other processes hits both alike.
//!
//! The cache: 32 layers, 8 KV heads, head size 128, bf16, 16-token blocks,
//! one tensor per layer, more blocks allocated than read; one request reads
//! 512 distinct random block ids (1 GiB of KV). The same bytes are read as
//! HND (`[num_blocks, 2, heads, 16, head_size]`, FlashInfer's shape) and as
//! NHD with K and V in separate halves (`[2, num_blocks, 16, heads,
//! head_size]`, FlashAttention's shape).

use std::hint::black_box;
use std::time::Instant;

use kvcsum::{BlockSet, LayerSpec, Region, ReplicaKey, Role, Segment, StreamHandle, Worker, WorkerOptions};

const LAYERS: u32 = 32;
const KV_HEADS: u32 = 8;
/// Head size 128 in bf16: the bytes of one token's K (or V) of one head.
const HEAD_BYTES: u64 = 128 * 2;
const BLOCK_SIZE: u32 = 16;
/// Blocks allocated per layer; more than are read, so ids are scattered.
const CACHE_BLOCKS: u32 = 640;
/// Blocks one request reads by default: 512 x 2 MiB = 1 GiB.
const READ_BLOCKS: usize = 512;
/// K or V of one block of one layer: 16 tokens x 8 heads x 256 bytes.
const HALF_BLOCK_BYTES: u64 = BLOCK_SIZE as u64 * KV_HEADS as u64 * HEAD_BYTES;
const LAYER_BYTES: u64 = 2 * HALF_BLOCK_BYTES * CACHE_BLOCKS as u64;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Shape {
    Hnd,
    Nhd,
}

/// A small deterministic generator (xorshift64*), so runs read the same bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Layer `layer`'s K and V segments in `shape`, the cache at `base`.
fn segments(shape: Shape, base: u64, layer: u32) -> Vec<Segment> {
    let layer_base = base + layer as u64 * LAYER_BYTES;
    let (k, v, block_stride, head_stride, token_stride) = match shape {
        Shape::Hnd => (
            layer_base,
            layer_base + HALF_BLOCK_BYTES,
            2 * HALF_BLOCK_BYTES,
            BLOCK_SIZE as u64 * HEAD_BYTES,
            HEAD_BYTES,
        ),
        Shape::Nhd => (
            layer_base,
            layer_base + HALF_BLOCK_BYTES * CACHE_BLOCKS as u64,
            HALF_BLOCK_BYTES,
            HEAD_BYTES,
            KV_HEADS as u64 * HEAD_BYTES,
        ),
    };
    [k, v]
        .into_iter()
        .map(|address| Segment {
            address,
            block_stride: block_stride as i64,
            kernel_block_stride: 0,
            head_stride: head_stride as i64,
            token_stride: token_stride as i64,
            bytes_per_token: HEAD_BYTES as u32,
        })
        .collect()
}

/// The `(offset, length)` in pieces of every contiguous range the checksum
/// of `block_ids` reads, in the engine's order (block, then layer, K then V).
fn read_ranges(shape: Shape, block_ids: &[u32]) -> Vec<(usize, usize)> {
    let mut ranges = Vec::new();
    for &block in block_ids {
        for layer in 0..LAYERS {
            let layer_base = layer as u64 * LAYER_BYTES;
            match shape {
                Shape::Hnd => ranges.push((layer_base + block as u64 * 2 * HALF_BLOCK_BYTES, 2 * HALF_BLOCK_BYTES)),
                Shape::Nhd => {
                    let v_base = layer_base + HALF_BLOCK_BYTES * CACHE_BLOCKS as u64;
                    ranges.push((layer_base + block as u64 * HALF_BLOCK_BYTES, HALF_BLOCK_BYTES));
                    ranges.push((v_base + block as u64 * HALF_BLOCK_BYTES, HALF_BLOCK_BYTES));
                }
            }
        }
    }
    ranges
        .into_iter()
        .map(|(offset, len)| (offset as usize / 8, len as usize / 8))
        .collect()
}

/// The ceiling: a plain loop summing the u64s of `ranges`, one thread.
fn plain_read(cache: &[u64], ranges: &[(usize, usize)]) -> u64 {
    let mut sum = 0u64;
    for &(offset, len) in ranges {
        for &piece in &cache[offset..offset + len] {
            sum = sum.wrapping_add(piece);
        }
    }
    sum
}

fn worker(shape: Shape, cache: &[u64], threads: u32) -> Worker {
    let mut worker = Worker::new(WorkerOptions {
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        device: None,
        num_threads: threads,
    })
    .expect("host worker");
    let base = cache.as_ptr() as u64;
    worker
        .add_region(Region {
            address: base,
            length: std::mem::size_of_val(cache) as u64,
        })
        .expect("region");
    worker.add_group(0, BLOCK_SIZE).expect("group");
    for layer in 0..LAYERS {
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
                num_blocks: CACHE_BLOCKS,
                kernel_blocks: 1,
                tokens_per_kernel_block: BLOCK_SIZE,
                segments: segments(shape, base, layer),
                identity: format!("model.layers.{layer}.self_attn.attn").into_bytes(),
            })
            .expect("layer");
    }
    worker
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut reps = 9usize;
    // Fewer blocks (one fits in L2) show the engine's compute rate apart
    // from memory; the table in BENCHMARKS.md uses the default.
    let mut read_blocks = READ_BLOCKS;
    while let Some(arg) = args.next() {
        let mut value = || args.next().and_then(|n| n.parse().ok());
        match arg.as_str() {
            "--reps" => reps = value().expect("--reps N"),
            "--read-blocks" => {
                read_blocks = value()
                    .filter(|&n| n > 0 && n <= CACHE_BLOCKS as usize)
                    .expect("--read-blocks 1..=640")
            }
            other => panic!("unknown argument {other} (usage: host_bench [--reps N] [--read-blocks N])"),
        }
    }
    let seed = 0x6b76_6373_756d_0001u64;
    let mut rng = Rng(seed);
    let pieces = (LAYER_BYTES * LAYERS as u64 / 8) as usize;
    // Random bytes, written once: this also faults every page in.
    let cache: Vec<u64> = (0..pieces).map(|_| rng.next()).collect();
    let mut ids: Vec<u32> = (0..CACHE_BLOCKS).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let block_ids = &ids[..read_blocks];
    let mut blocks = BlockSet::new();
    blocks
        .add_request("bench", (read_blocks * BLOCK_SIZE as usize) as u64)
        .expect("request");
    blocks.add_group("bench", 0, 0, block_ids).expect("group");

    let read_bytes = read_blocks as u64 * LAYERS as u64 * 2 * HALF_BLOCK_BYTES;
    println!(
        "host_bench: {LAYERS} layers, {KV_HEADS} KV heads, head size 128, bf16, {BLOCK_SIZE}-token blocks; \
         cache {:.2} GiB ({CACHE_BLOCKS} blocks), reading {read_blocks} random blocks = {:.2} GiB; \
         median of {reps} repetitions (seed {seed:#x})",
        (LAYER_BYTES * LAYERS as u64) as f64 / (1u64 << 30) as f64,
        read_bytes as f64 / (1u64 << 30) as f64,
    );
    println!("{:<7} {:>8} {:>8} {:>12}", "layout", "threads", "GB/s", "of ceiling");
    for shape in [Shape::Hnd, Shape::Nhd] {
        let ranges = read_ranges(shape, block_ids);
        let ranged: u64 = ranges.iter().map(|r| r.1 as u64 * 8).sum();
        assert_eq!(ranged, read_bytes, "the ceiling reads the checksum's bytes");
        let thread_counts = [1u32, 2];
        let workers: Vec<Worker> = thread_counts.iter().map(|&t| worker(shape, &cache, t)).collect();
        let mut ceiling = Vec::new();
        let mut engine: Vec<Vec<f64>> = vec![Vec::new(); thread_counts.len()];
        let mut reference: Option<Vec<u64>> = None;
        // Repetition 0 warms up and is not counted.
        for rep in 0..=reps {
            let start = Instant::now();
            black_box(plain_read(black_box(&cache), &ranges));
            let seconds = start.elapsed().as_secs_f64();
            if rep > 0 {
                ceiling.push(read_bytes as f64 / seconds / 1e9);
            }
            for (index, worker) in workers.iter().enumerate() {
                let start = Instant::now();
                let result = worker
                    .checksum(&blocks, Role::Producer, StreamHandle::legacy_default())
                    .expect("checksum");
                let seconds = start.elapsed().as_secs_f64();
                let values = result.values().expect("host values are ready").to_vec();
                match &reference {
                    None => reference = Some(values),
                    Some(expected) => assert_eq!(&values, expected, "thread counts agree"),
                }
                if rep > 0 {
                    engine[index].push(read_bytes as f64 / seconds / 1e9);
                }
            }
        }
        let ceiling = median(&mut ceiling);
        let name = format!("{shape:?}").to_uppercase();
        println!("{name:<7} {:>8} {ceiling:>8.2} {:>12.2}", "read", 1.0);
        for (index, &threads) in thread_counts.iter().enumerate() {
            let rate = median(&mut engine[index]);
            println!("{name:<7} {threads:>8} {rate:>8.2} {:>12.2}", rate / ceiling);
        }
        let values = reference.expect("computed");
        let digest = values.iter().fold(0u64, |acc, &v| acc.rotate_left(5) ^ v);
        println!("{name:<7} checksum digest {digest:#018x} ({} positions)", values.len());
    }
}
