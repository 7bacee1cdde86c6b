//! Per-call buffers. A slot pairs mapped pinned host memory (the values the
//! kernel publishes, the call's rows and row starts, and the stored
//! checksums' items and gathered words) with device memory (accumulators,
//! the finished-block counter, rows) and an event. Slots are reused once
//! their event completed; a result dropped while its work is in flight
//! parks its slot until then, so destroying a pending result is safe.

use std::mem::{size_of, MaybeUninit};
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;

use super::descriptors::DevStoredItem;
use super::raw::{self, DevicePtr, DriverError, Event};
use crate::base::error::{err, Result};
use crate::plan::Row;

/// Maps a driver error to `Error::Device` with what was being done.
pub fn device_error(what: &str) -> impl FnOnce(DriverError) -> crate::base::error::Error + '_ {
    move |e| err!(Device, "{what} failed: {e}")
}

/// Pinned host memory mapped into the device's address space: the host
/// writes it, the device reads it in place or copies it; the kernels
/// publish into it. Freed on drop, which happens only once nothing queued
/// reads it (its slot is idle).
pub struct Pinned {
    /// Bytes allocated.
    len: usize,
    /// Host address (page-aligned); null until allocated.
    host: *mut u8,
    /// The same memory as the device sees it.
    on_device: DevicePtr,
}

// SAFETY: owned by its slot, which serialises access (see `Slot`).
unsafe impl Send for Pinned {}
// SAFETY: shared access only reads what the device published after the event.
unsafe impl Sync for Pinned {}

impl Pinned {
    /// `len` bytes of mapped pinned memory (the context is bound).
    pub fn new(len: usize) -> Result<Pinned> {
        let mut pinned = Pinned { len, ..Pinned::none() };
        // SAFETY: a plain allocation on the bound context, owned (and on
        // failure freed) by `pinned`; its device address while it is live.
        unsafe {
            pinned.host = raw::malloc_host_mapped(len).map_err(device_error("cuMemHostAlloc"))?;
            pinned.on_device =
                raw::device_pointer_of(pinned.host).map_err(device_error("cuMemHostGetDevicePointer"))?;
        }
        Ok(pinned)
    }

    /// No memory (frees nothing when dropped).
    fn none() -> Pinned {
        Pinned {
            len: 0,
            host: std::ptr::null_mut(),
            on_device: 0,
        }
    }

    /// Host address of byte `offset`, which lies in the allocation.
    fn host_at(&self, offset: usize) -> *mut u8 {
        assert!(offset <= self.len);
        // SAFETY: inside the allocation (or one past its end).
        unsafe { self.host.add(offset) }
    }

    /// Device address of byte `offset`.
    fn device_at(&self, offset: usize) -> u64 {
        self.on_device + offset as u64
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if !self.host.is_null() {
            // SAFETY: owned; dropped with its slot, which is idle by then.
            let _ = unsafe { raw::free_host(self.host) };
        }
    }
}

/// Bytes of one stored-checksum item in a slot's pinned memory: the item,
/// and the two words (value, stamp) a gather reads back for it.
const STORED_ITEM_BYTES: usize = size_of::<DevStoredItem>() + 2 * 8;

/// Buffers for one call in flight.
pub struct Slot {
    /// Rows the slot holds.
    pub row_capacity: usize,
    /// Values the slot holds.
    pub value_capacity: usize,
    /// `value_capacity` values, then `row_capacity` rows and as many row
    /// starts (uploaded from here, or read in place).
    pinned: Pinned,
    /// Device memory: accumulators, the counter (8 bytes), rows, row starts.
    device: DevicePtr,
    /// Recorded after the call's work.
    pub event: Event,
    /// The layer table the call's kernel reads, kept until the call is done.
    pub table: Option<Arc<DeviceTable>>,
    /// Stored checksums' items, then two gathered words per item, for as
    /// many items as rows (made with the slot, so that calls do not
    /// allocate; grown when a call has more).
    stored: Pinned,
}

// SAFETY: the pointers are owned by the slot; access is serialised by the
// pool's lock or by the one result holding the slot.
unsafe impl Send for Slot {}
// SAFETY: shared access only reads the published values after the event.
unsafe impl Sync for Slot {}

impl Slot {
    fn new(row_capacity: usize, value_capacity: usize) -> Result<Slot> {
        let row_bytes = row_capacity * (size_of::<Row>() + 8);
        let device_bytes = value_capacity * 8 + 8 + row_bytes;
        let pinned = Pinned::new(value_capacity * 8 + row_bytes)?;
        let stored = Pinned::new(row_capacity * STORED_ITEM_BYTES)?;
        // Drop frees whatever was allocated when a later step fails.
        let mut slot = Slot {
            row_capacity,
            value_capacity,
            pinned,
            device: 0,
            event: std::ptr::null_mut(),
            table: None,
            stored,
        };
        // SAFETY: plain allocations on the bound context, owned by the slot.
        unsafe {
            slot.device = raw::malloc(device_bytes).map_err(device_error("cuMemAlloc"))?;
            // Accumulators and counter start at zero; the kernel leaves them so.
            raw::zero(slot.device, value_capacity * 8 + 8).map_err(device_error("cuMemsetD8"))?;
            slot.event = raw::create_event().map_err(device_error("cuEventCreate"))?;
        }
        Ok(slot)
    }

    /// Byte offset of the rows in the pinned memory.
    fn rows_offset(&self) -> usize {
        self.value_capacity * 8
    }

    /// All of the pinned rows, to be written before [`Slot::rows_and_starts`]
    /// reads them.
    pub fn row_room(&mut self) -> &mut [MaybeUninit<Row>] {
        // SAFETY: rows follow the values in the pinned allocation, 8-byte
        // aligned (page-aligned base, 8-byte multiples), with room for
        // `row_capacity` of them; MaybeUninit makes no claim on the bytes.
        unsafe { std::slice::from_raw_parts_mut(self.pinned.host_at(self.rows_offset()).cast(), self.row_capacity) }
    }

    /// The first `n` pinned rows and, right after them, `n` row starts (so
    /// that one copy carries both, no more than they need).
    pub fn rows_and_starts(&mut self, n: usize) -> (&mut [Row], &mut [u64]) {
        assert!(n <= self.row_capacity);
        let rows = self.pinned.host_at(self.rows_offset());
        // SAFETY: as in `row_room`; the starts follow the `n` rows, 8-byte
        // aligned, inside the allocation (room for `row_capacity` rows and
        // as many starts). The two slices do not overlap.
        unsafe {
            let starts = rows.add(n * size_of::<Row>());
            (
                std::slice::from_raw_parts_mut(rows.cast(), n),
                std::slice::from_raw_parts_mut(starts.cast(), n),
            )
        }
    }

    /// Host address of the pinned rows, `offset` bytes in (rows, then starts).
    pub fn pinned_rows(&self, offset: usize) -> *const u8 {
        assert!(offset <= self.row_capacity * (size_of::<Row>() + 8));
        self.pinned.host_at(self.rows_offset() + offset)
    }

    /// Device address of the pinned rows (mapped memory).
    pub fn pinned_rows_on_device(&self) -> u64 {
        self.pinned.device_at(self.rows_offset())
    }

    /// The first `n` published values (read only after the event completed).
    pub fn values(&self, n: usize) -> &[u64] {
        assert!(n <= self.value_capacity);
        // SAFETY: the values start the pinned allocation.
        unsafe { std::slice::from_raw_parts(self.pinned.host.cast(), n) }
    }

    /// Device address of the published values (mapped host memory).
    pub fn host_values_on_device(&self) -> u64 {
        self.pinned.device_at(0)
    }

    /// Device address of the accumulators.
    pub fn accumulators(&self) -> u64 {
        self.device
    }

    /// Device address of the finished-block counter.
    pub fn finished_blocks(&self) -> u64 {
        self.device + self.value_capacity as u64 * 8
    }

    /// Device address of the rows (the pinned rows' device twin, laid out
    /// alike: rows, then starts).
    pub fn device_rows(&self) -> u64 {
        self.finished_blocks() + 8
    }

    /// Items the stored-checksum memory holds.
    fn stored_capacity(&self) -> usize {
        self.stored.len / STORED_ITEM_BYTES
    }

    /// Room for `n` stored-checksum items, grown first where the slot holds
    /// fewer (freeing and allocating pinned memory may synchronise, as a
    /// new slot may): the slot must be idle.
    pub fn stored_items(&mut self, n: usize) -> Result<&mut [DevStoredItem]> {
        if self.stored_capacity() < n {
            // The small one goes first: the slot is idle, nothing reads it.
            self.stored = Pinned::none();
            self.stored = Pinned::new(n.max(256).next_power_of_two() * STORED_ITEM_BYTES)?;
        }
        // SAFETY: the items start the allocation, 8-byte aligned, which
        // holds at least `n`; the slot is idle, so nothing reads them.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.stored.host.cast(), n) })
    }

    /// Device addresses of the stored-checksum items and of the words
    /// gathered after them.
    pub fn stored_on_device(&self) -> (u64, u64) {
        let items = self.stored_capacity() * size_of::<DevStoredItem>();
        (self.stored.device_at(0), self.stored.device_at(items))
    }

    /// The first `n` gathered words, two per item (read only after the
    /// event completed).
    pub fn gathered(&self, n: usize) -> &[u64] {
        if n == 0 {
            return &[];
        }
        assert!(n <= 2 * self.stored_capacity());
        let items = self.stored_capacity() * size_of::<DevStoredItem>();
        // SAFETY: inside the allocation, 8-byte aligned (40-byte items),
        // written by the gather before the event the caller waited for.
        unsafe { std::slice::from_raw_parts(self.stored.host_at(items).cast(), n) }
    }

    /// Whether the slot's last work completed.
    pub fn is_idle(&self) -> Result<bool> {
        // SAFETY: the event is live while the slot is.
        unsafe { raw::has_completed(self.event) }.map_err(device_error("cuEventQuery"))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // SAFETY: owned allocations (null where never made); a slot is only
        // dropped when idle (the pool waits for parked slots first). Its
        // pinned memory frees itself.
        unsafe {
            if !self.event.is_null() {
                let _ = raw::destroy_event(self.event);
            }
            if self.device != 0 {
                let _ = raw::free(self.device);
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
                let _ = unsafe { raw::wait(slot.event) };
            }
        }
    }
}

/// A layout's layer descriptors in device memory.
pub struct DeviceTable {
    context: Arc<CudaContext>,
    /// Device address of the first descriptor.
    pub address: DevicePtr,
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
            table.address = raw::malloc(bytes.len().max(8)).map_err(device_error("cuMemAlloc"))?;
            raw::copy_to_device(table.address, bytes).map_err(device_error("cuMemcpyHtoD"))?;
        }
        Ok(table)
    }
}

impl Drop for DeviceTable {
    fn drop(&mut self) {
        if self.address != 0 && self.context.bind_to_thread().is_ok() {
            // SAFETY: the table owns the allocation at `address` (made by
            // `malloc_sync` in its context, bound just above), and every
            // call that read it holds an Arc of it until it is done, so no
            // launch still uses it.
            let _ = unsafe { raw::free(self.address) };
        }
    }
}
