//! The values of full KV blocks a worker computed, kept by block hash in a
//! bounded index, so that a block loaded back from an offload tier is
//! compared with what this worker computed (docs/vllm-tiers.md).
//!
//! A block's value is the sum of the worker's columns at its position
//! (docs/SPEC.md section 8's "sum of the worker's columns", every column,
//! as the consumer role computes them) over the block's bytes when the
//! store ran. A block computed again can differ in its last bits (kernels
//! are not batch-invariant), so up to [`MAX_VALUES`] values are kept per
//! hash; a hash seen with more, or at two positions, is *too many values*
//! from then on, never compared. A loaded block is matched when its value
//! is one of those kept for its hash at its position, mismatched when
//! values are kept and its value is none of them, and unknown otherwise
//! (no hash, a hash never stored or dropped, too many values, another
//! position, a group the worker does not checksum).
//!
//! Memory: at most `capacity` entries of [`ENTRY_BYTES`] each in the slot
//! array plus a table of 4-byte slot numbers at most half full; the least
//! recently stored or matched
//! entry goes first when the index is full. A device worker's store is
//! queued on its stream: its values are read at the next call on the index
//! that finds the work done, and by every check before it compares.

use crate::base::error::{err, Result};
use crate::inputs::role::Role;
use crate::inputs::stream::StreamHandle;
use crate::plan::{FullBlock, FullBlockRows};
use crate::results::checksums::Values;
use crate::worker::Worker;

/// Most distinct values kept per block hash.
pub(crate) const MAX_VALUES: usize = 4;
/// The shortest block hash the index takes.
pub(crate) const MIN_HASH_BYTES: usize = 8;
/// The longest block hash the index takes (SHA-256's).
pub(crate) const MAX_HASH_BYTES: usize = 32;
/// The most entries an index may be created for (slots are `u32`).
pub(crate) const MAX_CAPACITY: u64 = (u32::MAX - 1) as u64;
/// Bytes of one entry in the slot array (the table adds 8 to 16 bytes an
/// entry: 4 a bucket, between a quarter and half of them in use).
pub(crate) const ENTRY_BYTES: usize = std::mem::size_of::<Entry>();
/// Stores still queued on a device past which a store waits for the
/// oldest (their results hold the values until read).
const MAX_PENDING: usize = 64;
const NIL: u32 = u32::MAX;
const TOO_MANY: u8 = u8::MAX;

/// The outcome of one loaded block (`kvcs_tier_outcome` in C).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum TierOutcome {
    /// Its value is one of those kept for its hash at its position.
    Matched = 1,
    /// Values are kept for its hash at its position, and its value is none of them.
    Mismatched = 2,
    /// Unknown: the block has no hash (a partial block).
    NoBlockHash = 3,
    /// Unknown: no value is kept for its hash (never stored here, or dropped).
    UnknownBlock = 4,
    /// Unknown: its hash was stored with more than [`MAX_VALUES`] values or at two positions.
    TooManyValues = 5,
    /// Unknown: its hash was stored at another position.
    OtherPosition = 6,
    /// Unknown: the worker does not checksum the block's group.
    NotChecksummed = 7,
}

/// One block of a store or a check: its group, position in its request,
/// block id and hash (`None`: it has none, a check's partial block).
#[derive(Debug, Clone, Copy)]
pub struct TierBlock<'a> {
    /// The block's KV cache group.
    pub group_id: u32,
    /// Its position in its request.
    pub position: u64,
    /// Its block id in the worker's caches.
    pub block_id: u32,
    /// Its block hash.
    pub hash: Option<&'a [u8]>,
}

/// The blocks of a store or a check as a C caller has them, read in
/// place: block `i` is `block_ids[i]` at position `positions[i]` of group
/// `group_ids[i]`, with row `i` of `hashes` (`hash_bytes` bytes each) as
/// its hash, or none where `hashed` is given and `hashed[i]` is 0.
#[derive(Debug, Clone, Copy)]
pub struct TierArrays<'a> {
    group_ids: &'a [u32],
    positions: &'a [u64],
    block_ids: &'a [u32],
    hashes: &'a [u8],
    hash_bytes: usize,
    hashed: Option<&'a [u8]>,
}

impl<'a> TierArrays<'a> {
    /// The arrays' blocks, once their lengths agree, `hash_bytes` is a
    /// length the index takes (where there are blocks) and every flag of
    /// `hashed` is 0 or 1 (`InvalidArgument` naming the argument and
    /// entry otherwise).
    pub fn new(
        group_ids: &'a [u32],
        positions: &'a [u64],
        block_ids: &'a [u32],
        hashes: &'a [u8],
        hash_bytes: usize,
        hashed: Option<&'a [u8]>,
    ) -> Result<TierArrays<'a>> {
        let count = group_ids.len();
        if positions.len() != count || block_ids.len() != count || hashed.is_some_and(|h| h.len() != count) {
            return Err(err!(
                InvalidArgument,
                "group_ids has {count} entries, positions {}, block_ids {}{}",
                positions.len(),
                block_ids.len(),
                hashed.map_or(String::new(), |h| format!(", hashed {}", h.len()))
            ));
        }
        if count > 0 {
            TierArrays::check_hash_bytes(hash_bytes)?;
        }
        if count.checked_mul(hash_bytes) != Some(hashes.len()) {
            return Err(err!(
                InvalidArgument,
                "hashes has {} bytes, not {count} x hash_bytes {hash_bytes}",
                hashes.len()
            ));
        }
        if let Some(i) = hashed.and_then(|flags| flags.iter().position(|&f| f > 1)) {
            let flag = hashed.expect("found")[i];
            return Err(err!(InvalidArgument, "hashed[{i}] is {flag}, neither 0 nor 1"));
        }
        Ok(TierArrays {
            group_ids,
            positions,
            block_ids,
            hashes,
            hash_bytes,
            hashed,
        })
    }

    /// Fails unless `hash_bytes` is a hash length the index takes (8 to 32
    /// bytes): checked before a caller's hashes are taken as that long.
    pub fn check_hash_bytes(hash_bytes: usize) -> Result<()> {
        check_hash_len(hash_bytes, "hash_bytes")
    }

    /// How many blocks.
    pub fn len(&self) -> usize {
        self.group_ids.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.group_ids.is_empty()
    }

    /// Block `i` (below [`TierArrays::len`]).
    pub fn get(&self, i: usize) -> TierBlock<'a> {
        let has_hash = self.hashed.is_none_or(|flags| flags[i] == 1);
        TierBlock {
            group_id: self.group_ids[i],
            position: self.positions[i],
            block_id: self.block_ids[i],
            hash: has_hash.then(|| &self.hashes[i * self.hash_bytes..(i + 1) * self.hash_bytes]),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    group_id: u32,
    len: u8,
    hash: [u8; MAX_HASH_BYTES],
}

impl Key {
    fn of(group_id: u32, hash: &[u8]) -> Key {
        let mut bytes = [0u8; MAX_HASH_BYTES];
        bytes[..hash.len()].copy_from_slice(hash);
        Key {
            group_id,
            len: hash.len() as u8,
            hash: bytes,
        }
    }
}

#[derive(Debug, Clone)]
struct Entry {
    key: Key,
    position: u64,
    values: [u64; MAX_VALUES],
    /// Values kept, or `TOO_MANY`.
    count: u8,
    /// Older and newer neighbours in use order (`NIL` at the ends).
    older: u32,
    newer: u32,
}

/// A device store whose values are not read yet: block `i`'s key and
/// position, where it has a value (`None` for a group the worker skips),
/// and value `i` once the work is done.
struct Pending {
    values: Values,
    blocks: Vec<Option<(Key, u64)>>,
}

/// Counts of an index: what [`TierIndex::info`] gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierIndexInfo {
    /// Entries (block hashes) kept now.
    pub entries: u64,
    /// Entries pushed out by the bound so far.
    pub dropped: u64,
    /// Stores whose values were lost (their device work failed).
    pub lost_stores: u64,
    /// Bytes the index holds now (slot array and hash map).
    pub memory_bytes: u64,
}

/// The bounded index of one worker's block values.
pub struct TierIndex {
    capacity: usize,
    slots: Vec<Entry>,
    map: Table,
    oldest: u32,
    newest: u32,
    dropped: u64,
    lost_stores: u64,
    pending: Vec<Pending>,
    /// A host worker's calls, computed at once: their blocks, rows and
    /// sums, kept so that each call reuses the last one's memory.
    scratch: Scratch,
}

/// What [`TierIndex::store`] and [`TierIndex::check`] compute at once on a
/// host worker (see `Worker::full_block_sums`).
#[derive(Default)]
struct Scratch {
    blocks: Vec<FullBlock>,
    rows: FullBlockRows,
    sums: Vec<u64>,
}

impl Scratch {
    /// The sums of `blocks` (every one hashed, their hashes checked):
    /// computed now into `sums` (`None`, a host worker), or queued on
    /// `stream` (a device worker).
    fn compute<'a>(
        &mut self,
        worker: &Worker,
        blocks: impl Iterator<Item = TierBlock<'a>>,
        stream: StreamHandle,
    ) -> Result<Option<Values>> {
        self.blocks.clear();
        self.blocks.extend(blocks.map(|b| FullBlock {
            group_id: b.group_id,
            position: b.position,
            block_id: b.block_id,
        }));
        worker.full_block_sums(&self.blocks, Role::Consumer, stream, &mut self.rows, &mut self.sums)
    }

    /// Whether block `i` of the last call has a value.
    fn computed(&self, i: usize) -> bool {
        self.rows.computed[i]
    }
}

impl TierIndex {
    /// An empty index of at most `capacity` entries (1 to [`MAX_CAPACITY`]).
    /// Nothing is allocated up front: memory grows with the entries kept.
    pub fn new(capacity: u64) -> Result<TierIndex> {
        if capacity == 0 || capacity > MAX_CAPACITY {
            return Err(err!(
                InvalidArgument,
                "capacity {capacity} is not in [1, {MAX_CAPACITY}] entries"
            ));
        }
        Ok(TierIndex {
            capacity: capacity as usize,
            slots: Vec::new(),
            map: Table::default(),
            oldest: NIL,
            newest: NIL,
            dropped: 0,
            lost_stores: 0,
            pending: Vec::new(),
            scratch: Scratch::default(),
        })
    }

    /// Its counts and memory now.
    pub fn info(&self) -> TierIndexInfo {
        TierIndexInfo {
            entries: self.map.len as u64,
            dropped: self.dropped,
            lost_stores: self.lost_stores,
            memory_bytes: (self.slots.capacity() * ENTRY_BYTES + self.map.buckets.capacity() * 4) as u64,
        }
    }

    /// The position and values kept for a hash of a group (`None`: none
    /// kept, or too many). Stores still queued are not looked at.
    pub fn values(&self, group_id: u32, hash: &[u8]) -> Result<Option<(u64, Vec<u64>)>> {
        check_hash_len(hash.len(), "hash_bytes")?;
        let Some(slot) = self.map.get(&self.slots, &Key::of(group_id, hash)) else {
            return Ok(None);
        };
        let entry = &self.slots[slot as usize];
        if entry.count == TOO_MANY {
            return Ok(None);
        }
        Ok(Some((entry.position, entry.values[..entry.count as usize].to_vec())))
    }

    /// Checksums full blocks that became full (each at its position, every
    /// column) and keeps their values by hash: at once on a host worker; on
    /// a device worker the work is queued on `stream` and the values are
    /// read by a later call once it is done. Every block needs a hash. All
    /// arguments are checked before anything is computed or kept.
    pub fn store(&mut self, worker: &Worker, blocks: &[TierBlock<'_>], stream: StreamHandle) -> Result<()> {
        self.store_each(worker, blocks.len(), |i| blocks[i], stream)
    }

    /// [`TierIndex::store`] of the blocks of arrays as a C caller has them,
    /// read in place.
    pub fn store_arrays(&mut self, worker: &Worker, blocks: &TierArrays<'_>, stream: StreamHandle) -> Result<()> {
        self.store_each(worker, blocks.len(), |i| blocks.get(i), stream)
    }

    /// Compares loaded blocks with the values kept: checksums them (every
    /// column; queued on `stream` on a device, and waited for), waits for
    /// the stores still queued, and gives each block's outcome. A matched
    /// entry becomes the most recently used. All arguments are checked
    /// before anything is computed.
    pub fn check(
        &mut self,
        worker: &Worker,
        blocks: &[TierBlock<'_>],
        stream: StreamHandle,
    ) -> Result<Vec<TierOutcome>> {
        self.check_each(worker, blocks.len(), |i| blocks[i], stream)
    }

    /// [`TierIndex::check`] of the blocks of arrays as a C caller has them,
    /// read in place.
    pub fn check_arrays(
        &mut self,
        worker: &Worker,
        blocks: &TierArrays<'_>,
        stream: StreamHandle,
    ) -> Result<Vec<TierOutcome>> {
        self.check_each(worker, blocks.len(), |i| blocks.get(i), stream)
    }

    /// [`TierIndex::store`] of the `count` blocks `block(0..count)`. On a
    /// host worker nothing is allocated but the entries kept.
    fn store_each<'a>(
        &mut self,
        worker: &Worker,
        count: usize,
        block: impl Fn(usize) -> TierBlock<'a>,
        stream: StreamHandle,
    ) -> Result<()> {
        self.settle(false);
        if count == 0 {
            return Ok(());
        }
        if let Some(i) = (0..count).find(|&i| block(i).hash.is_none()) {
            return Err(err!(InvalidArgument, "hashes: block {i} of a store has no block hash"));
        }
        check_hashes((0..count).map(&block))?;
        let key = |i: usize| {
            let b = block(i);
            (Key::of(b.group_id, b.hash.expect("hashed blocks only")), b.position)
        };
        match self.scratch.compute(worker, (0..count).map(&block), stream)? {
            None => {
                // A host worker: computed now, kept now.
                for i in 0..count {
                    if self.scratch.computed(i) {
                        let (k, position) = key(i);
                        self.remember(k, position, self.scratch.sums[i]);
                    }
                }
            }
            Some(values) => {
                let blocks = (0..count).map(|i| self.scratch.computed(i).then(|| key(i))).collect();
                self.pending.push(Pending { values, blocks });
                if self.pending.len() > MAX_PENDING {
                    let oldest = self.pending.remove(0);
                    self.read(oldest);
                }
            }
        }
        Ok(())
    }

    /// [`TierIndex::check`] of the `count` blocks `block(0..count)`.
    fn check_each<'a>(
        &mut self,
        worker: &Worker,
        count: usize,
        block: impl Fn(usize) -> TierBlock<'a>,
        stream: StreamHandle,
    ) -> Result<Vec<TierOutcome>> {
        let hashed = || (0..count).map(&block).filter(|b| b.hash.is_some());
        check_hashes(hashed())?;
        let mut outcomes = vec![TierOutcome::NoBlockHash; count];
        if hashed().next().is_none() {
            self.settle(true);
            return Ok(outcomes);
        }
        let queued = self.scratch.compute(worker, hashed(), stream)?;
        // The stores still queued are read first (a check compares with
        // every value stored before it).
        self.settle(true);
        let sums: &[u64] = match &queued {
            None => &self.scratch.sums,
            Some(values) => {
                values.wait()?;
                values.get()?
            }
        };
        let found: Vec<Option<u64>> = (0..sums.len())
            .map(|i| self.scratch.computed(i).then(|| sums[i]))
            .collect();
        for (next, (i, b)) in (0..count)
            .map(|i| (i, block(i)))
            .filter(|(_, b)| b.hash.is_some())
            .enumerate()
        {
            let hash = b.hash.expect("hashed blocks only");
            outcomes[i] = match found[next] {
                Some(sum) => self.compare(&Key::of(b.group_id, hash), b.position, sum),
                None => TierOutcome::NotChecksummed,
            };
        }
        Ok(outcomes)
    }

    /// Reads the queued stores whose work is done (all of them, waiting,
    /// when `wait`).
    fn settle(&mut self, wait: bool) {
        if self.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        for store in pending {
            if wait || store.values.is_ready().unwrap_or(true) {
                self.read(store);
            } else {
                self.pending.push(store);
            }
        }
    }

    /// Waits for a queued store and keeps its values (none where its work
    /// failed: those blocks are then unknown, never mismatched).
    fn read(&mut self, store: Pending) {
        let values = match store.values.wait().and_then(|()| store.values.get()) {
            Ok(values) => values,
            Err(_) => {
                self.lost_stores += 1;
                return;
            }
        };
        for (block, &value) in store.blocks.iter().zip(values) {
            // A group the worker skips has no sum: its values stay unknown.
            if let Some((key, position)) = *block {
                self.remember(key, position, value);
            }
        }
    }

    fn remember(&mut self, key: Key, position: u64, value: u64) {
        if let Some(slot) = self.map.get(&self.slots, &key) {
            let entry = &mut self.slots[slot as usize];
            if entry.count != TOO_MANY {
                let count = entry.count as usize;
                if entry.position != position {
                    entry.count = TOO_MANY; // one hash at two positions: never compared
                } else if !entry.values[..count].contains(&value) {
                    if count >= MAX_VALUES {
                        entry.count = TOO_MANY;
                    } else {
                        entry.values[count] = value;
                        entry.count += 1;
                    }
                }
            }
            self.touch(slot);
            return;
        }
        let entry = Entry {
            key,
            position,
            values: [value, 0, 0, 0],
            count: 1,
            older: NIL,
            newer: NIL,
        };
        let slot = if self.map.len >= self.capacity {
            // Full: the least recently used entry's slot is reused.
            let slot = self.oldest;
            self.unlink(slot);
            let old = self.slots[slot as usize].key;
            self.map.remove(&self.slots, &old);
            self.dropped += 1;
            self.slots[slot as usize] = entry;
            slot
        } else {
            if self.slots.len() == self.slots.capacity() {
                // Grow by doubling, never past the capacity.
                let more = self.slots.len().max(16).min(self.capacity - self.slots.len());
                self.slots.reserve_exact(more);
            }
            self.slots.push(entry);
            (self.slots.len() - 1) as u32
        };
        self.map.insert(&self.slots, slot);
        self.link_newest(slot);
    }

    fn compare(&mut self, key: &Key, position: u64, value: u64) -> TierOutcome {
        let Some(slot) = self.map.get(&self.slots, key) else {
            return TierOutcome::UnknownBlock;
        };
        let entry = &self.slots[slot as usize];
        if entry.count == TOO_MANY {
            return TierOutcome::TooManyValues;
        }
        if entry.position != position {
            return TierOutcome::OtherPosition;
        }
        if entry.values[..entry.count as usize].contains(&value) {
            self.touch(slot);
            TierOutcome::Matched
        } else {
            TierOutcome::Mismatched
        }
    }

    fn touch(&mut self, slot: u32) {
        if self.newest != slot {
            self.unlink(slot);
            self.link_newest(slot);
        }
    }

    fn unlink(&mut self, slot: u32) {
        let (older, newer) = {
            let entry = &self.slots[slot as usize];
            (entry.older, entry.newer)
        };
        match older {
            NIL => self.oldest = newer,
            o => self.slots[o as usize].newer = newer,
        }
        match newer {
            NIL => self.newest = older,
            n => self.slots[n as usize].older = older,
        }
        let entry = &mut self.slots[slot as usize];
        entry.older = NIL;
        entry.newer = NIL;
    }

    fn link_newest(&mut self, slot: u32) {
        let newest = self.newest;
        {
            let entry = &mut self.slots[slot as usize];
            entry.older = newest;
            entry.newer = NIL;
        }
        match newest {
            NIL => self.oldest = slot,
            n => self.slots[n as usize].newer = slot,
        }
        self.newest = slot;
    }
}

/// An open-addressing table of slot numbers keyed by their entries' keys
/// (linear probing, at most half full, backward-shift removal): 4 bytes a
/// bucket instead of a copy of each key.
#[derive(Default)]
struct Table {
    buckets: Vec<u32>,
    len: usize,
}

impl Key {
    /// A mix of every byte of the key (block hashes need not be random).
    fn home(&self) -> u64 {
        let mut h = (self.group_id as u64) << 8 | self.len as u64;
        for word in self.hash.chunks_exact(8) {
            h = (h ^ u64::from_le_bytes(word.try_into().expect("8 bytes"))).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            h ^= h >> 29;
        }
        h
    }
}

impl Table {
    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    /// The bucket of `key`, or of the empty bucket where it would go.
    fn find(&self, slots: &[Entry], key: &Key) -> (usize, bool) {
        let mask = self.mask();
        let mut i = key.home() as usize & mask;
        loop {
            match self.buckets[i] {
                NIL => return (i, false),
                slot if slots[slot as usize].key == *key => return (i, true),
                _ => i = (i + 1) & mask,
            }
        }
    }

    fn get(&self, slots: &[Entry], key: &Key) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        match self.find(slots, key) {
            (i, true) => Some(self.buckets[i]),
            _ => None,
        }
    }

    /// Adds `slot` (whose key is not in the table).
    fn insert(&mut self, slots: &[Entry], slot: u32) {
        if (self.len + 1) * 2 > self.buckets.len() {
            let size = (self.buckets.len() * 2).max(16);
            let old = std::mem::replace(&mut self.buckets, vec![NIL; size]);
            for s in old.into_iter().filter(|&s| s != NIL) {
                let (i, _) = self.find(slots, &slots[s as usize].key);
                self.buckets[i] = s;
            }
        }
        let (i, _) = self.find(slots, &slots[slot as usize].key);
        self.buckets[i] = slot;
        self.len += 1;
    }

    /// Removes `key` (in the table), shifting later buckets of its run back.
    fn remove(&mut self, slots: &[Entry], key: &Key) {
        let (mut hole, found) = self.find(slots, key);
        if !found {
            return;
        }
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let slot = self.buckets[j];
            if slot == NIL {
                break;
            }
            let home = slots[slot as usize].key.home() as usize & mask;
            // The entry at j may move to the hole unless its home lies in (hole, j].
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.buckets[hole] = slot;
                hole = j;
            }
        }
        self.buckets[hole] = NIL;
        self.len -= 1;
    }
}

/// Every hash of `blocks` has a length the index takes.
fn check_hashes<'a>(mut blocks: impl Iterator<Item = TierBlock<'a>>) -> Result<()> {
    blocks.try_for_each(|b| b.hash.map_or(Ok(()), |hash| check_hash_len(hash.len(), "hash_bytes")))
}

fn check_hash_len(len: usize, name: &str) -> Result<()> {
    if !(MIN_HASH_BYTES..=MAX_HASH_BYTES).contains(&len) {
        return Err(err!(
            InvalidArgument,
            "{name} is {len}; a block hash of the tier index has {MIN_HASH_BYTES} to {MAX_HASH_BYTES} bytes"
        ));
    }
    Ok(())
}
