"""The counts KvcsumConnector reports with vLLM's connector stats, under
its name beside the wrapped connector's own."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclasses.dataclass
class KvcsumStats(KVConnectorStats):
    """Verification counts: loads verified (MATCH), mismatched, unverified
    (with reasons), payloads sent and not sent, sync loads declined; and
    for offload tiers, loads verified, mismatched (and their blocks),
    unverified (with reasons) and the blocks checked."""

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
            "tier_verified": 0,
            "tier_mismatched": 0,
            "tier_mismatched_blocks": 0,
            "tier_unverified": 0,
            "tier_unverified_reasons": {},
            "tier_blocks_checked": 0,
        }

    def add(self, key: str, n: int = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def add_reason(self, reason: str, key: str = "unverified_reasons") -> None:
        reasons = self.data.setdefault(key, {})
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
        for key in ("unverified", "tier_unverified"):
            for reason, count in sorted(self.data.get(f"{key}_reasons", {}).items()):
                out[f"{key}[{reason}]"] = count
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
