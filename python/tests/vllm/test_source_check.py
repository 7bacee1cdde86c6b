"""The producer's re-check of a sent request's blocks ("source changed
during send"), in vLLM 0.33.0's real scheduler and worker glue on the CPU.

The wrapped StoreConnector holds a sent request's blocks until the send is
over (store_connector.SEND["held"]), as a pull-based connector does: vLLM
keeps the blocks after request_finished, the workers read them in the next
step and report the request finished sending, and vLLM frees them when its
scheduler reads that report. The test writes into the producer's cache
blocks between the payload and the end of the send (the page-reuse and
race class), at fresh random places each run (the seed is printed), and
checks that the producer counts and names exactly the blocks it wrote, and
that an unchanged source is not counted. The consumer then tells the two
apart: a MISMATCH with the producer's source changed is damage on the
sender; one with it unchanged is damage on the wire or the receiver.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
import store_connector  # noqa: E402
from harness import TOTAL_KV_HEADS  # noqa: E402
from test_connector import P_BLOCK, consumer, decode, expected_tokens, kv_equal, producer, totals, verdict  # noqa: E402
from test_metrics import SEED, Prometheus, random_prompt  # noqa: E402

P_TP = 2


@pytest.fixture
def store():
    path = tempfile.mkdtemp(prefix="kvcsum-vllm-source-")
    store_connector.CORRUPT.clear()
    store_connector.SEND.clear()
    store_connector.SEND["held"] = True
    yield path
    store_connector.CORRUPT.clear()
    store_connector.SEND.clear()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def rng(request):
    seed = f"{SEED}-{request.node.name}"
    print(f"\nseed {seed} (KVCSUM_TEST_SEED={SEED})", flush=True)
    return random.Random(seed)


class Lines(logging.Handler):
    """The connector's log lines (vLLM's logger "vllm.kvcsum")."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("vllm.kvcsum").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("vllm.kvcsum").removeHandler(self)


def watch_rechecks(p) -> list:
    """Records, at each worker's re-check, whether vLLM still holds the
    request and the blocks the worker checksums (not freed yet)."""
    seen = []
    for rank, state in enumerate(p.ranks):
        check = state.connector.worker_role.source_check
        original = check.sending_finished

        def sending_finished(req_ids, original=original, rank=rank, state=state):
            for req_id in req_ids:
                held = req_id in p.scheduler.requests
                blocks = list(p.scheduler.kv_cache_manager.get_block_ids(req_id)[0]) if held else []
                seen.append((rank, req_id, held, blocks == state.tables[req_id][0][: len(blocks)] and bool(blocks)))
            return original(req_ids)

        check.sending_finished = sending_finished
    return seen


def prefill_until_params(p, req_id: str, prompt: list) -> dict:
    """The producer's prefill, up to the step whose output carries the
    params (the payload is made; the send is not over)."""
    p.add_request(req_id, prompt, 1, {"do_remote_decode": True})
    p.run(until=lambda: p.traces[req_id].kv_transfer_params is not None)
    params = p.traces[req_id].kv_transfer_params
    assert params is not None and "kv_checksums" in params, params
    # vLLM still holds the request's blocks for the send.
    assert req_id in p.scheduler.requests
    return dict(params)


def write_into_blocks(p, req_id: str, rng: random.Random, prompt_len: int) -> tuple[dict, str]:
    """Changes one 16-bit element of the KV of 1 to 3 random tokens, on one
    random producer rank, layer and head each; returns ({group: block ids
    written}, the worker named)."""
    rank = rng.randrange(P_TP)
    state = p.ranks[rank]
    heads = TOTAL_KV_HEADS // P_TP
    groups = p.kv_cache_config.kv_cache_groups
    blocks: dict = {}
    for token in rng.sample(range(prompt_len), rng.randint(1, 3)):
        layer = rng.randrange(4)
        name = f"model.layers.{layer}.self_attn.attn"
        group = next(g for g, spec in enumerate(groups) if name in spec.layer_names)
        block = state.tables[req_id][group][token // P_BLOCK]
        row = state.caches[name][block, rng.randrange(heads), token % P_BLOCK]
        element = rng.randrange(row.shape[-1])
        bits = row.view(torch.int16)
        bits[element] = bits[element] ^ rng.randrange(1, 1 << 15)
        blocks.setdefault(group, set()).add(block)
    return blocks, f"pp0.tp{rank}"


def sent(p, req_id: str) -> None:
    """Steps the producer until vLLM freed the request's blocks (the send is over)."""
    p.run()
    assert req_id not in p.scheduler.requests


@pytest.mark.parametrize("hybrid", [False, True])
def test_blocks_written_during_the_send_are_counted_and_named(store, rng, hybrid):
    # hybrid: full attention (layers 0, 2) and a sliding window (1, 3), two
    # KV cache groups with block tables of their own.
    window = {"sliding_window": 64} if hybrid else {}
    p = producer(store, **window)
    prom = Prometheus([p])
    seen = watch_rechecks(p)
    prompt = random_prompt(rng)
    params = prefill_until_params(p, "req-source-changed", prompt)
    written, worker = write_into_blocks(p, "req-source-changed", rng, len(prompt))
    with Lines() as log:
        sent(p, "req-source-changed")
        prom.flush()
    # Every worker re-checked while vLLM still held the request and its blocks.
    assert sorted((r, q, h, b) for r, q, h, b in seen) == [(r, "req-source-changed", True, True) for r in range(P_TP)]
    assert p.connector().scheduler_role.source_check.outcomes["req-source-changed"] == "changed"
    got = totals(p)
    num_written = sum(len(blocks) for blocks in written.values())
    assert (got.get("sources_rechecked"), got.get("sources_changed"), got.get("sources_changed_blocks")) == (1, 1, num_written), got
    assert prom.value("vllm:kvcsum_sources_changed_total", 0) == 1
    assert prom.value("vllm:kvcsum_sources_changed_blocks_total", 0) == num_written
    assert prom.value("vllm:kvcsum_sources_rechecked_total", 0) == 1
    assert prom.value("vllm:kvcsum_checksum_seconds_count", 0, kind="recheck") == P_TP
    lines = [line for line in log.lines if "source changed during send" in line]
    assert len(lines) == 1, log.lines
    assert "request req-source-changed: source changed during send: group " in lines[0], lines[0]
    named = {int(part.split(" blocks ")[0]): part.split(" blocks ")[1].split(" (")[0] for part in lines[0].split("group ")[1:]}
    assert named == {group: str(sorted(blocks)) for group, blocks in written.items()}, (named, written)
    assert f"(on workers {worker})" in lines[0], lines[0]
    # The workers keep no checksums once the send is over.
    assert all(not state.connector.worker_role.source_check.kept() for state in p.ranks)
    # The consumer loads what was sent (read after the write): a MISMATCH,
    # which the producer's count places on the sender; vLLM recomputes it.
    c = consumer(store, **window)
    trace = decode(c, "req-source-changed", params, prompt)
    assert verdict(c, "req-source-changed")[0] == kvcsum.MISMATCH
    assert trace.output_tokens == expected_tokens(prompt, 3)
    assert kv_equal(p, "req-source-changed", c, "req-source-changed", len(prompt))
    print(f"CASE source written during the send{' (hybrid)' if hybrid else ''}: {lines[0]}", flush=True)


@pytest.mark.parametrize("wire", [False, True])
def test_an_unchanged_source_is_rechecked_and_not_counted(store, rng, wire):
    p = producer(store)
    prom = Prometheus([p])
    seen = watch_rechecks(p)
    prompt = random_prompt(rng)
    params = prefill_until_params(p, "req-source-same", prompt)
    with Lines() as log:
        sent(p, "req-source-same")
        prom.flush()
    assert len(seen) == P_TP and all(held and blocks for _, _, held, blocks in seen), seen
    assert p.connector().scheduler_role.source_check.outcomes["req-source-same"] == "unchanged"
    got = totals(p)
    assert got.get("sources_rechecked") == 1 and "sources_changed" not in got and "sources_changed_blocks" not in got, got
    assert prom.value("vllm:kvcsum_sources_changed_total", 0) == 0
    assert prom.value("vllm:kvcsum_sources_rechecked_total", 0) == 1
    assert not [line for line in log.lines if "source changed" in line], log.lines
    # With the source unchanged, a consumer's MISMATCH is damage on the wire
    # or the receiver: here one byte changed as the consumer loads it.
    c = consumer(store)
    if wire:
        store_connector.CORRUPT.update(token=rng.randrange(len(prompt)), head=rng.randrange(TOTAL_KV_HEADS))
    decode(c, "req-source-same", params, prompt)
    assert verdict(c, "req-source-same")[0] == (kvcsum.MISMATCH if wire else kvcsum.MATCH)
    print(f"CASE source unchanged during the send{', one byte changed on the wire' if wire else ''}: "
          f"consumer {verdict(c, 'req-source-same')[0]!r}", flush=True)


def test_a_source_freed_without_a_send_is_not_kept(store, rng):
    # Without held sends (the connector saved the KV in the step of the
    # payload, and vLLM frees the blocks at once), the workers drop the
    # checksums they kept: nothing is re-checked and nothing stays behind.
    store_connector.SEND.clear()
    p = producer(store)
    prompt = random_prompt(rng)
    p.add_request("req-source-free", prompt, 1, {"do_remote_decode": True})
    p.run(until=lambda: p.traces["req-source-free"].kv_transfer_params is not None)
    # The payload is made and the blocks freed; the workers still keep the
    # checksums, until the next step's metadata says the blocks were freed.
    assert "req-source-free" not in p.scheduler.requests
    assert [state.connector.worker_role.source_check.kept() for state in p.ranks] == [{"req-source-free"}] * P_TP
    p.run()
    assert all(not state.connector.worker_role.source_check.kept() for state in p.ranks)
    assert "sources_rechecked" not in totals(p)
    assert "req-source-free" not in p.connector().scheduler_role.source_check.outcomes


@pytest.mark.parametrize("written", [False, True])
def test_a_recheck_that_fails_on_a_worker_is_unchecked_never_unchanged(store, rng, written):
    # One worker cannot checksum the blocks again: the request is not
    # called unchanged on the other workers' word (counted unchecked, with
    # the worker and why); a change another worker saw is still a change.
    p = producer(store)
    prompt = random_prompt(rng)
    prefill_until_params(p, "req-source-part", prompt)
    changed_on = None
    if written:
        blocks, changed_on = write_into_blocks(p, "req-source-part", rng, len(prompt))
    failing = 1 - int(changed_on[-1]) if changed_on else rng.randrange(P_TP)
    checksummer = p.ranks[failing].connector.worker_role.source_check._checksummer

    def refuse(jobs, role, cuda_stream=None):
        raise kvcsum.Error(kvcsum.Status.INVALID_ARGUMENT, "KVCS_ERR_INVALID_ARGUMENT", "the test refuses this checksum")

    checksummer.checksum = refuse
    with Lines() as log:
        sent(p, "req-source-part")
    outcome = p.connector().scheduler_role.source_check.outcomes["req-source-part"]
    got = totals(p)
    if written:
        assert outcome == "changed" and got.get("sources_changed") == 1 and "sources_unchecked" not in got, got
    else:
        assert outcome == "unchecked" and got.get("sources_unchecked") == 1, got
        assert "sources_rechecked" not in got and "sources_changed" not in got, got
        [line] = [line for line in log.lines if "could not all be re-checked" in line]
        assert f"pp0.tp{failing}: the re-check's checksum call failed:" in line and "the test refuses" in line, line
