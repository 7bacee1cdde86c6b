"""KvcsumConnector: a vLLM KV connector that wraps any other (NIXL, Mooncake,
LMCache, the offloading connector, ...) and adds verified transfers, through
the connector interface of unmodified vLLM alone.

Settings (kv_connector_extra_config):

- "inner": the wrapped connector, in the form of MultiConnector's entries
  ({"kv_connector": "NixlConnector", "kv_connector_extra_config": {...}},
  plus "kv_connector_module_path" for an external one). Required.
- "unverified": "fail" (default: a P/D load that could not be verified is
  a load error, like a mismatch) or "log" (log it, count it, and go on).
- "checksum_requests": which finished requests a producer checksums:
  "remote_decode" (default: those whose kv_transfer_params ask for
  do_remote_decode, as a P/D proxy sends them) or "all".
- "verify_loads": which P/D loads a consumer verifies against a payload:
  "remote_prefill" (default: loads of requests whose kv_transfer_params
  carried do_remote_prefill or kv_checksums) or "all" (with verify_tiers
  off, every other external load too, which has no payload: unverified).
- "verify_tiers": true (default) checks every other external load (an
  offload tier's: vLLM's offloading connector, LMCache, a file or CPU tier)
  against the values the workers kept of the blocks they computed, by
  block hash (kvcsum.vllm.tier_values; docs/vllm-tiers.md); false turns
  that, and the checksums of every block that becomes full, off.
- "unverified_tier": "log" (default) or "fail": what a tier block whose
  value is unknown (another engine stored it, or the bounded map dropped
  it) does; counted apart from the P/D loads.
- "tier_values": the blocks a worker keeps values of (default 1048576,
  at most 112 MiB of host memory a worker: kvcsum.TierIndex).
- "log_matches": log every verified load at INFO (default false).
- "algorithm": the checksum algorithm of every worker: "mixed2" (default,
  kvcsum 0.3's), "mixed" (kvcsum 0.2's, to verify against 0.2 engines
  during an upgrade) or "weighted" (vLLM's own). The other side learns it
  from the payload's extension (a plain vLLM payload means weighted); a
  difference makes loads UNVERIFIED (ALGORITHM_DIFFERS), never MISMATCH.

- "unfailable_sync_loads": "async" (default) or "decline": what becomes of
  a verified sync load that vLLM could not take back if it failed (several
  KV cache groups; a sync P/D load whose workers' records cannot meet in
  its step, as with several PP stages): handed to vLLM as an async load,
  checked in the step it is done before vLLM uses it, or declined so that
  vLLM computes its tokens (kvcsum.vllm.load_order; a wrapped connector
  that loads only the step's scheduled requests is always declined).

Any other key is refused at startup, naming the valid ones
(kvcsum.vllm.config.KNOWN_KEYS).

Producer: in the step whose forward completes a request's prompt, every
worker checksums the request's blocks after the forward (host workers at
once, device workers queued on torch's current stream) and sends its record
to the scheduler in its worker metadata. `request_finished` adds the
payload, standard base64 of the msgpack payload (vLLM fork's
KVChecksumPayload), under "kv_checksums" to the kv_transfer_params the
inner connector returns, plus "kv_checksums_info" (the producer's block
sizes and a digest of the prompt tokens the payload covers). Records that
arrive later in the same scheduler update still make it into the params.

Consumer: each load's blocks are checksummed once the load is complete
(sync loads after the step's forward, async loads in the step the inner
connector reports them received), and a kvcsum.Verifier compares the
records of all workers with the payload (kvcsum.vllm.load_verdict). An
async load the scheduler judges in the step it arrives: vLLM reads
finished_recving after the connector's update_connector_output, so an
intact load is released in that very step (no engine step added) and one
that fails is held back and handed to vLLM the next step with its load
errors. A sync load the workers judge in the step of the load: their
records meet in one worker (kvcsum.vllm.record_exchange, over vLLM's TP
group), which hands vLLM the load errors in that step's output, read
before the step's tokens are emitted; with several PP stages the records
go to the scheduler instead, which judges the load a step late. A
MISMATCH reports the differing blocks through
get_block_ids_with_load_errors (`failed_recving` where vLLM has several KV
cache groups, as it requires), and vLLM's kv_load_failure_policy
recomputes them ("recompute") or fails the request ("fail"). Where vLLM
has several KV cache groups it cannot fail a sync load (only async ones,
through failed_recving), so a sync load that would be verified is declined
and vLLM computes its tokens. Counts go out with the connector's stats.

Where the wrapped connector keeps a request's blocks until it has sent them
(delay_free_blocks, as NIXL does), the producer's workers checksum them
again in the step it reports them sent, before vLLM frees them, and the
scheduler counts and logs a request whose blocks changed ("source changed
during send", kvcsum.vllm.source_check): a consumer's MISMATCH of it is
damage on the sender, not on the wire. The counts also go to Prometheus
(vllm:kvcsum_*, kvcsum.vllm.metrics; docs/metrics.md) beside the wrapped
connector's metrics.

kv_transfer_params are read in one place, kvcsum.vllm.params: whatever a
client sends there makes the load UNVERIFIED with a reason, never an
exception.

This module is the facade vLLM loads: it builds the wrapped connector and
delegates each call to it and to the role's module, kvcsum.vllm.scheduler
(SchedulerRole) or kvcsum.vllm.worker_role (WorkerRole); what passes
between the roles is in kvcsum.vllm.common, the settings in
kvcsum.vllm.config, the counts in kvcsum.vllm.stats. A connector has one
role: a hook of the other role raises WrongRoleError (WORKER_HOOKS,
SCHEDULER_HOOKS below).
"""


from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvcsum.vllm.common import NAME, KvcsumConnectorMetadata, KvcsumWorkerMetadata
from kvcsum.vllm.config import (
    Settings,
    dcp_size,
    groups_not_checksummed,
    inner_config,
    inner_entry_config,
    inner_transfer_config,
    total_kv_heads,
    transfer_block_sizes,
)
from kvcsum.vllm.load_order import records_meet_in_step
from kvcsum.vllm.scheduler import SchedulerRole
from kvcsum.vllm.stats import KvcsumCombinedStats, KvcsumStats
from kvcsum.vllm.worker_role import WorkerRole

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvcsumConnector", "KvcsumConnectorMetadata", "KvcsumWorkerMetadata", "KvcsumStats", "WrongRoleError"]

#: vLLM's hooks of the worker role and of the scheduler role (vLLM 0.33's
#: KVConnectorBase_V1, by where vLLM calls them). KvcsumConnector answers a
#: hook of the other role with WrongRoleError before anything is done
#: (the inner connector is not called). shutdown and get_kv_connector_stats
#: are hooks of both; class methods and properties have no role.
WORKER_HOOKS = frozenset({
    "get_mem_pool_context",
    "register_kv_caches",
    "unregister_kv_caches",
    "restore_kv_caches",
    "set_host_xfer_buffer_ops",
    "bind_connector_metadata",
    "clear_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "finish_forward",
    "reset_capture_state",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_kv_cache_events",
    "get_handshake_metadata",
    "build_connector_worker_meta",
})
SCHEDULER_HOOKS = frozenset({
    "bind_kv_cache_manager",
    "bind_gpu_block_pool",
    "on_new_request",
    "get_num_new_matched_tokens",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "register_finished_partial_tail",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_finished_count",
    "set_xfer_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware",
    "reset_cache",
})
BOTH_ROLES_HOOKS = frozenset({"shutdown", "get_kv_connector_stats"})
#: Hooks called every step (or every layer) that kvcsum only passes on to
#: the wrapped connector: on an instance of their role they are the wrapped
#: connector's own bound methods, so that passing them on adds no call.
PASSED_ON_HOOKS = {
    KVConnectorRole.WORKER: ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "get_kv_connector_kv_cache_events"),
    KVConnectorRole.SCHEDULER: ("take_events",),
}


class WrongRoleError(RuntimeError):
    """A hook (or a role's property) called on a KvcsumConnector of the
    other role: a bug in the caller, named with the role it needs."""


def _wrong_role(name: str, role: KVConnectorRole, kind: str = "hook") -> WrongRoleError:
    needed = "scheduler" if role == KVConnectorRole.WORKER else "worker"
    return WrongRoleError(f"{name} is a {needed} {kind}; this KvcsumConnector has the {role.name} role")


def _refusal(name: str, role: KVConnectorRole):
    """What a connector of `role` holds under the other role's hook `name`."""

    def refuse(*args, **kwargs):
        raise _wrong_role(name, role)

    refuse.__name__ = refuse.__qualname__ = name
    return refuse


def hash_block_size(kv_cache_config: "KVCacheConfig", vllm_config: "VllmConfig") -> int:
    """The tokens of one of vLLM's block hashes (its own resolution: with
    DCP or several groups it is not cache_config.block_size)."""
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
    except Exception:  # noqa: BLE001 - an older vLLM, or a config it cannot resolve
        return int(vllm_config.cache_config.block_size)


class KvcsumConnector(KVConnectorBase_V1, SupportsHMA):
    """Wraps the connector named by kv_connector_extra_config["inner"] and
    adds kvcsum checksums: payloads on the producer, verdicts on the
    consumer (see the module's doc)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        inner = inner_config(vllm_config)
        inner_cls = KVConnectorFactory.get_connector_class(inner.kv_transfer_config)
        self._inner_supports_hma = supports_hma(inner_cls)
        if len(kv_cache_config.kv_cache_groups) > 1 and not self._inner_supports_hma:
            raise ValueError(
                f"KvcsumConnector: the inner {inner_cls.__name__} does not support the hybrid KV cache "
                "manager and this model has several KV cache groups; set --disable-hybrid-kv-cache-manager"
            )
        self._inner: KVConnectorBase_V1 = inner_cls(inner, role, kv_cache_config)
        self._inner_name = inner_cls.__name__
        self._settings = Settings.of(self._kv_transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        num_workers = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
        self._scheduler: SchedulerRole | None = None
        self._worker: WorkerRole | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerRole(
                self._settings,
                kv_cache_config,
                transfer_block_sizes(kv_cache_config, dcp_size(vllm_config)),
                num_workers,
                self._inner_name,
                str(self._kv_transfer_config.kv_load_failure_policy),
                hash_block_size=hash_block_size(kv_cache_config, vllm_config),
                records_meet=records_meet_in_step(vllm_config),
                not_checksummed=groups_not_checksummed(kv_cache_config, total_kv_heads(vllm_config), dcp_size(vllm_config)),
                tp_size=int(parallel.tensor_parallel_size),
            )
        else:
            self._worker = WorkerRole(kv_cache_config, total_kv_heads(vllm_config), self._settings, vllm_config=vllm_config)
        # The other role's hooks are shadowed on this instance by ones that
        # raise: the right role's calls reach the class's methods untouched
        # (nothing added on the hot path).
        for hook in WORKER_HOOKS if role == KVConnectorRole.SCHEDULER else SCHEDULER_HOOKS:
            setattr(self, hook, _refusal(hook, role))
        for hook in PASSED_ON_HOOKS.get(role, ()):
            setattr(self, hook, getattr(self._inner, hook))

    @property
    def last_verdicts(self) -> dict:
        """The scheduler's {req_id: (verdict, reason, message)} of the loads
        judged so far (for tests and tools; bounded; the scheduler's only)."""
        if self._scheduler is None:
            raise _wrong_role("last_verdicts", self._role, "property")
        return self._scheduler.last_verdicts

    @property
    def worker_role(self) -> WorkerRole | None:
        """The worker role (None on the scheduler)."""
        return self._worker

    @property
    def scheduler_role(self) -> SchedulerRole | None:
        """The scheduler role (None on a worker)."""
        return self._scheduler

    # --- properties and class methods delegated to the inner connector --------

    @property
    def inner(self) -> KVConnectorBase_V1:
        """The wrapped connector."""
        return self._inner

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._inner.supports_divergent_local_hybrid_hits

    @property
    def requires_kv_delivery(self) -> bool:
        return self._inner.requires_kv_delivery

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: "KVTransferConfig") -> bool:
        inner = inner_transfer_config(kv_transfer_config)
        return KVConnectorFactory.get_connector_class(inner).supports_sleep_mode(inner)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        inner = inner_config(vllm_config)
        return KVConnectorFactory.get_connector_class(inner.kv_transfer_config).get_required_kvcache_layout(inner)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        entry, entry_extra = inner_entry_config(extra_config)
        return KVConnectorFactory.get_connector_class(entry).requires_piecewise_for_cudagraph(entry_extra)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        if data is None:
            return KvcsumCombinedStats()
        out = {}
        for name, value in data.items():
            if isinstance(value, KVConnectorStats):
                out[name] = value
            elif name == NAME:
                out[name] = KvcsumStats(data=dict(value))
            else:
                try:
                    inner_cls = KVConnectorFactory.get_connector_class_by_name(name)
                except ValueError:
                    continue
                stats = inner_cls.build_kv_connector_stats(data=value)
                if stats is not None:
                    out[name] = stats
        return KvcsumCombinedStats(data=out)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorPromMetrics

        from kvcsum.vllm.metrics import KvcsumPromMetrics

        inner = inner_config(vllm_config)
        inner_cls = KVConnectorFactory.get_connector_class(inner.kv_transfer_config)
        prom = inner_cls.build_prom_metrics(inner, metric_types, labelnames, per_engine_labelvalues)
        metrics = {inner_cls.__name__: prom} if prom is not None else {}
        # kvcsum's own (vllm:kvcsum_*) beside the wrapped connector's.
        metrics[NAME] = KvcsumPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        return MultiKVConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, metrics)

    # --- plain delegation --------------------------------------------------------

    def get_mem_pool_context(self):
        return self._inner.get_mem_pool_context()

    def unregister_kv_caches(self) -> None:
        self._inner.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self._inner.restore_kv_caches()

    def set_host_xfer_buffer_ops(self, copy_operation) -> None:
        self._inner.set_host_xfer_buffer_ops(copy_operation)

    def finish_forward(self) -> None:
        self._inner.finish_forward()

    def reset_capture_state(self) -> None:
        self._inner.reset_capture_state()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        inner = kv_connector_metadata.inner if isinstance(kv_connector_metadata, KvcsumConnectorMetadata) else kv_connector_metadata
        self._inner.handle_preemptions(inner)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def shutdown(self):
        try:
            return self._inner.shutdown()
        finally:
            if self._worker is not None:
                self._worker.shutdown()

    def get_kv_connector_kv_cache_events(self):
        return self._inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._inner.get_handshake_metadata()

    def set_xfer_handshake_metadata(self, metadata) -> None:
        self._inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata) -> None:
        self._inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def get_finished_count(self) -> int | None:
        return self._inner.get_finished_count()

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)
        self._inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        return self._inner.get_loaded_kv_cache_group_ids(request)

    def get_external_cache_hit_sources(self, request, num_external_tokens):
        return self._inner.get_external_cache_hit_sources(request, num_external_tokens)

    def on_new_request(self, request: "Request") -> None:
        self._scheduler.on_new_request(request)
        self._inner.on_new_request(request)

    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads) -> bool:
        return self._inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    def take_events(self):
        return self._inner.take_events()

    def has_pending_block_frees(self) -> bool:
        return self._inner.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self._inner.has_pending_push_work()

    def reset_cache(self) -> bool | None:
        return self._inner.reset_cache()

    # ==========================================================================
    # Worker side
    # ==========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._layer_names = tuple(kv_caches)
        self._inner.register_kv_caches(kv_caches)
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Its own type first: the ABC check of isinstance costs more.
        assert type(connector_metadata) is KvcsumConnectorMetadata or isinstance(connector_metadata, KvcsumConnectorMetadata)
        self._inner.bind_connector_metadata(connector_metadata.inner)
        # What KVConnectorBase_V1's bind_connector_metadata does, without its call.
        self._connector_metadata = connector_metadata
        self._worker.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._inner.clear_connector_metadata()
        # KVConnectorBase_V1's clear_connector_metadata, without its call.
        self._connector_metadata = None
        self._worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._inner.start_load_kv(forward_context, **kwargs)

    def wait_for_save(self):
        self._inner.wait_for_save()
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]):
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        inner = self._inner.get_transfer_results(finished_req_ids)
        meta = self._connector_metadata
        converted = meta.converted if type(meta) is KvcsumConnectorMetadata or isinstance(meta, KvcsumConnectorMetadata) else None
        if converted:
            # The wrapped connector's sync loads that vLLM sees as async
            # (kvcsum.vllm.load_order): started in this step's
            # start_load_kv; no forward read them, so the waits a forward
            # makes for each layer are made here, and they are received
            # now and checked as any async load.
            for name in getattr(self, "_layer_names", ()):
                self._inner.wait_for_layer_load(name)
            inner.finished_recving = set(inner.finished_recving or ()) | set(converted)
        return self._worker.get_transfer_results(inner, finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors(self._inner.get_block_ids_with_load_errors())

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_connector_worker_meta(self._inner.build_connector_worker_meta())

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        inner = self._inner.get_kv_connector_stats()
        ours = self._scheduler.get_kv_connector_stats() if self._scheduler is not None else self._worker.get_kv_connector_stats()
        if inner is None and ours is None:
            return None
        data = {}
        if inner is not None:
            data[self._inner_name] = inner
        if ours is not None:
            data[NAME] = ours
        return KvcsumCombinedStats(data=data)

    # ==========================================================================
    # Scheduler side
    # ==========================================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        tokens, load_async = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens, tokens, load_async)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        loaded_groups = set(self.get_loaded_kv_cache_group_ids(request))
        self._scheduler.update_state_after_alloc(request, num_external_tokens, loaded_groups)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        inner = self._inner.build_connector_meta(scheduler_output)
        return self._scheduler.build_connector_meta(scheduler_output, inner)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        meta = connector_output.kv_connector_worker_meta
        # Most steps bring no worker metadata: no ABC isinstance check then.
        ours = meta if meta is not None and isinstance(meta, KvcsumWorkerMetadata) else None
        if ours is not None:
            connector_output.kv_connector_worker_meta = ours.inner
        try:
            self._inner.update_connector_output(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = meta
        self._scheduler.update_connector_output(connector_output, ours)

    def request_finished(self, request: "Request", block_ids: list[int]):
        delay, params = self._inner.request_finished(request, block_ids)
        return self._scheduler.request_finished(request, delay, params)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]):
        if self._inner_supports_hma:
            delay, params = self._inner.request_finished_all_groups(request, block_ids)
        else:
            assert len(block_ids) == 1
            delay, params = self._inner.request_finished(request, block_ids[0])
        return self._scheduler.request_finished(request, delay, params)
