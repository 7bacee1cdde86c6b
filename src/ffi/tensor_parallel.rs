//! Transfer topology's free functions (docs/SPEC.md#11-transfer-topology-for-transfer-agents):
//! TP and block size arithmetic, which heads a rank holds and which remote
//! ranks supply them. The per-engine handle `kvcs_topology` is `topology.rs`;
//! the completion counter is `completion.rs`.
//!
//! Every TP size these calls take runs from 1 to `KVCS_MAX_TP_SIZE`
//! (`crate::topology::MAX_TP_SIZE`), so that each answer fits in memory.

use super::buffer::write_entries;
use super::panic::ffi_boundary;
use super::status::kvcs_status;
use super::{not_null, try_engine, write_out};
use crate::topology::{self, HeadSource};

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
