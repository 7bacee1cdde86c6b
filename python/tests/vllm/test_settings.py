"""KvcsumConnector's settings (kv_connector_extra_config): a key that is not
a setting is refused at startup, naming the valid ones; the "algorithm"
setting picks every worker's checksum algorithm, which the other side
learns from the payload's extension: equal algorithms verify, different
ones are UNVERIFIED (ALGORITHM_DIFFERS), never MISMATCH. In vLLM 0.33.0's
real scheduler and worker glue, on the CPU (the engines of test_connector.py)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
import store_connector  # noqa: E402
from test_connector import consumer, decode, prefill, producer, show, verdict  # noqa: E402


@pytest.fixture
def store():
    path = tempfile.mkdtemp(prefix="kvcsum-vllm-settings-")
    store_connector.CORRUPT.clear()
    yield path
    store_connector.CORRUPT.clear()
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    "key,hint",
    [("unverfied", "'unverified'"), ("algoritm", "'algorithm'"), ("verify_tier", "'verify_tiers'"), ("zzz", None)],
)
def test_an_unknown_key_is_refused_naming_the_valid_ones(key, hint):
    from kvcsum.vllm.config import KNOWN_KEYS, Settings

    with pytest.raises(ValueError) as raised:
        Settings.of({"inner": {"kv_connector": "x"}, key: "log"})
    message = str(raised.value)
    assert repr(key) in message
    for valid in KNOWN_KEYS:
        assert valid in message, (valid, message)
    if hint:
        assert f"did you mean {hint}?" in message
    else:
        assert "did you mean" not in message
    # Every known key alone is taken (with a value it accepts).
    accepted = {
        "inner": {"kv_connector": "x"}, "unverified": "log", "checksum_requests": "all", "verify_loads": "all",
        "verify_tiers": False, "unverified_tier": "fail", "tier_values": 8, "log_matches": True, "algorithm": "mixed",
        "unfailable_sync_loads": "decline",
    }
    assert set(accepted) == set(KNOWN_KEYS)
    Settings.of(accepted)


def test_an_unknown_key_stops_the_engine_at_startup(store):
    with pytest.raises(ValueError, match="'unverfied'.*did you mean 'unverified'"):
        consumer(store, extra={"unverfied": "log"})


@pytest.mark.parametrize(
    "value,want",
    [("mixed2", kvcsum.MIXED2), ("MIXED", kvcsum.MIXED), ("weighted", kvcsum.WEIGHTED), (None, kvcsum.MIXED2)],
)
def test_the_algorithm_setting_names_an_algorithm(value, want):
    from kvcsum.vllm.config import Settings

    extra = {} if value is None else {"algorithm": value}
    assert Settings.of(extra).algorithm == want
    for bad in ("mixed3", 2, "", None):
        if bad is None:
            continue
        with pytest.raises(ValueError, match="algorithm"):
            Settings.of({"algorithm": bad})


def _payload_algorithm(params: dict) -> int:
    import msgspec

    payload = msgspec.msgpack.decode(kvcsum.base64_decode(params["kv_checksums"]))
    return payload[3][-1] if len(payload) == 4 else kvcsum.WEIGHTED


@pytest.mark.parametrize(
    "p_algorithm,c_algorithm",
    [("mixed", "mixed"), ("weighted", "weighted"), ("mixed", None), (None, "mixed"), ("weighted", "mixed2")],
)
def test_the_algorithm_setting_reaches_the_workers_and_the_consumer_learns_it(store, p_algorithm, c_algorithm):
    p_extra = {} if p_algorithm is None else {"algorithm": p_algorithm}
    c_extra = {"unverified": "log"} | ({} if c_algorithm is None else {"algorithm": c_algorithm})
    p, c = producer(store, extra=p_extra), consumer(store, extra=c_extra)
    for state in p.ranks + c.ranks:
        engine_extra = p_extra if state in p.ranks else c_extra
        want = {"mixed2": kvcsum.MIXED2, "mixed": kvcsum.MIXED, "weighted": kvcsum.WEIGHTED}[
            engine_extra.get("algorithm", "mixed2")
        ]
        assert state.connector.worker_role._checksummer.worker._algorithm == want
    params = prefill(p, "req-alg")
    sent = {"mixed2": kvcsum.MIXED2, "mixed": kvcsum.MIXED, "weighted": kvcsum.WEIGHTED}[p_algorithm or "mixed2"]
    assert _payload_algorithm(params) == sent
    decode(c, "req-alg", params)
    name, _, _, _ = show(f"producer {p_algorithm or 'default'}, consumer {c_algorithm or 'default'}", c, "req-alg")
    if (p_algorithm or "mixed2") == (c_algorithm or "mixed2"):
        assert name == kvcsum.MATCH
    else:
        assert name == kvcsum.UNVERIFIED and verdict(c, "req-alg")[1] == "ALGORITHM_DIFFERS"


def test_a_weighted_consumer_verifies_a_plain_payload_as_a_vllm_fork_producer_sends_it(store):
    # A fork producer computes WEIGHTED and sends the plain payload (three
    # elements, no kvcsum extension, no kv_checksums_info): a consumer set
    # to "weighted" verifies it (equal block sizes); one left at the
    # default is UNVERIFIED (ALGORITHM_DIFFERS: a plain payload means
    # weighted), never MISMATCH.
    import msgspec

    from test_connector import C_BLOCK

    p = producer(store, block_size=C_BLOCK, extra={"algorithm": "weighted"})
    params = prefill(p, "req-plain")
    payload = msgspec.msgpack.decode(kvcsum.base64_decode(params["kv_checksums"]))
    plain = dict(params)
    plain.pop("kv_checksums_info")
    plain["kv_checksums"] = kvcsum.base64_encode(msgspec.msgpack.encode(payload[:3]))
    for algorithm, want in (("weighted", kvcsum.MATCH), ("mixed2", kvcsum.UNVERIFIED)):
        c = consumer(store, extra={"unverified": "log", "algorithm": algorithm})
        decode(c, "req-plain", dict(plain))
        name, _, _, _ = show(f"plain payload, consumer {algorithm}", c, "req-plain")
        assert name == want
        if want == kvcsum.UNVERIFIED:
            assert verdict(c, "req-plain")[1] == "ALGORITHM_DIFFERS"


def test_the_unfailable_sync_loads_setting_takes_async_or_decline():
    from kvcsum.vllm.config import Settings

    assert Settings.of({}).async_unfailable_sync_loads is True
    assert Settings.of({"unfailable_sync_loads": "decline"}).async_unfailable_sync_loads is False
    with pytest.raises(ValueError, match="unfailable_sync_loads"):
        Settings.of({"unfailable_sync_loads": "sync"})
