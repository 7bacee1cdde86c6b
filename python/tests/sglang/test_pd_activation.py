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
