//! The host engine: computes a plan's partial checksums from host memory,
//! split over threads. Every slice is read once; contributions are added
//! with wrapping arithmetic, so the order (and the thread count) does not
//! change any value.
//!
//! Each host worker owns one [`HostEngine`], whose helper threads are started
//! on its first call that is large enough to split, parked between calls, and
//! joined when the worker is dropped (see [`crate::pool`]). One pool per
//! worker rather than one per process: no thread outlives the workers (so
//! the library holds nothing once the last is destroyed, and can be
//! unloaded), and each worker's `num_threads` means what it says. A process
//! with several host workers that call at once could oversubscribe; it
//! gives them fewer threads each.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::checksum::{piece_weight, run_checksum, slice_weight, Algorithm, Identity, Mix, Mix2, PieceFn, PIECE_BYTES};
use crate::error::{err, Result};
use crate::layout::{Layer, Layout, Region, Role, Segment};
use crate::plan::{Plan, Row};
use crate::pool::Pool;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod lanes;

#[cfg(target_arch = "x86_64")]
use avx2::{Avx2, Avx2Lanes};
#[cfg(target_arch = "x86_64")]
use avx512::{Avx512, Avx512Lanes};
#[cfg(target_arch = "x86_64")]
use lanes::Mix2Lanes;

/// Work items handed to a thread at a time.
const ITEMS_PER_GRAB: usize = 16;

/// Below this many bytes a call runs on the calling thread alone.
const MIN_BYTES_PER_THREAD: u64 = 4 << 20;

/// The most threads a host worker may use (`num_threads` or
/// `KVCS_HOST_THREADS`); a bound, so that a wild value is an error rather
/// than thousands of threads.
pub const MAX_HOST_THREADS: u32 = 256;

/// The environment variable that sets the thread count of workers created
/// with `num_threads` 0.
pub const THREADS_VARIABLE: &str = "KVCS_HOST_THREADS";

/// The environment variable that caps the SIMD form of the host engine's
/// mixing (`avx512`, `avx2` or `portable`; unset: the best the CPU runs),
/// read when a host worker is created. For measurements
/// (`benches/host_bench.rs`) and for ruling a SIMD form out; every form
/// gives the same values.
pub const SIMD_VARIABLE: &str = "KVCS_HOST_SIMD";

/// The SIMD form the host engine's mixing runs in (see [`item_checksum_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Simd {
    /// Plain Rust, vectorised only as far as the compiler does by itself.
    Portable,
    /// AVX2 builds and intrinsics (x86-64 CPUs that have AVX2).
    Avx2,
    /// AVX-512F intrinsics for MIXED2 (x86-64 CPUs that have AVX-512F).
    Avx512,
}

impl Simd {
    /// Its name, for logs and [`SIMD_VARIABLE`]: "avx512", "avx2", "portable".
    pub fn name(self) -> &'static str {
        match self {
            Simd::Portable => "portable",
            Simd::Avx2 => "avx2",
            Simd::Avx512 => "avx512",
        }
    }
}

/// A [`Simd`] form with what lets it run: the detection token of its
/// instruction set (`host/avx2.rs`, `host/avx512.rs`), which exists only
/// where the CPU has them. The engine picks one when it is created.
#[derive(Debug, Clone, Copy)]
enum Form {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2(Avx2),
    #[cfg(target_arch = "x86_64")]
    Avx512(Avx512),
}

impl Form {
    /// The best form this CPU runs.
    fn best() -> Form {
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(isa) = Avx512::new() {
                return Form::Avx512(isa);
            }
            if let Some(isa) = Avx2::new() {
                return Form::Avx2(isa);
            }
        }
        Form::Portable
    }

    /// Which form it is.
    fn simd(self) -> Simd {
        match self {
            Form::Portable => Simd::Portable,
            #[cfg(target_arch = "x86_64")]
            Form::Avx2(_) => Simd::Avx2,
            #[cfg(target_arch = "x86_64")]
            Form::Avx512(_) => Simd::Avx512,
        }
    }

    /// This form, or the lower `cap` where it is below it (a form is never
    /// raised: a token is never made up).
    fn capped(self, cap: Simd) -> Form {
        match (self, cap) {
            #[cfg(target_arch = "x86_64")]
            (Form::Avx512(isa), Simd::Avx2) => Form::Avx2(isa.avx2()),
            (_, Simd::Portable) => Form::Portable,
            (form, _) => form,
        }
    }
}

/// At most this many threads by default, however many cores there are:
/// eight ranks of four threads are 32 streams reading memory at once, which
/// is about what a server's memory channels feed; more would mostly wait on
/// memory while taking cores from the serving engine. A host that wants
/// more sets `KVCS_HOST_THREADS` or `num_threads`.
const DEFAULT_MAX_THREADS: usize = 4;

/// The default assumes this many rank processes share the host's cores
/// (one per GPU of a usual 8-GPU server), so that they do not oversubscribe it.
const DEFAULT_RANKS_PER_HOST: usize = 8;

/// The host engine of a worker: its thread count and, once a call needed
/// more than one thread, its helper threads (one fewer than the thread
/// count: the calling thread works too).
pub struct HostEngine {
    threads: usize,
    pool: OnceLock<Pool>,
    form: Form,
}

impl HostEngine {
    /// An engine of `num_threads` threads; 0 picks the default: the value
    /// of `KVCS_HOST_THREADS` when set, else a share of the cores this
    /// process may run on (see [`default_threads`]). Starts no thread.
    pub fn new(num_threads: u32) -> Result<HostEngine> {
        let threads = match num_threads {
            0 => match std::env::var(THREADS_VARIABLE) {
                Ok(text) => match text.trim().parse::<u32>() {
                    Ok(n) if (1..=MAX_HOST_THREADS).contains(&n) => n as usize,
                    _ => {
                        return Err(err!(
                            InvalidArgument,
                            "{THREADS_VARIABLE} {text:?} is not a thread count from 1 to {MAX_HOST_THREADS}"
                        ))
                    }
                },
                Err(_) => default_threads(),
            },
            n if n > MAX_HOST_THREADS => {
                return Err(err!(
                    InvalidArgument,
                    "num_threads {n} is above the maximum {MAX_HOST_THREADS}"
                ))
            }
            n => n as usize,
        };
        let best = Form::best();
        let cap = match std::env::var(SIMD_VARIABLE) {
            Err(_) => best.simd(),
            Ok(text) => match [Simd::Avx512, Simd::Avx2, Simd::Portable]
                .into_iter()
                .find(|form| form.name() == text.trim())
            {
                // A cap: a form the CPU lacks is never run.
                Some(form) => form,
                None => {
                    return Err(err!(
                        InvalidArgument,
                        "{SIMD_VARIABLE} {text:?} is not avx512, avx2 or portable"
                    ))
                }
            },
        };
        Ok(HostEngine {
            threads,
            pool: OnceLock::new(),
            form: best.capped(cap),
        })
    }

    /// The SIMD form the engine's mixing runs in.
    pub fn simd(&self) -> Simd {
        self.form.simd()
    }

    /// The most threads a call uses.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Helper threads running: 0 until a call needed more than one thread,
    /// then one fewer than [`HostEngine::threads`] (fewer where the system
    /// refused to start some).
    pub fn helpers(&self) -> usize {
        self.pool.get().map_or(0, Pool::helpers)
    }

    /// Computes the values of `plan` (whose rows are `rows`) with
    /// `algorithm`, on up to [`HostEngine::threads`] threads. Calls may run
    /// concurrently; each gets what helpers are free.
    ///
    /// The layout's registration checks guarantee every address read lies in
    /// a registered region; the caller of [`crate::Worker::add_region`]
    /// promised those are readable host memory.
    pub fn compute(&self, layout: &Layout, plan: &Plan, rows: &[Row], role: Role, algorithm: Algorithm) -> Vec<u64> {
        let mut items = Vec::new();
        let mut total_bytes = 0u64;
        for row in rows {
            let group = layout.group_in_slot(row.group_slot);
            let columns = group.columns(role);
            for layer in &group.layers {
                if let Ok(column) = columns.binary_search(&layer.spec.replica) {
                    items.push(Item { row, layer, column });
                    total_bytes +=
                        row.valid_tokens as u64 * layer.spec.num_heads as u64 * layer.pieces_per_token * PIECE_BYTES;
                }
            }
        }
        let values: Vec<AtomicU64> = (0..plan.num_values).map(|_| AtomicU64::new(0)).collect();
        let useful_threads = (total_bytes / MIN_BYTES_PER_THREAD).max(1) as usize;
        let threads = self.threads.clamp(1, useful_threads);
        let next = AtomicUsize::new(0);
        let work = || {
            // Per-head accumulators for token-outer walks, reused across items.
            let mut scratch = Vec::new();
            loop {
                let start = next.fetch_add(ITEMS_PER_GRAB, Ordering::Relaxed);
                if start >= items.len() {
                    break;
                }
                for item in &items[start..(start + ITEMS_PER_GRAB).min(items.len())] {
                    let sum = item_checksum_of(algorithm, self.form, item.row, item.layer, &mut scratch);
                    let out = item.row.out as usize + item.column * item.row.column_stride as usize;
                    values[out].fetch_add(sum, Ordering::Relaxed);
                }
            }
        };
        if threads == 1 {
            work();
        } else {
            let pool = self.pool.get_or_init(|| Pool::new(self.threads - 1, "kvcsum-host"));
            pool.run(threads - 1, &work);
        }
        let mut values: Vec<u64> = values.into_iter().map(AtomicU64::into_inner).collect();
        add_states(layout, rows, algorithm, &mut values);
        values
    }
}

/// The thread count of `num_threads` 0 without `KVCS_HOST_THREADS`: the
/// cores this process may run on (its affinity mask and CPU quota) divided
/// by 8, the usual number of rank processes per host, between 1 and 4.
pub fn default_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / DEFAULT_RANKS_PER_HOST).clamp(1, DEFAULT_MAX_THREADS)
}

/// One (row, layer) pair: a block position in one layer.
#[derive(Clone, Copy)]
struct Item<'a> {
    row: &'a Row,
    layer: &'a Layer,
    column: usize,
}

/// Adds the state layers' checksums (SPEC section 6) of the rows of state
/// groups among `rows`, on the calling thread.
fn add_states(layout: &Layout, rows: &[Row], algorithm: Algorithm, values: &mut [u64]) {
    for row in rows {
        for state in layout.group_in_slot(row.group_slot).states() {
            let value = &mut values[row.out as usize];
            *value = value.wrapping_add(state.block_checksum(row.block_id, algorithm));
        }
    }
}

/// [`item_checksum`] under `algorithm`, in the form `form`.
///
/// MIXED's 64-bit products vectorise only with AVX2 (SSE2, the default
/// target, has no 64-bit lane multiply: in cache the mixed loop ran at 6
/// GB/s with SSE2 and 24 GB/s with AVX2, against 22 GB/s for WEIGHTED's
/// adds), so where the CPU has AVX2 it runs an AVX2 build of the same code.
/// MIXED2's rounds are 32x32->64 multiplies, which the compiler does not
/// reliably vectorise by itself: [`lanes::Mix2Lanes`] writes them once over
/// a lane type, with an AVX2 and an AVX-512F lane type (BENCHMARKS.md,
/// "Mixing function choice").
///
/// Each SIMD arm runs only with the detection token its [`Form`] holds, so
/// no form runs on a CPU without its instructions.
fn item_checksum_of(algorithm: Algorithm, form: Form, row: &Row, layer: &Layer, scratch: &mut Vec<RowSums>) -> u64 {
    match (algorithm, form) {
        (Algorithm::Weighted, _) => item_checksum(Identity, row, layer, scratch),
        (Algorithm::Mixed, Form::Portable) => item_checksum(Mix, row, layer, scratch),
        (Algorithm::Mixed2, Form::Portable) => item_checksum(Mix2, row, layer, scratch),
        #[cfg(target_arch = "x86_64")]
        (Algorithm::Mixed, Form::Avx2(isa)) => isa.item_checksum(Mix, row, layer, scratch),
        #[cfg(target_arch = "x86_64")]
        (Algorithm::Mixed, Form::Avx512(isa)) => isa.avx2().item_checksum(Mix, row, layer, scratch),
        #[cfg(target_arch = "x86_64")]
        (Algorithm::Mixed2, Form::Avx2(isa)) => isa.item_checksum(Mix2Lanes::<Avx2Lanes>(isa), row, layer, scratch),
        #[cfg(target_arch = "x86_64")]
        (Algorithm::Mixed2, Form::Avx512(isa)) => isa.item_checksum(Mix2Lanes::<Avx512Lanes>(isa), row, layer, scratch),
    }
}

/// `sum over heads of m * s` for one block position of one layer, `f` of
/// SPEC section 12 fixed at compile time (`F`). Inlined into its callers,
/// so that an AVX2 caller (`host/avx2.rs`) builds it with AVX2.
#[inline(always)]
fn item_checksum<F: PieceFn>(f: F, row: &Row, layer: &Layer, scratch: &mut Vec<RowSums>) -> u64 {
    let spec = &layer.spec;
    let per_kernel_block = spec.tokens_per_kernel_block;
    let mut sum = 0u64;
    let mut token = 0u32;
    // Walk the valid tokens kernel block by kernel block.
    while token < row.valid_tokens {
        let kernel_block = token / per_kernel_block;
        let first_slot = token % per_kernel_block;
        let count = (per_kernel_block - first_slot).min(row.valid_tokens - token);
        let first_index = (row.first_token + token as u64).wrapping_mul(layer.pieces_per_token);
        for (segment, &piece_offset) in spec.segments.iter().zip(&layer.segment_piece_offsets) {
            let base = segment.address as i64
                + row.block_id as i64 * segment.block_stride
                + kernel_block as i64 * segment.kernel_block_stride
                + first_slot as i64 * segment.token_stride;
            let tokens = TokenRun {
                address: base,
                count,
                first_index: first_index + piece_offset,
            };
            sum = sum.wrapping_add(segment_heads(f, layer, segment, &tokens, scratch));
        }
        token += count;
    }
    sum
}

/// `count` consecutive tokens of one kernel block in one segment: head 0's
/// first token at `address`, its first piece numbered `first_index`.
struct TokenRun {
    address: i64,
    count: u32,
    first_index: u64,
}

/// `sum over heads of m * (the slice contribution of the tokens)` for one
/// segment.
///
/// Memory is read in the order it is laid out, so that the hardware
/// prefetchers stream it: heads outer when a head's tokens are closer
/// together than a token's heads (HND), tokens outer otherwise (NHD; reading
/// NHD heads outer ran at 0.6-0.7 of the read ceiling). Each (head, token)
/// row of pieces is added into per-head [`RowSums`], reduced once per head
/// rather than once per row.
#[inline(always)]
fn segment_heads<F: PieceFn>(
    f: F,
    layer: &Layer,
    segment: &Segment,
    tokens: &TokenRun,
    scratch: &mut Vec<RowSums>,
) -> u64 {
    let spec = &layer.spec;
    let pieces = (segment.bytes_per_token as u64 / PIECE_BYTES) as usize;
    let token_stride = segment.token_stride;
    let head_stride = segment.head_stride;
    let heads_outer = token_stride.unsigned_abs() <= head_stride.unsigned_abs();
    let weight = |head: u32| slice_weight(spec.layer_number, spec.first_head + head);
    let row = |head: u32, slot: u32| {
        debug_assert!(head < spec.num_heads && slot < tokens.count);
        // SAFETY: every call below passes a head below `num_heads` and a
        // slot below the run's count, and registration checked that every
        // (block, kernel block, head, token) cell of this segment lies in a
        // registered region, which the caller of `add_region` promised is
        // readable host memory.
        unsafe {
            host_pieces(
                tokens.address + head as i64 * head_stride + slot as i64 * token_stride,
                pieces as u64,
            )
        }
    };
    let slice_sum = |sums: &RowSums| sums.weighted(pieces as u64, tokens.first_index, layer.pieces_per_token);
    let mut sum = 0u64;
    if spec.segments.len() == 1 && token_stride == segment.bytes_per_token as i64 {
        // A head's tokens are one run of consecutive pieces.
        for head in 0..spec.num_heads {
            // SAFETY: as above; the run is the head's `count` cells.
            let run = unsafe {
                host_pieces(
                    tokens.address + head as i64 * head_stride,
                    (pieces * tokens.count as usize) as u64,
                )
            };
            sum = sum.wrapping_add(weight(head).wrapping_mul(run_checksum(f, run, tokens.first_index)));
        }
    } else if !pieces.is_multiple_of(LANES) {
        // Rows that do not fill whole lanes: reduce each row on its own.
        let row_index = |slot: u32| {
            tokens
                .first_index
                .wrapping_add((slot as u64).wrapping_mul(layer.pieces_per_token))
        };
        let row_sum =
            |head: u32, slot: u32| weight(head).wrapping_mul(run_checksum(f, row(head, slot), row_index(slot)));
        if heads_outer {
            for head in 0..spec.num_heads {
                for slot in 0..tokens.count {
                    sum = sum.wrapping_add(row_sum(head, slot));
                }
            }
        } else {
            for slot in 0..tokens.count {
                for head in 0..spec.num_heads {
                    sum = sum.wrapping_add(row_sum(head, slot));
                }
            }
        }
    } else if heads_outer {
        for head in 0..spec.num_heads {
            let mut sums = RowSums::default();
            // The next head's rows, one head ahead (see PREFETCH_TOKENS).
            let prefetch = head + 1 < spec.num_heads;
            for slot in 0..tokens.count {
                let pieces = row(head, slot);
                if prefetch {
                    prefetch_row(pieces, head_stride);
                }
                sums.add_row(f, pieces);
            }
            sum = sum.wrapping_add(weight(head).wrapping_mul(slice_sum(&sums)));
        }
    } else {
        scratch.clear();
        scratch.resize(spec.num_heads as usize, RowSums::default());
        for slot in 0..tokens.count {
            let prefetch = slot + PREFETCH_TOKENS < tokens.count;
            for (head, sums) in scratch.iter_mut().enumerate() {
                let pieces = row(head as u32, slot);
                if prefetch {
                    prefetch_row(pieces, PREFETCH_TOKENS as i64 * token_stride);
                }
                sums.add_row(f, pieces);
            }
        }
        for (head, sums) in scratch.iter().enumerate() {
            sum = sum.wrapping_add(weight(head as u32).wrapping_mul(slice_sum(sums)));
        }
    }
    sum
}

/// How many tokens ahead a token-outer walk prefetches. A token's heads
/// are one short contiguous stretch (2 KiB for 8 heads of 256 bytes), too
/// short for the hardware prefetchers to run far enough ahead on their own;
/// fetching two tokens ahead lifted NHD from about 0.88 to 0.97 of the read
/// ceiling in `benches/host_bench.rs`. Heads-outer walks over rows of whole
/// lanes prefetch the same row of the next head (4 KiB ahead for 16 tokens
/// of 256 bytes): on the 2-core AMD machine that changed nothing, but on
/// the GPU host's Xeon one thread went from 0.77 to 1.05 of the read (HND,
/// K and V apart), where the hardware prefetchers alone did not keep enough
/// lines in flight.
const PREFETCH_TOKENS: u32 = 2;

/// Asks for the cache lines of the row that lies `offset` bytes past `row`.
#[inline(always)]
fn prefetch_row(row: &[u64], offset: i64) {
    let ahead = row.as_ptr().wrapping_byte_offset(offset as isize);
    for line in (0..row.len()).step_by(LANES) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is a hint that never faults, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ahead.wrapping_add(line).cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = ahead.wrapping_add(line);
    }
}

/// Lanes of [`RowSums`]: eight pieces, one cache line.
const LANES: usize = 8;

/// Pages whose residency one `mincore` call reports: the vector it fills
/// is one byte per page, so a region of any size is checked with this
/// fixed buffer (16 MiB of 4 KiB pages per call; a 100 GiB region takes
/// 1,600 calls).
const MINCORE_PAGES: usize = 4096;

/// Fails unless every page of `region` (host memory) is mapped in this
/// process, so that a host worker never registers memory whose reading
/// would crash it (address 8, a freed mapping, a range running past a
/// mapping). `mincore` answers `ENOMEM` for a range holding an unmapped
/// page; it reads no byte of the region and costs one call per
/// [`MINCORE_PAGES`] pages. A mapping without read permission
/// (`PROT_NONE`) is mapped, and is not told apart here.
///
/// `InvalidArgument` when the region's first page is not mapped (as for
/// address 0, it is no memory at all); `OutOfBounds` when a later page is
/// not, naming that page (the region runs past the memory given).
pub fn check_mapped(region: Region) -> Result<()> {
    let page = page_size();
    let start = region.address - region.address % page;
    // The region's end does not wrap (checked before), but rounding it up
    // to a page can: such a range is no mapped memory either.
    let Some(end) = region
        .address
        .checked_add(region.length)
        .and_then(|end| end.checked_next_multiple_of(page))
    else {
        return Err(not_mapped(region, region.address));
    };
    let mut residency = [0u8; MINCORE_PAGES];
    let mut at = start;
    while at < end {
        let pages = ((end - at) / page).min(MINCORE_PAGES as u64);
        if !pages_mapped(at, pages * page, &mut residency)? {
            // Some page of this chunk is unmapped: find the first by halving,
            // keeping `at .. at + mapped pages` mapped and `at .. at +
            // unmapped pages` not.
            let (mut mapped, mut unmapped) = (0u64, pages);
            while unmapped - mapped > 1 {
                let middle = (mapped + unmapped) / 2;
                if pages_mapped(at, middle * page, &mut residency)? {
                    mapped = middle;
                } else {
                    unmapped = middle;
                }
            }
            let first_unmapped = at + mapped * page;
            return Err(not_mapped(region, first_unmapped));
        }
        at += pages * page;
    }
    Ok(())
}

/// The error for `region`, whose page at `unmapped` is not mapped.
fn not_mapped(region: Region, unmapped: u64) -> crate::error::Error {
    let page = page_size();
    if unmapped <= region.address - region.address % page {
        err!(
            InvalidArgument,
            "address {:#x} (region of length {}) is not mapped memory of this process; a host worker would read it and crash",
            region.address,
            region.length
        )
    } else {
        err!(
            OutOfBounds,
            "region at address {:#x} of length {} runs past mapped memory: the page at {unmapped:#x} is not mapped",
            region.address,
            region.length
        )
    }
}

/// Whether the `length` bytes (whole pages) at page-aligned `address` are
/// all mapped: `mincore` over them, `residency` holding a byte per page.
fn pages_mapped(address: u64, length: u64, residency: &mut [u8; MINCORE_PAGES]) -> Result<bool> {
    if length == 0 {
        return Ok(true);
    }
    loop {
        // SAFETY: mincore reads no memory at `address`, only the page
        // tables; it writes one byte per page of `length` (at most
        // MINCORE_PAGES, the callers' bound) into `residency`.
        let status = unsafe {
            libc::mincore(
                address as usize as *mut libc::c_void,
                length as usize,
                residency.as_mut_ptr().cast(),
            )
        };
        if status == 0 {
            return Ok(true);
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::ENOMEM) => return Ok(false),
            // The kernel was short of memory for a moment: ask again.
            Some(libc::EAGAIN) => continue,
            other => {
                return Err(err!(
                    Internal,
                    "mincore({address:#x}, {length}) failed with errno {other:?}"
                ))
            }
        }
    }
}

/// The size of a page of this process's memory.
fn page_size() -> u64 {
    static PAGE: OnceLock<u64> = OnceLock::new();
    // SAFETY: sysconf reads a constant of the system.
    *PAGE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        size if size > 0 => size as u64,
        _ => 4096,
    })
}

/// Running sums over the rows (one head's pieces of one token) of a slice,
/// from which [`RowSums::weighted`] gives their slice-checksum contribution
/// with one reduction for all rows. The same identity as
/// `checksum::run_checksum`, extended by a row index: within lane `l`,
/// after each chunk `running += sum`, so `sum_k k * x = chunks * sum -
/// running`; after each row `row_running += sum`, so `sum_r r * x = rows *
/// sum - row_running`. Adds only, so the chunk loop vectorises.
#[derive(Clone, Copy, Default)]
struct RowSums {
    sum: [u64; LANES],
    running: [u64; LANES],
    row_running: [u64; LANES],
    chunks: u64,
    rows: u64,
}

impl RowSums {
    /// Adds the next row (each piece through `f`: [`PieceFn`]); its
    /// length is a multiple of [`LANES`] and the same for every row.
    #[inline(always)]
    // One index walks three lane arrays in step; this is what vectorises.
    #[allow(clippy::needless_range_loop)]
    fn add_row<F: PieceFn>(&mut self, f: F, row: &[u64]) {
        let chunks = row.chunks_exact(LANES);
        debug_assert!(chunks.remainder().is_empty());
        self.chunks += chunks.len() as u64;
        f.accumulate(row, &mut self.sum, &mut self.running);
        for lane in 0..LANES {
            self.row_running[lane] = self.row_running[lane].wrapping_add(self.sum[lane]);
        }
        self.rows += 1;
    }

    /// `sum over rows r, pieces p of x * (2 * (first_index + r * row_index_stride + p) + 1)`
    /// for rows of `row_len` pieces.
    fn weighted(&self, row_len: u64, first_index: u64, row_index_stride: u64) -> u64 {
        let mut total = 0u64;
        // sum_i i * x over the rows laid end to end, and sum_r r * x.
        let mut flat_weighted = 0u64;
        let mut row_weighted = 0u64;
        for lane in 0..LANES {
            let sum = self.sum[lane];
            total = total.wrapping_add(sum);
            let chunk_weighted = self.chunks.wrapping_mul(sum).wrapping_sub(self.running[lane]);
            flat_weighted = flat_weighted
                .wrapping_add(chunk_weighted.wrapping_mul(LANES as u64))
                .wrapping_add((lane as u64).wrapping_mul(sum));
            row_weighted = row_weighted.wrapping_add(self.rows.wrapping_mul(sum).wrapping_sub(self.row_running[lane]));
        }
        // Piece p of row r is flat piece i = r * row_len + p; its index is
        // first_index + i + r * (row_index_stride - row_len).
        piece_weight(first_index)
            .wrapping_mul(total)
            .wrapping_add(flat_weighted.wrapping_mul(2))
            .wrapping_add(
                row_index_stride
                    .wrapping_sub(row_len)
                    .wrapping_mul(row_weighted)
                    .wrapping_mul(2),
            )
    }
}

/// The `count` pieces at host address `address`.
///
/// # Safety
/// `address .. address + 8 * count` must be readable memory, 8-byte aligned,
/// not written while the returned slice is alive.
unsafe fn host_pieces<'a>(address: i64, count: u64) -> &'a [u64] {
    // SAFETY: the caller's promise above.
    unsafe { std::slice::from_raw_parts(address as usize as *const u64, count as usize) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SIMD forms of MIXED2's eight-piece step give `mix2` of each
    /// piece, for each form the CPU can run (this machine's CI has both),
    /// called outside any AVX build (so not inlined into one).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_forms_of_mix2_equal_mix2() {
        use crate::checksum::PieceFn;
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        type Step = Box<dyn Fn(&[u64; 8]) -> [u64; 8]>;
        let mut forms: Vec<(&str, Step)> = Vec::new();
        if let Some(isa) = Avx2::new() {
            forms.push(("AVX2", Box::new(move |p| Mix2Lanes::<Avx2Lanes>(isa).lanes(p))));
        }
        if let Some(isa) = Avx512::new() {
            forms.push(("AVX-512F", Box::new(move |p| Mix2Lanes::<Avx512Lanes>(isa).lanes(p))));
        }
        assert_eq!(
            forms.len(),
            [Simd::Avx2, Simd::Avx512]
                .iter()
                .filter(|&&form| form <= Form::best().simd())
                .count(),
            "a token for each form the CPU reports"
        );
        for _ in 0..10_000 {
            let pieces: [u64; 8] = std::array::from_fn(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            });
            for (name, lanes) in &forms {
                assert_eq!(
                    lanes(&pieces),
                    pieces.map(crate::checksum::mix2),
                    "{name} of {pieces:x?}"
                );
            }
        }
        // Zeros and all-ones edges.
        for (name, lanes) in &forms {
            assert_eq!(lanes(&[0; 8]), [0; 8], "{name}");
            assert_eq!(lanes(&[u64::MAX; 8]), [crate::checksum::mix2(u64::MAX); 8], "{name}");
        }
    }

    /// The accumulate step of each SIMD form of MIXED2 gives the portable
    /// one's lane sums, over rows of several lines.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_forms_of_mix2_accumulate_as_the_portable_one() {
        use crate::checksum::PieceFn;
        let mut state = 0x0DDB_1A5E_5BAD_5EEDu64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for lines in [1usize, 2, 7, 32] {
            let pieces: Vec<u64> = (0..8 * lines).map(|_| next()).collect();
            let start: [u64; 8] = std::array::from_fn(|_| next());
            let (mut sum, mut running) = (start, start.map(|x| x.rotate_left(7)));
            Mix2.accumulate(&pieces, &mut sum, &mut running);
            if let Some(isa) = Avx2::new() {
                let (mut s, mut r) = (start, start.map(|x| x.rotate_left(7)));
                Mix2Lanes::<Avx2Lanes>(isa).accumulate(&pieces, &mut s, &mut r);
                assert_eq!((s, r), (sum, running), "AVX2, {lines} lines");
            }
            if let Some(isa) = Avx512::new() {
                let (mut s, mut r) = (start, start.map(|x| x.rotate_left(7)));
                Mix2Lanes::<Avx512Lanes>(isa).accumulate(&pieces, &mut s, &mut r);
                assert_eq!((s, r), (sum, running), "AVX-512F, {lines} lines");
            }
        }
    }

    /// `RowSums` gives what `weighted_run` (the definition) gives row by
    /// row, under both algorithms.
    #[test]
    fn row_sums_equal_rows_of_weighted_runs() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for row_len in [8usize, 16, 32, 72] {
            for rows in [1usize, 2, 5, 16] {
                for extra_stride in [0u64, 8, 29] {
                    let pieces: Vec<u64> = (0..row_len * rows).map(|_| next()).collect();
                    let first_index = next() >> 4;
                    let row_index_stride = row_len as u64 + extra_stride;
                    for algorithm in Algorithm::all() {
                        let mut sums = RowSums::default();
                        let mut expected = 0u64;
                        for (r, row) in pieces.chunks_exact(row_len).enumerate() {
                            match algorithm {
                                Algorithm::Weighted => sums.add_row(Identity, row),
                                Algorithm::Mixed => sums.add_row(Mix, row),
                                Algorithm::Mixed2 => sums.add_row(Mix2, row),
                            }
                            let index = first_index.wrapping_add(r as u64 * row_index_stride);
                            expected = expected.wrapping_add(crate::checksum::weighted_run(row, index, algorithm));
                        }
                        assert_eq!(
                            sums.weighted(row_len as u64, first_index, row_index_stride),
                            expected,
                            "row_len {row_len}, rows {rows}, row_index_stride {row_index_stride}, {algorithm:?}"
                        );
                    }
                }
            }
        }
    }
}
