//! The device engine over cudarc (driver API and NVRTC, both loaded at run
//! time, so the library builds and runs its host engine without CUDA).
//!
//! cudarc panics when it cannot load `libcuda` or `libnvrtc`, so presence is
//! checked first and absence becomes `Error::Device`. A worker uses its
//! device's primary context, shared with PyTorch or the engine in-process.
//! A `checksum` call has two parts. The decision (`launch.rs`: pure,
//! tested without a GPU) says from the plan, the layer table and the card
//! what the call queues: the kernel's form and shape, where each kernel
//! reads its rows (inline, in place from pinned memory, or after the one
//! upload) and the grids. The engine ([`DeviceEngine::checksum`]) only
//! writes the call's slot (the plan's rows go straight into its pinned
//! memory) and queues that: at most one row upload, the state kernel where
//! the call has rows of state groups (SPEC section 6), the checksum
//! kernel, the stored-checksum launch (`store_launch`), the slot's event.
//! Nothing blocks the host.

mod buffers;
mod descriptors;
mod kernel_prelude;
mod kernels;
mod launch;
mod layer_table;
mod raw;
mod store_launch;

pub use self::descriptors::DevStoredItem;
pub use self::kernels::checksum_ptx;
pub use self::store_launch::{StoredMode, StoredWork};

use std::sync::Arc;

use cudarc::driver::CudaContext;

use self::buffers::{device_error, DeviceTable, Slot, SlotPool};
use self::descriptors::{
    DevCall, DevGroup, DevStateCall, DevStoredCall, INLINE_GROUPS, INLINE_ROWS, INLINE_STATE_ROWS, THREADS_PER_BLOCK,
    WARP,
};
use self::kernels::Kernels;
use self::launch::{
    call_room, partition_state_rows, plan_launch, row_starts, CallInputs, CallLaunch, ChecksumKernel, ChecksumLaunch,
    ResidentWarps, RowPlace,
};
use self::layer_table::{role_index, LayerTable};
use crate::base::checksum::Algorithm;
use crate::base::error::{err, Result};
use crate::inputs::blocks::BlockSet;
use crate::inputs::layout::Layout;
use crate::inputs::role::Role;
use crate::inputs::stream::StreamHandle;
use crate::plan::{Plan, Row, RowRoom};
use crate::results::checksums::{PendingValues, Values};

/// Call buffers made with the engine (more are made when more calls are in flight).
const RESERVED_SLOTS: usize = 4;

/// Whether the CUDA driver and NVRTC libraries can be loaded.
pub fn libraries_present() -> bool {
    raw::libraries_present()
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
    /// Warps the card runs at once with each kernel.
    resident: ResidentWarps,
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
        let processors = raw::multiprocessors(&context).map_err(device_error("cuDeviceGetAttribute"))?;
        let blocks_per_processor = |function: &cudarc::driver::CudaFunction| -> Result<i32> {
            raw::blocks_per_multiprocessor(function, THREADS_PER_BLOCK)
                .map_err(device_error("cuOccupancyMaxActiveBlocksPerMultiprocessor"))
        };
        let resident =
            |blocks: i32| (processors.max(1) as u64) * (blocks.max(1) as u64) * (THREADS_PER_BLOCK / WARP) as u64;
        let registers = raw::registers;
        let checksum_blocks = blocks_per_processor(&kernels.checksum)?;
        let unpaired_blocks = blocks_per_processor(&kernels.checksum_unpaired)?;
        let single_head_blocks = blocks_per_processor(&kernels.checksum_single_head)?;
        let placed_blocks = blocks_per_processor(&kernels.checksum_placed)?;
        let narrow_blocks = blocks_per_processor(&kernels.checksum_narrow)?;
        let state_blocks = blocks_per_processor(&kernels.state)?;
        let (major, minor) = context.compute_capability().unwrap_or((0, 0));
        let description = format!(
            "device {ordinal} (sm_{major}{minor}, {processors} SMs): kvcs_checksum uses {} registers, \
             {checksum_blocks} blocks of {THREADS_PER_BLOCK} threads per SM; kvcs_checksum_unpaired {} registers, \
             {unpaired_blocks} blocks per SM; kvcs_checksum_single_head {} registers, {single_head_blocks} blocks \
             per SM; kvcs_checksum_placed {} registers, {placed_blocks} blocks per SM; kvcs_checksum_narrow {} \
             registers, {narrow_blocks} blocks per SM; kvcs_state {} registers, {state_blocks} blocks per SM",
            registers(&kernels.checksum),
            registers(&kernels.checksum_unpaired),
            registers(&kernels.checksum_single_head),
            registers(&kernels.checksum_placed),
            registers(&kernels.checksum_narrow),
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
            resident: ResidentWarps {
                checksum: resident(checksum_blocks),
                unpaired: resident(unpaired_blocks),
                single_head: resident(single_head_blocks),
                placed: resident(placed_blocks),
                narrow: resident(narrow_blocks),
                state: resident(state_blocks),
            },
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

    /// Checks that `address .. address + length` is memory this device may
    /// write a caller's buffer of that length into: memory that
    /// [`DeviceEngine::check_region`] accepts and, where it starts in an
    /// allocation of `cuMemAlloc` (legacy device memory, one buffer to its
    /// owner), ends in it. A range that runs from such an allocation on into
    /// the next one is a buffer too small for its length, and writes past
    /// its end would land in other memory. Ranges of virtual-memory
    /// mappings (PyTorch's expandable segments) or pinned host memory may
    /// still span several allocations, as `check_region` allows.
    pub fn check_writable(&self, address: u64, length: u64) -> Result<()> {
        self.check_region(address, length)?;
        let (start, size) = self
            .allocation_at(address)
            .map_err(|reason| err!(InvalidArgument, "address {address:#x} {reason}"))?;
        let end = address as u128 + length as u128;
        let allocation_end = start as u128 + size as u128;
        if end > allocation_end && self.is_legacy_allocation(address) {
            return Err(err!(
                OutOfBounds,
                "address {address:#x} + length {length} runs past the end of its cudaMalloc allocation \
                 ({start:#x} + {size} bytes) into other memory: the buffer is too small for its length"
            ));
        }
        Ok(())
    }

    /// Whether `pointer` lies in legacy device memory (`cuMemAlloc`), the
    /// memory that legacy CUDA IPC can share; false for virtual-memory
    /// mappings, pool allocations and host memory, and where the driver
    /// does not say.
    fn is_legacy_allocation(&self, pointer: u64) -> bool {
        raw::is_legacy_allocation(pointer)
    }

    /// The CUDA allocation holding `pointer` (start, size), if it is one this
    /// device reads; otherwise why not.
    fn allocation_at(&self, pointer: u64) -> std::result::Result<(u64, usize), String> {
        let ordinal = self.context.ordinal();
        let raw::Allocation {
            start,
            size,
            on_device,
            device,
        } = raw::allocation_at(pointer).map_err(|e| {
            format!("is not memory that CUDA knows ({e}); a device worker reads device memory or pinned host memory")
        })?;
        if on_device && device != ordinal as i32 {
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

    /// Checks and lays out `blocks` ([`Plan::write`], the rows straight
    /// into the call's slot) and queues their checksums under `algorithm`
    /// on `stream` (the caller's handle passed to the driver unchanged;
    /// null is the legacy default stream), then, on the same stream before
    /// the call's event, the store or gather that `stored` gives for the
    /// plan (SPEC section 8; see `store_launch.rs`; its items checked by
    /// the caller). What is queued is decided first, without the device
    /// ([`launch::plan_launch`]); this only writes the slot and queues what
    /// the decision says. Returns without waiting.
    pub fn checksum(
        &self,
        layout: &Layout,
        blocks: &BlockSet,
        role: Role,
        algorithm: Algorithm,
        stream: StreamHandle,
        stored: impl FnOnce(&Plan) -> Result<Option<StoredWork>>,
    ) -> Result<(Plan, Values)> {
        let write = |rows: RowRoom<'_>| Plan::write(layout, blocks, role, rows);
        self.checksum_planned(layout, blocks.max_rows(role), 1, role, algorithm, stream, write, stored)
    }

    /// [`DeviceEngine::checksum`] of the plan and rows `write` lays out
    /// into the call's room (at most `max_rows` rows, and values for at
    /// least `min_values`), such as full blocks taken one by one
    /// (`plan::full_block_plan`).
    #[allow(clippy::too_many_arguments)]
    pub fn checksum_planned(
        &self,
        layout: &Layout,
        max_rows: usize,
        min_values: usize,
        role: Role,
        algorithm: Algorithm,
        stream: StreamHandle,
        write: impl FnOnce(RowRoom<'_>) -> Result<Plan>,
        stored: impl FnOnce(&Plan) -> Result<Option<StoredWork>>,
    ) -> Result<(Plan, Values)> {
        self.context.bind_to_thread().map_err(device_error("cuCtxSetCurrent"))?;
        let max_columns = layout.groups().map(|group| group.columns(role).len()).max();
        let mut room = call_room(max_rows, max_columns.unwrap_or(0));
        room.values = room.values.max(min_values);
        let mut slot = self.pool.take(room.rows, room.values)?;
        let queue = |slot: &mut Slot| -> Result<(Plan, CallLaunch, usize)> {
            let rows = RowRoom {
                rows: slot.row_room(),
                streaming: room.stream_rows,
            };
            let plan = write(rows)?;
            let work = stored(&plan)?;
            let launch = plan_launch(&CallInputs {
                table: &self.table,
                table_on_device: self.device_table.is_some(),
                role,
                rows_per_slot: &plan.rows_per_slot,
                num_rows: plan.num_rows,
                stored_items: work.as_ref().map_or(0, |work| work.items.len()),
                resident: self.resident,
            });
            if launch.queues() {
                let mut parameters = self.fill(&launch, &plan, slot, role, algorithm, work.as_ref())?;
                // SAFETY: `fill` wrote every address in the parameters from
                // the slot and the table, which the slot holds until its
                // event completes; nothing writes the slot before then.
                unsafe { self.enqueue(&launch, &mut parameters, slot, stream)? };
            }
            Ok((plan, launch, work.map_or(0, |work| work.items.len())))
        };
        let (plan, launch, num_items) = match queue(&mut slot) {
            Ok((plan, launch, num_items)) if launch.queues() => (plan, launch, num_items),
            queued => {
                // Parked while anything queued may still run.
                self.pool.give_back(slot);
                // Nothing queued: every value is the empty sum.
                let (plan, _, _) = queued?;
                let values = Values::Ready(vec![0; plan.num_values]);
                return Ok((plan, values));
            }
        };
        let computed = launch.checksum.is_some();
        let values = Values::Pending(Box::new(DevicePending {
            context: self.context.clone(),
            pool: self.pool.clone(),
            slot: Some(slot),
            num_values: if computed { plan.num_values } else { 0 },
            num_gathered: 2 * num_items,
            // A call that read nothing: its values are the empty sums.
            zeros: (!computed).then(|| vec![0; plan.num_values]),
        }));
        Ok((plan, values))
    }

    /// Writes what `launch` says into `slot` (idle, holding the plan's
    /// rows): the rows moved (state rows last), copied inline and given row
    /// starts where it says; the stored items; and gives the launches'
    /// parameters, which name the slot's memory and the table.
    fn fill(
        &self,
        launch: &CallLaunch,
        plan: &Plan,
        slot: &mut Slot,
        role: Role,
        algorithm: Algorithm,
        stored: Option<&StoredWork>,
    ) -> Result<Parameters> {
        let store = |slot: &mut Slot, values: u64| match (stored, launch.store_blocks) {
            (Some(work), Some(_)) => store_launch::write_items(slot, work, values).map(Some),
            _ => Ok(None),
        };
        let (checksum, table_address) = match (&launch.checksum, &self.device_table) {
            (Some(checksum), Some(table)) => (checksum, table.address),
            _ => {
                // Nothing to read: the store alone, over sums of 0.
                let store = store(slot, 0)?;
                return Ok(Parameters { checksum: None, store });
            }
        };
        if plan.num_values > slot.value_capacity {
            return Err(err!(
                Internal,
                "a slot of {} values for a call of {} values",
                slot.value_capacity,
                plan.num_values
            ));
        }
        slot.table = self.device_table.clone();
        let (mut call, mut state_call) = self.parameters(checksum, plan, slot, table_address, role, algorithm);
        let (table, groups) = (&self.table, &self.table.groups[role_index(role)]);
        let values = slot.host_values_on_device();
        let store = store(slot, values)?;
        let (rows, starts) = slot.rows_and_starts(plan.num_rows);
        if checksum.state_rows > 0 {
            partition_state_rows(rows, checksum.state_rows, |row| table.is_state_slot(row.group_slot));
        }
        let (attention, state) = rows.split_at(checksum.attention_rows);
        if checksum.rows == RowPlace::Inline {
            call.inline_rows[..attention.len()].copy_from_slice(attention);
        }
        if checksum.row_starts {
            row_starts(attention, groups, checksum.shape.split, &mut starts[..attention.len()]);
        }
        if checksum.state.is_some_and(|state| state.rows == RowPlace::Inline) {
            state_call.inline_rows[..state.len()].copy_from_slice(state);
        }
        Ok(Parameters {
            checksum: Some((call, state_call)),
            store,
        })
    }

    /// The checksum kernels' parameters for `checksum`, naming `slot`'s
    /// memory and the table at `table_address`; rows inline are left to
    /// [`DeviceEngine::fill`].
    fn parameters(
        &self,
        checksum: &ChecksumLaunch,
        plan: &Plan,
        slot: &Slot,
        table_address: u64,
        role: Role,
        algorithm: Algorithm,
    ) -> (DevCall, DevStateCall) {
        let (table, groups) = (&self.table, &self.table.groups[role_index(role)]);
        let place = |rows: RowPlace| match rows {
            RowPlace::Inline => 0,
            RowPlace::Mapped => slot.pinned_rows_on_device(),
            RowPlace::Device { offset } => slot.device_rows() + offset as u64,
        };
        let mut call = DevCall {
            layers: table_address + table.layers_offset(),
            groups: table_address + table.groups_offset(role),
            rows: place(checksum.rows),
            row_starts: match checksum.row_starts {
                true => slot.device_rows() + (plan.num_rows * std::mem::size_of::<Row>()) as u64,
                false => 0,
            },
            accumulators: slot.accumulators(),
            host_values: slot.host_values_on_device(),
            finished_blocks: slot.finished_blocks(),
            total_units: checksum.shape.total_units,
            num_rows: checksum.attention_rows as u32,
            num_values: plan.num_values as u32,
            split: checksum.shape.split,
            row_units: checksum.shape.row_units,
            algorithm: algorithm.code(),
            reserved: 0,
            inline_groups: [DevGroup::default(); INLINE_GROUPS],
            inline_rows: [Row::default(); INLINE_ROWS],
        };
        let inline_groups = groups.len().min(INLINE_GROUPS);
        call.inline_groups[..inline_groups].copy_from_slice(&groups[..inline_groups]);
        let state_call = DevStateCall {
            tensors: table_address + table.state_tensors_offset(),
            groups: table_address + table.state_groups_offset(),
            rows: checksum.state.map_or(0, |state| place(state.rows)),
            accumulators: slot.accumulators(),
            num_rows: checksum.state_rows as u32,
            algorithm: algorithm.code(),
            inline_rows: [Row::default(); INLINE_STATE_ROWS],
        };
        (call, state_call)
    }

    /// Queues on `stream` what `launch` says, with `parameters`: the
    /// upload, the state kernel, the checksum kernel, the stored launch
    /// (each where it has one), then the slot's event.
    ///
    /// # Safety
    /// Every address in `parameters` stays valid until the slot's event
    /// completes, and the slot's pinned memory is not written before then;
    /// every stored item's address is 16 bytes this device may write
    /// (store) or read (gather).
    unsafe fn enqueue(
        &self,
        launch: &CallLaunch,
        parameters: &mut Parameters,
        slot: &Slot,
        stream: StreamHandle,
    ) -> Result<()> {
        // Null stays null: CUDA's legacy default stream, never a private
        // one, so the work is ordered after what the caller queued there.
        let stream = raw::foreign_stream(stream.0);
        let threads = (THREADS_PER_BLOCK, 1, 1);
        // SAFETY: per this function's contract; each launch copies its one
        // parameter before it returns; the kernels read cache bytes that
        // registration proved lie in registered regions; the upload reads
        // `upload.bytes` of the pinned rows, which `plan_launch` keeps
        // inside the call's rows and starts (the slot holds them).
        unsafe {
            if let (Some(launch), Some((call, state_call))) = (&launch.checksum, &mut parameters.checksum) {
                if let Some(upload) = launch.upload {
                    let to = slot.device_rows() + upload.offset as u64;
                    let from = slot.pinned_rows(upload.offset);
                    raw::copy_to_device_async(to, from, upload.bytes, stream)
                        .map_err(device_error("cuMemcpyHtoDAsync"))?;
                }
                if let Some(state) = launch.state {
                    // Before the checksum kernel on the same stream: its last
                    // block publishes what this one added.
                    let mut params = [(state_call as *mut DevStateCall).cast::<std::ffi::c_void>()];
                    let grid = (state.grid.0, state.grid.1, 1);
                    raw::launch(&self.kernels.state, grid, threads, stream, &mut params)
                        .map_err(device_error("launching kvcs_state"))?;
                }
                let function = match launch.kernel {
                    ChecksumKernel::Paired => &self.kernels.checksum,
                    ChecksumKernel::SingleHead => &self.kernels.checksum_single_head,
                    ChecksumKernel::Unpaired => &self.kernels.checksum_unpaired,
                    ChecksumKernel::Placed => &self.kernels.checksum_placed,
                    ChecksumKernel::Narrow => &self.kernels.checksum_narrow,
                };
                let mut params = [(call as *mut DevCall).cast::<std::ffi::c_void>()];
                let grid = (launch.shape.blocks, 1, 1);
                raw::launch(function, grid, threads, stream, &mut params)
                    .map_err(device_error("launching kvcs_checksum"))?;
            }
            // The event is recorded even when the stored launch fails, so
            // that the slot is parked until the checksum kernel is done.
            let stored = match (&mut parameters.store, launch.store_blocks) {
                (Some(call), Some(blocks)) => store_launch::enqueue(&self.kernels, call, blocks, stream),
                _ => Ok(()),
            };
            raw::record(slot.event, stream).map_err(device_error("cuEventRecord"))?;
            stored
        }
    }
}

/// The launches' parameters of one call, written by [`DeviceEngine::fill`].
struct Parameters {
    /// The checksum kernel's and the state kernel's.
    checksum: Option<(DevCall, DevStateCall)>,
    /// The stored launch's.
    store: Option<DevStoredCall>,
}

/// Values being computed on a device; readable once the slot's event completed.
struct DevicePending {
    context: Arc<CudaContext>,
    pool: Arc<SlotPool>,
    slot: Option<Slot>,
    num_values: usize,
    /// Stored values a load check gathers into the slot.
    num_gathered: usize,
    /// The values of a call that launched no checksum kernel (nothing to
    /// read): the empty sums, zeros.
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
        unsafe { raw::wait(self.slot().event) }.map_err(device_error("cuEventSynchronize"))
    }

    fn values(&self) -> &[u64] {
        match &self.zeros {
            Some(zeros) => zeros,
            None => self.slot().values(self.num_values),
        }
    }

    fn gathered(&self) -> &[u64] {
        self.slot().gathered(self.num_gathered)
    }
}

impl Drop for DevicePending {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.pool.give_back(slot);
        }
    }
}
