//! Errors of the engine. Each message names what was wrong, with which
//! argument and value; the C boundary maps each variant to one `kvcs_status`
//! in one place (`src/ffi/status.rs`). Notions that only C has (a caller's
//! buffer too small, a NULL pointer) are the C boundary's own.

/// An engine error, by the category a caller acts on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// An argument is malformed or inconsistent.
    #[error("{0}")]
    InvalidArgument(String),
    /// An index (block id, column) is at or past its end.
    #[error("{0}")]
    OutOfBounds(String),
    /// Valid input that kvcsum cannot checksum (alignment, head count).
    #[error("{0}")]
    Unsupported(String),
    /// An unknown request, group or layer.
    #[error("{0}")]
    NotFound(String),
    /// Bytes that do not decode.
    #[error("{0}")]
    Malformed(String),
    /// A result that is not ready yet.
    #[error("{0}")]
    NotReady(String),
    /// The CUDA driver, NVRTC or the device failed or is absent.
    #[error("{0}")]
    Device(String),
    /// A bug in kvcsum.
    #[error("{0}")]
    Internal(String),
}

impl Error {
    /// The same error (same variant), its message prefixed by `context: `.
    pub fn with_context(self, context: &str) -> Error {
        let prefix = |message: String| format!("{context}: {message}");
        match self {
            Error::InvalidArgument(m) => Error::InvalidArgument(prefix(m)),
            Error::OutOfBounds(m) => Error::OutOfBounds(prefix(m)),
            Error::Unsupported(m) => Error::Unsupported(prefix(m)),
            Error::NotFound(m) => Error::NotFound(prefix(m)),
            Error::Malformed(m) => Error::Malformed(prefix(m)),
            Error::NotReady(m) => Error::NotReady(prefix(m)),
            Error::Device(m) => Error::Device(prefix(m)),
            Error::Internal(m) => Error::Internal(prefix(m)),
        }
    }
}

/// Builds an [`Error`] variant with a formatted message:
/// `err!(NotFound, "group_id {} is not registered", id)`.
macro_rules! err {
    ($variant:ident, $($fmt:tt)+) => {
        $crate::base::error::Error::$variant(format!($($fmt)+))
    };
}
pub(crate) use err;

/// The result type of the engine.
pub type Result<T> = std::result::Result<T, Error>;
