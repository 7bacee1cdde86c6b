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

`TorchRecordExchange` gathers over a torch.distributed group
(gather_object to the group's rank 0). `engine_exchange` picks vLLM's group
of this engine's workers, or says why there is none:

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
from typing import Protocol

__all__ = ["LoadRecord", "WorkerRecords", "RecordExchange", "TorchRecordExchange", "engine_exchange"]


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

    def gather(self, worker_key: str, records: list) -> list | None:
        """Called once a step by every worker of the engine, with its
        LoadRecords: every worker's WorkerRecords on the judging worker,
        None on the others."""


class TorchRecordExchange:
    """gather_object over a torch.distributed process group (a CPU group:
    the records are pickled), to the group's rank `judge`."""

    def __init__(self, group, judge: int = 0):
        import torch.distributed as dist

        self._group = group
        self._judge = judge
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    @property
    def judges(self) -> bool:
        """Whether this worker is the one that gets the records."""
        return self._rank == self._judge

    def gather(self, worker_key: str, records: list) -> list | None:
        import torch.distributed as dist

        gathered = [None] * self._size if self.judges else None
        dist.gather_object(WorkerRecords(worker_key, tuple(records)), gathered, group=self._group, group_dst=self._judge)
        return gathered


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
