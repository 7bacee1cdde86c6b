"""KvcsumConnector's worker role: checksums over vLLM's own KV cache tensors
(kvcsum.vllm.cache_checksums), a note per job for the scheduler, and the
verdicts handed to vLLM as load errors.

Each step the worker binds the scheduler's KvcsumConnectorMetadata; after
the forward (`wait_for_save`) it checksums the step's producer jobs and
sync loads; an async load it checksums in the step the wrapped connector
reports it received, and reports it received in that step too (the
scheduler judges it before vLLM reads finished_recving, and holds back one
that failed). Notes go back in KvcsumWorkerMetadata.

Offload tiers: after each forward the worker checksums the blocks that
became full in it (queued on the device's current stream) and keeps their
values by block hash (kvcsum.vllm.tier_values) once they are ready. A tier
load it compares itself, in the step of the load: a sync load after the
forward (its blocks go to vLLM through get_block_ids_with_load_errors of
that same step, which vLLM reads before it emits the step's tokens), an
async one in the step the wrapped connector reports it received (load
errors, or failed_recving where vLLM has several KV cache groups, in that
same step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvcsum
from kvcsum.vllm.cache_checksums import CacheChecksummer, Job
from kvcsum.vllm.common import HashedBlocks, KvcsumConnectorMetadata, KvcsumWorkerMetadata, TierNote, WorkerNote, logger
from kvcsum.vllm.config import Settings, layer_specs, parallel_place
from kvcsum.vllm.decoding import LayerDecodings
from kvcsum.vllm.source_check import WorkerSourceCheck
from kvcsum.vllm.stats import KvcsumStats
from kvcsum.vllm.tier_values import TierChecker

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

if TYPE_CHECKING:
    import torch

    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerRole"]


class WorkerRole:
    """The worker side of KvcsumConnector (one per TP rank and PP stage)."""

    def __init__(
        self,
        kv_cache_config: "KVCacheConfig",
        total_kv_heads: int | None,
        settings: Settings | None = None,
        vllm_config=None,
    ):
        settings = settings or Settings()
        # Read for each layer's kv_cache_dtype and fp8 scales (LayerDecodings).
        self._vllm_config = vllm_config
        self._decodings: LayerDecodings | None = None
        self._settings = settings
        self._kv_cache_config = kv_cache_config
        self._total_kv_heads = total_kv_heads
        self._multi_group = len(kv_cache_config.kv_cache_groups) > 1
        self._tier: TierChecker | None = None
        self._watch_tier: dict = {}
        self._tier_notes: list = []
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
        # Each layer's kv_cache_dtype, fp8 scales and head size, declared
        # (again when they change) so that a load whose sides read the same
        # bytes differently is UNVERIFIED (DECODING_DIFFERS), never MATCH.
        self._decodings = LayerDecodings(self._vllm_config, layers, self._checksummer, kv_caches)
        self._decodings.declare()
        try:
            self._tier = TierChecker(self._checksummer, self._settings.tier_values)
        except (kvcsum.Error, ValueError, RuntimeError) as error:
            # The loads it would check are then unverified, never matched.
            logger.error("kvcsum: worker %s keeps no block values for tier checks: %s", self._worker_key, error)
            self._tier = None
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
        self._watch_tier.update(meta.tier_async_loads)
        if self._tier is not None:
            self._tier.settle(wait=False)
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
        # A sync load's blocks no comparison can cover: vLLM reads this
        # step's load errors before it emits the step's tokens.
        self._invalid_out |= set(meta.uncompared)

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
        # The forward that filled them is queued before: their values are
        # read once ready (next step, or before a tier check).
        if self._tier is not None:
            self._declare_decodings()
            self._tier.store(meta.stores)
        for blocks in meta.tier_sync_loads:
            # vLLM reads this step's load errors before it emits its tokens.
            invalid = self._check_tier(blocks)
            if self._multi_group:
                # Never sent (the scheduler declines such loads): vLLM 0.33
                # raises on block load errors with several KV cache groups.
                logger.error("kvcsum: worker %s: a sync tier load with several KV cache groups cannot be failed", self._worker_key)
            else:
                self._invalid_out |= invalid

    def _declare_decodings(self) -> None:
        """Declares the layers' decodings again where vLLM changed them
        (calculate_kv_scales), before a checksum or store uses them."""
        if self._decodings is not None:
            self._decodings.declare()

    def _note(self, role: int, job: Job, generation: int, inner_failed: bool = False) -> None:
        if not inner_failed:
            self._declare_decodings()
        pending = None if inner_failed else self._checksummer.checksum([job], role)
        if role == kvcsum.PRODUCER and self._sources is not None:
            self._sources.made(job, pending)
        self._pending_notes.append((role, job.req_id, generation, pending, inner_failed))

    def transfer_results(self, inner: KVConnectorTransferResults, finished_req_ids=()) -> KVConnectorTransferResults:
        """get_transfer_results, from the inner connector's: an async load
        being verified is checksummed in the step the inner connector
        reports it received, and reported received in that step too (the
        scheduler takes it out again if it fails: SchedulerRole.received)."""
        results = KVConnectorTransferResults(
            finished_sending=set(inner.finished_sending or ()),
            finished_recving=set(),
            failed_recving=set(),
        )
        for req_id in finished_req_ids or ():
            # Finished (aborted) while its load was awaited: not checked.
            self._watch_async.pop(req_id, None)
            self._watch_tier.pop(req_id, None)
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
            tier = self._watch_tier.pop(req_id, None)
            if tier is not None and failed:
                self._tier_notes.append(TierNote(self._worker_key, req_id, tier.generation, inner_failed=True))
            elif tier is not None and self._checksummer is not None:
                invalid = self._check_tier(tier)
                if invalid and self._multi_group:
                    # Block ids are per group there: vLLM takes the whole load.
                    results.failed_recving.add(req_id)
                else:
                    self._invalid_out |= invalid
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
        tier_notes, self._tier_notes = self._tier_notes, []
        source_notes = self._sources.notes() if self._sources is not None else []
        if inner is None and not notes and not tier_notes and not source_notes:
            return None
        return KvcsumWorkerMetadata(inner=inner, notes=notes, tier_notes=tier_notes, source_notes=source_notes)

    def take_stats(self) -> KvcsumStats | None:
        """The worker's counts since the last call (its checksum times;
        None when there are none)."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvcsumStats()
        return stats

    def _check_tier(self, blocks: HashedBlocks) -> set[int]:
        """Compares a tier load's blocks with the values kept: the block ids
        that are load errors. Notes the outcome for the scheduler."""
        if self._tier is None:
            count = sum(len(ids) for _, ids, _ in blocks.groups.values())
            self._tier_notes.append(TierNote(self._worker_key, blocks.req_id, blocks.generation, unknown={"NO_VALUES_KEPT": count}))
            if self._settings.fail_unverified_tier:
                return {b for _, ids, _ in blocks.groups.values() for b in ids}
            return set()
        comparison = self._tier.check(blocks, fail_unknown=self._settings.fail_unverified_tier)
        self._tier_notes.append(
            TierNote(
                self._worker_key, blocks.req_id, blocks.generation,
                comparison.matched, comparison.mismatched, comparison.unknown,
            )
        )
        return set(comparison.invalid)

    @property
    def stored_values(self):
        """The values this worker keeps of the blocks it computed
        (kvcsum.vllm.tier_values.StoredValues; None when it keeps none)."""
        return self._tier.values if self._tier is not None else None

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
            "watch_tier": set(self._watch_tier),
            "invalid_out": set(self._invalid_out),
        }

    @property
    def source_check(self) -> WorkerSourceCheck | None:
        """The worker's re-check of sent requests (for tests and tools)."""
        return self._sources
