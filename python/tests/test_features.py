"""State layers, aliases and stored checksums through the Python package,
against naive references of docs/SPEC.md sections 6-8 written here with
Python integers and hashlib, on seeded random data."""

import hashlib
import os

import msgspec
import numpy as np
import pytest

import kvcsum
from test_checksums import mix2 as mix  # the tests' one naive MIXED2 (SPEC section 12)

MASK = (1 << 64) - 1
SEED = int(os.environ.get("KVCS_SEED", "0x666561"), 0)


@pytest.fixture
def rng(request):
    seed = SEED + sum(map(ord, request.node.name))
    print(f"random data seed {seed:#x} (KVCS_SEED={SEED:#x})")
    return np.random.default_rng(seed)


def fingerprint_of(identities):
    return sum(int.from_bytes(hashlib.sha256(i).digest()[:8], "little") for i in identities) & MASK


def test_state_layer_rows_are_slices(rng):
    # One layer, two tensors: conv [3 blocks, 4 rows, 6 uint16], ssm [3, 2 rows, 5 uint32].
    conv = rng.integers(0, 2**16, (3, 4, 6), dtype=np.uint16)
    ssm = rng.integers(0, 2**32, (3, 2, 5), dtype=np.uint32)
    expected = 0
    for head, row in enumerate([*conv[2], *ssm[2]]):
        s = sum(mix(int(x)) * (2 * j + 1) for j, x in enumerate(row))
        expected = (expected + (2 * (7 * 65536 + head) + 1) * s) & MASK
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
        for array in (conv, ssm):
            worker.add_region_of(array)
        worker.add_group(3, 16)
        tensors = [
            kvcsum.StateTensor(conv.ctypes.data, conv.strides[0], conv.strides[1], 0, 4, 4, 12, 2),
            kvcsum.StateTensor(ssm.ctypes.data, ssm.strides[0], ssm.strides[1], 0, 2, 2, 20, 4),
        ]
        worker.add_state(3, 7, tensors, num_blocks=3, identity=b"mamba 7")
        blocks.add_request("s", 0).add_group("s", 3, [2])
        with worker.checksum(blocks) as result:
            assert int(result.column("s", 3)[0]) == expected
        with pytest.raises(kvcsum.InvalidArgument, match="element_size is 3"):
            worker.add_state(3, 8, [kvcsum.StateTensor(conv.ctypes.data, 48, 12, 0, 4, 4, 12, 3)], num_blocks=3)


def alias_mark() -> int:
    """What docs/SPEC.md section 7 adds per alias."""
    return int.from_bytes(hashlib.sha256(b"kvcsum alias").digest()[:8], "little") | 1


def test_aliases_count_in_the_fingerprint_like_vllm_and_their_mark_travels_in_the_extension(rng):
    kv = rng.integers(0, 2**64, (4, 2, 8, 2), dtype=np.uint64)  # [blocks, heads, tokens, pieces]
    own = repr(("model.layers.0.self_attn.attn", "FullAttentionSpec", "torch.bfloat16")).encode()
    shared = repr(("model.layers.1.self_attn.attn", "FullAttentionSpec", "torch.bfloat16")).encode()
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks, kvcsum.Verifier(1) as verifier:
        worker.add_region_of(kv)
        worker.add_group(0, 8)
        worker.add_layer(kvcsum.layer(kv, "BHTD", layer_number=0, identity=own))
        worker.add_alias(0, 1, 0, shared)
        with pytest.raises(kvcsum.NotFound, match="target_layer_number 5"):
            worker.add_alias(0, 2, 5, b"x")
        blocks.add_request("r", 16).add_group("r", 0, [3, 1])
        verifier.expect(blocks, kvcsum.PRODUCER)
        with worker.checksum(blocks) as result:
            verifier.add_record(result.encode())
        payload = verifier.payload("r")
        # Stored checksums keep the marked fingerprint (SPEC section 8).
        hashes = [bytes(rng.integers(0, 256, 32, dtype=np.uint8))]
        marked = (fingerprint_of([own, shared]) + alias_mark()) % 2**64
        assert [int(t) for t in worker.block_tags(0, hashes)] == [int.from_bytes(hashes[0][:8], "little") ^ marked]
    # [1, num_tokens, [[group_id, fingerprint, first_position, values]],
    #  [3, tp, [[group_id, block_size, layers, coverage, marks, decodings]], algorithm]]:
    # the fingerprint is vLLM's, and the alias's mark travels beside it.
    _, _, [(_, fingerprint, _, _)], extension = msgspec.msgpack.decode(payload)
    assert fingerprint == fingerprint_of([own, shared])
    assert extension[2][0][4] == alias_mark()


def test_stored_checksums_round_trip_and_a_corrupted_block(rng):
    kv = rng.integers(0, 2**64, (6, 2, 8, 2), dtype=np.uint64)
    stored = np.zeros((6, 2), dtype=np.uint64)  # value, stamp per block id
    hashes = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(3)]
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
        worker.add_region_of(kv)
        worker.add_group(0, 8)
        worker.add_layer(kvcsum.layer(kv, "BHTD", layer_number=0, identity=b"layer 0"))
        worker.add_stored_of(0, stored)
        blocks.add_request("o", 24).add_group("o", 0, [4, 0, 5]).set_hashes("o", 0, hashes)
        tags = worker.block_tags(0, hashes)
        assert [int(t) for t in tags] == [int.from_bytes(h[:8], "little") ^ fingerprint_of([b"layer 0"]) for h in hashes]
        with worker.store(blocks) as result:
            values = result.column("o", 0)
        assert [int(stored[b, 0]) ^ int(t) for b, t in zip([4, 0, 5], tags)] == [int(v) for v in values]
        with worker.check_stored(blocks) as result:
            assert list(result.stored("o", 0)) == [kvcsum.STORED_MATCHED] * 3
        kv[0, 1, 3, 0] ^= 1 << 17  # block 0 is position 1
        with worker.check_stored(blocks) as result:
            assert list(result.stored("o", 0)) == [kvcsum.STORED_MATCHED, kvcsum.STORED_FAILED, kvcsum.STORED_MATCHED]
        with pytest.raises(kvcsum.InvalidArgument, match="hash_bytes is 4"):
            blocks.set_hashes("o", 0, [b"abcd"] * 3)


def test_a_verifier_judges_an_offload_load_from_load_check_records(rng):
    kv = rng.integers(0, 2**64, (6, 2, 8, 2), dtype=np.uint64)
    stored = np.zeros((6, 2), dtype=np.uint64)  # value, stamp per block id
    hashes = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(3)]
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks, kvcsum.Verifier(1) as verifier:
        worker.add_region_of(kv)
        worker.add_group(0, 8)
        worker.add_layer(kvcsum.layer(kv, "BHTD", layer_number=0, identity=b"layer 0"))
        worker.add_stored_of(0, stored)
        blocks.add_request("o", 20).add_group("o", 0, [4, 0, 5]).set_hashes("o", 0, hashes)
        worker.store(blocks).close()
        verifier.expect(blocks, kvcsum.CONSUMER)
        with worker.check_stored(blocks) as result:
            verifier.add_record(result.encode())
        with verifier.check_stored("o") as report:
            assert report.verdict == kvcsum.MATCH and report.passed, report.message
            assert report.compared_positions == 3
        kv[5, 0, 2, 1] ^= 1 << 40  # block 5 is position 2, tokens 16..20 (token 18)
        with worker.check_stored(blocks) as result:
            verifier.add_record(result.encode())  # replaces the worker's earlier record
        with verifier.check_stored("o") as report:
            assert report.verdict == kvcsum.MISMATCH and not report.passed, report.message
            assert [(m.group_id, m.first_position, m.first_token, m.num_tokens) for m in report.mismatches] == [
                (0, 2, 16, 4)
            ]
            assert "stored checksum failed on worker (pp_rank 0, tp_rank 0)" in report.message


def test_connectors_keeping_entries_get_value_and_stamp_and_the_load_checks_outcomes(rng):
    """Result.entries gives what Worker.store writes (value and stamp);
    Result.check_entries judges kept entries as a load check does: a
    damaged stamp fails (never another configuration), a partial block
    checked holding more tokens is OTHER_TOKENS."""
    kv = rng.integers(0, 2**64, (6, 2, 8, 2), dtype=np.uint64)
    stored = np.zeros((6, 2), dtype=np.uint64)
    hashes = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(3)]
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks, kvcsum.Blocks() as longer:
        worker.add_region_of(kv)
        worker.add_group(0, 8)
        worker.add_layer(kvcsum.layer(kv, "BHTD", layer_number=0, identity=b"layer 0"))
        worker.add_stored_of(0, stored)
        blocks.add_request("o", 20).add_group("o", 0, [4, 0, 5]).set_hashes("o", 0, hashes)
        worker.store(blocks).close()
        with worker.checksum(blocks, kvcsum.CONSUMER) as result:
            entries = result.entries("o", 0)
            assert entries.dtype == np.uint64 and entries.shape == (3, 2)
            assert (entries == stored[[4, 0, 5]]).all()
            assert list(result.check_entries("o", 0, entries)) == [kvcsum.STORED_MATCHED] * 3
            damaged = entries.copy()
            damaged[1, 1] ^= np.uint64(1 << int(rng.integers(0, 64)))
            assert list(result.check_entries("o", 0, damaged)) == [
                kvcsum.STORED_MATCHED,
                kvcsum.STORED_FAILED,
                kvcsum.STORED_MATCHED,
            ]
            with pytest.raises(ValueError, match=r"entries must be integers of shape \(3, 2\)"):
                result.check_entries("o", 0, entries[:2])
        longer.add_request("o", 24).add_group("o", 0, [4, 0, 5]).set_hashes("o", 0, hashes)
        with worker.checksum(longer, kvcsum.CONSUMER) as result:
            assert list(result.check_entries("o", 0, entries)) == [
                kvcsum.STORED_MATCHED,
                kvcsum.STORED_MATCHED,
                kvcsum.STORED_OTHER_TOKENS,
            ]
        with worker.checksum(blocks, kvcsum.PRODUCER) as result:
            with pytest.raises(kvcsum.InvalidArgument, match="KVCS_ROLE_PRODUCER"):
                result.entries("o", 0)


def test_kept_entries_never_pass_across_a_change_of_decoding(rng):
    """Result.entries follows the rule a store follows (SPEC section 8:
    the marked fingerprint plus the digest of the declared decodings): it
    is what Worker.store writes with a decoding declared, and an entry kept
    under one decoding (bfloat16, K scale 0.5, head size 64, or none)
    reads OTHER_FINGERPRINT, never MATCHED, when checked under another
    (fp8_e4m3, K scale 1.0, head size 128, or none)."""
    kv = rng.integers(0, 2**64, (6, 2, 8, 2), dtype=np.uint64)
    hashes = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(3)]
    cases = [
        ({"dtype": "bfloat16"}, {"dtype": "fp8_e4m3"}),
        ({"dtype": "fp8_e4m3", "k_scale": 0.5}, {"dtype": "fp8_e4m3", "k_scale": 1.0}),
        ({"head_size": 64}, {"head_size": 128}),
        ({"dtype": "bfloat16"}, None),
        (None, {"dtype": "bfloat16"}),
        ({"dtype": "bfloat16", "head_size": 64}, {"dtype": "bfloat16", "head_size": 64}),
    ]
    for stored_under, checked_under in cases:
        entries = {}
        for name, decoding in (("stored", stored_under), ("checked", checked_under)):
            stored = np.zeros((6, 2), dtype=np.uint64)
            with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
                worker.add_region_of(kv)
                worker.add_group(0, 8)
                worker.add_layer(kvcsum.layer(kv, "BHTD", layer_number=0, identity=b"layer 0"))
                worker.add_stored_of(0, stored)
                if decoding is not None:
                    worker.set_layer_decoding(0, 0, **decoding)
                blocks.add_request("o", 20).add_group("o", 0, [4, 0, 5]).set_hashes("o", 0, hashes)
                if name == "stored":
                    with worker.checksum(blocks, kvcsum.CONSUMER) as result:
                        entries["kept"] = result.entries("o", 0)
                    worker.store(blocks).close()
                    assert (entries["kept"] == stored[[4, 0, 5]]).all(), f"{stored_under}: entries() is what a store writes"
                else:
                    with worker.checksum(blocks, kvcsum.CONSUMER) as result:
                        outcomes = list(result.check_entries("o", 0, entries["kept"]))
        expected = kvcsum.STORED_MATCHED if stored_under == checked_under else kvcsum.STORED_OTHER_FINGERPRINT
        assert outcomes == [expected] * 3, f"stored under {stored_under}, checked under {checked_under}: {outcomes}"


def test_group_placement_names_bad_fields_and_must_precede_layers():
    """Worker.set_group_placement (docs/SPEC.md section 16): bad sizes name
    the field and its value; a placed group's layers tile its local slots;
    after a layer, the placement is refused."""
    worker = kvcsum.Worker()
    worker.add_group(0, 32)
    for kwargs, needle in [
        ({"dcp_size": 2, "dcp_rank": 2}, "dcp_rank 2 is not below placement.dcp_size 2"),
        ({"dcp_size": 0}, "dcp_size is 0"),
        ({"interleave": 0}, "interleave is 0"),
        ({"tokens_per_slot": 3}, "not a multiple of placement.tokens_per_slot 3"),
        ({"dcp_size": 2, "interleave": 3}, "interleave 3 does not divide the local block of 16 slots"),
    ]:
        with pytest.raises(kvcsum.InvalidArgument, match=needle):
            worker.set_group_placement(0, **kwargs)
    with pytest.raises(kvcsum.NotFound):
        worker.set_group_placement(7)
    worker.set_group_placement(0, dcp_size=2, dcp_rank=1, interleave=2, tokens_per_slot=2)
    # 32 tokens / 2 per slot / 2 ranks: local blocks of 8 slots.
    cache = np.ones((4, 8, 16), dtype=np.uint8)
    worker.add_region_of(cache)
    worker.add_layer(kvcsum.layer(cache, "BTD", group_id=0, layer_number=0))
    with pytest.raises(kvcsum.InvalidArgument, match="set its placement before registering them"):
        worker.set_group_placement(0)
