"""CPU time of KvcsumConnector per engine step, scheduler and each worker,
against vLLM's own scheduler time in the same run and against the wrapped
connector alone.

One engine of the vLLM test harness (vLLM 0.33.0's real Scheduler and
worker glue, KV caches in CPU memory, TP 2 by default, 16-token blocks, 4
layers of 4 KV heads of 16 elements, fp16) with N running requests of 100
to 115 prompt tokens, decoding: a sixteenth of them fill a block each step
(requests out of lockstep), the connector's default settings. The wrapped
connector is a null connector (it loads and stores nothing), so "wrapped
alone" is vLLM's calls into a connector and the difference is kvcsum's
work: every block that becomes full is checksummed (on the host here, since
the caches are in CPU memory: on a GPU that work is a kernel queued on the
stream, and the worker's CPU time is the call), its value kept, and the
scheduler's metadata built.

Times are CPU time of this process (time.process_time, which counts the
host checksum threads too) per decode step, medians over the decode steps:

- vLLM's own scheduler: Scheduler.schedule + Scheduler.update_from_output,
  less the connector calls made inside them, in the run with kvcsum;
- connector, scheduler: inside the scheduler connector's calls;
- connector, worker: inside one worker connector's calls (the slowest rank).

kvcsum's added time is the run with it less the run with the null
connector alone, and its share is that over vLLM's own scheduler time.
`--lockstep` gives every request the same prompt length, so that most
steps fill no block: those steps are reported apart ("no block fills").

    cd build && PYTHONPATH=$PWD/../python KVCSUM_LIBRARY=$PWD/../target/release/libkvcsum.so \\
        VLLM_LOGGING_LEVEL=ERROR ./vllm-venv/bin/python ../python/tests/vllm/bench_connector.py \\
        [--requests 256 1024] [--steps 48] [--tp 2] [--lockstep]
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


def measure(wrap: bool, requests: int, steps: int, tp: int, lockstep: bool) -> dict:
    """Per decode step with every request running: (vLLM's own scheduler
    time, the scheduler connector's, the slowest worker connector's, the
    blocks that became full), in seconds, one tuple a step."""
    inner = {"kv_connector": "NullConnector", "kv_connector_module_path": __name__ if __name__ != "__main__" else "bench_connector"}
    engine = Engine(
        "bench", role="kv_both", tp=tp, block_size=16, layout=KVCacheLayout.LBNHC, store_dir="", inner=inner, wrap=wrap,
        num_blocks=requests * 12 + 64, max_num_seqs=requests, max_batched_tokens=8192,
    )
    scheduler_clock, vllm_clock = Clock(), Clock()
    worker_clocks = [Clock() for _ in engine.ranks]
    scheduler_clock.wrap(engine.scheduler.connector, SCHEDULER_CALLS)
    vllm_clock.wrap(engine.scheduler, ["schedule", "update_from_output"])
    for clock, rank in zip(worker_clocks, engine.ranks):
        clock.wrap(rank.connector, WORKER_CALLS)
    for r in range(requests):
        # Prompts of 100 to 115 tokens: a sixteenth of the requests fill a
        # block in each decode step, as requests out of lockstep do.
        length = 100 if lockstep else 100 + r % 16
        engine.add_request(f"r{r}", [11 + (r * 31 + i * 7) % 900 for i in range(length)], steps + 40)
    samples = []
    while len(samples) < steps:
        before = (scheduler_clock.seconds, vllm_clock.seconds, [c.seconds for c in worker_clocks])
        engine.step()
        running = len(engine.scheduler.running)
        decoding = all(len(t.output_tokens) > 0 for t in engine.traces.values())
        if decoding and running == requests:
            connector = scheduler_clock.seconds - before[0]
            # A full block: a request whose tokens reached a multiple of 16.
            filled = sum(1 for t in engine.traces.values() if t.scheduled and sum(t.scheduled[-1]) % 16 == 0)
            samples.append((
                vllm_clock.seconds - before[1] - connector,
                connector,
                max(c.seconds - b for c, b in zip(worker_clocks, before[2])),
                filled,
            ))
    engine.close()
    return samples


def _median_us(samples, index: int, where=lambda s: True) -> float:
    chosen = [s[index] for s in samples if where(s)]
    return statistics.median(chosen) * 1e6 if chosen else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--lockstep", action="store_true", help="equal prompts: most steps fill no block")
    args = parser.parse_args()
    kinds = [("every step", lambda s: True)]
    if args.lockstep:
        kinds = [("no block fills", lambda s: s[3] == 0), ("blocks fill", lambda s: s[3] > 0)]
    print(
        f"TP {args.tp}, 16-token blocks, {args.steps} decode steps a run, "
        + ("prompts of 100 tokens (all fill together)" if args.lockstep else "prompts of 100-115 tokens (a sixteenth fill a step)")
        + "; CPU time per decode step, median, in us"
    )
    print()
    print("| running requests | steps | vLLM's own scheduler | null connector, scheduler | null connector, each worker "
          "| kvcsum, scheduler | kvcsum, each worker | kvcsum adds, scheduler | kvcsum adds, each worker |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for requests in args.requests:
        alone = measure(False, requests, args.steps, args.tp, args.lockstep)
        kvcsum = measure(True, requests, args.steps, args.tp, args.lockstep)
        for label, where in kinds:
            own = _median_us(kvcsum, 0, where)
            null_s, null_w = _median_us(alone, 1, where), _median_us(alone, 2, where)
            ks, kw = _median_us(kvcsum, 1, where), _median_us(kvcsum, 2, where)
            add_s, add_w = ks - null_s, kw - null_w
            print(
                f"| {requests:,} | {label} | {own:,.0f} | {null_s:,.0f} | {null_w:,.0f} | {ks:,.0f} | {kw:,.0f} "
                f"| {add_s:,.0f} ({add_s / own:.1%}) | {add_w:,.0f} ({add_w / own:.1%}) |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
