//! Transfer topology (docs/SPEC.md#11-transfer-topology-for-transfer-agents)
//! at the C boundary: first the free functions (TP and block size
//! arithmetic, which heads a rank holds and which remote ranks supply
//! them), then the per-engine handle `kvcs_topology`, which keeps what each
//! remote engine's handshake told and answers those functions for this
//! worker and that engine. The completion counter is `completion.rs`.
//!
//! Every TP size these calls take runs from 1 to `KVCS_MAX_TP_SIZE`
//! (`crate::base::topology::MAX_TP_SIZE`), so that each answer fits in memory.

use std::ffi::c_char;

use super::buffer::write_entries;
use super::handle::{free, handle, into_handle, try_handle, try_handle_mut};
use super::panic::ffi_boundary;
use super::status::{fail, kvcs_status};
use super::{c_str, not_null, try_engine, try_ref, write_out};
use crate::base::error::err;
use crate::base::topology::{self, HeadSource, LocalEngine, RemoteEngine, Topology};

/// A run of a local rank's heads and the remote rank that supplies it
/// (`kvcs_head_sources`).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_head_source {
    /// The remote rank to read from.
    pub remote_rank: u32,
    /// Global number of the first head of the run.
    pub first_head: u32,
    /// Heads in the run.
    pub num_heads: u32,
    /// Index of `first_head` among the local rank's heads.
    pub local_offset: u32,
    /// Index of `first_head` among the remote rank's heads.
    pub remote_offset: u32,
}

impl From<HeadSource> for kvcs_head_source {
    fn from(source: HeadSource) -> Self {
        kvcs_head_source {
            remote_rank: source.remote_rank,
            first_head: source.heads.first,
            num_heads: source.heads.count,
            local_offset: source.local_offset,
            remote_offset: source.remote_offset,
        }
    }
}

/// `local_tp / remote_tp` when `local_tp >= remote_tp`, else `-(remote_tp /
/// local_tp)`, into `*ratio`. `KVCS_ERR_INVALID_ARGUMENT` when a size is 0
/// or above `KVCS_MAX_TP_SIZE`, or the larger is not a multiple of the
/// smaller.
#[no_mangle]
pub extern "C" fn kvcs_tp_ratio(local_tp: u32, remote_tp: u32, ratio: *mut i64) -> kvcs_status {
    ffi_boundary! {
        not_null!(ratio, "ratio");
        let value = try_engine!(topology::tp_ratio(local_tp, remote_tp));
        // SAFETY: non-NULL and writable per the contract.
        unsafe { ratio.write(value) };
        kvcs_status::KVCS_OK
    }
}

/// The remote ranks local rank `local_rank` reads from, ascending, into
/// `(ranks, cap)` with the count in `*len` (`(NULL, 0)` asks for it):
/// `local_rank / ratio` for a positive `kvcs_tp_ratio`, else the `|ratio|`
/// ranks from `local_rank * |ratio|` (so at most `KVCS_MAX_TP_SIZE`).
/// `KVCS_ERR_OUT_OF_BOUNDS` for a rank at or past `local_tp`;
/// `KVCS_ERR_INVALID_ARGUMENT` for sizes `kvcs_tp_ratio` refuses.
#[no_mangle]
pub extern "C" fn kvcs_remote_ranks(
    local_rank: u32,
    local_tp: u32,
    remote_tp: u32,
    ranks: *mut u32,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let items = try_engine!(topology::remote_ranks(local_rank, local_tp, remote_tp));
        // SAFETY: the contract gives `cap` writable ranks and a writable `len`.
        unsafe { write_entries(&items, ranks, cap, len) }
    }
}

/// The remote ranks to handshake with before the remote engine is known:
/// the same as `kvcs_remote_ranks`, from the two TP sizes alone.
#[no_mangle]
pub extern "C" fn kvcs_handshake_targets(
    local_rank: u32,
    local_tp: u32,
    remote_tp: u32,
    ranks: *mut u32,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    kvcs_remote_ranks(local_rank, local_tp, remote_tp, ranks, cap, len)
}

/// `local_block_size / remote_block_size` into `*ratio`;
/// `KVCS_ERR_INVALID_ARGUMENT` when a size is 0 or it is not whole.
#[no_mangle]
pub extern "C" fn kvcs_block_size_ratio(local_block_size: u32, remote_block_size: u32, ratio: *mut u32) -> kvcs_status {
    ffi_boundary! {
        not_null!(ratio, "ratio");
        let value = try_engine!(topology::block_size_ratio(local_block_size, remote_block_size));
        // SAFETY: non-NULL and writable per the contract.
        unsafe { ratio.write(value) };
        kvcs_status::KVCS_OK
    }
}

/// `*replicated` = 1 if a remote engine of TP size `remote_tp` (1 to
/// `KVCS_MAX_TP_SIZE`) replicates KV heads (`remote_tp > total_kv_heads`),
/// else 0.
#[no_mangle]
pub extern "C" fn kvcs_remote_kv_replicated(remote_tp: u32, total_kv_heads: u32, replicated: *mut u32) -> kvcs_status {
    ffi_boundary! {
        not_null!(replicated, "replicated");
        let value = try_engine!(topology::remote_kv_replicated(remote_tp, total_kv_heads));
        // SAFETY: non-NULL and writable per the contract.
        unsafe { replicated.write(u32::from(value)) };
        kvcs_status::KVCS_OK
    }
}

/// `*replicated` = 1 if the local engine, of TP size `tp` (1 to
/// `KVCS_MAX_TP_SIZE`), replicates KV heads (`is_mla` is 1, or `tp >
/// total_kv_heads`), else 0.
#[no_mangle]
pub extern "C" fn kvcs_local_kv_replicated(
    tp: u32,
    total_kv_heads: u32,
    is_mla: u32,
    replicated: *mut u32,
) -> kvcs_status {
    ffi_boundary! {
        not_null!(replicated, "replicated");
        let is_mla = try_engine!(super::flag_arg(is_mla, "is_mla"));
        let value = try_engine!(topology::local_kv_replicated(tp, total_kv_heads, is_mla));
        // SAFETY: non-NULL and writable per the contract.
        unsafe { replicated.write(u32::from(value)) };
        kvcs_status::KVCS_OK
    }
}

/// The global heads rank `rank` of an engine of TP size `tp` (1 to
/// `KVCS_MAX_TP_SIZE`) holds: `[r*K/T, (r+1)*K/T)` when `T <= K`, else
/// head `r / (T/K)`; with MLA (`total_kv_heads` must be 1) head 0. Sizes
/// that do not divide give `KVCS_ERR_INVALID_ARGUMENT`. Either out-pointer
/// may be NULL.
#[no_mangle]
pub extern "C" fn kvcs_rank_heads(
    rank: u32,
    tp: u32,
    total_kv_heads: u32,
    is_mla: u32,
    first_head: *mut u32,
    num_heads: *mut u32,
) -> kvcs_status {
    ffi_boundary! {
        let is_mla = try_engine!(super::flag_arg(is_mla, "is_mla"));
        let heads = try_engine!(topology::rank_heads(rank, tp, total_kv_heads, is_mla));
        // SAFETY: each is NULL or writable per the contract.
        unsafe {
            write_out(first_head, heads.first);
            write_out(num_heads, heads.count);
        }
        kvcs_status::KVCS_OK
    }
}

/// For local rank `local_rank`, the runs of its heads in head order, each
/// with the remote rank that supplies it (one of `kvcs_remote_ranks`; the
/// lowest where the remote engine replicates a head), into `(sources,
/// cap)` with the count in `*len` (`(NULL, 0)` asks for it). Each run is a
/// different remote rank, so there are at most `|kvcs_tp_ratio|` of them,
/// however many heads the rank holds; the work is per run. Sizes are
/// checked as by `kvcs_remote_ranks` and `kvcs_rank_heads`.
#[no_mangle]
pub extern "C" fn kvcs_head_sources(
    local_rank: u32,
    local_tp: u32,
    remote_tp: u32,
    total_kv_heads: u32,
    is_mla: u32,
    sources: *mut kvcs_head_source,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let is_mla = try_engine!(super::flag_arg(is_mla, "is_mla"));
        let items: Vec<kvcs_head_source> =
            try_engine!(topology::head_sources(local_rank, local_tp, remote_tp, total_kv_heads, is_mla))
                .into_iter()
                .map(Into::into)
                .collect();
        // SAFETY: the contract gives `cap` writable entries and a writable `len`.
        unsafe { write_entries(&items, sources, cap, len) }
    }
}

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
    ask: impl FnOnce(&Topology, &str) -> crate::base::error::Result<T>,
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
