//! Verifiers (`kvcs_verifier`): [`CVerifier`].

use std::ffi::CString;
use std::ptr::null_mut;

use kvcsum::ffi::status::kvcs_status::*;
use kvcsum::ffi::verifier::*;

use super::{check, last_error, CBlocks, CReport, Failure};

/// A verifier handle.
pub struct CVerifier(pub *mut kvcs_verifier);

impl Drop for CVerifier {
    fn drop(&mut self) {
        kvcs_verifier_destroy(self.0);
    }
}

// SAFETY: a verifier may be used from any thread (its documented contract).
unsafe impl Send for CVerifier {}
// SAFETY: every call but destroy may run concurrently (its documented contract).
unsafe impl Sync for CVerifier {}

impl CVerifier {
    pub fn new(num_workers: u32) -> CVerifier {
        let mut handle = null_mut();
        assert_eq!(
            kvcs_verifier_create(num_workers, &mut handle),
            KVCS_OK,
            "{}",
            last_error()
        );
        CVerifier(handle)
    }

    pub fn extension(&self, on: bool) {
        assert_eq!(kvcs_verifier_set_extension(self.0, on as u32), KVCS_OK);
    }

    pub fn producer_tp_size(&self, tp_size: u32) {
        assert_eq!(kvcs_verifier_set_producer_tp_size(self.0, tp_size), KVCS_OK);
    }

    /// Tells a consumer the producer's block size of `group_id`, which a
    /// plain payload does not say.
    pub fn producer_block_size(&self, group_id: u32, block_size: u32) {
        assert_eq!(
            kvcs_verifier_set_producer_block_size(self.0, group_id, block_size),
            KVCS_OK,
            "{}",
            last_error()
        );
    }

    pub fn expect(&self, blocks: &CBlocks, role: u32) {
        assert_eq!(
            kvcs_verifier_expect(self.0, blocks.0, role),
            KVCS_OK,
            "{}",
            last_error()
        );
    }

    pub fn add(&self, record: &[u8]) -> Result<(), Failure> {
        check(kvcs_verifier_add_record(self.0, record.as_ptr(), record.len()))
    }

    /// The payload bytes of `req_id` (size query first).
    pub fn payload(&self, req_id: &str) -> Result<Vec<u8>, Failure> {
        let c_req = CString::new(req_id).expect("no NUL");
        let mut len = 0usize;
        match kvcs_verifier_payload(self.0, c_req.as_ptr(), null_mut(), 0, &mut len) {
            KVCS_ERR_BUFFER_TOO_SMALL => {}
            status => return Err((status, last_error())),
        }
        let mut bytes = vec![0u8; len];
        check(kvcs_verifier_payload(
            self.0,
            c_req.as_ptr(),
            bytes.as_mut_ptr(),
            len,
            &mut len,
        ))?;
        Ok(bytes)
    }

    pub fn check(&self, req_id: &str, payload: &[u8]) -> Result<CReport, Failure> {
        let c_req = CString::new(req_id).expect("no NUL");
        let mut out = null_mut();
        check(kvcs_verifier_check(
            self.0,
            c_req.as_ptr(),
            payload.as_ptr(),
            payload.len(),
            &mut out,
        ))?;
        Ok(CReport(out))
    }

    pub fn check_no_payload(&self, req_id: &str) -> Result<CReport, Failure> {
        let c_req = CString::new(req_id).expect("no NUL");
        let mut out = null_mut();
        check(kvcs_verifier_check_no_payload(self.0, c_req.as_ptr(), &mut out))?;
        Ok(CReport(out))
    }

    pub fn check_stored(&self, req_id: &str) -> Result<CReport, Failure> {
        let c_req = CString::new(req_id).expect("no NUL");
        let mut out = null_mut();
        check(kvcs_verifier_check_stored(self.0, c_req.as_ptr(), &mut out))?;
        Ok(CReport(out))
    }
}
