"""One TP rank of an SGLang 0.5.23 prefill or decode instance on the CPU,
for test_pd.py: SGLang's real MHATokenToKVPool, ReqToTokenPool,
PagedTokenToKVPoolAllocator and MetadataBuffers, and Mooncake's real
bootstrap server, manager, sender and receiver over the TCP transport on
127.0.0.1. kvcsum's P/D check is turned on as an operator would: SGLang's
plugin loader finds kvcsum's entry point and KVCSUM_SGLANG_PD=1; SGLang's
own send_kv_chunk runs on a stand-in scheduler (the scheduler loop itself
does not run on the CPU), and the decode handshake is driven here as the
decode queues would.

    python pd_rank.py SPEC_JSON

SPEC (JSON): role (prefill | decode), tp_rank, tp_size, bootstrap_port,
dist_port (torch.distributed among this instance's ranks), seed,
requests [{room, tokens, flip: [layer, page position, local head, decode
rank] | null, payload_of: ROOM | "none" | null}], out (a JSON file for the
results), dir (where each request's K and V are saved as .npy).
"""

from __future__ import annotations

import json
import os
import sys
import time
import types

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sglang.srt.plugins import load_plugins  # noqa: E402

from kvcsum.sglang import pd  # noqa: E402
from kvcsum.sglang.pd import take_payload  # noqa: E402



PAGE, TOTAL_HEADS, HEAD_DIM, LAYERS = 4, 4, 8, 2
POOL_TOKENS, ROWS, CONTEXT = 256, 8, 128
MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_model")
WAIT_S = 30.0


def server_args(role: str, tp_size: int, bootstrap_port: int):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=MODEL_DIR, device="cpu", load_format="dummy", skip_tokenizer_init=True,
        disaggregation_mode=role, disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port, tp_size=tp_size, host="127.0.0.1",
    )


class Rank:
    def __init__(self, spec: dict):
        from sglang.srt.disaggregation.base import KVArgs
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode, MetadataBuffers, build_kv_layer_ids, get_kv_transfer_buf_infos, setup_state_kv_args,
        )
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            maybe_init_shared_mooncake_transfer_engine,
        )
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish

        self.spec = spec
        # As SGLang's run_scheduler_process does first: its plugin loader runs
        # kvcsum's entry point (KVCSUM_SGLANG_PD is set), which activates.
        load_plugins()
        self.activation = pd.active()
        if self.activation is None:
            raise RuntimeError("SGLang's load_plugins() did not activate kvcsum's P/D check (entry point not found?)")
        self.role, self.rank, self.tp = spec["role"], spec["tp_rank"], spec["tp_size"]
        self.args = server_args(self.role, self.tp, spec["bootstrap_port"])
        publish(self.args, role="scheduler", ranks=SpawnRanks(world_rank=self.rank, gpu_id=0))
        # Stand-in 1: no PP group on the CPU (SGLang builds it with the GPU groups).
        get_parallel().override_permanently(pp_group=None)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{spec['dist_port']}", rank=self.rank, world_size=self.tp
        )
        self.group = dist.new_group(list(range(self.tp)), backend="gloo")
        # Stand-in 2: what SGLang's distributed bootstrap calls on a GPU.
        maybe_init_shared_mooncake_transfer_engine(gpu_id=0)

        heads = TOTAL_HEADS // self.tp
        self.pool = MHATokenToKVPool(
            POOL_TOKENS, PAGE, torch.float16, heads, HEAD_DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1
        )
        self.allocator = PagedTokenToKVPoolAllocator(POOL_TOKENS, PAGE, torch.int64, "cpu", self.pool, False)
        self.req_to_token_pool = ReqToTokenPool(ROWS, CONTEXT, "cpu", False)
        self.metadata = MetadataBuffers(ROWS, hidden_size=16, hidden_states_dtype=torch.float16, max_sampling_mask_tokens=16)
        generator = torch.Generator().manual_seed(spec["seed"] * 100 + self.rank + (50 if self.role == "decode" else 0))
        for buffer in (*self.pool.k_buffer, *self.pool.v_buffer):
            buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, buffer.shape, generator=generator, dtype=torch.int16))

        kv_args = KVArgs()
        kv_args.engine_rank = self.rank
        kv_args.pp_rank = 0
        kv_args.system_dp_rank = 0
        kv_args.rust_http_port = None
        kv_args.kv_cache_dtype_str = "auto"
        kv_args.kv_layout = None
        kv_args.prefill_start_layer = 0
        kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(self.pool)
        kv_args.prefill_end_layer = LAYERS
        kv_args.num_draft_entries = 0
        kv_args.kv_layer_ids = build_kv_layer_ids(
            token_to_kv_pool=self.pool, draft_token_to_kv_pool=None, num_draft_entries=0, num_hidden_layers=LAYERS
        )
        kv_args.kv_head_num = heads
        kv_args.total_kv_head_num = TOTAL_HEADS
        kv_args.page_size = PAGE
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = self.metadata.get_buf_infos()
        kv_args.ib_device = None
        kv_args.gpu_id = 0
        setup_state_kv_args(kv_args, self.pool, None, LAYERS, req_to_token_pool=self.req_to_token_pool)
        self.kv_args = kv_args

        from sglang.srt.disaggregation.mooncake import MooncakeKVBootstrapServer, MooncakeKVManager

        self.bootstrap = None
        if self.role == "prefill" and self.rank == 0:
            self.bootstrap = MooncakeKVBootstrapServer(host="127.0.0.1", port=spec["bootstrap_port"])
        mode = DisaggregationMode.PREFILL if self.role == "prefill" else DisaggregationMode.DECODE
        self.manager = MooncakeKVManager(kv_args, mode, self.args, False)
        self.bootstrap_addr = f"127.0.0.1:{spec['bootstrap_port']}"

    # --- helpers -------------------------------------------------------------

    def place(self, tokens: int) -> tuple[int, torch.Tensor]:
        """A request row with its pages (the allocator's real pages)."""
        row = int(self.req_to_token_pool.alloc_rows(1)[0])
        indices = self.allocator.alloc(-(-tokens // PAGE) * PAGE)
        self.req_to_token_pool.req_to_token[row, : len(indices)] = indices.to(self.req_to_token_pool.req_to_token.dtype)
        return row, indices[:tokens]

    def dump(self, room: int, indices: torch.Tensor) -> None:
        """The request's K and V as this rank holds them, [layer, token, head,
        dim] int16, for the test's reference comparison."""
        import numpy as np

        for name, buffers in (("k", self.pool.k_buffer), ("v", self.pool.v_buffer)):
            data = torch.stack([b[indices].view(torch.int16) for b in buffers]).numpy()
            np.save(os.path.join(self.spec["dir"], f"{self.role}{self.rank}-{room}-{name}.npy"), data)

    def wait(self, poller, wanted, what: str):
        from sglang.srt.disaggregation.base import KVPoll

        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            state = poller.poll()
            if state in wanted:
                return state
            if state == KVPoll.Failed:
                raise RuntimeError(f"{what}: failed: {self.manager.failure_records.get(poller.bootstrap_room)}")
            time.sleep(0.01)
        raise TimeoutError(f"{what}: still {poller.poll()} after {WAIT_S} s")


def _prefill_scheduler(rank: Rank):
    """A stand-in scheduler: SGLang's own prefill mixin (send_kv_chunk,
    _send_kv_chunk) over this rank's real pools, metadata buffers and
    manager, with the attributes those methods read."""
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    class Scheduler(SchedulerDisaggregationPrefillMixin):
        pass

    s = Scheduler()
    s.token_to_kv_pool_allocator = rank.allocator
    s.req_to_token_pool = rank.req_to_token_pool
    s.disagg_metadata_buffers = rank.metadata
    s.disagg_prefill_bootstrap_queue = types.SimpleNamespace(kv_manager=rank.manager, kv_checksum_signature=0)
    s.kv_checksum_computer = None
    s.enable_staging = False
    s.disagg_prefill_pending_chunk_rids = set()
    s.attn_tp_cpu_group = rank.group
    s.tp_worker = types.SimpleNamespace(get_attention_tp_cpu_group=lambda: rank.group)
    return s


def _req(room: int, tokens: list, row: int, aux: int, sender=None):
    """The fields of SGLang's Req that the P/D send and check read."""
    return types.SimpleNamespace(
        rid=f"req-{room}", bootstrap_room=room, origin_input_ids=list(tokens), extend_end=len(tokens),
        start_send_idx=0, disagg_decode_prefix_len=0, kv=types.SimpleNamespace(req_pool_idx=row, cache_protected_len=0),
        metadata_buffer_index=aux, output_ids=[7], cached_tokens=0, cached_tokens_device=0, cached_tokens_host=0,
        cached_tokens_storage=0, get_mm_token_counts=lambda: (0, 0, 0), return_logprob=False,
        return_sampling_mask=False, hidden_states_tensor=None, disagg_kv_sender=sender,
    )


def run_prefill(rank: Rank) -> dict:
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.mooncake import MooncakeKVSender

    scheduler = _prefill_scheduler(rank)
    out = {}
    for aux, r in enumerate(rank.spec["requests"]):
        room, tokens = r["room"], r["tokens"]
        sender = MooncakeKVSender(rank.manager, rank.bootstrap_addr, room)
        # Stand-in 3: the host-index path copies into pinned memory and records
        # a CUDA event; the other path (kv_to_page_indices) is SGLang's as well.
        sender.supports_host_tensor_indices = False
        rank.wait(sender, {KVPoll.WaitingForInput}, f"prefill room {room} handshake")
        row, indices = rank.place(len(tokens))
        sender.init(-(-len(tokens) // PAGE), aux)
        req = _req(room, tokens, row, aux, sender)
        scheduler.send_kv_chunk(req, last_chunk=True)
        state = rank.wait(sender, {KVPoll.Success, KVPoll.Failed}, f"prefill room {room} send")
        pages = [int(p) for p in (indices[::PAGE] // PAGE)]
        out[str(room)] = {"state": state.name if hasattr(state, "name") else str(state), "pages": pages}
        rank.dump(room, indices)
    return out


def _decode_scheduler(rank: Rank):
    """A stand-in scheduler: SGLang's own decode mixin (_verify_kv_checksums,
    _handle_kv_checksum_mismatch) over this rank's real pools and manager.
    Its output streamer and tree cache stand in (they record; the request's
    KV row is released by the test)."""
    from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin

    class Scheduler(SchedulerDisaggregationDecodeMixin):
        pass

    s = Scheduler()
    s.kv_checksum_computer = None  # SGLang's own GPU digest is off (it needs CUDA)
    s.token_to_kv_pool_allocator = rank.allocator
    s.req_to_token_pool = rank.req_to_token_pool
    s.attn_tp_cpu_group = rank.group
    s.disagg_decode_prealloc_queue = types.SimpleNamespace(kv_manager=rank.manager)
    s.streamed = []
    s.output_streamer = types.SimpleNamespace(stream_output=lambda reqs, logprob: s.streamed.extend(r.rid for r in reqs))
    s.tree_cache = types.SimpleNamespace(supports_mamba=lambda: True)
    s.metrics_reporter = types.SimpleNamespace(enable_metrics=False)
    return s


class _Batch:
    """The two things _verify_kv_checksums uses of a ScheduleBatch."""

    def __init__(self, reqs):
        self.reqs = list(reqs)

    def filter_batch(self, keep_indices):
        self.reqs = [self.reqs[i] for i in keep_indices]


def run_decode(rank: Rank) -> dict:
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.mooncake import MooncakeKVReceiver

    scheduler = _decode_scheduler(rank)
    deadline = time.monotonic() + WAIT_S
    while not rank.manager.try_ensure_parallel_info(rank.bootstrap_addr):
        if time.monotonic() > deadline:
            raise TimeoutError("decode: the prefill's parallel info never came")
        time.sleep(0.1)
    out, reqs, payloads = {}, {}, {}
    for aux, r in enumerate(rank.spec["requests"]):
        room, tokens = r["room"], r["tokens"]
        receiver = MooncakeKVReceiver(rank.manager, rank.bootstrap_addr, room)
        receiver.init(0)
        row, indices = rank.place(len(tokens))
        pages = (indices[::PAGE] // PAGE).numpy().astype("int32")
        rank.metadata.clear_slot(aux)
        receiver.send_metadata(pages, aux)
        state = rank.wait(receiver, {KVPoll.Success, KVPoll.Failed}, f"decode room {room} receive")
        req = _req(room, tokens, row, aux)
        req.kv.holds_kv, req.kv.is_kv_released, req.kv.holds_mamba, req.finished_reason = False, True, False, None
        take_payload(rank.metadata, types.SimpleNamespace(req=req, metadata_buffer_index=aux))
        payloads[room] = req._kvcsum_pd_payload
        reqs[room] = req
        out[str(room)] = {"state": state.name if hasattr(state, "name") else str(state), "pages": [int(p) for p in pages]}
        flip = r.get("flip")
        if flip and flip[3] == rank.rank:  # [layer, page position, local head, rank]
            layer, position, head = flip[:3]
            token = int(pages[position]) * PAGE
            rank.pool.k_buffer[layer][token, head, 0:1].view(torch.int16).bitwise_xor_(1)
        rank.dump(room, indices)
    for r in rank.spec["requests"]:
        if r.get("payload_of") == "none":  # the row as an engine without kvcsum leaves it
            reqs[r["room"]]._kvcsum_pd_payload = pd.ArrivedPayload(None, "no kvcsum payload arrived (test)")
        elif r.get("payload_of") is not None:  # another request's payload in this one's row
            reqs[r["room"]]._kvcsum_pd_payload = payloads[r["payload_of"]]
    batch = _Batch(reqs[r["room"]] for r in rank.spec["requests"])
    scheduler._verify_kv_checksums(batch)
    kept = {req.bootstrap_room for req in batch.reqs}
    for room, req in reqs.items():
        verdict = rank.activation.verdicts.get(req.rid)
        out[str(room)].update(
            verdict=verdict.verdict if verdict else None,
            bad_pages=list(verdict.bad_pages) if verdict else None,
            bad_positions=list(verdict.bad_positions) if verdict else None,
            message=verdict.message if verdict else None,
            kept=room in kept,
            aborted=str(getattr(req.finished_reason, "message", "") or "") if req.finished_reason else None,
            streamed=req.rid in scheduler.streamed,
        )
    return out


def main() -> int:
    spec = json.loads(sys.argv[1])
    rank = Rank(spec)
    results = run_prefill(rank) if spec["role"] == "prefill" else run_decode(rank)
    dist.barrier(group=rank.group)
    with open(spec["out"], "w") as f:
        json.dump(results, f)
    time.sleep(1.0)  # let the peers finish their last polls
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
