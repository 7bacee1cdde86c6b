"""CPU time of KvcsumConnector's workers in the engine step of a sync P/D
load, against the wrapped connector alone.

The vLLM test harness (vLLM 0.33.0's real Scheduler and worker glue, KV
caches in CPU memory, 16-token blocks, 4 layers of 4 KV heads of 16
elements, fp16): a producer (TP 1) prefills requests of `--tokens` prompt
tokens; a consumer of TP `--tp` loads each through the test's
StoreConnector in sync mode (inside the step), one request a step. Counted
is the time spent inside the consumer's worker connector calls of the load
step but start_load_kv (where the wrapped connector reads its files),
summed over its ranks (time.process_time of this process, which runs
every rank), median over `--loads` loads: bare StoreConnector, and
KvcsumConnector around it. The difference is kvcsum's work in that step:
the checksums of the loaded blocks (on the host here, since the caches are
in CPU memory: on a GPU that is a kernel queued on the stream, and the
worker's CPU time is the call and the wait), the records' exchange (the
harness's in-process one) and the verdict on the judging worker
("judging" below: WorkerRole._judge_sync_loads, the wait for the records
and their encoding included, all ranks and the judging worker's alone).
Medians per call as well, summed over the ranks, and the scheduler's
update_connector_output of that step. The same script runs on a tree
before the workers judged sync loads (no "judging" there): the records
were encoded in build_connector_worker_meta and judged in the scheduler.

    cd build && PYTHONPATH=$PWD/../python KVCSUM_LIBRARY=$PWD/../target/release/libkvcsum.so \\
        VLLM_LOGGING_LEVEL=ERROR ./vllm-venv/bin/python ../python/tests/vllm/bench_sync_load.py [--tp 4] [--tokens 1025] [--loads 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
from bench_connector import WORKER_CALLS, Clock  # noqa: E402
from harness import Engine, KVCacheLayout  # noqa: E402


#: The worker calls where a sync load's checksums, wait and verdict fall.
CALLS = ["wait_for_save", "get_block_ids_with_load_errors", "build_connector_worker_meta"]


def measure(wrap: bool, tp: int, tokens: int, loads: int) -> dict:
    store = tempfile.mkdtemp(prefix="kvcsum-bench-sync-")
    try:
        blocks = loads * (tokens // 16 + 4) + 64
        p = Engine(
            "producer", role="kv_producer", tp=1, block_size=16, layout=KVCacheLayout.LBNHC, store_dir=store, wrap=wrap,
            num_blocks=tokens // 16 + 64, max_batched_tokens=max(2048, tokens + 16),
        )
        prompts = [[11 + (r * 31 + i * 7) % 900 for i in range(tokens)] for r in range(loads)]
        params = []
        for r, prompt in enumerate(prompts):
            p.add_request(f"r{r}", prompt, 1, {"do_remote_decode": True})
            p.run()
            params.append(dict(p.traces[f"r{r}"].kv_transfer_params))
        p.close()
        c = Engine(
            "consumer", role="kv_consumer", tp=tp, block_size=16, layout=KVCacheLayout.LBHNC, store_dir=store, wrap=wrap,
            load_mode="sync", num_blocks=blocks, max_batched_tokens=max(2048, tokens + 16),
        )
        worker_clock, judge_clock, judging_worker, scheduler_clock = Clock(), Clock(), Clock(), Clock()
        calls = {name: Clock() for name in CALLS}
        for rank in c.ranks:
            # Not start_load_kv: kvcsum only passes it on, and the wrapped
            # connector's file reads there would drown what kvcsum adds.
            worker_clock.wrap(rank.connector, [name for name in WORKER_CALLS if name != "start_load_kv"])
            for name, clock in calls.items():
                clock.wrap(rank.connector, [name])
            if wrap:
                judge_clock.wrap(rank.connector.worker_role, ["_judge_sync_loads"])
        if wrap:
            # The harness's judging worker is the last rank (harness.py).
            judging_worker.wrap(c.ranks[-1].connector.worker_role, ["_judge_sync_loads"])
        scheduler_clock.wrap(c.scheduler.connector, ["update_connector_output"])
        clocks = {
            "workers": worker_clock, "judging": judge_clock, "judging worker": judging_worker,
            "scheduler update": scheduler_clock, **calls,
        }
        samples = {name: [] for name in clocks}
        for r, prompt in enumerate(prompts):
            c.add_request(f"r{r}", prompt, 2, params[r])
            before = {name: clock.seconds for name, clock in clocks.items()}
            c.step()  # the load step
            for name, clock in clocks.items():
                samples[name].append(clock.seconds - before[name])
            c.run()
            if wrap:
                assert c.connector().last_verdicts[f"r{r}"][0] == kvcsum.MATCH, c.connector().last_verdicts[f"r{r}"]
        c.close()
        return {name: statistics.median(values) * 1e6 for name, values in samples.items()}
    finally:
        shutil.rmtree(store, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1025)
    parser.add_argument("--loads", type=int, default=20)
    args = parser.parse_args()
    print(f"consumer TP {args.tp}, sync loads of {args.tokens - 1} tokens ({(args.tokens - 1) // 16} blocks), {args.loads} loads")
    results = {wrap: measure(wrap, args.tp, args.tokens, args.loads) for wrap in (False, True)}
    for wrap, label in ((False, "StoreConnector alone           "), (True, "KvcsumConnector(StoreConnector)")):
        m = results[wrap]
        parts = ", ".join(f"{name} {m[name]:.0f}" for name in CALLS)
        print(
            f"{label}: workers {m['workers']:8.0f} us in the load step, all ranks ({parts}; judging {m['judging']:.0f}, "
            f"on the judging worker {m['judging worker']:.0f}); "
            f"scheduler update_connector_output {m['scheduler update']:.0f} us",
            flush=True,
        )
    print(f"added by kvcsum to the workers: {results[True]['workers'] - results[False]['workers']:.0f} us (medians)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
