"""The values a worker keeps of its blocks, by block hash, for offload tier
loads (kvcsum.vllm.tier_values), with torch and without vLLM: each kept
value is docs/SPEC.md's block checksum of the worker's own heads (a naive
reference, loops over logical indices); a flipped byte is caught; a block
computed again with other bits keeps both values; the map is bounded and
says "unknown", never "mismatch", for what it dropped or cannot tell."""

from __future__ import annotations

import os
import random
import sys
import tracemalloc

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
from kvcsum.vllm.tier_values import MATCHED, MAX_VALUES, MISMATCHED, UNKNOWN, HashedBlocks, StoredValues, TierChecker  # noqa: E402
from layouts import checksummer, lay_out, layer_specs, logical_caches  # noqa: E402

NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD = 3, 12, 4, 16, 8
MASK = (1 << 64) - 1
SEED = int(os.environ.get("KVCSUM_SEED", random.SystemRandom().randrange(2**31)))


def mix(x: int) -> int:
    """f of SPEC section 12 (MIXED), written again here."""
    g = ((x ^ (x >> 32)) * 0x9E3779B97F4A7C15) & MASK
    return g ^ (g >> 32)


F = {kvcsum.WEIGHTED: lambda x: x, kvcsum.MIXED: mix}


def naive_block(logical, block_id: int, position: int, first_head: int, heads: int, f) -> int:
    """SPEC sections 2-3: c(q) of one full block over layers 0.. and the
    global heads first_head .. first_head + heads (logical[layer][block,
    head, token, K+V elements], fp16: a piece is 4 elements)."""
    total = 0
    for layer, cache in enumerate(logical):
        raw = cache[block_id].contiguous().view(torch.int16).to(torch.int64) & 0xFFFF  # [heads, tokens, elements]
        for h in range(heads):
            slice_sum = 0
            for t in range(BLOCK):
                row = raw[first_head + h, t].tolist()
                pieces = len(row) // 4
                for p in range(pieces):
                    x = row[4 * p] | row[4 * p + 1] << 16 | row[4 * p + 2] << 32 | row[4 * p + 3] << 48
                    j = (position * BLOCK + t) * pieces + p
                    slice_sum += f(x) * (2 * j + 1)
            total += (2 * (layer * 65536 + first_head + h) + 1) * slice_sum
    return total & MASK


def fake_hash(position: int, salt: int = 0) -> bytes:
    return bytes([position, salt]) * 16


@pytest.mark.parametrize("algorithm", [kvcsum.WEIGHTED, kvcsum.MIXED])
@pytest.mark.parametrize("tp", [1, 2])
def test_kept_values_are_the_spec_checksums_of_each_rank_own_heads(algorithm, tp):
    print(f"\nseed {SEED} (KVCSUM_SEED)")
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, seed=SEED)
    ids = [7, 2, 9]
    stores = HashedBlocks("req", 3 * BLOCK, {0: (0, tuple(ids), tuple(fake_hash(q) for q in range(3)))})
    heads = HEADS // tp
    for rank in range(tp):
        shard = [t[:, rank * heads : (rank + 1) * heads] for t in logical]
        specs = layer_specs(NUM_LAYERS, BLOCK, heads, HEAD, total_kv_heads=HEADS)
        worker = checksummer(specs, lay_out(shard, "FA" if rank else "LBNHC"), NUM_BLOCKS, BLOCK, tp_rank=rank, tp_size=tp)
        worker.worker.set_algorithm(algorithm)
        tier = TierChecker(worker, capacity=64)
        tier.store([stores])
        tier.settle(wait=True)
        for q, block_id in enumerate(ids):
            want = naive_block(logical, block_id, q, rank * heads, heads, F[algorithm])
            assert tier.values.values(0, fake_hash(q)) == (want,), (SEED, rank, q)
        worker.close()


def test_a_loaded_block_is_matched_and_a_flipped_byte_caught():
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, seed=SEED + 1)
    caches = lay_out(logical, "LBHNC")
    worker = checksummer(layer_specs(NUM_LAYERS, BLOCK, HEADS, HEAD), caches, NUM_BLOCKS, BLOCK)
    tier = TierChecker(worker)
    hashes = tuple(fake_hash(q) for q in range(3))
    tier.store([HashedBlocks("computed", 3 * BLOCK, {0: (0, (1, 2, 3), hashes)})])
    # The tier gives the bytes back into other blocks: a copy of 1, 2, 3 into 8, 9, 10.
    for cache in caches:
        cache[[8, 9, 10]] = cache[[1, 2, 3]]
    loaded = HashedBlocks("loaded", 3 * BLOCK, {0: (0, (8, 9, 10), hashes)})
    comparison = tier.check(loaded)
    assert (comparison.matched, comparison.mismatched, comparison.unknown) == (3, (), {})
    caches[2][9].view(-1).view(torch.uint8)[11] ^= 0x04
    comparison = tier.check(loaded)
    assert (comparison.matched, comparison.mismatched, set(comparison.invalid)) == (2, (9,), {9})
    # A block of no known hash (another engine stored it) is unknown, and a
    # load error only under fail_unknown.
    other = HashedBlocks("other", 3 * BLOCK, {0: (0, (8, 9, 10), tuple(fake_hash(q, 7) for q in range(3)))})
    assert tier.check(other).unknown == {"UNKNOWN_BLOCK": 3} and not tier.check(other).invalid
    assert tier.check(other, fail_unknown=True).invalid == {8, 9, 10}
    # A partial block has no hash.
    partial = HashedBlocks("partial", 2 * BLOCK + 3, {0: (0, (8, 9, 10), hashes[:2] + (None,))})
    assert tier.check(partial).unknown == {"NO_BLOCK_HASH": 1}
    worker.close()


def test_a_block_computed_again_with_other_bits_keeps_both_values():
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, seed=SEED + 2)
    caches = lay_out(logical, "LBNHC")
    worker = checksummer(layer_specs(NUM_LAYERS, BLOCK, HEADS, HEAD), caches, NUM_BLOCKS, BLOCK)
    tier = TierChecker(worker)
    first = [c[4].clone() for c in caches]
    tier.store([HashedBlocks("a", BLOCK, {0: (0, (4,), (fake_hash(0),))})])
    caches[0].view(torch.int16)[4, 0, 0, 3] ^= 1  # the last bit, as another batch computes it
    tier.store([HashedBlocks("b", BLOCK, {0: (0, (4,), (fake_hash(0),))})])
    tier.settle(wait=True)
    assert len(tier.values.values(0, fake_hash(0))) == 2
    for cache, block in zip(caches, first):
        cache[5] = block  # the tier's earlier copy
    assert tier.check(HashedBlocks("c", BLOCK, {0: (0, (5,), (fake_hash(0),))})).matched == 1
    worker.close()


def test_the_map_is_bounded_and_never_says_mismatch_for_what_it_cannot_tell():
    values = StoredValues(capacity=3)
    for q in range(4):
        values.remember(0, fake_hash(q), q, 100 + q)
    assert len(values) == 3 and values.dropped == 1
    assert values.compare(0, fake_hash(0), 0, 100).outcome == UNKNOWN  # dropped: the oldest
    # Least recently used out: a match keeps a hash.
    assert values.compare(0, fake_hash(1), 1, 101).outcome == MATCHED
    values.remember(0, fake_hash(9), 9, 5)
    assert values.compare(0, fake_hash(1), 1, 101).outcome == MATCHED
    assert values.compare(0, fake_hash(2), 2, 102).reason == "UNKNOWN_BLOCK"
    # Up to MAX_VALUES values per hash; past that, unknown.
    many = StoredValues()
    for k in range(MAX_VALUES):
        many.remember(0, b"h" * 32, 0, k)
    assert many.compare(0, b"h" * 32, 0, 0).outcome == MATCHED
    assert many.compare(0, b"h" * 32, 0, 77).outcome == MISMATCHED
    many.remember(0, b"h" * 32, 0, MAX_VALUES)
    assert many.compare(0, b"h" * 32, 0, 77).reason == "TOO_MANY_VALUES"
    # A hash at another position, or in another group, is not compared.
    assert many.compare(0, b"h" * 32, 1, 0).outcome == UNKNOWN
    assert many.compare(1, b"h" * 32, 0, 0).reason == "UNKNOWN_BLOCK"


def test_the_memory_of_a_million_kept_blocks():
    # Measured on 200,000 distinct 32-byte hashes (vLLM's sha256 block
    # hashes), one value each, and scaled; printed for docs/vllm-tiers.md.
    count = 200_000
    rng = random.Random(SEED)
    tracemalloc.start()
    values = StoredValues(capacity=count)
    for q in range(count):
        # The hashes arrive with the scheduler's metadata: the map holds them.
        values.remember(0, rng.randbytes(32), q % 4096, rng.getrandbits(64))
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    per_million = used * (1_000_000 / count)
    print(f"\nMEMORY kept values: {used / count:.0f} bytes a block, {per_million / 2**20:.0f} MiB per million blocks (a worker)")
    assert len(values) == count
    assert used / count < 400  # a dict entry, a 32-byte key and an int


def test_the_library_index_refuses_bad_buffers_and_keeps_nothing_of_them():
    import array

    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, seed=SEED + 5)
    worker = checksummer(layer_specs(NUM_LAYERS, BLOCK, HEADS, HEAD), lay_out(logical, "LBNHC"), NUM_BLOCKS, BLOCK)
    index = kvcsum.TierIndex(8)
    ids, groups, positions = array.array("I", [1, 2]), array.array("I", [0, 0]), array.array("Q", [0, 1])
    hashes = fake_hash(0) + fake_hash(1)
    with pytest.raises(ValueError, match="2 blocks need"):
        index.store_buffers(worker.worker, 2, groups, positions, array.array("I", [1]), hashes, 32)
    with pytest.raises(ValueError, match="2 blocks need"):
        index.store_buffers(worker.worker, 2, groups, array.array("I", [0, 1]), ids, hashes, 32)
    with pytest.raises(ValueError, match="2 blocks need"):
        index.store_buffers(worker.worker, 2, groups, positions, ids, hashes[:40], 32)
    with pytest.raises(kvcsum.InvalidArgument, match="hash_bytes is 4"):
        index.store_buffers(worker.worker, 2, groups, positions, ids, hashes[:8], 4)
    with pytest.raises(kvcsum.InvalidArgument, match=r"group_ids\[1\] 3"):
        index.store_buffers(worker.worker, 2, array.array("I", [0, 3]), positions, ids, hashes, 32)
    with pytest.raises(kvcsum.OutOfBounds):
        index.store_buffers(worker.worker, 2, groups, positions, array.array("I", [1, NUM_BLOCKS]), hashes, 32)
    assert len(index) == 0 and index.info()["dropped"] == 0
    index.store_buffers(worker.worker, 2, groups, positions, ids, hashes, 32)
    assert len(index) == 2
    position, kept = index.values(0, fake_hash(1))
    assert position == 1 and len(kept) == 1
    outcomes = index.check(worker.worker, [0, 0], [0, 1], [1, 2], np.frombuffer(hashes, dtype=np.uint8).reshape(2, 32), hashed=[1, 0])
    assert outcomes.tolist() == [kvcsum.TierOutcome.MATCHED, kvcsum.TierOutcome.NO_BLOCK_HASH]
    with pytest.raises(ValueError, match="hashed has shape"):
        index.check(worker.worker, [0, 0], [0, 1], [1, 2], np.zeros((2, 32), dtype=np.uint8), hashed=[1])
    worker.close()


def test_a_batch_made_of_arrays_is_the_one_its_constructor_makes():
    """StoreBatch.of_arrays sets the frozen batch's slots itself (the
    scheduler makes one every decode step): the batch is equal to the one
    made field by field, stays frozen, and a hash of another length leaves
    its block out, as of_lists does."""
    import array
    import dataclasses

    from kvcsum.vllm.tier_values import UINT32_CODE, StoreBatch

    rng = random.Random(SEED + 9)
    print(f"\nseed {SEED} (KVCSUM_SEED)")
    count = rng.randrange(1, 40)
    group_ids = [rng.randrange(4) for _ in range(count)]
    positions = [rng.randrange(1 << 40) for _ in range(count)]
    block_ids = [rng.randrange(1 << 32) for _ in range(count)]
    hashes = [rng.randbytes(32) for _ in range(count)]
    made = StoreBatch.of_arrays(
        array.array(UINT32_CODE, group_ids), array.array("Q", positions), array.array(UINT32_CODE, block_ids), hashes
    )
    expected = StoreBatch(
        array.array(UINT32_CODE, group_ids), array.array("Q", positions), array.array(UINT32_CODE, block_ids),
        b"".join(hashes), 32,
    )
    assert type(made) is StoreBatch and made == expected
    names = [f.name for f in dataclasses.fields(StoreBatch)]
    assert [getattr(made, n) for n in names] == [getattr(expected, n) for n in names]
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.hashes = b""
    odd = rng.randrange(count)
    hashes[odd] = hashes[odd][:31]
    short = StoreBatch.of_arrays(
        array.array(UINT32_CODE, group_ids), array.array("Q", positions), array.array(UINT32_CODE, block_ids), hashes
    )
    assert short == StoreBatch.of_lists(group_ids, positions, block_ids, hashes)
    # The first hash's length is the batch's: a short first leaves the others out.
    assert short.num_blocks == (count - 1 if odd else 1)
