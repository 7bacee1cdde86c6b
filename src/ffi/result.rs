//! `kvcs_result`: a worker's partial checksums of one call.

use std::ffi::c_char;

use super::buffer::write_named;
use super::c_enum::c_enum;
use super::handle::{free, handle, try_handle};
use super::panic::ffi_boundary;
use super::status::kvcs_status;
use super::{c_array, c_str, not_null, try_engine, write_out};
use crate::engines::stored;
use crate::results::checksums::{Checksums, StoredOutcome};

/// The partial checksums of one `kvcs_worker_checksum` call: per request and
/// group, one column per replica key, one value per block position.
///
/// Ownership: made by `kvcs_worker_checksum`, freed by `kvcs_result_destroy`
/// (also while a device is still computing it: the values are then dropped
/// once the device is done). Independent of its worker.
/// Thread safety: `const kvcs_result *` calls may run concurrently;
/// `kvcs_result_wait` and `kvcs_result_destroy` need exclusive access.
#[allow(non_camel_case_types)]
pub struct kvcs_result {
    _private: [u8; 0],
}

handle!(kvcs_result => Checksums);

/// `KVCS_OK` once the values are readable, `KVCS_ERR_NOT_READY` while a
/// device is computing them; never blocks. Host results are ready at once.
#[no_mangle]
pub extern "C" fn kvcs_result_query(result: *const kvcs_result) -> kvcs_status {
    ffi_boundary! {
        let result = try_handle!(result, "result");
        match try_engine!(result.is_ready()) {
            true => kvcs_status::KVCS_OK,
            false => super::status::fail(&crate::base::error::Error::NotReady(
                "the result is still being computed on the device".to_owned(),
            )),
        }
    }
}

/// Blocks until the values are readable.
#[no_mangle]
pub extern "C" fn kvcs_result_wait(result: *mut kvcs_result) -> kvcs_status {
    ffi_boundary! {
        let result = try_handle!(result, "result");
        try_engine!(result.wait());
        kvcs_status::KVCS_OK
    }
}

/// The shape of group `group_id` of request `req_id`: its first position,
/// its number of positions and of columns. Any out-pointer may be NULL.
/// `KVCS_ERR_NOT_FOUND` for a request or group not in the result (a skipped
/// group too, with the worker's reason). Readable before the values are.
#[no_mangle]
pub extern "C" fn kvcs_result_group(
    result: *const kvcs_result,
    req_id: *const c_char,
    group_id: u32,
    first_position: *mut u64,
    num_positions: *mut usize,
    num_columns: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let result = try_handle!(result, "result");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        let group = try_engine!(result.group(req_id, group_id));
        // SAFETY: each is NULL or writable per the contract.
        unsafe {
            write_out(first_position, group.first_position);
            write_out(num_positions, group.num_positions);
            write_out(num_columns, group.columns.len());
        }
        kvcs_status::KVCS_OK
    }
}

/// Column `column` of group `group_id` of request `req_id`: its replica key
/// and its `num_positions` values, copied to `values` (which may be NULL only
/// when `num_positions` is 0). `replicas` and `replica_index` may be NULL.
/// `KVCS_ERR_NOT_READY` while a device is computing,
/// `KVCS_ERR_OUT_OF_BOUNDS` for a column at or past `num_columns`.
///
/// Deprecated: it writes a count it never sees; use
/// `kvcs_result_column_buf`, which takes the buffer's capacity. Kept for
/// ABI 2.
#[no_mangle]
pub extern "C" fn kvcs_result_column(
    result: *const kvcs_result,
    req_id: *const c_char,
    group_id: u32,
    column: usize,
    replicas: *mut u32,
    replica_index: *mut u32,
    values: *mut u64,
) -> kvcs_status {
    ffi_boundary! {
        let result = try_handle!(result, "result");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        let (key, column_values) = try_engine!(result.column(req_id, group_id, column));
        if values.is_null() && !column_values.is_empty() {
            return super::status::fail(&crate::base::error::Error::InvalidArgument(format!(
                "values is NULL for {} positions", column_values.len()
            )));
        }
        // SAFETY: the contract gives `num_positions` writable values.
        unsafe {
            if !column_values.is_empty() {
                std::ptr::copy_nonoverlapping(column_values.as_ptr(), values, column_values.len());
            }
            write_out(replicas, key.replicas);
            write_out(replica_index, key.replica_index);
        }
        kvcs_status::KVCS_OK
    }
}

/// A load check's verdict on one block position (`kvcs_result_stored`).
#[allow(non_camel_case_types)]
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvcs_stored_outcome {
    /// The recomputed checksum differs from the stored one.
    KVCS_STORED_FAILED = 0,
    /// The recomputed checksum equals the stored one.
    KVCS_STORED_MATCHED = 1,
    /// Not checked: the position holds no valid token.
    KVCS_STORED_NOT_CHECKED = 2,
    /// Not compared: a clean entry stored by a worker whose group has other
    /// layers, identities, heads or block size (another fingerprint); a
    /// configuration change, judged unverified (SPEC section 8). A damaged
    /// entry fails instead.
    KVCS_STORED_OTHER_FINGERPRINT = 3,
    /// Not compared: the value was stored with another checksum algorithm.
    KVCS_STORED_OTHER_ALGORITHM = 4,
    /// Not compared: stored when the block held another number of valid
    /// tokens (a partial last block stored, the request longer when loaded).
    KVCS_STORED_OTHER_TOKENS = 5,
    /// Not compared: an entry of kvcsum 0.2.0's format, stored under this
    /// configuration, whose value does not match (that format cannot tell
    /// corruption from another token count). One whose value matches is
    /// `KVCS_STORED_MATCHED`.
    KVCS_STORED_OTHER_FORMAT = 6,
}

c_enum!(kvcs_stored_outcome {
    KVCS_STORED_FAILED,
    KVCS_STORED_MATCHED,
    KVCS_STORED_NOT_CHECKED,
    KVCS_STORED_OTHER_FINGERPRINT,
    KVCS_STORED_OTHER_ALGORITHM,
    KVCS_STORED_OTHER_TOKENS,
    KVCS_STORED_OTHER_FORMAT
});

impl kvcs_stored_outcome {
    /// The C value of an engine outcome.
    pub(super) fn of(outcome: StoredOutcome) -> kvcs_stored_outcome {
        match outcome {
            StoredOutcome::Failed => kvcs_stored_outcome::KVCS_STORED_FAILED,
            StoredOutcome::Matched => kvcs_stored_outcome::KVCS_STORED_MATCHED,
            StoredOutcome::NotChecked => kvcs_stored_outcome::KVCS_STORED_NOT_CHECKED,
            StoredOutcome::OtherFingerprint => kvcs_stored_outcome::KVCS_STORED_OTHER_FINGERPRINT,
            StoredOutcome::OtherAlgorithm => kvcs_stored_outcome::KVCS_STORED_OTHER_ALGORITHM,
            StoredOutcome::OtherTokens => kvcs_stored_outcome::KVCS_STORED_OTHER_TOKENS,
            StoredOutcome::OtherFormat => kvcs_stored_outcome::KVCS_STORED_OTHER_FORMAT,
        }
    }
}

/// A load check's verdicts (`kvcs_worker_check_stored`) on group `group_id`
/// of request `req_id`: one `kvcs_stored_outcome` value per block position
/// (`num_positions` of `kvcs_result_group`) written to `outcomes`.
/// `KVCS_ERR_NOT_FOUND` when the result is not a load check's or the group
/// is not in it, `KVCS_ERR_NOT_READY` while a device computes.
///
/// Deprecated: it writes a count it never sees; use
/// `kvcs_result_stored_buf`, which takes the buffer's capacity. Kept for
/// ABI 2.
#[no_mangle]
pub extern "C" fn kvcs_result_stored(
    result: *const kvcs_result,
    req_id: *const c_char,
    group_id: u32,
    outcomes: *mut u8,
) -> kvcs_status {
    ffi_boundary! {
        let result = try_handle!(result, "result");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        let verdicts = try_engine!(result.stored_outcomes(req_id, group_id));
        if outcomes.is_null() && !verdicts.is_empty() {
            return super::status::fail(&crate::base::error::Error::InvalidArgument(format!(
                "outcomes is NULL for {} positions", verdicts.len()
            )));
        }
        for (i, &verdict) in verdicts.iter().enumerate() {
            // SAFETY: the contract gives `num_positions` writable bytes.
            unsafe { outcomes.add(i).write(kvcs_stored_outcome::of(verdict) as u8) };
        }
        kvcs_status::KVCS_OK
    }
}

/// The entries of docs/SPEC.md#8-stored-checksums-for-offloaded-kv that
/// `kvcs_worker_store` would write for group `group_id` of request `req_id`
/// of `result`, for connectors that keep stored checksums themselves: two
/// words per block position (`num_positions` of `kvcs_result_group`)
/// written to `entries`, the value (`sum XOR tag`) then the stamp (the
/// configuration, algorithm and valid tokens that computed it, with a check
/// binding them to the block hash), as numbers (a buffer of
/// `kvcs_worker_add_stored` holds them little-endian). A position holding no
/// valid token gets `(0, 0)`: a store writes nothing there. Keep both words
/// with the block and judge them with `kvcs_result_check_entries`: the
/// value alone cannot tell a configuration change from corruption.
///
/// `result` is a `kvcs_worker_checksum` of `KVCS_ROLE_CONSUMER` (every
/// column; `KVCS_ERR_INVALID_ARGUMENT` for a producer's) of blocks with
/// block hashes (`kvcs_blocks_set_hashes`; `KVCS_ERR_INVALID_ARGUMENT`
/// without). `KVCS_ERR_NOT_FOUND` for a request or group not in it (or
/// skipped), `KVCS_ERR_NOT_READY` while a device computes.
///
/// Deprecated: it writes a count it never sees; use
/// `kvcs_result_entries_buf`, which takes the buffer's capacity. Kept for
/// ABI 2.
#[no_mangle]
pub extern "C" fn kvcs_result_entries(
    result: *const kvcs_result,
    req_id: *const c_char,
    group_id: u32,
    entries: *mut u64,
) -> kvcs_status {
    ffi_boundary! {
        let result = try_handle!(result, "result");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        let found = try_engine!(stored::result_entries(result, req_id, group_id));
        if entries.is_null() && !found.is_empty() {
            return super::status::fail(&crate::base::error::Error::InvalidArgument(format!(
                "entries is NULL for {} positions", found.len()
            )));
        }
        for (i, &(value, stamp)) in found.iter().enumerate() {
            // SAFETY: the contract gives 2 * `num_positions` writable words.
            unsafe {
                entries.add(2 * i).write(value);
                entries.add(2 * i + 1).write(stamp);
            }
        }
        kvcs_status::KVCS_OK
    }
}

/// The load check of docs/SPEC.md#8-stored-checksums-for-offloaded-kv
/// against entries the caller kept (`kvcs_result_entries` of the stored
/// blocks, copied with them): `entries` holds two words per block position
/// of group `group_id` of request `req_id` (value, stamp), and `outcomes`
/// gets one `kvcs_stored_outcome` per position, as `kvcs_result_stored`
/// gives them after `kvcs_worker_check_stored`: matched, failed (the data
/// or the entry changed, or it is another block's), not checked, or not
/// compared because another configuration, algorithm, valid-token count or
/// format stored it. Requirements and errors as `kvcs_result_entries`.
///
/// Deprecated: it reads and writes counts it never sees; use
/// `kvcs_result_check_entries_buf`, which takes both lengths. Kept for
/// ABI 2.
#[no_mangle]
pub extern "C" fn kvcs_result_check_entries(
    result: *const kvcs_result,
    req_id: *const c_char,
    group_id: u32,
    entries: *const u64,
    outcomes: *mut u8,
) -> kvcs_status {
    ffi_boundary! {
        let result = try_handle!(result, "result");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        let (_, blocks) = try_engine!(result.given_blocks(req_id, group_id));
        let positions = blocks.block_ids.len();
        let Some(words) = positions.checked_mul(2) else {
            return super::status::fail(&crate::base::error::Error::InvalidArgument(format!(
                "2 x {positions} positions overflows"
            )));
        };
        // SAFETY: the contract gives 2 * `num_positions` readable words.
        let words = try_engine!(unsafe { c_array(entries, words, "entries") });
        let pairs: Vec<(u64, u64)> = words.chunks_exact(2).map(|pair| (pair[0], pair[1])).collect();
        let verdicts = try_engine!(stored::check_result_entries(result, req_id, group_id, &pairs));
        if outcomes.is_null() && !verdicts.is_empty() {
            return super::status::fail(&crate::base::error::Error::InvalidArgument(format!(
                "outcomes is NULL for {} positions", verdicts.len()
            )));
        }
        for (i, &verdict) in verdicts.iter().enumerate() {
            // SAFETY: the contract gives `num_positions` writable bytes.
            unsafe { outcomes.add(i).write(kvcs_stored_outcome::of(verdict) as u8) };
        }
        kvcs_status::KVCS_OK
    }
}

/// Column `column` of group `group_id` of request `req_id`, as
/// `kvcs_result_column` gives it, into the caller's buffer of `cap`
/// values (the buffer convention of `kvcs_result_encode`): `*len` gets the
/// number of values (`num_positions`), and a `cap` below it gives
/// `KVCS_ERR_BUFFER_TOO_SMALL` with `*len` set to the number needed and
/// nothing else written; `(NULL, 0)` asks for it. `replicas` and
/// `replica_index` may be NULL; they are written on success. Errors as
/// `kvcs_result_column`; `len` NULL is `KVCS_ERR_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn kvcs_result_column_buf(
    result: *const kvcs_result,
    req_id: *const c_char,
    group_id: u32,
    column: usize,
    replicas: *mut u32,
    replica_index: *mut u32,
    values: *mut u64,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let result = try_handle!(result, "result");
        not_null!(len, "len");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        let (key, column_values) = try_engine!(result.column(req_id, group_id, column));
        // SAFETY: `values` has `cap` writable values and `len` is writable per the contract.
        let status = unsafe { write_named(column_values, (values, "values"), cap, len, "values") };
        if status == kvcs_status::KVCS_OK {
            // SAFETY: each is NULL or writable per the contract.
            unsafe {
                write_out(replicas, key.replicas);
                write_out(replica_index, key.replica_index);
            }
        }
        status
    }
}

/// A load check's verdicts on group `group_id` of request `req_id`, as
/// `kvcs_result_stored` gives them (one `kvcs_stored_outcome` byte per
/// block position), into the caller's `cap` bytes at `outcomes`, with the
/// count in `*len` (the buffer convention: a `cap` below it gives
/// `KVCS_ERR_BUFFER_TOO_SMALL` with `*len` set and nothing written).
/// Errors as `kvcs_result_stored`.
#[no_mangle]
pub extern "C" fn kvcs_result_stored_buf(
    result: *const kvcs_result,
    req_id: *const c_char,
    group_id: u32,
    outcomes: *mut u8,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let result = try_handle!(result, "result");
        not_null!(len, "len");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        let verdicts = try_engine!(result.stored_outcomes(req_id, group_id));
        let bytes: Vec<u8> = verdicts.iter().map(|&verdict| kvcs_stored_outcome::of(verdict) as u8).collect();
        // SAFETY: `outcomes` has `cap` writable bytes and `len` is writable per the contract.
        unsafe { write_named(&bytes, (outcomes, "outcomes"), cap, len, "outcomes") }
    }
}

/// The stored-checksum entries of group `group_id` of request `req_id`, as
/// `kvcs_result_entries` gives them (two words per block position: value,
/// stamp), into the caller's `cap` words at `entries`, with the number of
/// words (`2 * num_positions`) in `*len` (the buffer convention: a `cap`
/// below it gives `KVCS_ERR_BUFFER_TOO_SMALL` with `*len` set and nothing
/// written). Requirements and errors as `kvcs_result_entries`.
#[no_mangle]
pub extern "C" fn kvcs_result_entries_buf(
    result: *const kvcs_result,
    req_id: *const c_char,
    group_id: u32,
    entries: *mut u64,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let result = try_handle!(result, "result");
        not_null!(len, "len");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        let found = try_engine!(stored::result_entries(result, req_id, group_id));
        let words: Vec<u64> = found.iter().flat_map(|&(value, stamp)| [value, stamp]).collect();
        // SAFETY: `entries` has `cap` writable words and `len` is writable per the contract.
        unsafe { write_named(&words, (entries, "entries"), cap, len, "words") }
    }
}

/// The load check of `kvcs_result_check_entries` with both lengths given:
/// `entries` holds `num_words` words, which must be two per block position
/// of the group (value, stamp; `KVCS_ERR_INVALID_ARGUMENT` naming both
/// counts otherwise), and the outcomes go to the caller's `cap` bytes at
/// `outcomes` with their count in `*len` (the buffer convention: a `cap`
/// below it gives `KVCS_ERR_BUFFER_TOO_SMALL` with `*len` set and nothing
/// written). Requirements and other errors as `kvcs_result_entries`.
#[no_mangle]
pub extern "C" fn kvcs_result_check_entries_buf(
    result: *const kvcs_result,
    req_id: *const c_char,
    group_id: u32,
    entries: *const u64,
    num_words: usize,
    outcomes: *mut u8,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let result = try_handle!(result, "result");
        not_null!(len, "len");
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        let (_, blocks) = try_engine!(result.given_blocks(req_id, group_id));
        let positions = blocks.block_ids.len();
        if positions.checked_mul(2) != Some(num_words) {
            return super::status::fail(&crate::base::error::Error::InvalidArgument(format!(
                "num_words {num_words} is not 2 x the {positions} positions of group_id {group_id} (2 each: value, stamp)"
            )));
        }
        // SAFETY: the contract gives `num_words` readable words.
        let words = try_engine!(unsafe { c_array(entries, num_words, "entries") });
        let pairs: Vec<(u64, u64)> = words.chunks_exact(2).map(|pair| (pair[0], pair[1])).collect();
        let verdicts = try_engine!(stored::check_result_entries(result, req_id, group_id, &pairs));
        let bytes: Vec<u8> = verdicts.iter().map(|&verdict| kvcs_stored_outcome::of(verdict) as u8).collect();
        // SAFETY: `outcomes` has `cap` writable bytes and `len` is writable per the contract.
        unsafe { write_named(&bytes, (outcomes, "outcomes"), cap, len, "outcomes") }
    }
}

/// Frees a result. NULL is a no-op. Safe while a device is still computing.
#[no_mangle]
pub extern "C" fn kvcs_result_destroy(result: *mut kvcs_result) {
    ffi_boundary! {
        // SAFETY: NULL, or made by `kvcs_worker_checksum` and not freed before (the contract).
        unsafe { free(result) };
    }
}

/// The worker's record of this result (its rank, every request's columns
/// with replica keys and first positions, skipped groups, group
/// fingerprints; layer partials in detail mode) as versioned bytes for
/// `kvcs_verifier_add_record`, into `(buf, cap)` with the length in `*len`;
/// `(NULL, 0)` asks for the size (`KVCS_ERR_BUFFER_TOO_SMALL` with `*len`
/// set). `KVCS_ERR_NOT_READY` while a device is computing the values.
#[no_mangle]
pub extern "C" fn kvcs_result_encode(
    result: *const kvcs_result,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let result = try_handle!(result, "result");
        super::not_null!(len, "len");
        let bytes = try_engine!(crate::wire::record::Record::from_checksums(result)).encode();
        // SAFETY: `buf` has `cap` writable bytes and `len` is writable per the contract.
        unsafe { super::buffer::write_bytes(&bytes, buf, cap, len) }
    }
}
