"""The worker part of kvcsum's vLLM connector on CPU tensors, with torch and
without vLLM: every attention backend's layout gives the same checksums,
TP shards add up to the unsharded values, and the fingerprints are the vLLM
fork's."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
from kvcsum.vllm.cache_checksums import Job, LayerSpec, layer_fingerprint, layer_number  # noqa: E402
from layouts import LAYOUTS, MLA_LAYOUTS, checksummer, jobs, lay_out, layer_specs, logical_caches, values  # noqa: E402

NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD = 3, 8, 4, 16, 8


def test_worker_part_needs_no_vllm():
    import subprocess

    code = (
        "import sys, kvcsum.vllm.cache_checksums, kvcsum.vllm.tier_values, kvcsum.vllm.params; "
        "assert 'vllm' not in sys.modules, 'vllm imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.stdout.strip() == "ok", out.stderr


def test_fork_identity_and_layer_number():
    name = "model.layers.7.self_attn.attn"
    digest = hashlib.sha256(repr((name, "FullAttentionSpec", 16, "torch.bfloat16")).encode()).digest()
    assert layer_fingerprint(name, "FullAttentionSpec", 16, "torch.bfloat16") == int.from_bytes(digest[:8], "little")
    assert layer_number(name) == 7
    with pytest.raises(ValueError):
        layer_number("model.layers.1.experts.2.attn")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("role", [kvcsum.PRODUCER, kvcsum.CONSUMER])
def test_every_layout_checksums_alike(layout, role):
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    specs = layer_specs(NUM_LAYERS, BLOCK, HEADS, HEAD)
    reference = values(checksummer(specs, lay_out(logical, "LBHNC"), NUM_BLOCKS, BLOCK), role, jobs(BLOCK))
    got = values(checksummer(specs, lay_out(logical, layout), NUM_BLOCKS, BLOCK), role, jobs(BLOCK))
    assert got.keys() == reference.keys()
    for key in reference:
        assert (got[key] == reference[key]).all(), (layout, key)


def _payload(records: list, num_workers: int, job_list) -> list:
    with kvcsum.Verifier(num_workers) as verifier, kvcsum.Blocks() as blocks:
        for job in job_list:
            job.to_blocks(blocks)
        verifier.expect(blocks, kvcsum.PRODUCER)
        for record in records:
            verifier.add_record(record)
        return _plain(verifier.payload(job_list[0].req_id))


def _plain(payload: bytes) -> list:
    """The payload's plain part, [1, num_tokens, groups]: a MIXED2 payload's
    extension also names the producer's TP size, which differs between the
    TP sizes compared here."""
    import msgspec

    return msgspec.msgpack.decode(payload)[:3]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_shards_add_up(tp):
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, seed=3)
    whole = checksummer(layer_specs(NUM_LAYERS, BLOCK, HEADS, HEAD), lay_out(logical, "LBNHC"), NUM_BLOCKS, BLOCK)
    expected = _payload([whole.checksum(jobs(BLOCK), kvcsum.PRODUCER).record()], 1, jobs(BLOCK))
    records = []
    per_rank = max(1, HEADS // tp)
    for rank in range(tp):
        first = (rank * HEADS // tp) if tp <= HEADS else rank // (tp // HEADS)
        shard = [t[:, first : first + per_rank] for t in logical]
        specs = layer_specs(NUM_LAYERS, BLOCK, per_rank, HEAD, total_kv_heads=HEADS)
        worker = checksummer(specs, lay_out(shard, "FA" if rank % 2 else "LBHNC"), NUM_BLOCKS, BLOCK, tp_rank=rank, tp_size=tp)
        records.append(worker.checksum(jobs(BLOCK), kvcsum.PRODUCER).record())
    assert _payload(records, tp, jobs(BLOCK)) == expected


def test_mla_layouts_and_replicas():
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, 1, BLOCK, 2 * HEAD, seed=5)
    specs = layer_specs(NUM_LAYERS, BLOCK, 1, HEAD, mla=True)
    payloads = []
    for layout in MLA_LAYOUTS:
        worker = checksummer(specs, lay_out(logical, layout), NUM_BLOCKS, BLOCK)
        payloads.append(_payload([worker.checksum(jobs(BLOCK), kvcsum.PRODUCER).record()], 1, jobs(BLOCK)))
    # TP 2: each rank holds the whole latent cache (replicated).
    records = [
        checksummer(specs, lay_out(logical, "MLA"), NUM_BLOCKS, BLOCK, tp_rank=r, tp_size=2).checksum(jobs(BLOCK), kvcsum.PRODUCER).record()
        for r in range(2)
    ]
    payloads.append(_payload(records, 2, jobs(BLOCK)))
    assert payloads[0] == payloads[1] == payloads[2]


def test_kv_sharing_counts_in_the_fingerprint_once_in_the_sums():
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, seed=7)
    plain_specs = layer_specs(NUM_LAYERS, BLOCK, HEADS, HEAD)
    shared = {NUM_LAYERS: 1}  # layer 3 reads layer 1's cache
    shared_specs = layer_specs(NUM_LAYERS, BLOCK, HEADS, HEAD, shared=shared)
    caches = lay_out(logical, "LBNHC")
    plain = checksummer(plain_specs, caches, NUM_BLOCKS, BLOCK)
    sharing = checksummer(shared_specs, caches, NUM_BLOCKS, BLOCK, shared=shared)
    assert values(plain, kvcsum.PRODUCER, jobs(BLOCK)) .keys() == values(sharing, kvcsum.PRODUCER, jobs(BLOCK)).keys()
    a, b = values(plain, kvcsum.PRODUCER, jobs(BLOCK)), values(sharing, kvcsum.PRODUCER, jobs(BLOCK))
    assert all((a[k] == b[k]).all() for k in a)
    fork = sum(layer_fingerprint(s.name, s.spec_type, s.block_size, s.dtype) for s in shared_specs) % 2**64
    assert sharing.fingerprints[0] == fork != plain.fingerprints[0]


def test_unsupported_groups_are_skipped_with_a_reason():
    logical = logical_caches(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    specs = layer_specs(NUM_LAYERS, BLOCK, HEADS, HEAD)
    state = LayerSpec(name="model.layers.9.mixer", group_id=1, spec_type="MambaSpec", block_size=BLOCK, dtype="torch.float16", kind="state", unsupported="MambaSpec has no per-token KV blocks")
    kv = {s.name: c for s, c in zip(specs, lay_out(logical, "LBNHC"))}
    import torch

    kv[state.name] = torch.zeros(4)
    worker = __import__("kvcsum.vllm.cache_checksums", fromlist=["CacheChecksummer"]).CacheChecksummer(
        specs + [state], kv, NUM_BLOCKS, {0: BLOCK, 1: BLOCK}
    )
    assert worker.skipped == {1: "MambaSpec has no per-token KV blocks"}
    record = worker.checksum([Job("a", 45, {0: (0, [3, 1, 6])})], kvcsum.PRODUCER).record()
    assert record


# --- which engine reads the caches (cache_checksums.worker_device) ---------------------------


class _Device:
    def __init__(self, kind, index=None):
        self.type, self.index = kind, index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


class _Cache:
    """What worker_device reads of a torch tensor: what makes it one to
    kvcsum (data_ptr, element_size, stride), its device and, in host
    memory, whether it is pinned (duck-typed: no GPU needed)."""

    def __init__(self, kind, index=None, pinned=False):
        self.device, self._pinned = _Device(kind, index), pinned

    def data_ptr(self):
        return 0

    def element_size(self):
        return 2

    def stride(self):
        return (1,)

    def is_pinned(self):
        return self._pinned


def _specs(*unsupported):
    return [
        LayerSpec(name=f"model.layers.{i}.attn", group_id=i, spec_type="FullAttentionSpec", block_size=BLOCK,
                  dtype="torch.bfloat16", unsupported=why)
        for i, why in enumerate(unsupported)
    ]


def test_the_worker_device_is_the_caches_cuda_device_or_the_host():
    from kvcsum.vllm.cache_checksums import worker_device

    specs = _specs("", "", "")
    names = [s.name for s in specs]
    assert worker_device(specs, dict.fromkeys(names, _Cache("cpu"))) == kvcsum.HOST
    assert worker_device(specs, dict.fromkeys(names, _Cache("cuda", 1))) == 1
    assert worker_device(specs, dict.fromkeys(names, _Cache("cuda"))) == 0  # torch's "cuda", no index
    # A pinned host cache beside CUDA ones is read by the device worker.
    mixed = {names[0]: _Cache("cuda", 2), names[1]: _Cache("cpu", pinned=True), names[2]: _Cache("cuda", 2)}
    assert worker_device(specs, mixed) == 2


def test_a_host_resident_group_beside_cuda_caches_does_not_refuse_the_worker():
    # HiSparse's source group: its pages in HiSparse's host pool (CPU
    # views, v1/hisparse/binding.py allocate_hisparse_kv_caches), the other
    # groups on the GPU. The group is named not checksummed and never
    # read, so its tensors decide nothing: before, the worker refused to
    # start ("partly on a CUDA device, partly on the host").
    from kvcsum.vllm.cache_checksums import worker_device

    specs = _specs("its KV is host-resident", "")
    caches = {specs[0].name: _Cache("cpu"), specs[1].name: _Cache("cuda", 0)}
    assert worker_device(specs, caches) == 0
    # Were it checksummed, its unpinned host memory would be refused, named.
    with pytest.raises(ValueError, match=r"model.layers.0.attn's KV cache is in host memory that is not pinned.*device 0"):
        worker_device(_specs("", ""), caches)


@pytest.mark.parametrize(
    "caches, match",
    [
        ([_Cache("xpu", 0), _Cache("xpu", 0)], r"model.layers.0.attn's KV cache is on device xpu:0: kvcsum checksums KV in host memory or on CUDA"),
        ([_Cache("cuda", 0), _Cache("hpu")], r"model.layers.1.attn's KV cache is on device hpu"),
        ([_Cache("cuda", 0), _Cache("cuda", 1)], r"several CUDA devices: \[0, 1\]"),
    ],
)
def test_caches_no_engine_reads_are_refused_naming_the_layer(caches, match):
    from kvcsum.vllm.cache_checksums import worker_device

    specs = _specs("", "")
    with pytest.raises(ValueError, match=match):
        worker_device(specs, {s.name: c for s, c in zip(specs, caches)})


def test_caches_on_a_gpu_of_rocms_torch_are_refused_naming_rocm(monkeypatch):
    from kvcsum.vllm.cache_checksums import worker_device

    monkeypatch.setattr(sys.modules["torch"].version, "hip", "6.4.0", raising=False)
    specs = _specs("")
    with pytest.raises(ValueError, match=r"model.layers.0.attn's KV cache is on a GPU of ROCm's torch \(HIP 6.4.0\): kvcsum's device engine runs on CUDA only"):
        worker_device(specs, {specs[0].name: _Cache("cuda", 0)})
    # ROCm's torch on the host (vLLM's CPU backend): a host worker.
    assert worker_device(specs, {specs[0].name: _Cache("cpu")}) == kvcsum.HOST
