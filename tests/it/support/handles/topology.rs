//! Topologies (`kvcs_topology`): a local engine's topology and what its
//! head-source calls give. The handle is returned raw: the tests destroy
//! it themselves.

use std::ptr::null_mut;

use kvcsum::ffi::status::kvcs_status::{self, *};
use kvcsum::ffi::topology::*;

use super::last_error;

/// A topology of local engine "decode" (rank 0 of `tp_size`, `heads` KV
/// heads, 16-token blocks).
pub fn topology(tp_size: u32, heads: u32) -> *mut kvcs_topology {
    let local = kvcs_local_engine {
        tp_rank: 0,
        tp_size,
        total_kv_heads: heads,
        is_mla: 0,
        block_size: 16,
    };
    let mut handle = null_mut();
    assert_eq!(
        kvcs_topology_create(c"decode".as_ptr(), &local, &mut handle),
        KVCS_OK,
        "{}",
        last_error()
    );
    handle
}

pub fn remote_engine(tp_size: u32) -> kvcs_remote_engine {
    kvcs_remote_engine {
        block_bytes: 4096,
        tp_size,
        block_size: 16,
        kernel_blocks: 1,
    }
}

/// A head source's fields as a tuple: (remote rank, first head, heads,
/// local offset, remote offset).
pub fn fields(source: &kvcs_head_source) -> (u32, u32, u32, u32, u32) {
    (
        source.remote_rank,
        source.first_head,
        source.num_heads,
        source.local_offset,
        source.remote_offset,
    )
}

/// The head sources a call gives, through a size query and then a buffer
/// of exactly the size it named.
pub fn head_sources_of(
    call: impl Fn(*mut kvcs_head_source, usize, *mut usize) -> kvcs_status,
) -> Vec<kvcs_head_source> {
    let mut len = 0usize;
    assert_eq!(
        call(null_mut(), 0, &mut len),
        KVCS_ERR_BUFFER_TOO_SMALL,
        "{}",
        last_error()
    );
    let empty = kvcs_head_source {
        remote_rank: u32::MAX,
        first_head: 0,
        num_heads: 0,
        local_offset: 0,
        remote_offset: 0,
    };
    let mut sources = vec![empty; len];
    let cap = sources.len();
    assert_eq!(call(sources.as_mut_ptr(), cap, &mut len), KVCS_OK, "{}", last_error());
    assert_eq!(len, cap);
    sources
}
