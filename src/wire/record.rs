//! Worker records: what one worker's `checksum` call gives the verifier,
//! usually in another process, as versioned, self-describing bytes.
//!
//! A record says who the worker is (its TP rank and size, its PP stage), the
//! role it computed in, the algorithm it computed with (SPEC section 12), what it knows of each registered group (block size,
//! fingerprint of SPEC section 7, whether its checksums are shard-keyed
//! state of SPEC section 6), and per request: the token count, per group the
//! first position, the number of positions and one column of partial
//! checksums per replica key, the groups it skipped and why, in detail
//! mode the per-layer partial checksums, and for a load check (SPEC section
//! 8, `Worker::check_stored`) the verdict on each block position's stored
//! checksum.
//!
//! # Encoding
//!
//! A versioned msgpack array; [docs/SPEC.md section
//! 17](../../docs/SPEC.md#17-worker-records) is its definition (every
//! element, what each version lacks, which versions are read), so it is not
//! repeated here. [`RECORD_VERSION`] is the version written. Each part of
//! a record has a writer and a reader beside it in this file, in encoding
//! order, so [`Record::decode`] reads what [`Record::encode`] writes, part
//! for part.
//!
//! [`Record::decode`] accepts exactly that shape in versions 4 to 7 and validates
//! every value (ranks, keys, orders, lengths, uniqueness); anything else is
//! `Error::Malformed` with a message naming the field and byte offset.

use std::collections::HashSet;

use crate::base::checksum::{piece_bytes_of, Algorithm, KNOWN_ALGORITHMS, MAX_KV_HEADS_PER_LAYER};
use crate::base::error::{err, Result};
use crate::base::msgpack::{initial_capacity, Reader, Writer};
use crate::inputs::decoding::{LayerDecoding, LayerGeometry};
use crate::inputs::layout::ReplicaKey;
use crate::inputs::placement::GroupPlacement;
use crate::inputs::role::Role;
pub use crate::results::checksums::LayerPartial;
use crate::results::checksums::{Checksums, SkippedGroup, StoredOutcome};
pub use crate::results::record_facts::{GroupInfo, Rank};

/// The first element of every record.
pub const RECORD_MAGIC: &str = "kvcsum.record";

/// The record encoding this library writes and reads; it also reads
/// versions 4 to 6 (kvcsum 0.3.0's development builds: no `short_last`,
/// no geometry; no placement).
pub const RECORD_VERSION: u64 = 7;

/// One column of a group in a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Its replica key.
    pub replica: ReplicaKey,
    /// One partial checksum per block position.
    pub values: Vec<u64>,
}

/// One group of one request in a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordGroup {
    /// The group.
    pub group_id: u32,
    /// Position of the first value.
    pub first_position: u64,
    /// Block positions checksummed (values per column).
    pub num_positions: u64,
    /// Columns, sorted by replica key.
    pub columns: Vec<Column>,
    /// Detail mode: the worker's layer partials, sorted by (layer, first head,
    /// replica key); empty otherwise.
    pub layers: Vec<LayerPartial>,
    /// A load check's verdict on each block position's stored checksum (SPEC
    /// section 8), `num_positions` of them; `None` for any other call.
    pub stored: Option<Vec<StoredOutcome>>,
    /// A producer's call where the group holds the request's last token:
    /// per column, in column order, the value of that last position over
    /// `num_tokens - 1` tokens (SPEC section 9); `None` otherwise.
    pub short_last: Option<Vec<u64>>,
}

/// One request in a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordRequest {
    /// Caller's request id.
    pub req_id: String,
    /// Tokens whose KV the blocks hold.
    pub num_tokens: u64,
    /// Groups checksummed.
    pub groups: Vec<RecordGroup>,
    /// Groups this worker skipped, with its reasons.
    pub skipped: Vec<SkippedGroup>,
}

/// A worker's record: its place, its groups and its partial checksums.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The worker's place.
    pub rank: Rank,
    /// The role the values were computed in.
    pub role: Role,
    /// Whether layer partials are included.
    pub detail: bool,
    /// The algorithm every value was computed with (SPEC section 12).
    pub algorithm: Algorithm,
    /// Every group the worker registered, sorted by id.
    pub groups: Vec<GroupInfo>,
    /// The requests of the call.
    pub requests: Vec<RecordRequest>,
}

impl Record {
    /// The record of a result made by `Worker::checksum`; `NotReady` while a
    /// device is still computing it.
    pub fn from_checksums(checksums: &Checksums) -> Result<Record> {
        let info = checksums.record_info().ok_or_else(|| {
            err!(
                InvalidArgument,
                "the result carries no worker record information (it was not made by a worker's checksum call)"
            )
        })?;
        let values = checksums.values()?;
        let partials = match &info.detail {
            Some(detail) => Some(detail.partials(checksums.requests())?),
            None => None,
        };
        let mut requests = Vec::with_capacity(checksums.requests().len());
        for (request_index, request) in checksums.requests().iter().enumerate() {
            let detail = partials.as_ref().and_then(|d| d.get(request_index));
            let mut groups = Vec::with_capacity(request.groups.len());
            for (group_index, group) in request.groups.iter().enumerate() {
                let columns = group
                    .columns
                    .iter()
                    .enumerate()
                    .map(|(column, &replica)| {
                        let start = group.values_offset + column * group.num_positions;
                        Column {
                            replica,
                            values: values[start..start + group.num_positions].to_vec(),
                        }
                    })
                    .collect();
                let layers = detail
                    .and_then(|d| d.groups.get(group_index))
                    .cloned()
                    .unwrap_or_default();
                let stored = if checksums.is_load_check() {
                    Some(checksums.stored_outcomes(&request.req_id, group.group_id)?)
                } else {
                    None
                };
                let short_last = group
                    .short_last
                    .map(|start| values[start..start + group.columns.len()].to_vec());
                groups.push(RecordGroup {
                    group_id: group.group_id,
                    first_position: group.first_position,
                    num_positions: group.num_positions as u64,
                    columns,
                    layers,
                    stored,
                    short_last,
                });
            }
            requests.push(RecordRequest {
                req_id: request.req_id.clone(),
                num_tokens: request.num_tokens,
                groups,
                skipped: request.skipped.clone(),
            });
        }
        let record = Record {
            rank: info.rank,
            role: info.role,
            detail: info.detail.is_some(),
            algorithm: info.algorithm,
            groups: info.groups.to_vec(),
            requests,
        };
        record
            .validate()
            .map_err(|e| err!(Internal, "a worker's own record does not validate: {e}"))?;
        Ok(record)
    }

    /// The record's bytes (see the module documentation). Each part has
    /// its writer here and its reader, in the same order, in [`Record::decode`].
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.array(8);
        w.str(RECORD_MAGIC);
        w.uint(RECORD_VERSION);
        write_rank(&mut w, self.rank);
        w.uint(role_code(self.role));
        w.bool(self.detail);
        w.array(self.groups.len());
        for group in &self.groups {
            write_group_info(&mut w, group);
        }
        w.array(self.requests.len());
        for request in &self.requests {
            write_request(&mut w, request);
        }
        w.uint(self.algorithm.code().into());
        w.into_bytes()
    }

    /// Decodes and validates a record; `Error::Malformed` with a message for
    /// anything but a valid record of version 7 (or 6, 5 or 4). Allocates at most in proportion
    /// to `bytes.len()`. Each part is read by the reader paired with its
    /// writer in [`Record::encode`]; `version` picks the parts a version has.
    pub fn decode(bytes: &[u8]) -> Result<Record> {
        let mut r = Reader::new(bytes, "record");
        r.array_of("the record", 8)?;
        let version = read_magic_and_version(&mut r)?;
        let rank = read_rank(&mut r)?;
        let role = read_role(&mut r)?;
        let detail = r.bool("detail")?;
        let num_groups = r.array("groups")?;
        let mut groups = Vec::with_capacity(initial_capacity(num_groups));
        for _ in 0..num_groups {
            groups.push(read_group_info(&mut r, version)?);
        }
        let num_requests = r.array("requests")?;
        let mut requests = Vec::with_capacity(initial_capacity(num_requests));
        for _ in 0..num_requests {
            requests.push(read_request(&mut r, version)?);
        }
        let algorithm = read_algorithm(&mut r)?;
        r.finish()?;
        let record = Record {
            rank,
            role,
            detail,
            algorithm,
            groups,
            requests,
        };
        record.validate()?;
        Ok(record)
    }

    /// Checks everything the encoding cannot express: ranks, keys, orders,
    /// lengths, uniqueness. `Error::Malformed` naming the first problem.
    pub fn validate(&self) -> Result<()> {
        let rank = self.rank;
        if rank.tp_size == 0 || rank.tp_rank >= rank.tp_size {
            return Err(err!(
                Malformed,
                "record: tp_rank {} is not below tp_size {}",
                rank.tp_rank,
                rank.tp_size
            ));
        }
        for pair in self.groups.windows(2) {
            if pair[0].group_id >= pair[1].group_id {
                return Err(err!(
                    Malformed,
                    "record: group {} follows group {}: groups must be sorted by id and distinct",
                    pair[1].group_id,
                    pair[0].group_id
                ));
            }
        }
        if let Some(group) = self.groups.iter().find(|g| g.block_size == 0) {
            return Err(err!(Malformed, "record: group {} has block_size 0", group.group_id));
        }
        for group in &self.groups {
            let place = format!("group {} coverage", group.group_id);
            for (key, _) in &group.coverage {
                check_key(*key, &place)?;
            }
            if group.coverage.windows(2).any(|pair| pair[0].0 >= pair[1].0) {
                return Err(err!(
                    Malformed,
                    "record: {place}: replica keys are out of order or repeated"
                ));
            }
            check_decodings(&group.decodings, &format!("record: group {}", group.group_id))?;
            check_geometry(&group.geometry, &format!("record: group {}", group.group_id))?;
            group
                .placement
                .check(group.group_id, group.block_size)
                .map_err(|e| err!(Malformed, "record: {e}"))?;
            if group.state && !group.placement.is_default() {
                return Err(err!(
                    Malformed,
                    "record: state group {} has a placement (state groups have none)",
                    group.group_id
                ));
            }
        }
        let mut req_ids = HashSet::with_capacity(self.requests.len());
        let mut load_check: Option<(&str, u32, bool)> = None;
        for request in &self.requests {
            let req_id = &request.req_id;
            if req_id.is_empty() {
                return Err(err!(Malformed, "record: a request has an empty req_id"));
            }
            if !req_ids.insert(req_id.as_str()) {
                return Err(err!(Malformed, "record: req_id {req_id:?} appears twice"));
            }
            let mut seen = HashSet::with_capacity(request.groups.len() + request.skipped.len());
            for group in &request.groups {
                self.validate_group(req_id, group)?;
                // A load check judges every group it computes; no other call any.
                let checked = group.stored.is_some();
                match load_check {
                    Some((first_req, first_group, first_checked)) if first_checked != checked => {
                        return Err(err!(
                            Malformed,
                            "record: group {} of req_id {req_id:?} {} stored outcomes, group {first_group} of req_id {first_req:?} {}",
                            group.group_id,
                            if checked { "has" } else { "has no" },
                            if first_checked { "has" } else { "has none" }
                        ));
                    }
                    Some(_) => {}
                    None => load_check = Some((req_id, group.group_id, checked)),
                }
                if !seen.insert(group.group_id) {
                    return Err(err!(
                        Malformed,
                        "record: group {} appears twice in req_id {req_id:?}",
                        group.group_id
                    ));
                }
            }
            for skipped in &request.skipped {
                if skipped.reason.is_empty() {
                    return Err(err!(
                        Malformed,
                        "record: skipped group {} of req_id {req_id:?} has an empty reason",
                        skipped.group_id
                    ));
                }
                if !seen.insert(skipped.group_id) {
                    return Err(err!(
                        Malformed,
                        "record: group {} of req_id {req_id:?} is listed twice (checksummed or skipped)",
                        skipped.group_id
                    ));
                }
            }
        }
        Ok(())
    }

    fn validate_group(&self, req_id: &str, group: &RecordGroup) -> Result<()> {
        let group_id = group.group_id;
        let place = format!("group {group_id} of req_id {req_id:?}");
        if self.group_info(group_id).is_none() {
            return Err(err!(
                Malformed,
                "record: {place} is not among the record's registered groups"
            ));
        }
        if group.first_position.checked_add(group.num_positions).is_none() {
            return Err(err!(
                Malformed,
                "record: {place}: first_position {} + num_positions {} overflows",
                group.first_position,
                group.num_positions
            ));
        }
        let mut previous: Option<ReplicaKey> = None;
        for column in &group.columns {
            let key = column.replica;
            check_key(key, &place)?;
            if !key.computed_in(self.role) {
                return Err(err!(
                    Malformed,
                    "record: {place}: a producer record has a column of replica_index {}",
                    key.replica_index
                ));
            }
            if previous.is_some_and(|p| p >= key) {
                return Err(err!(
                    Malformed,
                    "record: {place}: column ({}, {}) is out of order or repeated",
                    key.replicas,
                    key.replica_index
                ));
            }
            previous = Some(key);
            if column.values.len() as u64 != group.num_positions {
                return Err(err!(
                    Malformed,
                    "record: {place}: column ({}, {}) has {} values for num_positions {}",
                    key.replicas,
                    key.replica_index,
                    column.values.len(),
                    group.num_positions
                ));
            }
        }
        if let Some(stored) = &group.stored {
            if self.role != Role::Consumer {
                return Err(err!(
                    Malformed,
                    "record: {place} has stored outcomes in a producer record (load checks compute as consumers)"
                ));
            }
            if stored.len() as u64 != group.num_positions {
                return Err(err!(
                    Malformed,
                    "record: {place}: {} stored outcomes for num_positions {}",
                    stored.len(),
                    group.num_positions
                ));
            }
        }
        if let Some(short_last) = &group.short_last {
            if self.role != Role::Producer {
                return Err(err!(
                    Malformed,
                    "record: {place} has short last values in a consumer record (only producers compute them)"
                ));
            }
            if short_last.len() != group.columns.len() {
                return Err(err!(
                    Malformed,
                    "record: {place}: {} short last values for {} columns",
                    short_last.len(),
                    group.columns.len()
                ));
            }
        }
        if !self.detail && !group.layers.is_empty() {
            return Err(err!(
                Malformed,
                "record: {place} has layer values but the record is not in detail mode"
            ));
        }
        for layer in &group.layers {
            let what = format!("{place}, layer {} heads from {}", layer.layer_number, layer.first_head);
            check_key(layer.replica, &what)?;
            if !layer.replica.computed_in(self.role) {
                return Err(err!(
                    Malformed,
                    "record: {what}: a producer record has replica_index {}",
                    layer.replica.replica_index
                ));
            }
            // Columns are sorted by key (checked above).
            if group
                .columns
                .binary_search_by_key(&layer.replica, |c| c.replica)
                .is_err()
            {
                return Err(err!(Malformed, "record: {what}: no column has its replica key"));
            }
        }
        check_layer_partials(&group.layers, group.num_positions, &format!("record: {place}"))?;
        Ok(())
    }

    /// What the record says of group `group_id`, if it is registered.
    pub fn group_info(&self, group_id: u32) -> Option<&GroupInfo> {
        self.groups
            .binary_search_by_key(&group_id, |g| g.group_id)
            .ok()
            .map(|i| &self.groups[i])
    }
}

// The parts of a record, each writer beside its reader, in encoding order.

/// The magic and the version; the version is one this library reads.
fn read_magic_and_version(r: &mut Reader<'_>) -> Result<u64> {
    let at = r.position();
    let magic = r.str("the record's first element")?;
    if magic != RECORD_MAGIC {
        return Err(err!(
            Malformed,
            "record: byte {at}: the first element is {magic:?}, not {RECORD_MAGIC:?} (not a kvcsum record)"
        ));
    }
    let at = r.position();
    let version = r.uint("version")?;
    if !(4..=RECORD_VERSION).contains(&version) {
        return Err(err!(
            Malformed,
            "record: byte {at}: version {version} is not supported (this library reads versions 4 to {RECORD_VERSION})"
        ));
    }
    Ok(version)
}

fn write_rank(w: &mut Writer, rank: Rank) {
    w.array(3);
    w.uint(rank.tp_rank as u64);
    w.uint(rank.tp_size as u64);
    w.uint(rank.pp_rank as u64);
}

fn read_rank(r: &mut Reader<'_>) -> Result<Rank> {
    r.array_of("rank", 3)?;
    Ok(Rank {
        tp_rank: r.u32("tp_rank")?,
        tp_size: r.u32("tp_size")?,
        pp_rank: r.u32("pp_rank")?,
    })
}

fn role_code(role: Role) -> u64 {
    role.code().into()
}

fn read_role(r: &mut Reader<'_>) -> Result<Role> {
    let at = r.position();
    let code = r.uint("role")?;
    Role::from_code(code).ok_or_else(|| {
        err!(
            Malformed,
            "record: byte {at}: role {code} is neither 0 (producer) nor 1 (consumer)"
        )
    })
}

/// A registered group's facts: 11 elements (10 in version 6, without the
/// placement; 9 before, without the geometry).
fn write_group_info(w: &mut Writer, group: &GroupInfo) {
    w.array(11);
    w.uint(group.group_id as u64);
    w.uint(group.block_size as u64);
    w.uint(group.fingerprint);
    w.uint(group.marks);
    w.bool(group.shard_keyed);
    w.bool(group.holds_caches);
    w.bool(group.state);
    w.array(group.coverage.len());
    for (key, coverage) in &group.coverage {
        w.array(3);
        w.uint(key.replicas as u64);
        w.uint(key.replica_index as u64);
        w.uint(*coverage);
    }
    write_decodings(w, &group.decodings);
    write_geometry(w, &group.geometry);
    let placement = &group.placement;
    w.array(4);
    for word in [
        placement.dcp_size,
        placement.dcp_rank,
        placement.interleave,
        placement.tokens_per_slot,
    ] {
        w.uint(word as u64);
    }
}

fn read_group_info(r: &mut Reader<'_>, version: u64) -> Result<GroupInfo> {
    r.array_of(
        "a group",
        match version {
            7.. => 11,
            6 => 10,
            _ => 9,
        },
    )?;
    let group_id = r.u32("group_id")?;
    let block_size = r.u32("block_size")?;
    let fingerprint = r.uint("fingerprint")?;
    let marks = r.uint("marks")?;
    let shard_keyed = r.bool("shard_keyed")?;
    let holds_caches = r.bool("holds_caches")?;
    let state = r.bool("state")?;
    let num_keys = r.array("coverage")?;
    let mut coverage = Vec::with_capacity(initial_capacity(num_keys));
    for _ in 0..num_keys {
        r.array_of("a coverage entry", 3)?;
        let key = ReplicaKey {
            replicas: r.u32("replicas")?,
            replica_index: r.u32("replica_index")?,
        };
        coverage.push((key, r.uint("coverage")?));
    }
    let decodings = read_decodings(r, "record")?;
    let geometry = if version >= 6 { read_geometry(r)? } else { Vec::new() };
    let placement = if version >= 7 {
        r.array_of("a placement", 4)?;
        GroupPlacement {
            dcp_size: r.u32("dcp_size")?,
            dcp_rank: r.u32("dcp_rank")?,
            interleave: r.u32("interleave")?,
            tokens_per_slot: r.u32("tokens_per_slot")?,
        }
    } else {
        GroupPlacement::DEFAULT
    };
    Ok(GroupInfo {
        group_id,
        block_size,
        fingerprint,
        marks,
        shard_keyed,
        holds_caches,
        state,
        coverage,
        decodings,
        geometry,
        placement,
    })
}

/// A request: its id, token count, groups and skipped groups.
fn write_request(w: &mut Writer, request: &RecordRequest) {
    w.array(4);
    w.str(&request.req_id);
    w.uint(request.num_tokens);
    w.array(request.groups.len());
    for group in &request.groups {
        write_request_group(w, group);
    }
    w.array(request.skipped.len());
    for skipped in &request.skipped {
        w.array(2);
        w.uint(skipped.group_id as u64);
        w.str(&skipped.reason);
    }
}

fn read_request(r: &mut Reader<'_>, version: u64) -> Result<RecordRequest> {
    r.array_of("a request", 4)?;
    let req_id = r.str("req_id")?.to_owned();
    let num_tokens = r.uint("num_tokens")?;
    let num_request_groups = r.array("the request's groups")?;
    let mut groups = Vec::with_capacity(initial_capacity(num_request_groups));
    for _ in 0..num_request_groups {
        groups.push(read_request_group(r, version)?);
    }
    let num_skipped = r.array("skipped groups")?;
    let mut skipped = Vec::with_capacity(initial_capacity(num_skipped));
    for _ in 0..num_skipped {
        r.array_of("a skipped group", 2)?;
        skipped.push(SkippedGroup {
            group_id: r.u32("group_id")?,
            reason: r.str("reason")?.to_owned(),
        });
    }
    Ok(RecordRequest {
        req_id,
        num_tokens,
        groups,
        skipped,
    })
}

/// A group of a request: 7 elements (6 in version 4, without `short_last`).
fn write_request_group(w: &mut Writer, group: &RecordGroup) {
    w.array(7);
    w.uint(group.group_id as u64);
    w.uint(group.first_position);
    w.uint(group.num_positions);
    w.array(group.columns.len());
    for column in &group.columns {
        w.array(3);
        w.uint(column.replica.replicas as u64);
        w.uint(column.replica.replica_index as u64);
        w.u64s(&column.values);
    }
    w.array(group.layers.len());
    for layer in &group.layers {
        write_layer_partial(w, layer);
    }
    match &group.short_last {
        None => w.nil(),
        Some(values) => w.u64s(values),
    }
    match &group.stored {
        None => w.nil(),
        Some(outcomes) => {
            let codes: Vec<u8> = outcomes.iter().map(|o| o.code()).collect();
            w.bin(&codes);
        }
    }
}

fn read_request_group(r: &mut Reader<'_>, version: u64) -> Result<RecordGroup> {
    r.array_of("a request group", if version == 4 { 6 } else { 7 })?;
    let group_id = r.u32("group_id")?;
    let first_position = r.uint("first_position")?;
    let num_positions = r.uint("num_positions")?;
    let num_columns = r.array("columns")?;
    let mut columns = Vec::with_capacity(initial_capacity(num_columns));
    for _ in 0..num_columns {
        r.array_of("a column", 3)?;
        let replica = ReplicaKey {
            replicas: r.u32("replicas")?,
            replica_index: r.u32("replica_index")?,
        };
        let values = r.u64s("column values")?;
        columns.push(Column { replica, values });
    }
    let num_layers = r.array("layers")?;
    let mut layers = Vec::with_capacity(initial_capacity(num_layers));
    for _ in 0..num_layers {
        layers.push(read_layer_partial(r)?);
    }
    let at = r.position();
    let short_last = match version {
        4 => None,
        _ => match r.nil_or_bin("short_last")? {
            None => None,
            Some(bytes) => Some(short_last_values(bytes, at)?),
        },
    };
    let at = r.position();
    let stored = match r.nil_or_bin("stored outcomes")? {
        None => None,
        Some(codes) => Some(stored_outcomes(codes, at)?),
    };
    Ok(RecordGroup {
        group_id,
        first_position,
        num_positions,
        columns,
        layers,
        stored,
        short_last,
    })
}

/// A layer partial of detail mode.
fn write_layer_partial(w: &mut Writer, layer: &LayerPartial) {
    w.array(6);
    w.uint(layer.layer_number as u64);
    w.uint(layer.first_head as u64);
    w.uint(layer.num_heads as u64);
    w.uint(layer.replica.replicas as u64);
    w.uint(layer.replica.replica_index as u64);
    w.u64s(&layer.values);
}

fn read_layer_partial(r: &mut Reader<'_>) -> Result<LayerPartial> {
    r.array_of("a layer", 6)?;
    Ok(LayerPartial {
        layer_number: r.u32("layer_number")?,
        first_head: r.u32("first_head")?,
        num_heads: r.u32("num_heads")?,
        replica: ReplicaKey {
            replicas: r.u32("replicas")?,
            replica_index: r.u32("replica_index")?,
        },
        values: r.u64s("layer values")?,
    })
}

fn read_algorithm(r: &mut Reader<'_>) -> Result<Algorithm> {
    let at = r.position();
    let code = r.uint("algorithm")?;
    Algorithm::from_code(code).ok_or_else(|| {
        err!(
            Malformed,
            "record: byte {at}: algorithm {code} is not {KNOWN_ALGORITHMS}"
        )
    })
}

/// Writes a group's layer decodings (SPEC section 7): `[[layer_number,
/// dtype, head_size, k_scale, v_scale], ...]`, `""` and `0` where a fact is
/// not declared.
pub(crate) fn write_decodings(w: &mut Writer, decodings: &[(u32, LayerDecoding)]) {
    w.array(decodings.len());
    for (layer_number, decoding) in decodings {
        let (dtype, head_size, k_scale, v_scale) = decoding.parts();
        w.array(5);
        w.uint(*layer_number as u64);
        w.str(dtype);
        w.uint(head_size as u64);
        w.uint(k_scale);
        w.uint(v_scale);
    }
}

/// Reads what [`write_decodings`] writes; a declaration that is not one
/// (a bad name, a scale that is no finite positive number, nothing
/// declared) is `Error::Malformed` naming the byte and `what` (the record
/// or the payload).
pub(crate) fn read_decodings(r: &mut Reader<'_>, what: &str) -> Result<Vec<(u32, LayerDecoding)>> {
    let num_decodings = r.array("decodings")?;
    let mut decodings = Vec::with_capacity(initial_capacity(num_decodings));
    for _ in 0..num_decodings {
        r.array_of("a decoding", 5)?;
        let layer_number = r.u32("layer_number")?;
        let at = r.position();
        let dtype = r.str("dtype")?;
        let head_size = r.u32("head_size")?;
        let k_scale = r.uint("k_scale")?;
        let v_scale = r.uint("v_scale")?;
        let decoding = LayerDecoding::from_parts(dtype, head_size, k_scale, v_scale).map_err(|e| {
            err!(
                Malformed,
                "{what}: byte {at}: the decoding of layer {layer_number}: {e}"
            )
        })?;
        decodings.push((layer_number, decoding));
    }
    Ok(decodings)
}

/// Writes a group's geometry (SPEC section 7): `[[layer_number,
/// first_head, num_heads, cell_bytes, k_bytes], ...]`.
pub(crate) fn write_geometry(w: &mut Writer, geometry: &[LayerGeometry]) {
    w.array(geometry.len());
    for run in geometry {
        w.array(5);
        for word in [
            run.layer_number,
            run.first_head,
            run.num_heads,
            run.cell_bytes,
            run.k_bytes,
        ] {
            w.uint(word as u64);
        }
    }
}

/// Reads what [`write_geometry`] writes.
pub(crate) fn read_geometry(r: &mut Reader<'_>) -> Result<Vec<LayerGeometry>> {
    let num_runs = r.array("geometry")?;
    let mut geometry = Vec::with_capacity(initial_capacity(num_runs));
    for _ in 0..num_runs {
        r.array_of("a geometry run", 5)?;
        geometry.push(LayerGeometry {
            layer_number: r.u32("layer_number")?,
            first_head: r.u32("first_head")?,
            num_heads: r.u32("num_heads")?,
            cell_bytes: r.u32("cell_bytes")?,
            k_bytes: r.u32("k_bytes")?,
        });
    }
    Ok(geometry)
}

/// Geometry runs hold at least one head and none at or past
/// `MAX_KV_HEADS_PER_LAYER`, cells of whole pieces (SPEC section 1: a
/// positive multiple of 8 bytes, or of 4 and not of 8) with K (where
/// known) of whole pieces and shorter than the cell, and are sorted by (layer, first
/// head) without overlap.
pub(crate) fn check_geometry(geometry: &[LayerGeometry], place: &str) -> Result<()> {
    for run in geometry {
        let what = format!(
            "{place}: the geometry of layer {} heads from {}",
            run.layer_number, run.first_head
        );
        if run.num_heads == 0 || run.end() > MAX_KV_HEADS_PER_LAYER {
            return Err(err!(
                Malformed,
                "{what}: num_heads {} is 0 or reaches past head {MAX_KV_HEADS_PER_LAYER}",
                run.num_heads
            ));
        }
        // A cell is whole pieces, and so is K (SPEC section 1): 8-byte ones
        // in a cell of a multiple of 8 bytes, else 4-byte ones.
        let piece = piece_bytes_of(run.cell_bytes as u64);
        if piece.is_none_or(|piece| !(run.k_bytes as u64).is_multiple_of(piece)) || run.k_bytes >= run.cell_bytes {
            return Err(err!(
                Malformed,
                "{what}: cell_bytes {} and k_bytes {} are not a cell of whole pieces (a positive multiple of 8, or of 4 and not of 8) and a K of whole pieces below it",
                run.cell_bytes,
                run.k_bytes
            ));
        }
    }
    match geometry
        .windows(2)
        .find(|pair| (pair[0].layer_number, pair[0].first_head) >= (pair[1].layer_number, pair[1].first_head) || (pair[0].layer_number == pair[1].layer_number && pair[0].end() > pair[1].first_head as u64))
    {
        Some(pair) => Err(err!(
            Malformed,
            "{place}: the geometry of layer {} heads from {} follows or overlaps that of layer {} heads {}..{}: runs must be sorted by (layer, first head) and not overlap",
            pair[1].layer_number,
            pair[1].first_head,
            pair[0].layer_number,
            pair[0].first_head,
            pair[0].end()
        )),
        None => Ok(()),
    }
}

/// Layer decodings are sorted by layer number, each once.
pub(crate) fn check_decodings(decodings: &[(u32, LayerDecoding)], place: &str) -> Result<()> {
    match decodings.windows(2).find(|pair| pair[0].0 >= pair[1].0) {
        Some(pair) => Err(err!(
            Malformed,
            "{place}: the decoding of layer {} follows that of layer {}: decodings must be sorted by layer number and distinct",
            pair[1].0,
            pair[0].0
        )),
        None => Ok(()),
    }
}

/// Checks the per-layer partials of one group, in a record or a payload
/// extension alike: each layer holds at least one head and none at or past
/// `MAX_KV_HEADS_PER_LAYER`, the layers are sorted by (layer, first head)
/// without overlap, and each holds one value per position of its group
/// (`num_positions`). `place` names the group (and the bytes it came from)
/// in the message of `Error::Malformed`.
pub(crate) fn check_layer_partials(layers: &[LayerPartial], num_positions: u64, place: &str) -> Result<()> {
    let mut previous: Option<&LayerPartial> = None;
    for layer in layers {
        let what = format!("{place}, layer {} heads from {}", layer.layer_number, layer.first_head);
        let end = layer.first_head as u64 + layer.num_heads as u64;
        if layer.num_heads == 0 || end > MAX_KV_HEADS_PER_LAYER {
            return Err(err!(
                Malformed,
                "{what}: num_heads {} is 0 or reaches past head {MAX_KV_HEADS_PER_LAYER}",
                layer.num_heads
            ));
        }
        if let Some(p) = previous {
            let ordered = (p.layer_number, p.first_head) < (layer.layer_number, layer.first_head);
            let overlaps = p.layer_number == layer.layer_number
                && p.first_head as u64 + p.num_heads as u64 > layer.first_head as u64;
            if !ordered || overlaps {
                return Err(err!(Malformed, "{what}: layers are out of order or overlap"));
            }
        }
        previous = Some(layer);
        if layer.values.len() as u64 != num_positions {
            return Err(err!(
                Malformed,
                "{what}: {} values for {num_positions} positions",
                layer.values.len()
            ));
        }
    }
    Ok(())
}

fn check_key(key: ReplicaKey, place: &str) -> Result<()> {
    if key.replicas == 0 || key.replica_index >= key.replicas {
        return Err(err!(
            Malformed,
            "record: {place}: replica key ({}, {}) is invalid (replicas >= 1, replica_index < replicas)",
            key.replicas,
            key.replica_index
        ));
    }
    Ok(())
}

/// The outcomes of a `bin` of outcome numbers that starts at byte `at`.
fn stored_outcomes(codes: &[u8], at: usize) -> Result<Vec<StoredOutcome>> {
    codes
        .iter()
        .enumerate()
        .map(|(i, &code)| {
            StoredOutcome::from_code(code).ok_or_else(|| {
                err!(
                    Malformed,
                    "record: stored outcomes (byte {at}): outcome {i} is {code}, not 0 (failed), 1 (matched), 2 (not checked), 3 (other fingerprint) or 4 (other algorithm)"
                )
            })
        })
        .collect()
}

/// The `u64`s of a `short_last` bin that starts at byte `at`.
fn short_last_values(bytes: &[u8], at: usize) -> Result<Vec<u64>> {
    if !bytes.len().is_multiple_of(8) {
        return Err(err!(
            Malformed,
            "record: short_last (byte {at}): {} bytes are not a whole number of u64s",
            bytes.len()
        ));
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|word| u64::from_le_bytes(word.try_into().expect("8 bytes")))
        .collect())
}
