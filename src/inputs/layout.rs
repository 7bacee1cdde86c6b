//! Layout registration: the memory a worker may read, its groups, and where
//! each attention layer's cells live (SPEC section 1), validated so that the
//! engines never read a byte outside a registered region.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::base::checksum::{mix, piece_bytes_of, slice_weight, MAX_KV_HEADS_PER_LAYER, PIECE_BYTES};
use crate::base::error::{err, Result};
use crate::inputs::decoding::{LayerDecoding, LayerGeometry};
use crate::inputs::placement::GroupPlacement;
use crate::inputs::role::Role;
use crate::inputs::state::{tensor_bytes, StateLayer, StateSpec};

/// A range of memory the worker may read: `address .. address + length`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// First byte.
    pub address: u64,
    /// Bytes in the region.
    pub length: u64,
}

/// One region of a cache (a layer's whole cell, or its K or V part).
/// Strides are in bytes and may be negative or zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Address of block 0, kernel block 0, head 0, token 0.
    pub address: u64,
    /// Between logical blocks.
    pub block_stride: i64,
    /// Between kernel blocks of one logical block.
    pub kernel_block_stride: i64,
    /// Between heads.
    pub head_stride: i64,
    /// Between tokens of one kernel block.
    pub token_stride: i64,
    /// Contiguous bytes of one (head, token) in this segment; a multiple of
    /// the cell's piece bytes (8, or 4 in a cell of a multiple of 4 and not
    /// of 8 bytes: SPEC section 1).
    pub bytes_per_token: u32,
}

/// The replica key of SPEC section 4: heads held by `replicas` consecutive
/// ranks, this copy being number `replica_index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReplicaKey {
    /// Ranks holding the same heads; 1 = not replicated.
    pub replicas: u32,
    /// This copy, in `0 .. replicas`.
    pub replica_index: u32,
}

impl ReplicaKey {
    /// Whether a worker in `role` computes this key's column.
    pub fn computed_in(self, role: Role) -> bool {
        role == Role::Consumer || self.replica_index == 0
    }
}

/// An attention layer's cache as a caller registers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSpec {
    /// The group whose block table indexes this cache.
    pub group_id: u32,
    /// Model-wide layer number.
    pub layer_number: u32,
    /// Global number of the first head held here.
    pub first_head: u32,
    /// Heads held here.
    pub num_heads: u32,
    /// Replica key of these heads.
    pub replica: ReplicaKey,
    /// Logical blocks in the cache.
    pub num_blocks: u32,
    /// Kernel blocks per logical block.
    pub kernel_blocks: u32,
    /// Tokens per kernel block.
    pub tokens_per_kernel_block: u32,
    /// One segment (cell in one place) or two (K then V).
    pub segments: Vec<Segment>,
    /// Bytes hashed into the group fingerprint (SPEC section 7).
    pub identity: Vec<u8>,
}

/// A registered layer: its spec and what follows from it.
#[derive(Debug, Clone)]
pub struct Layer {
    /// As registered.
    pub spec: LayerSpec,
    /// Pieces per token of one slice (`P` of SPEC section 2).
    pub pieces_per_token: u64,
    /// Bytes of each piece (SPEC section 1): 8, or 4 where the cell's bytes
    /// are a multiple of 4 and not of 8.
    pub piece_bytes: u64,
    /// Per segment, the index of its first piece within a token's cell.
    pub segment_piece_offsets: Vec<u64>,
    /// Where its group's tokens sit (SPEC section 16), as the group had it
    /// when the layer was registered (it cannot change after).
    pub placement: GroupPlacement,
}

/// A layer that reads another layer's cache (vLLM's KV sharing): it counts
/// in its group's fingerprint (SPEC section 7) and adds no checksum, since
/// the cache it reads is checksummed once, as its target's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alias {
    /// Model-wide layer number of the sharing layer.
    pub layer_number: u32,
    /// Layer number of the registered layer whose cache it reads.
    pub target_layer_number: u32,
    /// Bytes hashed into the group fingerprint.
    pub identity: Vec<u8>,
}

/// A group's buffer of stored checksums (SPEC section 8):
/// [`StoredBuffer::BYTES_PER_BLOCK`] bytes per block id, in memory of the
/// worker's kind, written by stores and read by load checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredBuffer {
    /// Address of block id 0's value; a multiple of 8.
    pub address: u64,
    /// Values in the buffer: block ids below it have one.
    pub num_blocks: u64,
}

impl StoredBuffer {
    /// Bytes per block id (`KVCS_BLOCK_CHECKSUM_BYTES`): the stored value,
    /// then the stamp of the configuration that stored it (SPEC section 8).
    pub(crate) const BYTES_PER_BLOCK: u64 = 16;

    /// The half-open byte range `[low, high)` of the buffer (its end was
    /// checked not to wrap at registration).
    fn bytes(&self) -> (i128, i128) {
        let low = self.address as i128;
        (low, low + (self.num_blocks * Self::BYTES_PER_BLOCK) as i128)
    }
}

/// Bytes a registered cache can reach (an attention layer's segment or a
/// state tensor): stored checksums must not overlap them.
#[derive(Debug, Clone, Copy)]
struct CacheBytes {
    low: i128,
    high: i128,
    layer_number: u32,
}

/// Layers sharing one block table and block size.
#[derive(Debug, Clone)]
pub struct Group {
    /// Caller's group id.
    pub group_id: u32,
    /// Dense index of the group on its worker, in registration order; what
    /// engines index their per-group tables with.
    pub slot: u32,
    /// Tokens per logical block.
    pub block_size: u32,
    /// Where its tokens sit in this worker's caches (SPEC section 16):
    /// DCP shard and tokens per slot; set before any layer.
    pub(crate) placement: GroupPlacement,
    /// Registered layers, in registration order (added only through
    /// `push`, which keeps the fields below in step).
    pub(crate) layers: Vec<Layer>,
    /// Layers that read another layer's cache, in registration order.
    pub(crate) aliases: Vec<Alias>,
    /// State layers (SPEC section 6), in registration order; a group holds
    /// attention layers or state layers, never both.
    pub(crate) states: Vec<StateLayer>,
    /// Where its stored checksums live, if registered.
    pub(crate) stored: Option<StoredBuffer>,
    /// Sorted replica keys of the columns computed as producer, then as
    /// consumer; shared with every result of the group.
    columns: [Arc<[ReplicaKey]>; 2],
    /// The smallest block count of the layers' caches.
    num_blocks: u32,
    /// Per replica key, the coverage of its slices ([`coverage_of`]).
    coverage: BTreeMap<ReplicaKey, u64>,
    /// Per layer number, how the engine decodes the layer's cache (SPEC
    /// section 7), as declared.
    decodings: BTreeMap<u32, LayerDecoding>,
}

/// The coverage of slices `heads` of layer `layer_number` (SPEC section 10):
/// the sum of `mix(m)` over their slice weights `m`, which no set of other
/// slices is likely to give (a slice left out or counted twice changes it).
pub fn coverage_of(layer_number: u32, heads: std::ops::Range<u64>) -> u64 {
    heads.fold(0u64, |sum, head| {
        sum.wrapping_add(mix(slice_weight(layer_number, head as u32)))
    })
}

impl Group {
    fn new(group_id: u32, slot: u32, block_size: u32) -> Group {
        Group {
            group_id,
            slot,
            block_size,
            placement: GroupPlacement::DEFAULT,
            layers: Vec::new(),
            aliases: Vec::new(),
            states: Vec::new(),
            stored: None,
            columns: [Arc::from([]), Arc::from([])],
            num_blocks: u32::MAX,
            coverage: BTreeMap::new(),
            decodings: BTreeMap::new(),
        }
    }

    /// Adds a checked layer and updates what follows from the layers.
    fn push(&mut self, layer: Layer) {
        self.num_blocks = self.num_blocks.min(layer.spec.num_blocks);
        let first = layer.spec.first_head as u64;
        let covered = coverage_of(layer.spec.layer_number, first..first + layer.spec.num_heads as u64);
        let entry = self.coverage.entry(layer.spec.replica).or_insert(0);
        *entry = entry.wrapping_add(covered);
        for (columns, role) in self.columns.iter_mut().zip([Role::Producer, Role::Consumer]) {
            let key = layer.spec.replica;
            if key.computed_in(role) {
                if let Err(at) = columns.binary_search(&key) {
                    let mut keys = columns.to_vec();
                    keys.insert(at, key);
                    *columns = keys.into();
                }
            }
        }
        self.layers.push(layer);
    }

    /// Where the group's tokens sit in this worker's caches (SPEC section 16).
    pub fn placement(&self) -> GroupPlacement {
        self.placement
    }

    /// Registered layers, in registration order.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// Adds a checked state layer: its one column is `(1, 0)` in either role.
    fn push_state(&mut self, state: StateLayer) {
        self.num_blocks = self.num_blocks.min(state.spec.num_blocks);
        let key = ReplicaKey {
            replicas: 1,
            replica_index: 0,
        };
        self.columns = [Arc::from([key]), Arc::from([key])];
        let layer_number = state.spec.layer_number;
        let covered = if state.spec.split_known {
            state
                .spec
                .tensors
                .iter()
                .zip(&state.head_bases)
                .fold(0u64, |sum, (tensor, &base)| {
                    let base = base as u64;
                    sum.wrapping_add(coverage_of(layer_number, base..base + tensor.num_rows as u64))
                })
        } else {
            let head = state.shard_head as u64;
            coverage_of(layer_number, head..head + 1)
        };
        let entry = self.coverage.entry(key).or_insert(0);
        *entry = entry.wrapping_add(covered);
        self.states.push(state);
    }

    /// Per replica key, the coverage of the group's slices held here
    /// ([`coverage_of`] summed over its layers' heads), sorted by key.
    pub fn coverage(&self) -> Vec<(ReplicaKey, u64)> {
        self.coverage.iter().map(|(&key, &value)| (key, value)).collect()
    }

    /// What the engine declared about decoding the group's layers (SPEC
    /// section 7), sorted by layer number.
    pub fn decodings(&self) -> Vec<(u32, LayerDecoding)> {
        self.decodings.iter().map(|(&n, d)| (n, d.clone())).collect()
    }

    /// The geometry of the group's attention caches (SPEC section 7,
    /// "Geometry"), one run per registered layer entry, sorted by (layer,
    /// first head): its heads, its cell bytes (the segments' bytes per
    /// token) and, with two segments (K then V), the bytes of K.
    pub fn geometry(&self) -> Vec<LayerGeometry> {
        let mut runs: Vec<LayerGeometry> = self
            .layers
            .iter()
            .map(|layer| {
                let spec = &layer.spec;
                LayerGeometry {
                    layer_number: spec.layer_number,
                    first_head: spec.first_head,
                    num_heads: spec.num_heads,
                    cell_bytes: spec
                        .segments
                        .iter()
                        .fold(0u32, |sum, s| sum.saturating_add(s.bytes_per_token)),
                    k_bytes: match &spec.segments[..] {
                        [k, _] => k.bytes_per_token,
                        _ => 0,
                    },
                }
            })
            .collect();
        runs.sort_unstable();
        runs
    }

    /// Registered state layers, in registration order.
    pub fn states(&self) -> &[StateLayer] {
        &self.states
    }

    /// Whether this is a state group (its layers are state layers).
    pub fn is_state(&self) -> bool {
        !self.states.is_empty()
    }

    /// Whether the group's checksums are shard-keyed state (TP split unknown).
    pub fn is_shard_keyed(&self) -> bool {
        self.states.iter().any(|state| !state.spec.split_known)
    }

    /// The buffer of stored checksums, if registered.
    pub fn stored(&self) -> Option<StoredBuffer> {
        self.stored
    }

    /// Registered aliases (layers reading another layer's cache).
    pub fn aliases(&self) -> &[Alias] {
        &self.aliases
    }

    /// The smallest block count of the group's caches: block ids must be below it.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// The replica keys of the columns computed in `role`, sorted.
    pub fn columns(&self, role: Role) -> &Arc<[ReplicaKey]> {
        match role {
            Role::Producer => &self.columns[0],
            Role::Consumer => &self.columns[1],
        }
    }
}

/// Everything a worker has registered.
#[derive(Debug, Clone, Default)]
pub struct Layout {
    regions: Vec<Region>,
    /// Groups by slot (registration order).
    groups: Vec<Group>,
    /// Slot of each group id.
    slots: BTreeMap<u32, u32>,
    skipped: BTreeMap<u32, String>,
    /// Every registered head range, keyed by (layer number, first head),
    /// with its end: finds an overlap in logarithmic time.
    head_ranges: BTreeMap<(u32, u64), u64>,
    /// The group of each registered attention layer entry, keyed by (layer
    /// number, group id).
    attention: BTreeSet<(u32, u32)>,
    /// The group of each layer registered as an alias or a state layer.
    cacheless: BTreeMap<u32, u32>,
    /// The bytes each registered cache can reach.
    cache_bytes: Vec<CacheBytes>,
}

impl Layout {
    /// Registers memory the worker may read (see [`Layout::check_region`]).
    pub fn add_region(&mut self, region: Region) -> Result<()> {
        Layout::check_region(region)?;
        self.regions.push(region);
        Ok(())
    }

    /// Fails unless `region` can be memory a worker reads: not empty, not
    /// at address 0 (never memory: a host worker, which cannot check host
    /// memory, would read it and crash), and ending inside the address
    /// space.
    pub fn check_region(region: Region) -> Result<()> {
        if region.address == 0 {
            return Err(err!(
                InvalidArgument,
                "address 0x0 (region of length {}) is NULL, never memory a worker can read",
                region.length
            ));
        }
        if region.length == 0 {
            return Err(err!(
                InvalidArgument,
                "length is 0 (region at address {:#x})",
                region.address
            ));
        }
        if region.address.checked_add(region.length).is_none() {
            return Err(err!(
                InvalidArgument,
                "address {:#x} + length {} wraps past the end of the address space",
                region.address,
                region.length
            ));
        }
        Ok(())
    }

    /// Registers a group of layers sharing a block table.
    pub fn add_group(&mut self, group_id: u32, block_size: u32) -> Result<()> {
        if block_size == 0 {
            return Err(err!(InvalidArgument, "block_size is 0 (group_id {group_id})"));
        }
        if self.slots.contains_key(&group_id) {
            return Err(err!(InvalidArgument, "group_id {group_id} is already registered"));
        }
        let slot = self.groups.len() as u32;
        self.slots.insert(group_id, slot);
        self.groups.push(Group::new(group_id, slot, block_size));
        Ok(())
    }

    /// Declares that this worker cannot checksum `group_id` (SPEC section 7).
    pub fn skip_group(&mut self, group_id: u32, reason: &str) -> Result<()> {
        if reason.is_empty() {
            return Err(err!(InvalidArgument, "reason is empty (group_id {group_id})"));
        }
        if self.skipped.contains_key(&group_id) {
            return Err(err!(InvalidArgument, "group_id {group_id} is already skipped"));
        }
        self.skipped.insert(group_id, reason.to_owned());
        Ok(())
    }

    /// Sets where `group_id`'s tokens sit in this worker's caches (SPEC
    /// section 16). The group must hold no cache yet: its layers' tiling
    /// (`kernel_blocks * tokens_per_kernel_block`) is of the local slots
    /// the placement leaves a block, checked when each is registered. A
    /// later call before any layer replaces the placement; on error
    /// nothing changes.
    pub fn set_group_placement(&mut self, group_id: u32, placement: GroupPlacement) -> Result<()> {
        let slot = *self.slots.get(&group_id).ok_or_else(|| {
            err!(
                NotFound,
                "group_id {group_id} is not registered (kvcs_worker_add_group first)"
            )
        })?;
        let group = &self.groups[slot as usize];
        if !group.layers.is_empty() || !group.states.is_empty() || !group.aliases.is_empty() {
            return Err(err!(
                InvalidArgument,
                "group_id {group_id} already holds {} layers; set its placement before registering them",
                group.layers.len() + group.states.len() + group.aliases.len()
            ));
        }
        placement.check(group_id, group.block_size)?;
        self.groups[slot as usize].placement = placement;
        Ok(())
    }

    /// Registers an attention layer's cache after checking every constraint;
    /// on error nothing changes.
    pub fn add_layer(&mut self, spec: LayerSpec) -> Result<()> {
        let layer = self.check_layer(spec)?;
        // check_layer found the group.
        let slot = self.slots[&layer.spec.group_id];
        let first_head = layer.spec.first_head as u64;
        self.head_ranges.insert(
            (layer.spec.layer_number, first_head),
            first_head + layer.spec.num_heads as u64,
        );
        self.attention.insert((layer.spec.layer_number, layer.spec.group_id));
        for segment in &layer.spec.segments {
            let (low, high) = reachable_bytes(&layer.spec, segment);
            self.cache_bytes.push(CacheBytes {
                low,
                high,
                layer_number: layer.spec.layer_number,
            });
        }
        self.groups[slot as usize].push(layer);
        Ok(())
    }

    /// Registers `alias.layer_number` as a layer of `group_id` that reads the
    /// cache of the registered layer `alias.target_layer_number` of the same
    /// group: its identity counts in the group fingerprint, and it adds no
    /// checksum. On error nothing changes.
    pub fn add_alias(&mut self, group_id: u32, alias: Alias) -> Result<()> {
        let layer_number = alias.layer_number;
        let target = alias.target_layer_number;
        let slot = *self.slots.get(&group_id).ok_or_else(|| {
            err!(
                NotFound,
                "group_id {group_id} is not registered (alias layer_number {layer_number})"
            )
        })?;
        if layer_number == target {
            return Err(err!(
                InvalidArgument,
                "layer_number {layer_number} names itself as target_layer_number"
            ));
        }
        if !self.attention.contains(&(target, group_id)) {
            return Err(err!(
                NotFound,
                "target_layer_number {target} is not a registered layer of group_id {group_id} (alias layer_number {layer_number})"
            ));
        }
        self.check_layer_number_free(layer_number, "an alias is a layer without a cache of its own")?;
        self.cacheless.insert(layer_number, group_id);
        self.groups[slot as usize].aliases.push(alias);
        Ok(())
    }

    /// Declares how the engine decodes layer `layer_number` of `group_id`
    /// (SPEC section 7), replacing an earlier declaration of the layer. The
    /// layer must be registered in the group (an attention layer, an alias
    /// or a state layer); `NotFound` otherwise, and nothing changes.
    pub fn set_layer_decoding(&mut self, group_id: u32, layer_number: u32, decoding: LayerDecoding) -> Result<()> {
        let slot = *self.slots.get(&group_id).ok_or_else(|| {
            err!(
                NotFound,
                "group_id {group_id} is not registered (layer_number {layer_number})"
            )
        })?;
        let registered =
            self.attention.contains(&(layer_number, group_id)) || self.cacheless.get(&layer_number) == Some(&group_id);
        if !registered {
            return Err(err!(
                NotFound,
                "layer_number {layer_number} is not a registered layer of group_id {group_id} (register it first: a layer, an alias or a state layer)"
            ));
        }
        self.groups[slot as usize].decodings.insert(layer_number, decoding);
        Ok(())
    }

    /// Registers `group_id`'s buffer of stored checksums (replacing any
    /// before); on error nothing changes.
    pub fn set_stored(&mut self, group_id: u32, stored: StoredBuffer, in_region: bool) -> Result<()> {
        let slot = self.check_stored(group_id, stored, in_region)?;
        self.groups[slot as usize].stored = Some(stored);
        Ok(())
    }

    /// Fails unless `stored` can be `group_id`'s buffer of stored checksums
    /// (see [`Layout::set_stored`]); the group's slot otherwise. The buffer
    /// must not overlap a registered cache or another group's buffer (a
    /// store would overwrite them); with `in_region` (host workers, whose
    /// buffers are not checked by CUDA) it must lie in a registered region.
    pub fn check_stored(&self, group_id: u32, stored: StoredBuffer, in_region: bool) -> Result<u32> {
        let slot = *self
            .slots
            .get(&group_id)
            .ok_or_else(|| err!(NotFound, "group_id {group_id} is not registered"))?;
        if stored.address == 0 {
            return Err(err!(
                InvalidArgument,
                "address is 0 (stored checksums of group_id {group_id})"
            ));
        }
        if !stored.address.is_multiple_of(8) {
            return Err(err!(
                Unsupported,
                "address {:#x} of group_id {group_id}'s stored checksums is not a multiple of 8",
                stored.address
            ));
        }
        if stored.num_blocks == 0 {
            return Err(err!(
                InvalidArgument,
                "num_blocks is 0 (stored checksums of group_id {group_id})"
            ));
        }
        let end = stored
            .num_blocks
            .checked_mul(StoredBuffer::BYTES_PER_BLOCK)
            .and_then(|bytes| stored.address.checked_add(bytes));
        if end.is_none() {
            return Err(err!(
                InvalidArgument,
                "address {:#x} + {} x num_blocks {} wraps past the end of the address space",
                stored.address,
                StoredBuffer::BYTES_PER_BLOCK,
                stored.num_blocks
            ));
        }
        let (low, high) = stored.bytes();
        if in_region && !self.in_region(low, high) {
            return Err(err!(
                OutOfBounds,
                "stored checksums of group_id {group_id} (address {:#x}, num_blocks {}) reach bytes {}..{}, which no registered region holds",
                stored.address,
                stored.num_blocks,
                signed_hex(low),
                signed_hex(high)
            ));
        }
        if let Some(cache) = self.cache_bytes.iter().find(|c| c.low < high && low < c.high) {
            return Err(err!(
                InvalidArgument,
                "stored checksums of group_id {group_id} (bytes {}..{}) overlap the cache of layer_number {} (bytes {}..{}); a store would overwrite KV",
                signed_hex(low),
                signed_hex(high),
                cache.layer_number,
                signed_hex(cache.low),
                signed_hex(cache.high)
            ));
        }
        self.check_no_stored_overlap(low, high, Some(group_id))
            .map_err(|other| {
                err!(
                    InvalidArgument,
                    "stored checksums of group_id {group_id} (bytes {}..{}) overlap those of group_id {other}; each group needs a buffer of its own",
                    signed_hex(low),
                    signed_hex(high)
                )
            })?;
        Ok(slot)
    }

    /// `Err(group_id)` of a group (other than `except`) whose stored
    /// checksums overlap the bytes `low .. high`.
    fn check_no_stored_overlap(&self, low: i128, high: i128, except: Option<u32>) -> std::result::Result<(), u32> {
        let overlapping = self.groups.iter().find(|group| {
            Some(group.group_id) != except
                && group.stored.is_some_and(|buffer| {
                    let (b_low, b_high) = buffer.bytes();
                    b_low < high && low < b_high
                })
        });
        match overlapping {
            Some(group) => Err(group.group_id),
            None => Ok(()),
        }
    }

    /// Whether the bytes `low .. high` lie in one registered region.
    fn in_region(&self, low: i128, high: i128) -> bool {
        self.regions
            .iter()
            .any(|r| low >= r.address as i128 && high <= r.address as i128 + r.length as i128)
    }

    /// Registers a state layer (SPEC section 6) of a worker of TP rank
    /// `tp_rank` after checking every constraint; on error nothing changes.
    pub fn add_state(&mut self, spec: StateSpec, tp_rank: u32) -> Result<()> {
        let layer_number = spec.layer_number;
        let group_id = spec.group_id;
        let slot = *self.slots.get(&group_id).ok_or_else(|| {
            err!(
                NotFound,
                "group_id {group_id} is not registered (state layer_number {layer_number})"
            )
        })?;
        let group = &self.groups[slot as usize];
        if !group.layers.is_empty() {
            return Err(err!(
                InvalidArgument,
                "group_id {group_id} holds attention layers; state layer_number {layer_number} needs a group of its own"
            ));
        }
        if !group.placement.is_default() {
            return Err(err!(
                InvalidArgument,
                "group_id {group_id} has a placement (dcp_size {}, tokens_per_slot {}); a state group's state is one block that no placement applies to (state layer_number {layer_number})",
                group.placement.dcp_size,
                group.placement.tokens_per_slot
            ));
        }
        if let Some(first) = group.states.first() {
            if first.spec.split_known != spec.split_known {
                return Err(err!(
                    InvalidArgument,
                    "split_known is {} for state layer_number {layer_number} but {} for layer_number {} of group_id {group_id}; a group's state layers agree",
                    spec.split_known as u32,
                    first.spec.split_known as u32,
                    first.spec.layer_number
                ));
            }
        }
        self.check_layer_number_free(layer_number, "a state layer has no attention cache")?;
        let state = StateLayer::new(spec, tp_rank, |low, high| self.in_region(low, high))?;
        for (index, tensor) in state.spec.tensors.iter().enumerate() {
            let (low, high) = tensor_bytes(&state.spec, tensor);
            self.check_not_stored(
                low,
                high,
                &format!("tensors[{index}] of state layer_number {layer_number}"),
            )?;
        }
        for tensor in &state.spec.tensors {
            let (low, high) = tensor_bytes(&state.spec, tensor);
            self.cache_bytes.push(CacheBytes {
                low,
                high,
                layer_number,
            });
        }
        self.cacheless.insert(layer_number, group_id);
        self.groups[slot as usize].push_state(state);
        Ok(())
    }

    /// Fails when `layer_number` is registered already, as an attention
    /// layer, an alias or a state layer.
    fn check_layer_number_free(&self, layer_number: u32, why: &str) -> Result<()> {
        let owner = self.cacheless.get(&layer_number).copied().or_else(|| {
            self.attention
                .range((layer_number, 0)..=(layer_number, u32::MAX))
                .next()
                .map(|&(_, group_id)| group_id)
        });
        match owner {
            Some(group_id) => Err(err!(
                InvalidArgument,
                "layer_number {layer_number} is already registered (in group_id {group_id}); {why}"
            )),
            None => Ok(()),
        }
    }

    fn check_layer(&self, spec: LayerSpec) -> Result<Layer> {
        let layer_number = spec.layer_number;
        let group = self.group(spec.group_id).ok_or_else(|| {
            err!(
                NotFound,
                "group_id {} is not registered (layer_number {layer_number})",
                spec.group_id
            )
        })?;
        if group.is_state() {
            return Err(err!(
                InvalidArgument,
                "group_id {} is a state group; attention layer_number {layer_number} needs a group of its own",
                spec.group_id
            ));
        }
        if spec.num_heads == 0 {
            return Err(err!(InvalidArgument, "num_heads is 0 (layer_number {layer_number})"));
        }
        let head_end = spec.first_head as u64 + spec.num_heads as u64;
        if head_end > MAX_KV_HEADS_PER_LAYER {
            return Err(err!(
                Unsupported,
                "first_head {} + num_heads {} exceeds {MAX_KV_HEADS_PER_LAYER} heads per layer (layer_number {layer_number})",
                spec.first_head,
                spec.num_heads
            ));
        }
        let replica = spec.replica;
        if replica.replicas == 0 {
            return Err(err!(InvalidArgument, "replicas is 0 (layer_number {layer_number})"));
        }
        if replica.replica_index >= replica.replicas {
            return Err(err!(
                InvalidArgument,
                "replica_index {} is not below replicas {} (layer_number {layer_number})",
                replica.replica_index,
                replica.replicas
            ));
        }
        if spec.num_blocks == 0 {
            return Err(err!(InvalidArgument, "num_blocks is 0 (layer_number {layer_number})"));
        }
        let tiled = spec.kernel_blocks as u64 * spec.tokens_per_kernel_block as u64;
        let placement = group.placement;
        let local_slots = placement.local_slots(group.block_size);
        if spec.kernel_blocks == 0 || spec.tokens_per_kernel_block == 0 || tiled != local_slots as u64 {
            let what = if placement.is_default() {
                format!("block_size {}", group.block_size)
            } else {
                format!(
                    "the {local_slots} local slots per block (block_size {} / tokens_per_slot {} / dcp_size {})",
                    group.block_size, placement.tokens_per_slot, placement.dcp_size
                )
            };
            return Err(err!(
                InvalidArgument,
                "kernel_blocks {} x tokens_per_kernel_block {} does not tile {what} of group_id {} (layer_number {layer_number})",
                spec.kernel_blocks,
                spec.tokens_per_kernel_block,
                spec.group_id
            ));
        }
        if !(1..=2).contains(&spec.segments.len()) {
            return Err(err!(
                InvalidArgument,
                "num_segments is {}, not 1 or 2 (layer_number {layer_number})",
                spec.segments.len()
            ));
        }
        let piece_bytes = cell_piece_bytes(&spec)?;
        let mut segment_piece_offsets = Vec::with_capacity(spec.segments.len());
        let mut pieces_per_token = 0u64;
        for (index, segment) in spec.segments.iter().enumerate() {
            check_segment_fields(&spec, index, segment, piece_bytes)?;
            segment_piece_offsets.push(pieces_per_token);
            pieces_per_token += segment.bytes_per_token as u64 / piece_bytes;
        }
        // Cells that share bytes are refused whatever memory they lie in.
        check_cells_disjoint(&CellCounts::of(&spec), &spec.segments, &SEGMENT_NAMES)
            .map_err(|e| e.with_context(&format!("layer_number {layer_number}")))?;
        for (index, segment) in spec.segments.iter().enumerate() {
            self.check_segment_memory(&spec, index, segment)?;
        }
        if let Some(&group_id) = self.cacheless.get(&layer_number) {
            return Err(err!(
                InvalidArgument,
                "layer_number {layer_number} is registered as an alias or a state layer in group_id {group_id}"
            ));
        }
        // Registered ranges of a layer are disjoint, so the one starting last
        // below `head_end` is the only one that can reach past `first_head`.
        let before = self
            .head_ranges
            .range((layer_number, 0)..(layer_number, head_end))
            .next_back();
        if let Some((&(_, other_first), &other_end)) = before {
            if (spec.first_head as u64) < other_end {
                return Err(err!(
                    InvalidArgument,
                    "heads {}..{} of layer_number {layer_number} overlap heads {other_first}..{other_end} registered before",
                    spec.first_head,
                    head_end
                ));
            }
        }
        Ok(Layer {
            spec,
            pieces_per_token,
            piece_bytes,
            segment_piece_offsets,
            placement,
        })
    }

    /// Fails unless the segment's cells lie in a registered region and
    /// overlap no buffer of stored checksums.
    fn check_segment_memory(&self, spec: &LayerSpec, index: usize, segment: &Segment) -> Result<()> {
        let layer_number = spec.layer_number;
        let (low, high) = reachable_bytes(spec, segment);
        if !self.in_region(low, high) {
            return Err(err!(
                OutOfBounds,
                "segments[{index}] of layer_number {layer_number} reaches bytes {}..{}, which no registered region holds",
                signed_hex(low),
                signed_hex(high)
            ));
        }
        self.check_not_stored(low, high, &format!("segments[{index}] of layer_number {layer_number}"))
    }

    /// Fails when the cache bytes `low .. high` (of `what`) overlap a
    /// registered buffer of stored checksums.
    fn check_not_stored(&self, low: i128, high: i128, what: &str) -> Result<()> {
        self.check_no_stored_overlap(low, high, None).map_err(|group_id| {
            err!(
                InvalidArgument,
                "{what} reaches bytes {}..{}, which overlap the stored checksums of group_id {group_id}; a store would overwrite KV",
                signed_hex(low),
                signed_hex(high)
            )
        })
    }

    /// The group `group_id`, if registered.
    pub fn group(&self, group_id: u32) -> Option<&Group> {
        self.slots.get(&group_id).map(|&slot| &self.groups[slot as usize])
    }

    /// The group in `slot` (see [`Group::slot`]).
    pub fn group_in_slot(&self, slot: u32) -> &Group {
        &self.groups[slot as usize]
    }

    /// Registered groups, in registration order (by slot).
    pub fn groups(&self) -> impl Iterator<Item = &Group> {
        self.groups.iter()
    }

    /// The skipped groups and their reasons, by group id.
    pub fn skipped_groups(&self) -> impl Iterator<Item = (u32, &str)> {
        self.skipped.iter().map(|(&id, reason)| (id, reason.as_str()))
    }

    /// Why `group_id` is skipped, if it is.
    pub fn skip_reason(&self, group_id: u32) -> Option<&str> {
        self.skipped.get(&group_id).map(String::as_str)
    }

    /// Registered regions.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }
}

/// The bytes of each piece of `spec`'s cells (SPEC section 1): 8 where
/// the cell (its segments' bytes per token together) is a multiple of 8
/// bytes, 4 where it is a multiple of 4 and not of 8; anything else is
/// refused, naming the cell size.
fn cell_piece_bytes(spec: &LayerSpec) -> Result<u64> {
    let layer_number = spec.layer_number;
    let cell_bytes: u64 = spec.segments.iter().map(|s| s.bytes_per_token as u64).sum();
    piece_bytes_of(cell_bytes).ok_or_else(|| {
        // A segment of no bytes, or a cell of one segment, is named by its field.
        let named = spec.segments.iter().position(|s| s.bytes_per_token == 0).or((spec.segments.len() == 1).then_some(0));
        if let Some(index) = named {
            let bytes = spec.segments[index].bytes_per_token;
            return err!(
                InvalidArgument,
                "segments[{index}].bytes_per_token {bytes} is not a positive multiple of 4: a cell is a whole number of 8- or 4-byte pieces (layer_number {layer_number})"
            );
        }
        let parts = spec.segments.iter().map(|s| s.bytes_per_token.to_string()).collect::<Vec<_>>().join(" + ");
        err!(
            InvalidArgument,
            "the cell of layer_number {layer_number} is {cell_bytes} bytes ({parts} bytes per token of its segments), not a positive multiple of 4"
        )
    })
}

/// Fails unless the segment's fields are a cell of whole pieces of
/// `piece_bytes` bytes at addresses aligned to them (SPEC section 1).
fn check_segment_fields(spec: &LayerSpec, index: usize, segment: &Segment, piece_bytes: u64) -> Result<()> {
    let layer_number = spec.layer_number;
    let bytes = segment.bytes_per_token;
    if bytes == 0 || !(bytes as u64).is_multiple_of(piece_bytes) {
        let why = if piece_bytes == PIECE_BYTES {
            ", as its cell is a multiple of 8 bytes and so read in 8-byte pieces"
        } else {
            ""
        };
        return Err(err!(
            InvalidArgument,
            "segments[{index}].bytes_per_token {bytes} is not a positive multiple of {piece_bytes}{why} (layer_number {layer_number})"
        ));
    }
    let fields = [
        ("address", segment.address as i128),
        ("block_stride", segment.block_stride as i128),
        ("kernel_block_stride", segment.kernel_block_stride as i128),
        ("head_stride", segment.head_stride as i128),
        ("token_stride", segment.token_stride as i128),
    ];
    for (name, value) in fields {
        if value % piece_bytes as i128 != 0 {
            return Err(err!(
                Unsupported,
                "segments[{index}].{name} {value} is not a multiple of {piece_bytes}, the bytes of its cell's pieces (layer_number {layer_number})"
            ));
        }
    }
    Ok(())
}

/// How many of each index a layer's cells have: what, with a segment's
/// strides, places its cells (SPEC section 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellCounts {
    /// Logical blocks.
    pub blocks: u32,
    /// Kernel blocks per logical block.
    pub kernel_blocks: u32,
    /// Heads.
    pub heads: u32,
    /// Tokens per kernel block.
    pub tokens: u32,
}

impl CellCounts {
    /// The counts of a registered layer.
    pub fn of(spec: &LayerSpec) -> CellCounts {
        CellCounts {
            blocks: spec.num_blocks,
            kernel_blocks: spec.kernel_blocks,
            heads: spec.num_heads,
            tokens: spec.tokens_per_kernel_block,
        }
    }
}

/// What errors call a layer's dimensions and segments: the fields of a
/// segment here, the letters of a layout string in `layout_string`.
#[derive(Debug, Clone, Copy)]
pub struct CellNames {
    /// The block, kernel block, head and token dimensions, in that order.
    pub dims: [&'static str; 4],
    /// The first and the second segment.
    pub segments: [&'static str; 2],
}

/// A registered layer's names: its segments' fields.
const SEGMENT_NAMES: CellNames = CellNames {
    dims: ["block_stride", "kernel_block_stride", "head_stride", "token_stride"],
    segments: ["segments[0]", "segments[1]"],
};

/// Fails unless distinct cells of a layer never share a byte (SPEC section
/// 14): within a segment, the cells of distinct (block, kernel block, head,
/// token) indices; across two segments (K then V), any two cells. A
/// dimension of stride 0 and size above 1 (a broadcast view: V aliasing K,
/// or every token one cell) or cells closer than their size would let both
/// sides of a transfer read the same bytes twice and others never, and
/// match while those others are corrupt; no KV cache is laid out so.
///
/// The rule, exact and linear in the dimensions: within a segment, its
/// dimensions of size above 1 sorted by `|stride|`, each `|stride|` is at
/// least the bytes that one index of it spans (the cell's
/// `bytes_per_token`, plus `|stride| * (size - 1)` of each dimension
/// before it). Nested layouts pass it (HND, NHD, kernel blocks, cross-layer
/// caches, padding, negative strides); an interleaving that would need a
/// search to prove disjoint is refused. Two segments pass when their
/// reachable bytes are disjoint, or when some outer dimensions, of equal
/// strides in both, hold K's and V's cells apart ([`pair_nests`]): K and V
/// side by side per block, interleaved per cell, or K-then-V as a
/// dimension of size 2 (FlashInfer's `[blocks, 2, ...]`).
pub fn check_cells_disjoint(counts: &CellCounts, segments: &[Segment], names: &CellNames) -> Result<()> {
    let sizes = [counts.blocks, counts.kernel_blocks, counts.heads, counts.tokens];
    let dims_of = |segment: &Segment| {
        let strides = [
            segment.block_stride,
            segment.kernel_block_stride,
            segment.head_stride,
            segment.token_stride,
        ];
        let mut dims: Vec<(&'static str, i64, u32)> = names
            .dims
            .iter()
            .zip(strides.into_iter().zip(sizes))
            .map(|(&name, (stride, size))| (name, stride, size))
            .collect();
        dims.retain(|&(_, _, size)| size > 1);
        dims
    };
    for (index, segment) in segments.iter().enumerate() {
        nested(&dims_of(segment), segment.bytes_per_token as u128).map_err(|overlap| {
            err!(
                InvalidArgument,
                "{}: distinct cells share bytes: {overlap}; a broadcast or overlapping view is no KV cache",
                names.segments[index]
            )
        })?;
    }
    let [k, v] = match segments {
        [k, v] => [k, v],
        _ => return Ok(()),
    };
    let (k_low, k_high) = reach(counts, k);
    let (v_low, v_high) = reach(counts, v);
    if k_high <= v_low || v_high <= k_low {
        return Ok(());
    }
    let same_strides = (k.block_stride, k.kernel_block_stride, k.head_stride, k.token_stride)
        == (v.block_stride, v.kernel_block_stride, v.head_stride, v.token_stride);
    let distance = v.address as i128 - k.address as i128;
    if pair_nests(&dims_of(k), &dims_of(v), k, v) {
        return Ok(());
    }
    Err(err!(
        InvalidArgument,
        "{} (bytes {}..{}) and {} (bytes {}..{}) share bytes: {}; K and V must not overlap",
        names.segments[0],
        signed_hex(k_low),
        signed_hex(k_high),
        names.segments[1],
        signed_hex(v_low),
        signed_hex(v_high),
        if same_strides {
            format!(
                "with the same strides, V starts {distance} bytes from K, which neither lies beside K's cells nor steps over them"
            )
        } else {
            "their cells interleave without nesting (no outer dimensions of equal strides hold K's and V's cells apart)"
                .to_owned()
        }
    ))
}

/// Whether K's and V's cells (`k_dims`, `v_dims`: the dimensions of size
/// above 1 of each, in the same order) provably never share a byte: for
/// some split of the dimensions into outer ones, of the same stride in both
/// segments and at least `threshold` (one of those strides, or 0), and
/// inner ones, the bytes K's cells reach over the inner dimensions and
/// V's are disjoint, and the outer dimensions nest over the bytes both
/// span. Every outer index then holds its K and V cells apart, and no two
/// outer indices overlap. Covers K and V side by side per block or kernel
/// block (`[blocks, [K heads, tokens], [V heads, tokens]]`, each of its own
/// head size), interleaved per cell, and K-then-V as a dimension of size 2
/// anywhere in a nesting (`[blocks, 2, ...]`).
fn pair_nests(
    k_dims: &[(&'static str, i64, u32)],
    v_dims: &[(&'static str, i64, u32)],
    k: &Segment,
    v: &Segment,
) -> bool {
    let shared = |i: usize| k_dims[i].1 == v_dims[i].1;
    let mut thresholds: Vec<u64> = (0..k_dims.len())
        .filter(|&i| shared(i))
        .map(|i| k_dims[i].1.unsigned_abs())
        .collect();
    thresholds.push(0);
    let span = |address: u64, dims: &[(&'static str, i64, u32)], bytes: u32| {
        let mut low = address as i128;
        let mut high = low + bytes as i128;
        for &(_, stride, size) in dims {
            let reach = stride as i128 * (size as i128 - 1);
            if reach < 0 {
                low += reach;
            } else {
                high += reach;
            }
        }
        (low, high)
    };
    thresholds.into_iter().any(|threshold| {
        let outer = |i: &usize| shared(*i) && k_dims[*i].1.unsigned_abs() >= threshold;
        let (outer_dims, k_inner, v_inner) = {
            let indices: Vec<usize> = (0..k_dims.len()).collect();
            let outer_dims: Vec<_> = indices.iter().filter(|i| outer(i)).map(|&i| k_dims[i]).collect();
            let k_inner: Vec<_> = indices.iter().filter(|i| !outer(i)).map(|&i| k_dims[i]).collect();
            let v_inner: Vec<_> = indices.iter().filter(|i| !outer(i)).map(|&i| v_dims[i]).collect();
            (outer_dims, k_inner, v_inner)
        };
        let (k_low, k_high) = span(k.address, &k_inner, k.bytes_per_token);
        let (v_low, v_high) = span(v.address, &v_inner, v.bytes_per_token);
        let apart = k_high <= v_low || v_high <= k_low;
        let both = (k_high.max(v_high) - k_low.min(v_low)) as u128;
        apart && nested(&outer_dims, both).is_ok()
    })
}

/// `Err(what overlaps)` unless `dims` (name, stride, size above 1) nest:
/// sorted by `|stride|`, each at least the bytes its lower dimensions and
/// the `cell` span.
fn nested(dims: &[(&'static str, i64, u32)], cell: u128) -> std::result::Result<(), String> {
    let mut sorted = dims.to_vec();
    sorted.sort_by_key(|&(_, stride, _)| stride.unsigned_abs());
    let mut extent = cell;
    let mut below = "one cell".to_owned();
    for (name, stride, size) in sorted {
        let step = stride.unsigned_abs() as u128;
        if step < extent {
            return Err(format!(
                "{name} {stride} (over {size} indices) steps {step} bytes, fewer than the {extent} bytes that {below} spans"
            ));
        }
        extent += step * (size as u128 - 1);
        below = format!("an index of {name}");
    }
    Ok(())
}

/// The half-open byte range a segment with `counts` can reach.
fn reach(counts: &CellCounts, segment: &Segment) -> (i128, i128) {
    let dims = [
        (segment.block_stride, counts.blocks),
        (segment.kernel_block_stride, counts.kernel_blocks),
        (segment.head_stride, counts.heads),
        (segment.token_stride, counts.tokens),
    ];
    let mut low = segment.address as i128;
    let mut high = low + segment.bytes_per_token as i128;
    for (stride, count) in dims {
        let span = stride as i128 * (count as i128 - 1);
        if span < 0 {
            low += span;
        } else {
            high += span;
        }
    }
    (low, high)
}

/// `value` in hex with its sign: `-0x40`, not the two's complement.
fn signed_hex(value: i128) -> String {
    if value < 0 {
        format!("-{:#x}", value.unsigned_abs())
    } else {
        format!("{value:#x}")
    }
}

/// The half-open byte range `[low, high)` that a segment of `spec` can reach.
fn reachable_bytes(spec: &LayerSpec, segment: &Segment) -> (i128, i128) {
    reach(&CellCounts::of(spec), segment)
}
