"""Repair after a MISMATCH: the consumer blocks to load again."""

from __future__ import annotations

import dataclasses
from ctypes import byref, c_size_t, c_uint32

from . import _lib
from ._base import _c, _check, _int, library
from ._verify import Report
from ._worker import Blocks

# --- Repair (reload only the blocks that differ) ---------------------------------


@dataclasses.dataclass(frozen=True)
class RepairBlock:
    """A consumer block to load again (kvcs_repair_block): its group, block
    position and block id, and the request tokens of it that were compared
    and differ, half-open: `[start_token, end_token)`, which is
    `first_token` and the `num_tokens` from it.

    Thread safety: immutable (a frozen dataclass); share it freely."""

    group_id: int
    position: int
    block_id: int
    first_token: int
    num_tokens: int

    @property
    def start_token(self) -> int:
        """The first request token to load again (first_token)."""
        return self.first_token

    @property
    def end_token(self) -> int:
        """One past the last request token to load again."""
        return self.first_token + self.num_tokens


def repair_plan(report, block_tables: dict, block_size) -> dict[int, list[RepairBlock]]:
    """The consumer blocks to transfer again after a MISMATCH, per group
    (kvcs_report_repair_plan; SPEC section 15).

    `report` is a Report (or a list of its Mismatch entries); `block_tables`
    maps each group id to the consumer's block ids of the request, either
    from position 0 (`{0: [7, 2, 9]}`) or as `(first_position, block_ids)`;
    `block_size` is the consumer's tokens per block, one int (for every
    group of `block_tables`) or `{group_id: block_size}`. Returns
    `{group_id: [RepairBlock, ...]}` in position order, each position once;
    a MATCH gives `{}`.

    Where the two sides' block sizes differ, a mismatch covers a run of
    their least common multiple, so every consumer block of that run is
    named. A state group's block is named with the tokens `[0, num_tokens)`
    whose state it holds (none for a request of no tokens).

    Raises kvcsum.InvalidArgument (a ValueError) where a plan would not make
    the load verified:
    - an UNVERIFIED report (it names no positions: the load must be
      repeated whole);
    - a report with findings, such as a MISMATCH in one group while
      another group's fingerprint differs: that group was not compared, and
      reloading blocks cannot make it comparable, so the plan would end in
      an unverified load; the message names each such group and reason,
      and the load must be repeated whole (or the configuration fixed).
      A list of Mismatch entries carries no findings: passing one skips
      this check (its entries of one group must not overlap);
    - a block size of a mismatching group other than the consumer's that
      the report was made with (the report knows it; a list of Mismatch
      entries does not, and is refused only where an entry's positions are
      not the blocks of its tokens under the size given, which also refuses
      a state group's entry whose tokens do not fit its block);
    - a mismatch that does not fit the tables: a group with no table, a
      position without a block id, a group without a block size.
    Block sizes and block ids must be integers (TypeError for a bool or a
    non-integer); ValueError for a block size below 1 or a block id outside
    [0, 2**32).
    """
    tables = {}
    for group, table in block_tables.items():
        group = _int(group, "uint32_t", "group id of block_tables")
        first_position, ids = table if isinstance(table, tuple) else (0, table)
        first_position = _int(first_position, "uint64_t", f"first position of block_tables[{group}]")
        ids = [_int(b, "uint32_t", f"block_tables[{group}][{i}]") for i, b in enumerate(ids)]
        tables[group] = (first_position, ids)
    if isinstance(block_size, dict):
        sizes = {_int(g, "uint32_t", "group id of block_size"): s for g, s in block_size.items()}
    else:
        sizes = dict.fromkeys(tables, block_size)
    sizes = {g: _int(s, "uint32_t", f"block_size of group {g}") for g, s in sizes.items()}
    group_ids = (c_uint32 * max(len(sizes), 1))(*sizes)
    block_sizes = (c_uint32 * max(len(sizes), 1))(*sizes.values())
    # Each entry is a distinct table position, so this many always suffice.
    cap = sum(len(ids) for _, ids in tables.values())
    entries = (_lib.RepairBlockStruct * max(cap, 1))()
    count = c_size_t()
    lib = library()
    # The tables are the report's request's: the library refuses a report
    # of another request than the one it is asked to plan.
    req_id = report.req_id if isinstance(report, Report) else "repair"
    with Blocks() as blocks:
        blocks.add_request(req_id, 0)
        for group, (first_position, ids) in tables.items():
            blocks.add_group(req_id, group, ids, first_position)
        with blocks._use() as blocks_handle:
            args = (blocks_handle, _c(req_id, "req_id"), group_ids, block_sizes, len(sizes), entries, cap, byref(count))
            if isinstance(report, Report):
                with report._use() as handle:
                    _check(lib.kvcs_report_repair_plan(handle, *args))
            else:
                mismatches = list(report)
                structs = (_lib.MismatchStruct * max(len(mismatches), 1))()
                for i, m in enumerate(mismatches):
                    structs[i] = _lib.MismatchStruct(
                        group_id=m.group_id,
                        first_position=m.first_position,
                        num_positions=m.num_positions,
                        first_token=m.first_token,
                        num_tokens=m.num_tokens,
                    )
                _check(lib.kvcs_repair_plan(structs, len(mismatches), *args))
    plan: dict[int, list[RepairBlock]] = {}
    for entry in entries[: count.value]:
        plan.setdefault(entry.group_id, []).append(
            RepairBlock(
                entry.group_id, entry.position, entry.block_id, entry.start_token, entry.end_token - entry.start_token
            )
        )
    return plan
