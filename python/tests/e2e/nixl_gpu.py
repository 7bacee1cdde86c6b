#!/usr/bin/env python3
"""The GPU end-to-end test over NIXL, in two processes.

A producer process (GPU 0, TP=2: two device workers on one GPU, FlashInfer's
HND layout, 16-token blocks) and a consumer process (GPU 1 when there are
two GPUs, else GPU 0; TP=4, NHD with K and V apart, 32-token blocks) hold a
Llama-3.1-8B-like KV cache (32 layers, 8 KV heads of 128 bf16) in device
memory allocated with torch. Each process has one NIXL agent (UCX, "VRAM")
and exchanges agent metadata with the other through NIXL's metadata API
(get_agent_metadata / add_remote_agent) over files in a shared folder; the
consumer's handshake (its buffers and each rank's head sources from
kvcsum.Topology) travels beside it as JSON. The producer WRITEs each
request's runs into the consumer's memory with its payload in the NIXL
notification, as vLLM carries kv_transfer_params["kv_checksums"]. Both sides
checksum with kvcsum device workers on torch's current stream.

Scenario (harness.py's, at this size): an intact load (MATCH), the five
faults of the host test plus another request's payload, each localised, and
each repaired by re-sending only the runs of the blocks the report names.
Prints the verdicts and the time of the transfer and of both sides'
checksums. `--host` runs the same two processes on host memory (no GPU).

    python nixl_gpu.py [--tokens N,M] [--full] [--no-faults] [--host] [--seed S]

The default batch is two requests of 1000 and 300 tokens (~163 MiB of KV);
`--full` is 6000 + 2192 tokens (1 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

import kvcsum
from harness import CONSUMER_BLOCK, CONSUMER_TP, GROUP, PRODUCER_BLOCK, PRODUCER_TP, K, V, describe, mismatched

LAYERS, KV_HEADS, HEAD_DIM, ITEM = 32, 8, 128, 2  # Llama-3.1-8B's cache, bf16
ROW = HEAD_DIM * ITEM  # one token's K (or V) of one head: one descriptor
WAIT_S = 120.0
SPARE_BLOCKS = 8  # unused blocks on each side (the wrong-source fault reads one)


def positions(tokens: int, block: int) -> int:
    return -(-tokens // block)


# --- What both processes derive from the seed -------------------------------------------


class Plan:
    """Block tables, the runs of each request (one row per descriptor, as
    columns of logical indices) and the faults, from the seed and the head
    sources of the consumer's topologies."""

    def __init__(self, seed: int, requests: dict[str, int], head_sources: list[list[tuple[int, int, int, int]]]):
        self.requests, self.rng = requests, np.random.default_rng(seed)
        total_p = sum(positions(n, PRODUCER_BLOCK) for n in requests.values())
        total_c = sum(positions(n, CONSUMER_BLOCK) for n in requests.values())
        self.producer_blocks, self.consumer_blocks = total_p + SPARE_BLOCKS, total_c + SPARE_BLOCKS
        producer_ids = self.rng.permutation(self.producer_blocks).tolist()
        consumer_ids = self.rng.permutation(self.consumer_blocks).tolist()
        self.tables, self.consumer_tables = {}, {}
        for req, n in requests.items():
            self.tables[req] = [producer_ids.pop() for _ in range(positions(n, PRODUCER_BLOCK))]
            self.consumer_tables[req] = [consumer_ids.pop() for _ in range(positions(n, CONSUMER_BLOCK))]
        self.unused_producer_blocks = producer_ids
        self.sources = [sorted({s[0] for s in rank}) for rank in head_sources]
        self.runs = {req: self._runs(req, head_sources) for req in requests}

    def _runs(self, req: str, head_sources) -> dict[str, np.ndarray]:
        parts = []
        tokens = np.arange(self.requests[req])
        for c, rank_sources in enumerate(head_sources):
            for remote_rank, remote_offset, local_offset, num_heads in rank_sources:
                i, layer, kv, t = (
                    a.ravel() for a in np.meshgrid(np.arange(num_heads), np.arange(LAYERS), (K, V), tokens, indexing="ij")
                )
                parts.append(
                    dict(c_rank=np.full_like(t, c), p_rank=np.full_like(t, remote_rank), layer=layer, kv=kv, token=t,
                         c_head=local_offset + i, p_head=remote_offset + i)
                )
        runs = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        t = runs["token"]
        runs["p_block"] = np.asarray(self.tables[req])[t // PRODUCER_BLOCK]
        runs["p_slot"] = t % PRODUCER_BLOCK
        runs["c_block"] = np.asarray(self.consumer_tables[req])[t // CONSUMER_BLOCK]
        runs["c_slot"] = t % CONSUMER_BLOCK
        return runs

    def faults(self) -> list[dict]:
        """harness.faults at this size: name, detail, runs, expected positions,
        payload of another request, the byte to flip after the load."""
        first, second = list(self.requests)
        runs, rng, out = self.runs[first], self.rng, []
        n = len(runs["token"])

        def pick(condition=None) -> int:
            while True:
                i = int(rng.integers(n))
                if condition is None or condition(i):
                    return i

        def replaced(i: int, **fields) -> dict:
            copy = {k: v.copy() for k, v in runs.items()}
            for k, value in fields.items():
                copy[k][i] = value
            return copy

        def where(i: int) -> str:
            head = kvcsum.rank_heads(int(runs["c_rank"][i]), CONSUMER_TP, KV_HEADS).start + int(runs["c_head"][i])
            return (f"consumer rank {runs['c_rank'][i]} layer {runs['layer'][i]} {'KV'[runs['kv'][i]]} head {head} "
                    f"token {runs['token'][i]}")

        def position(i: int) -> int:
            return int(runs["token"][i]) // CONSUMER_BLOCK

        i = pick()
        other = int(rng.choice(self.unused_producer_blocks))
        out.append(dict(name="wrong source block", detail=f"{where(i)} reads producer block {other}",
                        runs=replaced(i, p_block=other), expected={position(i)}))
        i = pick(lambda j: runs["p_slot"][j] < PRODUCER_BLOCK - 1)
        out.append(dict(name="descriptor one token off", detail=f"{where(i)} reads the next token's bytes",
                        runs=replaced(i, p_slot=runs["p_slot"][i] + 1), expected={position(i)}))
        i = pick()
        keep = np.ones(n, dtype=bool)
        keep[i] = False
        out.append(dict(name="run dropped", detail=f"{where(i)} left out of the list",
                        runs={k: v[keep] for k, v in runs.items()}, expected={position(i)}))
        table = self.consumer_tables[first]
        p1, p2 = sorted(int(q) for q in rng.choice(len(table), size=2, replace=False))
        swapped = {k: v.copy() for k, v in runs.items()}
        pos = runs["token"] // CONSUMER_BLOCK
        swapped["c_block"][pos == p1], swapped["c_block"][pos == p2] = table[p2], table[p1]
        out.append(dict(name="destinations swapped",
                        detail=f"position {p1} written to block {table[p2]} and position {p2} to block {table[p1]}",
                        runs=swapped, expected={p1, p2}))
        i = pick()
        byte, mask = int(rng.integers(ROW)), int(rng.integers(1, 256))
        flip = {k: int(runs[k][i]) for k in ("c_rank", "kv", "layer", "c_block", "c_slot", "c_head")}
        out.append(dict(name="byte flipped after the transfer", detail=f"{where(i)} byte {byte} xor {mask:#04x}",
                        runs=runs, expected={position(i)}, flip=(flip, byte, mask)))
        out.append(dict(name="notification carries another request's payload",
                        detail=f"{first}'s notifications carry {second}'s kv_checksums", runs=runs,
                        expected=set(range(self.requests[second] // CONSUMER_BLOCK)), other=second))
        return out


# --- Memory: torch on a GPU, numpy on the host ------------------------------------------


class Memory:
    def __init__(self, device: int | None, seed: int):
        self.device, self.kind = device, ("VRAM" if device is not None else "DRAM")
        if device is not None:
            import torch

            self.torch = torch
            torch.cuda.set_device(device)
            self.generator = torch.Generator(device=f"cuda:{device}").manual_seed(seed)
        self.rng = np.random.default_rng(seed)

    def empty(self, shape):
        if self.device is None:
            return np.empty(shape, dtype=np.uint16)
        return self.torch.empty(shape, dtype=self.torch.bfloat16, device=f"cuda:{self.device}")

    def fill(self, array) -> None:
        if self.device is None:
            array[...] = self.rng.integers(0, 1 << 16, array.shape, dtype=np.uint16)
        else:
            t = self.torch
            bits = t.randint(-(1 << 15), 1 << 15, array.shape, dtype=t.int16, device=array.device, generator=self.generator)
            array.copy_(bits.view(t.bfloat16))

    def address(self, array) -> int:
        return int(array.ctypes.data) if self.device is None else int(array.data_ptr())

    def nbytes(self, array) -> int:
        return int(array.nbytes) if self.device is None else array.numel() * array.element_size()

    def stream(self):
        return None if self.device is None else self.torch.cuda.current_stream(self.device).cuda_stream

    def sync(self) -> None:
        if self.device is not None:
            self.torch.cuda.synchronize(self.device)

    def flip(self, array, index: tuple, byte: int, mask: int) -> None:
        if self.device is None:
            array[index].view(np.uint8)[byte] ^= mask
        else:
            cell = array[index].view(self.torch.uint8)
            cell[byte] ^= mask
            self.sync()

    def worker(self, rank: int, tp: int) -> kvcsum.Worker:
        if self.device is None:
            return kvcsum.Worker(tp_rank=rank, tp_size=tp)
        return kvcsum.Worker(tp_rank=rank, tp_size=tp, device=self.device)


def byte_strides(shape) -> list[int]:
    out, step = [], ITEM
    for n in reversed(shape):
        out.append(step)
        step *= n
    return list(reversed(out))


# --- NIXL: one agent per process ---------------------------------------------------------

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def nixl():
    for module in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
        try:
            api = __import__(module, fromlist=["nixl_agent"])
            return api.nixl_agent, api.nixl_agent_config
        except ImportError:
            continue
    raise SystemExit("cannot import NIXL (pip install nixl-cu13==1.5.1 or nixl-cu12==1.5.1)")


class Endpoint:
    """A process's NIXL agent; metadata published to and read from `folder`."""

    def __init__(self, name: str, folder: str, memory: Memory):
        nixl_agent, config = nixl()
        self.name, self.folder, self.memory = name, folder, memory
        self.agent = nixl_agent(name, config(enable_prog_thread=False, backends=["UCX"]))

    def register(self, arrays) -> None:
        regions = [(self.memory.address(a), self.memory.nbytes(a), self.memory.device or 0, "") for a in arrays]
        self.agent.register_memory(regions, self.memory.kind)

    def publish(self, handshake: dict) -> None:
        for suffix, data in ((".json", json.dumps(handshake).encode()), (".meta", self.agent.get_agent_metadata())):
            path = os.path.join(self.folder, self.name + suffix)
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)

    def connect(self, peer: str) -> tuple[str, dict]:
        """Waits for `peer`'s published metadata; adds it; returns its name and handshake."""
        meta, deadline = os.path.join(self.folder, peer + ".meta"), time.monotonic() + WAIT_S
        while not os.path.exists(meta):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no metadata from {peer} after {WAIT_S} s")
            time.sleep(0.05)
        with open(os.path.join(self.folder, peer + ".json")) as f:
            handshake = json.load(f)
        with open(meta, "rb") as f:
            name = self.agent.add_remote_agent(f.read())
        return (name.decode() if isinstance(name, bytes) else name), handshake

    def messages(self) -> list[dict]:
        return [json.loads(m) for ms in self.agent.get_new_notifs().values() for m in ms]

    def wait_message(self) -> dict:
        deadline = time.monotonic() + WAIT_S
        while True:
            for m in self.messages():
                return m  # one command at a time: the peer waits for our answer
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no message after {WAIT_S} s")

    def send(self, peer: str, body: dict) -> None:
        self.agent.send_notif(peer, json.dumps(body).encode())


# --- The producer ------------------------------------------------------------------------


def producer(args) -> int:
    memory = Memory(None if args.host else 0, args.seed)
    heads = [kvcsum.rank_heads(r, PRODUCER_TP, KV_HEADS) for r in range(PRODUCER_TP)]
    endpoint = Endpoint("prefill", args.folder, memory)
    # Publish the handshake first: the consumer needs the block size and bytes for its topologies.
    shape_of = lambda blocks: (LAYERS, blocks, 2, len(heads[0]), PRODUCER_BLOCK, HEAD_DIM)  # noqa: E731
    block_bytes = int(np.prod(shape_of(1)[1:])) * ITEM
    endpoint.publish(dict(tp_size=PRODUCER_TP, block_size=PRODUCER_BLOCK, block_bytes=block_bytes))
    peer, handshake = endpoint.connect("decode")
    plan = Plan(args.seed, args.requests, handshake["head_sources"])
    caches = [memory.empty(shape_of(plan.producer_blocks)) for _ in range(PRODUCER_TP)]
    workers = []
    for rank, cache in enumerate(caches):
        memory.fill(cache)
        worker = memory.worker(rank, PRODUCER_TP)
        worker.add_region_of(cache)
        worker.add_group(GROUP, PRODUCER_BLOCK)
        for layer in range(LAYERS):
            worker.add_layer(kvcsum.layer(cache[layer], "BKHTD", layer_number=layer, first_head=heads[rank].start))
        workers.append(worker)
    memory.sync()
    endpoint.register(caches)

    # The scheduler's payloads, timed (the producer's checksum of the batch).
    timings = {"producer_checksum_s": []}
    for _ in range(3):
        start = time.perf_counter()
        with kvcsum.Blocks() as blocks, kvcsum.Verifier(PRODUCER_TP) as verifier:
            for req, n in args.requests.items():
                blocks.add_request(req, n).add_group(req, GROUP, plan.tables[req])
            verifier.expect(blocks, kvcsum.PRODUCER)
            results = [w.checksum(blocks, kvcsum.PRODUCER, cuda_stream=memory.stream()) for w in workers]
            for result in results:
                verifier.add_record(result.wait().encode())
                result.close()
            payloads = {req: kvcsum.base64_encode(verifier.payload(req)) for req in args.requests}
        timings["producer_checksum_s"].append(time.perf_counter() - start)

    p_strides = byte_strides(shape_of(plan.producer_blocks))
    p_base = [memory.address(c) for c in caches]
    c_strides = handshake["strides"]
    c_base = {K: handshake["k"], V: handshake["v"]}
    device_c = handshake["device"]
    faults = plan.faults()
    timings["transfers"] = []

    def rows(runs: dict, mask) -> tuple[np.ndarray, np.ndarray]:
        r = {k: v[mask] for k, v in runs.items()}
        src = (np.asarray(p_base, dtype=np.int64)[r["p_rank"]] + r["layer"] * p_strides[0] + r["p_block"] * p_strides[1]
               + r["kv"] * p_strides[2] + r["p_head"] * p_strides[3] + r["p_slot"] * p_strides[4])
        base = np.where(r["kv"] == K, np.asarray(c_base[K], dtype=np.int64)[r["c_rank"]],
                        np.asarray(c_base[V], dtype=np.int64)[r["c_rank"]])
        dst = (base + r["layer"] * c_strides[0] + r["c_block"] * c_strides[1] + r["c_slot"] * c_strides[2]
               + r["c_head"] * c_strides[3])
        n = len(src)
        length = np.full(n, ROW, dtype=np.uint64)
        source = np.stack([src.astype(np.uint64), length, np.full(n, memory.device or 0, dtype=np.uint64)], axis=1)
        target = np.stack([dst.astype(np.uint64), length, np.full(n, device_c, dtype=np.uint64)], axis=1)
        return np.ascontiguousarray(source), np.ascontiguousarray(target)

    def send(step: int, loads: dict[str, tuple[dict, np.ndarray | None, str]]) -> dict:
        """One WRITE per (producer rank, consumer rank) pair of each request,
        the payload text in its notification; returns the timing."""
        build = time.perf_counter()
        posts = []
        for req, (runs, selected, text) in loads.items():
            for c in range(CONSUMER_TP):
                for p in plan.sources[c]:
                    mask = (runs["c_rank"] == c) & (runs["p_rank"] == p)
                    if selected is not None:
                        mask &= selected
                    message = json.dumps(
                        {"req_id": req, "step": step, "pair": [p, c], "kv_transfer_params": {"kv_checksums": text}}
                    ).encode()
                    if mask.any():
                        source, target = rows(runs, mask)
                        posts.append((source, target, message))
                    else:
                        posts.append((None, None, message))
        start = time.perf_counter()
        handles, descriptors = [], 0
        for source, target, message in posts:
            if source is None:
                endpoint.agent.send_notif(peer, message)
                continue
            descriptors += len(source)
            handle = endpoint.agent.initialize_xfer(
                "WRITE", endpoint.agent.get_xfer_descs(source, memory.kind),
                endpoint.agent.get_xfer_descs(target, memory.kind), peer, message,
            )
            state = endpoint.agent.transfer(handle)
            if state == "ERR":
                raise RuntimeError(f"step {step}: a WRITE of {len(source)} descriptors failed to post")
            handles.append([handle, state])
        posted = time.perf_counter()
        while handles:
            for h in handles:
                if h[1] == "PROC":
                    h[1] = endpoint.agent.check_xfer_state(h[0])
                if h[1] == "ERR":
                    raise RuntimeError(f"step {step}: a WRITE failed")
            for h in [h for h in handles if h[1] == "DONE"]:
                h[0].release()
            handles = [h for h in handles if h[1] != "DONE"]
        done = time.perf_counter()
        return dict(step=step, descriptors=descriptors, bytes=descriptors * ROW, build_s=start - build,
                    post_s=posted - start, transfer_s=done - start)

    first = list(args.requests)[0]
    while True:
        command = endpoint.wait_message()
        if command["cmd"] == "quit":
            break
        step = command["step"]
        if command["cmd"] == "load":
            f = command["fault"]
            loads = {}
            for req in args.requests:
                runs, text = plan.runs[req], payloads[req]
                if f is not None and req == first:
                    runs = faults[f]["runs"]
                    text = payloads[faults[f]["other"]] if "other" in faults[f] else text
                loads[req] = (runs, None, text)
        else:  # repair: only the runs of the named blocks' tokens
            runs = plan.runs[first]
            selected = np.zeros(len(runs["token"]), dtype=bool)
            for block, first_token, num_tokens in command["blocks"]:
                selected |= (runs["c_block"] == block) & (runs["token"] >= first_token) & (
                    runs["token"] < first_token + num_tokens)
            loads = {first: (runs, selected, payloads[first])}
        timing = send(step, loads)
        timing["cmd"] = command["cmd"]
        timings["transfers"].append(timing)
    with open(os.path.join(args.folder, "prefill.timings"), "w") as f:
        json.dump(timings, f)
    return 0


# --- The consumer ------------------------------------------------------------------------


def consumer(args) -> int:
    import_device = None
    if not args.host:
        import torch

        import_device = 1 if torch.cuda.device_count() >= 2 else 0
    memory = Memory(import_device, args.seed + 1)
    endpoint = Endpoint("decode", args.folder, memory)
    peer, producer_handshake = endpoint.connect("prefill")
    remote = kvcsum.RemoteEngine(tp_size=producer_handshake["tp_size"], block_bytes=producer_handshake["block_bytes"],
                                 block_size=producer_handshake["block_size"])
    heads = [kvcsum.rank_heads(r, CONSUMER_TP, KV_HEADS) for r in range(CONSUMER_TP)]
    topologies, head_sources = [], []
    for rank in range(CONSUMER_TP):
        topology = kvcsum.Topology("decode", tp_rank=rank, tp_size=CONSUMER_TP, total_kv_heads=KV_HEADS,
                                   block_size=CONSUMER_BLOCK)
        topology.add_remote("prefill", remote)
        topologies.append(topology)
        sources = topology.head_sources("prefill")
        assert sorted({s.remote_rank for s in sources}) == topology.remote_ranks("prefill")
        head_sources.append([(s.remote_rank, s.remote_offset, s.local_offset, s.num_heads) for s in sources])
    plan = Plan(args.seed, args.requests, head_sources)
    shape = (LAYERS, plan.consumer_blocks, CONSUMER_BLOCK, len(heads[0]), HEAD_DIM)
    k = [memory.empty(shape) for _ in range(CONSUMER_TP)]
    v = [memory.empty(shape) for _ in range(CONSUMER_TP)]
    workers = []
    for rank in range(CONSUMER_TP):
        worker = memory.worker(rank, CONSUMER_TP)
        worker.add_region_of(k[rank])
        worker.add_region_of(v[rank])
        worker.add_group(GROUP, CONSUMER_BLOCK)
        for layer in range(LAYERS):
            worker.add_layer(kvcsum.layer(k[rank][layer], "NHD", layer_number=layer, first_head=heads[rank].start,
                                          v=v[rank][layer]))
        workers.append(worker)
    endpoint.register(k + v)
    endpoint.publish(dict(head_sources=head_sources, strides=byte_strides(shape), device=memory.device or 0,
                          k=[memory.address(a) for a in k], v=[memory.address(a) for a in v]))
    verifier = kvcsum.Verifier(CONSUMER_TP)
    verifier.set_producer_block_size(GROUP, topologies[0].remote("prefill").block_size)
    first, second = list(args.requests)
    where = f"GPU {memory.device}" if memory.device is not None else "host memory"
    print(f"consumer: {where}" + (" (two GPUs present)" if memory.device == 1 else
                                   " (one GPU: producer and consumer share GPU 0)" if memory.device == 0 else ""))
    for req in args.requests:
        n = len(plan.runs[req]["token"])
        print(f"{req}: {args.requests[req]} tokens, {positions(args.requests[req], PRODUCER_BLOCK)} producer blocks, "
              f"{len(plan.consumer_tables[req])} consumer blocks, {n} descriptors of {ROW} bytes ({n * ROW} bytes)")
    sys.stdout.flush()
    failed, timings, step = [], {"consumer_checksum_s": [], "load_s": []}, [0]

    def expect(ok: bool, what: str) -> None:
        if not ok:
            failed.append(what)
            print(f"  FAILED: {what}")

    def load(command: dict, reqs: list[str]) -> dict[str, str]:
        step[0] += 1
        command = dict(command, step=step[0])
        pairs = {req: {(p, c) for c in range(CONSUMER_TP) for p in plan.sources[c]} for req in reqs}
        heard = {req: set() for req in reqs}
        texts: dict[str, set] = {req: set() for req in reqs}
        start = time.perf_counter()
        endpoint.send(peer, command)
        deadline = time.monotonic() + WAIT_S
        while any(heard[r] != pairs[r] for r in reqs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step[0]}: heard {heard} after {WAIT_S} s")
            for m in endpoint.messages():
                assert m["step"] == step[0], m
                heard[m["req_id"]].add(tuple(m["pair"]))
                texts[m["req_id"]].add(m["kv_transfer_params"]["kv_checksums"])
        timings["load_s"].append(time.perf_counter() - start)
        for req, seen in texts.items():
            assert len(seen) == 1, f"{req}: its notifications carried {len(seen)} payloads"
        return {req: seen.pop() for req, seen in texts.items()}

    def check(texts: dict[str, str]) -> dict[str, kvcsum.Report]:
        start = time.perf_counter()
        with kvcsum.Blocks() as blocks:
            for req in texts:
                blocks.add_request(req, args.requests[req]).add_group(req, GROUP, plan.consumer_tables[req])
            verifier.expect(blocks, kvcsum.CONSUMER)
            results = [w.checksum(blocks, kvcsum.CONSUMER, cuda_stream=memory.stream()) for w in workers]
            for result in results:
                verifier.add_record(result.wait().encode())
                result.close()
        timings["consumer_checksum_s"].append(time.perf_counter() - start)
        return {req: verifier.check(req, text) for req, text in texts.items()}

    def scramble() -> None:
        for array in k + v:
            memory.fill(array)
        memory.sync()

    for attempt in ("intact load", "intact load again"):
        scramble()
        texts = load({"cmd": "load", "fault": None}, list(args.requests))
        reports = check(texts)
        print(f"{attempt}: " + "; ".join(f"{r} {describe(x, plan.consumer_tables[r])}" for r, x in reports.items()))
        for req, report in reports.items():
            expect(report.verdict == kvcsum.MATCH, f"{req}: intact load gives MATCH")
            wanted = positions(args.requests[req], CONSUMER_BLOCK)
            expect(report.compared_positions == wanted, f"{req}: all {wanted} positions compared")
    intact_checks = len(timings["consumer_checksum_s"])

    total = len(plan.runs[first]["token"]) * ROW
    for number, fault in enumerate([] if args.no_faults else plan.faults()):
        print(f"fault {number + 1}, {fault['name']}: {fault['detail']}")
        scramble()
        texts = load({"cmd": "load", "fault": number}, list(args.requests))
        if "flip" in fault:
            cell, byte, mask = fault["flip"]
            array = (k if cell["kv"] == K else v)[cell["c_rank"]]
            memory.flip(array, (cell["layer"], cell["c_block"], cell["c_slot"], cell["c_head"]), byte, mask)
        reports = check(texts)
        report = reports[first]
        print(f"  {first}: {describe(report, plan.consumer_tables[first])}")
        print(f"  {second}: {describe(reports[second], plan.consumer_tables[second])}")
        expect(reports[second].verdict == kvcsum.MATCH, f"{second} is untouched by a fault in {first}")
        expect(report.verdict == kvcsum.MISMATCH, f"{fault['name']} gives MISMATCH")
        expect(mismatched(report) == fault["expected"],
               f"{fault['name']} is localised to {sorted(fault['expected'])}, got {sorted(mismatched(report))}")
        if "other" in fault:
            continue
        repair = kvcsum.repair_plan(report, {GROUP: plan.consumer_tables[first]}, CONSUMER_BLOCK).get(GROUP, [])
        blocks = [(b.block_id, b.first_token, b.num_tokens) for b in repair]
        texts = load({"cmd": "repair", "blocks": blocks}, [first])
        after = check(texts)[first]
        sent = sum(n for _, _, n in blocks) * LAYERS * 2 * KV_HEADS * ROW
        print(f"  repair: positions {[b.position for b in repair]} (blocks {[b[0] for b in blocks]}), re-sent "
              f"{sent} of {total} bytes ({100 * sent / total:.1f}%) -> {describe(after, plan.consumer_tables[first])}")
        expect(after.verdict == kvcsum.MATCH, f"{fault['name']}: MATCH after the repair")
        expect(0 < sent < total, f"{fault['name']}: the repair re-sends part of the request")
    endpoint.send(peer, {"cmd": "quit"})
    timings["intact_checks"] = intact_checks
    with open(os.path.join(args.folder, "decode.timings"), "w") as f:
        json.dump(dict(timings, failed=failed), f)
    if failed:
        print(f"{len(failed)} expectation(s) failed (seed {args.seed}):")
        for what in failed:
            print(f"  {what}")
        return 1
    print("all expectations held")
    return 0


# --- The parent: starts both, prints the timings -----------------------------------------


def summary(folder: str, requests: dict[str, int]) -> None:
    with open(os.path.join(folder, "prefill.timings")) as f:
        p = json.load(f)
    with open(os.path.join(folder, "decode.timings")) as f:
        c = json.load(f)
    intact = [t for t in p["transfers"] if t["cmd"] == "load"][:2]  # the two intact loads
    batch = intact[-1]
    transfer = min(t["transfer_s"] for t in intact)
    produce = min(p["producer_checksum_s"])
    consume = min(c["consumer_checksum_s"][: c["intact_checks"]])
    gib = batch["bytes"] / (1 << 30)
    print(f"batch: {sum(requests.values())} tokens, {batch['bytes']} bytes ({gib:.3f} GiB) of KV, "
          f"{batch['descriptors']} descriptors of {ROW} bytes")
    print(f"descriptor lists built in {batch['build_s']:.3f} s (numpy); WRITEs posted in {batch['post_s']:.3f} s")
    print(f"transfer (post to all WRITEs done, best of 2): {transfer * 1e3:.2f} ms ({gib / transfer:.2f} GiB/s); "
          f"consumer's load (command to all notifications): {min(c['load_s'][:2]) * 1e3:.2f} ms")
    print(f"producer checksum (2 workers, best of 3): {produce * 1e3:.2f} ms ({100 * produce / transfer:.2f}% of "
          f"the transfer); consumer checksum (4 workers, best of 2): {consume * 1e3:.2f} ms "
          f"({100 * consume / transfer:.2f}%); both: {100 * (produce + consume) / transfer:.2f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", choices=["producer", "consumer"])
    parser.add_argument("folder", nargs="?")
    parser.add_argument("--seed", type=int, default=int(os.environ.get("KVCS_E2E_SEED") or
                                                         int.from_bytes(os.urandom(4), "little")))
    parser.add_argument("--tokens", default="1000,300", help="tokens of the two requests")
    parser.add_argument("--full", action="store_true", help="6000 + 2192 tokens: 1 GiB of KV")
    parser.add_argument("--no-faults", action="store_true", help="the two intact loads only (timing)")
    parser.add_argument("--host", action="store_true", help="host memory and host workers (no GPU)")
    args = parser.parse_args()
    tokens = [6000, 2192] if args.full else [int(t) for t in args.tokens.split(",")]
    args.requests = {"req-a": tokens[0], "req-b": tokens[1]}
    if args.role == "producer":
        return producer(args)
    if args.role == "consumer":
        return consumer(args)

    import tempfile

    print(f"seed {args.seed} (--seed {args.seed} repeats this run)")
    print(f"model: {LAYERS} layers, {KV_HEADS} KV heads of {HEAD_DIM} bf16; prefill: TP={PRODUCER_TP} HND "
          f"{PRODUCER_BLOCK}-token blocks on {'host' if args.host else 'GPU 0'} -> decode: TP={CONSUMER_TP} NHD, "
          f"K and V apart, {CONSUMER_BLOCK}-token blocks")
    sys.stdout.flush()
    with tempfile.TemporaryDirectory(prefix="kvcs-nixl-") as folder:
        extra = ["--seed", str(args.seed), "--tokens", ",".join(map(str, tokens))] + (["--host"] if args.host else []) + (
            ["--no-faults"] if args.no_faults else [])
        me = os.path.abspath(__file__)
        procs = [subprocess.Popen([sys.executable, me, role, folder] + extra) for role in ("producer", "consumer")]
        codes = [p.wait(timeout=1800) for p in procs]
        print(f"exit codes: producer {codes[0]}, consumer {codes[1]}")
        if codes == [0, 0]:
            summary(folder, args.requests)
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    status = main()
    # nixl 1.5.1's bundled libnl-route can crash in its destructor at exit
    # (see nixl_host.py): leave without running library destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
