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
        // An attention group with a layer of 4-byte pieces now and then.
        let narrow = kind == 0 && random.chance(15);
        for r in 0..2 {
            table.narrow[r].push(narrow);
        }
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
    let mut narrow_calls = 0usize;
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
                narrow: 1 + random.below(20_000),
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

        // The kernel's form, and the shape for that form's card: the
        // narrow one exactly where a row is of a group with a layer of
        // 4-byte pieces (rows of other groups never run its code).
        let reads_narrow = attention.iter().any(|row| table.narrow[r][row.group_slot as usize]);
        let (kernel, resident) = if reads_narrow {
            (ChecksumKernel::Narrow, inputs.resident.narrow)
        } else if table.placed[r] {
            (ChecksumKernel::Placed, inputs.resident.placed)
        } else if table.paired[r] {
            (ChecksumKernel::Paired, inputs.resident.checksum)
        } else if table.any_layer[r] && !table.multi_head[r] {
            (ChecksumKernel::SingleHead, inputs.resident.single_head)
        } else {
            (ChecksumKernel::Unpaired, inputs.resident.unpaired)
        };
        assert_eq!(checksum.kernel, kernel, "{context}");
        narrow_calls += reads_narrow as usize;
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
        narrow_calls > 50,
        "calls reading 4-byte pieces: {narrow_calls}, seed {seed}"
    );
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
