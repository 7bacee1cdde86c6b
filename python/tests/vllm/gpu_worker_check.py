"""The worker part of kvcsum's vLLM connector on a GPU, with torch alone (no
vLLM): device workers over CUDA tensors in every layout vLLM's attention
backends use, on torch's current stream, must give the values host workers
give over the same bytes in host memory, and the same as the reference
layout's.

Not run by `make test` (no GPU there). On a machine with a CUDA GPU, torch
and a built kvcsum:

    KVCSUM_LIBRARY=$PWD/target/release/libkvcsum.so PYTHONPATH=$PWD/python \\
        python3 python/tests/vllm/gpu_worker_check.py

Prints one line per check and "N passed, 0 failed"; exits non-zero on any
failure.
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import kvcsum  # noqa: E402
from kvcsum.vllm.cache_checksums import Job  # noqa: E402
from layouts import LAYOUTS, MLA_LAYOUTS, checksummer, jobs, lay_out, layer_specs, logical_caches  # noqa: E402

NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD = 3, 64, 8, 16, 64


def _values(worker, role, job_list, stream=None) -> dict:
    pending = worker.checksum(job_list, role, cuda_stream=stream)
    result = pending.result
    result.wait()
    out = {}
    for job in job_list:
        for key, column in result.columns(job.req_id, 0).items():
            out[(job.req_id, key)] = column.copy()
    record = result.encode()
    result.close()
    return out, record


def _jobs():
    many = [Job(f"r{i}", 16 * (i % 5) + 7 + i, {0: (0, list(range(3 * i, 3 * i + 1 + (16 * (i % 5) + 7 + i) // 16)))}) for i in range(12)]
    return jobs(BLOCK) + many


def check_layout(layout: str, role: int, mla: bool = False) -> str:
    heads = 1 if mla else HEADS
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, heads, BLOCK, 2 * HEAD, seed=11)
    specs = layer_specs(NUM_LAYERS, BLOCK, heads, HEAD, mla=mla)
    reference_layout = "MLA" if mla else "LBHNC"
    reference, _ = _values(checksummer(specs, lay_out(logical, reference_layout), NUM_BLOCKS, BLOCK), role, _jobs())
    host, host_record = _values(checksummer(specs, lay_out(logical, layout), NUM_BLOCKS, BLOCK), role, _jobs())
    device_caches = lay_out(logical, layout, device="cuda")
    device_worker = checksummer(specs, device_caches, NUM_BLOCKS, BLOCK)
    assert device_worker.device == torch.cuda.current_device(), device_worker.device
    # The KV arrives on torch's current stream (a side stream here), behind a
    # long kernel: the checksum, queued on that stream, must see it, not the
    # zeros the caches hold until then.
    saved = [cache.clone() for cache in device_caches]
    for cache in device_caches:
        cache.zero_()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        for cache, source in zip(device_caches, saved):
            cache.copy_(source)
        device, device_record = _values(device_worker, role, _jobs())
    torch.cuda.synchronize()
    assert device.keys() == host.keys() == reference.keys()
    for key in reference:
        assert (host[key] == reference[key]).all(), f"host {layout} differs from {reference_layout} at {key}"
        assert (device[key] == host[key]).all(), f"device {layout} differs from host at {key}"
    assert device_record == host_record, "device and host records differ"
    return f"{sum(len(v) for v in device.values())} values equal (device, host, {reference_layout})"


def check_tp_on_device() -> str:
    """TP 2 ranks on the device add up to TP 1 on the host (payload bytes)."""
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, seed=13)
    whole = checksummer(layer_specs(NUM_LAYERS, BLOCK, HEADS, HEAD), lay_out(logical, "LBNHC"), NUM_BLOCKS, BLOCK)
    records = [whole.checksum(_jobs(), kvcsum.PRODUCER).record()]
    expected = _payloads(records, 1)
    records = []
    for rank in range(2):
        shard = [t[:, rank * HEADS // 2 : (rank + 1) * HEADS // 2] for t in logical]
        specs = layer_specs(NUM_LAYERS, BLOCK, HEADS // 2, HEAD, total_kv_heads=HEADS)
        worker = checksummer(specs, lay_out(shard, "FI", device="cuda"), NUM_BLOCKS, BLOCK, tp_rank=rank, tp_size=2)
        records.append(worker.checksum(_jobs(), kvcsum.PRODUCER).record())
    got = _payloads(records, 2)
    # The payloads' plain parts are equal; a MIXED2 payload's extension also
    # names the producer's TP size (1 and 2), so compare by verifying: the
    # device's TP 2 payloads must match the host's TP 1 consumer record.
    consumer_record = whole.checksum(_jobs(), kvcsum.CONSUMER).record()
    with kvcsum.Verifier(1) as verifier, kvcsum.Blocks() as blocks:
        for job in _jobs():
            job.to_blocks(blocks)
        verifier.expect(blocks, kvcsum.CONSUMER)
        verifier.add_record(consumer_record)
        for job, payload, host_payload in zip(_jobs(), got, expected):
            for sent in (payload, host_payload):
                with verifier.check(job.req_id, sent) as report:
                    assert report.verdict == kvcsum.MATCH, report.message
    return f"{len(got)} payloads of TP 2 on the device verify against TP 1 on the host"


def check_pinned_host_cache_beside_cuda(role: int) -> str:
    """A layer's cache in pinned host memory beside CUDA caches (as
    HiSparse's host pool is): the device worker reads it across the bus,
    with the values and record a host worker gives over the same bytes.
    Unpinned host memory there is refused by name, and a host worker
    refuses a CUDA tensor (the library alone cannot tell its address from
    a host one)."""
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, seed=17)
    specs = layer_specs(NUM_LAYERS, BLOCK, HEADS, HEAD)
    host, host_record = _values(checksummer(specs, lay_out(logical, "LBHNC"), NUM_BLOCKS, BLOCK), role, _jobs())
    caches = lay_out(logical, "LBHNC", device="cuda")
    caches[1] = caches[1].cpu().pin_memory()
    assert caches[1].is_pinned()
    worker = checksummer(specs, caches, NUM_BLOCKS, BLOCK)
    assert worker.device == torch.cuda.current_device(), worker.device
    device, device_record = _values(worker, role, _jobs())
    assert device.keys() == host.keys()
    for key in host:
        assert (device[key] == host[key]).all(), f"device with a pinned layer differs from host at {key}"
    assert device_record == host_record, "device (a pinned layer) and host records differ"
    caches[1] = caches[1].clone()  # unpinned
    assert not caches[1].is_pinned()
    try:
        checksummer(specs, caches, NUM_BLOCKS, BLOCK)
    except ValueError as error:
        assert "not pinned" in str(error), error
    else:
        raise AssertionError("unpinned host memory beside CUDA caches was taken")
    with kvcsum.Worker() as host_worker:
        try:
            host_worker.add_region_of(torch.zeros(64, device="cuda"))
        except kvcsum.InvalidArgument as error:
            assert "CUDA device memory" in str(error), error
        else:
            raise AssertionError("a host worker took a CUDA tensor")
    return f"{len(host)} columns equal the host worker's; unpinned host memory and a host worker's CUDA tensor refused"


def _payloads(records, num_workers):
    out = []
    with kvcsum.Verifier(num_workers) as verifier, kvcsum.Blocks() as blocks:
        for job in _jobs():
            job.to_blocks(blocks)
        verifier.expect(blocks, kvcsum.PRODUCER)
        for record in records:
            verifier.add_record(record)
        for job in _jobs():
            out.append(verifier.payload(job.req_id))
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        print("0 passed, 1 failed")
        return 1
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; kvcsum {kvcsum.version()}", flush=True)
    checks = []
    for role in (kvcsum.PRODUCER, kvcsum.CONSUMER):
        for layout in LAYOUTS:
            checks.append((f"{layout} {'producer' if role == kvcsum.PRODUCER else 'consumer'}", lambda l=layout, r=role: check_layout(l, r)))
        for layout in MLA_LAYOUTS:
            checks.append((f"{layout} {'producer' if role == kvcsum.PRODUCER else 'consumer'}", lambda l=layout, r=role: check_layout(l, r, mla=True)))
    checks.append(("TP 2 on the device = TP 1 on the host", check_tp_on_device))
    for role in (kvcsum.PRODUCER, kvcsum.CONSUMER):
        name = f"a pinned host cache beside CUDA caches, {'producer' if role == kvcsum.PRODUCER else 'consumer'}"
        checks.append((name, lambda r=role: check_pinned_host_cache_beside_cuda(r)))
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
