"""kvcsum: layout-independent checksums of LLM KV-cache blocks, from Python.

A thin ctypes layer over the C ABI of libkvcsum (no compiled extension).
The library is found through $KVCSUM_LIBRARY, beside this package, in the
source tree's target/release, or by the system loader (libkvcsum.so.0);
loading checks its ABI version and every struct's size, so a mismatched
library is refused (kvcsum.AbiError) rather than corrupting memory.

Every failed call raises a kvcsum.Error subclass carrying the status and the
library's message. Handles (Worker, Blocks, Result, Verifier, Report,
Topology, Completion) are context managers and free themselves. Checksums
come back as numpy uint64 arrays, records and payloads as bytes.

    import numpy as np, kvcsum
    cache = np.random.default_rng(0).integers(0, 2**16, (8, 16, 4, 64), dtype=np.uint16)  # NHD
    with kvcsum.Worker(tp_rank=0, tp_size=1) as worker, kvcsum.Blocks() as blocks:
        worker.add_region_of(cache)
        worker.add_group(0, block_size=16)
        worker.add_layer(kvcsum.layer(cache, "NHD", layer_number=0))
        blocks.add_request("req", num_tokens=40)
        blocks.add_group("req", 0, [3, 1, 6])
        with worker.checksum(blocks) as result:
            values = result.column("req", 0)   # numpy uint64, one per position

See docs/SPEC.md for the definition and README.md for the C API it wraps.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from ctypes import byref, c_char_p, c_int64, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from typing import Iterable, Sequence

import numpy as np

from . import _lib
from ._lib import ABI_VERSION, AbiError

__all__ = [
    "ABI_VERSION",
    "AbiError",
    "Error",
    "InvalidArgument",
    "OutOfBounds",
    "Unsupported",
    "NotFound",
    "Malformed",
    "NotReady",
    "DeviceError",
    "BufferTooSmall",
    "InternalError",
    "HOST",
    "PRODUCER",
    "CONSUMER",
    "WEIGHTED",
    "MIXED",
    "FAIL_OPEN",
    "FAIL_CLOSED",
    "MATCH",
    "MISMATCH",
    "UNVERIFIED",
    "SENDING",
    "RECEIVING",
    "library",
    "version",
    "Layer",
    "layer",
    "Blocks",
    "StateTensor",
    "STORED_FAILED",
    "STORED_MATCHED",
    "STORED_NOT_CHECKED",
    "Worker",
    "Result",
    "Verifier",
    "Report",
    "Mismatch",
    "LayerDifference",
    "Finding",
    "base64_encode",
    "base64_decode",
    "tp_ratio",
    "remote_ranks",
    "handshake_targets",
    "block_size_ratio",
    "remote_kv_replicated",
    "local_kv_replicated",
    "rank_heads",
    "head_sources",
    "HeadSource",
    "RemoteEngine",
    "Topology",
    "Completion",
]

#: The `device` of a host worker (KVCS_HOST).
HOST = -1
#: Roles (kvcs_role).
PRODUCER, CONSUMER = 0, 1
# Checksum algorithms (kvcs_algorithm, docs/SPEC.md section 12); MIXED is the default.
WEIGHTED, MIXED = 1, 2
#: Policies (kvcs_policy).
FAIL_OPEN, FAIL_CLOSED = 0, 1
#: Verdicts (kvcs_verdict).
MATCH, MISMATCH, UNVERIFIED = 0, 1, 2
#: Directions (kvcs_direction).
SENDING, RECEIVING = 0, 1

_library = None
_library_lock = threading.Lock()


def library() -> _lib.Api:
    """The loaded, checked library (loaded on first use)."""
    global _library
    with _library_lock:
        if _library is None:
            _library = _lib.load()
        return _library


def version() -> str:
    """The library's version string."""
    return library().kvcs_version().decode()


# --- Errors -------------------------------------------------------------------


class Error(Exception):
    """A kvcsum call failed: `status` (the kvcs_status value), `status_name`
    and `message` (kvcs_last_error, copied at once)."""

    def __init__(self, status: int, status_name: str, message: str):
        super().__init__(f"{status_name}: {message}")
        self.status = status
        self.status_name = status_name
        self.message = message


class InvalidArgument(Error, ValueError):
    """KVCS_ERR_INVALID_ARGUMENT."""


class OutOfBounds(Error, IndexError):
    """KVCS_ERR_OUT_OF_BOUNDS."""


class Unsupported(Error):
    """KVCS_ERR_UNSUPPORTED."""


class NotFound(Error, LookupError):
    """KVCS_ERR_NOT_FOUND."""


class Malformed(Error, ValueError):
    """KVCS_ERR_MALFORMED."""


class NotReady(Error):
    """KVCS_ERR_NOT_READY."""


class DeviceError(Error):
    """KVCS_ERR_DEVICE."""


class BufferTooSmall(Error):
    """KVCS_ERR_BUFFER_TOO_SMALL (the helpers here size buffers themselves)."""


class InternalError(Error):
    """KVCS_ERR_INTERNAL: a bug in kvcsum."""


_ERRORS = {
    1: InvalidArgument,
    2: OutOfBounds,
    3: Unsupported,
    4: NotFound,
    5: Malformed,
    6: NotReady,
    7: DeviceError,
    8: BufferTooSmall,
    9: InternalError,
}
_OK = 0
_BUFFER_TOO_SMALL = 8


def _check(status: int) -> None:
    """Raises the Error of a non-OK status with the thread's last message."""
    if status != _OK:
        lib = library()
        message = lib.kvcs_last_error().decode(errors="replace")
        name = lib.kvcs_status_name(status).decode()
        raise _ERRORS.get(status, Error)(status, name, message)


def _c(text: str) -> bytes:
    if not isinstance(text, str):
        raise TypeError(f"expected a str, got {type(text).__name__}")
    return text.encode()


def _sized(call, element=c_uint8):
    """Runs call(buf, cap, len_ptr) as a size query, then for real; gives
    the ctypes array and its length."""
    length = c_size_t(0)
    status = call(None, 0, byref(length))
    if status not in (_OK, _BUFFER_TOO_SMALL):
        _check(status)
    buffer = (element * max(length.value, 1))()
    if length.value:
        _check(call(buffer, length.value, byref(length)))
    return buffer, length.value


def _bytes_of(data) -> tuple:
    """A ctypes view of bytes-like `data` (kept alive by the caller) and its length."""
    data = bytes(data)
    return (c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0"), len(data)


def _block_ids(block_ids) -> np.ndarray:
    """Block ids as a contiguous uint32 array; ValueError for any that is
    not an integer in [0, 2**32) (numpy would wrap it silently)."""
    ids = np.asarray(block_ids if hasattr(block_ids, "__len__") else list(block_ids))
    if ids.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"block ids must be a 1-D sequence of integers, got dtype {ids.dtype} shape {ids.shape}")
    if int(ids.min()) < 0 or int(ids.max()) > 0xFFFFFFFF:
        raise ValueError(f"block ids must be in [0, 2**32): got {int(ids.min())} .. {int(ids.max())}")
    return np.ascontiguousarray(ids, dtype=np.uint32)


class _Handle:
    """An owned C handle, freed by close(), the with-block or the collector."""

    _destroy = ""

    def __init__(self, handle: int):
        self._handle = handle
        self._lib = library()

    @property
    def handle(self) -> int:
        """The C handle (raises once closed)."""
        if not self._handle:
            raise ValueError(f"this {type(self).__name__} is closed")
        return self._handle

    def close(self) -> None:
        """Frees the handle now; later calls on it raise ValueError."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            getattr(self._lib, self._destroy)(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def _create(function, *args) -> int:
    out = c_void_p()
    _check(function(*args, byref(out)))
    return out.value


# --- Layers from arrays --------------------------------------------------------

_ALIASES = {"NHD": "BTHD", "HND": "BHTD"}


def _array_info(array) -> tuple[int, tuple, tuple, int]:
    """(address, shape, byte strides, item size) of a numpy array, a torch
    tensor, or anything with __cuda_array_interface__ / __array_interface__."""
    if hasattr(array, "data_ptr") and hasattr(array, "element_size") and callable(array.stride):
        item = int(array.element_size())
        return int(array.data_ptr()), tuple(int(n) for n in array.shape), tuple(int(s) * item for s in array.stride()), item
    for name in ("__cuda_array_interface__", "__array_interface__"):
        interface = getattr(array, name, None)
        if interface is not None:
            shape = tuple(int(n) for n in interface["shape"])
            item = np.dtype(interface["typestr"]).itemsize
            strides = interface.get("strides")
            if strides is None:  # C-contiguous
                strides, step = [], item
                for n in reversed(shape):
                    strides.append(step)
                    step *= n
                strides = tuple(reversed(strides))
            return int(interface["data"][0]), shape, tuple(int(s) for s in strides), item
    raise TypeError(f"cannot describe a {type(array).__name__}: expected a numpy array or a torch tensor")


def region_of(array) -> tuple[int, int]:
    """(address, length) of the bytes `array` can reach, for Worker.add_region."""
    address, shape, strides, item = _array_info(array)
    if any(n == 0 for n in shape):
        return address, 0
    low = address + sum(s * (n - 1) for n, s in zip(shape, strides) if s < 0)
    high = address + sum(s * (n - 1) for n, s in zip(shape, strides) if s > 0) + item
    return low, high - low


@dataclasses.dataclass
class Layer:
    """An attention layer's cache on one worker (kvcs_layer), ready for
    Worker.add_layer; made by kvcsum.layer() or by hand."""

    group_id: int
    layer_number: int
    first_head: int
    num_heads: int
    num_blocks: int
    kernel_blocks: int
    tokens_per_kernel_block: int
    segments: list  # of _lib.Segment, K then V
    replicas: int = 1
    replica_index: int = 0
    identity: bytes = b""

    def _struct(self):
        segments = (_lib.Segment * len(self.segments))(*self.segments)
        identity = (c_uint8 * max(len(self.identity), 1)).from_buffer_copy(self.identity or b"\0")
        struct = _lib.LayerStruct(
            group_id=self.group_id,
            layer_number=self.layer_number,
            first_head=self.first_head,
            num_heads=self.num_heads,
            replicas=self.replicas,
            replica_index=self.replica_index,
            num_blocks=self.num_blocks,
            kernel_blocks=self.kernel_blocks,
            tokens_per_kernel_block=self.tokens_per_kernel_block,
            num_segments=len(self.segments),
            segments=ctypes.cast(segments, ctypes.POINTER(_lib.Segment)),
            identity=ctypes.cast(identity, ctypes.POINTER(c_uint8)),
            identity_len=len(self.identity),
        )
        return struct, (segments, identity)


def layer(
    cache,
    layout: str,
    *,
    layer_number: int,
    group_id: int = 0,
    first_head: int = 0,
    kernel_blocks: int = 1,
    replicas: int = 1,
    replica_index: int = 0,
    identity: bytes = b"",
    v=None,
) -> Layer:
    """Describes one layer's cache from a numpy array or torch tensor.

    `layout` names the dimensions of `cache`, outermost first: B (blocks),
    T (tokens of a block), H (heads), D (the contiguous elements of a
    head's cell for one token) and, where K and V live apart in the same
    array, K (size 2: K then V). "NHD" means "BTHD", "HND" means "BHTD";
    an MLA cache with no head dimension is "BTD". Examples:

        layer(cache, "KBTHD", layer_number=i)   # FlashAttention [2, blocks, 16, heads, 128]
        layer(cache, "BKHTD", layer_number=i)   # FlashInfer HND [blocks, 2, heads, 16, 128]
        layer(k_cache, "NHD", layer_number=i, v=v_cache)   # K and V in two tensors

    Any strided view works: for a cross-layer cache [blocks, layers, ...]
    pass `cache[:, i]` for layer i.

    With `kernel_blocks` > 1 the B dimension counts kernel blocks, that
    many making one logical block (block b holds kernel blocks
    b*kernel_blocks ...). `first_head` is the global number of the first
    head held here (rank * heads for TP rank `rank`).
    """
    dims = _ALIASES.get(layout.upper(), layout.upper())
    if sorted(dims) not in (sorted("BTHD"), sorted("BTHDK"), sorted("BTD"), sorted("BTDK")):
        raise ValueError(f"layout {layout!r}: name each dimension once with B, T, H, D and optionally K")
    if "K" in dims and v is not None:
        raise ValueError("give either a K dimension in the layout or a separate v array, not both")
    if kernel_blocks < 1:
        raise ValueError(f"kernel_blocks {kernel_blocks} must be at least 1")

    def segments_of(array) -> list:
        address, shape, strides, item = _array_info(array)
        if len(shape) != len(dims):
            raise ValueError(f"layout {layout!r} names {len(dims)} dimensions, the array has shape {shape}")
        size = dict(zip(dims, shape))
        stride = dict(zip(dims, strides))
        if size["D"] > 1 and stride["D"] != item:
            raise ValueError(f"the D dimension must be contiguous: its stride is {stride['D']} bytes, items are {item}")
        if size["B"] % kernel_blocks:
            raise ValueError(f"{size['B']} blocks are not a multiple of kernel_blocks {kernel_blocks}")
        base = []
        for k in range(size.get("K", 1)):
            base.append(
                _lib.Segment(
                    address=address + k * stride.get("K", 0),
                    block_stride=stride["B"] * kernel_blocks,
                    kernel_block_stride=stride["B"],
                    head_stride=stride.get("H", 0),
                    token_stride=stride["T"],
                    bytes_per_token=size["D"] * item,
                )
            )
        if "K" in dims and size["K"] != 2:
            raise ValueError(f"the K dimension has size {size['K']}, not 2")
        return base, size

    segments, size = segments_of(cache)
    if v is not None:
        v_segments, v_size = segments_of(v)
        if {d: v_size[d] for d in "BTH" if d in v_size} != {d: size[d] for d in "BTH" if d in size}:
            raise ValueError(f"k and v differ in blocks, tokens or heads: {size} vs {v_size}")
        segments += v_segments
    return Layer(
        group_id=group_id,
        layer_number=layer_number,
        first_head=first_head,
        num_heads=size.get("H", 1),
        num_blocks=size["B"] // kernel_blocks,
        kernel_blocks=kernel_blocks,
        tokens_per_kernel_block=size["T"],
        segments=segments,
        replicas=replicas,
        replica_index=replica_index,
        identity=bytes(identity),
    )


@dataclasses.dataclass(frozen=True)
class StateTensor:
    """One state tensor of a state layer as this worker holds it
    (kvcs_state_tensor): strides in bytes."""

    address: int
    block_stride: int
    row_stride: int
    first_row: int
    num_rows: int
    total_rows: int
    bytes_per_row: int
    element_size: int


STORED_FAILED = 0
STORED_MATCHED = 1
STORED_NOT_CHECKED = 2


# --- Handles -------------------------------------------------------------------


class Blocks(_Handle):
    """A request block set (kvcs_blocks)."""

    _destroy = "kvcs_blocks_destroy"

    def __init__(self):
        super().__init__(_create(library().kvcs_blocks_create))

    def add_request(self, req_id: str, num_tokens: int) -> "Blocks":
        """Adds request `req_id` whose blocks hold `num_tokens` tokens."""
        _check(self._lib.kvcs_blocks_add_request(self.handle, _c(req_id), num_tokens))
        return self

    def add_group(self, req_id: str, group_id: int, block_ids: Iterable[int], first_position: int = 0) -> "Blocks":
        """Adds group `group_id`'s blocks of `req_id` at consecutive positions."""
        ids = _block_ids(block_ids)
        pointer = ids.ctypes.data_as(ctypes.POINTER(c_uint32)) if ids.size else None
        _check(self._lib.kvcs_blocks_add_group(self.handle, _c(req_id), group_id, first_position, pointer, ids.size))
        return self

    def set_hashes(self, req_id: str, group_id: int, hashes: Sequence[bytes]) -> "Blocks":
        """Gives the block hashes of a group's blocks of `req_id` (one per
        block id, in order, all of one length of at least 8 bytes), for
        stored checksums (Worker.store / Worker.check_stored)."""
        hashes = [bytes(h) for h in hashes]
        size = len(hashes[0]) if hashes else 8
        if any(len(h) != size for h in hashes):
            raise InvalidArgument(1, "KVCS_ERR_INVALID_ARGUMENT", "hashes: every block hash must have the same length")
        data = b"".join(hashes)
        buffer = (c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        _check(self._lib.kvcs_blocks_set_hashes(self.handle, _c(req_id), group_id, buffer, size, len(hashes)))
        return self


class Result(_Handle):
    """A worker's partial checksums (kvcs_result)."""

    _destroy = "kvcs_result_destroy"

    def ready(self) -> bool:
        """True once the values are readable (never blocks)."""
        status = self._lib.kvcs_result_query(self.handle)
        if status == 6:
            return False
        _check(status)
        return True

    def wait(self) -> "Result":
        """Blocks until the values are readable."""
        _check(self._lib.kvcs_result_wait(self.handle))
        return self

    def group(self, req_id: str, group_id: int) -> tuple[int, int, int]:
        """(first_position, num_positions, num_columns) of a group."""
        first, positions, columns = c_uint64(), c_size_t(), c_size_t()
        _check(
            self._lib.kvcs_result_group(
                self.handle, _c(req_id), group_id, byref(first), byref(positions), byref(columns)
            )
        )
        return first.value, positions.value, columns.value

    def column(self, req_id: str, group_id: int, column: int = 0) -> np.ndarray:
        """One column's values, a numpy uint64 array (one per position)."""
        return self.column_with_key(req_id, group_id, column)[1]

    def column_with_key(self, req_id: str, group_id: int, column: int = 0) -> tuple[tuple[int, int], np.ndarray]:
        """((replicas, replica_index), values) of one column."""
        _, positions, _ = self.group(req_id, group_id)
        values = np.zeros(positions, dtype=np.uint64)
        replicas, index = c_uint32(), c_uint32()
        pointer = values.ctypes.data_as(ctypes.POINTER(c_uint64)) if positions else None
        _check(
            self._lib.kvcs_result_column(
                self.handle, _c(req_id), group_id, column, byref(replicas), byref(index), pointer
            )
        )
        return (replicas.value, index.value), values

    def columns(self, req_id: str, group_id: int) -> dict:
        """Every column of a group: {(replicas, replica_index): values}."""
        _, _, count = self.group(req_id, group_id)
        return dict(self.column_with_key(req_id, group_id, c) for c in range(count))

    def stored(self, req_id: str, group_id: int) -> np.ndarray:
        """A load check's verdicts (Worker.check_stored), one per block
        position: STORED_MATCHED, STORED_FAILED or STORED_NOT_CHECKED."""
        _, positions, _ = self.group(req_id, group_id)
        outcomes = np.zeros(positions, dtype=np.uint8)
        pointer = outcomes.ctypes.data_as(ctypes.POINTER(c_uint8)) if positions else None
        _check(self._lib.kvcs_result_stored(self.handle, _c(req_id), group_id, pointer))
        return outcomes

    def encode(self) -> bytes:
        """The worker's record of this result, for Verifier.add_record."""
        buffer, length = _sized(lambda buf, cap, n: self._lib.kvcs_result_encode(self.handle, buf, cap, n))
        return bytes(buffer[:length])


class Worker(_Handle):
    """A worker context for one TP rank / PP stage (kvcs_worker)."""

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
        options = _lib.WorkerOptions(tp_rank, tp_size, pp_rank, device, num_threads)
        super().__init__(_create(library().kvcs_worker_create, byref(options)))
        if algorithm is not None:
            self.set_algorithm(algorithm)

    def add_region(self, address: int, length: int) -> None:
        """Registers `length` bytes at `address` that the worker may read."""
        _check(self._lib.kvcs_worker_add_region(self.handle, address, length))

    def add_region_of(self, array) -> None:
        """Registers the bytes a numpy array or torch tensor spans."""
        self.add_region(*region_of(array))

    def add_group(self, group_id: int, block_size: int) -> None:
        """Registers group `group_id` with `block_size` tokens per block."""
        _check(self._lib.kvcs_worker_add_group(self.handle, group_id, block_size))

    def skip_group(self, group_id: int, reason: str) -> None:
        """Declares a group this worker cannot checksum."""
        _check(self._lib.kvcs_worker_skip_group(self.handle, group_id, _c(reason)))

    def add_layer(self, layer: Layer) -> None:
        """Registers a layer (see kvcsum.layer)."""
        struct, keep_alive = layer._struct()
        _check(self._lib.kvcs_worker_add_layer(self.handle, byref(struct)))
        del keep_alive

    def set_detail(self, on: bool) -> None:
        """Detail mode: per-layer partials in results and records."""
        _check(self._lib.kvcs_worker_set_detail(self.handle, 1 if on else 0))

    def set_algorithm(self, algorithm: int) -> None:
        """The checksum algorithm, MIXED (the default) or WEIGHTED (vLLM's),
        set before the worker's first checksum, store or load check."""
        _check(self._lib.kvcs_worker_set_algorithm(self.handle, algorithm))

    def add_alias(self, group_id: int, layer_number: int, target_layer_number: int, identity: bytes) -> None:
        """Registers a layer that reads the cache of registered layer
        `target_layer_number` (KV sharing): it counts in the group
        fingerprint and adds no checksum."""
        data = bytes(identity)
        buffer = (c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        _check(self._lib.kvcs_worker_add_alias(self.handle, group_id, layer_number, target_layer_number, buffer, len(data)))

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
        rows are numbered (docs/SPEC.md section 6)."""
        array = (_lib.StateTensorStruct * len(tensors))(
            *[
                _lib.StateTensorStruct(
                    t.address, t.block_stride, t.row_stride, t.first_row, t.num_rows, t.total_rows,
                    t.bytes_per_row, t.element_size,
                )
                for t in tensors
            ]
        )
        data = bytes(identity)
        identity_buffer = (c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        struct = _lib.StateStruct(
            group_id, layer_number, 1 if split_known else 0, num_blocks, len(tensors),
            ctypes.cast(array, ctypes.POINTER(_lib.StateTensorStruct)),
            ctypes.cast(identity_buffer, ctypes.POINTER(c_uint8)), len(data),
        )
        _check(self._lib.kvcs_worker_add_state(self.handle, byref(struct)))

    def add_stored(self, group_id: int, address: int, num_blocks: int) -> None:
        """Registers the group's buffer of stored checksums: 8 bytes per
        block id, `num_blocks` of them at `address` (docs/SPEC.md section 8)."""
        _check(self._lib.kvcs_worker_add_stored(self.handle, group_id, address, num_blocks))

    def add_stored_of(self, group_id: int, array) -> None:
        """Registers a numpy uint64 array (one per block id) as the buffer."""
        address, length = region_of(array)
        self.add_stored(group_id, address, length // 8)

    def _call_result(self, function, blocks: Blocks, cuda_stream) -> Result:
        out = c_void_p()
        _check(function(self.handle, blocks.handle, cuda_stream, byref(out)))
        result = Result.__new__(Result)
        _Handle.__init__(result, out.value)
        return result

    def store(self, blocks: Blocks, cuda_stream: int | None = None) -> Result:
        """Checksums `blocks` and writes each block's stored checksum."""
        return self._call_result(self._lib.kvcs_worker_store, blocks, cuda_stream)

    def check_stored(self, blocks: Blocks, cuda_stream: int | None = None) -> Result:
        """Checksums loaded `blocks` against their stored checksums; read the
        verdicts with Result.stored."""
        return self._call_result(self._lib.kvcs_worker_check_stored, blocks, cuda_stream)

    def block_tags(self, group_id: int, hashes: Sequence[bytes]) -> np.ndarray:
        """The tags of docs/SPEC.md section 8 for blocks with these hashes."""
        hashes = [bytes(h) for h in hashes]
        size = len(hashes[0]) if hashes else 8
        data = b"".join(hashes)
        buffer = (c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        tags = np.zeros(len(hashes), dtype=np.uint64)
        pointer = tags.ctypes.data_as(ctypes.POINTER(c_uint64)) if len(hashes) else None
        _check(self._lib.kvcs_block_tags(self.handle, group_id, buffer, size, len(hashes), pointer))
        return tags

    def checksum(self, blocks: Blocks, role: int = PRODUCER, cuda_stream: int | None = None) -> Result:
        """Computes (host) or queues (device, on `cuda_stream`) the partial
        checksums of every block in `blocks`."""
        out = c_void_p()
        _check(self._lib.kvcs_worker_checksum(self.handle, blocks.handle, role, cuda_stream, byref(out)))
        result = Result.__new__(Result)
        _Handle.__init__(result, out.value)
        return result


@dataclasses.dataclass(frozen=True)
class LayerDifference:
    """A layer head range that differs in one replica check."""

    layer_number: int
    first_head: int
    num_heads: int
    check: int


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Consumer block positions of one group that differ."""

    group_id: int
    first_position: int
    num_positions: int
    first_token: int
    num_tokens: int
    failed_checks: tuple
    localised: bool
    layers: tuple


@dataclasses.dataclass(frozen=True)
class Finding:
    """A reason the load or a group was not compared."""

    reason: int
    reason_name: str
    group_id: int
    message: str


class Report(_Handle):
    """A verifier's judgement of one load (kvcs_report)."""

    _destroy = "kvcs_report_destroy"

    def _u32(self, function) -> int:
        value = c_uint32()
        _check(function(self.handle, byref(value)))
        return value.value

    @property
    def verdict(self) -> int:
        """MATCH, MISMATCH or UNVERIFIED."""
        return self._u32(self._lib.kvcs_report_verdict)

    @property
    def verdict_name(self) -> str:
        """"KVCS_VERDICT_MATCH", ..."""
        return self._lib.kvcs_verdict_name(self.verdict).decode()

    @property
    def passed(self) -> bool:
        """Whether the load may proceed under the verifier's policy."""
        return bool(self._u32(self._lib.kvcs_report_passed))

    @property
    def reason(self) -> int:
        """The first finding's reason (0 when none)."""
        return self._u32(self._lib.kvcs_report_reason)

    @property
    def message(self) -> str:
        """One line for a log."""
        text = c_char_p()
        _check(self._lib.kvcs_report_message(self.handle, byref(text)))
        return text.value.decode(errors="replace")

    @property
    def compared_positions(self) -> int:
        """Block positions compared over all groups."""
        value = c_uint64()
        _check(self._lib.kvcs_report_compared_positions(self.handle, byref(value)))
        return value.value

    @property
    def mismatches(self) -> list[Mismatch]:
        """The differing positions, per group."""
        count = c_size_t()
        _check(self._lib.kvcs_report_num_mismatches(self.handle, byref(count)))
        out = []
        for i in range(count.value):
            entry = _lib.MismatchStruct()
            _check(self._lib.kvcs_report_mismatch(self.handle, i, byref(entry)))
            checks = []
            for k in range(entry.num_failed_checks):
                value = c_uint32()
                _check(self._lib.kvcs_report_failed_check(self.handle, i, k, byref(value)))
                checks.append(value.value)
            layers = []
            for k in range(entry.num_layers):
                difference = _lib.LayerDifferenceStruct()
                _check(self._lib.kvcs_report_layer_difference(self.handle, i, k, byref(difference)))
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
        count = c_size_t()
        _check(self._lib.kvcs_report_num_unverified(self.handle, byref(count)))
        out = []
        for i in range(count.value):
            reason, group, text = c_uint32(), c_uint32(), c_char_p()
            _check(self._lib.kvcs_report_unverified(self.handle, i, byref(reason), byref(group), byref(text)))
            name = self._lib.kvcs_unverified_reason_name(reason.value).decode()
            out.append(Finding(reason.value, name, group.value, text.value.decode(errors="replace")))
        return out


class Verifier(_Handle):
    """A scheduler's verifier (kvcs_verifier): payloads on the producer,
    verdicts on the consumer."""

    _destroy = "kvcs_verifier_destroy"

    def __init__(self, num_workers: int):
        super().__init__(_create(library().kvcs_verifier_create, num_workers))

    def set_policy(self, policy: int) -> None:
        """FAIL_OPEN or FAIL_CLOSED."""
        _check(self._lib.kvcs_verifier_set_policy(self.handle, policy))

    def set_extension(self, on: bool) -> None:
        """Producer: payloads carry the kvcsum extension."""
        _check(self._lib.kvcs_verifier_set_extension(self.handle, 1 if on else 0))

    def set_producer_tp_size(self, tp_size: int) -> None:
        """Consumer: the producer's TP size."""
        _check(self._lib.kvcs_verifier_set_producer_tp_size(self.handle, tp_size))

    def set_producer_block_size(self, group_id: int, block_size: int) -> None:
        """Consumer: the producer's block size of a group."""
        _check(self._lib.kvcs_verifier_set_producer_block_size(self.handle, group_id, block_size))

    def expect(self, scheduled: Blocks, role: int) -> None:
        """Registers the requests of `scheduled` in `role`."""
        _check(self._lib.kvcs_verifier_expect(self.handle, scheduled.handle, role))

    def forget(self, req_id: str) -> None:
        """Drops a request's state."""
        _check(self._lib.kvcs_verifier_forget(self.handle, _c(req_id)))

    def add_record(self, record: bytes) -> None:
        """Adds a worker's record (Result.encode())."""
        data, length = _bytes_of(record)
        _check(self._lib.kvcs_verifier_add_record(self.handle, data, length))

    def payload(self, req_id: str) -> bytes:
        """Producer: the payload bytes of `req_id` (vLLM's KVChecksumPayload)."""
        buffer, length = _sized(
            lambda buf, cap, n: self._lib.kvcs_verifier_payload(self.handle, _c(req_id), buf, cap, n)
        )
        return bytes(buffer[:length])

    def _report(self, function, *args) -> Report:
        out = c_void_p()
        _check(function(self.handle, *args, byref(out)))
        report = Report.__new__(Report)
        _Handle.__init__(report, out.value)
        return report

    def check(self, req_id: str, payload: bytes | str | None) -> Report:
        """Consumer: judges the load of `req_id` against the producer's
        payload: bytes, the base64 text of kv_transfer_params["kv_checksums"],
        or None when the producer sent none."""
        if payload is None:
            return self._report(self._lib.kvcs_verifier_check_no_payload, _c(req_id))
        if isinstance(payload, str):
            return self._report(self._lib.kvcs_verifier_check_base64, _c(req_id), _c(payload))
        data, length = _bytes_of(payload)
        return self._report(self._lib.kvcs_verifier_check, _c(req_id), data, length)

    def check_stored(self, req_id: str) -> Report:
        """Consumer: judges the offload load of `req_id` from its workers'
        load-check records alone (Worker.check_stored results, encoded and
        added with add_record): MATCH, MISMATCH at the positions whose stored
        checksum failed on some worker, or UNVERIFIED (e.g. a record is not a
        load check's)."""
        return self._report(self._lib.kvcs_verifier_check_stored, _c(req_id))


def base64_encode(data: bytes) -> str:
    """Standard padded base64 of `data` (as kv_transfer_params carries it)."""
    raw, length = _bytes_of(data)
    lib = library()
    buffer, used = _sized(lambda buf, cap, n: lib.kvcs_base64_encode(raw, length, buf, cap, n), ctypes.c_char)
    return bytes(buffer[: used - 1]).decode("ascii")


def base64_decode(text: str) -> bytes:
    """The bytes of standard padded base64 `text`; Malformed otherwise."""
    raw = _c(text)
    lib = library()
    buffer, length = _sized(lambda buf, cap, n: lib.kvcs_base64_decode(raw, len(raw), buf, cap, n))
    return bytes(buffer[:length])


# --- Topology (SPEC section 11) -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class HeadSource:
    """A run of a local rank's heads and the remote rank that supplies it."""

    remote_rank: int
    first_head: int
    num_heads: int
    local_offset: int
    remote_offset: int


@dataclasses.dataclass(frozen=True)
class RemoteEngine:
    """What a remote engine's handshake told."""

    tp_size: int
    block_bytes: int
    block_size: int
    kernel_blocks: int = 1


def _u32_list(call) -> list[int]:
    buffer, length = _sized(call, c_uint32)
    return list(buffer[:length])


def _head_sources(call) -> list[HeadSource]:
    buffer, length = _sized(call, _lib.HeadSourceStruct)
    return [
        HeadSource(s.remote_rank, s.first_head, s.num_heads, s.local_offset, s.remote_offset) for s in buffer[:length]
    ]


def tp_ratio(local_tp: int, remote_tp: int) -> int:
    """local/remote when local >= remote, else -(remote/local); InvalidArgument
    when the sizes do not divide."""
    value = c_int64()
    _check(library().kvcs_tp_ratio(local_tp, remote_tp, byref(value)))
    return value.value


def remote_ranks(local_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """The remote ranks local rank `local_rank` reads from."""
    lib = library()
    return _u32_list(lambda buf, cap, n: lib.kvcs_remote_ranks(local_rank, local_tp, remote_tp, buf, cap, n))


def handshake_targets(local_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """The remote ranks to handshake with, from the TP sizes alone."""
    lib = library()
    return _u32_list(lambda buf, cap, n: lib.kvcs_handshake_targets(local_rank, local_tp, remote_tp, buf, cap, n))


def block_size_ratio(local_block_size: int, remote_block_size: int) -> int:
    """local/remote block size; InvalidArgument when not whole."""
    value = c_uint32()
    _check(library().kvcs_block_size_ratio(local_block_size, remote_block_size, byref(value)))
    return value.value


def remote_kv_replicated(remote_tp: int, total_kv_heads: int) -> bool:
    """Whether the remote engine replicates KV heads (remote_tp > heads)."""
    value = c_uint32()
    _check(library().kvcs_remote_kv_replicated(remote_tp, total_kv_heads, byref(value)))
    return bool(value.value)


def local_kv_replicated(tp: int, total_kv_heads: int, is_mla: bool = False) -> bool:
    """Whether the local engine replicates KV heads (MLA, or tp > heads)."""
    value = c_uint32()
    _check(library().kvcs_local_kv_replicated(tp, total_kv_heads, int(is_mla), byref(value)))
    return bool(value.value)


def rank_heads(rank: int, tp: int, total_kv_heads: int, is_mla: bool = False) -> range:
    """The global heads rank `rank` of an engine of TP size `tp` holds."""
    first, count = c_uint32(), c_uint32()
    _check(library().kvcs_rank_heads(rank, tp, total_kv_heads, int(is_mla), byref(first), byref(count)))
    return range(first.value, first.value + count.value)


def head_sources(
    local_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int, is_mla: bool = False
) -> list[HeadSource]:
    """For local rank `local_rank`, each run of its heads with the remote
    rank that supplies it."""
    lib = library()
    return _head_sources(
        lambda buf, cap, n: lib.kvcs_head_sources(
            local_rank, local_tp, remote_tp, total_kv_heads, int(is_mla), buf, cap, n
        )
    )


class Topology(_Handle):
    """One local worker's view of the engines it transfers with
    (kvcs_topology): per remote engine id, what its handshake told."""

    _destroy = "kvcs_topology_destroy"

    def __init__(
        self, local_engine_id: str, *, tp_rank: int, tp_size: int, total_kv_heads: int, block_size: int, is_mla: bool = False
    ):
        local = _lib.LocalEngineStruct(tp_rank, tp_size, total_kv_heads, int(is_mla), block_size)
        super().__init__(_create(library().kvcs_topology_create, _c(local_engine_id), byref(local)))

    def add_remote(self, engine_id: str, remote: RemoteEngine) -> bool:
        """Records a handshake; False when the engine was known (kept as first told)."""
        struct = _lib.RemoteEngineStruct(remote.block_bytes, remote.tp_size, remote.block_size, remote.kernel_blocks)
        added = c_uint32()
        _check(self._lib.kvcs_topology_add_remote(self.handle, _c(engine_id), byref(struct), byref(added)))
        return bool(added.value)

    def remote(self, engine_id: str) -> RemoteEngine:
        """What `engine_id`'s handshake told; NotFound when none."""
        struct = _lib.RemoteEngineStruct()
        _check(self._lib.kvcs_topology_remote(self.handle, _c(engine_id), byref(struct)))
        return RemoteEngine(struct.tp_size, struct.block_bytes, struct.block_size, struct.kernel_blocks)

    def tp_ratio(self, engine_id: str) -> int:
        """tp_ratio of the local engine and `engine_id`."""
        value = c_int64()
        _check(self._lib.kvcs_topology_tp_ratio(self.handle, _c(engine_id), byref(value)))
        return value.value

    def block_size_ratio(self, engine_id: str) -> int:
        """block_size_ratio of the local engine and `engine_id`."""
        value = c_uint32()
        _check(self._lib.kvcs_topology_block_size_ratio(self.handle, _c(engine_id), byref(value)))
        return value.value

    def remote_kv_replicated(self, engine_id: str) -> bool:
        """Whether `engine_id` replicates KV heads."""
        value = c_uint32()
        _check(self._lib.kvcs_topology_remote_kv_replicated(self.handle, _c(engine_id), byref(value)))
        return bool(value.value)

    def remote_ranks(self, engine_id: str) -> list[int]:
        """The ranks of `engine_id` this worker reads from."""
        return _u32_list(
            lambda buf, cap, n: self._lib.kvcs_topology_remote_ranks(self.handle, _c(engine_id), buf, cap, n)
        )

    def head_sources(self, engine_id: str) -> list[HeadSource]:
        """Which rank of `engine_id` supplies each run of this worker's heads."""
        return _head_sources(
            lambda buf, cap, n: self._lib.kvcs_topology_head_sources(self.handle, _c(engine_id), buf, cap, n)
        )


class Completion(_Handle):
    """Says when every expected worker reported a request finished sending
    or receiving (kvcs_completion); unites invalid block ids."""

    _destroy = "kvcs_completion_destroy"

    def __init__(self, expected_workers: int):
        super().__init__(_create(library().kvcs_completion_create, expected_workers))

    def set_expected(self, expected_workers: int) -> None:
        """The expected count for requests first reported from now on."""
        _check(self._lib.kvcs_completion_set_expected(self.handle, expected_workers))

    def report(
        self, worker: int, direction: int, req_ids: Sequence[str], expected_workers: int | None = None
    ) -> list[str]:
        """Worker `worker` finished `req_ids` in `direction` (SENDING or
        RECEIVING); returns the requests this report completed. A worker's
        output may carry a new expected count (vLLM's
        expected_finished_count): pass it as `expected_workers`; it applies
        from this report's new requests on."""
        if expected_workers:
            self.set_expected(expected_workers)
        encoded = [_c(r) for r in req_ids]
        ids = (c_char_p * max(len(encoded), 1))(*encoded)
        done = (c_uint8 * max(len(encoded), 1))()
        _check(self._lib.kvcs_completion_report(self.handle, worker, direction, ids, len(encoded), done))
        return [r for r, d in zip(req_ids, done) if d]

    def reported(self, direction: int, req_id: str) -> int:
        """Workers that reported `req_id` so far (0 once it completed)."""
        value = c_uint32()
        _check(self._lib.kvcs_completion_reported(self.handle, direction, _c(req_id), byref(value)))
        return value.value

    def add_invalid_blocks(self, block_ids: Iterable[int]) -> None:
        """Adds block ids a worker found invalid."""
        ids = _block_ids(block_ids)
        _check(
            self._lib.kvcs_completion_add_invalid_blocks(
                self.handle, ids.ctypes.data_as(ctypes.POINTER(c_uint32)) if ids.size else None, ids.size
            )
        )

    def invalid_blocks(self) -> set[int]:
        """The union of invalid block ids since the last clear."""
        return set(
            _u32_list(lambda buf, cap, n: self._lib.kvcs_completion_invalid_blocks(self.handle, buf, cap, n))
        )

    def clear_invalid_blocks(self) -> None:
        """Forgets the invalid block ids."""
        _check(self._lib.kvcs_completion_clear_invalid_blocks(self.handle))


# --- Repair (reload only the blocks that differ) ---------------------------------

__all__ += ["RepairBlock", "repair_plan"]


@dataclasses.dataclass(frozen=True)
class RepairBlock:
    """A consumer block to load again: its group, block position and block
    id, and the request tokens `first_token .. first_token + num_tokens - 1`
    of it that were compared and differ."""

    group_id: int
    position: int
    block_id: int
    first_token: int
    num_tokens: int


def repair_plan(report, block_tables: dict, block_size) -> dict[int, list[RepairBlock]]:
    """The consumer blocks to transfer again after a MISMATCH, per group.

    `report` is a Report (or a list of its Mismatch entries); `block_tables`
    maps each group id to the consumer's block ids of the request, either
    from position 0 (`{0: [7, 2, 9]}`) or as `(first_position, block_ids)`;
    `block_size` is the consumer's tokens per block, one int or
    `{group_id: block_size}`. Returns `{group_id: [RepairBlock, ...]}` in
    position order, each position once; a MATCH gives `{}`.

    Where the two sides' block sizes differ, a mismatch covers a run of
    their least common multiple, so every consumer block of that run is
    named. Raises ValueError for an UNVERIFIED report (it names no
    positions: the load must be repeated whole) and for a mismatch that
    does not fit the tables (a position without a block id, a group or block
    size not given, tokens outside the position).
    """
    if hasattr(report, "mismatches"):
        if report.verdict == UNVERIFIED:
            raise ValueError(f"report is unverified ({report.message}); it names no positions to repair")
        mismatches = report.mismatches
    else:
        mismatches = list(report)
    plan: dict[int, dict[int, RepairBlock]] = {}
    for m in mismatches:
        if m.group_id not in block_tables:
            raise ValueError(f"group {m.group_id} differs but block_tables has no table for it")
        table = block_tables[m.group_id]
        first_position, ids = table if isinstance(table, tuple) else (0, table)
        size = block_size[m.group_id] if isinstance(block_size, dict) else block_size
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"block_size of group {m.group_id} is {size!r}; it must be a positive integer")
        end_token = m.first_token + m.num_tokens
        for q in range(m.first_position, m.first_position + m.num_positions):
            index = q - first_position
            if not 0 <= index < len(ids):
                raise ValueError(
                    f"group {m.group_id} position {q} differs but the block table holds positions "
                    f"{first_position} .. {first_position + len(ids) - 1}"
                )
            low, high = max(q * size, m.first_token), min((q + 1) * size, end_token)
            if high <= low:
                raise ValueError(
                    f"group {m.group_id} position {q} (block size {size}) holds none of the differing tokens "
                    f"{m.first_token} .. {end_token - 1}"
                )
            plan.setdefault(m.group_id, {})[q] = RepairBlock(m.group_id, q, int(ids[index]), low, high - low)
    return {group: [blocks[q] for q in sorted(blocks)] for group, blocks in sorted(plan.items())}
