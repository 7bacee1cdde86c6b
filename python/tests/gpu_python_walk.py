"""docs/python.md's CUDA walk, run as written on a GPU, then checked.

Not run by `make test` (no GPU there). On a machine with a CUDA GPU, torch
and a built kvcsum, from the repository root:

    KVCSUM_LIBRARY=$PWD/target/release/libkvcsum.so PYTHONPATH=$PWD/python \\
        python3 python/tests/gpu_python_walk.py

The example of "On a GPU: device=, streams and wait()" is taken from the
page and executed; its values must equal a host worker's over a CPU copy of
the same caches (the host engine is checked against the SPEC's naive
reference by the other tests), and so must a device checksum queued on a
side torch.cuda.Stream (made to wait for the stream that wrote the KV), one
passed as a raw CUstream int and one through __cuda_stream__. Prints one
line per check and "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import pathlib
import re
import sys

import numpy as np
import torch

import kvcsum

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
SECTION = "On a GPU: device=, streams and wait()"
passed = failed = 0


def check(ok: bool, what: str) -> None:
    global passed, failed
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    passed, failed = passed + ok, failed + (not ok)


def example() -> str:
    text = (DOCS / "python.md").read_text()
    start = text.index(f"\n## {SECTION}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)[0]


def host_values(kv_caches, block_size, block_ids, num_tokens) -> np.ndarray:
    """The same checksum by a host worker over CPU copies of the caches."""
    copies = [c.cpu() for c in kv_caches]
    with kvcsum.Worker() as worker, kvcsum.Blocks() as blocks:
        worker.add_group(0, block_size)
        for i, cache in enumerate(copies):
            worker.add_region_of(cache)
            worker.add_layer(kvcsum.layer(cache, "KBTHD", layer_number=i))
        blocks.add_request("req-0", num_tokens)
        blocks.add_group("req-0", 0, block_ids)
        with worker.checksum(blocks) as result:
            return result.column("req-0", 0)


def device_values(kv_caches, block_size, block_ids, num_tokens, stream) -> np.ndarray:
    with kvcsum.Worker(device=kv_caches[0].device.index or 0) as worker, kvcsum.Blocks() as blocks:
        worker.add_group(0, block_size)
        for i, cache in enumerate(kv_caches):
            worker.add_region_of(cache)
            worker.add_layer(kvcsum.layer(cache, "KBTHD", layer_number=i))
        blocks.add_request("req-0", num_tokens)
        blocks.add_group("req-0", 0, block_ids)
        with worker.checksum(blocks, cuda_stream=stream) as result:
            return result.wait().column("req-0", 0)


class ProtocolStream:
    def __init__(self, stream):
        self.stream = stream

    def __cuda_stream__(self):
        return (0, self.stream.cuda_stream)


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_python_walk: no CUDA device", file=sys.stderr)
        return 2
    scope: dict = {}
    exec(compile(example(), "docs/python.md", "exec"), scope)  # noqa: S102 - the page's own example
    torch.cuda.synchronize()
    kv_caches, block_size = scope["kv_caches"], scope["block_size"]
    values = scope["values"]
    want = host_values(kv_caches, block_size, [3, 1, 6], 40)
    check(values.dtype == np.uint64 and len(values) == 3, f"the example gives 3 uint64 values: {values}")
    check(np.array_equal(values, want), "the example's device values equal a host worker's over the same bytes")
    check(isinstance(scope["record"], bytes) and len(scope["record"]) > 0, "the example's record is bytes")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    check(np.array_equal(device_values(kv_caches, block_size, [3, 1, 6], 40, side), want),
          "a side torch.cuda.Stream (waiting for the writer) gives the same values")
    check(np.array_equal(device_values(kv_caches, block_size, [3, 1, 6], 40, side.cuda_stream), want),
          "a raw CUstream int gives the same values")
    check(np.array_equal(device_values(kv_caches, block_size, [3, 1, 6], 40, ProtocolStream(side)), want),
          "an object with __cuda_stream__ gives the same values")

    # Ordering: a write queued on the stream before the call is seen by it.
    stream = torch.cuda.current_stream()
    kv_caches[0][0, 3, 0, 0, 0] += 1.0
    after = device_values(kv_caches, block_size, [3, 1, 6], 40, stream)
    changed = host_values(kv_caches, block_size, [3, 1, 6], 40)
    check(np.array_equal(after, changed) and after[0] != want[0] and np.array_equal(after[1:], want[1:]),
          "a write queued before the call on its stream is in the values (position 0 only)")
    print(f"gpu_python_walk: {passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
