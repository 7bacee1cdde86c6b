"""The counts KvcsumConnector reports with vLLM's connector stats, under
its name beside the wrapped connector's own.

Keys of `KvcsumStats.data` (every count since the last report; vLLM sums
them over workers and steps, and kvcsum.vllm.metrics turns them into
Prometheus metrics):

- loads judged, per path (`PATHS`: "pd", a load from a P/D producer with
  its payload; "tier", a load from an offload tier): "verified",
  "mismatched", "unverified", "unverified_reasons" ({reason: count}),
  "mismatched_blocks" for P/D; "uncompared_blocks" (loaded blocks of a
  MATCH or MISMATCH that no comparison covered, handed to vLLM as load
  errors so that it computes them again); the same prefixed "tier_" for
  tier loads;
- producer: "payloads_sent", "payloads_missing"; and the re-check of a
  sent request's blocks once the wrapped connector reports it sent
  (kvcsum.vllm.source_check): "sources_rechecked", "sources_changed",
  "sources_changed_blocks", "sources_unchecked";
- consumer: "sync_loads_declined", "sync_loads_as_async"
  (kvcsum.vllm.load_order);
- workers: "checksum_seconds" ({kind: [seconds of each checksum call]},
  kinds `CHECKSUM_KINDS`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

#: The load paths counted apart: "pd" (from a P/D producer, with its
#: payload) and "tier" (from an offload tier).
PATHS = ("pd", "tier")

#: The kinds of worker checksum calls timed: a producer's checksums of a
#: request to send ("send"), a consumer's of a load ("load"), the re-check
#: of a sent request's blocks ("recheck").
CHECKSUM_KINDS = ("send", "load", "recheck")

#: What a judged load counts as.
LOAD_OUTCOMES = ("verified", "mismatched", "unverified")


def load_key(path: str, name: str) -> str:
    """The data key of a load count `name` on `path` ("verified" for P/D,
    "tier_verified" for a tier)."""
    if path not in PATHS:
        raise ValueError(f"path {path!r} is none of {PATHS}")
    return name if path == "pd" else f"{path}_{name}"


def _merge(mine: Any, theirs: Any) -> Any:
    """Sum of two stats values: numbers add, lists join, dicts merge by key."""
    if isinstance(theirs, dict):
        out = dict(mine) if isinstance(mine, dict) else {}
        for key, value in theirs.items():
            out[key] = _merge(out.get(key), value)
        return out
    if isinstance(theirs, list):
        return (list(mine) if isinstance(mine, list) else []) + theirs
    return (mine or 0) + theirs


def _empty(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_empty(v) for v in value.values())
    if isinstance(value, list):
        return not value
    return not value


@dataclasses.dataclass
class KvcsumStats(KVConnectorStats):
    """Verification counts (the module's doc lists the keys).

    `is_empty` is asked every engine step, on both roles, and almost always
    finds nothing counted: the dict `reset` made is remembered
    (`_untouched`) until a count changes it, so that answer is one
    identity check instead of a walk over the nested counts."""

    #: Not a field: a copy made without __post_init__ just walks its counts.
    _untouched = None

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self._untouched = self.data = {
            "verified": 0,
            "mismatched": 0,
            "unverified": 0,
            "unverified_reasons": {},
            "mismatched_blocks": 0,
            "payloads_sent": 0,
            "payloads_missing": 0,
        }

    def add(self, key: str, n: int = 1) -> None:
        self._untouched = None
        self.data[key] = self.data.get(key, 0) + n

    def add_reason(self, reason: str, path: str = "pd") -> None:
        self._untouched = None
        reasons = self.data.setdefault(load_key(path, "unverified_reasons"), {})
        reasons[reason] = reasons.get(reason, 0) + 1

    def count_load(self, path: str, outcome: str, reason: str = "", blocks: int = 0) -> None:
        """One judged load on `path` ("pd" or "tier"): `outcome` one of
        LOAD_OUTCOMES, with its `reason` (unverified) or its differing
        `blocks` (mismatched)."""
        if outcome not in LOAD_OUTCOMES:
            raise ValueError(f"outcome {outcome!r} is none of {LOAD_OUTCOMES}")
        self.add(load_key(path, outcome))
        if outcome == "unverified":
            self.add_reason(reason or "UNKNOWN", path)
        elif outcome == "mismatched":
            self.add(load_key(path, "mismatched_blocks"), blocks)

    def observe_seconds(self, kind: str, seconds: float) -> None:
        """One worker checksum call of `kind` (CHECKSUM_KINDS) took `seconds`."""
        if kind not in CHECKSUM_KINDS:
            raise ValueError(f"kind {kind!r} is none of {CHECKSUM_KINDS}")
        self._untouched = None
        self.data.setdefault("checksum_seconds", {}).setdefault(kind, []).append(float(seconds))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self._untouched = None
        for key, value in other.data.items():
            self.data[key] = _merge(self.data.get(key), value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {}
        for key, value in self.data.items():
            if isinstance(value, (int, float)):
                out[key] = value
        for key, value in sorted(self.data.items()):
            if key.endswith("unverified_reasons") and isinstance(value, dict):
                prefix = key[: -len("_reasons")]
                for reason, count in sorted(value.items()):
                    out[f"{prefix}[{reason}]"] = count
        for kind, seconds in sorted(self.data.get("checksum_seconds", {}).items()):
            if seconds:
                out[f"checksum_calls[{kind}]"] = len(seconds)
                out[f"checksum_ms_mean[{kind}]"] = round(1000.0 * sum(seconds) / len(seconds), 3)
        return out

    def is_empty(self) -> bool:
        # A dict replaced or counted into since reset is walked.
        return self.data is self._untouched or _empty(self.data)


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
