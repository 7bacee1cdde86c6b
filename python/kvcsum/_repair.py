"""Repair after a MISMATCH: the consumer blocks to load again."""

from __future__ import annotations

import dataclasses

from ._base import _int
from ._constants import UNVERIFIED, WHOLE_LOAD
from ._verify import Report

# --- Repair (reload only the blocks that differ) ---------------------------------


@dataclasses.dataclass(frozen=True)
class RepairBlock:
    """A consumer block to load again: its group, block position and block
    id, and the request tokens `first_token .. first_token + num_tokens - 1`
    of it that were compared and differ.

    Thread safety: immutable (a frozen dataclass); share it freely."""

    group_id: int
    position: int
    block_id: int
    first_token: int
    num_tokens: int


def repair_plan(report, block_tables: dict, block_size) -> dict[int, list[RepairBlock]]:
    """The consumer blocks to transfer again after a MISMATCH, per group.

    `report` is a Report (or a list of its Mismatch entries); `block_tables`
    maps each group id to the consumer's block ids of the request, either
    from position 0 (`{0: [7, 2, 9]}`) or as `(first_position, block_ids)`;
    `block_size` is the consumer's tokens per block, one int or
    `{group_id: block_size}`. Returns `{group_id: [RepairBlock, ...]}` in
    position order, each position once; a MATCH gives `{}`.

    Where the two sides' block sizes differ, a mismatch covers a run of
    their least common multiple, so every consumer block of that run is
    named.

    Raises ValueError where a plan would not make the load verified:
    - an UNVERIFIED report (it names no positions: the load must be
      repeated whole);
    - a report with findings, such as a MISMATCH in one group while
      another group's fingerprint differs: that group was not compared, and
      reloading blocks cannot make it comparable, so the plan would end in
      an unverified load; the message names each such group and reason,
      and the load must be repeated whole (or the configuration fixed).
      A list of Mismatch entries carries no findings: passing one skips
      this check;
    - a mismatch that does not fit the tables: a group with no table, a
      position without a block id, a group without a block size, tokens
      outside the position.
    Block sizes and block ids must be integers (TypeError for a bool or a
    non-integer); ValueError for a block size below 1 or a block id outside
    [0, 2**32).
    """
    if isinstance(report, Report):
        verdict = report.verdict
        if verdict == UNVERIFIED:
            raise ValueError(f"report is unverified ({report.message}); it names no positions to repair")
        findings = report.findings
        if findings:
            unverified = "; ".join(
                f"{'the whole load' if f.group_id == WHOLE_LOAD else f'group {f.group_id}'} is unverified "
                f"({f.reason_name}: {f.message})"
                for f in findings
            )
            raise ValueError(
                f"{unverified}: repairing the differing blocks cannot make this load verified; "
                "load the request again whole"
            )
        mismatches = report.mismatches
    else:
        mismatches = list(report)
    plan: dict[int, dict[int, RepairBlock]] = {}
    for m in mismatches:
        if m.group_id not in block_tables:
            raise ValueError(f"group {m.group_id} differs but block_tables has no table for it")
        table = block_tables[m.group_id]
        first_position, ids = table if isinstance(table, tuple) else (0, table)
        first_position = _int(first_position, "uint64_t", f"first position of block_tables[{m.group_id}]")
        if isinstance(block_size, dict):
            if m.group_id not in block_size:
                raise ValueError(f"group {m.group_id} differs but block_size has no entry for it")
            size = block_size[m.group_id]
        else:
            size = block_size
        size = _int(size, "uint32_t", f"block_size of group {m.group_id}")
        if size < 1:
            raise ValueError(f"block_size of group {m.group_id} is {size}; it must be a positive integer")
        end_token = m.first_token + m.num_tokens
        for q in range(m.first_position, m.first_position + m.num_positions):
            index = q - first_position
            if not 0 <= index < len(ids):
                raise ValueError(
                    f"group {m.group_id} position {q} differs but the block table holds positions "
                    f"{first_position} .. {first_position + len(ids) - 1}"
                )
            low, high = max(q * size, m.first_token), min((q + 1) * size, end_token)
            if high <= low:
                raise ValueError(
                    f"group {m.group_id} position {q} (block size {size}) holds none of the differing tokens "
                    f"{m.first_token} .. {end_token - 1}"
                )
            block_id = _int(ids[index], "uint32_t", f"block_tables[{m.group_id}][{index}]")
            plan.setdefault(m.group_id, {})[q] = RepairBlock(m.group_id, q, block_id, low, high - low)
    return {group: [blocks[q] for q in sorted(blocks)] for group, blocks in sorted(plan.items())}
