"""Which verified sync loads vLLM 0.33 could not take back, and what the
scheduler does with them: hand them to vLLM as async loads, checked before
vLLM uses them.

vLLM 0.33 takes a load back in two forms only:

- block load errors (`invalid_block_ids`), with one KV cache group alone:
  `Scheduler._handle_invalid_blocks` raises where there are several
  ("Block IDs are only unique within a group"), whether the load was sync
  or async;
- failed loads (`failed_recving`), only for a request still waiting for an
  async load: `Scheduler._handle_failed_recving` skips any request whose
  status is not WAITING_FOR_REMOTE_KVS, so a sync load (the request is
  RUNNING, its step's forward already read the KV) cannot be failed.

And a sync P/D load is judged in its own step only where the workers'
records can meet inside the connector's calls (kvcsum.vllm.record_exchange);
with several PP stages, the external launcher or prefill context
parallelism they cannot, and the scheduler judges the load a step late,
after the step's sampled token is out.

The order of events that allows using such a load and never a bad one is
vLLM's async one: the scheduler answers get_num_new_matched_tokens with
`load_async=True` for the wrapped connector's sync hit. vLLM then allocates
the blocks, calls update_state_after_alloc (the wrapped connector records
the load as it would for its sync load), puts the request in
WAITING_FOR_REMOTE_KVS and schedules nothing of it in that step; the
wrapped connector loads the blocks in that step's start_load_kv. No
forward reads them, so the connector makes the waits a forward makes
(wait_for_layer_load of every layer) before the workers report the
request received in that step's get_transfer_results
(`KvcsumConnectorMetadata.converted`, added to the wrapped connector's
finished_recving), and kvcsum checks it there as any async load: a tier
load against the values the workers kept, a P/D load against its payload,
both in that very step (kvcsum.vllm.worker_role, kvcsum.vllm.scheduler).
An intact load is cached and computed on from in the next step, with the
same tokens reused as through the wrapped connector alone; a bad one is a
failed_recving where vLLM has several KV cache groups (computed again from
token 0) and its bad blocks' load errors where it has one (computed again
from the first bad block), or a failed request with kv_load_failure_policy
"fail". The cost is the step the request waits.

This needs a wrapped connector that loads what update_state_after_alloc
recorded in the step's start_load_kv whether or not vLLM schedules the
request in that step (the test's tier and P/D connectors, vLLM's
OffloadingConnector, which emits its loads from its own list). A connector
that builds its loads from the step's scheduled requests would load
nothing there; for those (`SCHEDULED_ONLY`: LMCache's vLLM adapter and
vLLM's ExampleConnector, whose build_connector_meta iterates
`scheduler_output.scheduled_new_reqs`) the load is declined and vLLM
computes its tokens, as it is with the setting "unfailable_sync_loads":
"decline".
"""

from __future__ import annotations

#: Wrapped connectors whose loads are built from the step's scheduled
#: requests only (their build_connector_meta iterates
#: scheduler_output.scheduled_new_reqs): a load handed to vLLM as async
#: would never be done.
SCHEDULED_ONLY = frozenset({"LMCacheConnectorV1", "ExampleConnector"})

#: What the scheduler does with a verified sync load vLLM could not take back.
USE = "use"  # vLLM can take it back: a sync load as the wrapped connector offers it
ASYNC = "async"  # handed to vLLM as an async load, checked before it is used
DECLINE = "decline"  # vLLM computes its tokens


def records_meet_in_step(vllm_config) -> tuple[bool, str]:
    """Whether the workers' records of a sync P/D load can meet inside the
    connector's calls of its step, as far as the scheduler can tell from the
    engine's config (the same conditions as
    kvcsum.vllm.record_exchange.engine_exchange), and why not."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None:
        return True, ""
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        return False, f"pipeline parallelism ({pp} stages)"
    if getattr(parallel, "distributed_executor_backend", None) == "external_launcher":
        return False, "the external launcher"
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    if pcp > 1:
        return False, f"prefill context parallelism ({pcp} ranks)"
    return True, ""


class LoadOrder:
    """The scheduler's decision for each verified sync load.

    Args:
        multi_group: vLLM has several KV cache groups (no block errors).
        records_meet: the workers' records of a sync P/D load meet in its
            step (records_meet_in_step); `why_not` says why they do not.
        inner_name: the wrapped connector's class name.
        as_async: the setting "unfailable_sync_loads" is "async".
    """

    def __init__(self, multi_group: bool, records_meet: bool, inner_name: str, as_async: bool, why_not: str = ""):
        self.multi_group = multi_group
        self.records_meet = records_meet
        self.why_not = why_not
        self.inner_name = inner_name
        self.as_async = as_async and inner_name not in SCHEDULED_ONLY

    def why_unfailable(self, pd: bool) -> str:
        """Why vLLM could not take back a bad sync load of this kind ("" where it can)."""
        if self.multi_group:
            return "with several KV cache groups vLLM can fail only async loads"
        if pd and not self.records_meet:
            return f"the workers' records of a sync P/D load cannot meet in its step ({self.why_not})"
        return ""

    def sync_load(self, pd: bool) -> str:
        """USE, ASYNC or DECLINE for a verified sync load (`pd`: a P/D load
        with a payload, else a tier load)."""
        if not self.why_unfailable(pd):
            return USE
        return ASYNC if self.as_async else DECLINE

    def decline_reason(self) -> str:
        """Why a load is declined rather than handed to vLLM as async."""
        if self.inner_name in SCHEDULED_ONLY:
            return (
                f"the wrapped {self.inner_name} loads only requests scheduled in the step, so the load cannot be "
                "handed to vLLM as an async load"
            )
        return "unfailable_sync_loads is 'decline'"
