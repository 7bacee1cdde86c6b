"""The cost of the producer's re-check of a sent request (kvcsum.vllm.source_check),
per request and worker, on the CPU (or a GPU with --device cuda), with torch
and kvcsum alone (no vLLM engine):

- "payload": the producer checksum every sent request already has (the
  call, the wait, the record);
- "keep": what the re-check adds to it on every producer request: reading
  the checksums' values to keep them (WorkerSourceCheck.collect);
- "recheck": what it adds once the send is over: checksumming the blocks
  again, reading the values and comparing (sending_finished + notes).

Not a test (not collected). Run, from the repository root, after
`cargo build --release --lib`:

    KVCSUM_LIBRARY=$PWD/target/release/libkvcsum.so PYTHONPATH=$PWD/python \\
        build/vllm-venv/bin/python python/tests/vllm/source_check_cost.py [--device cuda] [--repeat 30]

Prints one line per case: median and 90th percentile milliseconds of each
part, over --repeat requests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import kvcsum  # noqa: E402
from kvcsum.vllm.cache_checksums import Job  # noqa: E402
from kvcsum.vllm.source_check import WorkerSourceCheck  # noqa: E402
from layouts import checksummer, lay_out, layer_specs, logical_caches  # noqa: E402

#: (name, layers, KV heads of the worker, head size, block size, prompt tokens)
CASES = (
    ("the vLLM test's producer worker (TP 2 of 4 heads)", 4, 2, 16, 8, 45),
    ("Llama-3-8B-like worker (TP 1), 1k-token prompt", 32, 8, 128, 16, 1024),
    ("Llama-3-8B-like worker (TP 1), 4k-token prompt", 32, 8, 128, 16, 4096),
)


def _ms(values: list) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{1000 * statistics.median(ordered):8.3f} ms (p90 {1000 * p90:8.3f})"


def run_case(name, layers, heads, head, block, tokens, device: str, repeat: int) -> str:
    num_blocks = -(-tokens // block) + 8
    logical = logical_caches(layers, num_blocks, heads, block, 2 * head, seed=7)
    caches = lay_out(logical, "LBNHC", device=device)
    del logical
    worker = checksummer(layer_specs(layers, block, heads, head), caches, num_blocks, block)
    check = WorkerSourceCheck(worker, "pp0.tp0")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    payload, keep, recheck = [], [], []
    for i in range(repeat + 2):
        job = Job(f"req-{i}", tokens, {0: (0, list(range(1, 1 + -(-tokens // block))))})
        sync()
        t0 = time.perf_counter()
        pending = worker.checksum([job], kvcsum.PRODUCER)
        pending.wait()
        t1 = time.perf_counter()
        check.made(job, pending)
        check.collect()  # the result is ready: this reads its values
        t2 = time.perf_counter()
        pending.record()
        t3 = time.perf_counter()
        check.sending_finished([job.req_id])
        [note] = check.notes()
        sync()
        t4 = time.perf_counter()
        assert not note.changed and not note.error and note.num_blocks == len(job.groups[0][1]), note
        if i >= 2:  # the first calls warm up
            payload.append((t1 - t0) + (t3 - t2))
            keep.append(t2 - t1)
            recheck.append(t4 - t3)
    worker.close()
    size = layers * len(job.groups[0][1]) * heads * block * 2 * head * 2
    return (
        f"{name}: {len(job.groups[0][1])} blocks, {size / 2**20:.2f} MiB of KV | payload {_ms(payload)} | "
        f"keep {_ms(keep)} | recheck {_ms(recheck)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    print(f"kvcsum {kvcsum.__version__}, device {args.device}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    for case in CASES:
        print(run_case(*case, device=args.device, repeat=args.repeat), flush=True)


if __name__ == "__main__":
    main()
