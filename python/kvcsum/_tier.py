"""TierIndex (kvcs_tier_index): the values of a worker's full blocks by
block hash, stored and compared in one call each, from numpy arrays."""

from __future__ import annotations

import ctypes
from ctypes import c_size_t, c_uint64, c_void_p

import numpy as np

from ._base import _Handle, _check, _create, _int, _of_type, _stream, library
from ._constants import TierOutcome
from ._worker import Worker

__all__ = ["TierIndex", "TierOutcome"]

_U32, _U64 = np.dtype(np.uint32), np.dtype(np.uint64)


def _raw(name: str, argtypes: list):
    """A second declaration of `name` taking plain addresses and sizes (the
    arrays are checked here; the checked wrappers would cost more than the
    call on a decode step's few blocks)."""
    function = library().cdll[name]
    function.restype = ctypes.c_int
    function.argtypes = argtypes
    return function


_STORE_ARGS = [c_void_p, c_void_p, c_size_t, c_void_p, c_void_p, c_void_p, c_void_p, c_size_t, c_void_p]
_CHECK_ARGS = _STORE_ARGS[:8] + [c_void_p, c_void_p, c_void_p]


def _array(values, dtype: np.dtype, name: str, count: int | None) -> np.ndarray:
    """`values` as a contiguous 1-D array of `dtype` (of `count` entries):
    TypeError for another kind, ValueError for a value `dtype` cannot hold
    or another length."""
    if type(values) is np.ndarray and values.dtype == dtype and values.ndim == 1 and values.flags.c_contiguous:
        array = values
    else:
        array = np.asarray(values)
        if array.size == 0:
            array = np.zeros(0, dtype=dtype)
        elif array.ndim != 1 or array.dtype.kind not in "iu":
            raise TypeError(f"{name} must be a 1-D sequence of integers, got dtype {array.dtype} shape {array.shape}")
        elif array.dtype != dtype:
            low, high = int(array.min()), int(array.max())
            if low < 0 or high > np.iinfo(dtype).max:
                raise ValueError(f"{name} must be in [0, {np.iinfo(dtype).max}]: got {low} .. {high}")
            array = np.ascontiguousarray(array, dtype=dtype)
    if count is not None and array.size != count:
        raise ValueError(f"{name} has {array.size} entries, group_ids {count}")
    return array


def _hashes(hashes, count: int) -> np.ndarray:
    """The block hashes as a contiguous 2-D uint8 array, a row per block."""
    if not (type(hashes) is np.ndarray and hashes.dtype == np.uint8 and hashes.flags.c_contiguous):
        hashes = np.ascontiguousarray(hashes, dtype=np.uint8) if isinstance(hashes, np.ndarray) else np.array(hashes, dtype=np.uint8)
    if hashes.ndim != 2 or hashes.shape[0] != count:
        raise ValueError(f"hashes must be a 2-D uint8 array of {count} rows (a row per block), got shape {hashes.shape}")
    return hashes


class TierIndex(_Handle):
    """A bounded index of one worker's block values by (group, block hash)
    (kvcs_tier_index; docs/vllm-tiers.md): `store` checksums the blocks a
    step filled and keeps their values, `check` compares loaded blocks with
    them, each in one call from numpy arrays. At most `capacity` entries,
    at most KVCS_TIER_INDEX_ENTRY_BYTES (112) bytes each; the least
    recently stored or matched goes first when full.

    Thread safety: store and check need the index alone (they wait for
    each other); info and values may run concurrently."""

    _destroy = "kvcs_tier_index_destroy"

    def __init__(self, capacity: int):
        capacity = _int(capacity, "uint64_t", "capacity")
        super().__init__(_create(library().kvcs_tier_index_create, capacity))
        self.capacity = capacity
        self._store_fn = _raw("kvcs_tier_index_store", _STORE_ARGS)
        self._check_fn = _raw("kvcs_tier_index_check", _CHECK_ARGS)
        # The workers whose device work a store may still have queued: their
        # caches must outlive it.
        self._workers: list = []

    def _describe(self) -> str:
        with self._use(wait=False) as handle:
            entries = c_uint64()
            _check(self._lib.kvcs_tier_index_info(handle, ctypes.byref(entries), None, None, None))
        return f"entries={entries.value} capacity={self.capacity}"

    def _remember(self, worker: Worker) -> None:
        if worker not in self._workers:
            self._workers.append(worker)

    def store(self, worker: Worker, group_ids, positions, block_ids, hashes, cuda_stream=None) -> None:
        """Checksums full blocks (block_ids[i] at positions[i] of group
        group_ids[i], hash hashes[i], a 2-D uint8 array of a row per block)
        and keeps their values: on a host worker before it returns, on a
        device worker once the work queued on `cuda_stream` is done (read by
        a later call). Arrays of the right dtype (uint32, uint64, uint32,
        uint8) pass without a copy."""
        _of_type(worker, Worker, "worker")
        group_ids = _array(group_ids, _U32, "group_ids", None)
        count = group_ids.size
        positions = _array(positions, _U64, "positions", count)
        block_ids = _array(block_ids, _U32, "block_ids", count)
        hashes = _hashes(hashes, count)
        stream = _stream(cuda_stream)
        self._remember(worker)
        with self._use(exclusive=True) as handle, worker._use(exclusive=True) as worker_handle:
            _check(
                self._store_fn(
                    handle, worker_handle, count, group_ids.ctypes.data, positions.ctypes.data, block_ids.ctypes.data,
                    hashes.ctypes.data, hashes.shape[1], stream,
                )
            )

    def store_buffers(self, worker: Worker, count: int, group_ids, positions, block_ids, hashes, hash_bytes: int, cuda_stream=None) -> None:
        """`store` from machine arrays as they are, without a copy: `count`
        blocks, `group_ids` and `block_ids` uint32 and `positions` uint64
        array.array objects (typecodes "I"/"L" of 4 bytes, "Q"), `hashes`
        bytes of `count * hash_bytes` (what kvcsum.vllm's StoreBatch holds).
        Lengths and item sizes are checked (ValueError) before the call."""
        # What the C call reads of each buffer is checked here (it cannot
        # know their lengths); the values it checks itself.
        if not (
            len(group_ids) == len(positions) == len(block_ids) == count
            and group_ids.itemsize == block_ids.itemsize == 4 and positions.itemsize == 8
            and type(hashes) is bytes and type(hash_bytes) is int and len(hashes) == count * hash_bytes
        ):
            raise ValueError(
                f"store_buffers: {count} blocks need group_ids, block_ids (uint32), positions (uint64) of that length "
                f"and {count} x {hash_bytes} hash bytes; got lengths {len(group_ids)}, {len(block_ids)}, "
                f"{len(positions)} and {len(hashes)} bytes"
            )
        stream = _stream(cuda_stream) if cuda_stream is not None else None
        if worker not in self._workers:
            _of_type(worker, Worker, "worker")
            self._workers.append(worker)
        handle = self._acquire(True)
        try:
            worker_handle = worker._acquire(True)
            try:
                status = self._store_fn(
                    handle, worker_handle, count, group_ids.buffer_info()[0], positions.buffer_info()[0],
                    block_ids.buffer_info()[0], hashes, hash_bytes, stream,
                )
            finally:
                worker._release()
        finally:
            self._release()
        if status:
            _check(status)

    def check(self, worker: Worker, group_ids, positions, block_ids, hashes, hashed=None, cuda_stream=None) -> np.ndarray:
        """Compares loaded blocks with the values kept: a numpy uint8 array
        of a TierOutcome per block. `hashed`: None (every block has a hash)
        or a bool/uint8 flag per block (a block without one, whose row of
        `hashes` is not read, is NO_BLOCK_HASH)."""
        _of_type(worker, Worker, "worker")
        group_ids = _array(group_ids, _U32, "group_ids", None)
        count = group_ids.size
        positions = _array(positions, _U64, "positions", count)
        block_ids = _array(block_ids, _U32, "block_ids", count)
        hashes = _hashes(hashes, count)
        flags = None
        if hashed is not None:
            flags = np.ascontiguousarray(hashed, dtype=np.uint8)
            if flags.shape != (count,):
                raise ValueError(f"hashed has shape {flags.shape}, group_ids {count} entries")
        outcomes = np.zeros(count, dtype=np.uint8)
        stream = _stream(cuda_stream)
        with self._use(exclusive=True) as handle, worker._use(exclusive=True) as worker_handle:
            _check(
                self._check_fn(
                    handle, worker_handle, count, group_ids.ctypes.data, positions.ctypes.data, block_ids.ctypes.data,
                    hashes.ctypes.data, hashes.shape[1], None if flags is None else flags.ctypes.data, stream,
                    outcomes.ctypes.data,
                )
            )
        return outcomes

    def info(self) -> dict:
        """{"entries", "dropped", "lost_stores", "memory_bytes"} now."""
        values = [c_uint64() for _ in range(4)]
        with self._use() as handle:
            _check(self._lib.kvcs_tier_index_info(handle, *(ctypes.byref(v) for v in values)))
        return dict(zip(("entries", "dropped", "lost_stores", "memory_bytes"), (v.value for v in values)))

    def __len__(self) -> int:
        return self.info()["entries"]

    def values(self, group_id: int, block_hash: bytes) -> tuple | None:
        """(position, (values...)) kept for a hash, None when none are (or
        too many). Stores still queued on a device are not read."""
        group_id = _int(group_id, "uint32_t", "group_id")
        data = bytes(block_hash)
        buffer = (c_uint64 * 8)()
        position, length = c_uint64(), c_size_t()
        source = (ctypes.c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        with self._use() as handle:
            _check(
                self._lib.kvcs_tier_index_values(
                    handle, group_id, source, len(data), ctypes.byref(position), buffer, 8, ctypes.byref(length)
                )
            )
        if not length.value:
            return None
        return position.value, tuple(buffer[: length.value])
