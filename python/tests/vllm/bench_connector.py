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

Times are CPU time per decode step, medians over the decode steps, of the
thread that makes the calls (time.thread_time: the harness runs the
scheduler and every rank on one thread, as vLLM runs each on its own),
and apart from it the CPU time of kvcsum's own host checksum threads
("kvcsum-host", read from /proc in clock ticks: their mean per step and
worker is printed under the table; none start for a step's few full
blocks here). `--process-time` counts the whole process instead, as
this benchmark did before 2026-12-02: that also counts torch's OpenMP
threads spinning after the stand-in forward into whatever call runs
next, which was about a sixth of the library's store call's samples
under `perf`:

- vLLM's own scheduler: Scheduler.schedule + Scheduler.update_from_output,
  less the connector calls made inside them, in the run with kvcsum;
- connector, scheduler: inside the scheduler connector's calls;
- connector, worker: inside one worker connector's calls (the slowest rank).

kvcsum's added time is the run with it less the run with the null
connector alone, and its share is that over vLLM's own scheduler time.
`--lockstep` gives every request the same prompt length, so that most
steps fill no block: those steps are reported apart ("no block fills").
`--tier-loads` wraps the test's offload tier (tier_connector.py, loads
inside the step: sync) instead of the null connector, and in every decode
step one more request arrives whose prompt's first 96 tokens another
request computed: the tier loads its 6 blocks and kvcsum compares them
with the values its workers kept ("tier load" steps; the tier's own work
is in both runs). `--store-call` adds the time inside the library's store
call (kvcsum.TierIndex: the host checksum of the step's full blocks, which
a GPU worker queues as a kernel) to the table, as part of the worker's.

    cd build && PYTHONPATH=$PWD/../python KVCSUM_LIBRARY=$PWD/../target/release/libkvcsum.so \\
        VLLM_LOGGING_LEVEL=ERROR ./vllm-venv/bin/python ../python/tests/vllm/bench_connector.py \\
        [--requests 256 1024] [--steps 48] [--tp 2] [--lockstep] [--tier-loads] [--store-call] [--process-time]
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


#: The clock of the calls (main: --process-time picks time.process_time).
CLOCK = time.thread_time


def helper_seconds() -> float:
    """CPU seconds so far of kvcsum's host checksum threads in this process."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("kvcsum-host"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except OSError:
            continue
    return total / os.sysconf("SC_CLK_TCK")


class Clock:
    def __init__(self):
        self.seconds = 0.0

    def wrap(self, connector, names):
        for name in names:
            method = getattr(connector, name, None)
            if method is None:
                continue

            def timed(*args, _method=method, **kwargs):
                start = CLOCK()
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.seconds += CLOCK() - start

            setattr(connector, name, timed)


class StoreClock:
    """Time inside the library's store call (kvcsum.TierIndex.store_buffers,
    where the tree has it), per call."""

    def __init__(self):
        self.seconds = 0.0
        import kvcsum

        index = getattr(kvcsum, "TierIndex", None)
        method = getattr(index, "store_buffers", None)
        self._undo = None
        if method is None:
            return

        def timed(*args, **kwargs):
            start = CLOCK()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += CLOCK() - start

        index.store_buffers = timed
        self._undo = lambda: setattr(index, "store_buffers", method)

    def close(self):
        if self._undo is not None:
            self._undo()


def measure(wrap: bool, requests: int, steps: int, tp: int, lockstep: bool, tier_loads: bool = False) -> dict:
    """Per decode step with every request running: (vLLM's own scheduler
    time, the scheduler connector's, the slowest worker connector's, the
    blocks that became full, whether a tier load was in it, the library's
    store calls), in seconds, one tuple a step."""
    inner = {"kv_connector": "NullConnector", "kv_connector_module_path": __name__ if __name__ != "__main__" else "bench_connector"}
    if tier_loads:
        import tier_connector

        # The tier is the process's: each run starts with it empty.
        for shared in (tier_connector.TIER, tier_connector.INDEX, tier_connector.FAULT):
            shared.clear()
        inner = {
            "kv_connector": "TierConnector",
            "kv_connector_module_path": "tier_connector",
            "kv_connector_extra_config": {"load_mode": "sync", "capacity": requests * 16},
        }
    engine = Engine(
        "bench", role="kv_both", tp=tp, block_size=16, layout=KVCacheLayout.LBNHC, store_dir="", inner=inner, wrap=wrap,
        num_blocks=requests * 12 + 64, max_num_seqs=requests + (8 if tier_loads else 0), max_batched_tokens=8192,
    )
    scheduler_clock, vllm_clock = Clock(), Clock()
    worker_clocks = [Clock() for _ in engine.ranks]
    scheduler_clock.wrap(engine.scheduler.connector, SCHEDULER_CALLS)
    vllm_clock.wrap(engine.scheduler, ["schedule", "update_from_output"])
    for clock, rank in zip(worker_clocks, engine.ranks):
        clock.wrap(rank.connector, WORKER_CALLS)
    store_clock = StoreClock()
    prompts = []
    for r in range(requests):
        # Prompts of 100 to 115 tokens: a sixteenth of the requests fill a
        # block in each decode step, as requests out of lockstep do.
        length = 100 if lockstep else 100 + r % 16
        prompts.append([11 + (r * 31 + i * 7) % 900 for i in range(length)])
        engine.add_request(f"r{r}", prompts[-1], steps + 40)
    samples = []
    arrivals = 0
    while len(samples) < steps:
        before = (scheduler_clock.seconds, vllm_clock.seconds, [c.seconds for c in worker_clocks], store_clock.seconds, helper_seconds())
        decoding = all(len(t.output_tokens) > 0 for name, t in engine.traces.items() if name.startswith("r"))
        if tier_loads and decoding:
            # A request whose first 6 blocks another computed: the tier loads them.
            source = prompts[arrivals % requests]
            engine.add_request(f"t{arrivals}", source[:96] + [901 + arrivals % 50] * 4, 1)
            arrivals += 1
        engine.step()
        running = sum(1 for r in engine.scheduler.running if r.request_id.startswith("r"))
        if decoding and running == requests:
            connector = scheduler_clock.seconds - before[0]
            # A full block: a request whose tokens reached a multiple of 16.
            filled = sum(
                1 for name, t in engine.traces.items() if name.startswith("r") and t.scheduled and sum(t.scheduled[-1]) % 16 == 0
            )
            loaded = any(engine.steps_run in t.steps for name, t in engine.traces.items() if name.startswith("t"))
            samples.append((
                vllm_clock.seconds - before[1] - connector,
                connector,
                max(c.seconds - b for c, b in zip(worker_clocks, before[2])),
                filled,
                loaded,
                (store_clock.seconds - before[3]) / max(1, len(worker_clocks)),
                (helper_seconds() - before[4]) / max(1, len(worker_clocks)),
            ))
    store_clock.close()
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
    parser.add_argument("--tier-loads", action="store_true", help="the test's tier as the inner connector, a 6-block tier load every step")
    parser.add_argument("--store-call", action="store_true", help="also the time inside the library's store call, per worker")
    parser.add_argument("--process-time", action="store_true", help="CPU time of the whole process (every thread) instead")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.process_time else time.thread_time
    kinds = [("every step", lambda s: True)]
    if args.lockstep:
        kinds = [("no block fills", lambda s: s[3] == 0), ("blocks fill", lambda s: s[3] > 0)]
    if args.tier_loads:
        kinds = [("tier load", lambda s: s[4]), ("no tier load", lambda s: not s[4])]
    wrapped = "tier connector" if args.tier_loads else "null connector"
    print(
        f"TP {args.tp}, 16-token blocks, {args.steps} decode steps a run, "
        + ("prompts of 100 tokens (all fill together)" if args.lockstep else "prompts of 100-115 tokens (a sixteenth fill a step)")
        + (", a 6-block sync tier load every step" if args.tier_loads else "")
        + "; CPU time per decode step, median, in us, "
        + ("of the whole process" if args.process_time else "of the calling thread plus kvcsum's host threads")
    )
    print()
    store_head, store_rule = (" | of which the library's store call, each worker", "|---:") if args.store_call else ("", "")
    print(f"| running requests | steps | vLLM's own scheduler | {wrapped}, scheduler | {wrapped}, each worker "
          f"| kvcsum, scheduler | kvcsum, each worker | kvcsum adds, scheduler | kvcsum adds, each worker{store_head} |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:" + store_rule + "|")
    notes = []
    for requests in args.requests:
        alone = measure(False, requests, args.steps, args.tp, args.lockstep, args.tier_loads)
        kvcsum = measure(True, requests, args.steps, args.tp, args.lockstep, args.tier_loads)
        for label, where in kinds:
            own = _median_us(kvcsum, 0, where)
            null_s, null_w = _median_us(alone, 1, where), _median_us(alone, 2, where)
            ks, kw = _median_us(kvcsum, 1, where), _median_us(kvcsum, 2, where)
            add_s, add_w = ks - null_s, kw - null_w
            store = f" | {_median_us(kvcsum, 5, where):,.0f}" if args.store_call else ""
            print(
                f"| {requests:,} | {label} | {own:,.0f} | {null_s:,.0f} | {null_w:,.0f} | {ks:,.0f} | {kw:,.0f} "
                f"| {add_s:,.0f} ({add_s / own:.1%}) | {add_w:,.0f} ({add_w / own:.1%}){store} |",
                flush=True,
            )
        helpers = statistics.mean(s[6] for s in kvcsum) * 1e6
        notes.append(f"{requests:,} requests: kvcsum's host threads {helpers:,.0f} us per step and worker (mean)")
    if not args.process_time:
        print()
        for note in notes:
            print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
