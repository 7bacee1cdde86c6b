//! Detail mode: per-layer partial checksums, so that a verifier can name the
//! layers (and head ranges) that differ at a mismatching block position.
//!
//! Each registered layer entry becomes its own "shadow" group of one layer
//! (same block size, same caches), and the request blocks are repeated for
//! each shadow group; one engine call over that shadow layout then gives
//! every layer entry's partials, with the arithmetic of the plain call (a
//! layer's partial is exactly its share of the group's column). Detail mode
//! reads the KV a second time; it is opt-in, for diagnosing transfers.

use crate::blocks::BlockSet;
use crate::error::{err, Result};
use crate::host::HostEngine;
use crate::layout::{Layout, Role};
use crate::plan::Plan;
use crate::result::{LayerPartial, RequestLayers};

/// The layer partials of every request and group of `blocks`, computed on
/// the worker's host engine. `blocks` must already have passed
/// `Plan::new` against `layout` (ids in bounds, groups registered).
pub fn compute(layout: &Layout, blocks: &BlockSet, role: Role, engine: &HostEngine) -> Result<Vec<RequestLayers>> {
    // Shadow group `i` holds layer entry `entries[i]` = (group id, index in group).
    let mut shadow = Layout::default();
    for &region in layout.regions() {
        shadow.add_region(region)?;
    }
    let mut entries = Vec::new();
    for group in layout.groups() {
        for (index, layer) in group.layers.iter().enumerate() {
            let shadow_id = u32::try_from(entries.len())
                .map_err(|_| err!(Unsupported, "detail mode supports at most 2^32 layer entries"))?;
            shadow.add_group(shadow_id, group.block_size)?;
            let mut spec = layer.spec.clone();
            spec.group_id = shadow_id;
            shadow.add_layer(spec)?;
            entries.push((group.group_id, index));
        }
    }
    let mut shadow_blocks = BlockSet::new();
    for request in blocks.requests() {
        shadow_blocks.add_request(&request.req_id, request.num_tokens)?;
        for group_blocks in &request.groups {
            if layout.skip_reason(group_blocks.group_id).is_some() {
                continue;
            }
            for (shadow_id, &(group_id, _)) in entries.iter().enumerate() {
                if group_id == group_blocks.group_id {
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
    let plan = Plan::new(&shadow, &shadow_blocks, role)?;
    let values = engine.compute(&shadow, &plan, role);
    let mut requests = Vec::with_capacity(blocks.requests().len());
    let shadow_requests = plan.shape.build();
    for (request, shadow_request) in blocks.requests().iter().zip(&shadow_requests) {
        let mut groups = Vec::with_capacity(request.groups.len());
        for group_blocks in &request.groups {
            if layout.skip_reason(group_blocks.group_id).is_some() {
                continue;
            }
            let group = layout
                .group(group_blocks.group_id)
                .expect("the plain plan checked the group");
            let mut layers = Vec::new();
            for shadow_group in &shadow_request.groups {
                let (group_id, index) = entries[shadow_group.group_id as usize];
                // A shadow group has one column, or none where the role does
                // not compute its layer's replica.
                if group_id != group.group_id || shadow_group.columns.is_empty() {
                    continue;
                }
                let spec = &group.layers[index].spec;
                let start = shadow_group.values_offset;
                layers.push(LayerPartial {
                    layer_number: spec.layer_number,
                    first_head: spec.first_head,
                    num_heads: spec.num_heads,
                    replica: spec.replica,
                    values: values[start..start + shadow_group.num_positions].to_vec(),
                });
            }
            layers.sort_by_key(|l| (l.layer_number, l.first_head));
            groups.push(layers);
        }
        requests.push(RequestLayers { groups });
    }
    Ok(requests)
}
