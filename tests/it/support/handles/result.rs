//! Results (`kvcs_result`): [`CResult`].

use std::ffi::{CStr, CString};
use std::ptr::null_mut;

use kvcsum::ffi::result::*;
use kvcsum::ffi::status::kvcs_status::*;

use super::{check, last_error, Failure};

/// A result handle.
pub struct CResult(pub *mut kvcs_result);

impl Drop for CResult {
    fn drop(&mut self) {
        kvcs_result_destroy(self.0);
    }
}

impl CResult {
    /// Its record (`kvcs_result_encode`, size query first), or the status
    /// and message of the call that failed.
    pub fn encode(&self) -> Result<Vec<u8>, Failure> {
        let mut len = 0usize;
        match kvcs_result_encode(self.0, null_mut(), 0, &mut len) {
            KVCS_ERR_BUFFER_TOO_SMALL => {}
            status => return Err((status, last_error())),
        }
        let mut bytes = vec![0u8; len];
        check(kvcs_result_encode(self.0, bytes.as_mut_ptr(), len, &mut len))?;
        Ok(bytes)
    }

    /// `(first_position, num_positions, num_columns)` of a group.
    pub fn group(&self, req_id: &str, group_id: u32) -> Result<(u64, usize, usize), Failure> {
        let req_id = CString::new(req_id).expect("no NUL");
        let (mut first, mut positions, mut columns) = (0u64, 0usize, 0usize);
        check(kvcs_result_group(
            self.0,
            req_id.as_ptr(),
            group_id,
            &mut first,
            &mut positions,
            &mut columns,
        ))?;
        Ok((first, positions, columns))
    }

    /// Column `column` of a group of `num_positions` positions (the request
    /// id already a C string, so that a loop of lookups allocates none).
    pub fn column(
        &self,
        req_id: &CStr,
        group_id: u32,
        column: usize,
        num_positions: usize,
    ) -> Result<Vec<u64>, Failure> {
        let mut values = vec![0u64; num_positions];
        check(kvcs_result_column(
            self.0,
            req_id.as_ptr(),
            group_id,
            column,
            null_mut(),
            null_mut(),
            values.as_mut_ptr(),
        ))?;
        Ok(values)
    }

    /// A load check's outcomes of a group, one `kvcs_stored_outcome` per position.
    pub fn stored(&self, req_id: &str, group_id: u32) -> Result<Vec<u8>, Failure> {
        let (_, positions, _) = self.group(req_id, group_id)?;
        let c_req = CString::new(req_id).expect("no NUL");
        let mut outcomes = vec![0xEEu8; positions];
        check(kvcs_result_stored(
            self.0,
            c_req.as_ptr(),
            group_id,
            outcomes.as_mut_ptr(),
        ))?;
        Ok(outcomes)
    }

    /// The sum of every column of a group, per position.
    pub fn position_sums(&self, req_id: &str, group_id: u32) -> Result<Vec<u64>, Failure> {
        let (_, positions, columns) = self.group(req_id, group_id)?;
        let c_req = CString::new(req_id).expect("no NUL");
        let mut sums = vec![0u64; positions];
        for column in 0..columns {
            let values = self.column(&c_req, group_id, column, positions)?;
            for (sum, value) in sums.iter_mut().zip(&values) {
                *sum = sum.wrapping_add(*value);
            }
        }
        Ok(sums)
    }
}
