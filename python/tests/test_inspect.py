"""Payloads read back through the library (kvcsum.decode_payload), the
payload inspector `python -m kvcsum inspect` on real and hostile input,
and layer decodings (Worker.set_layer_decoding) as Python declares them.

The reference for what a payload holds is msgspec, an independent msgpack
decoder, on the same bytes (SPEC section 9's layout)."""

from __future__ import annotations

import base64
import os
import pathlib
import struct
import subprocess
import sys

import msgspec
import numpy as np
import pytest

import kvcsum

SEED = int(os.environ.get("KVCS_SEED", "0x1A5BEC7"), 0)
PACKAGE = pathlib.Path(kvcsum.__file__).resolve().parent


@pytest.fixture
def rng(request):
    seed = SEED + sum(map(ord, request.node.name))
    print(f"random data seed {seed:#x} (KVCS_SEED={SEED:#x})")
    return np.random.default_rng(seed)


def inspect(*args) -> subprocess.CompletedProcess:
    """`python -m kvcsum inspect ARGS` in a fresh interpreter over this
    package and library."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    environment["KVCSUM_LIBRARY"] = kvcsum.library().path
    done = subprocess.run(
        [sys.executable, "-m", "kvcsum", "inspect", *map(str, args)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


def bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def produce(cache, *, detail=False, decodings=(), extension=True, algorithm=kvcsum.MIXED2) -> bytes:
    """The payload of one request over blocks 3, 1, 6 of `cache` (NHD, two
    layers 0 and 5 in one array each), with `decodings` declared."""
    with kvcsum.Worker(num_threads=1, algorithm=algorithm) as worker, kvcsum.Blocks() as blocks:
        worker.add_region_of(cache)
        worker.add_group(0, 16)
        worker.add_layer(kvcsum.layer(cache[0], "NHD", layer_number=0, identity=b"model.layers.0.attn"))
        worker.add_layer(kvcsum.layer(cache[1], "NHD", layer_number=5, identity=b"model.layers.5.attn"))
        worker.set_detail(detail)
        for layer_number, kwargs in decodings:
            worker.set_layer_decoding(0, layer_number, **kwargs)
        blocks.add_request("req", 40).add_group("req", 0, [3, 1, 6])
        with kvcsum.Verifier(1) as verifier:
            verifier.set_extension(extension)
            verifier.expect(blocks, kvcsum.PRODUCER)
            with worker.checksum(blocks, kvcsum.PRODUCER) as result:
                verifier.add_record(result.encode())
            return verifier.payload("req")


def random_cache(rng) -> np.ndarray:
    return rng.integers(0, 2**16, (2, 8, 16, 4, 32), dtype=np.uint16)


FP8 = {"dtype": "fp8_e4m3", "head_size": 64, "k_scale": 0.0125, "v_scale": 0.5}


# --- decode_payload against msgspec ------------------------------------------------


def test_decoded_payloads_say_what_msgspec_reads(rng):
    cache = random_cache(rng)
    payload = produce(cache, detail=True, decodings=[(0, FP8), (5, {"dtype": "bfloat16"})])
    version, num_tokens, groups, extension = msgspec.msgpack.decode(payload)
    decoded = kvcsum.decode_payload(payload)
    assert decoded == kvcsum.decode_payload(base64.b64encode(payload).decode()), "bytes and base64 alike"
    assert (decoded.version, decoded.num_tokens) == (version, num_tokens) == (1, 40)
    assert decoded.extension_version == extension[0] == kvcsum.EXTENSION_VERSION
    assert decoded.producer_tp_size == extension[1] == 1
    assert decoded.algorithm == extension[3] == kvcsum.MIXED2
    [(group_id, fingerprint, first, raw)] = groups
    [(ext_id, block_size, layers, coverage, marks, decodings, short_last, geometry)] = extension[2]
    # The geometry each registration tells (extension version 5): layers 0
    # and 5, heads 0..4, cells of 32 uint16 elements, one segment (K's
    # bytes not known).
    assert geometry == [[0, 0, 4, 64, 0], [5, 0, 4, 64, 0]]
    # 40 tokens, 16-token blocks from position 0: the group holds the last
    # token, so its last position over 39 tokens is sent, one u64.
    assert len(short_last) == 8
    group = decoded.groups[0]
    assert (group.group_id, group.fingerprint, group.first_position) == (group_id, fingerprint, first)
    assert group.values == struct.unpack(f"<{len(raw) // 8}Q", raw)
    assert (group.block_size, group.coverage, group.marks) == (block_size, coverage, marks)
    assert [(l.layer_number, l.first_head, l.num_heads) for l in group.layers] == [(n, h, k) for n, h, k, _ in layers]
    for layer, (_, _, _, values) in zip(group.layers, layers):
        assert layer.values == struct.unpack(f"<{len(values) // 8}Q", values)
    assert sum(np.array(l.values, dtype=np.uint64) for l in group.layers).tolist() == list(group.values)
    assert [(d.layer_number, d.dtype or "", d.head_size or 0, d.k_scale_bits or 0, d.v_scale_bits or 0) for d in group.decodings] == [
        tuple(d) for d in decodings
    ]
    fp8 = group.decodings[0]
    assert (fp8.dtype, fp8.head_size, fp8.k_scale, fp8.v_scale) == ("fp8_e4m3", 64, 0.0125, 0.5)
    assert fp8.k_scale_bits == bits(0.0125)
    assert (group.decodings[1].dtype, group.decodings[1].k_scale) == ("bfloat16", None)


def test_a_plain_payload_decodes_without_an_extension(rng):
    payload = produce(random_cache(rng), extension=False, algorithm=kvcsum.WEIGHTED)
    decoded = kvcsum.decode_payload(payload)
    assert len(msgspec.msgpack.decode(payload)) == 3
    assert (decoded.extension_version, decoded.producer_tp_size, decoded.algorithm) == (0, None, kvcsum.WEIGHTED)
    group = decoded.groups[0]
    assert (group.block_size, group.coverage, group.marks, group.layers, group.decodings) == (None, None, None, (), ())


def test_decode_payload_refuses_what_is_no_payload():
    with pytest.raises(kvcsum.Malformed, match="truncated"):
        kvcsum.decode_payload(b"\x93\x01")
    with pytest.raises(kvcsum.Malformed, match="base64"):
        kvcsum.decode_payload("kwE")
    with pytest.raises(TypeError, match="data must be bytes-like"):
        kvcsum.decode_payload(7)


# --- Layer decodings ---------------------------------------------------------------


def judge(cache, payload: bytes, decodings=()) -> kvcsum.Report:
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks, kvcsum.Verifier(1) as verifier:
        worker.add_region_of(cache)
        worker.add_group(0, 16)
        worker.add_layer(kvcsum.layer(cache[0], "NHD", layer_number=0, identity=b"model.layers.0.attn"))
        worker.add_layer(kvcsum.layer(cache[1], "NHD", layer_number=5, identity=b"model.layers.5.attn"))
        for layer_number, kwargs in decodings:
            worker.set_layer_decoding(0, layer_number, **kwargs)
        blocks.add_request("req", 40).add_group("req", 0, [3, 1, 6])
        verifier.expect(blocks, kvcsum.CONSUMER)
        with worker.checksum(blocks, kvcsum.CONSUMER) as result:
            verifier.add_record(result.encode())
        return verifier.check("req", payload)


def test_a_scale_declared_otherwise_is_unverified_never_a_match(rng):
    cache = random_cache(rng)
    payload = produce(cache, decodings=[(0, FP8)])
    assert judge(cache, payload, [(0, FP8)]).verdict == kvcsum.MATCH
    assert judge(cache, payload).verdict == kvcsum.MATCH, "a consumer that declares nothing compares as before"
    for field, value in [("v_scale", 0.25), ("k_scale", 0.0125 * (1 + 2**-52)), ("dtype", "fp8_e5m2"), ("head_size", 32)]:
        with judge(cache, payload, [(0, {**FP8, field: value})]) as report:
            assert report.verdict == kvcsum.UNVERIFIED, (field, report.message)
            assert report.reason == kvcsum.DECODING_DIFFERS, report.message
            assert f"layer 0: {field} differs" in report.message, report.message


def test_bad_declarations_raise_naming_the_argument(rng):
    cache = random_cache(rng)
    with kvcsum.Worker(num_threads=1) as worker:
        worker.add_region_of(cache)
        worker.add_group(0, 16)
        worker.add_layer(kvcsum.layer(cache[0], "NHD", layer_number=0))
        with pytest.raises(kvcsum.NotFound, match="layer_number 3"):
            worker.set_layer_decoding(0, 3, "bfloat16")
        with pytest.raises(kvcsum.NotFound, match="group_id 2"):
            worker.set_layer_decoding(2, 0, "bfloat16")
        with pytest.raises(kvcsum.InvalidArgument, match="dtype"):
            worker.set_layer_decoding(0, 0, "torch.bfloat16")
        with pytest.raises(kvcsum.InvalidArgument, match="k_scale NaN"):
            worker.set_layer_decoding(0, 0, k_scale=float("nan"))
        with pytest.raises(kvcsum.InvalidArgument, match="declares nothing"):
            worker.set_layer_decoding(0, 0)
        with pytest.raises(ValueError, match="v_scale is 0.0"):
            worker.set_layer_decoding(0, 0, v_scale=0.0)
        with pytest.raises(TypeError, match="k_scale must be a number"):
            worker.set_layer_decoding(0, 0, k_scale="0.5")
        with pytest.raises(TypeError, match="k_scale must be a number"):
            worker.set_layer_decoding(0, 0, k_scale=True)


# --- python -m kvcsum inspect -------------------------------------------------------


def test_inspect_prints_what_the_payload_says(rng):
    payload = produce(random_cache(rng), detail=True, decodings=[(0, FP8)])
    text = base64.b64encode(payload).decode()
    _, num_tokens, [(group_id, fingerprint, first, raw)], extension = msgspec.msgpack.decode(payload)
    done = inspect(text)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"payload: version 1, {num_tokens} tokens, 1 group"
    assert lines[1] == f"  extension version {extension[0]}: algorithm MIXED2 (3), producer TP size 1"
    assert f"  group {group_id}: fingerprint {fingerprint:#018x}, positions 0..3 (3 values), block size 16" in lines
    assert any("layer 0 decoding: dtype fp8_e4m3, head_size 64, k_scale 0.0125 (bits 0x3f8999999999999a)" in l for l in lines)
    assert "    layer partials: 0 (heads 0..4), 5 (heads 0..4)" in lines
    values = struct.unpack("<3Q", raw)
    assert lines[-4:-1] == [f"    position {q}: {v:016x}" for q, v in enumerate(values)]
    (short_last,) = struct.unpack("<Q", extension[2][0][6])
    assert lines[-1] == f"    short last value (position 2 over 39 tokens, for a load of one token fewer): {short_last:016x}"
    # A pasted log line or kv_transfer_params dump holding it reads the same.
    for pasted in [f"{{'do_remote_prefill': True, 'kv_checksums': '{text}', 'remote_block_ids': [1]}}", f'"{text[:30]}\n{text[30:]}"']:
        again = inspect(pasted)
        assert (again.returncode, again.stdout) == (0, done.stdout), again.stderr


def test_inspect_names_the_positions_two_payloads_differ_at(rng, tmp_path):
    cache = random_cache(rng)
    flipped = cache.copy()
    token = int(rng.integers(0, 8))  # of block 6, position 2: request tokens 32..39
    flipped[1, 6, token, int(rng.integers(0, 4)), int(rng.integers(0, 32))] ^= 1 << int(rng.integers(0, 16))
    first, second = produce(cache), produce(flipped)
    (tmp_path / "a.txt").write_text(base64.b64encode(first).decode() + "\n")
    (tmp_path / "b.bin").write_bytes(second)
    done = inspect("--file", tmp_path / "a.txt", "--file", tmp_path / "b.bin")
    assert done.returncode == 1, done.stderr
    a = struct.unpack("<3Q", msgspec.msgpack.decode(first)[2][0][3])
    b = struct.unpack("<3Q", msgspec.msgpack.decode(second)[2][0][3])
    assert a[2] != b[2] and a[:2] == b[:2], "the flip is in block 6, position 2"
    # The short last value covers tokens 32..38 of position 2: it differs too unless the flip is in token 39.
    short = [kvcsum.decode_payload(p).groups[0].short_last for p in (first, second)]
    expected = [f"  group 0: short_last {short[0]:#018x} vs {short[1]:#018x}"] if token < 7 else []
    assert (short[0] != short[1]) == (token < 7)
    expected.append(f"  group 0: position 2: {a[2]:016x} vs {b[2]:016x}")
    assert done.stdout.splitlines()[-len(expected) - 1 :] == [f"differences ({len(expected)}):", *expected]
    same = inspect(base64.b64encode(first).decode(), "--file", tmp_path / "a.txt")
    assert same.returncode == 0 and same.stdout.endswith("the two payloads say the same\n"), same.stdout
    # Other facts differ too: a plain payload of WEIGHTED values against a MIXED2 one.
    plain = produce(cache, extension=False, algorithm=kvcsum.WEIGHTED)
    done = inspect(base64.b64encode(first).decode(), base64.b64encode(plain).decode())
    assert done.returncode == 1
    assert "  algorithm: MIXED2 (3) vs WEIGHTED (1)" in done.stdout, done.stdout
    assert "  producer_tp_size: 1 vs not sent" in done.stdout, done.stdout
    assert f"  extension_version: {kvcsum.EXTENSION_VERSION} vs 0" in done.stdout, done.stdout


def with_short_last(payload: bytes, value: int) -> bytes:
    """`payload` with its one group's short last value replaced by `value`
    (re-encoded by msgspec: any valid msgpack of the shape decodes)."""
    plain_version, num_tokens, groups, extension = msgspec.msgpack.decode(payload)
    extension[2][0][6] = struct.pack("<Q", value)
    return msgspec.msgpack.encode([plain_version, num_tokens, groups, extension])


def test_the_short_last_value_is_decoded_shown_and_compared(rng):
    first = produce(random_cache(rng))
    (sent,) = struct.unpack("<Q", msgspec.msgpack.decode(first)[3][2][0][6])
    assert kvcsum.decode_payload(first).groups[0].short_last == sent
    plain = produce(random_cache(rng), extension=False, algorithm=kvcsum.WEIGHTED)
    assert kvcsum.decode_payload(plain).extension_version == 0 and kvcsum.decode_payload(plain).groups[0].short_last is None
    other = (sent + 1 + int(rng.integers(0, 2**32))) % 2**64
    second = with_short_last(first, other)
    assert kvcsum.decode_payload(second).groups[0].short_last == other
    assert kvcsum.decode_payload(second).groups[0].values == kvcsum.decode_payload(first).groups[0].values
    done = inspect(base64.b64encode(first).decode(), base64.b64encode(second).decode())
    assert done.returncode == 1, done.stdout
    assert done.stdout.splitlines()[-2:] == ["differences (1):", f"  group 0: short_last {sent:#018x} vs {other:#018x}"]


def test_inspect_json_holds_what_the_text_says(rng):
    import json

    cache = random_cache(rng)
    first, second = produce(cache, decodings=[(0, FP8)]), produce(cache)
    done = inspect("--json", base64.b64encode(first).decode())
    assert done.returncode == 0, done.stderr
    (payload,) = json.loads(done.stdout)["payloads"]
    decoded = kvcsum.decode_payload(first)
    assert payload["num_tokens"] == decoded.num_tokens and payload["algorithm"] == "MIXED2"
    (group,) = payload["groups"]
    assert group["values"] == list(decoded.groups[0].values)
    assert group["short_last"] == decoded.groups[0].short_last and group["fingerprint"] == decoded.groups[0].fingerprint
    assert group["decodings"][0]["dtype"] == "fp8_e4m3" and group["decodings"][0]["k_scale"] == 0.0125
    both = inspect("--json", base64.b64encode(first).decode(), base64.b64encode(second).decode())
    assert both.returncode == 1
    differences = json.loads(both.stdout)["differences"]
    assert differences and all(line.startswith("group 0: layer 0 decoding") for line in differences), differences


def test_inspect_into_a_closed_pipe_ends_quietly(rng):
    """`inspect ... | head` must not print a BrokenPipe traceback: the
    reader's end is closed before the inspector writes its first line."""
    text = base64.b64encode(produce(random_cache(rng))).decode()
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    environment["KVCSUM_LIBRARY"] = kvcsum.library().path
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvcsum", "inspect", text],
            env=environment,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert done.stderr == "", done.stderr
    assert done.returncode == 0


def hostile_inputs(payload: bytes) -> list:
    """(what, base64 text, what the message must say) of inputs that are no
    payload, each built from a real one."""
    text = base64.b64encode(payload).decode()
    huge = b"\x93\x01\x28\xdd\xff\xff\xff\xff" + b"\x94\x00\x07\x00\xc4\x00" * 4
    wrong_type = msgspec.msgpack.encode(["1", 40, []])
    bad_dtype = msgspec.msgpack.decode(payload)
    bad_dtype[3][2][0][5][0][1] = "FP8"
    return [
        ("empty", "", "the payload is empty"),
        ("only whitespace", "  \n ", "the payload is empty"),
        ("truncated base64", text[:-3], "base64"),
        ("not base64", text[:10] + "!" + text[11:], "'!' at character 10"),
        ("truncated payload", base64.b64encode(payload[:-5]).decode(), "truncated"),
        ("trailing bytes", base64.b64encode(payload + b"\xc0").decode(), "1 trailing bytes"),
        ("wrong types", base64.b64encode(wrong_type).decode(), "expected an integer, found a string"),
        ("huge declared length", base64.b64encode(huge).decode(), "cannot fit"),
        ("not an array", base64.b64encode(b"\xc0").decode(), "expected an array"),
        ("a bad declaration", base64.b64encode(msgspec.msgpack.encode(bad_dtype)).decode(), "is not an element type name"),
    ]


def test_inspect_refuses_hostile_input_with_exit_status_2_and_no_traceback(rng, tmp_path):
    payload = produce(random_cache(rng), decodings=[(0, FP8)])
    for what, text, needle in hostile_inputs(payload):
        done = inspect(text)
        assert done.returncode == 2, (what, done.stdout, done.stderr)
        assert needle in done.stderr, (what, done.stderr)
        assert done.stdout == "", what
    done = inspect("--file", tmp_path / "absent.txt")
    assert done.returncode == 2 and "cannot read" in done.stderr and "absent.txt" in done.stderr, done.stderr
    (tmp_path / "junk.bin").write_bytes(bytes(rng.integers(0, 256, 64, dtype=np.uint8)) + b"\xff")
    done = inspect("--file", tmp_path / "junk.bin")
    assert done.returncode == 2 and "is not a kvcsum payload" in done.stderr, done.stderr
    good = base64.b64encode(payload).decode()
    for arguments in [(), (good, good, good)]:
        done = inspect(*arguments)
        assert done.returncode == 2 and "give one payload, or two" in done.stderr, done.stderr
    done = inspect(good, "kwE")
    assert done.returncode == 2 and "payload 2 is not a kvcsum payload" in done.stderr, done.stderr
