//! The host engine: computes a plan's partial checksums from host memory,
//! split over threads. Every slice is read once; contributions are added
//! with wrapping arithmetic, so the order (and the thread count) does not
//! change any value.
//!
//! Each host worker owns one [`HostEngine`], whose helper threads are started
//! on its first call that is large enough to split, parked between calls, and
//! joined when the worker is dropped (see [`crate::engines::host::pool`]). One pool per
//! worker rather than one per process: no thread outlives the workers (so
//! the library holds nothing once the last is destroyed, and can be
//! unloaded), and each worker's `num_threads` means what it says. A process
//! with several host workers that call at once could oversubscribe; it
//! gives them fewer threads each.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::base::checksum::{Algorithm, Identity, Mix, Mix2, PIECE_BYTES};
use crate::base::error::{err, Result};
use crate::engines::host::pool::Pool;
use crate::inputs::layout::{Layer, Layout, Region};
use crate::inputs::role::Role;
use crate::plan::{Plan, Row};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod lanes;
mod pool;
mod walk;

#[cfg(target_arch = "x86_64")]
use avx2::{Avx2, Avx2Lanes};
#[cfg(target_arch = "x86_64")]
use avx512::{Avx512, Avx512Lanes};
#[cfg(target_arch = "x86_64")]
use lanes::Mix2Lanes;
use walk::{item_checksum, narrow_item_checksum, RowSums};

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
        let mut values = vec![0u64; plan.num_values];
        self.compute_into(layout, rows, role, algorithm, &mut values);
        values
    }

    /// [`HostEngine::compute`] into `values` (zeroed by the caller, as long
    /// as the rows' value indices need). A call whose bytes one thread
    /// reads allocates nothing but a token-outer walk's per-head sums, so
    /// that a small call (a step's full blocks) costs its reads.
    pub fn compute_into(&self, layout: &Layout, rows: &[Row], role: Role, algorithm: Algorithm, values: &mut [u64]) {
        let (mut total_bytes, mut count) = (0u64, 0u64);
        for (row, layer, _) in items(layout, rows, role) {
            total_bytes += item_bytes(row, layer);
            count += 1;
        }
        let useful_threads = (total_bytes / MIN_BYTES_PER_THREAD).max(1) as usize;
        let threads = self.threads.clamp(1, useful_threads);
        if threads == 1 {
            // The walk reads item by item; where items are small chunks,
            // the prefetch asks for the items ahead of it, at most
            // PREFETCH_AHEAD bytes ahead (large items stream on their own,
            // and asking for them too slowed a 1 GiB walk from 0.97 to 0.79
            // of the read ceiling).
            let mut scratch = Vec::new();
            let mut ahead = items(layout, rows, role);
            let prefetch = total_bytes <= count.saturating_mul(PREFETCH_ITEM_BYTES);
            let mut asked = 0u64;
            for (row, layer, column) in items(layout, rows, role) {
                while prefetch && asked < PREFETCH_AHEAD {
                    let Some((row, layer, _)) = ahead.next() else { break };
                    asked += walk::prefetch_item(row, layer);
                }
                let sum = item_checksum_of(algorithm, self.form, row, layer, &mut scratch);
                let out = &mut values[row.out as usize + column * row.column_stride as usize];
                *out = out.wrapping_add(sum);
                asked = asked.saturating_sub(item_bytes(row, layer));
            }
        } else {
            let items: Vec<Item> = items(layout, rows, role)
                .map(|(row, layer, column)| Item { row, layer, column })
                .collect();
            let sums: Vec<AtomicU64> = (0..values.len()).map(|_| AtomicU64::new(0)).collect();
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
                        sums[out].fetch_add(sum, Ordering::Relaxed);
                    }
                }
            };
            let pool = self.pool.get_or_init(|| Pool::new(self.threads - 1, "kvcsum-host"));
            pool.run(threads - 1, &work);
            for (value, sum) in values.iter_mut().zip(sums) {
                *value = value.wrapping_add(sum.into_inner());
            }
        }
        add_states(layout, rows, algorithm, values);
    }
}

/// Each (row, layer, column) of `rows` the worker computes in `role`: the
/// layers of the row's group whose replica is one of the role's columns,
/// in the group's layer order.
fn items<'a>(
    layout: &'a Layout,
    rows: &'a [Row],
    role: Role,
) -> impl Iterator<Item = (&'a Row, &'a Layer, usize)> + 'a {
    rows.iter().flat_map(move |row| {
        let group = layout.group_in_slot(row.group_slot);
        let columns = group.columns(role);
        group.layers.iter().filter_map(move |layer| {
            columns
                .binary_search(&layer.spec.replica)
                .ok()
                .map(|column| (row, layer, column))
        })
    })
}

/// The bytes the walk of `row` in `layer` reads.
fn item_bytes(row: &Row, layer: &Layer) -> u64 {
    row.valid_tokens as u64 * layer.spec.num_heads as u64 * layer.pieces_per_token * layer.piece_bytes
}

/// How far ahead of a one-thread walk its prefetch asks for lines: well
/// inside a core's L2, far enough for the misses of many small chunks to
/// overlap.
const PREFETCH_AHEAD: u64 = 128 << 10;

/// The largest mean item (bytes of one block position in one layer) whose
/// call the one-thread walk prefetches: a decode step's full blocks of a
/// small model are a few KiB each; a Llama-8B block of one layer is 64 KiB.
const PREFETCH_ITEM_BYTES: u64 = 16 << 10;

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
///
/// A layer of 4-byte pieces (SPEC section 1) takes the portable
/// [`narrow_item_checksum`] instead, decided once per item.
fn item_checksum_of(algorithm: Algorithm, form: Form, row: &Row, layer: &Layer, scratch: &mut Vec<RowSums>) -> u64 {
    if layer.piece_bytes != PIECE_BYTES {
        return match algorithm {
            Algorithm::Weighted => narrow_item_checksum(Identity, row, layer),
            Algorithm::Mixed => narrow_item_checksum(Mix, row, layer),
            Algorithm::Mixed2 => narrow_item_checksum(Mix2, row, layer),
        };
    }
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

/// Pages whose residency one `mincore` call reports: the vector it fills
/// is one byte per page, so a region of any size is checked with this
/// fixed buffer (16 MiB of 4 KiB pages per call; a 100 GiB region takes
/// 1,600 calls).
const MINCORE_PAGES: usize = 4096;

/// Fails unless every page of `region` (host memory) is mapped in this
/// process and may be read, so that a host worker never registers memory
/// whose reading would crash it (address 8, a freed mapping, a range
/// running past a mapping, a mapping without read permission). `mincore`
/// answers `ENOMEM` for a range holding an unmapped page; it reads no byte
/// of the region and costs one call per [`MINCORE_PAGES`] pages. A mapping
/// without read permission (`PROT_NONE`: a guard page, a reservation, and
/// CUDA's device memory, which unified addressing reserves so in the host
/// process) is mapped for `mincore`; [`check_readable`] tells it apart.
///
/// `InvalidArgument` when the region's first page is not mapped or not
/// readable (as for address 0, it is no memory a host worker reads);
/// `OutOfBounds` when a later page is not, naming that page (the region
/// runs past the memory given).
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
    match std::fs::read_to_string("/proc/self/maps") {
        Ok(maps) => check_readable(region, start, end, &maps),
        // No procfs (a sandbox without /proc): the permission is the
        // caller's to keep, as kvcs_worker_add_region says.
        Err(_) => Ok(()),
    }
}

/// Fails where a mapping of `maps` (the text of `/proc/self/maps`: one
/// mapping a line, `start-end perms ...` in hexadecimal, in address order)
/// without read permission overlaps the pages `start .. end` of `region`,
/// naming the first such page as [`check_mapped`] names an unmapped one.
/// Work is linear in the text: it is the process's mappings, read once a
/// region is registered.
fn check_readable(region: Region, start: u64, end: u64, maps: &str) -> Result<()> {
    for line in maps.lines() {
        let mut fields = line.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((low, high)) = range.split_once('-') else {
            continue;
        };
        let (Ok(low), Ok(high)) = (u64::from_str_radix(low, 16), u64::from_str_radix(high, 16)) else {
            continue;
        };
        if high <= start {
            continue;
        }
        if low >= end {
            break;
        }
        if !perms.starts_with('r') {
            return Err(not_readable(region, low.max(start), perms));
        }
    }
    Ok(())
}

/// The error for `region`, whose page at `page_at` is mapped with
/// permissions `perms`, none to read.
fn not_readable(region: Region, page_at: u64, perms: &str) -> crate::base::error::Error {
    let page = page_size();
    if page_at <= region.address - region.address % page {
        err!(
            InvalidArgument,
            "address {:#x} (region of length {}) is mapped without read permission ({perms}): a host worker would \
             read it and crash; device memory (CUDA's unified addressing reserves it so in the host process) is \
             read by a device worker",
            region.address,
            region.length
        )
    } else {
        err!(
            OutOfBounds,
            "region at address {:#x} of length {} runs into memory mapped without read permission ({perms}): the \
             page at {page_at:#x}",
            region.address,
            region.length
        )
    }
}

/// The error for `region`, whose page at `unmapped` is not mapped.
fn not_mapped(region: Region, unmapped: u64) -> crate::base::error::Error {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `check_readable` over a made-up `/proc/self/maps`: a mapping without
    /// 'r' refuses the regions overlapping it, naming the first page it
    /// holds of them (the region's first page: InvalidArgument, a later
    /// one: OutOfBounds); regions beside it pass; lines it cannot read are
    /// passed over.
    #[test]
    fn check_readable_refuses_what_overlaps_a_mapping_without_read() {
        let page = page_size();
        let at = |n: u64| 0x7f00_0000_0000 + n * page;
        let maps = format!(
            "{:x}-{:x} r--p 00000000 00:00 0 /lib/x.so\nnot a mapping\n{:x}-{:x} ---p 00000000 00:00 0\n\
             {:x}-{:x} rw-p 00000000 00:00 0 [heap]\n",
            at(0),
            at(2),
            at(2),
            at(3),
            at(3),
            at(8)
        );
        let check = |address: u64, length: u64| {
            let region = Region { address, length };
            let start = address - address % page;
            let end = (address + length).next_multiple_of(page);
            check_readable(region, start, end, &maps)
        };
        assert!(check(at(0) + 8, 2 * page - 8).is_ok());
        assert!(check(at(3), 5 * page).is_ok());
        match check(at(1) + 16, page) {
            Err(crate::Error::OutOfBounds(message)) => {
                assert!(message.contains(&format!("page at {:#x}", at(2))), "{message}")
            }
            other => panic!("{other:?}"),
        }
        for (address, length) in [(at(2), 8), (at(2) + page - 8, 16), (at(2) + 64, 8 * page)] {
            match check(address, length) {
                Err(crate::Error::InvalidArgument(message)) => {
                    assert!(message.contains("without read permission (---p)"), "{message}")
                }
                other => panic!("{address:#x} + {length}: {other:?}"),
            }
        }
    }

    /// The SIMD forms of MIXED2's eight-piece step give `mix2` of each
    /// piece, for each form the CPU can run (this machine's CI has both),
    /// called outside any AVX build (so not inlined into one).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_forms_of_mix2_equal_mix2() {
        use crate::base::checksum::PieceFn;
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
                    pieces.map(crate::base::checksum::mix2),
                    "{name} of {pieces:x?}"
                );
            }
        }
        // Zeros and all-ones edges.
        for (name, lanes) in &forms {
            assert_eq!(lanes(&[0; 8]), [0; 8], "{name}");
            assert_eq!(
                lanes(&[u64::MAX; 8]),
                [crate::base::checksum::mix2(u64::MAX); 8],
                "{name}"
            );
        }
    }

    /// The accumulate step of each SIMD form of MIXED2 gives the portable
    /// one's lane sums, over rows of several lines.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_forms_of_mix2_accumulate_as_the_portable_one() {
        use crate::base::checksum::PieceFn;
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
}
