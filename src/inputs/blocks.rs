//! Request block sets (SPEC section 5): per request its token count and, per
//! group, the blocks at consecutive positions from a first position.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::base::error::{err, Result};
use crate::inputs::role::Role;

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

    /// Adds a batch of requests with their groups and blocks, given as
    /// arrays (SPEC section 5's block set in compressed rows), in one call:
    /// what a server with many requests a step builds without one call per
    /// request and group. Every argument is checked before the set changes:
    /// on an error nothing is added. Work and memory are linear in the
    /// arrays' lengths.
    pub fn add_arrays(&mut self, arrays: &BlockArrays<'_>) -> Result<()> {
        let rows = arrays.checked_rows()?;
        // Each id goes into the index as it is checked; an id already there
        // takes back the ones this call put in (nothing half-added).
        let first = self.requests.len();
        self.index.reserve(rows.len());
        for (i, row) in rows.iter().enumerate() {
            if let Some(&at) = self.index.get(row.req_id) {
                for earlier in &rows[..i] {
                    self.index.remove(earlier.req_id);
                }
                let message = if at >= first {
                    format!("req_ids[{i}] \"{}\" is given twice in these arrays", row.req_id)
                } else {
                    format!("req_ids[{i}] \"{}\" is already in the block set", row.req_id)
                };
                return Err(crate::base::error::Error::InvalidArgument(message));
            }
            self.index.insert(row.req_id.to_owned(), first + i);
        }
        let mut requests = Vec::with_capacity(rows.len());
        let (mut num_groups, mut num_blocks) = (0, 0);
        for row in rows {
            let groups = (row.groups.clone())
                .map(|g| {
                    let ids = &arrays.block_ids[arrays.block_range(g)];
                    let hashes = arrays.hashes.map(|(bytes, hash_bytes)| {
                        let range = arrays.block_range(g);
                        bytes[range.start * hash_bytes..range.end * hash_bytes]
                            .chunks_exact(hash_bytes)
                            .map(|hash| u64::from_le_bytes(hash[..8].try_into().expect("8 bytes")))
                            .collect()
                    });
                    GroupBlocks {
                        group_id: arrays.group_ids[g],
                        first_position: arrays.first_positions[g],
                        block_ids: ids.to_vec(),
                        hashes,
                        max_block_id: ids.iter().copied().max().unwrap_or(0),
                    }
                })
                .collect::<Vec<_>>();
            num_groups += groups.len();
            num_blocks += groups.iter().map(|g| g.block_ids.len()).sum::<usize>();
            requests.push(RequestBlocks {
                req_id: row.req_id.to_owned(),
                num_tokens: row.num_tokens,
                groups,
            });
        }
        // Checked: now copy the requests if a result still shares them.
        Arc::make_mut(&mut self.requests).extend(requests);
        self.num_groups += num_groups;
        self.num_blocks += num_blocks;
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

/// A batch of requests in compressed rows, for [`BlockSet::add_arrays`]:
/// request `i`'s id is `req_ids[req_id_ends[i - 1] .. req_id_ends[i]]` (from
/// 0 for `i = 0`), its groups are `group_ends[i - 1] .. group_ends[i]` of
/// the group arrays, and group `g`'s blocks are `block_ends[g - 1] ..
/// block_ends[g]` of `block_ids` (and of the hashes, `hash_bytes` each).
#[derive(Debug, Clone, Copy)]
pub struct BlockArrays<'a> {
    /// The request ids, UTF-8, one after another.
    pub req_ids: &'a [u8],
    /// Per request, where its id ends in `req_ids`.
    pub req_id_ends: &'a [usize],
    /// Per request, the tokens its blocks hold.
    pub num_tokens: &'a [u64],
    /// Per request, where its groups end in the group arrays.
    pub group_ends: &'a [usize],
    /// Per group, its id.
    pub group_ids: &'a [u32],
    /// Per group, the position of its first block.
    pub first_positions: &'a [u64],
    /// Per group, where its blocks end in `block_ids`.
    pub block_ends: &'a [usize],
    /// The block ids of every group, one group after another.
    pub block_ids: &'a [u32],
    /// Per block id, its block hash (`hash_bytes` bytes, at least 8; the
    /// first 8 are used), or none for every block.
    pub hashes: Option<(&'a [u8], usize)>,
}

/// One request of a [`BlockArrays`], checked.
struct Row<'a> {
    req_id: &'a str,
    num_tokens: u64,
    groups: std::ops::Range<usize>,
}

impl<'a> BlockArrays<'a> {
    fn block_range(&self, group: usize) -> std::ops::Range<usize> {
        let start = if group == 0 { 0 } else { self.block_ends[group - 1] };
        start..self.block_ends[group]
    }

    /// Checks every array and their ends against each other (not against
    /// a block set): the requests' rows.
    fn checked_rows(&self) -> Result<Vec<Row<'a>>> {
        let n = self.req_id_ends.len();
        if self.num_tokens.len() != n || self.group_ends.len() != n {
            return Err(err!(
                InvalidArgument,
                "req_id_ends has {n} entries, num_tokens {} and group_ends {}: one per request each",
                self.num_tokens.len(),
                self.group_ends.len()
            ));
        }
        let num_groups = self.group_ids.len();
        if self.first_positions.len() != num_groups || self.block_ends.len() != num_groups {
            return Err(err!(
                InvalidArgument,
                "group_ids has {num_groups} entries, first_positions {} and block_ends {}: one per group each",
                self.first_positions.len(),
                self.block_ends.len()
            ));
        }
        check_ends("req_id_ends", self.req_id_ends, self.req_ids.len(), "req_ids")?;
        check_ends("group_ends", self.group_ends, num_groups, "group_ids")?;
        check_ends("block_ends", self.block_ends, self.block_ids.len(), "block_ids")?;
        if let Some((hashes, hash_bytes)) = self.hashes {
            if hash_bytes < 8 {
                return Err(err!(
                    InvalidArgument,
                    "hash_bytes is {hash_bytes}; a block hash has at least 8 bytes"
                ));
            }
            if self.block_ids.len().checked_mul(hash_bytes) != Some(hashes.len()) {
                return Err(err!(
                    InvalidArgument,
                    "{} hash bytes are not {} hashes of hash_bytes {hash_bytes}",
                    hashes.len(),
                    self.block_ids.len()
                ));
            }
        }
        let mut seen: HashSet<u32> = HashSet::new();
        let mut rows = Vec::with_capacity(n);
        let (mut id_start, mut group_start) = (0, 0);
        for i in 0..n {
            let bytes = &self.req_ids[id_start..self.req_id_ends[i]];
            id_start = self.req_id_ends[i];
            let req_id = std::str::from_utf8(bytes).map_err(|_| err!(InvalidArgument, "req_ids[{i}] is not UTF-8"))?;
            if req_id.is_empty() {
                return Err(err!(InvalidArgument, "req_ids[{i}] is empty"));
            }
            if let Some(at) = bytes.iter().position(|&b| b == 0) {
                // The calls that name a request take a C string, which
                // would end there.
                return Err(err!(InvalidArgument, "req_ids[{i}] holds a NUL byte at {at}"));
            }
            let groups = group_start..self.group_ends[i];
            group_start = self.group_ends[i];
            seen.clear();
            for g in groups.clone() {
                let group_id = self.group_ids[g];
                if !seen.insert(group_id) {
                    return Err(err!(
                        InvalidArgument,
                        "group_ids[{g}] {group_id} is given twice for req_ids[{i}] \"{req_id}\""
                    ));
                }
                let count = self.block_range(g).len() as u64;
                if self.first_positions[g].checked_add(count).is_none() {
                    return Err(err!(
                        InvalidArgument,
                        "first_positions[{g}] {} + {count} blocks overflows (req_ids[{i}] \"{req_id}\", group_id {group_id})",
                        self.first_positions[g]
                    ));
                }
            }
            rows.push(Row {
                req_id,
                num_tokens: self.num_tokens[i],
                groups,
            });
        }
        Ok(rows)
    }
}

/// Checks that `ends` (named `name`) never decreases and that its last
/// entry is `len`, the length of `of` (0 when there are no entries).
fn check_ends(name: &str, ends: &[usize], len: usize, of: &str) -> Result<()> {
    let mut previous = 0;
    for (i, &end) in ends.iter().enumerate() {
        if end < previous {
            return Err(err!(
                InvalidArgument,
                "{name}[{i}] {end} is below the entry before it, {previous}"
            ));
        }
        previous = end;
    }
    if previous != len {
        return Err(err!(
            InvalidArgument,
            "{name} ends at {previous}, but {of} has {len} entries"
        ));
    }
    Ok(())
}
