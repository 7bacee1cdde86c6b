"""kvcsum's check of SGLang P/D transfers across TP sizes and layouts
(docs/sglang.md, "P/D across TP sizes").

SGLang 0.5.23 has no extension point for this, so `activate_pd()` wraps
six of its methods, after checking that SGLang is exactly the version
tested and that each wrapped method (and the failure path it calls) has
the signature this code was written against (anything else fails at
startup, naming what differs). SGLang's general plugin framework runs it
in every SGLang process: the kvcsum wheel's entry point `kvcsum_pd`
(`sglang_plugin`), active where KVCSUM_SGLANG_PD is set.

- `MetadataBuffers.__init__`, `get_buf_infos`, `clear_slot`
  (disaggregation/utils.py): one more metadata buffer, a fixed-size row per
  request slot holding a length-prefixed kvcsum payload. SGLang's own
  transfer moves it with the request's other metadata, after its last KV
  chunk (both engines must activate, with the same row size).
- `SchedulerDisaggregationPrefillMixin.send_kv_chunk` (prefill.py): on a
  request's last chunk, every prefill TP rank checksums the pool pages it
  is about to send (its `MHATokenToKVPool` k_buffer / v_buffer, one kvcsum
  block a page); the ranks' records are gathered over the attention-TP CPU
  group and the producer's payload written into the request's row.
- `DecodeTransferQueue._commit_transfer_to_req` (decode.py): the row is
  read before SGLang frees the metadata slot.
- `SchedulerDisaggregationDecodeMixin._verify_kv_checksums` (decode.py):
  after SGLang's own check, every decode TP rank checksums the request's
  pages in its pool, the records are gathered, and the payload judged. A
  MISMATCH is handed to SGLang's own failure path for a bad transfer
  (`_handle_kv_checksum_mismatch`, which in 0.5.23 aborts the request), with
  the bad pages named; the ranks agree on the set first, as SGLang does.

Verdicts: MATCH (used), MISMATCH (SGLang's failure path), UNVERIFIED (no
payload, a row of another size, a payload too large for the row, another
configuration: admitted unverified and counted, as SGLang admits its own
digests it cannot compare, or refused with `unverified="fail"`).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

import kvcsum
from kvcsum._layers import _hip_version, _memory_of

logger = logging.getLogger("kvcsum.sglang.pd")

TESTED_SGLANG = "0.5.23"
DEFAULT_MAX_PAYLOAD_BYTES = 16384
ROW_MAGIC = b"KVCSPD1\0"
ROW_HEADER = struct.Struct("<8sII")  # magic, row capacity, payload length
TOO_LARGE = 0xFFFFFFFF
GROUP = 0

# What each wrapped method must look like (parameter names, in order).
_EXPECTED = {
    ("sglang.srt.disaggregation.utils", "MetadataBuffers", "__init__"): None,  # checked for 'size' first, below
    ("sglang.srt.disaggregation.utils", "MetadataBuffers", "get_buf_infos"): ["self"],
    ("sglang.srt.disaggregation.utils", "MetadataBuffers", "clear_slot"): ["self", "idx"],
    ("sglang.srt.disaggregation.prefill", "SchedulerDisaggregationPrefillMixin", "send_kv_chunk"): [
        "self", "req", "last_chunk", "end_idx",
    ],
    ("sglang.srt.disaggregation.decode", "DecodeTransferQueue", "_commit_transfer_to_req"): ["self", "decode_req"],
    ("sglang.srt.disaggregation.decode", "SchedulerDisaggregationDecodeMixin", "_verify_kv_checksums"): [
        "self", "batch",
    ],
    ("sglang.srt.disaggregation.decode", "SchedulerDisaggregationDecodeMixin", "_handle_kv_checksum_mismatch"): [
        "self", "req", "msg",
    ],
}


class SGLangMismatch(RuntimeError):
    """The installed SGLang is not the one activate_pd() was written for."""


@dataclass
class PdStats:
    """What the P/D checks did in this process."""

    payloads_sent: int = 0  # prefill: payloads written into a request's row
    payloads_too_large: int = 0  # prefill: payloads that did not fit the row (the decode side: UNVERIFIED)
    matched: int = 0  # decode: MATCH, used
    mismatched: int = 0  # decode: MISMATCH, handed to SGLang's failure path
    unverified: int = 0  # decode: UNVERIFIED (admitted, or failed with unverified="fail")


@dataclass(frozen=True)
class PdVerdict:
    """One decode-side judgement (PdActivation.verdicts)."""

    rid: str
    bootstrap_room: int
    verdict: str  # MATCH, MISMATCH or UNVERIFIED
    bad_pages: tuple  # this rank's pool pages of the positions that differ
    bad_positions: tuple  # the request's page positions that differ
    message: str
    failed: bool  # handed to SGLang's failure path


@dataclass(frozen=True)
class ArrivedPayload:
    """What a request's payload row held when its transfer was committed
    (decode): the payload, or None and why none."""

    payload: Optional[bytes]
    why: str = ""


@dataclass
class PdActivation:
    max_payload_bytes: int
    unverified: str
    stats: PdStats = field(default_factory=PdStats)
    verdicts: "OrderedDict[str, PdVerdict]" = field(default_factory=OrderedDict)
    _originals: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _note(self, verdict: PdVerdict) -> None:
        with self._lock:
            self.verdicts[verdict.rid] = verdict
            while len(self.verdicts) > 4096:
                self.verdicts.popitem(last=False)

    def deactivate(self) -> None:
        """Puts SGLang's methods back (tests; a running engine keeps them)."""
        global _ACTIVE
        for (cls, name), original in self._originals.items():
            setattr(cls, name, original)
        self._originals.clear()
        _ACTIVE = None


_ACTIVE: Optional[PdActivation] = None


# --- the version check ---------------------------------------------------------------


def _resolve():
    """The classes to wrap, after checking SGLang's version and each
    method's signature; raises SGLangMismatch naming every difference."""
    import importlib

    try:
        import sglang
    except ImportError as error:
        raise SGLangMismatch(f"kvcsum.sglang.activate_pd needs SGLang {TESTED_SGLANG}: {error}") from error
    version = getattr(sglang, "__version__", None)
    if version != TESTED_SGLANG:
        raise SGLangMismatch(
            f"kvcsum.sglang.activate_pd wraps SGLang {TESTED_SGLANG}'s P/D internals; the installed SGLang is "
            f"{version!r}. Its P/D methods may differ: refusing to start (docs/sglang.md, 'P/D across TP sizes')"
        )
    problems, classes = [], {}
    for (module_name, class_name, method), wanted in _EXPECTED.items():
        where = f"{module_name}.{class_name}.{method}"
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as error:
            problems.append(f"{module_name}.{class_name} is missing ({error})")
            continue
        function = cls.__dict__.get(method)
        if not callable(function):
            problems.append(f"{where} is missing")
            continue
        names = list(inspect.signature(function).parameters)
        if wanted is None:
            if names[:2] != ["self", "size"] or "hidden_size" not in names:
                problems.append(f"{where} takes ({', '.join(names)}), expected (self, size, hidden_size, ...)")
        elif names != wanted:
            problems.append(f"{where} takes ({', '.join(names)}), expected ({', '.join(wanted)})")
        classes[(class_name, method)] = cls
    if problems:
        raise SGLangMismatch(
            "kvcsum.sglang.activate_pd: SGLang's P/D internals differ from SGLang " f"{TESTED_SGLANG}'s: "
            + "; ".join(problems)
        )
    return classes


def activate_pd(*, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, unverified: str = "admit") -> PdActivation:
    """Turns kvcsum's P/D check on in this process (call it before SGLang
    builds its schedulers, on prefill and decode alike, with the same
    `max_payload_bytes`). `unverified`: "admit" (the default: a transfer
    that cannot be checked is used, counted and logged) or "fail" (it goes
    to SGLang's failure path like a MISMATCH). Calling it again with the
    same settings returns the active activation; other settings raise."""
    global _ACTIVE
    if not isinstance(max_payload_bytes, int) or isinstance(max_payload_bytes, bool) or not (
        256 <= max_payload_bytes <= 1 << 24
    ):
        raise ValueError(f"max_payload_bytes must be an int in [256, {1 << 24}], got {max_payload_bytes!r}")
    if unverified not in ("admit", "fail"):
        raise ValueError(f'unverified must be "admit" or "fail", got {unverified!r}')
    if _ACTIVE is not None:
        if (_ACTIVE.max_payload_bytes, _ACTIVE.unverified) != (max_payload_bytes, unverified):
            raise RuntimeError(
                f"kvcsum.sglang.activate_pd is already active with max_payload_bytes={_ACTIVE.max_payload_bytes}, "
                f"unverified={_ACTIVE.unverified!r}; asked for {max_payload_bytes}, {unverified!r}"
            )
        return _ACTIVE
    classes = _resolve()
    activation = PdActivation(max_payload_bytes=max_payload_bytes, unverified=unverified)
    _wrap(activation, classes)
    _ACTIVE = activation
    return activation


def active() -> Optional[PdActivation]:
    return _ACTIVE


ENV = "KVCSUM_SGLANG_PD"


def settings_from_env(value: Optional[str]) -> Optional[dict]:
    """KVCSUM_SGLANG_PD's settings: unset, "" or "0": off (None); "1": the
    defaults; otherwise comma-separated key=value pairs of activate_pd's
    arguments ("max_payload_bytes=32768,unverified=fail")."""
    if value is None or value.strip() in ("", "0"):
        return None
    if value.strip() == "1":
        return {}
    settings = {}
    for item in value.split(","):
        key, sep, raw = item.strip().partition("=")
        if not sep or key not in ("max_payload_bytes", "unverified"):
            raise ValueError(
                f'{ENV}={value!r}: expected "1" or key=value pairs of max_payload_bytes, unverified; got {item.strip()!r}'
            )
        if key == "max_payload_bytes":
            try:
                settings[key] = int(raw)
            except ValueError:
                raise ValueError(f"{ENV}={value!r}: max_payload_bytes must be an integer, got {raw!r}") from None
        else:
            settings[key] = raw
    return settings


def sglang_plugin() -> None:
    """SGLang's general plugin entry point (group "sglang.srt.plugins", name
    "kvcsum_pd"), which SGLang's load_plugins() runs early in every one of
    its processes, schedulers included. Activates the P/D check when
    KVCSUM_SGLANG_PD is set, and does nothing otherwise. A refusal (another
    SGLang, a bad setting) stops the process with the message: SGLang's
    plugin loader logs and continues past ordinary exceptions, which would
    leave the engine running without the check the operator asked for."""
    import os

    try:
        settings = settings_from_env(os.environ.get(ENV))
        if settings is None:
            return
        activate_pd(**settings)
    except (SGLangMismatch, ValueError, RuntimeError) as error:
        raise SystemExit(f"kvcsum: {ENV} is set but the P/D check cannot start: {error}") from error
    logger.info("kvcsum: SGLang P/D check active (%s)", settings or "defaults")


# --- the payload row -------------------------------------------------------------------


def _row_bytes(activation: PdActivation) -> int:
    return ROW_HEADER.size + activation.max_payload_bytes


def write_row(buffers, index: int, payload: Optional[bytes], activation: PdActivation) -> bool:
    """Writes `payload` into row `index` of buffers.kvcsum_payload; a
    payload too large for the row is marked so (the decode side reads it
    as UNVERIFIED). True when the payload went in."""
    row = buffers.kvcsum_payload[index]
    row.zero_()
    fits = payload is not None and len(payload) <= activation.max_payload_bytes
    length = len(payload) if fits else TOO_LARGE
    header = ROW_HEADER.pack(ROW_MAGIC, activation.max_payload_bytes, length)
    data = header + (payload if fits else b"")
    import torch

    row[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return fits


def read_row(buffers, index: int) -> tuple[Optional[bytes], str]:
    """(payload or None, why none) of row `index`."""
    row = bytes(buffers.kvcsum_payload[index].cpu().numpy().tobytes())
    magic, capacity, length = ROW_HEADER.unpack_from(row)
    if magic != ROW_MAGIC:
        return None, "no kvcsum payload arrived (the prefill did not activate kvcsum, or wrote none)"
    if capacity != len(row) - ROW_HEADER.size:
        return None, f"the prefill's payload row holds {capacity} bytes, this decode's {len(row) - ROW_HEADER.size}"
    if length == TOO_LARGE:
        return None, f"the prefill's payload did not fit its {capacity}-byte row (raise max_payload_bytes on both)"
    if length > capacity:
        return None, f"the payload row says {length} bytes in a {capacity}-byte row"
    return row[ROW_HEADER.size : ROW_HEADER.size + length], ""


# --- the checksums of one side -------------------------------------------------------


class _Side:
    """One TP rank's kvcsum worker over its MHATokenToKVPool (block = page)."""

    def __init__(self, pool, tp_rank: int, tp_size: int, total_kv_heads: int, group):
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        if not isinstance(pool, MHATokenToKVPool) or type(pool).__name__ != "MHATokenToKVPool":
            raise TypeError(
                f"kvcsum.sglang P/D checks SGLang's MHATokenToKVPool; this engine's pool is {type(pool).__name__}"
            )
        import torch

        if pool.dtype not in (torch.float16, torch.bfloat16, torch.float32) or any(
            getattr(pool, name, None) is not None for name in ("k_scale_buffer", "v_scale_buffer")
        ):
            # fp8 and the quantized recipes are read with scales kvcsum is not
            # told of: equal bytes could mean other values, so no verdict.
            raise TypeError(
                f"kvcsum.sglang P/D checks float16, bfloat16 and float32 KV pools without scales; this pool "
                f"holds {str(pool.dtype).replace('torch.', '')}"
                + (" with scale buffers" if getattr(pool, "k_scale_buffer", None) is not None else "")
            )
        device = pool.k_buffer[0].device
        where = _memory_of(pool.k_buffer[0])  # the binding's one rule (Worker._check_readable)
        if where not in ("cuda", "host"):
            # No engine of kvcsum reads it: kvcsum's device engine is CUDA's
            # (ROCm's torch calls its GPUs "cuda" too), its host engine host
            # memory. Refused here, as a pool kind, so every rank says why.
            place = f"a GPU of ROCm's torch (HIP {_hip_version()})" if where == "rocm" else f"device {device}"
            raise TypeError(
                f"kvcsum.sglang P/D checks KV pools on CUDA GPUs or in host memory; this engine's pool is on {place}"
            )
        self.page = int(pool.page_size)
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        first_head = kvcsum.rank_heads(tp_rank, tp_size, total_kv_heads).start
        # A GPU pool is read where it lives, on the stream SGLang is on when it
        # computes its own digest at the same two points (not run on the CPU test).
        self.cuda = where == "cuda"
        worker = kvcsum.Worker(
            tp_rank=tp_rank, tp_size=tp_size, device=device.index if self.cuda else kvcsum.HOST
        )
        for layer in range(pool.layer_num):
            k, v = pool.k_buffer[layer], pool.v_buffer[layer]
            worker.add_region_of(k)
            worker.add_region_of(v)
        worker.add_group(GROUP, self.page)
        for layer in range(pool.layer_num):
            # [tokens, heads, dim] with token 0 of page p at p * page: pages of NHD.
            k, v = (x[layer].unflatten(0, (-1, self.page)) for x in (pool.k_buffer, pool.v_buffer))
            worker.add_layer(
                kvcsum.layer(k, "NHD", layer_number=pool.start_layer + layer, first_head=first_head, v=v)
            )
            # The element type and head size the engine reads the bytes as: two
            # engines that differ there (fp16 and bf16 are the same width) are
            # UNVERIFIED, never a MISMATCH.
            worker.set_layer_decoding(
                GROUP, pool.start_layer + layer, dtype=str(pool.dtype).replace("torch.", ""), head_size=int(pool.head_dim)
            )
        self.worker = worker
        self.lock = threading.Lock()

    def blocks(self, req_id: str, tokens, start: int, end: int, page_ids) -> kvcsum.Blocks:
        blocks = kvcsum.Blocks().add_request(req_id, end)
        blocks.add_group(req_id, GROUP, [int(p) for p in page_ids], first_position=start // self.page)
        blocks.set_hashes(req_id, GROUP, _page_hashes(tokens, start, end, self.page))
        return blocks

    def records(self, blocks: kvcsum.Blocks, role) -> list:
        stream = None
        if self.cuda:
            import torch

            stream = torch.cuda.current_stream()
        with self.lock, self.worker.checksum(blocks, role, cuda_stream=stream) as result:
            mine = result.wait().encode()
        return _all_gather(mine, self.group, self.tp_size)


def _page_hashes(tokens, start: int, end: int, page: int) -> list:
    """A chain over the request's token ids, one hash a page from page
    0, so a page is bound to the tokens before and in it; returns those of
    the pages [start, end) covers."""
    ids = np.asarray(list(tokens[:end]), dtype=np.int64)
    digest, out = b"kvcsum-sglang-pd", []
    for first in range(0, end, page):
        digest = hashlib.sha256(digest + ids[first : first + page].tobytes()).digest()
        if first >= start - start % page:
            out.append(digest)
    return out


def _all_gather(record: bytes, group, size: int) -> list:
    if size == 1 or group is None:
        return [record]
    import torch.distributed as dist

    out = [None] * size
    dist.all_gather_object(out, record, group=group)
    return out


def _agree(flags: list, group, size: int) -> list:
    """The ranks' flags, MAX-reduced (SGLang's TP ranks must drop the same
    requests or hang on the next collective)."""
    if size == 1 or group is None or not flags:
        return flags
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(flags, dtype=torch.int32)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def _side_of(scheduler, manager):
    """This rank's _Side, or a string saying why the engine is not checked."""
    side = getattr(scheduler, "_kvcsum_pd_side", None)
    if side is None:
        side = _unsupported(manager)
        if not side:
            pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
            args = manager.kv_args
            try:
                side = _Side(
                    pool,
                    tp_rank=int(manager.attn_tp_rank),
                    tp_size=int(manager.attn_tp_size),
                    total_kv_heads=int(getattr(args, "total_kv_head_num", 0) or pool.head_num * manager.attn_tp_size),
                    group=scheduler.attn_tp_cpu_group,
                )
            except TypeError as error:  # another pool: the same on every rank
                side = str(error)
        scheduler._kvcsum_pd_side = side
    if isinstance(side, str):
        _tell_once(side)
    return side


def _req_id(req) -> str:
    return f"sglang-room-{int(req.bootstrap_room)}"


def _is_health_check(req) -> bool:
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    return isinstance(req.rid, str) and req.rid.startswith(HEALTH_CHECK_RID_PREFIX)


# --- prefill -------------------------------------------------------------------------


def prefill_payload(scheduler, req, end_idx: Optional[int], activation: PdActivation) -> Optional[bytes]:
    """The producer's payload of `req`'s pages [disagg_decode_prefix_len,
    end): every prefill TP rank's record, gathered. Collective over the
    attention-TP CPU group."""
    manager = scheduler.disagg_prefill_bootstrap_queue.kv_manager
    side = _side_of(scheduler, manager)
    end = int(end_idx) if end_idx is not None else min(int(req.extend_end), len(req.origin_input_ids))
    start = int(req.disagg_decode_prefix_len)
    rows = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end]
    page_ids = (rows[:: side.page] // side.page).tolist()
    req_id = _req_id(req)
    with side.blocks(req_id, req.origin_input_ids, start, end, page_ids) as blocks:
        records = side.records(blocks, kvcsum.PRODUCER)
        with kvcsum.Verifier(side.tp_size) as verifier:
            verifier.set_extension(True)
            verifier.expect(blocks, kvcsum.PRODUCER)
            for record in records:
                verifier.add_record(record)
            return verifier.payload(req_id)


def _unsupported(manager) -> str:
    """Why this engine's transfers are not checked ("" when they are)."""
    pp = int(getattr(manager, "pp_size", 1) or 1)
    if pp > 1:
        return f"pipeline parallelism (pp_size {pp}) is not covered: each stage sends its own layers and metadata"
    return ""


_TOLD = set()


def _tell_once(why: str) -> None:
    if why not in _TOLD:
        _TOLD.add(why)
        logger.warning("kvcsum: P/D transfers of this engine are not checked: %s", why)


def _wrapped_send_kv_chunk(original: Callable, activation: PdActivation):
    def send_kv_chunk(self, req, last_chunk: bool = False, end_idx: Optional[int] = None):
        if last_chunk:
            buffers, index = self.disagg_metadata_buffers, req.metadata_buffer_index
            side = _side_of(self, self.disagg_prefill_bootstrap_queue.kv_manager)
            if isinstance(side, str) or _is_health_check(req):
                buffers.kvcsum_payload[index].zero_()  # no payload, never a previous request's
            else:
                payload = prefill_payload(self, req, end_idx, activation)
                if write_row(buffers, index, payload, activation):
                    activation.stats.payloads_sent += 1
                else:
                    activation.stats.payloads_too_large += 1
                    logger.warning(
                        "kvcsum: the payload of %s (%d bytes) does not fit the %d-byte row; decode will find it UNVERIFIED",
                        req.rid, len(payload), activation.max_payload_bytes,
                    )
        return original(self, req, last_chunk=last_chunk, end_idx=end_idx)

    return send_kv_chunk


# --- decode --------------------------------------------------------------------------


def take_payload(metadata_buffers, decode_req) -> None:
    """Copies the request's payload row onto its Req before SGLang frees
    the metadata slot (what the _commit_transfer_to_req wrapper does)."""
    payload, why = read_row(metadata_buffers, decode_req.metadata_buffer_index)
    decode_req.req._kvcsum_pd_payload = ArrivedPayload(payload, why)


def _wrapped_commit(original: Callable):
    def _commit_transfer_to_req(self, decode_req):
        take_payload(self.metadata_buffers, decode_req)
        return original(self, decode_req)

    return _commit_transfer_to_req


def decode_judge(scheduler, batch, activation: PdActivation) -> list:
    """Judges every request of `batch` holding a payload row; hands the
    failed ones to SGLang's `_handle_kv_checksum_mismatch` and filters them
    out of the batch. Collective over the attention-TP CPU group (every
    rank runs the same batch). Returns the PdVerdicts."""
    candidates = []
    for i, req in enumerate(batch.reqs):
        if hasattr(req, "_kvcsum_pd_payload"):
            if _is_health_check(req):  # SGLang's own digest skips these too
                del req._kvcsum_pd_payload
            else:
                candidates.append((i, req))
    if not candidates:
        return []
    manager = scheduler.disagg_decode_prealloc_queue.kv_manager
    side = _side_of(scheduler, manager)
    if isinstance(side, str):  # not checked here: UNVERIFIED, with the reason (the same on every rank)
        out = [_unchecked(scheduler, req, side, activation) for _, req in candidates]
        if activation.unverified == "fail":
            drop = {i for i, _ in candidates}
            batch.filter_batch(keep_indices=[i for i in range(len(batch.reqs)) if i not in drop])
        return out
    judged = []
    for i, req in candidates:
        arrived = req._kvcsum_pd_payload
        payload, why = arrived.payload, arrived.why
        del req._kvcsum_pd_payload  # judged once, as SGLang's own digest
        end = len(req.origin_input_ids)
        start = int(req.kv.cache_protected_len)
        rows = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end]
        page_ids = (rows[:: side.page] // side.page).tolist()
        req_id = _req_id(req)
        with side.blocks(req_id, req.origin_input_ids, start, end, page_ids) as blocks:
            records = side.records(blocks, kvcsum.CONSUMER)
            with kvcsum.Verifier(side.tp_size) as verifier:
                # The policy says what an UNVERIFIED load becomes, as the message tells.
                verifier.set_policy(kvcsum.FAIL_CLOSED if activation.unverified == "fail" else kvcsum.FAIL_OPEN)
                verifier.expect(blocks, kvcsum.CONSUMER)
                for record in records:
                    verifier.add_record(record)
                with verifier.check(req_id, payload) as report:
                    verdict, reason = report.verdict, f"reason {getattr(report.reason, 'name', report.reason)}"
                    first_page = start // side.page
                    positions = sorted(
                        {q for m in report.mismatches for q in range(m.first_position, m.first_position + m.num_positions)}
                    )
                    message = report.message if payload is not None else f"{why} ({report.message})"
        bad_pages = tuple(page_ids[q - first_page] for q in positions if 0 <= q - first_page < len(page_ids))
        judged.append((i, req, verdict, reason, tuple(positions), bad_pages, message))

    def fails(verdict) -> bool:
        return verdict == kvcsum.MISMATCH or (verdict == kvcsum.UNVERIFIED and activation.unverified == "fail")

    flags = _agree([1 if fails(j[2]) else 0 for j in judged], side.group, side.tp_size)
    out, drop = [], set()
    for (i, req, verdict, reason, positions, bad_pages, message), flag in zip(judged, flags):
        name = kvcsum.Verdict(verdict).name
        failed = bool(flag)
        if verdict == kvcsum.MATCH:
            activation.stats.matched += 1
        elif verdict == kvcsum.MISMATCH:
            activation.stats.mismatched += 1
        else:
            activation.stats.unverified += 1
            _tell_unverified(reason, req.rid, message)
        if failed:
            if verdict == kvcsum.MISMATCH:
                text = (
                    f"kvcsum: KV of req={req.rid} bootstrap_room={req.bootstrap_room} differs from what prefill sent "
                    f"at page positions {list(positions)} (this rank's pool pages {list(bad_pages)}): {message}"
                )
            elif verdict == kvcsum.UNVERIFIED:
                text = f"kvcsum: KV of req={req.rid} bootstrap_room={req.bootstrap_room} could not be verified: {message}"
            else:
                text = f"kvcsum: KV of req={req.rid} bootstrap_room={req.bootstrap_room} differs on a peer rank"
            req.kvcsum_bad_pages = bad_pages
            logger.error(text)
            scheduler._handle_kv_checksum_mismatch(req, text)
            drop.add(i)
        else:
            text = message
        result = PdVerdict(
            rid=str(req.rid), bootstrap_room=int(req.bootstrap_room), verdict=name, bad_pages=bad_pages,
            bad_positions=positions, message=text, failed=failed,
        )
        activation._note(result)
        out.append(result)
    if drop:
        batch.filter_batch(keep_indices=[i for i in range(len(batch.reqs)) if i not in drop])
    return out


def _tell_unverified(reason: str, rid, message: str) -> None:
    """The first UNVERIFIED transfer of each reason at warning level, the
    rest at debug level (an engine facing a prefill without kvcsum would
    otherwise log every request); stats().unverified counts them all."""
    if reason not in _TOLD:
        _TOLD.add(reason)
        logger.warning("kvcsum: P/D transfer of %s UNVERIFIED (further ones of this reason at debug level): %s", rid, message)
    else:
        logger.debug("kvcsum: P/D transfer of %s UNVERIFIED: %s", rid, message)


def _unchecked(scheduler, req, why: str, activation: PdActivation) -> PdVerdict:
    del req._kvcsum_pd_payload
    activation.stats.unverified += 1
    failed = activation.unverified == "fail"
    text = f"kvcsum: KV of req={req.rid} bootstrap_room={req.bootstrap_room} could not be verified: {why}"
    if failed:
        logger.error(text)
        scheduler._handle_kv_checksum_mismatch(req, text)
    result = PdVerdict(
        rid=str(req.rid), bootstrap_room=int(req.bootstrap_room), verdict="UNVERIFIED", bad_pages=(),
        bad_positions=(), message=text, failed=failed,
    )
    activation._note(result)
    return result


def _wrapped_verify(original: Callable, activation: PdActivation):
    def _verify_kv_checksums(self, batch):
        original(self, batch)  # SGLang's own digest first (it may drop requests)
        decode_judge(self, batch, activation)

    return _verify_kv_checksums


# --- the metadata buffer ----------------------------------------------------------------


def _wrapped_init(original: Callable, activation: PdActivation):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        import torch

        self.kvcsum_payload = torch.zeros(
            (self.output_ids.shape[0], _row_bytes(activation)), dtype=torch.uint8, device=self.bootstrap_room.device
        )

    return __init__


def _wrapped_buf_infos(original: Callable):
    def get_buf_infos(self):
        ptrs, data_lens, item_lens = original(self)
        extra = getattr(self, "kvcsum_payload", None)
        if extra is not None:  # last, so an engine without it pairs the others up
            ptrs, data_lens, item_lens = list(ptrs), list(data_lens), list(item_lens)
            ptrs.append(extra.data_ptr())
            data_lens.append(extra.nbytes)
            item_lens.append(extra[0].nbytes)
        return ptrs, data_lens, item_lens

    return get_buf_infos


def _wrapped_clear_slot(original: Callable):
    def clear_slot(self, idx: int) -> None:
        original(self, idx)
        extra = getattr(self, "kvcsum_payload", None)
        if extra is not None:
            extra[idx] = 0

    return clear_slot


def _wrap(activation: PdActivation, classes: dict) -> None:
    def put(cls, name: str, make):
        original = cls.__dict__[name]
        activation._originals[(cls, name)] = original
        wrapped = make(original)
        wrapped.__wrapped__ = original
        wrapped.__qualname__ = f"{cls.__name__}.{name}"
        setattr(cls, name, wrapped)

    put(classes[("MetadataBuffers", "__init__")], "__init__", lambda o: _wrapped_init(o, activation))
    put(classes[("MetadataBuffers", "get_buf_infos")], "get_buf_infos", _wrapped_buf_infos)
    put(classes[("MetadataBuffers", "clear_slot")], "clear_slot", _wrapped_clear_slot)
    put(
        classes[("SchedulerDisaggregationPrefillMixin", "send_kv_chunk")], "send_kv_chunk",
        lambda o: _wrapped_send_kv_chunk(o, activation),
    )
    put(classes[("DecodeTransferQueue", "_commit_transfer_to_req")], "_commit_transfer_to_req", _wrapped_commit)
    put(
        classes[("SchedulerDisaggregationDecodeMixin", "_verify_kv_checksums")], "_verify_kv_checksums",
        lambda o: _wrapped_verify(o, activation),
    )
