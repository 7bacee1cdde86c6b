"""What passes between KvcsumConnector's two roles, each a named dataclass:
the scheduler's metadata to its workers every step
(`KvcsumConnectorMetadata`, carrying `ChecksumJob`s, `LoadOutcome`s and
`HashedBlocks`, and a `StoreBatch` of the blocks that became full), and each worker's metadata back (`KvcsumWorkerMetadata`,
carrying `WorkerNote`s and `TierNote`s). What a worker judges a load by
and the verdict it sends back are kvcsum.vllm.load_verdict's `LoadCheck`
and `LoadVerdict`."""

from __future__ import annotations

import dataclasses

from kvcsum.vllm.cache_checksums import Job
from kvcsum.vllm.load_verdict import LoadCheck, LoadVerdict
from kvcsum.vllm.tier_values import EMPTY_STORES, HashedBlocks, StoreBatch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.logger import init_logger

# Under vLLM's logger, so that its handlers and VLLM_LOGGING_LEVEL apply.
logger = init_logger("vllm.kvcsum")

#: The connector's name, as vLLM's factory and its stats know it.
NAME = "KvcsumConnector"


class UnusableLoadError(RuntimeError):
    """A worker judged a sync load bad that vLLM 0.33 cannot fail (a model
    with several KV cache groups: vLLM takes no block errors there and
    reads failed_recving only for requests still waiting for an async
    load). The KV is already in the cache and this step's forward read it,
    so the worker stops the step before vLLM emits its tokens: the engine
    fails rather than serve tokens from KV known to be bad. The scheduler
    declines such loads up front (sync_loads_declined), so this is only
    reached where that was bypassed."""


@dataclasses.dataclass(frozen=True)
class ChecksumJob:
    """Blocks the workers checksum: a request's `job`, under the
    scheduler's `generation` for it (a note of an older generation, from
    before a preemption or a second load, is dropped). A sync load's
    `check`: what the workers judge it by themselves, in the step of the
    load (None: they send their records to the scheduler)."""

    job: Job
    generation: int
    check: LoadCheck | None = None


@dataclasses.dataclass(frozen=True)
class TierNote:
    """One worker's comparison of a tier load with the values it keeps:
    the blocks that matched, the block ids that mismatched, and the blocks
    of unknown value by reason ({reason: count}); or that the wrapped
    connector failed the load (vLLM handles it; nothing was compared)."""

    worker: str
    req_id: str
    generation: int
    matched: int = 0
    mismatched: tuple = ()
    unknown: dict = dataclasses.field(default_factory=dict)
    inner_failed: bool = False  # the wrapped connector failed the load: not compared


@dataclasses.dataclass(frozen=True)
class LoadOutcome:
    """What the workers hand to vLLM for a judged load: the block ids that
    are load errors, whether the whole load failed (failed_recving, where
    vLLM has several KV cache groups), and whether the workers report the
    load received again (`release`: an async load the scheduler held back
    from vLLM, in the step it arrived, to fail it)."""

    invalid_block_ids: tuple = ()
    failed: bool = False
    release: bool = False


@dataclasses.dataclass(frozen=True)
class WorkerNote:
    """One worker's part of a checksum job: its `record` (bytes for the
    scheduler's kvcsum.Verifier, None when it checksummed nothing), in
    `role` (kvcsum.PRODUCER or CONSUMER); `inner_failed` when the wrapped
    connector reported the load failed. `verdict`: a sync load the worker
    judged with every worker's record, in the step of the load (it handed
    vLLM the load errors; the scheduler counts and logs it)."""

    worker: str
    role: int
    req_id: str
    generation: int
    record: bytes | None
    inner_failed: bool = False
    verdict: LoadVerdict | None = None


@dataclasses.dataclass
class KvcsumConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, each step: the inner connector's metadata, the
    requests to checksum after this step's forward (`sends`, producer; and
    `sync_loads`, consumer, with what to judge them by), the async loads to checksum once received
    ({req_id: ChecksumJob}), the outcomes to hand to vLLM this step
    ({req_id: LoadOutcome}); for offload tiers, the blocks to keep values
    of and the tier loads to compare (HashedBlocks); `sources_released`:
    the producer requests whose blocks vLLM freed without a send, or that
    were preempted, whose checksums the workers no longer keep for the
    re-check after the send (kvcsum.vllm.source_check); `uncompared`: sync
    loads' blocks that no comparison can cover, load errors this step."""

    inner: KVConnectorMetadata | None
    sends: list = dataclasses.field(default_factory=list)
    sync_loads: list = dataclasses.field(default_factory=list)
    async_loads: dict = dataclasses.field(default_factory=dict)
    verdicts: dict = dataclasses.field(default_factory=dict)
    #: Blocks that become full in this step's forward, with their hashes,
    #: as arrays (StoreBatch: four numpy arrays, not an object per request
    #: or block).
    stores: StoreBatch = EMPTY_STORES
    #: Tier loads of this step (sync) and to compare once received (async).
    tier_sync_loads: list = dataclasses.field(default_factory=list)
    tier_async_loads: dict = dataclasses.field(default_factory=dict)
    sources_released: list = dataclasses.field(default_factory=list)
    #: Block ids of this step's sync loads that no comparison can cover
    #: (kvcsum.vllm.coverage): load errors of this very step.
    uncompared: set = dataclasses.field(default_factory=set)
    #: Requests whose wrapped connector's sync load vLLM sees as async
    #: (kvcsum.vllm.load_order): done in this step's start_load_kv, so the
    #: workers report them received in this step.
    converted: set = dataclasses.field(default_factory=set)
    #: Nothing in this step but `stores` (and the inner metadata): the
    #: workers skip every other field (most decode steps).
    quiet: bool = False


#: The empty fields of a quiet step's metadata, shared (never changed).
NO_JOBS: tuple = ()
NO_ENTRIES: dict = {}
NO_BLOCKS: frozenset = frozenset()


@dataclasses.dataclass
class KvcsumWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: the inner connector's worker metadata, the
    workers' notes (WorkerNote, TierNote) and their re-checks of sent
    requests (kvcsum.vllm.source_check.SourceNote), gathered over workers by
    vLLM."""

    inner: KVConnectorWorkerMetadata | None = None
    notes: list = dataclasses.field(default_factory=list)
    tier_notes: list = dataclasses.field(default_factory=list)
    source_notes: list = dataclasses.field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvcsumWorkerMetadata)
        if self.inner is None:
            inner = other.inner
        elif other.inner is None:
            inner = self.inner
        else:
            inner = self.inner.aggregate(other.inner)
        return KvcsumWorkerMetadata(
            inner=inner,
            notes=self.notes + other.notes,
            tier_notes=self.tier_notes + other.tier_notes,
            source_notes=self.source_notes + other.source_notes,
        )
