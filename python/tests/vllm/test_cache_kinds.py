"""Every kind of KV cache vLLM 0.33 allocates, through KvcsumConnector in
vLLM's real Scheduler and worker glue, on the CPU: per kind an
engine pair (or one engine and a tier) with a tier and a P/D round trip.
Intact loads are used, with the tokens reused equal to the bare wrapped
connector's; a flipped byte is never used (the stand-in model's forward
never reads KV other than what it computes: Engine(track_kv=True)).

Each case prints one line: what vLLM did and kvcsum's counts.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
import store_connector  # noqa: E402
import tier_connector  # noqa: E402
from harness import Engine, KVCacheLayout, sampled_token  # noqa: E402

BLOCK = 16
PROMPT = [7 + (i * 13) % 600 for i in range(70)]  # 4 full blocks (64 tokens) and 6 more
WINDOW = 128  # the sliding window group's: every block of the prompt is in it
NAMES = {kvcsum.MATCH: "MATCH", kvcsum.MISMATCH: "MISMATCH", kvcsum.UNVERIFIED: "UNVERIFIED"}


@pytest.fixture(autouse=True)
def tier():
    for shared in (tier_connector.TIER, tier_connector.INDEX, tier_connector.FAULT, store_connector.CORRUPT):
        shared.clear()
    yield
    for shared in (tier_connector.TIER, tier_connector.INDEX, tier_connector.FAULT, store_connector.CORRUPT):
        shared.clear()


@pytest.fixture
def store():
    path = tempfile.mkdtemp(prefix="kvcsum-vllm-kinds-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def counts(e: Engine) -> dict:
    """kvcsum's counts from the engine's connector stats, summed."""
    out: dict = {}
    for stats in e.stats:
        data = stats.get("KvcsumConnector") if isinstance(stats, dict) else None
        for key, value in (data or {}).items():
            if isinstance(value, dict):
                for k, v in value.items():
                    if isinstance(v, int):
                        out[f"{key}.{k}"] = out.get(f"{key}.{k}", 0) + v
            elif isinstance(value, int) and value:
                out[key] = out.get(key, 0) + value
    return out


def computed(e: Engine, req_id: str, prompt_len: int = len(PROMPT)) -> tuple[int, int]:
    """(prompt tokens vLLM computed, the first of them)."""
    runs = [(s, min(s + n, prompt_len) - s) for s, n in e.traces[req_id].scheduled if s < prompt_len]
    return sum(n for _, n in runs), min((s for s, _ in runs), default=-1)


def expected(n: int, prompt=PROMPT) -> list:
    return [sampled_token(len(prompt) - 1 + i) for i in range(n)]


def line(case: str, e: Engine, req_id: str, prompt_len: int = len(PROMPT)) -> None:
    verdicts = e.connector().last_verdicts if hasattr(e.connector(), "last_verdicts") else {}
    got = verdicts.get(req_id)
    label = "-" if got is None else NAMES[got[0]] + (f" ({got[1]})" if got[1] else "")
    count, first = computed(e, req_id, prompt_len)
    trace = e.traces[req_id]
    print(
        f"\nCASE {case:<58} | {label:<24} | computed {count} of {prompt_len} prompt tokens from {first}; "
        f"{len(trace.output_tokens)} tokens out; bad KV read in steps {trace.bad_kv_steps} | {counts(e) if verdicts else ''}",
        flush=True,
    )


# --- 1. hybrid models keep sync tier reuse ---------------------------------------------


def tier_engine(load_mode: str, *, wrap: bool = True, tp: int = 1, extra: dict | None = None) -> Engine:
    inner = {
        "kv_connector": "TierConnector",
        "kv_connector_module_path": "tier_connector",
        "kv_connector_extra_config": {"load_mode": load_mode, "capacity": 256},
    }
    return Engine(
        "hybrid-tiered", role="kv_both", tp=tp, block_size=BLOCK, layout=KVCacheLayout.LBNHC, store_dir="",
        inner=inner, extra=extra, wrap=wrap, sliding_window=WINDOW, track_kv=True,
    )


def tier_round_trip(e: Engine) -> None:
    e.add_request("first", PROMPT, 2)
    e.run()
    e.add_request("again", PROMPT, 3)
    e.run()


@pytest.mark.parametrize("tp", [1, 2])
def test_hybrid_sync_tier_hit_intact_reuses_as_many_tokens_as_the_bare_tier(tp):
    bare = tier_engine("sync", wrap=False, tp=tp)
    assert len(bare.kv_cache_config.kv_cache_groups) == 2
    tier_round_trip(bare)
    line(f"hybrid sync tier, bare TierConnector, TP {tp}", bare, "again")
    tier_connector.TIER.clear(), tier_connector.INDEX.clear()
    e = tier_engine("sync", tp=tp)
    tier_round_trip(e)
    line(f"hybrid sync tier, wrapped, intact, TP {tp}", e, "again")
    assert e.connector().last_verdicts["again"][0] == kvcsum.MATCH
    # The same tokens reused (64 of 70) as through the bare tier.
    assert computed(e, "again") == computed(bare, "again") == (len(PROMPT) - 64, 64)
    assert e.traces["again"].output_tokens == bare.traces["again"].output_tokens == expected(3)
    assert e.traces["again"].bad_kv_steps == [] and bare.traces["again"].bad_kv_steps == []
    assert counts(e).get("sync_loads_as_async") == 1 and not counts(e).get("sync_loads_declined")
    # The load waited one engine step (the one that loaded and checked it).
    assert e.traces["again"].first_scheduled() == bare.traces["again"].first_scheduled() + 1


@pytest.mark.parametrize("rank", [0, 1])
def test_hybrid_sync_tier_hit_with_a_flipped_byte_is_never_used(rank):
    tp = 2
    bare = tier_engine("sync", wrap=False, tp=tp)
    tier_connector.FAULT.update(flip=1, rank=rank)
    tier_round_trip(bare)
    line(f"hybrid sync tier, bare, flip on rank {rank}", bare, "again")
    assert bare.traces["again"].bad_kv_steps, "the bare tier uses the flipped byte"
    tier_connector.TIER.clear(), tier_connector.INDEX.clear(), tier_connector.FAULT.clear()
    e = tier_engine("sync", tp=tp)
    tier_connector.FAULT.update(flip=1, rank=rank)
    tier_round_trip(e)
    line(f"hybrid sync tier, wrapped, flip on rank {rank}", e, "again")
    assert tier_connector.FAULT.get("done") == 1
    assert e.connector().last_verdicts["again"][0] == kvcsum.MISMATCH
    assert e.traces["again"].bad_kv_steps == []
    # vLLM takes only whole failed loads with several groups: from token 0.
    assert computed(e, "again") == (len(PROMPT), 0)
    assert e.traces["again"].output_tokens == expected(3)
    assert e.request_status("again") == "FINISHED_LENGTH_CAPPED"


@pytest.mark.parametrize("flip", [False, True])
def test_vllm_offloading_connector_sync_loads_on_a_hybrid_model_reuse_as_alone_and_never_use_a_flip(flip):
    # vLLM 0.33's own OffloadingConnector (CPU spec, host copies:
    # offloading_spec.py) with sync loads (sync_load_budget_bytes): it
    # emits its loads from its own list, so the load handed to vLLM as
    # async is done in the step vLLM allocates it.
    import offloading_spec

    results = {}
    for wrap in (False, True):
        offloading_spec.FAULT.clear()
        inner = {
            "kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {
                "spec_name": "HostCopySpec", "spec_module_path": "offloading_spec",
                "cpu_bytes_to_use": 1 << 26, "sync_load_budget_bytes": 1 << 26,
            },
        }
        e = Engine("offloading", role="kv_both", tp=1, block_size=BLOCK, layout=KVCacheLayout.LBNHC, store_dir="",
                   inner=inner, wrap=wrap, sliding_window=WINDOW, track_kv=True)
        e.add_request("first", PROMPT, 2)
        e.run()
        if flip:
            offloading_spec.FAULT["flip"] = 1
        e.add_request("again", PROMPT, 3)
        e.run()
        if flip:
            assert offloading_spec.FAULT.get("done"), "the fault was made"
        line(f"hybrid, vLLM OffloadingConnector sync, {'wrapped' if wrap else 'bare'}, {'flip' if flip else 'intact'}", e, "again")
        results[wrap] = e
    bare, e = results[False], results[True]
    assert counts(e).get("sync_loads_as_async") == 1
    assert e.traces["again"].output_tokens == expected(3)
    if flip:
        assert set(bare.traces["again"].bad_kv_steps) & set(bare.traces["again"].token_steps)
        assert e.connector().last_verdicts["again"][0] == kvcsum.MISMATCH
        assert e.traces["again"].bad_kv_steps == [] and computed(e, "again") == (len(PROMPT), 0)
    else:
        assert e.connector().last_verdicts["again"][0] == kvcsum.MATCH
        assert computed(e, "again") == computed(bare, "again") == (len(PROMPT) - 64, 64)
        assert e.traces["again"].bad_kv_steps == []
        assert e.traces["again"].first_scheduled() == bare.traces["again"].first_scheduled() + 1


def test_hybrid_sync_tier_hit_declined_where_the_setting_says_so():
    e = tier_engine("sync", extra={"unfailable_sync_loads": "decline"})
    tier_round_trip(e)
    line("hybrid sync tier, unfailable_sync_loads=decline", e, "again")
    assert computed(e, "again") == (len(PROMPT), 0)
    assert counts(e).get("sync_loads_declined") == 1
    assert e.traces["again"].bad_kv_steps == []


# --- 5. PP: a sync P/D load whose records cannot meet in its step ------------------------

P_BLOCK, C_BLOCK = 8, 16
PD_PROMPT = [11 + (i * 7) % 500 for i in range(49)]


def pd_pair(store: str, *, c_tp: int = 2, **kw) -> tuple[Engine, Engine]:
    p = Engine("producer", role="kv_producer", tp=2, block_size=P_BLOCK, layout=KVCacheLayout.LBNHC, store_dir=store,
               sliding_window=kw.get("sliding_window"))
    c = Engine("consumer", role="kv_consumer", tp=c_tp, block_size=C_BLOCK, layout=KVCacheLayout.LBHNC, store_dir=store, **kw)
    return p, c


def pd_round_trip(p: Engine, c: Engine, req_id: str, prompt=PD_PROMPT, max_tokens: int = 3):
    p.add_request(req_id, prompt, 1, {"do_remote_decode": True})
    p.run()
    params = dict(p.traces[req_id].kv_transfer_params)
    c.add_request(req_id, prompt, max_tokens, params)
    c.run()
    return c.traces[req_id]


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_sync_pd_load_into_two_pp_stages_is_judged_before_any_token_and_a_stage_1_flip_never_gets_out(store, corrupt):
    # The consumer: TP 1, PP 2, each stage's worker holding its own layers
    # (stage 0: layers 0 and 1, stage 1: layers 2 and 3), the wrapped
    # StoreConnector loading sync. The scheduler reads the PP size from
    # vLLM's config (records_meet_in_step) and hands the load to vLLM as
    # async; a flip in a stage-1 layer is a MISMATCH before any forward.
    inner = dict(STORE, kv_connector_extra_config={"store_dir": store, "load_mode": "sync"})
    results = {}
    for wrap in (False, True):
        store_connector.CORRUPT.clear()
        p = Engine("producer", role="kv_producer", tp=2, block_size=P_BLOCK, layout=KVCacheLayout.LBNHC, store_dir=store,
                   inner=inner, wrap=wrap)
        c = Engine("consumer", role="kv_consumer", tp=1, pp=2, block_size=C_BLOCK, layout=KVCacheLayout.LBHNC, store_dir=store,
                   inner=inner, wrap=wrap, track_kv=True)
        assert [sorted(s.caches) for s in c.ranks] == [
            ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
            ["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"],
        ]
        if corrupt:
            store_connector.CORRUPT.update(token=20, layer="model.layers.3.self_attn.attn", head=2)
        trace = pd_round_trip(p, c, f"req-pp-{wrap}")
        line(f"sync P/D into PP 2, {'wrapped' if wrap else 'bare'}, {'stage-1 flip' if corrupt else 'intact'}", c,
             f"req-pp-{wrap}", len(PD_PROMPT))
        if corrupt:
            assert store_connector.CORRUPT.get("done") == 1
        results[wrap] = (c, trace)
    (bare, bare_trace), (c, trace) = results[False], results[True]
    assert c.connector().scheduler_role._order.records_meet is False
    assert counts(c).get("sync_loads_as_async") == 1
    assert trace.bad_kv_steps == [] and trace.output_tokens == expected(3, PD_PROMPT)
    if corrupt:
        assert set(bare_trace.bad_kv_steps) & set(bare_trace.token_steps), "the bare connector emits tokens from the flip"
        assert c.connector().last_verdicts["req-pp-True"][0] == kvcsum.MISMATCH
        assert computed(c, "req-pp-True", len(PD_PROMPT))[1] == 16
    else:
        assert c.connector().last_verdicts["req-pp-True"][0] == kvcsum.MATCH
        assert computed(c, "req-pp-True", len(PD_PROMPT)) == computed(bare, "req-pp-False", len(PD_PROMPT)) == (1, len(PD_PROMPT) - 1)


def test_the_scheduler_knows_from_the_config_when_the_records_of_a_sync_load_cannot_meet():
    from types import SimpleNamespace

    from kvcsum.vllm.load_order import records_meet_in_step

    def config(**parallel):
        base = dict(pipeline_parallel_size=1, distributed_executor_backend="mp", prefill_context_parallel_size=1)
        return SimpleNamespace(parallel_config=SimpleNamespace(**{**base, **parallel}))

    assert records_meet_in_step(config()) == (True, "")
    assert records_meet_in_step(config(pipeline_parallel_size=2)) == (False, "pipeline parallelism (2 stages)")
    assert records_meet_in_step(config(distributed_executor_backend="external_launcher"))[0] is False
    assert records_meet_in_step(config(prefill_context_parallel_size=2))[0] is False
    # vLLM's own ParallelConfig, as the connector reads it.
    from vllm.config import ParallelConfig

    assert records_meet_in_step(SimpleNamespace(parallel_config=ParallelConfig(pipeline_parallel_size=2)))[0] is False


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_sync_pd_load_of_several_pp_stages_goes_to_vllm_as_async_and_no_token_from_bad_kv_gets_out(store, corrupt):
    # As with several PP stages: the workers have no record exchange (their
    # records cannot meet in the step) and the scheduler knows it from the
    # config (records_meet_in_step: pipeline parallelism). The sync load
    # goes to vLLM as an async load, judged in the step it is done, before
    # any forward reads it.
    p, c = pd_pair(store, load_mode="sync", track_kv=True, record_exchange=False)
    c.connector().scheduler_role._order.records_meet = False
    c.connector().scheduler_role._order.why_not = "pipeline parallelism (2 stages)"
    if corrupt:
        store_connector.CORRUPT.update(token=20, layer="model.layers.3.self_attn.attn", head=2)
    trace = pd_round_trip(p, c, "req-pp")
    line(f"sync P/D load, records cannot meet (PP), {'corrupted' if corrupt else 'intact'}", c, "req-pp", len(PD_PROMPT))
    assert counts(c).get("sync_loads_as_async") == 1
    assert trace.bad_kv_steps == []
    assert trace.output_tokens == expected(3, PD_PROMPT)
    if corrupt:
        assert store_connector.CORRUPT.get("done") == 1
        assert c.connector().last_verdicts["req-pp"][0] == kvcsum.MISMATCH
        # One KV cache group: vLLM takes the bad block back and computes from it.
        assert computed(c, "req-pp", len(PD_PROMPT))[1] == 16
    else:
        assert c.connector().last_verdicts["req-pp"][0] == kvcsum.MATCH
        # The sync load's tokens (all but the prompt's last) reused.
        assert computed(c, "req-pp", len(PD_PROMPT)) == (1, len(PD_PROMPT) - 1)
    assert c.request_status("req-pp") == "FINISHED_LENGTH_CAPPED"


# --- 7. never silent: a group kvcsum cannot checksum --------------------------------------


@pytest.mark.parametrize("unverified", ["fail", "log"])
def test_a_group_kvcsum_cannot_checksum_is_named_counted_and_fails_the_load_under_unverified_fail(store, monkeypatch, unverified):
    # The sliding-window group stands in for a kind kvcsum cannot checksum
    # (a compressed state without the token placement, say): both sides
    # skip it, the payload leaves it out, and the library's verdict on the
    # other group is MATCH. The load filled it too: UNVERIFIED.
    from kvcsum.vllm import cache_kinds

    describe = cache_kinds.describe_spec

    def stand_in(name, group_id, spec, *args, **kw):
        fields = describe(name, group_id, spec, *args, **kw)
        if type(spec).__name__ == "SlidingWindowSpec":
            fields["unsupported"] = "a stand-in for a kind kvcsum cannot checksum"
        return fields

    monkeypatch.setattr(cache_kinds, "describe_spec", stand_in)
    warnings = []
    from kvcsum.vllm import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module.logger, "warning", lambda text, *a: warnings.append(text % a))
    p, c = pd_pair(store, track_kv=True, sliding_window=64, extra={"unverified": unverified})
    trace = pd_round_trip(p, c, "req-skip")
    line(f"a group kvcsum cannot checksum, unverified={unverified}", c, "req-skip", len(PD_PROMPT))
    name, reason, message = c.connector().last_verdicts["req-skip"]
    assert (name, reason) == (kvcsum.UNVERIFIED, "GROUP_NOT_CHECKSUMMED"), message
    assert "group 1" in message and "stand-in" in message
    assert [w for w in warnings if "KV cache group 1 is not checksummed" in w], warnings
    assert counts(c).get("groups_not_checksummed") == 1
    assert counts(c).get("unverified_reasons.GROUP_NOT_CHECKSUMMED") == 1
    assert trace.bad_kv_steps == [] and trace.output_tokens == expected(3, PD_PROMPT)
    if unverified == "fail":
        # Several groups: vLLM takes the whole load as failed, from token 0.
        assert computed(c, "req-skip", len(PD_PROMPT)) == (len(PD_PROMPT), 0)
    else:
        assert computed(c, "req-skip", len(PD_PROMPT)) == (1, len(PD_PROMPT) - 1)


# --- engine pairs per kind of KV cache (kinds_engine.KindEngine) ---------------------------

import torch  # noqa: E402
from kinds_engine import KindEngine  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)

KIND_PROMPT = [11 + (i * 7) % 500 for i in range(49)]
STORE = {"kv_connector": "StoreConnector", "kv_connector_module_path": "store_connector"}


def kind_pair(store: str, groups, *, p_tp: int, c_tp: int, block_size: int = BLOCK, wrap: bool = True, **kw):
    inner = dict(STORE, kv_connector_extra_config={"store_dir": store, "load_mode": kw.pop("load_mode", "async")})
    p_groups = kw.pop("p_groups", groups)
    common = dict(block_size=block_size, layout=KVCacheLayout.LBNHC, store_dir=store, inner=inner, wrap=wrap)
    p = KindEngine("producer", role="kv_producer", tp=p_tp, groups=p_groups, **dict(common, block_size=kw.pop("p_block_size", block_size)))
    common["groups"] = groups
    c = KindEngine("consumer", role="kv_consumer", tp=c_tp, track_kv=True, **common, **kw)
    return p, c


def kind_pd(store: str, case: str, groups, corrupt: dict | None, *, p_tp: int, c_tp: int, **kw) -> dict:
    """A P/D round trip, bare and wrapped, with the same fault (if any):
    {"bare": consumer, "wrapped": consumer}."""
    out = {}
    for wrap in (False, True):
        store_connector.CORRUPT.clear()
        path = os.path.join(store, "wrapped" if wrap else "bare")
        p, c = kind_pair(path, groups, p_tp=p_tp, c_tp=c_tp, wrap=wrap, **kw)
        if corrupt:
            store_connector.CORRUPT.update(corrupt)
        pd_round_trip(p, c, "req", KIND_PROMPT)
        if corrupt:
            assert store_connector.CORRUPT.get("done"), "the fault was made"
        line(f"{case}, P/D, {'wrapped' if wrap else 'bare'}", c, "req", len(KIND_PROMPT))
        out["wrapped" if wrap else "bare"] = c
    return out


def kind_tier(case: str, groups, fault: dict | None, *, tp: int, load_mode: str = "sync") -> dict:
    """A tier round trip (the test's TierConnector, raw blocks by hash),
    bare and wrapped: {"bare": engine, "wrapped": engine}."""
    out = {}
    for wrap in (False, True):
        for shared in (tier_connector.TIER, tier_connector.INDEX, tier_connector.FAULT):
            shared.clear()
        inner = {
            "kv_connector": "TierConnector",
            "kv_connector_module_path": "tier_connector",
            "kv_connector_extra_config": {"load_mode": load_mode, "capacity": 256},
        }
        e = KindEngine(
            "tiered", groups=groups, role="kv_both", tp=tp, block_size=BLOCK, layout=KVCacheLayout.LBNHC, store_dir="",
            inner=inner, wrap=wrap, track_kv=True,
        )
        if fault:
            tier_connector.FAULT.update(fault)
        tier_round_trip(e)
        if fault:
            assert tier_connector.FAULT.get("done"), "the fault was made"
        line(f"{case}, tier ({load_mode}), {'wrapped' if wrap else 'bare'}", e, "again")
        out["wrapped" if wrap else "bare"] = e
    return out


def intact(pair: dict, req_id: str, prompt) -> None:
    bare, wrapped = pair["bare"], pair["wrapped"]
    assert wrapped.connector().last_verdicts[req_id][0] == kvcsum.MATCH, wrapped.connector().last_verdicts[req_id]
    assert computed(wrapped, req_id, len(prompt)) == computed(bare, req_id, len(prompt))
    assert computed(wrapped, req_id, len(prompt))[1] > 0, "tokens were reused"
    assert wrapped.traces[req_id].bad_kv_steps == bare.traces[req_id].bad_kv_steps == []
    assert wrapped.traces[req_id].output_tokens == bare.traces[req_id].output_tokens


def flipped(pair: dict, req_id: str, prompt, want=kvcsum.MISMATCH) -> None:
    """The bare connector's forward reads the flipped byte and emits tokens
    computed from it; through kvcsum no token computed from it gets out
    (a sync load of one group is read by its own step's forward, whose
    tokens vLLM drops with the load errors; any other load is never read)."""
    bare, wrapped = pair["bare"], pair["wrapped"]
    assert set(bare.traces[req_id].bad_kv_steps) & set(bare.traces[req_id].token_steps), "the bare connector uses the flipped byte"
    assert wrapped.connector().last_verdicts[req_id][0] == want, wrapped.connector().last_verdicts[req_id]
    trace = wrapped.traces[req_id]
    assert not set(trace.bad_kv_steps) & set(trace.token_steps), (trace.bad_kv_steps, trace.token_steps)
    assert len(trace.bad_kv_steps) <= 1
    assert trace.output_tokens == bare.traces[req_id].output_tokens[:0] + expected(3, prompt)
    assert wrapped.request_status(req_id) == "FINISHED_LENGTH_CAPPED"


# --- 2. attention + Mamba state group ---------------------------------------------------

MAMBA_LEN = 2048  # vLLM's mamba_block_size without prefix caching: max_model_len


def mamba_groups(tp: int, speculative: int = 0):
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4 // tp, head_size=16, dtype=torch.float16)
    # conv bf16 then ssm fp32, TP-split, padded to the attention page.
    mamba = MambaSpec(
        block_size=MAMBA_LEN, shapes=((3, 64 // tp), (4 // tp, 8, 4)), dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=full.page_size_bytes, num_speculative_blocks=speculative,
    )
    return [
        ([f"model.layers.{i}.self_attn.attn" for i in (0, 2)], full),
        ([f"model.layers.{i}.mixer" for i in (1, 3)], mamba),
    ]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("fault", [None, "conv", "ssm"])
def test_attention_plus_mamba_pd_round_trip(store, tp, fault):
    # vLLM's scheduler block is the Mamba group's (max_model_len) as vLLM
    # resolves it (resolve_kv_cache_block_sizes: the LCM of the groups').
    conv_bytes = 3 * (64 // tp) * 2
    corrupt = None if fault is None else {"state": 3 if fault == "conv" else conv_bytes + 9, "layer": "model.layers.3.mixer"}
    pair = kind_pd(store, f"attention + Mamba TP {tp}, {fault or 'intact'}", mamba_groups, corrupt, p_tp=tp, c_tp=tp, block_size=MAMBA_LEN)
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
        assert "5 block positions compared" in pair["wrapped"].connector().last_verdicts["req"][2]
    else:
        flipped(pair, "req", KIND_PROMPT)
        # Several groups: the whole load failed, computed from token 0.
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT)) == (len(KIND_PROMPT), 0)
        assert "group 1 position 0" in pair["wrapped"].connector().last_verdicts["req"][2]


def split_mamba_groups(kind: str, mamba_len: int = MAMBA_LEN):
    """Attention + a Mamba2 (or GDN) layer pair whose state vLLM's NIXL
    connector splits across TP (DS conv layout: the ds_conv_layout
    fixture), shapes from vLLM's own MambaStateShapeCalculator."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    def groups(tp: int):
        full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4 // tp, head_size=16, dtype=torch.float16)
        if kind == "MAMBA2":
            # x 32 channels, B and C 2 groups of 4, conv kernel 4; 4 heads of 8 x 4.
            shapes = calc.mamba2_state_shape(tp, 32, 2, num_heads=4, head_dim=8, state_size=4, conv_kernel=4)
        else:
            # Q and K 2 heads of 4, V 4 heads of 8; temporal 4 v heads of 8 x 4.
            shapes = calc.gated_delta_net_state_shape(tp, 2, 4, head_k_dim=4, head_v_dim=8, conv_kernel_size=4)
        mamba = MambaSpec(
            block_size=mamba_len, shapes=tuple(shapes), dtypes=(torch.bfloat16, torch.float32),
            page_size_padded=full.page_size_bytes, mamba_type=getattr(MambaAttentionBackendEnum, kind),
        )
        return [
            ([f"model.layers.{i}.self_attn.attn" for i in (0, 2)], full),
            ([f"model.layers.{i}.mixer" for i in (1, 3)], mamba),
        ]

    return groups


#: (kind, P TP, C TP, the consumer rank with the fault, fault): intact loads
#: both ways, then a flipped byte of the conv state (its last
#: sub-projection, C or V) and of the ssm state on each consumer rank.
SPLIT_CASES = [
    ("MAMBA2", 1, 2, None, None),
    ("MAMBA2", 2, 1, None, None),
    ("GDN_ATTN", 1, 2, None, None),
    ("GDN_ATTN", 2, 1, None, None),
    ("MAMBA2", 1, 2, 0, "conv"),
    ("MAMBA2", 1, 2, 1, "conv"),
    ("MAMBA2", 1, 2, 0, "ssm"),
    ("MAMBA2", 1, 2, 1, "ssm"),
    ("MAMBA2", 2, 1, 0, "conv"),
    ("MAMBA2", 2, 1, 0, "ssm"),
    ("GDN_ATTN", 1, 2, 1, "conv"),
    ("GDN_ATTN", 2, 1, 0, "ssm"),
]


@pytest.mark.parametrize("kind, p_tp, c_tp, rank, fault", SPLIT_CASES)
def test_a_mamba_state_vllm_splits_across_tp_round_trips_between_tp_sizes(store, ds_conv_layout, kind, p_tp, c_tp, rank, fault):
    # vLLM's NIXL connector moves Mamba state between engines of different
    # TP sizes (each sub-projection's slice, then the ssm state's:
    # ssm_conv_transfer_utils.py derive_mamba_conv_split); the test's
    # connector moves it row by global row the same way, and kvcsum
    # numbers the rows alike (cache_kinds.state_split), so the state
    # verifies at another TP size and a flipped byte is a MISMATCH.
    import mamba_states

    groups = split_mamba_groups(kind)
    corrupt = None
    if fault is not None:
        split = mamba_states.nixl_split(groups(c_tp)[1][1], c_tp)
        conv_bytes = sum(rows * row for rows, row in split[:-1])
        byte = conv_bytes - 3 if fault == "conv" else conv_bytes + 9
        corrupt = {"state": byte, "layer": "model.layers.3.mixer", "rank": rank}
    where = "intact" if fault is None else f"{fault} on rank {rank}"
    case = f"attention + {kind} (DS), P TP {p_tp} -> C TP {c_tp}, {where}"
    pair = kind_pd(store, case, groups, corrupt, p_tp=p_tp, c_tp=c_tp, block_size=MAMBA_LEN)
    verdict = pair["wrapped"].connector().last_verdicts["req"]
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
        assert "5 block positions compared" in verdict[2], verdict
    else:
        assert store_connector.CORRUPT.get("done") == 1
        flipped(pair, "req", KIND_PROMPT)
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT)) == (len(KIND_PROMPT), 0)
        assert "group 1 position 0" in verdict[2], verdict


def test_a_mamba_state_vllm_splits_verifies_between_tp_sizes_and_state_block_sizes(store, ds_conv_layout):
    # The producer's Mamba block (max_model_len without prefix caching)
    # twice the consumer's: vLLM's layer identities hold the block size, so
    # the consumer rewrites the producer's fingerprint of the state group
    # (kvcsum.vllm.load_verdict), which it computes with the split's global
    # rows at its own TP size (config.group_fingerprint): the state is
    # compared, not FINGERPRINT_DIFFERS.
    groups = split_mamba_groups("MAMBA2")
    pair = kind_pd(
        store, "attention + MAMBA2 (DS), P TP 1 Mamba block 4096 -> C TP 2 2048, intact", groups, None, p_tp=1, c_tp=2,
        block_size=MAMBA_LEN, p_block_size=2 * MAMBA_LEN, p_groups=split_mamba_groups("MAMBA2", 2 * MAMBA_LEN),
    )
    intact(pair, "req", KIND_PROMPT)
    assert "5 block positions compared" in pair["wrapped"].connector().last_verdicts["req"][2]


def mamba_align_groups(tp: int, speculative: int = 0):
    # vLLM's Mamba prefix caching: mamba_cache_mode "align", the Mamba
    # block the attention block (platforms/interface.py,
    # update_block_size_for_backend), a state per block.
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4 // tp, head_size=16, dtype=torch.float16)
    mamba = MambaSpec(
        block_size=BLOCK, shapes=((3, 64 // tp), (4 // tp, 8, 4)), dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=full.page_size_bytes, mamba_cache_mode="align", num_speculative_blocks=speculative,
    )
    return [
        ([f"model.layers.{i}.self_attn.attn" for i in (0, 2)], full),
        ([f"model.layers.{i}.mixer" for i in (1, 3)], mamba),
    ]


#: 50 tokens: vLLM computes a fully loaded prompt's last token again, its
#: state read from column (49 - 1) // 16, where the loaded state after 50
#: tokens lies, (50 - 1) // 16 (NIXL instead loads one token fewer).
ALIGN_PROMPT = [11 + (i * 7) % 500 for i in range(50)]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("speculative", [0, 2])
@pytest.mark.parametrize("fault", [None, "conv", "ssm"])
def test_a_mamba_state_in_align_mode_is_its_block_at_the_state_column(store, fault, speculative, tp):
    # With mamba_cache_mode "align" the request's block list of the Mamba
    # group is position-indexed; its state after n tokens is the block at
    # column (n - 1) // block_size, which vLLM's kernels read and connectors
    # move, not column 0 (the state after the first block's tokens).
    conv_bytes = 3 * (64 // tp) * 2
    corrupt = None if fault is None else {"state": 5 if fault == "conv" else conv_bytes + 11, "layer": "model.layers.1.mixer"}
    out = {}
    for wrap in (False, True):
        store_connector.CORRUPT.clear()
        path = os.path.join(store, "wrapped" if wrap else "bare")
        p, c = kind_pair(
            path, lambda tp: mamba_align_groups(tp, speculative), p_tp=tp, c_tp=tp, wrap=wrap,
            cache=dict(mamba_cache_mode="align", enable_prefix_caching=True),
        )
        if corrupt:
            store_connector.CORRUPT.update(corrupt)
        pd_round_trip(p, c, "req", ALIGN_PROMPT)
        if corrupt:
            assert store_connector.CORRUPT.get("done"), "the fault was made"
        line(f"attention + Mamba align TP {tp}, {speculative} speculative blocks, {fault or 'intact'}, P/D, {'wrapped' if wrap else 'bare'}", c, "req", len(ALIGN_PROMPT))
        out["wrapped" if wrap else "bare"] = c
    verdict = out["wrapped"].connector().last_verdicts["req"]
    if fault is None:
        intact(out, "req", ALIGN_PROMPT)
        assert verdict[2].endswith("(5 block positions compared)"), verdict  # 4 attention blocks and the state
    else:
        flipped(out, "req", ALIGN_PROMPT)
        assert computed(out["wrapped"], "req", len(ALIGN_PROMPT)) == (len(ALIGN_PROMPT), 0)
        assert "group 1 position 0" in verdict[2], verdict


@pytest.mark.parametrize("fault", [None, "ssm"])
def test_a_mamba_state_with_speculative_blocks_is_its_first_block(store, fault):
    # mamba_cache_mode "none" with speculative blocks (MTP/EAGLE): a
    # request's list is its state, then the scratch blocks, which vLLM's
    # connectors drop (kv_connector/utils.py clip_ssm_state_blocks).
    corrupt = None if fault is None else {"state": 3 * 64 * 2 + 9, "layer": "model.layers.3.mixer"}
    pair = kind_pd(
        store, f"attention + Mamba, 2 speculative blocks, {fault or 'intact'}", lambda tp: mamba_groups(tp, 2), corrupt,
        p_tp=1, c_tp=1, block_size=MAMBA_LEN,
    )
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
        assert "5 block positions compared" in pair["wrapped"].connector().last_verdicts["req"][2]
    else:
        flipped(pair, "req", KIND_PROMPT)
        assert "group 1 position 0" in pair["wrapped"].connector().last_verdicts["req"][2]


def test_a_mamba_model_has_no_block_hashes_so_no_tier_can_offer_its_blocks():
    # vLLM itself: without prefix caching (mamba_cache_mode "none") the
    # hash block is the scheduler block, max_model_len, so a request has no
    # block hash and a tier (keyed by block hash) has nothing to load.
    e = KindEngine(
        "tiered", groups=mamba_groups, role="kv_both", tp=1, block_size=MAMBA_LEN, layout=KVCacheLayout.LBNHC, store_dir="",
        inner={"kv_connector": "TierConnector", "kv_connector_module_path": "tier_connector",
               "kv_connector_extra_config": {"load_mode": "sync"}},
    )
    tier_round_trip(e)
    assert e.requests["again"].block_hashes == [] and computed(e, "again") == (len(PROMPT), 0)


# --- 3. quantized cells --------------------------------------------------------------------


def int8_groups(tp: int):
    # Triton's int8 per-token-head cell: K (32 int8), K scale (fp32), V, V scale.
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=4 // tp, head_size=32, dtype=torch.int8,
        kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD, state_content_bytes=72,
    )
    return [([f"model.layers.{i}.self_attn.attn" for i in range(4)], spec)]


def nvfp4_groups(tp: int):
    # FlashInfer nvfp4: 2*H head slots, K slots then V slots.
    heads = 4 // tp
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=heads, head_size=32, dtype=torch.uint8,
        kv_quant_mode=KVQuantMode.NVFP4, num_head_slots=2 * heads, state_content_bytes=24,
    )
    return [([f"model.layers.{i}.self_attn.attn" for i in range(4)], spec)]


QUANT = {"int8": (int8_groups, 1, 2), "nvfp4": (nvfp4_groups, 2, 2)}


@pytest.mark.parametrize("kind", sorted(QUANT))
@pytest.mark.parametrize("fault", [None, "data", "scale"])
def test_quantized_cells_pd_round_trip(store, kind, fault):
    groups, p_tp, c_tp = QUANT[kind]
    # int8: byte 33 of the 72-byte cell is K's scale; nvfp4: byte 17 of a
    # 24-byte slot is in its fp8 block scales (head slot 1 on rank 1: a V slot).
    byte = {"data": 2, "scale": 33 if kind == "int8" else 17}.get(fault)
    corrupt = None if fault is None else {"token": 20, "layer": "model.layers.2.self_attn.attn", "head": 3, "byte": byte}
    pair = kind_pd(store, f"{kind} (P TP {p_tp}, C TP {c_tp}), {fault or 'intact'}", groups, corrupt, p_tp=p_tp, c_tp=c_tp)
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        # One group: computed again from the bad block (token 16 on).
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT))[1] == 16


@pytest.mark.parametrize("kind", sorted(QUANT))
@pytest.mark.parametrize("fault", [None, "data", "scale"])
def test_quantized_cells_tier_round_trip(kind, fault):
    groups, _, tp = QUANT[kind]
    # The block's first cells: int8 head 0 token 0 (byte 33: K's scale);
    # nvfp4 K slot 0 token 0 (byte 17: its scales).
    byte = {"data": 2, "scale": 33 if kind == "int8" else 17}.get(fault)
    fault_spec = None if fault is None else {"flip": 1, "rank": 1, "layer": "model.layers.3.self_attn.attn", "byte": byte}
    pair = kind_tier(f"{kind} TP {tp}, {fault or 'intact'}", groups, fault_spec, tp=tp)
    if fault is None:
        intact(pair, "again", PROMPT)
    else:
        flipped(pair, "again", PROMPT)
        assert computed(pair["wrapped"], "again")[1] == BLOCK


# --- 4. MLA plus its indexer's k-cache -------------------------------------------------------


def mla_groups(tp: int):
    specs = {}
    for i in range(2):
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER,
        )
    return [(list(specs), UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs=specs))]


# vLLM's indexer cache (DeepSeek V3.2's DeepseekV32IndexerCache): 132-byte
# cells, each block's page its keys (token t's 128 bytes at t*128), then
# their 4-byte scales (at BLOCK*128 + t*4); the stand-in model and the test
# connectors write and move it so (data_scale_pages.py). A stored row is a
# token's key then its scale: byte 129 is a scale byte.
INDEXER_BYTE = {"mla": 3, "indexer key": 3, "indexer scale": 129}


@pytest.mark.parametrize("fault", [None, "mla", "indexer key", "indexer scale"])
def test_mla_with_indexer_pd_round_trip(store, fault):
    layer = "model.layers.1.self_attn." + ("attn" if fault == "mla" else "indexer.k_cache")
    corrupt = None if fault is None else {"token": 30, "layer": layer, "head": 0, "byte": INDEXER_BYTE[fault]}
    pair = kind_pd(store, f"MLA + indexer TP 2, {fault or 'intact'}", mla_groups, corrupt, p_tp=2, c_tp=2)
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT))[1] == 16


@pytest.mark.parametrize("fault", [None, "mla", "indexer key", "indexer scale"])
def test_mla_with_indexer_tier_round_trip(fault):
    layer = "model.layers.0.self_attn." + ("attn" if fault == "mla" else "indexer.k_cache")
    # Byte 40 of the page: token 0's key; BLOCK*128 + 1: token 0's scale.
    byte = BLOCK * 128 + 1 if fault == "indexer scale" else 40
    fault_spec = None if fault is None else {"flip": 2, "layer": layer, "byte": byte}
    pair = kind_tier(f"MLA + indexer TP 2, {fault or 'intact'}", mla_groups, fault_spec, tp=2, load_mode="async")
    if fault is None:
        intact(pair, "again", PROMPT)
    else:
        flipped(pair, "again", PROMPT)
        assert computed(pair["wrapped"], "again")[1] == 2 * BLOCK


# --- 6. DCP: consumer TP 2 with DCP 2, producer DCP 1 -------------------------------------

from kvcsum.vllm.cache_kinds import PLACEMENT  # noqa: E402


def dcp_groups(tp: int):
    # One KV head (DCP needs TP >= dcp x KV heads): every rank holds it.
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float16)
    return [([f"model.layers.{i}.self_attn.attn" for i in range(4)], spec)]


def dcp_pair(store: str, wrap: bool, interleave: int):
    inner = dict(STORE, kv_connector_extra_config={"store_dir": store})
    common = dict(groups=dcp_groups, block_size=BLOCK, layout=KVCacheLayout.LBNHC, store_dir=store, inner=inner, wrap=wrap, kv_heads=1)
    p = KindEngine("producer", role="kv_producer", tp=1, **common)
    c = KindEngine("consumer", role="kv_consumer", tp=2, dcp=2, interleave=interleave, track_kv=True, **common)
    return p, c


@pytest.mark.parametrize("interleave", [1, 2])
@pytest.mark.parametrize("flip_rank", [None, 0, 1])
def test_dcp_consumer_pd_round_trip(store, interleave, flip_rank):
    # Token 21's in-block offset is 21: DCP rank (21 // I) % 2.
    token = next(t for t in range(17, 32) if (t // interleave) % 2 == flip_rank) if flip_rank is not None else None
    pair = {}
    for wrap in (False, True):
        store_connector.CORRUPT.clear()
        if token is not None:
            store_connector.CORRUPT.update(token=token, layer="model.layers.2.self_attn.attn", head=0)
        p, c = dcp_pair(os.path.join(store, str(wrap)), wrap, interleave)
        pd_round_trip(p, c, "req", KIND_PROMPT)
        if token is not None:
            # The consumer's two DCP ranks: only the one holding the token loads it.
            assert store_connector.CORRUPT.get("done") == 1
        line(f"DCP 2 (I {interleave}), P/D, {'wrapped' if wrap else 'bare'}, flip on rank {flip_rank}", c, "req", len(KIND_PROMPT))
        pair["wrapped" if wrap else "bare"] = c
    wrapped = pair["wrapped"]
    verdict, reason, message = wrapped.connector().last_verdicts["req"]
    if not PLACEMENT:
        # Without the library's token placement: named, counted, never
        # silent (the producer sent the group the consumer skipped).
        assert verdict == kvcsum.UNVERIFIED and reason in ("ONE_SIDED_GROUP", "GROUP_NOT_CHECKSUMMED"), message
        assert counts(wrapped).get("groups_not_checksummed") == 1
        assert "DCP shards" in message
        assert wrapped.traces["req"].bad_kv_steps == [] and wrapped.traces["req"].output_tokens == expected(3, KIND_PROMPT)
        return
    if flip_rank is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        assert computed(wrapped, "req", len(KIND_PROMPT))[1] == 0  # the manager block of tokens 0..32


@pytest.mark.parametrize("flip_rank", [None, 1])
def test_dcp_tier_round_trip(flip_rank):
    results = {}
    for wrap in (False, True):
        for shared in (tier_connector.TIER, tier_connector.INDEX, tier_connector.FAULT):
            shared.clear()
        inner = {
            "kv_connector": "TierConnector", "kv_connector_module_path": "tier_connector",
            "kv_connector_extra_config": {"load_mode": "sync", "capacity": 256},
        }
        e = KindEngine("tiered", groups=dcp_groups, role="kv_both", tp=2, dcp=2, kv_heads=1, block_size=BLOCK,
                       layout=KVCacheLayout.LBNHC, store_dir="", inner=inner, wrap=wrap, track_kv=True,
                       extra={"unverified_tier": "fail"} if wrap else None)
        if flip_rank is not None:
            tier_connector.FAULT.update(flip=1, rank=flip_rank, layer="model.layers.1.self_attn.attn", byte=40)
        tier_round_trip(e)
        line(f"DCP 2, tier (sync), {'wrapped' if wrap else 'bare'}, flip on rank {flip_rank}", e, "again")
        results["wrapped" if wrap else "bare"] = e
    wrapped = results["wrapped"]
    verdict, reason, message = wrapped.connector().last_verdicts["again"]
    if not PLACEMENT:
        # Not checksummed: every block unverified, load errors under
        # unverified_tier=fail; never used.
        assert verdict == kvcsum.UNVERIFIED and reason == "NOT_CHECKSUMMED", message
        assert not set(wrapped.traces["again"].bad_kv_steps) & set(wrapped.traces["again"].token_steps)
        assert wrapped.traces["again"].output_tokens == expected(3)
        return
    if flip_rank is None:
        intact(results, "again", PROMPT)
    else:
        flipped(results, "again", PROMPT)


# --- 8. compressed MLA states (DeepSeek V4: 4 tokens per state) -----------------------------


def compressed_groups(tp: int, indexer_head: int | None = None, block: int = BLOCK):
    # DeepSeek V4's compressed attention cache as vLLM 0.33 declares it
    # (models/deepseek_v4/attention.py, bf16 rows: no fp8_ds_mla): one
    # replicated latent head (max_tp_shards 1), one state per 4 tokens,
    # pages aligned to 512 bytes. With `indexer_head`, a C4A layer's
    # indexer k-cache beside it in the group (vLLM's: 132 bytes, 128 fp8
    # keys and a 4-byte scale, the page padded to the alignment).
    specs = {}
    for i in range(2):
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=64, dtype=torch.bfloat16,
            tokens_per_state=4, alignment=512, model_version="deepseek_v4",
        )
        if indexer_head:
            specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
                block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=indexer_head, dtype=torch.uint8,
                tokens_per_state=4, alignment=512,
            )
    return [(list(specs), UniformTypeKVCacheSpecs(block_size=block, kv_cache_specs=specs))]


def test_compressed_states_are_vllms_own_specs():
    # The stand-in's caches, from vLLM's spec classes themselves: 16-token
    # blocks of 4 states; the indexer's 528-byte page padded to 1024.
    (names, group), = compressed_groups(1, indexer_head=132)
    mla, indexer = group.kv_cache_specs[names[0]], group.kv_cache_specs[names[1]]
    assert mla.tokens_per_state == indexer.tokens_per_state == 4 and mla.num_states == 4
    assert mla.page_size_bytes == 4 * 64 * 2 and indexer.real_page_size_bytes == 4 * 132
    assert indexer.page_size_bytes == 1024


@pytest.mark.parametrize("fault", [None, "state"])
def test_compressed_states_pd_round_trip(store, fault):
    # Producer TP 1, consumer TP 2 (the latent replicated on both ranks).
    # Token 30 is in state 7 (tokens 28..31), in block 1 (tokens 16..31).
    corrupt = None if fault is None else {"token": 30, "layer": "model.layers.1.self_attn.attn", "head": 0, "byte": 5}
    pair = kind_pd(store, f"compressed MLA (4 tokens a state) P TP 1, C TP 2, {fault or 'intact'}", compressed_groups, corrupt,
                   p_tp=1, c_tp=2)
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT))[1] == 16


@pytest.mark.parametrize("fault", [None, "state"])
def test_compressed_states_pd_round_trip_between_block_sizes(store, fault):
    # Producer blocks of 32 tokens (8 states), consumer blocks of 16 (4):
    # the states are numbered by their place in the request, so the sides'
    # runs of blocks line up. Token 30: state 7, the consumer's block 1.
    corrupt = None if fault is None else {"token": 30, "layer": "model.layers.0.self_attn.attn", "head": 0, "byte": 9}
    pair = kind_pd(store, f"compressed MLA, P blocks 32 TP 2, C blocks 16 TP 1, {fault or 'intact'}", compressed_groups, corrupt,
                   p_tp=2, c_tp=1, p_block_size=32, p_groups=lambda tp: compressed_groups(tp, block=32))
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT))[1] == 0  # the producer's block of tokens 0..32


@pytest.mark.parametrize("load_mode", ["sync", "async"])
@pytest.mark.parametrize("fault", [None, "state"])
def test_compressed_states_tier_round_trip(fault, load_mode):
    # Byte 40 of block 2's page: its first state (tokens 32..35).
    fault_spec = None if fault is None else {"flip": 2, "layer": "model.layers.0.self_attn.attn", "byte": 40}
    pair = kind_tier(f"compressed MLA TP 2, {fault or 'intact'}", compressed_groups, fault_spec, tp=2, load_mode=load_mode)
    if fault is None:
        intact(pair, "again", PROMPT)
    else:
        flipped(pair, "again", PROMPT)
        assert computed(pair["wrapped"], "again")[1] == 2 * BLOCK


@pytest.mark.parametrize("interleave", [1, 2])
@pytest.mark.parametrize("flip_rank", [None, 0, 1])
def test_compressed_states_on_dcp_ranks_compare_by_their_place_in_the_request(store, interleave, flip_rank):
    # Consumer TP 2 with DCP 2, producer TP 1: a manager block of 2 x 16
    # tokens holds 8 states of 4 tokens, state u at offset u on DCP rank
    # (u // I) % 2 (SPEC section 16, units of k tokens). A flip in a state
    # of block 0 on the rank chosen.
    corrupt = None
    if flip_rank is not None:
        state = next(u for u in range(8) if (u // interleave) % 2 == flip_rank)
        corrupt = {"token": 4 * state + 2, "layer": "model.layers.1.self_attn.attn", "head": 0, "byte": 5}
    pair = kind_pd(store, f"compressed MLA, P TP 1, C TP 2 DCP 2 (I {interleave}), flip on rank {flip_rank}", compressed_groups,
                   corrupt, p_tp=1, c_tp=2, dcp=2, interleave=interleave, kv_heads=1)
    if flip_rank is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT))[1] == 0  # the manager block of tokens 0..32


@pytest.mark.parametrize("fault", [None, "indexer key", "indexer scale"])
def test_a_c4a_group_with_vllms_indexer_keys_is_checksummed_and_a_flip_never_used(store, fault):
    # A DeepSeek V4 C4A group as vLLM 0.33 declares it: the compressed MLA
    # cache and its indexer's 132-byte keys, one per state of 4 tokens
    # (models/deepseek_v4/attention.py:911-924), each block's page the
    # states' keys, then their scales. kvcsum registers the keys and the
    # scales as one cell of two segments (4-byte pieces): an intact P/D load
    # MATCHes with the bare connector's reuse; a flipped key or scale byte
    # (a stored row is a state's key then its scale) is a MISMATCH and never
    # used. Token 30 is in state 7, in block 1.
    from kvcsum.vllm.config import groups_not_checksummed

    groups = lambda tp: compressed_groups(tp, indexer_head=132)  # noqa: E731
    corrupt = None if fault is None else {
        "token": 30, "layer": "model.layers.1.self_attn.indexer.k_cache", "head": 0, "byte": INDEXER_BYTE[fault],
    }
    pair = kind_pd(store, f"C4A with vLLM's indexer keys, {fault or 'intact'}", groups, corrupt, p_tp=1, c_tp=2)
    assert groups_not_checksummed(pair["wrapped"].kv_cache_config, 1) == {}
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT))[1] == 16

# --- 9. DeepSeek V4's fp8_ds_mla compressed states: each block's data, then its scales -------

import random  # noqa: E402

#: The seed of the flipped bytes below (KVCS_SEED changes it); printed.
DS_MLA_SEED = int(os.environ.get("KVCS_SEED", "0x64736D6C"), 0)
DS_MLA_DATA, DS_MLA_SCALES = 576, 8


def ds_mla_groups(tp: int, block: int = BLOCK, indexer: bool = False):
    # DeepSeek V4's compressed MLA cache in fp8_ds_mla records as vLLM 0.33
    # declares it (models/deepseek_v4/attention.py:860-883): uint8, one
    # replicated head, one state per 4 tokens, 584-byte states, pages padded
    # to a multiple of 576 bytes. vLLM writes each block's page as its
    # states' 576 data bytes (state t's at t*576), then their 8 scale bytes
    # (at states*576 + t*8) (models/deepseek_v4/common/ops/cache_utils.py:
    # 64-69, fused_compress_quant_cache.py:263-272); the stand-in model and
    # the test connectors write and move them so (data_scale_pages.py). A
    # stored row is a state's data then its scales: bytes 576.. are scales.
    # With `indexer`, a C4A layer's indexer k-cache beside it, as vLLM
    # declares it with fp8_ds_mla (models/deepseek_v4/attention.py:911-924:
    # 132 bytes, the page aligned to 576).
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    specs = {}
    for i in range(2):
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8, tokens_per_state=4,
            cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4",
            kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"), state_content_bytes=584,
        )
        if indexer:
            specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
                block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
                tokens_per_state=4, alignment=576,
            )
    return [(list(specs), UniformTypeKVCacheSpecs(block_size=block, kv_cache_specs=specs))]


def ds_mla_fault(case: str, fault: str | None, states: int = 0) -> tuple[dict, str]:
    """A seeded fault ({"token", "position", "byte"}) and the case's line
    naming it and the seed: a byte of a stored row (a state's data, then
    its scales) or, with `states`, of a block's page (its states' data,
    then their scales), in the data or in the scales."""
    rng = random.Random(f"{DS_MLA_SEED}:{case}:{fault}")
    data, scales = (states * DS_MLA_DATA, states * DS_MLA_SCALES) if states else (DS_MLA_DATA, DS_MLA_SCALES)
    where = {
        "token": rng.randrange(48),  # of KIND_PROMPT's 48 loaded tokens
        "position": rng.randrange(4),  # of PROMPT's 4 full blocks
        "byte": rng.randrange(data) if fault == "data" else data + rng.randrange(scales),
    }
    if fault is None:
        return where, f"{case}, intact"
    at = f"block {where['position']}" if states else f"token {where['token']}"
    return where, f"{case}, {fault} ({at}, byte {where['byte']}; seed {DS_MLA_SEED:#x}, KVCS_SEED)"


def test_fp8_ds_mla_states_are_vllms_own_specs():
    # vLLM's own spec and view: 16-token blocks of 4 states, 4 x 584 bytes
    # padded to 2880 (5 x 576); the view [B, 1, 4, 584] over each page.
    from vllm.v1.worker.utils import allocate_kv_cache

    from kinds_engine import kinds_config

    (names, group), = ds_mla_groups(1)
    spec = group.kv_cache_specs[names[0]]
    assert (spec.num_states, spec.real_page_size_bytes, spec.page_size_bytes) == (4, 4 * 584, 2880)
    cache = allocate_kv_cache(kinds_config(ds_mla_groups(1), 3), torch.device("cpu"), KVCacheLayout.LBNHC)[names[0]]
    assert tuple(cache.shape) == (3, 1, 4, 584) and cache.stride(0) == 2880 and cache.dtype == torch.uint8


@pytest.mark.parametrize("fault", [None, "data", "scale"])
def test_fp8_ds_mla_states_pd_round_trip(store, fault):
    # Producer TP 1, consumer TP 2 (the replicated latent on both ranks): a
    # flipped data or scale byte of one state's row is a MISMATCH of its
    # block, never used; intact: the bare connector's tokens reused.
    where, case = ds_mla_fault("fp8_ds_mla states P TP 1, C TP 2", fault)
    token = where["token"]
    corrupt = None if fault is None else {"token": token, "layer": "model.layers.1.self_attn.attn", "head": 0, "byte": where["byte"]}
    pair = kind_pd(store, case, ds_mla_groups, corrupt, p_tp=1, c_tp=2)
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        # One group: computed again from the block of the state holding the token.
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT))[1] == token // BLOCK * BLOCK, case


@pytest.mark.parametrize("fault", [None, "data", "scale"])
def test_fp8_ds_mla_states_pd_round_trip_between_block_sizes(store, fault):
    # Producer blocks of 32 tokens (8 states: scales at 8*576), consumer
    # blocks of 16 (4 states: scales at 4*576): the cell is a state's data
    # then its scales whatever the page, numbered by its place in the
    # request, so the sides' runs of blocks line up.
    where, case = ds_mla_fault("fp8_ds_mla states, P blocks 32 TP 2, C blocks 16 TP 1", fault)
    token = where["token"]
    corrupt = None if fault is None else {"token": token, "layer": "model.layers.0.self_attn.attn", "head": 0, "byte": where["byte"]}
    pair = kind_pd(store, case, ds_mla_groups, corrupt, p_tp=2, c_tp=1, p_block_size=32,
                   p_groups=lambda tp: ds_mla_groups(tp, block=32))
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        # Computed again from the producer's block (32 tokens) holding it.
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT))[1] == token // 32 * 32, case


@pytest.mark.parametrize("load_mode", ["sync", "async"])
@pytest.mark.parametrize("fault", [None, "data", "scale"])
def test_fp8_ds_mla_states_tier_round_trip(fault, load_mode):
    # The tier moves whole pages (4 states' data, then their 4 x 8 scale
    # bytes); the flip is a byte of one block's page, on both ranks.
    where, case = ds_mla_fault("fp8_ds_mla states TP 2", fault, states=BLOCK // 4)
    position = where["position"]
    fault_spec = None if fault is None else {"flip": position, "layer": "model.layers.0.self_attn.attn", "byte": where["byte"]}
    pair = kind_tier(case, ds_mla_groups, fault_spec, tp=2, load_mode=load_mode)
    if fault is None:
        intact(pair, "again", PROMPT)
    else:
        flipped(pair, "again", PROMPT)
        assert computed(pair["wrapped"], "again")[1] == position * BLOCK, case


@pytest.mark.parametrize("fault", [None, "state scale", "indexer scale"])
def test_a_c4a_group_in_fp8_ds_mla_records_is_checksummed_and_a_flip_never_used(store, fault):
    # DeepSeek V4's C4A group with fp8_ds_mla: the compressed MLA states
    # (576 + 8 bytes, 8-byte pieces) and the indexer's keys (128 + 4 bytes,
    # 4-byte pieces), each a block's data then its scales, in one group, on
    # host workers. Token 30: state 7, block 1; byte 579 of a state's row
    # is a scale byte (576..583), byte 129 of the indexer's (128..131).
    from kvcsum.vllm.config import groups_not_checksummed

    groups = lambda tp: ds_mla_groups(tp, indexer=True)  # noqa: E731
    layer = "model.layers.1.self_attn." + ("indexer.k_cache" if fault == "indexer scale" else "attn")
    corrupt = None if fault is None else {"token": 30, "layer": layer, "head": 0, "byte": 129 if fault == "indexer scale" else 579}
    pair = kind_pd(store, f"C4A in fp8_ds_mla records, {fault or 'intact'}", groups, corrupt, p_tp=1, c_tp=2)
    assert groups_not_checksummed(pair["wrapped"].kv_cache_config, 1) == {}
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT))[1] == 16


# --- 10. DeepSeek V4's sliding-window cache and V4.1's interleaved records --------------------


def swa_groups(tp: int, block: int = BLOCK):
    # DeepSeek V4's sliding-window cache with fp8_ds_mla as vLLM 0.33
    # declares it (v1/attention/backends/mla/sparse_swa.py:120-147): a
    # SlidingWindowMLASpec, uint8, one replicated head (max_tp_shards 1),
    # 584-byte records a token, pages padded to a multiple of 576 bytes.
    # vLLM writes each block's page as its tokens' 576 data bytes, then
    # their 8 scale bytes (models/deepseek_v4/common/ops/cache_utils.py:
    # 168-230 via xpu/xpu_qnorm_rope_kv_fp8_insert.py:153-162); the
    # stand-in model and the test connectors write and move them so
    # (data_scale_pages.py). A window of 128 tokens holds the prompt whole.
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec, get_kv_quant_mode

    spec = SlidingWindowMLASpec(
        block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8, sliding_window=128,
        cache_dtype_str="fp8_ds_mla", state_content_bytes=584, alignment=576, model_version="deepseek_v4",
        kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
    )
    return [([f"model.layers.{i}.self_attn.swa_cache" for i in range(2)], spec)]


def v41_groups(tp: int, block: int = BLOCK):
    # DeepSeek V4.1's compressed MLA cache on SM100 (models/deepseek_v41/
    # attention.py:1206-1231): 528-byte records (512 fp8 dims, then 16
    # UE8M0 scales), each state's scales right after its own data
    # (models/deepseek_v41/common/ops/cache_utils.py:44-49,
    # fused_compress_quant_cache.py:464-466), 4 tokens a state, pages
    # padded to 512 bytes: a row as the stand-in writes it, bytes 512.. the
    # scales.
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    spec = MLAAttentionSpec(
        block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8, tokens_per_state=4,
        cache_dtype_str="fp8_ds_mla", alignment=512, model_version="deepseek_v4",
        kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"), state_content_bytes=528,
    )
    return [([f"model.layers.{i}.self_attn.attn" for i in range(2)], spec)]


@pytest.mark.parametrize("fault", [None, "data", "scale"])
def test_deepseek_v4_sliding_window_records_pd_round_trip(store, fault):
    # Producer TP 1, consumer TP 2 (the replicated latent on both ranks): a
    # seeded flip of a data or a scale byte of one token's row is a
    # MISMATCH of its block, never used; intact: the bare connector's
    # tokens reused.
    from kvcsum.vllm.config import groups_not_checksummed

    where, case = ds_mla_fault("V4 sliding-window fp8_ds_mla P TP 1, C TP 2", fault)
    token = where["token"]
    layer = "model.layers.1.self_attn.swa_cache"
    corrupt = None if fault is None else {"token": token, "layer": layer, "head": 0, "byte": where["byte"]}
    pair = kind_pd(store, case, swa_groups, corrupt, p_tp=1, c_tp=2)
    assert groups_not_checksummed(pair["wrapped"].kv_cache_config, 1) == {}
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT))[1] == token // BLOCK * BLOCK, case


@pytest.mark.parametrize("fault", [None, "data", "scale"])
def test_deepseek_v41_528_byte_records_pd_round_trip(store, fault):
    # V4.1's interleaved 528-byte states, opaque cells: producer TP 1,
    # consumer TP 2; a seeded flip of a state's data byte (0..511) or of
    # its scale bytes (512..527): MISMATCH, never used.
    rng = random.Random(f"{DS_MLA_SEED}:v41:{fault}")
    token, byte = rng.randrange(48), (rng.randrange(512) if fault == "data" else 512 + rng.randrange(16))
    case = "V4.1 528-byte states P TP 1, C TP 2, " + (
        "intact" if fault is None else f"{fault} (token {token}, byte {byte}; seed {DS_MLA_SEED:#x}, KVCS_SEED)"
    )
    corrupt = None if fault is None else {"token": token, "layer": "model.layers.1.self_attn.attn", "head": 0, "byte": byte}
    pair = kind_pd(store, case, v41_groups, corrupt, p_tp=1, c_tp=2)
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT))[1] == token // BLOCK * BLOCK, case


# --- 11. Whisper's block pooling: p states a token --------------------------------------------

from fractions import Fraction  # noqa: E402


def pooled_groups(tp: int, block: int = BLOCK):
    # Whisper's block pooling as vLLM 0.33 declares it (model_executor/
    # models/whisper_causal.py:411-417): 4 KV heads, 4 states a token,
    # token t's states at slots 4t .. 4t + 4 of its block (:238-241).
    spec = FullAttentionSpec(block_size=block, num_kv_heads=4 // tp, head_size=16, dtype=torch.float16, tokens_per_state=Fraction(1, 4))
    return [([f"model.layers.{i}.self_attn.attn" for i in range(2)], spec)]


@pytest.mark.parametrize("fault", [None, "state 0", "state 3"])
def test_whisper_pooled_states_pd_round_trip_between_tp_and_block_sizes(store, fault):
    # Producer TP 1 with 32-token blocks, consumer TP 2 with 16-token
    # blocks: each state of a token is a cache of its layer, numbered by
    # the token's place in the request. Token 30 (the consumer's block 1):
    # byte 5 of state 0 or 3 of head 3 (rank 1) of layer 1; a stored row
    # is a token's 4 states of 64 bytes.
    state = None if fault is None else int(fault.split()[1])
    corrupt = None if fault is None else {"token": 30, "layer": "model.layers.1.self_attn.attn", "head": 3, "byte": state * 64 + 5}
    pair = kind_pd(store, f"Whisper pooling P TP 1 x 32, C TP 2 x 16, {fault or 'intact'}", pooled_groups, corrupt,
                   p_tp=1, c_tp=2, p_block_size=32, p_groups=lambda tp: pooled_groups(tp, block=32))
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
    else:
        flipped(pair, "req", KIND_PROMPT)
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT))[1] == 0  # the producer's block of tokens 0..32


@pytest.mark.parametrize("fault", [None, "state 2"])
def test_whisper_pooled_states_tier_round_trip(fault):
    # The tier keeps a block as its [H, N, C] view's bytes (2 heads a
    # rank, N = 64 slots, 64-byte cells): byte 7 of head 1, slot 4*3 + 2,
    # token 35's (block 2's token 3) state 2.
    byte = (1 * 64 + 3 * 4 + 2) * 64 + 7
    fault_spec = None if fault is None else {"flip": 2, "layer": "model.layers.0.self_attn.attn", "byte": byte}
    pair = kind_tier(f"Whisper pooling TP 2, {fault or 'intact'}", pooled_groups, fault_spec, tp=2)
    if fault is None:
        intact(pair, "again", PROMPT)
    else:
        flipped(pair, "again", PROMPT)
        assert computed(pair["wrapped"], "again")[1] == 2 * BLOCK


# --- 12. rings (CircularBufferSpec: one block a request, moved whole) ------------------------

from vllm.v1.kv_cache_interface import CircularBufferSpec  # noqa: E402


def ring_groups(tp: int):
    # Attention layers 0 and 1, and in each a compressor ring as DeepSeek
    # V4.1 declares it (models/deepseek_v41/compressor.py:231-237: one
    # head, fp32 rows, head_size_v 0), 8 rows: every TP rank holds it whole.
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4 // tp, head_size=16, dtype=torch.float16)
    ring = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=16, head_size_v=0, dtype=torch.float32)
    return [
        ([f"model.layers.{i}.self_attn.attn" for i in range(2)], full),
        ([f"model.layers.{i}.self_attn.compressor.state_cache" for i in range(2)], ring),
    ]


@pytest.mark.parametrize("fault", [None, "ring row"])
def test_a_ring_pd_round_trip_at_equal_tp(store, fault):
    # P and D at TP 2; the ring's block moved whole (as NIXL moves it, from
    # the rank of the same number). D loads 48 tokens and its first forward
    # reads the rows of positions 45..47: a flipped byte of position 46's
    # row (slot 6: byte 6*64 + 5 of the block) is a MISMATCH of the ring
    # (group 1 position 0) and never used; intact, a MATCH with the bare
    # connector's tokens reused.
    corrupt = None if fault is None else {"state": 6 * 64 + 5, "layer": "model.layers.1.self_attn.compressor.state_cache"}
    pair = kind_pd(store, f"attention + compressor ring TP 2, {fault or 'intact'}", ring_groups, corrupt, p_tp=2, c_tp=2)
    verdict = pair["wrapped"].connector().last_verdicts["req"]
    if fault is None:
        intact(pair, "req", KIND_PROMPT)
        assert verdict[2].endswith("(5 block positions compared)"), verdict  # 4 attention blocks and the ring
    else:
        flipped(pair, "req", KIND_PROMPT)
        # Several groups: the whole load failed, computed from token 0.
        assert computed(pair["wrapped"], "req", len(KIND_PROMPT)) == (len(KIND_PROMPT), 0)
        assert "group 1 position 0" in verdict[2], verdict
