//! What one `checksum` call computes: the result's shape and the rows of work
//! (one per block position with valid tokens), shared by every engine.

use std::mem::MaybeUninit;

use crate::base::error::{err, Result};
use crate::inputs::blocks::{valid_tokens, BlockSet};
use crate::inputs::layout::{Group, Layout};
use crate::inputs::placement::GroupPlacement;
use crate::inputs::role::Role;
use crate::results::checksums::{Placement, Shape, SkippedGroup};

/// One block position to checksum in every layer of its group. `repr(C)`
/// because the device engine uploads rows as they are (`struct kvcs_dev_row`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Row {
    /// Request number of the block's first unit: its first token, or,
    /// where the group's placement puts several tokens in a slot, its
    /// first slot's state index (SPEC section 16). A placed slot's number
    /// is this plus the slot's unit offset, not its local index.
    pub first_token: u64,
    /// Block id in the group's caches.
    pub block_id: u32,
    /// Local slots of the block to read, from its first slot: its valid
    /// tokens, or under a placement the valid slots this worker holds
    /// (possibly none).
    pub valid_tokens: u32,
    /// Value index of column 0 at this position.
    pub out: u32,
    /// Value distance between columns (the group's positions in the request).
    pub column_stride: u32,
    /// The group's slot on the worker ([`crate::inputs::layout::Group::slot`]).
    pub group_slot: u32,
    /// Zero.
    pub reserved: u32,
}

// Rows are written as little-endian words (`RowWriter`) and read by the
// device as they are.
#[cfg(not(target_endian = "little"))]
compile_error!("kvcsum lays out rows for a little-endian host");
const _: () = assert!(std::mem::size_of::<Row>() == 32 && std::mem::align_of::<Row>() == 8);

/// The work of one call and the shape of its result. [`Plan::lay_out`]
/// decides it: it checks the blocks and says which rows there are, run by
/// run (`RowRun`), writing none; [`Plan::write`] writes each run's rows
/// where the caller wants them as they are decided (a vector,
/// [`Plan::new`], or a device call's pinned memory, with no copy).
#[derive(Debug, Clone)]
pub struct Plan {
    /// Result shape.
    pub shape: Shape,
    /// Rows of the call, in request order.
    pub num_rows: usize,
    /// Rows of each group, by group slot.
    pub rows_per_slot: Vec<u64>,
    /// Length of the value array.
    pub num_values: usize,
}

/// The rows of one (request, group): one per position of its first `rows`
/// block ids (those with valid tokens; a state group's one block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowRun {
    /// Rows of the run's block ids (the short last row, if any, comes on top).
    pub rows: u32,
    /// The group's slot on the worker.
    pub group_slot: u32,
    /// Request position of the first row's first token.
    pub first_token: u64,
    /// Tokens per position: 0 for a state group, whose one row reads no
    /// tokens (SPEC section 6).
    pub block_size: u64,
    /// The request's tokens.
    pub num_tokens: u64,
    /// Value index of column 0 at the first row.
    pub out: u32,
    /// Value distance between columns (the group's positions in the request).
    pub column_stride: u32,
    /// Where one more row goes, after the run's rows: the last row again
    /// with one token fewer (the request's last position over
    /// `num_tokens - 1` tokens, SPEC section 9's `short_last`), column `c`'s value at
    /// index `out + c`. `None` where the call computes none for the run, or
    /// where that last position holds one token (over one token fewer it
    /// holds none, and its value slots stay 0).
    pub short_last: Option<u32>,
    /// Where the group's tokens sit (SPEC section 16); under the default
    /// one the rows take their plain form.
    pub placement: GroupPlacement,
}

impl Plan {
    /// Checks `blocks` against `layout` and lays out the work, with its rows;
    /// any bad block id or unknown group fails the whole call.
    pub fn new(layout: &Layout, blocks: &BlockSet, role: Role) -> Result<(Plan, Vec<Row>)> {
        // Sized from the count kept as the blocks were added (an upper bound
        // on the rows): no pass over the set.
        let mut rows = Vec::with_capacity(blocks.max_rows(role));
        let room = RowRoom {
            rows: rows.spare_capacity_mut(),
            streaming: false,
        };
        let plan = Plan::write(layout, blocks, role, room)?;
        // SAFETY: `write` initialised the first `num_rows` elements of the
        // spare capacity, which starts at index 0 of the empty vector.
        unsafe { rows.set_len(plan.num_rows) };
        Ok((plan, rows))
    }

    /// As [`Plan::new`], with the rows written to `room.rows[..num_rows]`,
    /// which holds at least `blocks.max_rows(role)` rows (no call has more),
    /// run by run as [`Plan::lay_out`] decides them. On error what the room
    /// holds means nothing.
    pub fn write(layout: &Layout, blocks: &BlockSet, role: Role, room: RowRoom<'_>) -> Result<Plan> {
        if room.rows.len() < blocks.max_rows(role) {
            return Err(err!(
                Internal,
                "room for {} rows, for a call of at most {} rows",
                room.rows.len(),
                blocks.max_rows(role)
            ));
        }
        let mut rows = RowWriter {
            out: room.rows,
            len: 0,
            streaming: room.streaming,
        };
        let plan = Plan::lay_out(layout, blocks, role, |run, block_ids| rows.write_run(run, block_ids))?;
        rows.finish();
        Ok(plan)
    }

    /// Checks `blocks` against `layout` and lays out the work: the result's
    /// shape, and which rows there are, given to `run` one run at a time in
    /// request order with the run's block ids (the first `rows` of them
    /// make rows), never written here. Any bad block id or unknown group
    /// fails the whole call.
    pub fn lay_out(
        layout: &Layout,
        blocks: &BlockSet,
        role: Role,
        mut run: impl FnMut(&RowRun, &[u32]),
    ) -> Result<Plan> {
        let requests = blocks.shared_requests();
        let mut placements = Vec::with_capacity(blocks.num_groups());
        let skipped: Vec<SkippedGroup> = layout
            .skipped_groups()
            .map(|(group_id, reason)| SkippedGroup {
                group_id,
                reason: reason.to_owned(),
            })
            .collect();
        let mut num_values = 0usize;
        let mut num_rows = 0usize;
        let mut rows_per_slot = vec![0u64; layout.groups().count()];
        let mut last_group: Option<&Group> = None;
        let short_last = blocks.computes_short_last(role);
        for request in requests.iter() {
            let req_id = &request.req_id;
            for group_blocks in &request.groups {
                let group_id = group_blocks.group_id;
                if let Some(index) = skipped.iter().position(|s| s.group_id == group_id) {
                    placements.push(Placement::Skipped { index: index as u32 });
                    continue;
                }
                // Consecutive requests mostly name the same groups.
                let group = match last_group {
                    Some(group) if group.group_id == group_id => group,
                    _ => layout.group(group_id).ok_or_else(|| {
                        err!(
                            NotFound,
                            "group_id {group_id} of req_id \"{req_id}\" is not registered on this worker"
                        )
                    })?,
                };
                last_group = Some(group);
                let block_ids = &group_blocks.block_ids;
                let num_blocks = group.num_blocks();
                // The set found the largest id when the blocks were added:
                // one comparison here; the error path finds the culprit.
                if !block_ids.is_empty() && group_blocks.max_block_id() >= num_blocks {
                    let (i, block_id) = block_ids
                        .iter()
                        .enumerate()
                        .find(|(_, &id)| id >= num_blocks)
                        .expect("max");
                    let position = group_blocks.first_position + i as u64;
                    return Err(err!(
                        OutOfBounds,
                        "block id {block_id} at position {position} of req_id \"{req_id}\", group_id {group_id} is not below num_blocks {num_blocks}"
                    ));
                }
                let num_positions = block_ids.len();
                let columns = group.columns(role).len();
                let values_offset = num_values;
                num_values += columns * num_positions;
                // The group holds the request's last token: a producer's
                // call also gives that position over one token fewer, in
                // one more value per column after the group's columns.
                let first = group_blocks.first_position;
                let holds_last = !group.is_state()
                    && request.num_tokens > 0
                    && (request.num_tokens - 1) / group.block_size as u64 >= first
                    && (request.num_tokens - 1) / group.block_size as u64 - first < num_positions as u64;
                let with_short_last = short_last && holds_last;
                if with_short_last {
                    num_values += columns;
                }
                if num_values > u32::MAX as usize {
                    return Err(err!(
                        Unsupported,
                        "one call would hold {num_values} values (req_id \"{req_id}\", group_id {group_id}); at most {} are supported",
                        u32::MAX
                    ));
                }
                placements.push(Placement::Computed {
                    slot: group.slot,
                    values_offset,
                    short_last: with_short_last,
                });
                if columns == 0 {
                    continue;
                }
                let (rows, block_size) = if group.is_state() {
                    // SPEC section 6: the state is one block at position 0,
                    // whatever num_tokens says.
                    if first != 0 || num_positions > 1 {
                        return Err(err!(
                            InvalidArgument,
                            "group_id {group_id} of req_id \"{req_id}\" is a state group: its state is one block at position 0, not {num_positions} blocks from first_position {first}"
                        ));
                    }
                    (num_positions, 0)
                } else {
                    // Positions before `end` hold valid tokens (SPEC section 5).
                    let block_size = group.block_size as u64;
                    let end = request.num_tokens.div_ceil(block_size);
                    let with_tokens = end.saturating_sub(first).min(num_positions as u64) as usize;
                    (with_tokens, block_size)
                };
                if rows == 0 {
                    continue;
                }
                // The last row is the request's last position (the group
                // holds it); over one token fewer it holds one token
                // fewer, or none.
                let short_last = (with_short_last && request.num_tokens - 1 > (first + rows as u64 - 1) * block_size)
                    .then_some((values_offset + columns * num_positions) as u32);
                let all_rows = rows + short_last.is_some() as usize;
                rows_per_slot[group.slot as usize] += all_rows as u64;
                num_rows += all_rows;
                let this = RowRun {
                    rows: rows as u32,
                    group_slot: group.slot,
                    // position < end, so position * block_size < num_tokens: no
                    // overflow (a state group's position is 0).
                    first_token: first.wrapping_mul(block_size),
                    block_size,
                    num_tokens: request.num_tokens,
                    out: values_offset as u32,
                    column_stride: num_positions as u32,
                    short_last,
                    placement: group.placement,
                };
                run(&this, block_ids);
            }
        }
        let shape = Shape {
            requests,
            placements,
            columns: layout.groups().map(|group| group.columns(role).clone()).collect(),
            skipped,
        };
        Ok(Plan {
            shape,
            num_rows,
            rows_per_slot,
            num_values,
        })
    }
}

/// One full block of [`full_block_rows`]: block `block_id` of group
/// `group_id`, at position `position` of its request, every token valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullBlock {
    /// The block's KV cache group.
    pub group_id: u32,
    /// Its position in its request.
    pub position: u64,
    /// Its block id in the group's caches.
    pub block_id: u32,
}

/// The rows [`full_block_rows`] writes, kept by the caller so that calls
/// reuse their memory.
#[derive(Debug, Default)]
pub struct FullBlockRows {
    /// The rows, each block's at most one.
    pub rows: Vec<Row>,
    /// Per block: whether it has a value (false for a group the worker skips).
    pub computed: Vec<bool>,
}

/// The rows of full blocks taken one by one, as a call whose requests each
/// hold one such block (its request's tokens end with it) lays them out,
/// except that every column of block `i` adds into value `i`: the block's
/// sum of the worker's columns (with a state group's state).
/// A block of a group the worker skips has no row and no value. Checks
/// every block before writing a row; any bad one fails the call (the
/// arguments named as `group_ids[i]`, `positions[i]`, `block_ids[i]`).
pub fn full_block_rows(layout: &Layout, blocks: &[FullBlock], out: &mut FullBlockRows) -> Result<()> {
    out.rows.clear();
    out.rows.reserve(blocks.len());
    let room = RowRoom {
        rows: out.rows.spare_capacity_mut(),
        streaming: false,
    };
    let (written, _) = write_full_blocks(layout, blocks, room, &mut out.computed)?;
    // SAFETY: the writer initialised the first `written` elements of the
    // spare capacity (one row a block at most, room reserved above), which
    // starts at index 0 of the cleared vector.
    unsafe { out.rows.set_len(written) };
    Ok(())
}

/// [`full_block_rows`] into `room` (at least a row a block), as the plan of
/// a call of `blocks.len()` values and no requests: what a device engine
/// queues (`DeviceEngine::checksum_planned`). `computed[i]` says whether
/// block `i` has a value.
pub fn full_block_plan(
    layout: &Layout,
    blocks: &[FullBlock],
    room: RowRoom<'_>,
    computed: &mut Vec<bool>,
) -> Result<Plan> {
    let (num_rows, rows_per_slot) = write_full_blocks(layout, blocks, room, computed)?;
    Ok(Plan {
        shape: Shape {
            requests: Default::default(),
            placements: Vec::new(),
            columns: Vec::new(),
            skipped: Vec::new(),
        },
        num_rows,
        rows_per_slot,
        num_values: blocks.len(),
    })
}

/// Checks `blocks` and writes their rows into `room`: the rows written and
/// the rows of each group slot.
fn write_full_blocks(
    layout: &Layout,
    blocks: &[FullBlock],
    room: RowRoom<'_>,
    computed: &mut Vec<bool>,
) -> Result<(usize, Vec<u64>)> {
    if blocks.len() > u32::MAX as usize {
        return Err(err!(
            Unsupported,
            "{} blocks in one call; at most {} are supported",
            blocks.len(),
            u32::MAX
        ));
    }
    if room.rows.len() < blocks.len() {
        return Err(err!(
            Internal,
            "room for {} rows, for {} full blocks",
            room.rows.len(),
            blocks.len()
        ));
    }
    computed.clear();
    // The group of a block, or none where the worker skips it; checked
    // in the first pass, looked up again in the second (no allocation).
    let group_of = |block: &FullBlock| match layout.skip_reason(block.group_id) {
        Some(_) => None,
        None => layout.group(block.group_id),
    };
    for (i, block) in blocks.iter().enumerate() {
        let group_id = block.group_id;
        if layout.skip_reason(group_id).is_some() {
            continue;
        }
        let group = layout
            .group(group_id)
            .ok_or_else(|| err!(InvalidArgument, "group_ids[{i}] {group_id} is no group of this worker"))?;
        if block.block_id >= group.num_blocks() {
            return Err(err!(
                OutOfBounds,
                "block_ids[{i}] {} (group_id {group_id}) is not below num_blocks {}",
                block.block_id,
                group.num_blocks()
            ));
        }
        if group.is_state() {
            if block.position != 0 {
                return Err(err!(
                    InvalidArgument,
                    "positions[{i}] {} of group_id {group_id}, a state group: its state is one block at position 0",
                    block.position
                ));
            }
        } else {
            check_full_position(i, block.position, group.block_size)?;
        }
    }
    let mut rows_per_slot = vec![0u64; layout.groups().count()];
    let mut rows = RowWriter {
        out: room.rows,
        len: 0,
        streaming: room.streaming,
    };
    for (i, block) in blocks.iter().enumerate() {
        let group = group_of(block);
        computed.push(group.is_some());
        let Some(group) = group else { continue };
        let block_size = if group.is_state() { 0 } else { group.block_size as u64 };
        let run = RowRun {
            rows: 1,
            group_slot: group.slot,
            first_token: block.position * block_size,
            block_size,
            num_tokens: (block.position + 1) * block_size,
            out: i as u32,
            // Every column into the block's one value.
            column_stride: 0,
            short_last: None,
            placement: group.placement,
        };
        let before = rows.len;
        rows.write_run(&run, std::slice::from_ref(&block.block_id));
        rows_per_slot[group.slot as usize] += (rows.len - before) as u64;
    }
    rows.finish();
    Ok((rows.len, rows_per_slot))
}

/// Fails unless the tokens of full blocks up to `position` (entry `i` of a
/// call's `positions`) of `block_size` tokens each can be counted.
fn check_full_position(i: usize, position: u64, block_size: u32) -> Result<()> {
    if position
        .checked_add(1)
        .and_then(|end| end.checked_mul(block_size as u64))
        .is_none()
    {
        return Err(err!(
            InvalidArgument,
            "positions[{i}] {position} overflows the token count of a {block_size}-token block"
        ));
    }
    Ok(())
}

/// Where [`Plan::write`] puts a call's rows.
pub struct RowRoom<'a> {
    /// At least as many rows as the call's set has blocks.
    pub rows: &'a mut [MaybeUninit<Row>],
    /// Write past the CPU's caches: for memory the device reads next and
    /// the host does not (a device call's pinned rows). Written with
    /// ordinary stores, such memory costs a read of every line first, which
    /// doubled the plan's time on a lent host (9.5 -> 4.8 us for 2048 rows).
    pub streaming: bool,
}

/// Rows written in order into room the caller gave.
struct RowWriter<'a> {
    out: &'a mut [MaybeUninit<Row>],
    len: usize,
    streaming: bool,
}

impl RowWriter<'_> {
    /// Appends the rows of `run`, whose block ids start `block_ids`.
    fn write_run(&mut self, run: &RowRun, block_ids: &[u32]) {
        // A closure over copies, not references, and an iterator of known
        // length: the rows are written in one tight loop. Rows hold tokens,
        // so first_token < num_tokens: valid_tokens is the plain
        // difference, capped (0 for a state row, whose block_size is 0).
        let RowRun {
            rows,
            group_slot,
            first_token,
            block_size,
            num_tokens,
            out,
            column_stride,
            short_last,
            placement,
        } = *run;
        if !placement.is_default() {
            self.write_placed_run(run, block_ids);
            return;
        }
        let written = self.len;
        self.extend(
            rows as usize,
            block_ids[..rows as usize]
                .iter()
                .enumerate()
                .map(move |(i, &block_id)| {
                    let first_token = first_token + i as u64 * block_size;
                    Row {
                        first_token,
                        block_id,
                        valid_tokens: (num_tokens - first_token).min(block_size) as u32,
                        out: out + i as u32,
                        column_stride,
                        group_slot,
                        reserved: 0,
                    }
                }),
        );
        debug_assert!(
            block_size == 0
                || self.out[written..self.len].iter().all(|row| {
                    // SAFETY: just written.
                    let row = unsafe { row.assume_init_ref() };
                    let position = row.first_token / block_size;
                    row.valid_tokens == valid_tokens(num_tokens, block_size as u32, position)
                })
        );
        if let Some(short_out) = short_last {
            // The run's last row, over one token fewer (the plan made it
            // only where that leaves the row a token): its columns' values
            // follow one another.
            let first_token = first_token + (rows as u64 - 1) * block_size;
            let row = Row {
                first_token,
                block_id: block_ids[rows as usize - 1],
                valid_tokens: (num_tokens - 1 - first_token) as u32,
                out: short_out,
                column_stride: 1,
                group_slot,
                reserved: 0,
            };
            self.extend(1, std::iter::once(row));
        }
    }

    /// [`RowWriter::write_run`] for a group with a placement (SPEC section
    /// 16): each row's first unit and this worker's valid local slots.
    fn write_placed_run(&mut self, run: &RowRun, block_ids: &[u32]) {
        let RowRun {
            rows,
            group_slot,
            first_token,
            block_size,
            num_tokens,
            out,
            column_stride,
            short_last,
            placement,
        } = *run;
        let size = block_size as u32;
        let first_position = first_token / block_size;
        self.extend(
            rows as usize,
            block_ids[..rows as usize]
                .iter()
                .enumerate()
                .map(move |(i, &block_id)| {
                    let position = first_position + i as u64;
                    Row {
                        first_token: placement.first_unit(size, position),
                        block_id,
                        valid_tokens: placement.valid_slots(size, num_tokens, position),
                        out: out + i as u32,
                        column_stride,
                        group_slot,
                        reserved: 0,
                    }
                }),
        );
        if let Some(short_out) = short_last {
            let position = first_position + rows as u64 - 1;
            let row = Row {
                first_token: placement.first_unit(size, position),
                block_id: block_ids[rows as usize - 1],
                valid_tokens: placement.valid_slots(size, num_tokens - 1, position),
                out: short_out,
                column_stride: 1,
                group_slot,
                reserved: 0,
            };
            self.extend(1, std::iter::once(row));
        }
    }

    /// Appends the `count` rows of `rows` (a run's, so that
    /// `Plan::write`'s room check bounds the total), writing them in one
    /// tight loop with one bounds check.
    fn extend(&mut self, count: usize, rows: impl Iterator<Item = Row>) {
        let end = self.len + count;
        let out = &mut self.out[self.len..end];
        if self.streaming {
            for (slot, row) in out.iter_mut().zip(rows) {
                store_streaming(slot, row_words(&row));
            }
        } else {
            for (slot, row) in out.iter_mut().zip(rows) {
                // SAFETY: `Row` is `repr(C)`: a u64 then six u32s, 32 bytes
                // with no padding, 8-byte aligned (asserted above); on a
                // little-endian target `row_words` are its bytes.
                unsafe { slot.as_mut_ptr().cast::<[u64; 4]>().write(row_words(&row)) };
            }
        }
        self.len = end;
    }

    /// Makes streamed rows visible to whatever reads them next (the
    /// driver's copy or the kernel, both started after this).
    fn finish(&self) {
        #[cfg(target_arch = "x86_64")]
        if self.streaming {
            // SAFETY: a store fence; no memory is touched.
            unsafe { std::arch::x86_64::_mm_sfence() };
        }
    }
}

/// A row as four 8-byte words, in its memory order on a little-endian
/// target: four stores where the compiler writes the fields one by one
/// (the store rate bounds the plan).
fn row_words(row: &Row) -> [u64; 4] {
    [
        row.first_token,
        row.block_id as u64 | (row.valid_tokens as u64) << 32,
        row.out as u64 | (row.column_stride as u64) << 32,
        row.group_slot as u64 | (row.reserved as u64) << 32,
    ]
}

/// Writes `words` to `slot` with non-temporal stores where the target has
/// them (x86-64), else ordinary ones.
fn store_streaming(slot: &mut MaybeUninit<Row>, words: [u64; 4]) {
    let out = slot.as_mut_ptr().cast::<u64>();
    #[cfg(target_arch = "x86_64")]
    for (i, word) in words.into_iter().enumerate() {
        // SAFETY: `out + i` for i < 4 lies in the 32-byte, 8-byte aligned
        // row (see `extend`); a plain store of one word, past the caches.
        unsafe { std::arch::x86_64::_mm_stream_si64(out.add(i).cast(), word as i64) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: as in `extend`.
    unsafe {
        out.cast::<[u64; 4]>().write(words)
    };
}
