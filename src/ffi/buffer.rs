//! Variable-size output through `(uint8_t *buf, size_t cap, size_t *len)`.

use super::status::{fail, fail_with, kvcs_status};
use crate::base::error::err;

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
    // SAFETY: the caller's contract, as `write_items` asks it.
    unsafe { write_items(bytes, buf, cap, len, "bytes") }
}

/// Copies `items` to `buf` (capacity `cap` items) and their count to `*len`,
/// as [`write_bytes`] does; `unit` names them in the too-small message.
///
/// # Safety
/// `buf` is NULL or points to `cap` writable items; `len` is NULL or
/// writable.
pub(crate) unsafe fn write_items<T: Copy>(
    items: &[T],
    buf: *mut T,
    cap: usize,
    len: *mut usize,
    unit: &str,
) -> kvcs_status {
    // SAFETY: the caller's contract.
    unsafe { write_named(items, (buf, "buf"), cap, len, unit) }
}

/// [`write_items`] for a buffer argument named `buf.1` (`values`,
/// `outcomes`): its NULL message names it.
///
/// # Safety
/// `buf.0` is NULL or points to `cap` writable items; `len` is NULL or
/// writable.
pub(crate) unsafe fn write_named<T: Copy>(
    items: &[T],
    buf: (*mut T, &str),
    cap: usize,
    len: *mut usize,
    unit: &str,
) -> kvcs_status {
    let (buf, name) = buf;
    if len.is_null() {
        return fail(&err!(InvalidArgument, "len is NULL"));
    }
    if buf.is_null() && cap != 0 {
        return fail(&err!(InvalidArgument, "{name} is NULL with cap {cap}"));
    }
    if items.len() > cap {
        // SAFETY: `len` is not NULL (checked above), so writable (the caller's promise).
        unsafe { len.write(items.len()) };
        return fail_with(
            kvcs_status::KVCS_ERR_BUFFER_TOO_SMALL,
            &format!(
                "cap {cap} is below the {} {unit} needed (*len says how many)",
                items.len()
            ),
        );
    }
    if !items.is_empty() {
        // SAFETY: `buf` is not NULL (a NULL `buf` has `cap` 0, below the
        // count) and holds `cap` >= `items.len()` writable items (the
        // caller's promise); a Rust slice does not overlap the caller's buffer.
        unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), buf, items.len()) };
    }
    // SAFETY: `len` is not NULL (checked above), so writable (the caller's promise).
    unsafe { len.write(items.len()) };
    kvcs_status::KVCS_OK
}

/// Copies `items` to `(buf, cap)` and their count to `*len`, as
/// [`write_items`] does, naming them "entries" (the topology and completion
/// calls' arrays).
///
/// # Safety
/// `buf` is NULL or points to `cap` writable elements; `len` is NULL or
/// writable.
pub(crate) unsafe fn write_entries<T: Copy>(items: &[T], buf: *mut T, cap: usize, len: *mut usize) -> kvcs_status {
    // SAFETY: the caller's contract.
    unsafe { write_items(items, buf, cap, len, "entries") }
}
