//! The C ABI (`kvcsum::ffi`) called as a C engine would, in one place: the
//! strings it returns (`last_error()`, `text()`), a failed call as its
//! status and message ([`Failure`], [`check()`]), and owning wrappers of
//! its handles, one file per handle as in `src/ffi/`: workers
//! ([`CWorker`], and [`HostWorker`] over random KV it owns), block sets
//! ([`CBlocks`]), results ([`CResult`]), verifiers ([`CVerifier`]),
//! reports ([`CReport`]) and topologies.
//!
//! Each wrapper frees its handle on drop and keeps the raw handle in a
//! `pub` field, for tests that call the `extern "C"` functions themselves
//! as careless or hostile C would. Calls that may fail return
//! `Result<_, Failure>`; calls a test only sets up with assert success.

use std::ffi::{c_char, CStr};

use kvcsum::ffi::status::kvcs_status::{self, KVCS_OK};
use kvcsum::ffi::status::{kvcs_last_error, kvcs_status_name};
use kvcsum::ffi::worker::kvcs_role;

mod blocks;
mod report;
mod result;
mod topology;
mod verifier;
mod worker;

// Each test binary uses a part of these.
#[allow(unused_imports)]
pub use self::{blocks::*, report::*, result::*, topology::*, verifier::*, worker::*};

/// `kvcs_last_error()` of this thread.
pub fn last_error() -> String {
    text(kvcs_last_error())
}

/// A NUL-terminated string the library returned (it must not be NULL).
pub fn text(ptr: *const c_char) -> String {
    assert!(!ptr.is_null(), "the library returned a NULL string");
    // SAFETY: the library's strings are NUL-terminated and live at least
    // until the next call on this thread or the owning handle's destruction.
    unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
}

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

/// The status a call gave: `KVCS_OK`, or its failure's.
pub fn status_of<T>(outcome: &Result<T, Failure>) -> kvcs_status {
    match outcome {
        Ok(_) => KVCS_OK,
        Err((status, _)) => *status,
    }
}

/// The name of a status (`KVCS_ERR_...`).
pub fn status_name(status: kvcs_status) -> String {
    text(kvcs_status_name(status as u32))
}

pub const PRODUCER: u32 = kvcs_role::KVCS_ROLE_PRODUCER as u32;
pub const CONSUMER: u32 = kvcs_role::KVCS_ROLE_CONSUMER as u32;
