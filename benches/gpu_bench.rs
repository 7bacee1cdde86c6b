//! GPU benchmark: in one run on one device, a plain streaming-read kernel
//! over exactly the bytes a case checksums (the read ceiling) and kvcsum's
//! device engine on the same bytes, for a Llama-3.1-8B-like cache (32 layers,
//! 8 KV heads, head size 128, bf16, 16-token blocks) in HND, NHD and K/V-split
//! layouts, plus an MLA-like cache and an fp8 cache, each case under both
//! checksum algorithms side by side (WEIGHTED and MIXED2, docs/SPEC.md
//! section 12: two workers over the same bytes, timed in turn after the same
//! ceiling); then the latency of one block and the host time of a
//! 128-request call (MIXED2, the default).
//!
//! Build here: `cargo build --release --example gpu_bench`; run on a GPU
//! machine: `target/release/examples/gpu_bench [device] [--only N] [--host]
//! [--settle SECONDS] [--sustain SECONDS]`. It prints a
//! Markdown table for BENCHMARKS.md. `--sustain S` prints instead the
//! sustained table: each kernel run back to back for S seconds alone, timed
//! over its last half, so that a card held at its power limit (clocks
//! lowered: nvidia-smi's `clocks_event_reasons.active` 0x4, SW power cap)
//! runs each at the clocks that kernel leaves it.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result as cu, sys, CudaContext};
use cudarc::nvrtc::CompileOptions;
use kvcsum::{Algorithm, BlockSet, LayerSpec, Region, ReplicaKey, Role, Segment, StreamHandle, Worker, WorkerOptions};

const READ_KERNEL: &str = r#"
struct chunk { unsigned long long address; unsigned long long bytes; };
// Reads every 16-byte vector of every chunk once; one block per chunk at a time.
extern "C" __global__ void read_chunks(const chunk *chunks, unsigned long long count, unsigned long long *sink) {
    unsigned long long acc = 0;
    for (unsigned long long c = blockIdx.x; c < count; c += gridDim.x) {
        const ulonglong2 *p = (const ulonglong2 *)chunks[c].address;
        const unsigned long long n = chunks[c].bytes / 16;
        unsigned long long i = threadIdx.x;
        for (; i + 3 * blockDim.x < n; i += 4 * blockDim.x) {
            ulonglong2 a = __ldcs(p + i), b = __ldcs(p + i + blockDim.x);
            ulonglong2 d = __ldcs(p + i + 2 * blockDim.x), e = __ldcs(p + i + 3 * blockDim.x);
            acc ^= a.x ^ a.y ^ b.x ^ b.y ^ d.x ^ d.y ^ e.x ^ e.y;
        }
        for (; i < n; i += blockDim.x) { ulonglong2 a = __ldcs(p + i); acc ^= a.x ^ a.y; }
    }
    if (acc == 0x9e3779b97f4a7c15ull) *sink = acc;  // keeps the loads alive
}
// Does nothing with a parameter the size of kvcs_checksum's (976 bytes):
// what a parameter of that size adds to a launch's host time.
struct blob { unsigned long long words[122]; };
extern "C" __global__ void big_params(const __grid_constant__ blob b, unsigned long long *sink) {
    if (b.words[threadIdx.x % 122] == 0x9e3779b97f4a7c15ull) *sink = 1;
}
extern "C" __global__ void fill(unsigned long long *p, unsigned long long n, unsigned long long seed) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long z = (i + seed) * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull; z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        p[i] = z ^ (z >> 31);
    }
}
"#;

/// A cache shape: layers x heads x cell bytes, tokens per block.
#[derive(Clone, Copy)]
struct Model {
    name: &'static str,
    layers: u32,
    heads: u32,
    k_bytes: u32,
    v_bytes: u32,
    block_size: u32,
}

#[derive(Clone, Copy, PartialEq)]
enum Layout {
    Hnd,
    Nhd,
    KvSplit,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Hnd => "HND",
            Layout::Nhd => "NHD",
            Layout::KvSplit => "K/V split",
        }
    }
}

struct Device {
    ordinal: usize,
    _context: Arc<CudaContext>,
    stream: sys::CUstream,
    read_chunks: sys::CUfunction,
    big_params: sys::CUfunction,
    fill: sys::CUfunction,
    _module: Arc<cudarc::driver::CudaModule>,
    sink: u64,
}

fn check<T>(r: Result<T, cu::DriverError>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e}"))
}

impl Device {
    fn new(ordinal: usize) -> Device {
        let context = check(CudaContext::new(ordinal), "context");
        check(context.bind_to_thread(), "bind");
        let (major, minor) = check(context.compute_capability(), "capability");
        let options = CompileOptions {
            options: vec![format!("--gpu-architecture=sm_{major}{minor}")],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(READ_KERNEL, options).expect("compile read kernel");
        let module = check(context.load_module(ptx), "load");
        let read_chunks = check(module.load_function("read_chunks"), "read_chunks").cu_function();
        let fill = check(module.load_function("fill"), "fill").cu_function();
        let big_params = check(module.load_function("big_params"), "big_params").cu_function();
        let stream = check(cu::stream::create(cu::stream::StreamKind::NonBlocking), "stream");
        // SAFETY: a plain allocation on the context bound to this thread.
        let sink = unsafe { check(cu::malloc_sync(8), "sink") };
        Device {
            ordinal,
            _context: context,
            stream,
            read_chunks,
            big_params,
            fill,
            _module: module,
            sink,
        }
    }

    fn launch(&self, f: sys::CUfunction, blocks: u32, params: &mut [*mut std::ffi::c_void]) {
        // SAFETY: `f` is a kernel of this device's module on its context, and `params` holds
        // one pointer per kernel parameter, each to a value of that parameter's type that lives
        // through the call (cuLaunchKernel copies them).
        unsafe {
            check(
                cu::launch_kernel(f, (blocks, 1, 1), (256, 1, 1), 0, self.stream, params),
                "launch",
            )
        };
    }

    fn sync(&self) {
        // SAFETY: the device's own stream, alive while `self` is.
        unsafe { check(cu::stream::synchronize(self.stream), "sync") };
    }

    /// Milliseconds per run of `work` on the stream: median of `reps` timed batches of `inner`.
    fn time(&self, reps: usize, inner: usize, work: impl FnMut()) -> f64 {
        self.time_after(reps, inner, || {}, work)
    }

    /// As `time`, with `before` queued ahead of each timed batch (after one
    /// untimed warm-up run of `work`).
    fn time_after(&self, reps: usize, inner: usize, mut before: impl FnMut(), mut work: impl FnMut()) -> f64 {
        work();
        self.sync();
        let start = check(cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT), "event");
        let stop = check(cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT), "event");
        let mut times = Vec::new();
        for _ in 0..reps {
            before();
            // SAFETY: events created above and the device's own stream, all alive.
            unsafe { check(cu::event::record(start, self.stream), "record") };
            for _ in 0..inner {
                work();
            }
            // SAFETY: events created above and the device's own stream, all alive.
            unsafe { check(cu::event::record(stop, self.stream), "record") };
            self.sync();
            // SAFETY: both events were recorded, and have completed (the stream is
            // synchronized).
            times.push(unsafe { check(cu::event::elapsed(start, stop), "elapsed") } as f64 / inner as f64);
        }
        // SAFETY: events created above; the stream is synchronized, so no record of them is
        // pending, and they are not used again.
        unsafe {
            let _ = cu::event::destroy(start);
            let _ = cu::event::destroy(stop);
        }
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    }
}

/// Segments and ceiling chunks of one layer of `model` in `layout`.
fn layer_layout(model: &Model, layout: Layout, base: u64, num_blocks: u64) -> (Vec<Segment>, u64) {
    let (h, b) = (model.heads as i64, model.block_size as i64);
    let (k, v) = (model.k_bytes as i64, model.v_bytes as i64);
    let block_bytes = h * b * (k + v);
    let seg = |address: u64, block_stride: i64, head_stride: i64, token_stride: i64, bytes: i64| Segment {
        address,
        block_stride,
        kernel_block_stride: 0,
        head_stride,
        token_stride,
        bytes_per_token: bytes as u32,
    };
    let segments = match (layout, v) {
        (Layout::Hnd, 0) => vec![seg(base, block_bytes, b * k, k, k)],
        (Layout::Nhd, 0) | (Layout::KvSplit, 0) => vec![seg(base, block_bytes, k, h * k, k)],
        (Layout::Hnd, _) => vec![
            seg(base, block_bytes, b * k, k, k),
            seg(base + (h * b * k) as u64, block_bytes, b * v, v, v),
        ],
        (Layout::Nhd, _) => vec![
            seg(base, block_bytes, k, h * k, k),
            seg(base + (h * b * k) as u64, block_bytes, v, h * v, v),
        ],
        (Layout::KvSplit, _) => vec![
            seg(base, h * b * k, k, h * k, k),
            seg(base + num_blocks * (h * b * k) as u64, h * b * v, v, h * v, v),
        ],
    };
    (segments, block_bytes as u64 * num_blocks)
}

struct Case {
    /// The default algorithm's (MIXED2) worker.
    worker: Worker,
    /// A WEIGHTED worker over the same layout.
    weighted: Worker,
    blocks: BlockSet,
    chunks_device: u64,
    num_chunks: u64,
    bytes: u64,
}

/// Registers `model` in `layout` over the cache buffer and picks `requests`
/// requests of `blocks_per_request` random blocks each.
#[allow(clippy::too_many_arguments)]
fn build_case(
    dev: &Device,
    cache: u64,
    cache_bytes: u64,
    model: &Model,
    layout: Layout,
    requests: usize,
    blocks_per_request: usize,
    seed: u64,
) -> Case {
    let block_bytes = (model.heads * model.block_size * (model.k_bytes + model.v_bytes)) as u64;
    let num_blocks = cache_bytes / model.layers as u64 / block_bytes;
    assert!(num_blocks as usize >= requests * blocks_per_request, "cache too small");
    let new_worker = |algorithm: Algorithm| {
        let mut worker = Worker::new(WorkerOptions {
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            device: Some(dev.ordinal as u32),
            num_threads: 0,
        })
        .expect("device worker");
        worker.set_algorithm(algorithm).unwrap();
        worker
            .add_region(Region {
                address: cache,
                length: cache_bytes,
            })
            .unwrap();
        worker.add_group(0, model.block_size).unwrap();
        worker
    };
    let mut worker = new_worker(Algorithm::Mixed2);
    let mut weighted = new_worker(Algorithm::Weighted);
    let mut chunks: Vec<[u64; 2]> = Vec::new();
    let mut layer_segments = Vec::new();
    for layer in 0..model.layers {
        let base = cache + layer as u64 * num_blocks * block_bytes;
        let (segments, _) = layer_layout(model, layout, base, num_blocks);
        let spec = LayerSpec {
            group_id: 0,
            layer_number: layer,
            first_head: 0,
            num_heads: model.heads,
            replica: ReplicaKey {
                replicas: 1,
                replica_index: 0,
            },
            num_blocks: num_blocks as u32,
            kernel_blocks: 1,
            tokens_per_kernel_block: model.block_size,
            segments: segments.clone(),
            identity: format!("layer.{layer}").into_bytes(),
        };
        worker.add_layer(spec.clone()).unwrap();
        weighted.add_layer(spec).unwrap();
        layer_segments.push(segments);
    }
    // Random distinct block ids (a partial Fisher-Yates over all blocks).
    let mut state = seed | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    let picked = requests * blocks_per_request;
    for i in 0..picked {
        let j = i + (next() % (ids.len() - i) as u64) as usize;
        ids.swap(i, j);
    }
    let mut blocks = BlockSet::new();
    for r in 0..requests {
        let req = format!("req-{r}");
        let ids = &ids[r * blocks_per_request..(r + 1) * blocks_per_request];
        blocks
            .add_request(&req, (blocks_per_request as u64) * model.block_size as u64)
            .unwrap();
        blocks.add_group(&req, 0, 0, ids).unwrap();
        // The ceiling reads the same bytes: each block's contiguous runs in each layer.
        for segments in &layer_segments {
            for &id in ids {
                if segments.len() == 2 && layout == Layout::KvSplit {
                    let run = (model.heads * model.block_size) as u64;
                    chunks.push([
                        segments[0].address + id as u64 * segments[0].block_stride as u64,
                        run * model.k_bytes as u64,
                    ]);
                    chunks.push([
                        segments[1].address + id as u64 * segments[1].block_stride as u64,
                        run * model.v_bytes as u64,
                    ]);
                } else {
                    chunks.push([segments[0].address + id as u64 * block_bytes, block_bytes]);
                }
            }
        }
    }
    let bytes = chunks.iter().map(|c| c[1]).sum();
    // SAFETY: a plain allocation on the context bound to this thread, then a synchronous copy
    // of `chunks` (16 bytes each, the size allocated) into it.
    let chunks_device = unsafe {
        let p = check(cu::malloc_sync(chunks.len() * 16), "chunks");
        check(cu::memcpy_htod_sync(p, &chunks), "chunks copy");
        p
    };
    Case {
        worker,
        weighted,
        blocks,
        chunks_device,
        num_chunks: chunks.len() as u64,
        bytes,
    }
}

/// Queues the read kernel over `case`'s chunks: `blocks` blocks (grid-stride).
fn read_case(dev: &Device, case: &Case, blocks: u32) {
    let mut chunks = case.chunks_device;
    let mut count = case.num_chunks;
    let mut sink = dev.sink;
    let mut params = [
        (&mut chunks as *mut u64).cast(),
        (&mut count as *mut u64).cast(),
        (&mut sink as *mut u64).cast(),
    ];
    dev.launch(dev.read_chunks, blocks, &mut params);
}

fn ceiling_ms(dev: &Device, case: &Case) -> f64 {
    dev.time(7, 3, || read_case(dev, case, 132 * 8))
}

/// Milliseconds per run of `work` queued 50 times behind a read of `busy`
/// (which takes far longer than queueing them, so the host's part of each
/// call is hidden and the events time the device alone): median of 5.
fn queued_ms(dev: &Device, busy: &Case, work: impl FnMut()) -> f64 {
    dev.time_after(5, 50, || read_case(dev, busy, 132 * 8), work)
}

fn checksum_ms(dev: &Device, case: &Case, worker: &Worker) -> f64 {
    // Results are dropped at once (safe while pending); their buffers return
    // to the worker's pool when the work is done.
    dev.time(7, 3, || {
        drop(
            worker
                .checksum(&case.blocks, Role::Consumer, StreamHandle(dev.stream.cast()))
                .unwrap(),
        );
    })
}

/// A device's cache buffer of `bytes`, filled with random data.
fn random_cache(dev: &Device, bytes: u64, seed: u64) -> u64 {
    // SAFETY: a plain allocation on the context bound to this thread.
    let cache = unsafe { check(cu::malloc_sync(bytes as usize), "cache") };
    let (mut p, mut n, mut seed) = (cache, bytes / 8, seed);
    dev.launch(
        dev.fill,
        132 * 16,
        &mut [
            (&mut p as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
            (&mut seed as *mut u64).cast(),
        ],
    );
    dev.sync();
    cache
}

/// Two workers on two GPUs, called from two threads at the same time: each
/// one's rate against its own GPU's read ceiling (measured alone, before), so
/// that a lock or a shared resource in the library that serialised devices
/// would show as a fraction well below the one measured alone.
fn two_devices() {
    let model = Model {
        name: "Llama-3.1-8B bf16",
        layers: 32,
        heads: 8,
        k_bytes: 256,
        v_bytes: 256,
        block_size: 16,
    };
    let cache_bytes: u64 = 9 << 30;
    let sides: Vec<(Device, Case)> = (0..2)
        .map(|ordinal| {
            let dev = Device::new(ordinal);
            let cache = random_cache(&dev, cache_bytes, 0x1234_5678 + ordinal as u64);
            let case = build_case(&dev, cache, cache_bytes, &model, Layout::Hnd, 128, 16, 0x9E37);
            (dev, case)
        })
        .collect();
    println!("| device | case | read ceiling GB/s | kvcsum alone GB/s | fraction alone | kvcsum, both devices at once GB/s | fraction at once |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    let alone: Vec<(f64, f64)> = sides
        .iter()
        .map(|(dev, case)| {
            dev._context.bind_to_thread().expect("bind");
            (ceiling_ms(dev, case), checksum_ms(dev, case, &case.worker))
        })
        .collect();
    let barrier = std::sync::Barrier::new(2);
    let together: Vec<f64> = std::thread::scope(|scope| {
        let handles: Vec<_> = sides
            .iter()
            .map(|(dev, case)| {
                let barrier = &barrier;
                let dev = SendDevice(dev);
                scope.spawn(move || {
                    let dev = dev.get();
                    dev._context.bind_to_thread().expect("bind");
                    barrier.wait();
                    // More repetitions than alone, so that the two threads'
                    // timed calls overlap for most of their run.
                    dev.time(31, 3, || {
                        drop(
                            case.worker
                                .checksum(&case.blocks, Role::Consumer, StreamHandle(dev.stream.cast()))
                                .unwrap(),
                        );
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    for (((dev, case), (ceiling, ours)), both) in sides.iter().zip(alone).zip(together) {
        let gbs = |ms: f64| case.bytes as f64 / ms / 1e6;
        println!(
            "| {} | HND, 2048 blocks (128 req x 16), {:.0} MiB | {:.0} | {:.0} | {:.3} | {:.0} | {:.3} |",
            dev.ordinal,
            case.bytes as f64 / (1 << 20) as f64,
            gbs(ceiling),
            gbs(ours),
            ceiling / ours,
            gbs(both),
            ceiling / both
        );
    }
}

/// A device shared with a thread of `two_devices`: its CUDA handles may be
/// used from any thread once its context is bound, which the thread does.
struct SendDevice<'a>(&'a Device);
// SAFETY: see the type's doc; each device is used by one thread at a time.
unsafe impl Send for SendDevice<'_> {}

impl<'a> SendDevice<'a> {
    /// The device (a method, so that a closure captures the whole wrapper).
    fn get(self) -> &'a Device {
        self.0
    }
}

fn main() {
    if std::env::args().any(|a| a == "--two-devices") {
        two_devices();
        return;
    }
    // `--only N`: case N of the table alone (for profiling one case with ncu);
    // `--host`: only the small call and host-time rows.
    let args: Vec<String> = std::env::args().collect();
    let host_only = args.iter().any(|a| a == "--host");
    let only: Option<usize> = args
        .iter()
        .position(|a| a == "--only")
        .map(|i| args[i + 1].parse().expect("--only N"));
    // `--settle S`: the card idles S seconds before the stored table (which
    // follows 400 back-to-back 4 GiB calls), to tell a clock or power state
    // left by that sustained load from the cost of the calls it times.
    let settle: Option<f64> = args
        .iter()
        .position(|a| a == "--settle")
        .map(|i| args[i + 1].parse().expect("--settle SECONDS"));
    let sustain: Option<f64> = args
        .iter()
        .position(|a| a == "--sustain")
        .map(|i| args[i + 1].parse().expect("--sustain SECONDS"));
    let ordinal: usize = args
        .iter()
        .enumerate()
        .skip(1)
        .find(|&(i, a)| !a.starts_with("--") && !["--only", "--settle", "--sustain"].contains(&args[i - 1].as_str()))
        .map(|(_, a)| a)
        .map_or(0, |a| a.parse().expect("device ordinal"));
    let dev = Device::new(ordinal);
    let name = cudarc::driver::result::device::get_name(check(cu::device::get(ordinal as i32), "device")).unwrap();
    let cache_bytes: u64 = 9 << 30;
    // SAFETY: a plain allocation on the context bound to this thread.
    let cache = unsafe { check(cu::malloc_sync(cache_bytes as usize), "cache") };
    {
        let mut p = cache;
        let mut n = cache_bytes / 8;
        let mut seed = 0x1234_5678u64;
        dev.launch(
            dev.fill,
            132 * 16,
            &mut [
                (&mut p as *mut u64).cast(),
                (&mut n as *mut u64).cast(),
                (&mut seed as *mut u64).cast(),
            ],
        );
        dev.sync();
    }
    let llama = Model {
        name: "Llama-3.1-8B bf16",
        layers: 32,
        heads: 8,
        k_bytes: 256,
        v_bytes: 256,
        block_size: 16,
    };
    let fp8 = Model {
        name: "Llama-3.1-8B fp8",
        layers: 32,
        heads: 8,
        k_bytes: 128,
        v_bytes: 128,
        block_size: 16,
    };
    let mla = Model {
        name: "MLA 61x576 bf16",
        layers: 61,
        heads: 1,
        k_bytes: 1152,
        v_bytes: 0,
        block_size: 16,
    };
    // GQA at TP 8: Llama-3.1-70B's 8 KV heads over 8 ranks leave one head
    // per rank in each of its 80 layers, so the call runs the single-head
    // kernel form, as MLA does.
    let tp8 = Model {
        name: "Llama-3.1-70B bf16, TP 8 rank",
        layers: 80,
        heads: 1,
        k_bytes: 256,
        v_bytes: 256,
        block_size: 16,
    };
    // vLLM's sparse-attention indexer (DeepSeek V3.2): 128 fp8 key bytes
    // and a 4-byte scale a token, each block its keys then their scales
    // (HND with V after K), 64-token blocks: cells of 4-byte pieces, which
    // `kvcs_checksum_narrow` reads.
    let indexer = Model {
        name: "DeepSeek V3.2 indexer 61x(128+4) fp8",
        layers: 61,
        heads: 1,
        k_bytes: 128,
        v_bytes: 4,
        block_size: 64,
    };
    println!(
        "device: {name}; cache buffer {} GiB; date-stamped by the caller",
        cache_bytes >> 30
    );
    println!();
    if let Some(seconds) = sustain {
        sustained(
            &dev,
            cache,
            cache_bytes,
            &[(&llama, Layout::Hnd), (&fp8, Layout::Hnd), (&llama, Layout::Nhd)],
            seconds,
        );
        return;
    }
    println!(
        "| cache | layout | case | bytes read | read ceiling GB/s | WEIGHTED GB/s | fraction | MIXED2 GB/s | fraction | MIXED2 - WEIGHTED |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let cases: [(&Model, Layout, &str, usize, usize); 12] = [
        (&llama, Layout::Hnd, "2048 blocks (128 req x 16)", 128, 16),
        (&llama, Layout::Nhd, "2048 blocks (128 req x 16)", 128, 16),
        (&llama, Layout::KvSplit, "2048 blocks (128 req x 16)", 128, 16),
        (&llama, Layout::Hnd, "1 request, 2048 tokens", 1, 128),
        (&llama, Layout::Nhd, "1 request, 2048 tokens", 1, 128),
        (&llama, Layout::KvSplit, "1 request, 2048 tokens", 1, 128),
        (&mla, Layout::Hnd, "2048 blocks (128 req x 16)", 128, 16),
        (&fp8, Layout::Hnd, "2048 blocks (128 req x 16)", 128, 16),
        (&fp8, Layout::KvSplit, "2048 blocks (128 req x 16)", 128, 16),
        (&tp8, Layout::Hnd, "2048 blocks (128 req x 16)", 128, 16),
        (&tp8, Layout::KvSplit, "2048 blocks (128 req x 16)", 128, 16),
        (&indexer, Layout::Hnd, "2048 blocks, keys then scales", 128, 16),
    ];
    for (i, (model, layout, label, requests, per_request)) in cases.into_iter().enumerate() {
        if host_only || only.is_some_and(|n| n != i) {
            continue;
        }
        let case = build_case(
            &dev,
            cache,
            cache_bytes,
            model,
            layout,
            requests,
            per_request,
            0x9E37 + i as u64,
        );
        if i == 0 {
            println!("{}", case.worker.engine_description());
            println!();
        }
        let ceiling = ceiling_ms(&dev, &case);
        let weighted = checksum_ms(&dev, &case, &case.weighted);
        let mixed = checksum_ms(&dev, &case, &case.worker);
        let gbs = |ms: f64| case.bytes as f64 / ms / 1e6;
        let layout_name = layout.name();
        println!(
            "| {} | {layout_name} | {label} | {:.0} MiB | {:.0} | {:.0} | {:.3} | {:.0} | {:.3} | {:+.3} |",
            model.name,
            case.bytes as f64 / (1 << 20) as f64,
            gbs(ceiling),
            gbs(weighted),
            ceiling / weighted,
            gbs(mixed),
            ceiling / mixed,
            ceiling / mixed - ceiling / weighted
        );
    }

    // One block x 32 layers. (a) Call to event: a timing event, the call,
    // its work, a timing event, on an idle stream (so the host's part of the
    // call is in it). (b) The same work queued behind a busy stream (GPU time
    // only). (c) Host wall time from the call to a ready result. (d) Host
    // time inside the call.
    if only.is_some() {
        return;
    }
    let one = build_case(&dev, cache, cache_bytes, &llama, Layout::Hnd, 1, 1, 7);
    let busy = build_case(&dev, cache, cache_bytes, &llama, Layout::Hnd, 128, 16, 8);
    let call_to_event_us = dev.time(200, 1, || {
        drop(
            one.worker
                .checksum(&one.blocks, Role::Consumer, StreamHandle(dev.stream.cast()))
                .unwrap(),
        );
    }) * 1e3;
    let checksum_one = || {
        drop(
            one.worker
                .checksum(&one.blocks, Role::Consumer, StreamHandle(dev.stream.cast()))
                .unwrap(),
        )
    };
    let queued_us = queued_ms(&dev, &busy, checksum_one) * 1e3;
    // The read ceiling of the same 2 MiB: its own launch to event on an idle
    // stream, and queued the same way.
    let one_blocks = one.num_chunks as u32;
    let read_call_to_event_us = dev.time(200, 1, || read_case(&dev, &one, one_blocks)) * 1e3;
    let read_queued_us = queued_ms(&dev, &busy, || read_case(&dev, &one, one_blocks)) * 1e3;
    let mut wall = Vec::new();
    let mut inside = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        let r = one
            .worker
            .checksum(&one.blocks, Role::Consumer, StreamHandle(dev.stream.cast()))
            .unwrap();
        inside.push(t.elapsed().as_secs_f64() * 1e6);
        while !r.is_ready().unwrap() {}
        wall.push(t.elapsed().as_secs_f64() * 1e6);
    }
    wall.sort_by(f64::total_cmp);
    inside.sort_by(f64::total_cmp);
    // The floor of any one-launch call on this host: a bare launch of the
    // read kernel plus an event record, the two driver calls a checksum call
    // makes at least.
    let floor_event = check(cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING), "event");
    // Its two parts apart: the launch alone, the event record alone.
    // And a launch of a kernel whose parameter is as large as
    // kvcs_checksum's (one block, reading nothing).
    let (mut bare, mut launch_only, mut record_only, mut big) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut blob = [0u64; 122];
    let mut sink = dev.sink;
    for _ in 0..200 {
        let t = Instant::now();
        read_case(&dev, &one, one_blocks);
        // SAFETY: events created above and the device's own stream, all alive.
        unsafe { check(cu::event::record(floor_event, dev.stream), "record") };
        bare.push(t.elapsed().as_secs_f64() * 1e6);
        dev.sync();
        let t = Instant::now();
        read_case(&dev, &one, one_blocks);
        launch_only.push(t.elapsed().as_secs_f64() * 1e6);
        dev.sync();
        let t = Instant::now();
        // SAFETY: events created above and the device's own stream, all alive.
        unsafe { check(cu::event::record(floor_event, dev.stream), "record") };
        record_only.push(t.elapsed().as_secs_f64() * 1e6);
        dev.sync();
        let t = Instant::now();
        dev.launch(
            dev.big_params,
            1,
            &mut [(&mut blob as *mut [u64; 122]).cast(), (&mut sink as *mut u64).cast()],
        );
        big.push(t.elapsed().as_secs_f64() * 1e6);
        dev.sync();
    }
    // SAFETY: events created above; the stream is synchronized, so no record of them is
    // pending, and they are not used again.
    unsafe {
        let _ = cu::event::destroy(floor_event);
    }
    for times in [&mut bare, &mut launch_only, &mut record_only, &mut big] {
        times.sort_by(f64::total_cmp);
    }
    println!();
    println!("| measurement | median |");
    println!("|---|---:|");
    println!(
        "| 1 block x 32 layers (2 MiB): call to event, GPU timeline of an idle stream | {call_to_event_us:.2} us |"
    );
    println!("| 1 block x 32 layers: GPU time per call, queued behind busy work | {queued_us:.2} us |");
    println!("| the read ceiling kernel over the same 2 MiB, queued the same way | {read_queued_us:.2} us |");
    println!(
        "| the read ceiling kernel over the same 2 MiB: launch to event, idle stream | {read_call_to_event_us:.2} us |"
    );
    println!(
        "| 1 block x 32 layers: host wall time, call to result ready | {:.2} us |",
        wall[wall.len() / 2]
    );
    println!(
        "| 1 block x 32 layers: host time inside checksum | {:.2} us |",
        inside[inside.len() / 2]
    );
    println!(
        "| host time of a bare launch of the read kernel plus an event record (the floor of a call) | {:.2} us |",
        bare[bare.len() / 2]
    );
    println!(
        "| of which: the launch alone / the event record alone (each on an idle stream) | {:.2} / {:.2} us |",
        launch_only[launch_only.len() / 2],
        record_only[record_only.len() / 2]
    );
    println!(
        "| a launch of a kernel with a 976-byte parameter (kvcs_checksum's size), one block | {:.2} us |",
        big[big.len() / 2]
    );

    // Host time inside checksum for 128 requests of 16 blocks, and the part
    // of it that checks and lays out the blocks (the plan).
    let many = build_case(&dev, cache, cache_bytes, &llama, Layout::Hnd, 128, 16, 11);
    let mut host = Vec::new();
    let mut plan = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        let r = many
            .worker
            .checksum(&many.blocks, Role::Consumer, StreamHandle(dev.stream.cast()))
            .unwrap();
        host.push(t.elapsed().as_secs_f64() * 1e6);
        r.wait().unwrap();
        let t = Instant::now();
        let p = kvcsum::Plan::new(many.worker.layout(), &many.blocks, Role::Consumer).unwrap();
        plan.push(t.elapsed().as_secs_f64() * 1e6);
        drop(p);
    }
    // Back to back, as a busy engine calls it: up to 4 calls in flight.
    let mut in_flight = std::collections::VecDeque::new();
    let mut steady = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        let r = many
            .worker
            .checksum(&many.blocks, Role::Consumer, StreamHandle(dev.stream.cast()))
            .unwrap();
        steady.push(t.elapsed().as_secs_f64() * 1e6);
        in_flight.push_back(r);
        if in_flight.len() > 4 {
            in_flight.pop_front().unwrap().wait().unwrap();
        }
    }
    drop(in_flight);
    host.sort_by(f64::total_cmp);
    plan.sort_by(f64::total_cmp);
    steady.sort_by(f64::total_cmp);
    println!(
        "| 128 requests x 16 blocks, host time inside checksum, after waiting for the last | {:.2} us |",
        host[host.len() / 2]
    );
    println!(
        "| 128 requests x 16 blocks, host time inside checksum, back to back (4 in flight) | {:.2} us |",
        steady[steady.len() / 2]
    );
    println!(
        "| of which: checking and laying out the blocks (Plan::new) | {:.2} us |",
        plan[plan.len() / 2]
    );
    if !host_only {
        if let Some(seconds) = settle {
            dev.sync();
            std::thread::sleep(std::time::Duration::from_secs_f64(seconds));
            println!();
            println!("(the card idled {seconds} s before the stored table)");
        }
        stored_checksums(&dev, cache, cache_bytes, &llama);
    }
}

/// Milliseconds per call of `work` run back to back for `seconds`: the
/// median over batches of 10 calls in the second half (the card has by then
/// settled into the clocks and power that this work leaves it).
fn sustained_ms(dev: &Device, seconds: f64, mut work: impl FnMut()) -> f64 {
    let start = check(cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT), "event");
    let stop = check(cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT), "event");
    let began = Instant::now();
    let mut times = Vec::new();
    while began.elapsed().as_secs_f64() < seconds {
        // SAFETY: events created above and the device's own stream, all alive.
        unsafe { check(cu::event::record(start, dev.stream), "record") };
        for _ in 0..10 {
            work();
        }
        // SAFETY: events created above and the device's own stream, all alive.
        unsafe { check(cu::event::record(stop, dev.stream), "record") };
        dev.sync();
        if began.elapsed().as_secs_f64() >= seconds / 2.0 {
            // SAFETY: both events were recorded, and have completed (the stream is
            // synchronized).
            times.push(unsafe { check(cu::event::elapsed(start, stop), "elapsed") } as f64 / 10.0);
        }
    }
    // SAFETY: events created above; the stream is synchronized, so no record of them is
    // pending, and they are not used again.
    unsafe {
        let _ = cu::event::destroy(start);
        let _ = cu::event::destroy(stop);
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// The sustained table (`--sustain S`): per case, the read ceiling, WEIGHTED
/// and MIXED2 each run alone back to back for S seconds (then 2 s idle),
/// as fractions of the sustained read ceiling.
fn sustained(dev: &Device, cache: u64, cache_bytes: u64, cases: &[(&Model, Layout)], seconds: f64) {
    println!("sustained: each kernel back to back for {seconds} s alone, timed over its last half, 2 s idle between");
    println!();
    println!("| cache | layout | bytes read | read ceiling GB/s | WEIGHTED GB/s | fraction | MIXED2 GB/s | fraction | MIXED2 - WEIGHTED |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let idle = || std::thread::sleep(std::time::Duration::from_secs(2));
    for (i, &(model, layout)) in cases.iter().enumerate() {
        let case = build_case(dev, cache, cache_bytes, model, layout, 128, 16, 0x5EED + i as u64);
        let checksum = |worker: &Worker| {
            drop(
                worker
                    .checksum(&case.blocks, Role::Consumer, StreamHandle(dev.stream.cast()))
                    .unwrap(),
            )
        };
        idle();
        let ceiling = sustained_ms(dev, seconds, || read_case(dev, &case, 132 * 8));
        idle();
        let weighted = sustained_ms(dev, seconds, || checksum(&case.weighted));
        idle();
        let mixed = sustained_ms(dev, seconds, || checksum(&case.worker));
        let gbs = |ms: f64| case.bytes as f64 / ms / 1e6;
        let layout_name = layout.name();
        println!(
            "| {} | {layout_name} | {:.0} MiB | {:.0} | {:.0} | {:.3} | {:.0} | {:.3} | {:+.3} |",
            model.name,
            case.bytes as f64 / (1 << 20) as f64,
            gbs(ceiling),
            gbs(weighted),
            ceiling / weighted,
            gbs(mixed),
            ceiling / mixed,
            ceiling / mixed - ceiling / weighted
        );
    }
}

/// Stored checksums (SPEC section 8) on the device: a store (the checksum
/// kernel, then the kernel writing `sum ^ tag` per block into a buffer in
/// device memory) and a load check (the checksum, then the gather of the
/// stored values) against the checksum alone, each as a fraction of the
/// read ceiling of the same bytes, on a 4 GiB batch and on one request.
fn stored_checksums(dev: &Device, cache: u64, cache_bytes: u64, model: &Model) {
    println!();
    println!(
        "| stored checksums, {} HND | bytes read | read ceiling | checksum, no stored buffer | checksum | WEIGHTED checksum | store | load check |",
        model.name
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let block_bytes = (model.heads * model.block_size * (model.k_bytes + model.v_bytes)) as u64;
    let num_blocks = cache_bytes / model.layers as u64 / block_bytes;
    // SAFETY: a fresh device allocation of 16 bytes per block id (an entry:
    // value, then stamp; SPEC section 8), freed below. (It was 8 bytes per
    // block id: add_stored accepted it because the range ran on into the
    // next allocation, and stores then wrote entries past its end.)
    const ENTRY_BYTES: usize = 16;
    // SAFETY: a plain allocation on the context bound to this thread.
    let buffer = unsafe { check(cu::malloc_sync(num_blocks as usize * ENTRY_BYTES), "stored buffer") };
    let mut host_times = Vec::new();
    for (label, requests, per_request) in [
        ("2048 blocks (128 req x 16)", 128, 16),
        ("1 request, 2048 tokens", 1, 128),
    ] {
        let mut case = build_case(
            dev,
            cache,
            cache_bytes,
            model,
            Layout::Hnd,
            requests,
            per_request,
            0x5703,
        );
        // The same call before the worker has a stored buffer and the
        // blocks have hashes: a plain checksum does no stored work, so the
        // two should match (in one process, same bytes, same clocks).
        let ceiling = ceiling_ms(dev, &case);
        let bare = checksum_ms(dev, &case, &case.worker);
        case.worker.add_stored(0, buffer, num_blocks).expect("add_stored");
        for r in 0..requests {
            let hashes: Vec<u8> = (0..per_request * 32).map(|i| (i * 131 + r * 7) as u8).collect();
            case.blocks.set_hashes(&format!("req-{r}"), 0, &hashes, 32).unwrap();
        }
        let stream = StreamHandle(dev.stream.cast());
        let plain = checksum_ms(dev, &case, &case.worker);
        // WEIGHTED (no mixing) on the same bytes: where MIXED2 falls behind
        // it here but not in the main table, the card computes slower now
        // (clocks), not the call.
        let weighted = checksum_ms(dev, &case, &case.weighted);
        let store = dev.time(7, 3, || drop(case.worker.store(&case.blocks, stream).unwrap()));
        let load = dev.time(7, 3, || drop(case.worker.check_stored(&case.blocks, stream).unwrap()));
        // Host time inside each call (median of 51), to tell the host's
        // part of the difference from the device's.
        let host_us = |f: &dyn Fn() -> kvcsum::Checksums| {
            let mut times: Vec<f64> = (0..51)
                .map(|_| {
                    let t = Instant::now();
                    let r = f();
                    let us = t.elapsed().as_secs_f64() * 1e6;
                    r.wait().unwrap();
                    us
                })
                .collect();
            times.sort_by(f64::total_cmp);
            times[times.len() / 2]
        };
        let host = [
            host_us(&|| case.worker.checksum(&case.blocks, Role::Consumer, stream).unwrap()),
            host_us(&|| case.worker.store(&case.blocks, stream).unwrap()),
            host_us(&|| case.worker.check_stored(&case.blocks, stream).unwrap()),
        ];
        host_times.push((label, host));
        let cell = |ms: f64| format!("{:.1} us ({:.3})", ms * 1e3, ceiling / ms);
        println!(
            "| {label} | {:.0} MiB | {:.1} us | {} | {} | {} | {} | {} |",
            case.bytes as f64 / (1 << 20) as f64,
            ceiling * 1e3,
            cell(bare),
            cell(plain),
            cell(weighted),
            cell(store),
            cell(load)
        );
    }
    println!("(each time: median per call; in parentheses the read ceiling's time over it)");
    for (label, [checksum, store, load]) in host_times {
        println!(
            "host time inside the call, {label}: checksum {checksum:.1} us, store {store:.1} us, load check {load:.1} us"
        );
    }
    dev.sync();
    // SAFETY: nothing reads or writes it any more (synchronised).
    unsafe {
        let _ = cu::free_sync(buffer);
    }
}
