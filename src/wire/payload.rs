//! The payload of SPEC section 9: a producer's checksums of one request, as
//! sent to its consumer.
//!
//! [docs/SPEC.md section 9](../../docs/SPEC.md#9-payload-producer-to-consumer)
//! defines both encodings, so they are not repeated here: the plain
//! payload, byte for byte what vLLM's `KVChecksumPayload.to_bytes()` gives
//! (in `kv_transfer_params` as standard padded base64 under
//! [`TRANSFER_PARAMS_KEY`]), and the kvcsum extension (kvcsum to kvcsum
//! only, since vLLM's decoder rejects it), whose versions this module
//! writes ([`EXTENSION_VERSION`]) and reads. [`Payload::fingerprint_convention`]
//! says which convention a group's fingerprint follows.
//!
//! [`Payload::decode`] accepts any valid msgpack of these shapes (integers in
//! any width) and rejects everything else with `Error::Malformed` and a
//! message, allocating at most in proportion to its input.

use std::collections::{HashMap, HashSet};

use base64::Engine as _;

use crate::base::checksum::{Algorithm, KNOWN_ALGORITHMS};
use crate::base::error::{err, Result};
use crate::base::msgpack::{initial_capacity, Reader, Writer};
use crate::inputs::decoding::{LayerDecoding, LayerGeometry};
use crate::inputs::layout::ReplicaKey;
use crate::wire::record::{
    check_decodings, check_geometry, check_layer_partials, read_decodings, read_geometry, write_decodings,
    write_geometry,
};

/// The payload version this library writes and reads.
pub const PAYLOAD_VERSION: u64 = 1;

/// The newest extension version, which this library writes where a group
/// has a geometry (every group a producer of this release checksummed); it
/// also reads versions 1 (without `algorithm`, which means weighted, and
/// without coverage), 2 (without marks and decodings), 3 (without short
/// last values) and 4 (without geometry).
pub const EXTENSION_VERSION: u64 = 5;

/// The `kv_transfer_params` key of the base64 payload.
pub const TRANSFER_PARAMS_KEY: &str = "kv_checksums";

/// One group's checksums in a payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadGroup {
    /// The group.
    pub group_id: u32,
    /// The producer's fingerprint of the group (summed over PP stages).
    pub fingerprint: u64,
    /// Block position of `values[0]`.
    pub first_position: u64,
    /// One checksum per block position.
    pub values: Vec<u64>,
}

/// The payload extension's layers are [`LayerPartial`]s, the one type of
/// per-layer partials: the first copy of each layer entry's heads. Their
/// replica key is not sent, so a payload's layers carry
/// [`FIRST_COPY`] whatever the producer's replication.
pub use crate::results::checksums::LayerPartial;

/// The replica key of a payload's layer partials: first copies, unreplicated.
pub const FIRST_COPY: ReplicaKey = ReplicaKey {
    replicas: 1,
    replica_index: 0,
};

/// What the extension says of one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtensionGroup {
    /// A group of the plain payload.
    pub group_id: u32,
    /// The producer's block size of the group.
    pub block_size: u32,
    /// Detail mode: layer partials, sorted by (layer, first head), not
    /// overlapping; empty otherwise.
    pub layers: Vec<LayerPartial>,
    /// The coverage of the slices the producer checksummed (SPEC section
    /// 10); `None` in an extension of version 1, which has none.
    pub coverage: Option<u64>,
    /// The producer's marks of the group (SPEC section 7); `None` in an
    /// extension of version 1 or 2, whose fingerprint conventions
    /// [`Payload::fingerprint_convention`] gives.
    pub marks: Option<u64>,
    /// What the producer declared about decoding the group's layers (SPEC
    /// section 7), sorted by layer number; empty before version 3.
    pub decodings: Vec<(u32, LayerDecoding)>,
    /// The value of the group's position holding the request's last token
    /// over `num_tokens - 1` tokens (0 where it then holds none), summed as
    /// the values are; `None` where not sent (before version 4, or where
    /// the group does not hold the last token).
    pub short_last: Option<u64>,
    /// The geometry of the producer's caches of the group (SPEC section 7),
    /// its workers' runs merged, sorted by (layer, first head); empty
    /// before version 5.
    pub geometry: Vec<LayerGeometry>,
}

/// What a group's fingerprint in a payload counts (SPEC section 7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FingerprintConvention {
    /// Extension version 3, 4 or 5: the fingerprint without marks, the marks beside it.
    Separate {
        /// The producer's marks of the group.
        marks: u64,
    },
    /// Extension version 2 (kvcsum 0.2.0): the fingerprint plus the marks.
    Marked,
    /// Extension version 1 (kvcsum 0.1.0): the fingerprint, which had no marks.
    Unmarked,
    /// No extension entry for the group: vLLM's fingerprint (no marks), or
    /// a kvcsum producer's without extension (0.2.0's had the marks).
    Unknown,
}

/// The optional fourth element of a payload (kvcsum to kvcsum).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extension {
    /// The producer's TP size.
    pub producer_tp_size: u32,
    /// Per group of the payload (any subset, each at most once).
    pub groups: Vec<ExtensionGroup>,
    /// The algorithm of the payload's values (SPEC section 12).
    pub algorithm: Algorithm,
}

/// A producer's checksums of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    /// Tokens whose KV the checksummed blocks hold.
    pub num_tokens: u64,
    /// Per group, in the producer's order.
    pub groups: Vec<PayloadGroup>,
    /// The kvcsum extension, if sent.
    pub extension: Option<Extension>,
}

impl Extension {
    /// The version [`Payload::encode`] writes, the earliest that carries
    /// all there is: 5 where a group has a geometry, else 4 where a group
    /// has a short last value, else 3 where
    /// a group has marks or decodings, else 1 where that says all there is
    /// (weighted values, no coverage, as a version-1 extension decodes),
    /// else 2.
    pub fn version(&self) -> u64 {
        if self.groups.iter().any(|g| !g.geometry.is_empty()) {
            EXTENSION_VERSION
        } else if self.groups.iter().any(|g| g.short_last.is_some()) {
            4
        } else if self.groups.iter().any(|g| g.marks.is_some() || !g.decodings.is_empty()) {
            3
        } else if self.algorithm == Algorithm::Weighted && self.groups.iter().all(|g| g.coverage.is_none()) {
            1
        } else {
            2
        }
    }
}

impl Payload {
    /// The payload's bytes; without an extension, identical to vLLM's.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.array(if self.extension.is_some() { 4 } else { 3 });
        w.uint(PAYLOAD_VERSION);
        w.uint(self.num_tokens);
        w.array(self.groups.len());
        for group in &self.groups {
            w.array(4);
            w.uint(group.group_id as u64);
            w.uint(group.fingerprint);
            w.uint(group.first_position);
            w.u64s(&group.values);
        }
        if let Some(extension) = &self.extension {
            let version = extension.version();
            let version_1 = version == 1;
            w.array(if version_1 { 3 } else { 4 });
            w.uint(version);
            w.uint(extension.producer_tp_size as u64);
            w.array(extension.groups.len());
            for group in &extension.groups {
                w.array(match version {
                    1 => 3,
                    2 => 4,
                    3 => 6,
                    4 => 7,
                    _ => 8,
                });
                w.uint(group.group_id as u64);
                w.uint(group.block_size as u64);
                w.array(group.layers.len());
                for layer in &group.layers {
                    w.array(4);
                    w.uint(layer.layer_number as u64);
                    w.uint(layer.first_head as u64);
                    w.uint(layer.num_heads as u64);
                    w.u64s(&layer.values);
                }
                if !version_1 {
                    w.uint(group.coverage.unwrap_or(0));
                }
                if version >= 3 {
                    w.uint(group.marks.unwrap_or(0));
                    write_decodings(&mut w, &group.decodings);
                }
                if version >= 4 {
                    let short_last: Vec<u64> = group.short_last.into_iter().collect();
                    w.u64s(&short_last);
                }
                if version >= 5 {
                    write_geometry(&mut w, &group.geometry);
                }
            }
            if !version_1 {
                w.uint(extension.algorithm.code().into());
            }
        }
        w.into_bytes()
    }

    /// Decodes and validates a payload (plain or with the extension).
    pub fn decode(bytes: &[u8]) -> Result<Payload> {
        let mut r = Reader::new(bytes, "payload");
        let at = r.position();
        let len = r.array("the payload")?;
        if len != 3 && len != 4 {
            return Err(err!(
                Malformed,
                "payload: byte {at}: expected an array of 3 elements (4 with the kvcsum extension), found {len}"
            ));
        }
        let at = r.position();
        let version = r.uint("version")?;
        if version != PAYLOAD_VERSION {
            return Err(err!(
                Malformed,
                "payload: byte {at}: version {version} is not supported (this library reads version {PAYLOAD_VERSION})"
            ));
        }
        let num_tokens = r.uint("num_tokens")?;
        let num_groups = r.array("groups")?;
        let mut groups = Vec::with_capacity(initial_capacity(num_groups));
        for _ in 0..num_groups {
            r.array_of("a group", 4)?;
            groups.push(PayloadGroup {
                group_id: r.u32("group_id")?,
                fingerprint: r.uint("fingerprint")?,
                first_position: r.uint("first_position")?,
                values: r.u64s("values")?,
            });
        }
        let extension = if len == 4 {
            Some(decode_extension(&mut r)?)
        } else {
            None
        };
        r.finish()?;
        let payload = Payload {
            num_tokens,
            groups,
            extension,
        };
        payload.validate()?;
        Ok(payload)
    }

    /// Checks what the encoding cannot express; `Error::Malformed` naming the
    /// first problem.
    pub fn validate(&self) -> Result<()> {
        // Group id -> the group: one lookup per extension group, not a search.
        let mut plain_groups: HashMap<u32, &PayloadGroup> = HashMap::with_capacity(self.groups.len());
        for group in &self.groups {
            if plain_groups.insert(group.group_id, group).is_some() {
                return Err(err!(Malformed, "payload: group {} appears twice", group.group_id));
            }
            if group.first_position.checked_add(group.values.len() as u64).is_none() {
                return Err(err!(
                    Malformed,
                    "payload: group {}: first_position {} + {} values overflows",
                    group.group_id,
                    group.first_position,
                    group.values.len()
                ));
            }
        }
        let Some(extension) = &self.extension else {
            return Ok(());
        };
        if extension.producer_tp_size == 0 {
            return Err(err!(Malformed, "payload extension: producer_tp_size is 0"));
        }
        // Versions 3 and 4 give every group its marks; earlier versions none.
        let with_marks = extension.version() >= 3;
        if let Some(group) = extension.groups.iter().find(|g| g.marks.is_some() != with_marks) {
            return Err(err!(
                Malformed,
                "payload extension: group {} {} marks, which an extension of version {} {}",
                group.group_id,
                if group.marks.is_some() { "has" } else { "has no" },
                extension.version(),
                if with_marks { "gives every group" } else { "gives none" }
            ));
        }
        let mut extended = HashSet::with_capacity(extension.groups.len());
        for group in &extension.groups {
            let group_id = group.group_id;
            let Some(plain) = plain_groups.get(&group_id) else {
                return Err(err!(
                    Malformed,
                    "payload extension: group {group_id} is not in the payload"
                ));
            };
            if !extended.insert(group_id) {
                return Err(err!(Malformed, "payload extension: group {group_id} appears twice"));
            }
            if group.block_size == 0 {
                return Err(err!(Malformed, "payload extension: group {group_id} has block_size 0"));
            }
            check_layer_partials(
                &group.layers,
                plain.values.len() as u64,
                &format!("payload extension: group {group_id}"),
            )?;
            check_decodings(&group.decodings, &format!("payload extension: group {group_id}"))?;
            check_geometry(&group.geometry, &format!("payload extension: group {group_id}"))?;
            // A short last value belongs to the position holding the last
            // token, which the group must hold.
            let holds_last = self.num_tokens > 0 && {
                let last = (self.num_tokens - 1) / group.block_size as u64;
                last >= plain.first_position && last - plain.first_position < plain.values.len() as u64
            };
            if group.short_last.is_some() && !holds_last {
                return Err(err!(
                    Malformed,
                    "payload extension: group {group_id} has a short last value but its positions {}..{} (block size {}) do not hold token {} of {} (the last)",
                    plain.first_position,
                    plain.first_position + plain.values.len() as u64,
                    group.block_size,
                    self.num_tokens.saturating_sub(1),
                    self.num_tokens
                ));
            }
        }
        Ok(())
    }

    /// The payload's group `group_id`, if present.
    pub fn group(&self, group_id: u32) -> Option<&PayloadGroup> {
        self.groups.iter().find(|g| g.group_id == group_id)
    }

    /// The algorithm of the values: the extension's, else weighted (a
    /// plain payload is vLLM's, SPEC section 9).
    pub fn algorithm(&self) -> Algorithm {
        self.extension.as_ref().map_or(Algorithm::Weighted, |e| e.algorithm)
    }

    /// What group `group_id`'s fingerprint counts (SPEC section 7), from
    /// the version of the extension that has an entry for it.
    pub fn fingerprint_convention(&self, group_id: u32) -> FingerprintConvention {
        match self.extension_group(group_id) {
            None => FingerprintConvention::Unknown,
            Some(ExtensionGroup { marks: Some(marks), .. }) => FingerprintConvention::Separate { marks: *marks },
            // Version 2 gives every group a coverage, version 1 none.
            Some(ExtensionGroup { coverage: Some(_), .. }) => FingerprintConvention::Marked,
            Some(_) => FingerprintConvention::Unmarked,
        }
    }

    /// The extension's entry of group `group_id`, if any.
    pub fn extension_group(&self, group_id: u32) -> Option<&ExtensionGroup> {
        self.extension.as_ref()?.groups.iter().find(|g| g.group_id == group_id)
    }
}

fn decode_extension(r: &mut Reader<'_>) -> Result<Extension> {
    let at = r.position();
    let len = r.array("the extension")?;
    let at_version = r.position();
    let version = r.uint("extension version")?;
    // Version 1: 3 elements, weighted, groups of 3; version 2: 4, the
    // algorithm last, groups of 4 (the coverage last); version 3: 4,
    // groups of 6 (the marks and decodings after the coverage); version
    // 4: 4, groups of 7 (the short last value); version 5: 4, groups of 8
    // (the geometry last).
    let (expected_len, group_len) = match version {
        1 => (3, 3),
        2 => (4, 4),
        3 => (4, 6),
        4 => (4, 7),
        EXTENSION_VERSION => (4, 8),
        _ => {
            return Err(err!(
                Malformed,
                "payload: byte {at_version}: extension version {version} is not supported (this library reads versions 1 to {EXTENSION_VERSION})"
            ))
        }
    };
    if len != expected_len {
        return Err(err!(
            Malformed,
            "payload: byte {at}: the extension of version {version} has {expected_len} elements, found {len}"
        ));
    }
    let producer_tp_size = r.u32("producer_tp_size")?;
    let num_groups = r.array("extension groups")?;
    let mut groups = Vec::with_capacity(initial_capacity(num_groups));
    for _ in 0..num_groups {
        r.array_of("an extension group", group_len)?;
        let group_id = r.u32("group_id")?;
        let block_size = r.u32("block_size")?;
        let num_layers = r.array("layers")?;
        let mut layers = Vec::with_capacity(initial_capacity(num_layers));
        for _ in 0..num_layers {
            r.array_of("a layer", 4)?;
            layers.push(LayerPartial {
                layer_number: r.u32("layer_number")?,
                first_head: r.u32("first_head")?,
                num_heads: r.u32("num_heads")?,
                replica: FIRST_COPY,
                values: r.u64s("layer values")?,
            });
        }
        let coverage = if version == 1 { None } else { Some(r.uint("coverage")?) };
        let (marks, decodings) = if version >= 3 {
            (Some(r.uint("marks")?), read_decodings(r, "payload")?)
        } else {
            (None, Vec::new())
        };
        let short_last = if version >= 4 {
            let at = r.position();
            match r.u64s("short_last")?[..] {
                [] => None,
                [value] => Some(value),
                ref values => {
                    return Err(err!(
                        Malformed,
                        "payload: byte {at}: group {group_id}'s short_last holds {} values, not at most 1",
                        values.len()
                    ))
                }
            }
        } else {
            None
        };
        let geometry = if version >= 5 { read_geometry(r)? } else { Vec::new() };
        groups.push(ExtensionGroup {
            group_id,
            block_size,
            layers,
            coverage,
            marks,
            decodings,
            short_last,
            geometry,
        });
    }
    let algorithm = if version == 1 {
        Algorithm::Weighted
    } else {
        let at = r.position();
        let code = r.uint("algorithm")?;
        Algorithm::from_code(code).ok_or_else(|| {
            err!(
                Malformed,
                "payload: byte {at}: algorithm {code} is not {KNOWN_ALGORITHMS}"
            )
        })?
    };
    Ok(Extension {
        producer_tp_size,
        groups,
        algorithm,
    })
}

/// `bytes` as standard padded base64 (the `kv_checksums` value).
pub fn encode_base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The bytes of standard padded base64 `text`; `Error::Malformed` for
/// anything else (other alphabets, missing padding, whitespace).
pub fn decode_base64(text: &[u8]) -> Result<Vec<u8>> {
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| err!(Malformed, "base64: {e} (in {} bytes of text)", text.len()))
}
