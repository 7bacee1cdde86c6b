//! The C boundary, and only that: status codes, the panic guard, pointer
//! checks and one file per handle type. The engine never sees a raw pointer
//! from here except a registered address.
//!
//! Every `extern "C"` function here takes raw pointers from C and checks them
//! (NULL, lengths) before use; their validity beyond that is the C caller's
//! contract, documented per function, so they are not `unsafe fn` in Rust.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod api;
pub mod blocks;
pub mod buffer;
pub(crate) mod c_enum;
pub mod completion;
pub mod constants;
pub mod generated;
pub(crate) mod handle;
pub mod layout_string;
pub mod panic;
pub mod payload;
pub mod repair;
pub mod report;
pub mod result;
pub mod status;
pub mod struct_layout;
pub mod tier_index;
pub mod topology;
pub mod verifier;
pub mod worker;

use std::ffi::{c_char, CStr};

use crate::base::error::{err, Result};

/// Turns a NULL pointer to a C struct argument (not a handle: see
/// [`handle`]) into `KVCS_ERR_INVALID_ARGUMENT` (with a message naming it)
/// and returns from the guarded body; otherwise gives the reference.
macro_rules! try_ref {
    ($ptr:expr, $name:literal) => {{
        let ptr = $ptr;
        if ptr.is_null() {
            return $crate::ffi::status::fail(&$crate::base::error::Error::InvalidArgument(
                concat!($name, " is NULL").to_owned(),
            ));
        }
        // SAFETY: non-NULL; the C contract says it points to a live object
        // of this type, which the documented thread-safety rules protect.
        unsafe { &*ptr }
    }};
}
pub(crate) use try_ref;

/// Returns `KVCS_ERR_INVALID_ARGUMENT` from the guarded body when a pointer
/// (an out-parameter, say) is NULL.
macro_rules! not_null {
    ($ptr:expr, $name:literal) => {
        if $ptr.is_null() {
            return $crate::ffi::status::fail(&$crate::base::error::Error::InvalidArgument(
                concat!($name, " is NULL").to_owned(),
            ));
        }
    };
}
pub(crate) use not_null;

/// Returns the error's status from the guarded body when `$result` fails.
macro_rules! try_engine {
    ($result:expr) => {
        match $result {
            Ok(value) => value,
            Err(error) => return $crate::ffi::status::fail(&error),
        }
    };
}
pub(crate) use try_engine;

/// The UTF-8 string at `ptr` (named `name` in errors).
///
/// # Safety
/// `ptr` is NULL or a NUL-terminated string that stays valid for `'a`.
pub(crate) unsafe fn c_str<'a>(ptr: *const c_char, name: &str) -> Result<&'a str> {
    if ptr.is_null() {
        return Err(err!(InvalidArgument, "{name} is NULL"));
    }
    // SAFETY: not NULL (checked above), so a NUL-terminated string valid
    // for `'a` (the caller's promise).
    unsafe { CStr::from_ptr(ptr) }
        .to_str()
        .map_err(|e| err!(InvalidArgument, "{name} is not UTF-8: {e}"))
}

/// The array `(ptr, len)` (named `name` in errors); `(NULL, 0)` is empty.
///
/// # Safety
/// `ptr` is NULL or points to `len` readable elements valid for `'a`.
pub(crate) unsafe fn c_array<'a, T>(ptr: *const T, len: usize, name: &str) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(err!(InvalidArgument, "{name} is NULL with length {len}"));
    }
    if len > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(err!(InvalidArgument, "{name} length {len} is too large"));
    }
    // SAFETY: not NULL and `len` > 0 (checked above), so `len` readable
    // elements valid for `'a` (the caller's promise), whose bytes fit in
    // `isize` (checked above).
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// A 0/1 flag argument named `name` (C has no bool in these calls).
pub(crate) fn flag_arg(value: u32, name: &str) -> Result<bool> {
    match value {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(err!(InvalidArgument, "{name} {value} is neither 0 nor 1")),
    }
}

/// Writes `value` to the out-parameter `out` when it is not NULL.
///
/// # Safety
/// `out` is NULL or points to writable memory for a `T`.
pub(crate) unsafe fn write_out<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: not NULL, so writable for a `T` (the caller's promise).
        unsafe { out.write(value) };
    }
}
