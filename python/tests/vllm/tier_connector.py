"""TierConnector: a small offload tier for the vLLM test, the inner connector
that KvcsumConnector wraps. Like vLLM's offloading connector or LMCache it
keeps blocks by block hash: every block that becomes full in a step's
forward is copied, after that forward, to host memory (unless the tier
holds its hash already), up to `capacity` blocks, the least recently used
evicted first; a request whose prompt's leading blocks the tier holds gets
them loaded instead of computed ("async": loaded while the request waits,
reported done in that step; "sync": loaded inside the step that computes
the rest, as LMCache does).

The tier is shared by every engine in the process (as a tier shared by
engines is), each TP rank keeping its own heads: {(rank, hash): {layer:
block}}. A request whose kv_transfer_params say {"skip_tier": True} is
computed, not loaded (so a block can be computed again while the tier holds
its earlier copy).

Fault injection, set by the test in FAULT: {"flip": position} flips one
bit of the tier's copy of the block at that position as it is loaded
(optionally only on TP rank FAULT["rank"]; of layer FAULT["layer"],
layer 1's attention unless set; at byte FAULT["byte"] of the block, 5
unless set: the block is the layer view's `[H, N, C]` bytes, so a
page of a block's data then its scales is its data and its scales, its
padding left); {"stale": position} loads the
bytes of the tier's block at position + 1 into that position's slot (a
stale tier slot holding another hash's bytes).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

#: The tier's blocks: {(tp_rank, block hash): {layer name: block tensor}}.
TIER: dict = {}
#: The hashes the tier holds, least recently used first (the schedulers' view).
INDEX: OrderedDict = OrderedDict()
#: Fault injection (see the module's doc); FAULT["done"] counts the faults made.
FAULT: dict = {}


@dataclass
class TierMetadata(KVConnectorMetadata):
    saves: list = field(default_factory=list)  # (block hash, {group: block id})
    evictions: list = field(default_factory=list)  # block hashes
    loads: list = field(default_factory=list)  # (req_id, [(position, block hash, {group: block id})])


class TierConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._sync = extra.get("load_mode", "async") == "sync"
        self._capacity = int(extra.get("capacity", 1024))
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        dcp = int(vllm_config.parallel_config.decode_context_parallel_size)
        # A manager block: with DCP it covers block_size x dcp tokens (each
        # rank keeps its own part of it, as every rank keeps its heads).
        self._block_size = spec.block_size * (dcp if getattr(spec, "dcp_sharded", False) else 1)
        # Every group's block at a position (one block size for all groups).
        self._groups = tuple(range(len(kv_cache_config.kv_cache_groups)))
        self._group_of = {
            name: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names
        }
        self._known: dict = {}
        self._matched: dict = {}
        self._pending_loads: dict = {}
        self._caches: dict = {}
        self._done: set = set()
        self.loads_done = 0
        self.blocks_loaded = 0
        self.blocks_saved = 0

    # --- scheduler ---------------------------------------------------------

    def on_new_request(self, request) -> None:
        self._known[request.request_id] = request

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if (request.kv_transfer_params or {}).get("skip_tier"):
            return 0, False
        first = num_computed_tokens // self._block_size
        # Leave at least the prompt's last token to compute.
        last = (request.num_tokens - 1) // self._block_size
        hits = []
        for position in range(first, min(last, len(request.block_hashes))):
            block_hash = request.block_hashes[position]
            if block_hash not in INDEX:
                break
            hits.append((position, block_hash))
        if not hits:
            return 0, False
        self._matched[request.request_id] = hits
        return len(hits) * self._block_size, not self._sync

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        hits = self._matched.pop(request.request_id, [])
        if num_external_tokens <= 0 or not hits:
            return
        table = self._kv_cache_manager.get_block_ids(request.request_id)
        hits = hits[: num_external_tokens // self._block_size]
        for _, block_hash in hits:
            INDEX.move_to_end(block_hash)
        self._pending_loads[request.request_id] = [(q, h, {g: table[g][q] for g in self._groups}) for q, h in hits]

    def build_connector_meta(self, scheduler_output) -> TierMetadata:
        meta = TierMetadata()
        meta.loads = list(self._pending_loads.items())
        self._pending_loads = {}
        progress = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        progress += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, computed in progress:
            request = self._known.get(req_id)
            if request is None:
                continue
            end = min(computed + scheduler_output.num_scheduled_tokens.get(req_id, 0), request.num_tokens)
            table = self._kv_cache_manager.get_block_ids(req_id)
            for position in range(computed // self._block_size, end // self._block_size):
                if position >= len(request.block_hashes):
                    break
                block_hash = request.block_hashes[position]
                if block_hash in INDEX:
                    continue
                INDEX[block_hash] = True
                meta.saves.append((block_hash, {g: table[g][position] for g in self._groups}))
                while len(INDEX) > self._capacity:
                    evicted, _ = INDEX.popitem(last=False)
                    meta.evictions.append(evicted)
        return meta

    def request_finished(self, request, block_ids):
        self._known.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids)

    def evict(self, block_hash) -> None:
        """Drops a hash from the tier (the test's eviction of one block)."""
        INDEX.pop(block_hash, None)
        for key in [k for k in TIER if k[1] == block_hash]:
            del TIER[key]

    # --- worker --------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        self._caches = dict(kv_caches)
        self._rank = parallel_state.get_tensor_model_parallel_rank()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for req_id, blocks in meta.loads:
            by_position = {q: h for q, h, _ in blocks}
            for position, block_hash, block_ids in blocks:
                source = block_hash
                if FAULT.get("stale") == position and position + 1 in by_position:
                    source = by_position[position + 1]
                    FAULT["done"] = FAULT.get("done", 0) + 1
                stored = TIER[(self._rank, source)]
                for name, cache in self._caches.items():
                    block = stored[name].contiguous().clone()
                    layer = FAULT.get("layer")
                    hit = name == layer if layer is not None else name.endswith(".1.self_attn.attn")
                    if FAULT.get("flip") == position and FAULT.get("rank", self._rank) == self._rank and hit:
                        raw = block.view(-1).view(torch.uint8)
                        raw[FAULT.get("byte", 5)] ^= 0x01
                        FAULT["done"] = FAULT.get("done", 0) + 1
                    cache[block_ids[self._group_of[name]]].copy_(block)
                self.blocks_loaded += 1
            if not self._sync:
                self._done.add(req_id)
            self.loads_done += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        for block_hash in meta.evictions:
            TIER.pop((self._rank, block_hash), None)
        for block_hash, block_ids in meta.saves:
            TIER[(self._rank, block_hash)] = {
                name: cache[block_ids[self._group_of[name]]].clone() for name, cache in self._caches.items()
            }
            self.blocks_saved += 1

    def get_finished(self, finished_req_ids):
        done, self._done = self._done, set()
        return None, done or None
