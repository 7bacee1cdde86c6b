//! `kvcs_layer_from_layout`: a `kvcs_layer` from strided tensors and a
//! layout string such as "KBTHD" (docs/SPEC.md#14-layout-strings).

use std::ffi::c_char;

use super::panic::ffi_boundary;
use super::status::kvcs_status;
use super::worker::{kvcs_layer, kvcs_segment};
use super::{c_array, c_str, not_null, try_engine, try_ref};
use crate::base::error::Result;
use crate::inputs::layout_string::{layer_from_layout, TensorView};

/// A strided tensor (a PyTorch tensor, a DLPack `DLTensor`, a numpy array)
/// as `kvcs_layer_from_layout` reads it: sizes and strides, outermost
/// dimension first. Strides are in bytes (a PyTorch or DLPack stride times
/// the element size). The caller owns the arrays; the call only reads them.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_tensor {
    /// Address of the element whose every index is 0 (host or device memory;
    /// never read here).
    pub address: u64,
    /// `ndim` sizes, each at least 0.
    pub shape: *const i64,
    /// `ndim` strides in bytes, any sign.
    pub strides: *const i64,
    /// Dimensions: as many as the layout string has letters.
    pub ndim: usize,
    /// Bytes per element (2 for fp16/bf16, 1 for fp8).
    pub element_size: u32,
}

/// `tensor`'s arrays (named `name` in errors).
///
/// # Safety
/// `tensor.shape` and `tensor.strides` are NULL or point to `tensor.ndim`
/// readable values that outlive the view.
unsafe fn view<'a>(tensor: &'a kvcs_tensor, name: &str) -> Result<TensorView<'a>> {
    Ok(TensorView {
        address: tensor.address,
        // SAFETY: the caller's contract.
        shape: unsafe { c_array(tensor.shape, tensor.ndim, &format!("{name}.shape"))? },
        // SAFETY: the caller's contract.
        strides: unsafe { c_array(tensor.strides, tensor.ndim, &format!("{name}.strides"))? },
        element_size: tensor.element_size,
    })
}

/// Describes one attention layer's cache from its tensor and a layout
/// string (docs/SPEC.md#14-layout-strings), as Python's `kvcsum.layer()`
/// does, so that a FlashAttention or FlashInfer tensor maps to segments
/// without working out strides by hand.
///
/// `layout` names the dimensions of `cache`, outermost first, one letter
/// each (case-insensitive): `B` blocks, `T` tokens of a block, `H` heads
/// (left out for a cache with one head, such as MLA's), `D` the contiguous
/// elements of one head's cell for one token, and optionally `K` (size 2:
/// K then V, which become two segments). "NHD" means "BTHD", "HND" means
/// "BHTD". Examples: FlashAttention `[2, blocks, 16, heads, 128]` is
/// "KBTHD"; FlashInfer HND `[blocks, 2, heads, 16, 128]` is "BKHTD"; an
/// MLA cache `[blocks, 64, 576]` is "BTD". Where K and V live in two
/// tensors of the same layout (without `K`), give V's as `v`; else `v` is
/// NULL. With `kernel_blocks` > 1, B counts kernel blocks, that many
/// consecutive ones making one logical block.
///
/// On `KVCS_OK` writes every field of `*layer_out`: the geometry
/// (`num_heads`, `num_blocks`, `kernel_blocks`, `tokens_per_kernel_block`,
/// `num_segments`, `segments` = `segments_out`) and, for the fields that
/// say which layer this is, defaults the caller overwrites as needed before
/// `kvcs_worker_add_layer`: `group_id` 0, `layer_number` 0, `first_head` 0,
/// `replicas` 1, `replica_index` 0, `identity` (NULL, 0). It writes
/// `num_segments` (1 or 2) segments to `segments_out`, which has room for 2
/// and must outlive the use of `*layer_out`; each segment's
/// `bytes_per_token` is the bytes of its own part of the cell (D times
/// `element_size`), not of K and V together.
///
/// `KVCS_ERR_INVALID_ARGUMENT`, naming the argument and value: a layout
/// with an unknown or repeated letter or without B, T or D; a tensor whose
/// `ndim` differs from the layout's letters; a size below 0;
/// `element_size` 0; D not contiguous (stride other than `element_size`
/// where it has more than one element); K of a size other than 2; both a
/// K letter and `v`; `kernel_blocks` 0 or not dividing B; `v` differing
/// from `cache` in B, T or H; a field that does not fit its type; a view
/// whose distinct cells share bytes (a stride of 0 over a dimension of size
/// above 1, as torch's `expand()` and numpy's `broadcast_to` make, K of
/// stride 0, tokens closer than a cell, `v` over the cache: the rule of
/// `kvcs_worker_add_layer`). Nothing is read at `address`;
/// `kvcs_worker_add_layer` checks the rest (alignment, bytes per token a
/// whole number of the cell's pieces, 8 or 4 bytes: SPEC section 1,
/// registered regions).
#[no_mangle]
pub extern "C" fn kvcs_layer_from_layout(
    layout: *const c_char,
    cache: *const kvcs_tensor,
    v: *const kvcs_tensor,
    kernel_blocks: u32,
    layer_out: *mut kvcs_layer,
    segments_out: *mut kvcs_segment,
) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let layout = try_engine!(unsafe { c_str(layout, "layout") });
        let cache = try_ref!(cache, "cache");
        // SAFETY: NULL, or a live kvcs_tensor per the contract.
        let v = unsafe { v.as_ref() };
        not_null!(layer_out, "layer_out");
        not_null!(segments_out, "segments_out");
        // SAFETY: the contract gives `ndim` readable sizes and strides.
        let cache_view = try_engine!(unsafe { view(cache, "cache") });
        let v_view = match v {
            // SAFETY: as for `cache`.
            Some(v) => Some(try_engine!(unsafe { view(v, "v") })),
            None => None,
        };
        let geometry = try_engine!(layer_from_layout(layout, &cache_view, v_view.as_ref(), kernel_blocks));
        for (i, s) in geometry.segments.iter().enumerate() {
            let segment = kvcs_segment {
                address: s.address,
                block_stride: s.block_stride,
                kernel_block_stride: s.kernel_block_stride,
                head_stride: s.head_stride,
                token_stride: s.token_stride,
                bytes_per_token: s.bytes_per_token,
            };
            // SAFETY: non-NULL (checked) with room for 2 segments per the
            // contract; a geometry has 1 or 2.
            unsafe { segments_out.add(i).write(segment) };
        }
        let layer = kvcs_layer {
            group_id: 0,
            layer_number: 0,
            first_head: 0,
            num_heads: geometry.num_heads,
            replicas: 1,
            replica_index: 0,
            num_blocks: geometry.num_blocks,
            kernel_blocks: geometry.kernel_blocks,
            tokens_per_kernel_block: geometry.tokens_per_kernel_block,
            num_segments: geometry.segments.len() as u32,
            segments: segments_out,
            identity: std::ptr::null(),
            identity_len: 0,
        };
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { layer_out.write(layer) };
        kvcs_status::KVCS_OK
    }
}
