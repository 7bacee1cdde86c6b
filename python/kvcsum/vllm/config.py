"""KvcsumConnector's configuration: its settings (kv_connector_extra_config),
the wrapped connector's config, and what it reads of vLLM's KV cache config
(layers, block sizes, group fingerprints)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
from typing import TYPE_CHECKING, Any

import kvcsum
from kvcsum.vllm.cache_checksums import LayerSpec, layer_fingerprint, slot_parts
from kvcsum.vllm.tier_values import DEFAULT_CAPACITY

from vllm.config.kv_transfer import KVTransferConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


#: Every key kv_connector_extra_config may hold, with what it takes: the
#: one list of them (a key not here is refused at startup, naming these).
#: A new setting goes here, in Settings and in kvcsum.vllm.connector's doc.
KNOWN_KEYS: dict[str, str] = {
    "inner": "the wrapped connector's entry (required)",
    "unverified": "'fail' or 'log'",
    "checksum_requests": "'remote_decode' or 'all'",
    "verify_loads": "'remote_prefill' or 'all'",
    "verify_tiers": "true or false",
    "unverified_tier": "'log' or 'fail'",
    "tier_values": "a positive number of blocks",
    "log_matches": "true or false",
    "algorithm": "'mixed2', 'mixed' or 'weighted'",
    "unfailable_sync_loads": "'async' or 'decline'",
}

#: The names the "algorithm" setting takes (docs/SPEC.md section 12).
ALGORITHMS: dict[str, int] = {
    "mixed2": int(kvcsum.Algorithm.MIXED2),
    "mixed": int(kvcsum.Algorithm.MIXED),
    "weighted": int(kvcsum.Algorithm.WEIGHTED),
}


def check_keys(extra: dict) -> None:
    """ValueError naming each key of kv_connector_extra_config that is not
    a setting (with the closest one, where there is one) and the valid ones."""
    unknown = sorted(str(key) for key in extra if key not in KNOWN_KEYS)
    if not unknown:
        return
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
        named.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    valid = "; ".join(f"{key}: {what}" for key, what in KNOWN_KEYS.items())
    raise ValueError(
        f"KvcsumConnector: kv_connector_extra_config has {'an unknown key' if len(unknown) == 1 else 'unknown keys'} "
        f"{', '.join(named)}; the valid ones are {valid}"
    )


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings of kv_connector_extra_config (the module's doc of
    kvcsum.vllm.connector lists them)."""

    fail_unverified: bool = True
    checksum_all: bool = False
    verify_all: bool = False
    log_matches: bool = False
    verify_tiers: bool = True
    fail_unverified_tier: bool = False
    tier_values: int = DEFAULT_CAPACITY
    #: The checksum algorithm of every worker (kvcsum.Algorithm); the
    #: other side learns it from the records and the payload's extension,
    #: and a difference is UNVERIFIED (ALGORITHM_DIFFERS), never MISMATCH.
    algorithm: int = ALGORITHMS["mixed2"]
    #: A verified sync load vLLM could not fail (several KV cache groups;
    #: a sync P/D load whose records cannot meet in its step): "async" hands
    #: it to vLLM as an async load, checked before vLLM uses it
    #: (kvcsum.vllm.load_order), "decline" has vLLM compute its tokens.
    async_unfailable_sync_loads: bool = True

    @classmethod
    def of(cls, extra: dict | None) -> "Settings":
        """The settings of kv_connector_extra_config; ValueError naming a
        key that is not a setting, or a setting whose value is not one it
        takes."""
        extra = extra or {}
        if not isinstance(extra, dict):
            raise ValueError(f"KvcsumConnector: kv_connector_extra_config is {extra!r}, not a mapping")
        check_keys(extra)
        tier_values = extra.get("tier_values", DEFAULT_CAPACITY)
        if not isinstance(tier_values, int) or isinstance(tier_values, bool) or tier_values < 1:
            raise ValueError(f"KvcsumConnector: tier_values is {tier_values!r}, not a positive number of blocks")
        return cls(
            fail_unverified=_choice(extra, "unverified", ("fail", "log")) == "fail",
            checksum_all=_choice(extra, "checksum_requests", ("remote_decode", "all")) == "all",
            verify_all=_choice(extra, "verify_loads", ("remote_prefill", "all")) == "all",
            log_matches=_flag(extra, "log_matches", False),
            verify_tiers=_flag(extra, "verify_tiers", True),
            fail_unverified_tier=_choice(extra, "unverified_tier", ("log", "fail")) == "fail",
            tier_values=tier_values,
            algorithm=ALGORITHMS[_choice(extra, "algorithm", tuple(ALGORITHMS))],
            async_unfailable_sync_loads=_choice(extra, "unfailable_sync_loads", ("async", "decline")) == "async",
        )


def _choice(extra: dict, name: str, values: tuple) -> str:
    """A setting that takes one of `values` (the first is the default)."""
    value = extra.get(name, values[0])
    text = str(value).lower() if isinstance(value, str) else None
    if text not in values:
        raise ValueError(f"KvcsumConnector: {name} is {value!r}, not one of {', '.join(map(repr, values))}")
    return text


def _flag(extra: dict, name: str, default: bool) -> bool:
    """A setting that is true or false (JSON's, or the words)."""
    value = extra.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"KvcsumConnector: {name} is {value!r}, not true or false")


def inner_transfer_config(ktc: "KVTransferConfig") -> "KVTransferConfig":
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


def inner_config(vllm_config: "VllmConfig") -> "VllmConfig":
    """A copy of vllm_config whose kv_transfer_config is the inner entry's."""
    inner = copy.copy(vllm_config)
    inner.kv_transfer_config = inner_transfer_config(vllm_config.kv_transfer_config)
    return inner


def inner_entry_config(extra_config: dict[str, Any] | None) -> tuple["KVTransferConfig", dict]:
    """(a KVTransferConfig of the inner entry alone, its extra config)."""
    entry = dict((extra_config or {}).get("inner") or {})
    return KVTransferConfig(**{"kv_role": "kv_both", **entry}), entry.get("kv_connector_extra_config", {})


def transfer_block_sizes(kv_cache_config: "KVCacheConfig", dcp: int = 1) -> dict:
    """{group: block size} of the transfer groups: the tokens of one of the
    KV cache manager's blocks (with DCP, a DCP-sharded group's block covers
    block_size x dcp tokens, kvcsum.vllm.cache_kinds.group_block_size)."""
    from kvcsum.vllm.cache_kinds import group_block_size

    return {
        g: group_block_size(kv_cache_config.kv_cache_groups[g].kv_cache_spec, dcp) for g in kv_cache_config.transfer_group_ids
    }


def total_kv_heads(vllm_config: "VllmConfig") -> int | None:
    """The model's KV head count, None where its config has none."""
    model_config = vllm_config.model_config
    try:
        return int(model_config.get_total_num_kv_heads()) if model_config else None
    except Exception:  # noqa: BLE001 - a model config without heads (tests, pooling)
        return None


def conv_state_dim_first() -> bool:
    """Whether vLLM stores Mamba conv states as `(dim, state_len)`, its DS
    layout (VLLM_SSM_CONV_STATE_LAYOUT=DS; model_executor/layers/mamba/
    mamba_utils.py:28-50), where each channel is a row that TP's split
    moves whole (kvcsum.vllm.cache_kinds.state_split)."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:
        return False
    return bool(is_conv_state_dim_first())


def _group_layer_specs(
    kv_cache_config: "KVCacheConfig", group_id: int, total_kv_heads: int | None, dcp_size: int, conv_dim_first
) -> list:
    """LayerSpecs of one group's layers; `conv_dim_first` a callable asked
    only where the group holds a Mamba state."""
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec, UniformTypeKVCacheSpecs

    from kvcsum.vllm.cache_kinds import describe_spec

    # MLA caches: one latent head, replicated on every TP rank. DeepSeek
    # V4's sliding-window cache is one too (a SlidingWindowMLASpec, no
    # MLAAttentionSpec: num_kv_heads 1, max_tp_shards 1,
    # v1/attention/backends/mla/sparse_swa.py:127-146).
    mla = (MLAAttentionSpec, SlidingWindowMLASpec)
    group = kv_cache_config.kv_cache_groups[group_id]
    specs = []
    for name in group.layer_names:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[name]
        fields = describe_spec(
            name, group_id, spec, total_kv_heads, dcp_size, isinstance(spec, mla),
            conv_dim_first=isinstance(spec, MambaSpec) and conv_dim_first(),
        )
        if getattr(group, "host_resident", False):
            fields["unsupported"] = "its KV is host-resident"
        specs.append(LayerSpec(**fields))
    return specs


def layer_specs(kv_cache_config: "KVCacheConfig", total_kv_heads: int | None, dcp_size: int = 1) -> tuple[list, dict]:
    """LayerSpecs of every layer in the transfer groups (each kind's fields:
    kvcsum.vllm.cache_kinds), and {group: block size}."""
    from kvcsum.vllm.cache_kinds import group_block_size

    specs, block_sizes = [], {}
    for group_id in kv_cache_config.transfer_group_ids:
        group = kv_cache_config.kv_cache_groups[group_id]
        block_sizes[group_id] = group_block_size(group.kv_cache_spec, dcp_size)
        specs.extend(_group_layer_specs(kv_cache_config, group_id, total_kv_heads, dcp_size, conv_state_dim_first))
    return specs, block_sizes


def groups_not_checksummed(kv_cache_config: "KVCacheConfig", total_kv_heads: int | None, dcp: int = 1) -> dict:
    """{group: why kvcsum cannot checksum it} of the transfer groups, from
    vLLM's KV cache config alone (the same on the scheduler and on every
    worker): the reasons kvcsum.vllm.cache_kinds names at registration."""
    specs, _ = layer_specs(kv_cache_config, total_kv_heads, dcp)
    out: dict = {}
    for spec in specs:
        if spec.unsupported and spec.group_id not in out:
            out[spec.group_id] = f"layer {spec.name}: {spec.unsupported}"
    return out


def group_fingerprint(kv_cache_config: "KVCacheConfig", group_id: int, block_size: int, tp_size: int = 1) -> int:
    """The fingerprint this engine's workers (TP size `tp_size`) would
    register for a group's layers at `block_size`: the vLLM fork's, a state
    layer's identity naming its split where its rows are numbered along TP
    (kvcsum.vllm.cache_checksums.CacheChecksummer, cache_kinds.split_identity),
    a pooled layer's p caches each its own (cache_kinds.states_per_token)."""
    from kvcsum.vllm.cache_kinds import split_identity, state_split_refused

    specs = _group_layer_specs(kv_cache_config, group_id, None, 1, conv_state_dim_first)
    states = [s for s in specs if s.kind == "state" and s.state_shapes and not s.unsupported]
    split = len(states) == len(specs) and bool(states) and not state_split_refused(states, tp_size)
    total = 0
    for s in specs:
        # A pooled layer's p identities (cache_checksums.layer_fingerprint).
        total += layer_fingerprint(
            s.name, s.spec_type, block_size, s.dtype, split_identity(s, tp_size) if split else "", states_per_token=s.states_per_token,
            slot_parts=slot_parts(s),
        )
    return total % 2**64


def dcp_size(vllm_config) -> int:
    """vLLM's decode context parallel size (1 without one)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "decode_context_parallel_size", 1) or 1)


def dcp_interleave(vllm_config) -> int:
    """vLLM's cp_kv_cache_interleave_size: consecutive tokens a DCP rank holds."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1)


def dcp_place() -> tuple[int, int]:
    """(dcp_rank, dcp_size) from vLLM's parallel state ((0, 1) without a DCP group)."""
    from vllm.distributed import parallel_state

    try:
        group = parallel_state.get_dcp_group()
        return int(group.rank_in_group), int(group.world_size)
    except (AssertionError, AttributeError):
        return 0, 1


def parallel_place() -> tuple[int, int, int]:
    """(tp_rank, tp_size, pp_rank) from vLLM's parallel state."""
    from vllm.distributed import parallel_state

    return (
        int(parallel_state.get_tensor_model_parallel_rank()),
        int(parallel_state.get_tensor_model_parallel_world_size()),
        int(parallel_state.get_pp_group().rank_in_group),
    )
