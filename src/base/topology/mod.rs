//! Transfer topology for transfer agents (SPEC section 11): how the TP sizes
//! and block sizes of two engines relate, which remote ranks a local rank
//! reads from and which heads each supplies, and when every worker has
//! finished sending or receiving a request.
//!
//! The rules follow vLLM's `kv_connector/utils.py`; sizes that do not
//! divide are errors rather than silent truncation. Depends only on
//! [`crate::base::error`].

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::base::error::{err, Result};

/// The largest TP size the topology helpers take. A TP size comes from a
/// remote engine's handshake; a wild one (2^31, say) is an error here rather
/// than gigabytes of ranks or head runs, and every answer then fits in
/// memory: at most this many remote ranks or head runs.
pub const MAX_TP_SIZE: u32 = 65536;

/// Fails unless `value` is at least 1 (`name` in the message).
fn positive(value: u32, name: &str) -> Result<()> {
    if value == 0 {
        return Err(err!(InvalidArgument, "{name} is 0; it must be at least 1"));
    }
    Ok(())
}

/// Fails unless `value` is a TP size, 1 to [`MAX_TP_SIZE`] (`name` in the
/// message).
fn tp_size(value: u32, name: &str) -> Result<()> {
    positive(value, name)?;
    if value > MAX_TP_SIZE {
        return Err(err!(
            InvalidArgument,
            "{name} {value} is above the largest TP size, {MAX_TP_SIZE}"
        ));
    }
    Ok(())
}

/// `local_tp / remote_tp` when the local engine is at least as large, else
/// `-(remote_tp / local_tp)`: how many local ranks share one remote rank
/// (positive) or how many remote ranks one local rank reads from
/// (negative). An error when a size is not a TP size (1 to
/// [`MAX_TP_SIZE`]) or the larger is not a multiple of the smaller.
pub fn tp_ratio(local_tp: u32, remote_tp: u32) -> Result<i64> {
    tp_size(local_tp, "local_tp")?;
    tp_size(remote_tp, "remote_tp")?;
    if local_tp >= remote_tp {
        if !local_tp.is_multiple_of(remote_tp) {
            return Err(err!(
                InvalidArgument,
                "local_tp {local_tp} is not a multiple of remote_tp {remote_tp}"
            ));
        }
        Ok(i64::from(local_tp / remote_tp))
    } else {
        if !remote_tp.is_multiple_of(local_tp) {
            return Err(err!(
                InvalidArgument,
                "remote_tp {remote_tp} is not a multiple of local_tp {local_tp}"
            ));
        }
        Ok(-i64::from(remote_tp / local_tp))
    }
}

/// The remote ranks local rank `local_rank` reads from: `[rank / ratio]`
/// for a positive [`tp_ratio`], else the `|ratio|` consecutive ranks from
/// `rank * |ratio|`. These are also the handshake targets, known from the
/// two TP sizes before the remote engine is.
pub fn remote_ranks(local_rank: u32, local_tp: u32, remote_tp: u32) -> Result<Vec<u32>> {
    let ratio = tp_ratio(local_tp, remote_tp)?;
    if local_rank >= local_tp {
        return Err(err!(
            OutOfBounds,
            "local_rank {local_rank} is not below local_tp {local_tp}"
        ));
    }
    if ratio > 0 {
        // ratio <= local_tp fits u32.
        Ok(vec![local_rank / ratio as u32])
    } else {
        let count = (-ratio) as u32;
        // local_rank * count < local_tp * count = remote_tp: no overflow.
        Ok((0..count).map(|i| local_rank * count + i).collect())
    }
}

/// `local_block_size / remote_block_size`: how many remote blocks make one
/// local block. An error when it is not a whole number.
pub fn block_size_ratio(local_block_size: u32, remote_block_size: u32) -> Result<u32> {
    positive(local_block_size, "local_block_size")?;
    positive(remote_block_size, "remote_block_size")?;
    if !local_block_size.is_multiple_of(remote_block_size) {
        return Err(err!(
            InvalidArgument,
            "local_block_size {local_block_size} is not a multiple of remote_block_size {remote_block_size}"
        ));
    }
    Ok(local_block_size / remote_block_size)
}

/// Whether the remote engine replicates KV heads: `remote_tp >
/// total_kv_heads`.
pub fn remote_kv_replicated(remote_tp: u32, total_kv_heads: u32) -> Result<bool> {
    tp_size(remote_tp, "remote_tp")?;
    positive(total_kv_heads, "total_kv_heads")?;
    Ok(remote_tp > total_kv_heads)
}

/// Whether the local engine replicates KV heads: it is MLA (one latent head
/// on every rank) or `tp > total_kv_heads`.
pub fn local_kv_replicated(tp: u32, total_kv_heads: u32, is_mla: bool) -> Result<bool> {
    tp_size(tp, "tp")?;
    positive(total_kv_heads, "total_kv_heads")?;
    Ok(is_mla || tp > total_kv_heads)
}

/// A range of global KV head numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadRange {
    /// The first global head.
    pub first: u32,
    /// Heads in the range.
    pub count: u32,
}

/// The heads rank `rank` of an engine of TP size `tp` holds, with
/// `total_kv_heads` KV heads in all: `[r*K/T, (r+1)*K/T)` when `T <= K`
/// (`K` a multiple of `T`), else head `r / (T/K)` (`T` a multiple of `K`);
/// MLA (which must have `total_kv_heads == 1`) holds its latent head 0 on
/// every rank.
pub fn rank_heads(rank: u32, tp: u32, total_kv_heads: u32, is_mla: bool) -> Result<HeadRange> {
    tp_size(tp, "tp")?;
    positive(total_kv_heads, "total_kv_heads")?;
    if rank >= tp {
        return Err(err!(OutOfBounds, "rank {rank} is not below tp {tp}"));
    }
    if is_mla {
        if total_kv_heads != 1 {
            return Err(err!(
                InvalidArgument,
                "total_kv_heads {total_kv_heads} with MLA; an MLA cache has one latent head"
            ));
        }
        return Ok(HeadRange { first: 0, count: 1 });
    }
    if tp <= total_kv_heads {
        if !total_kv_heads.is_multiple_of(tp) {
            return Err(err!(
                InvalidArgument,
                "total_kv_heads {total_kv_heads} is not a multiple of tp {tp}"
            ));
        }
        let per_rank = total_kv_heads / tp;
        Ok(HeadRange {
            first: rank * per_rank,
            count: per_rank,
        })
    } else {
        if !tp.is_multiple_of(total_kv_heads) {
            return Err(err!(
                InvalidArgument,
                "tp {tp} is not a multiple of total_kv_heads {total_kv_heads}"
            ));
        }
        Ok(HeadRange {
            first: rank / (tp / total_kv_heads),
            count: 1,
        })
    }
}

/// Where some of a local rank's heads are read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSource {
    /// The remote rank that supplies them.
    pub remote_rank: u32,
    /// The global heads supplied.
    pub heads: HeadRange,
    /// Index of `heads.first` among the local rank's heads.
    pub local_offset: u32,
    /// Index of `heads.first` among the remote rank's heads.
    pub remote_offset: u32,
}

/// The lowest rank of an engine of TP size `tp` that holds `head` (see
/// [`rank_heads`], whose sizes it assumes checked): the holders of a head
/// are consecutive ranks.
fn lowest_holder(head: u32, tp: u32, total_kv_heads: u32, is_mla: bool) -> u32 {
    if is_mla {
        0
    } else if tp <= total_kv_heads {
        head / (total_kv_heads / tp)
    } else {
        // head < total_kv_heads, so this is below tp.
        head * (tp / total_kv_heads)
    }
}

/// For local rank `local_rank`, each run of its heads with the remote rank
/// that supplies it, in head order. The remote rank is one of
/// [`remote_ranks`]; where several of them hold the same head (the remote
/// engine replicates), the lowest is named, so each head is read once.
///
/// The work is per run, not per head: each run is a different remote rank
/// read from, so there are at most `|tp_ratio|` of them, however many
/// heads the local rank holds.
pub fn head_sources(
    local_rank: u32,
    local_tp: u32,
    remote_tp: u32,
    total_kv_heads: u32,
    is_mla: bool,
) -> Result<Vec<HeadSource>> {
    let candidates = remote_ranks(local_rank, local_tp, remote_tp)?;
    let local = rank_heads(local_rank, local_tp, total_kv_heads, is_mla)?;
    // The remote engine's sizes, checked once (they do not depend on the rank).
    rank_heads(0, remote_tp, total_kv_heads, is_mla)?;
    // Ascending and consecutive: the lowest candidate holding a head is the
    // lowest holder, or the first candidate when that is below it.
    let (first_candidate, last_candidate) = (candidates[0], candidates[candidates.len() - 1]);
    let local_end = local.first + local.count;
    let mut sources = Vec::new();
    let mut head = local.first;
    while head < local_end {
        let rank = lowest_holder(head, remote_tp, total_kv_heads, is_mla).max(first_candidate);
        let heads = rank_heads(rank, remote_tp, total_kv_heads, is_mla)?;
        let heads_end = heads.first + heads.count;
        if rank > last_candidate || head < heads.first || head >= heads_end {
            return Err(err!(
                Internal,
                "no remote rank of {first_candidate}..={last_candidate} holds head {head} of local rank {local_rank}"
            ));
        }
        // The run ends where this rank's heads or the local rank's do.
        let count = heads_end.min(local_end) - head;
        sources.push(HeadSource {
            remote_rank: rank,
            heads: HeadRange { first: head, count },
            local_offset: head - local.first,
            remote_offset: head - heads.first,
        });
        head += count;
    }
    Ok(sources)
}

/// What a remote engine's handshake told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteEngine {
    /// Its TP size.
    pub tp_size: u32,
    /// Bytes of one logical block of one layer on one of its ranks.
    pub block_bytes: u64,
    /// Tokens per logical block.
    pub block_size: u32,
    /// Physical (kernel) blocks per logical block.
    pub kernel_blocks: u32,
}

/// The local engine's side of a topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalEngine {
    /// This worker's TP rank.
    pub tp_rank: u32,
    /// The local TP size.
    pub tp_size: u32,
    /// KV heads of the model (1 for MLA).
    pub total_kv_heads: u32,
    /// Whether the model's cache is MLA.
    pub is_mla: bool,
    /// Local tokens per logical block.
    pub block_size: u32,
}

/// One local worker's view of the engines it transfers with: per remote
/// engine id, what its handshake told.
#[derive(Debug, Clone)]
pub struct Topology {
    local_engine_id: String,
    local: LocalEngine,
    remotes: HashMap<String, RemoteEngine>,
}

impl Topology {
    /// A topology of local engine `local_engine_id` (non-empty) with no
    /// remote engine yet; `local` is checked (rank below TP size, heads
    /// dividing, sizes at least 1).
    pub fn new(local_engine_id: &str, local: LocalEngine) -> Result<Topology> {
        if local_engine_id.is_empty() {
            return Err(err!(InvalidArgument, "local_engine_id is empty"));
        }
        positive(local.block_size, "block_size")?;
        rank_heads(local.tp_rank, local.tp_size, local.total_kv_heads, local.is_mla)?;
        Ok(Topology {
            local_engine_id: local_engine_id.to_owned(),
            local,
            remotes: HashMap::new(),
        })
    }

    /// The local engine.
    pub fn local(&self) -> LocalEngine {
        self.local
    }

    /// Records remote engine `engine_id`'s handshake. Returns false (and
    /// keeps the first) when it was registered before; registering the
    /// local engine's own id, or sizes that cannot work with the local
    /// engine's (TP sizes or block sizes that do not divide), is an error.
    pub fn add_remote(&mut self, engine_id: &str, remote: RemoteEngine) -> Result<bool> {
        if engine_id.is_empty() {
            return Err(err!(InvalidArgument, "engine_id is empty"));
        }
        if engine_id == self.local_engine_id {
            return Err(err!(
                InvalidArgument,
                "engine_id {engine_id:?} is the local engine's own id"
            ));
        }
        if self.remotes.contains_key(engine_id) {
            return Ok(false);
        }
        tp_size(remote.tp_size, "tp_size")?;
        positive(remote.kernel_blocks, "kernel_blocks")?;
        if remote.block_bytes == 0 {
            return Err(err!(InvalidArgument, "block_bytes is 0; it must be at least 1"));
        }
        tp_ratio(self.local.tp_size, remote.tp_size)?;
        block_size_ratio(self.local.block_size, remote.block_size)?;
        if !remote.block_size.is_multiple_of(remote.kernel_blocks) {
            return Err(err!(
                InvalidArgument,
                "block_size {} is not a multiple of kernel_blocks {}",
                remote.block_size,
                remote.kernel_blocks
            ));
        }
        head_sources(
            self.local.tp_rank,
            self.local.tp_size,
            remote.tp_size,
            self.local.total_kv_heads,
            self.local.is_mla,
        )?;
        self.remotes.insert(engine_id.to_owned(), remote);
        Ok(true)
    }

    /// What remote engine `engine_id`'s handshake told.
    pub fn remote(&self, engine_id: &str) -> Result<RemoteEngine> {
        self.remotes
            .get(engine_id)
            .copied()
            .ok_or_else(|| err!(NotFound, "engine_id {engine_id:?} is not a registered remote engine"))
    }

    /// [`tp_ratio`] of the local engine and `engine_id`.
    pub fn tp_ratio(&self, engine_id: &str) -> Result<i64> {
        tp_ratio(self.local.tp_size, self.remote(engine_id)?.tp_size)
    }

    /// [`block_size_ratio`] of the local engine and `engine_id`.
    pub fn block_size_ratio(&self, engine_id: &str) -> Result<u32> {
        block_size_ratio(self.local.block_size, self.remote(engine_id)?.block_size)
    }

    /// [`remote_ranks`] of this rank in `engine_id`.
    pub fn remote_ranks(&self, engine_id: &str) -> Result<Vec<u32>> {
        remote_ranks(self.local.tp_rank, self.local.tp_size, self.remote(engine_id)?.tp_size)
    }

    /// [`remote_kv_replicated`] for `engine_id`.
    pub fn remote_kv_replicated(&self, engine_id: &str) -> Result<bool> {
        remote_kv_replicated(self.remote(engine_id)?.tp_size, self.local.total_kv_heads)
    }

    /// [`head_sources`] of this rank in `engine_id`.
    pub fn head_sources(&self, engine_id: &str) -> Result<Vec<HeadSource>> {
        let remote = self.remote(engine_id)?;
        head_sources(
            self.local.tp_rank,
            self.local.tp_size,
            remote.tp_size,
            self.local.total_kv_heads,
            self.local.is_mla,
        )
    }
}

/// The direction of a transfer a worker reports finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The worker finished sending the request's KV.
    Sending,
    /// The worker finished receiving the request's KV.
    Receiving,
}

/// Counts, per request and direction, the workers that reported it
/// finished, and says when the expected number has. The expected count may
/// change (a worker tells a new one); a request keeps the count in force
/// when it was first reported. Invalid block ids from every worker are
/// united.
#[derive(Debug, Clone)]
pub struct Completion {
    expected: u32,
    pending: HashMap<(Direction, String), (u32, HashSet<u32>)>,
    invalid_blocks: BTreeSet<u32>,
}

impl Completion {
    /// A counter expecting `expected_workers` (at least 1) reports per
    /// request and direction.
    pub fn new(expected_workers: u32) -> Result<Completion> {
        positive(expected_workers, "expected_workers")?;
        Ok(Completion {
            expected: expected_workers,
            pending: HashMap::new(),
            invalid_blocks: BTreeSet::new(),
        })
    }

    /// The expected count for requests first reported from now on.
    pub fn expected(&self) -> u32 {
        self.expected
    }

    /// Changes the expected count (at least 1) for requests first reported
    /// from now on; requests already counting keep theirs.
    pub fn set_expected(&mut self, expected_workers: u32) -> Result<()> {
        positive(expected_workers, "expected_workers")?;
        self.expected = expected_workers;
        Ok(())
    }

    /// Worker `worker` reports `req_ids` finished in `direction`. Returns,
    /// per request, whether this report completed it (every expected worker
    /// has now reported it; its count is then dropped). A request listed
    /// twice, an empty id, or one this worker already reported (and not yet
    /// completed) is an error, and then nothing is counted.
    pub fn report(&mut self, worker: u32, direction: Direction, req_ids: &[&str]) -> Result<Vec<bool>> {
        let mut seen = HashSet::with_capacity(req_ids.len());
        for (i, req_id) in req_ids.iter().enumerate() {
            if req_id.is_empty() {
                return Err(err!(InvalidArgument, "req_ids[{i}] is empty"));
            }
            if !seen.insert(*req_id) {
                return Err(err!(InvalidArgument, "req_ids[{i}] {req_id:?} is listed twice"));
            }
            if let Some((_, workers)) = self.pending.get(&(direction, (*req_id).to_owned())) {
                if workers.contains(&worker) {
                    return Err(err!(
                        InvalidArgument,
                        "worker {worker} already reported request {req_id:?} finished {}",
                        match direction {
                            Direction::Sending => "sending",
                            Direction::Receiving => "receiving",
                        }
                    ));
                }
            }
        }
        let mut completed = Vec::with_capacity(req_ids.len());
        for req_id in req_ids {
            let key = (direction, (*req_id).to_owned());
            let entry = self
                .pending
                .entry(key.clone())
                .or_insert_with(|| (self.expected, HashSet::new()));
            entry.1.insert(worker);
            let done = entry.1.len() as u64 >= u64::from(entry.0);
            if done {
                self.pending.remove(&key);
            }
            completed.push(done);
        }
        Ok(completed)
    }

    /// Workers that reported `req_id` finished in `direction` so far (0 once
    /// it completed or before any did).
    pub fn reported(&self, direction: Direction, req_id: &str) -> u32 {
        self.pending
            .get(&(direction, req_id.to_owned()))
            .map_or(0, |(_, workers)| workers.len() as u32)
    }

    /// Adds block ids a worker found invalid.
    pub fn add_invalid_blocks(&mut self, block_ids: &[u32]) {
        self.invalid_blocks.extend(block_ids.iter().copied());
    }

    /// The union of the invalid block ids reported since the last clear,
    /// ascending.
    pub fn invalid_blocks(&self) -> Vec<u32> {
        self.invalid_blocks.iter().copied().collect()
    }

    /// Forgets the invalid block ids.
    pub fn clear_invalid_blocks(&mut self) {
        self.invalid_blocks.clear();
    }
}

#[cfg(test)]
mod tests;
