//! `kvcs_worker`: one TP rank / PP stage's layout and engine.

use std::ffi::{c_char, c_void};

use super::blocks::{blocks_ref, kvcs_blocks};
use super::panic::ffi_boundary;
use super::result::{kvcs_result, result_into_handle};
use super::status::{fail, kvcs_status, KVCS_HOST};
use super::{c_array, c_str, not_null, try_engine, try_mut, try_ref, write_out};
use crate::error::err;
use crate::layout::{LayerSpec, Region, ReplicaKey, Role, Segment};
use crate::worker::{StreamHandle, Worker, WorkerOptions};

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
    /// Host engine threads; 0 = the available cores.
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
    /// Contiguous bytes per (head, token); a positive multiple of 8.
    pub bytes_per_token: u32,
}

/// An attention layer's cache on this worker.
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

/// The worker behind a handle (a `Box<Worker>` made by `kvcs_worker_create`).
fn worker_mut(worker: *mut kvcs_worker) -> *mut Worker {
    worker.cast()
}

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
        unsafe { out.write(Box::into_raw(Box::new(worker)).cast()) };
        kvcs_status::KVCS_OK
    }
}

/// Frees a worker. NULL is a no-op. Results it made stay valid.
#[no_mangle]
pub extern "C" fn kvcs_worker_destroy(worker: *mut kvcs_worker) {
    ffi_boundary! {
        if !worker.is_null() {
            // SAFETY: made by `kvcs_worker_create` and not freed before.
            drop(unsafe { Box::from_raw(worker_mut(worker)) });
        }
    }
}

/// Registers `length` bytes at `address` (host or device memory, as the
/// worker) that the worker may read. The caller keeps them readable, and the
/// bytes being checksummed unchanged during a call, while the worker lives.
/// A device worker checks the range against CUDA: memory CUDA does not know
/// (a plain host pointer) gives `KVCS_ERR_INVALID_ARGUMENT`, a range past
/// the end of its allocation `KVCS_ERR_OUT_OF_BOUNDS`. A host worker cannot
/// check host memory and trusts the caller.
#[no_mangle]
pub extern "C" fn kvcs_worker_add_region(worker: *mut kvcs_worker, address: u64, length: u64) -> kvcs_status {
    ffi_boundary! {
        let worker = try_mut!(worker_mut(worker), "worker");
        try_engine!(worker.add_region(Region { address, length }));
        kvcs_status::KVCS_OK
    }
}

/// Registers group `group_id` with `block_size` tokens per logical block.
#[no_mangle]
pub extern "C" fn kvcs_worker_add_group(worker: *mut kvcs_worker, group_id: u32, block_size: u32) -> kvcs_status {
    ffi_boundary! {
        let worker = try_mut!(worker_mut(worker), "worker");
        try_engine!(worker.add_group(group_id, block_size));
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
        let worker = try_mut!(worker_mut(worker), "worker");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let reason = try_engine!(unsafe { c_str(reason, "reason") });
        try_engine!(worker.skip_group(group_id, reason));
        kvcs_status::KVCS_OK
    }
}

/// Registers an attention layer's cache. Every byte it can reach must lie in
/// one registered region (else `KVCS_ERR_OUT_OF_BOUNDS`); on any error
/// nothing is registered. A device worker uploads the descriptors here.
#[no_mangle]
pub extern "C" fn kvcs_worker_add_layer(worker: *mut kvcs_worker, layer: *const kvcs_layer) -> kvcs_status {
    ffi_boundary! {
        let worker = try_mut!(worker_mut(worker), "worker");
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

/// Computes (host worker) or queues (device worker) the partial checksums of
/// every block in `blocks`, in `role` (a `kvcs_role` value). A device worker
/// queues its work on `cuda_stream` (a `CUstream`; NULL = its own stream) and
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
        let worker = try_mut!(worker_mut(worker), "worker");
        let blocks = try_ref!(blocks_ref(blocks), "blocks");
        not_null!(out, "out");
        let role = match role {
            0 => Role::Producer,
            1 => Role::Consumer,
            r => return fail(&err!(InvalidArgument, "role {r} is neither KVCS_ROLE_PRODUCER (0) nor KVCS_ROLE_CONSUMER (1)")),
        };
        let result = try_engine!(worker.checksum(blocks, role, StreamHandle(cuda_stream)));
        // SAFETY: `out` is non-NULL (checked above) and writable per the contract.
        unsafe { write_out(out, result_into_handle(result)) };
        kvcs_status::KVCS_OK
    }
}

/// Detail mode (`on` = 1; 0 turns it off): the worker's results then also
/// carry per-layer partial checksums, which its records and a producer's
/// payload extension pass on, so that a consumer's report names the layers
/// (and head ranges) that differ. It reads the KV a second time. Host
/// workers only for now (`KVCS_ERR_UNSUPPORTED` on a device worker).
#[no_mangle]
pub extern "C" fn kvcs_worker_set_detail(worker: *mut kvcs_worker, on: u32) -> kvcs_status {
    ffi_boundary! {
        let worker = try_mut!(worker_mut(worker), "worker");
        let on = match on {
            0 => false,
            1 => true,
            v => return fail(&err!(InvalidArgument, "on {v} is neither 0 nor 1")),
        };
        try_engine!(worker.set_detail(on));
        kvcs_status::KVCS_OK
    }
}
