"""Layers from arrays: kvcsum.layer() and Layer, region_of, StateTensor,
and the checks of a stored-checksum buffer."""

from __future__ import annotations

import ctypes
import dataclasses
import sys
from ctypes import byref, c_int64, c_uint8

import numpy as np

from . import _lib
from ._base import _bytes, _c, _check, _int, _of_type, library
from ._lib import BLOCK_CHECKSUM_BYTES

# --- Layers from arrays --------------------------------------------------------


# --- DLPack (https://dmlc.github.io/dlpack/latest/c_api.html) ------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


#: DLPack's type codes as numpy's dtype kinds (kDLInt, kDLUInt, kDLFloat,
#: kDLBfloat, kDLComplex, kDLBool; kDLOpaqueHandle is no number).
_DL_KINDS = {0: "i", 1: "u", 2: "f", 4: "f", 5: "c", 6: "b"}
#: kDLCPU, kDLCUDA, kDLCUDAHost (pinned), kDLCUDAManaged: memory a worker
#: can read (a host worker the first, third and fourth, a device worker
#: the CUDA ones).
_DL_DEVICES = {1: "cpu", 2: "cuda", 3: "cuda_host", 13: "cuda_managed"}


def _has_dlpack(array) -> bool:
    return callable(getattr(array, "__dlpack__", None))


def _dlpack_info(array) -> tuple[int, tuple, tuple, int, str, str]:
    """(address, shape, byte strides, item size, numpy kind, device name of
    _DL_DEVICES) of a DLPack
    producer (`__dlpack__`: JAX, CuPy, TensorFlow, numpy ...). Only the
    description is read: the capsule is left unconsumed, so its own
    destructor releases the producer's export, and the caller keeps the
    producer (which owns the memory) alive, as for any tensor."""
    pythonapi = ctypes.pythonapi
    pythonapi.PyCapsule_IsValid.restype = ctypes.c_int
    pythonapi.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
    pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
    pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    capsule = array.__dlpack__()
    if pythonapi.PyCapsule_IsValid(capsule, b"dltensor"):
        managed = _DLManagedTensor.from_address(pythonapi.PyCapsule_GetPointer(capsule, b"dltensor"))
    elif pythonapi.PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        managed = _DLManagedTensorVersioned.from_address(pythonapi.PyCapsule_GetPointer(capsule, b"dltensor_versioned"))
        if managed.major != 1:
            raise TypeError(f"{type(array).__name__}.__dlpack__() gave DLPack {managed.major}.{managed.minor}, not 1.x")
    else:
        raise TypeError(f"{type(array).__name__}.__dlpack__() gave {capsule!r}, not a DLPack capsule")
    tensor = managed.dl_tensor
    device = _DL_DEVICES.get(tensor.device.device_type)
    if device is None:
        raise TypeError(
            f"{type(array).__name__} lives on DLPack device type {tensor.device.device_type}, not the host or CUDA"
        )
    dtype = tensor.dtype
    kind = _DL_KINDS.get(dtype.code)
    if kind is None or dtype.bits % 8 or dtype.bits == 0:
        raise TypeError(
            f"{type(array).__name__} has DLPack elements of code {dtype.code}, {dtype.bits} bits: kvcsum reads "
            "whole bytes of numbers"
        )
    item = dtype.bits // 8 * max(dtype.lanes, 1)
    ndim = int(tensor.ndim)
    shape = tuple(int(tensor.shape[i]) for i in range(ndim))
    if tensor.strides:
        strides = tuple(int(tensor.strides[i]) * item for i in range(ndim))
    else:  # compact, row-major
        steps, step = [], item
        for n in reversed(shape):
            steps.append(step)
            step *= n
        strides = tuple(reversed(steps))
    address = int(tensor.data or 0) + int(tensor.byte_offset)
    del capsule
    return address, shape, strides, item, kind, device


def _array_info(array) -> tuple[int, tuple, tuple, int]:
    """(address, shape, byte strides, item size) of a numpy array, a torch
    tensor, anything with __cuda_array_interface__ / __array_interface__,
    or a DLPack producer (__dlpack__)."""
    if hasattr(array, "data_ptr") and hasattr(array, "element_size") and callable(array.stride):
        item = int(array.element_size())
        return int(array.data_ptr()), tuple(int(n) for n in array.shape), tuple(int(s) * item for s in array.stride()), item
    if not hasattr(array, "__cuda_array_interface__") and not hasattr(array, "__array_interface__") and _has_dlpack(array):
        return _dlpack_info(array)[:4]
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
    raise TypeError(
        f"cannot describe a {type(array).__name__}: expected a numpy array, a torch tensor or a DLPack producer"
    )


def _hip_version() -> str | None:
    """ROCm's HIP version where the loaded torch is ROCm's build (whose GPUs
    are also "cuda" devices), else None; torch is not imported here."""
    return getattr(getattr(sys.modules.get("torch"), "version", None), "hip", None)


def _memory_of(array) -> str:
    """Where the bytes of `array` live, as far as it says: "host" (numpy,
    a CPU torch tensor, pinned or not, `__array_interface__`, DLPack's CPU,
    pinned and managed memory), "cuda" (a torch tensor on a CUDA device,
    `__cuda_array_interface__`, DLPack's CUDA device memory), "rocm" (a
    torch tensor on a GPU of ROCm's torch, whose device type is also
    "cuda"), or a torch tensor's other device type ("xpu", "mps", "meta",
    ...). The interface `_array_info` takes its address from decides."""
    if hasattr(array, "data_ptr") and hasattr(array, "element_size") and callable(array.stride):
        kind = str(getattr(getattr(array, "device", None), "type", "cpu"))
        if kind == "cpu":
            return "host"
        if kind == "cuda" and _hip_version():
            return "rocm"
        return kind
    if not hasattr(array, "__cuda_array_interface__") and not hasattr(array, "__array_interface__") and _has_dlpack(array):
        # _dlpack_info refuses device types other than these.
        return "cuda" if _dlpack_info(array)[5] == "cuda" else "host"
    return "cuda" if hasattr(array, "__cuda_array_interface__") else "host"


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
    if not hasattr(array, "__cuda_array_interface__") and not hasattr(array, "__array_interface__") and _has_dlpack(array):
        _, _, _, item, kind, _ = _dlpack_info(array)
        # DLPack says nothing of writability (1.x's read-only flag aside): a
        # stored-checksum buffer takes a numpy array or a torch tensor.
        return kind, True, False, f"DLPack {kind}{8 * item}"
    for name in ("__cuda_array_interface__", "__array_interface__"):
        interface = getattr(array, name, None)
        if interface is not None:
            dtype = np.dtype(interface["typestr"])
            return dtype.kind, dtype.isnative, not interface["data"][1], str(dtype)
    raise TypeError(f"cannot describe a {type(array).__name__}: expected a numpy array or a torch tensor")


def _numeric(array, name: str) -> None:
    """TypeError unless `array` holds numbers (bool, integers, floats,
    complex, or a numeric scalar type numpy registers, such as ml_dtypes'
    bfloat16): an array of Python objects holds pointers, a str or bytes
    array characters, a structured or void one records, and checksumming
    their bytes would compare pointers and padding, not KV."""
    if hasattr(array, "data_ptr") and hasattr(array, "element_size") and callable(array.stride):
        return  # torch's dtypes are all numeric
    if isinstance(array, np.ndarray):
        dtype = array.dtype
    elif not hasattr(array, "__cuda_array_interface__") and not hasattr(array, "__array_interface__") and _has_dlpack(array):
        return  # _dlpack_info refuses what is not whole bytes of numbers
    else:
        interface = getattr(array, "__cuda_array_interface__", None) or getattr(array, "__array_interface__", None)
        if interface is None:
            return  # _array_info says what it cannot describe
        descr = interface.get("descr")
        structured = descr is not None and (len(descr) > 1 or descr[0][0] != "")
        dtype = np.dtype(descr if structured else interface["typestr"])
    registered_scalar = dtype.kind == "V" and dtype.fields is None and dtype.subdtype is None and dtype.type is not np.void
    if dtype.hasobject or not (dtype.kind in "biufc" or registered_scalar):
        what = {"O": "Python objects", "U": "str", "S": "bytes", "V": "records (structured or void)"}.get(
            dtype.kind, f"dtype kind {dtype.kind!r}"
        )
        raise TypeError(
            f"{name} has elements of dtype {dtype} ({what}); a KV cache holds numbers (float16, bfloat16, "
            f"float8, int8, uint8, ...), and their bytes are what is checksummed"
        )


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
    memory is then the caller's to keep.

    Thread safety: a plain mutable value; do not change it while another
    thread passes it to Worker.add_layer."""

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
    SPEC section 14): a layout it refuses (a view whose cells share bytes,
    such as np.broadcast_to's or torch's expand()) raises
    kvcsum.InvalidArgument (a ValueError) naming the argument and value.
    Each segment's bytes_per_token is its own part of the cell (K's, or
    V's). An array of non-numeric elements (object, str, bytes, structured
    or void) raises TypeError.
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
        _numeric(array, name)
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
    (kvcs_state_tensor): strides in bytes.

    Thread safety: immutable (a frozen dataclass); share it freely."""

    address: int
    block_stride: int
    row_stride: int
    first_row: int
    num_rows: int
    total_rows: int
    bytes_per_row: int
    element_size: int
