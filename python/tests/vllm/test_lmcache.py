"""Loads from LMCache (0.5.6, its local CPU backend) through vLLM 0.33.0's
real LMCacheConnectorV1, bare and wrapped by KvcsumConnector, checked by
KvcsumConnector's workers against the values they kept of the blocks they
computed: in vLLM's real Scheduler and worker glue on the CPU (harness.py).

LMCache keeps one engine per process, so each case runs in a process of
its own (lmcache_case.py; lmcache_cpu.py says what stands in for a GPU).
LMCache's sync load: the request's load is inside the step that computes
the rest of the prompt, so a bad block is rewound in that step's output
(the token of that step never leaves).

Each case prints one line: the verdict and what vLLM did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import lmcache_cpu  # noqa: E402

BLOCK = lmcache_cpu.CHUNK
LOADED = 64  # LMCache loads the prompt's 4 full blocks; its last 6 tokens are computed
_RESULTS: dict = {}


def case(connector: str, transfer: str, flip: int | None = None) -> dict:
    """The result of one lmcache_case.py run (each run once per session)."""
    key = (connector, transfer, flip)
    if key not in _RESULTS:
        args = [sys.executable, os.path.join(HERE, "lmcache_case.py"), connector, transfer]
        if flip is not None:
            args.append(str(flip))
        env = dict(os.environ, **lmcache_cpu.environment())
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and len(lines) == 1, (
            f"{args[1:]} exited {done.returncode}\nstdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-8000:]}"
        )
        _RESULTS[key] = json.loads(lines[0][len("RESULT ") :])
    return _RESULTS[key]


def show(label: str, result: dict) -> None:
    verdict = result.get("verdict", "(bare, no verdict)")
    runs = [f"{s}..{s + n}" for s, n in result["scheduled"] if s < 70]
    print(
        f"\nCASE {label:<58} | {verdict:<18} | vLLM computed prompt tokens {', then '.join(runs)}; "
        f"load errors {result['load_errors']}; final KV {'as computed' if result['kv_intact'] else 'WRONG'}",
        flush=True,
    )


def first_steps(result: dict) -> dict:
    return {
        "first scheduled": result["steps"][0] - result["added_at"],
        "first token": result["token_steps"][0] - result["added_at"],
    }


def test_an_intact_lmcache_reload_matches_and_reuses_the_tokens_bare_lmcache_reuses():
    bare, wrapped = case("bare", "exact"), case("wrapped", "exact")
    show("LMCache local CPU, intact, bare LMCacheConnectorV1", bare)
    show("LMCache local CPU, intact, through KvcsumConnector", wrapped)
    assert bare["stored_chunks"] == wrapped["stored_chunks"] == 4
    assert bare["scheduled"][0][0] == wrapped["scheduled"][0][0] == LOADED  # tokens reused
    assert wrapped["verdict"] == "MATCH", wrapped
    assert wrapped["scheduled"] == bare["scheduled"]
    assert first_steps(wrapped) == first_steps(bare)
    for result in (bare, wrapped):
        assert result["tokens_expected"] and result["kv_intact"] and result["load_errors"] == []


def test_a_bit_flipped_in_a_stored_lmcache_chunk_recomputes_that_block_only():
    result = case("wrapped", "exact", flip=1)  # the chunk of tokens 16..32
    show("LMCache local CPU, a bit flipped in the stored chunk 1", result)
    bad_block = result["block_ids"][1]
    assert result["verdict"] == "MISMATCH", result
    assert f"blocks [{bad_block}]" in result["message"], result["message"]
    assert result["load_errors"] == [bad_block]
    # Loaded and computed in one step, then rewound to the bad block.
    assert [s for s, _ in result["scheduled"][:2]] == [LOADED, BLOCK], result["scheduled"]
    assert result["token_steps"][0] == result["steps"][1]  # the first step's token never left
    assert result["tokens_expected"] and result["kv_intact"]


def test_stock_lmcache_cpu_transfer_of_the_packed_kv_layout_is_caught_never_used():
    # LMCache 0.5.6's CPU copy reads vLLM 0.33.0's packed K+V cache as
    # [K/V, slots, heads*head_size]: it stores and loads the wrong bytes.
    bare = case("bare", "stock")
    show("stock LMCache CPU transfer, bare LMCacheConnectorV1", bare)
    assert bare["scheduled"][0][0] == LOADED and not bare["kv_intact"]  # used, wrong, no error
    assert bare["load_errors"] == []
    wrapped = case("wrapped", "stock")
    show("stock LMCache CPU transfer, through KvcsumConnector", wrapped)
    assert wrapped["verdict"] == "MISMATCH", wrapped
    loaded_blocks = set(wrapped["block_ids"][: LOADED // BLOCK])
    assert wrapped["load_errors"] and set(wrapped["load_errors"]) <= set(wrapped["block_ids"]), wrapped
    assert set(wrapped["load_errors"]) & loaded_blocks
    first_bad = min(wrapped["block_ids"].index(b) for b in wrapped["load_errors"])
    assert [s for s, _ in wrapped["scheduled"][:2]] == [LOADED, first_bad * BLOCK], wrapped["scheduled"]
    assert wrapped["token_steps"][0] == wrapped["steps"][1]  # the wrong KV's token never left
    assert wrapped["tokens_expected"] and wrapped["kv_intact"]
