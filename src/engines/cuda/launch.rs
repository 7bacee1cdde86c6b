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
    let (kernel, resident_warps) = if table.placed[role] {
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
mod tests {
    use super::super::descriptors::DevStateGroup;
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

    /// Seeded random numbers for the random cases (xorshift64).
    struct Random(u64);

    impl Random {
        /// A seed from the clock, printed by the tests on failure.
        fn seeded() -> (Random, u64) {
            let seed = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(7, |d| d.as_nanos() as u64)
                | 1;
            (Random(seed), seed)
        }

        fn below(&mut self, bound: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % bound
        }

        fn chance(&mut self, percent: u64) -> bool {
            self.below(100) < percent
        }
    }

    /// A random layer table in `role` of up to 6 group slots: attention
    /// groups (units, a split cap), state groups (units for the state
    /// kernel, none for the checksum kernel's shape) and groups with no
    /// layer in the role; and random kernel facts.
    fn random_table(random: &mut Random, role: Role) -> LayerTable {
        let mut table = LayerTable::default();
        let slots = 1 + random.below(6) as usize;
        for _ in 0..slots {
            let kind = random.below(3);
            let units = 1 + random.below(5000) as u32;
            for r in 0..2 {
                let attention_units = if kind == 0 { units } else { 0 };
                table.groups[r].push(group(attention_units));
                table.max_split[r].push([1, 2, 4, 8][random.below(4) as usize]);
            }
            table.state_groups.push(DevStateGroup {
                units: if kind == 1 { units } else { 0 },
                ..DevStateGroup::default()
            });
        }
        let r = role_index(role);
        table.paired[r] = random.chance(40);
        table.placed[r] = random.chance(10);
        table.multi_head[r] = random.chance(50);
        table.any_layer[r] = random.chance(90);
        table
    }

    /// The pure decision, checked against a naive reading of the rows one
    /// by one: which kernels run, where each kernel reads its rows, that the
    /// one upload carries every byte a kernel reads from device memory and
    /// nothing else, and stays inside the slot it asks for.
    #[test]
    fn plan_launch_keeps_its_invariants_on_random_calls() {
        let (mut random, seed) = Random::seeded();
        let mut seen = [0usize; 6];
        for case in 0..20_000 {
            let role = if random.chance(50) {
                Role::Producer
            } else {
                Role::Consumer
            };
            let table = random_table(&mut random, role);
            let r = role_index(role);
            let slots = table.state_groups.len();
            // Rows of slots that have any (the plan makes no rows of a
            // slot without units in its role).
            let with_rows: Vec<u32> = (0..slots as u32)
                .filter(|&s| table.groups[r][s as usize].units > 0 || table.is_state_slot(s))
                .collect();
            let num_rows = match (with_rows.is_empty(), random.below(4)) {
                (true, _) | (_, 0) => 0,
                (_, 1) => 1 + random.below(INLINE_ROWS as u64 + 2) as usize,
                (_, 2) => 1 + random.below(40) as usize,
                _ => 1 + random.below(3000) as usize,
            };
            // Mostly one slot, to reach the uniform forms.
            let one = with_rows.first().copied();
            let rows: Vec<Row> = (0..num_rows)
                .map(|_| Row {
                    group_slot: match random.chance(50) {
                        true => one.unwrap(),
                        false => with_rows[random.below(with_rows.len() as u64) as usize],
                    },
                    ..Row::default()
                })
                .collect();
            let mut rows_per_slot = vec![0u64; slots];
            for row in &rows {
                rows_per_slot[row.group_slot as usize] += 1;
            }
            let inputs = CallInputs {
                table: &table,
                table_on_device: random.chance(95),
                role,
                rows_per_slot: &rows_per_slot,
                num_rows,
                stored_items: if random.chance(30) {
                    random.below(2000) as usize
                } else {
                    0
                },
                resident: ResidentWarps {
                    checksum: 1 + random.below(20_000),
                    unpaired: 1 + random.below(20_000),
                    single_head: 1 + random.below(20_000),
                    placed: 1 + random.below(20_000),
                    state: 1 + random.below(20_000),
                },
            };
            let launch = plan_launch(&inputs);
            let context = format!("seed {seed}, case {case}: {inputs:?} -> {launch:?}");

            // The stored launch: one thread per item.
            match launch.store_blocks {
                None => assert_eq!(inputs.stored_items, 0, "{context}"),
                Some(blocks) => {
                    let threads = blocks as usize * THREADS_PER_BLOCK as usize;
                    assert!(threads >= inputs.stored_items, "{context}");
                    assert!(threads < inputs.stored_items + THREADS_PER_BLOCK as usize, "{context}");
                }
            }
            // Nothing to read: no checksum kernel, a slot only for a store.
            assert_eq!(
                launch.queues(),
                launch.checksum.is_some() || inputs.stored_items > 0,
                "{context}"
            );
            let Some(checksum) = launch.checksum else {
                assert!(!inputs.table_on_device || num_rows == 0, "{context}");
                seen[0] += 1;
                continue;
            };
            assert!(inputs.table_on_device && num_rows > 0, "{context}");

            // Rows split between the two kernels, counted row by row.
            let is_state = |row: &Row| table.state_groups[row.group_slot as usize].units > 0;
            let state_rows = rows.iter().filter(|row| is_state(row)).count();
            let attention: Vec<&Row> = rows.iter().filter(|row| !is_state(row)).collect();
            assert_eq!(checksum.state_rows, state_rows, "{context}");
            assert_eq!(checksum.attention_rows, attention.len(), "{context}");

            // The kernel's form, and the shape for that form's card.
            let (kernel, resident) = if table.placed[r] {
                (ChecksumKernel::Placed, inputs.resident.placed)
            } else if table.paired[r] {
                (ChecksumKernel::Paired, inputs.resident.checksum)
            } else if table.any_layer[r] && !table.multi_head[r] {
                (ChecksumKernel::SingleHead, inputs.resident.single_head)
            } else {
                (ChecksumKernel::Unpaired, inputs.resident.unpaired)
            };
            assert_eq!(checksum.kernel, kernel, "{context}");
            let expected_shape = launch_shape(
                &rows_per_slot,
                &table.groups[r],
                &table.max_split[r],
                attention.len(),
                resident,
            );
            assert_eq!(checksum.shape, expected_shape, "{context}");
            assert!(checksum.shape.blocks >= 1, "{context}");

            // Where the checksum kernel reads: inline when its rows fit and
            // are of one group; in place when of one group; else searched,
            // from device memory.
            let mut groups_read: Vec<u32> = attention.iter().map(|row| row.group_slot).collect();
            groups_read.sort_unstable();
            groups_read.dedup();
            let expected_rows = if groups_read.len() > 1 {
                RowPlace::Device { offset: 0 }
            } else if attention.len() > INLINE_ROWS {
                RowPlace::Mapped
            } else {
                RowPlace::Inline
            };
            assert_eq!(checksum.rows, expected_rows, "{context}");
            assert_eq!(checksum.row_starts, groups_read.len() > 1, "{context}");

            // The state kernel: inline when its rows fit, else device memory
            // right after the checksum kernel's rows.
            let state_units = rows.iter().filter(|row| is_state(row));
            let max_units = state_units
                .map(|row| table.state_groups[row.group_slot as usize].units)
                .max();
            match (checksum.state, max_units) {
                (None, None) => {}
                (Some(state), Some(max_units)) => {
                    assert_eq!(
                        state.grid,
                        state_grid(state_rows, max_units, inputs.resident.state),
                        "{context}"
                    );
                    let expected = if state_rows > INLINE_STATE_ROWS {
                        RowPlace::Device {
                            offset: attention.len() * ROW_BYTES,
                        }
                    } else {
                        RowPlace::Inline
                    };
                    assert_eq!(state.rows, expected, "{context}");
                }
                _ => panic!("a state launch without state rows or the reverse: {context}"),
            }

            // Every byte read from device memory, as (start, end) in the
            // rows' layout (the call's rows, then the row starts).
            let mut read = Vec::new();
            if let RowPlace::Device { offset } = checksum.rows {
                read.push((offset, offset + attention.len() * ROW_BYTES));
            }
            if checksum.row_starts {
                let starts = num_rows * ROW_BYTES;
                read.push((starts, starts + attention.len() * 8));
            }
            if let Some(StateLaunch {
                rows: RowPlace::Device { offset },
                ..
            }) = checksum.state
            {
                read.push((offset, offset + state_rows * ROW_BYTES));
            }
            // The upload is exactly the span of what is read: no copy when
            // nothing is, never a byte past the last one read.
            let span = read.iter().copied().reduce(|(a, b), (c, d)| (a.min(c), b.max(d)));
            let upload = checksum
                .upload
                .map(|upload| (upload.offset, upload.offset + upload.bytes));
            assert_eq!(upload, span, "{context}");
            // Inside the slot's pinned rows and starts (it holds at least
            // the call's rows, and as many starts).
            if let Some((_, end)) = upload {
                assert!(end <= num_rows * (ROW_BYTES + 8), "{context}");
            }
            // Inline rows fit in the parameters.
            if checksum.rows == RowPlace::Inline {
                assert!(attention.len() <= INLINE_ROWS, "{context}");
            }
            seen[match (checksum.rows, checksum.state.is_some()) {
                (RowPlace::Inline, false) => 1,
                (RowPlace::Mapped, false) => 2,
                (RowPlace::Device { .. }, false) => 3,
                (_, true) if state_rows > INLINE_STATE_ROWS => 4,
                (_, true) => 5,
            }] += 1;
        }
        assert!(
            seen.iter().all(|&n| n > 50),
            "every form of call was drawn (none, inline, mapped, searched, state in memory, state inline): {seen:?}, seed {seed}"
        );
    }

    #[test]
    fn a_call_takes_room_for_every_block_and_column() {
        let room = call_room(100, 3);
        assert_eq!((room.rows, room.values, room.stream_rows), (100, 300, true));
        // Rows that go inline are read back by the host: cached.
        assert!(!call_room(INLINE_ROWS, 3).stream_rows);
        assert!(call_room(INLINE_ROWS + 1, 3).stream_rows);
        assert_eq!(call_room(usize::MAX, 2).values, usize::MAX);
    }

    #[test]
    fn state_rows_go_last_in_order() {
        let (mut random, seed) = Random::seeded();
        for _ in 0..200 {
            let rows: Vec<Row> = (0..random.below(60))
                .map(|i| Row {
                    block_id: i as u32,
                    group_slot: random.below(4) as u32,
                    ..Row::default()
                })
                .collect();
            let is_state = |row: &Row| row.group_slot >= 2;
            let naive: Vec<Row> = rows
                .iter()
                .filter(|row| !is_state(row))
                .chain(rows.iter().filter(|row| is_state(row)))
                .copied()
                .collect();
            let mut partitioned = rows.clone();
            let state_rows = rows.iter().filter(|row| is_state(row)).count();
            partition_state_rows(&mut partitioned, state_rows, is_state);
            assert_eq!(partitioned, naive, "seed {seed}");
        }
    }

    #[test]
    fn a_large_call_runs_one_warp_per_resident_warp() {
        let shape = launch_shape(&[1000], &[group(4096)], &[8], 1000, 2048);
        assert_eq!(shape.split, 1, "already 2000 units per warp");
        assert_eq!(shape.blocks, 2048 / 8);
        assert!(shape.rows_in_memory);
    }
}
