"""KvcsumConnector's worker role: checksums over vLLM's own KV cache tensors
(kvcsum.vllm.cache_checksums), a note per job for the scheduler, and the
verdicts handed to vLLM as load errors.

Each step the worker binds the scheduler's KvcsumConnectorMetadata; after
the forward (`wait_for_save`) it checksums the step's producer jobs and
sync loads; an async load it checksums in the step the wrapped connector
reports it received, and reports it received in that step too (the
scheduler judges it before vLLM reads finished_recving, and holds back one
that failed). Notes go back in KvcsumWorkerMetadata.

Sync P/D loads are judged by the workers, in the step of the load: in
get_block_ids_with_load_errors (which vLLM reads before it emits the
step's tokens) each worker waits for its records of the step's sync loads,
the records meet in one worker (kvcsum.vllm.record_exchange: vLLM's TP
group, or none with one worker), and that worker judges each load with
the rule the scheduler uses (kvcsum.vllm.load_verdict), hands vLLM its
load errors in that same output, and sends the verdict to the scheduler in
its note. Only steps with sync loads wait or exchange anything. Where the
records cannot meet (several PP stages: see record_exchange) the workers
send them to the scheduler instead, which judges the load a step late
(logged once).

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
from kvcsum.vllm.common import (
    HashedBlocks,
    KvcsumConnectorMetadata,
    KvcsumWorkerMetadata,
    TierNote,
    UnusableLoadError,
    WorkerNote,
    logger,
)
from kvcsum.vllm.config import (
    Settings,
    dcp_interleave,
    dcp_place,
    dcp_size,
    groups_not_checksummed,
    layer_specs,
    parallel_place,
    transfer_block_sizes,
)
from kvcsum.vllm.decoding import LayerDecodings
from kvcsum.vllm.load_verdict import LoadJudge
from kvcsum.vllm.record_exchange import LoadRecord, RecordExchange, WorkerRecords, engine_exchange, record_bound
from kvcsum.vllm.source_check import WorkerSourceCheck
from kvcsum.vllm.stats import KvcsumStats
from kvcsum.vllm.tier_values import TierChecker

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

if TYPE_CHECKING:
    import torch

    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerRole"]

#: How a worker judges sync loads (decided at the first one, alike on every
#: worker of the engine): alone (one worker), through a RecordExchange, or
#: not at all (the scheduler judges them a step late).
_ALONE, _EXCHANGE, _SCHEDULER = "alone", "exchange", "scheduler"


def _num_workers(vllm_config) -> int:
    """TP size times PP size: the records a load needs."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None:
        return 1
    return int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)


def _tp_size(vllm_config) -> int:
    """vLLM's TP size (1 without a parallel config)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


class WorkerRole:
    """The worker side of KvcsumConnector (one per TP rank and PP stage).

    Each public method is named after the vLLM hook (KVConnectorBase_V1)
    it serves; KvcsumConnector calls it after the inner connector's.
    """

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
        self._num_workers = _num_workers(vllm_config)
        self._exchange: RecordExchange | None = None
        self._sync_mode: str | None = None
        self._load_judge: LoadJudge | None = None
        #: The step's sync loads to judge, with this worker's pending
        #: record of each ([(ChecksumJob, PendingRecord | None)]).
        self._sync_pending: list = []
        self._sync_taken = False
        #: Notes whose record or verdict is ready (build_connector_worker_meta sends them).
        self._ready_notes: list = []

    def use_record_exchange(self, exchange: RecordExchange) -> None:
        """The exchange this worker's records of sync loads go through
        (instead of vLLM's TP group: for a test harness)."""
        self._exchange = exchange
        self._sync_mode = None

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        tp_rank, tp_size, pp_rank = parallel_place()
        layers, block_sizes = layer_specs(self._kv_cache_config, self._total_kv_heads, dcp_size(self._vllm_config))
        self._checksummer = CacheChecksummer(
            layers,
            kv_caches,
            self._kv_cache_config.num_blocks,
            block_sizes,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            algorithm=self._settings.algorithm,
            dcp_rank=dcp_place()[0],
            dcp_interleave=dcp_interleave(self._vllm_config),
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

    def bind_connector_metadata(self, meta: KvcsumConnectorMetadata) -> None:
        """bind_connector_metadata, after the inner connector's: the step's
        jobs and verdicts."""
        self._bound = meta
        if meta.quiet:
            # Nothing but blocks to store (after the forward).
            self._sync_taken = True
            if self._tier is not None and self._tier.queued:
                self._tier.settle(wait=False)
            return
        self._sync_taken = False
        if self._sources is not None:
            self._sources.release(meta.sources_released)
        self._watch_async.update(meta.async_loads)
        self._watch_tier.update(meta.tier_async_loads)
        if self._tier is not None and self._tier.queued:
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

    def clear_connector_metadata(self) -> None:
        """clear_connector_metadata, after the inner connector's."""
        self._bound = None

    def wait_for_save(self) -> None:
        """wait_for_save, after the inner connector's (so after the step's
        forwards, not a save of kvcsum's own): the step's producer jobs and
        sync loads are checksummed (queued on a device)."""
        meta = self._bound
        if meta is None or self._checksummer is None:
            return
        stores = meta.stores
        if meta.quiet:
            # A decode step's whole work: the blocks that filled, stored.
            tier = self._tier
            if tier is not None and stores.block_ids:
                if self._decodings is not None:
                    self._decodings.declare()
                tier.store(stores)
            return
        for checksum in meta.sends:
            self._note(kvcsum.PRODUCER, checksum.job, checksum.generation)
        self._take_sync_loads()
        # The forward that filled them is queued before: on a device their
        # values are read once ready (next step, or before a tier check).
        if self._tier is not None and stores.num_blocks:
            self._declare_decodings()
            self._tier.store(stores)
        for blocks in meta.tier_sync_loads:
            # vLLM reads this step's load errors before it emits its tokens.
            invalid = self._check_tier(blocks)
            if self._multi_group:
                self._refuse_unfailable("sync tier", blocks.req_id, invalid)
            else:
                self._invalid_out |= invalid

    def _take_sync_loads(self) -> None:
        """Checksums the step's sync loads (queued on a device), once a step:
        after the forward, or in get_block_ids_with_load_errors where vLLM
        calls wait_for_save after it (a speculative decoding step)."""
        meta = self._bound
        if self._sync_taken or meta is None:
            return
        self._sync_taken = True
        for checksum in meta.sync_loads:
            if checksum.check is None or not self._judges_sync_loads():
                if self._checksummer is not None:
                    self._note(kvcsum.CONSUMER, checksum.job, checksum.generation)
                continue
            pending = None
            if self._checksummer is not None:
                self._declare_decodings()
                try:
                    pending = self._checksummer.checksum([checksum.job], kvcsum.CONSUMER)
                except kvcsum.Error as error:
                    # Its record is missing: the verdict says WORKERS_MISSING.
                    logger.error("kvcsum: worker %s could not checksum request %s: %s", self._worker_key, checksum.job.req_id, error)
            self._sync_pending.append((checksum, pending))

    def _judges_sync_loads(self) -> bool:
        """Whether the workers judge sync loads (else the scheduler does, a
        step late); decided once, alike on every worker."""
        if self._sync_mode is None:
            if self._num_workers <= 1:
                self._sync_mode = _ALONE
            elif self._exchange is not None:
                self._sync_mode = _EXCHANGE
            else:
                exchange, why = engine_exchange(self._vllm_config)
                if exchange is not None:
                    self._exchange, self._sync_mode = exchange, _EXCHANGE
                else:
                    self._sync_mode = _SCHEDULER
                    if self._worker_key == "pp0.tp0":  # once an engine
                        logger.warning(
                            "kvcsum: the workers cannot exchange their records of a sync load (%s): sync P/D loads are "
                            "judged by the scheduler, one engine step late (the token sampled in the step of a bad "
                            "load is emitted before vLLM computes its blocks again)",
                            why,
                        )
        return self._sync_mode != _SCHEDULER

    def _judge_sync_loads(self) -> None:
        """The step's sync loads: this worker's records waited for and
        exchanged; the judging worker judges each load, hands its load
        errors to vLLM in this step and notes the verdict for the scheduler."""
        pending, self._sync_pending = self._sync_pending, []
        mine = []
        for checksum, record_pending in pending:
            record = None
            if record_pending is not None:
                try:
                    record = record_pending.record()
                except kvcsum.Error as error:
                    logger.error("kvcsum: worker %s: no record of request %s: %s", self._worker_key, checksum.job.req_id, error)
                self._stats.observe_seconds("load", record_pending.seconds)
            mine.append(LoadRecord(checksum.job.req_id, checksum.generation, record))
        if self._sync_mode == _ALONE:
            gathered = [WorkerRecords(self._worker_key, tuple(mine))]
        else:
            try:
                gathered = self._exchange.gather(self._worker_key, mine, bound=self._record_bound(pending))
            except Exception:  # noqa: BLE001 - judged here alone; later loads go to the scheduler, a step late
                logger.exception(
                    "kvcsum: worker %s: the exchange of sync load records failed; this step's sync loads are judged "
                    "without the other workers' records (UNVERIFIED, WORKERS_MISSING), later ones by the scheduler, "
                    "a step late",
                    self._worker_key,
                )
                self._sync_mode = _SCHEDULER
                # Whether or not another worker got this step's records, this
                # worker's verdict (the first to reach the scheduler counts;
                # vLLM unites the load errors) never passes a load it could
                # not compare: alone it is WORKERS_MISSING.
                gathered = [WorkerRecords(self._worker_key, tuple(mine))]
        if gathered is None:
            return  # another worker judges them
        judge = self._judge()
        for checksum, _ in pending:
            job = checksum.job
            judge.expect(job)
            for worker in gathered:
                for record in worker.records:
                    if record.req_id != job.req_id or record.generation != checksum.generation or record.record is None:
                        continue
                    try:
                        judge.add_record(record.record)
                    except kvcsum.Error as error:
                        # Left out: the verdict says which worker is missing.
                        logger.error("kvcsum: request %s: the record of worker %s is unusable: %s", job.req_id, worker.worker, error)
            verdict = judge.judge(job, checksum.check)
            if self._multi_group:
                self._refuse_unfailable("sync P/D", job.req_id, set(verdict.invalid), verdict.message)
            else:
                self._invalid_out |= set(verdict.invalid)
            self._ready_notes.append(
                WorkerNote(self._worker_key, kvcsum.CONSUMER, job.req_id, checksum.generation, None, verdict=verdict)
            )

    def _record_bound(self, pending: list) -> int:
        """The bytes every worker's records of this step's sync loads fit
        in, alike on every worker (the scheduler's jobs, the engine's
        layers and TP size)."""
        blocks = sum(len(ids) for checksum, _ in pending for _, ids in checksum.job.groups.values())
        groups = sum(len(checksum.job.groups) for checksum, _ in pending)
        layers = sum(len(group.layer_names) for group in self._kv_cache_config.kv_cache_groups)
        return record_bound(blocks, groups, layers, _tp_size(self._vllm_config), len(pending))

    def _refuse_unfailable(self, what: str, req_id: str, invalid: set, why: str = "") -> None:
        """A sync load judged bad on a model with several KV cache groups,
        which vLLM 0.33 cannot fail (it raises on block load errors there,
        and a running request is no failed_recving): the step is stopped
        here, before vLLM emits the tokens its forward computed from that
        KV. Never reached while the scheduler declines such loads."""
        if not invalid:
            return
        blocks = sorted(invalid)
        shown = ", ".join(map(str, blocks[:16])) + (f", ... ({len(blocks)} blocks)" if len(blocks) > 16 else "")
        message = (
            f"kvcsum: worker {self._worker_key}: the {what} load of request {req_id} is bad in blocks {shown}"
            + (f" ({why})" if why else "")
            + ", and "
            "vLLM cannot fail a sync load of a model with several KV cache groups; this step is stopped so that no "
            "token computed from that KV is emitted (the scheduler declines such loads unless that was bypassed)"
        )
        logger.error("%s", message)
        raise UnusableLoadError(message)

    def _judge(self) -> LoadJudge:
        if self._load_judge is None:
            self._load_judge = LoadJudge(
                self._kv_cache_config,
                transfer_block_sizes(self._kv_cache_config, dcp_size(self._vllm_config)),
                self._num_workers,
                self._settings.fail_unverified,
                groups_not_checksummed(self._kv_cache_config, self._total_kv_heads, dcp_size(self._vllm_config)),
                tp_size=_tp_size(self._vllm_config),
            )
        return self._load_judge

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

    def get_transfer_results(self, inner: KVConnectorTransferResults, finished_req_ids=()) -> KVConnectorTransferResults:
        """get_transfer_results, from the inner connector's: an async load
        being verified is checksummed in the step the inner connector
        reports it received, and reported received in that step too (the
        scheduler takes it out again if it fails:
        SchedulerRole.update_connector_output)."""
        if not (
            inner.finished_sending or inner.finished_recving or self._release_recving or self._release_failed
            or (finished_req_ids and (self._watch_async or self._watch_tier))
        ):
            return inner  # nothing sent, received or held back in this step
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

    def get_block_ids_with_load_errors(self, inner: set[int]) -> set[int]:
        """get_block_ids_with_load_errors, with the inner connector's: with
        this step's sync loads judged (vLLM reads these before it emits the
        step's tokens)."""
        if self._sync_taken and not self._sync_pending and not self._invalid_out:
            return inner
        self._take_sync_loads()
        if self._sync_pending:
            self._judge_sync_loads()
        out = set(inner) | self._invalid_out
        self._invalid_out = set()
        return out

    def build_connector_worker_meta(self, inner) -> KvcsumWorkerMetadata | None:
        """build_connector_worker_meta, around the inner connector's."""
        sources = self._sources
        if not (self._ready_notes or self._pending_notes or self._tier_notes or (sources is not None and sources.busy)):
            return None if inner is None else KvcsumWorkerMetadata(inner=inner)
        if self._sources is not None:
            self._sources.collect()  # before the records close their results
        notes, self._ready_notes = self._ready_notes, []
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

    def get_kv_connector_stats(self) -> KvcsumStats | None:
        """get_kv_connector_stats: the worker's counts since the last call
        (its checksum times; None when there are none), beside the inner
        connector's."""
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

    def shutdown(self) -> None:
        """shutdown, after the inner connector's: frees the checksummer and
        the load judge."""
        if self._checksummer is not None:
            self._checksummer.close()
            self._checksummer = None
        if self._load_judge is not None:
            self._load_judge.close()
            self._load_judge = None

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
            "sync_pending": {checksum.job.req_id for checksum, _ in self._sync_pending},
            "ready_notes": {note.req_id for note in self._ready_notes},
        }

    @property
    def source_check(self) -> WorkerSourceCheck | None:
        """The worker's re-check of sent requests (for tests and tools)."""
        return self._sources
