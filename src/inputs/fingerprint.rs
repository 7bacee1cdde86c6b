//! Group fingerprints (SPEC section 7): what identifies the layers of a group,
//! so that a producer's and a consumer's checksums are compared only when
//! both describe the same layers.
//!
//! A layer's fingerprint is the first 8 bytes of the SHA-256 of the identity
//! bytes its caller registered, read as a little-endian `u64`; a worker's
//! group fingerprint is the sum of those of its layers in the group, modulo
//! 2^64. Summing over PP stages (one TP rank per stage) gives the group's
//! fingerprint for the whole model, whatever the split into stages. It is
//! vLLM's fingerprint; the *marks* (aliases, shard-keyed state), which
//! vLLM's does not count, travel beside it (records, the payload
//! extension) and are summed the same way.

use sha2::{Digest, Sha256};

use crate::inputs::decoding::{merge_geometry, LayerDecoding, LayerGeometry};
use crate::inputs::layout::Group;
use crate::inputs::placement::GroupPlacement;

/// `LE_u64(SHA-256(identity)[0..8])`: one layer's share of its group's
/// fingerprint.
pub fn layer_fingerprint(identity: &[u8]) -> u64 {
    let digest = Sha256::digest(identity);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first)
}

/// What an alias (a layer reading another layer's cache) adds to its
/// group's marks, `LE_u64(SHA-256("kvcsum alias")[0..8]) | 1`: a layer
/// registered as an alias on one side and with a cache of its own on the
/// other checksums differently, and must not compare.
pub const ALIAS_MARK: &[u8] = b"kvcsum alias";

/// What a shard-keyed state layer (SPEC section 6, split unknown) adds to
/// its group's marks, `LE_u64(SHA-256("kvcsum shard-keyed
/// state")[0..8]) | 1`: its checksums follow another convention than
/// those of the same layer with the split known.
pub const SHARD_KEYED_MARK: &[u8] = b"kvcsum shard-keyed state";

/// The odd number a mark adds per layer: `n` marked layers add `n` times
/// it, never 0 modulo 2^64 for `n` below 2^64.
pub fn mark(text: &[u8]) -> u64 {
    layer_fingerprint(text) | 1
}

/// The worker's fingerprint of `group` (SPEC section 7, vLLM's): the sum
/// over its registered layers of [`layer_fingerprint`], modulo 2^64.
///
/// Every registered layer entry counts once: a layer whose caches are
/// registered as several entries of one group (a KV cache and its indexer,
/// say) adds the fingerprint of each entry's identity, a layer that reads
/// another's cache (an alias) adds its own, and so does a state layer.
/// Every TP rank of a stage registers the same entries, so each gives the
/// same value.
pub fn group_fingerprint(group: &Group) -> u64 {
    let identities = group
        .layers
        .iter()
        .map(|layer| &layer.spec.identity)
        .chain(group.aliases.iter().map(|alias| &alias.identity))
        .chain(group.states.iter().map(|state| &state.spec.identity));
    identities.fold(0u64, |sum, identity| sum.wrapping_add(layer_fingerprint(identity)))
}

/// The marks of `group` (SPEC section 7): [`ALIAS_MARK`]'s number for each
/// alias plus [`SHARD_KEYED_MARK`]'s for each shard-keyed state layer,
/// modulo 2^64. They tell apart two conventions of checksumming the same
/// layers, which the fingerprint (vLLM's) does not; the payload extension
/// carries them beside it.
pub fn group_marks(group: &Group) -> u64 {
    let aliases = (group.aliases.len() as u64).wrapping_mul(mark(ALIAS_MARK));
    let shard_keyed = group.states.iter().filter(|state| !state.spec.split_known).count() as u64;
    aliases
        .wrapping_add(shard_keyed.wrapping_mul(mark(SHARD_KEYED_MARK)))
        .wrapping_add(slots_mark(group))
}

/// The marks of compressed slots (SPEC section 16): with `k =
/// tokens_per_slot > 1`, each layer number of the group counts
/// `mark("kvcsum tokens per slot " || decimal k)`, so that sides whose
/// slots summarise other numbers of tokens (one of them per token) never
/// compare; 0 with one slot per token. DCP adds no mark: the verifier sums
/// its shards before anything crosses between engines.
fn slots_mark(group: &Group) -> u64 {
    let k = group.placement().tokens_per_slot;
    if k == 1 {
        return 0;
    }
    let layers: std::collections::BTreeSet<u32> = group.layers.iter().map(|l| l.spec.layer_number).collect();
    (layers.len() as u64).wrapping_mul(mark(format!("kvcsum tokens per slot {k}").as_bytes()))
}

/// The layer decodings of a group as one number (SPEC section 8): the sum
/// over the declared layers of `LE_u64(SHA-256("kvcsum decoding" ||
/// LE_u32(layer_number) || LE_u32(len(dtype)) || dtype || LE_u32(head_size)
/// || LE_u64(k_scale bits) || LE_u64(v_scale bits))[0..8])`, with `""` and
/// 0 for facts not declared; 0 for none.
pub fn decodings_digest(decodings: &[(u32, LayerDecoding)]) -> u64 {
    decodings.iter().fold(0u64, |sum, (layer_number, decoding)| {
        let (dtype, head_size, k_scale, v_scale) = decoding.parts();
        let mut bytes = b"kvcsum decoding".to_vec();
        bytes.extend(layer_number.to_le_bytes());
        bytes.extend((dtype.len() as u32).to_le_bytes());
        bytes.extend(dtype.as_bytes());
        bytes.extend(head_size.to_le_bytes());
        bytes.extend(k_scale.to_le_bytes());
        bytes.extend(v_scale.to_le_bytes());
        sum.wrapping_add(layer_fingerprint(&bytes))
    })
}

/// The geometry of a worker's caches of a group as one number (SPEC
/// section 8): its runs merged ([`merge_geometry`]: a layer registered as
/// several head ranges of equal cells is one run), then the sum over them
/// of `LE_u64(SHA-256("kvcsum geometry" || LE_u32(layer_number) ||
/// LE_u32(first_head) || LE_u32(num_heads) || LE_u32(cell_bytes))[0..8])`;
/// 0 for none. K's bytes are left out: whether K and V are registered
/// apart is layout, which does not change a checksum (SPEC section 3).
pub fn geometry_digest(geometry: &[LayerGeometry]) -> u64 {
    // One worker's runs never overlap (a layout refuses it), so they merge.
    let merged = merge_geometry(geometry.iter().copied()).unwrap_or_else(|_| geometry.to_vec());
    merged.iter().fold(0u64, |sum, run| {
        let mut bytes = b"kvcsum geometry".to_vec();
        for word in [run.layer_number, run.first_head, run.num_heads, run.cell_bytes] {
            bytes.extend(word.to_le_bytes());
        }
        sum.wrapping_add(layer_fingerprint(&bytes))
    })
}

/// The digest of a group's placement (SPEC sections 8 and 16) that a
/// stored entry's configuration adds to the geometry's: 0 for the default
/// placement (so stamps stored before placements existed still read as
/// the worker's own), else `LE_u64(SHA-256("kvcsum placement" ||
/// LE_u32(dcp_size) || LE_u32(dcp_rank) || LE_u32(interleave) ||
/// LE_u32(tokens_per_slot))[0..8])`.
pub fn placement_digest(placement: &GroupPlacement) -> u64 {
    if placement.is_default() {
        return 0;
    }
    let mut bytes = b"kvcsum placement".to_vec();
    for word in [
        placement.dcp_size,
        placement.dcp_rank,
        placement.interleave,
        placement.tokens_per_slot,
    ] {
        bytes.extend(word.to_le_bytes());
    }
    layer_fingerprint(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_fingerprint_is_the_first_eight_digest_bytes() {
        // SHA-256("abc") = ba7816bf 8f01cfea ..., a published test vector.
        assert_eq!(
            layer_fingerprint(b"abc"),
            u64::from_le_bytes([0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea])
        );
        // SHA-256("") = e3b0c442 98fc1c14 ...
        assert_eq!(
            layer_fingerprint(b""),
            u64::from_le_bytes([0xe3, 0xb0, 0xc4, 0x42, 0x98, 0xfc, 0x1c, 0x14])
        );
    }
}
