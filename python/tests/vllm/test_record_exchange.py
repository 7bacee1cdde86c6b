"""The workers' exchange of sync load records (kvcsum.vllm.record_exchange)
over vLLM's real groups: two processes, spawned by torch.multiprocessing,
each a TP rank of one engine (vLLM's distributed environment over gloo, on
the CPU). The engine_exchange of each rank must be the TP group's; in each
of a few steps the judging rank (TP rank 0) gets both ranks' records, in
rank order, and the other gets None. Where there can be no exchange (no
torch.distributed, several PP stages) engine_exchange says why.
"""

from __future__ import annotations

import os
import random
import tempfile

import pytest

STEPS = 3


def _config(tp: int, pp: int = 1):
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig

    return VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp), device_config=DeviceConfig("cpu"))


def _rank(rank: int, store: str, seed: int, results) -> None:
    """One TP rank: vLLM's groups over gloo, then STEPS gathers."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    from kvcsum.vllm.record_exchange import LoadRecord, engine_exchange

    config = _config(2)
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=2, rank=rank, distributed_init_method=f"file://{store}", local_rank=rank, backend="gloo"
        )
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            exchange, why = engine_exchange(config)
            got = []
            rng = random.Random(seed * 2 + rank)
            for step in range(STEPS):
                records = [LoadRecord(f"req-{step}", step + 1, rng.randbytes(rng.randrange(1, 4096)))]
                gathered = exchange.gather(f"pp0.tp{rank}", records) if exchange is not None else "no exchange"
                got.append((records, gathered))
            results.put((rank, why, got))
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def test_the_judging_rank_gets_every_ranks_records_over_vllms_tp_group():
    import torch.multiprocessing as mp

    seed = int(os.environ.get("KVCS_SEED", str(random.SystemRandom().randrange(2**32))), 0)
    print(f"\nseed {seed} (KVCS_SEED={seed} repeats it)", flush=True)
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="kvcsum-exchange-") as directory:
        mp.spawn(_rank, args=(os.path.join(directory, "store"), seed, results), nprocs=2, join=True)
        by_rank = {}
        for _ in range(2):
            rank, why, got = results.get(timeout=60)
            by_rank[rank] = (why, got)
    assert sorted(by_rank) == [0, 1]
    for rank, (why, got) in by_rank.items():
        assert why == "" and len(got) == STEPS, (rank, why)
    for step in range(STEPS):
        sent = {rank: by_rank[rank][1][step][0] for rank in (0, 1)}
        judged, other = by_rank[0][1][step][1], by_rank[1][1][step][1]
        print(
            f"step {step}: rank 0 got {[(w.worker, [len(r.record) for r in w.records]) for w in judged]}, rank 1 got {other}",
            flush=True,
        )
        assert other is None, seed
        assert [w.worker for w in judged] == ["pp0.tp0", "pp0.tp1"], seed
        assert [list(w.records) for w in judged] == [sent[0], sent[1]], seed


@pytest.mark.parametrize("pp", [1, 2])
def test_engine_exchange_says_why_there_is_none(pp):
    from kvcsum.vllm.record_exchange import engine_exchange

    exchange, why = engine_exchange(_config(2, pp))
    print(f"\nPP {pp}: no exchange: {why}", flush=True)
    assert exchange is None
    assert ("pipeline parallelism" in why) if pp > 1 else (why == "torch.distributed is not initialized")
