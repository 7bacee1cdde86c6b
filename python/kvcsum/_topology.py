"""Transfer topology (SPEC section 11): the TP and block-size helpers,
Topology, and the Completion counter."""

from __future__ import annotations

import ctypes
import dataclasses
from ctypes import byref, c_char_p, c_int64, c_uint8, c_uint32
from typing import Iterable, Sequence

from . import _lib
from ._base import _Handle, _block_ids, _c, _check, _create, _enum, _flag, _int, _of_type, _sized, library
from ._constants import Direction

# --- Topology (SPEC section 11) -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class HeadSource:
    """A run of a local rank's heads and the remote rank that supplies it.

    Thread safety: immutable (a frozen dataclass); share it freely."""

    remote_rank: int
    first_head: int
    num_heads: int
    local_offset: int
    remote_offset: int


@dataclasses.dataclass(frozen=True)
class RemoteEngine:
    """What a remote engine's handshake told.

    Thread safety: immutable (a frozen dataclass); share it freely."""

    tp_size: int
    block_bytes: int
    block_size: int
    kernel_blocks: int = 1


def _u32_list(call) -> list[int]:
    buffer, length = _sized(call, c_uint32)
    return list(buffer[:length])


def _head_sources(call) -> list[HeadSource]:
    buffer, length = _sized(call, _lib.HeadSourceStruct)
    return [
        HeadSource(s.remote_rank, s.first_head, s.num_heads, s.local_offset, s.remote_offset) for s in buffer[:length]
    ]


def tp_ratio(local_tp: int, remote_tp: int) -> int:
    """local/remote when local >= remote, else -(remote/local); InvalidArgument
    when the sizes do not divide, or a size is 0 or above KVCS_MAX_TP_SIZE
    (65536)."""
    local_tp, remote_tp = _int(local_tp, "uint32_t", "local_tp"), _int(remote_tp, "uint32_t", "remote_tp")
    value = c_int64()
    _check(library().kvcs_tp_ratio(local_tp, remote_tp, byref(value)))
    return value.value


def _ranks_args(local_rank, local_tp, remote_tp) -> tuple[int, int, int]:
    return (
        _int(local_rank, "uint32_t", "local_rank"),
        _int(local_tp, "uint32_t", "local_tp"),
        _int(remote_tp, "uint32_t", "remote_tp"),
    )


def remote_ranks(local_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """The remote ranks local rank `local_rank` reads from."""
    lib = library()
    args = _ranks_args(local_rank, local_tp, remote_tp)
    return _u32_list(lambda buf, cap, n: lib.kvcs_remote_ranks(*args, buf, cap, n))


def handshake_targets(local_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """The remote ranks to handshake with, from the TP sizes alone."""
    lib = library()
    args = _ranks_args(local_rank, local_tp, remote_tp)
    return _u32_list(lambda buf, cap, n: lib.kvcs_handshake_targets(*args, buf, cap, n))


def block_size_ratio(local_block_size: int, remote_block_size: int) -> int:
    """local/remote block size; InvalidArgument when not whole."""
    local_block_size = _int(local_block_size, "uint32_t", "local_block_size")
    remote_block_size = _int(remote_block_size, "uint32_t", "remote_block_size")
    value = c_uint32()
    _check(library().kvcs_block_size_ratio(local_block_size, remote_block_size, byref(value)))
    return value.value


def remote_kv_replicated(remote_tp: int, total_kv_heads: int) -> bool:
    """Whether the remote engine replicates KV heads (remote_tp > heads)."""
    remote_tp = _int(remote_tp, "uint32_t", "remote_tp")
    total_kv_heads = _int(total_kv_heads, "uint32_t", "total_kv_heads")
    value = c_uint32()
    _check(library().kvcs_remote_kv_replicated(remote_tp, total_kv_heads, byref(value)))
    return bool(value.value)


def local_kv_replicated(tp: int, total_kv_heads: int, is_mla: bool = False) -> bool:
    """Whether the local engine replicates KV heads (MLA, or tp > heads)."""
    tp, total_kv_heads = _int(tp, "uint32_t", "tp"), _int(total_kv_heads, "uint32_t", "total_kv_heads")
    value = c_uint32()
    _check(library().kvcs_local_kv_replicated(tp, total_kv_heads, _flag(is_mla, "is_mla"), byref(value)))
    return bool(value.value)


def rank_heads(rank: int, tp: int, total_kv_heads: int, is_mla: bool = False) -> range:
    """The global heads rank `rank` of an engine of TP size `tp` holds."""
    rank, tp = _int(rank, "uint32_t", "rank"), _int(tp, "uint32_t", "tp")
    total_kv_heads = _int(total_kv_heads, "uint32_t", "total_kv_heads")
    first, count = c_uint32(), c_uint32()
    _check(library().kvcs_rank_heads(rank, tp, total_kv_heads, _flag(is_mla, "is_mla"), byref(first), byref(count)))
    return range(first.value, first.value + count.value)


def head_sources(
    local_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int, is_mla: bool = False
) -> list[HeadSource]:
    """For local rank `local_rank`, each run of its heads with the remote
    rank that supplies it."""
    lib = library()
    args = _ranks_args(local_rank, local_tp, remote_tp) + (
        _int(total_kv_heads, "uint32_t", "total_kv_heads"),
        _flag(is_mla, "is_mla"),
    )
    return _head_sources(lambda buf, cap, n: lib.kvcs_head_sources(*args, buf, cap, n))


class Topology(_Handle):
    """One local worker's view of the engines it transfers with
    (kvcs_topology): per remote engine id, what its handshake told.

    Thread safety: add_remote needs the topology alone (it waits for calls
    in progress); the queries run concurrently."""

    _destroy = "kvcs_topology_destroy"

    def __init__(
        self, local_engine_id: str, *, tp_rank: int, tp_size: int, total_kv_heads: int, block_size: int, is_mla: bool = False
    ):
        # Struct fields are checked against their C types as they are set.
        local = _lib.LocalEngineStruct(
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_kv_heads=total_kv_heads,
            is_mla=_flag(is_mla, "is_mla"),
            block_size=block_size,
        )
        engine = _c(local_engine_id, "local_engine_id")
        super().__init__(_create(library().kvcs_topology_create, engine, byref(local)))
        self._local_engine_id = local_engine_id
        self._local = local
        self._remotes = 0  # added through this object, for the repr

    def _describe(self) -> str:
        local = self._local
        return (
            f"{self._local_engine_id!r} tp_rank={local.tp_rank} tp_size={local.tp_size} "
            f"total_kv_heads={local.total_kv_heads} block_size={local.block_size} is_mla={bool(local.is_mla)} "
            f"remotes={self._remotes}"
        )

    def add_remote(self, engine_id: str, remote: RemoteEngine) -> bool:
        """Records a handshake; False when the engine was known (kept as first told)."""
        engine = _c(engine_id, "engine_id")
        _of_type(remote, RemoteEngine, "remote")
        struct = _lib.RemoteEngineStruct(
            block_bytes=remote.block_bytes,
            tp_size=remote.tp_size,
            block_size=remote.block_size,
            kernel_blocks=remote.kernel_blocks,
        )
        added = c_uint32()
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_topology_add_remote(handle, engine, byref(struct), byref(added)))
            self._remotes += bool(added.value)
        return bool(added.value)

    def remote(self, engine_id: str) -> RemoteEngine:
        """What `engine_id`'s handshake told; NotFound when none."""
        engine = _c(engine_id, "engine_id")
        struct = _lib.RemoteEngineStruct()
        with self._use() as handle:
            _check(self._lib.kvcs_topology_remote(handle, engine, byref(struct)))
        return RemoteEngine(struct.tp_size, struct.block_bytes, struct.block_size, struct.kernel_blocks)

    def tp_ratio(self, engine_id: str) -> int:
        """tp_ratio of the local engine and `engine_id`."""
        engine = _c(engine_id, "engine_id")
        value = c_int64()
        with self._use() as handle:
            _check(self._lib.kvcs_topology_tp_ratio(handle, engine, byref(value)))
        return value.value

    def block_size_ratio(self, engine_id: str) -> int:
        """block_size_ratio of the local engine and `engine_id`."""
        engine = _c(engine_id, "engine_id")
        value = c_uint32()
        with self._use() as handle:
            _check(self._lib.kvcs_topology_block_size_ratio(handle, engine, byref(value)))
        return value.value

    def remote_kv_replicated(self, engine_id: str) -> bool:
        """Whether `engine_id` replicates KV heads."""
        engine = _c(engine_id, "engine_id")
        value = c_uint32()
        with self._use() as handle:
            _check(self._lib.kvcs_topology_remote_kv_replicated(handle, engine, byref(value)))
        return bool(value.value)

    def remote_ranks(self, engine_id: str) -> list[int]:
        """The ranks of `engine_id` this worker reads from."""
        engine = _c(engine_id, "engine_id")
        with self._use() as handle:
            return _u32_list(lambda buf, cap, n: self._lib.kvcs_topology_remote_ranks(handle, engine, buf, cap, n))

    def head_sources(self, engine_id: str) -> list[HeadSource]:
        """Which rank of `engine_id` supplies each run of this worker's heads."""
        engine = _c(engine_id, "engine_id")
        with self._use() as handle:
            return _head_sources(
                lambda buf, cap, n: self._lib.kvcs_topology_head_sources(handle, engine, buf, cap, n)
            )


class Completion(_Handle):
    """Says when every expected worker reported a request finished sending
    or receiving (kvcs_completion); unites invalid block ids.

    Thread safety: report, set_expected, add_invalid_blocks and
    clear_invalid_blocks need the counter alone (they wait for calls in
    progress); reported and invalid_blocks run concurrently."""

    _destroy = "kvcs_completion_destroy"

    def __init__(self, expected_workers: int):
        expected_workers = _int(expected_workers, "uint32_t", "expected_workers")
        super().__init__(_create(library().kvcs_completion_create, expected_workers))
        self._expected_workers = expected_workers

    def _describe(self) -> str:
        return f"expected_workers={self._expected_workers}"

    def set_expected(self, expected_workers: int) -> None:
        """The expected count (at least 1; InvalidArgument for 0) for
        requests first reported from now on."""
        expected_workers = _int(expected_workers, "uint32_t", "expected_workers")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_completion_set_expected(handle, expected_workers))
            self._expected_workers = expected_workers

    def report(
        self, worker: int, direction: int, req_ids: Sequence[str], expected_workers: int | None = None
    ) -> list[str]:
        """Worker `worker` finished `req_ids` in `direction` (SENDING or
        RECEIVING); returns the requests this report completed.

        A worker's output may carry a new expected count (vLLM's
        KVConnectorOutput.expected_finished_count): pass it as
        `expected_workers`; it applies from this report's new requests on.
        None or 0 means no change, as 0 does in vLLM (the field's default,
        which its aggregator ignores); any other value goes to
        set_expected (a negative one or a bool is refused)."""
        worker = _int(worker, "uint32_t", "worker")
        direction = _enum(direction, Direction, "direction")
        if isinstance(req_ids, (str, bytes)):
            raise TypeError(f"req_ids must be a sequence of str, got one {type(req_ids).__name__}")
        req_ids = list(req_ids)
        encoded = [_c(r, f"req_ids[{i}]") for i, r in enumerate(req_ids)]
        if expected_workers is not None and _int(expected_workers, "uint32_t", "expected_workers"):
            self.set_expected(expected_workers)
        ids = (c_char_p * max(len(encoded), 1))(*encoded)
        done = (c_uint8 * max(len(encoded), 1))()
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_completion_report(handle, worker, direction, ids, len(encoded), done))
        return [r for r, d in zip(req_ids, done) if d]

    def reported(self, direction: int, req_id: str) -> int:
        """Workers that reported `req_id` so far (0 once it completed)."""
        direction = _enum(direction, Direction, "direction")
        req = _c(req_id, "req_id")
        value = c_uint32()
        with self._use() as handle:
            _check(self._lib.kvcs_completion_reported(handle, direction, req, byref(value)))
        return value.value

    def add_invalid_blocks(self, block_ids: Iterable[int]) -> None:
        """Adds block ids a worker found invalid."""
        ids = _block_ids(block_ids)
        pointer = ids.ctypes.data_as(ctypes.POINTER(c_uint32)) if ids.size else None
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_completion_add_invalid_blocks(handle, pointer, ids.size))

    def invalid_blocks(self) -> set[int]:
        """The union of invalid block ids since the last clear."""
        with self._use() as handle:
            return set(_u32_list(lambda buf, cap, n: self._lib.kvcs_completion_invalid_blocks(handle, buf, cap, n)))

    def clear_invalid_blocks(self) -> None:
        """Forgets the invalid block ids."""
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_completion_clear_invalid_blocks(handle))
