"""Report.uncompared: where the loaded positions that no comparison covers
lie (SPEC section 10), against a naive reading of the rule over random
block-size pairs, token counts and first positions. Random data is seeded;
the seed is printed (and named in failures), and KVCS_SEED changes it."""

import math
import os

import numpy as np
import pytest

import kvcsum

SEED = int(os.environ.get("KVCS_SEED", "0x636B73"), 0)
HEADS, PIECES = 2, 2
SIZES = (2, 3, 4, 6, 8, 12, 16)


@pytest.fixture
def seed(request):
    value = SEED + sum(map(ord, request.node.name))
    print(f"random data seed {value:#x} (KVCS_SEED={SEED:#x})")
    return value


def side_cache(rng, kv, block_size, first, count, num_tokens):
    """An HND cache [blocks, heads, block_size, pieces] holding the logical
    tokens `kv` of positions first..first+count (random elsewhere), and its
    block ids per position."""
    num_blocks = count + 2
    cache = rng.integers(1, 2**64, (num_blocks, HEADS, block_size, PIECES), dtype=np.uint64, endpoint=False)
    ids = [int(b) for b in rng.permutation(num_blocks)[:count]]
    for index, block in enumerate(ids):
        position = first + index
        for token in range(position * block_size, min((position + 1) * block_size, num_tokens)):
            cache[block, :, token - position * block_size, :] = kv[token]
    return cache, ids


def record(cache, block_size, num_tokens, first, ids, role):
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
        worker.add_region_of(cache)
        worker.add_group(0, block_size)
        worker.add_layer(kvcsum.layer(cache, "HND", layer_number=0, identity=b"layer 0"))
        blocks.add_request("req", num_tokens).add_group("req", 0, ids, first)
        with worker.checksum(blocks, role) as result:
            return result.encode()


def naive_uncompared(b_p, n_p, p_first, p_count, b_c, n_c, c_first, c_count):
    """The consumer's loaded positions holding valid tokens whose run of
    lcm(b_p, b_c) tokens is not compared: a run is compared when both sides
    hold the same non-zero number of valid tokens in it and each side holds
    every one of its blocks of the run that holds valid tokens. A producer
    holding its last token sends that position over one token fewer too
    (the extension's short last value): a consumer of exactly one token
    fewer is compared against the producer's values over its own count."""
    run = math.lcm(b_p, b_c)
    if n_c + 1 == n_p and p_first <= (n_p - 1) // b_p < p_first + p_count:
        n_p = n_c

    def valid(n, q):
        return max(0, min(run, n - q * run))

    def holds_run(block_size, n, first, count, q):
        for position in range(q * run // block_size, (q + 1) * run // block_size):
            if position * block_size < n and not first <= position < first + count:
                return False
        return True

    def compared(q):
        return (
            valid(n_c, q) != 0
            and valid(n_c, q) == valid(n_p, q)
            and holds_run(b_p, n_p, p_first, p_count, q)
            and holds_run(b_c, n_c, c_first, c_count, q)
        )

    positions = [c for c in range(c_first, c_first + c_count) if c * b_c < n_c]
    any_compared = any(compared(c * b_c // run) for c in positions)
    return [c for c in positions if not compared(c * b_c // run)], any_compared


def ranges_of(positions):
    out = []
    for position in positions:
        if out and out[-1][0] + out[-1][1] == position:
            out[-1][1] += 1
        else:
            out.append([position, 1])
    return [tuple(r) for r in out]


def test_uncompared_ranges_follow_the_run_rule_for_random_block_sizes_and_token_counts(seed):
    rng = np.random.default_rng(seed)
    seen_uncompared = seen_clean = 0
    for case in range(150):
        b_p, b_c = int(rng.choice(SIZES)), int(rng.choice(SIZES))
        n_p = int(rng.integers(1, 90))
        # The consumer loads as many tokens, one fewer (vLLM computes the
        # last prompt token again), a few fewer or more, or any count.
        n_c = max(1, int(rng.choice([n_p, n_p - 1, n_p - int(rng.integers(1, 20)), n_p + int(rng.integers(1, 9)), int(rng.integers(1, 90))])))
        p_first = int(rng.choice([0, 0, 0, int(rng.integers(0, 3))]))
        p_end = -(-n_p // b_p) + int(rng.integers(0, 2))
        c_first = int(rng.choice([0, 0, int(rng.integers(0, 4))]))
        c_end = -(-n_c // b_c) + int(rng.integers(0, 2))
        if p_first >= p_end or c_first >= c_end:
            continue
        where = f"seed {seed:#x} case {case}: producer {b_p}x[{p_first}, {p_end}) {n_p} tokens, consumer {b_c}x[{c_first}, {c_end}) {n_c} tokens"
        kv = rng.integers(1, 2**64, (max(n_p, n_c), HEADS, PIECES), dtype=np.uint64, endpoint=False)
        p_cache, p_ids = side_cache(rng, kv, b_p, p_first, p_end - p_first, n_p)
        c_cache, c_ids = side_cache(rng, kv, b_c, c_first, c_end - c_first, n_c)
        with kvcsum.Verifier(1) as producer, kvcsum.Blocks() as blocks:
            blocks.add_request("req", n_p).add_group("req", 0, p_ids, p_first)
            producer.expect(blocks, kvcsum.PRODUCER)
            producer.add_record(record(p_cache, b_p, n_p, p_first, p_ids, kvcsum.PRODUCER))
            payload = producer.payload("req")
        expected, any_compared = naive_uncompared(b_p, n_p, p_first, p_end - p_first, b_c, n_c, c_first, c_end - c_first)
        # By default positions nobody compared make the load UNVERIFIED;
        # opted out, the compared positions alone are judged.
        for opted_out in (False, True):
            with kvcsum.Verifier(1) as consumer, kvcsum.Blocks() as scheduled:
                consumer.set_producer_block_size(0, b_p)
                if opted_out:
                    consumer.set_require_coverage(False)
                scheduled.add_request("req", n_c).add_group("req", 0, c_ids, c_first)
                consumer.expect(scheduled, kvcsum.CONSUMER)
                consumer.add_record(record(c_cache, b_c, n_c, c_first, c_ids, kvcsum.CONSUMER))
                with consumer.check("req", payload) as report:
                    if not any_compared:
                        assert report.verdict == kvcsum.UNVERIFIED and report.reason == kvcsum.NO_COMMON_POSITION, where
                        assert report.uncompared == [] and report.uncompared_positions == 0, where
                        continue
                    if expected and not opted_out:
                        assert report.verdict == kvcsum.UNVERIFIED, f"{where}: {report.message}"
                        assert report.reason == kvcsum.UNCOMPARED_POSITIONS and not report.passed, where
                    else:
                        assert report.verdict == kvcsum.MATCH, f"{where}: {report.message}"
                    got = [(u.group_id, u.first_position, u.num_positions) for u in report.uncompared]
                    assert got == [(0, first, count) for first, count in ranges_of(expected)], f"{where}: {report.message}"
                    assert report.uncompared_positions == len(expected), where
        if any_compared:
            seen_uncompared += bool(expected)
            seen_clean += not expected
    assert seen_uncompared >= 10 and seen_clean >= 10, (seen_uncompared, seen_clean)


def test_a_corruption_in_an_uncompared_position_is_never_a_match_by_default_and_is_named(seed):
    # Why the ranges matter: the producer sent 45 tokens, the consumer loaded
    # 42 (8- and 16-token blocks); the last consumer block (tokens 32..42)
    # is not compared, so a corruption there is not seen, and the report
    # says exactly which position that is. (A load of 44, one token fewer,
    # is compared whole: the producer sent its last position over 44
    # tokens too.)
    rng = np.random.default_rng(seed)
    kv = rng.integers(1, 2**64, (45, HEADS, PIECES), dtype=np.uint64, endpoint=False)
    p_cache, p_ids = side_cache(rng, kv, 8, 0, 6, 45)
    c_cache, c_ids = side_cache(rng, kv, 16, 0, 3, 42)
    c_cache[c_ids[2], 1, 40 - 32, 0] ^= np.uint64(1 << int(rng.integers(0, 64)))
    with kvcsum.Verifier(1) as producer, kvcsum.Blocks() as blocks:
        blocks.add_request("req", 45).add_group("req", 0, p_ids)
        producer.expect(blocks, kvcsum.PRODUCER)
        producer.add_record(record(p_cache, 8, 45, 0, p_ids, kvcsum.PRODUCER))
        payload = producer.payload("req")
    for opted_out in (False, True):
        with kvcsum.Verifier(1) as consumer, kvcsum.Blocks() as scheduled:
            consumer.set_producer_block_size(0, 8)
            if opted_out:
                # The explicit opt-out: a match of what was compared, which
                # says nothing of the position it names.
                consumer.set_require_coverage(False)
            scheduled.add_request("req", 42).add_group("req", 0, c_ids)
            consumer.expect(scheduled, kvcsum.CONSUMER)
            consumer.add_record(record(c_cache, 16, 42, 0, c_ids, kvcsum.CONSUMER))
            with consumer.check("req", payload) as report:
                expected = kvcsum.MATCH if opted_out else kvcsum.UNVERIFIED
                assert report.verdict == expected and report.compared_positions == 2, f"seed {seed:#x}: {report.message}"
                assert report.passed == opted_out, f"seed {seed:#x}"
                assert report.uncompared == [kvcsum.Uncompared(0, 2, 1)], f"seed {seed:#x}"
                if not opted_out:
                    assert "positions 2..3" in report.message, report.message
