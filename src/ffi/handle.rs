//! Handles: the one way a Rust value crosses to C and back.
//!
//! Each C handle type (`kvcs_worker`, `kvcs_blocks`, ...) is an opaque,
//! zero-sized struct that C only ever holds pointers to. [`Handle`] ties it
//! to the Rust value behind the pointer, which is always a `Box` of that
//! value; every handle is made by [`into_handle`], borrowed by [`borrow`] or
//! [`borrow_mut`] (NULL becomes `KVCS_ERR_INVALID_ARGUMENT` naming the
//! argument) and freed by [`free`] (NULL is a no-op). No handle file casts a
//! pointer itself. (The design follows rustls-ffi's `Castable`: the C type
//! names its Rust target once, and the casts live in one place.)

use crate::base::error::{err, Result};

/// A C handle type whose pointers own a `Box<Self::Target>`.
pub(crate) trait Handle {
    /// The Rust value behind the handle.
    type Target;
}

/// Declares that pointers to the C type `$handle` own a `Box<$target>`.
macro_rules! handle {
    ($handle:ty => $target:ty) => {
        impl $crate::ffi::handle::Handle for $handle {
            type Target = $target;
        }
    };
}
pub(crate) use handle;

/// Moves `value` behind a new handle that C owns until it calls the type's
/// destroy function.
pub(crate) fn into_handle<H: Handle>(value: H::Target) -> *mut H {
    Box::into_raw(Box::new(value)).cast()
}

/// The value behind `handle` (named `name` in errors), shared.
///
/// # Safety
/// `handle` is NULL or was made by [`into_handle`] for `H` and not freed,
/// and no exclusive borrow of it is live for `'a` (the C contract's thread
/// safety rules).
pub(crate) unsafe fn borrow<'a, H: Handle>(handle: *const H, name: &str) -> Result<&'a H::Target> {
    // SAFETY: per this function's contract.
    unsafe { handle.cast::<H::Target>().as_ref() }.ok_or_else(|| err!(InvalidArgument, "{name} is NULL"))
}

/// The value behind `handle` (named `name` in errors), exclusive.
///
/// # Safety
/// `handle` is NULL or was made by [`into_handle`] for `H` and not freed,
/// and no other borrow of it is live for `'a` (the C contract gives the call
/// exclusive access).
pub(crate) unsafe fn borrow_mut<'a, H: Handle>(handle: *mut H, name: &str) -> Result<&'a mut H::Target> {
    // SAFETY: per this function's contract.
    unsafe { handle.cast::<H::Target>().as_mut() }.ok_or_else(|| err!(InvalidArgument, "{name} is NULL"))
}

/// Drops the value behind `handle`; NULL is a no-op.
///
/// # Safety
/// `handle` is NULL or was made by [`into_handle`] for `H` and not freed,
/// and nothing uses it afterwards.
pub(crate) unsafe fn free<H: Handle>(handle: *mut H) {
    if !handle.is_null() {
        // SAFETY: made by `into_handle` (a `Box<H::Target>`) and freed only here, once.
        drop(unsafe { Box::from_raw(handle.cast::<H::Target>()) });
    }
}

/// Borrows a handle argument shared, or returns `KVCS_ERR_INVALID_ARGUMENT`
/// from the guarded body when it is NULL.
macro_rules! try_handle {
    ($ptr:expr, $name:literal) => {
        // SAFETY: the C contract: a live handle of this type, not borrowed
        // exclusively by a concurrent call.
        $crate::ffi::try_engine!(unsafe { $crate::ffi::handle::borrow($ptr, $name) })
    };
}
pub(crate) use try_handle;

/// Borrows a handle argument exclusively, or returns
/// `KVCS_ERR_INVALID_ARGUMENT` from the guarded body when it is NULL.
macro_rules! try_handle_mut {
    ($ptr:expr, $name:literal) => {
        // SAFETY: the C contract: a live handle of this type, and this call
        // has exclusive access to it.
        $crate::ffi::try_engine!(unsafe { $crate::ffi::handle::borrow_mut($ptr, $name) })
    };
}
pub(crate) use try_handle_mut;
