//! Stored checksums for offloaded KV (SPEC section 8) on the device: the
//! `kvcs_store` launch that a store or a load check queues after the
//! call's `kvcs_checksum`, on the same stream, before the call's event.
//!
//! A store writes `sum ^ tag` and the configuration stamp for each item to
//! its block's 16 bytes (device memory of the worker's device or pinned host
//! memory); a load check gathers each item's stored value and stamp into the
//! call's slot, which the result compares once the event completed. The items travel in mapped pinned
//! memory owned by the slot, so they live until the event completes (a
//! slot whose result is dropped early is parked until then). The caller
//! (the module `stored`, above this one) builds the items and checks every
//! block id against its buffer before anything is queued.

use cudarc::driver::{result as cu, sys};

use super::buffers::{device_error, Slot};
use super::descriptors::{DevStoredCall, DevStoredItem, THREADS_PER_BLOCK};
use super::kernels::Kernels;
use crate::error::Result;

/// What a call does with stored checksums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredMode {
    /// Writes `sum ^ tag` and the stamp to every item's address after the checksums.
    Store,
    /// Reads every item's stored value back into the result (a load check).
    Gather,
}

/// The stored-checksum work of one call: one item per block position that
/// holds a valid token, in the order a load check's expectations index.
#[derive(Debug, Clone)]
pub struct StoredWork {
    /// Store or gather.
    pub mode: StoredMode,
    /// The positions, addresses already checked against their buffers.
    pub items: Vec<DevStoredItem>,
}

/// Mapped pinned host memory of a slot: `capacity` items, then two gathered
/// words (value, stamp) per item.
pub struct Staging {
    capacity: usize,
    host: *mut u8,
    on_device: sys::CUdeviceptr,
}

// SAFETY: owned by its slot, which serialises access (see `Slot`).
unsafe impl Send for Staging {}
// SAFETY: shared access only reads gathered values after the event.
unsafe impl Sync for Staging {}

impl Staging {
    /// Staging for `capacity` items (the context is bound).
    pub fn new(capacity: usize) -> Result<Staging> {
        let bytes = capacity * (std::mem::size_of::<DevStoredItem>() + 2 * 8);
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        let mut staging = Staging {
            capacity,
            host: std::ptr::null_mut(),
            on_device: 0,
        };
        // SAFETY: a plain allocation on the bound context, owned (and on
        // failure freed) by `staging`.
        unsafe {
            staging.host = cu::malloc_host(bytes, flags)
                .map_err(device_error("cuMemHostAlloc"))?
                .cast();
            sys::cuMemHostGetDevicePointer_v2(&mut staging.on_device, staging.host.cast(), 0)
                .result()
                .map_err(device_error("cuMemHostGetDevicePointer"))?;
        }
        Ok(staging)
    }

    /// Host address of the gathered values.
    fn gathered_host(&self) -> *mut u64 {
        // SAFETY: inside the allocation; 8-byte aligned (page-aligned base,
        // 40-byte items).
        unsafe {
            self.host
                .add(self.capacity * std::mem::size_of::<DevStoredItem>())
                .cast()
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.host.is_null() {
            // SAFETY: owned; dropped with its slot, which is idle by then.
            let _ = unsafe { cu::free_host(self.host.cast()) };
        }
    }
}

/// A stored-checksum launch, staged and ready to queue.
pub struct StoredLaunch {
    call: DevStoredCall,
    blocks: u32,
}

/// Copies `work`'s items into `slot`'s staging (made or grown here, before
/// anything of the call is queued) and describes the launch. `values` is the
/// device address of the values `kvcs_checksum` publishes, or 0 when the
/// call launches no checksum (every sum is then 0).
pub fn stage(slot: &mut Slot, work: &StoredWork, values: u64) -> Result<Option<StoredLaunch>> {
    let n = work.items.len();
    if n == 0 {
        return Ok(None);
    }
    if !matches!(&slot.stored, Some(staging) if staging.capacity >= n) {
        // More items than the slot was made for: grow (freeing and
        // allocating pinned memory may synchronise, as a new slot may). The
        // small one goes first: the slot is idle, nothing reads it.
        slot.stored = None;
        slot.stored = Some(Staging::new(n.max(256).next_power_of_two())?);
    }
    let staging = slot.stored.as_ref().expect("made above");
    // SAFETY: the slot is idle (taken from the pool) so nothing reads its
    // staging; the items start the allocation, which holds `capacity >= n`.
    let items = unsafe { std::slice::from_raw_parts_mut(staging.host.cast::<DevStoredItem>(), n) };
    items.copy_from_slice(&work.items);
    if values == 0 {
        // A call that computed nothing: every sum is the empty sum.
        for item in items.iter_mut() {
            item.num_columns = 0;
        }
    }
    let gathered = staging.on_device + (staging.capacity * std::mem::size_of::<DevStoredItem>()) as u64;
    Ok(Some(StoredLaunch {
        call: DevStoredCall {
            items: staging.on_device,
            values,
            gathered,
            num_items: n as u32,
            gather: (work.mode == StoredMode::Gather) as u32,
        },
        blocks: n.div_ceil(THREADS_PER_BLOCK as usize) as u32,
    }))
}

/// Queues `launch` on `stream`.
///
/// # Safety
/// The slot whose staging `launch` uses stays held until an event recorded
/// after this completes; every item's address is 16 bytes this device may
/// write (store) or read (gather).
pub unsafe fn enqueue(kernels: &Kernels, launch: &mut StoredLaunch, stream: sys::CUstream) -> Result<()> {
    let mut params = [(&mut launch.call as *mut DevStoredCall).cast::<std::ffi::c_void>()];
    // SAFETY: per this function's contract; the launch copies the parameter.
    unsafe {
        cu::launch_kernel(
            kernels.store.cu_function(),
            (launch.blocks, 1, 1),
            (THREADS_PER_BLOCK, 1, 1),
            0,
            stream,
            &mut params,
        )
    }
    .map_err(device_error("launching kvcs_store"))
}

/// The first `n` gathered words of `slot`, two per item (read only after
/// its event completed).
pub fn gathered(slot: &Slot, n: usize) -> &[u64] {
    match &slot.stored {
        Some(staging) if n > 0 => {
            assert!(n <= 2 * staging.capacity);
            // SAFETY: inside the allocation, written by the gather before the
            // event the caller waited for.
            unsafe { std::slice::from_raw_parts(staging.gathered_host(), n) }
        }
        _ => &[],
    }
}
