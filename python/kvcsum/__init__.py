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

What the package checks before anything reaches C (plain Python
exceptions, not kvcsum.Error, as C never saw the call):

- Integers (arguments, struct fields, block ids) must be Python ints or
  numpy integers within their C type (uint32_t, uint64_t, int32_t,
  int64_t, size_t): TypeError for a bool or a non-integer, ValueError
  for a value outside the type, naming the argument (ctypes and numpy
  would wrap 2**32 + 3 to 3 and -1 to 2**64 - 1 without a word).
- Strings passed as C strings (request ids, engine ids, reasons, base64
  text) must be str without NUL: TypeError otherwise, ValueError for a
  NUL (C would read "a\\0b" as "a"). Byte strings (identities, records,
  payloads, hashes) must be bytes-like: TypeError for an int or a str.
- Handles passed to methods (a Blocks to Worker.checksum, ...) must be of
  the class named: TypeError naming the argument and the class received.

Lifetimes: a Worker keeps every array it was given (add_region_of, the
layers of kvcsum.layer(), add_stored_of) and a Layer keeps its arrays, so
the memory they describe cannot be freed while C may read or write it;
addresses given as integers (add_region, add_stored, StateTensor) are the
caller's to keep valid.

Threads: close() is atomic (once, from any thread; a call on a closed
handle raises ValueError) and waits for no one: a handle closed while
another thread is inside a call on it is freed when that call returns.
Calls that C allows to run concurrently (const calls, every Verifier
call) do; calls that need the handle alone (a Worker's, adding to a
Blocks, Result.wait, ...) wait for each other here, so sharing a handle
between threads is safe; each class says which of its calls are which.

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

import contextlib
import ctypes
import dataclasses
import threading
from ctypes import byref, c_char_p, c_int64, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from typing import Iterable, Sequence

import numpy as np

from . import _lib
from ._lib import ABI_VERSION, BLOCK_CHECKSUM_BYTES, AbiError
from ._lib import checked_int as _int

__all__ = [
    "ABI_VERSION",
    "BLOCK_CHECKSUM_BYTES",
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
    "WHOLE_LOAD",
    "NO_CHECKSUMS",
    "INVALID_CHECKSUMS",
    "WORKERS_MISSING",
    "OTHER_BLOCKS",
    "ONE_SIDED_GROUP",
    "FINGERPRINT_DIFFERS",
    "NO_COMMON_POSITION",
    "REPLICA_MISSING",
    "STATE_TP_DIFFERS",
    "ROLE_DIFFERS",
    "UNCOMPARED_POSITIONS",
    "NOT_LOAD_CHECK",
    "ALGORITHM_DIFFERS",
    "BLOCK_SIZE_UNKNOWN",
    "NOTHING_READ",
    "COVERAGE_DIFFERS",
    "library",
    "version",
    "Layer",
    "layer",
    "Blocks",
    "StateTensor",
    "STORED_FAILED",
    "STORED_MATCHED",
    "STORED_NOT_CHECKED",
    "STORED_OTHER_FINGERPRINT",
    "STORED_OTHER_ALGORITHM",
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
#: The group id of a Finding about the whole load (KVCS_WHOLE_LOAD).
WHOLE_LOAD = 0xFFFFFFFF
#: Why a load or a group was not compared (kvcs_unverified_reason, without
#: the KVCS_UNVERIFIED_ prefix): Report.reason, Finding.reason. 0 is none.
NO_CHECKSUMS = 1
INVALID_CHECKSUMS = 2
WORKERS_MISSING = 3
OTHER_BLOCKS = 4
ONE_SIDED_GROUP = 5
FINGERPRINT_DIFFERS = 6
NO_COMMON_POSITION = 7
REPLICA_MISSING = 8
STATE_TP_DIFFERS = 9
ROLE_DIFFERS = 10
UNCOMPARED_POSITIONS = 11
NOT_LOAD_CHECK = 12
ALGORITHM_DIFFERS = 13
BLOCK_SIZE_UNKNOWN = 14
NOTHING_READ = 15
COVERAGE_DIFFERS = 16

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
_NOT_READY = 6
_BUFFER_TOO_SMALL = 8


def _check(status: int) -> None:
    """Raises the Error of a non-OK status with the thread's last message."""
    if status != _OK:
        lib = library()
        message = lib.kvcs_last_error().decode(errors="replace")
        name = lib.kvcs_status_name(status).decode()
        raise _ERRORS.get(status, Error)(status, name, message)


def _c(text: str, name: str) -> bytes:
    """`text` as a NUL-terminated C string: TypeError unless a str,
    ValueError where it holds a NUL (C would read only what precedes it,
    so "a\\0b" and "a\\0c" would be one id)."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__} {text!r:.80}")
    if "\0" in text:
        raise ValueError(f"{name} {text!r:.80} holds a NUL character at {text.index(chr(0))}, which C would cut it at")
    return text.encode()


def _flag(value, name: str) -> int:
    """An on/off argument as 1 or 0: a bool, or the int 0 or 1."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if _int(value, "uint32_t", name) not in (0, 1):
        raise ValueError(f"{name} is {value!r}: give True or False")
    return int(value)


def _bytes(data, name: str) -> bytes:
    """Bytes-like `data` (bytes, bytearray, memoryview, a uint8 array) as
    bytes; TypeError for an int (bytes(5) would be five zero bytes) or a
    str (which has no one byte encoding here)."""
    if isinstance(data, (str, int, np.integer)) or data is None:
        raise TypeError(f"{name} must be bytes-like, got {type(data).__name__} {data!r:.80}")
    try:
        return bytes(memoryview(data))
    except TypeError:
        raise TypeError(f"{name} must be bytes-like, got {type(data).__name__}") from None


def _bytes_list(items, name: str) -> list[bytes]:
    """A sequence of bytes-like items (not one bytes object, whose items
    are ints) as a list of bytes."""
    if isinstance(items, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"{name} must be a sequence of bytes objects, got one {type(items).__name__}")
    return [_bytes(item, f"{name}[{i}]") for i, item in enumerate(items)]


def _of_type(value, cls: type, name: str):
    """`value`, or TypeError naming the argument and what it got: a handle
    of another type would reach C as a pointer to the wrong struct."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a kvcsum.{cls.__name__}, got {type(value).__module__}.{type(value).__name__}")
    return value


def _stream(cuda_stream) -> int | None:
    """A CUstream as an int (None is the legacy default stream)."""
    return None if cuda_stream is None else _int(cuda_stream, "uintptr_t", "cuda_stream")


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


def _bytes_of(data, name: str) -> tuple:
    """A ctypes copy of bytes-like `data` (kept alive by the caller) and its length."""
    data = _bytes(data, name)
    return (c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0"), len(data)


def _block_ids(block_ids, name: str = "block_ids") -> np.ndarray:
    """Block ids as a contiguous uint32 array: TypeError unless a 1-D
    sequence of integers (a bool is none), ValueError for any outside
    [0, 2**32) (numpy would wrap it silently)."""
    if isinstance(block_ids, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of integers, got {type(block_ids).__name__}")
    if not isinstance(block_ids, np.ndarray):
        block_ids = block_ids if hasattr(block_ids, "__len__") else list(block_ids)
        for i, block_id in enumerate(block_ids):
            if isinstance(block_id, (bool, np.bool_)):
                raise TypeError(f"{name}[{i}] is a bool ({block_id!r}), not a block id")
    ids = np.asarray(block_ids)
    if ids.size == 0 and ids.ndim == 1:
        return np.zeros(0, dtype=np.uint32)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise TypeError(f"{name} must be a 1-D sequence of integers, got dtype {ids.dtype} shape {ids.shape}")
    if int(ids.min()) < 0 or int(ids.max()) > 0xFFFFFFFF:
        raise ValueError(f"{name} must be in [0, 2**32): got {int(ids.min())} .. {int(ids.max())}")
    return np.ascontiguousarray(ids, dtype=np.uint32)


class _Handle:
    """An owned C handle, freed by close(), the with-block or the collector.

    Every call on the handle runs inside `_use()`: shared (calls C lets run
    concurrently) or exclusive (calls that need the handle alone, which
    then wait for each other and for shared ones). close() swaps the handle
    out under the same lock, so it is freed once whatever threads close it,
    and never while a call is using it: a handle closed during a call is
    freed by the last call to return."""

    _destroy = ""

    def __init__(self, handle: int):
        self._lib = library()
        self._state = threading.Condition(threading.Lock())
        self._users = 0  # calls using the handle now
        self._exclusive = False  # whether the one user has it alone
        self._orphan = None  # a handle closed while in use, freed by the last user
        self._handle = handle

    @classmethod
    def _adopt(cls, handle: int):
        """An object owning `handle`, made by a call of another handle."""
        adopted = cls.__new__(cls)
        _Handle.__init__(adopted, handle)
        return adopted

    @property
    def handle(self) -> int:
        """The C handle (raises once closed). Only valid until close():
        calls through it are outside the lock that keeps close() safe."""
        if not self._handle:
            raise ValueError(f"this {type(self).__name__} is closed")
        return self._handle

    @contextlib.contextmanager
    def _use(self, exclusive: bool = False):
        """The open handle for the length of one call; ValueError once closed."""
        with self._state:
            while self._handle and (self._exclusive or (exclusive and self._users)):
                self._state.wait()
            if not self._handle:
                raise ValueError(f"this {type(self).__name__} is closed")
            self._users += 1
            self._exclusive = exclusive
            handle = self._handle
        try:
            yield handle
        finally:
            with self._state:
                self._users -= 1
                self._exclusive = False
                orphan = None
                if not self._users:
                    orphan, self._orphan = self._orphan, None
                    self._state.notify_all()
            if orphan:
                getattr(self._lib, self._destroy)(orphan)

    def close(self) -> None:
        """Frees the handle; later calls on it raise ValueError. Atomic: from
        several threads at once it is freed once; during another thread's
        call on it, it is freed when that call returns."""
        state = getattr(self, "_state", None)
        if state is None:  # the constructor failed before there was a handle
            return
        with state:
            handle, self._handle = self._handle, None
            if handle and self._users:
                self._orphan, handle = handle, None
            state.notify_all()
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


def _elements(array) -> tuple[str, bool, bool, str]:
    """(kind, native byte order, writable, type name) of the elements of a
    numpy array, a torch tensor or an array interface; kind as numpy's
    dtype.kind ('u' unsigned, 'i' signed, 'f', 'c', 'b' bool, ...)."""
    if hasattr(array, "data_ptr") and hasattr(array, "element_size") and callable(array.stride):
        dtype = array.dtype
        if str(dtype) == "torch.bool":
            kind = "b"
        elif dtype.is_complex:
            kind = "c"
        elif dtype.is_floating_point:
            kind = "f"
        else:
            kind = "i" if dtype.is_signed else "u"
        return kind, True, True, str(dtype)
    for name in ("__cuda_array_interface__", "__array_interface__"):
        interface = getattr(array, name, None)
        if interface is not None:
            dtype = np.dtype(interface["typestr"])
            return dtype.kind, dtype.isnative, not interface["data"][1], str(dtype)
    raise TypeError(f"cannot describe a {type(array).__name__}: expected a numpy array or a torch tensor")


def _stored_buffer(array, name: str) -> tuple[int, int]:
    """(address, num_blocks) of a buffer of stored checksums: ValueError
    unless it is C-contiguous, writable, of native unsigned integers whose
    size divides BLOCK_CHECKSUM_BYTES, and holds whole blocks' checksums
    (num_blocks = bytes // BLOCK_CHECKSUM_BYTES). A strided or reversed
    view would have the library write over the elements between or before
    the view's; a float array would take bits for numbers."""
    kind, native, writable, type_name = _elements(array)
    address, shape, strides, item = _array_info(array)
    if kind != "u" or not native or BLOCK_CHECKSUM_BYTES % item:
        raise ValueError(
            f"{name} has elements of {type_name}; stored checksums need native unsigned integers of a size "
            f"dividing {BLOCK_CHECKSUM_BYTES} bytes (uint64: {BLOCK_CHECKSUM_BYTES // 8} per block id)"
        )
    step = item
    for n, stride in reversed(list(zip(shape, strides))):
        if n > 1 and stride != step:
            raise ValueError(
                f"{name} is not C-contiguous (shape {shape}, strides {strides} bytes): the library writes "
                f"{BLOCK_CHECKSUM_BYTES} bytes per block id from its first element on; pass a contiguous array"
            )
        step *= n
    if not writable:
        raise ValueError(f"{name} is read-only; the library writes the stored checksums into it")
    total = int(np.prod(shape, dtype=object)) * item
    if total % BLOCK_CHECKSUM_BYTES:
        raise ValueError(f"{name} holds {total} bytes, not a whole number of {BLOCK_CHECKSUM_BYTES}-byte checksums")
    return address, total // BLOCK_CHECKSUM_BYTES


@dataclasses.dataclass
class Layer:
    """An attention layer's cache on one worker (kvcs_layer), ready for
    Worker.add_layer; made by kvcsum.layer() or by hand.

    `arrays` holds the arrays (or tensors) the segments point into:
    kvcsum.layer() puts the cache (and v) there, so the memory lives as
    long as the Layer, and Worker.add_layer keeps them for the worker's
    lifetime. A Layer made by hand from addresses may leave it empty; its
    memory is then the caller's to keep."""

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
    arrays: tuple = dataclasses.field(default=(), repr=False, compare=False)

    def _struct(self):
        for i, segment in enumerate(self.segments):
            _of_type(segment, _lib.Segment, f"segments[{i}]")
        segments = (_lib.Segment * len(self.segments))(*self.segments)
        identity_bytes = _bytes(self.identity, "identity")
        identity = (c_uint8 * max(len(identity_bytes), 1)).from_buffer_copy(identity_bytes or b"\0")
        # Every integer field is checked against its C type as it is set
        # (_lib._Struct), so a layer_number of 2**32 + 3 is an error, not 3.
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
            identity_len=len(identity_bytes),
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
    pass `cache[:, i]` for layer i. The Layer keeps `cache` (and `v`), so
    they live while it does; the worker it is added to keeps them too.

    With `kernel_blocks` > 1 the B dimension counts kernel blocks, that
    many making one logical block (block b holds kernel blocks
    b*kernel_blocks ...). `first_head` is the global number of the first
    head held here (rank * heads for TP rank `rank`).

    The layout string's rules are the library's (kvcs_layer_from_layout,
    SPEC section 14): a layout it refuses raises kvcsum.InvalidArgument (a
    ValueError) naming the argument and value. Each segment's
    bytes_per_token is its own part of the cell (K's, or V's).
    """
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str such as \"NHD\", got {type(layout).__name__}")
    # The kvcs_layer fields, checked here where they are given (and again
    # as the struct is built), so an error points at this call.
    kernel_blocks = _int(kernel_blocks, "uint32_t", "kernel_blocks")
    layer_number = _int(layer_number, "uint32_t", "layer_number")
    group_id = _int(group_id, "uint32_t", "group_id")
    first_head = _int(first_head, "uint32_t", "first_head")
    replicas = _int(replicas, "uint32_t", "replicas")
    replica_index = _int(replica_index, "uint32_t", "replica_index")
    identity = _bytes(identity, "identity")

    # The layout string's rules (letters, K and V, what is refused) are
    # the library's: kvcs_layer_from_layout, SPEC section 14.
    def tensor_of(array, name: str) -> tuple:
        address, shape, strides, item = _array_info(array)
        sizes = (c_int64 * max(len(shape), 1))(*[_int(n, "int64_t", f"{name} shape") for n in shape])
        steps = (c_int64 * max(len(strides), 1))(*[_int(n, "int64_t", f"{name} strides") for n in strides])
        struct = _lib.TensorStruct(
            address=_int(address, "uint64_t", f"{name} address"),
            shape=ctypes.cast(sizes, ctypes.POINTER(c_int64)),
            strides=ctypes.cast(steps, ctypes.POINTER(c_int64)),
            ndim=len(shape),
            element_size=_int(item, "uint32_t", f"{name} element size"),
        )
        return struct, (sizes, steps)

    # The shape and stride arrays (cache_arrays, v_arrays) stay alive
    # through the call, which only reads them.
    cache_tensor, cache_arrays = tensor_of(cache, "cache")
    v_tensor, v_arrays = tensor_of(v, "v") if v is not None else (None, None)
    out = _lib.LayerStruct()
    segments = (_lib.Segment * 2)()
    _check(
        library().kvcs_layer_from_layout(
            _c(layout, "layout"),
            byref(cache_tensor),
            byref(v_tensor) if v_tensor is not None else None,
            kernel_blocks,
            byref(out),
            segments,
        )
    )
    return Layer(
        group_id=group_id,
        layer_number=layer_number,
        first_head=first_head,
        num_heads=out.num_heads,
        num_blocks=out.num_blocks,
        kernel_blocks=out.kernel_blocks,
        tokens_per_kernel_block=out.tokens_per_kernel_block,
        segments=[_lib.Segment.from_buffer_copy(segments[i]) for i in range(out.num_segments)],
        replicas=replicas,
        replica_index=replica_index,
        identity=identity,
        arrays=(cache,) if v is None else (cache, v),
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
STORED_OTHER_FINGERPRINT = 3  # stored under other layers or identities: not compared
STORED_OTHER_ALGORITHM = 4  # stored with another algorithm: not compared


# --- Handles -------------------------------------------------------------------


class Blocks(_Handle):
    """A request block set (kvcs_blocks).

    Thread safety: adding (add_request, add_group, set_hashes) needs the
    set alone, so such calls wait for any call using it; calls that only
    read it (Worker.checksum, Verifier.expect, ...) run concurrently."""

    _destroy = "kvcs_blocks_destroy"

    def __init__(self):
        super().__init__(_create(library().kvcs_blocks_create))

    def add_request(self, req_id: str, num_tokens: int) -> "Blocks":
        """Adds request `req_id` whose blocks hold `num_tokens` tokens."""
        req = _c(req_id, "req_id")
        num_tokens = _int(num_tokens, "uint64_t", "num_tokens")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_blocks_add_request(handle, req, num_tokens))
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


class Result(_Handle):
    """A worker's partial checksums (kvcs_result). Independent of its
    worker once made; it keeps the worker's arrays alive while it lives
    (a device may still be reading them).

    Thread safety: reads (ready, group, column, stored, encode) run
    concurrently; wait() needs the result alone and waits for them."""

    _destroy = "kvcs_result_destroy"

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
        """((replicas, replica_index), values) of one column."""
        column = _int(column, "size_t", "column")
        _, positions, _ = self.group(req_id, group_id)
        values = np.zeros(positions, dtype=np.uint64)
        replicas, index = c_uint32(), c_uint32()
        pointer = values.ctypes.data_as(ctypes.POINTER(c_uint64)) if positions else None
        with self._use() as handle:
            _check(
                self._lib.kvcs_result_column(
                    handle, _c(req_id, "req_id"), group_id, column, byref(replicas), byref(index), pointer
                )
            )
        return (replicas.value, index.value), values

    def columns(self, req_id: str, group_id: int) -> dict:
        """Every column of a group: {(replicas, replica_index): values}."""
        _, _, count = self.group(req_id, group_id)
        return dict(self.column_with_key(req_id, group_id, c) for c in range(count))

    def stored(self, req_id: str, group_id: int) -> np.ndarray:
        """A load check's verdicts (Worker.check_stored), one per block
        position: STORED_MATCHED, STORED_FAILED, STORED_NOT_CHECKED,
        STORED_OTHER_FINGERPRINT or STORED_OTHER_ALGORITHM."""
        _, positions, _ = self.group(req_id, group_id)
        outcomes = np.zeros(positions, dtype=np.uint8)
        pointer = outcomes.ctypes.data_as(ctypes.POINTER(c_uint8)) if positions else None
        with self._use() as handle:
            _check(self._lib.kvcs_result_stored(handle, _c(req_id, "req_id"), group_id, pointer))
        return outcomes

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
        if algorithm is not None:
            self.set_algorithm(algorithm)

    def add_region(self, address: int, length: int) -> None:
        """Registers `length` bytes at `address` that the worker may read
        (memory the caller keeps valid; add_region_of keeps an array)."""
        address = _int(address, "uint64_t", "address")
        length = _int(length, "uint64_t", "length")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_add_region(handle, address, length))

    def add_region_of(self, array) -> None:
        """Registers the bytes a numpy array or torch tensor spans, and
        keeps the array for the worker's lifetime."""
        self.add_region(*region_of(array))
        self._kept.append(array)

    def add_group(self, group_id: int, block_size: int) -> None:
        """Registers group `group_id` with `block_size` tokens per block."""
        group_id = _int(group_id, "uint32_t", "group_id")
        block_size = _int(block_size, "uint32_t", "block_size")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_add_group(handle, group_id, block_size))

    def skip_group(self, group_id: int, reason: str) -> None:
        """Declares a group this worker cannot checksum."""
        group_id = _int(group_id, "uint32_t", "group_id")
        reason = _c(reason, "reason")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_skip_group(handle, group_id, reason))

    def add_layer(self, layer: Layer) -> None:
        """Registers a layer (see kvcsum.layer) and keeps its arrays."""
        _of_type(layer, Layer, "layer")
        struct, keep_alive = layer._struct()
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_add_layer(handle, byref(struct)))
        self._kept.extend(layer.arrays)
        del keep_alive

    def set_detail(self, on: bool) -> None:
        """Detail mode: per-layer partials in results and records."""
        on = _flag(on, "on")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_set_detail(handle, on))

    def set_algorithm(self, algorithm: int) -> None:
        """The checksum algorithm, MIXED (the default) or WEIGHTED (vLLM's),
        set before the worker's first checksum, store or load check."""
        algorithm = _int(algorithm, "uint32_t", "algorithm")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_worker_set_algorithm(handle, algorithm))

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

    def store(self, blocks: Blocks, cuda_stream: int | None = None) -> Result:
        """Checksums `blocks` and writes each block's stored checksum."""
        return self._call_result(self._lib.kvcs_worker_store, blocks, cuda_stream)

    def check_stored(self, blocks: Blocks, cuda_stream: int | None = None) -> Result:
        """Checksums loaded `blocks` against their stored checksums; read the
        verdicts with Result.stored."""
        return self._call_result(self._lib.kvcs_worker_check_stored, blocks, cuda_stream)

    def block_tags(self, group_id: int, hashes: Sequence[bytes]) -> np.ndarray:
        """The tags of docs/SPEC.md section 8 for blocks with these hashes."""
        group_id = _int(group_id, "uint32_t", "group_id")
        hashes = _bytes_list(hashes, "hashes")
        size = len(hashes[0]) if hashes else 8
        data = b"".join(hashes)
        buffer = (c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        tags = np.zeros(len(hashes), dtype=np.uint64)
        pointer = tags.ctypes.data_as(ctypes.POINTER(c_uint64)) if len(hashes) else None
        with self._use() as handle:
            _check(self._lib.kvcs_block_tags(handle, group_id, buffer, size, len(hashes), pointer))
        return tags

    def checksum(self, blocks: Blocks, role: int = PRODUCER, cuda_stream: int | None = None) -> Result:
        """Computes (host) or queues (device, on `cuda_stream`) the partial
        checksums of every block in `blocks`."""
        _of_type(blocks, Blocks, "blocks")
        role = _int(role, "uint32_t", "role")
        return self._call_result(
            lambda handle, blocks_handle, stream, out: self._lib.kvcs_worker_checksum(
                handle, blocks_handle, role, stream, out
            ),
            blocks,
            cuda_stream,
        )


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
    """A reason the load or a group was not compared: `reason` is one of
    NO_CHECKSUMS ... NOT_LOAD_CHECK, `group_id` WHOLE_LOAD for the whole
    load."""

    reason: int
    reason_name: str
    group_id: int
    message: str


class Report(_Handle):
    """A verifier's judgement of one load (kvcs_report); independent of its
    verifier.

    Thread safety: immutable; every property may be read concurrently."""

    _destroy = "kvcs_report_destroy"

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
        """The first finding's reason (NO_CHECKSUMS ...; 0 when none)."""
        return self._u32(self._lib.kvcs_report_reason)

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
        token count. A MATCH says nothing about them; with
        Verifier.set_require_coverage(True) such a load is UNVERIFIED
        (UNCOMPARED_POSITIONS). 0 when everything loaded was compared."""
        return self._u64(self._lib.kvcs_report_uncompared_positions)

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
                out.append(Finding(reason.value, name, group.value, text.value.decode(errors="replace")))
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

    def set_policy(self, policy: int) -> None:
        """FAIL_OPEN or FAIL_CLOSED."""
        policy = _int(policy, "uint32_t", "policy")
        with self._use() as handle:
            _check(self._lib.kvcs_verifier_set_policy(handle, policy))

    def set_extension(self, on: bool) -> None:
        """Producer: payloads carry the kvcsum extension."""
        on = _flag(on, "on")
        with self._use() as handle:
            _check(self._lib.kvcs_verifier_set_extension(handle, on))

    def set_require_coverage(self, on: bool) -> None:
        """Consumer: with True a load is UNVERIFIED (UNCOMPARED_POSITIONS)
        when some loaded position was not compared
        (Report.uncompared_positions > 0) and none differs; False (the
        default, as vLLM) compares only the positions both sides hold with
        equal valid tokens and lets the rest pass. Applies to check and
        check_stored."""
        on = _flag(on, "on")
        with self._use() as handle:
            _check(self._lib.kvcs_verifier_set_require_coverage(handle, on))

    def set_producer_tp_size(self, tp_size: int) -> None:
        """Consumer: the producer's TP size."""
        tp_size = _int(tp_size, "uint32_t", "tp_size")
        with self._use() as handle:
            _check(self._lib.kvcs_verifier_set_producer_tp_size(handle, tp_size))

    def set_producer_block_size(self, group_id: int, block_size: int) -> None:
        """Consumer: the producer's block size of a group."""
        group_id = _int(group_id, "uint32_t", "group_id")
        block_size = _int(block_size, "uint32_t", "block_size")
        with self._use() as handle:
            _check(self._lib.kvcs_verifier_set_producer_block_size(handle, group_id, block_size))

    def expect(self, scheduled: Blocks, role: int) -> None:
        """Registers the requests of `scheduled` in `role`."""
        _of_type(scheduled, Blocks, "scheduled")
        role = _int(role, "uint32_t", "role")
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

    def _report(self, function, *args) -> Report:
        out = c_void_p()
        with self._use() as handle:
            _check(function(handle, *args, byref(out)))
        return Report._adopt(out.value)

    def check(self, req_id: str, payload: bytes | str | None) -> Report:
        """Consumer: judges the load of `req_id` against the producer's
        payload: bytes, the base64 text of kv_transfer_params["kv_checksums"],
        or None when the producer sent none."""
        req = _c(req_id, "req_id")
        if payload is None:
            return self._report(self._lib.kvcs_verifier_check_no_payload, req)
        if isinstance(payload, str):
            return self._report(self._lib.kvcs_verifier_check_base64, req, _c(payload, "payload"))
        data, length = _bytes_of(payload, "payload")
        return self._report(self._lib.kvcs_verifier_check, req, data, length)

    def check_stored(self, req_id: str) -> Report:
        """Consumer: judges the offload load of `req_id` from its workers'
        load-check records alone (Worker.check_stored results, encoded and
        added with add_record): MATCH, MISMATCH at the positions whose stored
        checksum failed on some worker, or UNVERIFIED (e.g. a record is not a
        load check's: NOT_LOAD_CHECK)."""
        return self._report(self._lib.kvcs_verifier_check_stored, _c(req_id, "req_id"))


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
    when the sizes do not divide, or a size is 0 or above KVCS_MAX_TP_SIZE
    (65536)."""
    local_tp, remote_tp = _int(local_tp, "uint32_t", "local_tp"), _int(remote_tp, "uint32_t", "remote_tp")
    value = c_int64()
    _check(library().kvcs_tp_ratio(local_tp, remote_tp, byref(value)))
    return value.value


def _ranks_args(local_rank, local_tp, remote_tp) -> tuple[int, int, int]:
    return (
        _int(local_rank, "uint32_t", "local_rank"),
        _int(local_tp, "uint32_t", "local_tp"),
        _int(remote_tp, "uint32_t", "remote_tp"),
    )


def remote_ranks(local_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """The remote ranks local rank `local_rank` reads from."""
    lib = library()
    args = _ranks_args(local_rank, local_tp, remote_tp)
    return _u32_list(lambda buf, cap, n: lib.kvcs_remote_ranks(*args, buf, cap, n))


def handshake_targets(local_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """The remote ranks to handshake with, from the TP sizes alone."""
    lib = library()
    args = _ranks_args(local_rank, local_tp, remote_tp)
    return _u32_list(lambda buf, cap, n: lib.kvcs_handshake_targets(*args, buf, cap, n))


def block_size_ratio(local_block_size: int, remote_block_size: int) -> int:
    """local/remote block size; InvalidArgument when not whole."""
    local_block_size = _int(local_block_size, "uint32_t", "local_block_size")
    remote_block_size = _int(remote_block_size, "uint32_t", "remote_block_size")
    value = c_uint32()
    _check(library().kvcs_block_size_ratio(local_block_size, remote_block_size, byref(value)))
    return value.value


def remote_kv_replicated(remote_tp: int, total_kv_heads: int) -> bool:
    """Whether the remote engine replicates KV heads (remote_tp > heads)."""
    remote_tp = _int(remote_tp, "uint32_t", "remote_tp")
    total_kv_heads = _int(total_kv_heads, "uint32_t", "total_kv_heads")
    value = c_uint32()
    _check(library().kvcs_remote_kv_replicated(remote_tp, total_kv_heads, byref(value)))
    return bool(value.value)


def local_kv_replicated(tp: int, total_kv_heads: int, is_mla: bool = False) -> bool:
    """Whether the local engine replicates KV heads (MLA, or tp > heads)."""
    tp, total_kv_heads = _int(tp, "uint32_t", "tp"), _int(total_kv_heads, "uint32_t", "total_kv_heads")
    value = c_uint32()
    _check(library().kvcs_local_kv_replicated(tp, total_kv_heads, _flag(is_mla, "is_mla"), byref(value)))
    return bool(value.value)


def rank_heads(rank: int, tp: int, total_kv_heads: int, is_mla: bool = False) -> range:
    """The global heads rank `rank` of an engine of TP size `tp` holds."""
    rank, tp = _int(rank, "uint32_t", "rank"), _int(tp, "uint32_t", "tp")
    total_kv_heads = _int(total_kv_heads, "uint32_t", "total_kv_heads")
    first, count = c_uint32(), c_uint32()
    _check(library().kvcs_rank_heads(rank, tp, total_kv_heads, _flag(is_mla, "is_mla"), byref(first), byref(count)))
    return range(first.value, first.value + count.value)


def head_sources(
    local_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int, is_mla: bool = False
) -> list[HeadSource]:
    """For local rank `local_rank`, each run of its heads with the remote
    rank that supplies it."""
    lib = library()
    args = _ranks_args(local_rank, local_tp, remote_tp) + (
        _int(total_kv_heads, "uint32_t", "total_kv_heads"),
        _flag(is_mla, "is_mla"),
    )
    return _head_sources(lambda buf, cap, n: lib.kvcs_head_sources(*args, buf, cap, n))


class Topology(_Handle):
    """One local worker's view of the engines it transfers with
    (kvcs_topology): per remote engine id, what its handshake told.

    Thread safety: add_remote needs the topology alone (it waits for calls
    in progress); the queries run concurrently."""

    _destroy = "kvcs_topology_destroy"

    def __init__(
        self, local_engine_id: str, *, tp_rank: int, tp_size: int, total_kv_heads: int, block_size: int, is_mla: bool = False
    ):
        # Struct fields are checked against their C types as they are set.
        local = _lib.LocalEngineStruct(
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_kv_heads=total_kv_heads,
            is_mla=_flag(is_mla, "is_mla"),
            block_size=block_size,
        )
        engine = _c(local_engine_id, "local_engine_id")
        super().__init__(_create(library().kvcs_topology_create, engine, byref(local)))

    def add_remote(self, engine_id: str, remote: RemoteEngine) -> bool:
        """Records a handshake; False when the engine was known (kept as first told)."""
        engine = _c(engine_id, "engine_id")
        _of_type(remote, RemoteEngine, "remote")
        struct = _lib.RemoteEngineStruct(
            block_bytes=remote.block_bytes,
            tp_size=remote.tp_size,
            block_size=remote.block_size,
            kernel_blocks=remote.kernel_blocks,
        )
        added = c_uint32()
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_topology_add_remote(handle, engine, byref(struct), byref(added)))
        return bool(added.value)

    def remote(self, engine_id: str) -> RemoteEngine:
        """What `engine_id`'s handshake told; NotFound when none."""
        engine = _c(engine_id, "engine_id")
        struct = _lib.RemoteEngineStruct()
        with self._use() as handle:
            _check(self._lib.kvcs_topology_remote(handle, engine, byref(struct)))
        return RemoteEngine(struct.tp_size, struct.block_bytes, struct.block_size, struct.kernel_blocks)

    def tp_ratio(self, engine_id: str) -> int:
        """tp_ratio of the local engine and `engine_id`."""
        engine = _c(engine_id, "engine_id")
        value = c_int64()
        with self._use() as handle:
            _check(self._lib.kvcs_topology_tp_ratio(handle, engine, byref(value)))
        return value.value

    def block_size_ratio(self, engine_id: str) -> int:
        """block_size_ratio of the local engine and `engine_id`."""
        engine = _c(engine_id, "engine_id")
        value = c_uint32()
        with self._use() as handle:
            _check(self._lib.kvcs_topology_block_size_ratio(handle, engine, byref(value)))
        return value.value

    def remote_kv_replicated(self, engine_id: str) -> bool:
        """Whether `engine_id` replicates KV heads."""
        engine = _c(engine_id, "engine_id")
        value = c_uint32()
        with self._use() as handle:
            _check(self._lib.kvcs_topology_remote_kv_replicated(handle, engine, byref(value)))
        return bool(value.value)

    def remote_ranks(self, engine_id: str) -> list[int]:
        """The ranks of `engine_id` this worker reads from."""
        engine = _c(engine_id, "engine_id")
        with self._use() as handle:
            return _u32_list(lambda buf, cap, n: self._lib.kvcs_topology_remote_ranks(handle, engine, buf, cap, n))

    def head_sources(self, engine_id: str) -> list[HeadSource]:
        """Which rank of `engine_id` supplies each run of this worker's heads."""
        engine = _c(engine_id, "engine_id")
        with self._use() as handle:
            return _head_sources(
                lambda buf, cap, n: self._lib.kvcs_topology_head_sources(handle, engine, buf, cap, n)
            )


class Completion(_Handle):
    """Says when every expected worker reported a request finished sending
    or receiving (kvcs_completion); unites invalid block ids.

    Thread safety: report, set_expected, add_invalid_blocks and
    clear_invalid_blocks need the counter alone (they wait for calls in
    progress); reported and invalid_blocks run concurrently."""

    _destroy = "kvcs_completion_destroy"

    def __init__(self, expected_workers: int):
        expected_workers = _int(expected_workers, "uint32_t", "expected_workers")
        super().__init__(_create(library().kvcs_completion_create, expected_workers))

    def set_expected(self, expected_workers: int) -> None:
        """The expected count (at least 1; InvalidArgument for 0) for
        requests first reported from now on."""
        expected_workers = _int(expected_workers, "uint32_t", "expected_workers")
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_completion_set_expected(handle, expected_workers))

    def report(
        self, worker: int, direction: int, req_ids: Sequence[str], expected_workers: int | None = None
    ) -> list[str]:
        """Worker `worker` finished `req_ids` in `direction` (SENDING or
        RECEIVING); returns the requests this report completed.

        A worker's output may carry a new expected count (vLLM's
        KVConnectorOutput.expected_finished_count): pass it as
        `expected_workers`; it applies from this report's new requests on.
        None or 0 means no change, as 0 does in vLLM (the field's default,
        which its aggregator ignores); any other value goes to
        set_expected (a negative one or a bool is refused)."""
        worker = _int(worker, "uint32_t", "worker")
        direction = _int(direction, "uint32_t", "direction")
        if isinstance(req_ids, (str, bytes)):
            raise TypeError(f"req_ids must be a sequence of str, got one {type(req_ids).__name__}")
        req_ids = list(req_ids)
        encoded = [_c(r, f"req_ids[{i}]") for i, r in enumerate(req_ids)]
        if expected_workers is not None and _int(expected_workers, "uint32_t", "expected_workers"):
            self.set_expected(expected_workers)
        ids = (c_char_p * max(len(encoded), 1))(*encoded)
        done = (c_uint8 * max(len(encoded), 1))()
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_completion_report(handle, worker, direction, ids, len(encoded), done))
        return [r for r, d in zip(req_ids, done) if d]

    def reported(self, direction: int, req_id: str) -> int:
        """Workers that reported `req_id` so far (0 once it completed)."""
        direction = _int(direction, "uint32_t", "direction")
        req = _c(req_id, "req_id")
        value = c_uint32()
        with self._use() as handle:
            _check(self._lib.kvcs_completion_reported(handle, direction, req, byref(value)))
        return value.value

    def add_invalid_blocks(self, block_ids: Iterable[int]) -> None:
        """Adds block ids a worker found invalid."""
        ids = _block_ids(block_ids)
        pointer = ids.ctypes.data_as(ctypes.POINTER(c_uint32)) if ids.size else None
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_completion_add_invalid_blocks(handle, pointer, ids.size))

    def invalid_blocks(self) -> set[int]:
        """The union of invalid block ids since the last clear."""
        with self._use() as handle:
            return set(_u32_list(lambda buf, cap, n: self._lib.kvcs_completion_invalid_blocks(handle, buf, cap, n)))

    def clear_invalid_blocks(self) -> None:
        """Forgets the invalid block ids."""
        with self._use(exclusive=True) as handle:
            _check(self._lib.kvcs_completion_clear_invalid_blocks(handle))


# --- Repair (reload only the blocks that differ) ---------------------------------

__all__ += ["RepairBlock", "repair_plan"]


@dataclasses.dataclass(frozen=True)
class RepairBlock:
    """A consumer block to load again (kvcs_repair_block): its group, block
    position and block id, and the request tokens of it that were compared
    and differ, half-open: `[start_token, end_token)`, which is
    `first_token` and the `num_tokens` from it."""

    group_id: int
    position: int
    block_id: int
    first_token: int
    num_tokens: int

    @property
    def start_token(self) -> int:
        """The first request token to load again (first_token)."""
        return self.first_token

    @property
    def end_token(self) -> int:
        """One past the last request token to load again."""
        return self.first_token + self.num_tokens


def repair_plan(report, block_tables: dict, block_size) -> dict[int, list[RepairBlock]]:
    """The consumer blocks to transfer again after a MISMATCH, per group
    (kvcs_report_repair_plan; SPEC section 15).

    `report` is a Report (or a list of its Mismatch entries); `block_tables`
    maps each group id to the consumer's block ids of the request, either
    from position 0 (`{0: [7, 2, 9]}`) or as `(first_position, block_ids)`;
    `block_size` is the consumer's tokens per block, one int (for every
    group of `block_tables`) or `{group_id: block_size}`. Returns
    `{group_id: [RepairBlock, ...]}` in position order, each position once;
    a MATCH gives `{}`.

    Where the two sides' block sizes differ, a mismatch covers a run of
    their least common multiple, so every consumer block of that run is
    named.

    Raises kvcsum.InvalidArgument (a ValueError) where a plan would not make
    the load verified:
    - an UNVERIFIED report (it names no positions: the load must be
      repeated whole);
    - a report with findings, such as a MISMATCH in one group while
      another group's fingerprint differs: that group was not compared, and
      reloading blocks cannot make it comparable, so the plan would end in
      an unverified load; the message names each such group and reason,
      and the load must be repeated whole (or the configuration fixed).
      A list of Mismatch entries carries no findings: passing one skips
      this check (its entries of one group must not overlap);
    - a mismatch that does not fit the tables: a group with no table, a
      position without a block id, a group without a block size, tokens
      outside the position.
    Block sizes and block ids must be integers (TypeError for a bool or a
    non-integer); ValueError for a block size below 1 or a block id outside
    [0, 2**32).
    """
    tables = {}
    for group, table in block_tables.items():
        group = _int(group, "uint32_t", "group id of block_tables")
        first_position, ids = table if isinstance(table, tuple) else (0, table)
        first_position = _int(first_position, "uint64_t", f"first position of block_tables[{group}]")
        ids = [_int(b, "uint32_t", f"block_tables[{group}][{i}]") for i, b in enumerate(ids)]
        tables[group] = (first_position, ids)
    if isinstance(block_size, dict):
        sizes = {_int(g, "uint32_t", "group id of block_size"): s for g, s in block_size.items()}
    else:
        sizes = dict.fromkeys(tables, block_size)
    sizes = {g: _int(s, "uint32_t", f"block_size of group {g}") for g, s in sizes.items()}
    group_ids = (c_uint32 * max(len(sizes), 1))(*sizes)
    block_sizes = (c_uint32 * max(len(sizes), 1))(*sizes.values())
    # Each entry is a distinct table position, so this many always suffice.
    cap = sum(len(ids) for _, ids in tables.values())
    entries = (_lib.RepairBlockStruct * max(cap, 1))()
    count = c_size_t()
    lib = library()
    with Blocks() as blocks:
        blocks.add_request("repair", 0)
        for group, (first_position, ids) in tables.items():
            blocks.add_group("repair", group, ids, first_position)
        with blocks._use() as blocks_handle:
            args = (blocks_handle, b"repair", group_ids, block_sizes, len(sizes), entries, cap, byref(count))
            if isinstance(report, Report):
                with report._use() as handle:
                    _check(lib.kvcs_report_repair_plan(handle, *args))
            else:
                mismatches = list(report)
                structs = (_lib.MismatchStruct * max(len(mismatches), 1))()
                for i, m in enumerate(mismatches):
                    structs[i] = _lib.MismatchStruct(
                        group_id=m.group_id,
                        first_position=m.first_position,
                        num_positions=m.num_positions,
                        first_token=m.first_token,
                        num_tokens=m.num_tokens,
                    )
                _check(lib.kvcs_repair_plan(structs, len(mismatches), *args))
    plan: dict[int, list[RepairBlock]] = {}
    for entry in entries[: count.value]:
        plan.setdefault(entry.group_id, []).append(
            RepairBlock(
                entry.group_id, entry.position, entry.block_id, entry.start_token, entry.end_token - entry.start_token
            )
        )
    return plan
