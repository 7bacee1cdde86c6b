"""Wall time of the workers' exchange of a sync load's records
(kvcsum.vllm.record_exchange) across two processes on this machine: two
TP ranks of one engine over vLLM's real TP group (gloo, on the CPU, as
test_record_exchange.py sets it up), each with its real record of a
`--blocks`-block load (a kvcsum worker's consumer record over `--layers`
layers of this rank's heads). Per exchange, the time inside `gather` on
each rank, for the fixed-size gather of TorchRecordExchange (one byte
tensor of the step's record_bound) and for gather_object (pickled
WorkerRecords, the exchange before it), alternating in the same run,
after a barrier each; medians over `--rounds` rounds, the slower rank's.

    cd build && PYTHONPATH=$PWD/../python KVCSUM_LIBRARY=$PWD/../target/release/libkvcsum.so \\
        VLLM_LOGGING_LEVEL=ERROR ./vllm-venv/bin/python ../python/tests/vllm/bench_record_exchange.py [--blocks 64] [--layers 32] [--rounds 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _record(rank: int, blocks: int, layers: int) -> bytes:
    """This rank's consumer record of a `blocks`-block load (2 of 4 heads)."""
    import kvcsum
    from kvcsum.vllm.cache_checksums import CacheChecksummer, Job
    from layouts import lay_out, layer_specs, logical_caches

    logical = logical_caches(layers, blocks + 1, 4, 16, 32, seed=rank)
    shard = [t[:, rank * 2 : rank * 2 + 2] for t in logical]
    specs = layer_specs(layers, 16, 2, 16, total_kv_heads=4)
    caches = lay_out(shard, "LBNHC")
    worker = CacheChecksummer(specs, {s.name: caches[i] for i, s in enumerate(specs)}, blocks + 1, {0: 16}, tp_rank=rank, tp_size=2)
    record = worker.checksum([Job("req-0", 16 * blocks, {0: (0, list(range(1, blocks + 1)))})], kvcsum.CONSUMER).record()
    worker.close()
    return record


def _rank(rank: int, store: str, args, results) -> None:
    import torch.distributed as dist
    from test_record_exchange import _config

    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    from kvcsum.vllm.record_exchange import LoadRecord, engine_exchange, record_bound

    config = _config(2)
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=2, rank=rank, distributed_init_method=f"file://{store}", local_rank=rank, backend="gloo"
        )
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            exchange, why = engine_exchange(config)
            assert exchange is not None, why
            group = parallel_state.get_tp_group().cpu_group
            records = [LoadRecord("req-0", 1, _record(rank, args.blocks, args.layers))]
            bound = record_bound(args.blocks, 1, args.layers, 2, 1)
            times = {"fixed-size gather": [], "gather_object": []}
            for round_ in range(args.rounds + 10):
                for name, kwargs in (("fixed-size gather", {"bound": bound}), ("gather_object", {})):
                    dist.barrier(group=group)
                    start = time.perf_counter()
                    gathered = exchange.gather(f"pp0.tp{rank}", records, **kwargs)
                    seconds = time.perf_counter() - start
                    if rank == 0:
                        assert [len(w.records[0].record) for w in gathered] and gathered[0].records == tuple(records)
                    if round_ >= 10:
                        times[name].append(seconds)
            results.put((rank, len(records[0].record), bound, {n: statistics.median(t) for n, t in times.items()}))
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="kvcsum-exchange-bench-") as directory:
        mp.spawn(_rank, args=(os.path.join(directory, "store"), args, results), nprocs=2, join=True)
        by_rank = dict((r[0], r[1:]) for r in (results.get(timeout=60) for _ in range(2)))
    sizes = {rank: by_rank[rank][0] for rank in by_rank}
    print(
        f"TP 2 over gloo, two processes; a {args.blocks}-block load over {args.layers} layers: records of "
        f"{sizes[0]} and {sizes[1]} bytes, bound {by_rank[0][1]} bytes; wall time per exchange, median of {args.rounds}, in us"
    )
    print()
    print("| exchange | rank 0 (judges) | rank 1 | slower rank |")
    print("|---|---:|---:|---:|")
    for name in ("fixed-size gather", "gather_object"):
        r0, r1 = by_rank[0][2][name] * 1e6, by_rank[1][2][name] * 1e6
        print(f"| {name} | {r0:,.0f} | {r1:,.0f} | {max(r0, r1):,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
