"""The workers' exchange of sync load records (kvcsum.vllm.record_exchange)
over vLLM's real groups: two processes, spawned by torch.multiprocessing,
each a TP rank of one engine (vLLM's distributed environment over gloo, on
the CPU). The engine_exchange of each rank must be the TP group's; in each
of a few steps the judging rank (TP rank 0) gets both ranks' records, in
rank order, and the other gets None: through the fixed-size gather (with
a bound), through gather_object (without), and with a bound that a
rank's records pass (sent as none: that rank's records are missing, the
others' arrive). Where there can be no exchange (no
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
                records = [
                    LoadRecord(f"req-{step}", step + 1, rng.randbytes(rng.randrange(1, 4096))),
                    LoadRecord(f"req-{step}-none", step + 7, None),
                ]
                for bound in (None, 8192, 2048):
                    if exchange is None:
                        got.append((records, bound, "no exchange"))
                        continue
                    gathered = exchange.gather(f"pp0.tp{rank}", records, bound=bound)
                    got.append((records, bound, gathered))
            results.put((rank, why, got))
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def test_the_judging_rank_gets_every_ranks_records_over_vllms_tp_group():
    import torch.multiprocessing as mp

    from kvcsum.vllm.record_exchange import pack_records

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
        assert why == "" and len(got) == 3 * STEPS, (rank, why)
    for call in range(3 * STEPS):
        sent = {rank: by_rank[rank][1][call][0] for rank in (0, 1)}
        bounds = {rank: by_rank[rank][1][call][1] for rank in (0, 1)}
        judged, other = by_rank[0][1][call][2], by_rank[1][1][call][2]
        print(
            f"call {call} (bounds {bounds}): rank 0 got "
            f"{[(w.worker, [None if r.record is None else len(r.record) for r in w.records]) for w in judged]}, rank 1 got {other}",
            flush=True,
        )
        assert other is None, seed
        assert len(judged) == 2, seed
        for rank in (0, 1):
            fits = bounds[rank] is None or len(pack_records(f"pp0.tp{rank}", sent[rank])) <= bounds[rank]
            if fits:
                assert judged[rank].worker == f"pp0.tp{rank}" and list(judged[rank].records) == sent[rank], seed
            else:
                # Past the bound: sent as none, so that rank's records are missing.
                assert judged[rank].records == (), seed


@pytest.mark.parametrize("pp", [1, 2])
def test_engine_exchange_says_why_there_is_none(pp):
    from kvcsum.vllm.record_exchange import engine_exchange

    exchange, why = engine_exchange(_config(2, pp))
    print(f"\nPP {pp}: no exchange: {why}", flush=True)
    assert exchange is None
    assert ("pipeline parallelism" in why) if pp > 1 else (why == "torch.distributed is not initialized")
