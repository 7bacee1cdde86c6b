//! Status codes, the per-thread last error message, and versions.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};

use crate::error::Error;

/// The C ABI version; a loader checks it equals `kvcs_abi_version()`.
/// Version 2: stored checksums take `KVCS_BLOCK_CHECKSUM_BYTES` (16) bytes
/// per block id, where version 1 took 8.
pub const KVCS_ABI_VERSION: u32 = 2;

/// Bytes of stored checksum per block id (docs/SPEC.md#8-stored-checksums-for-offloaded-kv):
/// the value, then the stamp of the configuration that stored it.
pub const KVCS_BLOCK_CHECKSUM_BYTES: u64 = 16;
const _: () = assert!(KVCS_BLOCK_CHECKSUM_BYTES == crate::layout::StoredBuffer::BYTES_PER_BLOCK);

/// `H` of docs/SPEC.md#3-block-checksum: no layer may have more heads than this.
pub const KVCS_MAX_KV_HEADS_PER_LAYER: u64 = 65536;
const _: () = assert!(KVCS_MAX_KV_HEADS_PER_LAYER == crate::checksum::MAX_KV_HEADS_PER_LAYER);

/// The `device` of a worker whose caches are in host memory.
pub const KVCS_HOST: i32 = -1;

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

    fn name(code: u32) -> &'static CStr {
        match code {
            0 => c"KVCS_OK",
            1 => c"KVCS_ERR_INVALID_ARGUMENT",
            2 => c"KVCS_ERR_OUT_OF_BOUNDS",
            3 => c"KVCS_ERR_UNSUPPORTED",
            4 => c"KVCS_ERR_NOT_FOUND",
            5 => c"KVCS_ERR_MALFORMED",
            6 => c"KVCS_ERR_NOT_READY",
            7 => c"KVCS_ERR_DEVICE",
            8 => c"KVCS_ERR_BUFFER_TOO_SMALL",
            9 => c"KVCS_ERR_INTERNAL",
            _ => c"unknown kvcs_status",
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
    kvcs_status::name(status).as_ptr()
}

/// The ABI version of the loaded library; equal to `KVCS_ABI_VERSION` of
/// the header a program was built with, or the program must not use it.
#[no_mangle]
pub extern "C" fn kvcs_abi_version() -> u32 {
    KVCS_ABI_VERSION
}

/// The library's version (the crate version, e.g. "0.3.0"; docs/VERSIONING.md), a static string. Never NULL.
#[no_mangle]
pub extern "C" fn kvcs_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
