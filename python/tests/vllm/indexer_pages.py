"""vLLM's sparse-attention indexer k-cache as vLLM lays it out, for the
stand-in model and the test connectors: each block's page holds its
tokens' keys (K bytes each, token t's at byte t*K), then their 4-byte
scales (token t's at block_size*K + t*4)
(v1/attention/ops/rocm_aiter_mla_sparse.py:190-192,
models/deepseek_v41/common/ops/indexer_k_store.py:196-213). Written here
from those lines, apart from the connector's own reading of them
(kvcsum.vllm.cache_checksums._keys_then_scales).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def split_pages(name: str, spec, cache: torch.Tensor):
    """(keys [B, N, K], scales [B, N, 4]) views of an indexer k-cache's
    `[B, 1, N, C]` uint8 view (C = K + 4, K a multiple of 8), or None for
    any other cache."""
    if not name.endswith(".indexer.k_cache") or type(spec).__name__ != "MLAAttentionSpec":
        return None
    cell = int(spec.head_size)
    if str(spec.dtype) != "torch.uint8" or cell % 8 != SCALE_BYTES:
        return None
    raw = cache.view(torch.uint8)
    blocks, tokens, page = raw.shape[0], raw.shape[2], raw.stride(0)
    keys = cell - SCALE_BYTES
    start = raw.storage_offset()
    return (
        raw.as_strided((blocks, tokens, keys), (page, keys, 1), start),
        raw.as_strided((blocks, tokens, SCALE_BYTES), (page, SCALE_BYTES, 1), start + tokens * keys),
    )


def read_rows(parts, blocks, slots) -> torch.Tensor:
    """[n, C]: each slot's key then its scale."""
    keys, scales = parts
    return torch.cat([keys[blocks, slots], scales[blocks, slots]], dim=-1)


def write_rows(parts, blocks, slots, rows: torch.Tensor) -> None:
    """Writes `rows` ([n, C]: key then scale) to the slots' keys and scales."""
    keys, scales = parts
    width = keys.shape[-1]
    keys[blocks, slots] = rows[..., :width]
    scales[blocks, slots] = rows[..., width:]
