//! Request block sets (SPEC section 5): per request its token count and, per
//! group, the blocks at consecutive positions from a first position.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{err, Result};
use crate::layout::Role;

/// One group's blocks of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupBlocks {
    /// The group.
    pub group_id: u32,
    /// Position of `block_ids[0]` in the request.
    pub first_position: u64,
    /// Block ids at positions `first_position ..`.
    pub block_ids: Vec<u32>,
    /// Per block, the first 8 bytes of its block hash read as a
    /// little-endian `u64`, when given (stored checksums, SPEC section 8).
    pub hashes: Option<Vec<u64>>,
    /// The largest of `block_ids` (0 when there are none), found when the
    /// blocks are added so that a checksum call checks them in one comparison.
    max_block_id: u32,
}

impl GroupBlocks {
    /// The largest block id (0 when there are no blocks).
    pub fn max_block_id(&self) -> u32 {
        self.max_block_id
    }
}

/// One request's blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestBlocks {
    /// Caller's request id.
    pub req_id: String,
    /// Tokens whose KV the blocks hold.
    pub num_tokens: u64,
    /// Per group, in the order added.
    pub groups: Vec<GroupBlocks>,
}

/// Valid tokens of the block at `position` (SPEC section 5):
/// `min(block_size, max(0, num_tokens - position * block_size))`.
pub fn valid_tokens(num_tokens: u64, block_size: u32, position: u64) -> u32 {
    let start = (position as u128) * (block_size as u128);
    let left = (num_tokens as u128).saturating_sub(start);
    left.min(block_size as u128) as u32
}

/// The blocks of a batch of requests, in the order added.
///
/// The requests are shared (copy on write) with the results made from them,
/// so a checksum call copies none of them.
#[derive(Debug, Clone, Default)]
pub struct BlockSet {
    requests: Arc<Vec<RequestBlocks>>,
    index: HashMap<String, usize>,
    /// Groups of blocks over all requests, counted as they are added.
    num_groups: usize,
    /// Block ids over all requests and groups, counted as they are added.
    num_blocks: usize,
    /// Whether a producer's call leaves out the value of each group's last
    /// position over one token fewer ([`BlockSet::computes_short_last`]).
    without_short_last: bool,
}

impl BlockSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a request with no blocks yet.
    pub fn add_request(&mut self, req_id: &str, num_tokens: u64) -> Result<()> {
        if req_id.is_empty() {
            return Err(err!(InvalidArgument, "req_id is empty"));
        }
        if self.index.contains_key(req_id) {
            return Err(err!(InvalidArgument, "req_id \"{req_id}\" is already in the block set"));
        }
        self.index.insert(req_id.to_owned(), self.requests.len());
        Arc::make_mut(&mut self.requests).push(RequestBlocks {
            req_id: req_id.to_owned(),
            num_tokens,
            groups: Vec::new(),
        });
        Ok(())
    }

    /// Adds one group's blocks to a request added before.
    pub fn add_group(&mut self, req_id: &str, group_id: u32, first_position: u64, block_ids: &[u32]) -> Result<()> {
        let &index = self
            .index
            .get(req_id)
            .ok_or_else(|| err!(NotFound, "req_id \"{req_id}\" is not in the block set"))?;
        let request = &self.requests[index];
        if request.groups.iter().any(|g| g.group_id == group_id) {
            return Err(err!(
                InvalidArgument,
                "group_id {group_id} already has blocks in req_id \"{req_id}\""
            ));
        }
        if first_position.checked_add(block_ids.len() as u64).is_none() {
            return Err(err!(
                InvalidArgument,
                "first_position {first_position} + {} blocks overflows (req_id \"{req_id}\", group_id {group_id})",
                block_ids.len()
            ));
        }
        // Checked: now copy the requests if a result still shares them.
        Arc::make_mut(&mut self.requests)[index].groups.push(GroupBlocks {
            group_id,
            first_position,
            block_ids: block_ids.to_vec(),
            hashes: None,
            max_block_id: block_ids.iter().copied().max().unwrap_or(0),
        });
        self.num_groups += 1;
        self.num_blocks += block_ids.len();
        Ok(())
    }

    /// Gives the block hashes of `group_id`'s blocks in `req_id`, one of
    /// `hash_bytes` bytes (at least 8) per block id, in block order: what
    /// binds a stored checksum to its block (SPEC section 8). Only the first
    /// 8 bytes of each hash are used.
    pub fn set_hashes(&mut self, req_id: &str, group_id: u32, hashes: &[u8], hash_bytes: usize) -> Result<()> {
        let &index = self
            .index
            .get(req_id)
            .ok_or_else(|| err!(NotFound, "req_id \"{req_id}\" is not in the block set"))?;
        let group = self.requests[index]
            .groups
            .iter()
            .position(|g| g.group_id == group_id)
            .ok_or_else(|| err!(NotFound, "group_id {group_id} has no blocks in req_id \"{req_id}\""))?;
        if hash_bytes < 8 {
            return Err(err!(
                InvalidArgument,
                "hash_bytes is {hash_bytes}; a block hash has at least 8 bytes"
            ));
        }
        let count = self.requests[index].groups[group].block_ids.len();
        if hashes.len() != count.saturating_mul(hash_bytes) {
            return Err(err!(
                InvalidArgument,
                "{} hash bytes are not {count} hashes of hash_bytes {hash_bytes} (req_id \"{req_id}\", group_id {group_id})",
                hashes.len()
            ));
        }
        let firsts = hashes
            .chunks_exact(hash_bytes)
            .map(|hash| u64::from_le_bytes(hash[..8].try_into().expect("8 bytes")))
            .collect();
        Arc::make_mut(&mut self.requests)[index].groups[group].hashes = Some(firsts);
        Ok(())
    }

    /// The requests, in the order added.
    pub fn requests(&self) -> &[RequestBlocks] {
        &self.requests
    }

    /// The requests, shared: what a result keeps of its block set.
    pub fn shared_requests(&self) -> Arc<Vec<RequestBlocks>> {
        self.requests.clone()
    }

    /// Groups of blocks over all requests: what a checksum call's result
    /// places.
    pub fn num_groups(&self) -> usize {
        self.num_groups
    }

    /// Block ids over all requests and groups.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Whether a call in `role` also computes, per (request, attention
    /// group) holding the request's last token, the value of that last
    /// position over `num_tokens - 1` tokens (SPEC section 9, the
    /// extension's `short_last`): producer calls do, unless
    /// [`BlockSet::leave_out_short_last`] was called.
    pub fn computes_short_last(&self, role: Role) -> bool {
        role == Role::Producer && !self.without_short_last
    }

    /// Makes producer calls on this set leave out the short last values
    /// (detail mode's shadow call, whose layer partials the payload does
    /// not carry over one token fewer).
    pub(crate) fn leave_out_short_last(&mut self) {
        self.without_short_last = true;
    }

    /// The most rows a call on this set in `role` has: one per block id,
    /// and one more per group where the call computes short last values.
    pub fn max_rows(&self, role: Role) -> usize {
        if self.computes_short_last(role) {
            self.num_blocks + self.num_groups
        } else {
            self.num_blocks
        }
    }

    /// The request `req_id`, if present.
    pub fn request(&self, req_id: &str) -> Option<&RequestBlocks> {
        self.index.get(req_id).map(|&i| &self.requests[i])
    }
}
