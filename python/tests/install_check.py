"""The install test of the wheel (make python-test): run by the Python of a
fresh venv into which pip installed the manylinux wheel of `make
python-wheel`, with neither KVCSUM_LIBRARY nor PYTHONPATH set, from outside
the source tree. It fails unless

- the package imported is the installed one, from a wheel tagged
  py3-none-manylinux_*, and the library loaded is the file inside it
  (kvcsum/libkvcsum.so), not the source tree's target/release or a system
  copy;
- a real checksum through that library agrees with itself across layouts
  (the same random KV cache as NHD and as HND gives the same values, which
  are not all zero), and a producer's payload verified against the
  consumer's record is a MATCH, and a MISMATCH at exactly the block that
  was changed.

Random data is seeded; the seed is printed, and KVCS_SEED changes it.
"""

import importlib.metadata
import os
import pathlib
import sys

import numpy as np

SEED = int(os.environ.get("KVCS_SEED", "0x776865656C"), 0)
TOKENS, HEADS, DIM = 16, 4, 64


def fail(message: str) -> None:
    sys.exit(f"install check: FAIL (seed {SEED:#x}): {message}")


def main() -> None:
    print(f"install check: random data seed {SEED:#x}")
    for name in ("KVCSUM_LIBRARY", "PYTHONPATH"):
        if os.environ.get(name):
            fail(f"{name} is set ({os.environ[name]}); the installed wheel must need neither")

    import kvcsum

    package = pathlib.Path(kvcsum.__file__).resolve().parent
    prefix = pathlib.Path(sys.prefix).resolve()
    if prefix not in package.parents:
        fail(f"kvcsum was imported from {package}, not from this venv ({prefix})")
    wheel = importlib.metadata.distribution("kvcsum").read_text("WHEEL") or ""
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    if not tags or not all(tag.startswith("py3-none-manylinux") for tag in tags):
        fail(f"the installed wheel's tags are {tags}, not py3-none-manylinux_*")
    loaded = pathlib.Path(kvcsum.library().path).resolve()
    if loaded != package / "libkvcsum.so":
        fail(f"the library loaded is {loaded}, not the one in the package ({package / 'libkvcsum.so'})")
    if kvcsum.version() != kvcsum.__version__:
        fail(f"the bundled library is version {kvcsum.version()}, the package {kvcsum.__version__}")

    rng = np.random.default_rng(SEED)
    num_blocks = 6
    nhd = rng.integers(0, 2**16, (num_blocks, TOKENS, HEADS, DIM), dtype=np.uint16)
    hnd = np.ascontiguousarray(nhd.transpose(0, 2, 1, 3))
    block_ids = [int(b) for b in rng.permutation(num_blocks)[:4]]
    num_tokens = 3 * TOKENS + 5

    def checksum(cache, layout, role):
        with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
            worker.add_region_of(cache)
            worker.add_group(0, TOKENS)
            worker.add_layer(kvcsum.layer(cache, layout, layer_number=0, identity=b"layer 0"))
            blocks.add_request("req", num_tokens).add_group("req", 0, block_ids)
            with worker.checksum(blocks, role) as result:
                return result.column("req", 0), result.encode()

    values_nhd, producer_record = checksum(nhd, "NHD", kvcsum.PRODUCER)
    values_hnd, _ = checksum(hnd, "HND", kvcsum.PRODUCER)
    if len(values_nhd) != len(block_ids) or not values_nhd.any():
        fail(f"checksums {values_nhd} for {len(block_ids)} blocks")
    if not np.array_equal(values_nhd, values_hnd):
        fail(f"the same cache gives {values_nhd} as NHD and {values_hnd} as HND")

    def verdict(consumer_cache):
        _, consumer_record = checksum(consumer_cache, "HND", kvcsum.CONSUMER)
        with kvcsum.Verifier(1) as producer, kvcsum.Verifier(1) as consumer, kvcsum.Blocks() as scheduled:
            scheduled.add_request("req", num_tokens).add_group("req", 0, block_ids)
            producer.expect(scheduled, kvcsum.PRODUCER)
            producer.add_record(producer_record)
            consumer.expect(scheduled, kvcsum.CONSUMER)
            consumer.add_record(consumer_record)
            with consumer.check("req", producer.payload("req")) as report:
                return report.verdict, [(m.first_position, m.num_positions) for m in report.mismatches]

    if verdict(hnd) != (kvcsum.MATCH, []):
        fail(f"an unchanged load gives {verdict(hnd)}")
    position = int(rng.integers(0, len(block_ids)))
    corrupted = hnd.copy()
    # A token every position holds (the last one holds num_tokens % TOKENS).
    token = int(rng.integers(0, num_tokens % TOKENS))
    corrupted[block_ids[position], int(rng.integers(0, HEADS)), token, int(rng.integers(0, DIM))] ^= 1
    if verdict(corrupted) != (kvcsum.MISMATCH, [(position, 1)]):
        fail(f"one bit flipped in block position {position} gives {verdict(corrupted)}")
    print(f"install check: ok: kvcsum {kvcsum.__version__} ({tags[0]}) from {package} over {loaded}")


if __name__ == "__main__":
    main()
