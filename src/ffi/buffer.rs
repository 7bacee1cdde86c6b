//! Variable-size output through `(uint8_t *buf, size_t cap, size_t *len)`.

use super::status::{fail, fail_with, kvcs_status};
use crate::error::err;

/// Copies `bytes` to `buf` (capacity `cap`) and their length to `*len`.
///
/// `len` must not be NULL; `buf` may be NULL only with `cap` 0 (a size
/// query). When `cap` is too small: `KVCS_ERR_BUFFER_TOO_SMALL`, `*len` set
/// to the size needed, `buf` untouched.
///
/// # Safety
/// `buf` is NULL or points to `cap` writable bytes; `len` is NULL or
/// writable.
pub(crate) unsafe fn write_bytes(bytes: &[u8], buf: *mut u8, cap: usize, len: *mut usize) -> kvcs_status {
    if len.is_null() {
        return fail(&err!(InvalidArgument, "len is NULL"));
    }
    if buf.is_null() && cap != 0 {
        return fail(&err!(InvalidArgument, "buf is NULL with cap {cap}"));
    }
    if bytes.len() > cap {
        len.write(bytes.len());
        return fail_with(
            kvcs_status::KVCS_ERR_BUFFER_TOO_SMALL,
            &format!(
                "cap {cap} is below the {} bytes needed (*len says how many)",
                bytes.len()
            ),
        );
    }
    if !bytes.is_empty() {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len());
    }
    len.write(bytes.len());
    kvcs_status::KVCS_OK
}
