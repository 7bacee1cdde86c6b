"""KV sharing across block sizes through the connector's fingerprint
rewrite (`kvcsum.vllm.load_verdict.rewrite_fingerprints`): the vLLM fork's layer identities name the
block size, so a consumer of another block size rewrites the producer's
fingerprint into its own before verifying. The fingerprint counts every
layer as the fork does (no marks); the alias marks travel in the payload
extension, so with KV sharing a rewritten payload verifies (MATCH intact,
MISMATCH on a flipped bit), and a side where a layer is an alias never
compares with one where it has its own cache (UNVERIFIED)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcsum  # noqa: E402
from kvcsum.vllm.load_verdict import rewrite_fingerprints  # noqa: E402
from kvcsum.vllm.cache_checksums import Job, layer_fingerprint  # noqa: E402
from layouts import checksummer, layer_specs, lay_out, logical_caches  # noqa: E402

LAYERS, BLOCKS, HEADS, HEAD = 4, 8, 4, 8
SHARED = {LAYERS: 1}  # layer 4 reads layer 1's cache
TOKENS = 45
CONSUMER_TABLE = [3, 1, 6]  # 16-token blocks
PRODUCER_TABLE = [2 * b + half for b in CONSUMER_TABLE for half in (0, 1)][:6]  # the same tokens in 8-token blocks


def fork_fingerprint(specs, block_size: int) -> int:
    """The fork's fingerprint of a group at `block_size` (the connector's
    _group_fingerprint): every layer name, none marked."""
    return sum(layer_fingerprint(s.name, s.spec_type, block_size, s.dtype) for s in specs) % 2**64


def in_8_token_blocks(logical):
    """Each layer's [B, H, 16, C] cache as [2B, H, 8, C]: block b's tokens in blocks 2b and 2b+1."""
    out = []
    for t in logical:
        B, H, N, C = t.shape
        out.append(t.reshape(B, H, 2, N // 2, C).permute(0, 2, 1, 3, 4).reshape(2 * B, H, N // 2, C).contiguous())
    return out


def producer_payload(logical, shared=SHARED) -> bytes:
    specs = layer_specs(len(logical), 8, HEADS, HEAD, shared=shared)
    worker = checksummer(specs, lay_out(in_8_token_blocks(logical), "LBNHC"), 2 * BLOCKS, 8, shared=shared)
    job = Job("a", TOKENS, {0: (0, PRODUCER_TABLE)})
    record = worker.checksum([job], kvcsum.PRODUCER).record()
    with kvcsum.Verifier(1) as verifier, kvcsum.Blocks() as blocks:
        job.to_blocks(blocks)
        verifier.expect(blocks, kvcsum.PRODUCER)
        verifier.add_record(record)
        return verifier.payload("a")


def consumer_report(logical, payload: bytes, shared=SHARED, caches=None) -> kvcsum.Report:
    specs = layer_specs(len(logical), 16, HEADS, HEAD, shared=shared)
    worker = checksummer(specs, caches if caches is not None else lay_out(logical, "LBHNC"), BLOCKS, 16, shared=shared)
    job = Job("a", TOKENS, {0: (0, CONSUMER_TABLE)})
    record = worker.checksum([job], kvcsum.CONSUMER).record()
    verifier = kvcsum.Verifier(1)
    with kvcsum.Blocks() as blocks:
        job.to_blocks(blocks)
        verifier.expect(blocks, kvcsum.CONSUMER)
    verifier.add_record(record)
    verifier.set_producer_block_size(0, 8)
    return verifier.check("a", payload)


def rewritten(payload: bytes, logical, shared=SHARED) -> bytes:
    specs = layer_specs(len(logical), 8, HEADS, HEAD, shared=shared)
    return rewrite_fingerprints(payload, {0: (fork_fingerprint(specs, 8), fork_fingerprint(specs, 16))})


def test_the_rewrite_replaces_the_fingerprint_and_keeps_the_extension():
    logical = logical_caches(LAYERS, BLOCKS, HEADS, 16, 2 * HEAD, seed=11)
    payload = producer_payload(logical)
    before, after = kvcsum.decode_payload(payload), kvcsum.decode_payload(rewritten(payload, logical))
    specs = layer_specs(LAYERS, 16, HEADS, HEAD, shared=SHARED)
    assert before.groups[0].fingerprint == fork_fingerprint(layer_specs(LAYERS, 8, HEADS, HEAD, shared=SHARED), 8)
    assert after.groups[0].fingerprint == fork_fingerprint(specs, 16)
    assert after.groups[0].marks == before.groups[0].marks != 0, "the alias's mark, beside the fingerprint"
    assert (after.extension_version, after.groups[0].values, after.groups[0].block_size) == (
        before.extension_version,
        before.groups[0].values,
        8,
    )


def test_kv_sharing_across_block_sizes_verifies_through_the_rewrite():
    logical = logical_caches(LAYERS, BLOCKS, HEADS, 16, 2 * HEAD, seed=12)
    payload = producer_payload(logical)
    with consumer_report(logical, rewritten(payload, logical)) as report:
        assert report.verdict == kvcsum.MATCH, report.message
    # Not rewritten: the fork's identities name another block size.
    with consumer_report(logical, payload) as report:
        assert report.reason == kvcsum.FINGERPRINT_DIFFERS, report.message
    # One bit of layer 1 (which layer 4 shares) in block 6, position 2.
    caches = lay_out(logical, "LBHNC")
    caches[1].view(torch.int16)[6, 2, 3, 5] ^= 8
    with consumer_report(logical, rewritten(payload, logical), caches=caches) as report:
        assert report.verdict == kvcsum.MISMATCH, report.message
        assert [(m.first_position, m.num_positions) for m in report.mismatches] == [(2, 1)]


def test_an_alias_and_an_own_cache_never_compare_through_the_rewrite():
    logical = logical_caches(LAYERS, BLOCKS, HEADS, 16, 2 * HEAD, seed=13)
    # The producer's layer 4 has a cache of its own, holding layer 1's bytes.
    owning = logical + [logical[1].clone()]
    payload = producer_payload(owning, shared={})
    assert kvcsum.decode_payload(payload).groups[0].marks == 0
    with consumer_report(logical, rewritten(payload, owning, shared={})) as report:
        assert report.verdict == kvcsum.UNVERIFIED, report.message
        assert report.reason == kvcsum.FINGERPRINT_DIFFERS and "alias" in report.message, report.message
    # And the other way round.
    payload = producer_payload(logical)
    with consumer_report(owning, rewritten(payload, logical), shared={}) as report:
        assert report.verdict == kvcsum.UNVERIFIED, report.message
        assert report.reason == kvcsum.FINGERPRINT_DIFFERS, report.message
