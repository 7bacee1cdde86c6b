"""Each kind of KV cache vLLM 0.33 allocates, registered by the connector's
worker part (kvcsum.vllm.config.layer_specs, kvcsum.vllm.cache_kinds,
CacheChecksummer) over the views vLLM itself makes (allocate_kv_cache /
create_kv_cache_views, from vLLM's own spec classes): a producer's KV moved
byte for byte to a consumer verifies (MATCH); a flipped byte in data, in a
scale, in a state, in an indexer cache is a MISMATCH of its block; TP shards
of head slots add up at another TP size. Each case prints one line."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
from kvcsum.vllm.cache_checksums import CacheChecksummer, Job  # noqa: E402
from kvcsum.vllm.config import layer_specs  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

NUM_BLOCKS, BLOCK, NUM_TOKENS = 12, 16, 45
IDS = [3, 7, 1]  # the request's blocks (45 tokens: 3 blocks)
STATE_BLOCK = 5
NAMES = {kvcsum.MATCH: "MATCH", kvcsum.MISMATCH: "MISMATCH", kvcsum.UNVERIFIED: "UNVERIFIED"}


def config(groups) -> KVCacheConfig:
    """vLLM's KV cache config of `groups` ([(layer names, spec)]): each layer
    its own region of one backing allocation, layer-outermost."""
    pages = []
    for names, spec in groups:
        for name in names:
            own = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
            pages.append((name, own.page_size_bytes))
    total = sum(page * NUM_BLOCKS for _, page in pages)
    tensors, offset = [], 0
    for name, page in pages:
        tensors.append(KVCacheTensor(size=total, layers=[name], layer_stride=page * NUM_BLOCKS, block_stride=page, offset=offset))
        offset += page * NUM_BLOCKS
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(list(n), s) for n, s in groups])


def raw(caches) -> torch.Tensor:
    """The backing allocation's bytes."""
    storage = next(iter(caches.values())).untyped_storage()
    return torch.tensor([], dtype=torch.uint8).set_(storage)


def engine_side(cfg: KVCacheConfig, seed: int | None, total_kv_heads: int, tp_rank: int = 0, tp_size: int = 1):
    caches = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout.LBNHC)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        buffer = raw(caches)
        buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, generator=generator))
    layers, sizes = layer_specs(cfg, total_kv_heads)
    worker = CacheChecksummer(layers, caches, cfg.num_blocks, sizes, tp_rank=tp_rank, tp_size=tp_size)
    return caches, worker


def job(cfg: KVCacheConfig) -> Job:
    groups = {}
    for g, group in enumerate(cfg.kv_cache_groups):
        groups[g] = (0, [STATE_BLOCK]) if isinstance(group.kv_cache_spec, (MambaSpec, CircularBufferSpec)) else (0, list(IDS))
    return Job("req", NUM_TOKENS, groups)


def verdict(producers: list, consumers: list, the_job: Job, producer_tp: int) -> kvcsum.Report:
    with kvcsum.Blocks() as blocks:
        the_job.to_blocks(blocks)
        with kvcsum.Verifier(len(producers)) as p:
            p.expect(blocks, kvcsum.PRODUCER)
            for w in producers:
                p.add_record(w.checksum([the_job], kvcsum.PRODUCER).record())
            payload = p.payload("req")
        c = kvcsum.Verifier(len(consumers))
        c.set_producer_tp_size(producer_tp)
        c.expect(blocks, kvcsum.CONSUMER)
        for w in consumers:
            c.add_record(w.checksum([the_job], kvcsum.CONSUMER).record())
        return c.check("req", payload)


def round_trip(case: str, groups, flip=None, total_kv_heads: int = 4) -> kvcsum.Report:
    """Producer and consumer at TP 1: the consumer's caches a byte-for-byte
    copy of the producer's, `flip(consumer caches)` changing one byte."""
    cfg = config(groups)
    p_caches, producer = engine_side(cfg, seed=11, total_kv_heads=total_kv_heads)
    c_caches, consumer = engine_side(cfg, seed=None, total_kv_heads=total_kv_heads)
    assert not producer.skipped and not consumer.skipped, (producer.skipped, consumer.skipped)
    raw(c_caches).copy_(raw(p_caches))
    if flip is not None:
        flip(c_caches)
    report = verdict([producer], [consumer], job(cfg), 1)
    print(f"\nCASE {case:<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}", flush=True)
    return report


def check(report: kvcsum.Report, flipped: bool, block: int | None = None) -> None:
    if not flipped:
        assert report.verdict == kvcsum.MATCH, report.message
        return
    assert report.verdict == kvcsum.MISMATCH, report.message
    if block is not None:
        # The mismatched position is the flipped block's (a state's: 0).
        position = 0 if block == STATE_BLOCK else IDS.index(block)
        got = {(m.first_position, m.num_positions) for m in report.mismatches}
        assert got == {(position, 1)}, report.mismatches


def full(heads=4, **kw) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=32, dtype=torch.float16, **kw)


ATTN = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


# --- 2. Mamba state group ------------------------------------------------------------------


def mamba() -> MambaSpec:
    # conv bf16 (3, 64) then ssm fp32 (4, 8, 4), padded to the attention page.
    page = full().page_size_bytes
    return MambaSpec(
        block_size=BLOCK * 64,
        shapes=((3, 64), (4, 8, 4)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=page,
    )


MAMBA = ["model.layers.2.mixer", "model.layers.3.mixer"]


@pytest.mark.parametrize("where", [None, "conv", "ssm", "attention"])
def test_an_attention_plus_mamba_model_verifies_its_state_group(where):
    groups = [(ATTN, full()), (MAMBA, mamba())]
    conv_bytes = 3 * 64 * 2

    def flip(caches):
        if where == "attention":
            caches[ATTN[1]].view(torch.uint8)[IDS[1], 2, 4, 9] ^= 0x10
        else:
            page = caches[MAMBA[1]]
            assert tuple(page.shape) == (NUM_BLOCKS, 1, 1, conv_bytes + 4 * 8 * 4 * 4) and page.dtype == torch.int8
            page[STATE_BLOCK, 0, 0, 7 if where == "conv" else conv_bytes + 13] ^= 0x01

    report = round_trip(f"attention + Mamba, flip in {where}", groups, flip if where else None)
    check(report, where is not None, IDS[1] if where == "attention" else STATE_BLOCK)


def test_a_mamba_state_is_shard_keyed_and_another_tp_size_is_unverified_never_a_mismatch():
    groups = [(MAMBA, mamba())]
    cfg = config(groups)
    _, producer = engine_side(cfg, seed=3, total_kv_heads=4)
    consumers = [engine_side(cfg, seed=3, total_kv_heads=4, tp_rank=r, tp_size=2)[1] for r in range(2)]
    report = verdict([producer], consumers, job(cfg), 1)
    print(f"\nCASE {'Mamba state, producer TP 1, consumer TP 2':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    assert report.verdict == kvcsum.UNVERIFIED


# --- 3. quantized cells --------------------------------------------------------------------


def int8_per_token_head(heads=4) -> FullAttentionSpec:
    # Triton's int8 per-token-head cell: K (32 int8), K scale (fp32), V, V scale: 72 bytes.
    return FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=heads, head_size=32, dtype=torch.int8,
        kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD, state_content_bytes=72,
    )


@pytest.mark.parametrize("where", [None, "k", "k_scale", "v_scale"])
def test_int8_per_token_head_cells_are_checksummed_with_their_scales(where):
    groups = [(ATTN, int8_per_token_head())]
    byte = {"k": 5, "k_scale": 33, "v_scale": 70}.get(where)

    def flip(caches):
        cache = caches[ATTN[0]]
        assert tuple(cache.shape) == (NUM_BLOCKS, 4, BLOCK, 72), cache.shape
        cache.view(torch.uint8)[IDS[2], 1, 3, byte] ^= 0x04

    report = round_trip(f"int8 per-token-head, flip in {where}", groups, flip if where else None)
    check(report, where is not None, IDS[2])


def nvfp4(heads=4) -> FullAttentionSpec:
    # FlashInfer nvfp4: 2*H head slots, K slots then V slots; a slot's cell
    # is 16 bytes of packed fp4 (32 elements) and 2 fp8 block scales, padded to 24.
    return FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=heads, head_size=32, dtype=torch.uint8,
        kv_quant_mode=KVQuantMode.NVFP4, num_head_slots=2 * heads, state_content_bytes=24,
    )


@pytest.mark.parametrize("where", [None, "k_slot", "v_slot_scale"])
def test_nvfp4_head_slots_are_checksummed(where):
    groups = [(ATTN, nvfp4())]

    def flip(caches):
        cache = caches[ATTN[1]]
        assert tuple(cache.shape) == (NUM_BLOCKS, 8, BLOCK, 24), cache.shape
        slot, byte = (1, 3) if where == "k_slot" else (6, 17)
        cache[IDS[0], slot, 2, byte] ^= 0x40

    report = round_trip(f"nvfp4 head slots, flip in {where}", groups, flip if where else None)
    check(report, where is not None, IDS[0])


@pytest.mark.parametrize("make", [nvfp4, int8_per_token_head], ids=["nvfp4", "int8"])
def test_packed_cells_of_tp_shards_add_up_at_another_tp_size(make):
    # Producer TP 1 (4 heads), consumer TP 2 (2 heads each): each rank's
    # slots are its heads' K slots then their V slots.
    whole = config([(ATTN, make(4))])
    p_caches, producer = engine_side(whole, seed=5, total_kv_heads=4)
    half = config([(ATTN, make(2))])
    consumers = []
    for rank in range(2):
        caches, worker = engine_side(half, seed=None, total_kv_heads=4, tp_rank=rank, tp_size=2)
        for name in ATTN:
            src, dst = p_caches[name], caches[name]
            if make is nvfp4:
                dst[:, :2].copy_(src[:, 2 * rank : 2 * rank + 2])
                dst[:, 2:].copy_(src[:, 4 + 2 * rank : 4 + 2 * rank + 2])
            else:
                dst.copy_(src[:, 2 * rank : 2 * rank + 2])
        consumers.append(worker)
    report = verdict([producer], consumers, job(whole), 1)
    print(f"\nCASE {make.__name__ + ', producer TP 1, consumer TP 2':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    assert report.verdict == kvcsum.MATCH, report.message


def b12x(heads=4) -> FullAttentionSpec:
    # vLLM's own b12x backend: two head slots, the K slot then the V slot,
    # each a token's K (V) of every head of the rank.
    import vllm.config  # noqa: F401  (vLLM's import order)
    from vllm.v1.attention.backends.b12x import B12xPagedAttentionBackend

    spec = B12xPagedAttentionBackend.customize_spec(full(heads))
    assert (spec.num_head_slots, spec.state_content_bytes) == (2, heads * 32 * 2), spec
    return spec


@pytest.mark.parametrize("heads", [4, 2])
@pytest.mark.parametrize("flip", [None, "k", "v"])
def test_b12x_k_and_v_slots_of_tp_shards_add_up_at_another_tp_size(heads, flip):
    # Producer TP 1 (`heads` heads), consumer TP 2 (heads / 2 each): the
    # consumer's caches are filled head by head, token by token, from the
    # producer's (rank r holds heads r*h .. (r+1)*h); a flipped byte of one
    # head's K or V is a mismatch at its block.
    whole = config([(ATTN, b12x(heads))])
    p_caches, producer = engine_side(whole, seed=23, total_kv_heads=heads)
    assert not producer.skipped, producer.skipped
    half = config([(ATTN, b12x(heads // 2))])
    local, width = heads // 2, 32  # heads a rank, elements of one head's K
    consumers = []
    for rank in range(2):
        caches, worker = engine_side(half, seed=None, total_kv_heads=heads, tp_rank=rank, tp_size=2)
        assert not worker.skipped, worker.skipped
        for name in ATTN:
            src, dst = p_caches[name], caches[name]
            for side in (0, 1):
                for h in range(local):
                    g = rank * local + h
                    for t in range(BLOCK):
                        dst[:, side, t, h * width : (h + 1) * width] = src[:, side, t, g * width : (g + 1) * width]
        consumers.append((caches, worker))
    if flip is not None:
        caches = consumers[1][0]
        caches[ATTN[0]].view(torch.uint8)[IDS[2], 0 if flip == "k" else 1, 4, 3] ^= 0x20
    report = verdict([producer], [w for _, w in consumers], job(whole), 1)
    print(f"\nCASE {f'b12x K/V slots, {heads} heads, TP 1 -> 2, flip {flip}':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    check(report, flip is not None, IDS[2])


def test_rocm_k_and_v_slots_are_named_not_checksummed(monkeypatch):
    # ROCm's two-slot packings (rocm_attn's x-packed K, AITER's shuffled
    # tiles) set the same spec fields as b12x but hold no cell per token.
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    layers, _ = layer_specs(config([(ATTN, b12x(4))]), 4)
    assert all("ROCm's tiled layout" in layer.unsupported for layer in layers), [layer.unsupported for layer in layers]


# --- 4. MLA plus its indexer's k-cache ------------------------------------------------------


def mla_with_indexer():
    specs = {}
    for i in range(2):
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER,
        )
    return list(specs), UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs=specs)


@pytest.mark.parametrize("where", [None, "mla", "indexer key", "indexer scale"])
def test_mla_and_its_indexer_cache_are_one_group_with_consecutive_heads(where):
    # vLLM's indexer cache (DeepSeek V3.2): 132-byte cells, each block's
    # page its keys (token t's 128 bytes at t*128), then their 4-byte
    # scales (at BLOCK*128 + t*4).
    names, spec = mla_with_indexer()

    def flip(caches):
        name = "model.layers.1.self_attn." + ("attn" if where == "mla" else "indexer.k_cache")
        page = caches[name].view(torch.uint8)[IDS[1]].reshape(-1)
        at = {"mla": 5 * 1152 + 11, "indexer key": 5 * 128 + 11, "indexer scale": BLOCK * 128 + 5 * 4 + 1}[where]
        page[at] ^= 0x02

    report = round_trip(f"MLA + indexer (one group), flip in {where}", [(names, spec)], flip if where else None, total_kv_heads=1)
    check(report, where is not None, IDS[1])


# --- 6. DCP shards and compressed states (the library's token placement) ---------------------

from kvcsum.vllm.cache_kinds import PLACEMENT  # noqa: E402

def needs_placement(test):
    """This kvcsum has the token placement (SPEC §16): the cases run, never skip."""
    return test


def test_this_kvcsum_has_the_token_placement():
    assert PLACEMENT, "kvcsum.Worker.set_group_placement is missing"
DCP_IDS = [3, 7]  # 45 tokens in two 32-token manager blocks


def dcp_slot(offset: int, dcp: int, interleave: int) -> tuple[int, int]:
    """(DCP rank, local slot) of in-block token offset `offset`
    (vllm.v1.worker.block_table)."""
    return (offset // interleave) % dcp, (offset // (dcp * interleave)) * interleave + offset % interleave


@needs_placement
@pytest.mark.parametrize("interleave", [1, 2])
@pytest.mark.parametrize("flip_rank", [None, 0, 1])
def test_dcp_shards_line_up_by_global_token(interleave, flip_rank):
    # Producer: TP 1, DCP 1, 32-token blocks, 1 KV head. Consumer: TP 2 with
    # DCP 2: each rank holds the head's tokens of its DCP rank, 16 slots of
    # each 32-token manager block.
    dcp, global_block = 2, 32
    head = lambda size: FullAttentionSpec(block_size=size, num_kv_heads=1, head_size=32, dtype=torch.float16)  # noqa: E731
    p_cfg = config([(ATTN, head(global_block))])
    p_caches, producer = engine_side(p_cfg, seed=17, total_kv_heads=1)
    c_cfg = config([(ATTN, head(global_block // dcp))])
    consumers, c_caches = [], []
    for rank in range(dcp):
        caches = allocate_kv_cache(c_cfg, torch.device("cpu"), KVCacheLayout.LBNHC)
        layers, sizes = layer_specs(c_cfg, 1, dcp)
        assert sizes == {0: global_block}
        worker = CacheChecksummer(layers, caches, NUM_BLOCKS, sizes, tp_rank=rank, tp_size=2, dcp_rank=rank, dcp_interleave=interleave)
        assert not worker.skipped, worker.skipped
        consumers.append(worker)
        c_caches.append(caches)
    for name in ATTN:
        src = p_caches[name].view(torch.uint8)
        for b in DCP_IDS:
            for o in range(global_block):
                rank, slot = dcp_slot(o, dcp, interleave)
                c_caches[rank][name].view(torch.uint8)[b, :, slot] = src[b, :, o]
    if flip_rank is not None:
        o = next(o for o in range(global_block) if dcp_slot(o, dcp, interleave)[0] == flip_rank and o > 3)
        c_caches[flip_rank][ATTN[1]].view(torch.uint8)[DCP_IDS[1], 0, dcp_slot(o, dcp, interleave)[1], 6] ^= 0x20
    the_job = Job("req", NUM_TOKENS, {0: (0, list(DCP_IDS))})
    with kvcsum.Blocks() as blocks:
        the_job.to_blocks(blocks)
        with kvcsum.Verifier(1) as p:
            p.expect(blocks, kvcsum.PRODUCER)
            p.add_record(producer.checksum([the_job], kvcsum.PRODUCER).record())
            payload = p.payload("req")
        c = kvcsum.Verifier(2)
        c.set_producer_tp_size(1)
        c.expect(blocks, kvcsum.CONSUMER)
        for w in consumers:
            c.add_record(w.checksum([the_job], kvcsum.CONSUMER).record())
        report = c.check("req", payload)
    print(f"\nCASE {f'DCP 2 interleave {interleave}, flip on rank {flip_rank}':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    check(report, flip_rank is not None)
    if flip_rank is not None:
        assert {(m.first_position, m.num_positions) for m in report.mismatches} == {(1, 1)}


@needs_placement
@pytest.mark.parametrize("where", [None, "state"])
def test_compressed_states_four_tokens_a_state(where):
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.bfloat16, tokens_per_state=4)

    def flip(caches):
        cache = caches[ATTN[0]]
        assert tuple(cache.shape)[:3] == (NUM_BLOCKS, 1, BLOCK // 4), cache.shape
        cache.view(torch.uint8)[IDS[1], 0, 2, 5] ^= 0x01

    report = round_trip(f"compressed states (4 tokens a state), flip in {where}", [(ATTN, spec)], flip if where else None, total_kv_heads=1)
    check(report, where is not None, IDS[1])


def test_without_the_token_placement_dcp_and_compressed_groups_are_named_not_checksummed(monkeypatch):
    from kvcsum.vllm import cache_kinds
    from kvcsum.vllm.config import groups_not_checksummed

    monkeypatch.setattr(cache_kinds, "PLACEMENT", False)
    dcp = config([(ATTN, FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float16))])
    assert "DCP shards its token positions across 2 ranks" in groups_not_checksummed(dcp, 1, 2)[0]
    assert groups_not_checksummed(dcp, 1, 1) == {}
    compressed = config([(ATTN, FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.bfloat16, tokens_per_state=4))])
    assert "4 tokens per state" in groups_not_checksummed(compressed, 1)[0]
    _, worker = engine_side(compressed, seed=1, total_kv_heads=1)
    assert "4 tokens per state" in worker.skipped[0]


# --- 7. caches whose view is no cell per token: named, never registered --------------------


def test_vllms_own_indexer_k_cache_is_checksummed_as_keys_then_scales():
    # vLLM's real indexer key (DeepSeek V3.2 and V4): 128 fp8 bytes and a
    # 4-byte scale, C = 132, stored as the block's keys then their scales.
    # Registered as one cell of two segments (keys, then scales: 4-byte
    # pieces, SPEC section 1), so the MLA + indexer group is checksummed.
    from kvcsum.vllm.config import groups_not_checksummed

    names, spec = mla_with_indexer()
    cfg = config([(names, spec)])
    assert groups_not_checksummed(cfg, 1) == {}
    _, worker = engine_side(cfg, seed=3, total_kv_heads=1)
    assert worker.skipped == {}
    assert worker.layers_registered == 4


def test_vllms_own_indexer_k_cache_on_a_device_worker_is_named_not_checksummed():
    # This kvcsum's device engine reads 8-byte pieces only (it refuses a
    # cell of 4-byte pieces at registration): a device worker's plan of the
    # group refuses it, naming the layer and its cell size, so the group is
    # skipped at startup (its loads UNVERIFIED), never registered. (No GPU
    # here: the plan of a host-built checksummer taken as a device one's.)
    names, spec = mla_with_indexer()
    cfg = config([(names, spec)])
    caches, worker = engine_side(cfg, seed=3, total_kv_heads=1)
    layers, _ = layer_specs(cfg, 1)
    worker.device = 0
    with pytest.raises(ValueError, match="132-byte cells .* device engine does not checksum"):
        worker._plan_group(0, [s for s in layers if s.group_id == 0], caches, cfg.num_blocks)


def test_deepseek_v4_fp8_ds_mla_states_are_named_not_checksummed():
    # fp8_ds_mla (models/deepseek_v4/attention.py): 584-byte states stored
    # as the block's state data, then every state's scales.
    from kvcsum.vllm.config import groups_not_checksummed

    spec = MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8, tokens_per_state=4,
        alignment=576, model_version="deepseek_v4", state_content_bytes=584, cache_dtype_str="fp8_ds_mla",
    )
    cfg = config([(ATTN, spec)])
    assert "then all of their scales" in groups_not_checksummed(cfg, 1)[0]
    _, worker = engine_side(cfg, seed=4, total_kv_heads=1)
    assert 0 in worker.skipped and worker.layers_registered == 0


# --- 8. Whisper's block pooling: p states a token, p caches of the layer ----------------------

from fractions import Fraction  # noqa: E402

#: The random cells of the naive-reference test (printed: a failure names it).
SEED = int(os.environ.get("KVCSUM_SEED", random.SystemRandom().randrange(2**31)))
MASK = 2**64 - 1


def pooled(p: int = 4, heads: int = 4, block: int = BLOCK) -> FullAttentionSpec:
    # Whisper's block pooling as vLLM 0.33 declares it (model_executor/
    # models/whisper_causal.py:411-417): the layer's attention spec with
    # tokens_per_state Fraction(1, p).
    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=16, dtype=torch.float16, tokens_per_state=Fraction(1, p))


def test_whisper_pooled_states_are_checksummed_as_p_caches_of_each_layer():
    # vLLM's view of a pooled cache: [B, H, block_size * p, C], token t's
    # state i at slot t*p + i of its block (whisper_causal.py:238-241;
    # num_states, v1/kv_cache_interface.py:272-275). kvcsum registers
    # state i of every token as a cache of the layer (slots i, i+p, ...).
    from kvcsum.vllm.config import groups_not_checksummed

    spec = pooled()
    cfg = config([(ATTN, spec)])
    caches = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout.LBNHC)
    assert spec.num_states == BLOCK * 4 and tuple(caches[ATTN[0]].shape) == (NUM_BLOCKS, 4, BLOCK * 4, 32)
    assert groups_not_checksummed(cfg, 4) == {}
    _, worker = engine_side(cfg, seed=2, total_kv_heads=4)
    assert worker.skipped == {} and worker.layers_registered == 2 * 4  # 4 caches a layer


def test_a_tokens_per_state_fraction_other_than_one_over_p_is_named_not_checksummed():
    from kvcsum.vllm.config import groups_not_checksummed

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=16, dtype=torch.float16, tokens_per_state=Fraction(2, 3))
    assert "stores 2/3 tokens per state" in groups_not_checksummed(config([(ATTN, spec)]), 4)[0]


@pytest.mark.parametrize("state", [None, 0, 3])
def test_whisper_pooled_states_round_trip(state):
    # Token 21 (block 1, offset 5): its state `state`, head 2.
    def flip(caches):
        caches[ATTN[1]].view(torch.uint8)[IDS[1], 2, 5 * 4 + state, 9] ^= 0x10

    report = round_trip(f"Whisper pooling (4 states a token), flip in state {state}", [(ATTN, pooled())], None if state is None else flip)
    check(report, state is not None, IDS[1])


def mix2(x: int) -> int:
    """f of SPEC section 12 for MIXED2 (the default), written again here."""
    lo, hi = x & 0xFFFFFFFF, x >> 32
    for r, k in enumerate((0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)):
        product = lo * k
        lo, hi = (hi + (product >> 32)) & 0xFFFFFFFF, product & 0xFFFFFFFF
        if r > 0:
            lo ^= hi
    return (hi << 32) | lo


def naive_pooled(cells: torch.Tensor, num_tokens: int, block: int) -> list:
    """SPEC sections 1-3 over logical cells, loops over logical indices:
    c(q) of each block position q, where state i of a token is a cache of
    its layer whose heads come after the states before it (global head i*H
    + h). cells: [layers, tokens, states, heads, cell bytes]."""
    layers, _, states, heads, width = cells.shape
    pieces = width // 8
    out = []
    for q in range(-(-num_tokens // block)):
        total = 0
        for layer in range(layers):
            for i in range(states):
                for h in range(heads):
                    slice_sum = 0
                    for t in range(q * block, min((q + 1) * block, num_tokens)):
                        cell = bytes(cells[layer, t, i, h].tolist())
                        for piece in range(pieces):
                            x = int.from_bytes(cell[8 * piece : 8 * piece + 8], "little")
                            slice_sum += mix2(x) * (2 * (t * pieces + piece) + 1)
                    total += (2 * (layer * 65536 + i * heads + h) + 1) * slice_sum
        out.append(total & MASK)
    return out


#: The request's blocks at block size 16 (45 tokens: 3) and 8 (6).
POOLED_IDS = {16: [3, 7, 1], 8: [3, 7, 1, 9, 4, 10]}


def pooled_ranks(cells: torch.Tensor, block: int, tp: int, layout=KVCacheLayout.LBNHC, kernel: int | None = None):
    """A TP `tp` engine's caches holding `cells` (token t's state i of
    global head g at slot t*p + i of its block, on rank g // (H / tp)),
    the rest of every page random, and each rank's CacheChecksummer. With
    `kernel`, vLLM splits each block into kernel blocks of that many tokens
    (token o of a block: kernel block o // kernel, slot (o % kernel)*p + i)."""
    _, tokens, p, heads, width = cells.shape
    local = heads // tp
    cfg = config([(ATTN, pooled(p, local, block))])
    ids = torch.tensor(POOLED_IDS[block])
    out = []
    for rank in range(tp):
        caches = allocate_kv_cache(cfg, torch.device("cpu"), layout, [kernel] if kernel else None)
        buffer = raw(caches)
        buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(SEED + 1 + rank)))
        positions = torch.arange(tokens)
        size = kernel or block
        assert tuple(caches[ATTN[0]].shape)[:3] == (NUM_BLOCKS * (block // size), local, size * p), caches[ATTN[0]].shape
        kernel_blocks = ids[positions // block] * (block // size) + (positions % block) // size
        for layer, name in enumerate(ATTN):
            page = caches[name].view(torch.uint8)
            for i in range(p):
                page[kernel_blocks, :, (positions % size) * p + i] = cells[layer, :, i, rank * local : (rank + 1) * local]
        layers, sizes = layer_specs(cfg, heads)
        worker = CacheChecksummer(layers, caches, cfg.num_blocks, sizes, tp_rank=rank, tp_size=tp)
        assert worker.skipped == {}, worker.skipped
        out.append((caches, worker))
    return out


@pytest.mark.parametrize("layout, kernel", [(KVCacheLayout.LBNHC, None), (KVCacheLayout.LBHNC, None), (KVCacheLayout.LBNHC, 4)])
def test_pooled_caches_give_the_naive_reference_at_two_block_sizes_and_tp_1_and_2(layout, kernel):
    # Seeded random cells of 2 layers, 45 tokens, 4 states a token, 4 KV
    # heads, 64-byte cells (K then V of 16 fp16): the sum of the ranks'
    # values at each block position is the naive reference's, at blocks of
    # 16 and of 8 tokens (with `kernel`, split into kernel blocks of 4),
    # TP 1 and TP 2; slots past the 45 tokens (random) are never read.
    print(f"\nrandom cells seed {SEED} (KVCSUM_SEED)")
    cells = torch.randint(0, 256, (2, NUM_TOKENS, 4, 4, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(SEED))
    got = {}
    for block in (16, 8):
        want = naive_pooled(cells, NUM_TOKENS, block)
        for tp in (1, 2):
            total = [0] * len(want)
            for _, worker in pooled_ranks(cells, block, tp, layout, kernel):
                job = Job("req", NUM_TOKENS, {0: (0, POOLED_IDS[block])})
                pending = worker.checksum([job], kvcsum.PRODUCER)
                pending.wait()
                columns = pending.result.columns("req", 0)
                pending.result.close()
                for column in columns.values():
                    total = [(a + int(b)) & MASK for a, b in zip(total, column)]
            assert total == want, f"block size {block}, TP {tp}, seed {SEED} (KVCSUM_SEED)"
            got[block] = total
    # Block size does not matter: two 8-token positions add up to the 16-token one.
    assert got[16] == [(got[8][2 * q] + got[8][2 * q + 1]) & MASK for q in range(3)], f"seed {SEED}"


@pytest.mark.parametrize("flip", [None, "state 2"])
def test_pooled_caches_verify_from_tp_1_blocks_of_16_to_tp_2_blocks_of_8(flip):
    # Through kvcsum.Verifier: a producer at TP 1 with 16-token blocks, a
    # consumer at TP 2 with 8-token blocks holding the same cells; a flipped
    # byte of token 21's state 2 (head 3: rank 1) is a MISMATCH at the
    # producer's position 1 (tokens 16..32). The consumer takes the
    # producer's fingerprint of its own layers at 16-token blocks for its
    # own, as the connector does (kvcsum.vllm.load_verdict): the identity's
    # block size is vLLM's.
    from kvcsum.vllm.config import group_fingerprint
    from kvcsum.vllm.load_verdict import rewrite_fingerprints

    print(f"\nrandom cells seed {SEED} (KVCSUM_SEED)")
    cells = torch.randint(0, 256, (2, NUM_TOKENS, 4, 4, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(SEED))
    (_, producer), = pooled_ranks(cells, 16, 1)
    consumers = pooled_ranks(cells, 8, 2)
    if flip:
        caches = consumers[1][0]
        caches[ATTN[0]].view(torch.uint8)[POOLED_IDS[8][2], 1, (21 % 8) * 4 + 2, 17] ^= 0x04
    p_job, c_job = (Job("req", NUM_TOKENS, {0: (0, POOLED_IDS[b])}) for b in (16, 8))
    with kvcsum.Blocks() as p_blocks, kvcsum.Blocks() as c_blocks:
        p_job.to_blocks(p_blocks)
        c_job.to_blocks(c_blocks)
        with kvcsum.Verifier(1) as p:
            p.expect(p_blocks, kvcsum.PRODUCER)
            p.add_record(producer.checksum([p_job], kvcsum.PRODUCER).record())
            payload = p.payload("req")
        own = config([(ATTN, pooled(4, 2, 8))])
        payload = rewrite_fingerprints(payload, {0: (group_fingerprint(own, 0, 16), group_fingerprint(own, 0, 8))})
        with kvcsum.Verifier(2) as c:
            c.set_producer_tp_size(1)
            c.set_producer_block_size(0, 16)
            c.expect(c_blocks, kvcsum.CONSUMER)
            for _, worker in consumers:
                c.add_record(worker.checksum([c_job], kvcsum.CONSUMER).record())
            report = c.check("req", payload)
    print(f"\nCASE {f'Whisper pooling, TP 1 x 16 -> TP 2 x 8, flip {flip}':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    if flip is None:
        assert report.verdict == kvcsum.MATCH, f"{report.message} (seed {SEED})"
    else:
        assert report.verdict == kvcsum.MISMATCH, f"{report.message} (seed {SEED})"
        assert {(m.first_token, m.num_tokens) for m in report.mismatches} == {(16, 16)}, report.mismatches


@pytest.mark.parametrize("other", [1, 2])
def test_a_side_pooling_by_another_p_is_unverified_never_a_mismatch(other):
    # The layer identity carries p (vLLM's four fields are the same at any
    # p), so a producer pooling 4 states a token and a consumer pooling
    # `other` (1: none) have other fingerprints: UNVERIFIED, never MISMATCH.
    from kvcsum.vllm.cache_checksums import layer_fingerprint
    from kvcsum.vllm.config import group_fingerprint

    p_cfg = config([(ATTN, pooled(4))])
    c_cfg = config([(ATTN, pooled(other) if other > 1 else full(heads=4))])
    _, producer = engine_side(p_cfg, seed=9, total_kv_heads=4)
    _, consumer = engine_side(c_cfg, seed=9, total_kv_heads=4)
    assert producer.fingerprints[0] == group_fingerprint(p_cfg, 0, BLOCK) != consumer.fingerprints[0] == group_fingerprint(c_cfg, 0, BLOCK)
    name = ATTN[0]
    assert layer_fingerprint(name, "FullAttentionSpec", BLOCK, "torch.float16", 4) != layer_fingerprint(name, "FullAttentionSpec", BLOCK, "torch.float16")
    report = verdict([producer], [consumer], job(p_cfg), 1)
    print(f"\nCASE {f'Whisper pooling 4 -> {other}':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    assert report.verdict == kvcsum.UNVERIFIED, report.message


# --- 9. rings (CircularBufferSpec): one block a request, compared whole -------------------------

RING = [f"model.layers.{i}.self_attn.compressor.state_cache" for i in range(2)]


def compressor_ring(capacity: int = 8) -> CircularBufferSpec:
    # DeepSeek V4.1's compressor ring as vLLM 0.33 declares it
    # (models/deepseek_v41/compressor.py:231-237: one head, the [kv, score]
    # state of 2 x head_dim fp32, head_size_v 0; head_dim 512 there),
    # `capacity` rows.
    return CircularBufferSpec(block_size=capacity, num_kv_heads=1, head_size=64, head_size_v=0, dtype=torch.float32)


def tail_ring() -> CircularBufferSpec:
    # GLM-5 Next's indexer tail (models/glm5next/common/attention.py:170-180):
    # two head slots (raw K, gate score) of bf16, not DCP-sharded.
    return CircularBufferSpec(block_size=8, num_kv_heads=2, head_size=32, head_size_v=0, dtype=torch.bfloat16, dcp_sharded=False)


@pytest.mark.parametrize("make", [compressor_ring, tail_ring])
@pytest.mark.parametrize("where", [None, "row", "stale slot", "attention"])
def test_a_ring_is_a_state_whose_block_is_compared_whole(make, where):
    # A ring's block is the request's state (SPEC section 6: position 0),
    # every byte of it: the rows written at position % capacity and the
    # slots no row reached (vLLM does not zero a ring's block), which a
    # connector moving the block moves too. A flipped byte of either is a
    # MISMATCH of the ring's position 0; intact, a MATCH.
    from kvcsum.vllm.config import groups_not_checksummed

    groups = [(ATTN, full()), (RING, make())]
    assert groups_not_checksummed(config(groups), 4) == {}

    def flip(caches):
        if where == "attention":
            caches[ATTN[0]].view(torch.uint8)[IDS[2], 1, 3, 7] ^= 0x01
            return
        ring = caches[RING[1]].view(torch.uint8)
        assert tuple(ring.shape)[:3] == (NUM_BLOCKS, make().num_kv_heads, 8)
        ring[STATE_BLOCK, ring.shape[1] - 1, 2 if where == "row" else 7, 5] ^= 0x20

    report = round_trip(f"{make.__name__} ring + attention, flip in {where}", groups, flip if where else None)
    check(report, where is not None, IDS[2] if where == "attention" else STATE_BLOCK)


def test_a_ring_is_numbered_by_head_slot_row_and_element_whatever_the_layout():
    # The same logical ring (head slot, row, element) in vLLM's LBNHC and
    # LBHNC views (row-major and head-major pages): equal checksums.
    groups = [(ATTN, full()), (RING, tail_ring())]
    cfg = config(groups)
    p_caches, producer = engine_side(cfg, seed=21, total_kv_heads=4)
    c_caches = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout.LBHNC)
    for name in ATTN + RING:
        c_caches[name].copy_(p_caches[name])
    layers, sizes = layer_specs(cfg, 4)
    consumer = CacheChecksummer(layers, c_caches, cfg.num_blocks, sizes)
    report = verdict([producer], [consumer], job(cfg), 1)
    print(f"\nCASE {'ring of 2 head slots, LBNHC -> LBHNC':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    assert report.verdict == kvcsum.MATCH, report.message


def test_a_ring_at_another_tp_size_or_capacity_is_unverified_never_a_mismatch():
    # Shard-keyed: the rows are the same on every rank, the stale slots are
    # not, so only equal TP sizes compare; another capacity (another
    # speculative lookahead) is another block size in the identity.
    cfg = config([(RING, compressor_ring())])
    _, producer = engine_side(cfg, seed=3, total_kv_heads=4)
    consumers = [engine_side(cfg, seed=3, total_kv_heads=4, tp_rank=r, tp_size=2)[1] for r in range(2)]
    report = verdict([producer], consumers, job(cfg), 1)
    print(f"\nCASE {'ring, producer TP 1, consumer TP 2':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    assert report.verdict == kvcsum.UNVERIFIED, report.message
    other = config([(RING, compressor_ring(16))])
    _, consumer = engine_side(other, seed=3, total_kv_heads=4)
    report = verdict([producer], [consumer], job(cfg), 1)
    print(f"\nCASE {'ring of 8 rows -> ring of 16':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    assert report.verdict == kvcsum.UNVERIFIED, report.message


# --- what vLLM allows that kvcsum names, and what vLLM itself refuses ------------------------


def test_a_host_resident_group_is_named_not_checksummed():
    # HiSparse's source group (v1/hisparse/layout.py: host_resident, KV
    # transfer on): its KV is in the host pool, not the workers' caches.
    from kvcsum.vllm.config import groups_not_checksummed

    cfg = config([(ATTN, full())])
    cfg.kv_cache_groups[0] = KVCacheGroupSpec(list(ATTN), full(), host_resident=True)
    assert "host-resident" in groups_not_checksummed(cfg, 4)[0]
    # A group without host_resident is checksummed.
    assert groups_not_checksummed(config([(ATTN, full())]), 4) == {}


@pytest.mark.parametrize("field, value", [("mamba_cache_mode", "all"), ("mamba_cache_dtype", "int8"), ("mamba_ssm_cache_dtype", "float64")])
def test_vllm_refuses_mamba_modes_and_state_dtypes_kvcsum_would_not_read(field, value):
    # vLLM's CacheConfig: MambaCacheMode "align" or "none", MambaDType
    # auto, float32, float16, bfloat16 (config/cache.py): no state element
    # of other than 2 or 4 bytes, no third mode.
    from vllm.config import CacheConfig

    with pytest.raises(Exception, match=field):
        CacheConfig(**{field: value})
    CacheConfig(**{field: {"mamba_cache_mode": "align", "mamba_cache_dtype": "float32", "mamba_ssm_cache_dtype": "bfloat16"}[field]})


def test_vllm_refuses_dcp_with_a_mamba_group():
    # vLLM's MambaManager: "DCP not support mamba now."
    # (v1/core/single_type_kv_cache_manager.py, find_longest_cache_hit).
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    spec = MambaSpec(block_size=BLOCK, shapes=((3, 64),), dtypes=(torch.bfloat16,))
    with pytest.raises(AssertionError, match="DCP not support mamba"):
        MambaManager.find_longest_cache_hit([], 64, [0], None, spec, False, BLOCK, dcp_world_size=2)
