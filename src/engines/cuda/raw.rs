//! The device engine's raw driver calls: the only module of `cuda/` that
//! calls cudarc's `result` and `sys` layers (and NVRTC's `sys`, to ask
//! whether the library loads). Everything else uses cudarc's
//! safe layer (`CudaContext`, `CudaModule`, `CudaFunction`) or these
//! functions.
//!
//! Why the engine leaves the safe layer at all: a device call runs on the
//! caller's stream, a foreign `CUstream` (PyTorch's current stream; NULL
//! for the legacy default stream), and cudarc's safe `CudaStream` can only
//! be a stream cudarc made, so the launches, the rows' asynchronous copy
//! and the event record on the caller's stream are raw calls. The call
//! buffers built around that stream (mapped pinned host memory the kernels
//! publish into, events recorded on the caller's stream and then queried
//! or waited on from any thread, plain device allocations that outlive any
//! stream) and the pointer attributes that check a caller's region have no
//! safe counterpart either. Each function here is one driver call (or a
//! fixed few), unsafe where the driver's contract asks more than its
//! arguments' types say.

use std::ffi::c_void;

use cudarc::driver::{result as cu, sys, CudaContext, CudaFunction};

pub use cudarc::driver::result::DriverError;

/// A device address (`CUdeviceptr`).
pub type DevicePtr = sys::CUdeviceptr;

/// An event (`CUevent`); null until created.
pub type Event = sys::CUevent;

/// A stream (`CUstream`): the caller's, null being the legacy default stream.
pub type Stream = sys::CUstream;

/// Whether the CUDA driver and NVRTC libraries can be loaded.
pub fn libraries_present() -> bool {
    // SAFETY: this only tries to dlopen the library and drops the handle.
    let driver = unsafe { sys::is_culib_present() };
    driver && nvrtc_present()
}

/// Whether the NVRTC library can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: this only tries to dlopen the library and drops the handle.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The stream whose raw handle the caller passed (`StreamHandle`'s value).
/// Null stays null: CUDA's legacy default stream, never a private one, so
/// the work is ordered after what the caller queued there.
pub fn foreign_stream(handle: *mut c_void) -> Stream {
    handle as Stream
}

/// The device's multiprocessor count.
pub fn multiprocessors(context: &CudaContext) -> Result<i32, DriverError> {
    context.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
}

/// The registers a thread of `function` uses (0 where the driver does not say).
pub fn registers(function: &CudaFunction) -> i32 {
    function
        .get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS)
        .unwrap_or(0)
}

/// How many blocks of `threads` threads of `function` a multiprocessor runs at once.
pub fn blocks_per_multiprocessor(function: &CudaFunction, threads: u32) -> Result<i32, DriverError> {
    let mut blocks = 0;
    // SAFETY: a valid function of a loaded module; the driver writes one
    // int to `blocks`.
    unsafe {
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, function.cu_function(), threads as i32, 0)
            .result()?;
    }
    Ok(blocks)
}

/// Whether `pointer` lies in legacy device memory (`cuMemAlloc`); false
/// where the driver does not say.
pub fn is_legacy_allocation(pointer: u64) -> bool {
    let mut legacy: i32 = 0;
    // SAFETY: the attribute's documented type is a boolean written as an
    // int to the given place.
    let known = unsafe {
        sys::cuPointerGetAttribute(
            (&mut legacy as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
            pointer,
        )
        .result()
        .is_ok()
    };
    known && legacy != 0
}

/// What the driver says of the allocation holding `pointer`.
pub struct Allocation {
    /// Its first address.
    pub start: DevicePtr,
    /// Its size in bytes.
    pub size: usize,
    /// Whether it is device memory (rather than host memory).
    pub on_device: bool,
    /// The device ordinal the driver gives (meaningful for device memory).
    pub device: i32,
}

/// The allocation holding `pointer`, or the driver's error where CUDA does
/// not know the pointer.
pub fn allocation_at(pointer: u64) -> Result<Allocation, DriverError> {
    let mut start: DevicePtr = 0;
    let mut size: usize = 0;
    let mut memory_type: u32 = 0;
    let mut device: i32 = -1;
    let attributes: [(*mut c_void, sys::CUpointer_attribute); 4] = [
        (
            (&mut start as *mut u64).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        ),
        (
            (&mut size as *mut usize).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ),
        (
            (&mut memory_type as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        ),
        (
            (&mut device as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        ),
    ];
    for (place, attribute) in attributes {
        // SAFETY: each call writes one value of the attribute's documented
        // type (CUdeviceptr, size_t, CUmemorytype, int) to its place, a
        // live local of that type.
        unsafe { sys::cuPointerGetAttribute(place, attribute, pointer) }.result()?;
    }
    Ok(Allocation {
        start,
        size,
        on_device: memory_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32,
        device,
    })
}

/// `bytes` of device memory on the bound context.
///
/// # Safety
/// A context is bound to this thread; the caller frees the memory with
/// [`free`] once nothing queued uses it.
pub unsafe fn malloc(bytes: usize) -> Result<DevicePtr, DriverError> {
    // SAFETY: per this function's contract.
    unsafe { cu::malloc_sync(bytes) }
}

/// Zeroes `bytes` bytes at `address`, synchronously.
///
/// # Safety
/// `address .. address + bytes` is device memory of the bound context.
pub unsafe fn zero(address: DevicePtr, bytes: usize) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { cu::memset_d8_sync(address, 0, bytes) }
}

/// Copies `bytes` to device memory at `address`, synchronously.
///
/// # Safety
/// `address` holds at least `bytes.len()` bytes of device memory of the bound context.
pub unsafe fn copy_to_device(address: DevicePtr, bytes: &[u8]) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { cu::memcpy_htod_sync(address, bytes) }
}

/// Frees device memory.
///
/// # Safety
/// `address` came from [`malloc`] on the bound context, is not freed yet,
/// and nothing queued uses it.
pub unsafe fn free(address: DevicePtr) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { cu::free_sync(address) }
}

/// `len` bytes of pinned host memory mapped into the device's address
/// space (portable across contexts).
///
/// # Safety
/// A context is bound to this thread; the caller frees the memory with
/// [`free_host`] once nothing queued uses it.
pub unsafe fn malloc_host_mapped(len: usize) -> Result<*mut u8, DriverError> {
    let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
    // SAFETY: per this function's contract.
    unsafe { cu::malloc_host(len, flags) }.map(|host| host.cast())
}

/// The device address of mapped pinned memory at `host`.
///
/// # Safety
/// `host` came from [`malloc_host_mapped`] and is not freed yet.
pub unsafe fn device_pointer_of(host: *mut u8) -> Result<DevicePtr, DriverError> {
    let mut on_device: DevicePtr = 0;
    // SAFETY: per this function's contract; the driver writes one address.
    unsafe { sys::cuMemHostGetDevicePointer_v2(&mut on_device, host.cast(), 0) }.result()?;
    Ok(on_device)
}

/// Frees mapped pinned memory.
///
/// # Safety
/// `host` came from [`malloc_host_mapped`], is not freed yet, and nothing
/// queued uses it.
pub unsafe fn free_host(host: *mut u8) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { cu::free_host(host.cast()) }
}

/// An event without timing, on the bound context.
pub fn create_event() -> Result<Event, DriverError> {
    cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
}

/// Records `event` on `stream`.
///
/// # Safety
/// `event` is live; `stream` is null or a live stream of the event's context.
pub unsafe fn record(event: Event, stream: Stream) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { cu::event::record(event, stream) }
}

/// Whether the work before `event`'s last record has completed.
///
/// # Safety
/// `event` is live.
pub unsafe fn has_completed(event: Event) -> Result<bool, DriverError> {
    // SAFETY: per this function's contract.
    match unsafe { cu::event::query(event) } {
        Ok(()) => Ok(true),
        Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Waits for the work before `event`'s last record.
///
/// # Safety
/// `event` is live.
pub unsafe fn wait(event: Event) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { cu::event::synchronize(event) }
}

/// Destroys `event`.
///
/// # Safety
/// `event` is live and not used after this.
pub unsafe fn destroy_event(event: Event) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { cu::event::destroy(event) }
}

/// Queues a copy of `bytes` bytes from mapped pinned memory at `from` to
/// device memory at `to` on `stream`.
///
/// # Safety
/// `from .. from + bytes` is pinned host memory and `to .. to + bytes`
/// device memory of the bound context, both live and `from` not written
/// until the copy is done (an event recorded after it completes); `stream`
/// is null or a live stream of that context.
pub unsafe fn copy_to_device_async(
    to: DevicePtr,
    from: *const u8,
    bytes: usize,
    stream: Stream,
) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { sys::cuMemcpyHtoDAsync_v2(to, from.cast(), bytes, stream) }.result()
}

/// Queues `function` on `stream` over `grid` blocks of `threads` threads,
/// with no dynamic shared memory; `params` holds a pointer to each kernel
/// parameter (the driver copies them before this returns).
///
/// # Safety
/// `function` is a kernel of a module loaded in the bound context; each
/// of `params` points to a value of that parameter's type; every address
/// the kernel reads or writes stays valid until its work is done; `stream`
/// is null or a live stream of that context.
pub unsafe fn launch(
    function: &CudaFunction,
    grid: (u32, u32, u32),
    threads: (u32, u32, u32),
    stream: Stream,
    params: &mut [*mut c_void],
) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { cu::launch_kernel(function.cu_function(), grid, threads, 0, stream, params) }
}
