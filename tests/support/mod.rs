//! Shared test support: a seeded PRNG, a logical KV model with a deliberately
//! naive reference of SPEC sections 2-3, layout builders that place logical KV
//! (or a TP/PP shard of it) into byte buffers, and helpers to register those
//! buffers on a `kvcsum::Worker` and read its results.
//!
//! Placements keep their bytes in host buffers and describe their caches
//! relative to each buffer's base address ([`Placement::layer_specs`]), so the
//! same placement can be copied to device memory and registered there.
//!
//! Reproduce a failure with the seed the failing test printed:
//! `KVCS_TEST_SEED=<seed> cargo test <test name> -- --nocapture`.

#![allow(dead_code)]

pub mod faults;
pub mod state;

use std::collections::BTreeMap;
use std::ops::Range;

use std::cell::Cell;

pub use kvcsum::Algorithm;
use kvcsum::{BlockSet, Checksums, LayerSpec, Region, ReplicaKey, Role, Segment, StreamHandle, Worker, WorkerOptions};

/// `H` of SPEC section 3, written here again so that the reference does not
/// depend on the crate's constant.
pub const HEADS_PER_LAYER: u64 = 65536;

// ---------------------------------------------------------------------------
// Random numbers
// ---------------------------------------------------------------------------

/// A small splitmix64 generator; every test makes its own from the run's seed.
#[derive(Debug, Clone)]
pub struct Rng {
    seed: u64,
    state: u64,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The run's seed: `KVCS_TEST_SEED` when set, else taken from the clock.
pub fn run_seed() -> u64 {
    match std::env::var("KVCS_TEST_SEED") {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("KVCS_TEST_SEED {text:?} is not a u64")),
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let mut state = nanos ^ (std::process::id() as u64) << 32;
            splitmix(&mut state)
        }
    }
}

impl Rng {
    /// The generator of test `test_name`: the run's seed mixed with the name,
    /// so tests draw different data but one seed reproduces all of them. The
    /// seed is printed (shown by cargo for a failing test).
    pub fn for_test(test_name: &str) -> Rng {
        let seed = run_seed();
        eprintln!("[{test_name}] seed {seed}: rerun with KVCS_TEST_SEED={seed} cargo test {test_name}");
        Rng::from_seed_and_name(seed, test_name)
    }

    /// The generator of `test_name` for a given seed.
    pub fn from_seed_and_name(seed: u64, test_name: &str) -> Rng {
        // FNV-1a of the name, so that the stream depends on it.
        let mut name_hash = 0xCBF2_9CE4_8422_2325u64;
        for byte in test_name.bytes() {
            name_hash = (name_hash ^ byte as u64).wrapping_mul(0x0000_0100_0000_01B3);
        }
        let mut state = seed ^ name_hash;
        splitmix(&mut state);
        Rng { seed, state }
    }

    /// The run's seed (put it in assertion messages).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        splitmix(&mut self.state)
    }

    /// A value in `0 .. n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// A value in `range` (non-empty).
    pub fn range(&mut self, range: Range<u64>) -> u64 {
        assert!(range.start < range.end, "empty range {range:?}");
        range.start + self.below(range.end - range.start)
    }

    /// True with probability `numerator / denominator`.
    pub fn chance(&mut self, numerator: u64, denominator: u64) -> bool {
        self.below(denominator) < numerator
    }

    /// One element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    /// Random bytes, any value.
    pub fn fill(&mut self, bytes: &mut [u8]) {
        for chunk in bytes.chunks_mut(8) {
            let word = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }

    /// Random bytes, none zero (cells are never zero, so that a piece read
    /// from the wrong place or not at all cannot go unnoticed).
    pub fn fill_nonzero(&mut self, bytes: &mut [u8]) {
        self.fill(bytes);
        for byte in bytes.iter_mut() {
            if *byte == 0 {
                *byte = 0x5A;
            }
        }
    }

    /// Shuffles `items` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }

    /// A random permutation of `0 .. n`.
    pub fn permutation(&mut self, n: u32) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..n).collect();
        self.shuffle(&mut ids);
        ids
    }
}

// ---------------------------------------------------------------------------
// Logical KV and the naive reference
// ---------------------------------------------------------------------------

/// The shape of a logical KV cache of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Model-wide number of the first layer.
    pub first_layer: u32,
    /// Layers `first_layer .. first_layer + num_layers`.
    pub num_layers: u32,
    /// Global number of head 0 of this cache (non-zero for a layer's second
    /// cache, such as an indexer, whose heads follow the first cache's).
    pub first_head: u32,
    /// KV heads of the whole model (across TP).
    pub total_kv_heads: u32,
    /// K bytes of a cell (the whole latent row for MLA); a multiple of 8.
    pub k_bytes: u32,
    /// V bytes of a cell (0 for MLA); a multiple of 8.
    pub v_bytes: u32,
    /// Tokens whose KV the request holds.
    pub num_tokens: u64,
}

impl KvShape {
    /// A GQA cache: `head_bytes` of K and of V per head and token.
    pub fn gqa(num_layers: u32, total_kv_heads: u32, head_bytes: u32, num_tokens: u64) -> KvShape {
        KvShape {
            first_layer: 0,
            num_layers,
            first_head: 0,
            total_kv_heads,
            k_bytes: head_bytes,
            v_bytes: head_bytes,
            num_tokens,
        }
    }

    /// An MLA-like cache: one latent head of `latent_bytes` per token, no V.
    pub fn mla(num_layers: u32, latent_bytes: u32, num_tokens: u64) -> KvShape {
        KvShape {
            first_layer: 0,
            num_layers,
            first_head: 0,
            total_kv_heads: 1,
            k_bytes: latent_bytes,
            v_bytes: 0,
            num_tokens,
        }
    }

    /// Bytes of one cell (K then V).
    pub fn cell_bytes(&self) -> u32 {
        self.k_bytes + self.v_bytes
    }
}

/// A request's logical KV: random, never-zero cell bytes per (layer, head,
/// token), independent of any memory layout.
#[derive(Debug, Clone)]
pub struct LogicalKv {
    /// Its shape.
    pub shape: KvShape,
    /// `[layer][head][token][cell byte]`.
    cells: Vec<u8>,
}

impl LogicalKv {
    /// Fresh random KV of `shape`.
    pub fn random(rng: &mut Rng, shape: KvShape) -> LogicalKv {
        assert!(
            shape.k_bytes > 0 && shape.k_bytes.is_multiple_of(8),
            "k_bytes {} must be a positive multiple of 8",
            shape.k_bytes
        );
        assert!(
            shape.v_bytes.is_multiple_of(8),
            "v_bytes {} must be a multiple of 8",
            shape.v_bytes
        );
        let len = shape.num_layers as usize
            * shape.total_kv_heads as usize
            * shape.num_tokens as usize
            * shape.cell_bytes() as usize;
        let mut cells = vec![0u8; len];
        rng.fill_nonzero(&mut cells);
        LogicalKv { shape, cells }
    }

    /// Bytes of one cell.
    pub fn cell_bytes(&self) -> u32 {
        self.shape.cell_bytes()
    }

    /// Tokens whose KV the request holds.
    pub fn num_tokens(&self) -> u64 {
        self.shape.num_tokens
    }

    /// Model-wide layer numbers, in order.
    pub fn layer_numbers(&self) -> Vec<u32> {
        (0..self.shape.num_layers).map(|i| self.shape.first_layer + i).collect()
    }

    /// Global head numbers, in order.
    pub fn heads(&self) -> Vec<u32> {
        (0..self.shape.total_kv_heads)
            .map(|i| self.shape.first_head + i)
            .collect()
    }

    fn cell_start(&self, layer_number: u32, head: u32, token: u64) -> usize {
        let s = &self.shape;
        // u64, so that layer numbers up to u32::MAX work.
        let first_layer = s.first_layer as u64;
        assert!(
            (first_layer..first_layer + s.num_layers as u64).contains(&(layer_number as u64)),
            "layer_number {layer_number} is not in this KV"
        );
        let first_head = s.first_head as u64;
        assert!(
            (first_head..first_head + s.total_kv_heads as u64).contains(&(head as u64)),
            "head {head} is not in this KV"
        );
        assert!(
            token < s.num_tokens,
            "token {token} is not below num_tokens {}",
            s.num_tokens
        );
        let layer = (layer_number - s.first_layer) as usize;
        let head = (head - s.first_head) as usize;
        ((layer * s.total_kv_heads as usize + head) * s.num_tokens as usize + token as usize) * s.cell_bytes() as usize
    }

    /// The cell of (layer, global head, token): K bytes then V bytes.
    pub fn cell(&self, layer_number: u32, head: u32, token: u64) -> &[u8] {
        let start = self.cell_start(layer_number, head, token);
        &self.cells[start..start + self.cell_bytes() as usize]
    }

    /// The cell of (layer, global head, token), writable.
    pub fn cell_mut(&mut self, layer_number: u32, head: u32, token: u64) -> &mut [u8] {
        let start = self.cell_start(layer_number, head, token);
        let len = self.cell_bytes() as usize;
        &mut self.cells[start..start + len]
    }
}

thread_local! {
    static ALGORITHM: Cell<Algorithm> = const { Cell::new(Algorithm::Mixed) };
}

/// The algorithm of this thread's tests: the naive reference computes it
/// and the workers the helpers make ([`host_worker`], the GPU tests'
/// device workers) are set to it. MIXED, the library's default, unless a
/// test runs its cases under each ([`for_each_algorithm`]).
pub fn algorithm() -> Algorithm {
    ALGORITHM.with(Cell::get)
}

/// Runs `body` once per algorithm, WEIGHTED then MIXED, with
/// [`algorithm`] set to it; back to MIXED after.
pub fn for_each_algorithm(mut body: impl FnMut(Algorithm)) {
    for algorithm in [Algorithm::Weighted, Algorithm::Mixed] {
        ALGORITHM.with(|cell| cell.set(algorithm));
        body(algorithm);
    }
    ALGORITHM.with(|cell| cell.set(Algorithm::Mixed));
}

/// Runs `body` with [`algorithm`] set to `algorithm`; back to MIXED after.
pub fn with_algorithm<T>(algorithm: Algorithm, body: impl FnOnce() -> T) -> T {
    ALGORITHM.with(|cell| cell.set(algorithm));
    let out = body();
    ALGORITHM.with(|cell| cell.set(Algorithm::Mixed));
    out
}

/// `f` of SPEC section 12, written here again from the definition: WEIGHTED
/// takes a piece as it is; MIXED folds its high half into the low one,
/// multiplies by the constant and folds the product's high half back.
pub fn naive_piece(algorithm: Algorithm, x: u64) -> u64 {
    match algorithm {
        Algorithm::Weighted => x,
        Algorithm::Mixed => {
            let folded = x ^ (x >> 32);
            let product = folded.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            product ^ (product >> 32)
        }
    }
}

/// Valid tokens of the block at `position`, straight from SPEC section 5.
pub fn naive_valid_tokens(num_tokens: u64, block_size: u32, position: u64) -> u32 {
    let start = position as u128 * block_size as u128;
    if start >= num_tokens as u128 {
        0
    } else {
        (num_tokens as u128 - start).min(block_size as u128) as u32
    }
}

/// The block checksum of SPEC sections 2-3 (and 12, under [`algorithm`])
/// over the given layers and global heads of `kv`, for tokens
/// `first_token .. first_token + valid_tokens`, computed the slow obvious
/// way, one piece at a time.
pub fn naive_block_checksum(
    kv: &LogicalKv,
    layer_numbers: &[u32],
    heads: &[u32],
    first_token: u64,
    valid_tokens: u32,
) -> u64 {
    let pieces_per_token = kv.cell_bytes() as u64 / 8;
    let algorithm = algorithm();
    let mut block = 0u64;
    for &layer in layer_numbers {
        for &head in heads {
            let mut slice = 0u64;
            for token in first_token..first_token + valid_tokens as u64 {
                let cell = kv.cell(layer, head, token);
                for piece in 0..pieces_per_token {
                    let at = piece as usize * 8;
                    let x = naive_piece(algorithm, u64::from_le_bytes(cell[at..at + 8].try_into().unwrap()));
                    let j = token.wrapping_mul(pieces_per_token).wrapping_add(piece);
                    let weight = j.wrapping_mul(2).wrapping_add(1);
                    slice = slice.wrapping_add(x.wrapping_mul(weight));
                }
            }
            let m = (layer as u64)
                .wrapping_mul(HEADS_PER_LAYER)
                .wrapping_add(head as u64)
                .wrapping_mul(2)
                .wrapping_add(1);
            block = block.wrapping_add(m.wrapping_mul(slice));
        }
    }
    block
}

/// The naive checksums of positions `first_position ..` (`num_positions` of
/// them) over the given layers and heads, with `block_size`-token blocks.
pub fn naive_positions(
    kv: &LogicalKv,
    layer_numbers: &[u32],
    heads: &[u32],
    block_size: u32,
    first_position: u64,
    num_positions: usize,
) -> Vec<u64> {
    (0..num_positions as u64)
        .map(|i| {
            let position = first_position + i;
            let valid = naive_valid_tokens(kv.num_tokens(), block_size, position);
            naive_block_checksum(kv, layer_numbers, heads, position * block_size as u64, valid)
        })
        .collect()
}

/// The full `c` (every layer and head of `kv`) of the given positions.
pub fn naive_full(kv: &LogicalKv, block_size: u32, first_position: u64, num_positions: usize) -> Vec<u64> {
    naive_positions(
        kv,
        &kv.layer_numbers(),
        &kv.heads(),
        block_size,
        first_position,
        num_positions,
    )
}

/// Element-wise wrapping sum.
pub fn add_values(total: &mut [u64], part: &[u64]) {
    assert_eq!(total.len(), part.len(), "value counts differ");
    for (t, p) in total.iter_mut().zip(part) {
        *t = t.wrapping_add(*p);
    }
}

// ---------------------------------------------------------------------------
// Shards
// ---------------------------------------------------------------------------

/// What one worker (TP rank, PP stage) holds of a logical KV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// TP rank.
    pub tp_rank: u32,
    /// TP size.
    pub tp_size: u32,
    /// PP stage.
    pub pp_rank: u32,
    /// PP stages.
    pub pp_size: u32,
    /// Model-wide layer numbers held.
    pub layer_numbers: Vec<u32>,
    /// First global head held.
    pub first_head: u32,
    /// Heads held.
    pub num_heads: u32,
    /// Replica key of those heads (SPEC section 4).
    pub replica: ReplicaKey,
}

impl Shard {
    /// Global heads held.
    pub fn heads(&self) -> Vec<u32> {
        (self.first_head..self.first_head + self.num_heads).collect()
    }
}

/// Heads of TP rank `tp_rank` of `tp_size` over `total_kv_heads` heads
/// numbered from `first_head`: `(first head, heads, replica key)`. With more
/// ranks than heads each rank holds one head, replicated on
/// `R = tp_size / total_kv_heads` consecutive ranks, key `(R, tp_rank % R)`;
/// an MLA latent (one head) is thus replicated on every rank.
pub fn tp_heads(first_head: u32, total_kv_heads: u32, tp_rank: u32, tp_size: u32) -> (u32, u32, ReplicaKey) {
    assert!(tp_rank < tp_size);
    if tp_size <= total_kv_heads {
        assert_eq!(
            total_kv_heads % tp_size,
            0,
            "{total_kv_heads} heads do not split over TP {tp_size}"
        );
        let per_rank = total_kv_heads / tp_size;
        let key = ReplicaKey {
            replicas: 1,
            replica_index: 0,
        };
        (first_head + tp_rank * per_rank, per_rank, key)
    } else {
        assert_eq!(
            tp_size % total_kv_heads,
            0,
            "TP {tp_size} does not replicate {total_kv_heads} heads evenly"
        );
        let replicas = tp_size / total_kv_heads;
        let key = ReplicaKey {
            replicas,
            replica_index: tp_rank % replicas,
        };
        (first_head + tp_rank / replicas, 1, key)
    }
}

/// Layers of PP stage `pp_rank` of `pp_size`: contiguous, possibly uneven.
pub fn pp_layers(layer_numbers: &[u32], pp_rank: u32, pp_size: u32) -> Vec<u32> {
    let n = layer_numbers.len();
    let start = n * pp_rank as usize / pp_size as usize;
    let end = n * (pp_rank as usize + 1) / pp_size as usize;
    layer_numbers[start..end].to_vec()
}

/// The shard of `kv` held by (tp_rank, pp_rank).
pub fn shard(kv: &LogicalKv, tp_rank: u32, tp_size: u32, pp_rank: u32, pp_size: u32) -> Shard {
    let (first_head, num_heads, replica) = tp_heads(kv.shape.first_head, kv.shape.total_kv_heads, tp_rank, tp_size);
    Shard {
        tp_rank,
        tp_size,
        pp_rank,
        pp_size,
        layer_numbers: pp_layers(&kv.layer_numbers(), pp_rank, pp_size),
        first_head,
        num_heads,
        replica,
    }
}

// ---------------------------------------------------------------------------
// Buffers and layouts
// ---------------------------------------------------------------------------

/// Host bytes at an 8-byte aligned address that does not move.
#[derive(Debug, Clone)]
pub struct Buffer {
    words: Vec<u64>,
    len: usize,
}

impl Buffer {
    /// `len` random bytes.
    pub fn random(rng: &mut Rng, len: usize) -> Buffer {
        let words = (0..len.div_ceil(8)).map(|_| rng.next_u64()).collect();
        Buffer { words, len }
    }

    /// Its bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes, any byte is
        // a valid `u8`, and the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    /// Its bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and the slice borrows `self` mutably.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }

    /// Host address of byte 0.
    pub fn address(&self) -> u64 {
        self.words.as_ptr() as u64
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }
}

/// How a cache lays out its cells in memory. Shapes use `L` layers of the
/// placement, `nb` blocks, `bs` tokens per block, `h` heads held, `C` cell
/// bytes (K then V).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutKind {
    /// One buffer per layer, `[nb][h][bs][C]`.
    Hnd,
    /// One buffer per layer, `[nb][bs][h][C]`.
    Nhd,
    /// vLLM's `[2, nb, bs, h, head_size]`: one buffer per layer, K half then
    /// V half (two segments); needs K and V of equal size.
    KvSplit,
    /// Two buffers per layer, K `[nb][h][bs][K]` and V `[nb][h][bs][V]`.
    HndKvSplit,
    /// Each logical block as `kernel_blocks` kernel blocks that are not
    /// adjacent: `[kernel_blocks][nb][h][bs / kernel_blocks][C]`.
    KernelBlocks {
        /// Kernel blocks per logical block; divides the block size.
        kernel_blocks: u32,
    },
    /// One buffer for every layer, `[nb][L][h][bs][C]`.
    CrossLayer,
    /// `[nb][h][bs][C]` with blocks, heads and tokens in reverse order, so
    /// that every stride is negative.
    NegativeStride,
    /// HND with 8 bytes of junk before the cache and padding after each
    /// token, head and block; addresses are 8 but not always 16 modulo 16.
    Padded,
}

/// Every layout kind, for KV with separate K and V of equal size; kernel
/// block splits need a block size divisible by 4.
pub fn all_kinds() -> Vec<LayoutKind> {
    vec![
        LayoutKind::Hnd,
        LayoutKind::Nhd,
        LayoutKind::KvSplit,
        LayoutKind::HndKvSplit,
        LayoutKind::KernelBlocks { kernel_blocks: 2 },
        LayoutKind::KernelBlocks { kernel_blocks: 4 },
        LayoutKind::CrossLayer,
        LayoutKind::NegativeStride,
        LayoutKind::Padded,
    ]
}

/// The layout kinds with the cell in one segment (usable for MLA latents).
pub fn single_segment_kinds() -> Vec<LayoutKind> {
    all_kinds()
        .into_iter()
        .filter(|kind| !matches!(kind, LayoutKind::KvSplit | LayoutKind::HndKvSplit))
        .collect()
}

/// Junk bytes before a padded cache.
const PAD_LEAD: usize = 8;
/// Junk bytes after each token, head and block of a padded cache.
const PAD_TOKEN: usize = 8;
const PAD_HEAD: usize = 16;
const PAD_BLOCK: usize = 24;

/// What one placement holds: one group's caches of some layers and heads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheSpec {
    /// The layout.
    pub kind: LayoutKind,
    /// Group of the caches.
    pub group_id: u32,
    /// Tokens per logical block.
    pub block_size: u32,
    /// Logical blocks in each cache.
    pub num_blocks: u32,
    /// Model-wide layer numbers held.
    pub layer_numbers: Vec<u32>,
    /// First global head held.
    pub first_head: u32,
    /// Heads held.
    pub num_heads: u32,
    /// Replica key of the heads.
    pub replica: ReplicaKey,
    /// K bytes per cell.
    pub k_bytes: u32,
    /// V bytes per cell (0: cell is K only).
    pub v_bytes: u32,
}

impl CacheSpec {
    /// The caches of `shard` of `kv`.
    pub fn for_shard(
        kv: &LogicalKv,
        shard: &Shard,
        kind: LayoutKind,
        group_id: u32,
        block_size: u32,
        num_blocks: u32,
    ) -> CacheSpec {
        CacheSpec {
            kind,
            group_id,
            block_size,
            num_blocks,
            layer_numbers: shard.layer_numbers.clone(),
            first_head: shard.first_head,
            num_heads: shard.num_heads,
            replica: shard.replica,
            k_bytes: kv.shape.k_bytes,
            v_bytes: kv.shape.v_bytes,
        }
    }

    fn cell_bytes(&self) -> usize {
        (self.k_bytes + self.v_bytes) as usize
    }

    fn padded_pitches(&self) -> (usize, usize, usize) {
        let token = self.cell_bytes() + PAD_TOKEN;
        let head = self.block_size as usize * token + PAD_HEAD;
        let block = self.num_heads as usize * head + PAD_BLOCK;
        (token, head, block)
    }
}

/// A placement: the bytes of one group's caches on one worker in a chosen
/// layout (random junk wherever no valid cell was written).
#[derive(Debug, Clone)]
pub struct Placement {
    spec: CacheSpec,
    buffers: Vec<Buffer>,
}

impl Placement {
    /// Caches of `spec` filled with random junk.
    pub fn new(rng: &mut Rng, spec: CacheSpec) -> Placement {
        let (nb, bs, h, c) = (
            spec.num_blocks as usize,
            spec.block_size as usize,
            spec.num_heads as usize,
            spec.cell_bytes(),
        );
        let layers = spec.layer_numbers.len();
        assert!(layers > 0 && nb > 0 && h > 0, "empty cache spec {spec:?}");
        let per_layer = nb * h * bs * c;
        let sizes: Vec<usize> = match spec.kind {
            LayoutKind::Hnd | LayoutKind::Nhd | LayoutKind::NegativeStride => vec![per_layer; layers],
            LayoutKind::KvSplit => {
                assert!(
                    spec.k_bytes == spec.v_bytes,
                    "KvSplit needs equal K and V sizes: {spec:?}"
                );
                vec![per_layer; layers]
            }
            LayoutKind::HndKvSplit => {
                assert!(spec.v_bytes > 0, "HndKvSplit needs a V part: {spec:?}");
                let part = |bytes: u32| nb * h * bs * bytes as usize;
                (0..layers)
                    .flat_map(|_| [part(spec.k_bytes), part(spec.v_bytes)])
                    .collect()
            }
            LayoutKind::KernelBlocks { kernel_blocks } => {
                assert!(
                    kernel_blocks > 0 && spec.block_size.is_multiple_of(kernel_blocks),
                    "kernel_blocks {kernel_blocks} does not divide block size {}",
                    spec.block_size
                );
                vec![per_layer; layers]
            }
            LayoutKind::CrossLayer => vec![per_layer * layers],
            LayoutKind::Padded => {
                let (_, _, block) = spec.padded_pitches();
                vec![PAD_LEAD + nb * block; layers]
            }
        };
        let buffers = sizes.into_iter().map(|len| Buffer::random(rng, len)).collect();
        Placement { spec, buffers }
    }

    /// `shard` of `kv` in layout `kind`, filled with junk (write requests next).
    pub fn for_shard(
        rng: &mut Rng,
        kv: &LogicalKv,
        shard: &Shard,
        kind: LayoutKind,
        group_id: u32,
        block_size: u32,
        num_blocks: u32,
    ) -> Placement {
        Placement::new(
            rng,
            CacheSpec::for_shard(kv, shard, kind, group_id, block_size, num_blocks),
        )
    }

    /// What it holds.
    pub fn spec(&self) -> &CacheSpec {
        &self.spec
    }

    /// Its buffers (copy these to device memory to re-base the placement).
    pub fn buffers(&self) -> &[Buffer] {
        &self.buffers
    }

    /// Its buffers, writable.
    pub fn buffers_mut(&mut self) -> &mut [Buffer] {
        &mut self.buffers
    }

    /// Host addresses of its buffers.
    pub fn host_bases(&self) -> Vec<u64> {
        self.buffers.iter().map(Buffer::address).collect()
    }

    /// One region per buffer, at `bases`.
    pub fn regions(&self, bases: &[u64]) -> Vec<Region> {
        assert_eq!(bases.len(), self.buffers.len(), "one base per buffer");
        bases
            .iter()
            .zip(&self.buffers)
            .map(|(&address, buffer)| Region {
                address,
                length: buffer.len() as u64,
            })
            .collect()
    }

    /// Where byte `byte` of the cell of (layer, global head) in slot `slot`
    /// of block `block_id` lives: `(buffer index, byte offset)`. Written as
    /// index arithmetic over each layout's shape, independently of the
    /// strides that [`Placement::layer_specs`] gives the engine.
    pub fn locate(&self, layer_number: u32, head: u32, block_id: u32, slot: u32, byte: u32) -> (usize, usize) {
        let s = &self.spec;
        let l = s
            .layer_numbers
            .iter()
            .position(|&n| n == layer_number)
            .unwrap_or_else(|| panic!("layer_number {layer_number} is not in this placement"));
        assert!(
            (s.first_head..s.first_head + s.num_heads).contains(&head),
            "head {head} is not in this placement"
        );
        assert!(block_id < s.num_blocks && slot < s.block_size && (byte as usize) < s.cell_bytes());
        let (nb, bs, h, c) = (
            s.num_blocks as usize,
            s.block_size as usize,
            s.num_heads as usize,
            s.cell_bytes(),
        );
        let layers = s.layer_numbers.len();
        let (hd, b, t, byte) = (
            (head - s.first_head) as usize,
            block_id as usize,
            slot as usize,
            byte as usize,
        );
        let k = s.k_bytes as usize;
        match s.kind {
            LayoutKind::Hnd => (l, ((b * h + hd) * bs + t) * c + byte),
            LayoutKind::Nhd => (l, ((b * bs + t) * h + hd) * c + byte),
            LayoutKind::KvSplit => {
                let (half, inner) = if byte < k { (0, byte) } else { (1, byte - k) };
                (l, (((half * nb + b) * bs + t) * h + hd) * k + inner)
            }
            LayoutKind::HndKvSplit => {
                if byte < k {
                    (2 * l, ((b * h + hd) * bs + t) * k + byte)
                } else {
                    let v = s.v_bytes as usize;
                    (2 * l + 1, ((b * h + hd) * bs + t) * v + byte - k)
                }
            }
            LayoutKind::KernelBlocks { kernel_blocks } => {
                let per_kernel = bs / kernel_blocks as usize;
                let (kernel, kt) = (t / per_kernel, t % per_kernel);
                (l, (((kernel * nb + b) * h + hd) * per_kernel + kt) * c + byte)
            }
            LayoutKind::CrossLayer => (0, (((b * layers + l) * h + hd) * bs + t) * c + byte),
            LayoutKind::NegativeStride => (l, (((nb - 1 - b) * h + (h - 1 - hd)) * bs + (bs - 1 - t)) * c + byte),
            LayoutKind::Padded => {
                let (token, head_pitch, block) = s.padded_pitches();
                (l, PAD_LEAD + b * block + hd * head_pitch + t * token + byte)
            }
        }
    }

    /// Writes `kv`'s valid cells of the placement's layers and heads into
    /// blocks `block_ids` at positions `first_position ..`. Slots past
    /// `num_tokens` keep their junk.
    pub fn write_request(&mut self, kv: &LogicalKv, first_position: u64, block_ids: &[u32]) {
        assert_eq!(kv.cell_bytes() as usize, self.spec.cell_bytes(), "cell sizes differ");
        let spec = self.spec.clone();
        for (i, &block_id) in block_ids.iter().enumerate() {
            let position = first_position + i as u64;
            let valid = naive_valid_tokens(kv.num_tokens(), spec.block_size, position);
            for &layer in &spec.layer_numbers {
                for head in spec.first_head..spec.first_head + spec.num_heads {
                    for slot in 0..valid {
                        let token = position * spec.block_size as u64 + slot as u64;
                        let cell = kv.cell(layer, head, token);
                        for piece in (0..cell.len()).step_by(8) {
                            let (buffer, at) = self.locate(layer, head, block_id, slot, piece as u32);
                            self.buffers[buffer].bytes_mut()[at..at + 8].copy_from_slice(&cell[piece..piece + 8]);
                        }
                    }
                }
            }
        }
    }

    /// XORs `mask` into one byte of a cell (see [`Placement::locate`]).
    pub fn xor_byte(&mut self, layer_number: u32, head: u32, block_id: u32, slot: u32, byte: u32, mask: u8) {
        let (buffer, at) = self.locate(layer_number, head, block_id, slot, byte);
        self.buffers[buffer].bytes_mut()[at] ^= mask;
    }

    /// The engine's description of the caches with buffer `i` at `bases[i]`.
    pub fn layer_specs(&self, bases: &[u64]) -> Vec<LayerSpec> {
        let s = &self.spec;
        assert_eq!(bases.len(), self.buffers.len(), "one base per buffer");
        let (nb, bs, h, c) = (
            s.num_blocks as i64,
            s.block_size as i64,
            s.num_heads as i64,
            s.cell_bytes() as i64,
        );
        let layers = s.layer_numbers.len() as i64;
        let (k, v) = (s.k_bytes as i64, s.v_bytes as i64);
        let at = |base: u64, offset: i64| (base as i64 + offset) as u64;
        let segment = |address: u64, block: i64, kernel: i64, head: i64, token: i64, bytes: i64| Segment {
            address,
            block_stride: block,
            kernel_block_stride: kernel,
            head_stride: head,
            token_stride: token,
            bytes_per_token: bytes as u32,
        };
        let kernel_blocks = match s.kind {
            LayoutKind::KernelBlocks { kernel_blocks } => kernel_blocks,
            _ => 1,
        };
        s.layer_numbers
            .iter()
            .enumerate()
            .map(|(l, &layer_number)| {
                let base = bases[match s.kind {
                    LayoutKind::HndKvSplit => 2 * l,
                    LayoutKind::CrossLayer => 0,
                    _ => l,
                }];
                let segments = match s.kind {
                    LayoutKind::Hnd => vec![segment(base, h * bs * c, 0, bs * c, c, c)],
                    LayoutKind::Nhd => vec![segment(base, bs * h * c, 0, c, h * c, c)],
                    LayoutKind::KvSplit => vec![
                        segment(base, bs * h * k, 0, k, h * k, k),
                        segment(at(base, nb * bs * h * k), bs * h * k, 0, k, h * k, k),
                    ],
                    LayoutKind::HndKvSplit => vec![
                        segment(base, h * bs * k, 0, bs * k, k, k),
                        segment(bases[2 * l + 1], h * bs * v, 0, bs * v, v, v),
                    ],
                    LayoutKind::KernelBlocks { .. } => {
                        let per_kernel = bs / kernel_blocks as i64;
                        vec![segment(
                            base,
                            h * per_kernel * c,
                            nb * h * per_kernel * c,
                            per_kernel * c,
                            c,
                            c,
                        )]
                    }
                    LayoutKind::CrossLayer => {
                        vec![segment(
                            at(base, l as i64 * h * bs * c),
                            layers * h * bs * c,
                            0,
                            bs * c,
                            c,
                            c,
                        )]
                    }
                    LayoutKind::NegativeStride => {
                        let last = (((nb - 1) * h + (h - 1)) * bs + (bs - 1)) * c;
                        vec![segment(at(base, last), -h * bs * c, 0, -bs * c, -c, c)]
                    }
                    LayoutKind::Padded => {
                        let (token, head, block) = s.padded_pitches();
                        vec![segment(
                            at(base, PAD_LEAD as i64),
                            block as i64,
                            0,
                            head as i64,
                            token as i64,
                            c,
                        )]
                    }
                };
                LayerSpec {
                    group_id: s.group_id,
                    layer_number,
                    first_head: s.first_head,
                    num_heads: s.num_heads,
                    replica: s.replica,
                    num_blocks: s.num_blocks,
                    kernel_blocks,
                    tokens_per_kernel_block: s.block_size / kernel_blocks,
                    segments,
                    identity: format!("layer {layer_number}").into_bytes(),
                }
            })
            .collect()
    }

    /// [`Placement::layer_specs`] at the host buffers.
    pub fn host_layer_specs(&self) -> Vec<LayerSpec> {
        self.layer_specs(&self.host_bases())
    }
}

// ---------------------------------------------------------------------------
// Requests and block sets
// ---------------------------------------------------------------------------

/// One group's blocks of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupTable {
    /// The group.
    pub group_id: u32,
    /// Position of `block_ids[0]`.
    pub first_position: u64,
    /// Block ids at consecutive positions.
    pub block_ids: Vec<u32>,
}

/// A request of a block set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestRequest {
    /// Request id.
    pub req_id: String,
    /// Tokens whose KV it holds.
    pub num_tokens: u64,
    /// Per group, its blocks.
    pub tables: Vec<GroupTable>,
}

impl TestRequest {
    /// The table of `group_id`.
    pub fn table(&self, group_id: u32) -> &GroupTable {
        self.tables
            .iter()
            .find(|t| t.group_id == group_id)
            .unwrap_or_else(|| panic!("req {} has no group {group_id}", self.req_id))
    }
}

/// The block set of `requests`, in order.
pub fn block_set(requests: &[TestRequest]) -> BlockSet {
    let mut blocks = BlockSet::new();
    for request in requests {
        blocks
            .add_request(&request.req_id, request.num_tokens)
            .expect("add_request");
        for table in &request.tables {
            blocks
                .add_group(&request.req_id, table.group_id, table.first_position, &table.block_ids)
                .expect("add_group");
        }
    }
    blocks
}

/// Hands out distinct block ids of a cache in random order (scattered).
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    free: Vec<u32>,
}

impl BlockAllocator {
    /// All of `0 .. num_blocks`, shuffled.
    pub fn new(rng: &mut Rng, num_blocks: u32) -> BlockAllocator {
        BlockAllocator {
            free: rng.permutation(num_blocks),
        }
    }

    /// `count` ids not handed out before.
    pub fn take(&mut self, count: usize) -> Vec<u32> {
        assert!(
            count <= self.free.len(),
            "cache too small: {count} blocks wanted, {} left",
            self.free.len()
        );
        self.free.split_off(self.free.len() - count)
    }

    /// Takes `block_id` out of the free list (to place it deliberately).
    pub fn reserve(&mut self, block_id: u32) -> u32 {
        let at = self
            .free
            .iter()
            .position(|&b| b == block_id)
            .expect("block id already taken");
        self.free.swap_remove(at);
        block_id
    }

    /// Ids not handed out yet.
    pub fn remaining(&self) -> usize {
        self.free.len()
    }
}

/// Positions a request of `num_tokens` tokens covers with `block_size`-token
/// blocks from `first_position`, plus `extra` positions past its end.
pub fn positions_for(num_tokens: u64, block_size: u32, first_position: u64, extra: usize) -> usize {
    let total = num_tokens.div_ceil(block_size as u64);
    total.saturating_sub(first_position) as usize + extra
}

// ---------------------------------------------------------------------------
// Workers and results
// ---------------------------------------------------------------------------

/// A host worker of this thread's [`algorithm`].
pub fn host_worker(tp_rank: u32, tp_size: u32, pp_rank: u32, num_threads: u32) -> Worker {
    let mut worker = Worker::new(WorkerOptions {
        tp_rank,
        tp_size,
        pp_rank,
        device: None,
        num_threads,
    })
    .expect("host worker");
    worker
        .set_algorithm(algorithm())
        .expect("a new worker takes an algorithm");
    worker
}

/// Registers `placement` with buffer `i` at `bases[i]`: a region per buffer,
/// its group (unless registered already) and its layers.
pub fn register_at(worker: &mut Worker, placement: &Placement, bases: &[u64]) -> kvcsum::Result<()> {
    for region in placement.regions(bases) {
        worker.add_region(region)?;
    }
    let spec = placement.spec();
    if worker.layout().group(spec.group_id).is_none() {
        worker.add_group(spec.group_id, spec.block_size)?;
    }
    for layer in placement.layer_specs(bases) {
        worker.add_layer(layer)?;
    }
    Ok(())
}

/// [`register_at`] at the placement's host buffers; panics on error.
pub fn register_host(worker: &mut Worker, placement: &Placement) {
    register_at(worker, placement, &placement.host_bases()).expect("register placement");
}

/// Runs a checksum call and waits for its values.
pub fn checksum(worker: &Worker, blocks: &BlockSet, role: Role) -> Checksums {
    let result = worker
        .checksum(blocks, role, StreamHandle::legacy_default())
        .expect("checksum");
    result.wait().expect("wait");
    result
}

/// The columns of (`req_id`, `group_id`) in `result`, by replica key.
pub fn columns_of(result: &Checksums, req_id: &str, group_id: u32) -> BTreeMap<ReplicaKey, Vec<u64>> {
    let group = result.group(req_id, group_id).expect("group in result");
    (0..group.columns.len())
        .map(|c| {
            let (key, values) = result.column(req_id, group_id, c).expect("column");
            (key, values.to_vec())
        })
        .collect()
}

/// Adds `part`'s columns into `total`, key by key.
pub fn add_columns(total: &mut BTreeMap<ReplicaKey, Vec<u64>>, part: &BTreeMap<ReplicaKey, Vec<u64>>) {
    for (key, values) in part {
        match total.get_mut(key) {
            Some(sum) => add_values(sum, values),
            None => {
                total.insert(*key, values.clone());
            }
        }
    }
}

/// Sum of every column (a producer's `c` once summed over its workers).
pub fn sum_of_columns(columns: &BTreeMap<ReplicaKey, Vec<u64>>, num_positions: usize) -> Vec<u64> {
    let mut sum = vec![0u64; num_positions];
    for values in columns.values() {
        add_values(&mut sum, values);
    }
    sum
}

/// The consumer checks of SPEC section 4 over columns summed across every
/// worker: check `k` in `0 .. maxR` sums, over the distinct replica counts
/// `R`, the column of key `(R, k % R)`. Panics when a key is missing.
pub fn replica_checks(totals: &BTreeMap<ReplicaKey, Vec<u64>>, num_positions: usize) -> Vec<Vec<u64>> {
    let mut counts: Vec<u32> = totals.keys().map(|key| key.replicas).collect();
    counts.dedup();
    let max = counts.iter().copied().max().unwrap_or(1);
    (0..max)
        .map(|k| {
            let mut check = vec![0u64; num_positions];
            for &replicas in &counts {
                let key = ReplicaKey {
                    replicas,
                    replica_index: k % replicas,
                };
                let column = totals.get(&key).unwrap_or_else(|| panic!("no column {key:?}"));
                add_values(&mut check, column);
            }
            check
        })
        .collect()
}

/// One worker of a host deployment and the placements it reads.
pub struct HostRank {
    /// Its shard of the model.
    pub shard: Shard,
    /// Its caches (kept alive while the worker is).
    pub placements: Vec<Placement>,
    /// The worker, with the placements registered.
    pub worker: Worker,
}

/// How to deploy one group of a logical KV over TP x PP host workers.
#[derive(Debug, Clone, Copy)]
pub struct Deploy {
    /// TP size.
    pub tp_size: u32,
    /// PP stages.
    pub pp_size: u32,
    /// Layout of every rank's caches.
    pub kind: LayoutKind,
    /// Group id.
    pub group_id: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks per cache.
    pub num_blocks: u32,
    /// Host threads per worker.
    pub num_threads: u32,
}

/// Deploys requests whose KV all have `shape_of`'s shape: every rank gets its
/// shard's caches in `deploy.kind`, each request's cells written at its
/// group table, and a host worker with it all registered. Ranks are ordered
/// `pp_rank * tp_size + tp_rank`.
pub fn deploy_host(rng: &mut Rng, deploy: Deploy, requests: &[(&LogicalKv, &GroupTable)]) -> Vec<HostRank> {
    let model = requests.first().expect("at least one request").0;
    let mut ranks = Vec::new();
    for pp_rank in 0..deploy.pp_size {
        for tp_rank in 0..deploy.tp_size {
            let shard = shard(model, tp_rank, deploy.tp_size, pp_rank, deploy.pp_size);
            let mut worker = host_worker(tp_rank, deploy.tp_size, pp_rank, deploy.num_threads);
            let mut placements = Vec::new();
            if !shard.layer_numbers.is_empty() {
                let mut placement = Placement::for_shard(
                    rng,
                    model,
                    &shard,
                    deploy.kind,
                    deploy.group_id,
                    deploy.block_size,
                    deploy.num_blocks,
                );
                for (kv, table) in requests {
                    assert_eq!(kv.shape.num_layers, model.shape.num_layers);
                    placement.write_request(kv, table.first_position, &table.block_ids);
                }
                register_host(&mut worker, &placement);
                placements.push(placement);
            } else {
                // A stage with no layers of the group still knows the group.
                worker.add_group(deploy.group_id, deploy.block_size).expect("add_group");
            }
            ranks.push(HostRank {
                shard,
                placements,
                worker,
            });
        }
    }
    ranks
}
