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

use crate::error::{err, Result};

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
mod tests {
    use super::*;

    #[test]
    fn undeclared_facts_are_not_compared_and_declared_ones_are() {
        let a = LayerDecoding::from_parts("fp8_e4m3", 0, 0.5f64.to_bits(), 0).unwrap();
        let b = LayerDecoding::from_parts("", 128, 0.5f64.to_bits(), 0.25f64.to_bits()).unwrap();
        assert_eq!(a.first_difference(&b), None);
        let merged = a.merge(&b).unwrap();
        assert_eq!(merged.parts(), ("fp8_e4m3", 128, 0.5f64.to_bits(), 0.25f64.to_bits()));
        let c = LayerDecoding::from_parts("fp8_e4m3", 0, 0.25f64.to_bits(), 0).unwrap();
        let difference = a.first_difference(&c).unwrap();
        assert_eq!(difference.field, "k_scale");
        assert!(difference.first.starts_with("0.5 "), "{difference:?}");
        assert!(difference.second.starts_with("0.25 "), "{difference:?}");
        let d = LayerDecoding::from_parts("bfloat16", 0, 0, 0).unwrap();
        assert_eq!(a.first_difference(&d).unwrap().field, "dtype");
    }

    #[test]
    fn bad_declarations_name_the_field_and_value() {
        let nan = LayerDecoding::from_parts("fp8_e4m3", 0, f64::NAN.to_bits(), 0).unwrap_err();
        assert!(nan.to_string().contains("k_scale NaN"), "{nan}");
        let negative = LayerDecoding::from_parts("", 0, 0, (-1.0f64).to_bits()).unwrap_err();
        assert!(negative.to_string().contains("v_scale -1.0"), "{negative}");
        for name in [
            "FP8",
            "8bit",
            "fp8-e4m3",
            "torch.float8",
            &"a".repeat(MAX_DTYPE_LEN + 1),
        ] {
            let error = LayerDecoding::from_parts(name, 0, 0, 0).unwrap_err();
            assert!(
                error.to_string().contains("is not an element type name"),
                "{name}: {error}"
            );
        }
        assert!(LayerDecoding::from_parts(&"a".repeat(MAX_DTYPE_LEN), 0, 0, 0).is_ok());
        let nothing = LayerDecoding::from_parts("", 0, 0, 0).unwrap_err();
        assert!(nothing.to_string().contains("declares nothing"), "{nothing}");
    }
}
