//! What one `checksum` call computes: the result's shape and the rows of work
//! (one per block position with valid tokens), shared by every engine.

use crate::blocks::{valid_tokens, BlockSet};
use crate::error::{err, Result};
use crate::layout::{Layout, Role};
use crate::result::{GroupChecksums, RequestChecksums, SkippedGroup};

/// One block position to checksum in every layer of its group. `repr(C)`
/// because the device engine uploads rows as they are (`struct kvcs_dev_row`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Row {
    /// Request position of the block's first token.
    pub first_token: u64,
    /// Block id in the group's caches.
    pub block_id: u32,
    /// Tokens of the block to read, from its first slot.
    pub valid_tokens: u32,
    /// Value index of column 0 at this position.
    pub out: u32,
    /// Value distance between columns (the group's positions in the request).
    pub column_stride: u32,
    /// The group's slot on the worker ([`crate::layout::Group::slot`]).
    pub group_slot: u32,
    /// Zero.
    pub reserved: u32,
}

/// The work of one call and the shape of its result.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Result shape, in block-set order.
    pub requests: Vec<RequestChecksums>,
    /// Positions with valid tokens.
    pub rows: Vec<Row>,
    /// Length of the value array.
    pub num_values: usize,
}

impl Plan {
    /// Checks `blocks` against `layout` and lays out the work; any bad block
    /// id or unknown group fails the whole call.
    pub fn new(layout: &Layout, blocks: &BlockSet, role: Role) -> Result<Plan> {
        let mut requests = Vec::with_capacity(blocks.requests().len());
        let total_blocks = blocks
            .requests()
            .iter()
            .flat_map(|r| &r.groups)
            .map(|g| g.block_ids.len())
            .sum();
        let mut rows = Vec::with_capacity(total_blocks);
        let mut num_values = 0usize;
        for request in blocks.requests() {
            let req_id = &request.req_id;
            let mut groups = Vec::with_capacity(request.groups.len());
            let mut skipped = Vec::new();
            for group_blocks in &request.groups {
                let group_id = group_blocks.group_id;
                if let Some(reason) = layout.skip_reason(group_id) {
                    skipped.push(SkippedGroup {
                        group_id,
                        reason: reason.to_owned(),
                    });
                    continue;
                }
                let group = layout.group(group_id).ok_or_else(|| {
                    err!(
                        NotFound,
                        "group_id {group_id} of req_id \"{req_id}\" is not registered on this worker"
                    )
                })?;
                let num_blocks = group.num_blocks();
                let num_positions = group_blocks.block_ids.len();
                let columns = group.columns(role);
                let values_offset = num_values;
                for (i, &block_id) in group_blocks.block_ids.iter().enumerate() {
                    let position = group_blocks.first_position + i as u64;
                    if block_id >= num_blocks {
                        return Err(err!(
                            OutOfBounds,
                            "block id {block_id} at position {position} of req_id \"{req_id}\", group_id {group_id} is not below num_blocks {num_blocks}"
                        ));
                    }
                    let valid = valid_tokens(request.num_tokens, group.block_size, position);
                    if valid == 0 || columns.is_empty() {
                        continue;
                    }
                    // valid > 0 means position * block_size < num_tokens: no overflow.
                    let first_token = position * group.block_size as u64;
                    rows.push(Row {
                        first_token,
                        block_id,
                        valid_tokens: valid,
                        // Both below num_values, checked against u32 below.
                        out: (values_offset + i) as u32,
                        column_stride: num_positions as u32,
                        group_slot: group.slot,
                        reserved: 0,
                    });
                }
                num_values += columns.len() * num_positions;
                if num_values > u32::MAX as usize {
                    return Err(err!(
                        Unsupported,
                        "one call would hold {num_values} values (req_id \"{req_id}\", group_id {group_id}); at most {} are supported",
                        u32::MAX
                    ));
                }
                groups.push(GroupChecksums {
                    group_id,
                    first_position: group_blocks.first_position,
                    num_positions,
                    columns: columns.clone(),
                    values_offset,
                });
            }
            requests.push(RequestChecksums {
                req_id: req_id.clone(),
                num_tokens: request.num_tokens,
                groups,
                skipped,
            });
        }
        Ok(Plan {
            requests,
            rows,
            num_values,
        })
    }
}
