"""CPU time of KvcsumConnector per engine step, scheduler and worker, at 256
running requests, against the wrapped connector alone.

One engine of the vLLM test harness (vLLM 0.33.0's real Scheduler and
worker glue, KV caches in CPU memory, TP 1, 16-token blocks, 4 layers of 4
KV heads of 16 elements, fp16) with 256 requests of 100 to 115 prompt tokens,
decoding (a sixteenth of them fill a block each step). The wrapped connector is a null connector (it loads and stores
nothing), so "wrapped alone" is vLLM's calls into a connector and the
difference is kvcsum's work: every block that becomes full is checksummed
(on the host here, since the caches are in CPU memory: on a GPU that work
is a kernel queued on the stream, and the worker's CPU time is the call),
its values kept, and the scheduler's metadata built. Only time spent
inside the connectors' calls is counted (time.process_time of this
process, which runs scheduler and worker alike), per step, median and
mean over the decode steps.

    cd build && PYTHONPATH=$PWD/../python KVCSUM_LIBRARY=$PWD/../target/release/libkvcsum.so \\
        VLLM_LOGGING_LEVEL=ERROR ./vllm-venv/bin/python ../python/tests/vllm/bench_connector.py [--requests 256] [--steps 48]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import Engine, KVCacheLayout  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata  # noqa: E402


class NullMetadata(KVConnectorMetadata):
    pass


class NullConnector(KVConnectorBase_V1):
    """Loads and stores nothing."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return

    def build_connector_meta(self, scheduler_output):
        return NullMetadata()

    def start_load_kv(self, forward_context, **kwargs):
        return

    def wait_for_layer_load(self, layer_name):
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        return


SCHEDULER_CALLS = [
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
    "request_finished", "request_finished_all_groups", "on_new_request", "get_kv_connector_stats", "take_events",
]
WORKER_CALLS = [
    "bind_connector_metadata", "start_load_kv", "wait_for_save", "get_transfer_results",
    "get_block_ids_with_load_errors", "build_connector_worker_meta", "clear_connector_metadata",
    "get_kv_connector_stats", "get_kv_connector_kv_cache_events",
]


class Clock:
    def __init__(self):
        self.seconds = 0.0

    def wrap(self, connector, names):
        for name in names:
            method = getattr(connector, name, None)
            if method is None:
                continue

            def timed(*args, _method=method, **kwargs):
                start = time.process_time()
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.seconds += time.process_time() - start

            setattr(connector, name, timed)


def measure(wrap: bool, requests: int, steps: int) -> dict:
    inner = {"kv_connector": "NullConnector", "kv_connector_module_path": __name__ if __name__ != "__main__" else "bench_connector"}
    engine = Engine(
        "bench", role="kv_both", tp=1, block_size=16, layout=KVCacheLayout.LBNHC, store_dir="", inner=inner, wrap=wrap,
        num_blocks=requests * 12 + 64, max_num_seqs=requests, max_batched_tokens=8192,
    )
    scheduler_clock, worker_clock = Clock(), Clock()
    scheduler_clock.wrap(engine.scheduler.connector, SCHEDULER_CALLS)
    for rank in engine.ranks:
        worker_clock.wrap(rank.connector, WORKER_CALLS)
    for r in range(requests):
        # Prompts of 100 to 115 tokens: a sixteenth of the requests fill a
        # block in each decode step, as requests out of lockstep do.
        engine.add_request(f"r{r}", [11 + (r * 31 + i * 7) % 900 for i in range(100 + r % 16)], steps + 40)
    samples = []
    while len(samples) < steps:
        before = (scheduler_clock.seconds, worker_clock.seconds)
        engine.step()
        running = len(engine.scheduler.running)
        decoding = all(len(t.output_tokens) > 0 for t in engine.traces.values())
        if decoding and running == requests:
            samples.append((scheduler_clock.seconds - before[0], worker_clock.seconds - before[1]))
    engine.close()
    sched = [s for s, _ in samples]
    work = [w for _, w in samples]
    return {
        "scheduler_median_us": statistics.median(sched) * 1e6,
        "scheduler_mean_us": statistics.mean(sched) * 1e6,
        "worker_median_us": statistics.median(work) * 1e6,
        "worker_mean_us": statistics.mean(work) * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    print(f"{args.requests} running requests, {args.steps} decode steps, 16-token blocks ({args.requests // 16} blocks fill a step)")
    for wrap in (False, True):
        m = measure(wrap, args.requests, args.steps)
        label = "KvcsumConnector(NullConnector)" if wrap else "NullConnector alone          "
        print(
            f"{label}: scheduler {m['scheduler_median_us']:8.0f} us a step (mean {m['scheduler_mean_us']:8.0f}), "
            f"worker {m['worker_median_us']:8.0f} us a step (mean {m['worker_mean_us']:8.0f})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
