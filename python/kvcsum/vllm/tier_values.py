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

This module needs neither vLLM nor torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["StoredValues", "BlockOutcome", "MATCHED", "MISMATCHED", "UNKNOWN", "MAX_VALUES", "DEFAULT_CAPACITY"]

#: The outcomes of one loaded block.
MATCHED, MISMATCHED, UNKNOWN = "matched", "mismatched", "unknown"

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
