//! `kvcs_payload`: a producer's payload decoded for reading
//! (docs/SPEC.md#9-payload-producer-to-consumer), so that a tool (an
//! operator's inspector, a log parser) reads what a payload says through
//! the library's own decoder instead of parsing msgpack itself.

use std::ffi::{c_char, CString};

use super::buffer::write_items;
use super::handle::{free, handle, into_handle, try_handle};
use super::panic::ffi_boundary;
use super::status::{fail, kvcs_status};
use super::{c_array, not_null, try_engine, write_out};
use crate::base::error::err;
use crate::wire::payload::{ExtensionGroup, Payload, PayloadGroup, PAYLOAD_VERSION};

/// A decoded payload: its groups, values and (when sent) the kvcsum
/// extension.
///
/// Ownership: made by `kvcs_payload_decode`, freed by
/// `kvcs_payload_destroy`. Strings it gives stay valid until it is
/// destroyed.
/// Thread safety: immutable; every accessor may run concurrently.
#[allow(non_camel_case_types)]
pub struct kvcs_payload {
    _private: [u8; 0],
}

/// What a payload says as a whole (`kvcs_payload_info` gives it).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_payload_summary {
    /// Tokens whose KV the checksummed blocks hold.
    pub num_tokens: u64,
    /// Groups in the payload (`kvcs_payload_group`).
    pub num_groups: usize,
    /// The payload version (`KVCS_PAYLOAD_VERSION`).
    pub version: u32,
    /// The version of the kvcsum extension (1 to `KVCS_EXTENSION_VERSION`);
    /// 0 for a plain payload (vLLM's), which has none.
    pub extension_version: u32,
    /// The producer's TP size from the extension; 0 where not sent.
    pub producer_tp_size: u32,
    /// The algorithm of the values (`KVCS_ALGORITHM_*`): the extension's,
    /// `KVCS_ALGORITHM_WEIGHTED` for a plain payload.
    pub algorithm: u32,
}

/// One group of a payload (`kvcs_payload_group` gives it), with what the extension
/// says of it; the extension's fields are 0 where it says nothing.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_group_checksums {
    /// The group.
    pub group_id: u32,
    /// The producer's block size of the group; 0 where not sent.
    pub block_size: u32,
    /// The producer's fingerprint (docs/SPEC.md#7-group-fingerprint).
    pub fingerprint: u64,
    /// The block position of the first value.
    pub first_position: u64,
    /// Values, one per block position (`kvcs_payload_values`).
    pub num_values: usize,
    /// 1 if the extension gives the group's coverage, 0 otherwise.
    pub has_coverage: u32,
    /// 1 if the extension gives the group's marks (extension version 3),
    /// 0 otherwise (the fingerprint's convention then follows the
    /// extension's version: SPEC section 7).
    pub has_marks: u32,
    /// The coverage of the producer's slices (docs/SPEC.md#10-verification).
    pub coverage: u64,
    /// The producer's marks: aliases and shard-keyed state.
    pub marks: u64,
    /// Per-layer partials the extension carries (detail mode;
    /// `kvcs_payload_layer`).
    pub num_layers: usize,
    /// Layer decodings the producer declared (`kvcs_payload_decoding`).
    pub num_decodings: usize,
}

/// One per-layer partial of a payload's extension (`kvcs_payload_layer` gives it):
/// heads `first_head .. first_head + num_heads` of layer `layer_number`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_layer_checksums {
    /// Model-wide layer number.
    pub layer_number: u32,
    /// Global number of the first head.
    pub first_head: u32,
    /// Heads covered.
    pub num_heads: u32,
    /// Values, one per block position of the group
    /// (`kvcs_payload_layer_values`).
    pub num_values: usize,
}

/// How a producer declared it decodes one layer's cache
/// (docs/SPEC.md#7-group-fingerprint, "Decoding"; `kvcs_payload_decoding`).
/// A fact not declared is NULL or 0.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_layer_decoding {
    /// The element type's name; NULL where not declared. Valid until the
    /// payload is destroyed.
    pub dtype: *const c_char,
    /// Model-wide layer number.
    pub layer_number: u32,
    /// Elements of one head's K per token; 0 where not declared.
    pub head_size: u32,
    /// The binary64 bits of K's scale; 0 where not declared.
    pub k_scale_bits: u64,
    /// The binary64 bits of V's scale; 0 where not declared.
    pub v_scale_bits: u64,
}

/// A decoded payload and the C strings it hands out.
pub(crate) struct PayloadHandle {
    payload: Payload,
    /// Per payload group, its extension entry (if any) and each
    /// decoding's element type as a C string.
    extension: Vec<Option<(ExtensionGroup, Vec<Option<CString>>)>>,
}

handle!(kvcs_payload => PayloadHandle);

impl PayloadHandle {
    fn new(payload: Payload) -> PayloadHandle {
        let extension = payload
            .groups
            .iter()
            .map(|group| {
                payload.extension_group(group.group_id).map(|entry| {
                    let names = entry
                        .decodings
                        .iter()
                        .map(|(_, d)| {
                            // Names are a-z, 0-9 and _ (the decoder checked): no NUL.
                            d.dtype
                                .as_deref()
                                .map(|name| CString::new(name).expect("no NUL in a dtype"))
                        })
                        .collect();
                    (entry.clone(), names)
                })
            })
            .collect();
        PayloadHandle { payload, extension }
    }

    fn group(&self, index: usize) -> Result<(&PayloadGroup, Option<&ExtensionGroup>), kvcs_status> {
        let count = self.payload.groups.len();
        match self.payload.groups.get(index) {
            Some(group) => Ok((group, self.extension[index].as_ref().map(|(e, _)| e))),
            None => Err(fail(&err!(
                OutOfBounds,
                "group_index {index} is not below the payload's {count} groups"
            ))),
        }
    }
}

/// Decodes and validates the payload bytes `(bytes, len)` (not base64:
/// `kvcs_base64_decode` turns the text of `kv_checksums` into them), plain
/// or with the kvcsum extension of any version this library reads.
/// `*out` owns the payload (free with `kvcs_payload_destroy`).
/// `KVCS_ERR_MALFORMED`, with a message naming the byte and what is wrong,
/// for anything else (truncated input, wrong types, declared lengths
/// larger than the input, trailing bytes); it allocates at most in
/// proportion to `len`.
#[no_mangle]
pub extern "C" fn kvcs_payload_decode(bytes: *const u8, len: usize, out: *mut *mut kvcs_payload) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: the contract gives `len` readable bytes.
        let bytes = try_engine!(unsafe { c_array(bytes, len, "bytes") });
        not_null!(out, "out");
        let payload = try_engine!(Payload::decode(bytes));
        let handle = into_handle::<kvcs_payload>(PayloadHandle::new(payload));
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(out, handle) };
        kvcs_status::KVCS_OK
    }
}

/// Frees a payload; NULL is a no-op.
#[no_mangle]
pub extern "C" fn kvcs_payload_destroy(payload: *mut kvcs_payload) {
    ffi_boundary! {
        // SAFETY: NULL, or made by `kvcs_payload_decode` and not freed before (the contract).
        unsafe { free(payload) };
    }
}

/// What the payload says as a whole.
#[no_mangle]
pub extern "C" fn kvcs_payload_info(payload: *const kvcs_payload, out: *mut kvcs_payload_summary) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(payload, "payload");
        not_null!(out, "out");
        let payload = &handle.payload;
        let extension = payload.extension.as_ref();
        let info = kvcs_payload_summary {
            num_tokens: payload.num_tokens,
            num_groups: payload.groups.len(),
            version: PAYLOAD_VERSION as u32,
            extension_version: extension.map_or(0, |e| e.version() as u32),
            producer_tp_size: extension.map_or(0, |e| e.producer_tp_size),
            algorithm: payload.algorithm().code(),
        };
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(out, info) };
        kvcs_status::KVCS_OK
    }
}

/// Group `group_index` (below `num_groups`, in the producer's order), with
/// what the extension says of it. `KVCS_ERR_OUT_OF_BOUNDS` past the last.
#[no_mangle]
pub extern "C" fn kvcs_payload_group(
    payload: *const kvcs_payload,
    group_index: usize,
    out: *mut kvcs_group_checksums,
) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(payload, "payload");
        not_null!(out, "out");
        let (group, extension) = match handle.group(group_index) {
            Ok(found) => found,
            Err(status) => return status,
        };
        let entry = kvcs_group_checksums {
            group_id: group.group_id,
            block_size: extension.map_or(0, |e| e.block_size),
            fingerprint: group.fingerprint,
            first_position: group.first_position,
            num_values: group.values.len(),
            has_coverage: extension.is_some_and(|e| e.coverage.is_some()) as u32,
            has_marks: extension.is_some_and(|e| e.marks.is_some()) as u32,
            coverage: extension.and_then(|e| e.coverage).unwrap_or(0),
            marks: extension.and_then(|e| e.marks).unwrap_or(0),
            num_layers: extension.map_or(0, |e| e.layers.len()),
            num_decodings: extension.map_or(0, |e| e.decodings.len()),
        };
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(out, entry) };
        kvcs_status::KVCS_OK
    }
}

/// The values of group `group_index`, one per block position from its
/// first position, into `(values, cap)`; `*len` their count. `(NULL, 0)`
/// asks for the count; a smaller `cap` gives `KVCS_ERR_BUFFER_TOO_SMALL`.
#[no_mangle]
pub extern "C" fn kvcs_payload_values(
    payload: *const kvcs_payload,
    group_index: usize,
    values: *mut u64,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(payload, "payload");
        let (group, _) = match handle.group(group_index) {
            Ok(found) => found,
            Err(status) => return status,
        };
        // SAFETY: `values` has `cap` writable elements and `len` is writable per the contract.
        unsafe { write_items(&group.values, values, cap, len, "values") }
    }
}

/// The short last value of group `group_index` (extension version 4): the
/// value of the group's position holding the request's last token, over
/// `num_tokens - 1` tokens, which the verifier compares against a load of
/// one token fewer (docs/SPEC.md#10-verification). Into `(values, cap)` as
/// `kvcs_payload_values` gives a group's values: `*len` is 1 where the
/// producer sent one, 0 where it did not (a plain payload, an extension
/// before version 4, a group that does not hold the last token).
#[no_mangle]
pub extern "C" fn kvcs_payload_short_last(
    payload: *const kvcs_payload,
    group_index: usize,
    values: *mut u64,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(payload, "payload");
        let (_, extension) = match handle.group(group_index) {
            Ok(found) => found,
            Err(status) => return status,
        };
        let short_last: Vec<u64> = extension.and_then(|e| e.short_last).into_iter().collect();
        // SAFETY: `values` has `cap` writable elements and `len` is writable per the contract.
        unsafe { write_items(&short_last, values, cap, len, "values") }
    }
}

/// Per-layer partial `layer_index` (below the group's `num_layers`) of
/// group `group_index`. `KVCS_ERR_OUT_OF_BOUNDS` for an index past the last.
#[no_mangle]
pub extern "C" fn kvcs_payload_layer(
    payload: *const kvcs_payload,
    group_index: usize,
    layer_index: usize,
    out: *mut kvcs_layer_checksums,
) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(payload, "payload");
        not_null!(out, "out");
        let layer = match layer_of(handle, group_index, layer_index) {
            Ok(layer) => layer,
            Err(status) => return status,
        };
        let entry = kvcs_layer_checksums {
            layer_number: layer.layer_number,
            first_head: layer.first_head,
            num_heads: layer.num_heads,
            num_values: layer.values.len(),
        };
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(out, entry) };
        kvcs_status::KVCS_OK
    }
}

/// The values of per-layer partial `layer_index` of group `group_index`,
/// as `kvcs_payload_values` gives a group's.
#[no_mangle]
pub extern "C" fn kvcs_payload_layer_values(
    payload: *const kvcs_payload,
    group_index: usize,
    layer_index: usize,
    values: *mut u64,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(payload, "payload");
        let layer = match layer_of(handle, group_index, layer_index) {
            Ok(layer) => layer,
            Err(status) => return status,
        };
        // SAFETY: `values` has `cap` writable elements and `len` is writable per the contract.
        unsafe { write_items(&layer.values, values, cap, len, "values") }
    }
}

/// Layer decoding `index` (below the group's `num_decodings`, sorted by
/// layer number) of group `group_index`: what the producer declared about
/// reading that layer's bytes. Its `dtype` stays valid until the payload
/// is destroyed. `KVCS_ERR_OUT_OF_BOUNDS` for an index past the last.
#[no_mangle]
pub extern "C" fn kvcs_payload_decoding(
    payload: *const kvcs_payload,
    group_index: usize,
    index: usize,
    out: *mut kvcs_layer_decoding,
) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(payload, "payload");
        not_null!(out, "out");
        if let Err(status) = handle.group(group_index) {
            return status;
        }
        let (decodings, names) = match &handle.extension[group_index] {
            Some((entry, names)) => (&entry.decodings[..], &names[..]),
            None => (&[][..], &[][..]),
        };
        let Some((layer_number, decoding)) = decodings.get(index) else {
            return fail(&err!(
                OutOfBounds,
                "index {index} is not below the {} decodings of group_index {group_index}",
                decodings.len()
            ));
        };
        let (_, head_size, k_scale_bits, v_scale_bits) = decoding.parts();
        let entry = kvcs_layer_decoding {
            dtype: names[index].as_ref().map_or(std::ptr::null(), |name| name.as_ptr()),
            layer_number: *layer_number,
            head_size,
            k_scale_bits,
            v_scale_bits,
        };
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(out, entry) };
        kvcs_status::KVCS_OK
    }
}

/// Layer partial `layer_index` of group `group_index`, or the status of
/// an index past the last.
fn layer_of(
    handle: &PayloadHandle,
    group_index: usize,
    layer_index: usize,
) -> Result<&crate::wire::payload::LayerPartial, kvcs_status> {
    let (_, extension) = handle.group(group_index)?;
    let layers = extension.map_or(&[][..], |e| &e.layers[..]);
    layers.get(layer_index).ok_or_else(|| {
        fail(&err!(
            OutOfBounds,
            "layer_index {layer_index} is not below the {} layers of group_index {group_index}",
            layers.len()
        ))
    })
}
