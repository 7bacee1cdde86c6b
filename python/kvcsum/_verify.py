"""The scheduler side: Verifier and its Report (Mismatch, LayerDifference,
Uncompared, Finding), and the base64 of payloads."""

from __future__ import annotations

import ctypes
import dataclasses
from ctypes import byref, c_char_p, c_size_t, c_uint32, c_uint64, c_void_p

from . import _lib
from ._base import _Handle, _bytes_of, _c, _check, _create, _enum, _flag, _int, _member, _of_type, _sized, library
from ._constants import Policy, Reason, Role, Verdict
from ._worker import Blocks


@dataclasses.dataclass(frozen=True)
class LayerDifference:
    """A layer head range that differs in one replica check.

    Thread safety: immutable (a frozen dataclass); share it freely."""

    layer_number: int
    first_head: int
    num_heads: int
    check: int


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Consumer block positions of one group that differ, and the request
    tokens compared there (a state group's: position 0, the tokens
    `[0, num_tokens)` whose state it holds).

    Thread safety: immutable (a frozen dataclass); share it freely."""

    group_id: int
    first_position: int
    num_positions: int
    first_token: int
    num_tokens: int
    failed_checks: tuple
    localised: bool
    layers: tuple


@dataclasses.dataclass(frozen=True)
class Uncompared:
    """Consumer block positions `[first_position, first_position +
    num_positions)` of one group that were loaded (hold valid tokens) but
    that no compared position covers: a verdict says nothing about them.

    Thread safety: immutable (a frozen dataclass); share it freely."""

    group_id: int
    first_position: int
    num_positions: int


@dataclasses.dataclass(frozen=True)
class Finding:
    """A reason the load or a group was not compared: `reason` is a Reason
    (NO_CHECKSUMS ... DECODING_DIFFERS), `group_id` WHOLE_LOAD for the whole
    load.

    Thread safety: immutable (a frozen dataclass); share it freely."""

    reason: Reason
    reason_name: str
    group_id: int
    message: str


class Report(_Handle):
    """A verifier's judgement of one load (kvcs_report); independent of its
    verifier.

    Thread safety: immutable; every property may be read concurrently."""

    _destroy = "kvcs_report_destroy"
    _req_id = ""

    @property
    def req_id(self) -> str:
        """The request the report judged (repair_plan plans its blocks)."""
        return self._req_id

    def _describe(self) -> str:
        verdict, reason = self.verdict, self.reason
        return (
            f"{getattr(verdict, 'name', verdict)} passed={self.passed} reason={getattr(reason, 'name', reason)} "
            f"mismatches={self._count(self._lib.kvcs_report_num_mismatches)} "
            f"compared_positions={self.compared_positions}"
        )

    def _u32(self, function) -> int:
        value = c_uint32()
        with self._use() as handle:
            _check(function(handle, byref(value)))
        return value.value

    def _u64(self, function) -> int:
        value = c_uint64()
        with self._use() as handle:
            _check(function(handle, byref(value)))
        return value.value

    def _count(self, function) -> int:
        value = c_size_t()
        with self._use() as handle:
            _check(function(handle, byref(value)))
        return value.value

    @property
    def verdict(self) -> Verdict:
        """Verdict.MATCH, MISMATCH or UNVERIFIED."""
        return _member(Verdict, self._u32(self._lib.kvcs_report_verdict))

    @property
    def verdict_name(self) -> str:
        """"KVCS_VERDICT_MATCH", ..."""
        return self._lib.kvcs_verdict_name(self.verdict).decode()

    @property
    def passed(self) -> bool:
        """Whether the load may proceed under the verifier's policy."""
        return bool(self._u32(self._lib.kvcs_report_passed))

    @property
    def reason(self) -> Reason:
        """The first finding's reason (Reason.NO_CHECKSUMS ...; Reason.NONE
        when none)."""
        return _member(Reason, self._u32(self._lib.kvcs_report_reason))

    @property
    def message(self) -> str:
        """One line for a log."""
        text = c_char_p()
        with self._use() as handle:
            _check(self._lib.kvcs_report_message(handle, byref(text)))
            return text.value.decode(errors="replace")

    @property
    def compared_positions(self) -> int:
        """Block positions compared over all groups."""
        return self._u64(self._lib.kvcs_report_compared_positions)

    @property
    def uncompared_positions(self) -> int:
        """The consumer's loaded block positions (holding valid tokens, in
        the groups compared) that no compared position covers: where block
        sizes differ, a leading partial run; positions past the producer's
        token count. Such a load is UNVERIFIED (UNCOMPARED_POSITIONS) unless
        Verifier.set_require_coverage(False) opted out; then a MATCH says
        nothing about them. 0 when everything loaded was compared."""
        return self._u64(self._lib.kvcs_report_uncompared_positions)

    @property
    def uncompared(self) -> list[Uncompared]:
        """Where the positions uncompared_positions counts lie: per group,
        ranges of the consumer's block positions that were loaded (hold
        valid tokens) but that no compared position covers, ascending
        within a group. Empty when everything loaded was compared."""
        out = []
        with self._use() as handle:
            count = c_size_t()
            _check(self._lib.kvcs_report_num_uncompared(handle, byref(count)))
            for i in range(count.value):
                group, first, num = c_uint32(), c_uint64(), c_uint64()
                _check(self._lib.kvcs_report_uncompared(handle, i, byref(group), byref(first), byref(num)))
                out.append(Uncompared(group.value, first.value, num.value))
        return out

    @property
    def mismatches(self) -> list[Mismatch]:
        """The differing positions, per group."""
        out = []
        with self._use() as handle:
            count = c_size_t()
            _check(self._lib.kvcs_report_num_mismatches(handle, byref(count)))
            for i in range(count.value):
                entry = _lib.MismatchStruct()
                _check(self._lib.kvcs_report_mismatch(handle, i, byref(entry)))
                checks = []
                for k in range(entry.num_failed_checks):
                    value = c_uint32()
                    _check(self._lib.kvcs_report_failed_check(handle, i, k, byref(value)))
                    checks.append(value.value)
                layers = []
                for k in range(entry.num_layers):
                    difference = _lib.LayerDifferenceStruct()
                    _check(self._lib.kvcs_report_layer_difference(handle, i, k, byref(difference)))
                    layers.append(
                        LayerDifference(
                            difference.layer_number, difference.first_head, difference.num_heads, difference.check
                        )
                    )
                out.append(
                    Mismatch(
                        entry.group_id,
                        entry.first_position,
                        entry.num_positions,
                        entry.first_token,
                        entry.num_tokens,
                        tuple(checks),
                        bool(entry.localised),
                        tuple(layers),
                    )
                )
        return out

    @property
    def findings(self) -> list[Finding]:
        """Why the load or groups were not compared."""
        out = []
        with self._use() as handle:
            count = c_size_t()
            _check(self._lib.kvcs_report_num_unverified(handle, byref(count)))
            for i in range(count.value):
                reason, group, text = c_uint32(), c_uint32(), c_char_p()
                _check(self._lib.kvcs_report_unverified(handle, i, byref(reason), byref(group), byref(text)))
                name = self._lib.kvcs_unverified_reason_name(reason.value).decode()
                message = text.value.decode(errors="replace")
                out.append(Finding(_member(Reason, reason.value), name, group.value, message))
        return out


class Verifier(_Handle):
    """A scheduler's verifier (kvcs_verifier): payloads on the producer,
    verdicts on the consumer.

    Thread safety: every call may run concurrently with any other, from any
    thread (the C verifier guards its state itself); close() frees it once
    the calls in progress have returned."""

    _destroy = "kvcs_verifier_destroy"

    def __init__(self, num_workers: int):
        num_workers = _int(num_workers, "uint32_t", "num_workers")
        super().__init__(_create(library().kvcs_verifier_create, num_workers))
        self._num_workers = num_workers
        self._policy = Policy.FAIL_CLOSED  # the C verifier's default until set_policy

    def _describe(self) -> str:
        return f"num_workers={self._num_workers} policy={getattr(self._policy, 'name', self._policy)}"

    def set_policy(self, policy: int) -> None:
        """FAIL_OPEN or FAIL_CLOSED."""
        policy = _enum(policy, Policy, "policy")
        with self._use() as handle:
            _check(self._lib.kvcs_verifier_set_policy(handle, policy))
            self._policy = _member(Policy, policy)

    def set_extension(self, on: bool) -> None:
        """Producer: payloads carry the kvcsum extension."""
        on = _flag(on, "on")
        with self._use() as handle:
            _check(self._lib.kvcs_verifier_set_extension(handle, on))

    def set_require_coverage(self, on: bool) -> None:
        """Consumer: with True (the default) a load is UNVERIFIED
        (UNCOMPARED_POSITIONS, the finding naming each group's uncompared
        ranges) when some loaded position was not compared
        (Report.uncompared_positions > 0) and none differs: positions
        nobody compared never count as passed. False is the explicit
        opt-out of a caller that reloads or recomputes the positions
        Report.uncompared lists itself (the vLLM connector does): the load
        is then judged on the positions both sides hold with equal valid
        tokens alone. Applies to check and check_stored."""
        on = _flag(on, "on")
        with self._use() as handle:
            _check(self._lib.kvcs_verifier_set_require_coverage(handle, on))

    def set_producer_tp_size(self, tp_size: int) -> None:
        """Consumer: the producer's TP size."""
        tp_size = _int(tp_size, "uint32_t", "tp_size")
        with self._use() as handle:
            _check(self._lib.kvcs_verifier_set_producer_tp_size(handle, tp_size))

    def set_producer_block_size(self, group_id: int, block_size: int) -> None:
        """Consumer: the producer's block size of a group, which a plain
        payload (no kvcsum extension) does not say: without it such a
        payload's attention group is UNVERIFIED (BLOCK_SIZE_UNKNOWN), even
        where both sides use the same block size."""
        group_id = _int(group_id, "uint32_t", "group_id")
        block_size = _int(block_size, "uint32_t", "block_size")
        with self._use() as handle:
            _check(self._lib.kvcs_verifier_set_producer_block_size(handle, group_id, block_size))

    def expect(self, scheduled: Blocks, role: int) -> None:
        """Registers the requests of `scheduled` in `role`."""
        _of_type(scheduled, Blocks, "scheduled")
        role = _enum(role, Role, "role")
        with self._use() as handle, scheduled._use() as blocks_handle:
            _check(self._lib.kvcs_verifier_expect(handle, blocks_handle, role))

    def forget(self, req_id: str) -> None:
        """Drops a request's state."""
        req = _c(req_id, "req_id")
        with self._use() as handle:
            _check(self._lib.kvcs_verifier_forget(handle, req))

    def add_record(self, record: bytes) -> None:
        """Adds a worker's record (Result.encode())."""
        data, length = _bytes_of(record, "record")
        with self._use() as handle:
            _check(self._lib.kvcs_verifier_add_record(handle, data, length))

    def payload(self, req_id: str) -> bytes:
        """Producer: the payload bytes of `req_id` (vLLM's KVChecksumPayload)."""
        req = _c(req_id, "req_id")
        with self._use() as handle:
            buffer, length = _sized(lambda buf, cap, n: self._lib.kvcs_verifier_payload(handle, req, buf, cap, n))
        return bytes(buffer[:length])

    def _report(self, req_id: str, function, *args) -> Report:
        out = c_void_p()
        with self._use() as handle:
            _check(function(handle, *args, byref(out)))
        report = Report._adopt(out.value)
        report._req_id = req_id
        return report

    def check(self, req_id: str, payload: bytes | str | None) -> Report:
        """Consumer: judges the load of `req_id` against the producer's
        payload: bytes, the base64 text of kv_transfer_params["kv_checksums"],
        or None when the producer sent none."""
        req = _c(req_id, "req_id")
        if payload is None:
            return self._report(req_id, self._lib.kvcs_verifier_check_no_payload, req)
        if isinstance(payload, str):
            return self._report(req_id, self._lib.kvcs_verifier_check_base64, req, _c(payload, "payload"))
        data, length = _bytes_of(payload, "payload")
        return self._report(req_id, self._lib.kvcs_verifier_check, req, data, length)

    def check_stored(self, req_id: str) -> Report:
        """Consumer: judges the offload load of `req_id` from its workers'
        load-check records alone (Worker.check_stored results, encoded and
        added with add_record): MATCH, MISMATCH at the positions whose stored
        checksum failed on some worker, or UNVERIFIED (e.g. a record is not a
        load check's: NOT_LOAD_CHECK)."""
        return self._report(req_id, self._lib.kvcs_verifier_check_stored, _c(req_id, "req_id"))


def base64_encode(data: bytes) -> str:
    """Standard padded base64 of `data` (as kv_transfer_params carries it)."""
    raw, length = _bytes_of(data, "data")
    lib = library()
    buffer, used = _sized(lambda buf, cap, n: lib.kvcs_base64_encode(raw, length, buf, cap, n), ctypes.c_char)
    return bytes(buffer[: used - 1]).decode("ascii")


def base64_decode(text: str) -> bytes:
    """The bytes of standard padded base64 `text`; Malformed otherwise."""
    raw = _c(text, "text")
    lib = library()
    buffer, length = _sized(lambda buf, cap, n: lib.kvcs_base64_decode(raw, len(raw), buf, cap, n))
    return bytes(buffer[:length])
