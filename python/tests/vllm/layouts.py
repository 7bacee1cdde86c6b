"""The KV cache layouts of vLLM's attention backends, built with torch alone
(no vLLM), for the worker checks on the host (test_cache_checksums.py) and on a GPU
(gpu_worker_check.py).

One logical cache per layer, `[blocks, heads, tokens, K+V]` (vLLM's per-layer
view), filled with random bytes, is laid out the way each backend keeps it:

- "LBNHC": vLLM's NHD view (token-major pages, FlashAttention's order);
- "LBHNC": vLLM's HND view (head-major pages, FlashInfer's order);
- "BLNHC": block-outermost pages (each block holds every layer's page);
- "FA": FlashAttention's `[2, blocks, tokens, heads, head_size]`;
- "FI": FlashInfer's `[blocks, 2, tokens, heads, head_size]` over HND memory;
- "KB2": vLLM's NHD view split into kernel blocks of half the block size
  (`[2*blocks, heads, tokens/2, K+V]`);
- "MLA": one latent row per token, `[blocks, tokens, latent]`, and vLLM's
  `[blocks, 1, tokens, latent]` view of it ("MLA4").

Every layout holds the same bytes per (layer, head, token), so every
layout's checksums must equal every other's.
"""

from __future__ import annotations

import torch

from kvcsum.vllm.cache_checksums import CacheChecksummer, Job, LayerSpec

LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "FA", "FI", "KB2"]
MLA_LAYOUTS = ["MLA", "MLA4"]


def logical_caches(num_layers: int, num_blocks: int, heads: int, tokens: int, content: int, seed: int = 0, dtype=torch.float16):
    """[layer][blocks, heads, tokens, content] random contents (as dtype)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 2**16, (num_layers, num_blocks, heads, tokens, content), generator=generator, dtype=torch.int32)
    return [raw[i].to(torch.int16).view(dtype) for i in range(num_layers)]


def lay_out(logical: list, layout: str, device: str = "cpu") -> list:
    """The layers' caches in `layout`, on `device` (same bytes as `logical`)."""
    num_layers = len(logical)
    B, H, N, C = logical[0].shape
    if layout == "LBNHC":
        return [t.permute(0, 2, 1, 3).contiguous().to(device).permute(0, 2, 1, 3) for t in logical]
    if layout == "LBHNC":
        return [t.contiguous().to(device) for t in logical]
    if layout == "BLNHC":
        stacked = torch.stack([t.permute(0, 2, 1, 3) for t in logical], dim=1).contiguous().to(device)  # [B, L, N, H, C]
        return [stacked[:, i].permute(0, 2, 1, 3) for i in range(num_layers)]
    if layout == "FA":
        D = C // 2
        out = []
        for t in logical:
            nhd = t.permute(0, 2, 1, 3)  # [B, N, H, C]
            out.append(torch.stack([nhd[..., :D], nhd[..., D:]], dim=0).contiguous().to(device))  # [2, B, N, H, D]
        return out
    if layout == "FI":
        D = C // 2
        out = []
        for t in logical:
            hnd = torch.stack([t[..., :D], t[..., D:]], dim=1).contiguous().to(device)  # [B, 2, H, N, D]
            out.append(hnd.permute(0, 1, 3, 2, 4))  # logical [B, 2, N, H, D]
        return out
    if layout == "KB2":
        return [
            t.reshape(B, H, 2, N // 2, C).permute(0, 2, 3, 1, 4).reshape(B * 2, N // 2, H, C).contiguous().to(device).permute(0, 2, 1, 3)
            for t in logical
        ]
    if layout == "MLA":
        return [t[:, 0].contiguous().to(device) for t in logical]  # [B, N, C]
    if layout == "MLA4":
        return [t[:, :1].contiguous().to(device) for t in logical]  # [B, 1, N, C]
    raise ValueError(layout)


def layer_specs(num_layers: int, block_size: int, heads: int, head_size: int, *, mla: bool = False, total_kv_heads=None, shared: dict | None = None):
    """LayerSpecs as the connector makes them from vLLM's config; `shared`
    maps a KV-sharing layer's number to its target's."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    for number in sorted(shared or {}):
        names.append(f"model.layers.{number}.self_attn.attn")
    out = []
    for name in names:
        out.append(
            LayerSpec(
                name=name,
                group_id=0,
                spec_type="MLAAttentionSpec" if mla else "FullAttentionSpec",
                block_size=block_size,
                dtype="torch.float16",
                num_kv_heads=1 if mla else heads,
                head_size=head_size if not mla else head_size * 2,
                head_size_v=0 if mla else head_size,
                is_mla=mla,
                total_kv_heads=total_kv_heads,
            )
        )
    return out


def checksummer(specs, caches: list, num_blocks: int, block_size: int, *, tp_rank=0, tp_size=1, shared=None):
    kv = {spec.name: caches[i] for i, spec in enumerate(specs[: len(caches)])}
    for number, target in sorted((shared or {}).items()):
        kv[f"model.layers.{number}.self_attn.attn"] = caches[target]
    return CacheChecksummer(specs, kv, num_blocks, {0: block_size}, tp_rank=tp_rank, tp_size=tp_size)


def jobs(block_size: int):
    """Two requests: 45 tokens over blocks [3, 1, 6], 20 over [5, 0]."""
    return [Job("a", 45, {0: (0, [3, 1, 6])}), Job("b", 20, {0: (0, [5, 0])})]


def values(checksum: CacheChecksummer, role: int, job_list) -> dict:
    """{(req, column key): numpy values} of one checksum call (waits)."""
    pending = checksum.checksum(job_list, role)
    result = pending.result
    result.wait()
    out = {}
    for job in job_list:
        for key, column in result.columns(job.req_id, 0).items():
            out[(job.req_id, key)] = column.copy()
    result.close()
    return out
