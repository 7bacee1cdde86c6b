//! Detail mode: per-layer partial checksums, so that a verifier can name the
//! layers (and head ranges) that differ at a mismatching block position.
//!
//! Each registered layer entry becomes its own "shadow" group of one layer
//! (same block size, same caches), and the request blocks are repeated for
//! each shadow group; one engine call over that shadow layout then gives
//! every layer entry's partials, with the arithmetic of the plain call (a
//! layer's partial is exactly its share of the group's column). Any engine
//! runs that call: the host engine at once, a device engine as one more
//! launch queued on the caller's stream. Detail mode reads the KV a second
//! time; it is opt-in, for diagnosing transfers.

use std::sync::Arc;

use crate::base::error::{err, Result};
use crate::inputs::blocks::BlockSet;
use crate::inputs::layout::Layout;
use crate::results::checksums::DetailEntry;

/// The shadow layout of a worker's layout: layer entry `entries[g]` is the
/// one layer of shadow group `g`.
#[derive(Debug, Clone)]
pub struct Shadow {
    /// One group per layer entry, over the same regions.
    pub layout: Layout,
    /// Per shadow group id, the entry it stands for.
    pub entries: Arc<[DetailEntry]>,
}

impl Shadow {
    /// The shadow of `layout` (its attention layer entries; state layers
    /// have no per-layer partials).
    pub fn new(layout: &Layout) -> Result<Shadow> {
        let mut shadow = Layout::default();
        for &region in layout.regions() {
            shadow.add_region(region)?;
        }
        let mut entries = Vec::new();
        for group in layout.groups() {
            for layer in group.layers() {
                let shadow_id = u32::try_from(entries.len())
                    .map_err(|_| err!(Unsupported, "detail mode supports at most 2^32 layer entries"))?;
                shadow.add_group(shadow_id, group.block_size)?;
                shadow.set_group_placement(shadow_id, group.placement())?;
                let mut spec = layer.spec.clone();
                spec.group_id = shadow_id;
                entries.push(DetailEntry {
                    group_id: group.group_id,
                    layer_number: spec.layer_number,
                    first_head: spec.first_head,
                    num_heads: spec.num_heads,
                    replica: spec.replica,
                });
                shadow.add_layer(spec)?;
            }
        }
        Ok(Shadow {
            layout: shadow,
            entries: entries.into(),
        })
    }

    /// The shadow call's blocks: every (request, group) of `blocks` that
    /// `layout` does not skip, repeated for each of the group's entries.
    /// `blocks` must already have passed `Plan::new` against `layout`.
    pub fn blocks(&self, layout: &Layout, blocks: &BlockSet) -> Result<BlockSet> {
        let mut shadow_blocks = BlockSet::new();
        shadow_blocks.leave_out_short_last();
        for request in blocks.requests() {
            shadow_blocks.add_request(&request.req_id, request.num_tokens)?;
            for group_blocks in &request.groups {
                if layout.skip_reason(group_blocks.group_id).is_some() {
                    continue;
                }
                for (shadow_id, entry) in self.entries.iter().enumerate() {
                    if entry.group_id == group_blocks.group_id {
                        shadow_blocks.add_group(
                            &request.req_id,
                            shadow_id as u32,
                            group_blocks.first_position,
                            &group_blocks.block_ids,
                        )?;
                    }
                }
            }
        }
        Ok(shadow_blocks)
    }
}
