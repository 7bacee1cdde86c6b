"""The tier checks of kvcsum's vLLM connector on a GPU, with torch alone (no
vLLM): the values a device worker keeps per block hash equal a host
worker's over the same bytes (in every layout vLLM's attention backends
use, and per TP rank); a store queued behind the forward sees that
forward's writes; and a GPU -> pinned host -> GPU round trip, as a CPU
offload tier makes it, is matched when intact and caught, on exactly the
block, when one byte flipped on the host.

Not run by `make test` (no GPU there). On a machine with a CUDA GPU, torch
and a built kvcsum:

    KVCSUM_LIBRARY=$PWD/target/release/libkvcsum.so PYTHONPATH=$PWD/python \\
        python3 python/tests/vllm/gpu_tier_check.py

Prints one line per check and "N passed, 0 failed"; exits non-zero on any
failure.
"""

from __future__ import annotations

import os
import random
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import kvcsum  # noqa: E402
from kvcsum.vllm.tier_values import HashedBlocks, TierChecker  # noqa: E402
from layouts import LAYOUTS, checksummer, lay_out, layer_specs, logical_caches  # noqa: E402

NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD = 3, 64, 8, 16, 64
SEED = int(os.environ.get("KVCSUM_SEED", random.SystemRandom().randrange(2**31)))


def block_hash(position: int, salt: int = 0) -> bytes:
    return bytes([position % 256, position // 256, salt]) + bytes(29)


def stores(requests: int = 6, blocks_each: int = 5) -> list:
    """Full blocks of several requests, each block with its hash."""
    out = []
    for r in range(requests):
        ids = tuple(range(1 + r * blocks_each, 1 + (r + 1) * blocks_each))
        hashes = tuple(block_hash(q, salt=r) for q in range(blocks_each))
        out.append(HashedBlocks(f"r{r}", blocks_each * BLOCK, {0: (0, ids, hashes)}))
    return out


def kept(tier: TierChecker, blocks_list) -> dict:
    tier.settle(wait=True)
    out = {}
    for blocks in blocks_list:
        for group, (first, ids, hashes) in blocks.groups.items():
            for q, h in enumerate(hashes):
                out[(blocks.req_id, q)] = tier.values.values(group, h)
    return out


def check_values_equal_the_hosts(layout: str, tp: int) -> str:
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, seed=SEED)
    heads = HEADS // tp
    compared = 0
    for rank in range(tp):
        shard = [t[:, rank * heads : (rank + 1) * heads] for t in logical]
        specs = layer_specs(NUM_LAYERS, BLOCK, heads, HEAD, total_kv_heads=HEADS)
        host = TierChecker(checksummer(specs, lay_out(shard, layout), NUM_BLOCKS, BLOCK, tp_rank=rank, tp_size=tp))
        device = TierChecker(checksummer(specs, lay_out(shard, layout, device="cuda"), NUM_BLOCKS, BLOCK, tp_rank=rank, tp_size=tp))
        assert device.checksummer.device == torch.cuda.current_device()
        host.store(stores())
        device.store(stores())
        want, got = kept(host, stores()), kept(device, stores())
        assert all(v is not None and len(v) == 1 for v in want.values())
        assert got == want, f"rank {rank}: device values differ from the host's"
        compared += len(got)
    return f"{compared} kept values equal (device, host)"


def check_store_is_ordered_after_the_forward() -> str:
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, seed=SEED + 1)
    specs = layer_specs(NUM_LAYERS, BLOCK, HEADS, HEAD)
    host = TierChecker(checksummer(specs, lay_out(logical, "LBNHC"), NUM_BLOCKS, BLOCK))
    caches = lay_out(logical, "LBNHC", device="cuda")
    device = TierChecker(checksummer(specs, caches, NUM_BLOCKS, BLOCK))
    saved = [cache.clone() for cache in caches]
    for cache in caches:
        cache.zero_()
    torch.cuda.synchronize()
    # The "forward" writes the KV on torch's current stream (a side stream
    # here) behind a long kernel; the store is queued right after, on it.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        for cache, source in zip(caches, saved):
            cache.copy_(source)
        device.store(stores())
    host.store(stores())
    assert kept(device, stores()) == kept(host, stores()), "the store did not see the forward's writes"
    return "values of blocks written by the preceding kernel equal the host's"


def check_round_trip_through_pinned_host_memory() -> str:
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, seed=SEED + 2)
    specs = layer_specs(NUM_LAYERS, BLOCK, HEADS, HEAD)
    caches = lay_out(logical, "LBHNC", device="cuda")
    tier = TierChecker(checksummer(specs, caches, NUM_BLOCKS, BLOCK))
    ids = (3, 4, 5, 6)
    hashes = tuple(block_hash(q, salt=9) for q in range(len(ids)))
    tier.store([HashedBlocks("computed", len(ids) * BLOCK, {0: (0, ids, hashes)})])
    # Offload: GPU -> pinned host on a copy stream, as a CPU tier does.
    copy = torch.cuda.Stream()
    copy.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy):
        host = [torch.empty(cache[list(ids)].shape, dtype=cache.dtype, pin_memory=True) for cache in caches]
        for buffer, cache in zip(host, caches):
            buffer.copy_(cache[list(ids)], non_blocking=True)
    copy.synchronize()
    outcomes = []
    for flip in (None, 2):
        if flip is not None:
            host[1][flip].view(-1).view(torch.uint8)[7] ^= 0x80  # layer 1, the block at position 2
        targets = [40, 41, 42, 43]
        # Load: pinned host -> other GPU blocks on the copy stream; the check,
        # on the current stream, waits for it.
        with torch.cuda.stream(copy):
            for buffer, cache in zip(host, caches):
                cache[targets] = buffer.to("cuda", non_blocking=True)
        torch.cuda.current_stream().wait_stream(copy)
        comparison = tier.check(HashedBlocks(f"loaded{flip}", len(ids) * BLOCK, {0: (0, tuple(targets), hashes)}))
        outcomes.append(comparison)
    intact, flipped = outcomes
    assert (intact.matched, intact.mismatched, intact.unknown) == (4, (), {}), intact
    assert (flipped.matched, flipped.mismatched, set(flipped.invalid)) == (3, (42,), {42}), flipped
    return "an intact round trip matched 4 of 4 blocks; one flipped byte on the host: block 42 (position 2) alone a load error"


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        print("0 passed, 1 failed")
        return 1
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; kvcsum {kvcsum.version()}; seed {SEED} (KVCSUM_SEED)", flush=True)
    checks = []
    for layout in LAYOUTS:
        for tp in (1, 2):
            checks.append((f"kept values {layout} TP {tp}", lambda l=layout, t=tp: check_values_equal_the_hosts(l, t)))
    checks.append(("store ordered after the forward", check_store_is_ordered_after_the_forward))
    checks.append(("GPU -> pinned host -> GPU round trip", check_round_trip_through_pinned_host_memory))
    passed = failed = 0
    for name, check in checks:
        try:
            print(f"ok    {name}: {check()}", flush=True)
            passed += 1
        except Exception:  # noqa: BLE001 - report each check
            print(f"FAIL  {name}:\n{traceback.format_exc()}", flush=True)
            failed += 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
