"""xxh3_64 over the bytes host_bench reads, for the comparison in
BENCHMARKS.md: 1 GiB of Llama-3.1-8B-like bf16 KV (32 layers, 8 KV heads of
128, 16-token blocks), hashed per block and layer as a tier would (64 KiB,
K and V, a chunk), on one thread. Needs numpy and xxhash (python-xxhash).

    python3 benches/xxh3_compare.py [--gib 1] [--reps 5]
"""

import argparse
import time

import numpy as np
import xxhash

CHUNK = 2 * 8 * 16 * 128 * 2  # K and V of one block of one layer, bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    size = int(args.gib * 2**30) // CHUNK * CHUNK
    data = np.random.default_rng(2026).integers(0, 256, size, dtype=np.uint8)
    view = memoryview(data)
    chunks = [view[i : i + CHUNK] for i in range(0, size, CHUNK)]
    best = {}
    for name, hash_chunk in [("xxh3_64", xxhash.xxh3_64_intdigest), ("xxh64", xxhash.xxh64_intdigest)]:
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            total = 0
            for chunk in chunks:
                total ^= hash_chunk(chunk)
            times.append(time.perf_counter() - start)
        best[name] = size / min(times) / 1e9
        print(f"{name} per block and layer ({CHUNK} bytes), one thread: {best[name]:.2f} GB/s (best of {args.reps}, median {size / sorted(times)[len(times) // 2] / 1e9:.2f})")
    start = time.perf_counter()
    for _ in range(args.reps):
        data.sum(dtype=np.uint64)
    print(f"numpy sum (a plain read, one thread): {size * args.reps / (time.perf_counter() - start) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
