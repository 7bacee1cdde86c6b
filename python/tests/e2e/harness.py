"""End-to-end harness: a producer and a consumer engine that disagree on TP
size, layout and block size move a batch of requests' KV through a real
transfer agent (agent.TransferAgent), checksum both sides with kvcsum, and
judge each load with the verifiers; then the same with faults injected
through the agent, each localised, and repaired by re-sending only the
blocks the report names.

The model is Llama-like and small: 4 layers, 8 KV heads of 64 bf16-sized
elements (128 bytes of K and 128 of V per head and token).
- Producer ("prefill"): TP=2 (4 heads per rank), FlashInfer's HND layout
  [blocks, 2, heads, 16, 64] per layer: 16-token blocks, K and V side by
  side in each block.
- Consumer ("decode"): TP=4 (2 heads per rank), NHD with K and V in
  separate regions, [blocks, 32, heads, 64] each per layer: 32-token blocks.
Each rank is a kvcsum.Worker with its own agent; all live in this process.

Descriptor lists come from the topology helpers: each consumer rank's
kvcsum.Topology says, from the producer's handshake, which producer rank
holds each run of its heads (head_sources) and whom it reads from
(remote_ranks). HND is contiguous along tokens and NHD along heads, so a
run contiguous on both sides is one token's K (or V) of one head: one
descriptor each (checked: no descriptor continues another on both sides).
The producer's rank agent WRITEs them into the consumer rank's memory; the
notification carries the producer's payload as vLLM's connectors carry
kv_transfer_params["kv_checksums"] (base64): in the WRITE itself with NIXL,
beside it on a side channel with Mooncake (the agent decides; see agent.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Callable

import numpy as np

import kvcsum
from agent import TransferAgent

LAYERS, KV_HEADS, HEAD_DIM = 4, 8, 64
DTYPE = np.uint16  # bf16-sized elements: the checksum reads bytes, not numbers
ROW = HEAD_DIM * np.dtype(DTYPE).itemsize  # bytes of one token's K (or V) of one head
GROUP = 0
PRODUCER_ID, CONSUMER_ID = "prefill", "decode"
PRODUCER_TP, PRODUCER_BLOCK, PRODUCER_BLOCKS = 2, 16, 32
CONSUMER_TP, CONSUMER_BLOCK, CONSUMER_BLOCKS = 4, 32, 16
#: The batch: request id -> tokens. Faults are injected into the first.
REQUESTS = {"req-a": 200, "req-b": 75}
K, V = 0, 1
VERDICTS = {kvcsum.MATCH: "MATCH", kvcsum.MISMATCH: "MISMATCH", kvcsum.UNVERIFIED: "UNVERIFIED"}
WAIT_S = 30.0


def positions(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def address(array: np.ndarray, *index: int) -> int:
    """The address of element `index` (a prefix of the dimensions) of `array`."""
    return array.ctypes.data + sum(i * s for i, s in zip(index, array.strides))


def random_fill(rng: np.random.Generator, array: np.ndarray) -> None:
    array[...] = rng.integers(0, 1 << 16, array.shape, dtype=DTYPE)


class Producer:
    """The prefill engine: one worker and one agent per TP rank, and the
    scheduler's verifier that makes each request's payload."""

    def __init__(self, rng: np.random.Generator, make_agent: Callable[[str], TransferAgent]):
        self.heads = [kvcsum.rank_heads(r, PRODUCER_TP, KV_HEADS) for r in range(PRODUCER_TP)]
        shape = (LAYERS, PRODUCER_BLOCKS, 2, len(self.heads[0]), PRODUCER_BLOCK, HEAD_DIM)
        self.caches = [np.empty(shape, dtype=DTYPE) for _ in range(PRODUCER_TP)]
        self.agents, self.workers = [], []
        for rank, cache in enumerate(self.caches):
            random_fill(rng, cache)
            agent = make_agent(f"{PRODUCER_ID}-{rank}")
            agent.register([cache])
            self.agents.append(agent)
            worker = kvcsum.Worker(tp_rank=rank, tp_size=PRODUCER_TP)
            worker.add_region_of(cache)
            worker.add_group(GROUP, PRODUCER_BLOCK)
            for layer in range(LAYERS):
                worker.add_layer(
                    kvcsum.layer(cache[layer], "BKHTD", layer_number=layer, first_head=self.heads[rank].start)
                )
            self.workers.append(worker)

    def block_bytes(self) -> int:
        """Bytes of one block of one layer on one rank (the handshake's)."""
        return self.caches[0][0, 0].nbytes

    def source(self, rank: int, layer: int, kv: int, block: int, head: int, slot: int) -> int:
        return address(self.caches[rank], layer, block, kv, head, slot)

    def payloads(self, tables: dict) -> dict[str, bytes]:
        """Checksums every request on every rank; the verifier's payloads."""
        with kvcsum.Blocks() as blocks, kvcsum.Verifier(PRODUCER_TP) as verifier:
            for req, num_tokens in REQUESTS.items():
                blocks.add_request(req, num_tokens).add_group(req, GROUP, tables[req])
            verifier.expect(blocks, kvcsum.PRODUCER)
            for worker in self.workers:
                with worker.checksum(blocks, kvcsum.PRODUCER) as result:
                    verifier.add_record(result.encode())
            return {req: verifier.payload(req) for req in REQUESTS}


class Consumer:
    """The decode engine: one worker, agent and topology per TP rank, and
    the scheduler's verifier and completion counter."""

    def __init__(self, rng: np.random.Generator, make_agent: Callable[[str], TransferAgent], producer: Producer):
        self.heads = [kvcsum.rank_heads(r, CONSUMER_TP, KV_HEADS) for r in range(CONSUMER_TP)]
        shape = (LAYERS, CONSUMER_BLOCKS, CONSUMER_BLOCK, len(self.heads[0]), HEAD_DIM)
        self.k = [np.empty(shape, dtype=DTYPE) for _ in range(CONSUMER_TP)]
        self.v = [np.empty(shape, dtype=DTYPE) for _ in range(CONSUMER_TP)]
        self.agents, self.workers, self.topologies = [], [], []
        handshake = kvcsum.RemoteEngine(
            tp_size=PRODUCER_TP, block_bytes=producer.block_bytes(), block_size=PRODUCER_BLOCK
        )
        for rank in range(CONSUMER_TP):
            random_fill(rng, self.k[rank])
            random_fill(rng, self.v[rank])
            agent = make_agent(f"{CONSUMER_ID}-{rank}")
            agent.register([self.k[rank], self.v[rank]])
            self.agents.append(agent)
            topology = kvcsum.Topology(
                CONSUMER_ID, tp_rank=rank, tp_size=CONSUMER_TP, total_kv_heads=KV_HEADS, block_size=CONSUMER_BLOCK
            )
            topology.add_remote(PRODUCER_ID, handshake)
            self.topologies.append(topology)
            worker = kvcsum.Worker(tp_rank=rank, tp_size=CONSUMER_TP)
            worker.add_region_of(self.k[rank])
            worker.add_region_of(self.v[rank])
            worker.add_group(GROUP, CONSUMER_BLOCK)
            for layer in range(LAYERS):
                worker.add_layer(
                    kvcsum.layer(
                        self.k[rank][layer], "NHD", layer_number=layer, first_head=self.heads[rank].start,
                        v=self.v[rank][layer],
                    )
                )
            self.workers.append(worker)
        self.verifier = kvcsum.Verifier(CONSUMER_TP)
        self.verifier.set_producer_block_size(GROUP, self.topologies[0].remote(PRODUCER_ID).block_size)
        self.completion = kvcsum.Completion(CONSUMER_TP)

    def target(self, rank: int, layer: int, kv: int, block: int, slot: int, head: int) -> int:
        return address((self.k if kv == K else self.v)[rank], layer, block, slot, head)

    def scramble(self, rng: np.random.Generator) -> None:
        """Fresh random bytes everywhere: what a load must overwrite."""
        for array in self.k + self.v:
            random_fill(rng, array)

    def check(self, tables: dict, texts: dict[str, str]) -> dict[str, kvcsum.Report]:
        """Checksums the requests of `texts` on every rank and judges each
        against the payload text its notification carried."""
        with kvcsum.Blocks() as blocks:
            for req in texts:
                blocks.add_request(req, REQUESTS[req]).add_group(req, GROUP, tables[req])
            self.verifier.expect(blocks, kvcsum.CONSUMER)
            for worker in self.workers:
                with worker.checksum(blocks, kvcsum.CONSUMER) as result:
                    self.verifier.add_record(result.encode())
        return {req: self.verifier.check(req, text) for req, text in texts.items()}


@dataclasses.dataclass(frozen=True)
class Run:
    """One descriptor: one token's K or V of one head, in logical terms."""

    req: str
    consumer_rank: int
    producer_rank: int
    layer: int
    kv: int
    token: int  # request position
    consumer_head: int  # index among the consumer rank's heads
    producer_head: int  # index among the producer rank's heads
    producer_block: int
    producer_slot: int
    consumer_block: int
    consumer_slot: int

    @property
    def position(self) -> int:
        """The consumer block position."""
        return self.token // CONSUMER_BLOCK


def plan(consumer: Consumer, tables: dict, consumer_tables: dict) -> dict[str, list[Run]]:
    """Every request's descriptors, from each consumer rank's topology."""
    out = {}
    for req, num_tokens in REQUESTS.items():
        runs = []
        for rank, topology in enumerate(consumer.topologies):
            for source in topology.head_sources(PRODUCER_ID):
                for i in range(source.num_heads):
                    for layer in range(LAYERS):
                        for kv in (K, V):
                            for t in range(num_tokens):
                                runs.append(
                                    Run(
                                        req, rank, source.remote_rank, layer, kv, t,
                                        source.local_offset + i, source.remote_offset + i,
                                        tables[req][t // PRODUCER_BLOCK], t % PRODUCER_BLOCK,
                                        consumer_tables[req][t // CONSUMER_BLOCK], t % CONSUMER_BLOCK,
                                    )
                                )
        out[req] = runs
    return out


def descriptors(producer: Producer, consumer: Consumer, runs: list[Run]) -> np.ndarray:
    """(source, destination, length) rows of `runs`."""
    return np.array(
        [
            (
                producer.source(r.producer_rank, r.layer, r.kv, r.producer_block, r.producer_head, r.producer_slot),
                consumer.target(r.consumer_rank, r.layer, r.kv, r.consumer_block, r.consumer_slot, r.consumer_head),
                ROW,
            )
            for r in runs
        ],
        dtype=np.uint64,
    ).reshape(-1, 3)


def notification(req: str, text: str) -> bytes:
    """What the producer's agents attach to each write of a request."""
    return json.dumps({"req_id": req, "kv_transfer_params": {"kv_checksums": text}}).encode()


class Harness:
    """Both engines, the agents connected, the block tables and the
    producer's payloads; `transfer` moves a batch of requests' runs."""

    def __init__(self, seed: int, make_agent: Callable[[str], TransferAgent]):
        self.rng = np.random.default_rng(seed)
        self.producer = Producer(self.rng, make_agent)
        self.consumer = Consumer(self.rng, make_agent, self.producer)
        # Block tables: distinct random blocks per request, some left unused.
        producer_ids = self.rng.permutation(PRODUCER_BLOCKS).tolist()
        consumer_ids = self.rng.permutation(CONSUMER_BLOCKS).tolist()
        self.tables, self.consumer_tables = {}, {}
        for req, num_tokens in REQUESTS.items():
            self.tables[req] = [producer_ids.pop() for _ in range(positions(num_tokens, PRODUCER_BLOCK))]
            self.consumer_tables[req] = [consumer_ids.pop() for _ in range(positions(num_tokens, CONSUMER_BLOCK))]
        self.unused_producer_blocks = producer_ids
        # Each consumer rank hears from the producer ranks it reads from.
        self.peers, self.sources, self.senders = {}, [], []
        for rank, topology in enumerate(self.consumer.topologies):
            sources = sorted({s.remote_rank for s in topology.head_sources(PRODUCER_ID)})
            assert sources == topology.remote_ranks(PRODUCER_ID), (rank, sources)
            self.sources.append(sources)
            self.senders.append({self.producer.agents[p].name for p in sources})
            for p in sources:
                self.peers[p, rank] = self.producer.agents[p].connect(self.consumer.agents[rank].metadata())
        self.runs = plan(self.consumer, self.tables, self.consumer_tables)
        self.payloads = {req: kvcsum.base64_encode(p) for req, p in self.producer.payloads(self.tables).items()}
        self.check_runs_are_maximal()

    def check_runs_are_maximal(self) -> None:
        """No descriptor continues another on both sides (else they would be one run)."""
        for req, runs in self.runs.items():
            rows = descriptors(self.producer, self.consumer, runs)
            ends = {(int(s + n), int(d + n)) for s, d, n in rows}
            merged = [(int(s), int(d)) for s, d, _ in rows if (int(s), int(d)) in ends]
            assert not merged, f"{req}: {len(merged)} descriptors continue another on both sides"

    def bytes_of(self, runs: list[Run]) -> int:
        return len(runs) * ROW

    def transfer(self, runs: dict[str, list[Run]], texts: dict[str, str]) -> dict[str, str]:
        """Writes each request's runs (one write per producer and consumer
        rank pair, the payload text in its notification; a pair with nothing
        to write sends the notification alone), then polls the writes and the
        consumer ranks' notifications until every write is done and every
        consumer rank heard from all its producer ranks of every request.
        Returns the payload text each request's notifications carried."""
        pending = []
        for req, req_runs in runs.items():
            pairs = {(p, c): [] for c in range(CONSUMER_TP) for p in self.sources[c]}
            for r in req_runs:
                pairs[r.producer_rank, r.consumer_rank].append(r)
            for (p, c), pair_runs in sorted(pairs.items()):
                agent, message = self.producer.agents[p], notification(req, texts[req])
                if pair_runs:
                    rows = descriptors(self.producer, self.consumer, pair_runs)
                    pending.append(agent.write(self.peers[p, c], rows, message))
                else:
                    agent.notify(self.peers[p, c], message)

        reqs = list(runs)
        heard = [{req: set() for req in reqs} for _ in range(CONSUMER_TP)]
        carried: dict[str, set] = {req: set() for req in reqs}
        received: set[str] = set()
        deadline = time.monotonic() + WAIT_S
        while pending or len(received) < len(reqs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"after {WAIT_S} s: {len(pending)} writes pending, notifications heard {heard}")
            pending = [transfer for transfer in pending if not transfer.done()]
            for rank, agent in enumerate(self.consumer.agents):
                for sender, message in agent.notifications():
                    body = json.loads(message)
                    req = body["req_id"]
                    assert sender in self.senders[rank] and sender not in heard[rank][req], (rank, sender, req)
                    heard[rank][req].add(sender)
                    carried[req].add(body["kv_transfer_params"]["kv_checksums"])
                    if heard[rank][req] == self.senders[rank]:
                        received.update(self.consumer.completion.report(rank, kvcsum.RECEIVING, [req]))
        for req, seen in carried.items():
            assert len(seen) == 1, f"{req}: its notifications carried {len(seen)} different payloads"
        return {req: seen.pop() for req, seen in carried.items()}


# --- The scenario: an intact load, each fault, each repair ---------------------------


def where(r: Run) -> str:
    head = kvcsum.rank_heads(r.consumer_rank, CONSUMER_TP, KV_HEADS).start + r.consumer_head
    return f"consumer rank {r.consumer_rank} layer {r.layer} {'KV'[r.kv]} head {head} token {r.token}"


def describe(report: kvcsum.Report, tables: list[int]) -> str:
    if report.verdict == kvcsum.MATCH:
        return f"MATCH ({report.compared_positions} positions compared)"
    if report.verdict == kvcsum.MISMATCH:
        parts = []
        for m in report.mismatches:
            for q in range(m.first_position, m.first_position + m.num_positions):
                parts.append(f"position {q} (block {tables[q]})")
            parts[-1] += f" tokens {m.first_token}..{m.first_token + m.num_tokens - 1}"
        return "MISMATCH at " + ", ".join(parts)
    return "UNVERIFIED: " + "; ".join(f"{f.reason_name}: {f.message}" for f in report.findings)


def mismatched(report: kvcsum.Report) -> set[int]:
    return {q for m in report.mismatches for q in range(m.first_position, m.first_position + m.num_positions)}


def naive_differences(h: Harness, req: str) -> tuple[int, int]:
    """(cells compared, cells differing) between the producer's and the
    consumer's memory of `req`, by logical index (heads handed out to ranks
    in order, without the topology helpers)."""
    per_producer, per_consumer = KV_HEADS // PRODUCER_TP, KV_HEADS // CONSUMER_TP
    compared = differing = 0
    for t in range(REQUESTS[req]):
        for g in range(KV_HEADS):
            for layer in range(LAYERS):
                for kv in (K, V):
                    source = h.producer.caches[g // per_producer][
                        layer, h.tables[req][t // PRODUCER_BLOCK], kv, g % per_producer, t % PRODUCER_BLOCK
                    ]
                    target = (h.consumer.k if kv == K else h.consumer.v)[g // per_consumer][
                        layer, h.consumer_tables[req][t // CONSUMER_BLOCK], t % CONSUMER_BLOCK, g % per_consumer
                    ]
                    compared += 1
                    differing += not np.array_equal(source, target)
    return compared, differing


@dataclasses.dataclass
class Fault:
    """A fault in the first request's load: its runs, the payload text its
    notifications carry, what to do after the transfer, and what the
    consumer's verifier must say."""

    name: str
    detail: str
    runs: list
    expected_positions: set | None = None  # MISMATCH at exactly these; None: see verdict
    verdict: int = kvcsum.MISMATCH
    text: str | None = None
    after: Callable[[], None] | None = None


def faults(h: Harness) -> list[Fault]:
    """Each fault of the issue, at random places (from the harness's seed)."""
    first, second = list(REQUESTS)
    runs, rng, out = h.runs[first], h.rng, []

    def pick(condition=lambda r: True) -> int:
        while True:
            i = int(rng.integers(len(runs)))
            if condition(runs[i]):
                return i

    i = pick()
    other = int(rng.choice(h.unused_producer_blocks))
    wrong = dataclasses.replace(runs[i], producer_block=other)
    out.append(
        Fault(
            "wrong source block",
            f"{where(runs[i])} reads producer block {other} instead of {runs[i].producer_block}",
            runs[:i] + [wrong] + runs[i + 1 :],
            {runs[i].position},
        )
    )

    i = pick(lambda r: r.producer_slot < PRODUCER_BLOCK - 1)
    shifted = dataclasses.replace(runs[i], producer_slot=runs[i].producer_slot + 1)
    out.append(
        Fault(
            "descriptor one token off",
            f"{where(runs[i])} reads the next token's bytes",
            runs[:i] + [shifted] + runs[i + 1 :],
            {runs[i].position},
        )
    )

    i = pick()
    out.append(
        Fault("run dropped", f"{where(runs[i])} left out of the list", runs[:i] + runs[i + 1 :], {runs[i].position})
    )

    table = h.consumer_tables[first]
    p1, p2 = sorted(int(q) for q in rng.choice(len(table), size=2, replace=False))
    swap = {p1: table[p2], p2: table[p1]}
    out.append(
        Fault(
            "destinations swapped",
            f"position {p1} written to block {table[p2]} and position {p2} to block {table[p1]}",
            [dataclasses.replace(r, consumer_block=swap[r.position]) if r.position in swap else r for r in runs],
            {p1, p2},
        )
    )

    r = runs[pick()]
    byte, mask = int(rng.integers(ROW)), int(rng.integers(1, 256))

    def flip() -> None:
        cell = (h.consumer.k if r.kv == K else h.consumer.v)[r.consumer_rank][
            r.layer, r.consumer_block, r.consumer_slot, r.consumer_head
        ]
        cell.view(np.uint8)[byte] ^= mask

    out.append(
        Fault(
            "byte flipped after the transfer",
            f"{where(r)} byte {byte} xor {mask:#04x} in the consumer's memory",
            runs,
            {r.position},
            after=flip,
        )
    )

    # Another request's payload: req-b's checksums judged as req-a's. The
    # producers agree on the block size and the first positions line up, so
    # the positions both hold with equal valid tokens (req-b's full ones)
    # are compared, and differ.
    common = set(range(REQUESTS[second] // CONSUMER_BLOCK))
    out.append(
        Fault(
            "notification carries another request's payload",
            f"{first}'s notifications carry {second}'s kv_checksums",
            runs,
            common,
            text=h.payloads[second],
        )
    )
    return out


def run(make_agent: Callable[[str], TransferAgent], seed: int, agent: str = "") -> bool:
    """Runs the scenario over the agents `make_agent` makes (`agent` names
    them in the output), printing each verdict; True when every expectation
    held."""
    if agent:
        print(f"agent: {agent}")
    print(f"seed {seed} (KVCS_E2E_SEED={seed} repeats this run)")
    print(
        f"model: {LAYERS} layers, {KV_HEADS} KV heads of {HEAD_DIM} bf16-sized elements; "
        f"{PRODUCER_ID}: TP={PRODUCER_TP} HND {PRODUCER_BLOCK}-token blocks -> "
        f"{CONSUMER_ID}: TP={CONSUMER_TP} NHD, K and V apart, {CONSUMER_BLOCK}-token blocks"
    )
    h = Harness(seed, make_agent)
    first, second = list(REQUESTS)
    failed: list[str] = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            failed.append(what)
            print(f"  FAILED: {what}")

    for req, runs in h.runs.items():
        print(
            f"{req}: {REQUESTS[req]} tokens, producer blocks {h.tables[req]}, consumer blocks "
            f"{h.consumer_tables[req]}, {len(runs)} descriptors of {ROW} bytes ({h.bytes_of(runs)} bytes)"
        )

    # The intact load.
    h.consumer.scramble(h.rng)
    texts = h.transfer(h.runs, h.payloads)
    expect(texts == h.payloads, "the notifications carry the producer's payloads")
    for req in REQUESTS:
        compared, differing = naive_differences(h, req)
        expect(differing == 0, f"{req}: {differing} of {compared} cells differ from the producer's after the load")
    reports = h.consumer.check(h.consumer_tables, texts)
    print("intact load: " + "; ".join(f"{req} {describe(r, h.consumer_tables[req])}" for req, r in reports.items()))
    for req, report in reports.items():
        expect(report.verdict == kvcsum.MATCH, f"{req}: intact load gives MATCH")
        wanted = positions(REQUESTS[req], CONSUMER_BLOCK)
        expect(report.compared_positions == wanted, f"{req}: all {wanted} positions compared")

    total = h.bytes_of(h.runs[first])
    for number, fault in enumerate(faults(h), 1):
        print(f"fault {number}, {fault.name}: {fault.detail}")
        h.consumer.scramble(h.rng)
        texts = {first: fault.text or h.payloads[first], second: h.payloads[second]}
        received = h.transfer({first: fault.runs, second: h.runs[second]}, texts)
        if fault.after:
            fault.after()
        reports = h.consumer.check(h.consumer_tables, received)
        report = reports[first]
        print(f"  {first}: {describe(report, h.consumer_tables[first])}")
        print(f"  {second}: {describe(reports[second], h.consumer_tables[second])}")
        expect(reports[second].verdict == kvcsum.MATCH, f"{second} is untouched by a fault in {first}")
        expect(report.verdict != kvcsum.MATCH, f"{fault.name} is not a MATCH")
        expect(report.verdict == fault.verdict, f"{fault.name} gives {VERDICTS[fault.verdict]}")
        expect(
            mismatched(report) == fault.expected_positions,
            f"{fault.name} is localised to {sorted(fault.expected_positions)}, got {sorted(mismatched(report))}",
        )
        if fault.text is not None:
            continue  # the KV is intact: nothing to re-send

        # Repair: re-send only the descriptors of the blocks the report names.
        plan = kvcsum.repair_plan(report, {GROUP: h.consumer_tables[first]}, CONSUMER_BLOCK)
        blocks = plan.get(GROUP, [])
        wanted = {(b.block_id, t) for b in blocks for t in range(b.first_token, b.first_token + b.num_tokens)}
        resend = [r for r in h.runs[first] if (r.consumer_block, r.token) in wanted]
        received = h.transfer({first: resend}, {first: h.payloads[first]})
        after = h.consumer.check(h.consumer_tables, received)[first]
        sent = h.bytes_of(resend)
        print(
            f"  repair: positions {[b.position for b in blocks]} (blocks "
            f"{[b.block_id for b in blocks]}), re-sent {sent} of {total} bytes "
            f"({100 * sent / total:.1f}%) -> {describe(after, h.consumer_tables[first])}"
        )
        expect(after.verdict == kvcsum.MATCH, f"{fault.name}: MATCH after the repair")
        expect(0 < sent < total, f"{fault.name}: the repair re-sends part of the request")
        compared, differing = naive_differences(h, first)
        expect(differing == 0, f"{fault.name}: {differing} of {compared} cells differ after the repair")

    for agent in h.producer.agents + h.consumer.agents:
        agent.close()
    if failed:
        print(f"{len(failed)} expectation(s) failed (seed {seed}):")
        for what in failed:
            print(f"  {what}")
        return False
    print("all expectations held")
    return True


def main(make_agent: Callable[[str], TransferAgent], agent: str) -> int:
    """An entry point's body: the scenario with a seed from KVCS_E2E_SEED
    (else random); 0 when every expectation held, else 1. The seed is
    printed again when the run raises."""
    seed = int(os.environ.get("KVCS_E2E_SEED") or int.from_bytes(os.urandom(4), "little"))
    try:
        return 0 if run(make_agent, seed, agent) else 1
    except BaseException:
        print(f"error ({agent}, seed {seed}):", file=sys.stderr)
        raise
