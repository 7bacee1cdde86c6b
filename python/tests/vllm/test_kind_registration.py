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
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # python/tests: the naive references

import kvcsum  # noqa: E402
from test_checksums import mix2  # noqa: E402 - the tests' one naive MIXED2 (SPEC section 12)
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
    # vLLM's default SD conv layout (state_len, dim): no channel is a row,
    # so no TP split is known (cache_kinds.state_split).
    groups = [(MAMBA, mamba())]
    cfg = config(groups)
    _, producer = engine_side(cfg, seed=3, total_kv_heads=4)
    consumers = [engine_side(cfg, seed=3, total_kv_heads=4, tp_rank=r, tp_size=2)[1] for r in range(2)]
    assert "SD layout" in producer.shard_keyed[0], producer.shard_keyed
    report = verdict([producer], consumers, job(cfg), 1)
    print(f"\nCASE {'Mamba state, producer TP 1, consumer TP 2':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    assert report.verdict == kvcsum.UNVERIFIED
    assert report.findings[0].reason_name == "KVCS_UNVERIFIED_STATE_TP_DIFFERS", report.message


# --- 2b. Mamba states whose TP split vLLM derives (its NIXL connector's) --------------------


def mamba_kind(kind: str, tp: int, n_groups: int = 2) -> MambaSpec:
    """vLLM's MambaSpec of a Mamba1, Mamba2 or GDN layer at TP size `tp`,
    its shapes from vLLM's own MambaStateShapeCalculator (the layout the
    environment sets: DS under the ds_conv_layout fixture), conv bf16 and
    temporal fp32."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    if kind == "MAMBA1":
        shapes = calc.mamba1_state_shape(tp, intermediate_size=32, state_size=4, conv_kernel=4)
    elif kind == "MAMBA2":
        shapes = calc.mamba2_state_shape(tp, 32, n_groups, num_heads=4, head_dim=8, state_size=4, conv_kernel=4)
    else:
        shapes = calc.gated_delta_net_state_shape(tp, 2, 4, head_k_dim=4, head_v_dim=8, conv_kernel_size=4)
    return MambaSpec(
        block_size=BLOCK * 64, shapes=tuple(shapes), dtypes=(torch.bfloat16, torch.float32),
        mamba_type=getattr(MambaAttentionBackendEnum, kind),
    )


#: Per kind, each tensor's global rows in numbering order (the conv state's
#: sub-projections, then the temporal state), and the elements of a row.
GLOBAL_ROWS = {
    "MAMBA1": [("x", 32, 3), ("ssm", 32, 4)],
    "MAMBA2": [("x", 32, 3), ("B", 8, 3), ("C", 8, 3), ("ssm", 4, 32)],
    "GDN_ATTN": [("Q", 8, 3), ("K", 8, 3), ("V", 32, 3), ("ssm", 4, 32)],
}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", sorted(GLOBAL_ROWS))
def test_a_state_of_a_tp_split_vllm_derives_registers_each_sub_projection_and_the_ssm_rows_globally(ds_conv_layout, kind, tp):
    import mamba_states
    from kvcsum.vllm import cache_kinds
    from kvcsum.vllm.config import group_fingerprint

    cfg = config([(MAMBA, mamba_kind(kind, tp))])
    vllm_split = mamba_states.nixl_split(cfg.kv_cache_groups[0].kv_cache_spec, tp)
    for rank in range(tp):
        caches, worker = engine_side(cfg, seed=None, total_kv_heads=4, tp_rank=rank, tp_size=tp)
        assert not worker.skipped and worker.shard_keyed == {}, (worker.skipped, worker.shard_keyed)
        # The identities registered (each naming its split) sum to the
        # fingerprint the scheduler computes at this TP size.
        assert worker.fingerprints[0] == group_fingerprint(cfg, 0, cfg.kv_cache_groups[0].kv_cache_spec.block_size, tp)
        spec = next(s for s in layer_specs(cfg, 4)[0] if s.name == MAMBA[0])
        tensors = cache_kinds.state_tensors(caches[MAMBA[0]], spec, rank, tp, split=True)
        base = int(caches[MAMBA[0]].data_ptr())
        got = [
            (part.label, t.first_row, t.num_rows, t.total_rows, t.bytes_per_row, t.element_size, t.address - base)
            for part, t in zip(spec.state_parts, tensors)
        ]
        want, offset = [], 0
        for (label, total, elements), (rows, row_bytes) in zip(GLOBAL_ROWS[kind], vllm_split):
            size = 2 if label != "ssm" else 4
            # vLLM's NIXL split, rank by rank: `rows` of the tensor's rows.
            assert rows * tp == total and row_bytes == elements * size
            want.append((label, rank * rows, rows, total, elements * size, size, offset))
            offset += rows * row_bytes
        print(f"\nCASE {kind} TP {tp} rank {rank}: {got}")
        assert got == want
        assert spec.state_type == kind


def global_state(split, tp: int, seed: int) -> torch.Tensor:
    """A layer's global state (every tensor's global rows), random bytes."""
    import mamba_states

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (mamba_states.global_bytes(split, tp),), dtype=torch.uint8, generator=generator)


def state_side(cfg, tp: int, states: dict, rank_content=None):
    """The workers of one engine of TP size `tp` whose layers' pages hold
    their rank's slice of `states` ({layer: global state}) at STATE_BLOCK
    (or `rank_content(layer, rank)`)."""
    import mamba_states

    split = mamba_states.nixl_split(cfg.kv_cache_groups[0].kv_cache_spec, tp)
    sides = []
    for rank in range(tp):
        caches, worker = engine_side(cfg, seed=None, total_kv_heads=4, tp_rank=rank, tp_size=tp)
        for name, state in states.items():
            content = rank_content(name, rank) if rank_content else mamba_states.rank_slice(state, split, tp, rank)
            caches[name][STATE_BLOCK].view(-1).view(torch.uint8)[: content.numel()] = content
        sides.append((caches, worker))
    return sides


@pytest.mark.parametrize("flip", [None, "conv", "ssm"])
@pytest.mark.parametrize("p_tp, c_tp", [(1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("kind", sorted(GLOBAL_ROWS))
def test_a_state_of_a_tp_split_vllm_derives_verifies_across_tp_sizes(ds_conv_layout, kind, p_tp, c_tp, flip):
    import mamba_states

    seed = 1000 * len(kind) + 10 * p_tp + c_tp
    split = mamba_states.nixl_split(mamba_kind(kind, 1), 1)
    states = {name: global_state(split, 1, seed + i) for i, name in enumerate(MAMBA)}
    producers = state_side(config([(MAMBA, mamba_kind(kind, p_tp))]), p_tp, states)
    c_cfg = config([(MAMBA, mamba_kind(kind, c_tp))])
    consumers = state_side(c_cfg, c_tp, states)
    if flip:
        # A byte of the last consumer rank's conv state (its last
        # sub-projection: B's twin C, GDN's V) or of its ssm state.
        c_split = mamba_states.nixl_split(c_cfg.kv_cache_groups[0].kv_cache_spec, c_tp)
        conv_bytes = sum(rows * row for rows, row in c_split[:-1])
        byte = conv_bytes - 5 if flip == "conv" else conv_bytes + 13
        caches, _ = consumers[-1]
        caches[MAMBA[1]][STATE_BLOCK].view(-1).view(torch.uint8)[byte] ^= 0x04
    report = verdict([w for _, w in producers], [w for _, w in consumers], job(c_cfg), p_tp)
    case = f"{kind} state, P TP {p_tp}, C TP {c_tp}, flip {flip} (seed {seed})"
    print(f"\nCASE {case:<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}", flush=True)
    check(report, flip is not None, STATE_BLOCK)


@pytest.mark.parametrize("p_tp, c_tp", [(1, 2), (2, 1)])
def test_mamba2_groups_vllm_replicates_at_one_tp_size_are_unverified_never_a_mismatch(ds_conv_layout, p_tp, c_tp):
    # n_groups 1: at TP 2 vLLM extends the groups to 2 so that each head
    # shard has its group (mamba_utils.py:199, :261-269, extra_groups_for_
    # head_shards): both ranks hold group 0's B and C, so B and C have 4
    # rows at TP 1 and 8 across TP 2. Numbered as a split, rows would
    # differ; the identity names each tensor's global rows, so the
    # fingerprints differ: UNVERIFIED, never MISMATCH (here over the same
    # model state on both sides).
    import mamba_states

    one = mamba_kind("MAMBA2", 1, n_groups=1)
    split = mamba_states.nixl_split(one, 1)
    assert [rows for rows, _ in split] == [32, 4, 4, 4]
    states = {name: global_state(split, 1, 77 + i) for i, name in enumerate(MAMBA)}

    def tp2_content(name, rank):
        # x and the ssm heads: the rank's half; B and C: the one group, whole.
        (x, row), (b, _), (c, _), (heads, ssm_row) = split
        state = states[name]
        x_part = state[rank * x // 2 * row : (rank + 1) * x // 2 * row]
        bc = state[x * row : (x + b + c) * row]
        ssm = state[(x + b + c) * row :]
        return torch.cat([x_part, bc, ssm[rank * heads // 2 * ssm_row : (rank + 1) * heads // 2 * ssm_row]])

    sides = {}
    for tp in {p_tp, c_tp}:
        cfg = config([(MAMBA, mamba_kind("MAMBA2", tp, n_groups=1))])
        sides[tp] = (cfg, state_side(cfg, tp, states, tp2_content if tp == 2 else None))
        assert all(w.shard_keyed == {} for _, w in sides[tp][1])
    producers, consumers = sides[p_tp][1], sides[c_tp][1]
    report = verdict([w for _, w in producers], [w for _, w in consumers], job(sides[c_tp][0]), p_tp)
    print(f"\nCASE {f'Mamba2 n_groups 1, P TP {p_tp}, C TP {c_tp}':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    assert report.verdict == kvcsum.UNVERIFIED, report.message
    assert report.findings[0].reason_name == "KVCS_UNVERIFIED_FINGERPRINT_DIFFERS", report.message


def test_a_state_of_known_split_against_a_shard_keyed_one_is_unverified(ds_conv_layout, monkeypatch):
    # The same Mamba2 state at TP 1: the producer in the DS layout (split
    # known), the consumer where vLLM keeps the SD layout (shard-keyed).
    # Their identities and marks differ (SPEC section 7): UNVERIFIED.
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    cfg = config([(MAMBA, mamba_kind("MAMBA2", 1))])
    _, producer = engine_side(cfg, seed=5, total_kv_heads=4)
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "SD")
    get_conv_state_layout.cache_clear()
    _, consumer = engine_side(cfg, seed=5, total_kv_heads=4)
    assert producer.shard_keyed == {} and "SD layout" in consumer.shard_keyed[0]
    report = verdict([producer], [consumer], job(cfg), 1)
    print(f"\nCASE {'Mamba2, split known against shard-keyed, TP 1':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    assert report.verdict == kvcsum.UNVERIFIED, report.message
    assert report.findings[0].reason_name == "KVCS_UNVERIFIED_FINGERPRINT_DIFFERS", report.message


@pytest.mark.parametrize(
    "make, why",
    [
        # vLLM's ShortConv (and the PLE's tp_replicated conv state): no split derived.
        (lambda tp: MambaSpec(block_size=BLOCK * 64, shapes=((64 // tp, 3),), dtypes=(torch.bfloat16,),
                              mamba_type=_backend("SHORT_CONV")), "SHORT_CONV"),
        (lambda tp: MambaSpec(block_size=BLOCK * 64, shapes=((64, 3),), dtypes=(torch.bfloat16,),
                              mamba_type=_backend("MAMBA1"), tp_replicated=True), "tp_replicated"),
        # A Mamba2 whose conv channels do not decompose into x + 2 B (fewer
        # than the heads' 32 x channels).
        (lambda tp: MambaSpec(block_size=BLOCK * 64, shapes=((16 // tp, 3), (4 // tp, 8, 4)),
                              dtypes=(torch.bfloat16, torch.float32)), "do not decompose"),
    ],
    ids=["short_conv", "tp_replicated", "no_decomposition"],
)
def test_a_state_whose_split_is_not_derived_stays_shard_keyed_and_another_tp_size_is_unverified(ds_conv_layout, make, why):
    p_cfg, c_cfg = config([(MAMBA, make(1))]), config([(MAMBA, make(2))])
    _, producer = engine_side(p_cfg, seed=3, total_kv_heads=4)
    consumers = [engine_side(c_cfg, seed=3, total_kv_heads=4, tp_rank=r, tp_size=2)[1] for r in range(2)]
    assert why in producer.shard_keyed[0], producer.shard_keyed
    report = verdict([producer], consumers, job(c_cfg), 1)
    print(f"\nCASE {f'state not split ({why}), P TP 1, C TP 2':<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}")
    assert report.verdict == kvcsum.UNVERIFIED, report.message


def _backend(name: str):
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    return getattr(MambaAttentionBackendEnum, name)


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


@pytest.mark.parametrize("make", [nvfp4, b12x], ids=["nvfp4", "b12x"])
def test_a_head_slot_cache_fingerprints_as_the_library_registers_it(make):
    # Its K slots and V slots are two caches, the V slots' with no
    # identity; the library counts that entry too (SPEC section 7). The
    # scheduler's fingerprint of the group at a block size (what a load
    # across block sizes is compared under: load_verdict) must be the
    # library's, or such loads would be UNVERIFIED for nothing.
    from kvcsum.vllm.config import group_fingerprint

    cfg = config([(ATTN, make())])
    _, producer = engine_side(cfg, seed=5, total_kv_heads=4)
    assert not producer.skipped, producer.skipped
    with kvcsum.Blocks() as blocks:
        job(cfg).to_blocks(blocks)
        with kvcsum.Verifier(1) as p:
            p.expect(blocks, kvcsum.PRODUCER)
            p.add_record(producer.checksum([job(cfg)], kvcsum.PRODUCER).record())
            library = kvcsum.decode_payload(p.payload("req")).group(0).fingerprint
    assert library == producer.fingerprints[0] == group_fingerprint(cfg, 0, BLOCK)
    # Without the V slots' entry it would not be.
    from kvcsum.vllm.cache_checksums import layer_fingerprint

    assert library != sum(layer_fingerprint(name, type(make()).__name__, BLOCK, str(make().dtype)) for name in ATTN) % 2**64


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


#: The seed of the fp8_ds_mla cases' flipped bytes (KVCS_SEED changes it); printed.
DS_MLA_SEED = int(os.environ.get("KVCS_SEED", "0x64736D6C"), 0)


def fp8_ds_mla(block: int = BLOCK) -> MLAAttentionSpec:
    # DeepSeek V4's compressed MLA cache in fp8_ds_mla records
    # (models/deepseek_v4/attention.py:860-883): 584-byte states, 4 tokens
    # a state, pages padded to a multiple of 576 bytes; each block's page
    # its states' 576 data bytes (state t's at t*576), then their 8 scale
    # bytes (at states*576 + t*8) (models/deepseek_v4/common/ops/
    # cache_utils.py:64-69, fused_compress_quant_cache.py:263-272).
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    return MLAAttentionSpec(
        block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8, tokens_per_state=4,
        alignment=576, model_version="deepseek_v4", state_content_bytes=584, cache_dtype_str="fp8_ds_mla",
        kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
    )


def test_deepseek_v4_fp8_ds_mla_states_are_registered_as_their_data_then_their_scales():
    # One 584-byte cell of two segments over each block's page: K the
    # state's 576 data bytes (at t*576), V its 8 scale bytes (at 4*576 +
    # t*8), the page's stride the padded 2880 bytes. Both are 8-byte pieces,
    # so a device worker's plan takes it too (as it takes the indexer's
    # 4-byte pieces: test_vllms_own_indexer_k_cache_on_a_device_worker_*).
    from kvcsum.vllm.config import groups_not_checksummed

    cfg = config([(ATTN, fp8_ds_mla())])
    assert groups_not_checksummed(cfg, 1) == {}
    caches, worker = engine_side(cfg, seed=4, total_kv_heads=1)
    assert worker.skipped == {} and worker.layers_registered == 2
    layers, _ = layer_specs(cfg, 1)
    assert {(layer.data_bytes, layer.scale_bytes) for layer in layers} == {(576, 8)}
    for device in (kvcsum.HOST, 0):
        worker.device = device
        plan = worker._plan_group(0, layers, caches, cfg.num_blocks)
        for layer, name in zip(plan["layers"], ATTN):
            page = caches[name]
            assert tuple(page.shape) == (NUM_BLOCKS, 1, 4, 584) and page.stride(0) == 2880
            k, v = layer.segments
            assert (k.bytes_per_token, k.token_stride, k.block_stride) == (576, 576, 2880)
            assert (v.bytes_per_token, v.token_stride, v.block_stride) == (8, 8, 2880)
            assert (k.address, v.address) == (page.data_ptr(), page.data_ptr() + 4 * 576)
            assert layer.tokens_per_kernel_block == 4 and layer.kernel_blocks == 1
    worker.device = kvcsum.HOST


@pytest.mark.parametrize("where", [None, "data", "scale", "padding"])
def test_deepseek_v4_fp8_ds_mla_states_verify_and_a_flipped_data_or_scale_byte_is_a_mismatch(where):
    # Seeded random pages, the consumer's a copy of the producer's; a
    # flipped byte of block IDS[1]'s page: in a state's data (bytes
    # 0..2304), in the scales (2304..2336): a MISMATCH of that block; in
    # the page's padding (2336..2880), no state's byte: MATCH.
    import random

    rng = random.Random(f"{DS_MLA_SEED}:{where}")
    at = {"data": (0, 4 * 576), "scale": (4 * 576, 4 * 584), "padding": (4 * 584, 2880)}.get(where)
    byte = rng.randrange(*at) if at else None

    def flip(caches):
        view = caches[ATTN[1]].view(torch.uint8)
        page = view.as_strided((view.stride(0),), (1,), view.storage_offset() + IDS[1] * view.stride(0))
        page[byte] ^= 1 << rng.randrange(8)

    case = f"fp8_ds_mla states, flip in {where}" + (f" (byte {byte}, seed {DS_MLA_SEED:#x}, KVCS_SEED)" if at else "")
    report = round_trip(case, [(ATTN, fp8_ds_mla())], flip if where else None, total_kv_heads=1)
    check(report, where in ("data", "scale"), IDS[1])


def swa_fp8_ds_mla(block: int = BLOCK, record: int = 584):
    # DeepSeek V4's sliding-window cache as DeepseekV4SWACache declares it
    # (v1/attention/backends/mla/sparse_swa.py:120-147): one head, uint8, a
    # token a record; V4's 584-byte records in pages padded to 576 bytes,
    # V4.1's 528-byte ones on SM100 in pages padded to 512, the block
    # stride to lcm(528, the compressed record) (models/deepseek_v41/
    # attention.py:521-531, :562-579).
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec, get_kv_quant_mode

    v41 = record != 584
    return SlidingWindowMLASpec(
        block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8, sliding_window=128,
        cache_dtype_str="fp8_ds_mla", state_content_bytes=record, alignment=512 if v41 else 576,
        block_stride_alignment=record if v41 else None, model_version="deepseek_v4",
        kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
    )


def v41_compressed(record: int = 528, block: int = BLOCK) -> MLAAttentionSpec:
    # DeepSeek V4.1's compressed MLA cache on SM100 (models/deepseek_v41/
    # attention.py:1206-1231): 528-byte MXFP8 records (288-byte NVFP4 ones
    # with nvfp4_ds_mla), 4 tokens a state, pages padded to 512 bytes.
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    dtype = "nvfp4_ds_mla" if record == 288 else "fp8_ds_mla"
    return MLAAttentionSpec(
        block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8, tokens_per_state=4,
        alignment=512, model_version="deepseek_v4", state_content_bytes=record, cache_dtype_str=dtype,
        kv_quant_mode=get_kv_quant_mode(dtype),
    )


def strided_config(groups) -> KVCacheConfig:
    """`config`, each block's stride rounded up to its spec's block stride
    alignment as vLLM's planner does (v1/core/kv_cache_planning.py:571)."""
    cfg = config(groups)
    pages = []
    for names, spec in groups:
        stride = -(-spec.page_size_bytes // spec.get_block_stride_alignment()) * spec.get_block_stride_alignment()
        pages += [(name, stride) for name in names]
    total = sum(page * NUM_BLOCKS for _, page in pages)
    tensors, offset = [], 0
    for name, page in pages:
        tensors.append(KVCacheTensor(size=total, layers=[name], layer_stride=page * NUM_BLOCKS, block_stride=page, offset=offset))
        offset += page * NUM_BLOCKS
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=cfg.kv_cache_groups)


def test_deepseek_v4_sliding_window_records_are_registered_as_their_data_then_their_scales():
    # The SlidingWindowMLASpec is one latent head like MLA's (is_mla: heads
    # not numbered as KV heads), its 584-byte records the fp8_ds_mla rule's
    # at a token a slot: K the token's 576 data bytes (at t*576), V its 8
    # scale bytes (at 16*576 + t*8), the page's stride the padded 9792.
    from kvcsum.vllm.config import groups_not_checksummed

    cfg = config([(ATTN, swa_fp8_ds_mla())])
    assert groups_not_checksummed(cfg, 1) == {}
    caches, worker = engine_side(cfg, seed=4, total_kv_heads=1)
    assert worker.skipped == {} and worker.layers_registered == 2
    layers, _ = layer_specs(cfg, 1)
    assert {(layer.is_mla, layer.data_bytes, layer.scale_bytes, layer.tokens_per_state) for layer in layers} == {(True, 576, 8, 1)}
    for device in (kvcsum.HOST, 0):
        worker.device = device
        plan = worker._plan_group(0, layers, caches, cfg.num_blocks)
        for layer, name in zip(plan["layers"], ATTN):
            page = caches[name]
            assert tuple(page.shape) == (NUM_BLOCKS, 1, BLOCK, 584) and page.stride(0) == 9792
            k, v = layer.segments
            assert (k.bytes_per_token, k.token_stride, k.block_stride) == (576, 576, 9792)
            assert (v.bytes_per_token, v.token_stride, v.block_stride) == (8, 8, 9792)
            assert (k.address, v.address) == (page.data_ptr(), page.data_ptr() + BLOCK * 576)
            assert layer.tokens_per_kernel_block == BLOCK and layer.kernel_blocks == 1
    worker.device = kvcsum.HOST


@pytest.mark.parametrize("record, tokens", [(528, 1), (528, 4), (288, 4)])
def test_deepseek_v41_interleaved_records_are_registered_as_opaque_cells(record, tokens):
    # V4.1's records keep a token's scales after its own data: one cell of
    # the record's bytes a slot (token or state), one segment, the block
    # stride the view's (the sliding window's rounded up to 528 bytes).
    spec = swa_fp8_ds_mla(record=record) if tokens == 1 else v41_compressed(record)
    cfg = strided_config([(ATTN, spec)])
    caches, worker = engine_side(cfg, seed=4, total_kv_heads=1)
    assert worker.skipped == {} and worker.layers_registered == 2
    layers, _ = layer_specs(cfg, 1)
    assert {(layer.is_mla, layer.cell_bytes, layer.data_bytes) for layer in layers} == {(True, record, 0)}
    slots = BLOCK // tokens
    stride = -(-(-(-slots * record // 512) * 512) // spec.get_block_stride_alignment()) * spec.get_block_stride_alignment()
    for device in (kvcsum.HOST, 0):
        worker.device = device
        plan = worker._plan_group(0, layers, caches, cfg.num_blocks)
        for layer, name in zip(plan["layers"], ATTN):
            page = caches[name]
            assert tuple(page.shape) == (NUM_BLOCKS, 1, slots, record) and page.stride(0) == stride
            (cell,) = layer.segments
            assert (cell.bytes_per_token, cell.token_stride, cell.block_stride) == (record, record, stride)
            assert cell.address == page.data_ptr() and layer.tokens_per_kernel_block == slots
    worker.device = kvcsum.HOST


@pytest.mark.parametrize("where", [None, "data", "scale"])
@pytest.mark.parametrize("record", [584, 528])
def test_deepseek_v4_sliding_window_records_verify_and_a_flipped_byte_is_a_mismatch(record, where):
    # Seeded random pages, the consumer's a copy of the producer's; a
    # flipped byte of block IDS[1]'s page: a MISMATCH of that block. V4's
    # data region is bytes 0..16*576, its scales 16*576..16*584; V4.1's
    # record t holds data at t*528 .. +512, its scales at +512 .. +528.
    import random

    rng = random.Random(f"{DS_MLA_SEED}:swa:{record}:{where}")
    if record == 584:
        at = {"data": (0, BLOCK * 576), "scale": (BLOCK * 576, BLOCK * 584)}.get(where)
        byte = rng.randrange(*at) if at else None
    else:
        t = rng.randrange(BLOCK)
        byte = t * 528 + (rng.randrange(512) if where == "data" else 512 + rng.randrange(16)) if where else None

    def flip(caches):
        view = caches[ATTN[1]].view(torch.uint8)
        page = view.as_strided((view.stride(0),), (1,), view.storage_offset() + IDS[1] * view.stride(0))
        page[byte] ^= 1 << rng.randrange(8)

    case = f"{record}-byte SWA records, flip in {where}" + (f" (byte {byte}, seed {DS_MLA_SEED:#x}, KVCS_SEED)" if where else "")
    groups = [(ATTN, swa_fp8_ds_mla(record=record))]
    cfg = strided_config(groups)
    p_caches, producer = engine_side(cfg, seed=11, total_kv_heads=1)
    c_caches, consumer = engine_side(cfg, seed=None, total_kv_heads=1)
    raw(c_caches).copy_(raw(p_caches))
    if where:
        flip(c_caches)
    report = verdict([producer], [consumer], job(cfg), 1)
    print(f"\nCASE {case:<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}", flush=True)
    check(report, where is not None, IDS[1])


@pytest.mark.parametrize("pair", ["swa 584 -> 528", "compressed 528 -> 288", "compressed 584 -> 528"])
def test_deepseek_v4_sides_of_another_record_format_are_unverified_never_a_mismatch(pair):
    # One layer name, spec type, block size and dtype (uint8) on both sides,
    # the fork's identity alike: the record's geometry (a cell's bytes, K's
    # bytes) tells them apart, UNVERIFIED (GEOMETRY_DIFFERS), never MISMATCH.
    specs = {
        "swa 584 -> 528": (swa_fp8_ds_mla(), swa_fp8_ds_mla(record=528)),
        "compressed 528 -> 288": (v41_compressed(528), v41_compressed(288)),
        "compressed 584 -> 528": (fp8_ds_mla(), v41_compressed(528)),
    }[pair]
    p_cfg, c_cfg = (strided_config([(ATTN, spec)]) for spec in specs)
    _, producer = engine_side(p_cfg, seed=11, total_kv_heads=1)
    _, consumer = engine_side(c_cfg, seed=11, total_kv_heads=1)
    assert not producer.skipped and not consumer.skipped
    assert producer.fingerprints == consumer.fingerprints
    report = verdict([producer], [consumer], job(p_cfg), 1)
    print(f"\nCASE {pair:<52} | {NAMES[report.verdict]:<10} | {report.message[:110]}", flush=True)
    assert report.verdict == kvcsum.UNVERIFIED, report.message
    assert report.reason == kvcsum.GEOMETRY_DIFFERS, report.message


def test_deepseek_v4_records_kvcsum_has_no_rule_for_are_named_not_checksummed():
    # A DeepSeek V4 packed record of another width, or of a spec that is no
    # one latent head (none vLLM 0.33 declares): named, never registered.
    v4 = MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=512, dtype=torch.uint8, tokens_per_state=4, alignment=512,
        model_version="deepseek_v4", state_content_bytes=656, cache_dtype_str="fp8_ds_mla",
    )
    wide = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=512, dtype=torch.uint8, state_content_bytes=528,
    )
    object.__setattr__(wide, "model_version", "deepseek_v4")
    for spec, size in ((v4, 656), (wide, 528)):
        cfg = config([(ATTN, spec)])
        from kvcsum.vllm.config import groups_not_checksummed

        assert f"{size}-byte records) packs its records in a layout kvcsum has no rule for" in groups_not_checksummed(cfg, 1)[0]
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
    assert layer_fingerprint(name, "FullAttentionSpec", BLOCK, "torch.float16", states_per_token=4) != layer_fingerprint(
        name, "FullAttentionSpec", BLOCK, "torch.float16"
    )
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
    from kvcsum.vllm.config import group_fingerprint

    cfg = config([(RING, compressor_ring())])
    _, producer = engine_side(cfg, seed=3, total_kv_heads=4)
    assert producer.shard_keyed and producer.fingerprints[0] == group_fingerprint(cfg, 0, 8, 1)
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
