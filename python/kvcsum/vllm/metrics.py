"""KvcsumConnector's Prometheus metrics (vllm:kvcsum_*), registered through
vLLM's KVConnectorPromMetrics beside the wrapped connector's own
(KvcsumConnector.build_prom_metrics combines both), from the counts of
kvcsum.vllm.stats as vLLM hands them over each step.

Every metric carries vLLM's engine labels (`labelnames`, with the values
vLLM gives per engine: model_name and engine in vLLM 0.33) and, where it
says so, a bounded label of its own: `path` ("pd" or "tier"), `reason` (a
kvcsum.Reason name or one of `OWN_REASONS`; any other value counts as
"OTHER", so a label never takes an unbounded set of values) and `kind`
(the worker checksum call: "send", "load", "recheck"). docs/metrics.md
lists them for users.
"""

from __future__ import annotations

from typing import Any

import kvcsum
from kvcsum.vllm.stats import CHECKSUM_KINDS, PATHS, load_key
from kvcsum.vllm.tier_values import UNKNOWN_REASONS

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["KvcsumPromMetrics", "COUNTERS", "HISTOGRAM", "OWN_REASONS", "SECONDS_BUCKETS"]

#: Reasons the connector gives besides kvcsum.Reason's names: its own for
#: P/D loads, and a tier block's unknown value's (tier_values).
OWN_REASONS = ("OTHER_REQUEST", "CHECK_FAILED", "INVALID_CHECKSUMS", "GROUP_NOT_CHECKSUMMED", "UNKNOWN") + UNKNOWN_REASONS

#: Buckets of vllm:kvcsum_checksum_seconds: 50 microseconds to 10 seconds.
SECONDS_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)

#: (metric name, stats key, extra labels, documentation) of each counter;
#: a key of None is a load count, read per path (kvcsum.vllm.stats.load_key).
COUNTERS = (
    ("vllm:kvcsum_loads_verified", "verified", ("path",),
     "KV loads whose blocks matched the producer's checksums (MATCH)."),
    ("vllm:kvcsum_loads_mismatched", "mismatched", ("path",),
     "KV loads whose blocks differ from the producer's checksums (MISMATCH): corruption."),
    ("vllm:kvcsum_loads_unverified", "unverified_reasons", ("path", "reason"),
     "KV loads that could not be compared (UNVERIFIED), by reason: missing checksums, or two engines "
     "configured differently; never counted as a mismatch."),
    ("vllm:kvcsum_mismatched_blocks", "mismatched_blocks", ("path",),
     "KV cache blocks of mismatched loads handed to vLLM as load errors."),
    ("vllm:kvcsum_uncompared_blocks", "uncompared_blocks", ("path",),
     "Loaded KV cache blocks that no checksum comparison covered (a last partial block holding other token counts "
     "on the two sides), handed to vLLM as load errors so that it computes them again: never used unchecked."),
    ("vllm:kvcsum_payloads_sent", "payloads_sent", (),
     "Producer requests whose kv_transfer_params carried kvcsum's checksums."),
    ("vllm:kvcsum_payloads_missing", "payloads_missing", (),
     "Producer requests that went without checksums (a worker's did not arrive in time, or could not be made)."),
    ("vllm:kvcsum_sync_loads_declined", "sync_loads_declined", (),
     "Sync loads declined because vLLM could not fail them (several KV cache groups, or a sync P/D load whose "
     "workers' records cannot meet in its step) and they could not go to vLLM as async loads; vLLM computed those "
     "tokens."),
    ("vllm:kvcsum_groups_not_checksummed", "groups_not_checksummed", (),
     "KV cache groups kvcsum cannot checksum (counted once at startup, named in the log): loads that fill them are "
     "UNVERIFIED (GROUP_NOT_CHECKSUMMED), never MATCH."),
    ("vllm:kvcsum_sync_loads_as_async", "sync_loads_as_async", (),
     "The wrapped connector's sync loads that vLLM could not fail, handed to vLLM as async loads: checked in the step "
     "they are done, before vLLM uses them."),
    ("vllm:kvcsum_sources_rechecked", "sources_rechecked", (),
     "Sent requests whose blocks the producer checksummed again when the wrapped connector reported them sent."),
    ("vllm:kvcsum_sources_changed", "sources_changed", (),
     "Sent requests whose blocks changed between their checksums and the end of the send: damage on the sender."),
    ("vllm:kvcsum_sources_changed_blocks", "sources_changed_blocks", (),
     "KV cache blocks that changed during a send (counted once per request and block)."),
    ("vllm:kvcsum_sources_unchecked", "sources_unchecked", (),
     "Sent requests whose blocks could not be checksummed again after the send."),
)

#: (name, documentation) of the histogram of worker checksum calls.
HISTOGRAM = (
    "vllm:kvcsum_checksum_seconds",
    "Time a worker spent in kvcsum per checksum call, by kind (send, load, recheck): the call and the wait for its "
    "result (on a GPU worker the wait includes the work queued before it on the stream).",
)


def _reason_label(reason: Any) -> str:
    text = str(reason)
    if text in kvcsum.Reason.__members__ or text in OWN_REASONS:
        return text
    return "OTHER"


def _count(value: Any) -> float:
    """A count from the stats (anything else, or a negative, counts 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return 0.0
    return float(value)


class KvcsumPromMetrics(KVConnectorPromMetrics):
    """The vllm:kvcsum_* metrics of each engine (`COUNTERS`, `HISTOGRAM`)."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        self._children: dict[tuple, Any] = {}
        for name, key, extra, documentation in COUNTERS:
            metric = self._counter_cls(name=name, documentation=documentation, labelnames=list(labelnames) + list(extra))
            self._counters[name] = (metric, key, extra)
            # Series that exist from the start (at 0), so that rate() and
            # alerts see them before the first event.
            if not extra:
                for engine, child in create_metric_per_engine(metric, per_engine_labelvalues).items():
                    self._children[(name, engine)] = child
            elif extra == ("path",):
                for path in PATHS:
                    for engine in per_engine_labelvalues:
                        self._child(name, engine, path)
        name, documentation = HISTOGRAM
        self._histogram = self._histogram_cls(
            name=name, documentation=documentation, buckets=list(SECONDS_BUCKETS), labelnames=list(labelnames) + ["kind"]
        )
        for kind in CHECKSUM_KINDS:
            for engine in per_engine_labelvalues:
                self._child(name, engine, kind)

    def _child(self, name: str, engine: int, *extra: str):
        key = (name, engine, *extra)
        child = self._children.get(key)
        if child is None:
            metric = self._histogram if name == HISTOGRAM[0] else self._counters[name][0]
            child = metric.labels(*self.per_engine_labelvalues[engine], *extra)
            self._children[key] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        """Adds one report of kvcsum's stats (KvcsumStats.data, summed over
        workers) to the engine's metrics."""
        if engine_idx not in self.per_engine_labelvalues or not isinstance(transfer_stats_data, dict):
            return
        data = transfer_stats_data
        for name, (metric, key, extra) in self._counters.items():
            if not extra:
                n = _count(data.get(key))
                if n:
                    self._child(name, engine_idx).inc(n)
                continue
            for path in PATHS:
                if "reason" in extra:
                    reasons = data.get(load_key(path, key))
                    reasons = reasons if isinstance(reasons, dict) else {}
                    told = 0.0
                    for reason, count in sorted(reasons.items(), key=lambda item: str(item[0])):
                        n = _count(count)
                        if n:
                            self._child(name, engine_idx, path, _reason_label(reason)).inc(n)
                            told += n
                    # Unverified loads counted without a reason.
                    rest = _count(data.get(load_key(path, "unverified"))) - told
                    if rest > 0:
                        self._child(name, engine_idx, path, "UNKNOWN").inc(rest)
                else:
                    n = _count(data.get(load_key(path, key)))
                    if n:
                        self._child(name, engine_idx, path).inc(n)
        seconds = data.get("checksum_seconds")
        if isinstance(seconds, dict):
            for kind, values in seconds.items():
                if kind not in CHECKSUM_KINDS or not isinstance(values, list):
                    continue
                child = self._child(HISTOGRAM[0], engine_idx, kind)
                for value in values:
                    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
                        child.observe(float(value))
