"""kvcsum's P/D check (kvcsum.sglang.activate_pd) in SGLang 0.5.23 on the CPU
(make sglang-test): a prefill and a decode instance, one process per TP
rank (pd_rank.py), moving MHATokenToKVPool pages with SGLang's real
Mooncake bootstrap server, manager, sender and receiver over Mooncake's TCP
transport on 127.0.0.1, at prefill TP 1 to decode TP 2 (SGLang's head-slice
path) and TP 2 to 1. Four requests a run:

- intact: MATCH on every decode rank, kept in the batch;
- one element flipped in one decode rank's pool after the transfer: MISMATCH
  on every rank naming exactly that page, handed to SGLang's own failure
  path (FINISH_ABORT "KV checksum mismatch", streamed out, dropped from the
  batch);
- another request's payload in its row: never MATCH (and not used);
- no payload (the row an engine without kvcsum leaves): UNVERIFIED, admitted.

The reference: each rank saves the request's K and V as it holds them; the
test joins the ranks' heads and compares prefill with decode element by
element (which positions differ), independently of kvcsum.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = 4  # pd_rank.PAGE
TIMEOUT_S = 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def requests(rng: np.random.Generator, flip_rank: int, flip_head: int) -> list:
    lengths = [14, 17, 13, 9]
    tokens = [rng.integers(1, 1000, n).tolist() for n in lengths]
    flip_position = int(rng.integers(0, -(-lengths[1] // PAGE)))
    return [
        {"room": 7001, "tokens": tokens[0], "flip": None, "payload_of": None},
        {"room": 7002, "tokens": tokens[1], "flip": [int(rng.integers(0, 2)), flip_position, flip_head, flip_rank],
         "payload_of": None},
        {"room": 7003, "tokens": tokens[2], "flip": None, "payload_of": 7001},
        {"room": 7004, "tokens": tokens[3], "flip": None, "payload_of": "none"},
    ]


def run_instances(tmp_path, site: str, prefill_tp: int, decode_tp: int, seed: int, reqs: list) -> dict:
    bootstrap = free_port()
    env = dict(os.environ, PYTHONWARNINGS="ignore", GLOG_minloglevel="2", SGLANG_LOG_LEVEL="error", KVCSUM_SGLANG_PD="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    procs = []
    for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        dist_port = free_port()
        for rank in range(tp):
            spec = dict(
                role=role, tp_rank=rank, tp_size=tp, bootstrap_port=bootstrap, dist_port=dist_port, seed=seed,
                requests=reqs, out=str(tmp_path / f"{role}{rank}.json"), dir=str(tmp_path),
            )
            log = open(tmp_path / f"{role}{rank}.log", "w")
            procs.append((f"{role}{rank}", subprocess.Popen(
                [sys.executable, os.path.join(HERE, "pd_rank.py"), json.dumps(spec)], env=env, stdout=log,
                stderr=subprocess.STDOUT,
            )))
    deadline = time.monotonic() + TIMEOUT_S
    failed = []
    for name, proc in procs:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        if rc != 0:
            failed.append(name)
    if failed:
        for name, proc in procs:
            if proc.poll() is None:
                proc.kill()
        tails = {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in failed}
        pytest.fail(f"seed {seed}: rank processes {failed} failed:\n" + "\n".join(f"--- {n}\n{t}" for n, t in tails.items()))
    return {name: json.loads((tmp_path / f"{name}.json").read_text()) for name, _ in procs}


def joined(tmp_path, role: str, tp: int, room: int, kv: str) -> np.ndarray:
    """[layer, token, head, dim] over all of an instance's heads (rank order)."""
    return np.concatenate([np.load(tmp_path / f"{role}{r}-{room}-{kv}.npy") for r in range(tp)], axis=2)


def differing_positions(a: np.ndarray, b: np.ndarray) -> list:
    """Page positions where any element differs, by a loop over logical indices."""
    layers, tokens, heads, dims = a.shape
    out = set()
    for layer in range(layers):
        for token in range(tokens):
            for head in range(heads):
                for dim in range(dims):
                    if a[layer, token, head, dim] != b[layer, token, head, dim]:
                        out.add(token // PAGE)
    return sorted(out)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)])
def test_pd_transfer_across_tp_sizes_is_judged_and_a_bad_page_goes_to_sglangs_failure_path(
    tmp_path, plugin_site, prefill_tp, decode_tp
):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    flip_rank = decode_tp - 1
    reqs = requests(rng, flip_rank=flip_rank, flip_head=int(rng.integers(0, 4 // decode_tp)))
    started = time.monotonic()
    results = run_instances(tmp_path, plugin_site, prefill_tp, decode_tp, seed, reqs)
    print(f"\nP/D prefill TP {prefill_tp} -> decode TP {decode_tp}: {time.monotonic() - started:.1f} s (seed {seed})")
    where = f"seed {seed}, prefill TP {prefill_tp} -> decode TP {decode_tp}"
    for r in reqs:
        room = r["room"]
        for name in [f"prefill{i}" for i in range(prefill_tp)] + [f"decode{i}" for i in range(decode_tp)]:
            assert results[name][str(room)]["state"] in ("Success", "4"), f"{where}: {name} room {room}: {results[name][str(room)]}"
        diff = sorted(
            set(differing_positions(joined(tmp_path, "prefill", prefill_tp, room, "k"), joined(tmp_path, "decode", decode_tp, room, "k")))
            | set(differing_positions(joined(tmp_path, "prefill", prefill_tp, room, "v"), joined(tmp_path, "decode", decode_tp, room, "v")))
        )
        wanted_diff = [r["flip"][1]] if r["flip"] else []
        assert diff == wanted_diff, f"{where}: room {room}: the reference finds positions {diff} differing"
        for rank in range(decode_tp):
            got = results[f"decode{rank}"][str(room)]
            pages = got["pages"]
            print(f"  room {room} decode rank {rank}: {got['verdict']} bad pages {got['bad_pages']} kept {got['kept']}")
            if room == 7001:
                assert got["verdict"] == "MATCH" and got["kept"] and got["aborted"] is None, f"{where}: {got}"
            elif room == 7002:
                position = r["flip"][1]
                assert got["verdict"] == "MISMATCH", f"{where}: {got}"
                assert got["bad_positions"] == [position] and got["bad_pages"] == [pages[position]], f"{where}: {got}"
                assert f"page positions [{position}]" in got["message"], f"{where}: {got['message']}"
                assert got["aborted"] == "KV checksum mismatch" and got["streamed"] and not got["kept"], f"{where}: {got}"
            elif room == 7003:
                assert got["verdict"] != "MATCH" and not got["kept"], f"{where}: another request's payload: {got}"
            else:
                assert got["verdict"] == "UNVERIFIED" and got["kept"] and got["aborted"] is None, f"{where}: {got}"
