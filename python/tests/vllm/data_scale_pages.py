"""vLLM's caches stored as each block's data, then their scales, laid out
as vLLM lays them out, for the stand-in model and the test connectors.
Written here from vLLM's lines, apart from the connector's own reading of
them (kvcsum.vllm.cache_kinds._data_then_scales_bytes,
kvcsum.vllm.cache_checksums._data_then_scales). Each block's page holds
its N slots' data (D bytes each, slot t's at byte t*D), then their scales
(S bytes each, slot t's at N*D + t*S), then padding:

- the sparse-attention indexer's k-cache: D = C - 4 key bytes, S = 4
  (v1/attention/ops/rocm_aiter_mla_sparse.py:190-192,
  models/deepseek_v41/common/ops/indexer_k_store.py:196-213);
- DeepSeek V4's fp8_ds_mla compressed MLA states (584-byte records):
  D = 576 (448 fp8 + 64 bf16), S = 8, N = block_size // tokens_per_state
  (models/deepseek_v4/common/ops/cache_utils.py:64-69, :86-104;
  fused_compress_quant_cache.py:129, :263-272), and its sliding-window
  cache's in the same records (a SlidingWindowMLASpec, N = block_size:
  cache_utils.py:168-230 via xpu/xpu_qnorm_rope_kv_fp8_insert.py:153-162,
  nvidia/ops/dequant_gather_k_cutedsl.py:55-60).

A row, as the stand-in model computes it and the test connectors move it,
is a slot's data then its scales (C = D + S bytes): a byte below D is a
data byte, one from D on a scale byte.
"""

from __future__ import annotations

import torch

INDEXER_SCALE_BYTES = 4
DS_MLA_DATA_BYTES, DS_MLA_SCALE_BYTES = 576, 8


def data_and_scale_bytes(name: str, spec) -> tuple[int, int] | None:
    """(D, S) of a cache vLLM stores as each block's data then its scales,
    or None for any other cache."""
    if type(spec).__name__ not in ("MLAAttentionSpec", "SlidingWindowMLASpec") or str(spec.dtype) != "torch.uint8":
        return None
    if getattr(spec, "model_version", None) == "deepseek_v4" and spec.state_content_bytes == DS_MLA_DATA_BYTES + DS_MLA_SCALE_BYTES:
        return DS_MLA_DATA_BYTES, DS_MLA_SCALE_BYTES
    cell = int(spec.head_size)
    if name.endswith(".indexer.k_cache") and cell % 8 == INDEXER_SCALE_BYTES:
        return cell - INDEXER_SCALE_BYTES, INDEXER_SCALE_BYTES
    return None


def split_pages(name: str, spec, cache: torch.Tensor):
    """(data [B, N, D], scales [B, N, S]) views of such a cache's
    `[B, 1, N, C]` view, or None for any other cache."""
    sizes = data_and_scale_bytes(name, spec)
    if sizes is None:
        return None
    data, scale = sizes
    raw = cache.view(torch.uint8)
    blocks, slots, page = raw.shape[0], raw.shape[2], raw.stride(0)
    assert raw.shape[3] == data + scale, (raw.shape, data, scale)
    start = raw.storage_offset()
    return (
        raw.as_strided((blocks, slots, data), (page, data, 1), start),
        raw.as_strided((blocks, slots, scale), (page, scale, 1), start + slots * data),
    )


def read_rows(parts, blocks, slots) -> torch.Tensor:
    """[n, C]: each slot's data then its scales."""
    data, scales = parts
    return torch.cat([data[blocks, slots], scales[blocks, slots]], dim=-1)


def write_rows(parts, blocks, slots, rows: torch.Tensor) -> None:
    """Writes `rows` ([n, C]: data then scales) to the slots' data and scales."""
    data, scales = parts
    width = data.shape[-1]
    data[blocks, slots] = rows[..., :width]
    scales[blocks, slots] = rows[..., width:]
