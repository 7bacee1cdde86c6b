//! `kvcs_report`: the verdict on one finished load (docs/SPEC.md#10-verification).

// C entry points take raw pointers by design; their documented contract,
// not `unsafe fn`, is what C callers see.

use std::ffi::{c_char, CString};

use super::c_enum::c_enum;
use super::handle::{free, handle, into_handle, try_handle};
use super::panic::ffi_boundary;
use super::status::{fail, kvcs_status};
use super::{not_null, write_out};
use crate::base::error::err;
use crate::verify::{Reason, Report, Verdict};

/// A verifier's judgement of one finished load: match, mismatch (groups and
/// block positions, with layers in detail mode) or unverified (reasons).
///
/// Ownership: made by `kvcs_verifier_check*`, freed by
/// `kvcs_report_destroy`; independent of its verifier. Strings it gives stay
/// valid until it is destroyed.
/// Thread safety: immutable; every accessor may run concurrently.
#[allow(non_camel_case_types)]
pub struct kvcs_report {
    _private: [u8; 0],
}

/// The verdict of a report. Values are fixed and never renumbered.
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvcs_verdict {
    /// Every compared block position is equal.
    KVCS_VERDICT_MATCH = 0,
    /// Some compared block position differs.
    KVCS_VERDICT_MISMATCH = 1,
    /// The load could not be compared; see the reasons.
    KVCS_VERDICT_UNVERIFIED = 2,
}

c_enum!(kvcs_verdict {
    KVCS_VERDICT_MATCH,
    KVCS_VERDICT_MISMATCH,
    KVCS_VERDICT_UNVERIFIED
});

/// Why a load or a group could not be compared (docs/SPEC.md#10-verification). Values are
/// fixed and never renumbered; a retired value stays reserved.
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvcs_unverified_reason {
    /// No reason: the report is not unverified for any cause.
    KVCS_UNVERIFIED_NONE = 0,
    /// The producer sent no checksums.
    KVCS_UNVERIFIED_NO_CHECKSUMS = 1,
    /// The producer's checksums do not decode (bad base64 or payload).
    KVCS_UNVERIFIED_INVALID_CHECKSUMS = 2,
    /// Not every worker reported its checksums of the request.
    KVCS_UNVERIFIED_WORKERS_MISSING = 3,
    /// A worker checksummed other blocks (or tokens) than scheduled.
    KVCS_UNVERIFIED_OTHER_BLOCKS = 4,
    /// A group is checksummed by one side only.
    KVCS_UNVERIFIED_ONE_SIDED_GROUP = 5,
    /// A group's fingerprint differs.
    KVCS_UNVERIFIED_FINGERPRINT_DIFFERS = 6,
    /// No block position in common (with equal valid tokens).
    KVCS_UNVERIFIED_NO_COMMON_POSITION = 7,
    /// A replica was not checksummed.
    KVCS_UNVERIFIED_REPLICA_MISSING = 8,
    /// TP sizes differ (or are unknown) for shard-keyed state.
    KVCS_UNVERIFIED_STATE_TP_DIFFERS = 9,
    /// A worker's record was computed in the other role than the request is
    /// expected in (e.g. a consumer rank checksummed as a producer): a
    /// configuration error, never reported as corrupt data.
    KVCS_UNVERIFIED_ROLE_DIFFERS = 10,
    /// Loaded positions were not compared and the verifier requires full
    /// coverage (`kvcs_verifier_set_require_coverage`); see
    /// `kvcs_report_uncompared_positions`.
    KVCS_UNVERIFIED_UNCOMPARED_POSITIONS = 11,
    /// An offload load was judged (`kvcs_verifier_check_stored`) from a
    /// worker's record that is not a load check's (it came from
    /// `kvcs_worker_checksum`, not `kvcs_worker_check_stored`).
    KVCS_UNVERIFIED_NOT_LOAD_CHECK = 12,
    /// The checksums were computed with different algorithms
    /// (`kvcs_worker_set_algorithm`, docs/SPEC.md#12-the-mixed-algorithm): between the workers of one side,
    /// or between the consumer's workers and the producer's payload (a
    /// payload without the kvcsum extension means `KVCS_ALGORITHM_WEIGHTED`).
    /// A configuration error, never reported as corrupt data.
    KVCS_UNVERIFIED_ALGORITHM_DIFFERS = 13,
    /// The producer's block size of an attention group is unknown: a plain
    /// payload and no `kvcs_verifier_set_producer_block_size` for the group.
    /// Its positions cannot be lined up with the consumer's, whatever the
    /// consumer's block size.
    KVCS_UNVERIFIED_BLOCK_SIZE_UNKNOWN = 14,
    /// No worker of one side registered any cache of a group, so nothing of
    /// it was read (a group with no layers).
    KVCS_UNVERIFIED_NOTHING_READ = 15,
    /// The producer's extension says it checksummed other layers or heads
    /// than a replica check of the consumer covers (a head left out, a
    /// replica declared wrongly, on either side): a registration differs.
    KVCS_UNVERIFIED_COVERAGE_DIFFERS = 16,
    /// The two sides declare that they read a layer's bytes differently
    /// (`kvcs_worker_set_layer_decoding`, docs/SPEC.md#7-group-fingerprint:
    /// another element type, head size or K or V scale), or the workers of
    /// one side do: equal checksums would not mean equal KV. A
    /// configuration difference, never reported as corrupt data.
    KVCS_UNVERIFIED_DECODING_DIFFERS = 17,
    /// The two sides' caches of a layer have another geometry
    /// (docs/SPEC.md#7-group-fingerprint, "Geometry": the layer's heads, a
    /// cell's bytes, or K's bytes where both register K and V apart), as
    /// every registration tells without a call: engines wired by hand with
    /// another head size or element width, no identity set. Or the workers
    /// of one side register a layer's heads with other cells. A
    /// configuration difference, never reported as corrupt data.
    KVCS_UNVERIFIED_GEOMETRY_DIFFERS = 18,
}

c_enum!(kvcs_unverified_reason {
    KVCS_UNVERIFIED_NONE,
    KVCS_UNVERIFIED_NO_CHECKSUMS,
    KVCS_UNVERIFIED_INVALID_CHECKSUMS,
    KVCS_UNVERIFIED_WORKERS_MISSING,
    KVCS_UNVERIFIED_OTHER_BLOCKS,
    KVCS_UNVERIFIED_ONE_SIDED_GROUP,
    KVCS_UNVERIFIED_FINGERPRINT_DIFFERS,
    KVCS_UNVERIFIED_NO_COMMON_POSITION,
    KVCS_UNVERIFIED_REPLICA_MISSING,
    KVCS_UNVERIFIED_STATE_TP_DIFFERS,
    KVCS_UNVERIFIED_ROLE_DIFFERS,
    KVCS_UNVERIFIED_UNCOMPARED_POSITIONS,
    KVCS_UNVERIFIED_NOT_LOAD_CHECK,
    KVCS_UNVERIFIED_ALGORITHM_DIFFERS,
    KVCS_UNVERIFIED_BLOCK_SIZE_UNKNOWN,
    KVCS_UNVERIFIED_NOTHING_READ,
    KVCS_UNVERIFIED_COVERAGE_DIFFERS,
    KVCS_UNVERIFIED_DECODING_DIFFERS,
    KVCS_UNVERIFIED_GEOMETRY_DIFFERS
});

/// The `group_id` of a finding about the whole load rather than one group.
pub const KVCS_WHOLE_LOAD: u32 = u32::MAX;

/// Block positions of one group that differ (`kvcs_report_mismatch`).
/// Positions are the consumer's; where block sizes differ one entry can
/// span several (runs of the two block sizes' least common multiple).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_mismatch {
    /// The group.
    pub group_id: u32,
    /// 1 if both sides sent per-layer partials (detail mode), so the layer
    /// differences name the layers; 0 otherwise.
    pub localised: u32,
    /// The consumer's first differing block position.
    pub first_position: u64,
    /// Consecutive consumer positions covered.
    pub num_positions: u64,
    /// Request position of the first token compared.
    pub first_token: u64,
    /// Tokens compared.
    pub num_tokens: u64,
    /// Replica checks that differ (`kvcs_report_failed_check`).
    pub num_failed_checks: usize,
    /// Layer differences (`kvcs_report_layer_difference`).
    pub num_layers: usize,
}

/// A layer head range whose partial checksums differ in one replica check.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvcs_layer_difference {
    /// Model-wide layer number.
    pub layer_number: u32,
    /// Global number of the first head of the range.
    pub first_head: u32,
    /// Heads in the range.
    pub num_heads: u32,
    /// The replica check (docs/SPEC.md#4-partial-checksums-replicas-roles) in which it differs.
    pub check: u32,
}

/// A report and the C strings it hands out.
pub(crate) struct ReportHandle {
    pub(crate) report: Report,
    message: CString,
    findings: Vec<CString>,
}

fn c_string(text: &str) -> CString {
    CString::new(text.replace('\0', "\\0")).expect("NULs were replaced")
}

handle!(kvcs_report => ReportHandle);

/// Moves a report behind a new handle.
pub(crate) fn report_into_handle(report: Report) -> *mut kvcs_report {
    let message = c_string(&report.message);
    let findings = report.unverified.iter().map(|f| c_string(&f.message)).collect();
    into_handle(ReportHandle {
        report,
        message,
        findings,
    })
}

fn reason_code(reason: Reason) -> kvcs_unverified_reason {
    use kvcs_unverified_reason::*;
    match reason {
        Reason::NoChecksums => KVCS_UNVERIFIED_NO_CHECKSUMS,
        Reason::InvalidChecksums => KVCS_UNVERIFIED_INVALID_CHECKSUMS,
        Reason::WorkersMissing => KVCS_UNVERIFIED_WORKERS_MISSING,
        Reason::OtherBlocks => KVCS_UNVERIFIED_OTHER_BLOCKS,
        Reason::OneSidedGroup => KVCS_UNVERIFIED_ONE_SIDED_GROUP,
        Reason::FingerprintDiffers => KVCS_UNVERIFIED_FINGERPRINT_DIFFERS,
        Reason::NoCommonPosition => KVCS_UNVERIFIED_NO_COMMON_POSITION,
        Reason::ReplicaMissing => KVCS_UNVERIFIED_REPLICA_MISSING,
        Reason::StateTpDiffers => KVCS_UNVERIFIED_STATE_TP_DIFFERS,
        Reason::RoleDiffers => KVCS_UNVERIFIED_ROLE_DIFFERS,
        Reason::UncomparedPositions => KVCS_UNVERIFIED_UNCOMPARED_POSITIONS,
        Reason::NotLoadCheck => KVCS_UNVERIFIED_NOT_LOAD_CHECK,
        Reason::AlgorithmDiffers => KVCS_UNVERIFIED_ALGORITHM_DIFFERS,
        Reason::BlockSizeUnknown => KVCS_UNVERIFIED_BLOCK_SIZE_UNKNOWN,
        Reason::NothingRead => KVCS_UNVERIFIED_NOTHING_READ,
        Reason::CoverageDiffers => KVCS_UNVERIFIED_COVERAGE_DIFFERS,
        Reason::DecodingDiffers => KVCS_UNVERIFIED_DECODING_DIFFERS,
        Reason::GeometryDiffers => KVCS_UNVERIFIED_GEOMETRY_DIFFERS,
    }
}

fn index_error(what: &str, index: usize, count: usize) -> kvcs_status {
    fail(&err!(OutOfBounds, "{what} {index} is not below {count}"))
}

/// The verdict, a `kvcs_verdict` value.
#[no_mangle]
pub extern "C" fn kvcs_report_verdict(report: *const kvcs_report, verdict: *mut u32) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        not_null!(verdict, "verdict");
        let code = match handle.report.verdict {
            Verdict::Match => kvcs_verdict::KVCS_VERDICT_MATCH,
            Verdict::Mismatch => kvcs_verdict::KVCS_VERDICT_MISMATCH,
            Verdict::Unverified => kvcs_verdict::KVCS_VERDICT_UNVERIFIED,
        };
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(verdict, code as u32) };
        kvcs_status::KVCS_OK
    }
}

/// 1 if the load may proceed under the verifier's policy (a match, or
/// unverified under fail-open), 0 if it failed.
#[no_mangle]
pub extern "C" fn kvcs_report_passed(report: *const kvcs_report, passed: *mut u32) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        not_null!(passed, "passed");
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(passed, handle.report.passed as u32) };
        kvcs_status::KVCS_OK
    }
}

/// The reason of the first finding (a `kvcs_unverified_reason`);
/// `KVCS_UNVERIFIED_NONE` when there is none. An unverified report always
/// has one; a mismatch may list some for other groups.
#[no_mangle]
pub extern "C" fn kvcs_report_reason(report: *const kvcs_report, reason: *mut u32) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        not_null!(reason, "reason");
        let code = handle.report.reason().map_or(kvcs_unverified_reason::KVCS_UNVERIFIED_NONE, reason_code);
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(reason, code as u32) };
        kvcs_status::KVCS_OK
    }
}

/// One line saying the verdict, the differing positions (and layers) and
/// the findings, for a log; valid until the report is destroyed.
#[no_mangle]
pub extern "C" fn kvcs_report_message(report: *const kvcs_report, message: *mut *const c_char) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        not_null!(message, "message");
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(message, handle.message.as_ptr()) };
        kvcs_status::KVCS_OK
    }
}

/// Block positions compared, over all groups (in runs where block sizes
/// differ), those that differ included: a payload check counts every
/// position it compared, an offload load check (`kvcs_verifier_check_stored`)
/// every position checked by every worker or failed by some.
#[no_mangle]
pub extern "C" fn kvcs_report_compared_positions(report: *const kvcs_report, positions: *mut u64) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        not_null!(positions, "positions");
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(positions, handle.report.compared_positions) };
        kvcs_status::KVCS_OK
    }
}

/// The consumer's loaded block positions (holding valid tokens, in the
/// groups compared) that no compared position covers: where block sizes
/// differ, a leading partial run; positions past the producer's token count.
/// A match says nothing about them. Counted apart from
/// `kvcs_report_compared_positions`; 0 when everything loaded was compared.
#[no_mangle]
pub extern "C" fn kvcs_report_uncompared_positions(report: *const kvcs_report, positions: *mut u64) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        not_null!(positions, "positions");
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(positions, handle.report.uncompared_positions) };
        kvcs_status::KVCS_OK
    }
}

/// The number of uncompared ranges (`kvcs_report_uncompared`): where the
/// positions `kvcs_report_uncompared_positions` counts lie. 0 when
/// everything loaded was compared.
#[no_mangle]
pub extern "C" fn kvcs_report_num_uncompared(report: *const kvcs_report, count: *mut usize) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        not_null!(count, "count");
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(count, handle.report.uncompared.len()) };
        kvcs_status::KVCS_OK
    }
}

/// Uncompared range `index` (below `kvcs_report_num_uncompared`): the
/// consumer's block positions `first_position .. first_position +
/// num_positions` of group `group_id` were loaded (hold valid tokens) but
/// no compared position covers them, so the verdict says nothing about
/// them. Ranges of one group are ascending and not adjacent; together they
/// hold `kvcs_report_uncompared_positions` positions. Any out-pointer may
/// be NULL.
#[no_mangle]
pub extern "C" fn kvcs_report_uncompared(
    report: *const kvcs_report,
    index: usize,
    group_id: *mut u32,
    first_position: *mut u64,
    num_positions: *mut u64,
) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        let ranges = &handle.report.uncompared;
        let Some(range) = ranges.get(index) else {
            return index_error("index", index, ranges.len());
        };
        // SAFETY: each is NULL or writable per the contract.
        unsafe {
            write_out(group_id, range.group_id);
            write_out(first_position, range.first_position);
            write_out(num_positions, range.num_positions);
        }
        kvcs_status::KVCS_OK
    }
}

/// The number of mismatch entries.
#[no_mangle]
pub extern "C" fn kvcs_report_num_mismatches(report: *const kvcs_report, count: *mut usize) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        not_null!(count, "count");
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(count, handle.report.mismatches.len()) };
        kvcs_status::KVCS_OK
    }
}

/// Mismatch entry `index` (below `kvcs_report_num_mismatches`).
#[no_mangle]
pub extern "C" fn kvcs_report_mismatch(
    report: *const kvcs_report,
    index: usize,
    out: *mut kvcs_mismatch,
) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        not_null!(out, "out");
        let mismatches = &handle.report.mismatches;
        let Some(m) = mismatches.get(index) else {
            return index_error("index", index, mismatches.len());
        };
        let entry = kvcs_mismatch {
            group_id: m.group_id,
            localised: m.localised as u32,
            first_position: m.first_position,
            num_positions: m.num_positions,
            first_token: m.first_token,
            num_tokens: m.num_tokens,
            num_failed_checks: m.failed_checks.len(),
            num_layers: m.layers.len(),
        };
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(out, entry) };
        kvcs_status::KVCS_OK
    }
}

/// Replica check `index` that differs in mismatch entry `mismatch`. Check
/// `k` compares copy `k % R` of every layer replicated on `R` ranks.
#[no_mangle]
pub extern "C" fn kvcs_report_failed_check(
    report: *const kvcs_report,
    mismatch: usize,
    index: usize,
    check: *mut u32,
) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        not_null!(check, "check");
        let mismatches = &handle.report.mismatches;
        let Some(m) = mismatches.get(mismatch) else {
            return index_error("mismatch", mismatch, mismatches.len());
        };
        let Some(&value) = m.failed_checks.get(index) else {
            return index_error("index", index, m.failed_checks.len());
        };
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(check, value) };
        kvcs_status::KVCS_OK
    }
}

/// Layer difference `index` of mismatch entry `mismatch` (detail mode).
#[no_mangle]
pub extern "C" fn kvcs_report_layer_difference(
    report: *const kvcs_report,
    mismatch: usize,
    index: usize,
    out: *mut kvcs_layer_difference,
) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        not_null!(out, "out");
        let mismatches = &handle.report.mismatches;
        let Some(m) = mismatches.get(mismatch) else {
            return index_error("mismatch", mismatch, mismatches.len());
        };
        let Some(layer) = m.layers.get(index) else {
            return index_error("index", index, m.layers.len());
        };
        let entry = kvcs_layer_difference {
            layer_number: layer.layer_number,
            first_head: layer.first_head,
            num_heads: layer.num_heads,
            check: layer.check,
        };
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(out, entry) };
        kvcs_status::KVCS_OK
    }
}

/// The number of findings (reasons the load or a group was not compared).
#[no_mangle]
pub extern "C" fn kvcs_report_num_unverified(report: *const kvcs_report, count: *mut usize) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        not_null!(count, "count");
        // SAFETY: non-NULL (checked) and writable per the contract.
        unsafe { write_out(count, handle.report.unverified.len()) };
        kvcs_status::KVCS_OK
    }
}

/// Finding `index`: its reason (a `kvcs_unverified_reason`), its group
/// (`KVCS_WHOLE_LOAD` for the whole load) and its message (valid until the
/// report is destroyed). Any out-pointer may be NULL.
#[no_mangle]
pub extern "C" fn kvcs_report_unverified(
    report: *const kvcs_report,
    index: usize,
    reason: *mut u32,
    group_id: *mut u32,
    message: *mut *const c_char,
) -> kvcs_status {
    ffi_boundary! {
        let handle = try_handle!(report, "report");
        let findings = &handle.report.unverified;
        let Some(finding) = findings.get(index) else {
            return index_error("index", index, findings.len());
        };
        // SAFETY: each is NULL or writable per the contract.
        unsafe {
            write_out(reason, reason_code(finding.reason) as u32);
            write_out(group_id, finding.group_id.unwrap_or(KVCS_WHOLE_LOAD));
            write_out(message, handle.findings[index].as_ptr());
        }
        kvcs_status::KVCS_OK
    }
}

/// Frees a report. NULL is a no-op.
#[no_mangle]
pub extern "C" fn kvcs_report_destroy(report: *mut kvcs_report) {
    ffi_boundary! {
        // SAFETY: NULL, or made by `kvcs_verifier_check*` and not freed before (the contract).
        unsafe { free(report) };
    }
}

/// The name of a verdict ("KVCS_VERDICT_MATCH", ...), a static string;
/// "unknown kvcs_verdict" for a value that is none. Never NULL.
#[no_mangle]
pub extern "C" fn kvcs_verdict_name(verdict: u32) -> *const c_char {
    kvcs_verdict::name_of(verdict).as_ptr()
}

/// The name of an unverified reason ("KVCS_UNVERIFIED_WORKERS_MISSING",
/// ...), a static string; "unknown kvcs_unverified_reason" for a value that
/// is none. Never NULL.
#[no_mangle]
pub extern "C" fn kvcs_unverified_reason_name(reason: u32) -> *const c_char {
    kvcs_unverified_reason::name_of(reason).as_ptr()
}
