"""Same bytes, read differently: the KV arrives intact while the consumer
decodes it with another fp8 scale (or element type). KvcsumConnector
declares each layer's kv_cache_dtype, fp8 k_scale/v_scale and head size to
its kvcsum workers (kvcsum.vllm.decoding), the payload extension carries
the producer's, and the consumer's verdict is UNVERIFIED with
DECODING_DIFFERS, never MATCH.

Two engines of vLLM 0.33.0 in this process (tests/vllm/harness.py): a
producer (TP 2, 8-token blocks) and a consumer (TP 4, 16-token blocks). The
stand-in model has no attention modules, so each case puts stand-ins of
vLLM's Attention layers (their kv_cache_dtype and _k_scale_float /
_v_scale_float, as vLLM's kv-cache quantization sets them) into the
engine's static forward context, where the connector reads them at each
checksum.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import types

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
import store_connector  # noqa: E402
from harness import NUM_LAYERS, Engine, KVCacheLayout, layer_name  # noqa: E402

from kvcsum.vllm.decoding import dtype_name  # noqa: E402

PROMPT = [17 + (i * 11) % 700 for i in range(41)]


@pytest.fixture
def store():
    path = tempfile.mkdtemp(prefix="kvcsum-vllm-decoding-")
    store_connector.CORRUPT.clear()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def engines(store):
    p = Engine("producer", role="kv_producer", tp=2, block_size=8, layout=KVCacheLayout.LBNHC, store_dir=store)
    c = Engine(
        "consumer",
        role="kv_consumer",
        tp=4,
        block_size=16,
        layout=KVCacheLayout.LBHNC,
        store_dir=store,
        extra={"unverified": "log"},
    )
    return p, c


def attention_layers(engine: Engine, k_scales: dict, v_scale: float = 1.0, kv_cache_dtype: str = "fp8") -> None:
    """Stand-ins of vLLM's Attention layers with fp8 scales ({layer: k_scale})."""
    context = engine.vllm_config.compilation_config.static_forward_context
    for i in range(NUM_LAYERS):
        context[layer_name(i)] = types.SimpleNamespace(
            kv_cache_dtype=kv_cache_dtype, _k_scale_float=k_scales.get(i, 1.0), _v_scale_float=v_scale
        )


def transfer(p: Engine, c: Engine, req_id: str) -> tuple:
    """A P/D request: the producer's prefill, then the consumer's load;
    the consumer's (verdict, reason, message) and the producer's payload."""
    p.add_request(req_id, PROMPT, 1, {"do_remote_decode": True})
    p.run()
    params = dict(p.traces[req_id].kv_transfer_params)
    c.add_request(req_id, PROMPT, 2, params)
    c.run()
    return c.connector().last_verdicts[req_id], kvcsum.decode_payload(params["kv_checksums"])


def show(case: str, verdict: tuple) -> None:
    names = {kvcsum.MATCH: "MATCH", kvcsum.MISMATCH: "MISMATCH", kvcsum.UNVERIFIED: "UNVERIFIED"}
    name, reason, message = verdict
    print(f"\nCASE {case:<44} | {names[name] + (f' ({reason})' if reason else ''):<26} | {message[:160]}", flush=True)


def test_the_payload_carries_each_layers_decoding(store):
    p, c = engines(store)
    try:
        attention_layers(p, {0: 0.0125, 2: 0.03125})
        attention_layers(c, {0: 0.0125, 2: 0.03125})
        (name, reason, message), payload = transfer(p, c, "req-same")
        show("fp8 scales equal on both sides", (name, reason, message))
        assert name == kvcsum.MATCH, message
        decodings = {d.layer_number: d for d in payload.groups[0].decodings}
        assert sorted(decodings) == list(range(NUM_LAYERS))
        assert decodings[0].dtype == dtype_name("fp8", None) == "fp8_e4m3"
        assert (decodings[0].k_scale, decodings[2].k_scale, decodings[1].k_scale) == (0.0125, 0.03125, 1.0)
        assert decodings[3].head_size == 16 and decodings[3].v_scale == 1.0
    finally:
        p.close()
        c.close()


@pytest.mark.parametrize("side", ["consumer", "producer"])
def test_fp8_scales_that_differ_on_one_side_are_unverified_not_a_match(store, side):
    p, c = engines(store)
    try:
        attention_layers(p, {2: 0.03125})
        attention_layers(c, {2: 0.03125})
        # One side reads layer 2 with twice the K scale: the same bytes, other KV.
        attention_layers(c if side == "consumer" else p, {2: 0.0625})
        (name, reason, message), _ = transfer(p, c, f"req-scale-{side}")
        show(f"fp8 k_scale of layer 2 differs on the {side}", (name, reason, message))
        assert name == kvcsum.UNVERIFIED, message
        assert reason == "DECODING_DIFFERS", (reason, message)
        assert "layer 2: k_scale differs" in message, message
        low, high = ("0.03125", "0.0625") if side == "consumer" else ("0.0625", "0.03125")
        assert f"the producer's {low}" in message and f"the consumer's {high}" in message, message
    finally:
        p.close()
        c.close()


def test_another_kv_cache_dtype_is_unverified(store):
    p, c = engines(store)
    try:
        attention_layers(p, {}, kv_cache_dtype="fp8_e4m3")
        attention_layers(c, {}, kv_cache_dtype="fp8_e5m2")
        (name, reason, message), _ = transfer(p, c, "req-dtype")
        show("kv_cache_dtype fp8_e4m3 read as fp8_e5m2", (name, reason, message))
        assert name == kvcsum.UNVERIFIED and reason == "DECODING_DIFFERS", message
        assert 'dtype differs: the producer\'s "fp8_e4m3", the consumer\'s "fp8_e5m2"' in message, message
    finally:
        p.close()
        c.close()


def test_dtype_names_follow_the_spec():
    assert dtype_name("auto", "torch.bfloat16") == "bfloat16"
    assert dtype_name("auto", "torch.float16") == "float16"
    assert dtype_name("fp8", None, fp8="fp8_e4m3fnuz") == "fp8_e4m3fnuz"
    assert dtype_name("fp8_e5m2", "torch.uint8") == "fp8_e5m2"
    assert dtype_name("auto", "torch.float8_e4m3fn") == "fp8_e4m3"
    assert dtype_name("auto", None) is None
    assert dtype_name("Weird-Type!", None) is None


def test_deepseek_v4_sliding_window_records_name_their_fnuz_encoding():
    # vLLM writes DeepSeek V4's sliding-window fp8_ds_mla records in FNUZ
    # fp8 on gfx942 (its compressed states in OCP): the declared dtype says
    # so, an OCP side of the same layer then UNVERIFIED (DECODING_DIFFERS).
    from kvcsum.vllm.cache_checksums import LayerSpec
    from kvcsum.vllm.decoding import LayerDecodings

    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(cache_dtype="fp8_ds_mla"))
    swa = LayerSpec(name="model.layers.0.attn.swa_cache", group_id=0, spec_type="SlidingWindowMLASpec", block_size=64,
                    dtype="torch.uint8", head_size=512, is_mla=True)
    states = LayerSpec(name="model.layers.0.attn", group_id=1, spec_type="MLAAttentionSpec", block_size=64,
                       dtype="torch.uint8", head_size=512, is_mla=True)
    decodings = LayerDecodings.__new__(LayerDecodings)
    decodings._config = config
    for fp8, want_swa in (("fp8_e4m3", "fp8_ds_mla"), ("fp8_e4m3fnuz", "fp8_ds_mla_fnuz")):
        decodings._fp8 = fp8
        assert decodings.facts(swa, None)[0] == want_swa
        assert decodings.facts(states, None)[0] == "fp8_ds_mla"
