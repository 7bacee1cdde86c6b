"""CPU time of the one library call a worker makes per decode step to keep
the values of the step's full blocks (kvcsum.vllm.tier_values.TierChecker
.store: `kvcsum.TierIndex.store_buffers` on a StoreBatch), on a host worker
and, where a CUDA GPU is present, on a device worker, over the model shape
of bench_connector.py (4 layers, 2 KV heads of 16 elements a rank, fp16,
16-token blocks, the LBNHC layout, 3,136 blocks) with torch alone (no
vLLM): what bench_connector.py's `--store-call` column measures on the CPU
machine, and what the same call costs where the caches are on a GPU (the
checksum a kernel queued on torch's stream; its values read by a later
call).

Each call stores 16 random full blocks (a decode step of 256 requests
filling a sixteenth); between calls a 64 MiB buffer is written ("cold":
the caches of the CPU as a forward leaves them) or not ("warm"). Times are
the calling thread's CPU time (time.thread_time_ns), medians and the 90th
percentile over the calls, in microseconds.

    KVCSUM_LIBRARY=$PWD/target/release/libkvcsum.so PYTHONPATH=$PWD/python \\
        python3 python/tests/vllm/bench_tier_store.py [--calls 300] [--blocks 16]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from kvcsum.vllm.tier_values import StoreBatch, TierChecker  # noqa: E402
from layouts import checksummer, lay_out, layer_specs, logical_caches  # noqa: E402

LAYERS, HEADS, HEAD, BLOCK, NUM_BLOCKS = 4, 2, 16, 16, 256 * 12 + 64


def measure(device: str, calls: int, blocks: int, cold: bool, seed: int) -> tuple:
    rng = random.Random(seed)
    logical = logical_caches(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, seed=seed)
    specs = layer_specs(LAYERS, BLOCK, HEADS, HEAD, total_kv_heads=2 * HEADS)
    caches = lay_out(logical, "LBNHC", device=device)
    tier = TierChecker(checksummer(specs, caches, NUM_BLOCKS, BLOCK, tp_rank=0, tp_size=2))
    junk = torch.zeros(64 << 20, dtype=torch.uint8)
    times = []
    for _ in range(calls):
        ids = rng.sample(range(1, NUM_BLOCKS), blocks)
        batch = StoreBatch.of_lists([0] * blocks, [rng.randrange(0, 7) for _ in ids], ids, [rng.randbytes(32) for _ in ids])
        if cold:
            junk.add_(1)
        start = time.thread_time_ns()
        tier.store(batch)
        times.append((time.thread_time_ns() - start) / 1000)
    tier.settle(wait=True)
    kept = tier.index.info()
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.9)], kept


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--seed", type=int, default=int(os.environ.get("KVCSUM_SEED", "1")))
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"{args.blocks} full blocks a call, {args.calls} calls, seed {args.seed}; CPU time of the calling thread, us")
    print()
    print("| worker | caches | median | 90th percentile | entries kept |")
    print("|---|---|---:|---:|---:|")
    for device in devices:
        for cold in (False, True):
            median, p90, info = measure(device, args.calls, args.blocks, cold, args.seed)
            where = "host" if device == "cpu" else torch.cuda.get_device_name()
            print(f"| {where} | {'cold' if cold else 'warm'} | {median:,.1f} | {p90:,.1f} | {info['entries']:,} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
