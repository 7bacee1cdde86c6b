"""The cost of the short last value (SPEC section 9): a producer-role call,
which also computes each request's last position over one token fewer (one
more row per request and attention group), against a consumer-role call
over the same blocks, on the host engine (one thread): 8 layers of
Llama-8B-like HND KV (8 heads, 256 bytes a head and token) in 16-token
blocks, 128 requests of B blocks each, the last block of each partial
(16*B - 3 tokens). Median of 7 calls each, three rounds.

    cd build && PYTHONPATH=$PWD/../python KVCSUM_LIBRARY=$PWD/../target/release/libkvcsum.so \
        ./venv/bin/python ../benches/short_last_cost.py [B]
"""
import sys
import time

import numpy as np

import kvcsum

R, B, LAYERS = 128, int(sys.argv[1]) if len(sys.argv) > 1 else 16, 8
rng = np.random.default_rng(1)
nblocks = R * B
caches = [rng.integers(1, 2**63, (nblocks, 2, 8, 16, 32), dtype=np.uint64) for _ in range(LAYERS)]  # 256 B per head token
w = kvcsum.Worker(num_threads=1)
w.add_group(0, 16)
for i, c in enumerate(caches):
    w.add_region_of(c)
    w.add_layer(kvcsum.layer(c, "BKHTD", layer_number=i, group_id=0, identity=b"l%d" % i))
blocks = kvcsum.Blocks()
ids = rng.permutation(nblocks)
for r in range(R):
    blocks.add_request(f"r{r}", 16 * B - 3).add_group(f"r{r}", 0, ids[r * B:(r + 1) * B].tolist())
def t(role):
    times = []
    for _ in range(7):
        s = time.perf_counter()
        with w.checksum(blocks, role) as res:
            res.wait()
        times.append(time.perf_counter() - s)
    return sorted(times)[3]
for rep in range(3):
    c, p = t(kvcsum.CONSUMER), t(kvcsum.PRODUCER)
    print(f"{R} requests x {B} blocks, {nblocks * LAYERS * 2 * 8 * 16 * 256 / 2**20:.0f} MiB: consumer {c*1e3:.1f} ms, producer {p*1e3:.1f} ms, producer/consumer {p/c:.3f} (the short rows' tokens over the call's: {1 + 12 / 16 / B:.3f})")
