//! How a call is launched, decided without the device: the chunks per
//! kernel block, the units, where the rows travel and the grid. Pure
//! functions of the plan's rows, the layer table and the card's size, so
//! that they are tested without a GPU.

use super::descriptors::{DevGroup, INLINE_ROWS, MAX_SPLIT, THREADS_PER_BLOCK, WARP};
use crate::plan::Row;

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
/// (`num_rows` in all, at least one), where `groups[s]` and `max_splits[s]`
/// describe slot `s` in the call's role and `resident_warps` warps fit on
/// the card at once.
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
    for (slot, &count) in rows_per_slot.iter().enumerate().filter(|(_, &count)| count > 0) {
        slots_with_rows += 1;
        first_units = groups[slot].units as u64;
        base_units += count * first_units;
        max_split = max_split.min(max_splits[slot]);
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
    fn a_large_call_runs_one_warp_per_resident_warp() {
        let shape = launch_shape(&[1000], &[group(4096)], &[8], 1000, 2048);
        assert_eq!(shape.split, 1, "already 2000 units per warp");
        assert_eq!(shape.blocks, 2048 / 8);
        assert!(shape.rows_in_memory);
    }
}
