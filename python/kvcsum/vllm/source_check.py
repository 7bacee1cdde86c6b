"""The producer's re-check of a sent request's blocks: did the source change
during the send?

A producer's payload holds the checksums of a request's blocks as its
prompt's forward left them. vLLM keeps those blocks for the wrapped
connector until it reports the request finished sending (its
request_finished asked vLLM to delay the free); vLLM frees them only when
the scheduler reads that report (Scheduler._update_from_kv_xfer_finished,
after the worker's step). In the worker's step that reports it, the blocks
therefore still hold the request's KV, unless something wrote them during
the send: a block reused or written while it was read (a page-reuse or a
race in the engine or the transfer). Each worker then checksums the
request's blocks again and compares them, position by position, with the
checksums the payload was made of; the scheduler gathers the workers'
notes and counts the request as changed (logging "source changed during
send" with the blocks) or unchanged.

A consumer's MISMATCH is then told apart: with the producer's source
changed, the damage is on the sender; with it unchanged, the bytes the
transfer read were those checksummed, and the damage is on the wire or on
the receiver.

`WorkerSourceCheck` is the worker's part (one per TP rank and PP stage),
`SchedulerSourceCheck` the scheduler's; `SourceNote` passes between them
in the worker metadata, and the requests whose blocks vLLM freed without a
send (or that were preempted) go to the workers in the connector metadata
(`KvcsumConnectorMetadata.sources_released`), so that a worker keeps the
checksums only of requests still being sent.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

import kvcsum
from kvcsum.vllm.common import logger

if TYPE_CHECKING:
    from kvcsum.vllm.cache_checksums import CacheChecksummer, Job, PendingRecord
    from kvcsum.vllm.stats import KvcsumStats

__all__ = ["SourceNote", "WorkerSourceCheck", "SchedulerSourceCheck", "MAX_KEPT"]

#: Most requests a worker keeps checksums of while they are being sent;
#: beyond it the oldest are dropped (and not re-checked), so a wrapped
#: connector that never reports a send finished cannot grow it unbounded.
MAX_KEPT = 16384


@dataclasses.dataclass(frozen=True)
class SourceNote:
    """One worker's re-check of a sent request: `changed` the blocks whose
    checksums differ from those the payload was made of, each
    (group_id, position, block_id); `num_blocks` the block positions
    compared; `num_tokens` the tokens of KV the payload covers; `error`
    says why the blocks could not be re-checked (then nothing was
    compared)."""

    worker: str
    req_id: str
    changed: tuple = ()
    num_blocks: int = 0
    num_tokens: int = 0
    error: str = ""


def _values(result: "kvcsum.Result", job: "Job") -> dict:
    """{group_id: (first_position, {column key: values})} of a finished
    result, for the job's groups the worker checksummed."""
    out = {}
    for group_id in sorted(job.groups):
        try:
            first, positions, _ = result.group(job.req_id, group_id)
        except kvcsum.Error:
            continue  # a group this worker does not checksum (skipped)
        if positions:
            out[group_id] = (first, result.columns(job.req_id, group_id))
    return out


def _compare(job: "Job", before: dict, after: dict) -> tuple[tuple, int]:
    """(changed (group, position, block id), positions compared) of two
    `_values` of one job; ValueError when their shapes differ (nothing is
    then compared)."""
    if set(before) != set(after):
        raise ValueError(f"groups {sorted(before)} were checksummed before, {sorted(after)} now")
    changed, compared = [], 0
    for group_id, (first, columns) in sorted(before.items()):
        first_after, columns_after = after[group_id]
        if first_after != first or set(columns_after) != set(columns):
            raise ValueError(f"group {group_id} has other positions or columns than before")
        job_first, block_ids = job.groups[group_id]
        differ = np.zeros(0, dtype=bool)
        for key, values in columns.items():
            now = columns_after[key]
            if now.shape != values.shape:
                raise ValueError(f"group {group_id} has {now.shape[0]} positions, {values.shape[0]} before")
            differ = (values != now) if differ.size == 0 else (differ | (values != now))
        compared += int(differ.size)
        for index in np.flatnonzero(differ):
            position = first + int(index)
            offset = position - job_first
            block_id = int(block_ids[offset]) if 0 <= offset < len(block_ids) else -1
            changed.append((group_id, position, block_id))
    return tuple(changed), compared


@dataclasses.dataclass
class _Kept:
    job: "Job"
    pending: "PendingRecord | None"  # until its values are read
    values: dict | None = None


class WorkerSourceCheck:
    """A worker's part: keeps the checksums of each producer request (the
    values its payload is made of) and, once the wrapped connector reports
    the request finished sending, checksums its blocks again and notes the
    positions that differ.

    Args:
        checksummer: the worker's CacheChecksummer.
        worker_key: the worker's name in notes ("pp0.tp1").
        observe: called with the seconds of each re-check's checksum call.
        max_kept: most requests kept (`MAX_KEPT`).
    """

    def __init__(
        self,
        checksummer: "CacheChecksummer",
        worker_key: str,
        observe: Callable[[float], None] | None = None,
        max_kept: int = MAX_KEPT,
    ):
        self._checksummer = checksummer
        self._worker_key = worker_key
        self._observe = observe
        self._max_kept = max_kept
        self._kept: dict[str, _Kept] = {}
        self._made: list = []  # the _Kept of this step's producer checksums
        self._rechecks: list = []  # (kept, pending re-check, error)
        self._dropped_logged = False

    def made(self, job: "Job", pending: "PendingRecord | None") -> None:
        """A producer checksum of `job` was queued (its record goes into
        the payload): its values are kept once `collect` reads them."""
        self._kept.pop(job.req_id, None)
        if pending is None:
            return
        kept = _Kept(job, pending)
        self._kept[job.req_id] = kept
        self._made.append(kept)
        while len(self._kept) > self._max_kept:
            oldest = next(iter(self._kept))
            self._kept.pop(oldest)
            if not self._dropped_logged:
                self._dropped_logged = True
                logger.warning(
                    "kvcsum: worker %s keeps the checksums of %d requests being sent; the oldest (%s) is no longer "
                    "re-checked when its send finishes (does the wrapped connector report finished_sending?)",
                    self._worker_key, self._max_kept, oldest,
                )

    @property
    def busy(self) -> bool:
        """Whether `collect` or `notes` has anything to do this step."""
        return bool(self._made or self._rechecks)

    def collect(self) -> None:
        """Reads the values of the producer checksums queued this step (in
        build_connector_worker_meta, before their records are encoded and
        their results closed)."""
        made, self._made = self._made, []
        for kept in made:
            pending, kept.pending = kept.pending, None
            req_id = kept.job.req_id
            if self._kept.get(req_id) is not kept:
                continue  # replaced or dropped since
            try:
                pending.wait()
                kept.values = _values(pending.result, kept.job)
            except kvcsum.Error as error:
                logger.warning("kvcsum: worker %s: request %s will not be re-checked: %s", self._worker_key, req_id, error)
                self._kept.pop(req_id, None)

    def release(self, req_ids: Iterable[str]) -> None:
        """Requests whose blocks vLLM freed without a send, or that were
        preempted: their checksums are no longer those of their blocks."""
        for req_id in req_ids:
            self._kept.pop(req_id, None)

    def sending_finished(self, req_ids: Iterable[str]) -> None:
        """The wrapped connector reports these requests finished sending
        (get_transfer_results): their blocks are checksummed again (queued
        on a device), before vLLM frees them."""
        for req_id in req_ids:
            kept = self._kept.pop(req_id, None)
            if kept is None or kept.values is None:
                continue
            try:
                pending = self._checksummer.checksum([kept.job], kvcsum.PRODUCER)
            except kvcsum.Error as error:
                self._rechecks.append((kept, None, f"the re-check's checksum call failed: {error}"))
                continue
            self._rechecks.append((kept, pending, ""))

    def notes(self) -> list:
        """The SourceNotes of the re-checks queued this step (waits for a
        device's results)."""
        out = []
        for kept, pending, error in self._rechecks:
            job = kept.job
            if pending is None:
                out.append(SourceNote(self._worker_key, job.req_id, error=error))
                continue
            try:
                pending.wait()
                after = _values(pending.result, job)
                changed, compared = _compare(job, kept.values, after)
                out.append(SourceNote(self._worker_key, job.req_id, changed, compared, job.num_tokens))
            except (kvcsum.Error, ValueError) as failure:
                out.append(SourceNote(self._worker_key, job.req_id, error=f"the blocks could not be re-checked: {failure}"))
            finally:
                pending.result.close()
                if self._observe is not None:
                    self._observe(pending.seconds)
        self._rechecks = []
        return out

    def kept(self) -> set:
        """The requests whose checksums this worker keeps (for tests)."""
        return set(self._kept)


def _ranges(positions: list, block_size: int | None, num_tokens: int) -> str:
    """"2..3 (tokens 16..31), 5 (tokens 40..44)" of sorted block positions
    (tokens below num_tokens)."""
    runs = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    out = []
    for a, b in runs:
        text = f"{a}" if a == b else f"{a}..{b}"
        if block_size:
            last = (b + 1) * block_size - 1
            text += f" (tokens {a * block_size}..{min(last, num_tokens - 1) if num_tokens else last})"
        out.append(text)
    return ", ".join(out)


class SchedulerSourceCheck:
    """The scheduler's part: tells the workers which requests' checksums to
    drop, gathers their SourceNotes, and judges a request once vLLM hears
    it finished sending (every worker reported it).

    A request counts as changed when any worker found a block changed; as
    unchanged only when every worker vLLM waits for (its expected count of
    finished_sending reports, all workers by default) compared its blocks
    and none changed; otherwise (a worker could not re-check, or sent no
    note) as unchecked. Once judged, every worker drops what it still
    keeps of the request (those the wrapped connector has report nothing).

    Args:
        stats: returns the KvcsumStats the counts go into.
        block_sizes: {group: block size} (for the token ranges logged).
        num_workers: TP size times PP size (every worker re-checks its part).
    """

    def __init__(self, stats: Callable[[], "KvcsumStats"], block_sizes: dict, num_workers: int):
        self._stats = stats
        self._num_workers = num_workers
        self._block_sizes = dict(block_sizes)
        self._released: list = []
        self._sending: set = set()
        self._notes: dict[str, list] = {}
        #: {req_id: "changed" | "unchanged" | "unchecked"} of the requests
        #: judged so far (for tests and tools; bounded).
        self.outcomes: dict[str, str] = {}

    def finished(self, req_id: str, delay: bool) -> None:
        """request_finished of a request the producer checksummed: `delay`
        when the wrapped connector keeps its blocks until it is sent."""
        if delay:
            self._sending.add(req_id)
        else:
            self._released.append(req_id)

    def released(self, preempted: Iterable[str] = ()) -> list:
        """The requests whose checksums the workers drop, for this step's
        metadata: those freed without a send, and the preempted."""
        if not (self._released or preempted):
            return []
        out = self._released + [r for r in preempted if r not in self._sending]
        self._released = []
        return out

    def reported(self, notes: Iterable[SourceNote]) -> None:
        """The workers' notes of this step."""
        for note in notes:
            if note.req_id in self._sending:
                self._notes.setdefault(note.req_id, []).append(note)

    def sent(self, finished_sending: Iterable[str] | None, expected: int = 0) -> None:
        """vLLM's finished_sending of this step (the `expected` workers, all
        when 0, reported the request sent, each with its note in that
        step): each request is judged."""
        for req_id in finished_sending or ():
            if req_id not in self._sending:
                continue
            self._sending.discard(req_id)
            self._released.append(req_id)
            self._judge(req_id, self._notes.pop(req_id, []), expected if expected > 0 else self._num_workers)

    def _judge(self, req_id: str, notes: list, expected: int) -> None:
        if not notes:
            return  # no worker kept its checksums (preempted, or none made)
        stats = self._stats()
        if len(self.outcomes) > 4096:
            self.outcomes.clear()
        changed = [n for n in notes if n.changed]
        failed = [n for n in notes if n.error]
        compared = {n.worker for n in notes if not n.error}
        if changed:
            self._log_changed(req_id, changed)
            stats.add("sources_rechecked")
            stats.add("sources_changed")
            stats.add("sources_changed_blocks", len({(g, b) for n in changed for g, _, b in n.changed}))
            self.outcomes[req_id] = "changed"
        elif failed or len(compared) < expected:
            why = [f"{n.worker}: {n.error}" for n in failed]
            if len(compared) + len(failed) < expected:
                why.append(f"{expected - len(compared) - len(failed)} of {expected} workers kept no checksums")
            stats.add("sources_unchecked")
            self.outcomes[req_id] = "unchecked"
            logger.warning("kvcsum: request %s: its blocks could not all be re-checked after the send: %s", req_id, "; ".join(why))
        else:
            stats.add("sources_rechecked")
            self.outcomes[req_id] = "unchanged"

    def _log_changed(self, req_id: str, changed: list) -> None:
        blocks = sorted({(g, p, b) for n in changed for g, p, b in n.changed})
        num_tokens = max(n.num_tokens for n in changed)
        where = []
        for group in sorted({g for g, _, _ in blocks}):
            mine = [(p, b) for g, p, b in blocks if g == group]
            where.append(
                f"group {group} blocks {sorted({b for _, b in mine})} "
                f"(positions {_ranges(sorted({p for p, _ in mine}), self._block_sizes.get(group), num_tokens)})"
            )
        workers = ", ".join(sorted({n.worker for n in changed}))
        logger.error(
            "kvcsum: request %s: source changed during send: %s no longer hold the KV its checksums were made of "
            "(on workers %s); a consumer's MISMATCH of this request is damage on the sender (a block written or "
            "reused while it was being sent), not on the wire",
            req_id, "; ".join(where), workers,
        )
