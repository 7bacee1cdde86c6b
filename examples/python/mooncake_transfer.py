#!/usr/bin/env python3
"""A verified KV transfer over Mooncake's Transfer Engine, from a connector's
point of view.

A prefill engine (TP=2, HND, 16-token blocks) sends one request's KV to a
decode engine (TP=4, NHD with K and V apart, 32-token blocks) with
batch_transfer_sync_write in host memory (TCP transport, peers found by P2P
handshake: no metadata server); both sides checksum their own layout with
kvcsum. Mooncake attaches no message to a write, so the producer's
checksums travel beside it, as Mooncake's connectors carry
kv_transfer_params: here a socket pair per decode rank, written once the
write returned. The decode side's verifier says MATCH. Everything runs in
this one process, one transfer engine per TP rank.

Run from the repository root (`make e2e-test` sets up build/venv with
numpy and mooncake-transfer-engine-non-cuda, which needs the system's
libibverbs1; `make lib` builds the library):

    PYTHONPATH=python build/venv/bin/python examples/python/mooncake_transfer.py

The full test, with faults injected through the agent and repaired, is
python/tests/e2e/ (harness.py, mooncake_agent.py).
"""

import json
import os
import socket

import numpy as np

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
from mooncake.engine import TransferEngine  # noqa: E402

import kvcsum  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 4, 8, 64  # bf16-sized elements: 128 bytes of K, 128 of V per head and token
ROW = HEAD_DIM * 2
REQ, NUM_TOKENS = "req-0", 100
CHUNK = 1024  # descriptors per batch: the TCP transport queues at most 1024 per peer
rng = np.random.default_rng(2024)


def engine(arrays):
    """A transfer engine (TCP, P2P handshake) with `arrays` registered, and
    the segment name peers write to it by."""
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, "TransferEngine.initialize failed"
    for x in arrays:
        assert e.register_memory(x.ctypes.data, x.nbytes) == 0, "register_memory failed"
    return e, f"127.0.0.1:{e.get_rpc_port()}"


def at(array, *index):
    """Address of array[index...]."""
    return array.ctypes.data + sum(i * s for i, s in zip(index, array.strides))


# --- Prefill: TP=2, FlashInfer HND [layers][blocks, 2 (K, V), heads, 16, 64] ---
P_TP, P_BLOCK = 2, 16
p_heads = len(kvcsum.rank_heads(0, P_TP, KV_HEADS))
p_cache = [rng.integers(0, 1 << 16, (LAYERS, 16, 2, p_heads, P_BLOCK, HEAD_DIM), dtype=np.uint16) for _ in range(P_TP)]
p_blocks = [3, 9, 0, 12, 5, 7, 14]  # the request's block table (100 tokens = 7 blocks)
p_engines = [engine([p_cache[r]])[0] for r in range(P_TP)]

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
d_engines = [engine([d_k[r], d_v[r]]) for r in range(D_TP)]

# --- Handshake and descriptors, per decode rank, from the topology helpers ---
texts = set()
for rank in range(D_TP):
    topology = kvcsum.Topology("decode", tp_rank=rank, tp_size=D_TP, total_kv_heads=KV_HEADS, block_size=D_BLOCK)
    topology.add_remote("prefill", kvcsum.RemoteEngine(tp_size=P_TP, block_bytes=p_cache[0][0, 0].nbytes,
                                                        block_size=P_BLOCK))
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
    side_send, side_recv = socket.socketpair()  # the side channel into this decode rank
    segment = d_engines[rank][1]
    for p, pairs in rows.items():  # the prefill rank's engine writes into this decode rank
        for s in range(0, len(pairs), CHUNK):
            src, dst = zip(*pairs[s : s + CHUNK])
            status = p_engines[p].batch_transfer_sync_write(segment, list(src), list(dst), [ROW] * len(src))
            assert status == 0, f"batch_transfer_sync_write returned {status}"
        # The bytes are there: kv_transfer_params beside the transfer, one JSON line.
        side_send.sendall(json.dumps({"req_id": REQ, "kv_transfer_params": {"kv_checksums": kv_checksums}}).encode()
                          + b"\n")
    side_send.close()
    with side_recv, side_recv.makefile("rb") as lines:  # decode: one line per prefill rank it reads from
        heard = [json.loads(line)["kv_transfer_params"]["kv_checksums"] for line in lines]
    assert len(heard) == len(topology.remote_ranks("prefill")), f"decode rank {rank} heard {len(heard)} producers"
    texts.update(heard)

# --- Decode: verify ---
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
