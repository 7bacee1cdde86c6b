//! Host engine benchmark: the host engine at several thread counts against a
//! plain multi-threaded read of the same bytes with as many threads (the
//! ceiling), on a Llama-3.1-8B-like KV cache.
//!
//! Run: `cargo run --release --example host_bench -- [options]` (or `make
//! bench`):
//!
//! - `--gib G`: KV one call reads, in GiB (default 1; fractions such as
//!   `0.25` are fine); the cache allocated is 5/4 of it, so the block ids
//!   read are scattered.
//! - `--threads 1,2,4,8,16`: the thread counts (default `1,2`).
//! - `--reps N`: repetitions (default 9), after one warm-up.
//! - `--read-blocks N`: read only N blocks (2 MiB each) of the cache; one
//!   block fits in L2 and shows the engine's compute rate apart from memory.
//! - `--algorithms weighted,mixed2`: the checksum algorithms measured, each
//!   right after the same read (default `weighted,mixed2`; `mixed`, kvcsum
//!   0.2's default, may be named too; docs/SPEC.md section 12).
//!
//! Prints a markdown table with one row per (layout, thread count): the
//! median GB/s of the read and of the engine over the repetitions, the
//! engine's fraction of the read (ratio of the medians) and the range of the
//! per-repetition fractions. Each repetition measures, for each thread
//! count in turn, the read and then the engine back to back, so that load
//! from other processes hits both alike.
//!
//! The cache: 32 layers, 8 KV heads, head size 128, bf16, 16-token blocks,
//! one tensor per layer; one request reads distinct random block ids (2 MiB
//! of KV per block). The same bytes are read as HND (`[num_blocks, 2, heads,
//! 16, head_size]`, FlashInfer's shape) and as NHD with K and V in separate
//! halves (`[2, num_blocks, 16, heads, head_size]`, FlashAttention's shape).
//!
//! The read splits the work as the engine does: one item per (block,
//! layer), its K and V ranges, in the engine's order (block, then layer),
//! handed out 16 items at a time from a shared counter to threads started
//! once (the calling thread reads too). The engine's threads are those of
//! a host worker created with `num_threads` set to the count.

use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use kvcsum::{Algorithm, BlockSet, LayerSpec, Region, ReplicaKey, Role, Segment, StreamHandle, Worker, WorkerOptions};

const LAYERS: u32 = 32;
const KV_HEADS: u32 = 8;
/// Head size 128 in bf16: the bytes of one token's K (or V) of one head.
const HEAD_BYTES: u64 = 128 * 2;
const BLOCK_SIZE: u32 = 16;
/// K or V of one block of one layer: 16 tokens x 8 heads x 256 bytes.
const HALF_BLOCK_BYTES: u64 = BLOCK_SIZE as u64 * KV_HEADS as u64 * HEAD_BYTES;
/// A block of every layer: 2 MiB.
const BLOCK_BYTES: u64 = 2 * HALF_BLOCK_BYTES * LAYERS as u64;
/// Items (block, layer) a read thread takes at a time, as the engine does.
const ITEMS_PER_GRAB: usize = 16;

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

/// The cache's size: blocks allocated per layer.
#[derive(Clone, Copy)]
struct Cache {
    blocks: u32,
}

impl Cache {
    fn layer_bytes(self) -> u64 {
        2 * HALF_BLOCK_BYTES * self.blocks as u64
    }

    /// Layer `layer`'s K and V segments in `shape`, the cache at `base`.
    fn segments(self, shape: Shape, base: u64, layer: u32) -> Vec<Segment> {
        let layer_base = base + layer as u64 * self.layer_bytes();
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
                layer_base + HALF_BLOCK_BYTES * self.blocks as u64,
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

    /// The `(offset, length)` in pieces of every contiguous range the
    /// checksum of `block_ids` reads, item by item in the engine's order
    /// (block, then layer; K then V), and the ranges per item.
    fn read_ranges(self, shape: Shape, block_ids: &[u32]) -> (Vec<(usize, usize)>, usize) {
        let mut ranges = Vec::new();
        for &block in block_ids {
            for layer in 0..LAYERS {
                let layer_base = layer as u64 * self.layer_bytes();
                match shape {
                    Shape::Hnd => ranges.push((layer_base + block as u64 * 2 * HALF_BLOCK_BYTES, 2 * HALF_BLOCK_BYTES)),
                    Shape::Nhd => {
                        let v_base = layer_base + HALF_BLOCK_BYTES * self.blocks as u64;
                        ranges.push((layer_base + block as u64 * HALF_BLOCK_BYTES, HALF_BLOCK_BYTES));
                        ranges.push((v_base + block as u64 * HALF_BLOCK_BYTES, HALF_BLOCK_BYTES));
                    }
                }
            }
        }
        let per_item = match shape {
            Shape::Hnd => 1,
            Shape::Nhd => 2,
        };
        let ranges = ranges
            .into_iter()
            .map(|(offset, len)| (offset as usize / 8, len as usize / 8))
            .collect();
        (ranges, per_item)
    }

    fn worker(self, shape: Shape, cache: &[u64], threads: u32, algorithm: Algorithm) -> Worker {
        let mut worker = Worker::new(WorkerOptions {
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            device: None,
            num_threads: threads,
        })
        .expect("host worker");
        worker.set_algorithm(algorithm).expect("algorithm");
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
                    num_blocks: self.blocks,
                    kernel_blocks: 1,
                    tokens_per_kernel_block: BLOCK_SIZE,
                    segments: self.segments(shape, base, layer),
                    identity: format!("model.layers.{layer}.self_attn.attn").into_bytes(),
                })
                .expect("layer");
        }
        worker
    }
}

/// One parallel read: the ranges, grouped `per_item` to an item, and the
/// counter that hands items out.
struct ReadJob {
    ranges: Arc<Vec<(usize, usize)>>,
    per_item: usize,
    next: AtomicUsize,
}

impl ReadJob {
    /// Takes items until none are left; the wrapping sum of their `u64`s.
    fn read(&self, cache: &[u64]) -> u64 {
        let items = self.ranges.len() / self.per_item;
        let mut sum = 0u64;
        loop {
            let start = self.next.fetch_add(ITEMS_PER_GRAB, Ordering::Relaxed);
            if start >= items {
                return sum;
            }
            let end = (start + ITEMS_PER_GRAB).min(items);
            for &(offset, len) in &self.ranges[start * self.per_item..end * self.per_item] {
                for &piece in &cache[offset..offset + len] {
                    sum = sum.wrapping_add(piece);
                }
            }
        }
    }
}

/// The ceiling's threads: the caller and `threads - 1` helpers started
/// once, each woken per read through its channel.
struct ReadTeam {
    cache: &'static [u64],
    jobs: Vec<Sender<Arc<ReadJob>>>,
    sums: Receiver<u64>,
    helpers: Vec<JoinHandle<()>>,
}

impl ReadTeam {
    fn new(cache: &'static [u64], threads: usize) -> ReadTeam {
        let (sum_sender, sums) = channel();
        let mut jobs = Vec::new();
        let mut helpers = Vec::new();
        for _ in 1..threads {
            let (job_sender, job_receiver) = channel::<Arc<ReadJob>>();
            let sum_sender = sum_sender.clone();
            helpers.push(std::thread::spawn(move || {
                for job in job_receiver {
                    let _ = sum_sender.send(job.read(cache));
                }
            }));
            jobs.push(job_sender);
        }
        ReadTeam {
            cache,
            jobs,
            sums,
            helpers,
        }
    }

    /// Reads every range once, split over the team; the wrapping sum.
    fn read(&self, ranges: &Arc<Vec<(usize, usize)>>, per_item: usize) -> u64 {
        let job = Arc::new(ReadJob {
            ranges: Arc::clone(ranges),
            per_item,
            next: AtomicUsize::new(0),
        });
        for sender in &self.jobs {
            sender.send(Arc::clone(&job)).expect("read helper alive");
        }
        let mut sum = job.read(self.cache);
        for _ in &self.jobs {
            sum = sum.wrapping_add(self.sums.recv().expect("read helper alive"));
        }
        sum
    }
}

impl Drop for ReadTeam {
    fn drop(&mut self) {
        self.jobs.clear();
        for helper in self.helpers.drain(..) {
            helper.join().expect("read helper");
        }
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// `len` random `u64`s, chunk by chunk in parallel (each chunk its own
/// seed, so the bytes do not depend on the core count); faults every page in.
fn random_cache(len: usize, seed: u64) -> Vec<u64> {
    const CHUNK: usize = 1 << 23;
    let mut cache = vec![0u64; len];
    let chunks: Vec<(usize, &mut [u64])> = cache.chunks_mut(CHUNK).enumerate().collect();
    let chunks = std::sync::Mutex::new(chunks);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..cores {
            scope.spawn(|| loop {
                let Some((index, chunk)) = chunks.lock().unwrap().pop() else {
                    return;
                };
                let mut rng = Rng(seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                for piece in chunk {
                    *piece = rng.next();
                }
            });
        }
    });
    cache
}

fn usage() -> ! {
    eprintln!(
        "usage: host_bench [--gib G] [--threads 1,2,4] [--reps N] [--read-blocks N] [--algorithms weighted,mixed,mixed2]"
    );
    std::process::exit(2)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut reps = 9usize;
    let mut gib = 1.0f64;
    let mut thread_counts = vec![1u32, 2];
    let mut read_blocks: Option<usize> = None;
    let mut algorithms = vec![Algorithm::Weighted, Algorithm::Mixed2];
    while let Some(arg) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        match arg.as_str() {
            "--reps" => reps = value.parse().ok().filter(|&n| n > 0).unwrap_or_else(|| usage()),
            "--gib" => {
                gib = value
                    .parse()
                    .ok()
                    .filter(|&g: &f64| g > 0.0 && g <= 1024.0)
                    .unwrap_or_else(|| usage())
            }
            "--threads" => {
                thread_counts = value
                    .split(',')
                    .map(|n| n.trim().parse().ok().filter(|&t| (1..=256).contains(&t)))
                    .collect::<Option<Vec<u32>>>()
                    .unwrap_or_else(|| usage())
            }
            "--read-blocks" => read_blocks = Some(value.parse().ok().filter(|&n| n > 0).unwrap_or_else(|| usage())),
            "--algorithms" => {
                algorithms = value
                    .split(',')
                    .map(|name| match name.trim() {
                        "weighted" => Some(Algorithm::Weighted),
                        "mixed" => Some(Algorithm::Mixed),
                        "mixed2" => Some(Algorithm::Mixed2),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()
                    .unwrap_or_else(|| usage())
            }
            _ => usage(),
        }
    }
    // The blocks one call reads, and 5/4 of them allocated.
    let default_read = ((gib * (1u64 << 30) as f64 / BLOCK_BYTES as f64).round() as usize).max(1);
    let cache_shape = Cache {
        blocks: (default_read + default_read / 4).max(1) as u32,
    };
    let read_blocks = read_blocks.unwrap_or(default_read);
    if read_blocks > cache_shape.blocks as usize {
        eprintln!(
            "--read-blocks {read_blocks} is more than the {} blocks of the cache",
            cache_shape.blocks
        );
        usage();
    }
    let seed = 0x6b76_6373_756d_0001u64;
    let pieces = (cache_shape.layer_bytes() * LAYERS as u64 / 8) as usize;
    // Lives as long as the program: the read team's threads borrow it.
    let cache: &'static [u64] = Vec::leak(random_cache(pieces, seed));
    let mut rng = Rng(seed);
    let mut ids: Vec<u32> = (0..cache_shape.blocks).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let block_ids = &ids[..read_blocks];
    let mut blocks = BlockSet::new();
    blocks
        .add_request("bench", (read_blocks * BLOCK_SIZE as usize) as u64)
        .expect("request");
    blocks.add_group("bench", 0, 0, block_ids).expect("group");

    let read_bytes = read_blocks as u64 * BLOCK_BYTES;
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "host_bench: {LAYERS} layers, {KV_HEADS} KV heads, head size 128, bf16, {BLOCK_SIZE}-token blocks; \
         cache {:.2} GiB ({} blocks), reading {read_blocks} random blocks = {:.3} GiB per call; \
         median of {reps} repetitions after a warm-up; {cores} cores available (seed {seed:#x})",
        (cache_shape.layer_bytes() * LAYERS as u64) as f64 / (1u64 << 30) as f64,
        cache_shape.blocks,
        read_bytes as f64 / (1u64 << 30) as f64,
    );
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for shape in [Shape::Hnd, Shape::Nhd] {
        let (ranges, per_item) = cache_shape.read_ranges(shape, block_ids);
        let ranged: u64 = ranges.iter().map(|r| r.1 as u64 * 8).sum();
        assert_eq!(ranged, read_bytes, "the read covers the checksum's bytes");
        let ranges = Arc::new(ranges);
        let teams: Vec<ReadTeam> = thread_counts
            .iter()
            .map(|&t| ReadTeam::new(cache, t as usize))
            .collect();
        // Per thread count, one worker per algorithm.
        let workers: Vec<Vec<Worker>> = thread_counts
            .iter()
            .map(|&t| {
                algorithms
                    .iter()
                    .map(|&a| cache_shape.worker(shape, cache, t, a))
                    .collect()
            })
            .collect();
        let cells = thread_counts.len() * algorithms.len();
        let mut read_rates: Vec<Vec<f64>> = vec![Vec::new(); cells];
        let mut engine_rates: Vec<Vec<f64>> = vec![Vec::new(); cells];
        let mut fractions: Vec<Vec<f64>> = vec![Vec::new(); cells];
        let mut references: Vec<Option<Vec<u64>>> = vec![None; algorithms.len()];
        let mut read_sum: Option<u64> = None;
        // Repetition 0 warms up (and starts the engine's helpers) and is not counted.
        for rep in 0..=reps {
            for (index, (team, workers)) in teams.iter().zip(&workers).enumerate() {
                for (a, worker) in workers.iter().enumerate() {
                    let start = Instant::now();
                    let sum = black_box(team.read(&ranges, per_item));
                    let read_seconds = start.elapsed().as_secs_f64();
                    assert_eq!(*read_sum.get_or_insert(sum), sum, "the read's sum changed");

                    let start = Instant::now();
                    let result = worker
                        .checksum(&blocks, Role::Producer, StreamHandle::legacy_default())
                        .expect("checksum");
                    let engine_seconds = start.elapsed().as_secs_f64();
                    let values = result.values().expect("host values are ready");
                    match &references[a] {
                        None => references[a] = Some(values.to_vec()),
                        Some(expected) => assert_eq!(values, expected.as_slice(), "thread counts agree"),
                    }
                    if rep > 0 {
                        let cell = index * algorithms.len() + a;
                        read_rates[cell].push(read_bytes as f64 / read_seconds / 1e9);
                        engine_rates[cell].push(read_bytes as f64 / engine_seconds / 1e9);
                        fractions[cell].push(read_seconds / engine_seconds);
                    }
                }
            }
        }
        let name = format!("{shape:?}").to_uppercase();
        for (index, &threads) in thread_counts.iter().enumerate() {
            for (a, algorithm) in algorithms.iter().enumerate() {
                let cell = index * algorithms.len() + a;
                let read = median(&mut read_rates[cell]);
                let engine = median(&mut engine_rates[cell]);
                let low = fractions[cell].iter().copied().fold(f64::INFINITY, f64::min);
                let high = fractions[cell].iter().copied().fold(0.0, f64::max);
                rows.push(format!(
                    "| {name} | {} | {threads} | {read:.2} | {engine:.2} | {:.2} | {low:.2}-{high:.2} |",
                    algorithm.name(),
                    engine / read
                ));
            }
        }
        for (algorithm, values) in algorithms.iter().zip(references) {
            let values = values.expect("computed");
            let digest = values.iter().fold(0u64, |acc, &v| acc.rotate_left(5) ^ v);
            notes.push(format!(
                "{name} {}: checksum digest {digest:#018x} ({} positions)",
                algorithm.name(),
                values.len(),
            ));
        }
        notes.push(format!(
            "{name}: {}",
            workers
                .last()
                .and_then(|w| w.last())
                .expect("a worker")
                .engine_description()
        ));
    }
    println!();
    println!("| layout | algorithm | threads | read GB/s | engine GB/s | of read | per-rep range |");
    println!("|---|---|---:|---:|---:|---:|---|");
    for row in rows {
        println!("{row}");
    }
    println!();
    for note in notes {
        println!("{note}");
    }
}
