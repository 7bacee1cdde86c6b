"""The kinds of KV cache vLLM 0.33 hands the connector, and how kvcsum
registers each (the per-kind rules of kvcsum.vllm.cache_checksums). Needs
torch and kvcsum, never vLLM: the rules read LayerSpec's plain fields.

What vLLM 0.33 allocates (vllm.v1.kv_cache_interface.create_kv_cache_views:
one `[B, H, N, C]` view per layer, C the bytes of one cell viewed as the
spec's dtype) and what kvcsum makes of it:

- attention, dense K/V (`FullAttentionSpec`, `SlidingWindowSpec`, ...):
  H KV heads, each cell K then V: one kvcsum layer per cache.
- quantized per-token-head cells (`kv_quant_mode` int8/fp8 per token head,
  Triton): the spec sets `state_content_bytes`, each head's cell is K, its
  scale, V, its scale (72 bytes for 32-element heads). The cell is
  checksummed whole, as **opaque cells**: the scales are bytes of the cell,
  computed from the token's KV with it, so a flipped scale byte is a
  changed cell (MISMATCH), and two sides that read the same bytes
  differently (another kv_cache_dtype or head size) are told apart by the
  declared decodings (kvcsum.vllm.decoding: DECODING_DIFFERS, UNVERIFIED),
  never by the sums. Per-tensor fp8 scales (`fp8` kv_cache_dtype) are no
  cell bytes: they are declared decodings too (a scale that differs is
  UNVERIFIED DECODING_DIFFERS, never MISMATCH).
- head slots (`num_head_slots`, nvfp4 on FlashInfer: 2·H slots, the H K
  slots then the H V slots, each slot's cell packed fp4 data and its fp8
  block scales): two caches of one layer, the K slots numbered as heads
  `0..H_total` and the V slots `H_total..2·H_total` (SPEC section 1,
  several caches of one layer: heads one cache after the other), so that
  TP shards add up alike at any TP size. b12x's two slots (the K slot,
  then the V slot, each a token's K (V) of every head of the rank,
  `state_content_bytes` H x head_size x element size) are numbered the
  same way, each slot viewed as `[B, N, H, head_size]`; ROCm's two slots
  (the same spec fields, tiled: no cell per token) are not checksummed.
- MLA (`MLAAttentionSpec`: one latent head, replicated on every TP rank)
  and several caches of one layer number (DeepSeek V3.2: the MLA cache
  `....self_attn.attn` and its indexer's k-cache `....self_attn.indexer.k_cache`,
  one group, `UniformTypeKVCacheSpecs`): the caches of one layer number
  get consecutive heads in layer-name order (the definition's cache order).
- Mamba state (`MambaSpec`): a raw `[B, 1, 1, content]` int8 page per
  layer (conv state then ssm state packed at the page's front, the page
  padded to the attention page size; a request's state is one block: the
  first of its list, or with mamba_cache_mode "align" (a state per block)
  the one at column (n - 1) // block_size, kvcsum.vllm.scheduler).
  Registered as a state layer (kvcs_worker_add_state, SPEC section 6), its
  tensors conv then ssm, each row its first dimension. MambaSpec does not
  say along which dimension TP splits the state, so the state is
  **shard-keyed**: compared between equal TP sizes only (another TP size is
  UNVERIFIED, never MISMATCH).
- rings (`CircularBufferSpec`: DeepSeek V4.1's compressor, GLM-5 Next's
  indexer tail, one block a request, rows written at position % capacity,
  never zeroed): a state layer too, its state the request's one block,
  compared whole (stale slots included, as connectors move the whole
  page), each head slot's rows a state tensor in slot order whatever the
  layout (`ring_tensors`), shard-keyed, registered under layer number
  RING_LAYER_NUMBERS + n (`_ring_state`).
- pooled states (`tokens_per_state` Fraction(1, p), Whisper's block
  pooling: token t's state i at slot t*p + i of its block): p caches of
  the layer, state i a view of slots i, i + p, ..., its heads after the
  states before it (SPEC section 1), so each token has a cell per (state,
  head) at its place in the request; the identity carries p
  (`states_per_token`, cache_checksums.identity).

- DCP-sharded token positions (`decode_context_parallel_size` > 1: a
  manager block covers block_size x dcp tokens, the token at in-block
  offset o on DCP rank (o // I) % dcp at local slot (o // (dcp I)) I + o % I)
  and compressed states (`tokens_per_state` > 1): the group's token
  placement registered with the library (Worker.set_group_placement,
  where this kvcsum has it: `PLACEMENT`), each token numbered by its place
  in the request, so the DCP ranks' sums add up to the block's value.

What kvcsum still cannot checksum is named (`unsupported`) and never
silent (kvcsum.vllm.load_verdict): compressed states and DCP without the
library's token placement, a tokens_per_state fraction other than 1/p,
host-resident groups (not in memory the workers read), state elements of
other than 2 or 4 bytes (a ring's too), an unknown mamba_cache_mode, head
slots packed other than K slots then V slots (and ROCm's), specs other
than a ring that address their pages themselves (`uses_slot_mapping`
False), and caches whose `[B, H, N, C]` view is no cell per token (`_no_token_cells`:
cells of no multiple of 8 bytes other than the indexer's below, and
DeepSeek V4's fp8_ds_mla states), the indexer's keys on ROCm (tiled in a
block) and on a device worker of a kvcsum whose device engine does not
read 4-byte pieces (this one's: SPEC section 1). A group holding one of
these is not checksummed at all, its other caches included.

- the sparse-attention indexer's k-cache (DeepSeek V3.2's
  DeepseekV32IndexerCache, V4's C4A indexer: `_indexer_key_bytes`): each
  block's page holds its tokens' keys (K bytes each), then their 4-byte
  scales. Registered as one cell of two segments, the keys (K) and the
  scales (V), so the cell is a token's key then its scale: 132 bytes,
  read in 4-byte pieces (SPEC section 1).
"""

from __future__ import annotations

import math
from fractions import Fraction

import kvcsum

__all__ = ["describe_spec", "state_tensors", "ring_tensors", "global_heads", "group_block_size", "states_per_token", "PLACEMENT", "DTYPE_BYTES"]

#: Whether this kvcsum registers a group's token placement (DCP shards,
#: compressed states: Worker.set_group_placement, SPEC section 16).
PLACEMENT = callable(getattr(kvcsum.Worker, "set_group_placement", None))


def group_block_size(spec, dcp: int = 1) -> int:
    """The tokens of one of the KV cache manager's blocks of a group: with
    DCP, a DCP-sharded group's block covers block_size x dcp tokens
    (vllm.v1.worker.block_table; AttentionSpec.max_num_blocks_per_req)."""
    size = int(spec.block_size)
    return size * dcp if dcp > 1 and getattr(spec, "dcp_sharded", False) else size

#: Element sizes of the dtypes vLLM's specs name.
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8": 1,
    "uint8": 1,
    "int8": 1,
    "fp8": 1,
}


def dtype_bytes(dtype: str) -> int | None:
    text = str(dtype).replace("torch.", "")
    for name, size in DTYPE_BYTES.items():
        if text.startswith(name):
            return size
    return None


def describe_spec(
    name: str, group_id: int, spec, total_kv_heads: int | None, dcp_size: int = 1, is_mla: bool = False
) -> dict:
    """The LayerSpec fields of one layer's vLLM spec (duck-typed: any object
    with vLLM 0.33's spec attributes), `unsupported` naming why kvcsum
    cannot checksum it ("" where it can)."""
    type_name = type(spec).__name__
    common = dict(
        name=name,
        group_id=group_id,
        spec_type=type_name,
        block_size=int(spec.block_size),
        dtype=str(getattr(spec, "dtype", None)),
    )
    unsupported = ""
    if hasattr(spec, "shapes") and hasattr(spec, "dtypes"):  # MambaSpec
        shapes = tuple(tuple(int(n) for n in shape) for shape in spec.shapes)
        dtypes = tuple(str(d) for d in spec.dtypes)
        sizes = [dtype_bytes(d) for d in dtypes]
        # vLLM's Mamba state dtypes are its model dtypes and MambaDType
        # (float16, bfloat16, float32: config/cache.py, config/model.py):
        # this guards a spec built some other way.
        if any(size not in (2, 4) for size in sizes):
            unsupported = f"{type_name} has state elements of {dtypes}: kvcsum reads 2- or 4-byte state elements"
        elif str(getattr(spec, "mamba_cache_mode", "none")) not in ("none", "align"):
            unsupported = f"{type_name} has mamba_cache_mode {spec.mamba_cache_mode!r}, a mode kvcsum does not know"
        return dict(common, kind="state", state_shapes=shapes, state_dtypes=dtypes, unsupported=unsupported)
    is_attention = hasattr(spec, "num_kv_heads") and hasattr(spec, "head_size")
    if not is_attention or not getattr(spec, "has_layer_views", True):
        return dict(common, kind="state", unsupported=f"{type_name} has no per-token KV blocks")
    if not getattr(spec, "uses_slot_mapping", True):
        if type_name == "CircularBufferSpec":
            return dict(common, **_ring_state(type_name, spec))
        # A spec that addresses its pages itself: vLLM's worker gives it no
        # slot mapping, so no slot is the token at its place in a block.
        return dict(common, kind="state", unsupported=f"{type_name} addresses its pages itself (no slot mapping): no per-token KV blocks")
    tokens_per_state = getattr(spec, "tokens_per_state", 1)
    pooled = states_per_token(spec)
    dcp_sharded = dcp_size > 1 and bool(getattr(spec, "dcp_sharded", False))
    # p states a token (pooled > 1) are p caches of the layer, not a placement.
    if tokens_per_state != 1 and pooled == 1 and not (PLACEMENT and isinstance(tokens_per_state, int) and tokens_per_state > 1):
        unsupported = f"{type_name} stores {tokens_per_state} tokens per state (no token placement registered)"
    elif dcp_sharded and not PLACEMENT:
        unsupported = f"DCP shards its token positions across {dcp_size} ranks (no token placement registered)"
    heads = int(spec.num_kv_heads)
    slots = getattr(spec, "num_head_slots", None)
    num_slots, folded = 0, False
    cell = getattr(spec, "state_content_bytes", None)
    size = dtype_bytes(getattr(spec, "dtype", ""))
    # Two slots, K then V, each a token's K (V) of every head of the rank
    # (b12x, ROCm's paged attention and AITER shuffle: `customize_spec`
    # sets num_head_slots 2, state_content_bytes num_kv_heads x head_size x
    # element size).
    whole_side = (
        slots is not None and int(slots) == 2 and cell is not None and size is not None
        and int(cell) == heads * int(spec.head_size) * size
        and int(getattr(spec, "head_size_v", spec.head_size) or 0) == int(spec.head_size)
    )
    if whole_side and _on_rocm() and not unsupported:
        # ROCm's (rocm_attn.py: x-packed K, split_kv_cache; rocm_aiter_fa.py:
        # a head_size x block_size tile a side): no cell per token.
        unsupported = f"its K and V head slots hold ROCm's tiled layout ({heads} KV heads, {cell}-byte slots): no cell per token"
    elif whole_side and heads > 1:
        num_slots, folded = 2, True  # the K slot then the V slot, heads inside each
    elif slots is not None and int(slots) != heads:
        if int(slots) == 2 * heads:
            num_slots = int(slots)  # K slots then V slots
        elif not unsupported:
            unsupported = f"its {heads} KV heads are packed into {slots} head slots, a packing kvcsum does not know"
    if cell is None and num_slots:
        # A slot holds K or V alone.
        cell = int(spec.state_content_size_bytes)
    key_bytes = _indexer_key_bytes(name, spec, is_mla)
    if not unsupported and key_bytes:
        unsupported = _indexer_layout_unknown(type_name)
    if not unsupported and not key_bytes:
        unsupported = _no_token_cells(type_name, spec, cell, is_mla)
    return dict(
        common,
        num_kv_heads=heads,
        head_size=int(spec.head_size),
        head_size_v=int(getattr(spec, "head_size_v", spec.head_size) or 0),
        is_mla=bool(is_mla),
        total_kv_heads=total_kv_heads,
        num_slots=num_slots,
        folded_slots=folded,
        cell_bytes=int(cell) if cell is not None else 0,
        tokens_per_state=int(tokens_per_state) if isinstance(tokens_per_state, int) else 1,
        dcp_size=dcp_size if dcp_sharded else 1,
        key_bytes=key_bytes,
        states_per_token=pooled,
        unsupported=unsupported,
    )


def states_per_token(spec) -> int:
    """The states a token has in the cache of `spec`: p where vLLM's
    `tokens_per_state` is Fraction(1, p), p > 1 (Whisper's block pooling,
    model_executor/models/whisper_causal.py:414-417); 1 for any other spec.

    vLLM writes token t's p states at p consecutive slots of its block,
    slot t*p + i for state i (whisper_causal.py:238-241: the slot mapping
    `slot * block_pool_size + arange(block_pool_size)`, a block of
    block_size * p slots, `get_num_kernel_states`, v1/kv_cache_interface.py:
    272-275). kvcsum registers state i of every token as its own cache of
    the layer, a view of slots i, i + p, i + 2p, ..., its heads numbered
    after the states before it (SPEC section 1: several caches of one
    layer), so every token has a cell per (state, head) at its place in the
    request, and TP shards and block sizes add up as for any cache."""
    value = getattr(spec, "tokens_per_state", 1)
    if isinstance(value, Fraction) and value.numerator == 1 and value.denominator > 1:
        return int(value.denominator)
    return 1


def _ring_state(type_name: str, spec) -> dict:
    """The LayerSpec fields of a ring (`CircularBufferSpec`): a state layer
    whose state is the request's one block, compared whole, shard-keyed.

    vLLM 0.33's rings (DeepSeek V4.1's compressor, models/deepseek_v41/
    compressor.py:86-94, 231-237; GLM-5 Next's indexer tail, models/
    glm5next/common/attention.py:125-180; Qwen4's QSA cache, Step5's CSA
    tail) hold one block a request (v1/core/single_type_kv_cache_manager.py:
    1186-1229), its rows written at `position % capacity` as the request
    advances, drafts included; the block is never zeroed (:115-120), so
    slots no row reached hold what the block held before. NIXL moves the
    whole page (nixl/base_worker.py:241-251, its regions :1782-1786), from
    the TP rank of the same number at equal TP (nixl/tp_mapping.py:107-126),
    as does every connector that restores the transfer groups
    (get_loaded_kv_cache_group_ids: nixl/connector.py:175, mooncake, moriio).
    The rows are the same on every TP rank (DeepSeek V4.1's wkv has
    disable_tp), the stale slots are not: compared as the rank's own bytes
    (shard-keyed, SPEC section 6), between equal TP sizes only. Each head
    slot's rows are one state tensor, read through the view's strides, so
    the bytes are numbered head, slot, element whatever the layout."""
    size = dtype_bytes(getattr(spec, "dtype", ""))
    heads = int(getattr(spec, "num_head_slots", None) or spec.num_kv_heads)
    content = int(spec.state_content_size_bytes)
    if size not in (2, 4) or content % size:
        return dict(kind="state", unsupported=f"{type_name} holds {spec.dtype} rows of {content} bytes: kvcsum reads 2- or 4-byte state elements")
    shapes = tuple((int(spec.num_states), content // size) for _ in range(heads))
    return dict(kind="state", state_shapes=shapes, state_dtypes=(str(spec.dtype),) * heads, ring=True, unsupported="")


#: What a ring's layer number is registered under: this plus the number in
#: its name. A ring lives inside an attention layer (DeepSeek V4.1's
#: `model.layers.N.self_attn.compressor.state_cache` beside
#: `model.layers.N.self_attn`, whose cache is in another group), and the
#: library keeps a layer number to one kind of cache (an attention cache,
#: or a state, or an alias: SPEC section 7), so the ring's state takes a
#: number no model's layer has. Every side running this kvcsum numbers it
#: alike; the fingerprint is the ring's own name's (its identity).
RING_LAYER_NUMBERS = 1 << 24


def ring_tensors(tensor, spec):
    """The kvcsum.StateTensors of a ring's `[B, H, N, C]` view (vLLM's, any
    stride order): one per head slot, its N rows of C elements in slot
    order (kvcsum.vllm.cache_kinds._ring_state). Shard-keyed: this rank's."""
    if tensor.dim() != 4 or int(tensor.stride(3)) != 1:
        raise ValueError(f"layer {spec.name}: its ring view of shape {tuple(tensor.shape)} and strides {tuple(tensor.stride())} has no contiguous rows")
    item = int(tensor.element_size())
    size = dtype_bytes(spec.state_dtypes[0])
    heads, rows, width = (int(n) for n in tensor.shape[1:])
    if (heads, (rows, width * item // size)) != (len(spec.state_shapes), spec.state_shapes[0]) or width * item % size:
        raise ValueError(f"layer {spec.name}: its ring view of shape {tuple(tensor.shape)} is not its spec's {spec.state_shapes}")
    return [
        kvcsum.StateTensor(
            address=int(tensor.data_ptr()) + h * int(tensor.stride(1)) * item,
            block_stride=int(tensor.stride(0)) * item,
            row_stride=int(tensor.stride(2)) * item,
            first_row=0,
            num_rows=rows,
            total_rows=rows,
            bytes_per_row=width * item,
            element_size=size,
        )
        for h in range(heads)
    ]


def _on_rocm() -> bool:
    """Whether torch is ROCm's build (vLLM's ROCm attention backends)."""
    import torch

    return getattr(torch.version, "hip", None) is not None


#: Bytes of the scale vLLM stores after each token's indexer key: one fp32
#: (or four packed ue8m0 bytes) per token, FP8 and MXFP4 keys alike
#: (model_executor/models/deepseek_v2.py:724-736, head_dim + head_dim //
#: 128 * 4 with quant_block_size 128; models/deepseek_v41/common/ops/
#: indexer_k_store.py:70-75, scale_dim 4).
INDEXER_SCALE_BYTES = 4


def _indexer_key_bytes(name: str, spec, is_mla: bool) -> int:
    """The key bytes per token of a sparse-attention indexer's k-cache
    that vLLM stores as a block's keys, then their scales; 0 for any other
    cache.

    DeepSeek V3.2's DeepseekV32IndexerCache (model_executor/models/
    deepseek_v2.py:638-667: an MLAAttentionSpec of one head, uint8,
    head_size 132, cache_role INDEXER) and DeepSeek V4's indexer cache
    (models/deepseek_v4/attention.py:911-924: the same spec with
    tokens_per_state, no cache_role) hold per token 128 fp8 key bytes (64
    with MXFP4) and a 4-byte scale, C = 132 (68). vLLM writes token t's key
    at byte t*K of its block's page and its scale at block_size*K + t*4
    (v1/attention/ops/rocm_aiter_mla_sparse.py:190-192: "the first portion
    as kv cache value and second portion as kv cache scale", its kernel at
    :156-175; models/deepseek_v41/common/ops/indexer_k_store.py:196-213;
    the CUDA op _custom_ops.py:3191 indexer_k_quant_and_cache, called from
    model_executor/layers/sparse_attn_indexer.py:573). The two parts are
    registered as two segments of one cell, K = the keys, V = the scales
    (SPEC section 1: a 132-byte cell is read in 4-byte pieces).
    """
    if not is_mla or dtype_bytes(getattr(spec, "dtype", "")) != 1 or int(getattr(spec, "num_kv_heads", 1)) != 1:
        return 0
    role = str(getattr(getattr(spec, "cache_role", None), "value", getattr(spec, "cache_role", "")))
    if role != "indexer" and not name.endswith(".indexer.k_cache"):
        return 0
    cell = int(spec.head_size)
    keys = cell - INDEXER_SCALE_BYTES
    return keys if keys > 0 and keys % 8 == 0 else 0


def _indexer_layout_unknown(type_name: str) -> str:
    """Why an indexer k-cache's keys-then-scales pages cannot be read as
    such here, or "": on ROCm, vLLM tiles a block's keys in 16 x 16-byte
    tiles above block size 1 (models/deepseek_v32/amd/rocm.py:28-31,
    models/deepseek_v41/common/ops/indexer_k_store.py:76-85), no key per
    token at t*K."""
    if _on_rocm():
        return f"{type_name} (a sparse-attention indexer's keys) is tiled within a block on ROCm: no key per token kvcsum can read"
    return ""


def _no_token_cells(type_name: str, spec, cell, is_mla: bool) -> str:
    """Why a cache's `[B, H, N, C]` view is no cell per token (slot), or "".

    - DeepSeek V4's fp8_ds_mla caches (`model_version` "deepseek_v4" with
      `state_content_bytes`) store a block's token data (448 fp8 + 128 bf16
      bytes a state), then all of its states' 8 scale bytes
      (models/deepseek_v4/common/ops/cache_utils.py,
      quantize_and_insert_k_kernel): the view's C bytes of a state are not
      that state's bytes, so the sums would number them by other states
      and differ between block sizes.
    - Cells of a size that is no multiple of 8 bytes, other than the
      sparse-attention indexer's keys then scales (`_indexer_key_bytes`,
      registered as two segments): a view of C bytes per token where the
      page holds something else (a block's keys, then their scales) is no
      cell per token.
    """
    if getattr(spec, "model_version", None) == "deepseek_v4" and getattr(spec, "state_content_bytes", None) is not None:
        return (
            f"{type_name} (DeepSeek V4, {spec.state_content_bytes}-byte states) stores a block's state data, "
            "then all of their scales: no cell per state kvcsum can read"
        )
    size = dtype_bytes(getattr(spec, "dtype", ""))
    if cell is None:
        if size is None:
            return ""
        width = int(spec.head_size) + (0 if is_mla else int(getattr(spec, "head_size_v", spec.head_size) or 0))
        cell = width * size
    if int(cell) % 8:
        what = " (a sparse-attention indexer's keys: vLLM stores a block's keys, then their scales)" if is_mla and size == 1 else ""
        return f"{type_name} has {int(cell)}-byte cells, no multiple of the definition's 8-byte pieces{what}"
    return ""


def global_heads(spec, tp_size: int) -> int:
    """Heads the cache holds across TP (the next cache of its layer number
    is numbered after them)."""
    if spec.is_mla:
        return 1
    total = spec.total_kv_heads or spec.num_kv_heads * tp_size
    return 2 * total if spec.num_slots else total


def state_tensors(tensor, spec, tp_rank: int):
    """The kvcsum.StateTensors of a Mamba layer's raw `[B, 1, 1, content]`
    page view (or any view whose dim 0 is the block): each state packed
    from the page's front in the spec's order (conv, then ssm), each row its
    first dimension. Shard-keyed: rows are this rank's."""
    address = int(tensor.data_ptr())
    block_stride = int(tensor.stride(0)) * int(tensor.element_size())
    out, offset = [], 0
    for shape, dtype in zip(spec.state_shapes, spec.state_dtypes):
        size = dtype_bytes(dtype)
        rows = int(shape[0]) if shape else 1
        per_row = math.prod(shape[1:]) * size if len(shape) > 1 else size
        if offset % size:
            raise ValueError(f"layer {spec.name}: a {dtype} state starts at byte {offset} of its page, not a multiple of {size}")
        out.append(
            kvcsum.StateTensor(
                address=address + offset,
                block_stride=block_stride,
                row_stride=per_row,
                first_row=0,
                num_rows=rows,
                total_rows=rows,
                bytes_per_row=per_row,
                element_size=size,
            )
        )
        offset += rows * per_row
    page = int(tensor[0].numel()) * int(tensor.element_size()) if tensor.dim() > 1 else block_stride
    if offset > max(page, 0):
        raise ValueError(f"layer {spec.name}: its states take {offset} bytes, its cache page {page}")
    return out
