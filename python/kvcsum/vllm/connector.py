"""KvcsumConnector: a vLLM KV connector that wraps any other (NIXL, Mooncake,
LMCache, the offloading connector, ...) and adds verified transfers, through
the connector interface of unmodified vLLM alone.

Settings (kv_connector_extra_config):

- "inner": the wrapped connector, in the form of MultiConnector's entries
  ({"kv_connector": "NixlConnector", "kv_connector_extra_config": {...}},
  plus "kv_connector_module_path" for an external one). Required.
- "unverified": "fail" (default: a load that could not be verified is a
  load error, like a mismatch) or "log" (log it, count it, and go on).
- "checksum_requests": which finished requests a producer checksums:
  "remote_decode" (default: those whose kv_transfer_params ask for
  do_remote_decode, as a P/D proxy sends them) or "all".
- "verify_loads": which loads a consumer verifies: "remote_prefill"
  (default: loads of requests whose kv_transfer_params carried
  do_remote_prefill or kv_checksums) or "all" (every external load; an
  offload tier sends no payload, so its loads are unverified).
- "log_matches": log every verified load at INFO (default false).

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
connector reports them received; such a load is held back from vLLM for the
steps the scheduler needs to judge it, one step usually). The scheduler's
verifier compares the records of all workers with the payload; a MISMATCH
reports the differing blocks through get_block_ids_with_load_errors
(`failed_recving` where vLLM has several KV cache groups, as it requires),
and vLLM's kv_load_failure_policy recomputes them ("recompute") or fails the
request ("fail"). Where vLLM has several KV cache groups it cannot fail a
sync load (only async ones, through failed_recving), so a sync load that
would be verified is declined and vLLM computes its tokens. Counts go out
with the connector's stats.

kv_transfer_params are read in one place, kvcsum.vllm.params: whatever a
client sends there makes the load UNVERIFIED with a reason, never an
exception.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch

import kvcsum
from kvcsum.vllm.params import (
    INFO_KEY,
    PAYLOAD_KEY,
    Checksums,
    LoadParams,
    Unusable,
    consistency,
    parse_load,
    payload_summary,
    token_digest,
    wants_remote_decode,
)
from kvcsum.vllm.worker import NULL_BLOCK_ID, CacheChecksummer, Job, LayerSpec, layer_fingerprint

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
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's logger, so that its handlers and VLLM_LOGGING_LEVEL apply.
logger = init_logger("vllm.kvcsum")

NAME = "KvcsumConnector"


# --- Metadata -------------------------------------------------------------------


@dataclasses.dataclass
class KvcsumConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, each step: the inner connector's metadata, the
    requests to checksum after this step's forward (`sends`, producer; and
    `sync_loads`, consumer), the async loads to checksum once received, and
    the verdicts to hand to vLLM this step ({req_id: (invalid block ids,
    failed)})."""

    inner: KVConnectorMetadata | None
    sends: list = dataclasses.field(default_factory=list)
    sync_loads: list = dataclasses.field(default_factory=list)
    async_loads: dict = dataclasses.field(default_factory=dict)
    verdicts: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class KvcsumWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: the inner connector's worker metadata and each
    worker's notes, (worker, role, req_id, generation, record or None,
    inner_failed)."""

    inner: KVConnectorWorkerMetadata | None = None
    notes: list = dataclasses.field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvcsumWorkerMetadata)
        if self.inner is None:
            inner = other.inner
        elif other.inner is None:
            inner = self.inner
        else:
            inner = self.inner.aggregate(other.inner)
        return KvcsumWorkerMetadata(inner=inner, notes=self.notes + other.notes)


@dataclasses.dataclass
class KvcsumStats(KVConnectorStats):
    """Verification counts: loads verified (MATCH), mismatched, unverified
    (with reasons), payloads sent and not sent."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {
            "verified": 0,
            "mismatched": 0,
            "unverified": 0,
            "unverified_reasons": {},
            "mismatched_blocks": 0,
            "payloads_sent": 0,
            "payloads_missing": 0,
        }

    def add(self, key: str, n: int = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def add_reason(self, reason: str) -> None:
        reasons = self.data.setdefault("unverified_reasons", {})
        reasons[reason] = reasons.get(reason, 0) + 1

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if isinstance(value, dict):
                mine = self.data.setdefault(key, {})
                for k, v in value.items():
                    mine[k] = mine.get(k, 0) + v
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {k: v for k, v in self.data.items() if not isinstance(v, dict)}
        for reason, count in sorted(self.data.get("unverified_reasons", {}).items()):
            out[f"unverified[{reason}]"] = count
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items())


@dataclasses.dataclass
class KvcsumCombinedStats(KVConnectorStats):
    """{connector name: stats} of the inner connector and kvcsum."""

    def reset(self):
        for stats in self.data.values():
            stats.reset()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, stats in other.data.items():
            if name in self.data:
                self.data[name] = self.data[name].aggregate(stats)
            else:
                self.data[name] = stats
        return self

    def reduce(self) -> dict[str, Any]:
        return {name: stats.reduce() for name, stats in self.data.items()}

    def is_empty(self) -> bool:
        return all(stats.is_empty() for stats in self.data.values())

    def to_dict(self) -> dict[str, Any]:
        return {name: stats.to_dict() for name, stats in self.data.items()}


# --- Helpers -------------------------------------------------------------------


def _inner_transfer_config(ktc: "KVTransferConfig") -> "KVTransferConfig":
    """The inner entry of kv_connector_extra_config as a KVTransferConfig,
    with kv_role, kv_load_failure_policy, engine_id and the transport fields
    taken from the outer config unless the entry sets them."""
    entry = dict((ktc.kv_connector_extra_config or {}).get("inner") or {})
    if not entry.get("kv_connector"):
        raise ValueError(
            'KvcsumConnector needs kv_connector_extra_config {"inner": {"kv_connector": ...}}: the connector it wraps'
        )
    entry.setdefault("kv_role", ktc.kv_role or "kv_both")
    entry.setdefault("kv_load_failure_policy", ktc.kv_load_failure_policy)
    for field in ("kv_rank", "kv_parallel_size", "kv_ip", "kv_port", "kv_buffer_device", "kv_buffer_size"):
        if field not in entry and getattr(ktc, field, None) is not None:
            entry[field] = getattr(ktc, field)
    entry.setdefault("engine_id", ktc.engine_id)
    return KVTransferConfig(**entry)


def _inner_config(vllm_config: "VllmConfig") -> "VllmConfig":
    """A copy of vllm_config whose kv_transfer_config is the inner entry's."""
    inner = copy.copy(vllm_config)
    inner.kv_transfer_config = _inner_transfer_config(vllm_config.kv_transfer_config)
    return inner


def _layer_specs(kv_cache_config: "KVCacheConfig", total_kv_heads: int | None) -> tuple[list, dict]:
    """LayerSpecs of every layer in the transfer groups, and {group: block size}."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

    specs, block_sizes = [], {}
    for group_id in kv_cache_config.transfer_group_ids:
        group = kv_cache_config.kv_cache_groups[group_id]
        block_sizes[group_id] = int(group.kv_cache_spec.block_size)
        for name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            common = dict(
                name=name,
                group_id=group_id,
                spec_type=type(spec).__name__,
                block_size=int(spec.block_size),
                dtype=str(getattr(spec, "dtype", None)),
            )
            unsupported = ""
            if getattr(group, "host_resident", False):
                unsupported = "its KV is host-resident"
            if not isinstance(spec, AttentionSpec) or not getattr(spec, "has_layer_views", True):
                specs.append(LayerSpec(**common, kind="state", unsupported=unsupported or f"{type(spec).__name__} has no per-token KV blocks"))
                continue
            if getattr(spec, "tokens_per_state", 1) != 1:
                unsupported = f"{type(spec).__name__} stores {spec.tokens_per_state} tokens per state"
            elif getattr(spec, "num_head_slots", None) is not None:
                unsupported = "its KV heads are packed into head slots"
            specs.append(
                LayerSpec(
                    **common,
                    num_kv_heads=int(spec.num_kv_heads),
                    head_size=int(spec.head_size),
                    head_size_v=int(getattr(spec, "head_size_v", spec.head_size) or 0),
                    is_mla=isinstance(spec, MLAAttentionSpec),
                    total_kv_heads=total_kv_heads,
                    unsupported=unsupported,
                )
            )
    return specs, block_sizes


def _parallel_place() -> tuple[int, int, int]:
    """(tp_rank, tp_size, pp_rank) from vLLM's parallel state."""
    from vllm.distributed import parallel_state

    return (
        int(parallel_state.get_tensor_model_parallel_rank()),
        int(parallel_state.get_tensor_model_parallel_world_size()),
        int(parallel_state.get_pp_group().rank_in_group),
    )


def _rewrite_fingerprints(payload: bytes, replace: dict) -> bytes:
    """The payload with group fingerprints replaced ({group: (old, new)})."""
    import msgspec

    version, num_tokens, groups = msgspec.msgpack.decode(payload)[:3]
    rest = msgspec.msgpack.decode(payload)[3:]
    out = []
    for group_id, fingerprint, first, values in groups:
        old_new = replace.get(group_id)
        if old_new is not None and fingerprint == old_new[0]:
            fingerprint = old_new[1]
        out.append([group_id, fingerprint, first, values])
    return msgspec.msgpack.encode([version, num_tokens, out, *rest])


def _forget(verifier: "kvcsum.Verifier", req_id: str) -> None:
    try:
        verifier.forget(req_id)
    except kvcsum.NotFound:
        pass


@dataclasses.dataclass
class _Send:
    job: Job | None = None
    generation: int = 0
    reported: set = dataclasses.field(default_factory=set)
    params: dict | None = None
    finished: bool = False
    digest: str = ""


@dataclasses.dataclass
class _Load:
    job: Job
    is_async: bool
    params: LoadParams
    token_ids: list
    generation: int
    reported: set = dataclasses.field(default_factory=set)
    inner_failed: bool = False
    verdict: tuple | None = None


# --- The connector -------------------------------------------------------------


class KvcsumConnector(KVConnectorBase_V1, SupportsHMA):
    """Wraps the connector named by kv_connector_extra_config["inner"] and
    adds kvcsum checksums: payloads on the producer, verdicts on the
    consumer (see the module's doc)."""

    @classmethod
    def _inner_class(cls, vllm_config: "VllmConfig"):
        return KVConnectorFactory.get_connector_class(_inner_config(vllm_config).kv_transfer_config)

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        inner_config = _inner_config(vllm_config)
        inner_cls = KVConnectorFactory.get_connector_class(inner_config.kv_transfer_config)
        self._inner_supports_hma = supports_hma(inner_cls)
        if len(kv_cache_config.kv_cache_groups) > 1 and not self._inner_supports_hma:
            raise ValueError(
                f"KvcsumConnector: the inner {inner_cls.__name__} does not support the hybrid KV cache "
                "manager and this model has several KV cache groups; set --disable-hybrid-kv-cache-manager"
            )
        self._inner: KVConnectorBase_V1 = inner_cls(inner_config, role, kv_cache_config)
        self._inner_name = inner_cls.__name__
        self._fail_unverified = str(extra.get("unverified", "fail")).lower() != "log"
        self._checksum_all = str(extra.get("checksum_requests", "remote_decode")).lower() == "all"
        self._verify_all = str(extra.get("verify_loads", "remote_prefill")).lower() == "all"
        self._log_matches = bool(extra.get("log_matches", False))
        self._multi_group = len(kv_cache_config.kv_cache_groups) > 1
        self._block_sizes = {
            g: int(kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size)
            for g in kv_cache_config.transfer_group_ids
        }
        parallel = vllm_config.parallel_config
        self._num_workers = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
        model_config = vllm_config.model_config
        try:
            self._total_kv_heads = int(model_config.get_total_num_kv_heads()) if model_config else None
        except Exception:  # noqa: BLE001 - a model config without heads (tests, pooling)
            self._total_kv_heads = None
        # Scheduler side.
        self._stats = KvcsumStats()
        self._sends: dict[str, _Send] = {}
        self._loads: dict[str, _Load] = {}
        self._matched: dict[str, tuple] = {}
        self._new_sends: list = []
        self._new_sync_loads: list = []
        self._new_async_loads: dict = {}
        self._verdicts_out: dict = {}
        self._unfilled: dict[str, _Send] = {}
        self._generation = 0
        self._logged: set = set()
        self._known: dict = {}
        self._last_verdicts: dict = {}
        if role == KVConnectorRole.SCHEDULER:
            self._producer = kvcsum.Verifier(self._num_workers)
            self._consumer = kvcsum.Verifier(self._num_workers)
            self._consumer.set_policy(kvcsum.FAIL_CLOSED if self._fail_unverified else kvcsum.FAIL_OPEN)
        # Worker side.
        self._checksummer: CacheChecksummer | None = None
        self._worker_key = "?"
        self._bound: KvcsumConnectorMetadata | None = None
        self._pending_notes: list = []
        self._watch_async: dict[str, tuple] = {}
        self._held: set[str] = set()
        self._release_recving: set[str] = set()
        self._release_failed: set[str] = set()
        self._invalid_out: set[int] = set()

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
        inner = _inner_transfer_config(kv_transfer_config)
        return KVConnectorFactory.get_connector_class(inner).supports_sleep_mode(inner)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        inner = _inner_config(vllm_config)
        return KVConnectorFactory.get_connector_class(inner.kv_transfer_config).get_required_kvcache_layout(inner)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        entry = dict((extra_config or {}).get("inner") or {})
        inner_cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**{"kv_role": "kv_both", **entry}))
        return inner_cls.requires_piecewise_for_cudagraph(entry.get("kv_connector_extra_config", {}))

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

        inner = _inner_config(vllm_config)
        inner_cls = KVConnectorFactory.get_connector_class(inner.kv_transfer_config)
        prom = inner_cls.build_prom_metrics(inner, metric_types, labelnames, per_engine_labelvalues)
        metrics = {inner_cls.__name__: prom} if prom is not None else {}
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
            if self._checksummer is not None:
                self._checksummer.close()
                self._checksummer = None

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
        self._inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        return self._inner.get_loaded_kv_cache_group_ids(request)

    def get_external_cache_hit_sources(self, request, num_external_tokens):
        return self._inner.get_external_cache_hit_sources(request, num_external_tokens)

    def on_new_request(self, request: "Request") -> None:
        self._known[request.request_id] = request
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
        self._inner.register_kv_caches(kv_caches)
        tp_rank, tp_size, pp_rank = _parallel_place()
        layers, block_sizes = _layer_specs(self._kv_cache_config, self._total_kv_heads)
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
        for group_id, reason in sorted(self._checksummer.skipped.items()):
            logger.warning("kvcsum: worker %s does not checksum KV cache group %d: %s", self._worker_key, group_id, reason)
        logger.info(
            "kvcsum: worker %s checksums %d layers on %s",
            self._worker_key,
            self._checksummer.layers_registered,
            "the host" if self._checksummer.device == kvcsum.HOST else f"cuda:{self._checksummer.device}",
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, KvcsumConnectorMetadata)
        self._inner.bind_connector_metadata(connector_metadata.inner)
        super().bind_connector_metadata(connector_metadata)
        self._bound = connector_metadata
        self._watch_async.update(connector_metadata.async_loads)
        for req_id, (invalid, failed) in connector_metadata.verdicts.items():
            self._watch_async.pop(req_id, None)
            if req_id in self._held:
                # An async load held back: released now, failed if judged so
                # (vLLM reads failed_recving only with finished_recving).
                self._held.discard(req_id)
                self._release_recving.add(req_id)
                if failed:
                    self._release_failed.add(req_id)
            else:
                # A sync load is never in finished_recving: a failure is
                # only ever its blocks, and nothing of it is kept.
                self._release_failed.discard(req_id)
            self._invalid_out |= set(invalid)

    def clear_connector_metadata(self) -> None:
        self._inner.clear_connector_metadata()
        super().clear_connector_metadata()
        self._bound = None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._inner.start_load_kv(forward_context, **kwargs)

    def wait_for_save(self):
        self._inner.wait_for_save()
        meta = self._bound
        if meta is None or self._checksummer is None:
            return
        for job, generation in meta.sends:
            self._note(kvcsum.PRODUCER, job, generation)
        for job, generation in meta.sync_loads:
            self._note(kvcsum.CONSUMER, job, generation)

    def _note(self, role: int, job: Job, generation: int, inner_failed: bool = False) -> None:
        pending = None if inner_failed else self._checksummer.checksum([job], role)
        self._pending_notes.append((role, job.req_id, generation, pending, inner_failed))

    def get_finished(self, finished_req_ids: set[str]):
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        inner = self._inner.get_transfer_results(finished_req_ids)
        results = KVConnectorTransferResults(
            finished_sending=set(inner.finished_sending or ()),
            finished_recving=set(),
            failed_recving=set(),
        )
        for req_id in inner.finished_recving or ():
            watched = self._watch_async.pop(req_id, None)
            if watched is None or self._checksummer is None:
                results.finished_recving.add(req_id)
                if req_id in (inner.failed_recving or ()):
                    results.failed_recving.add(req_id)
                continue
            job, generation = watched
            # Hold the load back from vLLM until the scheduler judged it.
            self._held.add(req_id)
            failed = req_id in (inner.failed_recving or ())
            if failed:
                self._release_failed.add(req_id)
            self._note(kvcsum.CONSUMER, job, generation, inner_failed=failed)
        results.finished_recving |= self._release_recving
        results.failed_recving |= self._release_failed & (self._release_recving | results.finished_recving)
        self._release_failed -= results.failed_recving
        self._release_recving.clear()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        out = set(self._inner.get_block_ids_with_load_errors()) | self._invalid_out
        self._invalid_out = set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        inner = self._inner.build_connector_worker_meta()
        notes = []
        for role, req_id, generation, pending, inner_failed in self._pending_notes:
            record = pending.record() if pending is not None else None
            notes.append((self._worker_key, role, req_id, generation, record, inner_failed))
        self._pending_notes = []
        if inner is None and not notes:
            return None
        return KvcsumWorkerMetadata(inner=inner, notes=notes)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        inner = self._inner.get_kv_connector_stats()
        ours = None
        if self.role == KVConnectorRole.SCHEDULER and not self._stats.is_empty():
            ours, self._stats = self._stats, KvcsumStats()
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
        if not tokens:
            return tokens, load_async
        params = parse_load(request.kv_transfer_params)
        verified = params.remote_prefill or self._verify_all
        if verified and self._multi_group and not load_async:
            # vLLM 0.33 takes load errors of a model with several KV cache
            # groups only as failed async loads (failed_recving); a sync load
            # (the request already running) cannot be failed or recomputed,
            # and invalid_block_ids raise in its scheduler. A verified sync
            # load is therefore declined: vLLM computes those tokens.
            self._stats.add("sync_loads_declined")
            self._log_once(
                "sync-declined",
                f"kvcsum: the wrapped {self._inner_name} offers sync loads (request {request.request_id}, {tokens} tokens); "
                "with several KV cache groups vLLM cannot recompute a sync load that fails verification, so kvcsum "
                "declines such loads and vLLM computes the tokens (counted as sync_loads_declined)",
                error=False,
            )
            return 0, False
        self._matched[request.request_id] = (num_computed_tokens, params, bool(load_async))
        return tokens, load_async

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        req_id = request.request_id
        matched = self._matched.pop(req_id, None)
        self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens <= 0 or matched is None:
            return
        num_computed, params, is_async = matched
        if not (params.remote_prefill or self._verify_all):
            return
        loaded_groups = set(self.get_loaded_kv_cache_group_ids(request))
        job = self._job(req_id, num_computed, num_computed + num_external_tokens, loaded_groups)
        if job is None:
            return
        self._generation += 1
        old = self._loads.pop(req_id, None)
        if old is not None:
            _forget(self._consumer, req_id)
        load = _Load(
            job=job,
            is_async=is_async,
            params=params,
            token_ids=list(request.prompt_token_ids or []),
            generation=self._generation,
        )
        self._loads[req_id] = load
        with kvcsum.Blocks() as expected:
            job.to_blocks(expected)
            self._consumer.expect(expected, kvcsum.CONSUMER)
        if is_async:
            self._new_async_loads[req_id] = (job, load.generation)
        else:
            self._new_sync_loads.append((job, load.generation))

    def _job(self, req_id: str, first_token: int, num_tokens: int, groups: set | None = None) -> Job | None:
        """The blocks of req_id holding tokens [first_token, num_tokens), per
        transfer group (all of them when groups is None), leading null
        blocks (outside a sliding window) left out."""
        table = self._kv_cache_manager.get_block_ids(req_id)
        out = {}
        for group_id, block_size in self._block_sizes.items():
            if groups is not None and group_id not in groups:
                continue
            ids = list(table[group_id])[: math.ceil(num_tokens / block_size)]
            first = first_token // block_size
            while first < len(ids) and ids[first] == NULL_BLOCK_ID:
                first += 1
            if first < len(ids):
                out[group_id] = (first, ids[first:])
        if not out:
            return None
        return Job(req_id, num_tokens, out)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        inner = self._inner.build_connector_meta(scheduler_output)
        self._give_up_unfilled()
        for req_id in scheduler_output.preempted_req_ids or ():
            send = self._sends.get(req_id)
            if send is not None and not send.finished:
                # Its KV will be computed again: checksum it again then.
                _forget(self._producer, req_id)
                self._sends[req_id] = _Send()
        self._schedule_sends(scheduler_output)
        meta = KvcsumConnectorMetadata(
            inner=inner,
            sends=self._new_sends,
            sync_loads=self._new_sync_loads,
            async_loads=self._new_async_loads,
            verdicts=self._verdicts_out,
        )
        self._new_sends, self._new_sync_loads, self._new_async_loads, self._verdicts_out = [], [], {}, {}
        return meta

    def _wants_send(self, request: "Request") -> bool:
        if self._checksum_all:
            return True
        return wants_remote_decode(request.kv_transfer_params)

    def _schedule_sends(self, scheduler_output: "SchedulerOutput") -> None:
        if self._kv_cache_manager is None:
            return
        progress = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        progress += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, computed in progress:
            request = self._request(req_id)
            if request is None or not self._wants_send(request):
                continue
            prompt = request.num_prompt_tokens
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if computed >= prompt or done < prompt:
                continue
            job = self._job(req_id, 0, prompt)
            if job is None:
                continue
            self._generation += 1
            _forget(self._producer, req_id)
            send = _Send(job=job, generation=self._generation, digest=token_digest(request.prompt_token_ids or [], prompt))
            self._sends[req_id] = send
            with kvcsum.Blocks() as expected:
                job.to_blocks(expected)
                self._producer.expect(expected, kvcsum.PRODUCER)
            self._new_sends.append((job, send.generation))

    def _request(self, req_id: str):
        """The scheduler's Request of req_id (kept from on_new_request)."""
        return self._known.get(req_id)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        meta = connector_output.kv_connector_worker_meta
        ours = meta if isinstance(meta, KvcsumWorkerMetadata) else None
        if ours is not None:
            connector_output.kv_connector_worker_meta = ours.inner
        try:
            self._inner.update_connector_output(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = meta
        if ours is None:
            return
        for worker, role, req_id, generation, record, inner_failed in ours.notes:
            if role == kvcsum.PRODUCER:
                self._producer_note(worker, req_id, generation, record)
            else:
                self._consumer_note(worker, req_id, generation, record, inner_failed)

    # --- producer ------------------------------------------------------------

    def _producer_note(self, worker: str, req_id: str, generation: int, record: bytes | None) -> None:
        send = self._sends.get(req_id)
        if send is None or send.generation != generation or record is None:
            return
        self._producer.add_record(record)
        send.reported.add(worker)
        if send.finished and len(send.reported) >= self._num_workers:
            self._fill(req_id, send)

    def _payload(self, req_id: str, send: _Send) -> str | None:
        try:
            return kvcsum.base64_encode(self._producer.payload(req_id))
        except kvcsum.Error as error:
            logger.warning("kvcsum: no checksums for request %s: %s", req_id, error)
            return None

    def _fill(self, req_id: str, send: _Send) -> None:
        """Adds the payload to the params request_finished returned."""
        text = self._payload(req_id, send)
        if text is not None and send.params is not None:
            send.params[PAYLOAD_KEY] = text
            send.params[INFO_KEY] = {
                "block_sizes": {str(g): b for g, b in self._block_sizes.items()},
                "tokens": send.digest,
            }
            self._stats.add("payloads_sent")
        else:
            self._stats.add("payloads_missing")
        _forget(self._producer, req_id)
        self._sends.pop(req_id, None)
        self._unfilled.pop(req_id, None)

    def _give_up_unfilled(self) -> None:
        """Requests whose records did not arrive by the end of the scheduler
        update that finished them: their outputs are gone, without checksums."""
        for req_id, send in list(self._unfilled.items()):
            logger.warning(
                "kvcsum: request %s finished before all workers checksummed its KV (%d of %d); it goes without checksums",
                req_id, len(send.reported), self._num_workers,
            )
            self._stats.add("payloads_missing")
            _forget(self._producer, req_id)
            self._sends.pop(req_id, None)
        self._unfilled.clear()

    def _finished(self, request: "Request", delay: bool, params: dict | None):
        req_id = request.request_id
        self._known_pop(req_id)
        self._matched.pop(req_id, None)
        send = self._sends.get(req_id)
        if send is None:
            return delay, params
        if send.job is None or request.status.name == "FINISHED_ABORTED" and len(send.reported) < self._num_workers:
            # Preempted and not computed again, or aborted before its checksums.
            _forget(self._producer, req_id)
            self._sends.pop(req_id, None)
            return delay, params
        if params is None:
            params = {}
        send.params = params
        send.finished = True
        if len(send.reported) >= self._num_workers:
            self._fill(req_id, send)
        else:
            self._unfilled[req_id] = send
        return delay, params

    def request_finished(self, request: "Request", block_ids: list[int]):
        delay, params = self._inner.request_finished(request, block_ids)
        return self._finished(request, delay, params)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]):
        if self._inner_supports_hma:
            delay, params = self._inner.request_finished_all_groups(request, block_ids)
        else:
            assert len(block_ids) == 1
            delay, params = self._inner.request_finished(request, block_ids[0])
        return self._finished(request, delay, params)

    # --- consumer ------------------------------------------------------------

    def _consumer_note(self, worker: str, req_id: str, generation: int, record: bytes | None, inner_failed: bool) -> None:
        load = self._loads.get(req_id)
        if load is None or load.generation != generation:
            return
        if record is not None:
            self._consumer.add_record(record)
        load.inner_failed |= inner_failed
        load.reported.add(worker)
        if len(load.reported) >= self._num_workers:
            self._judge(req_id, load)

    def _judge(self, req_id: str, load: _Load) -> None:
        self._loads.pop(req_id, None)
        if load.inner_failed:
            # The inner connector reported the load failed: vLLM handles it.
            _forget(self._consumer, req_id)
            self._verdicts_out[req_id] = ((), True)
            return
        try:
            verdict, reason, message, invalid = self._check(req_id, load)
        except Exception as error:  # noqa: BLE001 - a verdict must never take the engine down
            logger.exception("kvcsum: request %s: the load could not be checked", req_id)
            verdict, reason, message, invalid = (
                kvcsum.UNVERIFIED,
                "CHECK_FAILED",
                f"the check raised {type(error).__name__}: {error}",
                [],
            )
        _forget(self._consumer, req_id)
        if verdict == kvcsum.UNVERIFIED:
            self._stats.add("unverified")
            self._stats.add_reason(reason)
            invalid = self._loaded_block_ids(load.job) if self._fail_unverified else []
        elif verdict == kvcsum.MISMATCH:
            self._stats.add("mismatched")
            self._stats.add("mismatched_blocks", len(invalid))
        else:
            self._stats.add("verified")
        # vLLM maps block-level load errors back to requests only where there
        # is one KV cache group; with several it takes whole failed loads.
        # (A sync load there is never verified: get_num_new_matched_tokens
        # declines it, since a running request's load cannot be failed.)
        failed = bool(invalid) and self._multi_group
        if failed and not load.is_async:
            failed, invalid = False, []
            action = "vLLM cannot be told (a sync load with several KV cache groups)"
        elif failed:
            action = "vLLM gets the whole load as failed (several KV cache groups)"
        elif invalid:
            action = f"vLLM gets blocks {sorted(invalid)} as load errors"
        else:
            action = "the load is used"
        policy = f"kv_load_failure_policy={self._kv_transfer_config.kv_load_failure_policy}"
        if verdict == kvcsum.MATCH:
            if self._log_matches:
                logger.info("kvcsum: request %s: KV verified (%s)", req_id, message)
        elif verdict == kvcsum.MISMATCH:
            self._log_once(req_id, f"kvcsum: request {req_id}: KV MISMATCH: {message}; {action} ({policy})", error=True)
        else:
            setting = "unverified=fail" if self._fail_unverified else "unverified=log"
            self._log_once(
                req_id, f"kvcsum: request {req_id}: KV UNVERIFIED ({reason}): {message}; {setting}: {action}" + (f" ({policy})" if invalid else ""),
                error=self._fail_unverified,
            )
        self._verdicts_out[req_id] = ([] if failed else sorted(invalid), failed)
        self.last_verdicts[req_id] = (verdict, reason, message)

    @property
    def last_verdicts(self) -> dict:
        """{req_id: (verdict, reason, message)} of the loads judged so far
        (kept for tests and tools; bounded)."""
        if len(self._last_verdicts) > 4096:
            self._last_verdicts.clear()
        return self._last_verdicts

    def _log_once(self, req_id: str, text: str, error: bool = True) -> None:
        if req_id in self._logged:
            return
        if len(self._logged) > 65536:
            self._logged.clear()
        self._logged.add(req_id)
        (logger.error if error else logger.warning)(text)

    def _loaded_block_ids(self, job: Job) -> list[int]:
        return [b for _, (_, ids) in sorted(job.groups.items()) for b in ids]

    def _check(self, req_id: str, load: _Load) -> tuple[int, str, str, list]:
        """(verdict, reason name, message, invalid block ids)."""
        checksums = load.params.checksums
        if isinstance(checksums, Unusable):
            return kvcsum.UNVERIFIED, checksums.reason, checksums.message, []
        payload, producer_sizes = None, {}
        if isinstance(checksums, Checksums):
            digest = checksums.tokens
            if digest is not None and not digest.covers(load.token_ids):
                return (
                    kvcsum.UNVERIFIED,
                    "OTHER_REQUEST",
                    f"the checksums cover other tokens than this request's first {digest.count} (a payload of another request)",
                    [],
                )
            payload, producer_sizes = checksums.payload, checksums.block_sizes
            try:
                raw = kvcsum.base64_decode(payload)
            except kvcsum.Error:
                raw = None  # the verifier names what is wrong with it
            if raw is not None:
                disagreement = consistency(checksums, payload_summary(raw))
                if disagreement is not None:
                    return kvcsum.UNVERIFIED, disagreement.reason, disagreement.message, []
            replace = {}
            for group, size in producer_sizes.items():
                own = self._block_sizes.get(group)
                if own is not None and size != own:
                    replace[group] = (self._group_fingerprint(group, size), self._group_fingerprint(group, own))
            if replace:
                try:
                    payload = _rewrite_fingerprints(raw, replace)
                except Exception:  # noqa: BLE001 - left for the verifier to judge
                    payload = checksums.payload
        # The verifier keeps one producer block size per group: set every
        # group's for this load (its own where the producer did not say, as
        # a vLLM fork producer does not).
        for group, own in self._block_sizes.items():
            self._consumer.set_producer_block_size(group, producer_sizes.get(group, own))
        with self._consumer.check(req_id, payload) as report:
            verdict, message = report.verdict, report.message
            reason = ""
            if verdict == kvcsum.UNVERIFIED:
                findings = report.findings
                reason = findings[0].reason_name.replace("KVCS_UNVERIFIED_", "") if findings else "UNKNOWN"
            invalid = []
            if verdict == kvcsum.MISMATCH:
                invalid, where = self._repair(report, load.job)
                message = f"{message} [{where}]"
        return verdict, reason, message, invalid

    def _repair(self, report: "kvcsum.Report", job: Job) -> tuple[list, str]:
        """The block ids to load again after a MISMATCH, and where they are.
        Where the repair plan refuses (another group could not be compared,
        so reloading blocks would not make the load verified) every loaded
        block is named: the load is repeated whole."""
        positions = ", ".join(
            f"group {m.group_id} positions {m.first_position}..{m.first_position + m.num_positions} "
            f"(tokens {m.first_token}..{m.first_token + m.num_tokens})"
            for m in report.mismatches
        )
        tables = {g: (first, ids) for g, (first, ids) in job.groups.items()}
        try:
            plan = kvcsum.repair_plan(report, tables, dict(self._block_sizes))
        except kvcsum.Error as error:
            invalid = self._loaded_block_ids(job)
            return invalid, f"{positions}; the whole load is repeated: {error}"
        invalid = sorted({b.block_id for blocks in plan.values() for b in blocks})
        return invalid, f"{positions}; blocks {invalid}"

    def _group_fingerprint(self, group_id: int, block_size: int) -> int:
        from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

        group = self._kv_cache_config.kv_cache_groups[group_id]
        total = 0
        for name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            total += layer_fingerprint(name, type(spec).__name__, block_size, str(getattr(spec, "dtype", None)))
        return total % 2**64

    # --- request bookkeeping -----------------------------------------------------

    def _known_pop(self, req_id: str) -> None:
        self._known.pop(req_id, None)
