"""Two vLLM engines in one process, on the CPU: each with vLLM's real
Scheduler and, per TP rank, a worker connector driven through vLLM's worker
glue (KVConnectorModelRunnerMixin), over KV caches vLLM itself lays out
(allocate_kv_cache) in CPU memory. The model is a stand-in: a tiny Llama
config.json (no weights, no tokenizer) and a "forward" that writes, for each
scheduled token, KV that depends only on the token, its position, the layer
and the global head, so a recomputed token gets the same KV again.

The ranks of an engine run one after another, so a collective across them
(vLLM's TP group, over which the workers of a real engine gather their
records of a sync load: kvcsum.vllm.record_exchange) cannot work here:
each engine's workers share an `InProcessRecordExchange` instead, whose
judging worker is the last rank to call it in the step (the last TP rank).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import sys
import tempfile
from dataclasses import dataclass, field

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

# Every connector vLLM builds says that its API is experimental: once is enough.
import logging  # noqa: E402

logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.base").addFilter(
    lambda record: "Initializing KVConnectorBase_V1" not in record.getMessage()
)

NUM_LAYERS = 4
TOTAL_KV_HEADS = 4
HEAD_SIZE = 16
DTYPE = torch.float16
EOS = 2

_hash_ready = False


def model_dir(kv_heads: int = TOTAL_KV_HEADS) -> str:
    """A model directory holding only a tiny Llama config.json."""
    suffix = "" if kv_heads == TOTAL_KV_HEADS else f"-kv{kv_heads}"
    path = os.path.join(tempfile.gettempdir(), f"kvcsum-vllm-tiny-llama-{os.getpid()}{suffix}")
    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": kv_heads,
        "head_dim": HEAD_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": EOS,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def sampled_token(position: int) -> int:
    """The stand-in model's next token after `position` tokens."""
    return 100 + (position * 37) % 800


@contextlib.contextmanager
def place(tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1, dcp_size: int = 1):
    """vLLM's parallel state as one TP rank of one PP stage sees it (one
    process plays all); with DCP, the rank's DCP group is consecutive TP
    ranks (vLLM's parallel_state: dcp_rank = tp_rank % dcp)."""

    class _PP:
        rank_in_group = pp_rank
        world_size = pp_size

    class _DCP:
        rank_in_group = tp_rank % dcp_size
        world_size = dcp_size

    saved = (
        parallel_state.get_tensor_model_parallel_rank,
        parallel_state.get_tensor_model_parallel_world_size,
        parallel_state.get_pp_group,
        parallel_state.get_dcp_group,
    )
    parallel_state.get_tensor_model_parallel_rank = lambda: tp_rank
    parallel_state.get_tensor_model_parallel_world_size = lambda: tp_size
    parallel_state.get_pp_group = lambda: _PP()
    if dcp_size > 1:
        parallel_state.get_dcp_group = lambda: _DCP()
    try:
        yield
    finally:
        (
            parallel_state.get_tensor_model_parallel_rank,
            parallel_state.get_tensor_model_parallel_world_size,
            parallel_state.get_pp_group,
            parallel_state.get_dcp_group,
        ) = saved


class InProcessRecordExchange:
    """The harness's RecordExchange (kvcsum.vllm.record_exchange): the
    ranks call it one after another in the step; each rank's records wait
    here, and the last of the engine's `num_workers` ranks to call gets
    everyone's (so it is the judging worker), the others None."""

    def __init__(self, num_workers: int):
        self._num_workers = num_workers
        self._held: list = []
        self.judges: list = []  # the worker that judged, per gather
        self.bounds: list = []  # (packed bytes, bound) per gather

    def gather(self, worker_key: str, records: list, bound: int | None = None):
        from kvcsum.vllm.record_exchange import WorkerRecords, pack_records, unpack_records

        if bound is not None:
            # As TorchRecordExchange does: packed into the bound (none when
            # they do not fit), then unpacked.
            message = pack_records(worker_key, records)
            self.bounds.append((len(message), bound))
            held = unpack_records(message) if len(message) <= bound else WorkerRecords(worker_key, ())
        else:
            held = WorkerRecords(worker_key, tuple(records))
        self._held.append(held)
        if len(self._held) < self._num_workers:
            return None
        gathered, self._held = self._held, []
        self.judges.append(worker_key)
        return gathered


@dataclass
class RankState:
    connector: object
    caches: dict
    tables: dict = field(default_factory=dict)  # req_id -> {group: [block ids]}
    tp_rank: int = 0
    pp_rank: int = 0
    #: This worker's KV cache config (with several PP stages: its stage's layers).
    kv_cache_config: object = None


@dataclass
class Trace:
    """What vLLM did with one request on one engine."""

    scheduled: list = field(default_factory=list)  # (first position, count) per step
    steps: list = field(default_factory=list)  # the engine step of each entry of `scheduled`
    added_at: int = 0  # the engine steps run before the request was added
    finished: str | None = None
    kv_transfer_params: dict | None = None
    params_step: int | None = None  # the engine step whose output carried kv_transfer_params
    output_tokens: list = field(default_factory=list)
    token_steps: list = field(default_factory=list)  # the engine step of each output token
    #: With Engine(track_kv=True): the engine steps whose forward read KV of
    #: the request that differs from what the stand-in model computes.
    bad_kv_steps: list = field(default_factory=list)

    def first_scheduled(self) -> int | None:
        """Engine steps from the request's arrival to the one that first
        computed it (1: the first step after it arrived)."""
        return self.steps[0] - self.added_at if self.steps else None


class Engine:
    """One engine: a real Scheduler and one worker connector per TP rank."""

    def __init__(
        self,
        name: str,
        *,
        role: str,
        tp: int,
        block_size: int,
        layout: KVCacheLayout,
        store_dir: str,
        extra: dict | None = None,
        policy: str = "recompute",
        sliding_window: int | None = None,
        num_blocks: int = 64,
        max_batched_tokens: int = 512,
        wrap: bool = True,
        load_mode: str = "async",
        max_num_seqs: int = 8,
        inner: dict | None = None,
        track_kv: bool = False,
        record_exchange: bool = True,
        wire: bool = False,
        defer_finalize: bool = False,
        record_layout: bool = False,
        attn_metadata: object = None,
        pp: int = 1,
        dcp: int = 1,
        kv_heads: int = TOTAL_KV_HEADS,
        interleave: int = 1,
        cache: dict | None = None,
    ):
        """record_exchange: the ranks share an InProcessRecordExchange (off:
        they have none, as the workers of an engine with several PP stages).
        wire: each rank binds a pickled copy of the step's metadata and sends
        a pickled copy of its worker metadata, as vLLM's executors move them
        between processes. defer_finalize: vLLM's worker glue calls
        wait_for_save after it collected the step's connector output, as it
        does with speculative decoding. record_layout: the layout is recorded
        on the cache config as vLLM's engine core records the one it resolved
        (an inner connector that reads it, as LMCache does, needs it).
        attn_metadata: the forward context's attention metadata in each step
        (None, the default, as in a step with no attention; LMCache loads
        nothing in such a step). pp: PP stages, each with `tp` workers whose
        KV cache config holds only the stage's layers (as vLLM gives each
        stage's worker), layers split in consecutive runs. dcp: vLLM's
        decode context parallel size (the scheduler's blocks cover
        block_size x dcp tokens, `interleave` of them at a time on each DCP
        rank); kv_heads: the model's KV heads (DCP needs TP >= dcp x KV
        heads). cache: more CacheConfig fields (mamba_cache_mode "align"
        with enable_prefix_caching, as vLLM sets them for Mamba prefix
        caching)."""
        global _hash_ready
        if not _hash_ready:
            init_none_hash(sha256)
            _hash_ready = True
        self.name, self.tp, self.block_size, self.pp = name, tp, block_size, pp
        self.dcp, self.interleave = dcp, interleave
        if inner is None:
            inner = {
                "kv_connector": "StoreConnector",
                "kv_connector_module_path": "store_connector",
                "kv_connector_extra_config": {"store_dir": store_dir, "load_mode": load_mode},
            }
        if wrap:
            ktc = KVTransferConfig(
                kv_connector="KvcsumConnector",
                kv_connector_module_path="kvcsum.vllm",
                kv_role=role,
                kv_load_failure_policy=policy,
                kv_connector_extra_config={"inner": inner, **(extra or {})},
            )
        else:
            ktc = KVTransferConfig(kv_role=role, kv_load_failure_policy=policy, **inner)
        model_config = ModelConfig(model=model_dir(kv_heads), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=2048)
        self.vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(**dict(dict(block_size=block_size, enable_prefix_caching=False), **(cache or {}))),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_batched_tokens,
                max_model_len=2048,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
                disable_hybrid_kv_cache_manager=True if sliding_window is None else None,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=tp, pipeline_parallel_size=pp, decode_context_parallel_size=dcp,
                cp_kv_cache_interleave_size=interleave,
            ),
            kv_transfer_config=ktc,
            device_config=DeviceConfig("cpu"),
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        if record_layout:
            self.vllm_config.cache_config.kv_cache_layout = layout.name
        self.kv_cache_config = self._kv_cache_config(num_blocks, sliding_window)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size * dcp,  # the scheduler's block (resolve_kv_cache_block_sizes)
            log_stats=True,
        )
        self.ranks: list[RankState] = []
        for stage in range(pp):
            stage_config = self.stage_config(stage)
            for rank in range(tp):
                with place(rank, tp, stage, pp, dcp):
                    connector = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER, stage_config)
                    caches = allocate_kv_cache(stage_config, torch.device("cpu"), layout)
                    connector.register_kv_caches(caches)
                self.ranks.append(RankState(connector, caches, tp_rank=rank, pp_rank=stage, kv_cache_config=stage_config))
        self.exchange = None
        if wrap and record_exchange and tp > 1:
            self.exchange = InProcessRecordExchange(tp)
            for state in self.ranks:
                state.connector.worker_role.use_record_exchange(self.exchange)
        self.wire, self.defer_finalize = wire, defer_finalize
        #: {engine step: the block ids vLLM got as load errors in its output}.
        self.load_errors: dict = {}
        self.aggregator = KVOutputAggregator(tp * pp)
        self.traces: dict[str, Trace] = {}
        self.steps_run = 0
        # Nonzero: the stand-in model's KV differs in its last bits, as a
        # kernel that is not batch-invariant computes it in another batch.
        self.kv_noise = 0
        self.prompts: dict[str, list] = {}
        self.requests: dict[str, Request] = {}
        self.stats: list = []
        self.track_kv = track_kv
        self.attn_metadata = attn_metadata

    def stage_layers(self, stage: int) -> set:
        """The layer names of PP stage `stage` (consecutive runs of layers)."""
        names = sorted({n for g in self.kv_cache_config.kv_cache_groups for n in g.layer_names}, key=lambda n: int(n.split(".")[2]))
        per = -(-len(names) // self.pp)
        return set(names[stage * per : (stage + 1) * per])

    def stage_config(self, stage: int) -> KVCacheConfig:
        """The KV cache config of a worker of PP stage `stage`: its layers only."""
        if self.pp == 1:
            return self.kv_cache_config
        own = self.stage_layers(stage)
        groups = [
            KVCacheGroupSpec([n for n in g.layer_names if n in own], g.kv_cache_spec) for g in self.kv_cache_config.kv_cache_groups
        ]
        tensors = [t for t in self.kv_cache_config.kv_cache_tensors if t.layers[0] in own]
        return KVCacheConfig(num_blocks=self.kv_cache_config.num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)

    def _kv_cache_config(self, num_blocks: int, sliding_window: int | None) -> KVCacheConfig:
        heads = TOTAL_KV_HEADS // self.tp
        full = FullAttentionSpec(block_size=self.block_size, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=DTYPE)
        if sliding_window is None:
            groups = [KVCacheGroupSpec([layer_name(i) for i in range(NUM_LAYERS)], full)]
        else:
            swa = SlidingWindowSpec(
                block_size=self.block_size, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=DTYPE, sliding_window=sliding_window
            )
            groups = [
                KVCacheGroupSpec([layer_name(i) for i in range(0, NUM_LAYERS, 2)], full),
                KVCacheGroupSpec([layer_name(i) for i in range(1, NUM_LAYERS, 2)], swa),
            ]
        page = full.page_size_bytes
        # Layer-outermost: each layer's blocks in a region of their own; the
        # groups of a hybrid model overlay each other, as vLLM lays them out.
        per_group = max(len(g.layer_names) for g in groups)
        size = page * num_blocks * per_group
        tensors = []
        for group in groups:
            for slot, name in enumerate(group.layer_names):
                tensors.append(
                    KVCacheTensor(size=size, layers=[name], layer_stride=page * num_blocks, block_stride=page, offset=slot * page * num_blocks)
                )
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)

    # --- requests ---------------------------------------------------------------

    def add_request(self, req_id: str, prompt: list, max_tokens: int, kv_transfer_params: dict | None = None) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.block_size * self.dcp, sha256),
        )
        request.kv_transfer_params = kv_transfer_params
        self.prompts[req_id] = list(prompt)
        self.requests[req_id] = request
        self.traces[req_id] = Trace(added_at=self.steps_run)
        self.scheduler.add_request(request)
        return request

    # --- the stand-in model -------------------------------------------------------

    def token_at(self, req_id: str, position: int) -> int:
        prompt = self.prompts[req_id]
        return prompt[position] if position < len(prompt) else sampled_token(position - 1)

    def kv_values(self, req_id: str, positions: torch.Tensor, layer: int, first_head: int, heads: int) -> torch.Tensor:
        """[tokens, heads, K+V] KV of the given positions: a function of the
        token, its position, the layer and the global head."""
        tokens = torch.tensor([self.token_at(req_id, int(p)) for p in positions], dtype=torch.int64)
        head = torch.arange(first_head, first_head + heads, dtype=torch.int64).view(1, heads, 1)
        element = torch.arange(2 * HEAD_SIZE, dtype=torch.int64).view(1, 1, -1)
        value = (tokens.view(-1, 1, 1) * 131 + positions.view(-1, 1, 1) * 7 + layer * 1009 + head * 97 + element * 13) % 2039
        return (value.to(torch.float32) / 64.0 - 16.0).to(DTYPE)

    def _forward(self, rank: int, state: RankState, out) -> None:
        """Writes the KV of this step's scheduled tokens into the rank's caches."""
        heads = TOTAL_KV_HEADS // self.tp
        first_head = rank * heads
        for req_id, (start, count) in self._step_tokens.items():
            table = state.tables[req_id]
            positions = torch.arange(start, start + count)
            for group_id, group in enumerate((state.kv_cache_config or self.kv_cache_config).kv_cache_groups):
                ids = torch.tensor(table[group_id])
                blocks = ids[positions // self.block_size]
                offsets = positions % self.block_size
                for name in group.layer_names:
                    layer = int(name.split(".")[2])
                    values = self.kv_values(req_id, positions, layer, first_head, heads)
                    if self.kv_noise:
                        raw = values.view(torch.int16)
                        pattern = (torch.arange(raw.numel()).view(raw.shape) + self.kv_noise) % 5 == 0
                        values = (raw ^ pattern.to(torch.int16)).view(DTYPE)
                    state.caches[name][blocks, :, offsets] = values

    def _kv_as_computed(self, rank: int, state: RankState, req_id: str, num_tokens: int) -> bool:
        """Whether the rank's KV of the request's first `num_tokens` tokens
        (what this step's forward attends to) is what the model computes."""
        heads = TOTAL_KV_HEADS // self.tp
        table = state.tables[req_id]
        positions = torch.arange(num_tokens)
        for group_id, group in enumerate((state.kv_cache_config or self.kv_cache_config).kv_cache_groups):
            ids = torch.tensor(table[group_id])
            for name in group.layer_names:
                layer = int(name.split(".")[2])
                got = state.caches[name][ids[positions // self.block_size], :, positions % self.block_size]
                want = self.kv_values(req_id, positions, layer, rank * heads, heads)
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    return False
        return True

    def _update_tables(self, state: RankState, sched) -> None:
        for new in sched.scheduled_new_reqs:
            state.tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = sched.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.tables[req_id] = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for group_id, ids in enumerate(new_ids):
                    state.tables[req_id][group_id].extend(ids)

    def step(self) -> dict:
        """One engine step: schedule, every rank through vLLM's worker glue,
        aggregate, update the scheduler. Returns the EngineCoreOutputs."""
        sched = self.scheduler.schedule()
        self.steps_run += 1
        self._step_tokens = {}
        for new in sched.scheduled_new_reqs:
            self._step_tokens[new.req_id] = (new.num_computed_tokens, sched.num_scheduled_tokens[new.req_id])
        cached = sched.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._step_tokens[req_id] = (cached.num_computed_tokens[i], sched.num_scheduled_tokens[req_id])
        for req_id, (start, count) in self._step_tokens.items():
            if req_id in self.traces:
                self.traces[req_id].scheduled.append((start, count))
                self.traces[req_id].steps.append(self.steps_run)
        outputs = []
        for state in self.ranks:
            rank = state.tp_rank
            self._update_tables(state, sched)
            kv_transfer_state._KV_CONNECTOR_AGENT = state.connector
            rank_sched = sched
            if self.wire:
                rank_sched = copy.copy(sched)
                rank_sched.kv_connector_metadata = pickle.loads(pickle.dumps(sched.kv_connector_metadata))
            with place(rank, self.tp, state.pp_rank, self.pp, self.dcp), set_forward_context(self.attn_metadata, self.vllm_config):
                with KVConnectorModelRunnerMixin._get_kv_connector_output(rank_sched, defer_finalize=self.defer_finalize) as kv_out:
                    self._forward(rank, state, kv_out)
                if self.defer_finalize:
                    KVConnectorModelRunnerMixin.finalize_kv_connector()
            if self.wire and kv_out.kv_connector_worker_meta is not None:
                kv_out.kv_connector_worker_meta = pickle.loads(pickle.dumps(kv_out.kv_connector_worker_meta))
            if self.track_kv:
                for req_id, (start, count) in self._step_tokens.items():
                    if req_id in self.traces and not self._kv_as_computed(rank, state, req_id, start + count):
                        steps = self.traces[req_id].bad_kv_steps
                        if not steps or steps[-1] != self.steps_run:
                            steps.append(self.steps_run)
            req_ids = list(self._step_tokens)
            sampled = []
            for req_id in req_ids:
                start, count = self._step_tokens[req_id]
                end = start + count
                known = len(self.prompts[req_id]) + len(self.traces[req_id].output_tokens)
                sampled.append([sampled_token(end - 1)] if end >= known else [])
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                    kv_connector_output=kv_out if not kv_out.is_empty() else None,
                )
            )
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        merged = self.aggregator.aggregate(outputs)
        if merged.kv_connector_output is not None and merged.kv_connector_output.invalid_block_ids:
            self.load_errors[self.steps_run] = set(merged.kv_connector_output.invalid_block_ids)
        engine_outputs = self.scheduler.update_from_output(sched, merged)
        for client_outputs in engine_outputs.values():
            for output in client_outputs.outputs:
                trace = self.traces.get(output.request_id)
                if trace is None:
                    continue
                trace.output_tokens.extend(output.new_token_ids)
                trace.token_steps.extend([self.steps_run] * len(output.new_token_ids))
                if output.finish_reason is not None:
                    trace.finished = str(output.finish_reason)
                if output.kv_transfer_params is not None:
                    trace.kv_transfer_params = output.kv_transfer_params
                    trace.params_step = self.steps_run
            if client_outputs.scheduler_stats is not None and client_outputs.scheduler_stats.kv_connector_stats:
                self.stats.append(client_outputs.scheduler_stats.kv_connector_stats)
        return engine_outputs

    def run(self, until=None, max_steps: int = 64) -> None:
        """Steps until every request finished (or `until()` holds)."""
        for _ in range(max_steps):
            if until is not None and until():
                return
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"{self.name}: requests still unfinished after {max_steps} steps")

    def request_status(self, req_id: str) -> str:
        """vLLM's RequestStatus of the request (FINISHED_LENGTH_CAPPED, ...)."""
        return self.requests[req_id].status.name

    def connector(self):
        return self.scheduler.connector

    def close(self) -> None:
        for state in self.ranks:
            state.connector.shutdown()
