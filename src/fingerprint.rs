//! Group fingerprints (SPEC section 7): what identifies the layers of a group,
//! so that a producer's and a consumer's checksums are compared only when
//! both describe the same layers.
//!
//! A layer's fingerprint is the first 8 bytes of the SHA-256 of the identity
//! bytes its caller registered, read as a little-endian `u64`; a worker's
//! group fingerprint is the sum of those of its layers in the group, modulo
//! 2^64. Summing over PP stages (one TP rank per stage) gives the group's
//! fingerprint for the whole model, whatever the split into stages.

use sha2::{Digest, Sha256};

use crate::layout::Group;

/// `LE_u64(SHA-256(identity)[0..8])`: one layer's share of its group's
/// fingerprint.
pub fn layer_fingerprint(identity: &[u8]) -> u64 {
    let digest = Sha256::digest(identity);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first)
}

/// The worker's fingerprint of `group`: the sum of [`layer_fingerprint`] over
/// its registered layers, modulo 2^64.
///
/// Every registered layer entry counts once: a layer whose caches are
/// registered as several entries of one group (a KV cache and its indexer,
/// say) adds the fingerprint of each entry's identity, and a layer that
/// reads another's cache (an alias) adds its own. Every TP rank of a stage
/// registers the same entries, so each gives the same value.
pub fn group_fingerprint(group: &Group) -> u64 {
    let identities = group
        .layers
        .iter()
        .map(|layer| &layer.spec.identity)
        .chain(group.aliases.iter().map(|alias| &alias.identity))
        .chain(group.states.iter().map(|state| &state.spec.identity));
    identities.fold(0u64, |sum, identity| sum.wrapping_add(layer_fingerprint(identity)))
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
