"""KvcsumConnector's Prometheus metrics, read from vLLM's own registry.

Each test runs a producer (engine 0) and a consumer (engine 1) in vLLM
0.33.0's real scheduler and worker glue on the CPU (harness.Engine), with
vLLM's PrometheusStatLogger recording every step's scheduler stats, as
vLLM's front end does (the connector stats through msgpack, as they travel
there). The metrics are then read from prometheus_client's registry by
name and labels, and compared with what each case must count. Prompts are
fresh random tokens each run (the seed is printed).
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import sys
import tempfile

import msgspec
import prometheus_client
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
import store_connector  # noqa: E402
from test_connector import consumer, decode, prefill, producer, totals, verdict  # noqa: E402

from vllm.v1.metrics.loggers import PrometheusStatLogger  # noqa: E402

SEED = int(os.environ.get("KVCSUM_TEST_SEED", random.randrange(2**32)))


@pytest.fixture
def store():
    path = tempfile.mkdtemp(prefix="kvcsum-vllm-metrics-")
    store_connector.CORRUPT.clear()
    store_connector.SEND.clear()
    yield path
    store_connector.CORRUPT.clear()
    store_connector.SEND.clear()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def rng(request):
    seed = f"{SEED}-{request.node.name}"
    print(f"\nseed {seed} (KVCSUM_TEST_SEED={SEED})", flush=True)
    return random.Random(seed)


def random_prompt(rng: random.Random) -> list:
    return [rng.randrange(3, 1000) for _ in range(rng.randint(20, 60))]


class Prometheus:
    """vLLM's PrometheusStatLogger over engines (engine index = position),
    fed each step's scheduler stats as vLLM's front end is."""

    def __init__(self, engines):
        self.logger = PrometheusStatLogger(engines[0].vllm_config, list(range(len(engines))))
        self.model = engines[0].vllm_config.model_config.served_model_name
        self.engines = engines
        for index, engine in enumerate(engines):
            engine.step = self._metered(engine.step, index)

    def _metered(self, step, index):
        def metered():
            outputs = step()
            for out in outputs.values():
                stats = out.scheduler_stats
                if stats is None:
                    continue
                if stats.kv_connector_stats is not None:
                    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(stats.kv_connector_stats))
                    stats = dataclasses.replace(stats, kv_connector_stats=wire)
                self.logger.record(scheduler_stats=stats, iteration_stats=None, engine_idx=index)
            return outputs

        return metered

    def flush(self) -> None:
        """One idle step of each engine: a worker's checksum times go out
        with the next step's stats (vLLM takes them before the worker
        metadata that waits for the checksums)."""
        for engine in self.engines:
            engine.step()

    def value(self, name: str, engine: int, **labels) -> float:
        found = prometheus_client.REGISTRY.get_sample_value(name, {"model_name": self.model, "engine": str(engine), **labels})
        return 0.0 if found is None else found

    def samples(self, name: str, engine: int) -> dict:
        """{labels beyond the engine's: value} of every sample of `name`."""
        out = {}
        for metric in prometheus_client.REGISTRY.collect():
            for sample in metric.samples:
                if sample.name == name and sample.labels.get("engine") == str(engine):
                    extra = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("engine", "model_name")))
                    out[extra] = sample.value
        return out


def load_counts(prom: Prometheus, engine: int, path: str) -> dict:
    return {
        "verified": prom.value("vllm:kvcsum_loads_verified_total", engine, path=path),
        "mismatched": prom.value("vllm:kvcsum_loads_mismatched_total", engine, path=path),
        "mismatched_blocks": prom.value("vllm:kvcsum_mismatched_blocks_total", engine, path=path),
        "unverified": {
            dict(labels)["reason"]: v
            for labels, v in prom.samples("vllm:kvcsum_loads_unverified_total", engine).items()
            if dict(labels)["path"] == path and v
        },
    }


NOTHING = {"verified": 0, "mismatched": 0, "mismatched_blocks": 0, "unverified": {}}


def test_an_intact_load_counts_one_verified_load_and_one_payload_sent(store, rng):
    p, c = producer(store), consumer(store)
    prom = Prometheus([p, c])
    prompt = random_prompt(rng)
    params = prefill(p, "req-metrics-intact", prompt)
    decode(c, "req-metrics-intact", params, prompt)
    prom.flush()
    assert verdict(c, "req-metrics-intact")[0] == kvcsum.MATCH
    assert load_counts(prom, 1, "pd") == {**NOTHING, "verified": 1}
    assert load_counts(prom, 1, "tier") == NOTHING
    assert load_counts(prom, 0, "pd") == NOTHING  # the producer loads nothing
    assert prom.value("vllm:kvcsum_payloads_sent_total", 0) == 1
    assert prom.value("vllm:kvcsum_payloads_missing_total", 0) == 0
    assert prom.value("vllm:kvcsum_payloads_sent_total", 1) == 0
    # One checksum call per worker: 2 producer workers (send), 4 consumer
    # workers (load); each took some time, none a re-check (no held send).
    for engine, kind, calls in ((0, "send", 2), (1, "load", 4), (0, "load", 0), (1, "send", 0), (0, "recheck", 0)):
        count = prom.value("vllm:kvcsum_checksum_seconds_count", engine, kind=kind)
        assert count == calls, (engine, kind, count)
        total = prom.value("vllm:kvcsum_checksum_seconds_sum", engine, kind=kind)
        assert (total > 0) == (calls > 0), (engine, kind, total)
        assert prom.value("vllm:kvcsum_checksum_seconds_bucket", engine, kind=kind, le="+Inf") == calls
    # The wrapped connector's own metrics still count: its 4 workers each loaded once.
    assert prom.value("vllm:store_connector_loads_total", 1) == 4
    # The same counts as the connector stats vLLM logs.
    assert totals(c).get("verified") == 1 and totals(p).get("payloads_sent") == 1
    print(f"CASE metrics of an intact load: {load_counts(prom, 1, 'pd')}", flush=True)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_corrupted_block_counts_one_mismatched_load_and_its_block(store, rng, policy):
    p, c = producer(store), consumer(store, policy=policy)
    prom = Prometheus([p, c])
    prompt = random_prompt(rng)
    params = prefill(p, "req-metrics-bad", prompt)
    token = rng.randrange(len(prompt))
    store_connector.CORRUPT.update(token=token, layer=f"model.layers.{rng.randrange(4)}.self_attn.attn", head=rng.randrange(4))
    decode(c, "req-metrics-bad", params, prompt)
    prom.flush()
    assert store_connector.CORRUPT.get("done") == 1
    assert verdict(c, "req-metrics-bad")[0] == kvcsum.MISMATCH, (token, verdict(c, "req-metrics-bad"))
    # One 16-token consumer block holds the corrupted token.
    assert load_counts(prom, 1, "pd") == {**NOTHING, "mismatched": 1, "mismatched_blocks": 1}
    assert load_counts(prom, 1, "tier") == NOTHING
    assert prom.value("vllm:kvcsum_payloads_sent_total", 0) == 1
    print(f"CASE metrics of a mismatch at token {token}, policy {policy}: {load_counts(prom, 1, 'pd')}", flush=True)


@pytest.mark.parametrize("unverified", ["fail", "log"])
def test_an_unverified_load_counts_under_its_reason(store, rng, unverified):
    p, c = producer(store), consumer(store, extra={"unverified": unverified})
    prom = Prometheus([p, c])
    prompt = random_prompt(rng)
    params = prefill(p, "req-metrics-nopayload", prompt)
    params.pop("kv_checksums")
    decode(c, "req-metrics-nopayload", params, prompt)
    # A second load whose payload is another request's.
    other_prompt = random_prompt(rng)
    other = prefill(p, "req-metrics-other", other_prompt)
    mine = prefill(p, "req-metrics-mine", prompt)
    mine["kv_checksums"], mine["kv_checksums_info"] = other["kv_checksums"], other["kv_checksums_info"]
    decode(c, "req-metrics-mine", mine, prompt)
    prom.flush()
    assert verdict(c, "req-metrics-nopayload")[1] == "NO_CHECKSUMS"
    assert verdict(c, "req-metrics-mine")[1] == "OTHER_REQUEST"
    assert load_counts(prom, 1, "pd") == {**NOTHING, "unverified": {"NO_CHECKSUMS": 1, "OTHER_REQUEST": 1}}
    assert load_counts(prom, 1, "tier") == NOTHING
    assert prom.value("vllm:kvcsum_payloads_sent_total", 0) == 3
    print(f"CASE metrics of unverified loads, unverified={unverified}: {load_counts(prom, 1, 'pd')}", flush=True)


def test_a_tier_load_counts_on_the_tier_path(store, rng):
    # A load from an offload tier (no do_remote_prefill, no payload): the
    # consumer's workers check it by block hash (verify_tiers, the default),
    # and the producer's blocks are unknown to them (another engine stored
    # them): UNVERIFIED on path "tier", nothing on "pd".
    p = producer(store)
    c = consumer(store, extra={"verify_loads": "all", "unverified": "log"})
    prom = Prometheus([p, c])
    prompt = random_prompt(rng)
    prefill(p, "req-metrics-tier", prompt)
    decode(c, "req-metrics-tier-hit", {"store_tier_key": "req-metrics-tier", "remote_num_tokens": len(prompt)}, prompt)
    prom.flush()
    assert all(rank.connector.inner.loads_done == 1 for rank in c.ranks)
    # The full blocks' hashes are unknown to the consumer (UNKNOWN_BLOCK); a
    # partial last block has no hash (NO_BLOCK_HASH): the random prompt's
    # length decides which the verdict names.
    name, reason = verdict(c, "req-metrics-tier-hit")[:2]
    assert name == kvcsum.UNVERIFIED and reason in ("UNKNOWN_BLOCK", "NO_BLOCK_HASH"), (name, reason)
    assert load_counts(prom, 1, "tier") == {**NOTHING, "unverified": {reason: 1}}
    assert load_counts(prom, 1, "pd") == NOTHING
    print(f"CASE metrics of a tier load: {load_counts(prom, 1, 'tier')}", flush=True)


def test_a_payload_that_missed_its_request_counts_as_missing(store, rng):
    # One producer worker's record comes a step after the request left: the
    # request goes without checksums (payloads_missing), none sent.
    p = producer(store)
    c = consumer(store, extra={"unverified": "log"})
    prom = Prometheus([p, c])
    rank1 = p.ranks[1].connector
    original = rank1.build_connector_worker_meta
    held = []

    def one_step_late():
        meta = original()
        if meta is not None and meta.notes and not held:
            held.append(meta)
            return None
        return held.pop() if held and held[0] is not meta else meta

    rank1.build_connector_worker_meta = one_step_late
    prompt = random_prompt(rng)
    p.add_request("req-metrics-late", prompt, 1, {"do_remote_decode": True})
    p.run()
    prom.flush()
    params = dict(p.traces["req-metrics-late"].kv_transfer_params)
    assert "kv_checksums" not in params
    assert prom.value("vllm:kvcsum_payloads_missing_total", 0) == 1
    assert prom.value("vllm:kvcsum_payloads_sent_total", 0) == 0
    decode(c, "req-metrics-late", params, prompt)
    prom.flush()
    assert load_counts(prom, 1, "pd") == {**NOTHING, "unverified": {"NO_CHECKSUMS": 1}}


def test_every_series_exists_at_zero_before_any_event(store):
    # Alerts on rate() need the series before the first event: every counter
    # without a reason, per engine and path, exists at 0 from the start.
    p, c = producer(store), consumer(store)
    prom = Prometheus([p, c])
    names = {m.name for m in prometheus_client.REGISTRY.collect() if m.name.startswith("vllm:kvcsum_")}
    from kvcsum.vllm.metrics import COUNTERS, HISTOGRAM

    assert names == {name for name, *_ in COUNTERS} | {HISTOGRAM[0]}
    for engine in (0, 1):
        for name, key, extra, _ in COUNTERS:
            if "reason" in extra:
                assert prom.samples(f"{name}_total", engine) == {}
            elif extra:
                assert prom.samples(f"{name}_total", engine) == {(("path", "pd"),): 0.0, (("path", "tier"),): 0.0}, name
            else:
                assert prom.samples(f"{name}_total", engine) == {(): 0.0}, name


def test_a_reason_outside_the_known_names_counts_as_other(store):
    # The reason label takes a bounded set of values: kvcsum.Reason's names,
    # the connector's own, and OTHER for anything else.
    from kvcsum.vllm.stats import KvcsumStats

    from vllm.v1.metrics.stats import SchedulerStats

    p = producer(store)
    prom = Prometheus([p])
    stats = KvcsumStats()
    stats.count_load("pd", "unverified", reason="FINGERPRINT_DIFFERS")
    stats.count_load("pd", "unverified", reason="made-up reason \x00 text")
    stats.count_load("tier", "unverified", reason="OTHER_REQUEST")
    stats.add("unverified")  # one counted without a reason
    prom.logger.record(scheduler_stats=SchedulerStats(kv_connector_stats={"KvcsumConnector": stats.data}), iteration_stats=None, engine_idx=0)
    assert load_counts(prom, 0, "pd")["unverified"] == {"FINGERPRINT_DIFFERS": 1, "OTHER": 1, "UNKNOWN": 1}
    assert load_counts(prom, 0, "tier")["unverified"] == {"OTHER_REQUEST": 1}
