//! Workers (`kvcs_worker`): [`CWorker`], a host worker registered as a C
//! engine would; [`HostWorker`], one over random KV it owns, for hand-made
//! layers; the C form of a layer spec; and [`StoredMemory`], host memory
//! for stored checksums.

use std::ffi::CString;
use std::ops::Deref;
use std::ptr::{null, null_mut};

use kvcsum::ffi::constants::{KVCS_BLOCK_CHECKSUM_BYTES, KVCS_HOST};
use kvcsum::ffi::status::kvcs_status;
use kvcsum::ffi::worker::*;
use kvcsum::{LayerSpec, StateSpec};

use super::{check, CBlocks, CResult, Failure};
use crate::support::{Placement, Rng};

/// The options of a host worker of TP rank 0 of 1, PP rank 0, one thread.
pub fn host_options() -> kvcs_worker_options {
    kvcs_worker_options {
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        device: KVCS_HOST,
        num_threads: 1,
    }
}

/// The C form of `spec`'s segments.
pub fn c_segments(spec: &LayerSpec) -> Vec<kvcs_segment> {
    spec.segments
        .iter()
        .map(|s| kvcs_segment {
            address: s.address,
            block_stride: s.block_stride,
            kernel_block_stride: s.kernel_block_stride,
            head_stride: s.head_stride,
            token_stride: s.token_stride,
            bytes_per_token: s.bytes_per_token,
        })
        .collect()
}

/// The C form of a layer spec, borrowing its segments and identity.
pub fn c_layer(spec: &LayerSpec, segments: &[kvcs_segment]) -> kvcs_layer {
    kvcs_layer {
        group_id: spec.group_id,
        layer_number: spec.layer_number,
        first_head: spec.first_head,
        num_heads: spec.num_heads,
        replicas: spec.replica.replicas,
        replica_index: spec.replica.replica_index,
        num_blocks: spec.num_blocks,
        kernel_blocks: spec.kernel_blocks,
        tokens_per_kernel_block: spec.tokens_per_kernel_block,
        num_segments: segments.len() as u32,
        segments: segments.as_ptr(),
        identity: if spec.identity.is_empty() {
            null()
        } else {
            spec.identity.as_ptr()
        },
        identity_len: spec.identity.len(),
    }
}

// ---------------------------------------------------------------------------
// Workers

/// A worker handle.
pub struct CWorker {
    pub handle: *mut kvcs_worker,
}

impl Drop for CWorker {
    fn drop(&mut self) {
        kvcs_worker_destroy(self.handle);
    }
}

std::thread_local! {
    /// The algorithm new workers of this thread get (0: the library's default).
    static ALGORITHM: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Sets the algorithm of the workers this thread creates from now on (a
/// test's own thread).
pub fn set_thread_algorithm(algorithm: u32) {
    ALGORITHM.with(|a| a.set(algorithm));
}

/// Runs `f` with the workers it creates on this thread set to `algorithm`
/// (`KVCS_ALGORITHM_WEIGHTED` for vLLM's plain payloads: a MIXED producer
/// always sends the extension).
pub fn with_algorithm<T>(algorithm: u32, f: impl FnOnce() -> T) -> T {
    let before = ALGORITHM.with(|a| a.replace(algorithm));
    let out = f();
    ALGORITHM.with(|a| a.set(before));
    out
}

impl CWorker {
    /// A host worker of one thread (of the algorithm [`with_algorithm`] set).
    pub fn host(tp_rank: u32, tp_size: u32, pp_rank: u32) -> Result<CWorker, Failure> {
        let options = kvcs_worker_options {
            tp_rank,
            tp_size,
            pp_rank,
            ..host_options()
        };
        let mut handle = null_mut();
        check(kvcs_worker_create(&options, &mut handle))?;
        let worker = CWorker { handle };
        let algorithm = ALGORITHM.with(|a| a.get());
        if algorithm != 0 {
            worker.set_algorithm(algorithm)?;
        }
        Ok(worker)
    }

    pub fn set_algorithm(&self, algorithm: u32) -> Result<(), Failure> {
        check(kvcs_worker_set_algorithm(self.handle, algorithm))
    }

    pub fn region(&self, address: u64, length: u64) -> Result<(), Failure> {
        check(kvcs_worker_add_region(self.handle, address, length))
    }

    pub fn group(&self, group_id: u32, block_size: u32) -> Result<(), Failure> {
        check(kvcs_worker_add_group(self.handle, group_id, block_size))
    }

    pub fn skip(&self, group_id: u32, reason: &str) -> Result<(), Failure> {
        let reason = CString::new(reason).expect("no NUL");
        check(kvcs_worker_skip_group(self.handle, group_id, reason.as_ptr()))
    }

    /// `kvcs_worker_add_layer` of `spec`.
    pub fn layer(&self, spec: &LayerSpec) -> Result<(), Failure> {
        let segments = c_segments(spec);
        let layer = c_layer(spec, &segments);
        check(kvcs_worker_add_layer(self.handle, &layer))
    }

    pub fn alias(&self, group_id: u32, layer_number: u32, target: u32, identity: &[u8]) -> Result<(), Failure> {
        check(kvcs_worker_add_alias(
            self.handle,
            group_id,
            layer_number,
            target,
            identity.as_ptr(),
            identity.len(),
        ))
    }

    /// `kvcs_worker_add_state` of `spec`.
    pub fn state(&self, spec: &StateSpec) -> Result<(), Failure> {
        let tensors: Vec<kvcs_state_tensor> = spec
            .tensors
            .iter()
            .map(|t| kvcs_state_tensor {
                address: t.address,
                block_stride: t.block_stride,
                row_stride: t.row_stride,
                first_row: t.first_row,
                num_rows: t.num_rows,
                total_rows: t.total_rows,
                bytes_per_row: t.bytes_per_row,
                element_size: t.element_size,
            })
            .collect();
        let state = kvcs_state {
            group_id: spec.group_id,
            layer_number: spec.layer_number,
            split_known: spec.split_known as u32,
            num_blocks: spec.num_blocks,
            num_tensors: tensors.len() as u32,
            tensors: tensors.as_ptr(),
            identity: spec.identity.as_ptr(),
            identity_len: spec.identity.len(),
        };
        check(kvcs_worker_add_state(self.handle, &state))
    }

    pub fn stored(&self, group_id: u32, address: u64, num_blocks: u64) -> Result<(), Failure> {
        check(kvcs_worker_add_stored(self.handle, group_id, address, num_blocks))
    }

    pub fn detail(&self, on: bool) -> Result<(), Failure> {
        check(kvcs_worker_set_detail(self.handle, on as u32))
    }

    /// Registers a region per buffer of `placement` and its layers (with the
    /// identities `identity(layer_number)`); the group must be registered.
    pub fn placement(&self, placement: &Placement, identity: &dyn Fn(u32) -> Vec<u8>) -> Result<(), Failure> {
        for region in placement.regions(&placement.host_bases()) {
            self.region(region.address, region.length)?;
        }
        for mut spec in placement.host_layer_specs() {
            spec.identity = identity(spec.layer_number);
            self.layer(&spec)?;
        }
        Ok(())
    }

    pub fn checksum(&self, blocks: &CBlocks, role: u32) -> Result<CResult, Failure> {
        let mut out = null_mut();
        check(kvcs_worker_checksum(self.handle, blocks.0, role, null_mut(), &mut out))?;
        Ok(CResult(out))
    }

    /// The record of a checksum call, which must succeed, or the status and
    /// message of `kvcs_result_encode`.
    pub fn record(&self, blocks: &CBlocks, role: u32) -> Result<Vec<u8>, Failure> {
        self.checksum(blocks, role).expect("kvcs_worker_checksum").encode()
    }

    pub fn store(&self, blocks: &CBlocks) -> Result<CResult, Failure> {
        let mut out = null_mut();
        check(kvcs_worker_store(self.handle, blocks.0, null_mut(), &mut out))?;
        Ok(CResult(out))
    }

    pub fn check_stored(&self, blocks: &CBlocks) -> Result<CResult, Failure> {
        let mut out = null_mut();
        check(kvcs_worker_check_stored(self.handle, blocks.0, null_mut(), &mut out))?;
        Ok(CResult(out))
    }
}

// ---------------------------------------------------------------------------
// A host worker on random KV: one head per layer, NHD, K and V in one
// 16-byte cell per token

/// A TP=1 host worker (WEIGHTED) whose one region is random KV it owns;
/// layers are placed in it by slot. It derefs to its [`CWorker`].
pub struct HostWorker {
    /// Declared first, so that the worker is destroyed before its memory.
    pub worker: CWorker,
    pub cache: Vec<u64>,
}

impl Deref for HostWorker {
    type Target = CWorker;

    fn deref(&self) -> &CWorker {
        &self.worker
    }
}

/// The bytes of one token's cell (K and V of its one head).
pub const CELL: u64 = 16;

impl HostWorker {
    /// A TP=1 host worker whose region holds `num_layers` caches of
    /// `num_blocks` blocks of `block_size` tokens, filled from `rng`.
    pub fn new(rng: &mut Rng, num_layers: u32, num_blocks: u32, block_size: u32) -> HostWorker {
        let worker = CWorker::host(0, 1, 0).expect("kvcs_worker_create");
        // WEIGHTED, as the plain payloads and the records these tests write by hand.
        worker.set_algorithm(1).expect("kvcs_worker_set_algorithm");
        let words = num_layers as usize * num_blocks as usize * block_size as usize * (CELL as usize / 8);
        let cache: Vec<u64> = (0..words).map(|_| rng.next_u64()).collect();
        let worker = HostWorker { worker, cache };
        worker
            .region(worker.base(), words as u64 * 8)
            .expect("kvcs_worker_add_region");
        worker
    }

    pub fn base(&self) -> u64 {
        self.cache.as_ptr() as u64
    }

    /// Registers layer `layer_number` over the cache at `slot`; the status
    /// itself, for tests that compare it with the C codes.
    pub fn add_layer(
        &self,
        group_id: u32,
        layer_number: u32,
        slot: u32,
        num_blocks: u32,
        block_size: u32,
    ) -> kvcs_status {
        let layer_bytes = num_blocks as u64 * block_size as u64 * CELL;
        let segment = kvcs_segment {
            address: self.base() + slot as u64 * layer_bytes,
            block_stride: (block_size as u64 * CELL) as i64,
            kernel_block_stride: 0,
            head_stride: CELL as i64,
            token_stride: CELL as i64,
            bytes_per_token: CELL as u32,
        };
        self.add_segment(group_id, layer_number, num_blocks, block_size, segment)
    }

    /// Registers layer `layer_number` (one head, identity
    /// `model.layers.<n>`) over `segment`; the status itself.
    pub fn add_segment(
        &self,
        group_id: u32,
        layer_number: u32,
        num_blocks: u32,
        block_size: u32,
        segment: kvcs_segment,
    ) -> kvcs_status {
        let identity = format!("model.layers.{layer_number}");
        let layer = kvcs_layer {
            group_id,
            layer_number,
            first_head: 0,
            num_heads: 1,
            replicas: 1,
            replica_index: 0,
            num_blocks,
            kernel_blocks: 1,
            tokens_per_kernel_block: block_size,
            num_segments: 1,
            segments: &segment,
            identity: identity.as_ptr(),
            identity_len: identity.len(),
        };
        kvcs_worker_add_layer(self.handle, &layer)
    }
}

// ---------------------------------------------------------------------------
// Memory for stored checksums

/// Host memory for a group's stored checksums: `KVCS_BLOCK_CHECKSUM_BYTES`
/// (value, then stamp) per block id, filled with random junk.
pub struct StoredMemory {
    pub words: Vec<u64>,
}

/// Words per block id of a stored buffer.
pub const STORED_WORDS: usize = (KVCS_BLOCK_CHECKSUM_BYTES / 8) as usize;

impl StoredMemory {
    pub fn random(rng: &mut Rng, num_blocks: usize) -> StoredMemory {
        StoredMemory {
            words: (0..num_blocks * STORED_WORDS).map(|_| rng.next_u64()).collect(),
        }
    }

    pub fn address(&self) -> u64 {
        self.words.as_ptr() as u64
    }

    /// The address of block `block`'s entry.
    pub fn at(&self, block: usize) -> u64 {
        self.address() + block as u64 * KVCS_BLOCK_CHECKSUM_BYTES
    }

    pub fn bytes(&self) -> u64 {
        self.words.len() as u64 * 8
    }

    pub fn num_blocks(&self) -> u64 {
        (self.words.len() / STORED_WORDS) as u64
    }

    /// `(value, stamp)` of block `block`.
    pub fn entry(&self, block: u32) -> (u64, u64) {
        let at = block as usize * STORED_WORDS;
        (self.words[at], self.words[at + 1])
    }

    pub fn set_entry(&mut self, block: u32, entry: (u64, u64)) {
        let at = block as usize * STORED_WORDS;
        self.words[at] = entry.0;
        self.words[at + 1] = entry.1;
    }
}
