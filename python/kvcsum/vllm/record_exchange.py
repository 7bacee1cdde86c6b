"""How a consumer engine's workers bring their records of a step's sync
P/D loads together in one worker, which judges them in that step.

A sync load's verdict needs every worker's record (each holds its own TP
heads and PP layers). vLLM reads the step's load errors
(get_block_ids_with_load_errors) before it emits the step's tokens, and
unions them over workers, so it is enough that one worker, holding all
records, judges and reports them there. `RecordExchange.gather` is that
meeting point: every worker calls it once in a step that has sync loads to
judge (the scheduler names them in the step's metadata, the same for
every worker), with its records; the judging worker gets all workers'
`WorkerRecords`, the others None.

`TorchRecordExchange` gathers over a torch.distributed group to the
group's rank 0 in one fixed-size collective: each worker packs its
records into a byte tensor of a size every worker computes alike from
the step's sync loads (`record_bound`: their blocks and the workers'
layers and columns), and one `gather` brings them together. A worker whose
records do not fit (never, with the bound's margin) sends none, and its
records count as missing (UNVERIFIED, WORKERS_MISSING): never a
mismatch. Without a bound it falls back to gather_object (pickled).
`engine_exchange` picks vLLM's group of this engine's workers, or says
why there is none:

- pipeline parallelism: an earlier stage sends its activations to the next
  only after the connector's calls of the step returned (vLLM 0.33's
  Worker.execute_model), so a gather across stages in one of those calls
  would wait for a stage that waits for it. With several PP stages the
  scheduler judges sync loads, a step late;
- vLLM's world group spans every data-parallel engine (its
  torch.distributed world is world_size_across_dp), whose steps are not
  this engine's; with one PP stage the TP group is exactly this engine's
  workers, so that group is used;
- torch.distributed not initialized, no TP group, prefill context
  parallelism (workers the connector does not count), or the external
  launcher (every rank has its own scheduler, and only the judging rank's
  would hear of the load errors).

The test harness, whose ranks run one after another in one process, has an
exchange of its own (python/tests/vllm/harness.py).
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from typing import Protocol

__all__ = [
    "LoadRecord",
    "WorkerRecords",
    "RecordExchange",
    "TorchRecordExchange",
    "engine_exchange",
    "record_bound",
    "pack_records",
    "unpack_records",
]

#: A packed message: magic, version, its length, the worker key's length,
#: the records' count; then the key, and per record its generation, the
#: request id's length, the record's length (NONE: no record), the id and
#: the record.
_MAGIC, _VERSION = b"KVRX", 1
_HEAD = struct.Struct("<4sBIHI")
_ITEM = struct.Struct("<QHI")
_NONE = 0xFFFFFFFF


def record_bound(num_blocks: int, num_groups: int, num_layers: int, num_columns: int, num_loads: int) -> int:
    """Bytes that every worker's packed records of a step's sync loads fit
    in: the same on every worker of the engine (from the scheduler's jobs,
    the same for all, and the engine's layers and TP size). A record is
    about 100 bytes, 8 a block and column and 6 a layer (measured); the
    bound doubles that, with room for the ids."""
    columns = max(1, num_columns)
    return 1024 + num_loads * 320 + 16 * num_blocks * columns + 64 * num_groups + 16 * num_layers * max(1, num_loads)


def pack_records(worker_key: str, records: list) -> bytes:
    """One worker's LoadRecords as bytes (unpack_records reads them)."""
    key = worker_key.encode()
    parts = [b""]
    for record in records:
        req = record.req_id.encode()
        body = record.record if record.record is not None else b""
        length = len(body) if record.record is not None else _NONE
        parts.append(_ITEM.pack(int(record.generation), len(req), length))
        parts.append(req)
        parts.append(body)
    payload = b"".join(parts)
    return _HEAD.pack(_MAGIC, _VERSION, _HEAD.size + len(key) + len(payload), len(key), len(records)) + key + payload


def unpack_records(data) -> "WorkerRecords | None":
    """The WorkerRecords of a packed message (None for an empty one: a
    worker whose records did not fit)."""
    try:
        return _unpack(memoryview(data))
    except (struct.error, UnicodeDecodeError):
        return None


def _unpack(view) -> "WorkerRecords | None":
    if len(view) < _HEAD.size:
        return None
    magic, version, length, key_length, count = _HEAD.unpack_from(view, 0)
    if magic != _MAGIC or version != _VERSION or length > len(view):
        return None
    at = _HEAD.size
    worker = bytes(view[at : at + key_length]).decode()
    at += key_length
    records = []
    for _ in range(count):
        generation, req_length, record_length = _ITEM.unpack_from(view, at)
        at += _ITEM.size
        req_id = bytes(view[at : at + req_length]).decode()
        at += req_length
        body = None
        if record_length != _NONE:
            body = bytes(view[at : at + record_length])
            at += record_length
        records.append(LoadRecord(req_id, generation, body))
    return WorkerRecords(worker, tuple(records))


@dataclasses.dataclass(frozen=True)
class LoadRecord:
    """One worker's record of a sync load: the scheduler's `generation` of
    the load, and the record bytes (None where it checksummed nothing)."""

    req_id: str
    generation: int
    record: bytes | None


@dataclasses.dataclass(frozen=True)
class WorkerRecords:
    """A worker's records of one step's sync loads (`worker`: "pp0.tp1")."""

    worker: str
    records: tuple = ()


class RecordExchange(Protocol):
    """Where the workers' records of a step meet."""

    def gather(self, worker_key: str, records: list, bound: int | None = None) -> list | None:
        """Called once a step by every worker of the engine, with its
        LoadRecords and the step's `record_bound` (alike on every worker):
        every worker's WorkerRecords on the judging worker, None on the
        others."""


class TorchRecordExchange:
    """The records of a step over a torch.distributed process group (a CPU
    group), to the group's rank `judge`: one gather of a byte tensor of the
    step's bound (gather_object without one)."""

    def __init__(self, group, judge: int = 0):
        import torch.distributed as dist

        self._group = group
        self._judge = judge
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self.overflows = 0  # steps whose records did not fit the bound

    @property
    def judges(self) -> bool:
        """Whether this worker is the one that gets the records."""
        return self._rank == self._judge

    def gather(self, worker_key: str, records: list, bound: int | None = None) -> list | None:
        import torch
        import torch.distributed as dist

        if bound is None:
            gathered = [None] * self._size if self.judges else None
            dist.gather_object(WorkerRecords(worker_key, tuple(records)), gathered, group=self._group, group_dst=self._judge)
            return gathered
        message = pack_records(worker_key, records)
        size = max(int(bound), _HEAD.size)
        if len(message) > size:
            # Sent as none: the judge counts this worker's records missing.
            self.overflows += 1
            logging.getLogger("vllm.kvcsum").error(
                "kvcsum: worker %s: its records of this step's sync loads (%d bytes) do not fit the bound of %d bytes; "
                "they count as missing (UNVERIFIED, WORKERS_MISSING)",
                worker_key, len(message), size,
            )
            message = b""
        buffer = bytearray(size)
        buffer[: len(message)] = message
        tensor = torch.frombuffer(buffer, dtype=torch.uint8)
        into = [torch.empty(size, dtype=torch.uint8) for _ in range(self._size)] if self.judges else None
        dist.gather(tensor, into, group=self._group, group_dst=self._judge)
        if into is None:
            return None
        out = []
        for rank, received in enumerate(into):
            unpacked = unpack_records(received.numpy())
            # With one PP stage (the only case with an exchange) the group's
            # ranks are the TP ranks.
            out.append(unpacked if unpacked is not None else WorkerRecords(f"pp0.tp{rank}", ()))
        return out


def engine_exchange(vllm_config) -> tuple[TorchRecordExchange | None, str]:
    """The exchange over this engine's workers, or (None, why there is
    none); the same answer on every worker of the engine (it depends on the
    engine's config and on vLLM's groups, which every worker has alike)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None:
        return None, "the worker has no vLLM parallel config"
    if int(parallel.pipeline_parallel_size) > 1:
        return None, (
            f"pipeline parallelism ({parallel.pipeline_parallel_size} stages): an earlier stage sends its activations "
            "on only after the connector's calls of the step return, so the stages cannot meet inside them"
        )
    if getattr(parallel, "distributed_executor_backend", None) == "external_launcher":
        return None, "the external launcher: each rank has a scheduler of its own, which must all hear the same"
    try:
        import torch.distributed as dist
    except ImportError:
        return None, "torch.distributed is missing"
    if not dist.is_available() or not dist.is_initialized():
        return None, "torch.distributed is not initialized"
    from vllm.distributed import parallel_state

    try:
        tp_group = parallel_state.get_tp_group()
    except AssertionError:
        return None, "vLLM's tensor parallel group is not initialized"
    try:
        pcp = parallel_state.get_pcp_group().world_size
    except (AssertionError, AttributeError):
        pcp = 1
    if pcp > 1:
        return None, f"prefill context parallelism ({pcp} ranks)"
    cpu_group = getattr(tp_group, "cpu_group", None)
    if cpu_group is None or int(tp_group.world_size) != int(parallel.tensor_parallel_size):
        return None, (
            f"vLLM's tensor parallel group ({getattr(tp_group, 'world_size', '?')} ranks, CPU group "
            f"{'present' if cpu_group is not None else 'missing'}) is not this engine's {parallel.tensor_parallel_size} workers"
        )
    return TorchRecordExchange(cpu_group), ""
