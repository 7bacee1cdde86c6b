"""StoreConnector: a small P/D connector for the vLLM test, the inner
connector that KvcsumConnector wraps. It moves KV between engines of
different TP sizes, block sizes and layouts through files, one per (request,
layer, global KV head): the producer's workers write the prompt's KV in the
step that completes it; the consumer loads it asynchronously (reporting the
load finished in the step it is done), each worker reading its own heads
into its own blocks and layout.

vLLM's own ExampleConnector cannot serve here: it keys its files by the
token ids aligned to its own block size and stores each layer's whole
tensor, so engines of different block or TP sizes never find each other's
KV.

Fault injection: set `CORRUPT["token"]` (and optionally "layer", "head",
"byte": the byte of the cell, 3 unless set) and the consumer changes one
byte of that token's KV as it loads it; `CORRUPT["state"]` (a byte index,
optionally "layer" and "rank") changes one byte of a state layer's loaded
state.

Compressed caches (`tokens_per_state` k > 1): each slot holds one state of
k tokens; the states of the tokens moved (those whose k tokens are all
among them) are moved, and `CORRUPT["token"]` changes the state holding
that token.

Caches vLLM stores as each block's data, then their scales (an indexer's
keys, fp8_ds_mla states: data_scale_pages.py) are read and written where
vLLM puts them; a stored row is a slot's data, then its scales, and
`CORRUPT["byte"]` a byte of that row.

Pooled caches (`tokens_per_state` Fraction(1, p), Whisper's block
pooling): a token's p states (slots t*p .. t*p + p of its block) are moved
as its row, [p, C] a head; `CORRUPT["byte"]` counts bytes of that row.

State groups (MambaSpec: a request's state is one block, raw bytes): each
layer's state block is moved whole, between equal TP sizes; where vLLM's
NIXL connector derives how TP splits the state (mamba_states.nixl_split:
Mamba1, Mamba2, GDN in the DS conv layout), row by global row (each conv
sub-projection's channels, then the ssm state's first dimension), as NIXL
moves each sub-projection's slice, so between any TP sizes. Rings
(CircularBufferSpec: one block a request): each layer's block is moved
whole, as NIXL moves a ring's page.

Held sends: with `SEND["held"]` set, the producer sends as a pull-based
connector (NIXL) does: request_finished asks vLLM to keep the request's
blocks, the workers read them and write the files only when the scheduler
reports the request finished (the next step's finished_req_ids), and then
report it finished sending. The KV sent is then what the blocks hold at the
end of the send, not at the end of the prompt's forward.

Stats and metrics of its own (the loads its workers did:
vllm:store_connector_loads), as a wrapped connector may have, beside
kvcsum's.

Tier loads: a request whose kv_transfer_params carry "store_tier_key" (and
"remote_num_tokens") loads that key's KV as an offload tier's hit would:
no do_remote_prefill, no payload.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

import mamba_states
from data_scale_pages import read_rows, split_pages, write_rows
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: Fault injection, set by the test: {"token": position, "layer": name, "head": global head}.
CORRUPT: dict = {}
#: Send mode, set by the test: {"held": True} holds the blocks until sent.
SEND: dict = {}


def _states_per_token(spec) -> int:
    """p of a pooled cache (tokens_per_state Fraction(1, p)); 1 otherwise."""
    from kvcsum.vllm.cache_kinds import states_per_token

    return states_per_token(spec)


@dataclass
class StoreMetadata(KVConnectorMetadata):
    saves: list = field(default_factory=list)  # (store key, num_tokens, {group: block ids})
    loads: list = field(default_factory=list)  # (req_id, store key, first_token, num_tokens, {group: block ids})


@dataclass
class StoreStats(KVConnectorStats):
    """The loads the workers did (summed over workers)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {"loads": 0}

    def aggregate(self, other):
        self.data["loads"] += other.data.get("loads", 0)
        return self

    def reduce(self):
        return dict(self.data)

    def is_empty(self):
        return not self.data.get("loads")


class StorePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls(name="vllm:store_connector_loads", documentation="Loads done by the test's StoreConnector workers.", labelnames=labelnames)
        self.loads = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data, engine_idx: int = 0):
        self.loads[engine_idx].inc(transfer_stats_data.get("loads", 0))


class StoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._dir = extra["store_dir"]
        # "async" (as NIXL: the request waits while its KV arrives) or "sync"
        # (as LMCache: the KV is loaded in the step that computes the rest).
        self._sync = extra.get("load_mode", "async") == "sync"
        self._matched: dict = {}
        self._groups = {
            g: kv_cache_config.kv_cache_groups[g] for g in kv_cache_config.transfer_group_ids
        }
        self._known: dict = {}
        self._pending_loads: dict = {}
        self._caches: dict = {}
        self._done: set = set()
        self.loads_done = 0
        self._stats = StoreStats()
        self._saving: set = set()  # scheduler: requests whose save was scheduled (held sends)
        self._held: dict = {}  # worker: req_id -> (num_tokens, table) to send once finished

    # --- scheduler ---------------------------------------------------------

    def on_new_request(self, request) -> None:
        self._known[request.request_id] = request

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = request.kv_transfer_params or {}
        if (params.get("do_remote_prefill") or params.get("store_tier_key")) and params.get("remote_num_tokens"):
            self._matched[request.request_id] = num_computed_tokens
            if self._sync:
                # A sync load leaves the prompt's last token to compute.
                return max(0, int(params["remote_num_tokens"]) - 1 - num_computed_tokens), False
            return max(0, int(params["remote_num_tokens"]) - num_computed_tokens), True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = request.kv_transfer_params or {}
        if num_external_tokens > 0 and params.get("store_tier_key"):
            first = self._matched.pop(request.request_id, 0)
            self._pending_loads[request.request_id] = (params.pop("store_tier_key"), first, first + num_external_tokens)
        elif num_external_tokens > 0 and params.get("do_remote_prefill"):
            first = self._matched.pop(request.request_id, 0)
            self._pending_loads[request.request_id] = (params["remote_request_id"], first, first + num_external_tokens)
            params["do_remote_prefill"] = False

    def get_loaded_kv_cache_group_ids(self, request):
        return self._kv_cache_config.transfer_group_ids

    def _table(self, req_id: str) -> dict:
        ids = self._kv_cache_manager.get_block_ids(req_id)
        return {g: list(ids[g]) for g in self._groups}

    def build_connector_meta(self, scheduler_output) -> StoreMetadata:
        meta = StoreMetadata()
        for req_id, (key, first, num_tokens) in self._pending_loads.items():
            meta.loads.append((req_id, key, first, num_tokens, self._table(req_id)))
        self._pending_loads = {}
        progress = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        progress += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, computed in progress:
            request = self._known.get(req_id)
            if request is None or not (request.kv_transfer_params or {}).get("do_remote_decode"):
                continue
            prompt = request.num_prompt_tokens
            if computed < prompt <= computed + scheduler_output.num_scheduled_tokens.get(req_id, 0):
                meta.saves.append((req_id, prompt, self._table(req_id)))
                self._saving.add(req_id)
        return meta

    def request_finished(self, request, block_ids):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids):
        self._known.pop(request.request_id, None)
        # Held sends: the blocks stay until the workers report them sent.
        delay = bool(SEND.get("held")) and request.request_id in self._saving
        self._saving.discard(request.request_id)
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or request.status.name == "FINISHED_ABORTED":
            return delay, None
        return delay, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_request_id": request.request_id,
            "remote_num_tokens": request.num_prompt_tokens,
        }

    # --- worker --------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        self._caches = dict(kv_caches)
        self._rank = parallel_state.get_tensor_model_parallel_rank()
        self._tp = parallel_state.get_tensor_model_parallel_world_size()
        parallel = self._vllm_config.parallel_config
        self._dcp = (int(parallel.decode_context_parallel_size), int(parallel.cp_kv_cache_interleave_size))

    def _slots(self, group: int, table: dict, first: int, num_tokens: int, k: int = 1):
        """(positions this rank holds, their blocks, their slots); with DCP a
        block covers block_size x dcp tokens, spread over the DCP ranks
        (vllm.v1.worker.block_table). A compressed cache (k tokens a state):
        its states' numbers instead of positions, block_size / k a block."""
        spec = self._groups[group].kv_cache_spec
        size = spec.block_size // k
        positions = torch.arange(first // k, num_tokens // k)
        dcp, interleave = self._dcp
        if dcp == 1 or not getattr(spec, "dcp_sharded", False):
            return positions, torch.tensor(table[group])[positions // size], positions % size
        offsets = positions % (size * dcp)
        mine = (offsets // interleave) % dcp == self._rank % dcp
        positions, offsets = positions[mine], offsets[mine]
        slots = (offsets // (dcp * interleave)) * interleave + offsets % interleave
        return positions, torch.tensor(table[group])[positions // (size * dcp)], slots

    def _layers(self):
        for group, spec in self._groups.items():
            for name in spec.layer_names:
                cache = self._caches[name]
                heads = cache.shape[1]
                own = getattr(spec.kv_cache_spec, "kv_cache_specs", {}).get(name, spec.kv_cache_spec)
                k = getattr(own, "tokens_per_state", 1)
                k = int(k) if isinstance(k, int) and k > 1 else 1
                # The ranks of a DCP group hold the same heads; every rank
                # holds an MLA cache's one latent (or indexer key) whole.
                first_head = 0 if type(own).__name__ in ("MLAAttentionSpec", "SlidingWindowMLASpec") else (self._rank // self._dcp[0]) * heads
                yield group, name, cache, heads, first_head, k

    def _own_spec(self, group: int, name: str):
        spec = self._groups[group].kv_cache_spec
        return getattr(spec, "kv_cache_specs", {}).get(name, spec)

    def _is_state(self, group: int) -> bool:
        """A MambaSpec group, or a ring (CircularBufferSpec: one block a
        request, moved whole as a connector moving the block does)."""
        return type(self._groups[group].kv_cache_spec).__name__ in ("MambaSpec", "CircularBufferSpec")

    def _state_block(self, group: int, table: dict, num_tokens: int) -> int:
        """The block holding the state after `num_tokens` tokens: the first
        with mamba_cache_mode "none", the one at column (num_tokens - 1) //
        block_size with "align" (where vLLM's kernels keep it, the block
        its connectors move: kv_connector/utils.py clip_ssm_state_blocks)."""
        spec = self._groups[group].kv_cache_spec
        column = max(0, num_tokens - 1) // spec.block_size if getattr(spec, "mamba_cache_mode", "none") == "align" else 0
        return table[group][column]

    def _path(self, key: str, layer: str, head: int) -> str:
        return os.path.join(self._dir, key, f"{layer}.h{head}.pt")

    def _state_rows(self, group: int):
        """(global row, byte offset in this rank's state, bytes) of each
        state row this rank holds where vLLM's NIXL split applies, else None
        (a ring's block is moved whole)."""
        spec = self._groups[group].kv_cache_spec
        if type(spec).__name__ != "MambaSpec":
            return None
        split = mamba_states.nixl_split(spec, self._tp)
        return None if split is None else mamba_states.rows_of(split, self._tp, self._rank)

    def _row_path(self, key: str, layer: str, row: int) -> str:
        return os.path.join(self._dir, key, f"{layer}.r{row}.pt")

    def _load_state(self, key: str, group: int, name: str, block) -> None:
        """A state block: whole (this rank's file) or row by global row."""
        rows = self._state_rows(group)
        page = block.view(-1).view(torch.uint8)
        if rows is None:
            stored = torch.load(self._path(key, name, self._rank)).view(-1).view(torch.uint8).clone()
        else:
            stored = torch.cat([torch.load(self._row_path(key, name, row)) for row, _, _ in rows])
        byte = CORRUPT.get("state")
        if byte is not None and CORRUPT.get("layer", name) == name and CORRUPT.get("rank", self._rank) == self._rank:
            stored[byte] ^= 0x08
            CORRUPT["done"] = CORRUPT.get("done", 0) + 1
        page[: stored.numel()] = stored

    def _save_state(self, key: str, group: int, name: str, block) -> None:
        rows = self._state_rows(group)
        page = block.view(-1).view(torch.uint8)
        if rows is None:
            torch.save(page.clone(), self._path(key, name, self._rank))
            return
        for row, offset, size in rows:
            torch.save(page[offset : offset + size].clone(), self._row_path(key, name, row))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for req_id, key, first, num_tokens, table in meta.loads:
            for group, name, cache, heads, first_head, k in self._layers():
                if self._is_state(group):
                    self._load_state(key, group, name, cache[self._state_block(group, table, num_tokens)])
                    continue
                positions, blocks, offsets = self._slots(group, table, first, num_tokens, k)
                parts = split_pages(name, self._own_spec(group, name), cache)
                for h in range(heads):
                    stored = torch.load(self._path(key, name, first_head + h))[positions].clone()
                    token = CORRUPT.get("token")
                    if token is not None:
                        token //= k  # the state holding it
                    if (
                        token is not None
                        and token in positions.tolist()
                        and CORRUPT.get("layer", name) == name
                        and CORRUPT.get("head", first_head + h) == first_head + h
                    ):
                        raw = stored[positions.tolist().index(token)].view(torch.uint8).view(-1)
                        raw[CORRUPT.get("byte", 3)] ^= 0x10
                        CORRUPT["done"] = CORRUPT.get("done", 0) + 1
                    p = _states_per_token(self._own_spec(group, name))
                    if p > 1:
                        for i in range(p):
                            cache[blocks, h, offsets * p + i] = stored[:, i]
                    elif parts is not None:
                        write_rows(parts, blocks, offsets, stored)
                    else:
                        cache[blocks, h, offsets] = stored
            if not self._sync:
                self._done.add(req_id)
            self.loads_done += 1
            self._stats.data["loads"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def get_kv_connector_stats(self):
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, StoreStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return StoreStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return StorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def _save(self, key: str, num_tokens: int, table: dict) -> None:
        os.makedirs(os.path.join(self._dir, key), exist_ok=True)
        for group, name, cache, heads, first_head, k in self._layers():
            if self._is_state(group):
                self._save_state(key, group, name, cache[self._state_block(group, table, num_tokens)])
                continue
            _, blocks, offsets = self._slots(group, table, 0, num_tokens, k)
            parts = split_pages(name, self._own_spec(group, name), cache)
            p = _states_per_token(self._own_spec(group, name))
            for h in range(heads):
                rows = read_rows(parts, blocks, offsets) if parts is not None else cache[blocks, h, offsets]
                if p > 1:
                    rows = torch.stack([cache[blocks, h, offsets * p + i] for i in range(p)], dim=1)
                torch.save(rows.clone(), self._path(key, name, first_head + h))

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        for key, num_tokens, table in meta.saves:
            if SEND.get("held"):
                self._held[key] = (num_tokens, table)
            else:
                self._save(key, num_tokens, table)

    def get_finished(self, finished_req_ids):
        done, self._done = self._done, set()
        sent = set()
        for req_id in sorted(set(finished_req_ids) & set(self._held)):
            self._save(req_id, *self._held.pop(req_id))
            sent.add(req_id)
        return sent or None, done or None
