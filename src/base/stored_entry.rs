//! The 16 bytes kept per block id for offloaded KV (SPEC section 8), in one
//! place: how a store fills them and how a load check reads them back.
//!
//! An entry is the stored *value*, then a *stamp*, each a little-endian
//! `u64`:
//!
//! - `value = sum XOR tag`, `tag = LE_u64(block_hash[0..8]) XOR fingerprint`;
//! - `stamp = check * 2^32 + digest`, where the `digest` (low 32 bits) says
//!   which configuration stored the value and for how many valid tokens, and
//!   the `check` (high 32 bits) binds the value and the digest to the block
//!   hash, so that a damaged entry (either word) fails instead of reading as
//!   another configuration.
//!
//! The check is computed from the entry and the block hash alone, so a
//! worker of any configuration tells a clean entry of another configuration
//! from a damaged one. `f` is [`mix`] (SPEC section 12) throughout.

use crate::base::checksum::{mix, Algorithm};

/// A load check's verdict on one block position (SPEC section 8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredOutcome {
    /// The recomputed checksum differs from the stored one, or the entry is
    /// damaged (its check fails) or was stored for another block hash.
    Failed,
    /// The recomputed checksum equals the stored one.
    Matched,
    /// Not checked: the position holds no valid token.
    NotChecked,
    /// Not compared: a clean entry stored by a worker whose group had other
    /// layers, identities, heads or block size (another configuration).
    OtherFingerprint,
    /// Not compared: a clean entry stored with another algorithm.
    OtherAlgorithm,
    /// Not compared: a clean entry of this configuration stored when the
    /// block held another number of valid tokens (a partial last block
    /// stored, the request longer when loaded, or shorter).
    OtherTokens,
    /// Not compared: an entry of the format kvcsum 0.2.0 stored (no check,
    /// no token count) under this configuration, whose value does not match;
    /// the format cannot tell corruption from another token count.
    OtherFormat,
}

impl StoredOutcome {
    /// The outcome's number in records (and `kvcs_stored_outcome`): 0
    /// failed, 1 matched, 2 not checked, 3 other fingerprint, 4 other
    /// algorithm, 5 other tokens, 6 other format.
    pub fn code(self) -> u8 {
        match self {
            StoredOutcome::Failed => 0,
            StoredOutcome::Matched => 1,
            StoredOutcome::NotChecked => 2,
            StoredOutcome::OtherFingerprint => 3,
            StoredOutcome::OtherAlgorithm => 4,
            StoredOutcome::OtherTokens => 5,
            StoredOutcome::OtherFormat => 6,
        }
    }

    /// The outcome of number `code`, if it is one.
    pub fn from_code(code: u8) -> Option<StoredOutcome> {
        match code {
            0 => Some(StoredOutcome::Failed),
            1 => Some(StoredOutcome::Matched),
            2 => Some(StoredOutcome::NotChecked),
            3 => Some(StoredOutcome::OtherFingerprint),
            4 => Some(StoredOutcome::OtherAlgorithm),
            5 => Some(StoredOutcome::OtherTokens),
            6 => Some(StoredOutcome::OtherFormat),
            _ => None,
        }
    }
}

/// The tag that binds a stored value to its block hash and group:
/// `LE_u64(block_hash[0..8]) XOR fingerprint`.
pub fn block_tag(block_hash: u64, group_fingerprint: u64) -> u64 {
    block_hash ^ group_fingerprint
}

/// The configuration of the group that stores or checks an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryConfig {
    /// The worker's fingerprint of the group (SPEC section 7), as the tag
    /// counts it (SPEC section 8: marked, plus the decodings' digest).
    pub fingerprint: u64,
    /// The digest of the geometry of the worker's caches of the group
    /// (SPEC section 8), which the digest counts and the tag does not.
    pub geometry: u64,
    /// The coverage of every slice the worker holds in the group, all its
    /// columns (SPEC section 10).
    pub coverage: u64,
    /// Tokens per block of the group.
    pub block_size: u32,
    /// The worker's algorithm.
    pub algorithm: Algorithm,
    /// Whether the group is a state group, whose one position holds the
    /// state whatever the tokens (its entries count 0 tokens).
    pub state: bool,
}

/// Algorithm ids a load check tells apart (those this library knows).
fn known_algorithms() -> impl Iterator<Item = u32> {
    Algorithm::all().into_iter().map(Algorithm::code)
}

impl EntryConfig {
    /// `config(algorithm) = f(f(f(fingerprint + geometry) XOR coverage) XOR
    /// (block_size * 2^32 + algorithm))`: the high 32 bits name the
    /// configuration in the digest.
    fn base(&self, algorithm: u32) -> u32 {
        let sizes = ((self.block_size as u64) << 32) | algorithm as u64;
        let fingerprint = self.fingerprint.wrapping_add(self.geometry);
        (mix(mix(mix(fingerprint) ^ self.coverage) ^ sizes) >> 32) as u32
    }

    /// The tokens an entry of a position with `valid_tokens` counts: 0 in a
    /// state group, else the valid tokens.
    pub fn tokens(&self, valid_tokens: u32) -> u32 {
        if self.state {
            0
        } else {
            valid_tokens
        }
    }

    /// The digests of this configuration's entries, for many positions
    /// (the configuration hashed once): a position counting `tokens`
    /// ([`EntryConfig::tokens`]) has `(config(algorithm) >> 32) XOR tokens`.
    pub fn digests(&self) -> Digests {
        Digests {
            base: self.base(self.algorithm.code()),
        }
    }

    /// The stamp kvcsum 0.2.0 wrote for this configuration under algorithm
    /// `algorithm`: `(fingerprint + coverage) XOR algorithm`.
    fn legacy_stamp(&self, algorithm: u32) -> u64 {
        self.fingerprint.wrapping_add(self.coverage) ^ algorithm as u64
    }

    /// What a load check needs to read entries of this configuration.
    pub fn reader(&self) -> EntryReader {
        let own = self.algorithm.code();
        let mut bases = vec![(own, self.base(own))];
        bases.extend(known_algorithms().filter(|&a| a != own).map(|a| (a, self.base(a))));
        EntryReader {
            own,
            bases,
            legacy: known_algorithms().map(|a| (a, self.legacy_stamp(a))).collect(),
            max_tokens: if self.state { 0 } else { self.block_size },
        }
    }
}

/// The digests of one configuration's entries ([`EntryConfig::digests`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Digests {
    /// `config(algorithm) >> 32`.
    base: u32,
}

impl Digests {
    /// The digest of a position counting `tokens`.
    pub fn digest(&self, tokens: u32) -> u32 {
        self.base ^ tokens
    }
}

/// The key that binds an entry to its block: `f(LE_u64(block_hash[0..8])
/// XOR f(digest))`. A device store gets it with each item (it does not
/// depend on the value).
pub fn entry_key(block_hash: u64, digest: u32) -> u64 {
    mix(block_hash ^ mix(digest as u64))
}

/// The stamp stored after `value`: `check * 2^32 + digest`, with `check =
/// f(f(value) XOR key) >> 32` (`kvcs_store` computes the same on a device).
pub fn stamp(value: u64, key: u64, digest: u32) -> u64 {
    let check = mix(mix(value) ^ key) >> 32;
    (check << 32) | digest as u64
}

/// The entry a store writes for a position whose columns add up to `sum`:
/// `(value, stamp)`.
pub fn entry(sum: u64, tag: u64, block_hash: u64, digest: u32) -> (u64, u64) {
    let value = sum ^ tag;
    (value, stamp(value, entry_key(block_hash, digest), digest))
}

/// How a load check reads entries for one configuration: the digests'
/// bases of every known algorithm (the worker's first) and the stamps
/// 0.2.0 wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryReader {
    /// The worker's algorithm.
    own: u32,
    /// (algorithm, the digest's base under it), the worker's first.
    bases: Vec<(u32, u32)>,
    /// (algorithm, the 0.2.0 stamp of this configuration under it).
    legacy: Vec<(u32, u64)>,
    /// The most tokens an entry of this configuration counts (the block
    /// size; 0 in a state group).
    max_tokens: u32,
}

impl EntryReader {
    /// The verdict on an entry `(value, stamp)` read back at a position of
    /// block hash `block_hash` and tag `tag`, counting `tokens`
    /// ([`EntryConfig::tokens`]), whose columns add up to `sum` now.
    pub fn judge(&self, block_hash: u64, tag: u64, tokens: u32, sum: u64, (value, read): (u64, u64)) -> StoredOutcome {
        let digest = read as u32;
        if stamp(value, entry_key(block_hash, digest), digest) != read {
            // Damaged, stored for another block, or 0.2.0's format.
            return match self.legacy.iter().find(|&&(_, legacy)| legacy == read) {
                Some(&(algorithm, _)) if algorithm == self.own && value ^ tag == sum => StoredOutcome::Matched,
                Some(_) => StoredOutcome::OtherFormat,
                None => StoredOutcome::Failed,
            };
        }
        let plausible = |stored: u32| {
            if self.max_tokens == 0 {
                stored == 0
            } else {
                (1..=self.max_tokens).contains(&stored)
            }
        };
        for &(algorithm, base) in &self.bases {
            let stored_tokens = digest ^ base;
            if !plausible(stored_tokens) {
                continue;
            }
            return if algorithm != self.own {
                StoredOutcome::OtherAlgorithm
            } else if stored_tokens != tokens {
                StoredOutcome::OtherTokens
            } else if value ^ tag == sum {
                StoredOutcome::Matched
            } else {
                StoredOutcome::Failed
            };
        }
        StoredOutcome::OtherFingerprint
    }
}

#[cfg(test)]
mod tests;
