"""Which consumer block positions of a load no comparison can cover,
known before the load's data is read: SPEC section 10's run rule, from
block sizes, token counts and the positions each side holds alone.

The verifier applies the rule when it judges (kvcsum.Report.uncompared
names the positions); this reading of it lets the scheduler hand a sync
P/D load's uncompared blocks to vLLM as load errors in the step of the
load, before vLLM emits a token computed from them, where the verdict
itself comes a step later. A kvcsum 0.3 producer also sends each group's
last position over one token fewer, so a sync load of all of a prompt's
tokens but the last is compared whole. The verdict's own list stays the authority:
blocks it names that this did not are handed when it comes.
"""

from __future__ import annotations

import math

__all__ = ["uncompared_positions"]


def uncompared_positions(producer: tuple, consumer: tuple, short_last: bool = False) -> list[tuple[int, int]]:
    """The consumer's block positions holding valid tokens that no
    compared run covers, as ascending `(first position, positions)` ranges.

    Each side is `(block_size, num_tokens, first_position, num_positions)`:
    its blocks hold positions `first_position .. first_position +
    num_positions` of a request of `num_tokens` tokens. Positions are
    compared in runs of `L = lcm(producer block size, consumer block
    size)` tokens: run `q` (tokens `q*L .. (q+1)*L`) is compared when both
    sides' valid tokens in it, `min(L, max(0, num_tokens - q*L))`, are
    equal and not zero and each side holds every one of its blocks of the
    run that holds valid tokens. `short_last`: the producer sent the
    group's short last value (its last position over one token fewer,
    extension version 4), so a consumer of exactly one token fewer is
    compared against the producer's values over the consumer's token
    count. Work is linear in the consumer's positions, whatever the block
    sizes.
    """
    b_p, n_p, p_first, p_count = (int(v) for v in producer)
    b_c, n_c, c_first, c_count = (int(v) for v in consumer)
    if short_last and n_c + 1 == n_p:
        n_p = n_c
    if min(b_p, b_c) <= 0 or c_count <= 0:
        return []
    run = math.lcm(b_p, b_c)

    def valid(n: int, q: int) -> int:
        return max(0, min(run, n - q * run))

    def holds(block_size: int, n: int, first: int, count: int, q: int) -> bool:
        per_run = run // block_size
        lo = q * per_run
        hi = max(lo, min(lo + per_run, -(-n // block_size)))
        return hi == lo or (first <= lo and hi <= first + count)

    # The consumer's positions holding valid tokens.
    end = min(c_first + c_count, -(-n_c // b_c))
    out: list[list[int]] = []
    position = c_first
    while position < end:
        q = position * b_c // run
        run_end = min(end, (q + 1) * run // b_c)
        compared = (
            valid(n_c, q) != 0
            and valid(n_c, q) == valid(n_p, q)
            and holds(b_p, n_p, p_first, p_count, q)
            and holds(b_c, n_c, c_first, c_count, q)
        )
        if not compared:
            if out and out[-1][0] + out[-1][1] == position:
                out[-1][1] += run_end - position
            else:
                out.append([position, run_end - position])
        position = run_end
    return [(first, count) for first, count in out]
