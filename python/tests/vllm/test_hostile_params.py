"""kv_transfer_params are hostile: whatever a client sends in them, the
consumer's KvcsumConnector judges the load UNVERIFIED (with a reason) or,
where only the checksum values were changed, MISMATCH; never MATCH, and
nothing it sends takes the engine down.

The same two engines as test_connector.py (vLLM 0.33.0's real Scheduler and
worker glue, on the CPU): a producer (TP 2, 8-token blocks) prefills once;
the consumer (TP 1 here, 16-token blocks, to keep a few thousand loads
quick) loads that KV again and again under damaged params.
"""

from __future__ import annotations

import base64
import logging
import os
import random
import shutil
import sys
import tempfile

import msgspec
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
import store_connector  # noqa: E402
from harness import Engine, KVCacheLayout, sampled_token  # noqa: E402
from kvcsum.vllm.params import Checksums, Unusable, parse_load  # noqa: E402
from test_connector import PROMPT, consumer, decode, prefill, producer, show, totals, verdict  # noqa: E402


@pytest.fixture
def store():
    path = tempfile.mkdtemp(prefix="kvcsum-vllm-hostile-")
    store_connector.CORRUPT.clear()
    yield path
    store_connector.CORRUPT.clear()
    shutil.rmtree(path, ignore_errors=True)


def expected(n: int) -> list:
    return [sampled_token(len(PROMPT) - 1 + i) for i in range(n)]


# --- each hostile field once, through both engines ------------------------------------


def _with_info(params: dict, **fields) -> dict:
    out = dict(params)
    out["kv_checksums_info"] = {**params["kv_checksums_info"], **fields}
    return out


HOSTILE = {
    "kv_checksums an int": lambda p: {**p, "kv_checksums": 12345},
    "kv_checksums a huge int": lambda p: {**p, "kv_checksums": 2**200},
    "kv_checksums a list": lambda p: {**p, "kv_checksums": [p["kv_checksums"]]},
    "kv_checksums a string holding a NUL": lambda p: {**p, "kv_checksums": p["kv_checksums"][:8] + "\0" + p["kv_checksums"][8:]},
    "kv_checksums a non-ASCII string": lambda p: {**p, "kv_checksums": "é" + p["kv_checksums"]},
    "kv_checksums_info a list": lambda p: {**p, "kv_checksums_info": [1, 2]},
    "token digest not count:hex": lambda p: _with_info(p, tokens="forty-five"),
    "token digest with a huge count": lambda p: _with_info(p, tokens="9" * 40 + ":" + "0" * 32),
    "token digest an int": lambda p: _with_info(p, tokens=45),
    "token digest of another count": lambda p: _with_info(p, tokens="44:" + p["kv_checksums_info"]["tokens"].split(":")[1]),
    "block_sizes a string": lambda p: _with_info(p, block_sizes="8"),
    "block_sizes 0": lambda p: _with_info(p, block_sizes={"0": 0}),
    "block_sizes 2^40": lambda p: _with_info(p, block_sizes={"0": 2**40}),
    "block_sizes a bool": lambda p: _with_info(p, block_sizes={"0": True}),
    "block_sizes keyed by junk": lambda p: _with_info(p, block_sizes={"zero": 8}),
    "block_sizes keyed by a negative group": lambda p: _with_info(p, block_sizes={"-1": 8}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_checksum_field_of_the_wrong_shape_is_unverified_never_an_exception(store, case):
    p = producer(store)
    c = consumer(store, extra={"unverified": "log"})
    params = HOSTILE[case](prefill(p, "req-hostile"))
    trace = decode(c, "req-hostile", params)
    name, count, first, state = show(f"hostile: {case}", c, "req-hostile")
    reason, message = verdict(c, "req-hostile")[1:]
    assert name == kvcsum.UNVERIFIED, (case, reason, message)
    assert reason in ("INVALID_CHECKSUMS", "OTHER_REQUEST"), (case, reason, message)
    # unverified=log: the intact load is used.
    assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected(3)
    assert (count, first) == (1, len(PROMPT) - 1)
    assert totals(c).get("unverified") == 1


def test_a_hostile_field_under_unverified_fail_recomputes_the_load(store):
    p = producer(store)
    c = consumer(store)
    params = HOSTILE["kv_checksums a list"](prefill(p, "req-hostile-fail"))
    trace = decode(c, "req-hostile-fail", params)
    name, count, first, state = show("hostile kv_checksums, unverified=fail", c, "req-hostile-fail")
    assert name == kvcsum.UNVERIFIED and verdict(c, "req-hostile-fail")[1] == "INVALID_CHECKSUMS"
    assert (count, first) == (len(PROMPT), 0)
    assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected(3)


def test_a_mismatch_beside_a_group_that_cannot_be_compared_repeats_the_whole_load(store):
    # Two KV cache groups: the KV of group 1 is corrupted, and the payload
    # gives group 0 another fingerprint, so group 0 cannot be compared. The
    # repair plan refuses to name blocks (reloading them would leave group 0
    # unverified): the whole load is failed and computed again.
    p = producer(store, sliding_window=64)
    c = consumer(store, sliding_window=64)
    params = prefill(p, "req-mixed")
    plain = msgspec.msgpack.decode(kvcsum.base64_decode(params["kv_checksums"]))
    for entry in plain[2]:
        if entry[0] == 0:
            entry[1] ^= 1 << 17
    params["kv_checksums"] = kvcsum.base64_encode(msgspec.msgpack.encode(plain))
    store_connector.CORRUPT.update(token=20, layer="model.layers.1.self_attn.attn", head=3)
    trace = decode(c, "req-mixed", params)
    assert store_connector.CORRUPT.get("done") == 1
    name, count, first, state = show("mismatch in group 1, group 0 not comparable", c, "req-mixed")
    message = verdict(c, "req-mixed")[2]
    assert name == kvcsum.MISMATCH and "the whole load is repeated" in message, message
    assert (count, first) == (len(PROMPT), 0)
    assert state == "FINISHED_LENGTH_CAPPED" and trace.output_tokens == expected(3)


# --- generated params ------------------------------------------------------------------


def _junk(rng: random.Random, depth: int = 0):
    """A JSON value of any shape."""
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return rng.choice([0, 1, -1, 2**31, 2**32, 2**63, 2**64, -(2**63), 2**rng.randrange(65, 400)])
    if kind == 1:
        return rng.random() * 10 ** rng.randrange(-5, 300)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        alphabet = "AZaz09+/=\0\n\t é:-" + "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(4))
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 80)))
    if kind == 4:
        return base64.b64encode(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 120)))).decode()
    if kind == 5:
        return ""
    if kind == 6:
        return str(rng.randrange(-5, 2**40))
    if kind == 7:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if kind == 8:
        return {str(_junk(rng, depth + 1))[:20]: _junk(rng, depth + 1) for _ in range(rng.randrange(0, 5))}
    return [[_junk(rng, depth + 2)]] * rng.randrange(1, 4)


def _damaged_payload(rng: random.Random, text: str) -> tuple[str, str]:
    """The payload with one field damaged, re-encoded: (base64, what changed).
    Only fields that take part in the verdict are damaged."""
    plain = msgspec.msgpack.decode(kvcsum.base64_decode(text))
    version, num_tokens, groups, ext = plain
    [[group, fingerprint, first, values]] = groups
    ext_version, tp, ext_groups, algorithm = ext
    # Version 3 of the extension adds marks and decodings per group.
    [[ext_group, ext_block, detail, coverage, *ext_rest]] = ext_groups
    field = rng.choice(
        [
            "version", "num_tokens", "group", "fingerprint", "first", "values_length", "value_bits",
            "ext_version", "ext_group", "ext_block", "coverage", "algorithm", "trailing", "truncated", "extra_element",
        ]
    )

    def other(value, low=0, high=2**64 - 1):
        while True:
            new = rng.choice([rng.randrange(low, min(high, 64) + 1), rng.randrange(low, high + 1)])
            if new != value:
                return new

    if field == "version":
        version = other(version, 0, 255)
    elif field == "num_tokens":
        num_tokens = other(num_tokens, 0, 2**63)
    elif field == "group":
        group = other(group, 0, 2**32 - 1)
    elif field == "fingerprint":
        fingerprint = other(fingerprint)
    elif field == "first":
        first = other(first, 0, 2**40)
    elif field == "values_length":
        cut = rng.choice([1, 3, 7, 9, len(values) - 1])
        values = values[:-cut] if rng.random() < 0.5 else values + bytes(cut)
    elif field == "value_bits":
        raw = bytearray(values)
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        values = bytes(raw)
    elif field == "ext_version":
        ext_version = other(ext_version, 0, 255)
    elif field == "ext_group":
        ext_group = other(ext_group, 0, 2**32 - 1)
    elif field == "ext_block":
        ext_block = other(ext_block, 0, 2**32 - 1)
    elif field == "coverage":
        coverage = other(coverage)
    elif field == "algorithm":
        algorithm = other(algorithm, 0, 2**32 - 1)
    plain = [version, num_tokens, [[group, fingerprint, first, values]], [ext_version, tp, [[ext_group, ext_block, detail, coverage, *ext_rest]], algorithm]]
    if field == "extra_element":
        plain.append(rng.randrange(100))
    data = msgspec.msgpack.encode(plain)
    if field == "trailing":
        data += bytes([rng.randrange(256)])
    elif field == "truncated":
        data = data[: rng.randrange(1, len(data))]
    return kvcsum.base64_encode(data), field


def generate(rng: random.Random, genuine: dict) -> tuple[dict, str]:
    """Params carrying the genuine P/D fields and one damaged kvcsum field:
    (params, category). Extra keys of any shape ride along."""
    params = dict(genuine)
    info = dict(genuine["kv_checksums_info"])
    category = rng.choice(["payload_junk", "payload_text", "payload_field", "info_junk", "tokens", "block_sizes"])
    if category == "payload_junk":
        params["kv_checksums"] = _junk(rng)
        if params["kv_checksums"] is None:
            params["kv_checksums"] = [None]
    elif category == "payload_text":
        text = genuine["kv_checksums"]
        cut = rng.randrange(1, len(text))
        choice = rng.randrange(4)
        if choice == 0:
            text = text[:cut]
        elif choice == 1:
            text = text[:cut] + rng.choice("\0!*é ") + text[cut:]
        elif choice == 2:
            text = text + "A" * rng.randrange(1, 9)
        else:
            text = base64.b64encode(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))).decode()
        params["kv_checksums"] = text
    elif category == "payload_field":
        params["kv_checksums"], field = _damaged_payload(rng, genuine["kv_checksums"])
        category = f"payload_field.{field}"
    elif category == "info_junk":
        value = _junk(rng)
        params["kv_checksums_info"] = value if not isinstance(value, dict) else {"block_sizes": value}
    elif category == "tokens":
        count, digest = info["tokens"].split(":")
        info["tokens"] = rng.choice(
            [
                _junk(rng),
                f"{rng.randrange(0, 2**70)}:{digest}",
                f"{count}:{''.join(rng.choice('0123456789abcdef') for _ in range(32))}",
                f"{count}:{digest.upper()}",
                f"{count}:{digest}0",
                f" {count}:{digest}",
            ]
        )
        if info["tokens"] is None or info["tokens"] == genuine["kv_checksums_info"]["tokens"]:
            info["tokens"] = "x"
        params["kv_checksums_info"] = info
    else:
        sizes = dict(info["block_sizes"])
        choice = rng.randrange(4)
        if choice == 0:
            sizes["0"] = rng.choice([0, -8, 2**32, 2**40, 2**rng.randrange(33, 300), 7, 9, 16, 1, 4, True, "8", 8.0, None, [8]])
        elif choice == 1:
            sizes = _junk(rng)
            if sizes is None or sizes == {}:
                sizes = "8"
        elif choice == 2:
            key = str(_junk(rng))[:12]
            sizes = {key if key not in ("", "0") else "0x": 8}
        else:
            sizes = {"0": 8, "0 ": 8}
        info["block_sizes"] = sizes
        params["kv_checksums_info"] = info
    for _ in range(rng.randrange(0, 3)):
        params[f"x_{rng.randrange(1000)}"] = _junk(rng)
    return params, category


#: Outcomes a category may have. Damaged checksum values cannot be told
#: from damaged KV: they mismatch. Every other damage is unverified.
def allowed(category: str) -> set:
    if category in ("payload_field.value_bits", "payload_field.first"):
        return {kvcsum.MISMATCH, kvcsum.UNVERIFIED}
    return {kvcsum.UNVERIFIED}


NUM_GENERATED = int(os.environ.get("KVCSUM_FUZZ_PARAMS", "3000"))


def test_generated_params_never_raise_in_the_scheduler_and_never_match(store):
    seed = int(os.environ.get("KVCSUM_FUZZ_SEED", random.SystemRandom().randrange(2**32)))
    print(f"\nfuzz seed {seed} (KVCSUM_FUZZ_SEED={seed} repeats it)", flush=True)
    rng = random.Random(seed)
    p = producer(store)
    genuine = prefill(p, "req-genuine")
    c = Engine(
        "consumer", role="kv_consumer", tp=1, block_size=16, layout=KVCacheLayout.LBHNC, store_dir=store,
        extra={"unverified": "log"}, num_blocks=512, max_num_seqs=64, max_batched_tokens=2048,
    )
    # One line a load, thousands of loads: the verdicts are counted below.
    quiet = [logging.getLogger(name) for name in ("vllm.kvcsum", "vllm.v1.core.sched.scheduler")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.CRITICAL)
    outcomes: dict = {}
    batch = 64
    made = 0
    try:
        while made < NUM_GENERATED:
            cases = {}
            for _ in range(min(batch, NUM_GENERATED - made)):
                params, category = generate(rng, genuine)
                req_id = f"fz-{made}"
                made += 1
                cases[req_id] = (params, category)
                c.add_request(req_id, PROMPT, 1, params)
            c.run(max_steps=32)  # an exception out of the scheduler fails the test here
            for req_id, (params, category) in cases.items():
                name, reason, message = verdict(c, req_id)
                assert name in allowed(category), (seed, req_id, category, reason, message, params)
                assert c.traces[req_id].output_tokens == expected(1), (seed, req_id, category)
                key = (category, getattr(name, "name", name), reason)
                outcomes[key] = outcomes.get(key, 0) + 1
                del c.traces[req_id], c.requests[req_id], c.prompts[req_id]
            c.connector().last_verdicts.clear()
    finally:
        # Restored even when the loop fails, so later tests see the log.
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    print(f"generated {made} params; outcomes (category, verdict, reason): ", flush=True)
    for key, count in sorted(outcomes.items()):
        print(f"  {count:5d}  {key}", flush=True)
    assert sum(outcomes.values()) == made == NUM_GENERATED
    assert not any(verdict_name == "MATCH" for _, verdict_name, _ in outcomes)


def test_the_parser_turns_any_json_value_into_checksums_or_a_reason():
    # The parser alone, on many more values than the engine can take: it
    # never raises, and gives back checksums only for a str payload with
    # block sizes of integers 1 to 2^32 - 1.
    seed = int(os.environ.get("KVCSUM_FUZZ_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    count = 0
    for _ in range(20000):
        params = {"kv_checksums": _junk(rng), "kv_checksums_info": _junk(rng)} if rng.random() < 0.5 else _junk(rng)
        parsed = parse_load(params)
        count += 1
        checksums = parsed.checksums
        if isinstance(checksums, Checksums):
            assert isinstance(checksums.payload, str) and "\0" not in checksums.payload, seed
            assert all(type(g) is int and type(s) is int and 1 <= s < 2**32 for g, s in checksums.block_sizes.items()), seed
        else:
            assert checksums is None or isinstance(checksums, Unusable), seed
    print(f"\nparser: {count} generated values, seed {seed}", flush=True)
