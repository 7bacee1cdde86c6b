//! Stored checksums for offloaded KV (SPEC section 8) on the device: the
//! `kvcs_store` launch that a store or a load check queues after the
//! call's `kvcs_checksum`, on the same stream, before the call's event.
//!
//! A store writes each item's entry to its block's 16 bytes (device memory
//! of the worker's device or pinned host memory): `sum ^ tag`, then the
//! stamp, the item's digest under the check the kernel computes from the
//! value and the item's key (`crate::base::stored_entry`); a load check gathers
//! each item's stored value and stamp into the call's slot, which the
//! result compares once the event completed. The
//! items travel in the slot's mapped pinned memory, so they live until the
//! event completes (a slot whose result is dropped early is parked until
//! then). The caller (the module `stored`, above this one) builds the items
//! and checks every block id against its buffer before anything is queued.

use super::buffers::{device_error, Slot};
use super::descriptors::{DevStoredCall, DevStoredItem, THREADS_PER_BLOCK};
use super::kernels::Kernels;
use super::raw::{self, Stream};
use crate::base::error::Result;

/// What a call does with stored checksums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredMode {
    /// Writes the entry (`sum ^ tag`, then the stamp) to every item's address after the checksums.
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

/// Writes `work`'s items into `slot` (idle; its item memory grown here,
/// before anything of the call is queued) and gives the launch's
/// parameter. `values` is the device address of the values `kvcs_checksum`
/// publishes, or 0 when the call launches no checksum (every sum is then 0).
pub fn write_items(slot: &mut Slot, work: &StoredWork, values: u64) -> Result<DevStoredCall> {
    let n = work.items.len();
    let items = slot.stored_items(n)?;
    items.copy_from_slice(&work.items);
    if values == 0 {
        // A call that computed nothing: every sum is the empty sum.
        for item in items.iter_mut() {
            item.num_columns = 0;
        }
    }
    let (items, gathered) = slot.stored_on_device();
    Ok(DevStoredCall {
        items,
        values,
        gathered,
        num_items: n as u32,
        gather: (work.mode == StoredMode::Gather) as u32,
    })
}

/// Queues `kvcs_store` with parameter `call` on `blocks` blocks on `stream`.
///
/// # Safety
/// The slot whose items `call` names stays held until an event recorded
/// after this completes; every item's address is 16 bytes this device may
/// write (store) or read (gather).
pub unsafe fn enqueue(kernels: &Kernels, call: &mut DevStoredCall, blocks: u32, stream: Stream) -> Result<()> {
    let mut params = [(call as *mut DevStoredCall).cast::<std::ffi::c_void>()];
    // SAFETY: per this function's contract; the launch copies the parameter.
    unsafe {
        raw::launch(
            &kernels.store,
            (blocks, 1, 1),
            (THREADS_PER_BLOCK, 1, 1),
            stream,
            &mut params,
        )
    }
    .map_err(device_error("launching kvcs_store"))
}
