"""KvcsumConnector's scheduler role: producer payloads and consumer verdicts.

Producer: in the step whose forward completes a request's prompt, the
scheduler asks every worker to checksum the request's blocks
(`KvcsumConnectorMetadata.sends`); the workers' records come back in their
worker metadata, and `request_finished` adds the payload to the params the
wrapped connector returns (records that arrive later in the same scheduler
update still make it into the params).

Consumer: each P/D load to verify becomes a `ChecksumJob` for the workers.
An async load the scheduler judges (kvcsum.vllm.load_verdict: the workers'
records and the payload in a kvcsum.Verifier) in the step it arrives, in
update_connector_output, before vLLM reads finished_recving; one that
failed is held back and its verdict goes back to the workers
(`KvcsumConnectorMetadata.verdicts`), which hand vLLM the load errors. A
sync load (loaded inside the step) goes to the workers with what to judge
it by (`ChecksumJob.check`: the parsed payload, whether its token digest
covers the request's tokens, the blocks already handed): the workers
gather their records in one worker (kvcsum.vllm.record_exchange), which
judges it with the same rule and hands vLLM its load errors in that very
step, before vLLM emits the step's tokens; its WorkerNote carries the
verdict, which the scheduler counts and logs as its own. Where the workers
cannot exchange records (several PP stages) they send the records instead,
and the scheduler judges the load and hands its errors a step late.

Offload tiers (any load without P/D params): each step the scheduler names
the blocks that become full in the step's forward, with their block hashes
(`KvcsumConnectorMetadata.stores`), and each worker keeps their values
(kvcsum.vllm.tier_values); a load from a tier goes to the workers with its
blocks' hashes and each worker compares it itself, in the step of the load,
handing vLLM the blocks that differ. The workers' TierNotes only feed the
scheduler's counts and logs.
"""

from __future__ import annotations

import array
import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

import kvcsum
from kvcsum.vllm.cache_checksums import NULL_BLOCK_ID, Job
from kvcsum.vllm.common import (
    ChecksumJob,
    HashedBlocks,
    KvcsumConnectorMetadata,
    KvcsumWorkerMetadata,
    LoadOutcome,
    NO_BLOCKS,
    NO_ENTRIES,
    NO_JOBS,
    TierNote,
    logger,
)
from kvcsum.vllm.config import Settings
from kvcsum.vllm.coverage import uncompared_positions
from kvcsum.vllm.load_verdict import LoadCheck, LoadJudge, LoadVerdict
from kvcsum.vllm.load_order import ASYNC, DECLINE, LoadOrder
from kvcsum.vllm.params import (
    INFO_KEY,
    PAYLOAD_KEY,
    Checksums,
    LoadParams,
    is_int,
    parse_load,
    payload_summary,
    token_digest,
    wants_remote_decode,
)
from kvcsum.vllm.source_check import SchedulerSourceCheck
from kvcsum.vllm.stats import KvcsumStats, load_key
from kvcsum.vllm.tier_values import EMPTY_STORES, UINT32_CODE, StoreBatch, uint32_array

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["SchedulerRole"]


def _zeros(count: int):
    """`count` zeros, for map(dict.get, keys, defaults)."""
    return (0,) * count


def _is_ring(spec) -> bool:
    """Whether a group's spec is a ring (CircularBufferSpec: one block a
    request), or vLLM's UniformTypeKVCacheSpecs of rings."""
    return type(getattr(spec, "first_spec", spec)).__name__ == "CircularBufferSpec"


def _forget(verifier: "kvcsum.Verifier", req_id: str) -> None:
    try:
        verifier.forget(req_id)
    except kvcsum.NotFound:
        pass


@dataclasses.dataclass
class _Send:
    """A producer request: its checksum job (None once preempted, until
    computed again), the workers that reported, the params to fill."""

    job: Job | None = None
    generation: int = 0
    reported: set = dataclasses.field(default_factory=set)
    params: dict | None = None
    finished: bool = False
    digest: str = ""


@dataclasses.dataclass
class _Load:
    """A consumer load being verified."""

    job: Job
    is_async: bool
    params: LoadParams
    generation: int
    #: What it is judged by (LoadCheck.handed: the blocks handed to vLLM as
    #: load errors in the step of the load, a sync load's that no
    #: comparison can cover).
    check: LoadCheck
    reported: set = dataclasses.field(default_factory=set)
    inner_failed: bool = False
    outcome: LoadOutcome | None = None  # once judged


@dataclasses.dataclass
class _TierLoad:
    """A tier load whose workers' comparisons are being gathered."""

    blocks: HashedBlocks
    is_async: bool
    reported: set = dataclasses.field(default_factory=set)
    matched: int = 0
    mismatched: set = dataclasses.field(default_factory=set)
    unknown: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Match:
    """What get_num_new_matched_tokens saw of a request, for
    update_state_after_alloc."""

    num_computed_tokens: int
    params: LoadParams
    is_async: bool
    #: The wrapped connector's sync load, handed to vLLM as async
    #: (kvcsum.vllm.load_order): the workers report it received.
    converted: bool = False


class SchedulerRole:
    """The scheduler side of KvcsumConnector.

    Each public method is named after the vLLM hook (KVConnectorBase_V1)
    it serves; KvcsumConnector calls it with the inner connector's answer.

    Args:
        settings: the connector's settings.
        kv_cache_config: vLLM's KV cache config.
        num_workers: TP size times PP size (every worker sends a note).
        inner_name: the wrapped connector's class name (for logs).
        failure_policy: vLLM's kv_load_failure_policy (for logs).
        tp_size: this engine's TP size (kvcsum.vllm.load_verdict.LoadJudge).
    """

    def __init__(
        self,
        settings: Settings,
        kv_cache_config: "KVCacheConfig",
        block_sizes: dict,
        num_workers: int,
        inner_name: str,
        failure_policy: str,
        hash_block_size: int | None = None,
        records_meet: tuple = (True, ""),
        not_checksummed: dict | None = None,
        tp_size: int = 1,
    ):
        self._settings = settings
        self._kv_cache_config = kv_cache_config
        self._block_sizes = dict(block_sizes)
        self._num_workers = num_workers
        self._multi_group = len(kv_cache_config.kv_cache_groups) > 1
        self._order = LoadOrder(
            self._multi_group, bool(records_meet[0]), inner_name, settings.async_unfailable_sync_loads, str(records_meet[1])
        )
        #: Requests whose sync load goes to vLLM as async this step.
        self._new_converted: set = set()
        self._inner_name = inner_name
        self._failure_policy = failure_policy
        self._hash_block_size = hash_block_size or min(self._block_sizes.values(), default=0)
        #: State (Mamba) groups, each True where vLLM keeps a state per block
        #: (mamba_cache_mode "align"): a request's state, at position 0 of
        #: its block set (SPEC section 6), is the block vLLM's Mamba kernels
        #: read it from (state_column). A ring group (CircularBufferSpec) is
        #: one too: its state is the request's one block.
        self._state_groups = {
            g: str(getattr(kv_cache_config.kv_cache_groups[g].kv_cache_spec, "mamba_cache_mode", "none")) == "align"
            for g in self._block_sizes
            if g < len(kv_cache_config.kv_cache_groups)
            and (
                type(kv_cache_config.kv_cache_groups[g].kv_cache_spec).__name__ == "MambaSpec"
                or _is_ring(kv_cache_config.kv_cache_groups[g].kv_cache_spec)
            )
        }
        self._kv_cache_manager = None
        self._tier_loads: dict[str, _TierLoad] = {}
        self._tier_failed: set[str] = set()
        self._new_tier_sync: list = []
        self._new_tier_async: dict = {}
        self._stats = KvcsumStats()
        self._sends: dict[str, _Send] = {}
        self._loads: dict[str, _Load] = {}
        self._matched: dict[str, _Match] = {}
        self._new_sends: list = []
        self._new_sync_loads: list = []
        self._new_async_loads: dict = {}
        self._new_uncompared: set = set()
        self._verdicts_out: dict = {}
        self._unfilled: dict[str, _Send] = {}
        self._generation = 0
        self._finished_reqs: list = []
        self._logged: set = set()
        self._known: dict = {}
        self._store_plan = None
        self._tables = None
        self._group_getters: dict = {}
        #: The requests whose prompt may complete in a later step (known, not
        #: yet seen past their prompt): only these are looked at for sends.
        self._before_prompt: set = set()
        self._last_verdicts: dict = {}
        self._producer = kvcsum.Verifier(num_workers)
        #: {group: reason}: groups kvcsum cannot checksum (never silent: a
        #: P/D load covering one is UNVERIFIED GROUP_NOT_CHECKSUMMED).
        self.not_checksummed = dict(not_checksummed or {})
        for group_id, reason in sorted(self.not_checksummed.items()):
            logger.warning(
                "kvcsum: KV cache group %d is not checksummed (%s): a P/D load that fills it is UNVERIFIED "
                "(GROUP_NOT_CHECKSUMMED; with unverified=fail a load error), a tier load's blocks of it are unverified "
                "(NOT_CHECKSUMMED; with unverified_tier=fail load errors)",
                group_id, reason,
            )
            self._stats.add("groups_not_checksummed")
        self._load_judge = LoadJudge(
            kv_cache_config, self._block_sizes, num_workers, settings.fail_unverified, self.not_checksummed, tp_size
        )
        self._sources = SchedulerSourceCheck(lambda: self._stats, self._block_sizes, num_workers)

    # --- vLLM's calls --------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: "Request") -> None:
        self._known[request.request_id] = request
        self._before_prompt.add(request.request_id)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int, tokens, load_async) -> tuple:
        """get_num_new_matched_tokens, after the inner connector answered
        (tokens, load_async): what vLLM gets."""
        if not tokens:
            return tokens, load_async
        if request.request_id in self._tier_failed:
            # Its tier load failed the check: vLLM, which rewinds such a
            # request to its first bad block, would load the same blocks again
            # (from 0, every step); they are computed instead.
            self._stats.add("tier_reloads_declined")
            return 0, False
        params = parse_load(request.kv_transfer_params)
        verified = params.remote_prefill or self._settings.verify_all or self._settings.verify_tiers
        converted = False
        if verified and not load_async:
            # A load judged against a payload (P/D, or verify_loads "all"
            # without tier checks) or against the workers' kept values.
            pd = params.remote_prefill or not self._settings.verify_tiers
            decision = self._order.sync_load(pd)
            if decision == ASYNC:
                # vLLM could not take this load back once used: it goes to
                # vLLM as an async load, checked in the step it is done and
                # failed (failed_recving) before vLLM uses it if bad
                # (kvcsum.vllm.load_order).
                converted, load_async = True, True
                self._stats.add("sync_loads_as_async")
                self._log_once(
                    "sync-as-async",
                    f"kvcsum: the wrapped {self._inner_name} offers sync loads (request {request.request_id}, {tokens} "
                    f"tokens); {self._order.why_unfailable(pd)}, so kvcsum hands such loads to vLLM as async loads, "
                    "checked before vLLM uses them (one engine step of wait; counted as sync_loads_as_async)",
                    error=False,
                )
            elif decision == DECLINE:
                # vLLM could not recompute such a load if it failed: vLLM
                # computes those tokens instead.
                self._stats.add("sync_loads_declined")
                self._log_once(
                    "sync-declined",
                    f"kvcsum: the wrapped {self._inner_name} offers sync loads (request {request.request_id}, {tokens} tokens); "
                    f"{self._order.why_unfailable(pd)} and {self._order.decline_reason()}, so kvcsum declines such loads "
                    "and vLLM computes the tokens (counted as sync_loads_declined)",
                    error=False,
                )
                return 0, False
        self._matched[request.request_id] = _Match(num_computed_tokens, params, bool(load_async), converted)
        return tokens, load_async

    def update_state_after_alloc(self, request: "Request", num_external_tokens: int, loaded_groups: set) -> None:
        """update_state_after_alloc, after the inner connector's, with the KV
        cache groups its load restores (get_loaded_kv_cache_group_ids)."""
        req_id = request.request_id
        matched = self._matched.pop(req_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        first = matched.num_computed_tokens
        if matched.converted:
            self._new_converted.add(req_id)
        if not matched.params.remote_prefill and self._settings.verify_tiers:
            self._tier_load(request, first, first + num_external_tokens, loaded_groups, matched.is_async)
            return
        if not (matched.params.remote_prefill or self._settings.verify_all):
            return
        job = self._job(req_id, first, first + num_external_tokens, loaded_groups)
        if job is None:
            return
        self._generation += 1
        old = self._loads.pop(req_id, None)
        if old is not None:
            self._load_judge.forget(req_id)
        # The blocks of a sync load that no comparison can cover are load
        # errors of the step of the load, whoever judges it (a step late
        # where the workers cannot: record_exchange).
        handed = frozenset() if matched.is_async else frozenset(self._predicted_uncompared(matched.params, job))
        load = _Load(
            job=job,
            is_async=matched.is_async,
            params=matched.params,
            generation=self._generation,
            check=LoadCheck.of(matched.params, request.prompt_token_ids or [], handed),
        )
        self._loads[req_id] = load
        # Also for a sync load, which the scheduler judges where the workers
        # send their records instead of a verdict.
        self._load_judge.expect(job)
        if matched.is_async:
            self._new_async_loads[req_id] = ChecksumJob(job, load.generation)
        else:
            self._new_sync_loads.append(ChecksumJob(job, load.generation, load.check))
            self._new_uncompared |= handed

    def build_connector_meta(self, scheduler_output: "SchedulerOutput", inner) -> KvcsumConnectorMetadata:
        """build_connector_meta, around the inner connector's metadata."""
        if self._unfilled:
            self._give_up_unfilled()
        if self._finished_reqs:
            for req_id in self._finished_reqs:
                if self._loads.pop(req_id, None) is not None:
                    self._load_judge.forget(req_id)
                self._tier_loads.pop(req_id, None)
                self._tier_failed.discard(req_id)
            self._finished_reqs = []
        preempted = scheduler_output.preempted_req_ids
        for req_id in preempted or ():
            if req_id in self._known:
                self._before_prompt.add(req_id)  # computed again from its start
            send = self._sends.get(req_id)
            if send is not None and not send.finished:
                # Its KV will be computed again: checksum it again then.
                _forget(self._producer, req_id)
                self._sends[req_id] = _Send()
        if self._before_prompt:
            self._schedule_sends(scheduler_output)
        stores = self._schedule_stores(scheduler_output) if self._settings.verify_tiers else EMPTY_STORES
        released = self._sources.released(preempted or ())
        if not (
            self._new_sends or self._new_sync_loads or self._new_async_loads or self._verdicts_out or self._new_tier_sync
            or self._new_tier_async or released or self._new_uncompared or self._new_converted
        ):
            # Most decode steps: nothing but the blocks that fill.
            return KvcsumConnectorMetadata(
                inner=inner,
                sends=NO_JOBS,
                sync_loads=NO_JOBS,
                async_loads=NO_ENTRIES,
                verdicts=NO_ENTRIES,
                stores=stores,
                tier_sync_loads=NO_JOBS,
                tier_async_loads=NO_ENTRIES,
                sources_released=NO_JOBS,
                uncompared=NO_BLOCKS,
                converted=NO_BLOCKS,
                quiet=True,
            )
        meta = KvcsumConnectorMetadata(
            inner=inner,
            sends=self._new_sends,
            sync_loads=self._new_sync_loads,
            async_loads=self._new_async_loads,
            verdicts=self._verdicts_out,
            stores=stores,
            tier_sync_loads=self._new_tier_sync,
            tier_async_loads=self._new_tier_async,
            sources_released=released,
            uncompared=self._new_uncompared,
            converted=self._new_converted,
        )
        self._new_uncompared, self._new_converted = set(), set()
        self._new_sends, self._new_sync_loads, self._new_async_loads, self._verdicts_out = [], [], {}, {}
        self._new_tier_sync, self._new_tier_async = [], {}
        return meta

    def update_connector_output(self, connector_output, worker_meta: KvcsumWorkerMetadata | None) -> None:
        """update_connector_output, after the inner connector's (which saw
        its own worker metadata): the workers' notes of this step
        (worker_meta, None when no worker sent any), then the loads
        received and the requests sent in this step."""
        if worker_meta is not None:
            self._workers_reported(worker_meta)
        # Most decode steps receive, send and fail nothing: no call then.
        if connector_output.finished_recving or getattr(connector_output, "invalid_block_ids", None):
            self._received(connector_output)
        finished_sending = connector_output.finished_sending
        if finished_sending:
            self._sent(finished_sending, connector_output.expected_finished_count)

    def _workers_reported(self, meta: KvcsumWorkerMetadata) -> None:
        """The workers' notes of this step (update_connector_output)."""
        for note in meta.notes:
            if note.role == kvcsum.PRODUCER:
                self._producer_note(note)
            else:
                self._consumer_note(note)
        for note in meta.tier_notes:
            self._tier_note(note)
        self._sources.reported(meta.source_notes)

    def _sent(self, finished_sending, expected: int = 0) -> None:
        """update_connector_output: vLLM's finished_sending of this step and
        its expected count of reports per request (the producer's re-checks
        of those requests are judged)."""
        self._sources.sent(finished_sending, expected)

    def _received(self, connector_output) -> None:
        """update_connector_output, after the notes: vLLM reads
        finished_recving after this call, so an async load that arrived in
        this step and passed is released in this very step (no engine step
        added), and one that failed is taken out of finished_recving and
        handed back next step with its load errors."""
        if getattr(connector_output, "invalid_block_ids", None):
            # vLLM rewinds the requests of load errors to their first bad
            # block, maybe into their prompt: look at every request again.
            self._before_prompt.update(self._known)
        finished = connector_output.finished_recving
        if not finished:
            return
        failed_by_inner = connector_output.failed_recving or set()
        held = set()
        for req_id in finished:
            load = self._loads.get(req_id)
            if load is None or not load.is_async:
                continue
            if req_id in failed_by_inner:
                load.inner_failed = True
            if load.outcome is None:
                # Every worker reported it received; one that sent no note
                # makes it WORKERS_MISSING.
                self._judge(req_id, load)
            self._loads.pop(req_id, None)
            outcome = load.outcome
            if outcome is not None and (outcome.invalid_block_ids or outcome.failed) and not load.inner_failed:
                held.add(req_id)
                self._verdicts_out[req_id] = dataclasses.replace(outcome, release=True)
        if held:
            connector_output.finished_recving = set(finished) - held

    def request_finished(self, request: "Request", delay: bool, params: dict | None):
        """request_finished (and request_finished_all_groups, where vLLM has
        several KV cache groups), after the inner connector's (delay, params)."""
        req_id = request.request_id
        self._known.pop(req_id, None)
        self._before_prompt.discard(req_id)
        self._matched.pop(req_id, None)
        # Its loads' notes of this step still come (update_connector_output
        # follows request_finished): forgotten next step.
        self._finished_reqs.append(req_id)
        send = self._sends.get(req_id)
        if send is None:
            return delay, params
        self._sources.finished(req_id, bool(delay))
        if send.job is None or request.status.name == "FINISHED_ABORTED" and len(send.reported) < self._num_workers:
            # Preempted and not computed again, or aborted before its checksums.
            _forget(self._producer, req_id)
            self._sends.pop(req_id, None)
            return delay, params
        if params is None:
            params = {}
        send.params = params
        send.finished = True
        if len(send.reported) >= self._num_workers:
            self._fill(req_id, send)
        else:
            self._unfilled[req_id] = send
        return delay, params

    def get_kv_connector_stats(self) -> KvcsumStats | None:
        """get_kv_connector_stats: the counts since the last call (None when
        there are none), beside the inner connector's."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvcsumStats()
        return stats

    @property
    def last_verdicts(self) -> dict:
        """{req_id: (verdict, reason, message)} of the loads judged so far
        (kept for tests and tools; bounded)."""
        if len(self._last_verdicts) > 4096:
            self._last_verdicts.clear()
        return self._last_verdicts

    @property
    def source_check(self) -> SchedulerSourceCheck:
        """The producer's re-check of sent requests (for tests and tools)."""
        return self._sources

    @property
    def pending_sends(self) -> dict:
        """The producer requests not yet given their payload (for tests)."""
        return self._sends

    # --- jobs ------------------------------------------------------------------------

    def _job(self, req_id: str, first_token: int, num_tokens: int, groups: set | None = None) -> Job | None:
        """The blocks of req_id holding tokens [first_token, num_tokens), per
        transfer group (all of them when groups is None), leading null
        blocks (outside a sliding window) left out."""
        table = self._kv_cache_manager.get_block_ids(req_id)
        out = {}
        for group_id, block_size in self._block_sizes.items():
            if groups is not None and group_id not in groups:
                continue
            if group_id in self._state_groups:
                column = self._state_column(group_id, num_tokens)
                ids = list(table[group_id])[column : column + 1]
                if ids and ids[0] != NULL_BLOCK_ID:
                    out[group_id] = (0, ids)
                continue
            ids = list(table[group_id])[: math.ceil(num_tokens / block_size)]
            first = first_token // block_size
            while first < len(ids) and ids[first] == NULL_BLOCK_ID:
                first += 1
            if first < len(ids):
                out[group_id] = (first, ids[first:])
        if not out:
            return None
        return Job(req_id, num_tokens, out)

    def _state_column(self, group_id: int, num_tokens: int) -> int:
        """The column of a request's block list of state group `group_id`
        holding its state after `num_tokens` tokens: 0 (its one state, then
        any speculative blocks) with mamba_cache_mode "none"; with "align"
        (a state per block, position-indexed) the column a step's kernels
        read the state after num_computed_tokens from and write it to,
        (num_tokens - 1) // block_size (vllm/v1/worker/mamba_utils.py,
        preprocess_mamba; v1/attention/backends/utils.py,
        mamba_get_block_table_tensor): the block vLLM's connectors move
        (kv_connector/utils.py, clip_ssm_state_blocks)."""
        if not self._state_groups.get(group_id):
            return 0
        return max(0, num_tokens - 1) // self._block_sizes[group_id]

    # --- offload tiers -------------------------------------------------------------------

    def _block_hash(self, request: "Request", group_id: int, position: int):
        """The block hash of a full block of the request, None where there is
        none (a block size that is no multiple of the hash block size, or
        tokens not hashed yet)."""
        size, unit = self._block_sizes[group_id], self._hash_block_size
        if unit <= 0 or size % unit:
            return None
        index = (position + 1) * (size // unit) - 1
        hashes = request.block_hashes
        return bytes(hashes[index]) if index < len(hashes) else None

    def _block_table(self, req_id: str):
        """(group_id, first, end) -> the request's block ids at positions
        [first, end) of that group: read from vLLM's block lists directly
        (the coordinator's get_blocks), so that a step's few new blocks are
        read without converting every block of the request; through
        get_block_ids where the manager has no coordinator."""
        get_blocks = getattr(getattr(self._kv_cache_manager, "coordinator", None), "get_blocks", None)
        if get_blocks is not None:
            blocks = get_blocks(req_id)
            return lambda group_id, first, end: [b.block_id for b in blocks[group_id][first:end]]
        table = self._kv_cache_manager.get_block_ids(req_id)
        return lambda group_id, first, end: list(table[group_id])[first:end]

    def _hashed_blocks(self, request: "Request", first_token: int, end_token: int, full_only: bool, groups=None):
        """The request's blocks of tokens [first_token, end_token) per group,
        with their hashes (None for a block not full by end_token), null
        blocks left out (a run after the last one). None when there are none."""
        table = self._block_table(request.request_id)
        out = {}
        for group_id, size in self._block_sizes.items():
            if groups is not None and group_id not in groups:
                continue
            if group_id in self._state_groups:
                # A state has no block hash: no value is kept of it, and a
                # tier load's state is unknown to the check (NO_BLOCK_HASH).
                column = self._state_column(group_id, end_token)
                state = table(group_id, column, column + 1)
                if not full_only and state and state[0] != NULL_BLOCK_ID:
                    out[group_id] = (0, tuple(state), (None,))
                continue
            first = first_token // size
            end = end_token // size if full_only else math.ceil(end_token / size)
            ids = table(group_id, first, end)
            while NULL_BLOCK_ID in ids:
                cut = ids.index(NULL_BLOCK_ID) + 1
                ids, first = ids[cut:], first + cut
            if not ids:
                continue
            hashes = tuple(
                self._block_hash(request, group_id, q) if (q + 1) * size <= end_token else None
                for q in range(first, first + len(ids))
            )
            out[group_id] = (first, tuple(ids), hashes)
        if not out:
            return None
        return HashedBlocks(request.request_id, end_token, out)

    def _store_groups(self) -> tuple:
        """(group_id, block_size, hash blocks per block) of the groups whose
        full blocks have block hashes (a size that is a multiple of the hash
        block size), and the gcd of every group's size (a step that passes
        no multiple of it fills no block); computed once. State groups keep
        no values: a state is one block at position 0 (SPEC section 6),
        while with mamba_cache_mode "align" vLLM keeps one per full block,
        so a tier load's state is unverified (NO_BLOCK_HASH), never MATCH."""
        if self._store_plan is None:
            unit = self._hash_block_size
            groups = tuple(
                (g, size, size // unit)
                for g, size in sorted(self._block_sizes.items())
                if unit > 0 and size % unit == 0 and g not in self._state_groups
            )
            self._store_plan = (groups, math.gcd(*self._block_sizes.values()) if self._block_sizes else 0)
        return self._store_plan

    def _block_tables(self):
        """(req_id, group_id) -> the request's KVCacheBlocks of that group:
        vLLM's own per-group dicts (the coordinator's managers'
        req_to_blocks, read without a call per request), else its
        get_blocks."""
        if self._tables is None:
            coordinator = getattr(self._kv_cache_manager, "coordinator", None)
            managers = getattr(coordinator, "single_type_managers", None)
            dicts = [getattr(m, "req_to_blocks", None) for m in managers or ()]
            if dicts and all(isinstance(d, dict) for d in dicts):
                empty = []
                self._tables = lambda req_id, group_id: dicts[group_id].get(req_id, empty)
            else:
                get_blocks = coordinator.get_blocks
                self._tables = lambda req_id, group_id: get_blocks(req_id)[group_id]
        return self._tables

    def _group_blocks(self, group_id: int) -> tuple:
        """(blocks_of, empty): blocks_of(req_id, empty) is the request's
        KVCacheBlocks of `group_id`, as _block_tables reads them: where
        vLLM's per-group dict is there, its own get (no Python call per
        request); found once per group."""
        found = self._group_getters.get(group_id)
        if found is None:
            coordinator = getattr(self._kv_cache_manager, "coordinator", None)
            managers = getattr(coordinator, "single_type_managers", None) or ()
            dicts = [getattr(m, "req_to_blocks", None) for m in managers]
            if dicts and all(isinstance(d, dict) for d in dicts):
                found = dicts[group_id].get, []
            else:
                tables = self._block_tables()
                found = (lambda req_id, _empty: tables(req_id, group_id)), None
            self._group_getters[group_id] = found
        return found

    def _schedule_stores(self, scheduler_output: "SchedulerOutput") -> StoreBatch:
        """The blocks that become full in this step's forward (the tokens
        computed, not loaded), with their hashes, as arrays: every worker
        keeps their values. Only the requests that pass a block boundary
        are looked at, found over the step's arrays at once."""
        if self._kv_cache_manager is None:
            return EMPTY_STORES
        groups, unit = self._store_plan or self._store_groups()
        if unit <= 0 or not groups:
            return EMPTY_STORES
        scheduled = scheduler_output.num_scheduled_tokens
        new_reqs = scheduler_output.scheduled_new_reqs
        cached = scheduler_output.scheduled_cached_reqs
        req_ids = cached.req_ids
        # One token for every request (a decode step): a block fills where
        # the token computed is a boundary's last.
        decode = scheduler_output.total_num_scheduled_tokens == len(scheduled)
        if decode and req_ids and not new_reqs and len(groups) == 1:
            return self._decode_stores(req_ids, cached.num_computed_tokens, unit, groups[0])
        progress = [(r.req_id, r.num_computed_tokens, scheduled.get(r.req_id, 0)) for r in new_reqs] if new_reqs else []
        if req_ids:
            computed = cached.num_computed_tokens
            if decode:
                last = unit - 1
                progress += [(req_ids[i], c, 1) for i, c in enumerate(computed) if c % unit == last]
            else:
                # vLLM schedules the running requests first, in the order of
                # scheduled_cached_reqs: their counts are then the dict's
                # first values (checked, else looked up one by one).
                steps = list(scheduled.values()) if list(scheduled)[: len(req_ids)] == req_ids else None
                if steps is None:
                    steps = [scheduled.get(r, 0) for r in req_ids]
                progress += [
                    (req_ids[i], c, s) for i, (c, s) in enumerate(zip(computed, steps)) if (c + s) // unit != c // unit
                ]
        if not progress:
            return EMPTY_STORES
        known = self._known
        tables = self._block_tables()
        group_ids, positions, block_ids, hashes = uint32_array(), array.array("Q"), uint32_array(), []
        for req_id, computed, step in progress:
            request = known.get(req_id)
            if request is None:
                continue
            # Speculative tokens are scheduled but not yet the request's.
            end = min(computed + step, request.num_tokens)
            block_hashes = request.block_hashes
            for group_id, size, ratio in groups:
                first, last = computed // size, min(end // size, len(block_hashes) // ratio)
                if first >= last:
                    continue
                blocks = tables(req_id, group_id)
                for q in range(first, last):
                    block_id = blocks[q].block_id
                    if block_id != NULL_BLOCK_ID:
                        group_ids.append(group_id)
                        positions.append(q)
                        block_ids.append(block_id)
                        hashes.append(block_hashes[(q + 1) * ratio - 1])
        return StoreBatch.of_arrays(group_ids, positions, block_ids, hashes)

    def _decode_stores(self, req_ids: list, computed: list, unit: int, group: tuple) -> StoreBatch:
        """_schedule_stores of a decode step of one group (`unit` its block
        size): the requests whose computed token (`computed`, beside
        `req_ids`) is a block's last fill that block, if it has its hash
        yet. It runs every decode step over every running request, so it
        is one loop in one frame: only the few requests found are looked
        up, and the arrays are made once at the end."""
        last = unit - 1
        group_id, size, ratio = group
        known_get = self._known.get
        blocks_of, empty = self._group_getters.get(group_id) or self._group_blocks(group_id)
        positions, block_ids, hashes = [], [], []
        for i, c in enumerate(computed):
            if c % unit != last:
                continue
            req_id = req_ids[i]
            request = known_get(req_id)
            if request is None:
                continue
            q = c // size
            end = (q + 1) * ratio
            block_hashes = request.block_hashes
            # A block whose tokens are not all known yet (speculative) has no hash.
            if end > len(block_hashes):
                continue
            block_id = blocks_of(req_id, empty)[q].block_id
            if block_id != NULL_BLOCK_ID:
                positions.append(q)
                block_ids.append(block_id)
                hashes.append(block_hashes[end - 1])
        if not block_ids:
            return EMPTY_STORES
        return StoreBatch.of_arrays(
            array.array(UINT32_CODE, (group_id,)) * len(block_ids),
            array.array("Q", positions),
            array.array(UINT32_CODE, block_ids),
            hashes,
        )

    def _tier_load(self, request: "Request", first: int, end: int, groups: set, is_async: bool) -> None:
        blocks = self._hashed_blocks(request, first, end, full_only=False, groups=groups)
        if blocks is None:
            return
        self._generation += 1
        blocks = dataclasses.replace(blocks, generation=self._generation)
        self._tier_loads[request.request_id] = _TierLoad(blocks, is_async)
        if is_async:
            self._new_tier_async[request.request_id] = blocks
        else:
            self._new_tier_sync.append(blocks)

    def _tier_note(self, note: TierNote) -> None:
        load = self._tier_loads.get(note.req_id)
        if load is None or load.blocks.generation != note.generation:
            return
        if note.inner_failed:
            # The wrapped connector failed the load; vLLM handles it.
            self._tier_loads.pop(note.req_id, None)
            return
        if note.mismatched or (note.unknown and self._settings.fail_unverified_tier):
            self._tier_failed.add(note.req_id)
        load.reported.add(note.worker)
        load.matched += note.matched
        load.mismatched |= set(note.mismatched)
        for reason, count in note.unknown.items():
            load.unknown[reason] = load.unknown.get(reason, 0) + count
        if len(load.reported) >= self._num_workers:
            self._tier_loads.pop(note.req_id, None)
            self._tier_verdict(note.req_id, load)

    def _tier_verdict(self, req_id: str, load: _TierLoad) -> None:
        """Counts and logs a tier load the workers compared (they already
        handed vLLM its load errors, in the step of the load)."""
        blocks = sum(len(ids) for _, ids, _ in load.blocks.groups.values())
        self._stats.add("tier_blocks_checked", blocks)
        policy = f"kv_load_failure_policy={self._failure_policy}"
        if load.mismatched:
            bad = sorted(load.mismatched)
            self._stats.count_load("tier", "mismatched", blocks=len(bad))
            verdict, reason = kvcsum.MISMATCH, ""
            message = f"blocks {bad} differ from the values this engine kept of them (on some worker)"
            action = "vLLM " + ("gets the whole load as failed" if self._multi_group else f"gets blocks {bad} as load errors")
            self._log_once(req_id, f"kvcsum: request {req_id}: tier KV MISMATCH: {message}; {action} ({policy})", error=True)
        elif load.unknown:
            reason = min(load.unknown, key=lambda r: (-load.unknown[r], r))
            verdict = kvcsum.UNVERIFIED
            counts = ", ".join(f"{n} {r}" for r, n in sorted(load.unknown.items()))
            message = f"block values unknown on some worker ({counts})"
            self._stats.count_load("tier", "unverified", reason=reason)
            setting = "unverified_tier=fail" if self._settings.fail_unverified_tier else "unverified_tier=log"
            action = "vLLM gets them as load errors" if self._settings.fail_unverified_tier else "the load is used"
            self._log_once(
                req_id,
                f"kvcsum: request {req_id}: tier KV UNVERIFIED ({reason}): {message}; {setting}: {action}",
                error=self._settings.fail_unverified_tier,
            )
        else:
            verdict, reason, message = kvcsum.MATCH, "", f"{load.matched} block checks matched"
            self._stats.count_load("tier", "verified")
            if self._settings.log_matches:
                logger.info("kvcsum: request %s: tier KV verified (%s)", req_id, message)
        self.last_verdicts[req_id] = (verdict, reason, message)

    # --- producer ----------------------------------------------------------------------

    def _wants_send(self, request: "Request") -> bool:
        return self._settings.checksum_all or wants_remote_decode(request.kv_transfer_params)

    def _schedule_sends(self, scheduler_output: "SchedulerOutput") -> None:
        """The producer jobs of the requests whose prompt completes in this
        step's forward. Only requests not yet seen past their prompt are
        looked at (a request computes from before its prompt's end again
        only after a preemption or load errors, which put it back)."""
        if self._kv_cache_manager is None or not self._before_prompt:
            return
        progress = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        before = self._before_prompt
        progress += [(r, c) for r, c in zip(cached.req_ids, cached.num_computed_tokens) if r in before]
        for req_id, computed in progress:
            if req_id not in self._before_prompt:
                continue
            request = self._known.get(req_id)
            if request is None:
                continue
            prompt = request.num_prompt_tokens
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if done >= prompt:
                self._before_prompt.discard(req_id)
            if computed >= prompt or done < prompt or not self._wants_send(request):
                continue
            job = self._job(req_id, 0, prompt)
            if job is None:
                continue
            self._generation += 1
            _forget(self._producer, req_id)
            send = _Send(job=job, generation=self._generation, digest=token_digest(request.prompt_token_ids or [], prompt))
            self._sends[req_id] = send
            with kvcsum.Blocks() as expected:
                job.to_blocks(expected)
                self._producer.expect(expected, kvcsum.PRODUCER)
            self._new_sends.append(ChecksumJob(job, send.generation))

    def _producer_note(self, note) -> None:
        send = self._sends.get(note.req_id)
        if send is None or send.generation != note.generation or note.record is None:
            return
        self._producer.add_record(note.record)
        send.reported.add(note.worker)
        if send.finished and len(send.reported) >= self._num_workers:
            self._fill(note.req_id, send)

    def _payload(self, req_id: str) -> str | None:
        try:
            return kvcsum.base64_encode(self._producer.payload(req_id))
        except kvcsum.Error as error:
            logger.warning("kvcsum: no checksums for request %s: %s", req_id, error)
            return None

    def _fill(self, req_id: str, send: _Send) -> None:
        """Adds the payload to the params request_finished returned."""
        text = self._payload(req_id)
        if text is not None and send.params is not None:
            send.params[PAYLOAD_KEY] = text
            send.params[INFO_KEY] = {
                "block_sizes": {str(g): b for g, b in self._block_sizes.items()},
                "tokens": send.digest,
            }
            self._stats.add("payloads_sent")
        else:
            self._stats.add("payloads_missing")
        _forget(self._producer, req_id)
        self._sends.pop(req_id, None)
        self._unfilled.pop(req_id, None)

    def _give_up_unfilled(self) -> None:
        """Requests whose records did not arrive by the end of the scheduler
        update that finished them: their outputs are gone, without checksums."""
        for req_id, send in list(self._unfilled.items()):
            logger.warning(
                "kvcsum: request %s finished before all workers checksummed its KV (%d of %d); it goes without checksums",
                req_id, len(send.reported), self._num_workers,
            )
            self._stats.add("payloads_missing")
            _forget(self._producer, req_id)
            self._sends.pop(req_id, None)
        self._unfilled.clear()

    # --- consumer ------------------------------------------------------------------------

    def _consumer_note(self, note) -> None:
        load = self._loads.get(note.req_id)
        if load is None or load.generation != note.generation or load.outcome is not None:
            return
        if note.verdict is not None:
            # A sync load a worker judged with every worker's record: it
            # handed vLLM the load errors in the step of the load.
            self._loads.pop(note.req_id, None)
            self._load_judge.forget(note.req_id)
            self._conclude(note.req_id, load, note.verdict, handed_by_workers=True)
            return
        if note.record is not None:
            self._load_judge.add_record(note.record)
        load.inner_failed |= note.inner_failed
        load.reported.add(note.worker)
        if len(load.reported) >= self._num_workers:
            self._judge(note.req_id, load)

    def _judge(self, req_id: str, load: _Load) -> None:
        """Judges a load once every worker reported (an async load stays in
        _loads until vLLM hears of it: `received`)."""
        if not load.is_async:
            self._loads.pop(req_id, None)
        if load.inner_failed:
            # The inner connector reported the load failed: vLLM handles it.
            self._load_judge.forget(req_id)
            load.outcome = LoadOutcome((), True)
            return
        self._conclude(req_id, load, self._load_judge.judge(load.job, load.check), handed_by_workers=False)

    def _conclude(self, req_id: str, load: _Load, judged: LoadVerdict, handed_by_workers: bool) -> None:
        """Counts and logs a judged load and sets its outcome; a sync load's
        load errors go out next step unless the workers handed them in the
        step of the load (`handed_by_workers`)."""
        verdict, reason, message = judged.verdict, judged.reason, judged.message
        invalid = list(judged.invalid)
        # A load from a P/D producer carries its params; any other verified
        # load (verify_loads "all") comes from an offload tier.
        path = "pd" if load.params.remote_prefill else "tier"
        if verdict == kvcsum.UNVERIFIED:
            self._stats.count_load(path, "unverified", reason=reason)
        elif verdict == kvcsum.MISMATCH:
            self._stats.count_load(path, "mismatched", blocks=judged.mismatched_blocks)
        else:
            self._stats.count_load(path, "verified")
        unchecked, where = judged.uncompared, judged.where
        if unchecked:
            self._stats.add(load_key(path, "uncompared_blocks"), len(unchecked))
        # vLLM maps block-level load errors back to requests only where there
        # is one KV cache group; with several it takes whole failed loads.
        # (A sync load there is never verified: `matched` declines it, since a
        # running request's load cannot be failed.)
        failed = bool(invalid) and self._multi_group
        if failed and not load.is_async:
            failed, invalid = False, []
            action = "vLLM cannot be told (a sync load with several KV cache groups)"
        elif failed:
            action = "vLLM gets the whole load as failed (several KV cache groups)"
        elif invalid:
            action = f"vLLM gets blocks {sorted(invalid)} as load errors"
            if not load.is_async:
                action += " in the step of the load" if handed_by_workers else " a step after the load"
        else:
            action = "the load is used"
        policy = f"kv_load_failure_policy={self._failure_policy}"
        if verdict == kvcsum.MATCH:
            if self._settings.log_matches:
                logger.info("kvcsum: request %s: KV verified (%s)", req_id, message)
        elif verdict == kvcsum.MISMATCH:
            self._log_once(req_id, f"kvcsum: request {req_id}: KV MISMATCH: {message}; {action} ({policy})", error=True)
        else:
            setting = "unverified=fail" if self._settings.fail_unverified else "unverified=log"
            self._log_once(
                req_id, f"kvcsum: request {req_id}: KV UNVERIFIED ({reason}): {message}; {setting}: {action}" + (f" ({policy})" if invalid else ""),
                error=self._settings.fail_unverified,
            )
        if unchecked:
            if failed:
                then = "vLLM gets the whole load as failed (several KV cache groups)"
            elif self._multi_group and not load.is_async:
                then = "vLLM cannot be told (a sync load with several KV cache groups)"
            elif self._failure_policy == "fail":
                then = "vLLM fails the request (kv_load_failure_policy=fail)"
            else:
                then = "recomputed"
            in_step = load.check.handed or (handed_by_workers and not load.is_async)
            self._log_once(
                f"{req_id} uncompared",
                f"kvcsum: request {req_id}: loaded blocks {sorted(unchecked)} ({where}) not compared: {then}"
                + (" (load errors in the step of the load)" if in_step else ""),
                error=False,
            )
        load.outcome = LoadOutcome(() if failed else tuple(sorted(invalid)), failed)
        if not load.is_async and not handed_by_workers and (load.outcome.invalid_block_ids or load.outcome.failed):
            # A sync load's step is over: its load errors go out next step.
            self._verdicts_out[req_id] = load.outcome
        self.last_verdicts[req_id] = (verdict, reason, message)

    def _log_once(self, key: str, text: str, error: bool = True) -> None:
        if key in self._logged:
            return
        if len(self._logged) > 65536:
            self._logged.clear()
        self._logged.add(key)
        (logger.error if error else logger.warning)(text)

    def _predicted_uncompared(self, params: LoadParams, job: Job) -> set:
        """The block ids of a load that no comparison can cover, from the
        payload's token count and positions and the block sizes
        (kvcsum.vllm.coverage); empty where the payload cannot say (the
        verdict then names them)."""
        checksums = params.checksums
        if not isinstance(checksums, Checksums):
            return set()
        try:
            summary = payload_summary(kvcsum.base64_decode(checksums.payload))
        except kvcsum.Error:
            return set()
        if summary is None:
            return set()
        from vllm.v1.kv_cache_interface import AttentionSpec

        groups = self._kv_cache_config.kv_cache_groups
        out = set()
        for group, (first, ids) in job.groups.items():
            own, sent = self._block_sizes.get(group), summary.positions.get(group)
            # State groups are compared whole, whatever the token counts.
            if own is None or sent is None or group >= len(groups) or not isinstance(groups[group].kv_cache_spec, AttentionSpec):
                continue
            size = summary.block_sizes.get(group, checksums.block_sizes.get(group, own))
            if not is_int(size) or size <= 0:
                continue
            short = group in summary.short_last
            for start, count in uncompared_positions((size, summary.num_tokens, *sent), (own, job.num_tokens, first, len(ids)), short):
                out.update(ids[p - first] for p in range(start, start + count))
        return out
