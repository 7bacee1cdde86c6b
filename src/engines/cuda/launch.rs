//! How a call is launched, decided without the device: the slot it takes
//! ([`call_room`]), which kernels run, the chunks per kernel block, the
//! units, where the rows travel (inline, read in place from pinned memory,
//! or uploaded) and the grids ([`plan_launch`]). Pure functions of the
//! plan, the layer table and the card's size, so that they are tested
//! without a GPU; the engine (`DeviceEngine::checksum`) only writes the
//! slot and queues what they say.

use super::descriptors::{DevGroup, INLINE_ROWS, INLINE_STATE_ROWS, MAX_SPLIT, THREADS_PER_BLOCK, WARP};
use super::layer_table::{role_index, LayerTable};
use crate::inputs::role::Role;
use crate::plan::Row;

/// Bytes of one row in pinned and device memory.
const ROW_BYTES: usize = std::mem::size_of::<Row>();

/// Warps the card runs at once with each kernel (its SMs times the
/// kernel's resident blocks per SM times warps per block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResidentWarps {
    /// `kvcs_checksum`.
    pub checksum: u64,
    /// `kvcs_checksum_unpaired`.
    pub unpaired: u64,
    /// `kvcs_checksum_single_head`.
    pub single_head: u64,
    /// `kvcs_checksum_placed`.
    pub placed: u64,
    /// `kvcs_checksum_narrow`.
    pub narrow: u64,
    /// `kvcs_state`.
    pub state: u64,
}

/// What the launch of one call depends on (its plan already written).
#[derive(Debug, Clone, Copy)]
pub struct CallInputs<'a> {
    /// The worker's layer table (host copy).
    pub table: &'a LayerTable,
    /// Whether the table is on the device (some layer is registered).
    pub table_on_device: bool,
    /// The call's role.
    pub role: Role,
    /// The plan's rows per group slot.
    pub rows_per_slot: &'a [u64],
    /// The plan's rows.
    pub num_rows: usize,
    /// Items of the call's store or gather of stored checksums (0: none).
    pub stored_items: usize,
    /// The card.
    pub resident: ResidentWarps,
}

/// Which form of the checksum kernel a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChecksumKernel {
    /// `kvcs_checksum`: some layer reads its K and V as one unit.
    Paired,
    /// `kvcs_checksum_single_head`: every layer holds one head (more loads
    /// in flight).
    SingleHead,
    /// `kvcs_checksum_unpaired`: the others (fewer registers, more warps).
    Unpaired,
    /// `kvcs_checksum_placed`: some layer's tokens are spread over DCP
    /// ranks (SPEC section 16); its K and V are read apart.
    Placed,
    /// `kvcs_checksum_narrow`: the call reads a layer of 4-byte pieces
    /// (SPEC section 1); otherwise as `Placed`.
    Narrow,
}

/// Where a kernel reads its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowPlace {
    /// In the launch's parameter.
    Inline,
    /// In place, from the slot's mapped pinned rows (from their start).
    Mapped,
    /// From the slot's device rows, `offset` bytes in, after an upload.
    Device {
        /// Bytes from the start of the rows.
        offset: usize,
    },
}

/// One copy of the slot's pinned rows to its device rows (both laid out
/// alike: the call's rows, then the row starts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Upload {
    /// Bytes from the start of the rows, on both sides.
    pub offset: usize,
    /// Bytes copied.
    pub bytes: usize,
}

/// The state kernel's part of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateLaunch {
    /// Grid (x, y) (see [`state_grid`]).
    pub grid: (u32, u32),
    /// Where it reads its rows.
    pub rows: RowPlace,
}

/// The kernels that checksum a call with rows: the state kernel where
/// it has rows of state groups, then the checksum kernel, which publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChecksumLaunch {
    /// The checksum kernel's form.
    pub kernel: ChecksumKernel,
    /// The checksum kernel's shape.
    pub shape: LaunchShape,
    /// Rows of the checksum kernel: the first of the call's rows once the
    /// state rows are moved to the end (keeping the order of each).
    pub attention_rows: usize,
    /// Rows of the state kernel, after those.
    pub state_rows: usize,
    /// Where the checksum kernel reads its rows.
    pub rows: RowPlace,
    /// Whether the checksum kernel searches row starts (rows of several
    /// groups): written right after all the call's rows, read from device memory.
    pub row_starts: bool,
    /// The one copy to the device, if any kernel reads device rows.
    pub upload: Option<Upload>,
    /// The state kernel, if the call has state rows.
    pub state: Option<StateLaunch>,
}

/// The slot a device call takes before its plan, which writes the rows
/// straight into the slot's pinned memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallRoom {
    /// Rows: at most one per block of the call's set and one per group (a
    /// producer's short last rows).
    pub rows: usize,
    /// Values: every column of the worker's widest group, per row.
    pub values: usize,
    /// Whether the rows are written past the CPU's caches
    /// ([`crate::plan::RowRoom::streaming`]): calls of more rows than go
    /// inline, whose rows the device reads and the host mostly does not.
    pub stream_rows: bool,
}

/// The room of a call of at most `max_rows` rows
/// ([`crate::inputs::blocks::BlockSet::max_rows`]) on a worker whose widest group
/// has `max_columns` columns in the call's role: a value per column per row.
pub fn call_room(max_rows: usize, max_columns: usize) -> CallRoom {
    CallRoom {
        rows: max_rows,
        values: max_rows.saturating_mul(max_columns),
        stream_rows: max_rows > INLINE_ROWS,
    }
}

/// Everything a device call queues, decided before any of it; a call that
/// queues nothing (no checksum, no store) gives back its slot, and every
/// value is the empty sum (0), ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallLaunch {
    /// The checksum kernels; `None` when the call reads no cache memory.
    pub checksum: Option<ChecksumLaunch>,
    /// Blocks of the `kvcs_store` launch, queued after the checksums (or
    /// alone, over sums of 0); `None` without stored items.
    pub store_blocks: Option<u32>,
}

impl CallLaunch {
    /// Whether the call queues anything.
    pub fn queues(&self) -> bool {
        self.checksum.is_some() || self.store_blocks.is_some()
    }
}

/// What a call queues (see [`CallLaunch`]).
///
/// Rows of state groups go to the state kernel, the others to the checksum
/// kernel (which skips state slots in its shape); both are counted per
/// group slot from the plan, not per row. The narrow kernel runs where the
/// call has rows of a group with a layer of 4-byte pieces, so that the
/// other kernels, and calls of 8-byte pieces only, run no code of them;
/// the placed one where a layer's tokens are spread over DCP ranks; the
/// paired one where some layer reads its K and V as one unit; where every
/// layer holds one head, the one with more loads in flight; else the one
/// with fewer registers. Rows that fit go inline; rows of one group are
/// read in place from mapped pinned memory (the kernel reads each once per
/// warp); rows of several groups, whose starts the kernel binary-searches,
/// are worth a copy to the device, rows and starts in one. The state
/// kernel reads its rows many times over: past [`INLINE_STATE_ROWS`], from
/// device memory, copied there unless the checksum kernel's copy (of every
/// row) carries them already.
pub fn plan_launch(inputs: &CallInputs<'_>) -> CallLaunch {
    let store_blocks =
        (inputs.stored_items > 0).then(|| inputs.stored_items.div_ceil(THREADS_PER_BLOCK as usize) as u32);
    let num_rows = inputs.num_rows;
    if !inputs.table_on_device || num_rows == 0 {
        // Nothing to read: the store alone, if any.
        return CallLaunch {
            checksum: None,
            store_blocks,
        };
    }
    let table = inputs.table;
    let role = role_index(inputs.role);
    let mut state_rows = 0usize;
    let mut max_state_units = 0u32;
    for (state_group, &count) in table.state_groups.iter().zip(inputs.rows_per_slot) {
        if state_group.units > 0 && count > 0 {
            state_rows += count as usize;
            max_state_units = max_state_units.max(state_group.units);
        }
    }
    let attention_rows = num_rows - state_rows;
    let (kernel, resident_warps) = if table.reads_narrow(inputs.role, inputs.rows_per_slot) {
        (ChecksumKernel::Narrow, inputs.resident.narrow)
    } else if table.placed[role] {
        (ChecksumKernel::Placed, inputs.resident.placed)
    } else if table.paired[role] {
        (ChecksumKernel::Paired, inputs.resident.checksum)
    } else if table.single_head(inputs.role) {
        (ChecksumKernel::SingleHead, inputs.resident.single_head)
    } else {
        (ChecksumKernel::Unpaired, inputs.resident.unpaired)
    };
    let shape = launch_shape(
        inputs.rows_per_slot,
        &table.groups[role],
        &table.max_split[role],
        attention_rows,
        resident_warps,
    );
    let row_starts = shape.rows_in_memory && !shape.uniform();
    let rows = match (shape.rows_in_memory, shape.uniform()) {
        (false, _) => RowPlace::Inline,
        (true, true) => RowPlace::Mapped,
        (true, false) => RowPlace::Device { offset: 0 },
    };
    let state_offset = attention_rows * ROW_BYTES;
    let state_in_memory = state_rows > INLINE_STATE_ROWS;
    let upload = if row_starts {
        Some(Upload {
            offset: 0,
            bytes: num_rows * ROW_BYTES + attention_rows * 8,
        })
    } else if state_in_memory {
        Some(Upload {
            offset: state_offset,
            bytes: state_rows * ROW_BYTES,
        })
    } else {
        None
    };
    let state = (state_rows > 0).then(|| StateLaunch {
        grid: state_grid(state_rows, max_state_units, inputs.resident.state),
        rows: if state_in_memory {
            RowPlace::Device { offset: state_offset }
        } else {
            RowPlace::Inline
        },
    });
    CallLaunch {
        checksum: Some(ChecksumLaunch {
            kernel,
            shape,
            attention_rows,
            state_rows,
            rows,
            row_starts,
            upload,
            state,
        }),
        store_blocks,
    }
}

/// The shape of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    /// Chunks per kernel block.
    pub split: u32,
    /// Units of the whole call (split included).
    pub total_units: u64,
    /// Units of every row (split included) when all rows are of one group,
    /// else 0: the kernel then finds a unit's row by a division, not a search.
    pub row_units: u32,
    /// Whether the rows go through memory (more than fit in the launch's
    /// parameters, or rows of several groups) rather than inline.
    pub rows_in_memory: bool,
    /// Thread blocks of the grid.
    pub blocks: u32,
}

impl LaunchShape {
    /// Whether every row is of one group (see [`LaunchShape::row_units`]).
    pub fn uniform(&self) -> bool {
        self.row_units != 0
    }
}

/// The launch of a call with `rows_per_slot[s]` rows of group slot `s`
/// (`num_rows` in all), where `groups[s]` and `max_splits[s]` describe slot
/// `s` in the call's role and `resident_warps` warps fit on the card at
/// once. Slots of no units (state groups, whose rows the state kernel
/// takes) are left out; `num_rows` counts only the other slots' rows. A
/// call with none of those still launches one block, which publishes the
/// values (the state kernel's).
///
/// Chunks per kernel block: enough that the call fills the card several
/// times over, so that even one block spreads across it, but no more than
/// keeps every lane's batch of loads full.
pub fn launch_shape(
    rows_per_slot: &[u64],
    groups: &[DevGroup],
    max_splits: &[u32],
    num_rows: usize,
    resident_warps: u64,
) -> LaunchShape {
    let mut base_units = 0u64;
    let mut slots_with_rows = 0;
    let mut first_units = 0u64;
    let mut max_split = MAX_SPLIT;
    let with_units = |(slot, &count): &(usize, &u64)| count > 0 && groups[*slot].units > 0;
    for (slot, &count) in rows_per_slot.iter().enumerate().filter(with_units) {
        slots_with_rows += 1;
        first_units = groups[slot].units as u64;
        base_units += count * first_units;
        max_split = max_split.min(max_splits[slot]);
    }
    if slots_with_rows == 0 {
        return LaunchShape {
            split: 1,
            total_units: 0,
            row_units: 0,
            rows_in_memory: false,
            blocks: 1,
        };
    }
    let uniform = slots_with_rows == 1;
    let mut split = 1u32;
    while split < max_split && base_units * (split as u64) < 4 * resident_warps {
        split *= 2;
    }
    let total_units = base_units * split as u64;
    let warps = total_units.min(resident_warps).max(1);
    LaunchShape {
        split,
        total_units,
        row_units: if uniform {
            (first_units * split as u64) as u32
        } else {
            0
        },
        rows_in_memory: num_rows > INLINE_ROWS || !uniform,
        blocks: warps.div_ceil((THREADS_PER_BLOCK / WARP) as u64) as u32,
    }
}

/// The grid of the state kernel, (x, y), for `num_rows` state rows (at
/// least one) of at most `max_units` units each: grid y walks the rows (at
/// most 65535 at once, the rest by stride), grid x times the block's warps
/// a row's units, together about twice the `resident_warps` the card runs
/// at once, never more warps per row than its units.
pub fn state_grid(num_rows: usize, max_units: u32, resident_warps: u64) -> (u32, u32) {
    let rows = (num_rows as u64).clamp(1, 65535);
    let warps_per_row = (2 * resident_warps).div_ceil(rows).min(max_units as u64).max(1);
    let blocks_x = warps_per_row.div_ceil((THREADS_PER_BLOCK / WARP) as u64);
    (blocks_x as u32, rows as u32)
}

/// The first unit of each row, for calls whose rows differ in units.
pub fn row_starts(rows: &[Row], groups: &[DevGroup], split: u32, starts: &mut [u64]) {
    let mut start = 0u64;
    for (row, row_start) in rows.iter().zip(starts.iter_mut()) {
        *row_start = start;
        start += groups[row.group_slot as usize].units as u64 * split as u64;
    }
}

/// Moves the `state_rows` rows that `is_state` picks to the end of `rows`,
/// keeping the order of the others (the checksum kernel's, first) and of
/// the state rows (the state kernel's).
pub fn partition_state_rows(rows: &mut [Row], state_rows: usize, is_state: impl Fn(&Row) -> bool) {
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

#[cfg(test)]
mod tests;
