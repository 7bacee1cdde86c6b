"""One LMCache case of test_lmcache.py, in a process of its own (LMCache
keeps one engine per process, with threads that outlive it): an engine
(harness.Engine, vLLM 0.33.0's real Scheduler and worker glue on the CPU)
whose connector is vLLM's real LMCacheConnectorV1 over LMCache's local CPU
backend, bare or wrapped by KvcsumConnector. A request computes the prompt
(LMCache stores its 4 full blocks, one 16-token chunk each), then a second
request with the same prompt loads them from LMCache.

    python lmcache_case.py {bare,wrapped} {exact,stock} [CHUNK_TO_FLIP]

exact: LMCache's copy between vLLM's cache and its chunks done right (the
test's, lmcache_cpu.py); stock: LMCache 0.5.6's own CPU copy. CHUNK_TO_FLIP:
the stored chunk (0..3) with one bit flipped before the reload. Prints one
line, "RESULT " and a JSON object, then leaves (os._exit: LMCache's threads
would keep the process alive).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import lmcache_cpu  # noqa: E402

lmcache_cpu.setup_environment()


def main() -> None:
    wrap, transfer = sys.argv[1] == "wrapped", sys.argv[2]
    flip = int(sys.argv[3]) if len(sys.argv) > 3 else None
    lmcache_cpu.install(transfer)

    import kvcsum
    from harness import Engine, KVCacheLayout, sampled_token

    block = lmcache_cpu.CHUNK
    prompt = [7 + (i * 13) % 600 for i in range(70)]
    inner = {"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {}}
    e = Engine(
        "lmcache", role="kv_both", tp=1, block_size=block, layout=KVCacheLayout.LBNHC, store_dir="",
        inner=inner, wrap=wrap, record_layout=True, attn_metadata={},
    )

    def run(req_id):
        e.add_request(req_id, prompt, 3)
        e.run()
        return e.traces[req_id]

    run("req-compute")
    stored = len(lmcache_cpu.stored_chunks())
    if flip is not None:
        lmcache_cpu.corrupt(flip)
    trace = run("req-load")
    import torch

    positions = torch.arange(len(prompt))
    state = e.ranks[0]
    ids = torch.tensor(state.tables["req-load"][0])
    intact = True
    for name in e.kv_cache_config.kv_cache_groups[0].layer_names:
        layer = int(name.split(".")[2])
        got = state.caches[name][ids[positions // block], :, positions % block]
        want = e.kv_values("req-load", positions, layer, 0, 4)
        intact = intact and torch.equal(got.view(torch.int16), want.view(torch.int16))
    result = {
        "stored_chunks": stored,
        "scheduled": trace.scheduled,
        "steps": trace.steps,
        "token_steps": trace.token_steps,
        "added_at": trace.added_at,
        "tokens_expected": trace.output_tokens == [sampled_token(len(prompt) - 1 + i) for i in range(3)],
        "kv_intact": intact,
        "block_ids": state.tables["req-load"][0],
        "load_errors": sorted(b for s in e.load_errors.values() for b in s),
        "copies": lmcache_cpu.STATE.copies,
    }
    if wrap:
        name, reason, message = e.connector().last_verdicts["req-load"]
        result["verdict"] = {kvcsum.MATCH: "MATCH", kvcsum.MISMATCH: "MISMATCH", kvcsum.UNVERIFIED: "UNVERIFIED"}[name]
        result["reason"], result["message"] = reason, message
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    code = 0
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
