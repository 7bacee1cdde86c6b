"""The verdict on a consumer's P/D load: one rule, used by both roles.

The scheduler judges async loads (SchedulerRole) and, where the workers
cannot exchange their records, sync ones a step late; a consumer worker
judges sync loads in the step of the load (WorkerRole, the workers' records
gathered by kvcsum.vllm.record_exchange). Both go through `LoadJudge`: the
workers' records and the producer's payload (its checksums as the
scheduler parsed them off kv_transfer_params, `LoadCheck`) in a
kvcsum.Verifier, and from its report the `LoadVerdict`: the verdict, its
reason and message, and the loaded blocks vLLM must compute again (those
that differ, every loaded block of an unverified load under
unverified=fail, and those no comparison covered).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import kvcsum
from kvcsum.vllm.cache_checksums import Job
from kvcsum.vllm.config import group_fingerprint
from kvcsum.vllm.params import Checksums, LoadParams, Unusable, consistency, payload_summary

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["LoadCheck", "LoadVerdict", "LoadJudge", "rewrite_fingerprints", "loaded_block_ids"]

# kvcsum.vllm.common's logger (that module imports this one).
logger = init_logger("vllm.kvcsum")


@dataclasses.dataclass(frozen=True)
class LoadCheck:
    """What judging a load needs besides the workers' records, fixed when
    the scheduler allocates the load (it travels to the workers in the
    step's metadata for a sync load, so it pickles): the producer's
    `checksums` (Checksums, an Unusable, or None when the params carried
    none); `other_request`, whether their token digest covers other tokens
    than the request's; `handed`, the block ids already handed to vLLM as
    load errors in the step of the load (a sync load's blocks that no
    comparison can cover, read off the payload)."""

    checksums: Checksums | Unusable | None
    other_request: bool = False
    handed: frozenset = frozenset()

    @classmethod
    def of(cls, params: LoadParams, token_ids, handed=frozenset()) -> "LoadCheck":
        checksums = params.checksums
        digest = checksums.tokens if isinstance(checksums, Checksums) else None
        return cls(checksums, digest is not None and not digest.covers(token_ids), frozenset(handed))


@dataclasses.dataclass(frozen=True)
class LoadVerdict:
    """A judged load: `verdict` (kvcsum.MATCH, MISMATCH or UNVERIFIED),
    `reason` (the unverified reason's name, "" otherwise), `message`;
    `invalid`, the loaded block ids vLLM must compute again, less those
    already handed (LoadCheck.handed); `mismatched_blocks`, how many blocks
    a MISMATCH names; `uncompared`, the loaded block ids no comparison
    covered (of a MATCH or MISMATCH), and `where` they are in words."""

    verdict: int
    reason: str
    message: str
    invalid: tuple = ()
    mismatched_blocks: int = 0
    uncompared: tuple = ()
    where: str = ""


def rewrite_fingerprints(payload: bytes, replace: dict) -> bytes:
    """The payload with group fingerprints replaced ({group: (old, new)})."""
    import msgspec

    version, num_tokens, groups = msgspec.msgpack.decode(payload)[:3]
    rest = msgspec.msgpack.decode(payload)[3:]
    out = []
    for group_id, fingerprint, first, values in groups:
        old_new = replace.get(group_id)
        if old_new is not None and fingerprint == old_new[0]:
            fingerprint = old_new[1]
        out.append([group_id, fingerprint, first, values])
    return msgspec.msgpack.encode([version, num_tokens, out, *rest])


def loaded_block_ids(job: Job) -> list[int]:
    """Every block id the load holds, group by group."""
    return [b for _, (_, ids) in sorted(job.groups.items()) for b in ids]


class LoadJudge:
    """The consumer's kvcsum.Verifier and the rule that turns its report
    into a LoadVerdict.

    Args:
        kv_cache_config: vLLM's KV cache config (each group's layers, for
            the fingerprint a producer of another block size sent).
        block_sizes: this engine's {group: block size} of the transfer groups.
        num_workers: the records a load needs (TP size times PP size).
        fail_unverified: unverified=fail: every loaded block of an
            unverified load is a load error.
        tp_size: this engine's TP size (a state layer whose rows are
            numbered along TP names their global count in its identity).
    """

    def __init__(
        self,
        kv_cache_config: "KVCacheConfig",
        block_sizes: dict,
        num_workers: int,
        fail_unverified: bool,
        not_checksummed: dict | None = None,
        tp_size: int = 1,
    ):
        self._kv_cache_config = kv_cache_config
        self._tp_size = tp_size
        #: {(group, block size): fingerprint} computed so far (config.group_fingerprint).
        self._fingerprints: dict = {}
        #: {group: reason} of the groups kvcsum cannot checksum: a load that
        #: covers one is never a MATCH (GROUP_NOT_CHECKSUMMED).
        self._not_checksummed = dict(not_checksummed or {})
        self._block_sizes = dict(block_sizes)
        self._fail_unverified = fail_unverified
        self._verifier = kvcsum.Verifier(num_workers)
        self._verifier.set_policy(kvcsum.FAIL_CLOSED if fail_unverified else kvcsum.FAIL_OPEN)
        # The connector's own rule for positions nobody compared is
        # stricter than the library's default (which makes the whole load
        # UNVERIFIED): judge() hands exactly those blocks to vLLM as load
        # errors, whatever the policy, so it opts out explicitly.
        self._verifier.set_require_coverage(False)

    def _fingerprint(self, group: int, block_size: int) -> int:
        """This engine's fingerprint of a group's layers at `block_size`
        (the one a producer of that block size sent), kept once computed."""
        key = (group, block_size)
        if key not in self._fingerprints:
            if len(self._fingerprints) >= 256:
                self._fingerprints.clear()  # a producer's block sizes are its params': bounded
            self._fingerprints[key] = group_fingerprint(self._kv_cache_config, group, block_size, self._tp_size)
        return self._fingerprints[key]

    def expect(self, job: Job) -> None:
        """The load's blocks, before any of its records."""
        with kvcsum.Blocks() as expected:
            job.to_blocks(expected)
            self._verifier.expect(expected, kvcsum.CONSUMER)

    def add_record(self, record: bytes) -> None:
        self._verifier.add_record(record)

    def forget(self, req_id: str) -> None:
        try:
            self._verifier.forget(req_id)
        except kvcsum.NotFound:
            pass

    def judge(self, job: Job, check: LoadCheck) -> LoadVerdict:
        """The verdict on the load, from the records added; the request is
        forgotten then. Never raises: a check that raises is UNVERIFIED
        (CHECK_FAILED)."""
        try:
            verdict, reason, message, invalid, (uncompared, where) = self._check(job, check)
        except Exception as error:  # noqa: BLE001 - a verdict must never take the engine down
            logger.exception("kvcsum: request %s: the load could not be checked", job.req_id)
            verdict, reason, message, invalid, uncompared, where = (
                kvcsum.UNVERIFIED, "CHECK_FAILED", f"the check raised {type(error).__name__}: {error}", [], [], "",
            )
        finally:
            self.forget(job.req_id)
        mismatched = len(invalid) if verdict == kvcsum.MISMATCH else 0
        skipped = sorted(g for g in job.groups if g in self._not_checksummed)
        if verdict == kvcsum.MATCH and skipped:
            # The groups compared matched, but the load also filled a group
            # no checksum covers: never silent, never a MATCH.
            verdict, reason = kvcsum.UNVERIFIED, "GROUP_NOT_CHECKSUMMED"
            message = "the load filled groups kvcsum does not checksum: " + "; ".join(
                f"group {g} ({self._not_checksummed[g]})" for g in skipped
            ) + f" (the other groups matched: {message})"
        if verdict == kvcsum.UNVERIFIED:
            invalid = loaded_block_ids(job) if self._fail_unverified else []
            uncompared, where = [], ""
        elif uncompared:
            # Blocks no comparison covered (a last partial block holding
            # other token counts on the two sides, a run the consumer holds
            # only part of) are never used unchecked: they are load errors,
            # so vLLM computes them (and what follows them) again. Those
            # handed in the step of the load are being computed again.
            invalid = sorted(set(invalid) | (set(uncompared) - check.handed))
        return LoadVerdict(verdict, reason, message, tuple(sorted(invalid)), mismatched, tuple(uncompared), where)

    def close(self) -> None:
        self._verifier.close()

    def _check(self, job: Job, check: LoadCheck) -> tuple[int, str, str, list, tuple]:
        """(verdict, reason name, message, invalid block ids, (uncompared
        block ids, where they are))."""
        nothing = ([], "")
        checksums = check.checksums
        if isinstance(checksums, Unusable):
            return kvcsum.UNVERIFIED, checksums.reason, checksums.message, [], nothing
        payload, producer_sizes = None, {}
        if isinstance(checksums, Checksums):
            if check.other_request:
                return (
                    kvcsum.UNVERIFIED,
                    "OTHER_REQUEST",
                    f"the checksums cover other tokens than this request's first {checksums.tokens.count} (a payload of another request)",
                    [],
                    nothing,
                )
            payload, producer_sizes = checksums.payload, checksums.block_sizes
            try:
                raw = kvcsum.base64_decode(payload)
            except kvcsum.Error:
                raw = None  # the verifier names what is wrong with it
            if raw is not None:
                disagreement = consistency(checksums, payload_summary(raw))
                if disagreement is not None:
                    return kvcsum.UNVERIFIED, disagreement.reason, disagreement.message, [], nothing
            replace = {}
            for group, size in producer_sizes.items():
                own = self._block_sizes.get(group)
                if own is not None and size != own:
                    replace[group] = (self._fingerprint(group, size), self._fingerprint(group, own))
            if replace:
                try:
                    payload = rewrite_fingerprints(raw, replace)
                except Exception:  # noqa: BLE001 - left for the verifier to judge
                    payload = checksums.payload
        # The verifier keeps one producer block size per group: set every
        # group's for this load, its own where the producer did not say (a
        # vLLM fork producer does not). That is no guess: the fork's layer
        # identities hash the block size into the group fingerprint, so a
        # producer of another block size sent another fingerprint, and the
        # verifier reports FINGERPRINT_DIFFERS, never compares.
        for group, own in self._block_sizes.items():
            self._verifier.set_producer_block_size(group, producer_sizes.get(group, own))
        with self._verifier.check(job.req_id, payload) as report:
            verdict, message = report.verdict, report.message
            reason = ""
            if verdict == kvcsum.UNVERIFIED:
                findings = report.findings
                reason = findings[0].reason_name.replace("KVCS_UNVERIFIED_", "") if findings else "UNKNOWN"
            invalid = []
            if verdict == kvcsum.MISMATCH:
                invalid, where = self._repair(report, job)
                message = f"{message} [{where}]"
            uncompared = nothing
            if verdict != kvcsum.UNVERIFIED and report.uncompared_positions:
                uncompared = self._uncompared_blocks(report.uncompared, job)
        return verdict, reason, message, invalid, uncompared

    def _uncompared_blocks(self, ranges: list, job: Job) -> tuple[list, str]:
        """The loaded block ids at the report's uncompared positions
        (kvcsum.Report.uncompared: consumer block positions per group), and
        where they are in words."""
        ids, where = set(), []
        for u in ranges:
            group = job.groups.get(u.group_id)
            if group is None:
                continue
            first, block_ids = group
            # Bounded by the job: the library names only positions it loaded.
            lo = max(u.first_position, first)
            hi = min(u.first_position + u.num_positions, first + len(block_ids))
            ids.update(block_ids[p - first] for p in range(lo, hi))
            where.append(f"group {u.group_id} positions {u.first_position}..{u.first_position + u.num_positions}")
        return sorted(ids), ", ".join(where)

    def _repair(self, report: "kvcsum.Report", job: Job) -> tuple[list, str]:
        """The block ids to load again after a MISMATCH, and where they are.
        Where the repair plan refuses (another group could not be compared,
        so reloading blocks would not make the load verified) every loaded
        block is named: the load is repeated whole."""
        positions = ", ".join(
            f"group {m.group_id} positions {m.first_position}..{m.first_position + m.num_positions} "
            f"(tokens {m.first_token}..{m.first_token + m.num_tokens})"
            for m in report.mismatches
        )
        tables = {g: (first, ids) for g, (first, ids) in job.groups.items()}
        try:
            plan = kvcsum.repair_plan(report, tables, dict(self._block_sizes))
        except kvcsum.Error as error:
            invalid = loaded_block_ids(job)
            return invalid, f"{positions}; the whole load is repeated: {error}"
        invalid = sorted({b.block_id for blocks in plan.values() for b in blocks})
        return invalid, f"{positions}; blocks {invalid}"
