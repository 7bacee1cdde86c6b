//! Status codes and the per-thread last error message. The versions and the
//! ABI's other constants are `constants.rs`.

use super::c_enum::c_enum;
use std::cell::RefCell;
use std::ffi::{c_char, CString};

use crate::base::error::Error;

/// The outcome of a call. Values are fixed and never renumbered; a retired
/// value stays reserved. Calls that take a status from C take `uint32_t`.
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvcs_status {
    /// Success.
    KVCS_OK = 0,
    /// An argument is NULL, malformed or inconsistent.
    KVCS_ERR_INVALID_ARGUMENT = 1,
    /// An index (block id, column) or a layer's reach is out of bounds.
    KVCS_ERR_OUT_OF_BOUNDS = 2,
    /// Valid input that kvcsum does not support (alignment, head count).
    KVCS_ERR_UNSUPPORTED = 3,
    /// An unknown request, group or layer.
    KVCS_ERR_NOT_FOUND = 4,
    /// Bytes (a record, a payload) that do not decode.
    KVCS_ERR_MALFORMED = 5,
    /// The result is still being computed.
    KVCS_ERR_NOT_READY = 6,
    /// The CUDA driver, NVRTC or the device is absent or failed.
    KVCS_ERR_DEVICE = 7,
    /// An output buffer is too small; the needed length was written.
    KVCS_ERR_BUFFER_TOO_SMALL = 8,
    /// A bug in kvcsum (a caught panic, a broken invariant).
    KVCS_ERR_INTERNAL = 9,
}

c_enum!(kvcs_status {
    KVCS_OK,
    KVCS_ERR_INVALID_ARGUMENT,
    KVCS_ERR_OUT_OF_BOUNDS,
    KVCS_ERR_UNSUPPORTED,
    KVCS_ERR_NOT_FOUND,
    KVCS_ERR_MALFORMED,
    KVCS_ERR_NOT_READY,
    KVCS_ERR_DEVICE,
    KVCS_ERR_BUFFER_TOO_SMALL,
    KVCS_ERR_INTERNAL
});

impl kvcs_status {
    /// The status of an engine error.
    pub fn of(error: &Error) -> kvcs_status {
        match error {
            Error::InvalidArgument(_) => kvcs_status::KVCS_ERR_INVALID_ARGUMENT,
            Error::OutOfBounds(_) => kvcs_status::KVCS_ERR_OUT_OF_BOUNDS,
            Error::Unsupported(_) => kvcs_status::KVCS_ERR_UNSUPPORTED,
            Error::NotFound(_) => kvcs_status::KVCS_ERR_NOT_FOUND,
            Error::Malformed(_) => kvcs_status::KVCS_ERR_MALFORMED,
            Error::NotReady(_) => kvcs_status::KVCS_ERR_NOT_READY,
            Error::Device(_) => kvcs_status::KVCS_ERR_DEVICE,
            Error::Internal(_) => kvcs_status::KVCS_ERR_INTERNAL,
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::from(c"no error"));
}

/// Records `message` as this thread's last error.
pub(crate) fn set_last_error(message: &str) {
    let text = CString::new(message.replace('\0', "\\0")).expect("NULs were replaced");
    LAST_ERROR.with(|last| *last.borrow_mut() = text);
}

/// Records `error` and gives its status: the way a call fails on an engine error.
pub(crate) fn fail(error: &Error) -> kvcs_status {
    fail_with(kvcs_status::of(error), &error.to_string())
}

/// Records `message` and gives `status`: the way a call fails on what only
/// the C boundary knows (a caller's buffer that is too small).
pub(crate) fn fail_with(status: kvcs_status, message: &str) -> kvcs_status {
    set_last_error(message);
    status
}

/// The message of the last failed call on this thread: what failed, which
/// argument, which value. Never NULL; valid until the next failing call on
/// this thread. "no error" before any call failed.
#[no_mangle]
pub extern "C" fn kvcs_last_error() -> *const c_char {
    LAST_ERROR.with(|last| last.borrow().as_ptr())
}

/// The name of a status code (`"KVCS_ERR_NOT_FOUND"`, say) as a static
/// string; "unknown kvcs_status" for a value that is none. Never NULL.
#[no_mangle]
pub extern "C" fn kvcs_status_name(status: u32) -> *const c_char {
    kvcs_status::name_of(status).as_ptr()
}
