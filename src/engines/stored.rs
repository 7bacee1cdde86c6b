//! Stored checksums for offloaded KV (SPEC section 8), on the host engine.
//!
//! A group may have a buffer of 16 bytes per block id beside its caches,
//! which an offload connector copies with each block. A store writes, for
//! each block being offloaded, the entry of [`crate::base::stored_entry`]: the
//! value `sum XOR tag`, where `sum` adds the worker's columns at the block's
//! position and `tag = LE_u64(block_hash[0..8]) XOR fingerprint(group)`, then
//! the stamp of the configuration and valid tokens that computed it, with a
//! check binding both to the block hash. A load check recomputes the loaded
//! blocks and compares: another block's bytes, another shard's KV, another
//! block hash or a damaged entry fail, while a clean stamp of another
//! configuration (other layers, identities, heads, block size or algorithm)
//! or token count is no corruption and is not compared.
//!
//! On a device worker the same checks run here before anything is queued,
//! and the positions become items of the `kvcs_store` launch that the call
//! queues after its checksums (`crate::engines::cuda`, [`device_work`]).

use crate::base::checksum::Algorithm;
use crate::base::error::{err, Result};
use crate::base::stored_entry::{block_tag, entry, entry_key, Digests, EntryConfig, EntryReader, StoredOutcome};
use crate::engines::cuda::{DevStoredItem, StoredMode, StoredWork};
use crate::inputs::blocks::{valid_tokens, BlockSet, GroupBlocks, RequestBlocks};
use crate::inputs::layout::{Group, Layout, StoredBuffer};
use crate::inputs::role::Role;
use crate::results::checksums::{Checksums, Placement, Shape, StoredExpectation, StoredRef};
use crate::results::record_facts::GroupInfo;

/// One (request, group) that a store or load check covers.
struct Target<'a> {
    /// Index of the (request, group) in block-set order (skipped ones too).
    index: usize,
    request: &'a RequestBlocks,
    blocks: &'a GroupBlocks,
    hashes: &'a [u64],
    group: &'a Group,
    buffer: StoredBuffer,
    /// The worker's configuration of the group (fingerprint, coverage of
    /// all its columns, block size, algorithm), which entries name.
    config: EntryConfig,
    /// Its digests (the configuration hashed once per target).
    digests: Digests,
}

impl Target<'_> {
    /// Whether the block at index `i` holds a valid token (state groups
    /// always do).
    fn holds_tokens(&self, i: usize) -> bool {
        let position = self.blocks.first_position + i as u64;
        self.group.is_state() || valid_tokens(self.request.num_tokens, self.group.block_size, position) > 0
    }

    /// How many of the group's first positions hold a valid token (all of
    /// a state group's): those a store writes and a load check checks.
    fn checked_positions(&self) -> usize {
        let n = self.blocks.block_ids.len();
        if self.group.is_state() {
            return n;
        }
        let end = self.request.num_tokens.div_ceil(self.group.block_size as u64);
        end.saturating_sub(self.blocks.first_position).min(n as u64) as usize
    }

    /// Where block `block_id`'s stored value lives; its stamp is the next word.
    fn slot(&self, block_id: u32) -> *mut u64 {
        let words = (StoredBuffer::BYTES_PER_BLOCK / 8) as usize;
        (self.buffer.address as usize as *mut u64).wrapping_add(block_id as usize * words)
    }

    /// The tag of the block at index `i`.
    fn tag(&self, i: usize) -> u64 {
        block_tag(self.hashes[i], self.config.fingerprint)
    }

    /// The tokens the entry at index `i` counts (0 in a state group).
    fn tokens(&self, i: usize) -> u32 {
        let position = self.blocks.first_position + i as u64;
        let valid = valid_tokens(self.request.num_tokens, self.group.block_size, position);
        self.config.tokens(valid)
    }

    /// The digest of the entry at index `i`.
    fn digest(&self, i: usize) -> u32 {
        self.digests.digest(self.tokens(i))
    }

    /// What a load check expects at index `i`, whose value is the `index`-th read back.
    fn expected(&self, i: usize, index: usize) -> StoredRef {
        StoredRef {
            index,
            tag: self.tag(i),
            block_hash: self.hashes[i],
            tokens: self.tokens(i),
        }
    }
}

/// Checks that every (request, group) of `blocks` that the worker does not
/// skip has a stored buffer, block hashes, and block ids inside the buffer,
/// each block id holding one value (see [`check_one_value_per_block`]): all
/// of it before anything is computed or written.
fn targets<'a>(
    layout: &'a Layout,
    infos: &[GroupInfo],
    blocks: &'a BlockSet,
    algorithm: Algorithm,
) -> Result<Vec<Target<'a>>> {
    let mut targets = Vec::new();
    let mut index = 0;
    // Each group's entry configuration once per call, not per request: it
    // hashes every layer's decoding and geometry (SHA-256), which per
    // request made a 128-request store spend most of its host time here.
    let configs: Vec<_> = infos.iter().map(|info| info.entry_config(algorithm)).collect();
    for request in blocks.requests() {
        let req_id = &request.req_id;
        for group_blocks in &request.groups {
            index += 1;
            let group_id = group_blocks.group_id;
            if layout.skip_reason(group_id).is_some() {
                continue;
            }
            let group = layout.group(group_id).ok_or_else(|| {
                err!(
                    NotFound,
                    "group_id {group_id} of req_id \"{req_id}\" is not registered on this worker"
                )
            })?;
            let buffer = group.stored().ok_or_else(|| {
                err!(
                    NotFound,
                    "group_id {group_id} has no buffer of stored checksums (kvcs_worker_add_stored) (req_id \"{req_id}\")"
                )
            })?;
            let hashes = group_blocks.hashes.as_deref().ok_or_else(|| {
                err!(
                    InvalidArgument,
                    "req_id \"{req_id}\", group_id {group_id} has no block hashes (kvcs_blocks_set_hashes)"
                )
            })?;
            if let Some((i, &block_id)) = group_blocks
                .block_ids
                .iter()
                .enumerate()
                .find(|(_, &id)| id as u64 >= buffer.num_blocks)
            {
                return Err(err!(
                    OutOfBounds,
                    "block id {block_id} at position {} of req_id \"{req_id}\", group_id {group_id} is not below the {} values of its stored checksums",
                    group_blocks.first_position + i as u64,
                    buffer.num_blocks
                ));
            }
            // The worker's group facts, hashed once per layout (not per
            // request: a group's fingerprint hashes every layer's identity),
            // name the entry's configuration (SPEC section 8).
            let config = infos
                .binary_search_by_key(&group_id, |info| info.group_id)
                .map(|i| configs[i])
                .map_err(|_| {
                    err!(
                        Internal,
                        "group_id {group_id} is registered but not among the worker's group facts"
                    )
                })?;
            let target = Target {
                index: index - 1,
                request,
                blocks: group_blocks,
                hashes,
                group,
                buffer,
                config,
                digests: config.digests(),
            };
            targets.push(target);
        }
    }
    check_one_value_per_block(&targets)?;
    Ok(targets)
}

/// Fails when a block id that holds tokens stands at two places of
/// `targets` (of one group) with other positions, block hashes or valid
/// tokens: its buffer keeps one value per block id, so one of the two could
/// never match (a null block shared by positions, say). The same block at
/// the same position of two requests (a shared prefix) is fine. Sorting
/// compact keys keeps it `n log n` whatever the block ids.
fn check_one_value_per_block(targets: &[Target<'_>]) -> Result<()> {
    // Most calls hold each block id once: a bit per block id of the
    // buffers (bounded by their registered size) finds those seen twice,
    // and only their places are sorted and compared.
    let mut seen: std::collections::BTreeMap<u32, Vec<u64>> = std::collections::BTreeMap::new();
    let mut repeated = false;
    for target in targets {
        let bits = seen
            .entry(target.blocks.group_id)
            .or_insert_with(|| vec![0u64; (target.buffer.num_blocks as usize).div_ceil(64)]);
        for &block_id in &target.blocks.block_ids[..target.checked_positions()] {
            let (word, bit) = (block_id as usize / 64, 1u64 << (block_id % 64));
            repeated |= bits[word] & bit != 0;
            bits[word] |= bit;
        }
    }
    if !repeated {
        return Ok(());
    }
    // (group and block id, target, index in the target), 16 bytes each.
    let mut uses: Vec<(u64, u32, u32)> = Vec::with_capacity(targets.iter().map(|t| t.checked_positions()).sum());
    for (t, target) in targets.iter().enumerate() {
        let group = (target.blocks.group_id as u64) << 32;
        for (i, &block_id) in target.blocks.block_ids[..target.checked_positions()].iter().enumerate() {
            uses.push((group | block_id as u64, t as u32, i as u32));
        }
    }
    uses.sort_unstable_by_key(|&(key, _, _)| key);
    // What the value at a place depends on besides the block's bytes.
    let value_of = |&(_, t, i): &(u64, u32, u32)| {
        let target = &targets[t as usize];
        let i = i as usize;
        let position = target.blocks.first_position + i as u64;
        let tokens = if target.group.is_state() {
            0
        } else {
            valid_tokens(target.request.num_tokens, target.group.block_size, position)
        };
        (position, target.hashes[i], tokens)
    };
    let clash = uses
        .windows(2)
        .find(|pair| pair[0].0 == pair[1].0 && value_of(&pair[0]) != value_of(&pair[1]));
    match clash {
        None => Ok(()),
        Some(pair) => {
            let (before, here) = (&pair[0], &pair[1]);
            Err(err!(
                InvalidArgument,
                "block id {} of group_id {} stands at position {} of req_id \"{}\" and at position {} of req_id \"{}\" with another block hash or other valid tokens; its stored checksum holds one value per block id",
                here.0 as u32,
                here.0 >> 32,
                value_of(before).0,
                targets[before.1 as usize].request.req_id,
                value_of(here).0,
                targets[here.1 as usize].request.req_id
            ))
        }
    }
}

/// Fails unless `blocks` can be stored or checked on `layout` (see [`targets`]).
pub fn check_blocks(layout: &Layout, infos: &[GroupInfo], blocks: &BlockSet, algorithm: Algorithm) -> Result<()> {
    targets(layout, infos, blocks, algorithm).map(|_| ())
}

/// Writes the entry (`sum XOR tag`, then the stamp) of every block of
/// `blocks` that holds a valid token, from `result` (this worker's
/// checksums of `blocks`, every column).
///
/// The caller of `add_stored` promised the buffers are writable host memory
/// that nothing else writes meanwhile.
pub fn store(
    layout: &Layout,
    infos: &[GroupInfo],
    blocks: &BlockSet,
    algorithm: Algorithm,
    result: &Checksums,
) -> Result<()> {
    let targets = targets(layout, infos, blocks, algorithm)?;
    let mut writes = Vec::new();
    for target in &targets {
        let sums = result.position_sums(&target.request.req_id, target.blocks.group_id)?;
        for (i, (&block_id, sum)) in target.blocks.block_ids.iter().zip(sums).enumerate() {
            if target.holds_tokens(i) {
                let (value, stamp) = entry(sum, target.tag(i), target.hashes[i], target.digest(i));
                writes.push((target.slot(block_id), value, stamp));
            }
        }
    }
    for (slot, value, stamp) in writes {
        // SAFETY: `targets` checked the block id is below the buffer's
        // length, so both words lie in the buffer; the buffer is 8-byte
        // aligned and writable (the caller's promise at registration).
        unsafe {
            slot.write(value.to_le());
            slot.add(1).write(stamp.to_le());
        }
    }
    Ok(())
}

/// Per (request, group) of `targets`, the positions a load check checks
/// (those holding a valid token: a prefix of the group's positions),
/// numbered in order: `visit(t, i, block_id)` for each (the `t`-th target's
/// position `i`), then (if `expect`) the expectations referring to those
/// numbers.
fn checked_positions(
    targets: &[Target<'_>],
    expect: bool,
    mut visit: impl FnMut(usize, usize, u32),
) -> Vec<StoredExpectation> {
    let mut count = 0usize;
    let mut expectations = Vec::with_capacity(if expect { targets.len() } else { 0 });
    // One reader per group (a call has few): every request's target of a
    // group has its configuration.
    let mut readers: Vec<(u32, std::sync::Arc<EntryReader>)> = Vec::new();
    for (t, target) in targets.iter().enumerate() {
        let block_ids = &target.blocks.block_ids;
        let checked = target.checked_positions();
        debug_assert!((0..block_ids.len()).all(|i| target.holds_tokens(i) == (i < checked)));
        if !expect {
            for (i, &block_id) in block_ids[..checked].iter().enumerate() {
                visit(t, i, block_id);
            }
            continue;
        }
        let mut expected = Vec::with_capacity(block_ids.len());
        for (i, &block_id) in block_ids[..checked].iter().enumerate() {
            visit(t, i, block_id);
            expected.push(Some(target.expected(i, count)));
            count += 1;
        }
        expected.resize(block_ids.len(), None);
        expectations.push(StoredExpectation {
            req_id: target.request.req_id.clone(),
            group_id: target.blocks.group_id,
            expected,
            reader: match readers.iter().find(|(group_id, _)| *group_id == target.blocks.group_id) {
                Some((_, reader)) => reader.clone(),
                None => {
                    let reader = std::sync::Arc::new(target.config.reader());
                    readers.push((target.blocks.group_id, reader.clone()));
                    reader
                }
            },
        });
    }
    expectations
}

/// Reads back the stored value and stamp of every block of `blocks` that
/// holds a valid token (host memory): what a load check expects, and the
/// values its expectations index (two words each: value, stamp).
pub fn expectations(
    layout: &Layout,
    infos: &[GroupInfo],
    blocks: &BlockSet,
    algorithm: Algorithm,
) -> Result<(Vec<StoredExpectation>, Vec<u64>)> {
    let targets = targets(layout, infos, blocks, algorithm)?;
    let mut read = Vec::with_capacity(2 * blocks.num_blocks());
    let expectations = checked_positions(&targets, true, |t, _, block_id| {
        let slot = targets[t].slot(block_id);
        // SAFETY: as in `store`, readable host memory.
        read.extend(unsafe { [slot.read(), slot.add(1).read()] }.map(u64::from_le));
    });
    Ok((expectations, read))
}

/// A device worker's store or load check of `blocks`, whose checksum call
/// has `shape` (every column): one item per block holding a valid token,
/// with its values' place, tag, key and digest (the stamp but its check,
/// which `kvcs_store` computes from the value) and stored address, checked
/// before anything is queued; and, for a load check, the expectations
/// indexing the values the device gathers (in item order).
pub fn device_work(
    layout: &Layout,
    infos: &[GroupInfo],
    blocks: &BlockSet,
    algorithm: Algorithm,
    shape: &Shape,
    mode: StoredMode,
) -> Result<(StoredWork, Vec<StoredExpectation>)> {
    let targets = targets(layout, infos, blocks, algorithm)?;
    // Per target, where its values are: (value index of column 0, columns).
    let places = targets
        .iter()
        .map(|target| match shape.placements.get(target.index) {
            Some(&Placement::Computed {
                slot, values_offset, ..
            }) => Ok((values_offset, shape.columns[slot as usize].len() as u32)),
            _ => Err(err!(
                Internal,
                "group_id {} of req_id \"{}\" has no values in the call",
                target.blocks.group_id,
                target.request.req_id
            )),
        })
        .collect::<Result<Vec<_>>>()?;
    let mut items = Vec::with_capacity(blocks.num_blocks());
    let expectations = checked_positions(&targets, mode == StoredMode::Gather, |t, i, block_id| {
        let target = &targets[t];
        let (values_offset, num_columns) = places[t];
        // A gather reads the entry back: it needs no key or digest.
        let (key, digest) = match mode {
            StoredMode::Store => {
                let digest = target.digest(i);
                (entry_key(target.hashes[i], digest), digest)
            }
            StoredMode::Gather => (0, 0),
        };
        items.push(DevStoredItem {
            tag: target.tag(i),
            address: target.slot(block_id) as usize as u64,
            key,
            out: (values_offset + i) as u32,
            column_stride: target.blocks.block_ids.len() as u32,
            num_columns,
            digest,
        });
    });
    Ok((StoredWork { mode, items }, expectations))
}

/// One (request, group) of a checksum result, as a connector that keeps
/// the entries itself stores or checks them: the worker's configuration
/// of the group, the sums of every column, and per position its block
/// hash, tag and tokens (`None` where it holds no valid token).
struct ResultPositions {
    config: EntryConfig,
    sums: Vec<u64>,
    positions: Vec<Option<(u64, u64, u32)>>,
}

/// The positions of `group_id` in `req_id` of `result`, which must be a
/// consumer-role checksum (every column, as a store sums them) of blocks
/// with block hashes; `NotReady` while a device computes.
fn result_positions(result: &Checksums, req_id: &str, group_id: u32) -> Result<ResultPositions> {
    let info = result.record_info().ok_or_else(|| {
        err!(
            Internal,
            "this result carries no worker facts (it was not made by a worker)"
        )
    })?;
    if info.role != Role::Consumer {
        return Err(err!(
            InvalidArgument,
            "the result was computed as KVCS_ROLE_PRODUCER: its sums leave out the replica columns a stored checksum covers; checksum as KVCS_ROLE_CONSUMER (req_id \"{req_id}\", group_id {group_id})"
        ));
    }
    let (request, blocks) = result.given_blocks(req_id, group_id)?;
    let hashes = blocks.hashes.as_deref().ok_or_else(|| {
        err!(
            InvalidArgument,
            "req_id \"{req_id}\", group_id {group_id} has no block hashes (kvcs_blocks_set_hashes)"
        )
    })?;
    let group = info.groups.iter().find(|g| g.group_id == group_id).ok_or_else(|| {
        err!(
            Internal,
            "group_id {group_id} is in the result but not among the worker's groups"
        )
    })?;
    // The rule a store follows (SPEC section 8), so that the entries a
    // connector keeps are those a store writes.
    let config = group.entry_config(info.algorithm);
    let positions = hashes
        .iter()
        .enumerate()
        .map(|(i, &hash)| {
            let position = blocks.first_position + i as u64;
            let valid = valid_tokens(request.num_tokens, group.block_size, position);
            (group.state || valid > 0).then(|| (hash, block_tag(hash, config.fingerprint), config.tokens(valid)))
        })
        .collect();
    Ok(ResultPositions {
        config,
        sums: result.position_sums(req_id, group_id)?,
        positions,
    })
}

/// The entries (value, stamp) that a store of the blocks of `result`
/// would write for `group_id` of `req_id`, one per block position; `(0,
/// 0)` where a position holds no valid token (a store writes none there).
/// For connectors that keep stored checksums themselves.
pub fn result_entries(result: &Checksums, req_id: &str, group_id: u32) -> Result<Vec<(u64, u64)>> {
    let found = result_positions(result, req_id, group_id)?;
    let digests = found.config.digests();
    Ok(found
        .positions
        .iter()
        .zip(&found.sums)
        .map(|(position, &sum)| match *position {
            Some((hash, tag, tokens)) => entry(sum, tag, hash, digests.digest(tokens)),
            None => (0, 0),
        })
        .collect())
}

/// A load check of `result` against `entries` (value, stamp per block
/// position of `group_id` in `req_id`) kept by the caller: the outcome of
/// each position, as `Worker::check_stored` gives them.
pub fn check_result_entries(
    result: &Checksums,
    req_id: &str,
    group_id: u32,
    entries: &[(u64, u64)],
) -> Result<Vec<StoredOutcome>> {
    let found = result_positions(result, req_id, group_id)?;
    if entries.len() != found.positions.len() {
        return Err(err!(
            InvalidArgument,
            "{} entries for the {} positions of group_id {group_id} of req_id \"{req_id}\"",
            entries.len(),
            found.positions.len()
        ));
    }
    let reader = found.config.reader();
    Ok(found
        .positions
        .iter()
        .zip(&found.sums)
        .zip(entries)
        .map(|((position, &sum), &read)| match *position {
            Some((hash, tag, tokens)) => reader.judge(hash, tag, tokens, sum, read),
            None => StoredOutcome::NotChecked,
        })
        .collect())
}
