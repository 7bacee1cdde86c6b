//! `kvcs_completion`: when every worker has finished sending or receiving a
//! request (docs/SPEC.md#11-transfer-topology-for-transfer-agents), and the
//! invalid block ids workers report.

use std::ffi::c_char;

use super::buffer::write_entries;
use super::c_enum::c_enum;
use super::handle::{free, handle, into_handle, try_handle, try_handle_mut};
use super::panic::ffi_boundary;
use super::status::{fail, kvcs_status};
use super::{c_array, c_str, not_null, try_engine};
use crate::base::error::err;
use crate::base::topology::{Completion, Direction};

/// Which transfer a worker reports finished (`kvcs_completion_report`).
/// Values are fixed and never renumbered.
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvcs_direction {
    /// The worker finished sending the request's KV.
    KVCS_DIRECTION_SENDING = 0,
    /// The worker finished receiving the request's KV.
    KVCS_DIRECTION_RECEIVING = 1,
}

c_enum!(kvcs_direction {
    KVCS_DIRECTION_SENDING,
    KVCS_DIRECTION_RECEIVING
});

fn direction(value: u32) -> crate::base::error::Result<Direction> {
    Ok(match kvcs_direction::from_arg(value, "direction")? {
        kvcs_direction::KVCS_DIRECTION_SENDING => Direction::Sending,
        kvcs_direction::KVCS_DIRECTION_RECEIVING => Direction::Receiving,
    })
}

/// Counts, per request and direction, the workers that reported it
/// finished, and says when every expected worker has (docs/SPEC.md#11-transfer-topology-for-transfer-agents);
/// unites the invalid block ids workers report.
///
/// Ownership: created by `kvcs_completion_create`, freed by
/// `kvcs_completion_destroy`.
/// Thread safety: `kvcs_completion *` calls need exclusive access; `const
/// kvcs_completion *` calls may run concurrently.
#[allow(non_camel_case_types)]
pub struct kvcs_completion {
    _private: [u8; 0],
}

handle!(kvcs_completion => Completion);

/// Creates a counter expecting `expected_workers` (at least 1) reports per
/// request and direction; `*out` owns it.
#[no_mangle]
pub extern "C" fn kvcs_completion_create(expected_workers: u32, out: *mut *mut kvcs_completion) -> kvcs_status {
    ffi_boundary! {
        not_null!(out, "out");
        let completion = try_engine!(Completion::new(expected_workers));
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(into_handle(completion)) };
        kvcs_status::KVCS_OK
    }
}

/// Frees a counter. NULL is a no-op.
#[no_mangle]
pub extern "C" fn kvcs_completion_destroy(completion: *mut kvcs_completion) {
    ffi_boundary! {
        // SAFETY: NULL, or made by `kvcs_completion_create` and not freed before (the contract).
        unsafe { free(completion) };
    }
}

/// Changes the expected count (at least 1) for requests first reported
/// from now on; requests already counting keep the count they started with.
#[no_mangle]
pub extern "C" fn kvcs_completion_set_expected(completion: *mut kvcs_completion, expected_workers: u32) -> kvcs_status {
    ffi_boundary! {
        let completion = try_handle_mut!(completion, "completion");
        try_engine!(completion.set_expected(expected_workers));
        kvcs_status::KVCS_OK
    }
}

/// Worker `worker` reports the `n` requests `req_ids` finished in
/// `direction` (a `kvcs_direction`). `completed[i]` is set to 1 when this
/// report completed request `i` (every expected worker has now reported
/// it), else 0. A request listed twice, or already reported by this worker
/// and not yet completed, gives `KVCS_ERR_INVALID_ARGUMENT` and nothing is
/// counted.
#[no_mangle]
pub extern "C" fn kvcs_completion_report(
    completion: *mut kvcs_completion,
    worker: u32,
    direction: u32,
    req_ids: *const *const c_char,
    n: usize,
    completed: *mut u8,
) -> kvcs_status {
    ffi_boundary! {
        let completion = try_handle_mut!(completion, "completion");
        let direction = try_engine!(self::direction(direction));
        // SAFETY: NULL or `n` readable pointers per the contract.
        let pointers = try_engine!(unsafe { c_array(req_ids, n, "req_ids") });
        if completed.is_null() && n != 0 {
            return fail(&err!(InvalidArgument, "completed is NULL with n {n}"));
        }
        let mut ids = Vec::with_capacity(pointers.len());
        for (i, &pointer) in pointers.iter().enumerate() {
            // SAFETY: each is NULL or a NUL-terminated string per the contract.
            ids.push(try_engine!(unsafe { c_str(pointer, &format!("req_ids[{i}]")) }));
        }
        let done = try_engine!(completion.report(worker, direction, &ids));
        for (i, value) in done.into_iter().enumerate() {
            // SAFETY: the contract gives `n` writable bytes at `completed`.
            unsafe { completed.add(i).write(u8::from(value)) };
        }
        kvcs_status::KVCS_OK
    }
}

/// The number of workers that reported `req_id` finished in `direction`
/// so far, into `*count` (0 before any did and once it completed).
#[no_mangle]
pub extern "C" fn kvcs_completion_reported(
    completion: *const kvcs_completion,
    direction: u32,
    req_id: *const c_char,
    count: *mut u32,
) -> kvcs_status {
    ffi_boundary! {
        let completion = try_handle!(completion, "completion");
        let direction = try_engine!(self::direction(direction));
        // SAFETY: NULL or a NUL-terminated string per the contract.
        let req_id = try_engine!(unsafe { c_str(req_id, "req_id") });
        not_null!(count, "count");
        // SAFETY: non-NULL and writable per the contract.
        unsafe { count.write(completion.reported(direction, req_id)) };
        kvcs_status::KVCS_OK
    }
}

/// Adds the `n` block ids a worker found invalid to the union.
#[no_mangle]
pub extern "C" fn kvcs_completion_add_invalid_blocks(
    completion: *mut kvcs_completion,
    block_ids: *const u32,
    n: usize,
) -> kvcs_status {
    ffi_boundary! {
        let completion = try_handle_mut!(completion, "completion");
        // SAFETY: NULL or `n` readable ids per the contract.
        let block_ids = try_engine!(unsafe { c_array(block_ids, n, "block_ids") });
        completion.add_invalid_blocks(block_ids);
        kvcs_status::KVCS_OK
    }
}

/// The union of the invalid block ids added since the last clear, ascending,
/// into `(block_ids, cap)` with the count in `*len` (`(NULL, 0)` asks for it).
#[no_mangle]
pub extern "C" fn kvcs_completion_invalid_blocks(
    completion: *const kvcs_completion,
    block_ids: *mut u32,
    cap: usize,
    len: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        let completion = try_handle!(completion, "completion");
        let items = completion.invalid_blocks();
        // SAFETY: the contract gives `cap` writable ids and a writable `len`.
        unsafe { write_entries(&items, block_ids, cap, len) }
    }
}

/// Forgets the invalid block ids.
#[no_mangle]
pub extern "C" fn kvcs_completion_clear_invalid_blocks(completion: *mut kvcs_completion) -> kvcs_status {
    ffi_boundary! {
        let completion = try_handle_mut!(completion, "completion");
        completion.clear_invalid_blocks();
        kvcs_status::KVCS_OK
    }
}
