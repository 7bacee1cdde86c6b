"""Records, payloads and verdicts through the Python package; errors as
exceptions; handles as context managers; the ABI checks that refuse a
library of another shape."""

import ctypes
import pathlib
import re

import numpy as np
import pytest

import kvcsum
from kvcsum import _abi, _lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKENS = 8


def make_cache(rng):
    return rng.integers(0, 2**64, (5, 2, TOKENS, 4), dtype=np.uint64, endpoint=False)  # HND, 2 heads


def checksum(cache, blocks, role, algorithm=kvcsum.MIXED2):
    with kvcsum.Worker(algorithm=algorithm) as worker:
        worker.add_region_of(cache)
        worker.add_group(0, TOKENS)
        worker.add_layer(kvcsum.layer(cache, "HND", layer_number=0, identity=b"layer 0"))
        with worker.checksum(blocks, role) as result:
            return result.encode(), result.column("req", 0)


@pytest.fixture
def scheduled():
    with kvcsum.Blocks() as blocks:
        blocks.add_request("req", 2 * TOKENS + 5).add_group("req", 0, [3, 1, 4])
        yield blocks


def producer_payload(cache, scheduled, algorithm=kvcsum.MIXED2):
    record, values = checksum(cache, scheduled, kvcsum.PRODUCER, algorithm)
    assert isinstance(record, bytes)
    with kvcsum.Verifier(1) as producer:
        producer.expect(scheduled, kvcsum.PRODUCER)
        producer.add_record(record)
        return producer.payload("req"), values


def consumer_report(cache, scheduled, payload):
    record, _ = checksum(cache, scheduled, kvcsum.CONSUMER)
    verifier = kvcsum.Verifier(1)
    verifier.expect(scheduled, kvcsum.CONSUMER)
    verifier.add_record(record)
    report = verifier.check("req", payload)
    verifier.close()  # the report outlives its verifier
    return report


def test_match_mismatch_and_unverified(scheduled):
    rng = np.random.default_rng(0x766572)
    cache = make_cache(rng)
    payload, values = producer_payload(cache, scheduled)
    text = kvcsum.base64_encode(payload)
    assert kvcsum.base64_decode(text) == payload

    with consumer_report(cache, scheduled, text) as report:
        assert report.verdict == kvcsum.MATCH and report.passed
        assert report.verdict_name == "KVCS_VERDICT_MATCH"
        assert report.compared_positions == 3
    with consumer_report(cache, scheduled, payload) as report:  # bytes work too
        assert report.verdict == kvcsum.MATCH

    flipped = cache.copy()
    flipped[4, 1, 2, 3] ^= np.uint64(1 << 40)  # block 4 is position 2, token 2 is valid
    with consumer_report(flipped, scheduled, text) as report:
        assert report.verdict == kvcsum.MISMATCH and not report.passed
        [mismatch] = report.mismatches
        assert (mismatch.group_id, mismatch.first_position, mismatch.num_positions) == (0, 2, 1)

    with consumer_report(cache, scheduled, None) as report:
        assert report.verdict == kvcsum.UNVERIFIED and not report.passed
        assert report.findings[0].reason_name == "KVCS_UNVERIFIED_NO_CHECKSUMS"
    with consumer_report(cache, scheduled, "not base64!") as report:
        assert report.findings[0].reason_name == "KVCS_UNVERIFIED_INVALID_CHECKSUMS"


def test_payload_is_what_msgspec_reads(scheduled):
    msgspec = pytest.importorskip("msgspec")
    cache = make_cache(np.random.default_rng(0x6D7367))
    # WEIGHTED values make vLLM's plain payload.
    payload, values = producer_payload(cache, scheduled, kvcsum.WEIGHTED)
    version, num_tokens, groups = msgspec.msgpack.decode(payload)
    assert (version, num_tokens) == (1, 2 * TOKENS + 5)
    [[group_id, _fingerprint, first_position, raw]] = groups
    assert (group_id, first_position) == (0, 0)
    np.testing.assert_array_equal(np.frombuffer(raw, dtype="<u8"), values)
    # MIXED2 values (the default) always carry the extension, whose last
    # element is the algorithm (docs/SPEC.md section 9).
    payload, values = producer_payload(cache, scheduled)
    version, num_tokens, groups, extension = msgspec.msgpack.decode(payload)
    assert (version, extension[0], extension[-1]) == (1, kvcsum.EXTENSION_VERSION, kvcsum.MIXED2)
    np.testing.assert_array_equal(np.frombuffer(groups[0][3], dtype="<u8"), values)
    with consumer_report(cache, scheduled, payload) as report:
        assert report.verdict == kvcsum.MATCH
    # Values of another algorithm are never compared: WEIGHTED's, and
    # MIXED's (kvcsum 0.2's default) against MIXED2's.
    for other in (kvcsum.WEIGHTED, kvcsum.MIXED):
        payload_of_other, _ = producer_payload(cache, scheduled, other)
        with consumer_report(cache, scheduled, payload_of_other) as report:
            assert report.verdict == kvcsum.UNVERIFIED
            assert report.findings[0].reason_name == "KVCS_UNVERIFIED_ALGORITHM_DIFFERS"


def test_errors_carry_status_and_message(scheduled):
    with pytest.raises(kvcsum.InvalidArgument) as caught:
        kvcsum.Worker(tp_rank=2, tp_size=2)
    assert caught.value.status == 1 and caught.value.status_name == "KVCS_ERR_INVALID_ARGUMENT"
    assert "tp_rank" in caught.value.message
    with kvcsum.Verifier(1) as verifier:
        with pytest.raises(kvcsum.NotFound, match="nobody"):
            verifier.payload("nobody")
        with pytest.raises(kvcsum.Malformed):
            verifier.add_record(b"\x00garbage")
        verifier.expect(scheduled, kvcsum.PRODUCER)
        with pytest.raises(kvcsum.NotReady):
            verifier.payload("req")
    with pytest.raises(kvcsum.Malformed):
        kvcsum.base64_decode("abc")
    with kvcsum.Blocks() as blocks:
        with pytest.raises(kvcsum.InvalidArgument, match="req_id"):
            blocks.add_request("", 4)
        blocks.add_request("r", 4)
        with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
            blocks.add_group("r", 0, [1, -1])
        # ctypes would wrap -1 into 2**64 - 1; the binding refuses it.
        with pytest.raises(ValueError, match="num_tokens is -1, outside uint64_t"):
            blocks.add_request("s", -1)
    with kvcsum.Worker() as worker:
        worker.add_group(0, 8)
        # No region registered: the layer reaches memory the worker may not read.
        with pytest.raises(kvcsum.OutOfBounds):
            worker.add_layer(kvcsum.layer(np.zeros((2, 8, 1, 4), dtype=np.uint16), "NHD", layer_number=0))


def test_handles_close_once_and_refuse_use_after():
    blocks = kvcsum.Blocks()
    with blocks:
        blocks.add_request("r", 1)
    with pytest.raises(ValueError, match="closed"):
        blocks.add_request("s", 1)
    blocks.close()  # a second close is a no-op


def test_every_header_call_is_declared_with_its_arity():
    header = (ROOT / "include" / "kvcsum.h").read_text()
    prototypes = dict(
        (name, args)
        for name, args in re.findall(r"^[A-Za-z_][\w \*]*?[ \*](kvcs_\w+)\(([^)]*)\);", header, flags=re.M)
    )
    assert prototypes, "no prototype found in kvcsum.h"
    assert set(prototypes) == set(_lib.SIGNATURES), set(prototypes) ^ set(_lib.SIGNATURES)
    for name, args in prototypes.items():
        count = 0 if args.strip() in ("", "void") else args.count(",") + 1
        assert len(_lib.SIGNATURES[name][1]) == count, name


def test_structs_match_the_library_and_drift_is_refused(monkeypatch):
    lib = kvcsum.library()
    for c_name, struct in _lib.STRUCTS.items():
        size = ctypes.c_size_t()
        assert lib.kvcs_struct_layout(c_name.encode(), ctypes.byref(size), None) == 0, c_name
        assert size.value == ctypes.sizeof(struct), c_name
        if hasattr(lib, c_name + "_size"):  # the older per-struct size call, where there is one
            assert getattr(lib, c_name + "_size")() == ctypes.sizeof(struct), c_name

    class Grown(ctypes.Structure):
        _fields_ = _lib.LayerStruct._fields_ + [("added", ctypes.c_uint64)]

    monkeypatch.setitem(_lib.STRUCTS, "kvcs_layer", Grown)
    with pytest.raises(kvcsum.AbiError, match="kvcs_layer is .* bytes"):
        _lib.load(lib.path)

    # Same size, fields swapped: only the offsets tell.
    fields = list(_lib.Segment._fields_)
    fields[1], fields[2] = fields[2], fields[1]

    class Swapped(ctypes.Structure):
        _fields_ = fields

    assert ctypes.sizeof(Swapped) == ctypes.sizeof(_lib.Segment)
    monkeypatch.setitem(_lib.STRUCTS, "kvcs_layer", _lib.LayerStruct)
    monkeypatch.setitem(_lib.STRUCTS, "kvcs_segment", Swapped)
    with pytest.raises(kvcsum.AbiError, match="field 1 of kvcs_segment as block_stride at offset 8"):
        _lib.load(lib.path)

    # Same size and offsets, another type: the field sizes tell.
    fields = list(_lib.Segment._fields_)
    fields[5] = ("bytes_per_token", ctypes.c_uint64)

    class Widened(ctypes.Structure):
        _fields_ = fields

    assert ctypes.sizeof(Widened) == ctypes.sizeof(_lib.Segment)
    monkeypatch.setitem(_lib.STRUCTS, "kvcs_segment", Widened)
    with pytest.raises(kvcsum.AbiError, match=r"bytes_per_token at offset 40 \(4 bytes\), this package as bytes_per_token at offset 40 \(8 bytes\)"):
        _lib.load(lib.path)


def test_the_abi_module_spells_the_headers_prototypes():
    """_abi (generated from the Rust source) against kvcsum.h (cbindgen):
    every prototype with the same parameter names and types, spaces aside."""
    header = (ROOT / "include" / "kvcsum.h").read_text()
    prototypes = re.findall(r"^([A-Za-z_][\w \*]*?[ \*])(kvcs_\w+)\(([^)]*)\);", header, flags=re.M)
    assert len(prototypes) == len(_abi.CALLS)
    for ret, name, params in prototypes:
        want_ret, want_params = _abi.CALLS[name]
        assert ret.replace(" ", "") == want_ret.replace(" ", ""), name
        params = [] if params.strip() == "void" else [" ".join(p.split()) for p in params.split(",")]
        assert [p.replace(" ", "") for p in params] == [(t + n).replace(" ", "") for n, t in want_params], name
    for name, value in _abi.CONSTANTS.items():
        defined = re.search(rf"^#define {name} (\S+)$", header, flags=re.M)
        assert defined, name
        text = defined.group(1).removesuffix("ull").replace("UINT32_MAX", str(2**32 - 1))
        assert int(text, 0) == value, name


def test_abi_version_and_missing_library_are_refused(monkeypatch, tmp_path):
    lib = kvcsum.library()
    monkeypatch.setattr(_lib, "ABI_VERSION", 99)
    with pytest.raises(kvcsum.AbiError, match="ABI version 2; this package speaks version 99"):
        _lib.load(lib.path)
    monkeypatch.undo()
    # No file there is a MissingLibraryError (test_package.py), a file that
    # does not load an AbiError.
    with pytest.raises(kvcsum.MissingLibraryError, match="libkvcsum not found"):
        _lib.load(str(tmp_path / "libkvcsum.so"))
    (tmp_path / "libkvcsum.so").write_bytes(b"not an ELF file")
    with pytest.raises(kvcsum.AbiError, match="cannot load libkvcsum"):
        _lib.load(str(tmp_path / "libkvcsum.so"))
    monkeypatch.setenv("KVCSUM_LIBRARY", str(tmp_path / "elsewhere.so"))
    assert _lib.candidates() == [str(tmp_path / "elsewhere.so")]
    libc = ctypes.util.find_library("c") if hasattr(ctypes, "util") else None
    if libc:
        with pytest.raises(kvcsum.AbiError, match="is not libkvcsum"):
            _lib.load(libc)


def test_check_stored_judges_offload_loads_from_load_check_records_only(scheduled):
    rng = np.random.default_rng(0x6F66666C)
    record, _ = checksum(make_cache(rng), scheduled, kvcsum.CONSUMER)
    with kvcsum.Verifier(1) as verifier:
        verifier.expect(scheduled, kvcsum.CONSUMER)
        with pytest.raises(kvcsum.NotFound, match="never"):
            verifier.check_stored("never")
        with verifier.check_stored("req") as report:
            assert report.verdict == kvcsum.UNVERIFIED
            assert [f.reason_name for f in report.findings] == ["KVCS_UNVERIFIED_WORKERS_MISSING"]
        # A plain checksum call's record is no load check.
        verifier.add_record(record)
        with verifier.check_stored("req") as report:
            assert report.verdict == kvcsum.UNVERIFIED and not report.passed
            assert report.reason == 12
            assert [f.reason_name for f in report.findings] == ["KVCS_UNVERIFIED_NOT_LOAD_CHECK"]
            assert "not of a load check" in report.message
