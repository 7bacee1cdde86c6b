//! Aliasing layouts, generated: a real layout of one layer (every kind of
//! tests/it/support's placements, or a tensor of a random layout string) with
//! one stride or address changed so that its cells may share bytes, judged
//! by a deliberately naive reference (every cell's bytes listed from its
//! logical indices, then sorted) and registered through the C ABI.
//!
//! The rule: a layout whose distinct cells share a byte is refused at
//! registration (`kvcs_worker_add_layer`, and `kvcs_layer_from_layout` for
//! tensors) with `KVCS_ERR_INVALID_ARGUMENT`; the real layouts the changes
//! start from are all accepted. A changed layout whose cells happen to stay
//! disjoint may be accepted or refused (the library's rule refuses cells
//! that interleave without nesting); those are counted, not judged.
//!
//! Used by `tests/it/verdict_property.rs` beside the configuration generator
//! (tests/it/verdict_property/generator.rs); the crate root declares
//! `mod support;`.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fmt::Write as _;
use std::ptr::null;

use kvcsum::ffi::layout_string::*;
use kvcsum::ffi::status::kvcs_status::{self, *};
use kvcsum::ffi::worker::*;
use kvcsum::{LayerSpec, ReplicaKey, Segment};

use crate::support::handles::*;
use crate::support::*;

/// What was changed in a real layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Change {
    /// A dimension of size above 1 given stride 0 (a broadcast view).
    ZeroStride,
    /// A dimension given another dimension's stride.
    CopiedStride,
    /// A dimension's stride made smaller, not 0 (multiples of 8).
    ShrunkStride,
    /// V (the second segment) moved to start inside K's cells.
    VIntoK,
    /// A second segment added over the first (V aliasing K).
    VOverK,
}

impl Change {
    pub fn name(self) -> &'static str {
        match self {
            Change::ZeroStride => "a stride of 0 on a dimension of size > 1",
            Change::CopiedStride => "a dimension given another one's stride",
            Change::ShrunkStride => "a stride made smaller (not 0)",
            Change::VIntoK => "V moved to start inside K's cells",
            Change::VOverK => "a V segment added over K",
        }
    }
}

/// Which registration path a case went through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Path {
    /// `kvcs_worker_add_layer` of segments.
    Segments,
    /// `kvcs_layer_from_layout` of a tensor, then `kvcs_worker_add_layer`
    /// of the same cells as segments built by hand.
    LayoutString,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::Segments => "segments",
            Path::LayoutString => "layout string",
        }
    }
}

/// One case's outcome.
#[derive(Debug, Clone)]
pub struct AliasingResult {
    pub path: Path,
    pub change: Change,
    /// Whether the naive reference found two cells sharing a byte.
    pub aliasing: bool,
    /// Whether registration refused the changed layout (both calls, on the
    /// layout-string path, must agree where the cells alias).
    pub refused: bool,
    /// Rule violations, with details.
    pub violations: Vec<String>,
}

/// Byte ranges `[start, end)` of every cell of `spec`, from its logical
/// indices (block, kernel block, head, token) and each segment's strides.
fn cells_of(spec: &LayerSpec) -> Vec<(i128, i128)> {
    let mut cells = Vec::new();
    for segment in &spec.segments {
        for block in 0..spec.num_blocks as i128 {
            for kernel in 0..spec.kernel_blocks as i128 {
                for head in 0..spec.num_heads as i128 {
                    for token in 0..spec.tokens_per_kernel_block as i128 {
                        let start = segment.address as i128
                            + block * segment.block_stride as i128
                            + kernel * segment.kernel_block_stride as i128
                            + head * segment.head_stride as i128
                            + token * segment.token_stride as i128;
                        cells.push((start, start + segment.bytes_per_token as i128));
                    }
                }
            }
        }
    }
    cells
}

/// Whether two of `cells` share a byte.
fn any_shared_byte(mut cells: Vec<(i128, i128)>) -> bool {
    cells.sort_unstable();
    cells.windows(2).any(|pair| pair[1].0 < pair[0].1)
}

/// A random real layout of one layer (a placement of tests/it/support) with
/// its buffers.
fn real_layout(rng: &mut Rng) -> Placement {
    let kinds = all_kinds();
    let kind = *rng.pick(&kinds);
    let block_size = match kind {
        LayoutKind::KernelBlocks { kernel_blocks } => kernel_blocks * rng.range(1..4) as u32,
        _ => rng.range(1..9) as u32,
    };
    let k_bytes = 8 * rng.range(1..5) as u32;
    let v_bytes = match kind {
        LayoutKind::KvSplit => k_bytes,
        LayoutKind::HndKvSplit => 8 * rng.range(1..5) as u32,
        // Scales of 4 to 16 bytes: cells of 4-byte pieces where they are an
        // odd number of 4 bytes (SPEC section 1).
        LayoutKind::KeysThenScales => 4 * rng.range(1..5) as u32,
        _ => 8 * rng.below(4) as u32,
    };
    let layers = rng.range(1..4) as u32;
    let spec = CacheSpec {
        kind,
        group_id: 0,
        block_size,
        num_blocks: rng.range(1..6) as u32,
        layer_numbers: (0..layers).collect(),
        first_head: 0,
        num_heads: rng.range(1..5) as u32,
        replica: ReplicaKey {
            replicas: 1,
            replica_index: 0,
        },
        k_bytes,
        v_bytes,
    };
    Placement::new(rng, spec)
}

/// A segment's strides with the size of their dimension, in the order
/// (block, kernel block, head, token).
fn dims(spec: &LayerSpec, segment: &Segment) -> [(i64, u32); 4] {
    [
        (segment.block_stride, spec.num_blocks),
        (segment.kernel_block_stride, spec.kernel_blocks),
        (segment.head_stride, spec.num_heads),
        (segment.token_stride, spec.tokens_per_kernel_block),
    ]
}

fn set_stride(segment: &mut Segment, dim: usize, stride: i64) {
    match dim {
        0 => segment.block_stride = stride,
        1 => segment.kernel_block_stride = stride,
        2 => segment.head_stride = stride,
        _ => segment.token_stride = stride,
    }
}

/// `spec` with one change, or `None` where the layout leaves no room for
/// it (no dimension of size above 1, one segment for `VIntoK`).
fn changed(rng: &mut Rng, spec: &LayerSpec, change: Change) -> Option<LayerSpec> {
    let mut out = spec.clone();
    let s = rng.below(spec.segments.len() as u64) as usize;
    let segment = spec.segments[s];
    let large: Vec<usize> = (0..4).filter(|&d| dims(spec, &segment)[d].1 > 1).collect();
    if large.is_empty() && !matches!(change, Change::VIntoK | Change::VOverK) {
        return None;
    }
    match change {
        Change::ZeroStride => {
            let dim = *rng.pick(&large);
            set_stride(&mut out.segments[s], dim, 0);
        }
        Change::CopiedStride => {
            if large.len() < 2 {
                return None;
            }
            let dim = *rng.pick(&large);
            let other = *rng.pick(&large.iter().copied().filter(|&d| d != dim).collect::<Vec<_>>());
            let stride = dims(spec, &segment)[other].0;
            set_stride(&mut out.segments[s], dim, stride);
        }
        Change::ShrunkStride => {
            let candidates: Vec<usize> = large
                .iter()
                .copied()
                .filter(|&d| {
                    let stride = dims(spec, &segment)[d].0.unsigned_abs();
                    stride / piece_step(stride) >= 2
                })
                .collect();
            if candidates.is_empty() {
                return None;
            }
            let dim = *rng.pick(&candidates);
            let stride = dims(spec, &segment)[dim].0;
            // A smaller stride in the stride's own pieces (4-byte pieces'
            // strides need not be multiples of 8).
            let step = piece_step(stride.unsigned_abs());
            let smaller = (step * rng.range(1..stride.unsigned_abs() / step)) as i64;
            set_stride(&mut out.segments[s], dim, smaller * stride.signum());
        }
        Change::VIntoK => {
            if spec.segments.len() < 2 {
                return None;
            }
            let k = spec.segments[0];
            let step = piece_step(k.bytes_per_token as u64);
            out.segments[1].address = k.address + step * rng.below(k.bytes_per_token as u64 / step);
        }
        Change::VOverK => {
            if spec.segments.len() > 1 {
                return None;
            }
            let mut v = segment;
            let step = piece_step(segment.bytes_per_token as u64);
            v.address += step * rng.below(segment.bytes_per_token as u64 / step);
            v.bytes_per_token = 8 * rng.range(1..5) as u32;
            out.segments.push(v);
        }
    }
    Some(out)
}

/// Registers `spec` on a fresh host worker over `placement`'s buffers:
/// `Ok` or the failure.
fn register(placement: &Placement, spec: &LayerSpec) -> Result<(), Failure> {
    let worker = CWorker::host(0, 1, 0)?;
    for region in placement.regions(&placement.host_bases()) {
        worker.region(region.address, region.length)?;
    }
    worker.group(spec.group_id, spec.kernel_blocks * spec.tokens_per_kernel_block)?;
    worker.layer(spec)
}

/// Whether `failure` is the refusal of cells that share bytes.
fn refusal_of_aliasing(failure: &Failure) -> bool {
    failure.0 == KVCS_ERR_INVALID_ARGUMENT && failure.1.contains("share bytes")
}

const CHANGES: [Change; 5] = [
    Change::ZeroStride,
    Change::CopiedStride,
    Change::ShrunkStride,
    Change::VIntoK,
    Change::VOverK,
];

/// Case `index` of the run with `seed`.
pub fn run_aliasing_case(seed: u64, index: u64) -> AliasingResult {
    let mut rng = Rng::from_seed_and_name(seed, &format!("aliasing layout case {index}"));
    if rng.chance(1, 3) {
        return layout_string_case(&mut rng, seed, index);
    }
    loop {
        let placement = real_layout(&mut rng);
        let specs = placement.host_layer_specs();
        let spec = rng.pick(&specs).clone();
        let change = *rng.pick(&CHANGES);
        let Some(changed_spec) = changed(&mut rng, &spec, change) else {
            continue;
        };
        let context = format!(
            "seed {seed}, aliasing case {index}: {:?} layout, {}: {spec:?} became {changed_spec:?}",
            placement.spec().kind,
            change.name()
        );
        let mut violations = Vec::new();
        if any_shared_byte(cells_of(&spec)) {
            violations.push(format!("{context}: the real layout's own cells share bytes (test bug)"));
        }
        if let Err(failure) = register(&placement, &spec) {
            violations.push(format!("{context}: the real layout was refused: {failure:?}"));
        }
        let aliasing = any_shared_byte(cells_of(&changed_spec));
        let outcome = register(&placement, &changed_spec);
        if aliasing {
            match &outcome {
                Ok(()) => violations.push(format!("{context}: cells sharing bytes were accepted")),
                Err(failure) if !refusal_of_aliasing(failure) => {
                    violations.push(format!("{context}: refused, but not as aliasing: {failure:?}"))
                }
                Err(_) => {}
            }
        }
        return AliasingResult {
            path: Path::Segments,
            change,
            aliasing,
            refused: outcome.is_err(),
            violations,
        };
    }
}

/// Layout strings of real caches: (as given to the call, its letters,
/// K and V in two tensors).
const LAYOUTS: [(&str, &str, bool); 7] = [
    ("KBTHD", "KBTHD", false),
    ("BKTHD", "BKTHD", false),
    ("BKHTD", "BKHTD", false),
    ("BTD", "BTD", false),
    ("NHD", "BTHD", true),
    ("HND", "BHTD", true),
    ("NHD", "BTHD", false),
];

/// A tensor: sizes and byte strides per letter of its layout, contiguous
/// in the layout's own order (as torch allocates it), over a buffer.
struct Tensor {
    buffer: Vec<u64>,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

impl Tensor {
    fn new(rng: &mut Rng, letters: &[char], size: &dyn Fn(char) -> i64, element_size: u32) -> Tensor {
        let shape: Vec<i64> = letters.iter().map(|&c| size(c)).collect();
        let mut strides = vec![0i64; letters.len()];
        let mut step = element_size as i64;
        for i in (0..letters.len()).rev() {
            strides[i] = step;
            step *= shape[i];
        }
        let buffer = (0..(step as usize).div_ceil(8)).map(|_| rng.next_u64()).collect();
        Tensor { buffer, shape, strides }
    }

    fn address(&self) -> u64 {
        self.buffer.as_ptr() as u64
    }
}

/// A view of memory at `address`: its sizes and byte strides per letter.
#[derive(Clone)]
struct View {
    address: u64,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

impl View {
    fn of(tensor: &Tensor) -> View {
        View {
            address: tensor.address(),
            shape: tensor.shape.clone(),
            strides: tensor.strides.clone(),
        }
    }

    fn c(&self, element_size: u32) -> kvcs_tensor {
        kvcs_tensor {
            address: self.address,
            shape: self.shape.as_ptr(),
            strides: self.strides.as_ptr(),
            ndim: self.shape.len(),
            element_size,
        }
    }
}

/// One tensor case's letters and element size.
struct Letters {
    letters: Vec<char>,
    element_size: u32,
}

impl Letters {
    fn stride(&self, view: &View, letter: char) -> i64 {
        self.letters
            .iter()
            .position(|&c| c == letter)
            .map_or(0, |i| view.strides[i])
    }

    fn size(&self, view: &View, letter: char) -> i64 {
        self.letters
            .iter()
            .position(|&c| c == letter)
            .map_or(1, |i| view.shape[i])
    }

    /// Byte ranges of every cell of `view` (one per block, token, head and
    /// K/V part: its D elements), from the logical indices and the strides.
    fn cells(&self, view: &View, out: &mut Vec<(i128, i128)>) {
        let cell = (self.size(view, 'D') * self.element_size as i64) as i128;
        for b in 0..self.size(view, 'B') {
            for t in 0..self.size(view, 'T') {
                for h in 0..self.size(view, 'H') {
                    for k in 0..self.size(view, 'K') {
                        let offset = b * self.stride(view, 'B')
                            + t * self.stride(view, 'T')
                            + h * self.stride(view, 'H')
                            + k * self.stride(view, 'K');
                        let start = view.address as i128 + offset as i128;
                        out.push((start, start + cell));
                    }
                }
            }
        }
    }

    /// The segments of `view` built by hand (K and V parts where it has K).
    fn segments(&self, view: &View) -> Vec<Segment> {
        let parts = self.size(view, 'K');
        (0..parts)
            .map(|part| Segment {
                address: (view.address as i64 + part * self.stride(view, 'K')) as u64,
                block_stride: self.stride(view, 'B'),
                kernel_block_stride: self.stride(view, 'B'),
                head_stride: self.stride(view, 'H'),
                token_stride: self.stride(view, 'T'),
                bytes_per_token: (self.size(view, 'D') * self.element_size as i64) as u32,
            })
            .collect()
    }
}

/// `kvcs_layer_from_layout(layout, cache, v, 1)`: its status, the message
/// of a failure, and whether it wrote `layer_out`.
fn from_layout(layout: &str, cache: &kvcs_tensor, v: Option<&kvcs_tensor>) -> (kvcs_status, String, bool) {
    let layout = CString::new(layout).unwrap();
    // SAFETY: all-zero kvcs_layer and kvcs_segment values are valid.
    let (mut layer, mut segments): (kvcs_layer, [kvcs_segment; 2]) = unsafe { std::mem::zeroed() };
    layer.num_segments = 77; // a sentinel that no success writes
    let status = kvcs_layer_from_layout(
        layout.as_ptr(),
        cache,
        v.map_or(null(), |v| v as *const kvcs_tensor),
        1,
        &mut layer,
        segments.as_mut_ptr(),
    );
    let message = if status == KVCS_OK { String::new() } else { last_error() };
    (status, message, layer.num_segments != 77)
}

/// A tensor case: a real layout string with one dimension's stride
/// changed (0, another one's, or smaller), or V given as the cache itself.
fn layout_string_case(rng: &mut Rng, seed: u64, index: u64) -> AliasingResult {
    let (layout, letters, separate_v) = *rng.pick(&LAYOUTS);
    let letters = Letters {
        letters: letters.chars().collect(),
        element_size: *rng.pick(&[1u32, 2, 4]),
    };
    let element_size = letters.element_size;
    let elements = (8 / element_size as i64) * rng.range(1..4) as i64;
    let (blocks, tokens, heads) = (rng.range(1..6) as i64, rng.range(1..9) as i64, rng.range(1..5) as i64);
    let size = move |c: char| match c {
        'B' => blocks,
        'T' => tokens,
        'H' => heads,
        'D' => elements,
        _ => 2,
    };
    let cache = Tensor::new(rng, &letters.letters, &size, element_size);
    let v = separate_v.then(|| Tensor::new(rng, &letters.letters, &size, element_size));
    let real = View::of(&cache);
    let mut view = real.clone();
    let large: Vec<usize> = (0..letters.letters.len())
        .filter(|&i| letters.letters[i] != 'D' && real.shape[i] > 1)
        .collect();
    let mut v_view = v.as_ref().map(View::of);
    if large.is_empty() && !separate_v {
        // Nothing to change in a tensor of one cell: draw another.
        return layout_string_case(rng, seed, index);
    }
    let change = if large.is_empty() || (separate_v && rng.chance(1, 5)) {
        // V is the cache's own memory.
        v_view = Some(real.clone());
        Change::VOverK
    } else {
        let i = *rng.pick(&large);
        let others: Vec<usize> = large.iter().copied().filter(|&j| j != i).collect();
        let stride = real.strides[i];
        match rng.below(3) {
            1 if !others.is_empty() => {
                view.strides[i] = real.strides[*rng.pick(&others)];
                Change::CopiedStride
            }
            2 if stride >= 16 => {
                view.strides[i] = 8 * rng.range(1..stride as u64 / 8) as i64;
                Change::ShrunkStride
            }
            _ => {
                view.strides[i] = 0;
                Change::ZeroStride
            }
        }
    };
    let mut cells = Vec::new();
    letters.cells(&view, &mut cells);
    if let Some(v_view) = &v_view {
        letters.cells(v_view, &mut cells);
    }
    let aliasing = any_shared_byte(cells);
    let context = format!(
        "seed {seed}, aliasing case {index}: layout {layout:?}, shape {:?}, strides {:?} became {:?}, v {:?}",
        real.shape,
        real.strides,
        view.strides,
        v_view.as_ref().map(|v| (v.address == real.address, &v.strides))
    );
    let mut violations = Vec::new();
    let real_v_view = v.as_ref().map(View::of);
    let real_v = real_v_view.as_ref().map(|v| v.c(element_size));
    let (status, message, _) = from_layout(layout, &real.c(element_size), real_v.as_ref());
    if status != KVCS_OK {
        violations.push(format!("{context}: the real layout was refused: {message}"));
    }
    let changed_v = v_view.as_ref().map(|v| v.c(element_size));
    let (status, message, written) = from_layout(layout, &view.c(element_size), changed_v.as_ref());
    let refused = status != KVCS_OK;
    if aliasing {
        if !refused {
            violations.push(format!(
                "{context}: kvcs_layer_from_layout accepted cells sharing bytes"
            ));
        } else if status != KVCS_ERR_INVALID_ARGUMENT || !message.contains("share bytes") {
            violations.push(format!("{context}: refused, but not as aliasing: {status:?} {message}"));
        } else if written {
            violations.push(format!("{context}: a refusal wrote layer_out"));
        }
        // The same cells as segments built by hand are refused at
        // registration too.
        let mut segments = letters.segments(&view);
        if let Some(v_view) = &v_view {
            segments.extend(letters.segments(v_view));
        }
        let spec = LayerSpec {
            group_id: 0,
            layer_number: 0,
            first_head: 0,
            num_heads: letters.size(&view, 'H') as u32,
            replica: ReplicaKey {
                replicas: 1,
                replica_index: 0,
            },
            num_blocks: blocks as u32,
            kernel_blocks: 1,
            tokens_per_kernel_block: tokens as u32,
            segments,
            identity: b"layer 0".to_vec(),
        };
        let registered = (|| {
            let worker = CWorker::host(0, 1, 0)?;
            for tensor in std::iter::once(&cache).chain(&v) {
                worker.region(tensor.address(), tensor.buffer.len() as u64 * 8)?;
            }
            worker.group(0, tokens as u32)?;
            worker.layer(&spec)
        })();
        match registered {
            Ok(()) => violations.push(format!("{context}: kvcs_worker_add_layer accepted its segments")),
            Err(failure) if !refusal_of_aliasing(&failure) => {
                violations.push(format!("{context}: its segments refused, not as aliasing: {failure:?}"))
            }
            Err(_) => {}
        }
    }
    AliasingResult {
        path: Path::LayoutString,
        change,
        aliasing,
        refused,
        violations,
    }
}

/// Counts of aliasing cases by path and change.
#[derive(Debug, Default)]
pub struct AliasingTally {
    /// (path, change) -> [aliasing refused, aliasing accepted, disjoint
    /// refused, disjoint accepted].
    pub counts: BTreeMap<(Path, Change), [u64; 4]>,
}

impl AliasingTally {
    pub fn add(&mut self, result: &AliasingResult) {
        let entry = self.counts.entry((result.path, result.change)).or_default();
        let slot = match (result.aliasing, result.refused) {
            (true, true) => 0,
            (true, false) => 1,
            (false, true) => 2,
            (false, false) => 3,
        };
        entry[slot] += 1;
    }

    /// Cases whose cells share bytes (the naive reference's judgement).
    pub fn aliasing(&self) -> u64 {
        self.counts.values().map(|c| c[0] + c[1]).sum()
    }

    pub fn table(&self, seed: u64) -> String {
        let mut out = format!(
            "aliasing layouts, seed {seed}:\n| path | change | cells share bytes: refused | accepted | disjoint: refused | accepted |\n|---|---|---:|---:|---:|---:|\n"
        );
        for ((path, change), c) in &self.counts {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} |",
                path.name(),
                change.name(),
                c[0],
                c[1],
                c[2],
                c[3]
            );
        }
        out
    }
}

/// The piece width a stride is a whole number of: 8, or 4 for the strides
/// of cells of 4-byte pieces.
fn piece_step(stride: u64) -> u64 {
    if stride.is_multiple_of(8) {
        8
    } else {
        4
    }
}
