#!/usr/bin/env python3
"""A verified KV transfer over NIXL, from a connector's point of view.

A prefill engine (TP=2, HND, 16-token blocks) sends one request's KV to a
decode engine (TP=4, NHD with K and V apart, 32-token blocks) with NIXL
WRITEs in host memory; both sides checksum their own layout with kvcsum,
and the producer's checksums travel in the NIXL notification as vLLM's
connectors carry kv_transfer_params["kv_checksums"]. The decode side's
verifier says MATCH. Everything runs in this one process, one NIXL agent
per TP rank.

Run from the repository root (`make e2e-test` sets up build/venv with
numpy and nixl-cu12; `make lib` builds the library):

    PYTHONPATH=python build/venv/bin/python examples/python/nixl_transfer.py

The full test, with faults injected through the agent and repaired, is
python/tests/e2e/ (harness.py, nixl_agent.py).
"""

import json
import time

import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config

import kvcsum

LAYERS, KV_HEADS, HEAD_DIM = 4, 8, 64  # bf16-sized elements: 128 bytes of K, 128 of V per head and token
ROW = HEAD_DIM * 2
REQ, NUM_TOKENS = "req-0", 100
rng = np.random.default_rng(2024)


def agent(name, arrays):
    """A NIXL agent (UCX) with `arrays` registered; polling it makes progress."""
    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    a.register_memory([(x.ctypes.data, x.nbytes, 0, "") for x in arrays], "DRAM")
    return a


def at(array, *index):
    """Address of array[index...]."""
    return array.ctypes.data + sum(i * s for i, s in zip(index, array.strides))


# --- Prefill: TP=2, FlashInfer HND [layers][blocks, 2 (K, V), heads, 16, 64] ---
P_TP, P_BLOCK = 2, 16
p_heads = len(kvcsum.rank_heads(0, P_TP, KV_HEADS))
p_cache = [rng.integers(0, 1 << 16, (LAYERS, 16, 2, p_heads, P_BLOCK, HEAD_DIM), dtype=np.uint16) for _ in range(P_TP)]
p_blocks = [3, 9, 0, 12, 5, 7, 14]  # the request's block table (100 tokens = 7 blocks)
p_agents = [agent(f"prefill-{r}", [p_cache[r]]) for r in range(P_TP)]

with kvcsum.Blocks() as blocks, kvcsum.Verifier(P_TP) as verifier:
    blocks.add_request(REQ, NUM_TOKENS).add_group(REQ, 0, p_blocks)
    verifier.expect(blocks, kvcsum.PRODUCER)  # the scheduler's side
    for rank in range(P_TP):  # each worker checksums what it holds, records go to the scheduler
        with kvcsum.Worker(tp_rank=rank, tp_size=P_TP) as worker:
            worker.add_region_of(p_cache[rank])
            worker.add_group(0, P_BLOCK)
            first = kvcsum.rank_heads(rank, P_TP, KV_HEADS).start
            for layer in range(LAYERS):
                worker.add_layer(kvcsum.layer(p_cache[rank][layer], "BKHTD", layer_number=layer, first_head=first))
            with worker.checksum(blocks, kvcsum.PRODUCER) as result:
                verifier.add_record(result.encode())
    kv_checksums = kvcsum.base64_encode(verifier.payload(REQ))  # kv_transfer_params["kv_checksums"]

# --- Decode: TP=4, NHD with K and V apart, [layers][blocks, 32, heads, 64] each ---
D_TP, D_BLOCK = 4, 32
d_heads = len(kvcsum.rank_heads(0, D_TP, KV_HEADS))
d_k = [np.zeros((LAYERS, 8, D_BLOCK, d_heads, HEAD_DIM), dtype=np.uint16) for _ in range(D_TP)]
d_v = [np.zeros_like(k) for k in d_k]
d_blocks = [6, 2, 4, 1]  # 100 tokens = 4 blocks of 32
d_agents = [agent(f"decode-{r}", [d_k[r], d_v[r]]) for r in range(D_TP)]

# --- Handshake and descriptors, per decode rank, from the topology helpers ---
pending, expected = [], {}
for rank in range(D_TP):
    topology = kvcsum.Topology("decode", tp_rank=rank, tp_size=D_TP, total_kv_heads=KV_HEADS, block_size=D_BLOCK)
    topology.add_remote("prefill", kvcsum.RemoteEngine(tp_size=P_TP, block_bytes=p_cache[0][0, 0].nbytes,
                                                        block_size=P_BLOCK))
    expected[f"decode-{rank}"] = {f"prefill-{p}" for p in topology.remote_ranks("prefill")}
    rows = {}  # prefill rank -> [(source address, destination address)]
    for source in topology.head_sources("prefill"):  # which prefill rank holds each run of my heads
        for i in range(source.num_heads):
            p_head, d_head = source.remote_offset + i, source.local_offset + i
            for layer in range(LAYERS):
                for kv, d_cache in ((0, d_k[rank]), (1, d_v[rank])):
                    for t in range(NUM_TOKENS):  # HND -> NHD: one token of one head is a contiguous run
                        src = at(p_cache[source.remote_rank], layer, p_blocks[t // P_BLOCK], kv, p_head, t % P_BLOCK)
                        dst = at(d_cache, layer, d_blocks[t // D_BLOCK], t % D_BLOCK, d_head)
                        rows.setdefault(source.remote_rank, []).append((src, dst))
    for p, pairs in rows.items():  # the prefill rank's agent WRITEs into this decode rank
        sender = p_agents[p]
        peer = sender.add_remote_agent(d_agents[rank].get_agent_metadata())
        src = sender.get_xfer_descs([(s, ROW, 0) for s, _ in pairs], "DRAM")  # (address, length, device 0)
        dst = sender.get_xfer_descs([(d, ROW, 0) for _, d in pairs], "DRAM")
        notif = json.dumps({"req_id": REQ, "kv_transfer_params": {"kv_checksums": kv_checksums}}).encode()
        handle = sender.initialize_xfer("WRITE", src, dst, peer, notif)
        pending.append((sender, handle, sender.transfer(handle)))

# --- Decode: wait for every write and every notification, then verify ---
heard, texts, deadline = {name: set() for name in expected}, set(), time.monotonic() + 30
while pending or any(heard[name] != expected[name] for name in expected):
    assert time.monotonic() < deadline, "transfer timed out"
    pending = [(a, h, a.check_xfer_state(h)) for a, h, state in pending if state != "DONE"]
    assert all(state != "ERR" for _, _, state in pending), "a transfer failed"
    for d_agent in d_agents:
        for sender, messages in d_agent.get_new_notifs().items():
            for message in messages:
                heard[d_agent.name].add(sender)
                texts.add(json.loads(message)["kv_transfer_params"]["kv_checksums"])

with kvcsum.Blocks() as blocks, kvcsum.Verifier(D_TP) as verifier:
    blocks.add_request(REQ, NUM_TOKENS).add_group(REQ, 0, d_blocks)
    verifier.expect(blocks, kvcsum.CONSUMER)
    verifier.set_producer_block_size(0, P_BLOCK)  # from the handshake: 16-token positions line up in pairs
    for rank in range(D_TP):
        with kvcsum.Worker(tp_rank=rank, tp_size=D_TP) as worker:
            worker.add_region_of(d_k[rank])
            worker.add_region_of(d_v[rank])
            worker.add_group(0, D_BLOCK)
            first = kvcsum.rank_heads(rank, D_TP, KV_HEADS).start
            for layer in range(LAYERS):
                worker.add_layer(
                    kvcsum.layer(d_k[rank][layer], "NHD", layer_number=layer, first_head=first, v=d_v[rank][layer])
                )
            with worker.checksum(blocks, kvcsum.CONSUMER) as result:
                verifier.add_record(result.encode())
    [text] = texts
    with verifier.check(REQ, text) as report:
        print(f"{REQ}: {report.verdict_name}, {report.compared_positions} positions compared: {report.message}")
        raise SystemExit(0 if report.passed else 1)
