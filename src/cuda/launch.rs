//! How a call is launched, decided without the device: the slot it takes,
//! which kernels run, the chunks per kernel block, the units, where the
//! rows travel (inline, read in place from pinned memory, or uploaded) and
//! the grids. Pure functions of the plan, the layer table and the card's
//! size, so that they are tested without a GPU; the engine
//! (`DeviceEngine::checksum`) only writes the slot and queues what
//! [`plan_launch`] says.

use super::descriptors::{
    role_index, DevGroup, LayerTable, INLINE_ROWS, INLINE_STATE_ROWS, MAX_SPLIT, THREADS_PER_BLOCK, WARP,
};
use crate::layout::Role;
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
    /// `kvcs_state`.
    pub state: u64,
}

/// What the launch of one call depends on.
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
    /// The plan's values.
    pub num_values: usize,
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

/// Everything a device call queues, decided before any of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallLaunch {
    /// Rows and values of the slot the call takes; `None`: no slot and
    /// nothing queued, every value the empty sum (0), ready.
    pub slot: Option<(usize, usize)>,
    /// Whether the rows are written past the CPU's caches
    /// ([`crate::plan::RowRoom::streaming`]): calls of more rows than go
    /// inline, whose rows the device reads and the host mostly does not.
    pub stream_rows: bool,
    /// The checksum kernels; `None` when the call reads no cache memory.
    pub checksum: Option<ChecksumLaunch>,
    /// Blocks of the `kvcs_store` launch, queued after the checksums (or
    /// alone, over sums of 0); `None` without stored items.
    pub store_blocks: Option<u32>,
}

/// What a call queues (see [`CallLaunch`]).
///
/// Rows of state groups go to the state kernel, the others to the checksum
/// kernel (which skips state slots in its shape); both are counted per
/// group slot from the plan, not per row. The paired kernel runs where
/// some layer reads its K and V as one unit; where every layer holds one
/// head, the one with more loads in flight; else the one with fewer
/// registers. Rows that fit go inline; rows of one group are read in place
/// from mapped pinned memory (the kernel reads each once per warp); rows
/// of several groups, whose starts the kernel binary-searches, are worth a
/// copy to the device, rows and starts in one. The state kernel reads its
/// rows many times over: past [`INLINE_STATE_ROWS`], from device memory,
/// copied there unless the checksum kernel's copy (of every row) carries
/// them already.
pub fn plan_launch(inputs: &CallInputs<'_>) -> CallLaunch {
    let store_blocks =
        (inputs.stored_items > 0).then(|| inputs.stored_items.div_ceil(THREADS_PER_BLOCK as usize) as u32);
    let num_rows = inputs.num_rows;
    if !inputs.table_on_device || num_rows == 0 {
        // Nothing to read: the store alone in a slot of its own, if any.
        return CallLaunch {
            slot: store_blocks.map(|_| (0, 0)),
            stream_rows: false,
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
    let (kernel, resident_warps) = if table.paired[role] {
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
        slot: Some((num_rows, inputs.num_values)),
        stream_rows: num_rows > INLINE_ROWS,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn group(units: u32) -> DevGroup {
        DevGroup {
            layers_begin: 0,
            layers_end: 1,
            units,
            layer_units: units,
        }
    }

    /// The split the shape should pick, counted naively: the smallest power
    /// of two at which the call has 4 units per resident warp, capped.
    fn naive_split(base_units: u64, cap: u32, resident_warps: u64) -> u32 {
        (0..=3)
            .map(|p| 1u32 << p)
            .find(|&s| s >= cap || base_units * s as u64 >= 4 * resident_warps)
            .unwrap_or(8)
            .min(cap.max(1))
    }

    #[test]
    fn one_group_divides_and_splits_to_fill_the_card() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |bound: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % bound
        };
        for _ in 0..500 {
            let units = 1 + next(5000) as u32;
            let rows = 1 + next(100);
            let cap = [1, 2, 4, 8][next(4) as usize];
            let resident = 1 + next(20_000);
            let shape = launch_shape(
                &[0, rows],
                &[group(7), group(units)],
                &[8, cap],
                rows as usize,
                resident,
            );
            let split = naive_split(rows * units as u64, cap, resident);
            let context = format!("units {units} rows {rows} cap {cap} resident {resident}: {shape:?}");
            assert_eq!(shape.split, split, "{context}");
            assert_eq!(shape.total_units, rows * units as u64 * split as u64, "{context}");
            assert_eq!(shape.row_units, units * split, "{context}");
            assert!(shape.uniform());
            assert_eq!(shape.rows_in_memory, rows as usize > INLINE_ROWS, "{context}");
            let warps = shape.total_units.min(resident);
            assert_eq!(shape.blocks as u64, warps.div_ceil(8), "{context}");
        }
    }

    #[test]
    fn several_groups_search_rows_in_memory() {
        let groups = [group(10), group(30), group(50)];
        let shape = launch_shape(&[2, 0, 1], &groups, &[8, 8, 2], 3, 1000);
        // 2 * 10 + 50 = 70 units; the third slot caps the split at 2.
        assert_eq!(shape.split, 2);
        assert_eq!(shape.total_units, 140);
        assert_eq!(shape.row_units, 0);
        assert!(!shape.uniform());
        assert!(shape.rows_in_memory);
        assert_eq!(shape.blocks, 140u64.div_ceil(8) as u32);

        let rows: Vec<Row> = [0u32, 2, 0]
            .iter()
            .map(|&group_slot| Row {
                group_slot,
                ..Row::default()
            })
            .collect();
        let mut starts = [u64::MAX; 3];
        row_starts(&rows, &groups, shape.split, &mut starts);
        assert_eq!(starts, [0, 20, 120]);
    }

    #[test]
    fn state_slots_are_left_to_the_state_kernel() {
        // Slot 1 is a state group (no units): its rows change nothing.
        let groups = [group(10), group(0), group(30)];
        let with = launch_shape(&[3, 5, 0], &groups, &[8, 8, 8], 3, 1000);
        let without = launch_shape(&[3, 0, 0], &groups, &[8, 8, 8], 3, 1000);
        assert_eq!(with, without);
        assert!(with.uniform(), "one slot with units: {with:?}");
        // Only state rows: one block, no units, publishing.
        let only = launch_shape(&[0, 7, 0], &groups, &[8, 8, 8], 0, 1000);
        assert_eq!(only.total_units, 0);
        assert_eq!(only.blocks, 1);
        assert!(!only.rows_in_memory);
    }

    #[test]
    fn the_state_grid_covers_rows_and_fills_the_card() {
        // One row of many units: about twice the resident warps.
        assert_eq!(state_grid(1, 1 << 20, 2048), (512, 1));
        // A row of few units: no more warps than units.
        assert_eq!(state_grid(1, 20, 2048), (3, 1));
        // Many rows share the card.
        assert_eq!(state_grid(64, 1 << 20, 2048), (8, 64));
        // More rows than grid y holds: the rest by stride.
        assert_eq!(state_grid(100_000, 1 << 20, 2048), (1, 65535));
    }

    #[test]
    fn a_large_call_runs_one_warp_per_resident_warp() {
        let shape = launch_shape(&[1000], &[group(4096)], &[8], 1000, 2048);
        assert_eq!(shape.split, 1, "already 2000 units per warp");
        assert_eq!(shape.blocks, 2048 / 8);
        assert!(shape.rows_in_memory);
    }
}
