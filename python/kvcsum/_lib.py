"""Loads libkvcsum and declares its C ABI to ctypes (kvcsum.h, by hand).

The declarations here are checked against the loaded library when it is
loaded: its ABI version must equal ABI_VERSION, and every struct's ctypes
size must equal the library's own (the exported kvcs_<struct>_size()
calls), so a library whose structs drifted is refused with an error
instead of corrupting memory. Where the library is found: see search_path.
"""

from __future__ import annotations

import ctypes
import operator
import os
import pathlib
from ctypes import (
    POINTER,
    Structure,
    c_char_p,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)

import numpy as np

#: The C ABI these declarations describe (KVCS_ABI_VERSION of kvcsum.h).
ABI_VERSION = 2

#: The environment variable naming the library file to load.
LIBRARY_ENV = "KVCSUM_LIBRARY"

#: Bytes of one block's stored checksum in a buffer given to
#: kvcs_worker_add_stored ("8 bytes per block id" in kvcsum.h; the header
#: has no KVCS_BLOCK_CHECKSUM_BYTES yet, and a #define cannot be read from
#: the loaded library). The one place the package states it: every size
#: check of a stored-checksum buffer is written in terms of it, and
#: python/tests/test_checks.py fails when the header says otherwise.
BLOCK_CHECKSUM_BYTES = 16


class AbiError(ImportError):
    """The library found cannot be used from here: it does not load (a
    file of another platform, a dependency missing), is not libkvcsum, or
    has another ABI version or structs of another shape."""


class MissingLibraryError(ImportError):
    """No libkvcsum was found anywhere the package looks (search_path():
    $KVCSUM_LIBRARY, beside the package, the source tree's target/release,
    the system loader's path); the message lists each place and how to get
    the library there. Not an AbiError: no library was found to be wrong."""


# --- Structs (kvcsum.h) -------------------------------------------------------


class _Struct(Structure):
    """A struct whose integer fields are checked against their C type on
    every assignment, in the constructor too (ctypes would silently keep
    the low bits of 2**32 + 3); the error names the field (checked_int)."""

    def __setattr__(self, name, value):
        c_type = _C_TYPES.get(_field_types(type(self)).get(name))
        if c_type:
            value = checked_int(value, c_type, name)
        super().__setattr__(name, value)


def _field_types(struct: type) -> dict:
    types = struct.__dict__.get("_field_types_")
    if types is None:
        types = {field[0]: field[1] for field in struct._fields_}
        struct._field_types_ = types
    return types


class WorkerOptions(_Struct):
    """kvcs_worker_options."""

    _fields_ = [
        ("tp_rank", c_uint32),
        ("tp_size", c_uint32),
        ("pp_rank", c_uint32),
        ("device", c_int32),
        ("num_threads", c_uint32),
    ]


class Segment(_Struct):
    """kvcs_segment: one region of a cache, strides in bytes."""

    _fields_ = [
        ("address", c_uint64),
        ("block_stride", c_int64),
        ("kernel_block_stride", c_int64),
        ("head_stride", c_int64),
        ("token_stride", c_int64),
        ("bytes_per_token", c_uint32),
    ]


class LayerStruct(_Struct):
    """kvcs_layer."""

    _fields_ = [
        ("group_id", c_uint32),
        ("layer_number", c_uint32),
        ("first_head", c_uint32),
        ("num_heads", c_uint32),
        ("replicas", c_uint32),
        ("replica_index", c_uint32),
        ("num_blocks", c_uint32),
        ("kernel_blocks", c_uint32),
        ("tokens_per_kernel_block", c_uint32),
        ("num_segments", c_uint32),
        ("segments", POINTER(Segment)),
        ("identity", POINTER(c_uint8)),
        ("identity_len", c_size_t),
    ]


class TensorStruct(_Struct):
    """kvcs_tensor: a strided tensor for kvcs_layer_from_layout, strides in bytes."""

    _fields_ = [
        ("address", c_uint64),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("ndim", c_size_t),
        ("element_size", c_uint32),
    ]


class StateTensorStruct(_Struct):
    """kvcs_state_tensor."""

    _fields_ = [
        ("address", c_uint64),
        ("block_stride", c_int64),
        ("row_stride", c_int64),
        ("first_row", c_uint32),
        ("num_rows", c_uint32),
        ("total_rows", c_uint32),
        ("bytes_per_row", c_uint32),
        ("element_size", c_uint32),
    ]


class StateStruct(_Struct):
    """kvcs_state."""

    _fields_ = [
        ("group_id", c_uint32),
        ("layer_number", c_uint32),
        ("split_known", c_uint32),
        ("num_blocks", c_uint32),
        ("num_tensors", c_uint32),
        ("tensors", POINTER(StateTensorStruct)),
        ("identity", POINTER(c_uint8)),
        ("identity_len", c_size_t),
    ]


class MismatchStruct(_Struct):
    """kvcs_mismatch."""

    _fields_ = [
        ("group_id", c_uint32),
        ("localised", c_uint32),
        ("first_position", c_uint64),
        ("num_positions", c_uint64),
        ("first_token", c_uint64),
        ("num_tokens", c_uint64),
        ("num_failed_checks", c_size_t),
        ("num_layers", c_size_t),
    ]


class LayerDifferenceStruct(_Struct):
    """kvcs_layer_difference."""

    _fields_ = [
        ("layer_number", c_uint32),
        ("first_head", c_uint32),
        ("num_heads", c_uint32),
        ("check", c_uint32),
    ]


class RepairBlockStruct(_Struct):
    """kvcs_repair_block: a consumer block to load again, tokens [start_token, end_token)."""

    _fields_ = [
        ("group_id", c_uint32),
        ("block_id", c_uint32),
        ("position", c_uint64),
        ("start_token", c_uint64),
        ("end_token", c_uint64),
    ]


class LocalEngineStruct(_Struct):
    """kvcs_local_engine."""

    _fields_ = [
        ("tp_rank", c_uint32),
        ("tp_size", c_uint32),
        ("total_kv_heads", c_uint32),
        ("is_mla", c_uint32),
        ("block_size", c_uint32),
    ]


class RemoteEngineStruct(_Struct):
    """kvcs_remote_engine."""

    _fields_ = [
        ("block_bytes", c_uint64),
        ("tp_size", c_uint32),
        ("block_size", c_uint32),
        ("kernel_blocks", c_uint32),
    ]


class HeadSourceStruct(_Struct):
    """kvcs_head_source."""

    _fields_ = [
        ("remote_rank", c_uint32),
        ("first_head", c_uint32),
        ("num_heads", c_uint32),
        ("local_offset", c_uint32),
        ("remote_offset", c_uint32),
    ]


#: Each struct with the library call that gives its size there.
STRUCT_SIZES = {
    "kvcs_worker_options_size": WorkerOptions,
    "kvcs_segment_size": Segment,
    "kvcs_layer_size": LayerStruct,
    "kvcs_state_tensor_size": StateTensorStruct,
    "kvcs_state_size": StateStruct,
    "kvcs_mismatch_size": MismatchStruct,
    "kvcs_layer_difference_size": LayerDifferenceStruct,
    "kvcs_local_engine_size": LocalEngineStruct,
    "kvcs_remote_engine_size": RemoteEngineStruct,
    "kvcs_head_source_size": HeadSourceStruct,
    "kvcs_tensor_size": TensorStruct,
    "kvcs_repair_block_size": RepairBlockStruct,
}

# --- Calls (kvcsum.h) ---------------------------------------------------------

_status = c_uint32
_p = c_void_p  # every opaque handle
_pp = POINTER(c_void_p)
_u32p = POINTER(c_uint32)
_u64p = POINTER(c_uint64)
_sizep = POINTER(c_size_t)
_u8p = POINTER(c_uint8)
_strp = POINTER(c_char_p)

#: name: (restype, argtypes), as in kvcsum.h.
SIGNATURES = {
    "kvcs_abi_version": (c_uint32, []),
    "kvcs_version": (c_char_p, []),
    "kvcs_last_error": (c_char_p, []),
    "kvcs_status_name": (c_char_p, [c_uint32]),
    "kvcs_verdict_name": (c_char_p, [c_uint32]),
    "kvcs_unverified_reason_name": (c_char_p, [c_uint32]),
    # blocks
    "kvcs_blocks_create": (_status, [_pp]),
    "kvcs_blocks_destroy": (None, [_p]),
    "kvcs_blocks_add_request": (_status, [_p, c_char_p, c_uint64]),
    "kvcs_blocks_add_group": (_status, [_p, c_char_p, c_uint32, c_uint64, _u32p, c_size_t]),
    # worker
    "kvcs_worker_create": (_status, [POINTER(WorkerOptions), _pp]),
    "kvcs_worker_destroy": (None, [_p]),
    "kvcs_worker_add_region": (_status, [_p, c_uint64, c_uint64]),
    "kvcs_worker_add_group": (_status, [_p, c_uint32, c_uint32]),
    "kvcs_worker_skip_group": (_status, [_p, c_uint32, c_char_p]),
    "kvcs_worker_add_layer": (_status, [_p, POINTER(LayerStruct)]),
    "kvcs_layer_from_layout": (
        _status,
        [c_char_p, POINTER(TensorStruct), POINTER(TensorStruct), c_uint32, POINTER(LayerStruct), POINTER(Segment)],
    ),
    "kvcs_worker_checksum": (_status, [_p, _p, c_uint32, c_void_p, _pp]),
    "kvcs_worker_set_detail": (_status, [_p, c_uint32]),
    "kvcs_worker_set_algorithm": (_status, [_p, c_uint32]),
    "kvcs_worker_add_alias": (_status, [_p, c_uint32, c_uint32, c_uint32, _u8p, c_size_t]),
    "kvcs_worker_add_state": (_status, [_p, POINTER(StateStruct)]),
    "kvcs_worker_add_stored": (_status, [_p, c_uint32, c_uint64, c_uint64]),
    "kvcs_worker_store": (_status, [_p, _p, c_void_p, _pp]),
    "kvcs_worker_check_stored": (_status, [_p, _p, c_void_p, _pp]),
    "kvcs_block_tags": (_status, [_p, c_uint32, _u8p, c_size_t, c_size_t, _u64p]),
    "kvcs_blocks_set_hashes": (_status, [_p, c_char_p, c_uint32, _u8p, c_size_t, c_size_t]),
    "kvcs_result_stored": (_status, [_p, c_char_p, c_uint32, _u8p]),
    # result
    "kvcs_result_query": (_status, [_p]),
    "kvcs_result_wait": (_status, [_p]),
    "kvcs_result_group": (_status, [_p, c_char_p, c_uint32, _u64p, _sizep, _sizep]),
    "kvcs_result_column": (_status, [_p, c_char_p, c_uint32, c_size_t, _u32p, _u32p, _u64p]),
    "kvcs_result_encode": (_status, [_p, _u8p, c_size_t, _sizep]),
    "kvcs_result_destroy": (None, [_p]),
    # verifier
    "kvcs_verifier_create": (_status, [c_uint32, _pp]),
    "kvcs_verifier_destroy": (None, [_p]),
    "kvcs_verifier_set_policy": (_status, [_p, c_uint32]),
    "kvcs_verifier_set_extension": (_status, [_p, c_uint32]),
    "kvcs_verifier_set_producer_tp_size": (_status, [_p, c_uint32]),
    "kvcs_verifier_set_producer_block_size": (_status, [_p, c_uint32, c_uint32]),
    "kvcs_verifier_set_require_coverage": (_status, [_p, c_uint32]),
    "kvcs_verifier_expect": (_status, [_p, _p, c_uint32]),
    "kvcs_verifier_forget": (_status, [_p, c_char_p]),
    "kvcs_verifier_add_record": (_status, [_p, _u8p, c_size_t]),
    "kvcs_verifier_payload": (_status, [_p, c_char_p, _u8p, c_size_t, _sizep]),
    "kvcs_verifier_check": (_status, [_p, c_char_p, _u8p, c_size_t, _pp]),
    "kvcs_verifier_check_base64": (_status, [_p, c_char_p, c_char_p, _pp]),
    "kvcs_verifier_check_no_payload": (_status, [_p, c_char_p, _pp]),
    "kvcs_verifier_check_stored": (_status, [_p, c_char_p, _pp]),
    # report
    "kvcs_report_verdict": (_status, [_p, _u32p]),
    "kvcs_report_passed": (_status, [_p, _u32p]),
    "kvcs_report_reason": (_status, [_p, _u32p]),
    "kvcs_report_message": (_status, [_p, _strp]),
    "kvcs_report_compared_positions": (_status, [_p, _u64p]),
    "kvcs_report_uncompared_positions": (_status, [_p, _u64p]),
    "kvcs_report_num_mismatches": (_status, [_p, _sizep]),
    "kvcs_report_mismatch": (_status, [_p, c_size_t, POINTER(MismatchStruct)]),
    "kvcs_report_failed_check": (_status, [_p, c_size_t, c_size_t, _u32p]),
    "kvcs_report_layer_difference": (_status, [_p, c_size_t, c_size_t, POINTER(LayerDifferenceStruct)]),
    "kvcs_report_num_unverified": (_status, [_p, _sizep]),
    "kvcs_report_unverified": (_status, [_p, c_size_t, _u32p, _u32p, _strp]),
    "kvcs_report_destroy": (None, [_p]),
    # repair plan
    "kvcs_report_repair_plan": (
        _status,
        [_p, _p, c_char_p, _u32p, _u32p, c_size_t, POINTER(RepairBlockStruct), c_size_t, _sizep],
    ),
    "kvcs_repair_plan": (
        _status,
        [POINTER(MismatchStruct), c_size_t, _p, c_char_p, _u32p, _u32p, c_size_t]
        + [POINTER(RepairBlockStruct), c_size_t, _sizep],
    ),
    # base64
    "kvcs_base64_encode": (_status, [_u8p, c_size_t, c_char_p, c_size_t, _sizep]),
    "kvcs_base64_decode": (_status, [c_char_p, c_size_t, _u8p, c_size_t, _sizep]),
    # topology
    "kvcs_tp_ratio": (_status, [c_uint32, c_uint32, POINTER(c_int64)]),
    "kvcs_remote_ranks": (_status, [c_uint32, c_uint32, c_uint32, _u32p, c_size_t, _sizep]),
    "kvcs_handshake_targets": (_status, [c_uint32, c_uint32, c_uint32, _u32p, c_size_t, _sizep]),
    "kvcs_block_size_ratio": (_status, [c_uint32, c_uint32, _u32p]),
    "kvcs_remote_kv_replicated": (_status, [c_uint32, c_uint32, _u32p]),
    "kvcs_local_kv_replicated": (_status, [c_uint32, c_uint32, c_uint32, _u32p]),
    "kvcs_rank_heads": (_status, [c_uint32, c_uint32, c_uint32, c_uint32, _u32p, _u32p]),
    "kvcs_head_sources": (
        _status,
        [c_uint32, c_uint32, c_uint32, c_uint32, c_uint32, POINTER(HeadSourceStruct), c_size_t, _sizep],
    ),
    "kvcs_topology_create": (_status, [c_char_p, POINTER(LocalEngineStruct), _pp]),
    "kvcs_topology_destroy": (None, [_p]),
    "kvcs_topology_add_remote": (_status, [_p, c_char_p, POINTER(RemoteEngineStruct), _u32p]),
    "kvcs_topology_remote": (_status, [_p, c_char_p, POINTER(RemoteEngineStruct)]),
    "kvcs_topology_tp_ratio": (_status, [_p, c_char_p, POINTER(c_int64)]),
    "kvcs_topology_block_size_ratio": (_status, [_p, c_char_p, _u32p]),
    "kvcs_topology_remote_kv_replicated": (_status, [_p, c_char_p, _u32p]),
    "kvcs_topology_remote_ranks": (_status, [_p, c_char_p, _u32p, c_size_t, _sizep]),
    "kvcs_topology_head_sources": (_status, [_p, c_char_p, POINTER(HeadSourceStruct), c_size_t, _sizep]),
    "kvcs_completion_create": (_status, [c_uint32, _pp]),
    "kvcs_completion_destroy": (None, [_p]),
    "kvcs_completion_set_expected": (_status, [_p, c_uint32]),
    "kvcs_completion_report": (_status, [_p, c_uint32, c_uint32, _strp, c_size_t, _u8p]),
    "kvcs_completion_reported": (_status, [_p, c_uint32, c_char_p, _u32p]),
    "kvcs_completion_add_invalid_blocks": (_status, [_p, _u32p, c_size_t]),
    "kvcs_completion_invalid_blocks": (_status, [_p, _u32p, c_size_t, _sizep]),
    "kvcs_completion_clear_invalid_blocks": (_status, [_p]),
}
for _name in STRUCT_SIZES:
    SIGNATURES[_name] = (c_size_t, [])


def search_path() -> list[str]:
    """Every place the library is looked for, in order, whether a file is
    there or not: $KVCSUM_LIBRARY alone when it is set; else beside this
    package (where the wheel that `pip install ./python` builds puts it),
    the source tree's release build (target/release), and the name the
    system loader resolves: the SONAME of an installed library of this ABI,
    libkvcsum.so.<ABI_VERSION> (docs/VERSIONING.md)."""
    if os.environ.get(LIBRARY_ENV):
        return [os.environ[LIBRARY_ENV]]
    here = pathlib.Path(__file__).resolve().parent
    soname = f"libkvcsum.so.{ABI_VERSION}"
    return [
        str(here / "libkvcsum.so"),
        str(here / soname),
        str(here.parent.parent / "target" / "release" / "libkvcsum.so"),
        soname,
    ]


def candidates() -> list[str]:
    """The places of search_path() worth trying: $KVCSUM_LIBRARY as given;
    else the files that exist, then the system loader's name."""
    if os.environ.get(LIBRARY_ENV):
        return [os.environ[LIBRARY_ENV]]
    return [place for place in search_path() if os.sep not in place or os.path.exists(place)]


def _absent(candidate: str, error: OSError) -> bool:
    """Whether `candidate` failed to load because nothing is there (a path
    with no file, a name the system loader did not find), not because what
    is there is unusable (then the message names the file, or the missing
    dependency, differently)."""
    if os.sep in candidate:
        return not os.path.exists(candidate)
    return str(error).startswith(f"{candidate}: cannot open shared object file")


def _missing_message(path: str | None, places: list[str]) -> str:
    """Where the library was looked for and how to put one there."""
    if path:
        where = f"no file at {path} (the path given to load())"
    elif os.environ.get(LIBRARY_ENV):
        where = f"${LIBRARY_ENV} is {os.environ[LIBRARY_ENV]}, which does not exist"
    else:
        where = "looked at " + ", ".join(places) + " (the last through the system loader)"
    return (
        f"kvcsum: libkvcsum not found: {where}. To fix: install the wheel that `pip install ./python` "
        "(or `make python-wheel`) builds, which carries the library; or build it in a source checkout "
        "with `cargo build --release`; or install it system-wide with `make install`; or set "
        f"{LIBRARY_ENV} to the path of a libkvcsum.so"
    )


#: The range of each C integer type that crosses the boundary.
_RANGES = {
    "uint32_t": (0, 2**32 - 1),
    "uint64_t": (0, 2**64 - 1),
    "size_t": (0, 2 ** (8 * ctypes.sizeof(c_size_t)) - 1),
    "int32_t": (-(2**31), 2**31 - 1),
    "int64_t": (-(2**63), 2**63 - 1),
    "uintptr_t": (0, 2 ** (8 * ctypes.sizeof(c_void_p)) - 1),
}
#: The C type of each ctypes integer type in the declarations (c_size_t is
#: c_uint64 on 64-bit hosts, so it is named after that; the ranges agree).
_C_TYPES = {
    c_size_t: "size_t",
    c_uint64: "uint64_t",
    c_uint32: "uint32_t",
    c_int32: "int32_t",
    c_int64: "int64_t",
    c_void_p: "uintptr_t",
}


def checked_int(value, c_type: str, name: str) -> int:
    """`value` as a Python int, checked against the range of the C integer
    type `c_type` ("uint32_t", "uint64_t", "size_t", "int32_t", "int64_t",
    or "uintptr_t" for a pointer); `name` names it in the error.

    ctypes (and numpy) would silently wrap a value outside the type
    (2**32 + 3 -> 3, -1 -> 2**64 - 1). Python ints and numpy integers (any
    type with __index__) are accepted; bools and non-integers (floats,
    strings, None) raise TypeError, values outside the type ValueError.
    Every integer the package hands to C goes through here."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer ({c_type}), got a bool ({value!r})")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer ({c_type}), got {type(value).__name__} {value!r}") from None
    low, high = _RANGES[c_type]
    if not low <= number <= high:
        raise ValueError(f"{name} is {number}, outside {c_type} ({low} .. {high})")
    return number


class Api:
    """The library's calls, each taking and giving what kvcsum.h says.
    Integer arguments are checked against their C type first
    (checked_int: ctypes would silently wrap -1 to 4294967295)."""

    path: str


def _range_checked(name, function, checks):
    """`function` with its integer arguments put through checked_int first
    (a NULL or a ctypes object given for a pointer passes as it is)."""

    def call(*args):
        args = list(args)
        for index, c_type in checks:
            value = args[index]
            if c_type == "uintptr_t" and (value is None or isinstance(value, ctypes._SimpleCData)):
                continue
            args[index] = checked_int(value, c_type, f"argument {index + 1} of {name}")
        return function(*args)

    call.__name__ = name
    return call


def load(path: str | None = None) -> Api:
    """Loads the library (from `path`, else the first of candidates() that
    loads), declares every call and checks the ABI version and the struct
    sizes. Raises MissingLibraryError when no library is there at all,
    AbiError saying what was tried or what differs otherwise."""
    tried = []
    absent = True
    library = None
    for candidate in [path] if path else candidates():
        try:
            library = ctypes.CDLL(candidate)
            path = candidate
            break
        except OSError as error:
            tried.append(f"{candidate}: {error}")
            absent = absent and _absent(candidate, error)
    if library is None and absent:
        raise MissingLibraryError(_missing_message(path, search_path()))
    if library is None:
        raise AbiError(
            "kvcsum: cannot load libkvcsum (set KVCSUM_LIBRARY to its path, build it with "
            "`cargo build --release`, or install it); tried: " + "; ".join(tried)
        )
    missing = [name for name in SIGNATURES if not hasattr(library, name)]
    if "kvcs_abi_version" in missing:
        raise AbiError(f"kvcsum: {path} is not libkvcsum (it has no kvcs_abi_version)")
    library.kvcs_abi_version.restype = c_uint32
    library.kvcs_abi_version.argtypes = []
    abi = library.kvcs_abi_version()
    if abi != ABI_VERSION:
        raise AbiError(f"kvcsum: {path} has ABI version {abi}; this package speaks version {ABI_VERSION}")
    if missing:
        raise AbiError(f"kvcsum: {path} lacks {', '.join(missing)} (an older build of ABI {abi}?)")
    api = Api()
    api.path = path
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype = restype
        function.argtypes = argtypes
        checks = [(i, _C_TYPES[t]) for i, t in enumerate(argtypes) if t in _C_TYPES]
        setattr(api, name, _range_checked(name, function, checks) if checks else function)
    for name, struct in STRUCT_SIZES.items():
        theirs = getattr(library, name)()
        if theirs != ctypes.sizeof(struct):
            raise AbiError(
                f"kvcsum: {path} says {name[:-5]} is {theirs} bytes, this package's is "
                f"{ctypes.sizeof(struct)}: the struct changed shape; use a matching package and library"
            )
    return api
