//! Layer decodings (SPEC section 7): what one side's workers declared
//! together, and whether the two sides read the same bytes the same way.
//!
//! A fact (element type, head size, K or V scale) is compared only where
//! both sides declare it for the same layer: a side that declares nothing
//! (an engine of an older release, vLLM's own) makes no claim, and its
//! loads compare as they did before declarations existed. Where both
//! declare a fact with different values the checksums may well match (the
//! bytes are the same) while the engines compute with different KV, so
//! the group is unverified (`DecodingDiffers`), never a match.

use std::collections::BTreeMap;

use crate::inputs::decoding::{
    first_geometry_difference, merge_geometry, GeometryDifference, LayerDecoding, LayerGeometry,
};

use super::collect::{Judged, Pending, Unverified};
use super::report::Reason;

impl Pending {
    /// What the workers of this side declared about decoding the layers of
    /// `group_id`, per layer: each fact any of them declares. Two workers
    /// declaring a fact of one layer differently (TP ranks of one stage
    /// read the layer otherwise) make it unverified.
    pub fn decodings(&self, group_id: u32) -> Judged<Vec<(u32, LayerDecoding)>> {
        let mut merged: BTreeMap<u32, (LayerDecoding, String)> = BTreeMap::new();
        for part in self.reports.values() {
            let Some(info) = part.group_info(group_id) else {
                continue;
            };
            for (layer_number, decoding) in &info.decodings {
                match merged.get_mut(layer_number) {
                    None => {
                        merged.insert(*layer_number, (decoding.clone(), part.name()));
                    }
                    Some((held, first_worker)) => {
                        *held = held.merge(decoding).map_err(|d| {
                            Unverified(
                                Reason::DecodingDiffers,
                                format!(
                                    "group {group_id}, layer {layer_number}: {first_worker} declares {} {}, {} declares {} (the workers of one side read the layer differently)",
                                    d.field,
                                    d.first,
                                    part.name(),
                                    d.second
                                ),
                            )
                        })?;
                    }
                }
            }
        }
        Ok(merged.into_iter().map(|(n, (d, _))| (n, d)).collect())
    }

    /// The geometry of this side's caches of `group_id` (SPEC section 7,
    /// "Geometry"): every worker's runs merged. Two workers holding heads
    /// of a layer with other cells (a rank registered otherwise) make it
    /// unverified.
    pub fn geometry(&self, group_id: u32) -> Judged<Vec<LayerGeometry>> {
        let runs = self
            .reports
            .values()
            .filter_map(|part| part.group_info(group_id))
            .flat_map(|info| info.geometry.iter().copied());
        merge_geometry(runs).map_err(|d| {
            Unverified(
                Reason::GeometryDiffers,
                format!(
                    "group {group_id}: {} (the workers of one side register the layer's heads with other cells)",
                    geometry_text(&d, "one worker's", "another's")
                ),
            )
        })
    }
}

/// A geometry difference in words: `layer 3, heads 0..8: cell_bytes 256
/// (the producer's), 128 (the consumer's)`.
fn geometry_text(d: &GeometryDifference, first: &str, second: &str) -> String {
    let what = match d.field {
        "heads" => "heads (one past the last global head)",
        "cell_bytes" => "cell_bytes (a head's K and V bytes per token)",
        _ => "k_bytes (a head's K bytes per token)",
    };
    let heads = if d.field == "heads" {
        String::new()
    } else {
        format!(", heads {}..{}", d.heads.0, d.heads.1)
    };
    format!(
        "layer {}{heads}: {what} differs: {first} {}, {second} {}",
        d.layer_number, d.first, d.second
    )
}

/// Compares the geometry the producer sent (the extension, version 5) with
/// the consumer's: the first layer and fact that differ (the layer's
/// heads, a cell's bytes, K's bytes where both know them) make the group
/// unverified, naming the layer, the fact and both values. Nothing is
/// compared where the producer sent none (an earlier extension).
pub(super) fn compare_geometry(group_id: u32, producer: &[LayerGeometry], consumer: &[LayerGeometry]) -> Judged<()> {
    match first_geometry_difference(producer, consumer) {
        None => Ok(()),
        Some(d) => Err(Unverified(
            Reason::GeometryDiffers,
            format!(
                "group {group_id}: {} (another head size or element width: a configuration difference, not corrupt data)",
                geometry_text(&d, "the producer's", "the consumer's")
            ),
        )),
    }
}

/// Compares the producer's declarations of a group (the payload extension)
/// with the consumer's: the first layer and fact both declare differently
/// makes the group unverified, naming the layer, the fact and both values.
pub(super) fn compare_decodings(
    group_id: u32,
    producer: &[(u32, LayerDecoding)],
    consumer: &[(u32, LayerDecoding)],
) -> Judged<()> {
    let consumer: BTreeMap<u32, &LayerDecoding> = consumer.iter().map(|(n, d)| (*n, d)).collect();
    for (layer_number, sent) in producer {
        let Some(ours) = consumer.get(layer_number) else {
            continue;
        };
        if let Some(d) = sent.first_difference(ours) {
            return Err(Unverified(
                Reason::DecodingDiffers,
                format!(
                    "group {group_id}, layer {layer_number}: {} differs: the producer's {}, the consumer's {} (the same bytes are read as other values; a configuration difference, not corrupt data)",
                    d.field, d.first, d.second
                ),
            ));
        }
    }
    Ok(())
}
