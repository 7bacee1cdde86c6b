//! Reports (`kvcs_report`): [`CReport`], the verdict and reason values,
//! and what a live report holds for tests that keep the raw handle.

use std::ffi::CString;
use std::ptr::{null, null_mut};

use kvcsum::ffi::repair::*;
use kvcsum::ffi::report::*;
use kvcsum::ffi::status::kvcs_status::*;

use super::{check, last_error, text, CBlocks, Failure};

/// One entry of a repair plan: (group, position, block id, start token,
/// end token).
pub type RepairEntry = (u32, u64, u32, u64, u64);

pub const MATCH: u32 = kvcs_verdict::KVCS_VERDICT_MATCH as u32;
pub const MISMATCH: u32 = kvcs_verdict::KVCS_VERDICT_MISMATCH as u32;
pub const UNVERIFIED: u32 = kvcs_verdict::KVCS_VERDICT_UNVERIFIED as u32;

/// A reason's value.
pub fn reason(reason: kvcs_unverified_reason) -> u32 {
    reason as u32
}

/// The name of a reason (`KVCS_UNVERIFIED_...`).
pub fn reason_name(reason: u32) -> String {
    text(kvcs_unverified_reason_name(reason))
}

/// `kvcs_report_message` of a live report.
pub fn report_message(report: *const kvcs_report) -> String {
    let mut message = null();
    assert_eq!(kvcs_report_message(report, &mut message), KVCS_OK);
    text(message)
}

/// `kvcs_report_compared_positions` of a live report.
pub fn report_compared(report: *const kvcs_report) -> u64 {
    let mut n = u64::MAX;
    assert_eq!(kvcs_report_compared_positions(report, &mut n), KVCS_OK);
    n
}

/// Every mismatch of a live report, in order.
pub fn report_mismatches(report: *const kvcs_report) -> Vec<kvcs_mismatch> {
    let mut count = 0usize;
    assert_eq!(kvcs_report_num_mismatches(report, &mut count), KVCS_OK);
    (0..count)
        .map(|i| {
            // SAFETY: all-zero bytes are a valid kvcs_mismatch (integers only).
            let mut entry: kvcs_mismatch = unsafe { std::mem::zeroed() };
            assert_eq!(kvcs_report_mismatch(report, i, &mut entry), KVCS_OK);
            entry
        })
        .collect()
}

/// One finding of a report: reason, group (`KVCS_WHOLE_LOAD` for the
/// load), message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CFinding {
    pub reason: u32,
    pub group_id: u32,
    pub message: String,
}

/// A report handle.
pub struct CReport(pub *mut kvcs_report);

// SAFETY: a report is immutable; every accessor may run from any thread.
unsafe impl Send for CReport {}

impl Drop for CReport {
    fn drop(&mut self) {
        kvcs_report_destroy(self.0);
    }
}

impl CReport {
    pub fn verdict(&self) -> u32 {
        let mut verdict = 99u32;
        assert_eq!(kvcs_report_verdict(self.0, &mut verdict), KVCS_OK);
        verdict
    }

    pub fn verdict_name(&self) -> String {
        text(kvcs_verdict_name(self.verdict()))
    }

    /// The first finding's reason.
    pub fn reason(&self) -> u32 {
        let mut reason = 99u32;
        assert_eq!(kvcs_report_reason(self.0, &mut reason), KVCS_OK);
        reason
    }

    pub fn passed(&self) -> bool {
        let mut passed = 9u32;
        assert_eq!(kvcs_report_passed(self.0, &mut passed), KVCS_OK);
        passed == 1
    }

    pub fn message(&self) -> String {
        report_message(self.0)
    }

    pub fn compared(&self) -> u64 {
        report_compared(self.0)
    }

    pub fn uncompared(&self) -> u64 {
        let mut n = u64::MAX;
        assert_eq!(kvcs_report_uncompared_positions(self.0, &mut n), KVCS_OK);
        n
    }

    pub fn findings(&self) -> Vec<CFinding> {
        let mut count = 0usize;
        assert_eq!(kvcs_report_num_unverified(self.0, &mut count), KVCS_OK);
        (0..count)
            .map(|i| {
                let (mut reason, mut group_id, mut message) = (0u32, 0u32, null());
                assert_eq!(
                    kvcs_report_unverified(self.0, i, &mut reason, &mut group_id, &mut message),
                    KVCS_OK
                );
                CFinding {
                    reason,
                    group_id,
                    message: text(message),
                }
            })
            .collect()
    }

    pub fn mismatches(&self) -> Vec<kvcs_mismatch> {
        report_mismatches(self.0)
    }

    /// The first `count` layer differences of mismatch `mismatch`: (layer,
    /// first head, heads, check).
    pub fn layer_differences(&self, mismatch: usize, count: usize) -> Vec<(u32, u32, u32, u32)> {
        (0..count)
            .map(|j| {
                // SAFETY: all-zero bytes are a valid kvcs_layer_difference.
                let mut d: kvcs_layer_difference = unsafe { std::mem::zeroed() };
                assert_eq!(kvcs_report_layer_difference(self.0, mismatch, j, &mut d), KVCS_OK);
                (d.layer_number, d.first_head, d.num_heads, d.check)
            })
            .collect()
    }

    /// `kvcs_report_repair_plan` for `req_id` of `blocks`, each group given
    /// with the consumer's block size: per entry (group, position, block id,
    /// start token, end token).
    pub fn repair_plan(
        &self,
        blocks: &CBlocks,
        req_id: &str,
        sizes: &[(u32, u32)],
    ) -> Result<Vec<RepairEntry>, Failure> {
        let req_id = CString::new(req_id).expect("no NUL");
        let (group_ids, block_sizes): (Vec<u32>, Vec<u32>) = sizes.iter().copied().unzip();
        let plan = |buf: *mut kvcs_repair_block, cap: usize, len: &mut usize| {
            kvcs_report_repair_plan(
                self.0,
                blocks.0,
                req_id.as_ptr(),
                group_ids.as_ptr(),
                block_sizes.as_ptr(),
                sizes.len(),
                buf,
                cap,
                len,
            )
        };
        let mut needed = 0usize;
        match plan(null_mut(), 0, &mut needed) {
            KVCS_OK => return Ok(Vec::new()),
            KVCS_ERR_BUFFER_TOO_SMALL => {}
            status => return Err((status, last_error())),
        }
        let empty = kvcs_repair_block {
            group_id: 0,
            block_id: 0,
            position: 0,
            start_token: 0,
            end_token: 0,
        };
        let mut entries = vec![empty; needed];
        let mut len = 0usize;
        check(plan(entries.as_mut_ptr(), needed, &mut len))?;
        Ok(entries[..len]
            .iter()
            .map(|e| (e.group_id, e.position, e.block_id, e.start_token, e.end_token))
            .collect())
    }
}
