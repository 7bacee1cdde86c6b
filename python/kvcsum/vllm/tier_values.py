"""The values a worker keeps of the KV blocks it computed, by block hash, so
that a block loaded back from an offload tier (vLLM's offloading connector,
LMCache, a file or CPU tier: any connector that loads by prefix) is
compared by the worker itself, in the step of the load.

A block's value is the sum of the worker's checksum columns at its position
(docs/SPEC.md section 8's "sum of the worker's columns": every column, so
every copy of replicated heads), over the block's bytes as this worker held
them when the forward that filled it had run. Each worker keeps the values
of its own columns, so each TP rank checks its own heads.

A block computed again can differ in its last bits (kernels are not
batch-invariant), and a tier may still hold the earlier copy: every value
seen for a hash is kept (up to `MAX_VALUES`; past that the hash's values
are unknown, never a mismatch). A loaded block is

- MATCH when its value is one of those kept for its hash;
- MISMATCH when values are kept for its hash and its value is none of them;
- UNKNOWN (unverified) when none are: another engine stored it, the map
  dropped it (it is bounded: the least recently used hashes go first), the
  block has no hash (a partial block), or more than MAX_VALUES were seen.

`TierChecker` does a worker's part over a CacheChecksummer: it checksums
the blocks that became full (queued on a device: their values are kept once
ready), and compares a tier load's blocks with the values kept. The blocks
that became full in a step go to the library in one store call (SPEC
section 8's store, into a buffer of 16 bytes a block id: host memory, or
pinned host memory for a device worker), whose values `sum XOR tag` are
read back with the tags of their hashes.

This module needs neither vLLM nor torch (numpy and kvcsum alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

import kvcsum
from kvcsum.vllm.cache_checksums import Job

__all__ = [
    "BlockBatch",
    "StoredValues",
    "TierChecker",
    "TierComparison",
    "HashedBlocks",
    "BlockOutcome",
    "MATCHED",
    "MISMATCHED",
    "UNKNOWN",
    "MAX_VALUES",
    "DEFAULT_CAPACITY",
    "UNKNOWN_REASONS",
]

#: The outcomes of one loaded block.
MATCHED, MISMATCHED, UNKNOWN = "matched", "mismatched", "unknown"

#: Why a loaded block's expected value is unknown (an UNKNOWN outcome's
#: reason): no block hash, a hash this worker never computed or dropped,
#: more values than kept, another position than computed, not checksummed,
#: or a worker that keeps no values at all.
UNKNOWN_REASONS = (
    "NO_BLOCK_HASH",
    "UNKNOWN_BLOCK",
    "TOO_MANY_VALUES",
    "OTHER_POSITION",
    "NOT_CHECKSUMMED",
    "NO_VALUES_KEPT",
)

#: Most distinct values kept per hash (a block computed again in other
#: batches); a hash seen with more is unknown from then on.
MAX_VALUES = 4

#: Blocks a worker keeps values of, by default (about 150 MB of host memory
#: a worker per million blocks: docs/vllm-tiers.md).
DEFAULT_CAPACITY = 1 << 20

_POSITION_SHIFT = 64
_VALUE_MASK = (1 << 64) - 1
#: The entry of a hash seen with more than MAX_VALUES values.
_TOO_MANY = ()


@dataclasses.dataclass(frozen=True)
class HashedBlocks:
    """A request's blocks with their block hashes: the blocks that became
    full in a step's forward (to keep their values), or the blocks a tier
    loaded (to compare them). `groups` is {group: (first_position,
    block_ids, hashes)}, a hash None where the block has none (a partial
    block); `num_tokens` the request's tokens those blocks hold;
    `generation` the scheduler's number for a tier load."""

    req_id: str
    num_tokens: int
    groups: dict
    generation: int = 0

    def job(self) -> Job:
        """The checksum job of these blocks."""
        return Job(self.req_id, self.num_tokens, {g: (first, list(ids)) for g, (first, ids, _) in self.groups.items()})


def _empty(dtype) -> np.ndarray:
    array = np.zeros(0, dtype=dtype)
    array.flags.writeable = False
    return array


@dataclasses.dataclass(frozen=True)
class BlockBatch:
    """The blocks of several requests with their block hashes, as arrays in
    compressed rows (kvcsum.Blocks.add_arrays): what the scheduler sends the
    workers each step of the blocks that became full
    (`KvcsumConnectorMetadata.stores`), one set of numpy arrays however many
    requests, built by the worker into one block set in one call.

    Request i is `req_ids[i]` with `num_tokens[i]` tokens; its groups are
    `group_ends[i-1] .. group_ends[i]` of `group_ids` / `first_positions` /
    `block_ends`, group g's blocks `block_ends[g-1] .. block_ends[g]` of
    `block_ids`, each with its hash, a row of `hashes` (uint8, one length)."""

    req_ids: tuple = ()
    num_tokens: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.uint64))
    group_ends: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.uintp))
    group_ids: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.uint32))
    first_positions: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.uint64))
    block_ends: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.uintp))
    block_ids: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.uint32))
    hashes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 8), dtype=np.uint8))
    #: Per block id, its position in its request and its group (what the
    #: worker keeps with its value), and the groups present.
    positions: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.int64))
    block_groups: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.uint32))
    groups: frozenset = frozenset()

    @property
    def num_blocks(self) -> int:
        return int(self.block_ids.size)

    @classmethod
    def of(cls, stores: Sequence[HashedBlocks]) -> "BlockBatch":
        """The batch of these requests' blocks: the groups whose blocks all
        have a hash, of the length of the first hash (a group with a block
        without one, or of another length, is left out, as is a request
        left with no group)."""
        req_ids, num_tokens, group_ends = [], [], []
        group_ids, firsts, block_ends, ids, hashes = [], [], [], [], []
        positions, block_groups = [], []
        size = None
        for blocks in stores:
            kept = 0
            for group_id, (first, block_ids, block_hashes) in blocks.groups.items():
                if not block_ids or any(h is None for h in block_hashes):
                    continue
                if size is None:
                    size = len(block_hashes[0])
                if any(len(h) != size for h in block_hashes):
                    continue
                group_ids.append(group_id)
                firsts.append(first)
                ids.extend(block_ids)
                hashes.extend(block_hashes)
                positions.extend(range(first, first + len(block_ids)))
                block_groups.extend([group_id] * len(block_ids))
                block_ends.append(len(ids))
                kept += 1
            if kept:
                req_ids.append(blocks.req_id)
                num_tokens.append(blocks.num_tokens)
                group_ends.append(len(group_ids))
        if not req_ids:
            return EMPTY_BATCH
        return cls(
            tuple(req_ids),
            np.array(num_tokens, dtype=np.uint64),
            np.array(group_ends, dtype=np.uintp),
            np.array(group_ids, dtype=np.uint32),
            np.array(firsts, dtype=np.uint64),
            np.array(block_ends, dtype=np.uintp),
            np.array(ids, dtype=np.uint32),
            np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(len(ids), size),
            np.array(positions, dtype=np.int64),
            np.array(block_groups, dtype=np.uint32),
            frozenset(group_ids),
        )

    def only_groups(self, keep) -> "BlockBatch":
        """The batch without the groups not in `keep` (itself where it has
        none such)."""
        if self.groups.issubset(keep):
            return self
        groups = self.group_ids.tolist()
        block_ends = self.block_ends.tolist()
        stores, start_group = [], 0
        for i, req_id in enumerate(self.req_ids):
            end_group = int(self.group_ends[i])
            out = {}
            for g in range(start_group, end_group):
                start = block_ends[g - 1] if g else 0
                if groups[g] in keep:
                    out[groups[g]] = (
                        int(self.first_positions[g]),
                        self.block_ids[start : block_ends[g]].tolist(),
                        [bytes(row) for row in self.hashes[start : block_ends[g]]],
                    )
            start_group = end_group
            if out:
                stores.append(HashedBlocks(req_id, int(self.num_tokens[i]), out))
        return BlockBatch.of(stores)

    def add_to(self, blocks: "kvcsum.Blocks") -> None:
        """Adds the batch to a block set, in one call."""
        blocks.add_arrays(
            self.req_ids, self.num_tokens, self.group_ends, self.group_ids, self.first_positions,
            self.block_ends, self.block_ids, self.hashes,
        )


#: The batch of no blocks (most decode steps).
EMPTY_BATCH = BlockBatch()


@dataclasses.dataclass(frozen=True)
class BlockOutcome:
    """A loaded block's comparison: `outcome` (MATCHED, MISMATCHED or
    UNKNOWN) and, for UNKNOWN, `reason` (one upper-case word)."""

    outcome: str
    reason: str = ""


class StoredValues:
    """A bounded map {(group, block hash): values} for one worker.

    Each entry holds the block's position in its request (a hash names a
    prefix, hence a position; a lookup at another position is unknown) and
    up to MAX_VALUES values. Memory: one dict entry, a key and an int (a
    tuple where a hash has several values) per block; `capacity` bounds the
    entries, least recently used first out.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity: {capacity!r} is not a positive number of blocks")
        self.capacity = capacity
        self._entries: dict = {}
        self.dropped = 0  # entries pushed out by the bound

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(group_id: int, block_hash: bytes):
        return block_hash if group_id == 0 else (group_id, block_hash)

    def remember(self, group_id: int, block_hash: bytes, position: int, value: int) -> None:
        """Keeps `value` (a block's sum, 0 to 2^64 - 1) for its hash."""
        key = self._key(group_id, block_hash)
        packed = (position << _POSITION_SHIFT) | (value & _VALUE_MASK)
        entry = self._entries.pop(key, None)
        if entry is None:
            entry = packed
        elif entry == _TOO_MANY:
            pass
        elif isinstance(entry, int):
            if entry >> _POSITION_SHIFT != position:
                entry = _TOO_MANY  # one hash at two positions: never compared
            elif entry != packed:
                entry = (entry, packed)
        elif packed not in entry:
            if entry[0] >> _POSITION_SHIFT != position or len(entry) >= MAX_VALUES:
                entry = _TOO_MANY
            else:
                entry = entry + (packed,)
        self._entries[key] = entry
        while len(self._entries) > self.capacity:
            del self._entries[next(iter(self._entries))]
            self.dropped += 1

    def remember_many(self, group_id: int, hashes: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
        """`remember` for a row of `hashes` (uint8, a hash a row) per block."""
        size = hashes.shape[1] if hashes.ndim == 2 else 0
        data = hashes.tobytes()
        for i, (position, value) in enumerate(zip(positions.tolist(), values.tolist())):
            self.remember(group_id, data[i * size : (i + 1) * size], position, value)

    def compare(self, group_id: int, block_hash: bytes | None, position: int, value: int) -> BlockOutcome:
        """The outcome of a loaded block whose sum is `value`."""
        if block_hash is None:
            return BlockOutcome(UNKNOWN, "NO_BLOCK_HASH")
        key = self._key(group_id, block_hash)
        entry = self._entries.get(key)
        if entry is None:
            return BlockOutcome(UNKNOWN, "UNKNOWN_BLOCK")
        if entry == _TOO_MANY:
            return BlockOutcome(UNKNOWN, "TOO_MANY_VALUES")
        values = (entry,) if isinstance(entry, int) else entry
        if values[0] >> _POSITION_SHIFT != position:
            return BlockOutcome(UNKNOWN, "OTHER_POSITION")
        packed = (position << _POSITION_SHIFT) | (value & _VALUE_MASK)
        if packed in values:
            # Recently used: kept longer.
            del self._entries[key]
            self._entries[key] = entry
            return BlockOutcome(MATCHED)
        return BlockOutcome(MISMATCHED)

    def values(self, group_id: int, block_hash: bytes) -> Sequence[int] | None:
        """The values kept for a hash (None: none, or too many)."""
        entry = self._entries.get(self._key(group_id, block_hash))
        if entry is None or entry == _TOO_MANY:
            return None
        values = (entry,) if isinstance(entry, int) else entry
        return tuple(v & _VALUE_MASK for v in values)


@dataclasses.dataclass(frozen=True)
class TierComparison:
    """One worker's comparison of a tier load: the blocks that matched, the
    block ids that differ, the blocks of unknown value ({reason: count}),
    and the block ids that are load errors (those that differ, and under
    fail_unknown those of unknown value)."""

    matched: int
    mismatched: tuple
    unknown: dict
    invalid: frozenset


class TierChecker:
    """A worker's stored values over its CacheChecksummer.

    Args:
        checksummer: the worker's kvcsum.vllm.cache_checksums.CacheChecksummer.
        capacity: the blocks whose values are kept (StoredValues).
    """

    def __init__(self, checksummer, capacity: int = DEFAULT_CAPACITY):
        self.checksummer = checksummer
        self.values = StoredValues(capacity)
        self._pending: list = []  # (kvcsum.Result, BlockBatch)
        # A buffer of stored checksums per group the worker checksums.
        self._buffers: dict = {}
        for group_id in sorted(checksummer.fingerprints):
            if checksummer.device == kvcsum.HOST:
                buffer = np.zeros((checksummer.num_blocks, 2), dtype=np.uint64)
                view = buffer
            else:
                import torch

                buffer = torch.zeros((checksummer.num_blocks, 16), dtype=torch.uint8, pin_memory=True)
                view = buffer.numpy().view(np.uint64)
            checksummer.worker.add_stored_of(group_id, buffer)
            self._buffers[group_id] = view

    @property
    def pending(self) -> int:
        """Checksums of stored blocks not yet read."""
        return len(self._pending)

    def store(self, stores, cuda_stream: int | None = None) -> None:
        """Checksums blocks that became full (a BlockBatch, or a sequence of
        HashedBlocks; on a device: queued on `cuda_stream`, torch's current
        stream by default, after the forward that filled them) in one call;
        their values are kept once read (`settle`)."""
        batch = stores if isinstance(stores, BlockBatch) else BlockBatch.of(stores)
        if not batch.num_blocks:
            return
        batch = batch.only_groups(self._buffers)
        if not batch.num_blocks:
            return
        # A block id freed and filled again would overwrite a value not yet
        # read: earlier stores are read first (their work is long done).
        self.settle(wait=True)
        with kvcsum.Blocks() as call:
            batch.add_to(call)
            if self.checksummer.device != kvcsum.HOST and cuda_stream is None:
                import torch

                cuda_stream = torch.cuda.current_stream(self.checksummer.device).cuda_stream
            result = self.checksummer.worker.store(call, cuda_stream)
        self._pending.append((result, batch))

    @staticmethod
    def sums(result: "kvcsum.Result", req_id: str, group_id: int, first: int, count: int):
        """The sum of a group's columns per position (numpy uint64, wrapping
        as the checksums do), None where the worker did not checksum it."""
        try:
            got_first, positions, columns = result.group(req_id, group_id)
        except kvcsum.Error:
            return None
        if got_first != first or positions != count or columns == 0:
            return None
        total = np.zeros(positions, dtype=np.uint64)
        for column in range(columns):
            total += result.column(req_id, group_id, column)
        return total

    def settle(self, wait: bool) -> None:
        """Keeps the values of the stored blocks checksummed so far: those
        whose results are ready, or all of them when `wait`."""
        kept = []
        for result, entries in self._pending:
            if not wait and not result.ready():
                kept.append((result, entries))
                continue
            try:
                result.wait()
                self._keep(result, entries)
            finally:
                result.close()
        self._pending = kept

    def _keep(self, result, batch: BlockBatch) -> None:
        """Keeps the values a store wrote of a batch's blocks (the buffer
        holds sum XOR tag, SPEC section 8)."""
        worker = self.checksummer.worker
        for group_id in batch.groups:
            chosen = slice(None) if len(batch.groups) == 1 else batch.block_groups == group_id
            ids, hashes = batch.block_ids[chosen], batch.hashes[chosen]
            sums = self._buffers[group_id][ids, 0] ^ worker.block_tags(group_id, hashes)
            self.values.remember_many(group_id, hashes, batch.positions[chosen], sums)

    def check(self, blocks: HashedBlocks, fail_unknown: bool = False, cuda_stream: int | None = None) -> TierComparison:
        """Compares loaded blocks with the values kept (waiting for the
        checksums of earlier stores and of these blocks)."""
        self.settle(wait=True)
        pending = self.checksummer.checksum([blocks.job()], kvcsum.CONSUMER, cuda_stream)
        result = pending.result
        matched, mismatched, unknown, invalid = 0, [], {}, set()
        try:
            result.wait()
            for group_id, (first, ids, hashes) in sorted(blocks.groups.items()):
                sums = self.sums(result, blocks.req_id, group_id, first, len(ids))
                for i, (block_id, block_hash) in enumerate(zip(ids, hashes)):
                    if sums is None:
                        outcome = BlockOutcome(UNKNOWN, "NOT_CHECKSUMMED")
                    else:
                        outcome = self.values.compare(group_id, block_hash, first + i, int(sums[i]))
                    if outcome.outcome == MATCHED:
                        matched += 1
                    elif outcome.outcome == MISMATCHED:
                        mismatched.append(block_id)
                        invalid.add(block_id)
                    else:
                        unknown[outcome.reason] = unknown.get(outcome.reason, 0) + 1
                        if fail_unknown:
                            invalid.add(block_id)
        finally:
            result.close()
        return TierComparison(matched, tuple(mismatched), unknown, frozenset(invalid))
