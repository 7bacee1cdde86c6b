//! Requests and block sets: per-request block tables and the allocator
//! that hands out block ids.

use kvcsum::BlockSet;

use super::Rng;

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
