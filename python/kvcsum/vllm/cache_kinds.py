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
  Registered as a state layer (kvcs_worker_add_state, SPEC section 6).
  Where vLLM's NIXL connector derives how TP splits the state
  (`state_split`: Mamba1, Mamba2 and GDN with the conv state in the DS
  layout `(dim, state_len)`, not tp_replicated), each conv sub-projection
  (x; x, B, C; Q, K, V) is a tensor whose rows are its channels, then the
  temporal (ssm) state, rows along its first dimension, each numbered
  globally (rank r's rows of a tensor of R rows a rank are r·R .. r·R + R):
  compared at any TP size. The layer's identity then names the split and
  each tensor's global shape (`split_identity`), so two sides that derive
  other global shapes (Mamba2 groups vLLM replicates at a TP size that
  n_groups does not divide) differ in fingerprint: UNVERIFIED, never
  MISMATCH. Anywhere else (ShortConv, linear attention, KDA, ReplaySSM's
  extra states, the SD layout, a shape that does not decompose, a
  tp_replicated state) the tensors are conv then ssm, each row its first
  dimension, and the state is **shard-keyed**: compared between equal TP
  sizes only (another TP size is UNVERIFIED, never MISMATCH).
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

- a block's data, then its scales (`_data_then_scales_bytes`): each
  block's page holds its slots' data (D bytes each, slot t's at byte
  t*D), then their scales (S bytes each, slot t's at N*D + t*S, N the
  slots of the block), the rest of the page padding. Registered as one
  cell of two segments, the data (K) and the scales (V), so the cell is a
  slot's data then its scale, D + S bytes, whatever the page's padding or
  the block size. Two kinds of vLLM's caches are stored so:
  - the sparse-attention indexer's k-cache (DeepSeek V3.2's
    DeepseekV32IndexerCache, V4's C4A indexer: `_indexer_key_bytes`): a
    token's (state's) 128-byte fp8 key (64 with MXFP4), then its 4-byte
    scale: 132-byte cells, read in 4-byte pieces (SPEC section 1);
  - DeepSeek V4's fp8_ds_mla records (`_is_ds_mla_states`): a state's
    (a token's) 576 data bytes (448 fp8 NoPE, 64 bf16 RoPE), then its 8
    UE8M0 scale bytes: 584-byte cells, read in 8-byte pieces
    (models/deepseek_v4/common/ops/cache_utils.py:64-104), in its
    compressed MLA cache and in its sliding-window cache (a
    SlidingWindowMLASpec, one latent head like MLA's, a token a slot).
  Compressed (`tokens_per_state` > 1) caches of either kind take the
  token placement above, the slots being states.
- DeepSeek V4.1's interleaved records (`_is_v41_records`: 528 bytes, 512
  fp8 then 16 UE8M0 scales; 288 bytes, 256 packed fp4 then 32 e4m3
  scales; a slot's scales right after its own data): opaque cells of the
  record's bytes, one latent head, as any packed cell above.

What kvcsum still cannot checksum is named (`unsupported`) and never
silent (kvcsum.vllm.load_verdict): compressed states and DCP without the
library's token placement, a tokens_per_state fraction other than 1/p,
host-resident groups (not in memory the workers read), state elements of
other than 2 or 4 bytes (a ring's too), an unknown mamba_cache_mode, head
slots packed other than K slots then V slots (and ROCm's), specs other
than a ring that address their pages themselves (`uses_slot_mapping`
False), and caches whose `[B, H, N, C]` view is no cell per token
(`_no_token_cells`: cells of no multiple of 8 bytes other than the
indexer's above, and DeepSeek V4's packed records of another width than
584, 528 or 288 bytes, or not one latent head of bytes), and the
indexer's keys on ROCm (tiled in a block). A group holding one of these
is not checksummed at all, its other caches included. Cells of 4-byte
pieces (the indexer's 132 bytes, SPEC section 1) are read by host and
device workers alike.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import kvcsum

__all__ = [
    "describe_spec",
    "state_split",
    "state_split_refused",
    "split_identity",
    "state_tensors",
    "ring_tensors",
    "StatePart",
    "global_heads",
    "group_block_size",
    "states_per_token",
    "RING_LAYER_NUMBERS",
    "PLACEMENT",
    "DTYPE_BYTES",
]

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
    name: str,
    group_id: int,
    spec,
    total_kv_heads: int | None,
    dcp_size: int = 1,
    is_mla: bool = False,
    conv_dim_first: bool = False,
) -> dict:
    """The LayerSpec fields of one layer's vLLM spec (duck-typed: any object
    with vLLM 0.33's spec attributes), `unsupported` naming why kvcsum
    cannot checksum it ("" where it can). `conv_dim_first`: vLLM stores
    Mamba conv states as `(dim, state_len)` (its DS layout,
    kvcsum.vllm.config.conv_state_dim_first)."""
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
        parts, unsplit = state_split(spec, conv_dim_first)
        return dict(
            common,
            kind="state",
            state_shapes=shapes,
            state_dtypes=dtypes,
            state_type=_mamba_type(spec),
            state_parts=parts,
            state_unsplit=unsplit,
            unsupported=unsupported,
        )
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
    data_bytes, scale_bytes = _data_then_scales_bytes(name, spec, is_mla)
    if not unsupported and _indexer_key_bytes(name, spec, is_mla):
        unsupported = _indexer_layout_unknown(type_name)
    if not unsupported and not data_bytes:
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
        data_bytes=data_bytes,
        scale_bytes=scale_bytes,
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
    return dict(
        kind="state",
        state_shapes=shapes,
        state_dtypes=(str(spec.dtype),) * heads,
        state_unsplit="a ring: its stale slots differ between TP ranks",
        ring=True,
        unsupported="",
    )


#: What a ring's layer number is registered under: this plus the number in
#: its name. A ring lives inside an attention layer (DeepSeek V4.1's
#: `model.layers.N.self_attn.compressor.state_cache` beside
#: `model.layers.N.self_attn`, whose cache is in another group), and the
#: library keeps a layer number to one kind of cache (an attention cache,
#: or a state, or an alias: SPEC section 7), so the ring's state takes a
#: number no model's layer has. Every side running this kvcsum numbers it
#: alike (SPEC section 1, "Layer number"); the fingerprint is the ring's
#: own name's (its identity).
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


def _data_then_scales_bytes(name: str, spec, is_mla: bool) -> tuple[int, int]:
    """(D, S): the data and the scale bytes of one slot (a token, or a
    state of `tokens_per_state` tokens) of a cache that vLLM stores as each
    block's data, then their scales: slot t's data at byte t*D of its
    block's page, its scale at N*D + t*S (N the page's slots, the view's
    `[B, H, N, C]` N, C = D + S), the rest of the page padding. (0, 0) for
    any other cache.

    Registered as one cell of two segments, K = the data, V = the scales
    (kvcsum.vllm.cache_checksums._data_then_scales), read in 8-byte pieces
    where D + S is a multiple of 8, else in 4-byte pieces, each segment a
    whole number of them (SPEC section 1). The caches vLLM 0.33 stores so:
    the sparse-attention indexer's k-cache (`_indexer_key_bytes`: D = 128
    or 64, S = 4) and DeepSeek V4's fp8_ds_mla compressed MLA states
    (`_is_ds_mla_states`: D = 576, S = 8).
    """
    keys = _indexer_key_bytes(name, spec, is_mla)
    if keys:
        return keys, INDEXER_SCALE_BYTES
    if _is_ds_mla_states(spec, is_mla):
        return DS_MLA_DATA_BYTES, DS_MLA_SCALE_BYTES
    return 0, 0


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


#: DeepSeek V4's fp8_ds_mla record: a state's 576 data bytes (448 fp8
#: e4m3 NoPE, then 64 bf16 RoPE), then, after the block's data, its 8
#: UE8M0 scale bytes (7 and a pad byte) (models/deepseek_v4/common/ops/
#: cache_utils.py:64-69, :200-210, TOKEN_DATA_SIZE 576, TOKEN_SCALE_DIM 8).
DS_MLA_DATA_BYTES = 576
DS_MLA_SCALE_BYTES = 8
#: Its width, the spec's `state_content_bytes`, which names the record
#: (models/deepseek_v41/common/ops/cache_utils.py:39-49).
DS_MLA_RECORD_BYTES = DS_MLA_DATA_BYTES + DS_MLA_SCALE_BYTES


def _is_ds_mla_states(spec, is_mla: bool) -> bool:
    """Whether `spec` is DeepSeek V4's compressed MLA cache in fp8_ds_mla
    records, which vLLM stores as each block's states' data, then their
    scales.

    The spec (models/deepseek_v4/attention.py:860-883): an MLAAttentionSpec
    of one head, uint8, `tokens_per_state` the layer's compress ratio,
    `model_version` "deepseek_v4", `state_content_bytes` 584, pages padded
    to a multiple of 576 bytes (`alignment`: v1/kv_cache_interface.py:
    719-725, the padding after the page's 584 N bytes); V4.1's compressed
    cache in the same 584-byte records (without MXFP8 records) likewise
    (models/deepseek_v41/attention.py:521-531, :1206-1231). Its view is `[B, 1, N, 584]`, N =
    block_size // tokens_per_state states a block (v1/kv_cache_interface.py:
    268-275, 360-376). Its writers put state t of a block's page (the
    view's block stride) at t*576 and its scales at N*576 + t*8, N the
    view's states a block: the Triton kernels (models/deepseek_v4/common/
    ops/fused_compress_quant_cache.py:129 N = kv_cache.shape[1], :141 the
    page stride, :192-194, :263-272) and CUDA's CuTe DSL compressor
    (models/deepseek_v4/compressor.py:472-480; models/deepseek_v4/nvidia/
    ops/sparse_attn_compress_cutedsl.py:286-293, :1667-1690 N =
    block_size // compress_ratio, the page round_up(N*(576 + 8), 576));
    its readers alike (models/deepseek_v4/common/ops/cache_utils.py:
    298-310; models/deepseek_v4/sparse_mla.py:262, N). ROCm's kernels keep
    the layout (models/deepseek_v4/amd/mono/attention/plan.py:17-20), the
    Triton writer's FNUZ mode only the fp8 encoding (cache_utils.py:
    138-142). "A page puts its whole data region ahead of its whole scale
    region" (models/deepseek_v41/common/ops/cache_utils.py:41-43).

    The sliding-window cache in fp8_ds_mla or nvfp4_ds_mla (a
    SlidingWindowMLASpec, v1/attention/backends/mla/sparse_swa.py:120-147:
    uint8, one head, `max_tp_shards` 1, `state_content_bytes` 584 where the
    record is V4's, pages padded to 576 bytes; kvcsum.vllm.config takes it
    as MLA) is this rule's too, a token a slot (N = block_size): its
    writers are the CUDA op torch.ops._C.
    fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert (models/deepseek_v4/
    attention.py:797-814, compiled, not read here) and on XPU the Triton
    writer of the compressed states (models/deepseek_v4/xpu/
    xpu_qnorm_rope_kv_fp8_insert.py:153-162 -> cache_utils.py:168-230,
    block_stride = the view's stride(0), cache_block_size = block_size);
    its readers take the same layout: FlashMLA reads it and the
    compressed cache in one call (models/deepseek_v4/nvidia/flashmla.py:
    217-262, k_cache and extra_k_cache), the prefill gathers it with the
    compressed cache's gather at N = block_size (flashmla.py:340-348;
    cache_utils.py:499-545: CuTe DSL's nvidia/ops/
    dequant_gather_k_cutedsl.py:55-60, "V4 puts all of a block's data
    rows ahead of its scale rows", scale_offset block_size * 576), ROCm's
    likewise (amd/rocm.py:1674-1684). On gfx942 ROCm's C++ writer encodes
    the SWA records' fp8 as FNUZ (use_fnuz there; the compressed states
    stay OCP): the declared decoding names it (kvcsum.vllm.decoding), so
    such a side and an OCP one compare UNVERIFIED, never MISMATCH. V4.1
    off SM100 keeps these 584-byte records (models/deepseek_v41/
    attention.py:131-138, :521); its 528- and 288-byte records are
    interleaved (models/deepseek_v41/common/ops/cache_utils.py:44-49):
    `_is_v41_records`.
    """
    return (
        is_mla
        and getattr(spec, "model_version", None) == "deepseek_v4"
        and getattr(spec, "state_content_bytes", None) == DS_MLA_RECORD_BYTES
        and dtype_bytes(getattr(spec, "dtype", "")) == 1
        and int(getattr(spec, "num_kv_heads", 1)) == 1
    )


#: DeepSeek V4.1's interleaved record widths: MXFP8 (512 fp8 e4m3 dims,
#: then 16 UE8M0 scales) and NVFP4 (256 bytes of e2m1 pairs, then 32 e4m3
#: scales, the compressed cache only) (models/deepseek_v41/common/ops/
#: cache_utils.py:44-54).
V41_RECORD_BYTES = (528, 288)


def _is_v41_records(spec, is_mla: bool) -> bool:
    """Whether `spec` is a DeepSeek V4.1 cache of interleaved records: a
    slot's scales right after its own data, slot t's record at t*C of its
    block's page (C = `state_content_bytes`, 528 or 288), the view's
    `[B, 1, N, C]` a cell per slot: opaque cells, one latent head.

    V4.1 declares them on SM100 (`_use_v41_mxfp8_kv_record`, models/
    deepseek_v41/attention.py:131-138): the sliding-window cache
    (DeepseekV4SWACache, attention.py:521-531, :562-579: 528 bytes,
    `model_version` "deepseek_v4", 32-token blocks, pages padded to 512,
    the block stride to lcm(528, the compressed record)) and the
    compressed MLA cache (attention.py:1206-1231: 528, or 288 with
    nvfp4_ds_mla). Their writers put slot t at page + (slot % N) * C, N =
    the view's slots a block, page = the view's stride(0) (models/
    deepseek_v41/common/ops/fused_compress_quant_cache.py:325-342,
    :464-466, :527-529; cache_utils.py:216, :570, :629), the CuTe DSL
    gather its scales at data_dim (models/deepseek_v4/nvidia/ops/
    dequant_gather_k_cutedsl.py:55-60).
    """
    return (
        is_mla
        and getattr(spec, "model_version", None) == "deepseek_v4"
        and getattr(spec, "state_content_bytes", None) in V41_RECORD_BYTES
        and dtype_bytes(getattr(spec, "dtype", "")) == 1
        and int(getattr(spec, "num_kv_heads", 1)) == 1
    )


def _no_token_cells(type_name: str, spec, cell, is_mla: bool) -> str:
    """Why a cache's `[B, H, N, C]` view is no cell per token (slot), or "".

    - DeepSeek V4's packed records (`model_version` "deepseek_v4" with
      `state_content_bytes`) other than fp8_ds_mla's (`_is_ds_mla_states`,
      registered as a block's data then its scales) and V4.1's interleaved
      ones (`_is_v41_records`, opaque cells): another width, or no one
      latent head of bytes. kvcsum has no rule for them.
    - Cells of a size that is no multiple of 8 bytes, other than the
      sparse-attention indexer's keys then scales (`_indexer_key_bytes`,
      registered as two segments): a view of C bytes per token where the
      page holds something else (a block's keys, then their scales) is no
      cell per token.
    """
    if (
        getattr(spec, "model_version", None) == "deepseek_v4"
        and getattr(spec, "state_content_bytes", None) is not None
        and not _is_v41_records(spec, is_mla)
    ):
        return (
            f"{type_name} (DeepSeek V4, {spec.state_content_bytes}-byte records) packs its records in a layout "
            "kvcsum has no rule for (only fp8_ds_mla's 584-byte and V4.1's 528- and 288-byte records, one latent head, are registered)"
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


#: The Mamba types whose TP split vLLM's NIXL connector derives from a
#: MambaSpec (distributed/kv_transfer/kv_connector/v1/
#: ssm_conv_transfer_utils.py:107-219, derive_mamba_conv_split), by the
#: name of their MambaAttentionBackendEnum member.
SPLIT_STATE_TYPES = ("MAMBA1", "MAMBA2", "GDN_ATTN")

#: Rows one state layer may number across TP: SPEC section 3's H (the
#: heads of one layer; a state row's number is its head number).
MAX_ROWS_PER_LAYER = 65536


@dataclasses.dataclass(frozen=True)
class StatePart:
    """One tensor of a state layer whose TP split is known: a conv
    sub-projection (its rows the channels, each `state_len` elements in
    the DS layout) or the temporal (ssm) state (rows along its first
    dimension). Each rank holds `rows` of its rows, rank r the global rows
    r·rows .. r·rows + rows."""

    #: "x", "B", "C" (Mamba2), "Q", "K", "V" (GDN), "x" (Mamba1), "ssm".
    label: str
    #: The spec's state it lies in (0: conv, 1: temporal).
    state: int
    #: Its first row in that state, on every rank.
    first_row: int
    #: Its rows on every rank.
    rows: int


def _mamba_type(spec) -> str:
    """The name of a MambaSpec's mamba_type (a MambaAttentionBackendEnum
    member: "MAMBA2", "GDN_ATTN", ...)."""
    kind = getattr(spec, "mamba_type", "MAMBA2")
    return str(getattr(kind, "name", kind))


def state_split(spec, conv_dim_first: bool) -> tuple[tuple, str]:
    """(the StateParts of a MambaSpec's state in numbering order, "") where
    TP's split of it is known exactly as vLLM's NIXL connector, which moves
    Mamba state between engines of different TP sizes, derives it
    (ssm_conv_transfer_utils.py:107-219, derive_mamba_conv_split, called
    at nixl/base_worker.py:699-719; each D rank reads its slice of each
    sub-projection and of the temporal state, :2047-2096); otherwise ((),
    why not): the state is then shard-keyed.

    - Mamba1: conv = [x], x of `intermediate_size / TP` channels (asserted
      equal to the temporal state's first dimension); temporal (x channels,
      state_size), rows its channels.
    - Mamba2: conv = [x, B, C], x the temporal state's heads times head_dim
      (intermediate_size / TP), B and C the rest halved (n_groups x
      state_size / TP each); temporal (heads, head_dim, state_size), rows
      its heads.
    - GDN: conv = [Q, K, V], V the temporal state's v heads times head_v_dim,
      Q and K the rest halved; temporal (v heads, head_v_dim, head_k_dim),
      rows its v heads.

    Each sub-projection and the temporal state is split contiguously along
    its rows by TP (mamba_utils.py:171-211, :272-293; the weight loaders
    mamba_mixer2.py:344-420, gdn/qwen_gdn_linear_attn.py:596-603, :629-640).
    The conv state must be in vLLM's DS layout `(dim, state_len)`, where a
    channel is one contiguous row (NIXL asserts it: base_worker.py:705-708);
    in the default SD layout `(state_len, dim)` a row holds every channel.

    Not derived (shard-keyed): another mamba_type (ShortConv, linear
    attention, KDA, a custom one), ReplaySSM's extra states (more than two
    states), a tp_replicated state (every rank holds it whole, vLLM's PLE
    conv state: kvcsum's state layer has one column, no replica keys, so
    TP copies would count TP times), and shapes that do not decompose.
    """
    kind = _mamba_type(spec)
    shapes = tuple(tuple(int(n) for n in shape) for shape in spec.shapes)
    if kind not in SPLIT_STATE_TYPES:
        return (), f"vLLM derives no TP split of a {kind} state (only {', '.join(SPLIT_STATE_TYPES)})"
    if getattr(spec, "tp_replicated", False):
        return (), "every TP rank holds the whole state (tp_replicated), and kvcsum's state layers have no replicas"
    if len(shapes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) < 2:
        return (), f"its states have shapes {shapes}, not a 2-D conv state and a temporal state"
    if not conv_dim_first:
        return (), (
            "its conv state is in vLLM's SD layout (state_len, dim), where a row holds every channel "
            "(VLLM_SSM_CONV_STATE_LAYOUT is not DS)"
        )
    (channels, _), temporal = shapes
    if kind == "MAMBA1":
        if temporal[0] != channels:
            return (), f"its Mamba1 temporal state's {temporal[0]} rows are not its conv state's {channels} channels"
        projections = (("x", channels),)
    else:
        # Mamba2's x (GDN's V): the temporal state's heads times their dim.
        first = temporal[0] * temporal[1]
        rest = channels - first
        if rest <= 0 or rest % 2:
            what, named = ("x + 2 B", "x") if kind == "MAMBA2" else ("2 Q + V", "V")
            return (), f"its {channels} conv channels do not decompose into {what} with {first} channels of {named}"
        half = rest // 2
        projections = (("x", first), ("B", half), ("C", half)) if kind == "MAMBA2" else (("Q", half), ("K", half), ("V", first))
    parts, row = [], 0
    for label, rows in projections:
        parts.append(StatePart(label, 0, row, rows))
        row += rows
    parts.append(StatePart("ssm", 1, 0, temporal[0]))
    return tuple(parts), ""


def state_split_refused(specs, tp_size: int) -> str:
    """Why the state layers `specs` (LayerSpecs of one group) are
    registered shard-keyed, "" where each has its TP split (`state_split`)
    and its rows fit a layer (SPEC section 3): a group's state layers
    agree (kvcs_state.split_known)."""
    for spec in specs:
        if not spec.state_parts:
            return f"layer {spec.name}: {spec.state_unsplit or 'no TP split is known'}"
        rows = sum(part.rows for part in spec.state_parts) * tp_size
        if rows > MAX_ROWS_PER_LAYER:
            return f"layer {spec.name}: its state has {rows} rows across TP, more than {MAX_ROWS_PER_LAYER} a layer"
    return ""


def split_identity(spec, tp_size: int) -> str:
    """What the identity of a state layer whose rows are numbered along
    TP's split adds (SPEC section 7): the split and, per tensor in
    numbering order, its global rows, the elements of a row and their
    dtype. Two sides that number rows alike name the same; sides that
    derive other global shapes (a Mamba2 of n_groups 1 at TP 2, whose B
    and C vLLM replicates to 2 groups, against TP 1, 1 group:
    mamba_utils.py:199, :261-269) differ in fingerprint, so they are
    UNVERIFIED, never compared row by misnumbered row."""
    tensors = []
    for part in spec.state_parts:
        shape = spec.state_shapes[part.state]
        elements = math.prod(shape[1:])
        dtype = str(spec.state_dtypes[part.state]).replace("torch.", "")
        tensors.append(f"{part.label} {part.rows * tp_size}x{elements} {dtype}")
    return f"kvcsum state rows along TP of {spec.state_type}, conv channels as rows (DS): {', '.join(tensors)}"


def state_tensors(tensor, spec, tp_rank: int, tp_size: int = 1, split: bool = False):
    """The kvcsum.StateTensors of a Mamba layer's raw `[B, 1, 1, content]`
    page view (or any view whose dim 0 is the block): each state packed
    from the page's front in the spec's order (conv, then ssm), as vLLM
    binds them (model_executor/layers/mamba/abstract.py:28-42, each state
    C-contiguous). With `split` (the spec's StateParts known), one tensor
    per part, its rows this rank's slice of the part's global rows;
    otherwise each state whole, each row its first dimension (shard-keyed:
    rows are this rank's)."""
    address = int(tensor.data_ptr())
    block_stride = int(tensor.stride(0)) * int(tensor.element_size())
    out, offset, starts = [], 0, []
    for shape, dtype in zip(spec.state_shapes, spec.state_dtypes):
        size = dtype_bytes(dtype)
        rows = int(shape[0]) if shape else 1
        per_row = math.prod(shape[1:]) * size if len(shape) > 1 else size
        if offset % size:
            raise ValueError(f"layer {spec.name}: a {dtype} state starts at byte {offset} of its page, not a multiple of {size}")
        starts.append((offset, per_row, size))
        if not split:
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
    if split:
        for part in spec.state_parts:
            start, per_row, size = starts[part.state]
            out.append(
                kvcsum.StateTensor(
                    address=address + start + part.first_row * per_row,
                    block_stride=block_stride,
                    row_stride=per_row,
                    first_row=tp_rank * part.rows,
                    num_rows=part.rows,
                    total_rows=part.rows * tp_size,
                    bytes_per_row=per_row,
                    element_size=size,
                )
            )
    return out
