"""KvcsumConnector in vLLM 0.33.0's real scheduler and worker glue, on the CPU.

Two engines in this process: a producer (TP 2, 8-token blocks, vLLM's NHD
layout LBNHC) and a consumer (TP 4, 16-token blocks, HND layout LBHNC), each
wrapping the test's StoreConnector in KvcsumConnector. Each case prints one
line: the consumer's verdict and what vLLM did (tokens recomputed, request
state).
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
from harness import Engine, KVCacheLayout  # noqa: E402

PROMPT = [11 + (i * 7) % 500 for i in range(45)]
OTHER_PROMPT = [900 - (i * 5) % 400 for i in range(45)]
P_BLOCK, C_BLOCK = 8, 16


@pytest.fixture
def store():
    path = tempfile.mkdtemp(prefix="kvcsum-vllm-store-")
    store_connector.CORRUPT.clear()
    yield path
    store_connector.CORRUPT.clear()
    shutil.rmtree(path, ignore_errors=True)


def producer(store, **kw) -> Engine:
    args = dict(role="kv_producer", tp=2, block_size=P_BLOCK, layout=KVCacheLayout.LBNHC, store_dir=store)
    args.update(kw)
    return Engine("producer", **args)


def consumer(store, **kw) -> Engine:
    args = dict(role="kv_consumer", tp=4, block_size=C_BLOCK, layout=KVCacheLayout.LBHNC, store_dir=store)
    args.update(kw)
    return Engine("consumer", **args)


def prefill(engine: Engine, req_id: str, prompt=PROMPT) -> dict:
    """The producer's prefill of a P/D request; its kv_transfer_params."""
    engine.add_request(req_id, prompt, 1, {"do_remote_decode": True})
    engine.run()
    params = engine.traces[req_id].kv_transfer_params
    assert params is not None and params.get("do_remote_prefill"), params
    return dict(params)


def decode(engine: Engine, req_id: str, params: dict, prompt=PROMPT, max_tokens: int = 3):
    engine.add_request(req_id, prompt, max_tokens, params)
    engine.run()
    return engine.traces[req_id]


def verdict(engine: Engine, req_id: str) -> tuple:
    return engine.connector().last_verdicts[req_id]


def recomputed(trace, prompt_len: int) -> tuple[int, int]:
    """(prompt tokens vLLM computed on the consumer, the first of them)."""
    runs = [(start, min(start + n, prompt_len) - start) for start, n in trace.scheduled if start < prompt_len]
    return sum(n for _, n in runs), min((start for start, _ in runs), default=-1)


def totals(engine: Engine) -> dict:
    """The kvcsum counts from the consumer's connector stats, summed."""
    out: dict = {}
    for stats in engine.stats:
        data = stats.get("KvcsumConnector") if isinstance(stats, dict) else None
        if data is None:
            continue
        for key, value in data.items():
            if isinstance(value, dict):
                for k, v in value.items():
                    if isinstance(v, int):  # not the workers' checksum times
                        out[f"{key}.{k}"] = out.get(f"{key}.{k}", 0) + v
            elif isinstance(value, int) and value:
                out[key] = out.get(key, 0) + value
    return out


def show(case: str, engine: Engine, req_id: str, prompt_len: int = len(PROMPT)) -> tuple:
    trace = engine.traces[req_id]
    name, reason, message = verdict(engine, req_id)
    names = {kvcsum.MATCH: "MATCH", kvcsum.MISMATCH: "MISMATCH", kvcsum.UNVERIFIED: "UNVERIFIED"}
    count, first = recomputed(trace, prompt_len)
    state = engine.request_status(req_id)
    label = names[name] + (f" ({reason})" if reason else "")
    runs = [f"{start}..{min(start + n, prompt_len)}" for start, n in trace.scheduled if start < prompt_len]
    computed = f"computed prompt tokens {', then '.join(runs)} ({count} of {prompt_len})" if count else "computed no prompt token"
    print(
        f"\nCASE {case:<44} | {label:<26} | vLLM {computed}, request {state}, "
        f"{len(trace.output_tokens)} tokens out | stats {totals(engine)}",
        flush=True,
    )
    return name, count, first, state


def nothing_left_behind(engine: Engine) -> None:
    """Every worker connector of the engine holds no load after its requests finished."""
    for rank, state in enumerate(engine.ranks):
        left = state.connector.worker_role.leftovers()
        assert not any(left.values()), (engine.name, rank, left)
    # Every exchange of sync load records fit the bound the workers computed.
    exchange = engine.exchange
    if exchange is not None:
        assert all(packed <= bound for packed, bound in exchange.bounds), (engine.name, exchange.bounds)


def expected_tokens(prompt, n):
    from harness import sampled_token

    return [sampled_token(len(prompt) - 1 + i) for i in range(n)]


def kv_equal(producer_engine: Engine, p_req: str, consumer_engine: Engine, c_req: str, num_tokens: int) -> bool:
    """The consumer's KV of the prompt equals the producer's (what the stand-in model computes)."""
    import torch

    for rank, state in enumerate(consumer_engine.ranks):
        heads = 4 // consumer_engine.tp
        table = state.tables.get(c_req)
        if table is None:
            return False
        positions = torch.arange(num_tokens)
        for group_id, group in enumerate(consumer_engine.kv_cache_config.kv_cache_groups):
            ids = torch.tensor(table[group_id])
            for name in group.layer_names:
                layer = int(name.split(".")[2])
                got = state.caches[name][ids[positions // consumer_engine.block_size], :, positions % consumer_engine.block_size]
                want = consumer_engine.kv_values(c_req, positions, layer, rank * heads, heads)
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    return False
    return True


# --- cases -------------------------------------------------------------------------


def test_intact_load_matches_and_continues(store):
    p, c = producer(store), consumer(store)
    params = prefill(p, "req-intact")
    assert "kv_checksums" in params and "kv_checksums_info" in params
    # The payload is the vLLM fork's: [1, num_tokens, [[group, fingerprint,
    # first position, values]]], the fingerprint summing the fork's layer
    # identities (name, spec type, block size, dtype), then, since the
    # workers compute MIXED2 (the default), kvcsum's extension naming it
    # (the algorithm last: docs/SPEC.md section 9).
    import hashlib

    import msgspec

    payload = msgspec.msgpack.decode(kvcsum.base64_decode(params["kv_checksums"]))
    assert len(payload) == 4 and payload[:2] == [1, len(PROMPT)]
    assert payload[3][0] == kvcsum.EXTENSION_VERSION and payload[3][-1] == kvcsum.MIXED2
    [[group, fingerprint, first, values]] = payload[2]
    fork = sum(
        int.from_bytes(hashlib.sha256(repr((f"model.layers.{i}.self_attn.attn", "FullAttentionSpec", P_BLOCK, "torch.float16")).encode()).digest()[:8], "little")
        for i in range(4)
    ) % 2**64
    assert (group, fingerprint, first, len(values)) == (0, fork, 0, 8 * 6)
    trace = decode(c, "req-intact", params)
    name, count, first, state = show("intact load", c, "req-intact")
    assert name == kvcsum.MATCH
    # vLLM took the 45 loaded tokens and computed only the last again, to sample.
    assert (count, first) == (1, len(PROMPT) - 1)
    assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected_tokens(PROMPT, 3)
    assert kv_equal(p, "req-intact", c, "req-intact", len(PROMPT))
    assert totals(c).get("verified") == 1


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_corrupted_block_mismatch(store, policy):
    p, c = producer(store), consumer(store, policy=policy)
    params = prefill(p, "req-bad")
    store_connector.CORRUPT.update(token=20, layer="model.layers.2.self_attn.attn", head=1)
    trace = decode(c, "req-bad", params)
    assert store_connector.CORRUPT.get("done") == 1
    name, count, first, state = show(f"one block corrupted, policy {policy}", c, "req-bad")
    assert name == kvcsum.MISMATCH
    bad_block_first_token = (20 // C_BLOCK) * C_BLOCK
    if policy == "recompute":
        # vLLM rescheduled from exactly the corrupted block's first token.
        assert first == bad_block_first_token == 16
        assert count == len(PROMPT) - bad_block_first_token
        assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected_tokens(PROMPT, 3)
        assert kv_equal(p, "req-bad", c, "req-bad", len(PROMPT))
    else:
        assert state == "FINISHED_ERROR" and count == 0 and trace.output_tokens == []
    assert totals(c).get("mismatched") == 1


@pytest.mark.parametrize("unverified", ["fail", "log"])
def test_payload_missing(store, unverified):
    p, c = producer(store), consumer(store, extra={"unverified": unverified})
    params = prefill(p, "req-nopayload")
    params.pop("kv_checksums")
    trace = decode(c, "req-nopayload", params)
    name, count, first, state = show(f"payload missing, unverified={unverified}", c, "req-nopayload")
    assert name == kvcsum.UNVERIFIED and verdict(c, "req-nopayload")[1] == "NO_CHECKSUMS"
    assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected_tokens(PROMPT, 3)
    if unverified == "fail":
        assert (count, first) == (len(PROMPT), 0)  # the load was a load error: all recomputed
    else:
        assert (count, first) == (1, len(PROMPT) - 1)  # logged, and the load used
    assert totals(c).get("unverified_reasons.NO_CHECKSUMS") == 1


@pytest.mark.parametrize("unverified", ["fail", "log"])
def test_payload_of_another_request(store, unverified):
    p, c = producer(store), consumer(store, extra={"unverified": unverified}, policy="fail")
    params = prefill(p, "req-a")
    other = prefill(p, "req-b", OTHER_PROMPT)
    params["kv_checksums"] = other["kv_checksums"]
    params["kv_checksums_info"] = other["kv_checksums_info"]
    trace = decode(c, "req-a", params)
    name, count, first, state = show(f"payload of another request, unverified={unverified}, policy fail", c, "req-a")
    assert name == kvcsum.UNVERIFIED and verdict(c, "req-a")[1] == "OTHER_REQUEST"
    if unverified == "fail":
        assert state == "FINISHED_ERROR" and trace.output_tokens == []
    else:
        assert state == "FINISHED_LENGTH_CAPPED" and (count, first) == (1, len(PROMPT) - 1)


@pytest.mark.parametrize("same_block_size", [True, False])
def test_payload_alone_as_the_vllm_fork_sends_it(store, same_block_size):
    # A vLLM fork producer sends the payload alone (no kv_checksums_info):
    # equal block sizes verify; different ones cannot (the fork's
    # fingerprints include the block size), so the load is unverified.
    p = producer(store, block_size=C_BLOCK if same_block_size else P_BLOCK)
    c = consumer(store, extra={"unverified": "log"})
    params = prefill(p, "req-fork")
    params.pop("kv_checksums_info")
    decode(c, "req-fork", params)
    label = "equal" if same_block_size else "different"
    name, count, first, state = show(f"payload alone (vLLM fork), {label} block sizes", c, "req-fork")
    if same_block_size:
        assert name == kvcsum.MATCH
    else:
        assert name == kvcsum.UNVERIFIED and verdict(c, "req-fork")[1] == "FINGERPRINT_DIFFERS"


@pytest.mark.parametrize("corrupt,policy", [(False, "recompute"), (True, "recompute"), (True, "fail")])
def test_hybrid_two_groups(store, corrupt, policy):
    p = producer(store, sliding_window=64)
    c = consumer(store, sliding_window=64, policy=policy)
    assert len(c.kv_cache_config.kv_cache_groups) == 2
    params = prefill(p, "req-hybrid")
    if corrupt:
        store_connector.CORRUPT.update(token=40, layer="model.layers.1.self_attn.attn", head=3)
    trace = decode(c, "req-hybrid", params)
    case = f"hybrid (full + sliding window), {'corrupted' if corrupt else 'intact'}, policy {policy}"
    name, count, first, state = show(case, c, "req-hybrid")
    assert name == (kvcsum.MISMATCH if corrupt else kvcsum.MATCH)
    if not corrupt:
        assert (count, first) == (1, len(PROMPT) - 1)
    elif policy == "recompute":
        # Several KV cache groups: vLLM takes only whole-request failures,
        # so the whole prompt is computed again.
        assert (count, first) == (len(PROMPT), 0)
    else:
        assert state == "FINISHED_ERROR" and count == 0 and trace.output_tokens == []
        return
    assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected_tokens(PROMPT, 3)
    assert kv_equal(p, "req-hybrid", c, "req-hybrid", len(PROMPT))
    nothing_left_behind(c)


@pytest.mark.parametrize("corrupt", [False, True])
def test_sync_load_with_several_kv_cache_groups_goes_to_vllm_as_async_and_is_used_only_intact(store, corrupt):
    # vLLM 0.33 cannot fail a sync load of a model with several KV cache
    # groups (failed_recving is read only for requests waiting for an async
    # load; invalid_block_ids raise there). The wrapped connector's sync
    # load goes to vLLM as an async load (kvcsum.vllm.load_order): loaded in
    # the step it is allocated, checked against the payload in that step,
    # used when intact (as many tokens as the sync load would reuse) and
    # failed (recomputed from token 0) when not.
    p = producer(store, sliding_window=64)
    c = consumer(store, sliding_window=64, load_mode="sync", track_kv=True)
    params = prefill(p, "req-hybrid-sync")
    if corrupt:
        store_connector.CORRUPT.update(token=20, layer="model.layers.1.self_attn.attn", head=3)
    trace = decode(c, "req-hybrid-sync", params)
    name, count, first, state = show("hybrid sync load, " + ("corrupted" if corrupt else "intact"), c, "req-hybrid-sync")
    assert all(rank.connector.inner.loads_done == 1 for rank in c.ranks)
    assert totals(c).get("sync_loads_as_async") == 1 and not totals(c).get("sync_loads_declined")
    assert trace.bad_kv_steps == []
    if corrupt:
        assert store_connector.CORRUPT.get("done") == 1
        assert name == kvcsum.MISMATCH and (count, first) == (len(PROMPT), 0)
    else:
        # The sync load leaves the prompt's last token to compute, as alone.
        assert name == kvcsum.MATCH and (count, first) == (1, len(PROMPT) - 1)
    assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected_tokens(PROMPT, 3)
    assert kv_equal(p, "req-hybrid-sync", c, "req-hybrid-sync", len(PROMPT))
    nothing_left_behind(c)


def test_sync_load_with_several_kv_cache_groups_is_declined_where_the_setting_says_so(store):
    p = producer(store, sliding_window=64)
    c = consumer(store, sliding_window=64, load_mode="sync", extra={"unfailable_sync_loads": "decline"})
    params = prefill(p, "req-hybrid-sync")
    trace = decode(c, "req-hybrid-sync", params)
    count, first = recomputed(trace, len(PROMPT))
    assert "req-hybrid-sync" not in c.connector().last_verdicts
    assert all(rank.connector.inner.loads_done == 0 for rank in c.ranks)
    assert (count, first) == (len(PROMPT), 0)
    assert totals(c).get("sync_loads_declined") == 1
    nothing_left_behind(c)


@pytest.mark.parametrize("corrupt,tp", [(False, 4), (True, 4), (True, 1)])
def test_a_bad_sync_load_vllm_cannot_fail_stops_the_step_before_its_tokens(store, corrupt, tp):
    # The scheduler's decline of verified sync loads on a model with several
    # KV cache groups bypassed: the workers must not rely on it. An intact
    # load is used as loaded; a bad one stops the step in the judging worker
    # (kvcsum.vllm.common.UnusableLoadError) before vLLM emits any token
    # computed from it, since vLLM 0.33 cannot fail such a load.
    from kvcsum.vllm.common import UnusableLoadError

    p = producer(store, sliding_window=64)
    c = consumer(store, sliding_window=64, load_mode="sync", tp=tp)
    c.connector().scheduler_role._order.multi_group = False  # the async hand-over bypassed
    params = prefill(p, "req-hybrid-bypass")
    if not corrupt:
        trace = decode(c, "req-hybrid-bypass", params)
        name, count, first, state = show("hybrid sync load, decline bypassed, intact", c, "req-hybrid-bypass")
        assert name == kvcsum.MATCH and (count, first) == (1, len(PROMPT) - 1)
        assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected_tokens(PROMPT, 3)
        return
    store_connector.CORRUPT.update(token=20, layer="model.layers.1.self_attn.attn", head=3 if tp == 4 else 1)
    c.add_request("req-hybrid-bypass", PROMPT, 3, params)
    with pytest.raises(UnusableLoadError, match="req-hybrid-bypass"):
        c.run()
    assert all(rank.connector.inner.loads_done == 1 for rank in c.ranks)
    assert c.traces["req-hybrid-bypass"].output_tokens == []
    print(f"\nCASE {'hybrid sync load, decline bypassed, corrupted, TP ' + str(tp):<44} | step stopped, 0 tokens out", flush=True)


@pytest.mark.parametrize("corrupt", [False, True])
def test_sync_load(store, corrupt):
    # The wrapped connector loads inside the step (as LMCache may): the
    # workers judge the load after that step's forward and hand vLLM its
    # bad blocks in that step's output.
    p, c = producer(store), consumer(store, load_mode="sync")
    params = prefill(p, "req-sync")
    if corrupt:
        store_connector.CORRUPT.update(token=20, layer="model.layers.0.self_attn.attn", head=0)
    trace = decode(c, "req-sync", params)
    name, count, first, state = show(f"sync load, {'corrupted' if corrupt else 'intact'}, policy recompute", c, "req-sync")
    assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected_tokens(PROMPT, 3)
    if corrupt:
        assert name == kvcsum.MISMATCH
        # The step after the load: vLLM rewinds to the bad block's first token.
        starts = [start for start, _ in trace.scheduled]
        assert starts[:2] == [len(PROMPT) - 1, 16], trace.scheduled
        assert kv_equal(p, "req-sync", c, "req-sync", len(PROMPT))
    else:
        # 44 of the 45 tokens loaded: the last consumer block (tokens 32..44)
        # holds 12 tokens, the producer's 13; it is compared against the
        # producer's value of it over 44 tokens, so nothing is computed again.
        assert name == kvcsum.MATCH
        assert trace.scheduled[0] == (len(PROMPT) - 1, 1) and all(start >= len(PROMPT) - 1 for start, _ in trace.scheduled), trace.scheduled
        assert kv_equal(p, "req-sync", c, "req-sync", len(PROMPT))
    nothing_left_behind(c)


def prompt_of(length: int) -> list:
    return [11 + (i * 7) % 500 for i in range(length)]


@pytest.mark.parametrize(
    "tp,prompt_len,glue",
    [
        (4, 49, "in process"),
        (1, 49, "in process"),
        (4, 45, "in process"),
        (4, 49, "pickled metadata"),
        (4, 49, "wait_for_save deferred"),
    ],
)
def test_a_corrupted_sync_load_is_a_load_error_of_its_own_step_and_no_token_of_that_step_is_emitted(store, tp, prompt_len, glue):
    # A sync load's first forward reads the loaded KV and samples a token;
    # vLLM reads the step's load errors before it emits that token. The
    # workers judge the load in that step (their records gathered in one
    # worker), so the corrupted block is a load error of the load's own
    # step and vLLM drops the token. 49 tokens: the consumer loads 48, three
    # full 16-token blocks; 45: its last block is partial, compared against
    # the producer's value of it over one token fewer; every loaded block is
    # compared either way. "pickled metadata": the metadata
    # crosses to the workers and back pickled, as between vLLM's processes;
    # "wait_for_save deferred": vLLM's glue of a speculative decoding step,
    # which calls wait_for_save after it read the load errors.
    import random

    seed = int(os.environ.get("KVCS_SEED", "0x73796E63"), 0) + tp * 1000 + prompt_len
    rng = random.Random(seed)
    token, layer, head = rng.randrange(16, 32), rng.randrange(4), rng.randrange(4)
    print(f"\nseed {seed:#x}: corrupted token {token}, layer {layer}, head {head} (KVCS_SEED changes them)")
    prompt = prompt_of(prompt_len)
    p = producer(store)
    c = consumer(
        store, tp=tp, load_mode="sync", track_kv=True,
        wire=glue == "pickled metadata", defer_finalize=glue == "wait_for_save deferred",
    )
    params = prefill(p, "req-sync-bad", prompt)
    store_connector.CORRUPT.update(token=token, layer=f"model.layers.{layer}.self_attn.attn", head=head)
    trace = decode(c, "req-sync-bad", params, prompt)
    assert store_connector.CORRUPT.get("done") == 1
    name, count, first, state = show(f"sync load, TP {tp}, {prompt_len} tokens, {glue}, corrupted", c, "req-sync-bad", len(prompt))
    load_step = trace.steps[0]
    bad_block = c.ranks[0].tables["req-sync-bad"][0][token // C_BLOCK]
    print(
        f"load at step {load_step}; vLLM got load errors {c.load_errors} (step: blocks), bad block {bad_block}; "
        f"the forward read bad KV at steps {trace.bad_kv_steps}; tokens emitted at steps {trace.token_steps}; "
        f"judged by {c.exchange.judges if c.exchange else 'the one worker'}",
        flush=True,
    )
    assert name == kvcsum.MISMATCH
    # The bad block is a load error of the load's own step, and of no other.
    assert set(c.load_errors) == {load_step} and bad_block in c.load_errors[load_step], c.load_errors
    if c.exchange is not None:
        assert c.exchange.judges == [f"pp0.tp{tp - 1}"]
    # Only the load step's forward read the bad KV, and none of its tokens went out.
    assert trace.bad_kv_steps == [load_step], (trace.bad_kv_steps, trace.scheduled)
    assert load_step not in trace.token_steps, (trace.token_steps, trace.scheduled)
    # The next step computes again from the bad block's first token.
    assert trace.scheduled[:2] == [(prompt_len - 1, 1), (16, prompt_len - 16)], trace.scheduled
    assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected_tokens(prompt, 3)
    assert kv_equal(p, "req-sync-bad", c, "req-sync-bad", prompt_len)
    assert totals(c).get("mismatched") == 1 and totals(c).get("mismatched_blocks") == 1
    assert totals(c).get("uncompared_blocks") is None
    nothing_left_behind(c)


def test_without_a_record_exchange_the_scheduler_judges_a_sync_load_a_step_late(store, monkeypatch):
    # Where the workers cannot meet (several PP stages), they send their
    # records to the scheduler, which judges the load as before: its bad
    # block is a load error of the next step, so the token sampled in the
    # step of the load, from the bad KV, is emitted (the documented limit).
    from kvcsum.vllm import worker_role

    warnings = []
    monkeypatch.setattr(worker_role.logger, "warning", lambda text, *args: warnings.append(text % args))
    prompt = prompt_of(49)
    p = producer(store)
    c = consumer(store, load_mode="sync", track_kv=True, record_exchange=False)
    params = prefill(p, "req-sync-late", prompt)
    store_connector.CORRUPT.update(token=20, layer="model.layers.1.self_attn.attn", head=2)
    trace = decode(c, "req-sync-late", params, prompt)
    name, count, first, state = show("sync load, no record exchange, corrupted", c, "req-sync-late", len(prompt))
    load_step = trace.steps[0]
    print(f"load at step {load_step}; vLLM got load errors {c.load_errors}; tokens emitted at steps {trace.token_steps}", flush=True)
    assert name == kvcsum.MISMATCH
    assert set(c.load_errors) == {load_step + 1}, c.load_errors
    # The load step's token, sampled from the bad KV, went out; the next
    # step's forward read it too, and that token was dropped.
    assert load_step in trace.token_steps and load_step + 1 not in trace.token_steps, trace.token_steps
    assert trace.bad_kv_steps == [load_step, load_step + 1], trace.bad_kv_steps
    assert trace.scheduled[:3] == [(48, 1), (49, 1), (16, 34)], trace.scheduled
    assert kv_equal(p, "req-sync-late", c, "req-sync-late", len(prompt))
    assert [w for w in warnings if "cannot exchange their records" in w] and len(warnings) == 1, warnings
    nothing_left_behind(c)


@pytest.mark.parametrize("unverified", ["fail", "log"])
def test_an_exchange_that_raises_leaves_the_sync_load_unverified_in_its_step(store, unverified):
    # The records cannot meet (the exchange raises on every rank): each
    # worker judges with its own record alone, so the load is UNVERIFIED
    # (WORKERS_MISSING), never a match, in the step of the load; under
    # unverified=fail its blocks are load errors of that step.
    class Broken:
        def gather(self, worker_key, records, bound=None):
            raise RuntimeError("the exchange is down")

    prompt = prompt_of(49)
    p = producer(store)
    c = consumer(store, load_mode="sync", extra={"unverified": unverified})
    for state in c.ranks:
        state.connector.worker_role.use_record_exchange(Broken())
    params = prefill(p, "req-broken", prompt)
    trace = decode(c, "req-broken", params, prompt)
    name, count, first, state = show(f"sync load, the exchange raises, unverified={unverified}", c, "req-broken", len(prompt))
    load_step = trace.steps[0]
    assert name == kvcsum.UNVERIFIED and verdict(c, "req-broken")[1] == "WORKERS_MISSING"
    if unverified == "fail":
        assert set(c.load_errors) == {load_step}, c.load_errors
        assert load_step not in trace.token_steps, trace.token_steps
    else:
        assert not c.load_errors and trace.output_tokens == expected_tokens(prompt, 3)
    assert state == "FINISHED_LENGTH_CAPPED"
    nothing_left_behind(c)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_sync_load_compares_its_partial_last_block_against_the_producers_value_over_one_token_fewer(store, policy):
    # The sync load leaves the prompt's last token to vLLM: the consumer
    # loads 44 tokens, whose last 16-token block holds 12 of them and the
    # producer's 13. The producer also sent that block's value over 44
    # tokens (the extension's short last value, SPEC section 9), so the
    # block is compared like the others (SPEC section 10): intact, it is
    # used as loaded (no step is added, see the steps test below);
    # corrupted, the load is a MISMATCH naming it.
    import random

    rng = random.Random(int(os.environ.get("KVCS_SEED", "0x636B73"), 0) + len(policy))
    token = rng.randrange(32, len(PROMPT) - 1)
    layer, head = rng.randrange(4), rng.randrange(4)
    print(f"\ncorrupted token {token}, layer {layer}, head {head} (KVCS_SEED changes them)")
    # Intact: compared whole, nothing recomputed.
    p, c = producer(store), consumer(store, load_mode="sync", policy=policy, track_kv=True)
    params = prefill(p, "req-partial")
    trace = decode(c, "req-partial", params)
    name, count, first, state = show(f"sync load, intact partial last block, {policy}", c, "req-partial")
    assert name == kvcsum.MATCH and "not compared" not in verdict(c, "req-partial")[2]
    assert trace.scheduled[0] == (len(PROMPT) - 1, 1) and (32, len(PROMPT) - 32) not in trace.scheduled, trace.scheduled
    assert not totals(c).get("uncompared_blocks")
    assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected_tokens(PROMPT, 3)
    nothing_left_behind(c)
    # Corrupted in that block: a mismatch of it.
    p, c = producer(store), consumer(store, load_mode="sync", policy=policy, track_kv=True)
    params = prefill(p, "req-partial-bad")
    store_connector.CORRUPT.update(token=token, layer=f"model.layers.{layer}.self_attn.attn", head=head)
    trace = decode(c, "req-partial-bad", params)
    assert store_connector.CORRUPT.get("done") == 1
    name, count, first, state = show(f"sync load, token {token} of its partial last block corrupted, {policy}", c, "req-partial-bad")
    assert name == kvcsum.MISMATCH and "position 2 (tokens 32..44" in verdict(c, "req-partial-bad")[2]
    assert totals(c).get("mismatched_blocks") == 1 and not totals(c).get("uncompared_blocks")
    load_step = trace.steps[0]
    # The forward of the load step read the bad KV (the tracking sees it) ...
    assert trace.bad_kv_steps == [load_step], (trace.bad_kv_steps, trace.scheduled)
    # ... and the workers judged the load in that step, so no token it
    # computed was emitted: the block went back to vLLM as a load error.
    assert load_step not in trace.token_steps, (trace.token_steps, trace.scheduled)
    if policy == "recompute":
        # vLLM computes again from the bad block's first token.
        assert trace.scheduled[:2] == [(len(PROMPT) - 1, 1), (32, len(PROMPT) - 32)], trace.scheduled
        assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected_tokens(PROMPT, 3)
        assert kv_equal(p, "req-partial-bad", c, "req-partial-bad", len(PROMPT))
    else:
        # kv_load_failure_policy=fail: vLLM fails the request, no token out.
        assert state == "FINISHED_ERROR" and trace.output_tokens == []
    nothing_left_behind(c)


def test_preempted_request(store):
    # A small producer (7 blocks of 8 tokens, 8 tokens a step): a decoding
    # request takes the block the P/D request needs mid-prefill, so vLLM
    # preempts it (after 39 of its 45 tokens) and computes it again later.
    p = producer(store, num_blocks=8, max_batched_tokens=8)
    p.add_request("req-long", [300 + i for i in range(4)], 12)
    p.add_request("req-pre", PROMPT, 1, {"do_remote_decode": True})
    p.run()
    request_preempted = any(start == 0 for start, _ in p.traces["req-pre"].scheduled[1:])
    assert request_preempted, p.traces["req-pre"].scheduled
    params = dict(p.traces["req-pre"].kv_transfer_params)
    assert "kv_checksums" in params
    c = consumer(store)
    trace = decode(c, "req-pre", params)
    name, count, first, state = show("preempted on the producer, then computed again", c, "req-pre")
    assert name == kvcsum.MATCH and (count, first) == (1, len(PROMPT) - 1)
    assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected_tokens(PROMPT, 3)


def test_records_after_the_request_left(store):
    # Every producer case above takes its records after request_finished (in
    # the same scheduler update, which still fills the params). Here one
    # worker's record comes a step later, after the request's output left:
    # the request goes without checksums, and the late record is dropped.
    p = producer(store)
    rank1 = p.ranks[1].connector
    original = rank1.build_connector_worker_meta
    held = []

    def one_step_late():
        meta = original()
        if meta is not None and meta.notes and not held:
            held.append(meta)
            return None
        return held.pop() if held and held[0] is not meta else meta

    rank1.build_connector_worker_meta = one_step_late
    p.add_request("req-late", PROMPT, 1, {"do_remote_decode": True})
    p.run()
    p.step()  # the late record arrives
    params = dict(p.traces["req-late"].kv_transfer_params)
    assert "kv_checksums" not in params and totals(p).get("payloads_missing") == 1
    c = consumer(store, extra={"unverified": "log"})
    decode(c, "req-late", params)
    name, count, first, state = show("a worker's record one step late (producer)", c, "req-late")
    assert name == kvcsum.UNVERIFIED and verdict(c, "req-late")[1] == "NO_CHECKSUMS"


def test_aborted_request_gets_no_payload(store):
    p = producer(store)
    p.add_request("req-abort", PROMPT, 1, {"do_remote_decode": True})
    p.scheduler.finish_requests({"req-abort"}, __import__("vllm.v1.request", fromlist=["RequestStatus"]).RequestStatus.FINISHED_ABORTED)
    p.run()
    print(f"\nCASE {'aborted before its prefill (producer)':<44} | no payload                 | vLLM request {p.request_status('req-abort')}", flush=True)
    assert p.connector().scheduler_role.pending_sends == {}


# --- engine steps: the wrapper adds none to an intact load ----------------------------


@pytest.mark.parametrize("load_mode,prompt_len", [("async", 45), ("sync", 45), ("sync", 49)])
def test_an_intact_load_is_first_scheduled_at_the_same_step_as_through_the_wrapped_connector_alone(store, load_mode, prompt_len):
    prompt = prompt_of(prompt_len)
    steps = {}
    for wrap in (False, True):
        path = os.path.join(store, "wrapped" if wrap else "bare")
        p = producer(path, wrap=wrap)
        p.add_request("req-steps", prompt, 1, {"do_remote_decode": True})
        p.run()
        params = dict(p.traces["req-steps"].kv_transfer_params)
        assert ("kv_checksums" in params) == wrap
        c = consumer(path, wrap=wrap, load_mode=load_mode)
        trace = decode(c, "req-steps", params, prompt)
        assert trace.output_tokens == expected_tokens(prompt, 3)
        steps[wrap] = {
            "producer params out": p.traces["req-steps"].params_step - p.traces["req-steps"].added_at,
            "consumer first scheduled": trace.first_scheduled(),
            "consumer first token": trace.token_steps[0] - trace.added_at,
            "prompt tokens computed": recomputed(trace, prompt_len)[0],
        }
        if wrap:
            assert verdict(c, "req-steps")[0] == kvcsum.MATCH
    print(f"\nSTEPS {load_mode} load of {prompt_len} tokens: bare wrapped connector {steps[False]}; through KvcsumConnector {steps[True]}", flush=True)
    # Async, a sync load of whole blocks (48 of 49 tokens), or a sync load
    # whose last block holds 12 of its 16 tokens (13 on the producer), that
    # block compared against the producer's value of it over one token
    # fewer: every loaded block compared, judged in its own step, nothing
    # computed again, no step added.
    assert steps[True] == steps[False]


@pytest.mark.parametrize(
    "extra,named",
    [
        ({"unverified": "warn"}, "unverified"),
        ({"verify_loads": True}, "verify_loads"),
        ({"verify_tiers": "no"}, "verify_tiers"),
        ({"verify_tiers": 1}, "verify_tiers"),
        ({"unverified_tier": "ignore"}, "unverified_tier"),
        ({"tier_values": 0}, "tier_values"),
        ({"tier_values": "1000"}, "tier_values"),
        ({"log_matches": "yes"}, "log_matches"),
    ],
)
def test_a_setting_of_another_value_is_refused_at_startup(extra, named):
    from kvcsum.vllm.config import Settings

    with pytest.raises(ValueError, match=named):
        Settings.of({"inner": {"kv_connector": "x"}, **extra})
    defaults = Settings.of({})
    assert (defaults.fail_unverified, defaults.verify_tiers, defaults.fail_unverified_tier) == (True, True, False)
    assert Settings.of({"verify_tiers": "false", "unverified_tier": "FAIL"}).verify_tiers is False
