//! Owning wrappers over the C ABI (`kvcsum::ffi`), called as a C engine
//! would: workers, block sets, results, verifiers and reports, each freed on
//! drop, every failed call returned as its status and `kvcs_last_error()`.
//!
//! Shared by `tests/verdicts.rs`, `tests/verdict_property.rs` and the fuzz
//! target `verdicts` (included with `#[path]`); it needs the crate root to
//! declare `mod support;` (tests/support).

#![allow(dead_code)]

use std::ffi::CString;
use std::ptr::{null, null_mut};

use kvcsum::ffi::blocks::*;
use kvcsum::ffi::constants::{KVCS_BLOCK_CHECKSUM_BYTES, KVCS_HOST};
use kvcsum::ffi::repair::*;
use kvcsum::ffi::report::*;
use kvcsum::ffi::result::*;
use kvcsum::ffi::status::kvcs_status::{self, *};
use kvcsum::ffi::status::*;
use kvcsum::ffi::verifier::*;
use kvcsum::ffi::worker::*;
use kvcsum::{LayerSpec, StateSpec};

pub use crate::support::c_abi::last_error;
use crate::support::c_abi::{c_layer, c_segments, report_compared, report_message, report_mismatches, text};
use crate::support::{GroupTable, Placement, Rng, TestRequest};

/// A failed call: its status and the library's message.
pub type Failure = (kvcs_status, String);

/// `Ok` for `KVCS_OK`, else the status and the message.
pub fn check(status: kvcs_status) -> Result<(), Failure> {
    if status == KVCS_OK {
        Ok(())
    } else {
        Err((status, last_error()))
    }
}

/// The name of a reason (`KVCS_UNVERIFIED_...`).
pub fn reason_name(reason: u32) -> String {
    text(kvcs_unverified_reason_name(reason))
}

/// The name of a status (`KVCS_ERR_...`).
pub fn status_name(status: kvcs_status) -> String {
    text(kvcs_status_name(status as u32))
}

pub const PRODUCER: u32 = kvcs_role::KVCS_ROLE_PRODUCER as u32;
pub const CONSUMER: u32 = kvcs_role::KVCS_ROLE_CONSUMER as u32;

pub const MATCH: u32 = kvcs_verdict::KVCS_VERDICT_MATCH as u32;
pub const MISMATCH: u32 = kvcs_verdict::KVCS_VERDICT_MISMATCH as u32;
pub const UNVERIFIED: u32 = kvcs_verdict::KVCS_VERDICT_UNVERIFIED as u32;

/// A reason's value.
pub fn reason(reason: kvcs_unverified_reason) -> u32 {
    reason as u32
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
            device: KVCS_HOST,
            num_threads: 1,
        };
        let mut handle = null_mut();
        check(kvcs_worker_create(&options, &mut handle))?;
        let worker = CWorker { handle };
        let algorithm = ALGORITHM.with(|a| a.get());
        if algorithm != 0 {
            check(kvcs_worker_set_algorithm(worker.handle, algorithm))?;
        }
        Ok(worker)
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
// Block sets and results

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

/// A result handle.
pub struct CResult(pub *mut kvcs_result);

impl Drop for CResult {
    fn drop(&mut self) {
        kvcs_result_destroy(self.0);
    }
}

impl CResult {
    /// Its record (`kvcs_result_encode`, size query first).
    pub fn encode(&self) -> Vec<u8> {
        let mut len = 0usize;
        assert_eq!(
            kvcs_result_encode(self.0, null_mut(), 0, &mut len),
            KVCS_ERR_BUFFER_TOO_SMALL,
            "{}",
            last_error()
        );
        let mut bytes = vec![0u8; len];
        assert_eq!(
            kvcs_result_encode(self.0, bytes.as_mut_ptr(), len, &mut len),
            KVCS_OK,
            "{}",
            last_error()
        );
        bytes
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
        let mut values = vec![0u64; positions];
        for column in 0..columns {
            check(kvcs_result_column(
                self.0,
                c_req.as_ptr(),
                group_id,
                column,
                null_mut(),
                null_mut(),
                values.as_mut_ptr(),
            ))?;
            for (sum, value) in sums.iter_mut().zip(&values) {
                *sum = sum.wrapping_add(*value);
            }
        }
        Ok(sums)
    }
}

// ---------------------------------------------------------------------------
// Verifiers and reports

/// A verifier handle.
pub struct CVerifier(pub *mut kvcs_verifier);

impl Drop for CVerifier {
    fn drop(&mut self) {
        kvcs_verifier_destroy(self.0);
    }
}

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

    pub fn producer_block_size(&self, group_id: u32, block_size: u32) {
        assert_eq!(
            kvcs_verifier_set_producer_block_size(self.0, group_id, block_size),
            KVCS_OK
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

    /// `kvcs_report_repair_plan` for `req_id` of `blocks`, each group given
    /// with the consumer's block size: per entry (group, position, block id,
    /// start token, end token).
    pub fn repair_plan(
        &self,
        blocks: &CBlocks,
        req_id: &str,
        sizes: &[(u32, u32)],
    ) -> Result<Vec<(u32, u64, u32, u64, u64)>, Failure> {
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
