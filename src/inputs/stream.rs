//! The caller's CUDA stream, as the engines take it.

/// A CUDA stream handle (`CUstream`) as the caller gives it, passed to the
/// driver unchanged: null is CUDA's legacy default stream, `0x2`
/// (`CU_STREAM_PER_THREAD`) the calling thread's default stream. A device
/// worker's work is ordered after everything already queued on that stream.
/// Meaningless for host workers.
#[derive(Debug, Clone, Copy)]
pub struct StreamHandle(pub *mut std::ffi::c_void);

impl StreamHandle {
    /// CUDA's legacy default stream (a null `CUstream`); host workers take it too.
    pub fn legacy_default() -> Self {
        StreamHandle(std::ptr::null_mut())
    }

    /// The calling thread's per-thread default stream (`CU_STREAM_PER_THREAD`).
    pub fn per_thread_default() -> Self {
        StreamHandle(0x2 as *mut std::ffi::c_void)
    }
}
