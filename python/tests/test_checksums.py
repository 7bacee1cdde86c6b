"""Checksums through the Python package against a naive reference of
docs/SPEC.md (loops over logical indices, Python integers mod 2**64), on
seeded random KV laid out every way kvcsum.layer() describes."""

import os

import numpy as np
import pytest

import kvcsum

MASK = (1 << 64) - 1
SEED = int(os.environ.get("KVCS_SEED", "0x707974"), 0)

BLOCKS, HEADS, TOKENS, K_PIECES, V_PIECES = 6, 4, 8, 2, 2
PIECES = K_PIECES + V_PIECES


@pytest.fixture
def rng(request):
    seed = SEED + sum(map(ord, request.node.name))
    print(f"random data seed {seed:#x} (KVCS_SEED={SEED:#x})")
    return np.random.default_rng(seed)


def logical_kv(rng, layers=1, heads=HEADS):
    """[layer][block id][head][token][piece]: K pieces then V pieces."""
    return rng.integers(0, 2**64, (layers, BLOCKS, heads, TOKENS, PIECES), dtype=np.uint64, endpoint=False)


def mix(x):
    """f of SPEC section 12 for MIXED (kvcsum 0.2's default), written again here."""
    g = ((x ^ (x >> 32)) * 0x9E3779B97F4A7C15) & MASK
    return g ^ (g >> 32)


def mix2(x):
    """f of SPEC section 12 for MIXED2 (the default), written again here:
    three rounds on the 32-bit halves (low half times the round's
    multiplier, high half added to the product's high half, halves
    swapped), the high half folded into the low one after the last two."""
    lo, hi = x & 0xFFFFFFFF, x >> 32
    for r, k in enumerate((0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)):
        product = lo * k
        lo, hi = (hi + (product >> 32)) & 0xFFFFFFFF, product & 0xFFFFFFFF
        if r > 0:
            lo ^= hi
    return (hi << 32) | lo


def reference(kv, block_ids, num_tokens, layer_numbers, first_head=0, heads=None, algorithm=kvcsum.MIXED2):
    """c(q) for each position q by SPEC sections 2-3 and 12, heads `first_head ..`."""
    f = {kvcsum.MIXED: mix, kvcsum.MIXED2: mix2}.get(algorithm, lambda x: x)
    heads = kv.shape[2] if heads is None else heads
    out = []
    for q, block in enumerate(block_ids):
        total = 0
        for li, layer_number in enumerate(layer_numbers):
            for h in range(heads):
                slice_sum = 0
                for t in range(TOKENS):
                    if q * TOKENS + t >= num_tokens:
                        break
                    for p in range(PIECES):
                        j = (q * TOKENS + t) * PIECES + p
                        slice_sum += f(int(kv[li, block, first_head + h, t, p])) * (2 * j + 1)
                weight = 2 * (layer_number * 65536 + first_head + h) + 1
                total = (total + weight * slice_sum) & MASK
        out.append(total)
    return np.array(out, dtype=np.uint64)


def run(layers, arrays, block_ids, num_tokens, tp_rank=0, tp_size=1, role=kvcsum.PRODUCER):
    with kvcsum.Worker(tp_rank=tp_rank, tp_size=tp_size, num_threads=2) as worker, kvcsum.Blocks() as blocks:
        for array in arrays:
            worker.add_region_of(array)
        worker.add_group(0, TOKENS)
        for layer in layers:
            worker.add_layer(layer)
        blocks.add_request("req", num_tokens)
        blocks.add_group("req", 0, block_ids)
        with worker.checksum(blocks, role) as result:
            assert result.ready()
            return result.column("req", 0)


BLOCK_IDS = [4, 0, 5, 2]
NUM_TOKENS = 3 * TOKENS + 3  # the last block is partial


def test_nhd_and_hnd_give_the_reference(rng):
    kv = logical_kv(rng, layers=2)
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [3, 9])
    hnd = [np.ascontiguousarray(kv[i]) for i in range(2)]  # [B, H, T, P]
    nhd = [np.ascontiguousarray(kv[i].transpose(0, 2, 1, 3)) for i in range(2)]  # [B, T, H, P]
    got_hnd = run([kvcsum.layer(a, "HND", layer_number=n) for a, n in zip(hnd, [3, 9])], hnd, BLOCK_IDS, NUM_TOKENS)
    got_nhd = run([kvcsum.layer(a, "NHD", layer_number=n) for a, n in zip(nhd, [3, 9])], nhd, BLOCK_IDS, NUM_TOKENS)
    assert got_hnd.dtype == np.uint64
    np.testing.assert_array_equal(got_hnd, want)
    np.testing.assert_array_equal(got_nhd, want)


def test_kv_split_layouts_and_a_separate_v(rng):
    kv = logical_kv(rng)
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [1])
    k, v = kv[0, ..., :K_PIECES], kv[0, ..., K_PIECES:]  # [B, H, T, pieces]
    # FlashAttention [2, B, T, H, D] as 16-bit elements.
    flash = np.ascontiguousarray(np.stack([k, v]).transpose(0, 1, 3, 2, 4)).view(np.uint16)
    # FlashInfer HND [B, 2, H, T, D].
    infer = np.ascontiguousarray(np.stack([k, v], axis=1))
    k_nhd = np.ascontiguousarray(k.transpose(0, 2, 1, 3))
    v_nhd = np.ascontiguousarray(v.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(
        run([kvcsum.layer(flash, "KBTHD", layer_number=1)], [flash], BLOCK_IDS, NUM_TOKENS), want
    )
    np.testing.assert_array_equal(
        run([kvcsum.layer(infer, "BKHTD", layer_number=1)], [infer], BLOCK_IDS, NUM_TOKENS), want
    )
    np.testing.assert_array_equal(
        run([kvcsum.layer(k_nhd, "NHD", layer_number=1, v=v_nhd)], [k_nhd, v_nhd], BLOCK_IDS, NUM_TOKENS), want
    )


def test_cross_layer_cache_through_views(rng):
    kv = logical_kv(rng, layers=3)
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [0, 1, 2])
    # One tensor for every layer, [blocks, layers, tokens, heads, pieces];
    # each layer is a strided view of it.
    cross = np.ascontiguousarray(kv.transpose(1, 0, 3, 2, 4))
    layers = [kvcsum.layer(cross[:, i], "NHD", layer_number=i) for i in range(3)]
    np.testing.assert_array_equal(run(layers, [cross], BLOCK_IDS, NUM_TOKENS), want)


def test_kernel_blocks_and_negative_strides(rng):
    kv = logical_kv(rng)
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [0])
    # Two kernel blocks of 4 tokens per logical block: [B*2, H, 4, P].
    halves = np.ascontiguousarray(
        kv[0].reshape(BLOCKS, HEADS, 2, TOKENS // 2, PIECES).transpose(0, 2, 1, 3, 4)
    ).reshape(BLOCKS * 2, HEADS, TOKENS // 2, PIECES)
    np.testing.assert_array_equal(
        run([kvcsum.layer(halves, "HND", layer_number=0, kernel_blocks=2)], [halves], BLOCK_IDS, NUM_TOKENS), want
    )
    # Blocks stored in reverse order: a view with a negative block stride.
    reversed_storage = np.ascontiguousarray(kv[0][::-1])
    view = reversed_storage[::-1]
    assert view.strides[0] < 0
    np.testing.assert_array_equal(
        run([kvcsum.layer(view, "HND", layer_number=0)], [view], BLOCK_IDS, NUM_TOKENS), want
    )


def test_mla_without_a_head_dimension(rng):
    kv = logical_kv(rng, heads=1)
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [2])
    latent = np.ascontiguousarray(kv[0, :, 0])  # [B, T, P]
    np.testing.assert_array_equal(
        run([kvcsum.layer(latent, "BTD", layer_number=2)], [latent], BLOCK_IDS, NUM_TOKENS), want
    )


class FakeTensor:
    """What kvcsum.layer() reads of a torch tensor: data_ptr(), shape,
    stride() in elements, element_size(). (torch itself is not installed by
    the test command; a real tensor goes through the same path.)"""

    def __init__(self, array):
        self.array = array
        self.shape = array.shape

    def data_ptr(self):
        return self.array.ctypes.data

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def element_size(self):
        return self.array.itemsize


def test_torch_style_tensor(rng):
    kv = logical_kv(rng)
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [5])
    nhd = np.ascontiguousarray(kv[0].transpose(0, 2, 1, 3)).view(np.int32)
    tensor = FakeTensor(nhd)
    np.testing.assert_array_equal(
        run([kvcsum.layer(tensor, "NHD", layer_number=5)], [nhd], BLOCK_IDS, NUM_TOKENS), want
    )


@pytest.mark.torch
def test_real_torch_tensor(rng):
    # Runs under make vllm-test, whose venv has torch (`-m torch`); the
    # plain venv deselects it (`-m "not torch"`), so it never skips.
    import torch

    kv = logical_kv(rng)
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [5])
    nhd = np.ascontiguousarray(kv[0].transpose(0, 2, 1, 3)).view(np.int32)
    real = torch.from_numpy(nhd)
    np.testing.assert_array_equal(
        run([kvcsum.layer(real, "NHD", layer_number=5)], [nhd], BLOCK_IDS, NUM_TOKENS), want
    )


def test_tp_ranks_add_up(rng):
    kv = logical_kv(rng, layers=2)
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [0, 1])
    total = np.zeros(len(BLOCK_IDS), dtype=np.uint64)
    for rank in range(2):
        shards = [np.ascontiguousarray(kv[i, :, rank * 2 : rank * 2 + 2]) for i in range(2)]
        layers = [kvcsum.layer(s, "HND", layer_number=i, first_head=rank * 2) for i, s in enumerate(shards)]
        part = run(layers, shards, BLOCK_IDS, NUM_TOKENS, tp_rank=rank, tp_size=2)
        np.testing.assert_array_equal(part, reference(kv, BLOCK_IDS, NUM_TOKENS, [0, 1], first_head=rank * 2, heads=2))
        total += part  # wraps mod 2**64 like the definition
    np.testing.assert_array_equal(total, want)


def test_layer_description_errors():
    cache = np.zeros((4, 8, 2, 16), dtype=np.uint16)
    with pytest.raises(ValueError, match="name each dimension once"):
        kvcsum.layer(cache, "BTXD", layer_number=0)
    with pytest.raises(ValueError, match="names 5 dimensions"):
        kvcsum.layer(cache, "KBTHD", layer_number=0)
    with pytest.raises(ValueError, match="must be contiguous"):
        kvcsum.layer(cache.transpose(0, 1, 3, 2), "BTHD", layer_number=0)
    with pytest.raises(ValueError, match="not a multiple of kernel_blocks"):
        kvcsum.layer(cache, "NHD", layer_number=0, kernel_blocks=3)
    with pytest.raises(ValueError, match="not 2"):
        kvcsum.layer(np.zeros((3, 4, 8, 2, 16), dtype=np.uint16), "KBTHD", layer_number=0)
    with pytest.raises(TypeError, match="cannot describe"):
        kvcsum.layer([1, 2, 3], "NHD", layer_number=0)
    # A cell that is not a whole number of 8-byte pieces: the library says so.
    odd = np.zeros((4, 8, 2, 3), dtype=np.uint16)
    with kvcsum.Worker() as worker:
        worker.add_region_of(odd)
        worker.add_group(0, 8)
        with pytest.raises(kvcsum.Error) as caught:
            worker.add_layer(kvcsum.layer(odd, "NHD", layer_number=0))
        assert "bytes_per_token" in caught.value.message


@pytest.mark.parametrize("algorithm", [kvcsum.WEIGHTED, kvcsum.MIXED, kvcsum.MIXED2])
def test_algorithms_against_the_reference(rng, algorithm):
    kv = logical_kv(rng, layers=1)
    array = kv[0].copy()
    layer = kvcsum.layer(array, "BHTD", layer_number=5)
    block_ids = [4, 1, 3]
    with kvcsum.Worker(num_threads=1, algorithm=algorithm) as worker, kvcsum.Blocks() as blocks:
        worker.add_region_of(array)
        worker.add_group(0, TOKENS)
        worker.add_layer(layer)
        blocks.add_request("req", 21)
        blocks.add_group("req", 0, block_ids)
        with worker.checksum(blocks) as result:
            values = result.column("req", 0)
        with pytest.raises(kvcsum.InvalidArgument, match="already computed"):
            worker.set_algorithm(kvcsum.WEIGHTED)
    expected = reference(kv, block_ids, 21, [5], algorithm=algorithm)
    assert list(values) == list(expected)
    with pytest.raises(kvcsum.InvalidArgument, match="algorithm 7"):
        kvcsum.Worker(algorithm=7)


def test_blocks_from_arrays_checksum_as_the_per_request_calls(rng):
    """Blocks.add_arrays (one C call from numpy arrays) gives the values of
    the same requests added one call at a time, and the reference."""
    kv = logical_kv(rng, layers=2)
    hnd = [np.ascontiguousarray(kv[i]) for i in range(2)]
    layers = [kvcsum.layer(a, "HND", layer_number=n) for a, n in zip(hnd, [3, 9])]
    requests = []
    for r in range(int(rng.integers(2, 9))):
        count = int(rng.integers(0, 5))
        ids = [int(b) for b in rng.integers(0, BLOCKS, count)]
        requests.append((f"req-{r}" + "é" * (r % 2), int(rng.integers(0, 5 * TOKENS)), int(rng.integers(0, 3)), ids))
    group_ends = np.arange(1, len(requests) + 1)
    block_ends = np.cumsum([len(ids) for _, _, _, ids in requests])
    flat = np.array([b for _, _, _, ids in requests for b in ids], dtype=np.int64)
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as bulk, kvcsum.Blocks() as calls:
        for array in hnd:
            worker.add_region_of(array)
        worker.add_group(0, TOKENS)
        for layer in layers:
            worker.add_layer(layer)
        for req_id, num_tokens, first, ids in requests:
            calls.add_request(req_id, num_tokens)
            calls.add_group(req_id, 0, ids, first)
        bulk.add_arrays(
            [r for r, _, _, _ in requests],
            np.array([n for _, n, _, _ in requests]),
            group_ends,
            np.zeros(len(requests), dtype=np.uint32),
            np.array([f for _, _, f, _ in requests]),
            block_ends,
            flat,
        )
        with worker.checksum(calls, kvcsum.CONSUMER) as a, worker.checksum(bulk, kvcsum.CONSUMER) as b:
            for req_id, num_tokens, first, ids in requests:
                got = b.column(req_id, 0)
                np.testing.assert_array_equal(got, a.column(req_id, 0))
                # Positions from `first`: the reference over the blocks at
                # their positions (ids padded before `first`).
                want = reference(kv, [0] * first + ids, num_tokens, [3, 9])[first:]
                np.testing.assert_array_equal(got, want)


def test_blocks_from_arrays_refuse_disagreeing_arrays_and_add_nothing():
    with kvcsum.Blocks() as blocks:
        args = (["a", "b"], [16, 8], [1, 2], [0, 0], [0, 0], [2, 3], [1, 2, 3])
        with pytest.raises(kvcsum.InvalidArgument, match="num_tokens has 1 entries"):
            blocks.add_arrays(["a", "b"], [16], *args[2:])
        with pytest.raises(kvcsum.InvalidArgument, match=r"block_ends ends at 3, but block_ids has 2"):
            blocks.add_arrays(*args[:6], [1, 2])
        with pytest.raises(kvcsum.InvalidArgument, match=r"group_ids\[1\] 0 is given twice"):
            blocks.add_arrays(["a"], [16], [2], [0, 0], [0, 0], [2, 3], [1, 2, 3])
        with pytest.raises(kvcsum.InvalidArgument, match="hashes has 2 rows"):
            blocks.add_arrays(*args, hashes=np.zeros((2, 8), dtype=np.uint8))
        with pytest.raises(ValueError, match="group_ends"):
            blocks.add_arrays(["a", "b"], [16, 8], [1, -2], *args[3:])
        blocks.add_request("b", 1)
        with pytest.raises(kvcsum.InvalidArgument, match=r'req_ids\[1\] "b" is already in the block set'):
            blocks.add_arrays(*args, hashes=np.ones((3, 32), dtype=np.uint8))
        # Nothing of the refused calls was added: "a" is new.
        blocks.add_request("a", 1)
        blocks.add_arrays(["c"], [4], [1], [0], [0], [1], [5], hashes=np.ones((1, 8), dtype=np.uint8))
        with pytest.raises(kvcsum.InvalidArgument, match="already"):
            blocks.add_request("c", 1)
