//! The C ABI's constants and versions: `KVCS_ABI_VERSION` (the one place it
//! is written; build.rs reads it for the SONAME) and the library's version,
//! the stored-checksum and head limits, and `KVCS_HOST`.

use std::ffi::c_char;

/// The C ABI version; a loader checks it equals `kvcs_abi_version()`.
/// Version 2: stored checksums take `KVCS_BLOCK_CHECKSUM_BYTES` (16) bytes
/// per block id, where version 1 took 8.
pub const KVCS_ABI_VERSION: u32 = 2;

/// Bytes of stored checksum per block id (docs/SPEC.md#8-stored-checksums-for-offloaded-kv):
/// the value, then the stamp of the configuration that stored it.
pub const KVCS_BLOCK_CHECKSUM_BYTES: u64 = 16;
const _: () = assert!(KVCS_BLOCK_CHECKSUM_BYTES == crate::inputs::layout::StoredBuffer::BYTES_PER_BLOCK);

/// `H` of docs/SPEC.md#3-block-checksum: no layer may have more heads than this.
pub const KVCS_MAX_KV_HEADS_PER_LAYER: u64 = 65536;
const _: () = assert!(KVCS_MAX_KV_HEADS_PER_LAYER == crate::base::checksum::MAX_KV_HEADS_PER_LAYER);

/// The `device` of a worker whose caches are in host memory.
pub const KVCS_HOST: i32 = -1;

/// The major version of the library this header comes with (the crate
/// version, docs/VERSIONING.md); `kvcs_version()` gives the loaded one's.
pub const KVCS_VERSION_MAJOR: u32 = 0;

/// The minor version of the library this header comes with.
pub const KVCS_VERSION_MINOR: u32 = 3;

/// The patch version of the library this header comes with.
pub const KVCS_VERSION_PATCH: u32 = 0;

/// `MAJOR * 10000 + MINOR * 100 + PATCH` of the library this header comes
/// with, for `#if KVCS_VERSION_NUMBER >= 300` (zstd's `ZSTD_VERSION_NUMBER`).
pub const KVCS_VERSION_NUMBER: u32 = 300;
const _: () =
    assert!(KVCS_VERSION_NUMBER == KVCS_VERSION_MAJOR * 10000 + KVCS_VERSION_MINOR * 100 + KVCS_VERSION_PATCH);

/// A decimal number of the crate's version at compile time.
const fn decimal(text: &str) -> u32 {
    let bytes = text.as_bytes();
    let mut value = 0;
    let mut i = 0;
    while i < bytes.len() {
        value = value * 10 + (bytes[i] - b'0') as u32;
        i += 1;
    }
    value
}
// The three are written out for cbindgen; a release that changes the
// crate version and not them does not build.
const _: () = assert!(KVCS_VERSION_MAJOR == decimal(env!("CARGO_PKG_VERSION_MAJOR")));
const _: () = assert!(KVCS_VERSION_MINOR == decimal(env!("CARGO_PKG_VERSION_MINOR")));
const _: () = assert!(KVCS_VERSION_PATCH == decimal(env!("CARGO_PKG_VERSION_PATCH")));

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
