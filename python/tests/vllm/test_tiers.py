"""Loads from an offload tier, checked by KvcsumConnector's workers against
the values they kept of the blocks they computed (by block hash), in vLLM
0.33.0's real Scheduler and worker glue, on the CPU.

Two tiers. The test's TierConnector (tier_connector.py): blocks offloaded
by hash to host memory after the forward that fills them, loaded back by
prefix, async (the request waits while its KV arrives) or sync (loaded
inside the step that computes the rest), evicted, shared between engines,
with faults injected. And vLLM's own OffloadingConnector with its CPU
offloading spec (its scheduler, manager and worker logic, async loads),
whose CUDA copies alone are replaced by host copies (offloading_spec.py,
loaded through spec_module_path): vLLM's own CPU tier copies with CUDA,
which this machine has not.

Each case prints one line: the verdict and what vLLM did (the prompt tokens
computed, the engine step of the first token).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
import offloading_spec  # noqa: E402
import tier_connector  # noqa: E402
from harness import Engine, KVCacheLayout, sampled_token  # noqa: E402

BLOCK = 16
PROMPT = [7 + (i * 13) % 600 for i in range(70)]  # 4 full blocks (64 tokens) and 6 more
LOADED = 64  # the tier loads the 4 full blocks; the prompt's last block is computed


@pytest.fixture(autouse=True)
def tier():
    for shared in (tier_connector.TIER, tier_connector.INDEX, tier_connector.FAULT, offloading_spec.FAULT):
        shared.clear()
    yield
    for shared in (tier_connector.TIER, tier_connector.INDEX, tier_connector.FAULT, offloading_spec.FAULT):
        shared.clear()


def engine(load_mode: str, *, tp: int = 1, wrap: bool = True, extra: dict | None = None, name: str = "tiered") -> Engine:
    inner = {
        "kv_connector": "TierConnector",
        "kv_connector_module_path": "tier_connector",
        "kv_connector_extra_config": {"load_mode": load_mode, "capacity": 256},
    }
    return Engine(
        name, role="kv_both", tp=tp, block_size=BLOCK, layout=KVCacheLayout.LBNHC, store_dir="",
        inner=inner, extra=extra, wrap=wrap,
    )


def run(e: Engine, req_id: str, params: dict | None = None, max_tokens: int = 3):
    e.add_request(req_id, PROMPT, max_tokens, params)
    e.run()
    return e.traces[req_id]


def expected(n: int) -> list:
    return [sampled_token(len(PROMPT) - 1 + i) for i in range(n)]


def inner(e: Engine, rank: int = 0):
    return e.ranks[rank].connector.inner if e.ranks[rank].connector.__class__.__name__ == "KvcsumConnector" else e.ranks[rank].connector


def counts(e: Engine) -> dict:
    out: dict = {}
    for stats in e.stats:
        data = stats.get("KvcsumConnector") if isinstance(stats, dict) else None
        for key, value in (data or {}).items():
            if key.startswith("tier") and isinstance(value, dict):
                for k, v in value.items():
                    out[f"{key}.{k}"] = out.get(f"{key}.{k}", 0) + v
            elif key.startswith("tier") and value:
                out[key] = out.get(key, 0) + value
    return out


def show(case: str, e: Engine, req_id: str) -> tuple:
    trace = e.traces[req_id]
    name, reason, message = e.connector().last_verdicts[req_id]
    label = {kvcsum.MATCH: "MATCH", kvcsum.MISMATCH: "MISMATCH", kvcsum.UNVERIFIED: "UNVERIFIED"}[name]
    label += f" ({reason})" if reason else ""
    runs = [f"{s}..{s + n}" for s, n in trace.scheduled if s < len(PROMPT)]
    first_token = trace.token_steps[0] - trace.added_at if trace.token_steps else None
    print(
        f"\nCASE {case:<52} | {label:<26} | vLLM computed prompt tokens {', then '.join(runs)}; "
        f"first token at step {first_token}; {len(trace.output_tokens)} tokens | stats {counts(e)}",
        flush=True,
    )
    return name, reason, trace


def kv_intact(e: Engine, req_id: str) -> bool:
    """Every rank's KV of the request's prompt is what the stand-in model computes."""
    import torch

    positions = torch.arange(len(PROMPT))
    heads = 4 // e.tp
    for rank, state in enumerate(e.ranks):
        ids = torch.tensor(state.tables[req_id][0])
        for name in e.kv_cache_config.kv_cache_groups[0].layer_names:
            layer = int(name.split(".")[2])
            got = state.caches[name][ids[positions // BLOCK], :, positions % BLOCK]
            want = e.kv_values(req_id, positions, layer, rank * heads, heads)
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                return False
    return True


MODES = ["async", "sync"]


@pytest.mark.parametrize("load_mode", MODES)
def test_an_intact_tier_round_trip_matches_and_the_load_is_used(load_mode):
    e = engine(load_mode)
    run(e, "req-compute")
    assert inner(e).blocks_saved == 4
    trace = run(e, "req-load")
    name, reason, _ = show(f"tier round trip, intact, {load_mode}", e, "req-load")
    assert name == kvcsum.MATCH
    assert inner(e).loads_done == 1 and inner(e).blocks_loaded == 4
    assert [s for s, _ in trace.scheduled][0] == LOADED  # only the prompt's last block computed
    assert trace.output_tokens == expected(3) and kv_intact(e, "req-load")
    assert counts(e).get("tier_verified") == 1 and counts(e).get("tier_blocks_checked") == 4


@pytest.mark.parametrize("load_mode", MODES)
@pytest.mark.parametrize("fault", ["flip", "stale"])
def test_a_damaged_tier_block_is_recomputed_from_that_block(load_mode, fault):
    e = engine(load_mode)
    run(e, "req-compute")
    tier_connector.FAULT[fault] = 1  # the block of tokens 16..32
    trace = run(e, "req-bad")
    assert tier_connector.FAULT.get("done") == 1
    case = "a bit flipped in the tier" if fault == "flip" else "a stale tier slot (another hash's bytes)"
    name, reason, _ = show(f"{case}, {load_mode}", e, "req-bad")
    assert name == kvcsum.MISMATCH
    starts = [s for s, _ in trace.scheduled]
    if load_mode == "async":
        # Judged in the step the load arrived: vLLM computes from the bad block.
        assert starts[0] == BLOCK, trace.scheduled
    else:
        # Computed from the loaded KV in the load's own step, then rewound to
        # the bad block in that step's output: the token of that first step
        # never left (the first token comes from the recomputation).
        assert starts[:2] == [LOADED, BLOCK], trace.scheduled
        assert trace.token_steps[0] == trace.steps[1], (trace.token_steps, trace.steps)
    assert trace.output_tokens == expected(3) and kv_intact(e, "req-bad")
    assert counts(e).get("tier_mismatched") == 1 and counts(e).get("tier_mismatched_blocks") == 1


@pytest.mark.parametrize("load_mode", MODES)
def test_a_block_computed_again_with_other_bits_is_never_a_mismatch(load_mode):
    # The tier keeps the first copy of each hash; the engine computes the
    # same prompt again (the tier skipped) with KV that differs in its last
    # bits, as a kernel that is not batch-invariant does. Loading the first
    # copy then must match: both values are kept.
    e = engine(load_mode)
    run(e, "req-first")
    first_copy = dict(tier_connector.TIER)
    e.kv_noise = 1
    run(e, "req-again", {"skip_tier": True})
    assert tier_connector.TIER.keys() == first_copy.keys()  # the tier still holds the first copy
    values = e.ranks[0].connector.worker_role.stored_values
    block_hash = e.requests["req-first"].block_hashes[1]
    kept = values.values(0, bytes(block_hash))
    assert kept is not None and len(kept) == 2, kept  # the two computations differ, both kept
    trace = run(e, "req-load")
    name, reason, _ = show(f"computed again with other bits, first copy loaded, {load_mode}", e, "req-load")
    assert name == kvcsum.MATCH
    assert [s for s, _ in trace.scheduled][0] == LOADED
    # Evicted and stored again (now the second computation's bytes): matches too.
    for position in range(4):
        e.connector().inner.evict(e.requests["req-first"].block_hashes[position])
    e.kv_noise = 2
    run(e, "req-third")
    trace = run(e, "req-load-again")
    name, reason, _ = show(f"evicted, computed again, stored again, loaded, {load_mode}", e, "req-load-again")
    assert name == kvcsum.MATCH and [s for s, _ in trace.scheduled][0] == LOADED


@pytest.mark.parametrize("load_mode", MODES)
@pytest.mark.parametrize("setting", ["log", "fail"])
def test_a_block_another_engine_stored_is_unverified_and_counted(load_mode, setting):
    other = engine(load_mode, name="other")
    run(other, "req-elsewhere")
    e = engine(load_mode, extra={"unverified_tier": setting})
    trace = run(e, "req-load")
    name, reason, _ = show(f"stored by another engine, unverified_tier={setting}, {load_mode}", e, "req-load")
    assert name == kvcsum.UNVERIFIED and reason == "UNKNOWN_BLOCK"
    assert counts(e).get("tier_unverified") == 1 and counts(e).get("tier_unverified_reasons.UNKNOWN_BLOCK") == 1
    starts = [s for s, _ in trace.scheduled]
    if setting == "log":
        assert starts[0] == LOADED  # used
    elif load_mode == "async":
        assert starts[0] == 0  # every block of unknown value is computed
    else:
        assert starts[:2] == [LOADED, 0]
        assert trace.token_steps[0] == trace.steps[1]
    assert trace.output_tokens == expected(3) and kv_intact(e, "req-load")


@pytest.mark.parametrize("load_mode", MODES)
def test_a_flip_on_one_tp_rank_is_a_load_error(load_mode):
    e = engine(load_mode, tp=2)
    run(e, "req-compute")
    tier_connector.FAULT.update(flip=2, rank=1)  # tokens 32..48, rank 1's heads only
    trace = run(e, "req-bad")
    assert tier_connector.FAULT.get("done") == 1
    name, reason, message = show(f"TP 2, a bit flipped on rank 1, {load_mode}", e, "req-bad")
    assert name == kvcsum.MISMATCH
    starts = [s for s, _ in trace.scheduled]
    assert (starts[0] if load_mode == "async" else starts[1]) == 2 * BLOCK, trace.scheduled
    assert trace.output_tokens == expected(3) and kv_intact(e, "req-bad")


@pytest.mark.parametrize("load_mode", MODES)
def test_an_intact_tier_load_is_first_scheduled_at_the_same_step_as_through_the_wrapped_connector_alone(load_mode):
    steps = {}
    for wrap in (False, True):
        tier_connector.TIER.clear()
        tier_connector.INDEX.clear()
        e = engine(load_mode, wrap=wrap)
        run(e, "req-compute")
        trace = run(e, "req-load")
        assert [s for s, _ in trace.scheduled][0] == LOADED and trace.output_tokens == expected(3)
        steps[wrap] = {"first scheduled": trace.first_scheduled(), "first token": trace.token_steps[0] - trace.added_at}
        if wrap:
            assert e.connector().last_verdicts["req-load"][0] == kvcsum.MATCH
    print(f"\nSTEPS tier {load_mode} load: bare wrapped connector {steps[False]}; through KvcsumConnector {steps[True]}", flush=True)
    assert steps[True] == steps[False]


@pytest.mark.parametrize("load_mode", MODES)
def test_a_tier_load_failed_from_its_first_block_is_computed_not_loaded_again(load_mode):
    # vLLM rewinds a failed load to its first bad block; from block 0 the
    # request looks the tier up again, which would load the same bad block
    # every step. The connector declines the reload: the prompt is computed.
    e = engine(load_mode)
    run(e, "req-compute")
    tier_connector.FAULT["flip"] = 0
    trace = run(e, "req-bad")
    name, reason, _ = show(f"a bit flipped in the first block, {load_mode}", e, "req-bad")
    assert name == kvcsum.MISMATCH and tier_connector.FAULT.get("done") == 1
    assert inner(e).loads_done == 1  # loaded once, never again
    starts = [s for s, _ in trace.scheduled]
    assert starts == ([0, 70, 71] if load_mode == "async" else [LOADED, 0, 70, 71]), trace.scheduled
    assert trace.output_tokens == expected(3) and kv_intact(e, "req-bad")
    # (A sync load's request keeps running: vLLM computes it without a lookup.)
    assert counts(e).get("tier_reloads_declined") == (1 if load_mode == "async" else None)


# --- vLLM's own OffloadingConnector (CPU spec, host copies) -------------------------------


def offloading_engine(*, wrap: bool = True, tp: int = 1) -> Engine:
    inner = {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {
            "spec_name": "HostCopySpec",
            "spec_module_path": "offloading_spec",
            "cpu_bytes_to_use": 1 << 26,
        },
    }
    return Engine(
        "offloading", role="kv_both", tp=tp, block_size=BLOCK, layout=KVCacheLayout.LBNHC, store_dir="",
        inner=inner, wrap=wrap,
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_offloading_connector_round_trip_matches_at_the_same_step_as_alone(tp):
    steps = {}
    for wrap in (False, True):
        e = offloading_engine(wrap=wrap, tp=tp)
        run(e, "req-compute")
        trace = run(e, "req-load")
        assert [s for s, _ in trace.scheduled][0] == LOADED, trace.scheduled  # loaded from the CPU tier
        assert trace.output_tokens == expected(3) and kv_intact(e, "req-load")
        steps[wrap] = {"first scheduled": trace.first_scheduled(), "first token": trace.token_steps[0] - trace.added_at}
        if wrap:
            name, reason, _ = show(f"vLLM OffloadingConnector (CPU spec), intact, TP {tp}", e, "req-load")
            assert name == kvcsum.MATCH and counts(e).get("tier_blocks_checked") == 4
    print(f"\nSTEPS vLLM OffloadingConnector TP {tp}: alone {steps[False]}; through KvcsumConnector {steps[True]}", flush=True)
    assert steps[True] == steps[False]


def test_vllm_offloading_connector_with_a_flipped_bit_in_the_cpu_tier_recomputes_from_that_block():
    e = offloading_engine()
    run(e, "req-compute")
    offloading_spec.FAULT["flip"] = 1  # the CPU chunk of the block of tokens 16..32
    trace = run(e, "req-bad")
    assert offloading_spec.FAULT.get("done") == 1
    name, reason, _ = show("vLLM OffloadingConnector (CPU spec), a bit flipped in the CPU tier", e, "req-bad")
    assert name == kvcsum.MISMATCH
    assert [s for s, _ in trace.scheduled][0] == BLOCK, trace.scheduled
    assert trace.output_tokens == expected(3) and kv_intact(e, "req-bad")
