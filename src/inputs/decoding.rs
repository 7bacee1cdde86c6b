//! How an engine reads a layer's KV bytes back as numbers (SPEC section 7,
//! "Decoding"): the cache's element type, the head size and the scales K
//! and V are stored with. Two engines can hold the same bytes and read them
//! differently (fp8 read with another scale, bf16 bytes read as fp8); their
//! checksums then match although the KV they compute with differs. An
//! engine declares these facts per layer, records and the payload extension
//! carry them, and a verifier that finds a fact declared on both sides with
//! different values reports the load unverified, naming the layer, the fact
//! and both values.
//!
//! Every fact is optional: a fact one side does not declare is not
//! compared (the absence of a claim, as from an engine of an older release
//! or vLLM's own, is no difference).

use crate::base::error::{err, Result};

/// The longest element type name, in bytes.
pub const MAX_DTYPE_LEN: usize = 32;

/// What one engine declared about how it decodes one layer's cache; `None`
/// where it declared nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerDecoding {
    /// The cache's element type (SPEC section 7 names them: `bfloat16`,
    /// `fp8_e4m3`, ...): 1 to [`MAX_DTYPE_LEN`] bytes of `a-z`, `0-9` and
    /// `_`, starting with a letter.
    pub dtype: Option<String>,
    /// Elements of one head's K per token (vLLM's `head_size`).
    pub head_size: Option<u32>,
    /// The IEEE-754 binary64 bits of the scale K is stored with (a finite
    /// positive number), compared bit for bit.
    pub k_scale: Option<u64>,
    /// The same for V.
    pub v_scale: Option<u64>,
}

/// A fact declared on two sides with different values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// The fact: `dtype`, `head_size`, `k_scale` or `v_scale`.
    pub field: &'static str,
    /// The first side's value, written for a message.
    pub first: String,
    /// The second side's value, written for a message.
    pub second: String,
}

impl LayerDecoding {
    /// A declaration from its wire form, where `""` and `0` mean "not
    /// declared" (records, the payload extension and the C call use it).
    /// `InvalidArgument` naming the field and value for a bad name, a
    /// scale that is not a finite positive number, or a declaration of
    /// nothing at all.
    pub fn from_parts(dtype: &str, head_size: u32, k_scale_bits: u64, v_scale_bits: u64) -> Result<LayerDecoding> {
        let dtype = if dtype.is_empty() {
            None
        } else {
            check_dtype(dtype)?;
            Some(dtype.to_owned())
        };
        let decoding = LayerDecoding {
            dtype,
            head_size: (head_size != 0).then_some(head_size),
            k_scale: scale(k_scale_bits, "k_scale")?,
            v_scale: scale(v_scale_bits, "v_scale")?,
        };
        if decoding == LayerDecoding::default() {
            return Err(err!(
                InvalidArgument,
                "the declaration declares nothing (no dtype, head_size 0, no k_scale, no v_scale)"
            ));
        }
        Ok(decoding)
    }

    /// The wire form: `(dtype or "", head_size or 0, k_scale bits or 0,
    /// v_scale bits or 0)`.
    pub fn parts(&self) -> (&str, u32, u64, u64) {
        (
            self.dtype.as_deref().unwrap_or(""),
            self.head_size.unwrap_or(0),
            self.k_scale.unwrap_or(0),
            self.v_scale.unwrap_or(0),
        )
    }

    /// The first fact both `self` and `other` declare with different
    /// values (in the order dtype, head size, K scale, V scale), if any;
    /// `first` is `self`'s value.
    pub fn first_difference(&self, other: &LayerDecoding) -> Option<Difference> {
        fn differ<T: PartialEq + Copy>(a: Option<T>, b: Option<T>) -> Option<(T, T)> {
            match (a, b) {
                (Some(a), Some(b)) if a != b => Some((a, b)),
                _ => None,
            }
        }
        if let Some((a, b)) = differ(self.dtype.as_deref(), other.dtype.as_deref()) {
            return Some(Difference {
                field: "dtype",
                first: format!("{a:?}"),
                second: format!("{b:?}"),
            });
        }
        if let Some((a, b)) = differ(self.head_size, other.head_size) {
            return Some(Difference {
                field: "head_size",
                first: a.to_string(),
                second: b.to_string(),
            });
        }
        for (field, a, b) in [
            ("k_scale", self.k_scale, other.k_scale),
            ("v_scale", self.v_scale, other.v_scale),
        ] {
            if let Some((a, b)) = differ(a, b) {
                return Some(Difference {
                    field,
                    first: scale_text(a),
                    second: scale_text(b),
                });
            }
        }
        None
    }

    /// What two declarations of the same layer by one side (two of its
    /// workers) say together: each fact either declares. A fact both
    /// declare differently is the [`Difference`].
    pub fn merge(&self, other: &LayerDecoding) -> std::result::Result<LayerDecoding, Difference> {
        if let Some(difference) = self.first_difference(other) {
            return Err(difference);
        }
        Ok(LayerDecoding {
            dtype: self.dtype.clone().or_else(|| other.dtype.clone()),
            head_size: self.head_size.or(other.head_size),
            k_scale: self.k_scale.or(other.k_scale),
            v_scale: self.v_scale.or(other.v_scale),
        })
    }
}

/// The geometry of one registered cache of a layer (SPEC section 7,
/// "Geometry"), which every registration already tells and records, the
/// payload extension and stored stamps carry without a call: the global
/// heads `first_head .. first_head + num_heads` it holds, the bytes of one
/// cell (one head's K then V of one token) and, where K and V are
/// registered as two segments, the bytes of K (0: not known, one segment).
/// Two engines wired by hand with another head size or element width hold
/// cells of other sizes: a difference of configuration, never corrupt data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LayerGeometry {
    /// Model-wide layer number.
    pub layer_number: u32,
    /// The first global head of the run.
    pub first_head: u32,
    /// Heads in the run, at least 1.
    pub num_heads: u32,
    /// Bytes of one cell: a head's K then V of one token (whole pieces,
    /// SPEC section 1: a multiple of 8, or of 4 and not of 8).
    pub cell_bytes: u32,
    /// Bytes of K in a cell where K and V are two segments; 0 where not
    /// known (one segment: the split is not registered).
    pub k_bytes: u32,
}

/// A geometry fact two sides (or two workers of one side) hold differently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeometryDifference {
    /// The layer.
    pub layer_number: u32,
    /// The fact: `heads` (the layer's heads, one past its last global
    /// head), `cell_bytes` or `k_bytes`.
    pub field: &'static str,
    /// The heads the fact is about, `first .. end` (all of the layer's for
    /// `heads`).
    pub heads: (u32, u32),
    /// The first side's value.
    pub first: u32,
    /// The second side's value.
    pub second: u32,
}

impl LayerGeometry {
    /// One past the run's last head.
    pub fn end(&self) -> u64 {
        self.first_head as u64 + self.num_heads as u64
    }

    /// The first fact of heads both runs hold that differs (cell bytes,
    /// then K bytes where both know them), if any.
    fn difference(&self, other: &LayerGeometry) -> Option<GeometryDifference> {
        let first = self.first_head.max(other.first_head);
        let end = self.end().min(other.end());
        if first as u64 >= end {
            return None;
        }
        let (field, a, b) = if self.cell_bytes != other.cell_bytes {
            ("cell_bytes", self.cell_bytes, other.cell_bytes)
        } else if self.k_bytes != 0 && other.k_bytes != 0 && self.k_bytes != other.k_bytes {
            ("k_bytes", self.k_bytes, other.k_bytes)
        } else {
            return None;
        };
        Some(GeometryDifference {
            layer_number: self.layer_number,
            field,
            heads: (first, end as u32),
            first: a,
            second: b,
        })
    }
}

/// The runs of several workers of one side as one list: sorted by (layer,
/// first head), overlapping or adjacent runs of the same cell and K bytes
/// joined (replicas hold the same heads), a K split one worker knows taken
/// where another does not. Two workers' runs of common heads with other
/// cell or K bytes are the [`GeometryDifference`] (first: the run held
/// earlier in layer order). Work is `n log n` in the runs given.
pub fn merge_geometry(
    runs: impl IntoIterator<Item = LayerGeometry>,
) -> std::result::Result<Vec<LayerGeometry>, GeometryDifference> {
    let mut runs: Vec<LayerGeometry> = runs.into_iter().collect();
    runs.sort_unstable();
    let mut merged: Vec<LayerGeometry> = Vec::with_capacity(runs.len());
    for run in runs {
        if let Some(last) = merged.last_mut() {
            if last.layer_number == run.layer_number && run.first_head as u64 <= last.end() {
                if let Some(difference) = last.difference(&run) {
                    return Err(difference);
                }
                let same = last.cell_bytes == run.cell_bytes
                    && (last.k_bytes == run.k_bytes || run.k_bytes == 0 || last.k_bytes == 0);
                if same {
                    let end = last.end().max(run.end());
                    last.num_heads = (end - last.first_head as u64) as u32;
                    last.k_bytes = last.k_bytes.max(run.k_bytes);
                    continue;
                }
            }
        }
        merged.push(run);
    }
    Ok(merged)
}

/// The first difference between two sides' merged runs ([`merge_geometry`])
/// of the layers both hold: the layer's heads (one past its last global
/// head), then the cell and K bytes of heads both hold. Layers one side
/// does not hold are not compared (their fingerprints differ). Linear in
/// the runs.
pub fn first_geometry_difference(first: &[LayerGeometry], second: &[LayerGeometry]) -> Option<GeometryDifference> {
    let layers = |runs: &[LayerGeometry]| {
        let mut ends: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
        for run in runs {
            let end = ends.entry(run.layer_number).or_insert(0);
            *end = (*end).max(run.end());
        }
        ends
    };
    let (ends_a, ends_b) = (layers(first), layers(second));
    for (layer_number, &a) in &ends_a {
        if let Some(&b) = ends_b.get(layer_number) {
            if a != b {
                return Some(GeometryDifference {
                    layer_number: *layer_number,
                    field: "heads",
                    heads: (0, a.max(b) as u32),
                    first: a as u32,
                    second: b as u32,
                });
            }
        }
    }
    // Both lists are sorted by (layer, first head): walk them together.
    let (mut i, mut j) = (0, 0);
    while i < first.len() && j < second.len() {
        let (a, b) = (&first[i], &second[j]);
        if let Some(difference) = (a.layer_number == b.layer_number).then(|| a.difference(b)).flatten() {
            return Some(difference);
        }
        if (a.layer_number, a.end()) <= (b.layer_number, b.end()) {
            i += 1;
        } else {
            j += 1;
        }
    }
    None
}

/// A scale's value and bits, as messages write it: `0.0125 (bits
/// 0x3f89999999999998)`.
pub fn scale_text(bits: u64) -> String {
    format!("{:?} (bits {bits:#018x})", f64::from_bits(bits))
}

fn check_dtype(dtype: &str) -> Result<()> {
    let bytes = dtype.as_bytes();
    let allowed = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_';
    if bytes.len() > MAX_DTYPE_LEN || !bytes[0].is_ascii_lowercase() || !bytes.iter().all(allowed) {
        let shown: String = dtype.chars().take(MAX_DTYPE_LEN + 8).collect();
        return Err(err!(
            InvalidArgument,
            "dtype {shown:?} is not an element type name (1 to {MAX_DTYPE_LEN} bytes of a-z, 0-9 and _, starting with a letter, such as \"bfloat16\" or \"fp8_e4m3\")"
        ));
    }
    Ok(())
}

/// `Some(bits)` of a declared scale (a finite positive binary64), `None`
/// for 0 (not declared).
fn scale(bits: u64, field: &str) -> Result<Option<u64>> {
    if bits == 0 {
        return Ok(None);
    }
    let value = f64::from_bits(bits);
    if !(value.is_finite() && value > 0.0) {
        return Err(err!(
            InvalidArgument,
            "{field} {} is not a finite positive number (0 bits: not declared)",
            scale_text(bits)
        ));
    }
    Ok(Some(bits))
}

#[cfg(test)]
mod tests;
