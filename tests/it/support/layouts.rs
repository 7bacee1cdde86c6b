//! Buffers and layouts: placements of logical KV (or a shard of it) into
//! byte buffers, described relative to each buffer's base address so that
//! the same placement can be copied to device memory and registered there.

use kvcsum::{LayerSpec, Region, ReplicaKey, Segment};

use super::{naive_valid_tokens, LogicalKv, Rng, Shard};

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
    /// vLLM's sparse-attention indexer cache: one buffer per layer, each
    /// block its K part `[h][bs][K]` then its V part `[h][bs][V]` (the
    /// keys of every token, then their scales: two segments).
    KeysThenScales,
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
        LayoutKind::KeysThenScales,
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
        .filter(|kind| {
            !matches!(
                kind,
                LayoutKind::KvSplit | LayoutKind::HndKvSplit | LayoutKind::KeysThenScales
            )
        })
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
            LayoutKind::Hnd | LayoutKind::Nhd | LayoutKind::NegativeStride | LayoutKind::KeysThenScales => {
                vec![per_layer; layers]
            }
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
            LayoutKind::KeysThenScales => {
                if byte < k {
                    (l, b * h * bs * c + (hd * bs + t) * k + byte)
                } else {
                    let v = s.v_bytes as usize;
                    (l, b * h * bs * c + h * bs * k + (hd * bs + t) * v + byte - k)
                }
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
                        // 4 bytes at a time: every part of a cell is a
                        // multiple of 4 bytes (SPEC section 1).
                        for piece in (0..cell.len()).step_by(4) {
                            let (buffer, at) = self.locate(layer, head, block_id, slot, piece as u32);
                            self.buffers[buffer].bytes_mut()[at..at + 4].copy_from_slice(&cell[piece..piece + 4]);
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
                    LayoutKind::KeysThenScales => vec![
                        segment(base, h * bs * c, 0, bs * k, k, k),
                        segment(at(base, h * bs * k), h * bs * c, 0, bs * v, v, v),
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
