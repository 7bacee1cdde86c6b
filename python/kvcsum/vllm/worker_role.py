"""KvcsumConnector's worker role: checksums over vLLM's own KV cache tensors
(kvcsum.vllm.cache_checksums), a note per job for the scheduler, and the
verdicts handed to vLLM as load errors.

Each step the worker binds the scheduler's KvcsumConnectorMetadata; after
the forward (`wait_for_save`) it checksums the step's producer jobs and
sync loads; an async load it checksums in the step the wrapped connector
reports it received, and reports it received in that step too (the
scheduler judges it before vLLM reads finished_recving, and holds back one
that failed). Notes go back in KvcsumWorkerMetadata.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvcsum
from kvcsum.vllm.cache_checksums import CacheChecksummer, Job
from kvcsum.vllm.common import KvcsumConnectorMetadata, KvcsumWorkerMetadata, WorkerNote, logger
from kvcsum.vllm.config import layer_specs, parallel_place
from kvcsum.vllm.source_check import WorkerSourceCheck
from kvcsum.vllm.stats import KvcsumStats

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

if TYPE_CHECKING:
    import torch

    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerRole"]


class WorkerRole:
    """The worker side of KvcsumConnector (one per TP rank and PP stage)."""

    def __init__(self, kv_cache_config: "KVCacheConfig", total_kv_heads: int | None):
        self._kv_cache_config = kv_cache_config
        self._total_kv_heads = total_kv_heads
        self._checksummer: CacheChecksummer | None = None
        self._worker_key = "?"
        self._bound: KvcsumConnectorMetadata | None = None
        self._pending_notes: list = []
        self._watch_async: dict = {}
        self._release_recving: set[str] = set()
        self._release_failed: set[str] = set()
        self._invalid_out: set[int] = set()
        self._stats = KvcsumStats()
        self._sources: WorkerSourceCheck | None = None

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        tp_rank, tp_size, pp_rank = parallel_place()
        layers, block_sizes = layer_specs(self._kv_cache_config, self._total_kv_heads)
        self._checksummer = CacheChecksummer(
            layers,
            kv_caches,
            self._kv_cache_config.num_blocks,
            block_sizes,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
        )
        self._worker_key = f"pp{pp_rank}.tp{tp_rank}"
        self._sources = WorkerSourceCheck(
            self._checksummer, self._worker_key, lambda seconds: self._stats.observe_seconds("recheck", seconds)
        )
        for group_id, reason in sorted(self._checksummer.skipped.items()):
            logger.warning("kvcsum: worker %s does not checksum KV cache group %d: %s", self._worker_key, group_id, reason)
        logger.info(
            "kvcsum: worker %s checksums %d layers on %s",
            self._worker_key,
            self._checksummer.layers_registered,
            "the host" if self._checksummer.device == kvcsum.HOST else f"cuda:{self._checksummer.device}",
        )

    def bind(self, meta: KvcsumConnectorMetadata) -> None:
        """bind_connector_metadata: the step's jobs and verdicts."""
        self._bound = meta
        if self._sources is not None:
            self._sources.release(meta.sources_released)
        self._watch_async.update(meta.async_loads)
        for req_id, outcome in meta.verdicts.items():
            self._watch_async.pop(req_id, None)
            if outcome.release:
                # An async load the scheduler held back from vLLM: reported
                # received again now, with its errors (vLLM reads
                # failed_recving only with finished_recving).
                self._release_recving.add(req_id)
                if outcome.failed:
                    self._release_failed.add(req_id)
            self._invalid_out |= set(outcome.invalid_block_ids)

    def clear(self) -> None:
        """clear_connector_metadata."""
        self._bound = None

    def after_forward(self) -> None:
        """wait_for_save, after the inner connector's: the step's producer
        jobs and sync loads are checksummed (queued on a device)."""
        meta = self._bound
        if meta is None or self._checksummer is None:
            return
        for checksum in meta.sends:
            self._note(kvcsum.PRODUCER, checksum.job, checksum.generation)
        for checksum in meta.sync_loads:
            self._note(kvcsum.CONSUMER, checksum.job, checksum.generation)

    def _note(self, role: int, job: Job, generation: int, inner_failed: bool = False) -> None:
        pending = None if inner_failed else self._checksummer.checksum([job], role)
        if role == kvcsum.PRODUCER and self._sources is not None:
            self._sources.made(job, pending)
        self._pending_notes.append((role, job.req_id, generation, pending, inner_failed))

    def transfer_results(self, inner: KVConnectorTransferResults) -> KVConnectorTransferResults:
        """get_transfer_results, from the inner connector's: an async load
        being verified is checksummed in the step the inner connector
        reports it received, and reported received in that step too (the
        scheduler takes it out again if it fails: SchedulerRole.received)."""
        results = KVConnectorTransferResults(
            finished_sending=set(inner.finished_sending or ()),
            finished_recving=set(),
            failed_recving=set(),
        )
        if self._sources is not None:
            # Sent: the blocks are checksummed again before vLLM frees them.
            self._sources.sending_finished(results.finished_sending)
        for req_id in inner.finished_recving or ():
            results.finished_recving.add(req_id)
            failed = req_id in (inner.failed_recving or ())
            if failed:
                results.failed_recving.add(req_id)
            watched = self._watch_async.pop(req_id, None)
            if watched is not None and self._checksummer is not None:
                self._note(kvcsum.CONSUMER, watched.job, watched.generation, inner_failed=failed)
        results.finished_recving |= self._release_recving
        results.failed_recving |= self._release_failed & (self._release_recving | results.finished_recving)
        self._release_failed -= results.failed_recving
        self._release_recving.clear()
        return results

    def load_errors(self, inner: set[int]) -> set[int]:
        """get_block_ids_with_load_errors, with the inner connector's."""
        out = set(inner) | self._invalid_out
        self._invalid_out = set()
        return out

    def build_meta(self, inner) -> KvcsumWorkerMetadata | None:
        """build_connector_worker_meta, around the inner connector's."""
        if self._sources is not None:
            self._sources.collect()  # before the records close their results
        notes = []
        for role, req_id, generation, pending, inner_failed in self._pending_notes:
            record = pending.record() if pending is not None else None
            if pending is not None:
                self._stats.observe_seconds("send" if role == kvcsum.PRODUCER else "load", pending.seconds)
            notes.append(WorkerNote(self._worker_key, role, req_id, generation, record, inner_failed))
        self._pending_notes = []
        source_notes = self._sources.notes() if self._sources is not None else []
        if inner is None and not notes and not source_notes:
            return None
        return KvcsumWorkerMetadata(inner=inner, notes=notes, source_notes=source_notes)

    def take_stats(self) -> KvcsumStats | None:
        """The worker's counts since the last call (its checksum times;
        None when there are none)."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvcsumStats()
        return stats

    def close(self) -> None:
        if self._checksummer is not None:
            self._checksummer.close()
            self._checksummer = None

    # For tests: what the worker still holds.

    def leftovers(self) -> dict:
        """The loads this worker still holds or owes vLLM (empty once every
        load it saw was handed back)."""
        return {
            "release_recving": set(self._release_recving),
            "release_failed": set(self._release_failed),
            "watch_async": set(self._watch_async),
            "invalid_out": set(self._invalid_out),
        }

    @property
    def source_check(self) -> WorkerSourceCheck | None:
        """The worker's re-check of sent requests (for tests and tools)."""
        return self._sources
