"""kvcsum.layer() over the library's kvcs_layer_from_layout (SPEC section
14): the caller's fields pass through, the geometry and segments are what
the tensor's shape and strides say (worked out here from numpy's own
strides, on seeded random sizes), and what the library refuses reaches
Python as InvalidArgument (a ValueError) naming the argument and value."""

import os

import numpy as np
import pytest

import kvcsum

SEED = int(os.environ.get("KVCS_SEED", "0x6c6179"), 0)


def test_fields_and_segments_follow_the_tensor():
    rng = np.random.default_rng(SEED)
    for case in range(20):
        blocks, tokens, heads = (int(n) for n in rng.integers(1, 6, 3))
        kernel_blocks = int(rng.integers(1, 4))
        dim = 8 * int(rng.integers(1, 4))
        flash = np.zeros((2, blocks * kernel_blocks, tokens, heads, dim), dtype=np.uint16)
        address = flash.ctypes.data
        layer = kvcsum.layer(
            flash,
            "KBTHD" if case % 2 else "kbthd",
            layer_number=3,
            group_id=2,
            first_head=4,
            kernel_blocks=kernel_blocks,
            replicas=2,
            replica_index=1,
            identity=b"layer 3",
        )
        context = f"seed {SEED:#x} case {case}: shape {flash.shape}"
        assert (layer.group_id, layer.layer_number, layer.first_head, layer.replicas, layer.replica_index) == (
            2,
            3,
            4,
            2,
            1,
        ), context
        assert layer.identity == b"layer 3" and layer.arrays[0] is flash, context
        assert (layer.num_heads, layer.num_blocks, layer.kernel_blocks, layer.tokens_per_kernel_block) == (
            heads,
            blocks,
            kernel_blocks,
            tokens,
        ), context
        k_stride, b_stride, t_stride, h_stride, _ = flash.strides
        got = [
            (s.address, s.block_stride, s.kernel_block_stride, s.head_stride, s.token_stride, s.bytes_per_token)
            for s in layer.segments
        ]
        want = [
            (address + part * k_stride, b_stride * kernel_blocks, b_stride, h_stride, t_stride, dim * 2)
            for part in (0, 1)
        ]
        assert got == want, context


def test_k_and_v_apart_each_say_their_own_bytes_per_token():
    k = np.zeros((4, 8, 2, 16), dtype=np.uint16)  # NHD, 32 bytes per head and token
    v = np.zeros((4, 8, 2, 8), dtype=np.uint16)  # V of another head size: 16 bytes
    layer = kvcsum.layer(k, "NHD", layer_number=0, v=v)
    assert [s.address for s in layer.segments] == [k.ctypes.data, v.ctypes.data]
    assert [s.bytes_per_token for s in layer.segments] == [32, 16]
    assert layer.arrays[0] is k and layer.arrays[1] is v


def test_refusals_name_the_argument():
    k = np.zeros((4, 8, 2, 16), dtype=np.uint16)
    with pytest.raises(kvcsum.InvalidArgument, match='layout "KBTHD" has a K dimension and v is given too'):
        kvcsum.layer(np.zeros((2, 4, 8, 2, 16), dtype=np.uint16), "KBTHD", layer_number=0, v=k)
    with pytest.raises(kvcsum.InvalidArgument, match="v and cache differ in blocks, tokens or heads: v B=4 T=4"):
        kvcsum.layer(k, "NHD", layer_number=0, v=np.zeros((4, 4, 2, 16), dtype=np.uint16))
    with pytest.raises(kvcsum.InvalidArgument, match="kernel_blocks is 0"):
        kvcsum.layer(k, "NHD", layer_number=0, kernel_blocks=0)
    with pytest.raises(ValueError, match='layout "BTHH": name each dimension once'):
        kvcsum.layer(k, "BTHH", layer_number=0)
    with pytest.raises(ValueError, match="D dimension must be contiguous: its stride is 32 bytes, element_size is 2"):
        kvcsum.layer(k.transpose(0, 1, 3, 2), "BTHD", layer_number=0)
    with pytest.raises(TypeError, match="layout must be a str"):
        kvcsum.layer(k, b"NHD", layer_number=0)


def test_views_whose_cells_share_bytes_are_refused():
    rng = np.random.default_rng(SEED)
    blocks, tokens, heads, dim = 4, 8, 2, 16
    cache = rng.integers(0, 2**16, (blocks, tokens, heads, dim), dtype=np.uint16)
    kvcsum.layer(cache, "NHD", layer_number=0)  # the real strides
    # numpy's broadcast_to (stride 0) over blocks, tokens or heads.
    for axis, letter in enumerate("BTH"):
        base = cache[tuple(slice(0, 1) if i == axis else slice(None) for i in range(4))]
        view = np.broadcast_to(base, cache.shape)
        with pytest.raises(kvcsum.InvalidArgument, match=f"share bytes: {letter} 0 "):
            kvcsum.layer(view, "NHD", layer_number=0)
    # K of stride 0 (V is K), and V given as the cache itself.
    flash = np.broadcast_to(cache[None], (2, blocks, tokens, heads, dim))
    with pytest.raises(kvcsum.InvalidArgument, match="V starts 0 bytes from K"):
        kvcsum.layer(flash, "KBTHD", layer_number=0)
    with pytest.raises(kvcsum.InvalidArgument, match="K and V must not overlap"):
        kvcsum.layer(cache, "NHD", layer_number=0, v=cache)
    # Tokens closer than their cells: an overlapping as_strided view.
    overlapping = np.lib.stride_tricks.as_strided(cache, strides=(cache.strides[0], 8, 2 * dim, 2))
    with pytest.raises(kvcsum.InvalidArgument, match="share bytes"):
        kvcsum.layer(overlapping, "NHD", layer_number=0)
