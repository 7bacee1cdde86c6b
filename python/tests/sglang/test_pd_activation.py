"""kvcsum.sglang.activate_pd's startup checks and its payload row, in SGLang
0.5.23 (make sglang-test), in this process: another SGLang version, a
wrapped method missing or of another signature, and bad arguments each
refuse to start with a message naming what differs, wrapping nothing; the
row SGLang's MetadataBuffers gains carries a payload byte for byte, and an
empty, oversized or differently sized row reads as no payload (the decode
side's UNVERIFIED), never as a payload."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import sglang
from sglang.srt.disaggregation import decode as sgl_decode
from sglang.srt.disaggregation import prefill as sgl_prefill
from sglang.srt.disaggregation.utils import MetadataBuffers

from kvcsum.sglang import SGLangMismatch, activate_pd
from kvcsum.sglang import pd

WRAPPED = [
    (MetadataBuffers, "__init__"), (MetadataBuffers, "get_buf_infos"), (MetadataBuffers, "clear_slot"),
    (sgl_prefill.SchedulerDisaggregationPrefillMixin, "send_kv_chunk"),
    (sgl_decode.DecodeTransferQueue, "_commit_transfer_to_req"),
    (sgl_decode.SchedulerDisaggregationDecodeMixin, "_verify_kv_checksums"),
]


@pytest.fixture
def originals():
    before = {(cls, name): cls.__dict__[name] for cls, name in WRAPPED}
    yield before
    active = pd.active()
    if active is not None:
        active.deactivate()
    for (cls, name), function in before.items():
        assert cls.__dict__[name] is function, f"{cls.__name__}.{name} was left wrapped"


def unwrapped(originals) -> bool:
    return all(cls.__dict__[name] is function for (cls, name), function in originals.items())


def test_another_sglang_version_refuses_to_start_and_wraps_nothing(originals, monkeypatch):
    monkeypatch.setattr(sglang, "__version__", "0.5.24")
    with pytest.raises(SGLangMismatch, match=r"SGLang 0\.5\.23.*installed SGLang is '0\.5\.24'"):
        activate_pd()
    assert unwrapped(originals) and pd.active() is None


def test_a_wrapped_method_of_another_signature_is_named_and_nothing_is_wrapped(originals, monkeypatch):
    def send_kv_chunk(self, req, last_chunk=False):  # end_idx gone
        pass

    monkeypatch.setattr(sgl_prefill.SchedulerDisaggregationPrefillMixin, "send_kv_chunk", send_kv_chunk)
    monkeypatch.delattr(sgl_decode.DecodeTransferQueue, "_commit_transfer_to_req")
    with pytest.raises(SGLangMismatch) as error:
        activate_pd()
    text = str(error.value)
    assert (
        "SchedulerDisaggregationPrefillMixin.send_kv_chunk takes (self, req, last_chunk), "
        "expected (self, req, last_chunk, end_idx)" in text
    ), text
    assert "DecodeTransferQueue._commit_transfer_to_req is missing" in text, text
    assert pd.active() is None
    assert MetadataBuffers.__dict__["get_buf_infos"] is originals[(MetadataBuffers, "get_buf_infos")]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_payload_bytes": 0}, "max_payload_bytes must be an int in \\[256, 16777216\\], got 0"),
        ({"max_payload_bytes": True}, "max_payload_bytes must be an int .* got True"),
        ({"max_payload_bytes": "4096"}, "max_payload_bytes must be an int .* got '4096'"),
        ({"unverified": "maybe"}, "unverified must be \"admit\" or \"fail\", got 'maybe'"),
    ],
)
def test_bad_arguments_are_refused_by_name(originals, kwargs, message):
    with pytest.raises(ValueError, match=message):
        activate_pd(**kwargs)
    assert unwrapped(originals)


def test_activating_again_returns_the_same_or_refuses_other_settings(originals):
    first = activate_pd(max_payload_bytes=1024)
    assert activate_pd(max_payload_bytes=1024) is first
    with pytest.raises(RuntimeError, match="already active with max_payload_bytes=1024.*asked for 2048"):
        activate_pd(max_payload_bytes=2048)
    first.deactivate()
    assert unwrapped(originals)


def test_the_payload_row_carries_a_payload_and_reads_every_other_row_as_none(originals):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    activation = activate_pd(max_payload_bytes=1024)
    buffers = MetadataBuffers(4, hidden_size=16, hidden_states_dtype=torch.float16, max_sampling_mask_tokens=16)
    ptrs, lens, items = buffers.get_buf_infos()
    assert ptrs[-1] == buffers.kvcsum_payload.data_ptr() and items[-1] == 1024 + pd.ROW_HEADER.size, seed
    assert lens[-1] == 4 * items[-1], seed

    payload = rng.integers(0, 256, 1000, dtype=np.uint8).tobytes()
    assert pd.write_row(buffers, 2, payload, activation)
    assert pd.read_row(buffers, 2) == (payload, ""), seed
    assert pd.read_row(buffers, 1)[0] is None  # never written
    assert "no kvcsum payload arrived" in pd.read_row(buffers, 1)[1]

    assert not pd.write_row(buffers, 3, payload + bytes(100), activation)
    got, why = pd.read_row(buffers, 3)
    assert got is None and "did not fit its 1024-byte row" in why, why

    buffers.clear_slot(2)
    assert pd.read_row(buffers, 2)[0] is None, seed

    # A prefill whose row is of another size: its header says so.
    assert pd.write_row(buffers, 0, payload[:10], activation)
    buffers.kvcsum_payload[0, 8:12] = torch.frombuffer(bytearray((2048).to_bytes(4, "little")), dtype=torch.uint8)
    got, why = pd.read_row(buffers, 0)
    assert got is None and "holds 2048 bytes, this decode's 1024" in why, why


def test_the_sglang_plugin_does_nothing_unless_asked(originals, monkeypatch):
    monkeypatch.delenv(pd.ENV, raising=False)
    pd.sglang_plugin()
    monkeypatch.setenv(pd.ENV, "0")
    pd.sglang_plugin()
    assert pd.active() is None and unwrapped(originals)


@pytest.mark.parametrize(
    "value,message",
    [
        ("max_payload_bytes=lots", "max_payload_bytes must be an integer, got 'lots'"),
        ("colour=blue", "got 'colour=blue'"),
        ("unverified=sometimes", "unverified must be \"admit\" or \"fail\", got 'sometimes'"),
    ],
)
def test_bad_plugin_settings_stop_the_process_by_name(originals, monkeypatch, value, message):
    monkeypatch.setenv(pd.ENV, value)
    with pytest.raises(SystemExit, match=message):
        pd.sglang_plugin()
    assert unwrapped(originals)


def test_sglangs_plugin_loader_finds_the_entry_point_and_does_not_swallow_a_refusal(originals, monkeypatch, plugin_site):
    import importlib

    import sglang.srt.plugins as plugins

    monkeypatch.syspath_prepend(plugin_site)
    importlib.invalidate_caches()
    monkeypatch.setenv(pd.ENV, "max_payload_bytes=2048")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    plugins.load_plugins()  # SGLang's own loader, as each of its processes runs it
    assert pd.active() is not None and pd.active().max_payload_bytes == 2048
    pd.active().deactivate()

    monkeypatch.setattr(sglang, "__version__", "0.6.0")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    with pytest.raises(SystemExit, match=r"KVCSUM_SGLANG_PD is set but the P/D check cannot start: .*'0\.6\.0'"):
        plugins.load_plugins()
    assert pd.active() is None and unwrapped(originals)


# --- The wrapped methods in this process, the transport a copy ---------------------------------


class _Sender:
    """Records what SGLang's _send_kv_chunk hands the sender (the transport
    stands in: the test copies those pages into the decode pool)."""

    supports_host_tensor_indices = False

    def __init__(self):
        self.sent = []

    def get_max_transfer_tokens(self):
        return None

    def should_send_kv_chunk(self, num_pages, last_chunk):
        return num_pages > 0 or last_chunk

    def send(self, page_indices, state_indices=None, num_kv_tokens=None):
        self.sent.extend(int(p) for p in page_indices)


def _engine(prefill: bool, pool_type=None, dtype=torch.float16):
    import types

    from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    pool = (pool_type or MHATokenToKVPool)(128, 4, dtype, 4, 8, 2, "cpu", False, start_layer=0, end_layer=1)
    mixin = SchedulerDisaggregationPrefillMixin if prefill else SchedulerDisaggregationDecodeMixin
    s = type("Scheduler", (mixin,), {})()
    s.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(128, 4, torch.int64, "cpu", pool, False)
    s.req_to_token_pool = ReqToTokenPool(4, 64, "cpu", False)
    s.disagg_metadata_buffers = MetadataBuffers(4, hidden_size=16, hidden_states_dtype=torch.float16, max_sampling_mask_tokens=16)
    manager = types.SimpleNamespace(
        kv_args=types.SimpleNamespace(state_types=[], total_kv_head_num=4), attn_tp_rank=0, attn_tp_size=1, pp_size=1
    )
    s.disagg_prefill_bootstrap_queue = s.disagg_decode_prealloc_queue = types.SimpleNamespace(
        kv_manager=manager, kv_checksum_signature=0
    )
    s.kv_checksum_computer, s.enable_staging, s.attn_tp_cpu_group = None, False, None
    s.disagg_prefill_pending_chunk_rids = set()
    s.failed = []
    s._handle_kv_checksum_mismatch = lambda req, msg: s.failed.append((req.rid, msg))  # the failure path, recorded
    return s, pool


def _request(s, tokens, rid, prefix):
    import types

    row = int(s.req_to_token_pool.alloc_rows(1)[0])
    indices = s.token_to_kv_pool_allocator.alloc(-(-len(tokens) // 4) * 4)
    s.req_to_token_pool.req_to_token[row, : len(indices)] = indices.to(torch.int32)
    return types.SimpleNamespace(
        rid=rid, bootstrap_room=abs(hash(rid)) % 10**9, origin_input_ids=tokens, extend_end=len(tokens),
        start_send_idx=prefix, disagg_decode_prefix_len=prefix, kv=types.SimpleNamespace(req_pool_idx=row, cache_protected_len=prefix),
        metadata_buffer_index=row % 4, output_ids=[1], cached_tokens=0, cached_tokens_device=0, cached_tokens_host=0,
        cached_tokens_storage=0, get_mm_token_counts=lambda: (0, 0, 0), return_logprob=False, return_sampling_mask=False,
        hidden_states_tensor=None, disagg_kv_sender=_Sender(),
    ), indices[: len(tokens)]


@pytest.mark.parametrize("decode_dtype", [torch.float16, torch.bfloat16])
def test_only_the_pages_sent_are_judged_health_checks_are_not_and_an_uncovered_pool_is_unverified(originals, decode_dtype):
    """A decode that already holds a 1-page prefix: only the rest is sent and
    judged (damage in the prefix is decode's own and not this transfer's);
    a health check carries no payload and is not judged; a pool kvcsum does
    not cover (another class, an fp8 cache read with scales) is UNVERIFIED,
    and with unverified="fail" goes to the failure path. A decode whose pool is bf16 against an fp16 prefill (the same
    bytes, read as other numbers): UNVERIFIED, never MISMATCH or MATCH."""
    seed = int.from_bytes(os.urandom(4), "little")
    generator = torch.Generator().manual_seed(seed)
    activation = activate_pd(max_payload_bytes=1024)
    prefill, ppool = _engine(True)
    decode, dpool = _engine(False, dtype=decode_dtype)
    for buffer in (*ppool.k_buffer, *ppool.v_buffer, *dpool.k_buffer, *dpool.v_buffer):
        buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, buffer.shape, generator=generator, dtype=torch.int16))
    tokens = torch.randint(1, 1000, (15,), generator=generator).tolist()
    reqs = []
    for rid in ("a", "b", "HEALTH_CHECK_c"):
        preq, pidx = _request(prefill, tokens, rid, prefix=4)
        prefill.send_kv_chunk(preq, last_chunk=True)  # SGLang's own, wrapped
        dreq, didx = _request(decode, tokens, rid, prefix=4)
        assert preq.disagg_kv_sender.sent == [int(p) for p in pidx[4::4] // 4], seed  # the pages past the prefix
        for name in ("k_buffer", "v_buffer"):  # the transport
            for p, d in zip(getattr(ppool, name), getattr(dpool, name)):
                d.view(torch.int16)[didx[4:]] = p.view(torch.int16)[pidx[4:]]  # the bytes
        decode.disagg_metadata_buffers.kvcsum_payload[dreq.metadata_buffer_index] = (
            prefill.disagg_metadata_buffers.kvcsum_payload[preq.metadata_buffer_index]
        )
        pd.take_payload(decode.disagg_metadata_buffers, __import__("types").SimpleNamespace(req=dreq, metadata_buffer_index=dreq.metadata_buffer_index))
        reqs.append((dreq, didx))
    dpool.k_buffer[0][reqs[0][1][1], 0, 0:1].view(torch.int16).bitwise_xor_(1)  # in a's prefix page
    dpool.v_buffer[1][reqs[1][1][9], 2, 3:4].view(torch.int16).bitwise_xor_(1)  # in b's page position 2
    batch = __import__("types").SimpleNamespace(reqs=[r for r, _ in reqs])
    batch.filter_batch = lambda keep_indices: setattr(batch, "reqs", [batch.reqs[i] for i in keep_indices])
    decode._verify_kv_checksums(batch)
    assert "HEALTH_CHECK_c" not in activation.verdicts, seed
    assert not prefill.disagg_metadata_buffers.kvcsum_payload[reqs[2][0].metadata_buffer_index].any(), seed
    if decode_dtype != torch.float16:
        for rid in ("a", "b"):
            got = activation.verdicts[rid]
            assert got.verdict == "UNVERIFIED" and "bytes differently" in got.message and "fail-open" in got.message, (seed, got.message)
        assert [r.rid for r in batch.reqs] == ["a", "b", "HEALTH_CHECK_c"] and not decode.failed, seed
        activation.deactivate()
        return
    assert activation.verdicts["a"].verdict == "MATCH", (seed, activation.verdicts["a"])
    b = activation.verdicts["b"]
    assert b.verdict == "MISMATCH" and b.bad_positions == (2,) and b.bad_pages == (int(reqs[1][1][8]) // 4,), (seed, b)
    assert [r.rid for r in batch.reqs] == ["a", "HEALTH_CHECK_c"] and [f[0] for f in decode.failed] == ["b"], seed
    activation.deactivate()

    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    other = type("OtherPool", (MHATokenToKVPool,), {})
    # A pool on a device no engine of kvcsum reads (its buffers moved to
    # torch's "meta" device, standing in for an NPU's or XPU's; SGLang's
    # pool cannot be built there): named, UNVERIFIED, the step goes on.
    for mode, pool_type, dtype, named, device in (
        ("admit", other, torch.float16, "OtherPool", "cpu"), ("fail", other, torch.float16, "OtherPool", "cpu"),
        ("admit", MHATokenToKVPool, torch.float8_e4m3fn, "float8_e4m3fn", "cpu"),
        ("admit", MHATokenToKVPool, torch.float16, "this engine's pool is on device meta", "meta"),
        ("fail", MHATokenToKVPool, torch.float16, "this engine's pool is on device meta", "meta"),
    ):
        activation = activate_pd(unverified=mode)
        decode, pool = _engine(False, pool_type=pool_type, dtype=dtype)
        if device != "cpu":
            pool.k_buffer = [b.to(device) for b in pool.k_buffer]
            pool.v_buffer = [b.to(device) for b in pool.v_buffer]
        dreq, _ = _request(decode, tokens, f"d-{mode}", prefix=0)
        dreq._kvcsum_pd_payload = pd.ArrivedPayload(b"not judged")
        batch = __import__("types").SimpleNamespace(reqs=[dreq])
        batch.filter_batch = lambda keep_indices, batch=batch: setattr(batch, "reqs", [batch.reqs[i] for i in keep_indices])
        decode._verify_kv_checksums(batch)
        got = activation.verdicts[f"d-{mode}"]
        assert got.verdict == "UNVERIFIED" and named in got.message, got
        assert got.failed == (mode == "fail") and len(batch.reqs) == (0 if mode == "fail" else 1), got
        assert [f[0] for f in decode.failed] == ([f"d-{mode}"] if mode == "fail" else []), got
        activation.deactivate()
