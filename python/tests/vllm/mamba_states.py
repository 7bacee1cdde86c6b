"""Mamba states as vLLM's NIXL connector sees them across TP sizes: each
rank's page holds its slice of one global state, the conv state's
sub-projections (x; x, B, C; Q, K, V) each split along its channels, then
the temporal (ssm) state split along its first dimension. The split is
vLLM's own (derive_mamba_conv_split, distributed/kv_transfer/kv_connector/
v1/ssm_conv_transfer_utils.py), never kvcsum's, so that the tests check
kvcsum's derivation against vLLM's.

Needs vLLM's DS conv layout (VLLM_SSM_CONV_STATE_LAYOUT=DS): the fixture
`ds_conv_layout` (conftest.py) sets it for a test.
"""

from __future__ import annotations

import math

import torch

from vllm.v1.kv_cache_interface import MambaSpec


def nixl_split(spec: MambaSpec, tp: int) -> list[tuple[int, int]] | None:
    """[(rows a rank holds, bytes a row)] of each tensor in page order (the
    conv sub-projections, then the temporal state) as vLLM's NIXL connector
    derives them for an engine of TP size `tp`; None where it derives none
    (another mamba_type, the SD layout, shapes that do not decompose)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split

    try:
        info = derive_mamba_conv_split(spec, tp)
    except (AssertionError, NotImplementedError):
        return None
    conv_row = info.conv_rows * info.conv_dtype_size
    temporal = spec.shapes[1]
    ssm_row = math.prod(temporal[1:]) * torch.tensor([], dtype=spec.dtypes[1]).element_size()
    return [(dim, conv_row) for dim in info.local_proj_dims] + [(int(temporal[0]), ssm_row)]


def global_bytes(split: list[tuple[int, int]], tp: int) -> int:
    """Bytes of the global state of a rank's `split` at TP size `tp`."""
    return sum(rows * tp * row for rows, row in split)


def rank_slice(state: torch.Tensor, split: list[tuple[int, int]], tp: int, rank: int) -> torch.Tensor:
    """The page content of TP rank `rank` of `tp` (uint8) holding its slice
    of the global `state` (uint8: each tensor's global rows, one tensor
    after the other): rows rank·R .. rank·R + R of each tensor of R rows a
    rank."""
    out, offset = [], 0
    for rows, row in split:
        out.append(state[offset + rank * rows * row : offset + (rank + 1) * rows * row])
        offset += rows * tp * row
    return torch.cat(out)


def rows_of(split: list[tuple[int, int]], tp: int, rank: int):
    """(global row number, byte offset in the rank's page content, bytes a
    row) of every row TP rank `rank` of `tp` holds, the tensors' global
    rows numbered one tensor after the other."""
    out, base, offset = [], 0, 0
    for rows, row in split:
        for i in range(rows):
            out.append((base + rank * rows + i, offset + i * row, row))
        base += rows * tp
        offset += rows * row
    return out
