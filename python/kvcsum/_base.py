"""What every part of the package builds on: the loaded library, the
status check, argument conversion and checks, and the handle base class."""

from __future__ import annotations

import contextlib
import enum
import math
import struct
import threading
from ctypes import byref, c_size_t, c_uint8, c_void_p

import numpy as np

from . import _lib
from ._constants import Status
from ._errors import _ERRORS, Error
from ._lib import checked_int as _int

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


_OK = Status.OK
_NOT_READY = Status.NOT_READY
_BUFFER_TOO_SMALL = Status.BUFFER_TOO_SMALL


def _check(status: int) -> None:
    """Raises the Error of a non-OK status with the thread's last message."""
    if status != _OK:
        lib = library()
        message = lib.kvcs_last_error().decode(errors="replace")
        name = lib.kvcs_status_name(status).decode()
        raise _ERRORS.get(status, Error)(_member(Status, status), name, message)


def _member(enum_type, value: int):
    """`value` as a member of the IntEnum `enum_type`, or as the plain int
    where the library gives a value this package does not know (a newer
    library's), so a new value reaches the caller instead of a ValueError."""
    try:
        return enum_type(value)
    except ValueError:
        return value


def _enum(value, enum_type, name: str) -> int:
    """An argument of the C enum `enum_type` (an IntEnum of this package)
    as an int: a member of `enum_type` or a plain integer, checked as a
    uint32_t. TypeError for a member of another enum, which is an int too
    and would pass as whatever value it has (Verifier.set_policy(kvcsum.MATCH)
    would mean FAIL_OPEN, checksum(role=kvcsum.WEIGHTED) CONSUMER)."""
    if isinstance(value, enum.Enum) and not isinstance(value, enum_type):
        raise TypeError(
            f"{name} must be a kvcsum.{enum_type.__name__} (or an int), got "
            f"{type(value).__name__}.{value.name} ({value.value!r})"
        )
    return _int(value, "uint32_t", name)


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


def _scale_bits(value, name: str) -> int:
    """A scale argument as the bits of its IEEE-754 binary64 value: None is
    0 (not declared); TypeError unless a real number (a bool is none);
    ValueError for 0, whose bits would read as "not declared". The library
    refuses NaN, infinities and negative values, naming them."""
    if value is None:
        return 0
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number or None, got {type(value).__name__} {value!r:.80}")
    value = float(value)
    if value == 0.0 and math.copysign(1.0, value) > 0:
        raise ValueError(f"{name} is 0.0, which is no scale (None leaves it undeclared)")
    return struct.unpack("<Q", struct.pack("<d", value))[0]


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
    """A CUstream as an int: None (the legacy default stream), an int (a
    CUstream handle, numpy integers too), or an object that carries one: a
    torch.cuda.Stream or a CuPy stream (its `cuda_stream` attribute, or
    `ptr`), or anything with `__cuda_stream__()` (the CUDA stream protocol:
    a (version, handle) pair). TypeError for anything else, naming it."""
    if cuda_stream is None:
        return None
    if isinstance(cuda_stream, bool):
        raise TypeError("cuda_stream is a bool, not a CUDA stream (an int handle, a torch.cuda.Stream, ...)")
    if isinstance(cuda_stream, (int, np.integer)):
        return _int(cuda_stream, "uintptr_t", "cuda_stream")
    protocol = getattr(cuda_stream, "__cuda_stream__", None)
    if protocol is not None:
        pair = protocol() if callable(protocol) else protocol
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(
                f"cuda_stream's __cuda_stream__() gave {pair!r}, not a (version, handle) pair "
                f"({type(cuda_stream).__name__})"
            )
        return _int(pair[1], "uintptr_t", f"cuda_stream ({type(cuda_stream).__name__}.__cuda_stream__()[1])")
    for attribute in ("cuda_stream", "ptr"):
        handle = getattr(cuda_stream, attribute, None)
        if handle is not None and not callable(handle):
            return _int(handle, "uintptr_t", f"cuda_stream ({type(cuda_stream).__name__}.{attribute})")
    raise TypeError(
        f"cuda_stream is a {type(cuda_stream).__name__}, not a CUDA stream: pass an int handle, a "
        "torch.cuda.Stream, or an object with cuda_stream or __cuda_stream__"
    )


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


class _Busy(Exception):
    """Another thread has the handle alone (raised by _use(wait=False))."""


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
        # Taken alone (a C-level `with`) on the fast path; the condition
        # over it only where a call must wait.
        self._lock = threading.Lock()
        self._state = threading.Condition(self._lock)
        self._waiting = 0  # calls waiting on the condition
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

    def _acquire(self, exclusive: bool = False, wait: bool = True) -> int:
        """The open handle, taken for one call (each _acquire is followed by
        one _release); ValueError once closed. With wait=False, _Busy
        instead of waiting for another thread's call."""
        with self._lock:
            while self._handle and (self._exclusive or (exclusive and self._users)):
                if not wait:
                    raise _Busy
                self._waiting += 1
                try:
                    self._state.wait()
                finally:
                    self._waiting -= 1
            if not self._handle:
                raise ValueError(f"this {type(self).__name__} is closed")
            self._users += 1
            self._exclusive = exclusive
            return self._handle

    def _release(self) -> None:
        """Ends the call an _acquire began (frees a handle closed meanwhile
        once its last call ends)."""
        with self._lock:
            self._users -= 1
            self._exclusive = False
            orphan = None
            if not self._users:
                orphan, self._orphan = self._orphan, None
                if self._waiting:
                    self._state.notify_all()
        if orphan:
            getattr(self._lib, self._destroy)(orphan)

    @contextlib.contextmanager
    def _use(self, exclusive: bool = False, wait: bool = True):
        """The open handle for the length of one call; ValueError once
        closed. With wait=False, _Busy instead of waiting for another
        thread's call (a repr must never block)."""
        handle = self._acquire(exclusive, wait)
        try:
            yield handle
        finally:
            self._release()

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

    def __repr__(self) -> str:
        name = f"kvcsum.{type(self).__name__}"
        if not getattr(self, "_handle", None):
            return f"<{name} closed>"
        try:
            details = self._describe()
        except _Busy:
            details = "(in use by another thread)"
        except Exception as error:  # a repr must not raise (closed meanwhile, ...)
            details = f"({type(error).__name__}: {error})"
        return f"<{name} {details}>" if details else f"<{name}>"

    def _describe(self) -> str:
        """What the repr of an open handle says after the class name; a
        call into C here uses self._use(wait=False)."""
        return ""

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
