"""Every kind of KV cache vLLM 0.33 allocates, through KvcsumConnector in
vLLM's real Scheduler and worker glue, on the CPU (issue 36): per kind an
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
