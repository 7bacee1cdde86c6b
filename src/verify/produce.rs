//! Producing: the payload of SPEC section 9 from every worker's part of a
//! producer's request.

use crate::base::checksum::Algorithm;
use crate::base::error::{err, Error, Result};
use crate::inputs::blocks::GroupBlocks;
use crate::wire::payload::{Extension, ExtensionGroup, LayerPartial, Payload, PayloadGroup, FIRST_COPY};
use crate::wire::record::RecordGroup;

use super::collect::{add_into, shard_coverage, Judged, Pending, Unverified, WorkerPart};

/// The payload of `req_id` from its complete parts, all computed with
/// `algorithm`; `with_extension` adds the kvcsum extension with
/// `producer_tp_size`, and so does an algorithm other than weighted, which
/// a plain payload cannot say (SPEC section 9).
pub(super) fn build_payload(
    req_id: &str,
    pending: &Pending,
    with_extension: bool,
    producer_tp_size: u32,
    algorithm: Algorithm,
) -> Result<Payload> {
    let fail = |Unverified(reason, message): Unverified| -> Error {
        err!(
            InvalidArgument,
            "no payload for req_id {req_id:?}: {}: {message}",
            reason.describe()
        )
    };
    pending.check_tokens().map_err(fail)?;
    let detail = pending.all_detail();
    let mut groups = Vec::new();
    let mut extension_groups = Vec::new();
    for scheduled in &pending.scheduled.groups {
        // A group no worker read is left out, as a skipped one is: the
        // consumer then knows it was not checksummed here.
        if pending.skipped_by(scheduled.group_id).is_some() || pending.check_read(scheduled.group_id).is_err() {
            continue;
        }
        let (group, extension_group) = payload_group(pending, scheduled, detail).map_err(fail)?;
        groups.push(group);
        extension_groups.push(extension_group);
    }
    let payload = Payload {
        num_tokens: pending.scheduled.num_tokens,
        groups,
        extension: (with_extension || algorithm != Algorithm::Weighted).then_some(Extension {
            producer_tp_size,
            groups: extension_groups,
            algorithm,
        }),
    };
    payload.validate().map_err(|e| {
        err!(
            InvalidArgument,
            "no payload for req_id {req_id:?}: the records give an invalid payload: {e}"
        )
    })?;
    Ok(payload)
}

/// One scheduled group's payload entry and extension entry (with the layer
/// partials when every worker sent them).
fn payload_group(pending: &Pending, scheduled: &GroupBlocks, detail: bool) -> Judged<(PayloadGroup, ExtensionGroup)> {
    let group_id = scheduled.group_id;
    let parts = pending.group_parts(scheduled)?;
    let (fingerprint, marks) = pending.fingerprint(group_id)?;
    let block_size = pending.block_size(group_id)?;
    let group = PayloadGroup {
        group_id,
        fingerprint,
        first_position: scheduled.first_position,
        values: first_copy_sum(&parts, scheduled.block_ids.len()),
    };
    let extension_group = ExtensionGroup {
        group_id,
        block_size,
        layers: if detail { first_copy_layers(&parts) } else { Vec::new() },
        coverage: Some(first_copy_coverage(&parts, group_id)?),
        marks: Some(marks),
        decodings: pending.decodings(group_id)?,
        geometry: pending.geometry(group_id)?,
        short_last: first_copy_short_last(&parts),
    };
    Ok((group, extension_group))
}

/// The sum of every worker's `replica_index == 0` short last values, as
/// [`first_copy_sum`] sums the values: the group's last position over one
/// token fewer. `None` unless every worker computed them (the group holds
/// the request's last token).
fn first_copy_short_last(parts: &[(&WorkerPart, &RecordGroup)]) -> Option<u64> {
    parts.iter().try_fold(0u64, |sum, (_, group)| {
        let short_last = group.short_last.as_ref()?;
        Some(
            group
                .columns
                .iter()
                .zip(short_last)
                .filter(|(column, _)| column.replica.replica_index == 0)
                .fold(sum, |sum, (_, value)| sum.wrapping_add(*value)),
        )
    })
}

/// The coverage of the slices in every worker's `replica_index == 0`
/// columns: what [`first_copy_sum`] adds up, its DCP token shards counted
/// once ([`shard_coverage`]: each must be there, each covering alike).
fn first_copy_coverage(parts: &[(&WorkerPart, &RecordGroup)], group_id: u32) -> Judged<u64> {
    Ok(shard_coverage(parts, group_id)?
        .iter()
        .filter(|(key, _)| key.replica_index == 0)
        .fold(0u64, |sum, (_, coverage)| sum.wrapping_add(*coverage)))
}

/// The sum of every worker's `replica_index == 0` columns: each head counted
/// once (SPEC section 4).
fn first_copy_sum(parts: &[(&WorkerPart, &RecordGroup)], num_positions: usize) -> Vec<u64> {
    let mut values = vec![0u64; num_positions];
    for (_, group) in parts {
        for column in group.columns.iter().filter(|c| c.replica.replica_index == 0) {
            add_into(&mut values, &column.values);
        }
    }
    values
}

/// Every worker's `replica_index == 0` layer partials, sorted by (layer,
/// first head).
fn first_copy_layers(parts: &[(&WorkerPart, &RecordGroup)]) -> Vec<LayerPartial> {
    let mut layers: Vec<LayerPartial> = parts
        .iter()
        .flat_map(|(_, group)| group.layers.iter())
        .filter(|l| l.replica.replica_index == 0)
        .map(|l| LayerPartial {
            replica: FIRST_COPY,
            ..l.clone()
        })
        .collect();
    layers.sort_by_key(|l| (l.layer_number, l.first_head));
    layers
}
