//! `kvcs_layer_from_layout` (SPEC section 14), called as C would: for every
//! layout string Python's `kvcsum.layer()` accepted (each order of B, T, H,
//! D with and without K and H, the aliases, any case, K and V in two
//! tensors), a tensor of random sizes and strides (padding, negative
//! strides, any stride on a dimension of size 1) holding random logical KV
//! gives the checksums of the naive reference, and the same as segments
//! built by hand. Hostile descriptions give an error, never a crash.
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it layer_from_layout::<name>`.

use crate::support;

use std::ffi::CString;
use std::ptr::{null, null_mut};

use kvcsum::ffi::blocks::*;
use kvcsum::ffi::layout_string::*;
use kvcsum::ffi::result::*;
use kvcsum::ffi::status::kvcs_status::*;
use kvcsum::ffi::status::*;
use kvcsum::ffi::worker::*;
use support::handles::{host_options, last_error};
use support::*;

/// Asserts that a call succeeded; `context` says which case.
fn ok(status: kvcs_status, context: &str) {
    assert_eq!(status, KVCS_OK, "{context}: {}", last_error());
}

/// One tensor laid out by the test: a buffer (8-byte aligned) and, per
/// dimension in the layout's order, its size and stride in bytes.
struct Tensor {
    buffer: Vec<u64>,
    /// Byte offset of the element whose every index is 0 within `buffer`.
    origin: usize,
    letters: Vec<char>,
    shape: Vec<i64>,
    strides: Vec<i64>,
    element_size: u32,
}

impl Tensor {
    /// A tensor of `letters` (upper case) with `size(letter)` elements each,
    /// nested in a random order (D innermost and contiguous), with random
    /// padding between dimensions, some strides negative, dimensions of
    /// size 1 given any stride; filled with random bytes.
    fn new(rng: &mut Rng, letters: &[char], size: impl Fn(char) -> i64, element_size: u32) -> Tensor {
        let mut nesting: Vec<char> = letters.iter().copied().filter(|&c| c != 'D').collect();
        rng.shuffle(&mut nesting);
        nesting.insert(0, 'D'); // innermost first
        let mut stride_of = std::collections::BTreeMap::new();
        // Bytes the dimensions nested so far cover.
        let mut span = 0i64;
        for &letter in &nesting {
            let natural = if letter == 'D' {
                element_size as i64
            } else {
                span + 8 * rng.below(3) as i64
            };
            let stride = if letter == 'D' {
                natural
            } else if size(letter) == 1 {
                8 * rng.range(0..1000) as i64 * if rng.chance(1, 2) { -1 } else { 1 }
            } else if rng.chance(1, 4) {
                -natural
            } else {
                natural
            };
            stride_of.insert(letter, stride);
            span = natural * size(letter);
        }
        let shape: Vec<i64> = letters.iter().map(|&c| size(c)).collect();
        let strides: Vec<i64> = letters.iter().map(|c| stride_of[c]).collect();
        let low: i64 = shape.iter().zip(&strides).map(|(&n, &s)| (s * (n - 1)).min(0)).sum();
        let high: i64 = shape
            .iter()
            .zip(&strides)
            .map(|(&n, &s)| (s * (n - 1)).max(0))
            .sum::<i64>()
            + element_size as i64;
        let mut buffer = vec![0u64; (high - low) as usize / 8 + 1];
        for word in &mut buffer {
            *word = rng.next_u64();
        }
        Tensor {
            buffer,
            origin: (-low) as usize,
            letters: letters.to_vec(),
            shape,
            strides,
            element_size,
        }
    }

    fn base(&self) -> u64 {
        self.buffer.as_ptr() as u64
    }

    fn address(&self) -> u64 {
        self.base() + self.origin as u64
    }

    fn bytes(&self) -> u64 {
        self.buffer.len() as u64 * 8
    }

    /// The C description of this tensor (valid while it lives).
    fn c(&self) -> kvcs_tensor {
        kvcs_tensor {
            address: self.address(),
            shape: self.shape.as_ptr(),
            strides: self.strides.as_ptr(),
            ndim: self.shape.len(),
            element_size: self.element_size,
        }
    }

    fn size(&self, letter: char) -> i64 {
        self.letters
            .iter()
            .position(|&c| c == letter)
            .map_or(1, |i| self.shape[i])
    }

    fn stride(&self, letter: char) -> i64 {
        self.letters
            .iter()
            .position(|&c| c == letter)
            .map_or(0, |i| self.strides[i])
    }

    /// Writes `bytes` at the cell of the given index per letter (those the
    /// tensor lacks are 0), one element index per `element_size` bytes,
    /// each address computed from the index and strides alone.
    fn write_cell(&mut self, index: impl Fn(char) -> i64, bytes: &[u8]) {
        let item = self.element_size as usize;
        let bytes_of: &mut [u8] = {
            let len = self.buffer.len() * 8;
            // SAFETY: the Vec<u64> holds `len` initialised bytes; u8 has no alignment.
            unsafe { std::slice::from_raw_parts_mut(self.buffer.as_mut_ptr().cast::<u8>(), len) }
        };
        for (d, element) in bytes.chunks(item).enumerate() {
            let mut offset = self.origin as i64;
            for (i, &letter) in self.letters.iter().enumerate() {
                let at = if letter == 'D' { d as i64 } else { index(letter) };
                offset += at * self.strides[i];
            }
            let offset = offset as usize;
            bytes_of[offset..offset + item].copy_from_slice(element);
        }
    }
}

/// One case: a layout (as given to the call), the tensors, the request.
struct Case {
    layout: String,
    cache: Tensor,
    v: Option<Tensor>,
    kernel_blocks: u32,
    tokens: u32,
    kv: LogicalKv,
    first_position: u64,
    block_ids: Vec<u32>,
}

impl Case {
    fn block_size(&self) -> u32 {
        self.kernel_blocks * self.tokens
    }

    fn context(&self, seed: u64) -> String {
        format!(
            "seed {seed}, layout {:?}, shape {:?}, strides {:?}, v {:?}, kernel_blocks {}",
            self.layout,
            self.cache.shape,
            self.cache.strides,
            self.v.as_ref().map(|v| (&v.shape, &v.strides)),
            self.kernel_blocks
        )
    }
}

/// `letters` (upper case, no alias) with random sizes, the logical KV of a
/// random request in it; `written` is the layout string as the caller
/// spells it; `separate_v` puts V in a tensor of its own.
fn make_case(rng: &mut Rng, letters: &[char], written: &str, separate_v: bool) -> Case {
    let element_size = *rng.pick(&[1u32, 2, 4]);
    let per_piece = 8 / element_size as i64;
    let kernel_blocks = rng.range(1..4) as u32;
    let num_blocks = rng.range(1..5) as i64;
    let tokens = rng.range(1..5) as i64;
    let heads = if letters.contains(&'H') {
        rng.range(1..4) as i64
    } else {
        1
    };
    let k_elements = per_piece * rng.range(1..4) as i64;
    let v_elements = per_piece * rng.range(1..4) as i64;
    let has_k = letters.contains(&'K');
    let sizes = |elements: i64| {
        move |c: char| match c {
            'B' => num_blocks * kernel_blocks as i64,
            'T' => tokens,
            'H' => heads,
            'D' => elements,
            'K' => 2,
            _ => unreachable!(),
        }
    };
    let mut cache = Tensor::new(rng, letters, sizes(k_elements), element_size);
    let mut v = separate_v.then(|| Tensor::new(rng, letters, sizes(v_elements), element_size));
    let k_bytes = (k_elements * element_size as i64) as u32;
    let v_bytes = if has_k {
        k_bytes
    } else if separate_v {
        (v_elements * element_size as i64) as u32
    } else {
        0
    };
    let block_size = kernel_blocks as u64 * tokens as u64;
    let first_position = rng.below(3);
    let num_positions = rng.range(1..num_blocks as u64 + 1);
    let num_tokens = (first_position + num_positions - 1) * block_size + rng.range(1..block_size + 1);
    let mut shape = KvShape::gqa(1, heads as u32, k_bytes, num_tokens);
    shape.v_bytes = v_bytes;
    shape.first_layer = rng.below(100) as u32;
    let kv = LogicalKv::random(rng, shape);
    let block_ids: Vec<u32> = rng.permutation(num_blocks as u32)[..num_positions as usize].to_vec();
    let layer = shape.first_layer;
    for (i, &block_id) in block_ids.iter().enumerate() {
        let position = first_position + i as u64;
        for slot in 0..block_size {
            let token = position * block_size + slot;
            if token >= num_tokens {
                break;
            }
            let kernel_block = (block_id as u64 * kernel_blocks as u64 + slot / tokens as u64) as i64;
            let in_kernel_block = (slot % tokens as u64) as i64;
            for head in 0..heads {
                let cell = kv.cell(layer, head as u32, token).to_vec();
                let index = |part: i64| {
                    move |c: char| match c {
                        'B' => kernel_block,
                        'T' => in_kernel_block,
                        'H' => head,
                        'K' => part,
                        _ => 0,
                    }
                };
                let (k_part, v_part) = cell.split_at(k_bytes as usize);
                cache.write_cell(index(0), k_part);
                if has_k {
                    cache.write_cell(index(1), v_part);
                } else if let Some(v) = v.as_mut() {
                    v.write_cell(index(0), v_part);
                }
            }
        }
    }
    Case {
        layout: written.to_owned(),
        cache,
        v,
        kernel_blocks,
        tokens: tokens as u32,
        kv,
        first_position,
        block_ids,
    }
}

/// The segments of `case` built by hand, from how the test laid it out.
fn hand_built_segments(case: &Case) -> Vec<kvcs_segment> {
    let kb = case.kernel_blocks as i64;
    let segment = |t: &Tensor, part: i64| kvcs_segment {
        address: (t.address() as i64 + part * t.stride('K')) as u64,
        block_stride: t.stride('B') * kb,
        kernel_block_stride: t.stride('B'),
        head_stride: t.stride('H'),
        token_stride: t.stride('T'),
        bytes_per_token: (t.size('D') * t.element_size as i64) as u32,
    };
    let mut segments = vec![segment(&case.cache, 0)];
    if case.cache.letters.contains(&'K') {
        segments.push(segment(&case.cache, 1));
    }
    if let Some(v) = &case.v {
        segments.push(segment(v, 0));
    }
    segments
}

/// Registers `layer` (its caller fields set here) on a fresh host worker
/// over the case's tensors, checksums the request and returns the values.
fn checksums_of(case: &Case, mut layer: kvcs_layer, context: &str) -> Vec<u64> {
    let options = host_options();
    let mut worker = null_mut();
    ok(kvcs_worker_create(&options, &mut worker), context);
    for tensor in std::iter::once(&case.cache).chain(&case.v) {
        ok(kvcs_worker_add_region(worker, tensor.base(), tensor.bytes()), context);
    }
    ok(kvcs_worker_add_group(worker, 3, case.block_size()), context);
    layer.group_id = 3;
    layer.layer_number = case.kv.shape.first_layer;
    ok(kvcs_worker_add_layer(worker, &layer), context);
    let mut blocks = null_mut();
    ok(kvcs_blocks_create(&mut blocks), context);
    let req = CString::new("r").unwrap();
    ok(
        kvcs_blocks_add_request(blocks, req.as_ptr(), case.kv.num_tokens()),
        context,
    );
    let ids = &case.block_ids;
    ok(
        kvcs_blocks_add_group(blocks, req.as_ptr(), 3, case.first_position, ids.as_ptr(), ids.len()),
        context,
    );
    let mut result = null_mut();
    ok(
        kvcs_worker_checksum(worker, blocks, 0, null_mut(), &mut result),
        context,
    );
    let mut values = vec![0u64; ids.len()];
    let (mut replicas, mut replica_index) = (0, 0);
    ok(
        kvcs_result_column(
            result,
            req.as_ptr(),
            3,
            0,
            &mut replicas,
            &mut replica_index,
            values.as_mut_ptr(),
        ),
        context,
    );
    kvcs_result_destroy(result);
    kvcs_blocks_destroy(blocks);
    kvcs_worker_destroy(worker);
    values
}

/// Every order of `letters`.
fn permutations(letters: &[char]) -> Vec<Vec<char>> {
    if letters.len() <= 1 {
        return vec![letters.to_vec()];
    }
    let mut out = Vec::new();
    for (i, &first) in letters.iter().enumerate() {
        let mut rest = letters.to_vec();
        rest.remove(i);
        for mut tail in permutations(&rest) {
            tail.insert(0, first);
            out.push(tail);
        }
    }
    out
}

#[test]
fn every_layout_gives_the_naive_reference_and_the_hand_built_segments() {
    let mut rng = Rng::for_test("every_layout_gives_the_naive_reference_and_the_hand_built_segments");
    let seed = rng.seed();
    // (letters, layout as written, K and V in two tensors)
    let mut cases: Vec<(Vec<char>, String, bool)> = Vec::new();
    for set in ["BTHD", "BTHDK", "BTD", "BTDK"] {
        for letters in permutations(&set.chars().collect::<Vec<_>>()) {
            let written: String = letters
                .iter()
                .map(|&c| if rng.chance(1, 4) { c.to_ascii_lowercase() } else { c })
                .collect();
            let separate = !set.contains('K');
            cases.push((letters.clone(), written.clone(), false));
            if separate {
                cases.push((letters, written, true));
            }
        }
    }
    for (alias, letters) in [("NHD", "BTHD"), ("HND", "BHTD"), ("nhd", "BTHD"), ("hNd", "BHTD")] {
        let letters: Vec<char> = letters.chars().collect();
        cases.push((letters.clone(), alias.to_owned(), false));
        cases.push((letters, alias.to_owned(), true));
    }
    assert_eq!(cases.len(), 24 * 2 + 120 + 6 * 2 + 24 + 8);
    for (letters, written, separate_v) in cases {
        let case = make_case(&mut rng, &letters, &written, separate_v);
        let context = case.context(seed);
        let layout = CString::new(case.layout.clone()).unwrap();
        let cache = case.cache.c();
        let v = case.v.as_ref().map(Tensor::c);
        let v_ptr = v.as_ref().map_or(null(), |v| v as *const kvcs_tensor);
        // SAFETY: an all-zero kvcs_layer is a valid value (integers and NULL pointers).
        let mut layer: kvcs_layer = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut segments: [kvcs_segment; 2] = unsafe { std::mem::zeroed() };
        ok(
            kvcs_layer_from_layout(
                layout.as_ptr(),
                &cache,
                v_ptr,
                case.kernel_blocks,
                &mut layer,
                segments.as_mut_ptr(),
            ),
            &context,
        );
        let hand = hand_built_segments(&case);
        assert_eq!(layer.num_segments as usize, hand.len(), "{context}");
        assert_eq!(layer.segments, segments.as_ptr(), "{context}");
        for (got, want) in segments.iter().zip(&hand) {
            let fields = |s: &kvcs_segment| {
                (
                    s.address,
                    s.block_stride,
                    s.kernel_block_stride,
                    s.head_stride,
                    s.token_stride,
                    s.bytes_per_token,
                )
            };
            assert_eq!(fields(got), fields(want), "{context}");
        }
        let heads = case.kv.shape.total_kv_heads;
        let geometry = (
            layer.num_heads,
            layer.num_blocks,
            layer.kernel_blocks,
            layer.tokens_per_kernel_block,
        );
        let blocks = case.cache.size('B') as u32 / case.kernel_blocks;
        assert_eq!(geometry, (heads, blocks, case.kernel_blocks, case.tokens), "{context}");
        let caller = (
            layer.group_id,
            layer.layer_number,
            layer.first_head,
            layer.replicas,
            layer.replica_index,
        );
        assert_eq!(caller, (0, 0, 0, 1, 0), "{context}");
        assert!(layer.identity.is_null() && layer.identity_len == 0, "{context}");

        let from_layout = checksums_of(&case, layer, &context);
        let mut by_hand = layer;
        by_hand.segments = hand.as_ptr();
        let hand_values = checksums_of(&case, by_hand, &context);
        let want = naive_full(&case.kv, case.block_size(), case.first_position, case.block_ids.len());
        assert_eq!(
            from_layout, want,
            "{context}: the layout string's layer against the naive reference"
        );
        assert_eq!(
            hand_values, want,
            "{context}: the hand-built layer against the naive reference"
        );
    }
}

#[test]
fn hostile_descriptions_give_an_error_and_leave_the_outputs() {
    let mut rng = Rng::for_test("hostile_descriptions_give_an_error_and_leave_the_outputs");
    let seed = rng.seed();
    let extremes = [
        i64::MIN,
        i64::MIN + 1,
        -1,
        0,
        1,
        2,
        8,
        1 << 31,
        1 << 32,
        i64::MAX / 2,
        i64::MAX,
    ];
    let alphabet = ['B', 'T', 'H', 'D', 'K', 'b', 'x', '\u{e9}'];
    let mut refused = 0;
    for _ in 0..20_000 {
        let letters = rng.range(0..7) as usize;
        let layout: String = (0..letters).map(|_| *rng.pick(&alphabet)).collect();
        let ndim = if rng.chance(3, 4) {
            layout.chars().count()
        } else {
            rng.range(0..7) as usize
        };
        let value = |rng: &mut Rng| {
            if rng.chance(1, 2) {
                *rng.pick(&extremes)
            } else {
                rng.range(0..6) as i64
            }
        };
        let shape: Vec<i64> = (0..ndim).map(|_| value(&mut rng)).collect();
        let strides: Vec<i64> = (0..ndim).map(|_| value(&mut rng)).collect();
        let tensor = kvcs_tensor {
            address: if rng.chance(1, 2) {
                u64::MAX - rng.below(64)
            } else {
                rng.next_u64()
            },
            shape: shape.as_ptr(),
            strides: strides.as_ptr(),
            ndim,
            element_size: *rng.pick(&[0, 1, 2, 4, u32::MAX]),
        };
        let kernel_blocks = *rng.pick(&[0, 1, 2, 3, u32::MAX]);
        let with_v = rng.chance(1, 4);
        let layout_c = CString::new(layout.clone()).unwrap();
        // SAFETY: all-zero layers and segments are valid values.
        let mut layer: kvcs_layer = unsafe { std::mem::zeroed() };
        layer.layer_number = 0xdead;
        // SAFETY: as above.
        let mut segments: [kvcs_segment; 2] = unsafe { std::mem::zeroed() };
        segments[0].bytes_per_token = 0xbeef;
        segments[1].bytes_per_token = 0xbeef;
        let status = kvcs_layer_from_layout(
            layout_c.as_ptr(),
            &tensor,
            if with_v { &tensor as *const kvcs_tensor } else { null() },
            kernel_blocks,
            &mut layer,
            segments.as_mut_ptr(),
        );
        let context = format!("seed {seed}: layout {layout:?}, shape {shape:?}, strides {strides:?}, v {with_v}");
        match status {
            KVCS_OK => assert_eq!(layer.layer_number, 0, "{context}"),
            KVCS_ERR_INVALID_ARGUMENT => {
                refused += 1;
                assert_eq!(layer.layer_number, 0xdead, "{context}: {}", last_error());
                assert!(segments.iter().all(|s| s.bytes_per_token == 0xbeef), "{context}");
                let message = last_error();
                let names_one = ["layout", "cache", "v ", "v:", "v.", "kernel_blocks"]
                    .iter()
                    .any(|name| message.contains(name));
                assert!(names_one, "{context}: the message names no argument: {message}");
            }
            other => panic!("{context}: status {other:?}: {}", last_error()),
        }
    }
    assert!(refused > 10_000, "seed {seed}: only {refused} refused");
}

/// Runs `kvcs_layer_from_layout` on `case` with the cache's strides
/// `strides` (and `v` as given); the status and, on an error, the message,
/// after checking that an error left both outputs as they were.
fn from_layout_with(case: &Case, strides: &[i64], v: Option<&kvcs_tensor>, context: &str) -> (kvcs_status, String) {
    let layout = CString::new(case.layout.clone()).unwrap();
    let mut cache = case.cache.c();
    cache.strides = strides.as_ptr();
    // SAFETY: an all-zero kvcs_layer is a valid value (integers and NULL pointers).
    let mut layer: kvcs_layer = unsafe { std::mem::zeroed() };
    layer.layer_number = 0xdead;
    // SAFETY: as above.
    let mut segments: [kvcs_segment; 2] = unsafe { std::mem::zeroed() };
    let status = kvcs_layer_from_layout(
        layout.as_ptr(),
        &cache,
        v.map_or(null(), |v| v as *const kvcs_tensor),
        case.kernel_blocks,
        &mut layer,
        segments.as_mut_ptr(),
    );
    if status == KVCS_OK {
        return (status, String::new());
    }
    assert_eq!(layer.layer_number, 0xdead, "{context}: layer_out written on an error");
    assert!(
        segments.iter().all(|s| s.bytes_per_token == 0),
        "{context}: segments_out written on an error"
    );
    (status, last_error())
}

/// Views whose cells share bytes, as `expand()` and `broadcast_to` make
/// (a stride of 0 over blocks, tokens or heads, or over K so that V is K)
/// or with tokens closer than a cell, or V the cache itself: refused with
/// `KVCS_ERR_INVALID_ARGUMENT` naming the layout and the dimension. Both
/// sides registered alike would match while bytes neither reads were
/// corrupt. The same tensor with its real strides is accepted.
#[test]
fn views_whose_cells_share_bytes_are_refused() {
    let mut rng = Rng::for_test("views_whose_cells_share_bytes_are_refused");
    let seed = rng.seed();
    let mut refusals = 0;
    for (letters, written, separate_v) in [
        ("KBTHD", "KBTHD", false),
        ("BKHTD", "bkhtd", false),
        ("BTHD", "NHD", true),
        ("BHTD", "HND", false),
        ("BTD", "BTD", false),
    ] {
        let letters: Vec<char> = letters.chars().collect();
        for _ in 0..20 {
            let case = make_case(&mut rng, &letters, written, separate_v);
            let context = case.context(seed);
            let v = case.v.as_ref().map(Tensor::c);
            let real = case.cache.strides.clone();
            let (status, message) = from_layout_with(&case, &real, v.as_ref(), &context);
            assert_eq!(status, KVCS_OK, "{context}: the real strides: {message}");
            // Each dimension of size above 1 but D broadcast (stride 0).
            for (i, &letter) in letters.iter().enumerate() {
                if letter == 'D' || case.cache.shape[i] < 2 {
                    continue;
                }
                let mut strides = real.clone();
                strides[i] = 0;
                let (status, message) = from_layout_with(&case, &strides, v.as_ref(), &context);
                assert_eq!(
                    status, KVCS_ERR_INVALID_ARGUMENT,
                    "{context}: {letter} of stride 0: {message}"
                );
                // The dimension named: its letter (B's kernel blocks as "B",
                // its logical blocks as "B x kernel_blocks"), or V's
                // distance from K.
                let named = match letter {
                    'K' => vec!["V starts 0 bytes from K".to_owned()],
                    _ => vec![format!("{letter} 0 (over"), format!("{letter} x kernel_blocks 0 (over")],
                };
                assert!(
                    named.iter().any(|needle| message.contains(needle.as_str())),
                    "{context}: none of {named:?} in {message:?}"
                );
                for needle in ["share bytes", &format!("layout \"{written}\"")] {
                    assert!(message.contains(needle), "{context}: {needle:?} not in {message:?}");
                }
                refusals += 1;
            }
            // Tokens closer than one cell.
            let t = letters.iter().position(|&c| c == 'T').unwrap();
            let cell = case.cache.size('D') * case.cache.element_size as i64;
            if case.cache.shape[t] > 1 && cell > 8 {
                let mut strides = real.clone();
                strides[t] = 8 * rng.range(1..cell as u64 / 8) as i64 * strides[t].signum();
                let (status, message) = from_layout_with(&case, &strides, v.as_ref(), &context);
                assert_eq!(
                    status, KVCS_ERR_INVALID_ARGUMENT,
                    "{context}: T closer than a cell: {message}"
                );
                assert!(message.contains("share bytes"), "{context}: {message}");
                refusals += 1;
            }
            // V the cache itself.
            if separate_v {
                let same = case.cache.c();
                let (status, message) = from_layout_with(&case, &real, Some(&same), &context);
                assert_eq!(status, KVCS_ERR_INVALID_ARGUMENT, "{context}: v the cache: {message}");
                for needle in ["cache (bytes", "v (bytes", "K and V must not overlap"] {
                    assert!(message.contains(needle), "{context}: {needle:?} not in {message:?}");
                }
                refusals += 1;
            }
        }
    }
    assert!(refusals > 100, "seed {seed}: only {refusals} views refused");
}
