//! Strings the C ABI hands back, read as Rust strings: the one
//! `last_error()` and `text()` of the tests.

use std::ffi::{c_char, CStr};

use kvcsum::ffi::status::kvcs_last_error;

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
