"""LMCache 0.5.6 on the CPU, in the harness's one process: what the vLLM
test needs so that vLLM 0.33.0's real LMCacheConnectorV1 (LMCache's own
vllm_v1_adapter, its engine, token database, lookup server and local CPU
backend) runs with no GPU. Nothing here changes what LMCache stores or
looks up; it stands in for what a GPU process has:

- vLLM's TP and PP groups (LMCache's engine broadcasts through the first
  and asks the second whether it is the last stage): one-rank stand-ins.
- The GPU connector (LMCache's copy between vLLM's paged KV cache and its
  chunks): LMCache picks none on a CPU device, so `install` makes it this
  module's `CPUPagedConnector`, a VLLMPagedMemGPUConnectorV2 without its
  CUDA streams. Its copy is either LMCache's own (`transfer="stock"`: its
  torch kernel, lmcache.v1.platform.torch_ops.mem_kernels, the code LMCache
  runs where its CUDA ops do not load) or the test's (`transfer="exact"`:
  each token's K and V read from vLLM 0.33.0's packed [blocks, heads,
  tokens, K+V] cache by its slot, a loop over logical indices).
- `corrupt`: a byte of LMCache's stored chunk flipped where its local CPU
  backend holds it (after the store, before the reload).

Configuration: LMCache reads its settings from LMCACHE_* variables, set by
`environment()` before LMCache is imported: 16-token chunks (one vLLM
block), the local CPU backend, no remote, no disk.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

CHUNK = 16


def environment() -> dict:
    """LMCache's settings for the test (its LMCACHE_* variables)."""
    return {
        "LMCACHE_CHUNK_SIZE": str(CHUNK),
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25",
        "LMCACHE_DISABLE_BANNER": "1",
        "LMCACHE_LOG_LEVEL": "WARNING",
        "PYTHONHASHSEED": "0",
    }


class _OneRankGroup:
    """vLLM's TP group as LMCache's engine uses it, for one rank."""

    world_size = 1
    rank_in_group = 0

    @staticmethod
    def broadcast(tensor, src=0):
        return tensor

    @staticmethod
    def broadcast_object(obj, src=0):
        return obj


STATE = SimpleNamespace(transfer="exact", copies=0)


def _exact_copy(memory_obj, kvcaches, slot_mapping, start: int, end: int, to_cache: bool, skip: int = 0) -> None:
    """LMCache's KV_2LTD chunk [K/V, layer, token, heads*head_size] to or from
    vLLM 0.33.0's per-layer cache, logical [block, head, token in block,
    K+V] (K the first head_size elements, V the rest), token by token."""
    chunk = memory_obj.tensor
    for t in range(start + skip, end):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        block, offset = divmod(slot, CHUNK)
        for layer, cache in enumerate(kvcaches):
            heads, packed = cache.shape[1], cache.shape[3]
            size = packed // 2
            for kv in range(2):
                cached = cache[block, :, offset, kv * size : (kv + 1) * size]
                row = chunk[kv, layer, t - start].view(heads, size)
                if to_cache:
                    cached.copy_(row)
                else:
                    row.copy_(cached)


def install(transfer: str) -> None:
    """Makes LMCache run on the CPU with the given copy ("stock": LMCache's
    own torch kernel; "exact": the test's). Call before the first engine."""
    assert transfer in ("stock", "exact"), transfer
    STATE.transfer = transfer
    from vllm.distributed import parallel_state

    parallel_state.get_tp_group = lambda: _OneRankGroup()
    import lmcache.integration.vllm.vllm_v1_adapter as adapter

    adapter.get_pp_group = lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True, rank_in_group=0, world_size=1)

    import lmcache.v1.gpu_connector as gpu_connector_module
    from lmcache import device_ops
    import lmcache.lmcache_native as lmcache_native
    from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2
    from lmcache.v1.gpu_connector.utils import (
        get_block_size,
        get_head_size,
        get_num_blocks,
        normalize_kv_and_discover_format,
    )

    class CPUPagedConnector(VLLMPagedMemGPUConnectorV2):
        """VLLMPagedMemGPUConnectorV2 with no CUDA stream or device check."""

        def __init__(self, hidden_dim_size, num_layers, use_gpu=False, **kwargs):
            self.hidden_dim_size = hidden_dim_size
            self.num_layers = num_layers
            self.kv_cache_pointers = torch.empty(num_layers, dtype=torch.int64)
            self.kv_cache_pointers_on_gpu = {}
            self.kvcaches = None
            self.gpu_buffer = None
            self.use_mla = bool(kwargs.get("use_mla"))
            self.layout_hints = kwargs.get("layout_hints") or {}

        def _initialize_pointers(self, kv_caches):
            self.device = kv_caches[0].device
            self.engine_kv_format, normalized = normalize_kv_and_discover_format(
                kv_caches, self._engine_type(), layout_hints=self.layout_hints
            )
            self.kv_cache_pointers.numpy()[:] = [t.data_ptr() for t in normalized]
            self.num_blocks = get_num_blocks(normalized, self.engine_kv_format)
            self.block_size = get_block_size(normalized, self.engine_kv_format)
            self.page_buffer_size = self.num_blocks * self.block_size
            self.head_size = get_head_size(normalized, self.engine_kv_format)
            return self.kv_cache_pointers

        @staticmethod
        def _engine_type():
            from lmcache.utils import EngineType

            return EngineType.VLLM

        def _transfer(self, memory_obj, start, end, direction, kwargs, skip=0):
            self.initialize_kvcaches_ptr(**kwargs)
            slot_mapping = kwargs["slot_mapping"]
            STATE.copies += 1
            if STATE.transfer == "exact":
                caches = list(kwargs.get("kvcaches") or self.kvcaches)
                _exact_copy(memory_obj, caches, slot_mapping, start, end, direction == "H2D", skip)
                return
            pointers = self._initialize_pointers(self.kvcaches)
            device_ops.multi_layer_kv_transfer(
                memory_obj.tensor,
                pointers,
                slot_mapping[start:end],
                self.device,
                self.page_buffer_size,
                getattr(lmcache_native.TransferDirection, direction),
                self.engine_kv_format,
                block_size=self.block_size,
                head_size=self.head_size,
                skip_prefix_n_tokens=skip,
            )

        def to_gpu(self, memory_obj, start, end, **kwargs):
            vllm_cached = kwargs.get("vllm_cached_tokens", 0)
            skip = min(end - start, max(0, vllm_cached - start))
            self._transfer(memory_obj, start, end, "H2D", kwargs, skip)

        def from_gpu(self, memory_obj, start, end, **kwargs):
            self._transfer(memory_obj, start, end, "D2H", kwargs)

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
            for memory_obj, start, end in zip(memory_objs, starts, ends):
                self.to_gpu(memory_obj, start, end, **kwargs)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for memory_obj, start, end in zip(memory_objs, starts, ends):
                self.from_gpu(memory_obj, start, end, **kwargs)

    def create(config, metadata, engine, layout_hints=None, **_):
        return CPUPagedConnector.from_metadata(metadata, False, torch.device("cpu"), layout_hints=layout_hints)

    gpu_connector_module.CreateGPUConnector = create


def shutdown() -> None:
    """Destroys LMCache's per-process engine (an engine built later in the
    process would otherwise get this one's, with its caches)."""
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    LMCacheEngineBuilder.destroy(ENGINE_NAME)


def stored_chunks() -> list:
    """The memory objects LMCache's local CPU backend holds, in store order."""
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    engine = LMCacheEngineBuilder.get(ENGINE_NAME)
    backend = engine.storage_manager.storage_backends["LocalCPUBackend"]
    return list(backend.hot_cache.values())


def corrupt(chunk_index: int, byte: int = 5) -> None:
    """Flips one bit of the `chunk_index`-th chunk LMCache holds (its layer
    1 K, the first token), where its local CPU backend keeps it."""
    chunk = stored_chunks()[chunk_index].tensor
    raw = chunk[0, 1].contiguous().view(torch.uint8)
    raw[byte] ^= 0x01
    chunk[0, 1].copy_(raw.view(chunk.dtype).view(chunk[0, 1].shape))


def setup_environment() -> None:
    for key, value in environment().items():
        os.environ.setdefault(key, value)
