#!/usr/bin/env python3
"""The storage-tier test over Mooncake Store (`make e2e-test`, part of
`make test`).

A real mooncake_master on 127.0.0.1 (from the mooncake-transfer-engine-
non-cuda wheel, with its HTTP metadata server), started and stopped here
with a bounded wait, and a real store client (TCP). The tier is the one of
examples/python/mooncake_store.py: a request's blocks offloaded as one
object, the 16-byte stored checksum of each block (Worker.store, SPEC
section 8) first, then the blocks; loaded back into other block ids with
their 16 bytes and checked (Worker.check_stored, the Verifier's
check_stored). Each round, on fresh random data (request length, block
ids, hashes, cache contents and fault places from the seed):

- intact: every position MATCHED, the verdict MATCH;
- bits flipped where the store keeps the object (the memory replica):
  exactly the positions whose valid tokens differ from what was stored
  FAILED, the verdict MISMATCH naming them, a flip past the last valid
  token read by nobody (MATCH);
- a flipped 16-byte entry: that position never MATCHED;
- another request's object under this request's hashes: no position
  MATCHED;
- range reads (get_into_ranges: one block and its 16 bytes out of the
  object, which Mooncake's own object CRC cannot check): each MATCHED
  exactly when its block is as stored.

The reference is a byte comparison of what was loaded against what was
stored (valid tokens only). Exits 1 when any expectation fails, and when
Mooncake cannot be imported; KVCS_E2E_SEED=N repeats a run.
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "examples", "python"))

import mooncake_store as tier  # noqa: E402

import kvcsum  # noqa: E402

ROUNDS = 3


class Run:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.failed: list = []

    def expect(self, case: str, ok: bool, detail: str) -> None:
        print(f"  {case:<58} {'ok' if ok else 'FAILED'}: {detail}")
        if not ok:
            self.failed.append(f"{case}: {detail}")


def valid_tokens(position: int, num_tokens: int) -> int:
    return min(tier.BLOCK, num_tokens - position * tier.BLOCK)


def same_valid(engine, a: int, b_cache: np.ndarray, tokens: int) -> bool:
    """Whether block `a` of the engine holds, in its first `tokens` tokens,
    what `b_cache` (one block's [layers, 2, heads, 16, 64]) holds."""
    return np.array_equal(engine.cache[:, a, :, :, :tokens], b_cache[:, :, :, :tokens])


def round_(run: Run, store, number: int) -> None:
    rng = run.rng
    engine = tier.Engine(rng)
    num_blocks = int(rng.integers(2, 6))
    num_tokens = int(rng.integers((num_blocks - 1) * tier.BLOCK + 1, num_blocks * tier.BLOCK + 1))
    ids = [int(i) for i in rng.permutation(tier.NUM_BLOCKS)]
    stored_ids, loaded_ids, spare = ids[:num_blocks], ids[num_blocks : 2 * num_blocks], ids[2 * num_blocks]
    hashes = [rng.bytes(32) for _ in range(num_blocks)]
    req, key = f"req-{number}", f"kv/{hashes[-1].hex()}/tp0"
    print(f"round {number}: {num_tokens} tokens, blocks {stored_ids} stored, loaded into {loaded_ids}")
    originals = [engine.cache[:, b].copy() for b in stored_ids]
    tier.put_chunk(store, key, engine, req, num_tokens, stored_ids, hashes)

    def load_and_judge():
        tier.get_chunk(store, key, engine, loaded_ids)
        outcomes, verdict, message = tier.check_load(engine, req, num_tokens, loaded_ids, hashes)
        differs = [
            p for p in range(num_blocks)
            if not same_valid(engine, loaded_ids[p], originals[p], valid_tokens(p, num_tokens))
        ]
        return outcomes, verdict, message, differs

    outcomes, verdict, message, differs = load_and_judge()
    run.expect(
        "intact load: MATCH",
        verdict == kvcsum.MATCH and differs == [] and all(o == kvcsum.STORED_MATCHED for o in outcomes),
        f"{verdict.name} {message}",
    )

    # Bits flipped in the store, in the blocks' bytes (some past the last
    # valid token of the last block, which no check reads).
    layout = (tier.LAYERS, 2, tier.HEADS, tier.BLOCK, tier.HEAD_DIM)
    flips = []
    for _ in range(int(rng.integers(1, 4))):
        position = int(rng.integers(0, num_blocks))
        layer, kv, head, token = (int(rng.integers(0, n)) for n in layout[:4])
        element = int(rng.integers(0, tier.HEAD_DIM))
        index = np.ravel_multi_index((layer, kv, head, token, element), layout)
        offset = num_blocks * tier.ENTRY + position * tier.BLOCK_BYTES + int(index) * 2 + int(rng.integers(0, 2))
        tier.flip_in_store(store, key, offset, int(rng.integers(0, 8)))
        flips.append((position, layer, kv, head, token))
    outcomes, verdict, message, differs = load_and_judge()
    failed = [p for p, o in enumerate(outcomes) if o == kvcsum.STORED_FAILED]
    named = all(f"position {p} (" in message for p in differs)
    want = kvcsum.MISMATCH if differs else kvcsum.MATCH
    run.expect(
        f"flips (position, layer, K/V, head, token) {flips}",
        failed == differs and verdict == want and (named or not differs),
        f"failed {failed}, bytes differ at {differs}; {verdict.name} {message}",
    )

    # Range reads: each position alone, out of the (now damaged) object.
    for position in range(num_blocks):
        tier.get_block_range(store, key, engine, num_blocks, position, spare, staging)
        outcome, verdict, message = tier.check_load(
            engine, req, num_tokens, [spare], [hashes[position]], first_position=position
        )
        intact = same_valid(engine, spare, originals[position], valid_tokens(position, num_tokens))
        run.expect(
            f"range read of position {position} alone",
            verdict == (kvcsum.MATCH if intact else kvcsum.MISMATCH)
            and list(outcome) == [kvcsum.STORED_MATCHED if intact else kvcsum.STORED_FAILED],
            f"block {'as stored' if intact else 'damaged'}; {verdict.name} {message}",
        )

    # A flipped 16-byte entry (the blocks stored again, intact, under a
    # new key).
    remove(store, key)
    key += "/again"
    for p, b in enumerate(stored_ids):
        engine.cache[:, b] = originals[p]
    tier.put_chunk(store, key, engine, req, num_tokens, stored_ids, hashes)
    position = int(rng.integers(0, num_blocks))
    tier.flip_in_store(store, key, position * tier.ENTRY + int(rng.integers(0, tier.ENTRY)), int(rng.integers(0, 8)))
    outcomes, verdict, message, differs = load_and_judge()
    run.expect(
        f"a bit flipped in position {position}'s 16 bytes: never MATCHED",
        differs == [] and outcomes[position] != kvcsum.STORED_MATCHED and verdict != kvcsum.MATCH
        and all(o == kvcsum.STORED_MATCHED for p, o in enumerate(outcomes) if p != position),
        f"outcomes {[kvcsum.StoredOutcome(int(o)).name for o in outcomes]}; {verdict.name} {message}",
    )

    # Another request's object (other KV, its own valid entries) under
    # this request's key and hashes.
    other_hashes = [rng.bytes(32) for _ in range(num_blocks)]
    other = tier.Engine(rng)
    remove(store, key)
    key += "/other"
    tier.put_chunk(store, key, other, f"other-{number}", num_tokens, stored_ids, other_hashes)
    outcomes, verdict, message, differs = load_and_judge()
    run.expect(
        "another request's object: no position MATCHED",
        verdict != kvcsum.MATCH and not any(o == kvcsum.STORED_MATCHED for o in outcomes),
        f"outcomes {[kvcsum.StoredOutcome(int(o)).name for o in outcomes]}; {verdict.name}",
    )
    other.close()
    remove(store, key)
    engine.close()


def remove(store, key: str) -> None:
    status = store.remove(key, force=True)
    if status != 0:
        raise RuntimeError(f"remove({key!r}) returned {status}")


staging = np.zeros(tier.ENTRY + tier.BLOCK_BYTES, dtype=np.uint8)


def main() -> int:
    seed = int(os.environ.get("KVCS_E2E_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"Mooncake Store tier test, seed {seed} (KVCS_E2E_SEED={seed} repeats this run)")
    run = Run(seed)
    master = tier.Master()
    try:
        store = master.client()
        print(f"mooncake_master on 127.0.0.1:{master.rpc}, metadata on 127.0.0.1:{master.http}")
        if store.register_buffer(staging.ctypes.data, staging.nbytes) != 0:
            raise RuntimeError("register_buffer failed")
        for number in range(ROUNDS):
            round_(run, store, number)
        store.unregister_buffer(staging.ctypes.data)
        store.close()
    finally:
        master.stop()
    if run.failed:
        print(f"{len(run.failed)} expectation(s) failed (seed {seed}):")
        for line in run.failed:
            print(f"  {line}")
        return 1
    print(f"Mooncake Store tier test: every expectation held (seed {seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
