//! Token placement (SPEC section 16) test support: logical units, vLLM's
//! forward DCP map, the naive reference that walks it, per-rank caches
//! filled through it, and workers registering them.

use kvcsum::{GroupPlacement, LayerSpec, Region, ReplicaKey, Segment, Worker};

use super::{algorithm, host_worker, naive_piece, Rng};

pub const LAYERS: u32 = 2;
pub const HEADS: u32 = 2;
pub const PIECES: u32 = 4;
pub const KERNEL_BLOCKS: u32 = 2;
pub const NUM_BLOCKS: u32 = 8;
pub const GROUP: u32 = 0;
pub const REQ: &str = "req";

/// One request's logical units: `[layer][head][unit][piece]`, random.
pub struct Units {
    pub values: Vec<u64>,
    pub num_units: u64,
}

impl Units {
    pub fn random(rng: &mut Rng, num_units: u64) -> Units {
        let count = (LAYERS * HEADS) as usize * num_units as usize * PIECES as usize;
        Units {
            values: (0..count).map(|_| rng.next_u64() | 1).collect(),
            num_units,
        }
    }

    pub fn at(&self, layer: u32, head: u32, unit: u64, piece: u32) -> u64 {
        let i = ((layer * HEADS + head) as u64 * self.num_units + unit) * PIECES as u64 + piece as u64;
        self.values[i as usize]
    }
}

/// vLLM's forward map: the (rank, local slot) of in-block unit offset `o`.
pub fn forward(o: u64, dcp_size: u32, interleave: u32) -> (u32, u64) {
    let (d, i) = (dcp_size as u64, interleave as u64);
    (((o / i) % d) as u32, (o / (d * i)) * i + o % i)
}

/// The naive partial of `rank` at block `position`: every unit of the
/// block the rank holds whose tokens are all below `num_tokens`, its
/// pieces weighed by `2 (u P + p) + 1`, each slice by its `m`.
pub fn naive_partial(
    units: &Units,
    p: GroupPlacement,
    block_size: u32,
    num_tokens: u64,
    position: u64,
    rank: Option<u32>,
) -> u64 {
    let per_block = (block_size / p.tokens_per_slot) as u64;
    let mut total = 0u64;
    for layer in 0..LAYERS {
        for head in 0..HEADS {
            let mut slice = 0u64;
            for o in 0..per_block {
                let (owner, _) = forward(o, p.dcp_size, p.interleave);
                if rank.is_some_and(|r| r != owner) {
                    continue;
                }
                let unit = position * per_block + o;
                if (unit + 1) * p.tokens_per_slot as u64 > num_tokens {
                    continue;
                }
                for piece in 0..PIECES {
                    let x = naive_piece(algorithm(), units.at(layer, head, unit, piece));
                    let j = unit * PIECES as u64 + piece as u64;
                    slice = slice.wrapping_add(x.wrapping_mul(2 * j + 1));
                }
            }
            let m = 2 * (layer as u64 * 65536 + head as u64) + 1;
            total = total.wrapping_add(m.wrapping_mul(slice));
        }
    }
    total
}

/// One rank's cache, NHD with two kernel blocks per local block:
/// `[block][kernel block][slot][layer][head][piece]`, junk where no unit
/// of the request was written.
pub struct RankCache {
    pub words: Vec<u64>,
    pub local: u32,
}

impl RankCache {
    pub fn index(&self, block: u32, slot: u64, layer: u32, head: u32, piece: u32) -> usize {
        (((block as u64 * self.local as u64 + slot) * LAYERS as u64 + layer as u64) * HEADS as u64 + head as u64)
            as usize
            * PIECES as usize
            + piece as usize
    }
}

/// Every rank's cache with `units` written at `block_ids` (position `i`
/// at `block_ids[i]`), placed by the forward map.
pub fn rank_caches(
    rng: &mut Rng,
    units: &Units,
    p: GroupPlacement,
    block_size: u32,
    block_ids: &[u32],
) -> Vec<RankCache> {
    let per_block = (block_size / p.tokens_per_slot) as u64;
    let local = (per_block / p.dcp_size as u64) as u32;
    let words = (NUM_BLOCKS * local * LAYERS * HEADS * PIECES) as usize;
    let mut caches: Vec<RankCache> = (0..p.dcp_size)
        .map(|_| RankCache {
            words: (0..words).map(|_| rng.next_u64()).collect(),
            local,
        })
        .collect();
    for (position, &block) in block_ids.iter().enumerate() {
        for o in 0..per_block {
            let unit = position as u64 * per_block + o;
            if unit >= units.num_units {
                continue;
            }
            let (rank, slot) = forward(o, p.dcp_size, p.interleave);
            let cache = &mut caches[rank as usize];
            for layer in 0..LAYERS {
                for head in 0..HEADS {
                    for piece in 0..PIECES {
                        let at = cache.index(block, slot, layer, head, piece);
                        cache.words[at] = units.at(layer, head, unit, piece);
                    }
                }
            }
        }
    }
    caches
}

/// A host worker of DCP rank `rank` over `cache`, its group placed by `p`
/// (a TP rank per DCP rank, as vLLM's DCP ranks are TP ranks).
pub fn rank_worker(cache: &RankCache, p: GroupPlacement, block_size: u32, rank: u32) -> Worker {
    let mut worker = host_worker(rank, p.dcp_size, 0, 1);
    register_rank(&mut worker, cache.words.as_ptr() as u64, cache, p, block_size, rank);
    worker
}

/// Registers `cache` (its words at `base`: host memory, or a device copy)
/// on `worker` as DCP rank `rank`'s cache of group [`GROUP`], placed by `p`.
pub fn register_rank(worker: &mut Worker, base: u64, cache: &RankCache, p: GroupPlacement, block_size: u32, rank: u32) {
    let cell = PIECES as i64 * 8;
    let region = cache.words.len() as u64 * 8;
    register_placed_layers(worker, base, region, cell, cache.local, p, block_size, rank);
}

/// Registers the `[layer][head]` cells of `cell` bytes a token of a rank's
/// cache (`region` bytes at `base`, `local` slots a block) on `worker` as
/// DCP rank `rank`'s cache of group [`GROUP`], placed by `p`: the one
/// registration of both piece widths.
#[allow(clippy::too_many_arguments)]
pub fn register_placed_layers(
    worker: &mut Worker,
    base: u64,
    region: u64,
    cell: i64,
    local: u32,
    p: GroupPlacement,
    block_size: u32,
    rank: u32,
) {
    worker
        .add_region(Region {
            address: base,
            length: region,
        })
        .unwrap();
    worker.add_group(GROUP, block_size).unwrap();
    worker
        .set_group_placement(GROUP, GroupPlacement { dcp_rank: rank, ..p })
        .unwrap();
    let token_stride = cell * (LAYERS * HEADS) as i64;
    let tokens_per_kernel_block = local / KERNEL_BLOCKS;
    for layer in 0..LAYERS {
        worker
            .add_layer(LayerSpec {
                group_id: GROUP,
                layer_number: layer,
                first_head: 0,
                num_heads: HEADS,
                replica: ReplicaKey {
                    replicas: 1,
                    replica_index: 0,
                },
                num_blocks: NUM_BLOCKS,
                kernel_blocks: KERNEL_BLOCKS,
                tokens_per_kernel_block,
                segments: vec![Segment {
                    address: base + (layer as i64 * HEADS as i64 * cell) as u64,
                    block_stride: token_stride * local as i64,
                    kernel_block_stride: token_stride * tokens_per_kernel_block as i64,
                    head_stride: cell,
                    token_stride,
                    bytes_per_token: cell as u32,
                }],
                identity: format!("layer {layer}").into_bytes(),
            })
            .unwrap();
    }
}

/// The same for cells of 4-byte pieces (SPEC section 1): `[layer]
/// [head][unit][piece]` units of 3 pieces (12-byte cells), each rank's
/// NHD cache of two kernel blocks a local block placed by vLLM's forward
/// map, and the naive partial that walks that map.
pub mod narrow {
    use kvcsum::{GroupPlacement, Worker};

    use super::super::{algorithm, host_worker, naive_piece, Rng, HEADS_PER_LAYER};
    use super::forward;

    // The same layers, heads, blocks and group as 8-byte pieces' (one
    // registration serves both: `super::register_placed_layers`).
    pub const LAYERS: u32 = super::LAYERS;
    pub const HEADS: u32 = super::HEADS;
    pub const NUM_BLOCKS: u32 = super::NUM_BLOCKS;
    pub const GROUP: u32 = super::GROUP;
    pub const REQ: &str = super::REQ;
    pub const PIECES: u32 = 3;

    /// One request's units: `[layer][head][unit][piece]`, random.
    pub struct Units {
        pub values: Vec<u32>,
        pub num_units: u64,
    }

    impl Units {
        pub fn random(rng: &mut Rng, num_units: u64) -> Units {
            let count = (LAYERS * HEADS) as usize * num_units as usize * PIECES as usize;
            Units {
                values: (0..count).map(|_| rng.next_u64() as u32 | 1).collect(),
                num_units,
            }
        }

        pub fn at(&self, layer: u32, head: u32, unit: u64, piece: u32) -> u32 {
            let i = ((layer * HEADS + head) as u64 * self.num_units + unit) * PIECES as u64 + piece as u64;
            self.values[i as usize]
        }
    }

    /// The naive partial of `rank` (every rank: `None`) at block
    /// `position`: every unit of the block the rank holds whose tokens are
    /// all below `num_tokens`, its pieces (zero-extended) weighed by
    /// `2 (u P + p) + 1`, each slice by its `m`.
    pub fn naive_partial(
        units: &Units,
        p: GroupPlacement,
        block_size: u32,
        num_tokens: u64,
        position: u64,
        rank: Option<u32>,
    ) -> u64 {
        let per_block = (block_size / p.tokens_per_slot) as u64;
        let mut total = 0u64;
        for layer in 0..LAYERS {
            for head in 0..HEADS {
                let mut slice = 0u64;
                for o in 0..per_block {
                    let (owner, _) = forward(o, p.dcp_size, p.interleave);
                    if rank.is_some_and(|r| r != owner) {
                        continue;
                    }
                    let unit = position * per_block + o;
                    if (unit + 1) * p.tokens_per_slot as u64 > num_tokens {
                        continue;
                    }
                    for piece in 0..PIECES {
                        let x = naive_piece(algorithm(), units.at(layer, head, unit, piece) as u64);
                        let j = unit * PIECES as u64 + piece as u64;
                        slice = slice.wrapping_add(x.wrapping_mul(2 * j + 1));
                    }
                }
                let m = 2 * (layer as u64 * HEADS_PER_LAYER + head as u64) + 1;
                total = total.wrapping_add(m.wrapping_mul(slice));
            }
        }
        total
    }

    /// One rank's cache: `[block][local slot][layer][head][piece]` of
    /// 4-byte words, junk where no unit of the request was written.
    pub struct RankCache {
        pub words: Vec<u32>,
        pub local: u32,
    }

    impl RankCache {
        fn index(&self, block: u32, slot: u64, layer: u32, head: u32, piece: u32) -> usize {
            (((block as u64 * self.local as u64 + slot) * LAYERS as u64 + layer as u64) * HEADS as u64 + head as u64)
                as usize
                * PIECES as usize
                + piece as usize
        }

        /// Its bytes, little-endian.
        pub fn bytes(&self) -> Vec<u8> {
            self.words.iter().flat_map(|w| w.to_le_bytes()).collect()
        }
    }

    /// Every rank's cache with `units` written at `block_ids`.
    pub fn rank_caches(
        rng: &mut Rng,
        units: &Units,
        p: GroupPlacement,
        block_size: u32,
        block_ids: &[u32],
    ) -> Vec<RankCache> {
        let per_block = (block_size / p.tokens_per_slot) as u64;
        let local = (per_block / p.dcp_size as u64) as u32;
        let words = (NUM_BLOCKS * local * LAYERS * HEADS * PIECES) as usize;
        let mut caches: Vec<RankCache> = (0..p.dcp_size)
            .map(|_| RankCache {
                words: (0..words).map(|_| rng.next_u64() as u32).collect(),
                local,
            })
            .collect();
        for (position, &block) in block_ids.iter().enumerate() {
            for o in 0..per_block {
                let unit = position as u64 * per_block + o;
                if unit >= units.num_units {
                    continue;
                }
                let (rank, slot) = forward(o, p.dcp_size, p.interleave);
                let cache = &mut caches[rank as usize];
                for layer in 0..LAYERS {
                    for head in 0..HEADS {
                        for piece in 0..PIECES {
                            let at = cache.index(block, slot, layer, head, piece);
                            cache.words[at] = units.at(layer, head, unit, piece);
                        }
                    }
                }
            }
        }
        caches
    }

    /// A host worker of DCP rank `rank` over `cache`, its group placed by `p`.
    pub fn rank_worker(cache: &RankCache, p: GroupPlacement, block_size: u32, rank: u32) -> Worker {
        let mut worker = host_worker(rank, p.dcp_size, 0, 1);
        register_rank(&mut worker, cache.words.as_ptr() as u64, cache, p, block_size, rank);
        worker
    }

    /// Registers `cache` (its bytes at `base`) on `worker` as DCP rank
    /// `rank`'s cache of group [`GROUP`], placed by `p`.
    pub fn register_rank(
        worker: &mut Worker,
        base: u64,
        cache: &RankCache,
        p: GroupPlacement,
        block_size: u32,
        rank: u32,
    ) {
        let cell = PIECES as i64 * 4;
        let region = cache.words.len() as u64 * 4;
        super::register_placed_layers(worker, base, region, cell, cache.local, p, block_size, rank);
    }
}
