//! The stream rule's scaffolding (docs/SPEC.md, the caller's stream): a
//! writer that puts a cache's true bytes on a stream late, behind a long
//! kernel, and one helper that runs the library's work on each stream a
//! caller may name behind such writes.

use std::sync::Arc;

use cudarc::driver::{result as cu, sys, CudaContext};
use kvcsum::{BlockSet, Checksums, Role, StreamHandle, Worker};

use crate::support::*;

/// A kernel that keeps a stream busy: one thread spins for `cycles` clocks.
pub const SPIN_KERNEL: &str = r#"
extern "C" __global__ void spin(unsigned long long cycles) {
    long long start = clock64();
    while ((unsigned long long)(clock64() - start) < cycles) {
    }
}
"#;

/// Writes device buffers late on a stream: holds their true bytes aside in
/// device memory, overwrites them with stale random bytes (`stale`), and
/// queues on a stream a kernel spinning about 200 ms, then the copies of the
/// true bytes back (`queue`). Work the library queues on that stream after
/// `queue` sees the true bytes; work it put anywhere else, the stale ones.
pub struct LateWriter {
    pub _module: Arc<cudarc::driver::CudaModule>,
    pub spin: sys::CUfunction,
    pub clock_khz: u64,
    /// (device buffer, its true bytes aside, length)
    pub buffers: Vec<(u64, u64, usize)>,
}

impl LateWriter {
    /// For device buffers `bases` whose true contents are `contents`.
    pub fn new(context: &Arc<CudaContext>, bases: &[u64], contents: &[&[u8]]) -> LateWriter {
        context.bind_to_thread().expect("bind");
        let (major, minor) = context.compute_capability().expect("capability");
        let options = cudarc::nvrtc::CompileOptions {
            options: vec![format!("--gpu-architecture=sm_{major}{minor}")],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(SPIN_KERNEL, options).expect("compile spin kernel");
        let module = context.load_module(ptx).expect("load spin kernel");
        let spin = module.load_function("spin").expect("spin").cu_function();
        let clock_khz = context
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
            .expect("clock rate") as u64;
        let buffers = bases
            .iter()
            .zip(contents)
            .map(|(&base, bytes)| {
                // SAFETY: a fresh allocation of the contents' length, filled from them.
                let source = unsafe {
                    let source = cu::malloc_sync(bytes.len()).expect("cuMemAlloc");
                    cu::memcpy_htod_sync(source, bytes).expect("copy aside");
                    source
                };
                (base, source, bytes.len())
            })
            .collect();
        LateWriter {
            _module: module,
            spin,
            clock_khz,
            buffers,
        }
    }

    /// Overwrites the buffers with random bytes (synchronously).
    pub fn stale(&self, rng: &mut Rng) {
        for &(base, _, len) in &self.buffers {
            let stale: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            // SAFETY: `base` holds `len` bytes; the copy is synchronous.
            unsafe { cu::memcpy_htod_sync(base, &stale).expect("stale bytes") };
        }
    }

    /// Queues on `stream` the spin kernel, then the true bytes' copies.
    pub fn queue(&self, stream: sys::CUstream) {
        // SAFETY: the spin kernel takes one u64 by value; the copies stay in
        // allocations that outlive the work (freed on drop, after a sync).
        unsafe {
            let mut cycles = self.clock_khz * 200; // about 200 ms
            let mut params = [(&mut cycles as *mut u64).cast::<std::ffi::c_void>()];
            cu::launch_kernel(self.spin, (1, 1, 1), (1, 1, 1), 0, stream, &mut params).expect("spin");
            for &(base, source, len) in &self.buffers {
                sys::cuMemcpyDtoDAsync_v2(base, source, len, stream)
                    .result()
                    .expect("write the true bytes on the stream");
            }
        }
    }
}

impl Drop for LateWriter {
    fn drop(&mut self) {
        // SAFETY: waits for everything queued, then frees what is ours.
        unsafe {
            let _ = cu::ctx::synchronize();
            for &(_, source, _) in &self.buffers {
                let _ = cu::free_sync(source);
            }
        }
    }
}

/// The streams a caller may name: the legacy default stream (NULL), the
/// per-thread default stream (0x2) and `explicit`.
pub fn stream_cases(explicit: sys::CUstream) -> [(&'static str, sys::CUstream); 3] {
    [
        ("NULL (legacy default stream)", std::ptr::null_mut()),
        ("CU_STREAM_PER_THREAD", 0x2 as sys::CUstream),
        ("an explicit non-blocking stream", explicit),
    ]
}

/// The streams an ordering test queues its work on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Streams {
    /// Each a caller may name ([`stream_cases`]).
    EveryKind,
    /// One explicit non-blocking stream.
    Explicit,
}

/// The stream rule's scaffolding, shared by the ordering tests: per stream
/// of `streams` (the explicit one created here, non-blocking, and destroyed
/// after), `writer` makes the cache stale and queues its true bytes on that
/// stream behind a long kernel; `call(name, stream)` then has the library
/// queue its work there and asserts what must hold while the stream is
/// still busy; once the stream is synchronised, `check(name, outcome)`
/// compares what the work gave with what the true bytes give. `writer` is
/// dropped (everything queued waited for) before the stream is destroyed.
pub fn behind_late_writes<T>(
    writer: LateWriter,
    rng: &mut Rng,
    streams: Streams,
    mut call: impl FnMut(&str, StreamHandle) -> T,
    mut check: impl FnMut(&str, T),
) {
    let explicit = cu::stream::create(cu::stream::StreamKind::NonBlocking).expect("stream");
    let cases = match streams {
        Streams::EveryKind => stream_cases(explicit).to_vec(),
        Streams::Explicit => vec![("an explicit non-blocking stream", explicit)],
    };
    for (name, stream) in cases {
        writer.stale(rng);
        writer.queue(stream);
        let outcome = call(name, StreamHandle(stream.cast()));
        // SAFETY: the stream's work is done once synchronised.
        unsafe { cu::stream::synchronize(stream).expect("sync") };
        check(name, outcome);
    }
    drop(writer);
    // SAFETY: nothing is queued any more; ours.
    unsafe {
        let _ = cu::stream::destroy(explicit);
    }
}

/// [`behind_late_writes`] for the checksum ordering tests: on each stream a
/// caller may name, `device` checksums `blocks` as a consumer; the result
/// must not be ready while the stream is busy, and `check(name, &result)`
/// gets it once waited for.
pub fn checksum_behind_late_writes(
    writer: LateWriter,
    rng: &mut Rng,
    device: &Worker,
    blocks: &BlockSet,
    mut check: impl FnMut(&str, &Checksums),
) {
    behind_late_writes(
        writer,
        rng,
        Streams::EveryKind,
        |name, stream| {
            let result = device.checksum(blocks, Role::Consumer, stream).expect("checksum");
            assert!(
                !result.is_ready().expect("query"),
                "{name}: the result was ready while the stream was still busy"
            );
            result
        },
        |name, result| {
            result.wait().expect("wait");
            check(name, &result);
        },
    );
}
