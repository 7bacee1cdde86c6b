"""Each kind of KV cache vLLM 0.33 allocates, registered by the connector's
worker part (kvcsum.vllm.config.layer_specs, kvcsum.vllm.cache_kinds,
CacheChecksummer) over the views vLLM itself makes (allocate_kv_cache /
create_kv_cache_views, from vLLM's own spec classes): a producer's KV moved
byte for byte to a consumer verifies (MATCH); a flipped byte in data, in a
scale, in a state, in an indexer cache is a MISMATCH of its block; TP shards
of head slots add up at another TP size. Each case prints one line."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
from kvcsum.vllm.cache_checksums import CacheChecksummer, Job  # noqa: E402
from kvcsum.vllm.config import layer_specs  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
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
        groups[g] = (0, [STATE_BLOCK]) if isinstance(group.kv_cache_spec, MambaSpec) else (0, list(IDS))
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


def test_vllms_own_indexer_k_cache_on_a_device_worker_is_registered_as_keys_then_scales(monkeypatch):
    # This kvcsum's device engine reads cells of 4-byte pieces as its host
    # engine does (SPEC section 1): a device worker's plan of the MLA +
    # indexer group registers every cache, the indexer as its keys then
    # its scales, one 132-byte cell of two segments. (No GPU here: the plan
    # of a host-built checksummer taken as a device one's.)
    from kvcsum.vllm import cache_checksums

    names, spec = mla_with_indexer()
    cfg = config([(names, spec)])
    caches, worker = engine_side(cfg, seed=3, total_kv_heads=1)
    layers, _ = layer_specs(cfg, 1)
    group = [s for s in layers if s.group_id == 0]
    worker.device = 0
    assert cache_checksums.DEVICE_READS_4_BYTE_PIECES
    plan = worker._plan_group(0, group, caches, cfg.num_blocks)
    cells = sorted(tuple(s.bytes_per_token for s in layer.segments) for layer in plan["layers"])
    assert cells == [(128, 4), (128, 4), (1152,), (1152,)]
    # The one switch of the rule: off, the plan names the indexer's cells
    # and the group is skipped at startup (its loads UNVERIFIED).
    monkeypatch.setattr(cache_checksums, "DEVICE_READS_4_BYTE_PIECES", False)
    with pytest.raises(ValueError, match="132-byte cells .*DEVICE_READS_4_BYTE_PIECES"):
        worker._plan_group(0, group, caches, cfg.num_blocks)


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


def test_a_ring_buffer_that_addresses_its_page_itself_is_named_not_checksummed():
    # DeepSeek V4.1's compressor ring (CircularBufferSpec): one block a
    # request, no slot mapping (vLLM's uses_slot_mapping False).
    from kvcsum.vllm.config import groups_not_checksummed
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    spec = CircularBufferSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
    assert spec.uses_slot_mapping is False
    cfg = config([(ATTN, spec)])
    assert "no slot mapping" in groups_not_checksummed(cfg, 1)[0]


# --- what vLLM allows that kvcsum names, and what vLLM itself refuses ------------------------


def test_whisper_pooled_states_are_named_not_checksummed():
    # Whisper's block pooling: several states a token, each token's
    # block_pool_size states consecutive slots (whisper_causal.py).
    from fractions import Fraction

    from kvcsum.vllm.config import groups_not_checksummed

    cfg = config([(ATTN, full(tokens_per_state=Fraction(1, 4)))])
    assert "stores 1/4 tokens per state" in groups_not_checksummed(cfg, 4)[0]


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
