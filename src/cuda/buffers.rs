//! Per-call buffers. A slot pairs mapped pinned host memory (row staging and
//! the values the kernel publishes) with device memory (accumulators, the
//! finished-block counter, rows) and an event. Slots are reused once their
//! event completed; a result dropped while its work is in flight parks its
//! slot until then, so destroying a pending result is safe.

use std::sync::{Arc, Mutex};

use cudarc::driver::{result as cu, sys, CudaContext};

use crate::error::{err, Result};
use crate::plan::Row;

/// Maps a driver error to `Error::Device` with what was being done.
pub fn device_error(what: &str) -> impl FnOnce(cu::DriverError) -> crate::error::Error + '_ {
    move |e| err!(Device, "{what} failed: {e}")
}

/// Buffers for one call in flight.
pub struct Slot {
    /// Rows the slot holds.
    pub row_capacity: usize,
    /// Values the slot holds.
    pub value_capacity: usize,
    /// Pinned, mapped host memory: `value_capacity` values, then
    /// `row_capacity` rows and as many row starts (the staging of uploads).
    host: *mut u8,
    /// The same memory as the device sees it.
    host_on_device: sys::CUdeviceptr,
    /// Device memory: accumulators, the counter (8 bytes), rows, row starts.
    device: sys::CUdeviceptr,
    /// Recorded after the call's work.
    pub event: sys::CUevent,
    /// The layer table the call's kernel reads, kept until the call is done.
    pub table: Option<Arc<DeviceTable>>,
    /// Stored checksums' items and gathered values, for as many items as
    /// rows (made with the slot, so that calls do not allocate; grown when a
    /// call has more).
    pub stored: Option<super::stored::Staging>,
}

// SAFETY: the pointers are owned by the slot; access is serialised by the
// pool's lock or by the one result holding the slot.
unsafe impl Send for Slot {}
// SAFETY: shared access only reads the published values after the event.
unsafe impl Sync for Slot {}

impl Slot {
    fn new(row_capacity: usize, value_capacity: usize) -> Result<Slot> {
        let staging_bytes = row_capacity * (std::mem::size_of::<Row>() + 8);
        let host_bytes = value_capacity * 8 + staging_bytes;
        let device_bytes = value_capacity * 8 + 8 + staging_bytes;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // Drop frees whatever was allocated when a later step fails.
        let mut slot = Slot {
            row_capacity,
            value_capacity,
            host: std::ptr::null_mut(),
            host_on_device: 0,
            device: 0,
            event: std::ptr::null_mut(),
            table: None,
            stored: None,
        };
        // SAFETY: plain allocations on the bound context, owned by the slot.
        unsafe {
            slot.host = cu::malloc_host(host_bytes, flags)
                .map_err(device_error("cuMemHostAlloc"))?
                .cast();
            sys::cuMemHostGetDevicePointer_v2(&mut slot.host_on_device, slot.host.cast(), 0)
                .result()
                .map_err(device_error("cuMemHostGetDevicePointer"))?;
            slot.device = cu::malloc_sync(device_bytes).map_err(device_error("cuMemAlloc"))?;
            // Accumulators and counter start at zero; the kernel leaves them so.
            cu::memset_d8_sync(slot.device, 0, value_capacity * 8 + 8).map_err(device_error("cuMemsetD8"))?;
            slot.event = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(device_error("cuEventCreate"))?;
        }
        slot.stored = Some(super::stored::Staging::new(row_capacity)?);
        Ok(slot)
    }

    /// Pinned staging for `n` rows and, right after them, `n` unit starts
    /// (host side); a call's rows and starts are uploaded together by one
    /// copy of [`Slot::staging_bytes`] bytes, no more than they need.
    pub fn staging(&mut self, n: usize) -> (&mut [Row], &mut [u64]) {
        assert!(n <= self.row_capacity);
        // SAFETY: rows follow the values in the pinned allocation and the
        // starts follow the `n` rows; both are 8-byte aligned (page-aligned
        // base, 8-byte multiples) and lie inside it (room for `row_capacity`
        // rows and as many starts).
        unsafe {
            let rows = self.host.add(self.value_capacity * 8);
            let starts = rows.add(n * std::mem::size_of::<Row>());
            (
                std::slice::from_raw_parts_mut(rows.cast(), n),
                std::slice::from_raw_parts_mut(starts.cast(), n),
            )
        }
    }

    /// All of the pinned row staging, to be written before [`Slot::staging`]
    /// reads it.
    pub fn staging_room(&mut self) -> &mut [std::mem::MaybeUninit<Row>] {
        // SAFETY: as in `staging`; MaybeUninit makes no claim on the bytes.
        unsafe {
            let rows = self.host.add(self.value_capacity * 8);
            std::slice::from_raw_parts_mut(rows.cast(), self.row_capacity)
        }
    }

    /// Host address of the staging (rows, then row starts).
    pub fn staging_host(&self) -> *const u8 {
        // SAFETY: inside the pinned allocation.
        unsafe { self.host.add(self.value_capacity * 8) }
    }

    /// Device address of the staging (mapped pinned memory).
    pub fn staging_on_device(&self) -> u64 {
        self.host_on_device + self.value_capacity as u64 * 8
    }

    /// Bytes from the staging's start to the end of the first `starts` row
    /// starts of [`Slot::staging`]`(rows)`.
    pub fn staging_bytes(&self, rows: usize, starts: usize) -> usize {
        rows * std::mem::size_of::<Row>() + starts * 8
    }

    /// The first `n` published values (read only after the event completed).
    pub fn values(&self, n: usize) -> &[u64] {
        assert!(n <= self.value_capacity);
        // SAFETY: the values start the pinned allocation.
        unsafe { std::slice::from_raw_parts(self.host.cast(), n) }
    }

    /// Device address of the published values (mapped host memory).
    pub fn host_values_on_device(&self) -> u64 {
        self.host_on_device
    }

    /// Device address of the accumulators.
    pub fn accumulators(&self) -> u64 {
        self.device
    }

    /// Device address of the finished-block counter.
    pub fn finished_blocks(&self) -> u64 {
        self.device + self.value_capacity as u64 * 8
    }

    /// Device address of the rows (the staging's device twin).
    pub fn device_rows(&self) -> u64 {
        self.finished_blocks() + 8
    }

    /// Device address of the row starts of [`Slot::staging`]`(rows)`.
    pub fn device_row_starts(&self, rows: usize) -> u64 {
        self.device_rows() + (rows * std::mem::size_of::<Row>()) as u64
    }

    /// Whether the slot's last work completed.
    pub fn is_idle(&self) -> Result<bool> {
        // SAFETY: the event is live while the slot is.
        match unsafe { cu::event::query(self.event) } {
            Ok(()) => Ok(true),
            Err(cu::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(device_error("cuEventQuery")(e)),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // SAFETY: owned allocations (null where never made); a slot is only
        // dropped when idle (the pool waits for parked slots first).
        unsafe {
            if !self.event.is_null() {
                let _ = cu::event::destroy(self.event);
            }
            if self.device != 0 {
                let _ = cu::free_sync(self.device);
            }
            if !self.host.is_null() {
                let _ = cu::free_host(self.host.cast());
            }
        }
    }
}

/// A device's free and parked slots.
pub struct SlotPool {
    context: Arc<CudaContext>,
    free: Mutex<Vec<Slot>>,
    parked: Mutex<Vec<Slot>>,
}

impl SlotPool {
    /// An empty pool on `context`.
    pub fn new(context: Arc<CudaContext>) -> SlotPool {
        SlotPool {
            context,
            free: Mutex::new(Vec::new()),
            parked: Mutex::new(Vec::new()),
        }
    }

    /// Makes `count` free slots ahead of use, so that the first calls do not
    /// allocate (allocation may synchronise the device).
    pub fn reserve(&self, count: usize, rows: usize, values: usize) -> Result<()> {
        let slots = (0..count)
            .map(|_| Slot::new(rows, values))
            .collect::<Result<Vec<_>>>()?;
        self.free
            .lock()
            .map_err(|_| err!(Internal, "slot pool lock poisoned"))?
            .extend(slots);
        Ok(())
    }

    /// A slot holding at least `rows` rows and `values` values.
    ///
    /// A free slot that fits serves the call under one lock, with no device
    /// call; parked slots are polled only when none does, before allocating.
    pub fn take(&self, rows: usize, values: usize) -> Result<Slot> {
        if let Some(slot) = self.take_free(rows, values)? {
            return Ok(slot);
        }
        self.reap()?;
        if let Some(slot) = self.take_free(rows, values)? {
            return Ok(slot);
        }
        Slot::new(rows.max(64).next_power_of_two(), values.max(256).next_power_of_two())
    }

    /// A free slot holding at least `rows` rows and `values` values, if any.
    fn take_free(&self, rows: usize, values: usize) -> Result<Option<Slot>> {
        let mut free = self
            .free
            .lock()
            .map_err(|_| err!(Internal, "slot pool lock poisoned"))?;
        Ok(free
            .iter()
            .position(|s| s.row_capacity >= rows && s.value_capacity >= values)
            .map(|i| free.swap_remove(i)))
    }

    /// Gives back a slot: free if its work is done, parked otherwise.
    pub fn give_back(&self, mut slot: Slot) {
        let idle = slot.is_idle().unwrap_or(false);
        if idle {
            slot.table = None;
        }
        let list = if idle { &self.free } else { &self.parked };
        if let Ok(mut list) = list.lock() {
            list.push(slot);
        } else {
            // A poisoned pool: never free memory the device may still use.
            std::mem::forget(slot);
        }
    }

    /// Moves parked slots whose work completed to the free list.
    fn reap(&self) -> Result<()> {
        let mut parked = self
            .parked
            .lock()
            .map_err(|_| err!(Internal, "slot pool lock poisoned"))?;
        let mut done = Vec::new();
        let mut i = 0;
        while i < parked.len() {
            if parked[i].is_idle()? {
                let mut slot = parked.swap_remove(i);
                slot.table = None;
                done.push(slot);
            } else {
                i += 1;
            }
        }
        drop(parked);
        if !done.is_empty() {
            let mut free = self
                .free
                .lock()
                .map_err(|_| err!(Internal, "slot pool lock poisoned"))?;
            free.extend(done);
        }
        Ok(())
    }
}

impl Drop for SlotPool {
    fn drop(&mut self) {
        if self.context.bind_to_thread().is_err() {
            return;
        }
        if let Ok(parked) = self.parked.get_mut() {
            for slot in parked.iter() {
                // SAFETY: the event is live; wait so its memory is no longer in use.
                let _ = unsafe { cu::event::synchronize(slot.event) };
            }
        }
    }
}

/// A layout's layer descriptors in device memory.
pub struct DeviceTable {
    context: Arc<CudaContext>,
    /// Device address of the first descriptor.
    pub address: sys::CUdeviceptr,
}

impl DeviceTable {
    /// Uploads `bytes` (blocking: registration may wait, checksums never do).
    pub fn upload(context: &Arc<CudaContext>, bytes: &[u8]) -> Result<DeviceTable> {
        let mut table = DeviceTable {
            context: context.clone(),
            address: 0,
        };
        // SAFETY: a plain allocation and copy on the bound context.
        unsafe {
            table.address = cu::malloc_sync(bytes.len().max(8)).map_err(device_error("cuMemAlloc"))?;
            cu::memcpy_htod_sync(table.address, bytes).map_err(device_error("cuMemcpyHtoD"))?;
        }
        Ok(table)
    }
}

impl Drop for DeviceTable {
    fn drop(&mut self) {
        // SAFETY: owned; every call that read it holds an Arc until it is done.
        if self.address != 0 && self.context.bind_to_thread().is_ok() {
            let _ = unsafe { cu::free_sync(self.address) };
        }
    }
}
