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

use crate::decoding::LayerDecoding;

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
