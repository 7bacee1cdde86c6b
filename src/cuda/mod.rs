//! The device engine over cudarc (driver API and NVRTC, both loaded at run
//! time, so the library builds and runs its host engine without CUDA).
//!
//! cudarc panics when it cannot load `libcuda` or `libnvrtc`, so presence is
//! checked first and absence becomes `Error::Device`. A worker uses its
//! device's primary context, shared with PyTorch or the engine in-process.
//! Each `checksum` call is one kernel launch plus, for calls of more than
//! [`descriptors::INLINE_ROWS`] rows, one row upload; a call with rows of
//! state groups (SPEC section 6) queues the state kernel before it (and,
//! for more than [`descriptors::INLINE_STATE_ROWS`] of them, their upload).
//! Nothing blocks the host.

mod buffers;
mod descriptors;
mod kernels;
mod launch;
mod stored;

pub use self::descriptors::DevStoredItem;
pub use self::kernels::checksum_ptx;
pub use self::stored::{StoredMode, StoredWork};

use std::sync::Arc;

use cudarc::driver::{result as cu, sys, CudaContext};

use self::buffers::{device_error, DeviceTable, Slot, SlotPool};
use self::descriptors::{
    role_index, DevCall, DevGroup, DevStateCall, LayerTable, INLINE_GROUPS, INLINE_ROWS, INLINE_STATE_ROWS,
    THREADS_PER_BLOCK, WARP,
};
use self::kernels::Kernels;
use self::launch::{launch_shape, row_starts, state_grid};
use crate::checksum::Algorithm;
use crate::error::{err, Result};
use crate::layout::{Layout, Role};
use crate::plan::{Plan, Row, RowRoom};
use crate::result::{PendingValues, Values};
use crate::stream::StreamHandle;

/// Call buffers made with the engine (more are made when more calls are in flight).
const RESERVED_SLOTS: usize = 4;

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
    let count =
        CudaContext::device_count().map_err(|e| err!(Device, "device {ordinal}: cuDeviceGetCount failed: {e}"))?;
    if ordinal as i64 >= count as i64 {
        return Err(err!(
            Device,
            "device {ordinal} is not below the {count} CUDA devices present"
        ));
    }
    CudaContext::new(ordinal as usize)
        .map_err(|e| err!(Device, "device {ordinal}: retaining the primary context failed: {e}"))
}

/// A device worker's engine.
pub struct DeviceEngine {
    context: Arc<CudaContext>,
    kernels: Arc<Kernels>,
    pool: Arc<SlotPool>,
    /// Host copy of the layer table (groups per role, layers).
    table: LayerTable,
    /// Its device copy; None before the first layer.
    device_table: Option<Arc<DeviceTable>>,
    /// Warps the card runs at once with the checksum kernel.
    resident_warps: u64,
    /// The same for `kvcs_checksum_unpaired`.
    unpaired_resident_warps: u64,
    /// The same for `kvcs_checksum_single_head`.
    single_head_resident_warps: u64,
    /// Warps the card runs at once with the state kernel.
    state_resident_warps: u64,
    /// What the engine runs on, for logs.
    description: String,
}

// SAFETY: the engine holds CUDA handles (context, module, device memory)
// that the driver lets any thread use once the context is bound, which every
// call does first.
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
        let blocks_per_processor = |function: &cudarc::driver::CudaFunction| -> Result<i32> {
            let mut blocks = 0;
            // SAFETY: a valid function of a loaded module.
            unsafe {
                sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    &mut blocks,
                    function.cu_function(),
                    THREADS_PER_BLOCK as i32,
                    0,
                )
                .result()
                .map_err(device_error("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
            }
            Ok(blocks)
        };
        let resident =
            |blocks: i32| (processors.max(1) as u64) * (blocks.max(1) as u64) * (THREADS_PER_BLOCK / WARP) as u64;
        let registers = |function: &cudarc::driver::CudaFunction| {
            function
                .get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS)
                .unwrap_or(0)
        };
        let checksum_blocks = blocks_per_processor(&kernels.checksum)?;
        let unpaired_blocks = blocks_per_processor(&kernels.checksum_unpaired)?;
        let single_head_blocks = blocks_per_processor(&kernels.checksum_single_head)?;
        let state_blocks = blocks_per_processor(&kernels.state)?;
        let (major, minor) = context.compute_capability().unwrap_or((0, 0));
        let description = format!(
            "device {ordinal} (sm_{major}{minor}, {processors} SMs): kvcs_checksum uses {} registers, \
             {checksum_blocks} blocks of {THREADS_PER_BLOCK} threads per SM; kvcs_checksum_unpaired {} registers, \
             {unpaired_blocks} blocks per SM; kvcs_checksum_single_head {} registers, {single_head_blocks} blocks \
             per SM; kvcs_state {} registers, {state_blocks} blocks per SM",
            registers(&kernels.checksum),
            registers(&kernels.checksum_unpaired),
            registers(&kernels.checksum_single_head),
            registers(&kernels.state),
        );
        let pool = Arc::new(SlotPool::new(context.clone()));
        pool.reserve(RESERVED_SLOTS, 4096, 4096)?;
        Ok(DeviceEngine {
            pool,
            context,
            kernels,
            table: LayerTable::default(),
            device_table: None,
            resident_warps: resident(checksum_blocks),
            unpaired_resident_warps: resident(unpaired_blocks),
            single_head_resident_warps: resident(single_head_blocks),
            state_resident_warps: resident(state_blocks),
            description,
        })
    }

    /// The CUDA device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.context.ordinal() as u32
    }

    /// The device, the kernel's registers and occupancy, for logs.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Checks that `address .. address + length` is memory this device can
    /// read: device memory of this device or pinned host memory, mapped
    /// without gaps (it may span several allocations, as with PyTorch's
    /// expandable segments). A host pointer or a range running past what is
    /// mapped would otherwise fault the kernel and poison the context.
    pub fn check_region(&self, address: u64, length: u64) -> Result<()> {
        self.context.bind_to_thread().map_err(device_error("cuCtxSetCurrent"))?;
        let end = address as u128 + length as u128;
        let mut cursor = address;
        while (cursor as u128) < end {
            let (start, size) = self.allocation_at(cursor).map_err(|reason| {
                if cursor == address {
                    err!(InvalidArgument, "address {address:#x} {reason}")
                } else {
                    err!(
                        OutOfBounds,
                        "address {address:#x} + length {length} runs past mapped memory at {cursor:#x}, which {reason}"
                    )
                }
            })?;
            cursor = start.saturating_add(size as u64).max(cursor + 1);
        }
        Ok(())
    }

    /// The CUDA allocation holding `pointer` (start, size), if it is one this
    /// device reads; otherwise why not.
    fn allocation_at(&self, pointer: u64) -> std::result::Result<(u64, usize), String> {
        let ordinal = self.context.ordinal();
        let mut start: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        let mut memory_type: u32 = 0;
        let mut device: i32 = -1;
        // SAFETY: each call writes one value of the attribute's documented
        // type (CUdeviceptr, size_t, CUmemorytype, int) to the given place.
        unsafe {
            let attributes: [(*mut std::ffi::c_void, sys::CUpointer_attribute); 4] = [
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
                sys::cuPointerGetAttribute(place, attribute, pointer)
                    .result()
                    .map_err(|e| {
                        format!(
                        "is not memory that CUDA knows ({e}); a device worker reads device memory or pinned host memory"
                    )
                    })?;
            }
        }
        if memory_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 && device != ordinal as i32 {
            return Err(format!(
                "is memory of device {device}, not of this worker's device {ordinal}"
            ));
        }
        if size == 0 {
            return Err("lies in an empty CUDA range".to_owned());
        }
        Ok((start, size))
    }

    /// Uploads every group's layer and state descriptors after a
    /// registration; on error the engine keeps its tables.
    pub fn upload_layout(&mut self, layout: &Layout) -> Result<()> {
        self.context.bind_to_thread().map_err(device_error("cuCtxSetCurrent"))?;
        let table = LayerTable::new(layout)?;
        let device_table = DeviceTable::upload(&self.context, &table.to_bytes())?;
        self.table = table;
        self.device_table = Some(Arc::new(device_table));
        Ok(())
    }

    /// A slot for a call of at most `max_rows` rows and `max_values` values,
    /// taken before planning so that [`Plan::write`] puts the rows straight
    /// into its pinned staging ([`Staged::room`]), with no copy.
    pub fn stage(&self, max_rows: usize, max_values: usize) -> Result<Staged> {
        self.context.bind_to_thread().map_err(device_error("cuCtxSetCurrent"))?;
        let slot = self.pool.take(max_rows, max_values)?;
        Ok(Staged {
            slot: Some(slot),
            pool: self.pool.clone(),
            // Rows that go inline are read back by the host: cached.
            streaming: max_rows > INLINE_ROWS,
        })
    }

    /// Queues the checksums of `plan`, whose rows are `rows`, on `stream`
    /// (copied into a slot's staging first: [`DeviceEngine::stage`] avoids
    /// that copy). See [`DeviceEngine::compute_staged`].
    pub fn compute(
        &self,
        plan: &Plan,
        rows: &[Row],
        role: Role,
        algorithm: Algorithm,
        stream: StreamHandle,
    ) -> Result<Values> {
        let mut staged = self.stage(rows.len(), plan.num_values)?;
        for (out, row) in staged.room().rows.iter_mut().zip(rows) {
            out.write(*row);
        }
        self.compute_staged(plan, staged, role, algorithm, stream, None)
    }

    /// Queues the checksums of `plan` under `algorithm`, whose
    /// `plan.num_rows` rows `staged` holds, on `stream` from the thread that staged them (the caller's
    /// handle passed to the driver unchanged; null is the legacy default
    /// stream), then, on the same stream before the call's event, `stored`'s
    /// store or gather (SPEC section 8; see `stored.rs`; its items were
    /// checked by the caller).
    /// Returns without waiting: at most two uploads, two launches (the state
    /// kernel where the call has rows of state groups, then the checksum
    /// kernel, which publishes), the stored launch, one event.
    pub fn compute_staged(
        &self,
        plan: &Plan,
        mut staged: Staged,
        role: Role,
        algorithm: Algorithm,
        stream: StreamHandle,
        stored: Option<&StoredWork>,
    ) -> Result<Values> {
        let num_values = plan.num_values;
        let num_rows = plan.num_rows;
        let (Some(device_table), false) = (&self.device_table, num_rows == 0) else {
            // Nothing to read: every value is the empty sum.
            drop(staged);
            return match stored.filter(|work| !work.items.is_empty()) {
                None => Ok(Values::Ready(vec![0; num_values])),
                Some(work) => self.stored_alone(num_values, work, stream),
            };
        };
        let mut slot = staged.slot.take().expect("held until used");
        if slot.row_capacity < num_rows || slot.value_capacity < num_values {
            let (rows, values) = (slot.row_capacity, slot.value_capacity);
            self.pool.give_back(slot);
            return Err(err!(
                Internal,
                "a slot of {rows} rows and {values} values staged a call of {num_rows} rows and {num_values} values"
            ));
        }
        // `stage` bound the context to this thread.
        let table = &self.table;
        let groups = &table.groups[role_index(role)];
        // Rows of state groups go to the state kernel, the others to the
        // checksum kernel (which skips state slots in its shape).
        // Counted per group slot from the plan, not per row.
        let mut state_rows = 0usize;
        let mut max_state_units = 0u32;
        for (state_group, &count) in table.state_groups.iter().zip(&plan.rows_per_slot) {
            if state_group.units > 0 && count > 0 {
                state_rows += count as usize;
                max_state_units = max_state_units.max(state_group.units);
            }
        }
        let attention_rows = num_rows - state_rows;
        // The paired kernel where some layer reads its K and V as one unit;
        // where every layer holds one head, the one with more loads in
        // flight; else the one with fewer registers (more warps per SM).
        let (checksum_kernel, resident_warps) = if table.paired[role_index(role)] {
            (&self.kernels.checksum, self.resident_warps)
        } else if table.single_head(role) {
            (&self.kernels.checksum_single_head, self.single_head_resident_warps)
        } else {
            (&self.kernels.checksum_unpaired, self.unpaired_resident_warps)
        };
        let shape = launch_shape(
            &plan.rows_per_slot,
            groups,
            &table.max_split[role_index(role)],
            attention_rows,
            resident_warps,
        );
        let state_in_memory = state_rows > INLINE_STATE_ROWS;
        let mut call = DevCall {
            layers: device_table.address + table.layers_offset(),
            groups: device_table.address + table.groups_offset(role),
            rows: 0,
            row_starts: 0,
            accumulators: slot.accumulators(),
            host_values: slot.host_values_on_device(),
            finished_blocks: slot.finished_blocks(),
            total_units: shape.total_units,
            num_rows: attention_rows as u32,
            num_values: num_values as u32,
            split: shape.split,
            row_units: shape.row_units,
            algorithm: algorithm.code(),
            reserved: 0,
            inline_groups: [DevGroup::default(); INLINE_GROUPS],
            inline_rows: [Row::default(); INLINE_ROWS],
        };
        let inline_groups = groups.len().min(INLINE_GROUPS);
        call.inline_groups[..inline_groups].copy_from_slice(&groups[..inline_groups]);
        let mut state_call = DevStateCall {
            tensors: device_table.address + table.state_tensors_offset(),
            groups: device_table.address + table.state_groups_offset(),
            rows: 0,
            accumulators: slot.accumulators(),
            num_rows: state_rows as u32,
            algorithm: algorithm.code(),
            inline_rows: [Row::default(); INLINE_STATE_ROWS],
        };
        let mut upload = 0;
        {
            // The staging holds the rows in request order; attention rows
            // go first, then the state kernel's.
            let (rows, starts) = slot.staging(num_rows);
            if state_rows > 0 {
                partition_state_rows(rows, state_rows, |row| table.is_state_slot(row.group_slot));
            }
            let (attention, state) = rows.split_at(attention_rows);
            if !shape.rows_in_memory {
                call.inline_rows[..attention_rows].copy_from_slice(attention);
            } else if !shape.uniform() {
                row_starts(attention, groups, shape.split, &mut starts[..attention_rows]);
            }
            if state_rows > 0 && !state_in_memory {
                state_call.inline_rows[..state_rows].copy_from_slice(state);
            }
        }
        if shape.rows_in_memory {
            if shape.uniform() {
                // The kernel reads each row once per warp: straight from
                // mapped pinned memory, with no copy to queue.
                call.rows = slot.staging_on_device();
            } else {
                // Row starts are binary-searched: worth a copy to the device.
                call.rows = slot.device_rows();
                call.row_starts = slot.device_row_starts(num_rows);
                upload = slot.staging_bytes(num_rows, attention_rows);
            }
        }
        // The state kernel reads its rows many times over: from device
        // memory, copied there unless the checksum kernel's upload (of every
        // row, then the starts) carries them already.
        let mut state_upload = None;
        if state_in_memory {
            let offset = (attention_rows * std::mem::size_of::<Row>()) as u64;
            state_call.rows = slot.device_rows() + offset;
            if upload == 0 {
                state_upload = Some((offset, state_rows * std::mem::size_of::<Row>()));
            }
        }
        let state = (state_rows > 0).then(|| StateLaunch {
            grid: state_grid(state_rows, max_state_units, self.state_resident_warps),
            upload: state_upload,
            call: &mut state_call,
        });
        let num_gathered = stored.map_or(0, |work| 2 * work.items.len());
        let host_values = slot.host_values_on_device();
        let mut launch = match stored {
            Some(work) => stored::stage(&mut slot, work, host_values)?,
            None => None,
        };
        slot.table = Some(device_table.clone());
        // SAFETY: every address in `call` and `state_call` is live until the
        // slot's event completes (the slot and table stay held until then);
        // the staging in pinned memory is not touched again before that; the
        // kernels read cache bytes that registration proved lie in registered
        // regions, and the stored launch 16-byte values that `add_stored`
        // checked.
        let queued = unsafe {
            self.enqueue(
                &mut call,
                state,
                &slot,
                (upload, shape.blocks, checksum_kernel),
                launch.as_mut(),
                stream,
            )
        };
        if let Err(error) = queued {
            // Parked while anything queued may still run.
            self.pool.give_back(slot);
            return Err(error);
        }
        Ok(Values::Pending(Box::new(DevicePending {
            context: self.context.clone(),
            pool: self.pool.clone(),
            slot: Some(slot),
            num_values,
            num_gathered,
            zeros: None,
        })))
    }

    /// A store or gather of a call with nothing to checksum: every sum is
    /// 0 (the items have no columns), the values are zeros.
    fn stored_alone(&self, num_values: usize, work: &StoredWork, stream: StreamHandle) -> Result<Values> {
        self.context.bind_to_thread().map_err(device_error("cuCtxSetCurrent"))?;
        let mut slot = self.pool.take(0, 0)?;
        let mut launch = stored::stage(&mut slot, work, 0)?;
        let stream = stream.0 as sys::CUstream;
        if let Some(launch) = launch.as_mut() {
            // SAFETY: the slot is held by the result until its event
            // completes; the items' addresses were checked by the caller.
            unsafe { stored::enqueue(&self.kernels, launch, stream)? };
        }
        // SAFETY: a live event and the caller's stream.
        unsafe { cu::event::record(slot.event, stream) }.map_err(device_error("cuEventRecord"))?;
        Ok(Values::Pending(Box::new(DevicePending {
            context: self.context.clone(),
            pool: self.pool.clone(),
            slot: Some(slot),
            num_values: 0,
            num_gathered: 2 * work.items.len(),
            zeros: Some(vec![0; num_values]),
        })))
    }

    /// Queues on `stream`: the upload of `upload` staged bytes to
    /// `call.rows` (if any), the state kernel with its upload (if any), the
    /// checksum kernel `function` on `blocks` blocks (`(upload, blocks,
    /// function) = main`), the stored checksums' launch (if
    /// any), and the slot's event.
    ///
    /// # Safety
    /// Every address in `call` and `state` stays valid until the slot's
    /// event completes, and the slot's staging is not written before then.
    unsafe fn enqueue(
        &self,
        call: &mut DevCall,
        state: Option<StateLaunch<'_>>,
        slot: &Slot,
        (upload, blocks, function): (usize, u32, &cudarc::driver::CudaFunction),
        stored: Option<&mut stored::StoredLaunch>,
        stream: StreamHandle,
    ) -> Result<()> {
        // Null stays null: CUDA's legacy default stream, never a private
        // one, so the work is ordered after what the caller queued there.
        let stream = stream.0 as sys::CUstream;
        // SAFETY: per this function's contract; each launch copies its one
        // parameter before it returns.
        unsafe {
            if upload > 0 {
                sys::cuMemcpyHtoDAsync_v2(call.rows, slot.staging_host().cast(), upload, stream)
                    .result()
                    .map_err(device_error("cuMemcpyHtoDAsync"))?;
            }
            if let Some(state) = state {
                if let Some((offset, bytes)) = state.upload {
                    sys::cuMemcpyHtoDAsync_v2(
                        slot.device_rows() + offset,
                        slot.staging_host().add(offset as usize).cast(),
                        bytes,
                        stream,
                    )
                    .result()
                    .map_err(device_error("cuMemcpyHtoDAsync"))?;
                }
                // Before the checksum kernel on the same stream: its last
                // block publishes what this one added.
                let mut params = [(state.call as *mut DevStateCall).cast::<std::ffi::c_void>()];
                cu::launch_kernel(
                    self.kernels.state.cu_function(),
                    (state.grid.0, state.grid.1, 1),
                    (THREADS_PER_BLOCK, 1, 1),
                    0,
                    stream,
                    &mut params,
                )
                .map_err(device_error("launching kvcs_state"))?;
            }
            let mut params = [(call as *mut DevCall).cast::<std::ffi::c_void>()];
            cu::launch_kernel(
                function.cu_function(),
                (blocks, 1, 1),
                (THREADS_PER_BLOCK, 1, 1),
                0,
                stream,
                &mut params,
            )
            .map_err(device_error("launching kvcs_checksum"))?;
            // The event is recorded even when the stored launch fails, so
            // that the slot is parked until the checksum kernel is done.
            let stored = match stored {
                Some(launch) => stored::enqueue(&self.kernels, launch, stream),
                None => Ok(()),
            };
            cu::event::record(slot.event, stream).map_err(device_error("cuEventRecord"))?;
            stored
        }
    }
}

/// A slot taken for one call before its plan (see [`DeviceEngine::stage`]);
/// given back to the pool if the call fails before it queues.
pub struct Staged {
    slot: Option<Slot>,
    pool: Arc<SlotPool>,
    /// Whether the rows are for the device alone (see [`RowRoom`]).
    streaming: bool,
}

impl Staged {
    /// The slot's pinned row staging, all of it, for [`Plan::write`].
    pub fn room(&mut self) -> RowRoom<'_> {
        RowRoom {
            rows: self.slot.as_mut().expect("held until used").staging_room(),
            streaming: self.streaming,
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.pool.give_back(slot);
        }
    }
}

/// Moves the `state_rows` rows that `is_state` picks to the end of `rows`,
/// keeping the order of the others (the checksum kernel's, first) and of
/// the state rows (the state kernel's).
fn partition_state_rows(rows: &mut [Row], state_rows: usize, is_state: impl Fn(&Row) -> bool) {
    let state: Vec<Row> = rows.iter().filter(|row| is_state(row)).copied().collect();
    debug_assert_eq!(state.len(), state_rows);
    let mut kept = 0;
    for i in 0..rows.len() {
        if !is_state(&rows[i]) {
            rows[kept] = rows[i];
            kept += 1;
        }
    }
    rows[kept..].copy_from_slice(&state);
}

/// The state kernel's part of a call: its grid (x, y), the upload of its
/// staged rows (offset in the staging and bytes) if it needs one, its parameter.
struct StateLaunch<'a> {
    grid: (u32, u32),
    upload: Option<(u64, usize)>,
    call: &'a mut DevStateCall,
}

/// Values being computed on a device; readable once the slot's event completed.
struct DevicePending {
    context: Arc<CudaContext>,
    pool: Arc<SlotPool>,
    slot: Option<Slot>,
    num_values: usize,
    /// Stored values a load check gathers into the slot.
    num_gathered: usize,
    /// The values of a call that read nothing (see `stored_alone`).
    zeros: Option<Vec<u64>>,
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
        match &self.zeros {
            Some(zeros) => zeros,
            None => self.slot().values(self.num_values),
        }
    }

    fn gathered(&self) -> &[u64] {
        stored::gathered(self.slot(), self.num_gathered)
    }
}

impl Drop for DevicePending {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.pool.give_back(slot);
        }
    }
}
