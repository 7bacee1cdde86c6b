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

`TierChecker` does a worker's part over a CacheChecksummer: the values
live in the library (kvcsum.TierIndex, bounded, its memory stated there);
the blocks that became full in a step (a `StoreBatch` of flat arrays) are
checksummed and kept in one library call (queued on a device: their
values are kept once ready), and a tier load's blocks are compared in one
call. `StoredValues` is the same map in Python, kept as a reference the
tests read.

This module needs neither vLLM nor torch (numpy and kvcsum alone).
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence

import numpy as np

import kvcsum
from kvcsum.vllm.cache_checksums import Job

__all__ = [
    "StoreBatch",
    "EMPTY_STORES",
    "KeptValues",
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
    "UINT32_CODE",
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

#: Blocks a worker keeps values of, by default (at most 112 MiB of host memory
#: a worker per million blocks: docs/vllm-tiers.md).
DEFAULT_CAPACITY = 1 << 20

_POSITION_SHIFT = 64
#: array.array's code of a 32-bit unsigned integer (StoreBatch's block and
#: group ids).
UINT32_CODE = "I" if array.array("I").itemsize == 4 else "L"
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


def uint32_array(values=()) -> array.array:
    """An array.array of uint32 (StoreBatch's block and group ids)."""
    return array.array(UINT32_CODE, values)


@dataclasses.dataclass(frozen=True, slots=True)
class StoreBatch:
    """The blocks that become full in a step, as flat arrays, one entry a
    block: what the scheduler sends the workers each step
    (`KvcsumConnectorMetadata.stores`) and a worker hands its
    kvcsum.TierIndex in one call (block `block_ids[i]` at position
    `positions[i]` of group `group_ids[i]`, its block hash bytes `i *
    hash_bytes ..` of `hashes`). Three machine arrays (array.array:
    uint32, uint64, uint32) and one bytes object however many requests and
    blocks (56 bytes a block with 32-byte hashes), which the worker passes
    to the library as they are."""

    group_ids: array.array = dataclasses.field(default_factory=uint32_array)
    positions: array.array = dataclasses.field(default_factory=lambda: array.array("Q"))
    block_ids: array.array = dataclasses.field(default_factory=uint32_array)
    hashes: bytes = b""
    hash_bytes: int = 8

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @classmethod
    def of_arrays(cls, group_ids: array.array, positions: array.array, block_ids: array.array, hashes: list) -> "StoreBatch":
        """The batch of these blocks: machine arrays as StoreBatch holds
        them and a list of their hashes (bytes of one length; blocks whose
        hash has another length than the first are left out)."""
        if not block_ids:
            return EMPTY_STORES
        size = len(hashes[0])
        joined = b"".join(hashes)
        if len(joined) != size * len(hashes):
            return cls.of_lists(list(group_ids), list(positions), list(block_ids), hashes)
        if cls is not StoreBatch:
            return cls(group_ids, positions, block_ids, joined, size)
        # The scheduler makes one a decode step: its fields are set through
        # their slots directly, as the frozen __init__ would (which looks up
        # object.__setattr__ and the slot on the type for each field: about
        # 6 us of a decode step with cold caches, against 3 this way).
        batch = _new_object(StoreBatch)
        _set_group_ids(batch, group_ids)
        _set_positions(batch, positions)
        _set_block_ids(batch, block_ids)
        _set_hashes(batch, joined)
        _set_hash_bytes(batch, size)
        return batch

    @classmethod
    def of_lists(cls, group_ids: list, positions: list, block_ids: list, hashes: list) -> "StoreBatch":
        """The batch of these blocks (lists of one entry a block; hashes
        bytes of one length). Blocks whose hash has another length than the
        first are left out."""
        if not block_ids:
            return EMPTY_STORES
        size = len(hashes[0])
        joined = b"".join(hashes)
        if len(joined) != size * len(hashes):
            kept = [i for i, h in enumerate(hashes) if len(h) == size]
            group_ids, positions, block_ids = ([v[i] for i in kept] for v in (group_ids, positions, block_ids))
            joined = b"".join(hashes[i] for i in kept)
        return cls(uint32_array(group_ids), array.array("Q", positions), uint32_array(block_ids), joined, size)

    @classmethod
    def of(cls, stores: Sequence[HashedBlocks]) -> "StoreBatch":
        """The batch of these requests' blocks (those with a hash)."""
        group_ids, positions, block_ids, hashes = [], [], [], []
        for blocks in stores:
            for group_id, (first, ids, block_hashes) in blocks.groups.items():
                for i, (block_id, block_hash) in enumerate(zip(ids, block_hashes)):
                    if block_hash is not None:
                        group_ids.append(group_id)
                        positions.append(first + i)
                        block_ids.append(block_id)
                        hashes.append(bytes(block_hash))
        return cls.of_lists(group_ids, positions, block_ids, hashes)


_new_object = object.__new__
# StoreBatch's slots' setters, in field order (of_arrays); a field added
# to StoreBatch must be added here too, which the unpacking checks.
_set_group_ids, _set_positions, _set_block_ids, _set_hashes, _set_hash_bytes = (
    StoreBatch.__dict__[field.name].__set__ for field in dataclasses.fields(StoreBatch)
)
assert not hasattr(StoreBatch, "__post_init__")

#: The batch of no blocks (most decode steps).
EMPTY_STORES = StoreBatch()


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


#: The library's outcome codes (kvcsum.TierOutcome) of unknown blocks, by reason.
_REASONS = {
    int(kvcsum.TierOutcome.NO_BLOCK_HASH): "NO_BLOCK_HASH",
    int(kvcsum.TierOutcome.UNKNOWN_BLOCK): "UNKNOWN_BLOCK",
    int(kvcsum.TierOutcome.TOO_MANY_VALUES): "TOO_MANY_VALUES",
    int(kvcsum.TierOutcome.OTHER_POSITION): "OTHER_POSITION",
    int(kvcsum.TierOutcome.NOT_CHECKSUMMED): "NOT_CHECKSUMMED",
}
_MATCHED, _MISMATCHED = int(kvcsum.TierOutcome.MATCHED), int(kvcsum.TierOutcome.MISMATCHED)


class KeptValues:
    """What a TierChecker's index keeps, for tests and tools: the values
    of a hash (`values(group, hash)`, None when none or too many), the
    entries kept (len) and dropped."""

    def __init__(self, index: "kvcsum.TierIndex"):
        self._index = index
        self.capacity = index.capacity

    def __len__(self) -> int:
        return len(self._index)

    @property
    def dropped(self) -> int:
        return self._index.info()["dropped"]

    def values(self, group_id: int, block_hash: bytes) -> Sequence[int] | None:
        found = self._index.values(group_id, block_hash)
        return None if found is None else found[1]


class TierChecker:
    """A worker's block values over its CacheChecksummer, kept in the
    library (kvcsum.TierIndex: bounded, its memory stated there).

    Args:
        checksummer: the worker's kvcsum.vllm.cache_checksums.CacheChecksummer.
        capacity: the blocks whose values are kept.
    """

    def __init__(self, checksummer, capacity: int = DEFAULT_CAPACITY):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity: {capacity!r} is not a positive number of blocks")
        self.checksummer = checksummer
        self.index = kvcsum.TierIndex(capacity)
        self.values = KeptValues(self.index)
        self._device = checksummer.device != kvcsum.HOST
        #: Whether a device store may still be queued (read by `settle`).
        self.queued = False

    def _stream(self, cuda_stream):
        if self._device and cuda_stream is None:
            import torch

            return torch.cuda.current_stream(self.checksummer.device).cuda_stream
        return cuda_stream

    def store(self, stores, cuda_stream: int | None = None) -> None:
        """Checksums blocks that became full (a StoreBatch, or a sequence of
        HashedBlocks; on a device queued on `cuda_stream`, torch's current
        stream by default, after the forward that filled them) and keeps
        their values, in one library call (on a device once the work is
        done: a later call reads them)."""
        batch = stores if type(stores) is StoreBatch or isinstance(stores, StoreBatch) else StoreBatch.of(stores)
        count = len(batch.block_ids)
        if not count:
            return
        self.index.store_buffers(
            self.checksummer.worker, count, batch.group_ids, batch.positions, batch.block_ids, batch.hashes,
            batch.hash_bytes, self._stream(cuda_stream) if self._device else cuda_stream,
        )
        self.queued = self._device

    def settle(self, wait: bool) -> None:
        """Keeps the values of the stores queued on a device: those done,
        or all of them (waiting) when `wait`."""
        if not self.queued:
            return
        empty = EMPTY_STORES
        worker = self.checksummer.worker
        if wait:
            self.index.check(worker, empty.group_ids, empty.positions, empty.block_ids, np.zeros((0, 8), dtype=np.uint8))
            self.queued = False
        else:
            self.index.store_buffers(worker, 0, empty.group_ids, empty.positions, empty.block_ids, b"", 8)

    def check(self, blocks: HashedBlocks, fail_unknown: bool = False, cuda_stream: int | None = None) -> TierComparison:
        """Compares loaded blocks with the values kept, in one library call
        (which waits for the checksums of earlier stores and of these
        blocks)."""
        group_ids, positions, ids, parts, hashed = [], [], [], [], []
        size = None
        for group_id, (first, block_ids, hashes) in sorted(blocks.groups.items()):
            count = len(block_ids)
            if not count:
                continue
            # A group's blocks without a hash (partial) are its last ones.
            known = count - hashes.count(None)
            if None in hashes[:known]:
                known = hashes.index(None)
            if size is None and known:
                size = len(hashes[0])
            flags = np.zeros(count, dtype=np.uint8)
            flags[:known] = 1
            data = b"".join(hashes[:known])
            if len(data) != known * (size or 0):
                # Hashes of other lengths than the first: no hash here.
                same = [h if len(h) == size else bytes(size) for h in hashes[:known]]
                flags[:known] = [len(h) == size for h in hashes[:known]]
                data = b"".join(same)
            parts.append(data + bytes((size or 8) * (count - known)))
            group_ids.append(np.full(count, group_id, dtype=np.uint32))
            positions.append(np.arange(first, first + count, dtype=np.uint64))
            ids.append(np.asarray(block_ids, dtype=np.uint32))
            hashed.append(flags)
        if not ids:
            return TierComparison(0, (), {}, frozenset())
        if size is None:
            size = 8
            parts = [bytes(8 * len(i)) for i in ids]
        data = b"".join(parts)
        flags = np.concatenate(hashed)
        block_ids = np.concatenate(ids)
        outcomes = self.index.check(
            self.checksummer.worker,
            np.concatenate(group_ids),
            np.concatenate(positions),
            block_ids,
            np.frombuffer(data, dtype=np.uint8).reshape(block_ids.size, size),
            flags,
            self._stream(cuda_stream),
        )
        self.queued = False
        counts = np.bincount(outcomes, minlength=8).tolist()
        mismatched = tuple(block_ids[outcomes == _MISMATCHED].tolist())
        unknown = {reason: counts[code] for code, reason in _REASONS.items() if counts[code]}
        invalid = set(mismatched)
        if fail_unknown and unknown:
            invalid |= set(block_ids[(outcomes != _MATCHED) & (outcomes != _MISMATCHED)].tolist())
        return TierComparison(counts[_MATCHED], mismatched, unknown, frozenset(invalid))
