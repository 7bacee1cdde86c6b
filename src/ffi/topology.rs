//! `kvcs_topology` (docs/SPEC.md#11-transfer-topology-for-transfer-agents):
//! per remote engine, what its handshake told, and the answers of the free
//! functions of `tensor_parallel.rs` for this worker and that engine. The
//! completion counter is `completion.rs`.
//!
//! Every TP size these calls take runs from 1 to `KVCS_MAX_TP_SIZE`
//! (`crate::topology::MAX_TP_SIZE`), so that each answer fits in memory.

use std::ffi::c_char;

use super::buffer::write_entries;
use super::handle::{free, handle, into_handle, try_handle, try_handle_mut};
use super::panic::ffi_boundary;
use super::status::{fail, kvcs_status};
use super::tensor_parallel::kvcs_head_source;
use super::{c_str, not_null, try_engine, try_ref, write_out};
use crate::error::err;
use crate::topology::{LocalEngine, RemoteEngine, Topology};

/// The local engine of a `kvcs_topology`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_local_engine {
    /// This worker's TP rank, below `tp_size`.
    pub tp_rank: u32,
    /// The local TP size, 1 to `KVCS_MAX_TP_SIZE`.
    pub tp_size: u32,
    /// KV heads of the model (1 for MLA).
    pub total_kv_heads: u32,
    /// 1 if the cache is MLA (one latent head on every rank), else 0.
    pub is_mla: u32,
    /// Local tokens per logical block.
    pub block_size: u32,
}

/// What a remote engine's handshake told (docs/SPEC.md#11-transfer-topology-for-transfer-agents).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_remote_engine {
    /// Bytes of one logical block of one layer on one of its ranks.
    pub block_bytes: u64,
    /// Its TP size, 1 to `KVCS_MAX_TP_SIZE` (a handshake telling more is
    /// refused).
    pub tp_size: u32,
    /// Its tokens per logical block.
    pub block_size: u32,
    /// Physical (kernel) blocks per logical block.
    pub kernel_blocks: u32,
}

impl From<RemoteEngine> for kvcs_remote_engine {
    fn from(remote: RemoteEngine) -> Self {
        kvcs_remote_engine {
            block_bytes: remote.block_bytes,
            tp_size: remote.tp_size,
            block_size: remote.block_size,
            kernel_blocks: remote.kernel_blocks,
        }
    }
}

/// One local worker's view of the engines it transfers with: per remote
/// engine id, what its handshake told (docs/SPEC.md#11-transfer-topology-for-transfer-agents).
///
/// Ownership: created by `kvcs_topology_create`, freed by
/// `kvcs_topology_destroy`.
/// Thread safety: `kvcs_topology *` calls need exclusive access; `const
/// kvcs_topology *` calls may run concurrently.
#[allow(non_camel_case_types)]
pub struct kvcs_topology {
    _private: [u8; 0],
}

handle!(kvcs_topology => Topology);

/// Creates a topology of local engine `local_engine_id` (a non-empty UTF-8
/// string) with no remote engine; `*out` owns it. `local` is checked as by
/// `kvcs_rank_heads` (TP size 1 to `KVCS_MAX_TP_SIZE`, rank below it, heads
/// dividing) and its block size must be at least 1.
#[no_mangle]
pub extern "C" fn kvcs_topology_create(
    local_engine_id: *const c_char,
    local: *const kvcs_local_engine,
    out: *mut *mut kvcs_topology,
) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let local_engine_id = try_engine!(unsafe { c_str(local_engine_id, "local_engine_id") });
        let local = try_ref!(local, "local");
        not_null!(out, "out");
        let is_mla = try_engine!(super::flag_arg(local.is_mla, "local->is_mla"));
        let topology = try_engine!(Topology::new(
            local_engine_id,
            LocalEngine {
                tp_rank: local.tp_rank,
                tp_size: local.tp_size,
                total_kv_heads: local.total_kv_heads,
                is_mla,
                block_size: local.block_size,
            },
        ));
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(into_handle(topology)) };
        kvcs_status::KVCS_OK
    }
}

/// Frees a topology. NULL is a no-op.
#[no_mangle]
pub extern "C" fn kvcs_topology_destroy(topology: *mut kvcs_topology) {
    ffi_boundary! {
        // SAFETY: NULL, or made by `kvcs_topology_create` and not freed before (the contract).
        unsafe { free(topology) };
    }
}

/// Records remote engine `engine_id`'s handshake. `*added` (may be NULL) is
/// 1, or 0 when the engine was registered before (the first is kept). The
/// local engine's own id, a size of 0, a TP size above `KVCS_MAX_TP_SIZE`,
/// or sizes that do not divide the local engine's (TP, block size, kernel
/// blocks, heads) give `KVCS_ERR_INVALID_ARGUMENT` and nothing is recorded.
#[no_mangle]
pub extern "C" fn kvcs_topology_add_remote(
    topology: *mut kvcs_topology,
    engine_id: *const c_char,
    remote: *const kvcs_remote_engine,
    added: *mut u32,
) -> kvcs_status {
    ffi_boundary! {
        let topology = try_handle_mut!(topology, "topology");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let engine_id = try_engine!(unsafe { c_str(engine_id, "engine_id") });
        let remote = try_ref!(remote, "remote");
        let was_added = try_engine!(topology.add_remote(
            engine_id,
            RemoteEngine {
                tp_size: remote.tp_size,
                block_bytes: remote.block_bytes,
                block_size: remote.block_size,
                kernel_blocks: remote.kernel_blocks,
            },
        ));
        // SAFETY: NULL or writable per the contract.
        unsafe { write_out(added, u32::from(was_added)) };
        kvcs_status::KVCS_OK
    }
}

/// What remote engine `engine_id`'s handshake told, into `*remote`;
/// `KVCS_ERR_NOT_FOUND` for an engine not registered.
#[no_mangle]
pub extern "C" fn kvcs_topology_remote(
    topology: *const kvcs_topology,
    engine_id: *const c_char,
    remote: *mut kvcs_remote_engine,
) -> kvcs_status {
    ffi_boundary! {
        let topology = try_handle!(topology, "topology");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let engine_id = try_engine!(unsafe { c_str(engine_id, "engine_id") });
        not_null!(remote, "remote");
        let value = try_engine!(topology.remote(engine_id));
        // SAFETY: non-NULL and writable per the contract.
        unsafe { remote.write(value.into()) };
        kvcs_status::KVCS_OK
    }
}

/// The body of a per-engine question with one answer: `ask` on the
/// topology and `engine_id`, its answer written to `*out` (named `out_name`
/// in errors).
///
/// # Safety
/// `topology` is NULL or a live handle, `engine_id` NULL or a NUL-terminated
/// string, `out` NULL or writable (the C contract of the calls that use it).
unsafe fn engine_answer<T>(
    topology: *const kvcs_topology,
    engine_id: *const c_char,
    out: *mut T,
    out_name: &str,
    ask: impl FnOnce(&Topology, &str) -> crate::error::Result<T>,
) -> kvcs_status {
    let topology = try_handle!(topology, "topology");
    // SAFETY: NULL or a NUL-terminated string per the contract.
    let engine_id = try_engine!(unsafe { c_str(engine_id, "engine_id") });
    if out.is_null() {
        return fail(&err!(InvalidArgument, "{out_name} is NULL"));
    }
    let value = try_engine!(ask(topology, engine_id));
    // SAFETY: non-NULL (checked) and writable per the contract.
    unsafe { out.write(value) };
    kvcs_status::KVCS_OK
}

/// `kvcs_tp_ratio` of the local engine and `engine_id`.
#[no_mangle]
pub extern "C" fn kvcs_topology_tp_ratio(
    topology: *const kvcs_topology,
    engine_id: *const c_char,
    ratio: *mut i64,
) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: the caller's contract for these arguments.
        unsafe { engine_answer(topology, engine_id, ratio, "ratio", |t, id| t.tp_ratio(id)) }
    }
}

/// `kvcs_block_size_ratio` of the local engine and `engine_id`.
#[no_mangle]
pub extern "C" fn kvcs_topology_block_size_ratio(
    topology: *const kvcs_topology,
    engine_id: *const c_char,
    ratio: *mut u32,
) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: the caller's contract for these arguments.
        unsafe { engine_answer(topology, engine_id, ratio, "ratio", |t, id| t.block_size_ratio(id)) }
    }
}

/// `kvcs_remote_kv_replicated` for `engine_id`.
#[no_mangle]
pub extern "C" fn kvcs_topology_remote_kv_replicated(
    topology: *const kvcs_topology,
    engine_id: *const c_char,
    replicated: *mut u32,
) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: the caller's contract for these arguments.
        unsafe { engine_answer(topology, engine_id, replicated, "replicated", |t, id| t.remote_kv_replicated(id).map(u32::from)) }
    }
}

/// `kvcs_remote_ranks` of this worker's rank in `engine_id`.
#[no_mangle]
pub extern "C" fn kvcs_topology_remote_ranks(
    topology: *const kvcs_topology,
    engine_id: *const c_char,
    ranks: *mut u32,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let topology = try_handle!(topology, "topology");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let engine_id = try_engine!(unsafe { c_str(engine_id, "engine_id") });
        let items = try_engine!(topology.remote_ranks(engine_id));
        // SAFETY: the contract gives `cap` writable ranks and a writable `len`.
        unsafe { write_entries(&items, ranks, cap, len) }
    }
}

/// `kvcs_head_sources` of this worker's rank in `engine_id`.
#[no_mangle]
pub extern "C" fn kvcs_topology_head_sources(
    topology: *const kvcs_topology,
    engine_id: *const c_char,
    sources: *mut kvcs_head_source,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let topology = try_handle!(topology, "topology");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let engine_id = try_engine!(unsafe { c_str(engine_id, "engine_id") });
        let items: Vec<kvcs_head_source> =
            try_engine!(topology.head_sources(engine_id)).into_iter().map(Into::into).collect();
        // SAFETY: the contract gives `cap` writable entries and a writable `len`.
        unsafe { write_entries(&items, sources, cap, len) }
    }
}
