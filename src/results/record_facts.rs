//! The facts about a worker that its records carry: where
//! it sits in the model ([`Rank`]) and what it knows about each registered
//! group ([`GroupInfo`]).

use crate::base::checksum::Algorithm;
use crate::base::stored_entry::EntryConfig;
use crate::inputs::decoding::{LayerDecoding, LayerGeometry};
use crate::inputs::fingerprint::{decodings_digest, geometry_digest, placement_digest};
use crate::inputs::layout::ReplicaKey;
use crate::inputs::placement::GroupPlacement;

/// Where a worker sits in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rank {
    /// Tensor-parallel rank, below `tp_size`.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline-parallel stage.
    pub pp_rank: u32,
}

/// What a worker knows about one of its registered groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupInfo {
    /// The group.
    pub group_id: u32,
    /// Tokens per logical block on this worker.
    pub block_size: u32,
    /// The worker's fingerprint of the group (SPEC section 7, vLLM's).
    pub fingerprint: u64,
    /// The worker's marks of the group (SPEC section 7: aliases and
    /// shard-keyed state layers).
    pub marks: u64,
    /// Whether the group's checksums are shard-keyed state (SPEC section 6:
    /// TP split unknown), comparable only between equal TP sizes. Attention
    /// groups never are; state layers set it when the split is unknown.
    pub shard_keyed: bool,
    /// Whether the worker registered any cache (attention or state layer)
    /// in the group: where no worker does, nothing of the group was read.
    pub holds_caches: bool,
    /// Whether the group is a state group (SPEC section 6): one block at
    /// position 0 that `num_tokens` does not limit.
    pub state: bool,
    /// Per replica key held here, the coverage of its slices (SPEC section
    /// 10), sorted by key: which layers and heads the worker checksums.
    pub coverage: Vec<(ReplicaKey, u64)>,
    /// Per layer number, what the worker declared about decoding its cache
    /// (SPEC section 7), sorted by layer number; empty where it declared
    /// nothing.
    pub decodings: Vec<(u32, LayerDecoding)>,
    /// The geometry of every attention cache the worker registered in the
    /// group (SPEC section 7, "Geometry"), sorted by (layer, first head),
    /// one run per registration; empty in records of version 5 and
    /// earlier, which do not carry it.
    pub geometry: Vec<LayerGeometry>,
    /// Where the group's tokens sit in the worker's caches (SPEC section
    /// 16): the DCP token shard its columns cover and the tokens per
    /// slot; the default in records of version 6 and earlier.
    pub placement: GroupPlacement,
}

impl GroupInfo {
    /// What stored checksums use (SPEC section 8): the fingerprint plus the
    /// marks plus the digest of the declared layer decodings.
    pub fn stored_fingerprint(&self) -> u64 {
        self.fingerprint
            .wrapping_add(self.marks)
            .wrapping_add(decodings_digest(&self.decodings))
    }

    /// The configuration a stored entry of this group names (SPEC section
    /// 8) under `algorithm`: the one rule every path that makes or checks
    /// an entry follows (a store, a load check, `kvcs_block_tags`, and the
    /// entries a connector keeps, `kvcs_result_entries` and
    /// `kvcs_result_check_entries`), so that an entry made on one path is
    /// read alike on another and never passes across a change of layers,
    /// marks, decodings, geometry, placement, coverage, block size or
    /// algorithm.
    pub fn entry_config(&self, algorithm: Algorithm) -> EntryConfig {
        EntryConfig {
            fingerprint: self.stored_fingerprint(),
            geometry: geometry_digest(&self.geometry).wrapping_add(placement_digest(&self.placement)),
            coverage: self
                .coverage
                .iter()
                .fold(0u64, |sum, (_, value)| sum.wrapping_add(*value)),
            block_size: self.block_size,
            algorithm,
            state: self.state,
        }
    }
}
