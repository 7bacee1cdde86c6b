//! `kvcs_verifier`: the scheduler side of verification (host only), and the
//! base64 helpers for `kv_transfer_params["kv_checksums"]`.

// C entry points take raw pointers by design; their documented contract,
// not `unsafe fn`, is what C callers see.

use std::ffi::c_char;

use super::blocks::kvcs_blocks;
use super::buffer::write_bytes;
use super::c_enum::c_enum;
use super::handle::{free, handle, into_handle, try_handle};
use super::panic::ffi_boundary;
use super::report::{kvcs_report, report_into_handle};
use super::status::{fail, kvcs_status};
use super::{c_array, c_str, not_null, try_engine, write_out};
use crate::base::error::err;

use crate::verify::{Policy, Verifier};
use crate::wire::payload::{decode_base64, encode_base64};

/// Collects every worker's records of requests and verifies loads
/// (docs/SPEC.md#4-partial-checksums-replicas-roles,
/// docs/SPEC.md#9-payload-producer-to-consumer,
/// docs/SPEC.md#10-verification): a producer's verifier builds payloads, a consumer's
/// judges finished loads against them.
///
/// Ownership: created by `kvcs_verifier_create`, freed by
/// `kvcs_verifier_destroy`. Reports it makes are independent of it.
/// Thread safety: unlike other handles, every call except
/// `kvcs_verifier_destroy` may run concurrently with any other on the same
/// verifier, from any thread: one mutex inside guards its state, held only
/// to read or change it (records are decoded, payloads built and loads
/// compared outside it), so no call waits on another's heavy work.
#[allow(non_camel_case_types)]
pub struct kvcs_verifier {
    _private: [u8; 0],
}

/// What a verifier does with an unverified load.
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvcs_policy {
    /// Unverified loads pass (the report's message is the warning to log).
    KVCS_POLICY_FAIL_OPEN = 0,
    /// Unverified loads fail like mismatches (the default).
    KVCS_POLICY_FAIL_CLOSED = 1,
}

c_enum!(kvcs_policy {
    KVCS_POLICY_FAIL_OPEN,
    KVCS_POLICY_FAIL_CLOSED
});

handle!(kvcs_verifier => Verifier);

/// Creates a verifier for an engine of `num_workers` workers (TP size x PP
/// stages; at least 1), fail-closed, with plain payloads. `*out` owns it.
#[no_mangle]
pub extern "C" fn kvcs_verifier_create(num_workers: u32, out: *mut *mut kvcs_verifier) -> kvcs_status {
    ffi_boundary! {
        not_null!(out, "out");
        let verifier = try_engine!(Verifier::new(num_workers));
        // SAFETY: `out` is non-NULL (checked above) and writable per the contract.
        unsafe { out.write(into_handle(verifier)) };
        kvcs_status::KVCS_OK
    }
}

/// Frees a verifier and every request's state. NULL is a no-op.
#[no_mangle]
pub extern "C" fn kvcs_verifier_destroy(verifier: *mut kvcs_verifier) {
    ffi_boundary! {
        // SAFETY: NULL, or made by `kvcs_verifier_create` and not freed
        // before; no other call is running on it (the contract).
        unsafe { free(verifier) };
    }
}

/// Sets what unverified loads do: `policy` is a `kvcs_policy` value.
#[no_mangle]
pub extern "C" fn kvcs_verifier_set_policy(verifier: *mut kvcs_verifier, policy: u32) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        let policy = match try_engine!(kvcs_policy::from_arg(policy, "policy")) {
            kvcs_policy::KVCS_POLICY_FAIL_OPEN => Policy::FailOpen,
            kvcs_policy::KVCS_POLICY_FAIL_CLOSED => Policy::FailClosed,
        };
        try_engine!(verifier.set_policy(policy));
        kvcs_status::KVCS_OK
    }
}

/// Producer: `on` = 1 makes payloads carry the kvcsum extension (the
/// producer's TP size and block sizes, the checksum algorithm, and
/// per-layer partials where every worker is in detail mode), which only
/// kvcsum consumers read; 0 (the default) gives the plain payload vLLM
/// reads, but only for `KVCS_ALGORITHM_WEIGHTED` values: a payload of
/// `KVCS_ALGORITHM_MIXED2` (the workers' default) or `KVCS_ALGORITHM_MIXED`
/// values always carries the extension, since a plain payload means weighted
/// (docs/SPEC.md#9-payload-producer-to-consumer). Records of different
/// algorithms make no payload (`kvcs_verifier_payload` fails with
/// `KVCS_ERR_INVALID_ARGUMENT`).
#[no_mangle]
pub extern "C" fn kvcs_verifier_set_extension(verifier: *mut kvcs_verifier, on: u32) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        let on = try_engine!(super::flag_arg(on, "on"));
        try_engine!(verifier.set_extension(on));
        kvcs_status::KVCS_OK
    }
}

/// Consumer: `on` = 1 (the default) makes a load unverified
/// (`KVCS_UNVERIFIED_UNCOMPARED_POSITIONS`, the finding naming each group's
/// uncompared ranges) when some loaded position was not compared
/// (`kvcs_report_uncompared_positions` > 0) and none differs: positions
/// nobody compared never count as passed. 0 is the explicit opt-out of a
/// consumer that reloads or recomputes the positions
/// `kvcs_report_uncompared` lists itself (the vLLM connector does): the
/// load is then judged on the positions both sides hold with equal valid
/// tokens alone. Applies to `kvcs_verifier_check` and
/// `kvcs_verifier_check_stored`.
#[no_mangle]
pub extern "C" fn kvcs_verifier_set_require_coverage(verifier: *mut kvcs_verifier, on: u32) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        let on = try_engine!(super::flag_arg(on, "on"));
        try_engine!(verifier.set_require_coverage(on));
        kvcs_status::KVCS_OK
    }
}

/// Consumer: the producer's TP size, for payloads that do not carry it
/// (plain ones). Shard-keyed state groups (docs/SPEC.md#6-state-mamba-groups) are compared
/// only when it is known and equal to the consumer's.
#[no_mangle]
pub extern "C" fn kvcs_verifier_set_producer_tp_size(verifier: *mut kvcs_verifier, tp_size: u32) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        try_engine!(verifier.set_producer_tp_size(tp_size));
        kvcs_status::KVCS_OK
    }
}

/// Consumer: the producer's block size of group `group_id`, for payloads
/// that do not carry it (plain ones). A plain payload says nothing of it,
/// so without this call its attention groups are UNVERIFIED
/// (`KVCS_UNVERIFIED_BLOCK_SIZE_UNKNOWN`), whatever the consumer's block
/// size: call it even where both sides use the same. The value is trusted
/// as given. Different block sizes are compared in runs of their least
/// common multiple of tokens.
#[no_mangle]
pub extern "C" fn kvcs_verifier_set_producer_block_size(
    verifier: *mut kvcs_verifier,
    group_id: u32,
    block_size: u32,
) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        try_engine!(verifier.set_producer_block_size(group_id, block_size));
        kvcs_status::KVCS_OK
    }
}

/// Registers every request of `scheduled` in `role` (a `kvcs_role` value)
/// with the blocks its workers were scheduled to checksum; a request
/// expected before starts over. The block set is copied.
#[no_mangle]
pub extern "C" fn kvcs_verifier_expect(
    verifier: *mut kvcs_verifier,
    scheduled: *const kvcs_blocks,
    role: u32,
) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        let scheduled = try_handle!(scheduled, "scheduled");
        let role = try_engine!(super::worker::role_arg(role));
        try_engine!(verifier.expect(scheduled, role));
        kvcs_status::KVCS_OK
    }
}

/// Drops the state of request `req_id`; `KVCS_ERR_NOT_FOUND` if it was not
/// expected.
#[no_mangle]
pub extern "C" fn kvcs_verifier_forget(verifier: *mut kvcs_verifier, req_id: *const c_char) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        if !try_engine!(verifier.forget(req_id)) {
            return fail(&err!(NotFound, "req_id {req_id:?} is not expected by this verifier"));
        }
        kvcs_status::KVCS_OK
    }
}

/// Adds a worker's record (`len` bytes from `kvcs_result_encode`). Parts of
/// requests not expected are ignored; a record of no expected request gives
/// `KVCS_OK` and changes nothing (it pins no TP size). A worker's newer
/// record of a request replaces its older one. `KVCS_ERR_MALFORMED` (with a
/// message) for bytes that are not a valid record;
/// `KVCS_ERR_INVALID_ARGUMENT` for a rank that does not fit `num_workers`,
/// or a TP size other than that of the records held (for requests still
/// expected). On error nothing is kept. A record computed in the other role
/// than its request is expected in is kept, and makes the load unverified
/// (`KVCS_UNVERIFIED_ROLE_DIFFERS`) or the payload fail.
#[no_mangle]
pub extern "C" fn kvcs_verifier_add_record(verifier: *mut kvcs_verifier, record: *const u8, len: usize) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        // SAFETY: the contract gives `len` readable bytes.
        let record = try_engine!(unsafe { c_array(record, len, "record") });
        try_engine!(verifier.add_record(record));
        kvcs_status::KVCS_OK
    }
}

/// Producer: the payload of request `req_id` (docs/SPEC.md#9-payload-producer-to-consumer), into
/// `(buf, cap)` with its length in `*len`; `(NULL, 0)` asks for the size
/// (`KVCS_ERR_BUFFER_TOO_SMALL` with `*len` set). `KVCS_ERR_NOT_READY` until
/// every worker reported the request; `KVCS_ERR_INVALID_ARGUMENT` when the
/// records cannot make a payload (the message says why: a worker
/// checksummed other blocks than scheduled, ...); `KVCS_ERR_NOT_FOUND` for a
/// request not expected. Send nothing when this fails: the consumer then
/// reports "the producer sent no checksums".
#[no_mangle]
pub extern "C" fn kvcs_verifier_payload(
    verifier: *mut kvcs_verifier,
    req_id: *const c_char,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        not_null!(len, "len");
        let bytes = try_engine!(verifier.payload(req_id)).encode();
        // SAFETY: `buf` has `cap` writable bytes and `len` is writable per the contract.
        unsafe { write_bytes(&bytes, buf, cap, len) }
    }
}

fn report_out(report: crate::Result<crate::verify::Report>, out: *mut *mut kvcs_report) -> kvcs_status {
    let report = try_engine!(report);
    // SAFETY: callers checked `out` is non-NULL; writable per the contract.
    unsafe { write_out(out, report_into_handle(report)) };
    kvcs_status::KVCS_OK
}

/// Consumer: judges the finished load of request `req_id` against the
/// producer's payload bytes `(payload, len)`; `*out` owns the report (free
/// with `kvcs_report_destroy`). Bytes that are not a payload give an
/// unverified report (invalid checksums), not an error. Use
/// `kvcs_verifier_check_no_payload` when the producer sent nothing.
/// `KVCS_ERR_NOT_FOUND` for a request not expected,
/// `KVCS_ERR_INVALID_ARGUMENT` for one expected as a producer.
#[no_mangle]
pub extern "C" fn kvcs_verifier_check(
    verifier: *mut kvcs_verifier,
    req_id: *const c_char,
    payload: *const u8,
    len: usize,
    out: *mut *mut kvcs_report,
) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        // SAFETY: the contract gives `len` readable bytes.
        let payload = try_engine!(unsafe { c_array(payload, len, "payload") });
        not_null!(out, "out");
        report_out(verifier.check(req_id, Some(payload)), out)
    }
}

/// Like `kvcs_verifier_check`, with the payload as the NUL-terminated
/// base64 text of `kv_transfer_params["kv_checksums"]`; text that is not
/// standard padded base64 gives an unverified report (invalid checksums).
#[no_mangle]
pub extern "C" fn kvcs_verifier_check_base64(
    verifier: *mut kvcs_verifier,
    req_id: *const c_char,
    payload_base64: *const c_char,
    out: *mut *mut kvcs_report,
) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        if payload_base64.is_null() {
            return fail(&err!(InvalidArgument, "payload_base64 is NULL"));
        }
        // SAFETY: non-NULL and NUL-terminated per the contract.
        let text = unsafe { std::ffi::CStr::from_ptr(payload_base64) }.to_bytes();
        not_null!(out, "out");
        report_out(verifier.check_base64(req_id, text), out)
    }
}

/// Consumer: judges the finished load of request `req_id` for which the
/// producer sent no checksums: an unverified report ("the producer sent no
/// checksums") once every worker reported, else "not every worker
/// reported". `*out` owns the report.
#[no_mangle]
pub extern "C" fn kvcs_verifier_check_no_payload(
    verifier: *mut kvcs_verifier,
    req_id: *const c_char,
    out: *mut *mut kvcs_report,
) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        not_null!(out, "out");
        report_out(verifier.check(req_id, None), out)
    }
}

/// Consumer: judges the finished offload load of request `req_id`
/// (docs/SPEC.md#8-stored-checksums-for-offloaded-kv) from its workers'
/// load-check records alone (`kvcs_worker_check_stored`, then
/// `kvcs_result_encode` and `kvcs_verifier_add_record`); an offload has no
/// producer payload. `*out` owns the report: a match when every worker's
/// stored checksums matched at every position it checked; a mismatch
/// naming each group and block position (with its tokens) where some
/// worker's failed (the message names the workers; entries have no replica
/// checks); unverified when not every worker reported, or some record is
/// not a load check's (`KVCS_UNVERIFIED_NOT_LOAD_CHECK`).
/// `KVCS_ERR_NOT_FOUND` for a request not expected,
/// `KVCS_ERR_INVALID_ARGUMENT` for one expected as a producer.
#[no_mangle]
pub extern "C" fn kvcs_verifier_check_stored(
    verifier: *mut kvcs_verifier,
    req_id: *const c_char,
    out: *mut *mut kvcs_report,
) -> kvcs_status {
    ffi_boundary! {
        let verifier = try_handle!(verifier, "verifier");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        not_null!(out, "out");
        report_out(verifier.check_stored(req_id), out)
    }
}

/// Writes `(bytes, len)` as standard padded base64 text followed by a NUL
/// into `(buf, cap)`; `*text_len` receives the bytes used, NUL included
/// (on `KVCS_ERR_BUFFER_TOO_SMALL`: the bytes needed). `(NULL, 0)` asks for
/// the size.
#[no_mangle]
pub extern "C" fn kvcs_base64_encode(
    bytes: *const u8,
    len: usize,
    buf: *mut c_char,
    cap: usize,
    text_len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: the contract gives `len` readable bytes.
        let bytes = try_engine!(unsafe { c_array(bytes, len, "bytes") });
        not_null!(text_len, "text_len");
        let mut text = encode_base64(bytes).into_bytes();
        text.push(0);
        // SAFETY: `buf` has `cap` writable bytes and `text_len` is writable per the contract.
        unsafe { write_bytes(&text, buf.cast(), cap, text_len) }
    }
}

/// Decodes `text_len` bytes of standard padded base64 `text` (no NUL needed)
/// into `(buf, cap)`, the decoded length in `*len`; `(NULL, 0)` asks for the
/// size. `KVCS_ERR_MALFORMED` for text that is not standard padded base64.
#[no_mangle]
pub extern "C" fn kvcs_base64_decode(
    text: *const c_char,
    text_len: usize,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: the contract gives `text_len` readable bytes.
        let text = try_engine!(unsafe { c_array(text.cast::<u8>(), text_len, "text") });
        let bytes = try_engine!(decode_base64(text));
        // SAFETY: `buf` has `cap` writable bytes and `len` is writable per the contract.
        unsafe { write_bytes(&bytes, buf, cap, len) }
    }
}
