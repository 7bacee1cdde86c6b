//! Block sets (`kvcs_blocks`): [`CBlocks`].

use std::ffi::CString;
use std::ptr::null_mut;

use kvcsum::ffi::blocks::*;
use kvcsum::ffi::status::kvcs_status::KVCS_OK;

use super::{check, Failure};
use crate::support::{GroupTable, TestRequest};

/// A block set handle.
pub struct CBlocks(pub *mut kvcs_blocks);

impl Drop for CBlocks {
    fn drop(&mut self) {
        kvcs_blocks_destroy(self.0);
    }
}

impl CBlocks {
    pub fn new() -> CBlocks {
        let mut handle = null_mut();
        assert_eq!(kvcs_blocks_create(&mut handle), KVCS_OK);
        CBlocks(handle)
    }

    /// The block set of `requests`, in order.
    pub fn of(requests: &[TestRequest]) -> CBlocks {
        let blocks = CBlocks::new();
        for request in requests {
            blocks
                .request(&request.req_id, request.num_tokens)
                .expect("add_request");
            for table in &request.tables {
                blocks.table(&request.req_id, table).expect("add_group");
            }
        }
        blocks
    }

    pub fn request(&self, req_id: &str, num_tokens: u64) -> Result<(), Failure> {
        let req_id = CString::new(req_id).expect("no NUL");
        check(kvcs_blocks_add_request(self.0, req_id.as_ptr(), num_tokens))
    }

    pub fn table(&self, req_id: &str, table: &GroupTable) -> Result<(), Failure> {
        let req_id = CString::new(req_id).expect("no NUL");
        check(kvcs_blocks_add_group(
            self.0,
            req_id.as_ptr(),
            table.group_id,
            table.first_position,
            table.block_ids.as_ptr(),
            table.block_ids.len(),
        ))
    }

    /// Block hashes of `hash_bytes` bytes each, one per block id.
    pub fn hashes(&self, req_id: &str, group_id: u32, hashes: &[u8], hash_bytes: usize) -> Result<(), Failure> {
        let req_id = CString::new(req_id).expect("no NUL");
        check(kvcs_blocks_set_hashes(
            self.0,
            req_id.as_ptr(),
            group_id,
            hashes.as_ptr(),
            hash_bytes,
            hashes.len() / hash_bytes,
        ))
    }
}

impl Default for CBlocks {
    fn default() -> Self {
        CBlocks::new()
    }
}
