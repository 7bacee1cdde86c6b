//! The device engine over cudarc (driver API and NVRTC, both loaded at run
//! time, so the library builds and runs its host engine without CUDA).
//!
//! cudarc panics when it cannot load `libcuda` or `libnvrtc`, so presence is
//! checked first and absence becomes `Error::Device`. A worker uses its
//! device's primary context, shared with PyTorch or the engine in-process.
//! Each `checksum` call is one kernel launch plus, for calls of more than
//! [`descriptors::INLINE_ROWS`] rows, one row upload; nothing blocks the host.

mod buffers;
mod descriptors;
mod kernels;

pub use self::kernels::checksum_ptx;

use std::sync::Arc;

use cudarc::driver::{result as cu, sys, CudaContext};

use self::buffers::{device_error, DeviceTable, Slot, SlotPool};
use self::descriptors::{DevCall, DevLayer, DevRow, LayerTable, INLINE_ROWS};
use self::kernels::Kernels;
use crate::error::{err, Result};
use crate::layout::{Layout, Role};
use crate::plan::Plan;
use crate::result::{PendingValues, Values};
use crate::worker::StreamHandle;

/// Threads per block of the checksum kernel (its `__launch_bounds__`).
const THREADS_PER_BLOCK: u32 = 256;

/// Whether the CUDA driver and NVRTC libraries can be loaded.
pub fn libraries_present() -> bool {
    // SAFETY: these only try to dlopen the libraries and drop the handles.
    unsafe { cudarc::driver::sys::is_culib_present() && cudarc::nvrtc::sys::is_culib_present() }
}

/// The primary context of device `ordinal`, or `Error::Device`.
pub fn primary_context(ordinal: u32) -> Result<Arc<CudaContext>> {
    if !libraries_present() {
        return Err(err!(
            Device,
            "device {ordinal}: the CUDA driver (libcuda) or NVRTC (libnvrtc) cannot be loaded on this machine"
        ));
    }
    let count = CudaContext::device_count().map_err(|e| err!(Device, "device {ordinal}: cuDeviceGetCount failed: {e}"))?;
    if ordinal as i64 >= count as i64 {
        return Err(err!(Device, "device {ordinal} is not below the {count} CUDA devices present"));
    }
    CudaContext::new(ordinal as usize)
        .map_err(|e| err!(Device, "device {ordinal}: retaining the primary context failed: {e}"))
}

/// A device worker's engine.
pub struct DeviceEngine {
    context: Arc<CudaContext>,
    kernels: Arc<Kernels>,
    pool: Arc<SlotPool>,
    /// Used when the caller passes no stream.
    own_stream: sys::CUstream,
    /// Host copy of the layer table (ranges per group and role).
    table: LayerTable,
    /// Its device copy; None before the first layer.
    device_table: Option<Arc<DeviceTable>>,
    /// Warps the card runs at once with this kernel.
    resident_warps: u64,
}

// SAFETY: the stream handle is only used with the context bound, and CUDA
// streams may be used from any thread.
unsafe impl Send for DeviceEngine {}
// SAFETY: as above; shared calls only enqueue work.
unsafe impl Sync for DeviceEngine {}

impl DeviceEngine {
    /// The engine of device `ordinal`: its primary context, its kernels
    /// (compiled by NVRTC on first use of the device) and a stream.
    pub fn new(ordinal: u32) -> Result<DeviceEngine> {
        let context = primary_context(ordinal)?;
        context.bind_to_thread().map_err(device_error("cuCtxSetCurrent"))?;
        let kernels = kernels::kernels(&context)?;
        let processors = context
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(device_error("cuDeviceGetAttribute"))?;
        let mut blocks_per_processor = 0;
        // SAFETY: a valid function of a loaded module.
        unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut blocks_per_processor,
                kernels.checksum.cu_function(),
                THREADS_PER_BLOCK as i32,
                0,
            )
            .result()
            .map_err(device_error("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
        }
        let resident_warps =
            (processors.max(1) as u64) * (blocks_per_processor.max(1) as u64) * (THREADS_PER_BLOCK as u64 / 32);
        let own_stream =
            cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(device_error("cuStreamCreate"))?;
        Ok(DeviceEngine {
            pool: Arc::new(SlotPool::new(context.clone())),
            context,
            kernels,
            own_stream,
            table: LayerTable::default(),
            device_table: None,
            resident_warps,
        })
    }

    /// Uploads every group's layer descriptors after a registration.
    pub fn upload_layout(&mut self, layout: &Layout) -> Result<()> {
        self.context.bind_to_thread().map_err(device_error("cuCtxSetCurrent"))?;
        let table = LayerTable::new(layout)?;
        // SAFETY: DevLayer is plain old data (repr(C), no padding holes read).
        let bytes = unsafe {
            std::slice::from_raw_parts(
                table.layers.as_ptr().cast::<u8>(),
                std::mem::size_of_val(table.layers.as_slice()),
            )
        };
        let device_table = DeviceTable::upload(&self.context, bytes)?;
        self.table = table;
        self.device_table = Some(Arc::new(device_table));
        Ok(())
    }

    /// Queues the plan's checksums on `stream` (or the worker's own) and
    /// returns without waiting: one kernel launch, one event.
    pub fn compute(&self, _layout: &Layout, plan: &Plan, role: Role, stream: StreamHandle) -> Result<Values> {
        let num_values = plan.num_values;
        if num_values > u32::MAX as usize {
            return Err(err!(Unsupported, "{num_values} values in one call is more than the device engine takes"));
        }
        let (Some(device_table), false) = (&self.device_table, plan.rows.is_empty()) else {
            // Nothing to read: every value is the empty sum.
            return Ok(Values::Ready(vec![0; num_values]));
        };
        self.context.bind_to_thread().map_err(device_error("cuCtxSetCurrent"))?;
        let stream = if stream.0.is_null() { self.own_stream } else { stream.0 as sys::CUstream };
        let rows_on_device = plan.rows.len() > INLINE_ROWS;
        let mut slot = self.pool.take(if rows_on_device { plan.rows.len() } else { 0 }, num_values)?;
        let mut call = DevCall {
            layers: device_table.address,
            rows: 0,
            accumulators: slot.accumulators(),
            host_values: slot.host_values_on_device(),
            finished_blocks: slot.finished_blocks(),
            total_units: 0,
            num_rows: plan.rows.len() as u32,
            num_values: num_values as u32,
            inline_rows: [DevRow::default(); INLINE_ROWS],
        };
        let rows: &mut [DevRow] = if rows_on_device {
            call.rows = slot.device_rows();
            slot.host_rows(plan.rows.len())
        } else {
            &mut call.inline_rows[..plan.rows.len()]
        };
        let mut total_units = 0u64;
        for (device_row, row) in rows.iter_mut().zip(&plan.rows) {
            let range = self.table.ranges[&(row.group_id, role)];
            *device_row = DevRow {
                first_token: row.first_token,
                unit_start: total_units,
                block_id: row.block_id,
                valid_tokens: row.valid_tokens,
                out: row.out as u32,
                column_stride: row.column_stride as u32,
                layers_begin: range.begin,
                layers_end: range.end,
            };
            total_units += range.units_per_row;
        }
        call.total_units = total_units;
        let warps = total_units.min(self.resident_warps).max(1);
        let blocks = warps.div_ceil(THREADS_PER_BLOCK as u64 / 32) as u32;
        // SAFETY: every address in `call` is live until the slot's event
        // completes (the slot and table stay held until then); the rows in
        // pinned memory are not touched again before that; the kernel reads
        // cache bytes that registration proved lie in registered regions.
        unsafe {
            if rows_on_device {
                let staged: &[DevRow] = slot.host_rows(plan.rows.len());
                cu::memcpy_htod_async(call.rows, staged, stream).map_err(device_error("cuMemcpyHtoDAsync"))?;
            }
            let mut params = [(&mut call as *mut DevCall).cast::<std::ffi::c_void>()];
            cu::launch_kernel(
                self.kernels.checksum.cu_function(),
                (blocks, 1, 1),
                (THREADS_PER_BLOCK, 1, 1),
                0,
                stream,
                &mut params,
            )
            .map_err(device_error("launching kvcs_checksum"))?;
            cu::event::record(slot.event, stream).map_err(device_error("cuEventRecord"))?;
        }
        slot.table = Some(device_table.clone());
        Ok(Values::Pending(Box::new(DevicePending {
            context: self.context.clone(),
            pool: self.pool.clone(),
            slot: Some(slot),
            num_values,
        })))
    }
}

impl Drop for DeviceEngine {
    fn drop(&mut self) {
        // Work still queued on the stream finishes first; the driver frees it then.
        if self.context.bind_to_thread().is_ok() {
            // SAFETY: our own stream, destroyed once.
            let _ = unsafe { cu::stream::destroy(self.own_stream) };
        }
    }
}

/// Values being computed on a device; readable once the slot's event completed.
struct DevicePending {
    context: Arc<CudaContext>,
    pool: Arc<SlotPool>,
    slot: Option<Slot>,
    num_values: usize,
}

impl DevicePending {
    fn slot(&self) -> &Slot {
        self.slot.as_ref().expect("held until drop")
    }
}

impl PendingValues for DevicePending {
    fn is_ready(&self) -> Result<bool> {
        self.slot().is_idle()
    }

    fn wait(&self) -> Result<()> {
        self.context.bind_to_thread().map_err(device_error("cuCtxSetCurrent"))?;
        // SAFETY: the event is live while the slot is held.
        unsafe { cu::event::synchronize(self.slot().event) }.map_err(device_error("cuEventSynchronize"))
    }

    fn values(&self) -> &[u64] {
        self.slot().values(self.num_values)
    }
}

impl Drop for DevicePending {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.pool.give_back(slot);
        }
    }
}

/// Size check: the kernel reads these with the layout of descriptors.cuh.
const _: () = {
    assert!(std::mem::size_of::<DevLayer>() == 184);
    assert!(std::mem::size_of::<DevRow>() == 40);
};
