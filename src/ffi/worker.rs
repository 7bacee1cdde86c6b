//! `kvcs_worker`: one TP rank / PP stage's layout and engine.

use std::ffi::{c_char, c_void};

use super::blocks::kvcs_blocks;
use super::c_enum::c_enum;
use super::constants::KVCS_HOST;
use super::handle::{free, handle, into_handle, try_handle, try_handle_mut};
use super::panic::ffi_boundary;
use super::result::kvcs_result;
use super::status::{fail, kvcs_status};
use super::{c_array, c_str, not_null, try_engine, try_ref, write_out};
use crate::base::checksum::Algorithm;
use crate::base::error::err;
use crate::inputs::blocks::BlockSet;
use crate::inputs::decoding::LayerDecoding;
use crate::inputs::layout::{Alias, LayerSpec, Region, ReplicaKey, Segment};
use crate::inputs::placement::GroupPlacement;
use crate::inputs::state::{StateSpec, StateTensor, MAX_STATE_TENSORS};
use crate::inputs::stream::StreamHandle;
use crate::results::checksums::Checksums;
use crate::worker::{Worker, WorkerOptions};

/// A worker context: the layout one TP rank / PP stage registered and the
/// engine (host threads or one CUDA device) that checksums it.
///
/// Ownership: created by `kvcs_worker_create`, freed by
/// `kvcs_worker_destroy`; results it made stay valid after it is destroyed.
/// Thread safety: calls taking `kvcs_worker *` need exclusive access; it may
/// move between threads.
#[allow(non_camel_case_types)]
pub struct kvcs_worker {
    _private: [u8; 0],
}

/// Options of `kvcs_worker_create`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_worker_options {
    /// This worker's tensor-parallel rank, below `tp_size`.
    pub tp_rank: u32,
    /// Tensor-parallel size, at least 1.
    pub tp_size: u32,
    /// Pipeline-parallel stage.
    pub pp_rank: u32,
    /// CUDA device ordinal, or `KVCS_HOST` for caches in host memory.
    pub device: i32,
    /// Host engine threads per call, 1 to `KVCS_MAX_HOST_THREADS` (ignored
    /// by device workers). 0 picks a default that leaves room for the other
    /// rank processes on the host: the value of the environment variable
    /// `KVCS_HOST_THREADS` when it is set (a bad value fails creation with
    /// `KVCS_ERR_INVALID_ARGUMENT`), else the cores this process may run on
    /// (its CPU affinity and quota) divided by 8, between 1 and 4. The
    /// worker starts its helper threads (one fewer than this; the calling
    /// thread works too) on its first call large enough to split (4 MiB of
    /// KV per thread), keeps them parked between calls and joins them in
    /// `kvcs_worker_destroy`. A host worker mixes (MIXED2, MIXED) with the
    /// best SIMD form the CPU has (AVX-512F, AVX2); the environment
    /// variable `KVCS_HOST_SIMD` (`avx512`, `avx2`, `portable`) caps it, for
    /// measurements, and another value fails creation with
    /// `KVCS_ERR_INVALID_ARGUMENT`. Every form gives the same values.
    pub num_threads: u32,
}

/// One region of a cache; strides in bytes (negative allowed). Addresses and
/// strides must be multiples of 8.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_segment {
    /// Address of block 0, kernel block 0, head 0, token 0.
    pub address: u64,
    /// Between logical blocks.
    pub block_stride: i64,
    /// Between kernel blocks of a logical block.
    pub kernel_block_stride: i64,
    /// Between heads.
    pub head_stride: i64,
    /// Between tokens of a kernel block.
    pub token_stride: i64,
    /// Contiguous bytes per (head, token) in this segment; a positive
    /// multiple of 8 (of 4 where the cell, every segment's bytes together,
    /// is a multiple of 4 and not of 8: 4-byte pieces, SPEC section 1;
    /// addresses and strides then need 4-byte alignment only). Per segment: where K and V are two segments, each
    /// says its own part's bytes (K's head size times the element size,
    /// say), not those of K and V together.
    pub bytes_per_token: u32,
}

/// An attention layer's cache on this worker (`kvcs_layer_from_layout`
/// fills one from a tensor and a layout string such as "KBTHD").
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_layer {
    /// A group registered with `kvcs_worker_add_group`.
    pub group_id: u32,
    /// Model-wide layer number.
    pub layer_number: u32,
    /// Global number of the first head held here.
    pub first_head: u32,
    /// Heads held here; `first_head + num_heads <= 65536`.
    pub num_heads: u32,
    /// Ranks holding the same heads; 1 = none.
    pub replicas: u32,
    /// In `[0, replicas)`.
    pub replica_index: u32,
    /// Logical blocks in the cache.
    pub num_blocks: u32,
    /// Kernel blocks per logical block.
    pub kernel_blocks: u32,
    /// Tokens per kernel block; `kernel_blocks * tokens_per_kernel_block`
    /// equals the group's block size.
    pub tokens_per_kernel_block: u32,
    /// 1 = cell in one region; 2 = K region then V region.
    pub num_segments: u32,
    /// `num_segments` segments.
    pub segments: *const kvcs_segment,
    /// Bytes hashed into the group fingerprint; may be `(NULL, 0)`.
    pub identity: *const u8,
    /// Length of `identity`.
    pub identity_len: usize,
}

handle!(kvcs_worker => Worker);

/// Creates a worker. A device worker uses the device's primary context;
/// where no CUDA driver or NVRTC is present it fails with `KVCS_ERR_DEVICE`.
/// On success `*out` owns the worker (free with `kvcs_worker_destroy`).
#[no_mangle]
pub extern "C" fn kvcs_worker_create(options: *const kvcs_worker_options, out: *mut *mut kvcs_worker) -> kvcs_status {
    ffi_boundary! {
        let options = try_ref!(options, "options");
        not_null!(out, "out");
        let device = match options.device {
            KVCS_HOST => None,
            d if d >= 0 => Some(d as u32),
            d => return fail(&err!(InvalidArgument, "options.device {d} is neither KVCS_HOST (-1) nor a device ordinal")),
        };
        let worker = try_engine!(Worker::new(WorkerOptions {
            tp_rank: options.tp_rank,
            tp_size: options.tp_size,
            pp_rank: options.pp_rank,
            device,
            num_threads: options.num_threads,
        }));
        // SAFETY: `out` is non-NULL (checked above) and writable per the contract.
        unsafe { out.write(into_handle(worker)) };
        kvcs_status::KVCS_OK
    }
}

/// Frees a worker. NULL is a no-op. Results it made stay valid.
#[no_mangle]
pub extern "C" fn kvcs_worker_destroy(worker: *mut kvcs_worker) {
    ffi_boundary! {
        // SAFETY: NULL, or made by `kvcs_worker_create` and not freed before (the contract).
        unsafe { free(worker) };
    }
}

/// Registers `length` bytes at `address` (host or device memory, as the
/// worker) that the worker may read. The caller keeps them readable, and the
/// bytes being checksummed unchanged during a call, while the worker lives.
/// `address` 0 (NULL), `length` 0, or a range running past the end of the
/// address space give `KVCS_ERR_INVALID_ARGUMENT`. A device worker checks
/// the range against CUDA: memory CUDA does not know (a plain host pointer)
/// gives `KVCS_ERR_INVALID_ARGUMENT`, a range past the end of its
/// allocation `KVCS_ERR_OUT_OF_BOUNDS`. A host worker checks that every page
/// of the range is mapped in the process (`mincore`, one call per 16 MiB of
/// 4 KiB pages; nothing is read): an unmapped first page (address 8, memory
/// already freed) gives `KVCS_ERR_INVALID_ARGUMENT`, a range running past a
/// mapping `KVCS_ERR_OUT_OF_BOUNDS` naming the first unmapped page. It
/// also checks the mappings' permissions (`/proc/self/maps`, read once a
/// call): a range starting in memory mapped without read permission
/// (`PROT_NONE`: a guard page, a reservation, CUDA device memory, which
/// unified addressing reserves so in the host process) gives
/// `KVCS_ERR_INVALID_ARGUMENT`, one running into such memory
/// `KVCS_ERR_OUT_OF_BOUNDS`. Without procfs that check is skipped; either
/// way the caller keeps the memory mapped and readable while the worker
/// lives. Reading the process's mappings is most of a host region's cost:
/// about 1.3 ms a call in a Python process with torch loaded (550
/// mappings) on a 2-core VM, once per region at registration.
#[no_mangle]
pub extern "C" fn kvcs_worker_add_region(worker: *mut kvcs_worker, address: u64, length: u64) -> kvcs_status {
    ffi_boundary! {
        let worker = try_handle_mut!(worker, "worker");
        try_engine!(worker.add_region(Region { address, length }));
        kvcs_status::KVCS_OK
    }
}

/// Registers group `group_id` with `block_size` tokens per logical block.
#[no_mangle]
pub extern "C" fn kvcs_worker_add_group(worker: *mut kvcs_worker, group_id: u32, block_size: u32) -> kvcs_status {
    ffi_boundary! {
        let worker = try_handle_mut!(worker, "worker");
        try_engine!(worker.add_group(group_id, block_size));
        kvcs_status::KVCS_OK
    }
}

/// Where a group's tokens sit in this worker's caches
/// (docs/SPEC.md#16-token-placement): vLLM's decode context parallelism,
/// which spreads each scheduler block's tokens over `dcp_size` ranks, and
/// compressed states, where one cache slot summarises `tokens_per_slot`
/// consecutive tokens. `KVCS_GROUP_PLACEMENT_INIT` is the default (every
/// token here, one slot per token): `{1, 0, 1, 1}`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_group_placement {
    /// Ranks the group's tokens are spread over (vLLM's DCP size), 1 to
    /// 65536; 1 = no DCP.
    pub dcp_size: u32,
    /// This worker's DCP rank, below `dcp_size`.
    pub dcp_rank: u32,
    /// Consecutive slots one rank holds before the next rank's (vLLM's
    /// `cp_kv_cache_interleave_size`); it divides the local block.
    pub interleave: u32,
    /// Tokens one slot summarises (vLLM's `tokens_per_state`); 1 = a slot
    /// per token. It divides the group's block size.
    pub tokens_per_slot: u32,
}

/// Sets where group `group_id`'s tokens sit in this worker's caches
/// (docs/SPEC.md#16-token-placement). Call it after
/// `kvcs_worker_add_group` and before any layer, alias or state layer of
/// the group: its layers then tile the local slots of a block,
/// `kernel_blocks * tokens_per_kernel_block = block_size / tokens_per_slot
/// / dcp_size` (the group's `block_size` stays the scheduler's, `B =
/// local_block_size * dcp_size` tokens). A call again before any layer
/// replaces the placement; once the group holds a layer it fails with
/// `KVCS_ERR_INVALID_ARGUMENT`, and so does a state group's layer added to
/// a group with a placement. `KVCS_ERR_NOT_FOUND` for a group not
/// registered; `KVCS_ERR_INVALID_ARGUMENT`, naming the field and value,
/// for `dcp_size` 0 or above 65536, `dcp_rank >= dcp_size`, `interleave`
/// or `tokens_per_slot` 0, a block size that `tokens_per_slot` does not
/// divide, slots per block that `dcp_size` does not divide, and a local
/// block that `interleave` does not divide. On any error nothing changes.
/// Records carry the placement, so the worker's verifier knows which DCP
/// shard each worker's columns cover (docs/SPEC.md#16-token-placement).
#[no_mangle]
pub extern "C" fn kvcs_worker_set_group_placement(
    worker: *mut kvcs_worker,
    group_id: u32,
    placement: *const kvcs_group_placement,
) -> kvcs_status {
    ffi_boundary! {
        let worker = try_handle_mut!(worker, "worker");
        let placement = try_ref!(placement, "placement");
        let placement = GroupPlacement {
            dcp_size: placement.dcp_size,
            dcp_rank: placement.dcp_rank,
            interleave: placement.interleave,
            tokens_per_slot: placement.tokens_per_slot,
        };
        try_engine!(worker.set_group_placement(group_id, placement));
        kvcs_status::KVCS_OK
    }
}

/// Declares that this worker cannot checksum group `group_id`, for `reason`
/// (a non-empty string). The group is then never computed and results list
/// it as skipped (docs/SPEC.md#7-group-fingerprint).
#[no_mangle]
pub extern "C" fn kvcs_worker_skip_group(
    worker: *mut kvcs_worker,
    group_id: u32,
    reason: *const c_char,
) -> kvcs_status {
    ffi_boundary! {
        let worker = try_handle_mut!(worker, "worker");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let reason = try_engine!(unsafe { c_str(reason, "reason") });
        try_engine!(worker.skip_group(group_id, reason));
        kvcs_status::KVCS_OK
    }
}

/// Registers an attention layer's cache. Every byte it can reach must lie in
/// one registered region (else `KVCS_ERR_OUT_OF_BOUNDS`). Distinct cells
/// must not share a byte (docs/SPEC.md#14-layout-strings; else
/// `KVCS_ERR_INVALID_ARGUMENT`): within a segment, its dimensions of size
/// above 1 sorted by |stride| each step at least the bytes those below it
/// span (no stride of 0 over several heads, tokens or blocks); two segments
/// (K, V) reach disjoint bytes, or share strides with V beside K's cell or a
/// whole step away. On any error nothing is registered. A device worker
/// uploads the descriptors here.
#[no_mangle]
pub extern "C" fn kvcs_worker_add_layer(worker: *mut kvcs_worker, layer: *const kvcs_layer) -> kvcs_status {
    ffi_boundary! {
        let worker = try_handle_mut!(worker, "worker");
        let layer = try_ref!(layer, "layer");
        if !(1..=2).contains(&layer.num_segments) {
            return fail(&err!(InvalidArgument, "layer.num_segments is {}, not 1 or 2", layer.num_segments));
        }
        // SAFETY: the contract gives `num_segments` readable segments.
        let segments = try_engine!(unsafe { c_array(layer.segments, layer.num_segments as usize, "layer.segments") });
        // SAFETY: the contract gives `identity_len` readable bytes.
        let identity = try_engine!(unsafe { c_array(layer.identity, layer.identity_len, "layer.identity") });
        let spec = LayerSpec {
            group_id: layer.group_id,
            layer_number: layer.layer_number,
            first_head: layer.first_head,
            num_heads: layer.num_heads,
            replica: ReplicaKey { replicas: layer.replicas, replica_index: layer.replica_index },
            num_blocks: layer.num_blocks,
            kernel_blocks: layer.kernel_blocks,
            tokens_per_kernel_block: layer.tokens_per_kernel_block,
            segments: segments
                .iter()
                .map(|s| Segment {
                    address: s.address,
                    block_stride: s.block_stride,
                    kernel_block_stride: s.kernel_block_stride,
                    head_stride: s.head_stride,
                    token_stride: s.token_stride,
                    bytes_per_token: s.bytes_per_token,
                })
                .collect(),
            identity: identity.to_vec(),
        };
        try_engine!(worker.add_layer(spec));
        kvcs_status::KVCS_OK
    }
}

/// One state tensor of a state layer (docs/SPEC.md#6-state-mamba-groups) as this worker holds
/// it; strides in bytes (negative allowed), addresses and strides multiples
/// of `element_size`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_state_tensor {
    /// Address of block (state slot) 0, row 0 (the first row held here).
    pub address: u64,
    /// Between blocks.
    pub block_stride: i64,
    /// Between rows held here.
    pub row_stride: i64,
    /// Global index, among the tensor's rows across TP, of the first row
    /// held here (when the split is known).
    pub first_row: u32,
    /// Rows held here, at least 1.
    pub num_rows: u32,
    /// The tensor's rows across all TP ranks (when the split is known); the
    /// next tensor's rows are numbered after them.
    pub total_rows: u32,
    /// Bytes of one row: a positive multiple of `element_size`.
    pub bytes_per_row: u32,
    /// 2 or 4: elements are read as unsigned little-endian integers.
    pub element_size: u32,
}

/// A state (Mamba) layer on this worker: its tensors (conv, then ssm, say),
/// whose rows are numbered consecutively in this order.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_state {
    /// A group registered with `kvcs_worker_add_group` that holds no
    /// attention layers.
    pub group_id: u32,
    /// Model-wide layer number.
    pub layer_number: u32,
    /// 1: each global row along the TP split is a slice, its head number the
    /// row's global index. 0: the split is unknown; the worker's shard of
    /// the layer is one slice with head number `tp_rank`, comparable only
    /// between equal TP sizes. All state layers of a group agree.
    pub split_known: u32,
    /// Blocks (state slots) in the tensors.
    pub num_blocks: u32,
    /// Tensors, 1 to 16.
    pub num_tensors: u32,
    /// `num_tensors` tensors.
    pub tensors: *const kvcs_state_tensor,
    /// Hashed into the group fingerprint, as `kvcs_layer.identity`.
    pub identity: *const u8,
    /// Bytes of `identity`.
    pub identity_len: usize,
}

/// Registers a state layer (docs/SPEC.md#6-state-mamba-groups). A request's state is one block
/// at position 0 of its state group (`kvcs_blocks_add_group` with
/// `first_position` 0 and one block id); `num_tokens` does not limit it.
/// Every byte a tensor can reach must lie in one registered region (else
/// `KVCS_ERR_OUT_OF_BOUNDS`); a group holds attention layers or state
/// layers, never both. A device worker uploads the state descriptors here
/// and reads the state on the device, with the host worker's values. On any
/// error nothing is registered.
#[no_mangle]
pub extern "C" fn kvcs_worker_add_state(worker: *mut kvcs_worker, state: *const kvcs_state) -> kvcs_status {
    ffi_boundary! {
        let worker = try_handle_mut!(worker, "worker");
        let state = try_ref!(state, "state");
        try_engine!(super::flag_arg(state.split_known, "state.split_known"));
        if state.num_tensors as usize > MAX_STATE_TENSORS || state.num_tensors == 0 {
            return fail(&err!(InvalidArgument, "state.num_tensors is {}, not 1 to {MAX_STATE_TENSORS}", state.num_tensors));
        }
        // SAFETY: the contract gives `num_tensors` readable tensors.
        let tensors = try_engine!(unsafe { c_array(state.tensors, state.num_tensors as usize, "state.tensors") });
        // SAFETY: the contract gives `identity_len` readable bytes.
        let identity = try_engine!(unsafe { c_array(state.identity, state.identity_len, "state.identity") });
        let spec = StateSpec {
            group_id: state.group_id,
            layer_number: state.layer_number,
            split_known: state.split_known == 1,
            num_blocks: state.num_blocks,
            tensors: tensors
                .iter()
                .map(|t| StateTensor {
                    address: t.address,
                    block_stride: t.block_stride,
                    row_stride: t.row_stride,
                    first_row: t.first_row,
                    num_rows: t.num_rows,
                    total_rows: t.total_rows,
                    bytes_per_row: t.bytes_per_row,
                    element_size: t.element_size,
                })
                .collect(),
            identity: identity.to_vec(),
        };
        try_engine!(worker.add_state(spec));
        kvcs_status::KVCS_OK
    }
}

/// Registers layer `layer_number` of group `group_id` as one that reads the
/// cache of the registered layer `target_layer_number` of the same group
/// (vLLM's KV sharing) instead of a cache of its own. Its `identity`
/// (`identity_len` bytes, as for `kvcs_layer.identity`) counts in the group
/// fingerprint, so that the fingerprint names every layer of the group as
/// vLLM's does; it adds no checksum, since the shared cache is checksummed
/// once, as its target's. Register it after its target, on every worker
/// that registers the target. `KVCS_ERR_NOT_FOUND` when the group or the
/// target is not registered; `KVCS_ERR_INVALID_ARGUMENT` when
/// `layer_number` is already registered (as a layer or an alias) or names
/// itself. On any error nothing is registered.
#[no_mangle]
pub extern "C" fn kvcs_worker_add_alias(
    worker: *mut kvcs_worker,
    group_id: u32,
    layer_number: u32,
    target_layer_number: u32,
    identity: *const u8,
    identity_len: usize,
) -> kvcs_status {
    ffi_boundary! {
        let worker = try_handle_mut!(worker, "worker");
        // SAFETY: the contract gives `identity_len` readable bytes.
        let identity = try_engine!(unsafe { c_array(identity, identity_len, "identity") });
        let alias = Alias { layer_number, target_layer_number, identity: identity.to_vec() };
        try_engine!(worker.add_alias(group_id, alias));
        kvcs_status::KVCS_OK
    }
}

/// Declares how the engine reads the cache of layer `layer_number` of group
/// `group_id` back as numbers (docs/SPEC.md#7-group-fingerprint, "Decoding"),
/// so that a load whose two sides read the same bytes differently is
/// `KVCS_UNVERIFIED_DECODING_DIFFERS`, never a match. Each fact is optional;
/// a fact either side leaves undeclared is not compared:
///
/// - `dtype`: the cache's element type, a NUL-terminated name of 1 to
///   `KVCS_MAX_DTYPE_LEN` bytes of `a-z`, `0-9` and `_` starting with a
///   letter, as SPEC section 7 names them (`"bfloat16"`, `"float16"`,
///   `"float32"`, `"fp8_e4m3"`, `"fp8_e5m2"`, ...); NULL: not declared;
/// - `head_size`: the elements of one head's K per token; 0: not declared;
/// - `k_scale_bits`, `v_scale_bits`: the IEEE-754 binary64 bits of the
///   scale K (V) is stored with, a finite positive number (an fp8 cache's
///   `k_scale`; a binary32 scale converts exactly), compared bit for bit;
///   0: not declared.
///
/// The layer must be registered in the group (layer, alias or state layer)
/// on this worker. A later call for the same layer replaces the
/// declaration (scales an engine computes at run time): records made from
/// then on carry it. `KVCS_ERR_NOT_FOUND` for a group or layer not
/// registered; `KVCS_ERR_INVALID_ARGUMENT` for a bad name (an empty one
/// included), a scale that is NaN, infinite, zero-signed or negative, or a
/// call that declares nothing. On any error nothing changes.
#[no_mangle]
pub extern "C" fn kvcs_worker_set_layer_decoding(
    worker: *mut kvcs_worker,
    group_id: u32,
    layer_number: u32,
    dtype: *const c_char,
    head_size: u32,
    k_scale_bits: u64,
    v_scale_bits: u64,
) -> kvcs_status {
    ffi_boundary! {
        let worker = try_handle_mut!(worker, "worker");
        let dtype = if dtype.is_null() {
            ""
        } else {
            // SAFETY: non-NULL; the contract says a NUL-terminated string.
            let name = try_engine!(unsafe { c_str(dtype, "dtype") });
            if name.is_empty() {
                return fail(&err!(
                    InvalidArgument,
                    "dtype is empty (pass NULL to leave it undeclared; layer_number {layer_number}, group_id {group_id})"
                ));
            }
            name
        };
        let decoding = try_engine!(LayerDecoding::from_parts(dtype, head_size, k_scale_bits, v_scale_bits)
            .map_err(|e| e.with_context(&format!("layer_number {layer_number} of group_id {group_id}"))));
        try_engine!(worker.set_layer_decoding(group_id, layer_number, decoding));
        kvcs_status::KVCS_OK
    }
}

/// Which columns a `kvcs_worker_checksum` computes (docs/SPEC.md#4-partial-checksums-replicas-roles).
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvcs_role {
    /// Only columns with `replica_index == 0`.
    KVCS_ROLE_PRODUCER = 0,
    /// Every column.
    KVCS_ROLE_CONSUMER = 1,
}

c_enum!(kvcs_role {
    KVCS_ROLE_PRODUCER,
    KVCS_ROLE_CONSUMER
});

/// The `role` argument (`KVCS_ROLE_*`).
pub(super) fn role_arg(role: u32) -> crate::base::error::Result<crate::inputs::role::Role> {
    use crate::inputs::role::Role;
    Ok(match kvcs_role::from_arg(role, "role")? {
        kvcs_role::KVCS_ROLE_PRODUCER => Role::Producer,
        kvcs_role::KVCS_ROLE_CONSUMER => Role::Consumer,
    })
}

/// Computes (host worker) or queues (device worker) the partial checksums of
/// every block in `blocks`, in `role` (a `kvcs_role` value). A device worker
/// queues its work on `cuda_stream`, a `CUstream` that NULL names as it does
/// to CUDA: the legacy default stream, so the work runs after everything
/// already queued there (PyTorch's default stream passes 0); a per-thread
/// default stream (`CU_STREAM_PER_THREAD`) is passed through as well. It
/// never blocks the host; read the values once `kvcs_result_query` says
/// ready. Any block id at or past its cache's `num_blocks` fails the call
/// with `KVCS_ERR_OUT_OF_BOUNDS` and nothing is computed. On success `*out`
/// owns the result (free with `kvcs_result_destroy`).
#[no_mangle]
pub extern "C" fn kvcs_worker_checksum(
    worker: *mut kvcs_worker,
    blocks: *const kvcs_blocks,
    role: u32,
    cuda_stream: *mut c_void,
    out: *mut *mut kvcs_result,
) -> kvcs_status {
    ffi_boundary! {
        let role = try_engine!(role_arg(role));
        // SAFETY: the caller's contract for these arguments.
        unsafe { call_into_result(worker, blocks, out, |w, b| w.checksum(b, role, StreamHandle(cuda_stream))) }
    }
}

/// Registers the buffer of stored checksums of group `group_id` (SPEC
/// section 8): `KVCS_BLOCK_CHECKSUM_BYTES` (16) bytes per block id,
/// `num_blocks` of them at `address` (not 0, a multiple of 8), memory the
/// worker writes (`kvcs_worker_store`) and reads
/// (`kvcs_worker_check_stored`) while it lives; the caller keeps it so and
/// copies each block's 16 bytes with the block when offloading. A later
/// call replaces the buffer. The buffer must not overlap any registered
/// cache (layer or state tensor) nor another group's buffer
/// (`KVCS_ERR_INVALID_ARGUMENT`; a store would overwrite them), and layers
/// registered later must not overlap it either. On a host worker it must
/// lie in a registered region (`KVCS_ERR_OUT_OF_BOUNDS` otherwise); on a
/// device worker it must be device memory of the worker's device or pinned
/// host memory (`KVCS_ERR_INVALID_ARGUMENT` otherwise,
/// `KVCS_ERR_OUT_OF_BOUNDS` when it runs past mapped memory, or past the
/// end of the cudaMalloc allocation it starts in). On error nothing
/// changes.
#[no_mangle]
pub extern "C" fn kvcs_worker_add_stored(
    worker: *mut kvcs_worker,
    group_id: u32,
    address: u64,
    num_blocks: u64,
) -> kvcs_status {
    ffi_boundary! {
        let worker = try_handle_mut!(worker, "worker");
        try_engine!(worker.add_stored(group_id, address, num_blocks));
        kvcs_status::KVCS_OK
    }
}

/// Checksums `blocks` (every column, as `KVCS_ROLE_CONSUMER`) and writes,
/// for each block holding a valid token, its entry into its group's buffer
/// (docs/SPEC.md#8-stored-checksums-for-offloaded-kv): the value `sum XOR
/// tag`, `tag` binding it to the block hash given with
/// `kvcs_blocks_set_hashes` and to the group, then the stamp naming the
/// worker's configuration, algorithm and the block's valid tokens, with a
/// check binding both words to the block hash (so that a damaged entry
/// fails rather than reading as another configuration).
/// Every group of `blocks` that the worker does not skip needs a buffer and
/// block hashes, every block id must be inside the buffer, and a block id
/// that stands at several places of the call must stand at the same
/// position with the same block hash and valid tokens (a buffer holds one
/// value per block id; `KVCS_ERR_INVALID_ARGUMENT` otherwise): checked
/// before anything is computed or written. `*out` gets the checksums, as
/// `kvcs_worker_checksum` gives them. A device worker queues the writes on
/// `cuda_stream` after the checksums and returns without waiting: they are
/// done when the result is ready (or the stream is synchronised).
#[no_mangle]
pub extern "C" fn kvcs_worker_store(
    worker: *mut kvcs_worker,
    blocks: *const kvcs_blocks,
    cuda_stream: *mut c_void,
    out: *mut *mut kvcs_result,
) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: the caller's contract for these arguments.
        unsafe { call_into_result(worker, blocks, out, |w, b| w.store(b, StreamHandle(cuda_stream))) }
    }
}

/// The body of a call that runs `call` on a worker and a block set and hands
/// its result to C through `*out`: NULL handles and a NULL `out` are
/// `KVCS_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `worker` and `blocks` are NULL or live handles of their types, `out` is
/// NULL or writable (the C contract of the calls that use it).
unsafe fn call_into_result(
    worker: *mut kvcs_worker,
    blocks: *const kvcs_blocks,
    out: *mut *mut kvcs_result,
    call: impl FnOnce(&Worker, &BlockSet) -> crate::base::error::Result<Checksums>,
) -> kvcs_status {
    let worker = try_handle_mut!(worker, "worker");
    let blocks = try_handle!(blocks, "blocks");
    not_null!(out, "out");
    let result = try_engine!(call(worker, blocks));
    // SAFETY: `out` is non-NULL (checked above) and writable per the contract.
    unsafe { write_out(out, into_handle(result)) };
    kvcs_status::KVCS_OK
}

/// The load check of docs/SPEC.md#8-stored-checksums-for-offloaded-kv: checksums the loaded `blocks` (every
/// column) and reads back their stored checksums (with the block hashes of
/// `kvcs_blocks_set_hashes`); `kvcs_result_stored` on `*out` then says, per
/// block position, whether they match. Same requirements as
/// `kvcs_worker_store`. A device worker reads the stored values on
/// `cuda_stream` with the checksums: `kvcs_result_stored` answers
/// `KVCS_ERR_NOT_READY` until the result is ready.
#[no_mangle]
pub extern "C" fn kvcs_worker_check_stored(
    worker: *mut kvcs_worker,
    blocks: *const kvcs_blocks,
    cuda_stream: *mut c_void,
    out: *mut *mut kvcs_result,
) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: the caller's contract for these arguments.
        unsafe { call_into_result(worker, blocks, out, |w, b| w.check_stored(b, StreamHandle(cuda_stream))) }
    }
}

/// The tags of docs/SPEC.md#8-stored-checksums-for-offloaded-kv for `n` blocks of group `group_id`, for
/// connectors that keep stored checksums themselves: `tags[i] =
/// LE_u64(hash_i[0..8]) XOR` the worker's fingerprint of the group, for the
/// `n` hashes of `hash_bytes` bytes (at least 8) at `hashes`. Store `sum XOR
/// tag`, where `sum` adds a block's columns in a `kvcs_worker_checksum`
/// result (as `KVCS_ROLE_CONSUMER`). The value alone cannot tell a
/// configuration change (other layers, heads, block size, algorithm) or a
/// partial block from corruption: `kvcs_result_entries` gives the whole
/// entry, value and stamp, and `kvcs_result_check_entries` judges it.
#[no_mangle]
pub extern "C" fn kvcs_block_tags(
    worker: *const kvcs_worker,
    group_id: u32,
    hashes: *const u8,
    hash_bytes: usize,
    n: usize,
    tags: *mut u64,
) -> kvcs_status {
    ffi_boundary! {
        let worker = try_handle!(worker, "worker");
        if hash_bytes < 8 {
            return fail(&err!(InvalidArgument, "hash_bytes is {hash_bytes}; a block hash has at least 8 bytes"));
        }
        let Some(total) = n.checked_mul(hash_bytes) else {
            return fail(&err!(InvalidArgument, "n {n} x hash_bytes {hash_bytes} overflows"));
        };
        // SAFETY: the contract gives `n * hash_bytes` readable bytes.
        let hashes = try_engine!(unsafe { c_array(hashes, total, "hashes") });
        if tags.is_null() && n > 0 {
            return fail(&err!(InvalidArgument, "tags is NULL for {n} blocks"));
        }
        let firsts: Vec<u64> = hashes
            .chunks_exact(hash_bytes)
            .map(|hash| u64::from_le_bytes(hash[..8].try_into().expect("8 bytes")))
            .collect();
        let values = try_engine!(worker.block_tags(group_id, &firsts));
        // SAFETY: the contract gives `n` writable values; n > 0 means non-NULL (checked).
        unsafe {
            if n > 0 {
                std::ptr::copy_nonoverlapping(values.as_ptr(), tags, n);
            }
        }
        kvcs_status::KVCS_OK
    }
}

/// Detail mode (`on` = 1; 0 turns it off): the worker's results then also
/// carry per-layer partial checksums, which its records and a producer's
/// payload extension pass on, so that a consumer's report names the layers
/// (and head ranges) that differ. It reads the KV a second time: a device
/// worker queues one more launch on the same stream, and its result is
/// ready once both are done. State layers have no per-layer partials.
/// Registration stays linear in detail mode: the per-layer layout is built
/// at the first checksum after the layout last changed, so that call (not
/// `kvcs_worker_add_layer`) reports its errors, such as a device's.
#[no_mangle]
pub extern "C" fn kvcs_worker_set_detail(worker: *mut kvcs_worker, on: u32) -> kvcs_status {
    ffi_boundary! {
        let worker = try_handle_mut!(worker, "worker");
        let on = try_engine!(super::flag_arg(on, "on"));
        try_engine!(worker.set_detail(on));
        kvcs_status::KVCS_OK
    }
}

/// Which function each piece passes through before it is weighted
/// (docs/SPEC.md#12-the-mixed-algorithm); `kvcs_worker_set_algorithm` takes these values. Values are
/// fixed and never renumbered.
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvcs_algorithm {
    /// SPEC sections 2-3 as first defined (each piece as it is): the values
    /// vLLM computes, in a payload vLLM reads. It misses every flip of bit
    /// 63 in an even number of pieces of a block, and swaps of values that
    /// differ only in their high bits (docs/SPEC.md#13-what-it-detects).
    KVCS_ALGORITHM_WEIGHTED = 1,
    /// Each piece mixed by kvcsum 0.2's bijection first
    /// (docs/SPEC.md#12-the-mixing-functions), the default of kvcsum 0.2:
    /// kept so that a worker can verify against a 0.2 peer. It has a fixed
    /// differential, so some structured faults (sign flips of fp32 values,
    /// an inverted bit-31 line) can cancel (docs/SPEC.md#13-what-it-detects).
    KVCS_ALGORITHM_MIXED = 2,
    /// Each piece mixed by a fixed bijection without a fixed differential
    /// first (docs/SPEC.md#12-the-mixing-functions): every property of the
    /// definition holds and no fault class of the catalogue goes unseen.
    /// The default of new workers.
    KVCS_ALGORITHM_MIXED2 = 3,
}

c_enum!(kvcs_algorithm {
    KVCS_ALGORITHM_WEIGHTED,
    KVCS_ALGORITHM_MIXED,
    KVCS_ALGORITHM_MIXED2
});

/// Chooses the worker's checksum algorithm (a `kvcs_algorithm` value:
/// `KVCS_ALGORITHM_MIXED2`, the default, `KVCS_ALGORITHM_MIXED` or
/// `KVCS_ALGORITHM_WEIGHTED`) for
/// every value it computes: checksums, detail mode's partials, state groups
/// and stored checksums. Its records carry it, and a producer's payload
/// carries it in the kvcsum extension (sent whenever the algorithm is not
/// `KVCS_ALGORITHM_WEIGHTED`, since a plain vLLM payload means weighted); a
/// verifier reports workers or a payload of another algorithm as unverified
/// (`KVCS_UNVERIFIED_ALGORITHM_DIFFERS`), never as a mismatch. Set it before
/// the worker's first `kvcs_worker_checksum`, `kvcs_worker_store` or
/// `kvcs_worker_check_stored`: after one it is `KVCS_ERR_INVALID_ARGUMENT`
/// and nothing changes. Another value is `KVCS_ERR_INVALID_ARGUMENT` naming
/// it. Stored checksums record it in their stamp: a load check under
/// another algorithm than the store's reads `KVCS_STORED_OTHER_ALGORITHM`
/// at each position, and the verifier calls the load unverified.
#[no_mangle]
pub extern "C" fn kvcs_worker_set_algorithm(worker: *mut kvcs_worker, algorithm: u32) -> kvcs_status {
    ffi_boundary! {
        let worker = try_handle_mut!(worker, "worker");
        let algorithm = match try_engine!(kvcs_algorithm::from_arg(algorithm, "algorithm")) {
            kvcs_algorithm::KVCS_ALGORITHM_WEIGHTED => Algorithm::Weighted,
            kvcs_algorithm::KVCS_ALGORITHM_MIXED => Algorithm::Mixed,
            kvcs_algorithm::KVCS_ALGORITHM_MIXED2 => Algorithm::Mixed2,
        };
        try_engine!(worker.set_algorithm(algorithm));
        kvcs_status::KVCS_OK
    }
}
