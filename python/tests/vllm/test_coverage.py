"""kvcsum.vllm.coverage, the scheduler's reading of the run rule (which
positions of a sync load no comparison can cover, known before its data
is read), against the library's Report.uncompared on random block-size
pairs, token counts and first positions (each load really checksummed and
judged). Seeded; the seed is printed, and KVCS_SEED changes it."""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np

import kvcsum
from kvcsum.vllm.coverage import uncompared_positions
from kvcsum.vllm.params import payload_summary

_spec = importlib.util.spec_from_file_location(
    "library_uncompared", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "test_uncompared.py")
)
library = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(library)

SEED = int(os.environ.get("KVCS_SEED", "0x636B73"), 0)


def judged_uncompared(rng, b_p, n_p, p_first, p_count, b_c, n_c, c_first, c_count):
    """(the library's uncompared ranges of group 0, whether the load was
    judged, the report's message, the payload's summary)."""
    kv = rng.integers(1, 2**64, (max(n_p, n_c), library.HEADS, library.PIECES), dtype=np.uint64, endpoint=False)
    p_cache, p_ids = library.side_cache(rng, kv, b_p, p_first, p_count, n_p)
    c_cache, c_ids = library.side_cache(rng, kv, b_c, c_first, c_count, n_c)
    with kvcsum.Verifier(1) as producer, kvcsum.Blocks() as blocks:
        blocks.add_request("req", n_p).add_group("req", 0, p_ids, p_first)
        producer.expect(blocks, kvcsum.PRODUCER)
        producer.add_record(library.record(p_cache, b_p, n_p, p_first, p_ids, kvcsum.PRODUCER))
        payload = producer.payload("req")
    with kvcsum.Verifier(1) as consumer, kvcsum.Blocks() as scheduled:
        consumer.set_producer_block_size(0, b_p)
        # As the connector's LoadJudge: it hands uncompared blocks to vLLM
        # itself, so it opts out of the library's default (UNVERIFIED).
        consumer.set_require_coverage(False)
        scheduled.add_request("req", n_c).add_group("req", 0, c_ids, c_first)
        consumer.expect(scheduled, kvcsum.CONSUMER)
        consumer.add_record(library.record(c_cache, b_c, n_c, c_first, c_ids, kvcsum.CONSUMER))
        with consumer.check("req", payload) as report:
            judged = report.verdict == kvcsum.MATCH
            ranges = [(u.first_position, u.num_positions) for u in report.uncompared]
            return ranges, judged, report.message, payload_summary(payload)


def test_the_schedulers_uncompared_positions_are_the_verifiers_for_random_sizes():
    seed = SEED + 0x5C
    print(f"random data seed {seed:#x} (KVCS_SEED={SEED:#x})")
    rng = np.random.default_rng(seed)
    judged_with_gaps = 0
    for case in range(200):
        b_p, b_c = int(rng.choice(library.SIZES)), int(rng.choice(library.SIZES))
        n_p = int(rng.integers(1, 90))
        n_c = max(1, int(rng.choice([n_p, n_p - 1, n_p - int(rng.integers(1, 20)), n_p + int(rng.integers(1, 9))])))
        p_first = int(rng.choice([0, 0, int(rng.integers(0, 3))]))
        p_count = -(-n_p // b_p) - p_first + int(rng.integers(0, 2))
        c_first = int(rng.choice([0, 0, int(rng.integers(0, 4))]))
        c_count = -(-n_c // b_c) - c_first + int(rng.integers(0, 2))
        if p_count <= 0 or c_count <= 0:
            continue
        where = f"seed {seed:#x} case {case}: producer {b_p}x{p_count}@{p_first} {n_p} tokens, consumer {b_c}x{c_count}@{c_first} {n_c} tokens"
        got, judged, message, summary = judged_uncompared(rng, b_p, n_p, p_first, p_count, b_c, n_c, c_first, c_count)
        # The producer's payload carries the short last value of a group
        # holding its last token, and the scheduler's summary reads it.
        short = 0 in summary.short_last
        assert short == (p_first <= (n_p - 1) // b_p < p_first + p_count), where
        predicted = uncompared_positions((b_p, n_p, p_first, p_count), (b_c, n_c, c_first, c_count), short)
        if judged:
            assert predicted == got, f"{where}: {message}"
            judged_with_gaps += bool(got)
        else:
            # Nothing compared at all (UNVERIFIED): every loaded position is uncompared.
            end = min(c_first + c_count, -(-n_c // b_c))
            assert predicted == ([(c_first, end - c_first)] if end > c_first else []), f"{where}: {message}"
    assert judged_with_gaps >= 20, judged_with_gaps


def test_uncompared_positions_take_work_linear_in_the_consumers_positions():
    # Coprime block sizes of a hostile payload: runs of 65535 * 65536 tokens
    # and a producer count of 2**60 tokens; the answer still comes from one
    # pass over the consumer's 3 positions.
    b_p, b_c = 65535, 65536
    assert math.lcm(b_p, b_c) == b_p * b_c
    assert uncompared_positions((b_p, 2**60, 0, 2**40), (b_c, 3 * b_c - 5, 0, 3)) == [(0, 3)]
    assert uncompared_positions((16, 45, 0, 3), (16, 44, 0, 3)) == [(2, 1)]
    # One token fewer, against a producer that sent its short last value:
    # every position compared; two fewer, not.
    assert uncompared_positions((16, 45, 0, 3), (16, 44, 0, 3), short_last=True) == []
    assert uncompared_positions((8, 45, 0, 6), (16, 44, 0, 3), short_last=True) == []
    assert uncompared_positions((16, 45, 0, 3), (16, 43, 0, 3), short_last=True) == [(2, 1)]
    assert uncompared_positions((8, 45, 0, 6), (16, 45, 0, 3)) == []
