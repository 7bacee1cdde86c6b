"""The worker side: Blocks (request block sets), Worker and its Result."""

from __future__ import annotations

import ctypes
from ctypes import byref, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from typing import Iterable, Sequence

import numpy as np

from . import _lib
from ._base import (
    _NOT_READY,
    _OK,
    _Handle,
    _block_ids,
    _bytes_list,
    _bytes_of,
    _c,
    _check,
    _create,
    _enum,
    _flag,
    _int,
    _member,
    _of_type,
    _scale_bits,
    _sized,
    _stream,
    library,
)
from ._constants import HOST, PRODUCER, Algorithm, Role, Status
from ._errors import InvalidArgument
from ._layers import Layer, StateTensor, _stored_buffer, _memory_of, region_of
from ._lib import BLOCK_CHECKSUM_BYTES

# --- Handles -------------------------------------------------------------------


class Blocks(_Handle):
    """A request block set (kvcs_blocks).

    Thread safety: adding (add_request, add_group, set_hashes) needs the
    set alone, so such calls wait for any call using it; calls that only
    read it (Worker.checksum, Verifier.expect, ...) run concurrently."""

    _destroy = "kvcs_blocks_destroy"

    def __init__(self):
        super().__init__(_create(library().kvcs_blocks_create))
        self._requests = 0  # added through this object, for the repr
        self._groups = 0

    def _describe(self) -> str:
        return f"requests={self._requests} groups={self._groups}"

    def add_request(self, req_id: str, num_tokens: int) -> "Blocks":
        """Adds request `req_id` whose blocks hold `num_tokens` tokens."""
        req = _c(req_id, "req_id")
        num_tokens = _int(num_tokens, "uint64_t", "num_tokens")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_blocks_add_request(handle, req, num_tokens))
            self._requests += 1
        return self

    def add_group(self, req_id: str, group_id: int, block_ids: Iterable[int], first_position: int = 0) -> "Blocks":
        """Adds group `group_id`'s blocks of `req_id` at consecutive positions."""
        req = _c(req_id, "req_id")
        group_id = _int(group_id, "uint32_t", "group_id")
        first_position = _int(first_position, "uint64_t", "first_position")
        ids = _block_ids(block_ids)
        pointer = ids.ctypes.data_as(ctypes.POINTER(c_uint32)) if ids.size else None
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_blocks_add_group(handle, req, group_id, first_position, pointer, ids.size))
            self._groups += 1
        return self

    def set_hashes(self, req_id: str, group_id: int, hashes: Sequence[bytes]) -> "Blocks":
        """Gives the block hashes of a group's blocks of `req_id` (one per
        block id, in order, all of one length of at least 8 bytes), for
        stored checksums (Worker.store / Worker.check_stored)."""
        req = _c(req_id, "req_id")
        group_id = _int(group_id, "uint32_t", "group_id")
        hashes = _bytes_list(hashes, "hashes")
        size = len(hashes[0]) if hashes else 8
        if any(len(h) != size for h in hashes):
            raise InvalidArgument(1, "KVCS_ERR_INVALID_ARGUMENT", "hashes: every block hash must have the same length")
        data = b"".join(hashes)
        buffer = (c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_blocks_set_hashes(handle, req, group_id, buffer, size, len(hashes)))
        return self

    def add_arrays(
        self,
        req_ids: Sequence[str],
        num_tokens,
        group_ends,
        group_ids,
        first_positions,
        block_ends,
        block_ids,
        hashes=None,
    ) -> "Blocks":
        """Adds a batch of requests with their groups and blocks in one call
        (kvcs_blocks_add_arrays), from arrays in compressed rows (numpy
        arrays or sequences of integers, passed through without a loop over
        blocks):

        - `req_ids` (str) and `num_tokens`: one per request;
        - `group_ends`: per request, where its groups end in the group
          arrays (a running total: request i's groups are
          group_ends[i-1] .. group_ends[i]);
        - `group_ids`, `first_positions`, `block_ends`: one per group,
          `block_ends` where its blocks end in `block_ids`;
        - `hashes`: None, or the block hashes of every block id, a 2-D uint8
          array of one row (at least 8 bytes) per block id.

        Arrays that disagree raise InvalidArgument naming the array and
        entry, and then nothing is added."""
        n = len(req_ids)
        joined = "".join(req_ids) if all(isinstance(r, str) for r in req_ids) else None
        if joined is None:
            bad = next(i for i, r in enumerate(req_ids) if not isinstance(r, str))
            raise TypeError(f"req_ids[{bad}] must be a str, got {type(req_ids[bad]).__name__}")
        data = joined.encode()
        if len(data) == len(joined):
            id_ends = np.fromiter(map(len, req_ids), dtype=np.uintp, count=n).cumsum(dtype=np.uintp)
        else:  # ids not all ASCII: their UTF-8 lengths
            id_ends = np.fromiter((len(r.encode()) for r in req_ids), dtype=np.uintp, count=n).cumsum(dtype=np.uintp)
        num_tokens = _integers(num_tokens, np.uint64, "num_tokens")
        group_ends = _integers(group_ends, np.uintp, "group_ends")
        group_ids = _integers(group_ids, np.uint32, "group_ids")
        first_positions = _integers(first_positions, np.uint64, "first_positions")
        block_ends = _integers(block_ends, np.uintp, "block_ends")
        if not (type(block_ids) is np.ndarray and block_ids.dtype == np.uint32 and block_ids.ndim == 1):
            block_ids = _block_ids(block_ids)
        block_ids = np.ascontiguousarray(block_ids)
        # The C call reads as many entries as the counts it is given say.
        for name, array, want, of in (
            ("num_tokens", num_tokens, n, "req_ids"),
            ("group_ends", group_ends, n, "req_ids"),
            ("first_positions", first_positions, group_ids.size, "group_ids"),
            ("block_ends", block_ends, group_ids.size, "group_ids"),
        ):
            if array.size != want:
                raise InvalidArgument(1, "KVCS_ERR_INVALID_ARGUMENT", f"{name} has {array.size} entries, {of} {want}")
        hash_bytes, hash_pointer = 0, None
        if hashes is not None:
            hashes = np.ascontiguousarray(hashes) if isinstance(hashes, np.ndarray) else np.array(hashes, dtype=np.uint8)
            if hashes.ndim != 2 or hashes.dtype != np.uint8:
                raise TypeError(f"hashes must be a 2-D uint8 array (a row per block id), got dtype {hashes.dtype} shape {hashes.shape}")
            if hashes.shape[0] != block_ids.size:
                raise InvalidArgument(
                    1, "KVCS_ERR_INVALID_ARGUMENT", f"hashes has {hashes.shape[0]} rows, block_ids {block_ids.size} entries"
                )
            hash_bytes = hashes.shape[1]
            hash_pointer = hashes.ctypes.data_as(ctypes.POINTER(c_uint8)) if hashes.size else (c_uint8 * 1)()

        def pointer(array, c_type):
            return array.ctypes.data_as(ctypes.POINTER(c_type)) if array.size else None

        with self._use(exclusive=True) as handle:
            _check(
                self._lib.kvcs_blocks_add_arrays(
                    handle, n, data, pointer(id_ends, c_size_t), pointer(num_tokens, c_uint64),
                    pointer(group_ends, c_size_t), group_ids.size, pointer(group_ids, c_uint32),
                    pointer(first_positions, c_uint64), pointer(block_ends, c_size_t), block_ids.size,
                    pointer(block_ids, c_uint32), hash_pointer, hash_bytes,
                )
            )
            self._requests += n
            self._groups += group_ids.size
        return self


def _integers(values, dtype, name: str) -> np.ndarray:
    """A 1-D array of non-negative integers as a contiguous array of
    `dtype`: TypeError for another kind (bools too), ValueError for a value
    `dtype` cannot hold (numpy would wrap it silently)."""
    if type(values) is np.ndarray and values.dtype == dtype and values.ndim == 1 and values.flags.c_contiguous:
        return values  # as the C call takes it
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=dtype)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be a 1-D sequence of integers, got dtype {array.dtype} shape {array.shape}")
    if array.dtype != dtype:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high > np.iinfo(dtype).max:
            raise ValueError(f"{name} must be in [0, {np.iinfo(dtype).max}]: got {low} .. {high}")
    return np.ascontiguousarray(array, dtype=dtype)


class Result(_Handle):
    """A worker's partial checksums (kvcs_result). Independent of its
    worker once made; it keeps the worker's arrays alive while it lives
    (a device may still be reading them).

    Thread safety: reads (ready, group, column, stored, encode) run
    concurrently; wait() needs the result alone and waits for them."""

    _destroy = "kvcs_result_destroy"

    def _describe(self) -> str:
        with self._use(wait=False) as handle:
            status = self._lib.kvcs_result_query(handle)
        if status in (_OK, _NOT_READY):
            return "ready" if status == _OK else "not ready"
        return f"failed ({_member(Status, status)!r})"

    def ready(self) -> bool:
        """True once the values are readable (never blocks)."""
        with self._use() as handle:
            status = self._lib.kvcs_result_query(handle)
        if status == _NOT_READY:
            return False
        _check(status)
        return True

    def wait(self) -> "Result":
        """Blocks until the values are readable."""
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_result_wait(handle))
        return self

    def group(self, req_id: str, group_id: int) -> tuple[int, int, int]:
        """(first_position, num_positions, num_columns) of a group."""
        req = _c(req_id, "req_id")
        group_id = _int(group_id, "uint32_t", "group_id")
        first, positions, columns = c_uint64(), c_size_t(), c_size_t()
        with self._use() as handle:
            _check(self._lib.kvcs_result_group(handle, req, group_id, byref(first), byref(positions), byref(columns)))
        return first.value, positions.value, columns.value

    def column(self, req_id: str, group_id: int, column: int = 0) -> np.ndarray:
        """One column's values, a numpy uint64 array (one per position)."""
        return self.column_with_key(req_id, group_id, column)[1]

    def column_with_key(self, req_id: str, group_id: int, column: int = 0) -> tuple[tuple[int, int], np.ndarray]:
        """((replicas, replica_index), values) of one column
        (kvcs_result_column_buf)."""
        column = _int(column, "size_t", "column")
        _, positions, _ = self.group(req_id, group_id)
        values = np.zeros(positions, dtype=np.uint64)
        replicas, index, length = c_uint32(), c_uint32(), c_size_t()
        pointer = values.ctypes.data_as(ctypes.POINTER(c_uint64)) if positions else None
        with self._use() as handle:
            _check(
                self._lib.kvcs_result_column_buf(
                    handle,
                    _c(req_id, "req_id"),
                    group_id,
                    column,
                    byref(replicas),
                    byref(index),
                    pointer,
                    positions,
                    byref(length),
                )
            )
        return (replicas.value, index.value), values[: length.value]

    def columns(self, req_id: str, group_id: int) -> dict:
        """Every column of a group: {(replicas, replica_index): values}."""
        _, _, count = self.group(req_id, group_id)
        return dict(self.column_with_key(req_id, group_id, c) for c in range(count))

    def stored(self, req_id: str, group_id: int) -> np.ndarray:
        """A load check's verdicts (Worker.check_stored), one per block
        position, a numpy uint8 array of StoredOutcome values: MATCHED,
        FAILED, NOT_CHECKED, OTHER_FINGERPRINT, OTHER_ALGORITHM,
        OTHER_TOKENS or OTHER_FORMAT (also named STORED_MATCHED ...)."""
        _, positions, _ = self.group(req_id, group_id)
        outcomes = np.zeros(positions, dtype=np.uint8)
        pointer = outcomes.ctypes.data_as(ctypes.POINTER(c_uint8)) if positions else None
        length = c_size_t()
        with self._use() as handle:
            _check(
                self._lib.kvcs_result_stored_buf(
                    handle, _c(req_id, "req_id"), group_id, pointer, positions, byref(length)
                )
            )
        return outcomes[: length.value]

    def entries(self, req_id: str, group_id: int) -> np.ndarray:
        """The stored-checksum entries a Worker.store of these blocks would
        write for a group (kvcs_result_entries), for connectors that keep
        them themselves: a numpy uint64 array of shape (positions, 2), the
        value then the stamp per block position ((0, 0) where a position
        holds no valid token). Needs a CONSUMER checksum of blocks with
        hashes (Blocks.set_hashes); judge them with check_entries."""
        _, positions, _ = self.group(req_id, group_id)
        entries = np.zeros((positions, 2), dtype=np.uint64)
        pointer = entries.ctypes.data_as(ctypes.POINTER(c_uint64)) if positions else None
        length = c_size_t()
        with self._use() as handle:
            _check(
                self._lib.kvcs_result_entries_buf(
                    handle, _c(req_id, "req_id"), group_id, pointer, 2 * positions, byref(length)
                )
            )
        return entries[: length.value // 2]

    def check_entries(self, req_id: str, group_id: int, entries) -> np.ndarray:
        """The load check against entries kept by the caller (as
        entries() gave them when the blocks were stored):
        kvcs_result_check_entries, one StoredOutcome value per block
        position in a numpy uint8 array, as stored() gives them. `entries`
        is (positions, 2) unsigned 64-bit integers (value, stamp)."""
        _, positions, _ = self.group(req_id, group_id)
        words = np.asarray(entries)
        if words.dtype.kind not in "ui" or words.shape != (positions, 2):
            raise ValueError(
                f"entries must be integers of shape ({positions}, 2) (value, stamp per position), "
                f"got dtype {words.dtype} shape {words.shape}"
            )
        if words.size and (int(words.min()) < 0 or int(words.max()) > 2**64 - 1):
            raise ValueError("entries must be in [0, 2**64)")
        words = np.ascontiguousarray(words, dtype=np.uint64)
        outcomes = np.zeros(positions, dtype=np.uint8)
        entries_pointer = words.ctypes.data_as(ctypes.POINTER(c_uint64)) if positions else None
        outcomes_pointer = outcomes.ctypes.data_as(ctypes.POINTER(c_uint8)) if positions else None
        length = c_size_t()
        with self._use() as handle:
            _check(
                self._lib.kvcs_result_check_entries_buf(
                    handle,
                    _c(req_id, "req_id"),
                    group_id,
                    entries_pointer,
                    words.size,
                    outcomes_pointer,
                    positions,
                    byref(length),
                )
            )
        return outcomes[: length.value]

    def encode(self) -> bytes:
        """The worker's record of this result, for Verifier.add_record."""
        with self._use() as handle:
            buffer, length = _sized(lambda buf, cap, n: self._lib.kvcs_result_encode(handle, buf, cap, n))
        return bytes(buffer[:length])


class Worker(_Handle):
    """A worker context for one TP rank / PP stage (kvcs_worker).

    It keeps every array it is given (add_region_of, the arrays of the
    layers added, add_stored_of) until it is closed, and so do the
    results it makes, so the memory C reads and writes stays allocated.

    Thread safety: the C worker needs exclusive use. Every call but
    block_tags takes it alone here (a call from a second thread waits for
    the first), so sharing a Worker between threads is safe but serial;
    give each thread its own Worker to checksum in parallel."""

    _destroy = "kvcs_worker_destroy"

    def __init__(
        self,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        device: int = HOST,
        num_threads: int = 0,
        algorithm: int | None = None,
    ):
        options = _lib.WorkerOptions(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, device=device, num_threads=num_threads
        )
        self._kept = []  # the arrays C may read or write while the worker (or a result) lives
        self._on_host = options.device == HOST
        super().__init__(_create(library().kvcs_worker_create, byref(options)))
        self._options = options
        self._algorithm = Algorithm.MIXED2  # the C worker's default until set_algorithm
        self._layers = 0  # added through this object, for the repr
        if algorithm is not None:
            self.set_algorithm(algorithm)

    def _describe(self) -> str:
        options = self._options
        device = "host" if options.device == HOST else f"cuda:{options.device}"
        algorithm = getattr(self._algorithm, "name", self._algorithm)
        return (
            f"tp_rank={options.tp_rank} tp_size={options.tp_size} pp_rank={options.pp_rank} device={device} "
            f"num_threads={options.num_threads or 'all'} algorithm={algorithm} layers={self._layers}"
        )

    def add_region(self, address: int, length: int) -> None:
        """Registers `length` bytes at `address` that the worker may read
        (memory the caller keeps valid; add_region_of keeps an array). A
        host worker refuses memory that is not mapped: kvcsum.InvalidArgument
        where the first page is not, kvcsum.OutOfBounds where the range runs
        past its mapping."""
        address = _int(address, "uint64_t", "address")
        length = _int(length, "uint64_t", "length")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_add_region(handle, address, length))

    def add_region_of(self, array) -> None:
        """Registers the bytes a numpy array or torch tensor spans, and
        keeps the array for the worker's lifetime. Memory this worker cannot
        read raises kvcsum.InvalidArgument naming where it lives (see
        `_check_readable`)."""
        self._check_readable(array, "array")
        self.add_region(*region_of(array))
        self._kept.append(array)

    def _check_readable(self, array, name: str) -> None:
        """kvcsum.InvalidArgument unless this worker's engine can read the
        memory `array` says it lives in: a host worker
        host memory, a device worker CUDA device memory or host memory
        (which the library then checks is pinned, mapped for the device).
        The library checks a host worker's region is mapped, readable memory
        (kvcs_worker_add_region), which CUDA's reservations of device memory
        are not; what the array says is checked here first, so that the
        error names the device, and so that device memory a process has
        mapped readable is refused too. ROCm's and other devices' memory
        (XPU, MPS, ...) no engine of kvcsum reads."""
        where = _memory_of(array)
        if where == "host" or (where == "cuda" and not self._on_host):
            return
        engine = "host memory" if self._on_host else "CUDA device memory or pinned host memory"
        what = {"cuda": "CUDA device memory", "rocm": "a ROCm GPU (kvcsum's device engine is CUDA's)"}.get(
            where, f"a {where!r} device"
        )
        raise InvalidArgument(
            1,
            "KVCS_ERR_INVALID_ARGUMENT",
            f"{name}: a {type(array).__name__} in {what}; this {'host' if self._on_host else 'device'} worker reads "
            f"{engine}",
        )

    def add_group(self, group_id: int, block_size: int) -> None:
        """Registers group `group_id` with `block_size` tokens per block."""
        group_id = _int(group_id, "uint32_t", "group_id")
        block_size = _int(block_size, "uint32_t", "block_size")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_add_group(handle, group_id, block_size))

    def set_group_placement(
        self,
        group_id: int,
        *,
        dcp_size: int = 1,
        dcp_rank: int = 0,
        interleave: int = 1,
        tokens_per_slot: int = 1,
    ) -> None:
        """Where group `group_id`'s tokens sit in this worker's caches
        (docs/SPEC.md section 16): vLLM's decode context parallelism
        (`dcp_size` ranks, this one `dcp_rank`, `interleave` consecutive
        slots per rank, vLLM's cp_kv_cache_interleave_size) and compressed
        states (`tokens_per_slot` tokens summarised by one slot, vLLM's
        tokens_per_state). Call it after add_group and before any layer of
        the group; the layers then tile block_size / tokens_per_slot /
        dcp_size local slots per block. Raises InvalidArgument naming the
        field and value for sizes that do not fit (dcp_rank >= dcp_size,
        a zero, a size that does not divide), and when the group already
        holds a layer."""
        group_id = _int(group_id, "uint32_t", "group_id")
        placement = _lib.GroupPlacementStruct(
            dcp_size=_int(dcp_size, "uint32_t", "dcp_size"),
            dcp_rank=_int(dcp_rank, "uint32_t", "dcp_rank"),
            interleave=_int(interleave, "uint32_t", "interleave"),
            tokens_per_slot=_int(tokens_per_slot, "uint32_t", "tokens_per_slot"),
        )
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_set_group_placement(handle, group_id, byref(placement)))

    def skip_group(self, group_id: int, reason: str) -> None:
        """Declares a group this worker cannot checksum."""
        group_id = _int(group_id, "uint32_t", "group_id")
        reason = _c(reason, "reason")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_skip_group(handle, group_id, reason))

    def add_layer(self, layer: Layer) -> None:
        """Registers a layer (see kvcsum.layer) and keeps its arrays."""
        _of_type(layer, Layer, "layer")
        for i, array in enumerate(layer.arrays):
            self._check_readable(array, f"layer.arrays[{i}]")
        struct, keep_alive = layer._struct()
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_add_layer(handle, byref(struct)))
            self._layers += 1
        self._kept.extend(layer.arrays)
        del keep_alive

    def set_detail(self, on: bool) -> None:
        """Detail mode: per-layer partials in results and records."""
        on = _flag(on, "on")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_set_detail(handle, on))

    def set_layer_decoding(
        self,
        group_id: int,
        layer_number: int,
        dtype: str | None = None,
        head_size: int = 0,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> None:
        """Declares how the engine reads layer `layer_number`'s bytes of
        group `group_id` back as numbers (docs/SPEC.md section 7,
        "Decoding"): its element type (a name such as "bfloat16" or
        "fp8_e4m3"), head size, and the scales K and V are stored with (as
        binary64, compared bit for bit). None / 0 leaves a fact undeclared;
        a fact both sides declare differently makes a load UNVERIFIED
        (DECODING_DIFFERS), never MATCH. A later call for the layer replaces
        the declaration."""
        group_id = _int(group_id, "uint32_t", "group_id")
        layer_number = _int(layer_number, "uint32_t", "layer_number")
        name = None if dtype is None else _c(dtype, "dtype")
        head_size = _int(head_size, "uint32_t", "head_size")
        k_bits, v_bits = _scale_bits(k_scale, "k_scale"), _scale_bits(v_scale, "v_scale")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_set_layer_decoding(handle, group_id, layer_number, name, head_size, k_bits, v_bits))

    def set_algorithm(self, algorithm: int) -> None:
        """The checksum algorithm, MIXED2 (the default), MIXED (kvcsum 0.2's
        default, to verify against a 0.2 peer) or WEIGHTED (vLLM's), set
        before the worker's first checksum, store or load check."""
        algorithm = _enum(algorithm, Algorithm, "algorithm")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_set_algorithm(handle, algorithm))
            self._algorithm = _member(Algorithm, algorithm)

    def add_alias(self, group_id: int, layer_number: int, target_layer_number: int, identity: bytes) -> None:
        """Registers a layer that reads the cache of registered layer
        `target_layer_number` (KV sharing): it counts in the group
        fingerprint and adds no checksum."""
        group_id = _int(group_id, "uint32_t", "group_id")
        layer_number = _int(layer_number, "uint32_t", "layer_number")
        target_layer_number = _int(target_layer_number, "uint32_t", "target_layer_number")
        buffer, length = _bytes_of(identity, "identity")
        with self._use(exclusive=True) as handle:
            _check(
                self._lib.kvcs_worker_add_alias(handle, group_id, layer_number, target_layer_number, buffer, length)
            )

    def add_state(
        self,
        group_id: int,
        layer_number: int,
        tensors: Sequence[StateTensor],
        num_blocks: int,
        split_known: bool = True,
        identity: bytes = b"",
    ) -> None:
        """Registers a state (Mamba) layer: its tensors in the order their
        rows are numbered (docs/SPEC.md section 6). The tensors' addresses
        are the caller's to keep valid."""
        for i, t in enumerate(tensors):
            _of_type(t, StateTensor, f"tensors[{i}]")
        # Struct fields are checked against their C types as they are set.
        array = (_lib.StateTensorStruct * len(tensors))(
            *[
                _lib.StateTensorStruct(
                    address=t.address,
                    block_stride=t.block_stride,
                    row_stride=t.row_stride,
                    first_row=t.first_row,
                    num_rows=t.num_rows,
                    total_rows=t.total_rows,
                    bytes_per_row=t.bytes_per_row,
                    element_size=t.element_size,
                )
                for t in tensors
            ]
        )
        identity_buffer, identity_length = _bytes_of(identity, "identity")
        struct = _lib.StateStruct(
            group_id=group_id,
            layer_number=layer_number,
            split_known=_flag(split_known, "split_known"),
            num_blocks=num_blocks,
            num_tensors=len(tensors),
            tensors=ctypes.cast(array, ctypes.POINTER(_lib.StateTensorStruct)),
            identity=ctypes.cast(identity_buffer, ctypes.POINTER(c_uint8)),
            identity_len=identity_length,
        )
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_add_state(handle, byref(struct)))

    def add_stored(self, group_id: int, address: int, num_blocks: int) -> None:
        """Registers the group's buffer of stored checksums:
        BLOCK_CHECKSUM_BYTES per block id, `num_blocks` of them at `address`
        (docs/SPEC.md section 8), memory the caller keeps valid and
        writable (add_stored_of keeps an array)."""
        group_id = _int(group_id, "uint32_t", "group_id")
        address = _int(address, "uint64_t", "address")
        num_blocks = _int(num_blocks, "uint64_t", "num_blocks")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_add_stored(handle, group_id, address, num_blocks))

    def add_stored_of(self, group_id: int, array) -> None:
        """Registers an array as the group's buffer of stored checksums and
        keeps it for the worker's lifetime: C-contiguous, writable, native
        unsigned integers, BLOCK_CHECKSUM_BYTES (16) per block id (a numpy
        uint64 array of shape (num_blocks, 2): the value and the stamp of
        docs/SPEC.md section 8); ValueError naming `array` otherwise. On a
        host worker the array's bytes are registered as a region too (a host
        buffer must lie in one)."""
        address, num_blocks = _stored_buffer(array, "array")
        self._check_readable(array, "array")
        if self._on_host:
            self.add_region(address, num_blocks * BLOCK_CHECKSUM_BYTES)
        self.add_stored(group_id, address, num_blocks)
        self._kept.append(array)

    def _call_result(self, function, blocks: Blocks, cuda_stream) -> Result:
        _of_type(blocks, Blocks, "blocks")
        stream = _stream(cuda_stream)
        out = c_void_p()
        with self._use(exclusive=True) as handle, blocks._use() as blocks_handle:
            _check(function(handle, blocks_handle, stream, byref(out)))
        result = Result._adopt(out.value)
        result._kept = self._kept
        return result

    def store(self, blocks: Blocks, cuda_stream=None) -> Result:
        """Checksums `blocks` and writes each block's stored checksum."""
        return self._call_result(self._lib.kvcs_worker_store, blocks, cuda_stream)

    def check_stored(self, blocks: Blocks, cuda_stream=None) -> Result:
        """Checksums loaded `blocks` against their stored checksums; read the
        verdicts with Result.stored."""
        return self._call_result(self._lib.kvcs_worker_check_stored, blocks, cuda_stream)

    def block_tags(self, group_id: int, hashes) -> np.ndarray:
        """The tags of docs/SPEC.md section 8 for blocks with these hashes
        (a sequence of bytes, or a 2-D uint8 array of a row per hash).
        A value alone cannot tell a configuration change from corruption:
        connectors that keep entries themselves take Result.entries (value
        and stamp) and judge them with Result.check_entries."""
        group_id = _int(group_id, "uint32_t", "group_id")
        if isinstance(hashes, np.ndarray):
            # A row per block hash (uint8): passed through as it is.
            if hashes.ndim != 2 or hashes.dtype != np.uint8:
                raise TypeError(f"hashes must be a 2-D uint8 array (a row per hash), got dtype {hashes.dtype} shape {hashes.shape}")
            rows = np.ascontiguousarray(hashes)
            count, size = rows.shape
            buffer = rows.ctypes.data_as(ctypes.POINTER(c_uint8)) if rows.size else (c_uint8 * 1)()
        else:
            hashes = _bytes_list(hashes, "hashes")
            count, size = len(hashes), len(hashes[0]) if hashes else 8
            data = b"".join(hashes)
            buffer = (c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        tags = np.zeros(count, dtype=np.uint64)
        pointer = tags.ctypes.data_as(ctypes.POINTER(c_uint64)) if count else None
        with self._use() as handle:
            _check(self._lib.kvcs_block_tags(handle, group_id, buffer, size, count, pointer))
        return tags

    def checksum(self, blocks: Blocks, role: int = PRODUCER, cuda_stream=None) -> Result:
        """Computes (host) or queues (device, on `cuda_stream`) the partial
        checksums of every block in `blocks`. `cuda_stream` is None (the
        legacy default stream), a CUstream handle, a torch.cuda.Stream (or
        anything with `cuda_stream` or `__cuda_stream__`); a host worker
        ignores it. A device result is ready after Result.wait()."""
        _of_type(blocks, Blocks, "blocks")
        role = _enum(role, Role, "role")
        return self._call_result(
            lambda handle, blocks_handle, stream, out: self._lib.kvcs_worker_checksum(
                handle, blocks_handle, role, stream, out
            ),
            blocks,
            cuda_stream,
        )
