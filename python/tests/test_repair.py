"""kvcsum.repair_plan: from a consumer's MISMATCH report to the consumer
blocks to load again, checked against a naive expectation written here
(flipped tokens -> runs of the two block sizes' least common multiple ->
consumer positions, block ids and tokens), on seeded random data. The plan
is the library's (kvcs_report_repair_plan); its token ranges are half-open,
[start_token, end_token)."""

import numpy as np
import pytest

import kvcsum

PRODUCER_BLOCK, CONSUMER_BLOCK = 8, 4  # runs of lcm 8 tokens: two consumer blocks each
NUM_TOKENS = 3 * PRODUCER_BLOCK + 5  # the last run is partial: 5 tokens, consumer blocks of 4 and 1
HEADS, PIECES = 2, 4
SEED = 0x726570


def checksum_record(cache, block_size, block_ids, role):
    with kvcsum.Worker() as worker, kvcsum.Blocks() as blocks:
        worker.add_region_of(cache)
        worker.add_group(0, block_size)
        worker.add_layer(kvcsum.layer(cache, "HND", layer_number=0))
        blocks.add_request("req", NUM_TOKENS).add_group("req", 0, block_ids)
        with worker.checksum(blocks, role) as result:
            return result.encode()


def verifier_for(role, block_ids):
    verifier = kvcsum.Verifier(1)
    with kvcsum.Blocks() as blocks:
        blocks.add_request("req", NUM_TOKENS).add_group("req", 0, block_ids)
        verifier.expect(blocks, role)
    return verifier


class Setup:
    """A producer (8-token blocks) and a consumer (4-token blocks) holding
    the same request in shuffled blocks."""

    def __init__(self, rng):
        self.rng = rng
        producer_positions = -(-NUM_TOKENS // PRODUCER_BLOCK)
        consumer_positions = -(-NUM_TOKENS // CONSUMER_BLOCK)
        self.producer = rng.integers(0, 2**64, (9, HEADS, PRODUCER_BLOCK, PIECES), dtype=np.uint64, endpoint=False)
        self.consumer = rng.integers(0, 2**64, (13, HEADS, CONSUMER_BLOCK, PIECES), dtype=np.uint64, endpoint=False)
        self.producer_ids = [int(b) for b in rng.permutation(9)[:producer_positions]]
        self.consumer_ids = [int(b) for b in rng.permutation(13)[:consumer_positions]]
        for t in range(NUM_TOKENS):  # the transfer, one token at a time
            source = self.producer[self.producer_ids[t // PRODUCER_BLOCK], :, t % PRODUCER_BLOCK]
            self.consumer[self.consumer_ids[t // CONSUMER_BLOCK], :, t % CONSUMER_BLOCK] = source
        with verifier_for(kvcsum.PRODUCER, self.producer_ids) as producer:
            producer.add_record(checksum_record(self.producer, PRODUCER_BLOCK, self.producer_ids, kvcsum.PRODUCER))
            self.payload = producer.payload("req")

    def report(self, cache=None, payload=None):
        cache = self.consumer if cache is None else cache
        with verifier_for(kvcsum.CONSUMER, self.consumer_ids) as consumer:
            consumer.set_producer_block_size(0, PRODUCER_BLOCK)
            consumer.add_record(checksum_record(cache, CONSUMER_BLOCK, self.consumer_ids, kvcsum.CONSUMER))
            return consumer.check("req", self.payload if payload is None else payload)

    def flipped(self, tokens):
        cache = self.consumer.copy()
        for t in tokens:
            head, piece = self.rng.integers(0, HEADS), self.rng.integers(0, PIECES)
            cache[self.consumer_ids[t // CONSUMER_BLOCK], head, t % CONSUMER_BLOCK, piece] ^= np.uint64(1 << 17)
        return cache


def naive_plan(tokens, consumer_ids):
    """{position: (block_id, first_token, num_tokens)} of the consumer blocks
    sharing a run of lcm(8, 4) = 8 tokens with a changed token."""
    want = {}
    for run in {t // PRODUCER_BLOCK for t in tokens}:
        run_start, run_end = run * PRODUCER_BLOCK, min((run + 1) * PRODUCER_BLOCK, NUM_TOKENS)
        for q in range(len(consumer_ids)):
            low, high = max(q * CONSUMER_BLOCK, run_start), min((q + 1) * CONSUMER_BLOCK, run_end)
            if low < high:
                want[q] = (consumer_ids[q], low, high - low)
    return want


def test_plan_names_the_blocks_of_each_differing_run():
    rng = np.random.default_rng(SEED)
    setup = Setup(rng)
    with setup.report() as report:
        assert report.verdict == kvcsum.MATCH, f"seed {SEED:#x}: {report.message}"
        assert kvcsum.repair_plan(report, {0: setup.consumer_ids}, CONSUMER_BLOCK) == {}
    cases = [[0], [NUM_TOKENS - 1], [9, 10], [3, 17, 27]] + [
        sorted(rng.choice(NUM_TOKENS, size=int(rng.integers(1, 4)), replace=False).tolist()) for _ in range(6)
    ]
    for tokens in cases:
        with setup.report(setup.flipped(tokens)) as report:
            assert report.verdict == kvcsum.MISMATCH, f"seed {SEED:#x} tokens {tokens}: {report.message}"
            plan = kvcsum.repair_plan(report, {0: setup.consumer_ids}, {0: CONSUMER_BLOCK})
        assert list(plan) == [0]
        got = {b.position: (b.block_id, b.first_token, b.num_tokens) for b in plan[0]}
        assert got == naive_plan(tokens, setup.consumer_ids), f"seed {SEED:#x} tokens {tokens}"
        assert [b.position for b in plan[0]] == sorted(got)
        assert all(b.group_id == 0 for b in plan[0])
        assert [(b.start_token, b.end_token) for b in plan[0]] == [
            (low, low + count) for _, low, count in (got[q] for q in sorted(got))
        ]


def test_repairing_the_planned_blocks_restores_a_match():
    setup = Setup(np.random.default_rng(SEED + 1))
    broken = setup.flipped([5, 20])
    with setup.report(broken) as report:
        plan = kvcsum.repair_plan(report, {0: setup.consumer_ids}, CONSUMER_BLOCK)
    for block in plan[0]:  # copy back only the planned tokens
        for t in range(block.start_token, block.end_token):
            broken[block.block_id, :, t % CONSUMER_BLOCK] = setup.consumer[block.block_id, :, t % CONSUMER_BLOCK]
    assert {b.position for b in plan[0]} == {0, 1, 4, 5}
    with setup.report(broken) as report:
        assert report.verdict == kvcsum.MATCH, report.message


def test_tables_given_from_a_first_position_and_the_errors():
    setup = Setup(np.random.default_rng(SEED + 2))
    with setup.report(setup.flipped([13])) as report:  # run 1: consumer positions 2 and 3
        mismatches = report.mismatches
        shifted = kvcsum.repair_plan(report, {0: (2, setup.consumer_ids[2:4])}, CONSUMER_BLOCK)
        assert [(b.position, b.block_id) for b in shifted[0]] == [(q, setup.consumer_ids[q]) for q in (2, 3)]
        assert kvcsum.repair_plan(mismatches, {0: setup.consumer_ids}, CONSUMER_BLOCK) == kvcsum.repair_plan(
            report, {0: setup.consumer_ids}, CONSUMER_BLOCK
        )
        with pytest.raises(ValueError, match="position 3 differs but consumer_blocks holds positions 0..3 of it"):
            kvcsum.repair_plan(report, {0: setup.consumer_ids[:3]}, CONSUMER_BLOCK)
        with pytest.raises(ValueError, match="group 0 differs but consumer_blocks has no blocks of it"):
            kvcsum.repair_plan(report, {1: setup.consumer_ids}, CONSUMER_BLOCK)
        with pytest.raises(ValueError, match="block_size of group 0 is 0"):
            kvcsum.repair_plan(report, {0: setup.consumer_ids}, 0)
        with pytest.raises(ValueError, match="block_sizes gives group 0 block size 2, but the report counted its"):
            kvcsum.repair_plan(report, {0: setup.consumer_ids}, 2)  # a block size the report was not made with
    with setup.report(payload=b"\x91not a payload") as report:
        assert report.verdict == kvcsum.UNVERIFIED
        with pytest.raises(ValueError, match="names no positions to repair"):
            kvcsum.repair_plan(report, {0: setup.consumer_ids}, CONSUMER_BLOCK)


def test_mismatch_entries_of_one_group_must_not_overlap():
    setup = Setup(np.random.default_rng(SEED + 3))
    with setup.report(setup.flipped([2])) as report:  # run 0: consumer positions 0 and 1
        mismatches = report.mismatches
    assert [(m.first_position, m.num_positions, m.first_token, m.num_tokens) for m in mismatches] == [(0, 2, 0, 8)]
    plan = kvcsum.repair_plan(mismatches, {0: setup.consumer_ids}, CONSUMER_BLOCK)
    assert [(b.position, b.start_token, b.end_token) for b in plan[0]] == [(0, 0, 4), (1, 4, 8)]
    with pytest.raises(kvcsum.InvalidArgument, match=r"group 0: the differing positions 0..2 and 0..2 overlap"):
        kvcsum.repair_plan(mismatches * 2, {0: setup.consumer_ids}, CONSUMER_BLOCK)


def test_a_block_size_other_than_the_reports_is_refused():
    """A report counts its positions in the consumer's block size it was
    made with; a plan under any other (1 to 64) raises InvalidArgument
    naming both sizes. Mismatch entries do not say their block size: they
    are refused under every size they are not whole blocks of (naive check
    over their tokens), and planned under the others with exactly their
    positions."""
    setup = Setup(np.random.default_rng(SEED + 4))
    with setup.report(setup.flipped([13, 27])) as report:  # runs 1 and 3
        mismatches = report.mismatches
        want = kvcsum.repair_plan(report, {0: setup.consumer_ids}, CONSUMER_BLOCK)
        assert {b.position for b in want[0]} == {2, 3, 6, 7}
        for size in range(1, 65):
            if size == CONSUMER_BLOCK:
                continue
            with pytest.raises(kvcsum.InvalidArgument) as raised:
                kvcsum.repair_plan(report, {0: setup.consumer_ids}, size)
            assert f"block size {size}, but the report counted its positions in blocks of {CONSUMER_BLOCK}" in str(
                raised.value
            )
    for size in range(1, 65):
        whole = all(
            m.first_token % size == 0
            and {t // size for t in range(m.first_token, m.first_token + m.num_tokens)}
            == set(range(m.first_position, m.first_position + m.num_positions))
            for m in mismatches
        )
        tables = {0: setup.consumer_ids + [50 + i for i in range(64)]}  # positions enough for any size
        if not whole:
            with pytest.raises(kvcsum.InvalidArgument, match="is not the one the mismatch was made with"):
                kvcsum.repair_plan(mismatches, tables, size)
            continue
        plan = kvcsum.repair_plan(mismatches, tables, size)
        assert [b.position for b in plan[0]] == [
            q for m in mismatches for q in range(m.first_position, m.first_position + m.num_positions)
        ], f"block size {size}"
    assert kvcsum.repair_plan(mismatches, {0: setup.consumer_ids}, CONSUMER_BLOCK) == want


def test_a_plan_is_of_the_request_its_report_judged():
    """The report knows its request: repair_plan plans that request's
    blocks (the library refuses a report of another request than the one
    it is asked to plan)."""
    setup = Setup(np.random.default_rng(SEED + 5))
    with setup.report(setup.flipped([1])) as report:
        assert report.req_id == "req"
        plan = kvcsum.repair_plan(report, {0: setup.consumer_ids}, CONSUMER_BLOCK)
    assert [(b.position, b.block_id) for b in plan[0]] == [(q, setup.consumer_ids[q]) for q in (0, 1)]


def test_a_state_block_is_planned_with_the_tokens_its_state_holds_even_none():
    """A state group's one position holds the request's state whatever its
    token count: a corrupted state of a request of no tokens mismatches
    ("the state after 0 tokens") and the plan names its block, with no
    tokens; with tokens, all of them, whatever the group's block size."""
    rng = np.random.default_rng(SEED + 6)
    for num_tokens in (0, 100):
        conv = rng.integers(0, 2**16, (3, 4, 6), dtype=np.uint16)
        sides = []
        for _ in range(2):
            state = conv.copy()
            worker = kvcsum.Worker(num_threads=1)
            worker.add_region_of(state)
            worker.add_group(3, 16)
            tensor = kvcsum.StateTensor(state.ctypes.data, state.strides[0], state.strides[1], 0, 4, 4, 12, 2)
            worker.add_state(3, 7, [tensor], num_blocks=3, identity=b"mamba 7")
            sides.append((worker, state))
        with kvcsum.Blocks() as blocks:
            blocks.add_request("s", num_tokens).add_group("s", 3, [2])
            (producer, _), (consumer, state) = sides
            with kvcsum.Verifier(1) as verifier:
                verifier.expect(blocks, kvcsum.PRODUCER)
                with producer.checksum(blocks, kvcsum.PRODUCER) as result:
                    verifier.add_record(result.encode())
                payload = verifier.payload("s")
            state[2, 1, 3] ^= 1 << 5
            with kvcsum.Verifier(1) as verifier:
                verifier.expect(blocks, kvcsum.CONSUMER)
                with consumer.checksum(blocks, kvcsum.CONSUMER) as result:
                    verifier.add_record(result.encode())
                with verifier.check("s", payload) as report:
                    assert report.verdict == kvcsum.MISMATCH, report.message
                    assert report.findings == []
                    assert f"group 3 position 0 (the state after {num_tokens} tokens" in report.message
                    plan = kvcsum.repair_plan(report, {3: [2]}, 16)
        for worker, _ in sides:
            worker.close()
        assert plan == {3: [kvcsum.RepairBlock(3, 0, 2, 0, num_tokens)]}, f"{num_tokens} tokens"
        assert (plan[3][0].start_token, plan[3][0].end_token) == (0, num_tokens)
