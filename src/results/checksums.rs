//! Checksum results: per request and group, one column of partial checksums
//! per replica key, one value per block position (SPEC section 4), and what
//! a result carries to become a record ([`RecordInfo`]; the worker facts in
//! it are `record_facts`).

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use crate::base::checksum::Algorithm;
use crate::base::error::{err, Result};
use crate::base::stored_entry::EntryReader;
pub use crate::base::stored_entry::StoredOutcome;
use crate::inputs::blocks::{GroupBlocks, RequestBlocks};
use crate::inputs::layout::ReplicaKey;
use crate::inputs::role::Role;
use crate::results::record_facts::{GroupInfo, Rank};

/// The per-layer partial checksums of one layer entry of a worker (detail
/// mode): the heads `first_head .. first_head + num_heads` of layer
/// `layer_number` in the column of `replica`, one value per block position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerPartial {
    /// Model-wide layer number.
    pub layer_number: u32,
    /// Global number of the first head.
    pub first_head: u32,
    /// Heads covered.
    pub num_heads: u32,
    /// The column the heads belong to.
    pub replica: ReplicaKey,
    /// One value per block position of the group.
    pub values: Vec<u64>,
}

/// Per group of one request (in the result's group order), its layer
/// partials.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestLayers {
    /// Aligned with the request's groups in the result.
    pub groups: Vec<Vec<LayerPartial>>,
}

/// What a result needs besides its values to become a record: set by
/// `Worker::checksum` at checksum time.
#[derive(Debug, Clone)]
pub struct RecordInfo {
    /// The worker's place.
    pub rank: Rank,
    /// The role the values were computed in.
    pub role: Role,
    /// The algorithm the values were computed with (SPEC section 12).
    pub algorithm: Algorithm,
    /// Every registered group, sorted by id.
    pub groups: Arc<[GroupInfo]>,
    /// Detail mode: the per-layer partials, computed or being computed.
    pub detail: Option<Arc<DetailValues>>,
}

/// One layer entry of a worker in detail mode: its group and heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DetailEntry {
    /// The group the entry belongs to.
    pub group_id: u32,
    /// Model-wide layer number.
    pub layer_number: u32,
    /// Global number of the first head.
    pub first_head: u32,
    /// Heads covered.
    pub num_heads: u32,
    /// The column the heads belong to.
    pub replica: ReplicaKey,
}

/// Detail mode's values: one call over the "shadow" layout in which each
/// layer entry is its own group (`entries[g]` is shadow group `g`), whose
/// values may still be on a device.
pub struct DetailValues {
    /// The shadow call's shape.
    pub shape: Shape,
    /// Per shadow group id, the layer entry it stands for.
    pub entries: Arc<[DetailEntry]>,
    /// The shadow call's values.
    pub values: Values,
}

impl std::fmt::Debug for DetailValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DetailValues")
            .field("entries", &self.entries.len())
            .finish_non_exhaustive()
    }
}

impl DetailValues {
    /// Whether the values are ready, without blocking.
    pub fn is_ready(&self) -> Result<bool> {
        self.values.is_ready()
    }

    /// Blocks until the values are ready.
    pub fn wait(&self) -> Result<()> {
        self.values.wait()
    }

    /// Per request of `requests` (the plain call's, in order), per computed
    /// group in order, its layer partials sorted by layer and first head.
    /// `NotReady` while a device computes.
    pub fn partials(&self, requests: &[RequestChecksums]) -> Result<Vec<RequestLayers>> {
        let values = self.values.get()?;
        let shadow_requests = self.shape.build();
        Ok(requests
            .iter()
            .zip(&shadow_requests)
            .map(|(request, shadow_request)| {
                let groups = request
                    .groups
                    .iter()
                    .map(|group| {
                        let mut layers: Vec<LayerPartial> = shadow_request
                            .groups
                            .iter()
                            .filter_map(|shadow| {
                                let entry = self.entries[shadow.group_id as usize];
                                // A shadow group has one column, or none where
                                // the role does not compute its replica.
                                if entry.group_id != group.group_id || shadow.columns.is_empty() {
                                    return None;
                                }
                                let start = shadow.values_offset;
                                Some(LayerPartial {
                                    layer_number: entry.layer_number,
                                    first_head: entry.first_head,
                                    num_heads: entry.num_heads,
                                    replica: entry.replica,
                                    values: values[start..start + shadow.num_positions].to_vec(),
                                })
                            })
                            .collect();
                        layers.sort_by_key(|l| (l.layer_number, l.first_head));
                        layers
                    })
                    .collect();
                RequestLayers { groups }
            })
            .collect())
    }
}

/// One group's partial checksums of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupChecksums {
    /// The group.
    pub group_id: u32,
    /// Position of the first value.
    pub first_position: u64,
    /// Values per column.
    pub num_positions: usize,
    /// Replica keys of the columns, sorted (shared with the layout).
    pub columns: Arc<[ReplicaKey]>,
    /// Index of column 0, position 0 in the value array; column `c` follows
    /// at `values_offset + c * num_positions`.
    pub values_offset: usize,
    /// A producer call where the group holds the request's last token:
    /// the index of column 0's value of that position over `num_tokens -
    /// 1` tokens (SPEC section 9's `short_last`); column `c`'s at `+ c`.
    pub short_last: Option<usize>,
}

/// A group this worker does not checksum, and why (SPEC section 7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedGroup {
    /// The group.
    pub group_id: u32,
    /// The worker's reason.
    pub reason: String,
}

/// One request's partial checksums.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestChecksums {
    /// Caller's request id.
    pub req_id: String,
    /// Tokens whose KV the blocks hold.
    pub num_tokens: u64,
    /// Groups checksummed, in the order the block set gave them.
    pub groups: Vec<GroupChecksums>,
    /// Groups of the request this worker skipped.
    pub skipped: Vec<SkippedGroup>,
}

/// Values that a device computes and that become readable later.
pub trait PendingValues: Send + Sync {
    /// Whether the values are ready, without blocking.
    fn is_ready(&self) -> Result<bool>;
    /// Blocks until the values are ready.
    fn wait(&self) -> Result<()>;
    /// The values; only called once ready.
    fn values(&self) -> &[u64];
    /// A load check's stored values gathered with the values (see
    /// [`StoredValues::Gathered`]); only called once ready.
    fn gathered(&self) -> &[u64] {
        &[]
    }
}

/// Where the values of a result are.
pub enum Values {
    /// Computed (host engine).
    Ready(Vec<u64>),
    /// Queued on a device.
    Pending(Box<dyn PendingValues>),
}

impl Values {
    /// Whether the values are ready, without blocking.
    pub fn is_ready(&self) -> Result<bool> {
        match self {
            Values::Ready(_) => Ok(true),
            Values::Pending(pending) => pending.is_ready(),
        }
    }

    /// Blocks until the values are ready.
    pub fn wait(&self) -> Result<()> {
        match self {
            Values::Ready(_) => Ok(()),
            Values::Pending(pending) => pending.wait(),
        }
    }

    /// The values once ready; `NotReady` while a device computes them.
    pub fn get(&self) -> Result<&[u64]> {
        match self {
            Values::Ready(values) => Ok(values),
            Values::Pending(pending) => {
                if pending.is_ready()? {
                    Ok(pending.values())
                } else {
                    Err(err!(NotReady, "the result is still being computed on the device"))
                }
            }
        }
    }

    /// A load check's gathered stored values once ready (none on the host
    /// engine); `NotReady` while a device gathers them.
    pub fn gathered(&self) -> Result<&[u64]> {
        match self {
            Values::Ready(_) => Ok(&[]),
            Values::Pending(pending) => {
                if pending.is_ready()? {
                    Ok(pending.gathered())
                } else {
                    Err(err!(NotReady, "the result is still being computed on the device"))
                }
            }
        }
    }
}

/// Where one (request, group) of a block set went in a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Computed: the group's slot on the worker and its values' offset.
    Computed {
        /// [`crate::inputs::layout::Group::slot`].
        slot: u32,
        /// Index of column 0, position 0 in the value array.
        values_offset: usize,
        /// Whether the group's short last values follow its columns
        /// ([`GroupChecksums::short_last`]).
        short_last: bool,
    },
    /// Skipped by the worker: index into [`Shape::skipped`].
    Skipped {
        /// Which skipped group.
        index: u32,
    },
}

/// The shape of a result in the compact form a call builds: the block set's
/// requests (shared, not copied) and where each (request, group) went. The
/// per-request form ([`RequestChecksums`]) is built from it on first use,
/// off the checksum call's path.
#[derive(Debug, Clone)]
pub struct Shape {
    /// The block set's requests.
    pub requests: Arc<Vec<RequestBlocks>>,
    /// Per (request, group), in block-set order.
    pub placements: Vec<Placement>,
    /// Sorted replica keys of each group's columns, by group slot.
    pub columns: Vec<Arc<[ReplicaKey]>>,
    /// The worker's skipped groups.
    pub skipped: Vec<SkippedGroup>,
}

impl Shape {
    /// The per-request form of the shape.
    pub(crate) fn build(&self) -> Vec<RequestChecksums> {
        let mut placements = self.placements.iter();
        self.requests
            .iter()
            .map(|request| {
                let mut groups = Vec::with_capacity(request.groups.len());
                let mut skipped = Vec::new();
                for blocks in &request.groups {
                    match *placements.next().expect("one placement per (request, group)") {
                        Placement::Computed {
                            slot,
                            values_offset,
                            short_last,
                        } => {
                            let columns = self.columns[slot as usize].clone();
                            let num_positions = blocks.block_ids.len();
                            groups.push(GroupChecksums {
                                group_id: blocks.group_id,
                                first_position: blocks.first_position,
                                num_positions,
                                short_last: short_last.then_some(values_offset + columns.len() * num_positions),
                                columns,
                                values_offset,
                            })
                        }
                        Placement::Skipped { index } => skipped.push(self.skipped[index as usize].clone()),
                    }
                }
                RequestChecksums {
                    req_id: request.req_id.clone(),
                    num_tokens: request.num_tokens,
                    groups,
                    skipped,
                }
            })
            .collect()
    }
}

/// Where a (request, group) is in [`Checksums::requests`].
#[derive(Debug, Clone, Copy)]
enum GroupIndex {
    /// `groups[i]` of the request.
    Computed(usize),
    /// `skipped[i]` of the request.
    Skipped(usize),
}

/// Maps from ids to places in the per-request form, so that a lookup costs
/// the same however many requests and groups a result holds.
#[derive(Debug, Default)]
struct Lookup {
    requests: HashMap<String, usize>,
    groups: HashMap<(usize, u32), GroupIndex>,
}

impl Lookup {
    fn of(requests: &[RequestChecksums]) -> Lookup {
        let mut lookup = Lookup::default();
        for (index, request) in requests.iter().enumerate() {
            lookup.requests.entry(request.req_id.clone()).or_insert(index);
            for (g, group) in request.groups.iter().enumerate() {
                lookup
                    .groups
                    .entry((index, group.group_id))
                    .or_insert(GroupIndex::Computed(g));
            }
            for (s, skipped) in request.skipped.iter().enumerate() {
                lookup
                    .groups
                    .entry((index, skipped.group_id))
                    .or_insert(GroupIndex::Skipped(s));
            }
        }
        lookup
    }
}

/// A worker's partial checksums of one `checksum` call.
pub struct Checksums {
    shape: Shape,
    requests: OnceLock<Vec<RequestChecksums>>,
    lookup: OnceLock<Lookup>,
    values: Values,
    /// The worker's rank, role and group facts at checksum time, for its record.
    record_info: Option<RecordInfo>,
    /// A load check's stored values (SPEC section 8), when the call was one.
    stored: Option<LoadCheck>,
}

/// A load check's expectations: per request id, per group id.
type StoredSums = HashMap<String, HashMap<u32, StoredExpectation>>;

/// A load check's expectations and where its stored values read back are.
struct LoadCheck {
    expected: StoredSums,
    values: StoredValues,
}

/// Where a load check's expected sum at one block position comes from:
/// the entry read back at `index` (of the call's [`StoredValues`], two
/// words each: value and stamp), read for the block hash `block_hash` and
/// `tokens` ([`crate::base::stored_entry::EntryReader::judge`]); the worker's
/// columns must add up to its value XOR `tag`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredRef {
    /// Index of the position's stored value among those read back.
    pub index: usize,
    /// The block's tag (SPEC section 8).
    pub tag: u64,
    /// The block's hash (its first 8 bytes, little-endian).
    pub block_hash: u64,
    /// The valid tokens the position's entry counts (0 in a state group).
    pub tokens: u32,
}

/// Where a load check's stored values read back are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredValues {
    /// Read by the host when the call was made (host engine).
    Read(Vec<u64>),
    /// Gathered on the device with the call's values, readable once they are
    /// ([`PendingValues::gathered`]).
    Gathered,
}

/// One (request, group) of a load check: per block position where its
/// expected sum comes from (`None` where the position holds no valid token
/// and is not checked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredExpectation {
    /// The request.
    pub req_id: String,
    /// The group.
    pub group_id: u32,
    /// One per block position of the group in the request.
    pub expected: Vec<Option<StoredRef>>,
    /// How entries of the worker's configuration for the group read.
    pub reader: Arc<EntryReader>,
}

impl Checksums {
    /// A result of the given shape and values.
    pub(crate) fn new(shape: Shape, values: Values) -> Self {
        Checksums {
            shape,
            requests: OnceLock::new(),
            lookup: OnceLock::new(),
            values,
            record_info: None,
            stored: None,
        }
    }

    /// The same result, carrying what its worker record needs (set by `Worker::checksum`).
    pub(crate) fn with_record_info(mut self, info: RecordInfo) -> Self {
        self.record_info = Some(info);
        self
    }

    /// The same result, carrying a load check's expectations and where its
    /// stored values read back are.
    pub fn with_stored(mut self, stored: Vec<StoredExpectation>, values: StoredValues) -> Self {
        let mut by_request = StoredSums::new();
        for expectation in stored {
            by_request
                .entry(expectation.req_id.clone())
                .or_default()
                .insert(expectation.group_id, expectation);
        }
        self.stored = Some(LoadCheck {
            expected: by_request,
            values,
        });
        self
    }

    /// Whether the result is a load check's (`Worker::check_stored`).
    pub fn is_load_check(&self) -> bool {
        self.stored.is_some()
    }

    /// A load check's verdicts on `group_id` of `req_id`, one per block
    /// position: whether the recomputed sum of the worker's columns equals
    /// the stored checksum. `NotFound` when the result is no load check's or
    /// the group is not in it; `NotReady` while a device computes.
    pub fn stored_outcomes(&self, req_id: &str, group_id: u32) -> Result<Vec<StoredOutcome>> {
        let stored = self.stored.as_ref().ok_or_else(|| {
            err!(
                NotFound,
                "this result is not a load check's (kvcs_worker_check_stored makes those)"
            )
        })?;
        let expectation = stored
            .expected
            .get(req_id)
            .and_then(|groups| groups.get(&group_id))
            .ok_or_else(|| {
                err!(
                    NotFound,
                    "group_id {group_id} of req_id \"{req_id}\" was not checked against stored checksums"
                )
            })?;
        let sums = self.position_sums(req_id, group_id)?;
        let read = match &stored.values {
            StoredValues::Read(values) => values.as_slice(),
            StoredValues::Gathered => self.values.gathered()?,
        };
        let reader = &expectation.reader;
        expectation
            .expected
            .iter()
            .zip(sums)
            .map(|(expected, sum)| {
                let Some(StoredRef {
                    index,
                    tag,
                    block_hash,
                    tokens,
                }) = *expected
                else {
                    return Ok(StoredOutcome::NotChecked);
                };
                let (Some(&value), Some(&stamp)) = (read.get(2 * index), read.get(2 * index + 1)) else {
                    return Err(err!(
                        Internal,
                        "stored value {index} of group_id {group_id} of req_id \"{req_id}\" was not read back ({} words were)",
                        read.len()
                    ));
                };
                Ok(reader.judge(block_hash, tag, tokens, sum, (value, stamp)))
            })
            .collect()
    }

    /// Per block position of `group_id` in `req_id`, the sum of the worker's
    /// columns: its partial checksum over every head it holds.
    pub fn position_sums(&self, req_id: &str, group_id: u32) -> Result<Vec<u64>> {
        let group = self.group(req_id, group_id)?;
        let values = self.values()?;
        let mut sums = vec![0u64; group.num_positions];
        for column in 0..group.columns.len() {
            let start = group.values_offset + column * group.num_positions;
            for (sum, value) in sums.iter_mut().zip(&values[start..start + group.num_positions]) {
                *sum = sum.wrapping_add(*value);
            }
        }
        Ok(sums)
    }

    /// The block set's request `req_id` and its group `group_id` as the
    /// call was given them (with block hashes, where set); `NotFound` as
    /// [`Checksums::group`].
    pub(crate) fn given_blocks(&self, req_id: &str, group_id: u32) -> Result<(&RequestBlocks, &GroupBlocks)> {
        self.group(req_id, group_id)?;
        let index = self
            .lookup
            .get()
            .and_then(|lookup| lookup.requests.get(req_id))
            .copied();
        let request = index.and_then(|i| self.shape.requests.get(i)).ok_or_else(|| {
            err!(
                Internal,
                "req_id \"{req_id}\" is in the result but not in its block set"
            )
        })?;
        let blocks = request.groups.iter().find(|g| g.group_id == group_id).ok_or_else(|| {
            err!(
                Internal,
                "group_id {group_id} of req_id \"{req_id}\" is in the result but not in its block set"
            )
        })?;
        Ok((request, blocks))
    }

    /// What the worker record needs besides the values, if set.
    pub(crate) fn record_info(&self) -> Option<&RecordInfo> {
        self.record_info.as_ref()
    }

    /// Whether the values can be read, without blocking.
    pub fn is_ready(&self) -> Result<bool> {
        let detail_ready = match self.record_info.as_ref().and_then(|info| info.detail.as_ref()) {
            Some(detail) => detail.is_ready()?,
            None => true,
        };
        Ok(detail_ready && self.values.is_ready()?)
    }

    /// Blocks until the values (and detail mode's) can be read.
    pub fn wait(&self) -> Result<()> {
        self.values.wait()?;
        if let Some(detail) = self.record_info.as_ref().and_then(|info| info.detail.as_ref()) {
            detail.wait()?;
        }
        Ok(())
    }

    /// The requests, in block-set order.
    pub fn requests(&self) -> &[RequestChecksums] {
        self.requests.get_or_init(|| self.shape.build())
    }

    /// The checksums of `group_id` in `req_id`.
    pub fn group(&self, req_id: &str, group_id: u32) -> Result<&GroupChecksums> {
        let requests = self.requests();
        let lookup = self.lookup.get_or_init(|| Lookup::of(requests));
        let index = *lookup
            .requests
            .get(req_id)
            .ok_or_else(|| err!(NotFound, "req_id \"{req_id}\" is not in this result"))?;
        let request = &requests[index];
        match lookup.groups.get(&(index, group_id)) {
            Some(&GroupIndex::Computed(g)) => Ok(&request.groups[g]),
            Some(&GroupIndex::Skipped(s)) => Err(err!(
                NotFound,
                "group_id {group_id} of req_id \"{req_id}\" was skipped by this worker: {}",
                request.skipped[s].reason
            )),
            None => Err(err!(
                NotFound,
                "group_id {group_id} is not in req_id \"{req_id}\" of this result"
            )),
        }
    }

    /// Column `column` of `group_id` in `req_id`: its replica key and values.
    /// Fails with `NotReady` while a device is still computing.
    pub fn column(&self, req_id: &str, group_id: u32, column: usize) -> Result<(ReplicaKey, &[u64])> {
        let group = self.group(req_id, group_id)?;
        let key = *group.columns.get(column).ok_or_else(|| {
            err!(
                OutOfBounds,
                "column {column} is not below num_columns {} (req_id \"{req_id}\", group_id {group_id})",
                group.columns.len()
            )
        })?;
        let values = self.values()?;
        let start = group.values_offset + column * group.num_positions;
        Ok((key, &values[start..start + group.num_positions]))
    }

    /// All values, once ready.
    pub fn values(&self) -> Result<&[u64]> {
        self.values.get()
    }
}
