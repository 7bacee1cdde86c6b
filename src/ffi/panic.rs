//! The panic guard: no panic crosses the C boundary.

/// What a guarded function returns when its body panicked.
pub trait PanicValue {
    /// The value for a panicked call (after recording the message).
    fn panic_value() -> Self;
}

impl PanicValue for super::status::kvcs_status {
    fn panic_value() -> Self {
        super::status::kvcs_status::KVCS_ERR_INTERNAL
    }
}

impl PanicValue for () {
    fn panic_value() -> Self {}
}

/// Runs `body`, turning a panic into `T::panic_value()` and an
/// internal-error message for `kvcs_last_error`.
pub fn guard<T: PanicValue>(body: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(value) => value,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            super::status::set_last_error(&format!("internal error (a bug in kvcsum): {what}"));
            T::panic_value()
        }
    }
}

/// Wraps a function body (not the function, so cbindgen sees a plain
/// `extern "C" fn`) in the panic guard.
macro_rules! ffi_boundary {
    ($($body:tt)*) => {
        $crate::ffi::panic::guard(move || { $($body)* })
    };
}
pub(crate) use ffi_boundary;
