//! Shards: the heads and layers a TP/PP rank holds of a logical KV cache.

use kvcsum::ReplicaKey;

use super::LogicalKv;

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
