"""Loads libkvcsum and declares its C ABI to ctypes.

The declarations come from _abi, which tools/bindgen generates from the
library's source with the header (`make header`; a test fails when it is
stale), so every call, struct, enum and constant of kvcsum.h is
here without a hand-written copy. They are checked against the loaded
library when it is loaded: its ABI version must equal ABI_VERSION, and
every struct must have, in the library's own words (kvcs_struct_layout,
kvcs_struct_field), the size and the fields (names, offsets, sizes) of
its ctypes declaration, so a library whose structs drifted is refused
with an error instead of corrupting memory. Where the library is found:
see find_library.
"""

from __future__ import annotations

import ctypes
import operator
import os
import pathlib
from ctypes import (
    POINTER,
    Structure,
    byref,
    c_bool,
    c_char_p,
    c_int8,
    c_int16,
    c_int32,
    c_int64,
    c_size_t,
    c_ssize_t,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
)

import numpy as np

from . import _abi

#: The C ABI these declarations describe (KVCS_ABI_VERSION of kvcsum.h).
ABI_VERSION = _abi.CONSTANTS["KVCS_ABI_VERSION"]

#: The environment variable naming the library file to load.
LIBRARY_ENV = "KVCSUM_LIBRARY"

#: Bytes of one block's stored checksum in a buffer given to
#: kvcs_worker_add_stored (KVCS_BLOCK_CHECKSUM_BYTES of kvcsum.h). The one
#: place the package states it: every size check of a stored-checksum
#: buffer is written in terms of it.
BLOCK_CHECKSUM_BYTES = _abi.CONSTANTS["KVCS_BLOCK_CHECKSUM_BYTES"]


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


#: The C integer types of the ABI.
_INTEGERS = {
    "uint8_t": c_uint8,
    "uint16_t": c_uint16,
    "uint32_t": c_uint32,
    "uint64_t": c_uint64,
    "int8_t": c_int8,
    "int16_t": c_int16,
    "int32_t": c_int32,
    "int64_t": c_int64,
    "size_t": c_size_t,
    "ptrdiff_t": c_ssize_t,
    "bool": c_bool,
}

#: Python names of the struct classes that have one of their own; the
#: others are named after their C name (kvcs_layer -> LayerStruct).
_CLASS_NAMES = {"kvcs_worker_options": "WorkerOptions", "kvcs_segment": "Segment"}


def _ctype(spelling: str):
    """The ctypes type of a C type of _abi ("const kvcs_layer *", say); None
    for void. Handles and other opaque types are void pointers."""
    array = spelling.endswith("]") and spelling[:-1].split("[")
    if array:  # a struct field "uint32_t[4]"
        return _ctype(array[0]) * int(array[1])
    words = spelling.replace("*", " * ").split()
    stars = words.count("*")
    (base,) = [word for word in words if word not in ("const", "*")]
    base = _abi.ENUMS[base][0] if base in _abi.ENUMS else base
    if base in _INTEGERS:
        pointee = _INTEGERS[base]
    elif base in _abi.STRUCTS:
        pointee = STRUCTS[base]
    elif stars == 0:
        if base != "void":
            raise TypeError(f"kvcsum: no ctypes type for {spelling!r}")
        return None
    else:  # char, void, handles: pointers of their own in ctypes
        pointee = c_char_p if base == "char" else c_void_p
        stars -= 1
    for _ in range(stars):
        pointee = POINTER(pointee)
    return pointee


#: Each struct of the ABI (C name -> ctypes class), filled below in an order
#: where a struct's pointees come first.
STRUCTS: dict = {}


def _declare_struct(c_name: str) -> type:
    if c_name not in STRUCTS:
        fields = _abi.STRUCTS[c_name]
        for _, spelling in fields:  # pointees first
            pointee = spelling.split("[")[0].replace("const", "").replace("*", "").strip()
            if pointee in _abi.STRUCTS and pointee != c_name:
                _declare_struct(pointee)
        words = c_name.removeprefix("kvcs_").split("_")
        name = _CLASS_NAMES.get(c_name, "".join(w.capitalize() for w in words) + "Struct")
        STRUCTS[c_name] = type(name, (_Struct,), {"__doc__": f"{c_name} (kvcsum.h).", "__module__": __name__})
        STRUCTS[c_name]._fields_ = [(field, _ctype(spelling)) for field, spelling in fields]
    return STRUCTS[c_name]


for _name in _abi.STRUCTS:
    _declare_struct(_name)

WorkerOptions = STRUCTS["kvcs_worker_options"]
Segment = STRUCTS["kvcs_segment"]
LayerStruct = STRUCTS["kvcs_layer"]
StateTensorStruct = STRUCTS["kvcs_state_tensor"]
StateStruct = STRUCTS["kvcs_state"]
GroupPlacementStruct = STRUCTS["kvcs_group_placement"]
MismatchStruct = STRUCTS["kvcs_mismatch"]
LayerDifferenceStruct = STRUCTS["kvcs_layer_difference"]
LocalEngineStruct = STRUCTS["kvcs_local_engine"]
RemoteEngineStruct = STRUCTS["kvcs_remote_engine"]
HeadSourceStruct = STRUCTS["kvcs_head_source"]
TensorStruct = STRUCTS["kvcs_tensor"]
RepairBlockStruct = STRUCTS["kvcs_repair_block"]

# --- Calls (kvcsum.h) ---------------------------------------------------------

#: name: (restype, argtypes), as in kvcsum.h.
SIGNATURES = {
    name: (_ctype(ret), [_ctype(spelling) for _, spelling in params]) for name, (ret, params) in _abi.CALLS.items()
}


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
    cdll: ctypes.CDLL


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
    layouts. Raises MissingLibraryError when no library is there at all,
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
    # The loaded library itself, for a second declaration of a hot call
    # (kvcsum._tier) that takes plain addresses.
    api.cdll = library
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype = restype
        function.argtypes = argtypes
        checks = [(i, _C_TYPES[t]) for i, t in enumerate(argtypes) if t in _C_TYPES]
        setattr(api, name, _range_checked(name, function, checks) if checks else function)
    # The one symbol a plugin resolves must give this ABI's table too.
    table = c_void_p()
    if api.kvcs_api_get(ABI_VERSION, byref(table)) != 0 or not table:
        raise AbiError(f"kvcsum: {path} gives no function table for ABI {ABI_VERSION}: {api.kvcs_last_error().decode()}")
    _check_layouts(api)
    return api


def _check_layouts(api: Api) -> None:
    """Raises AbiError unless every struct of STRUCTS has the library's size
    and fields (names, offsets, sizes, in order)."""
    for c_name, struct in STRUCTS.items():
        name = c_name.encode()
        size, count = c_size_t(), c_size_t()
        if api.kvcs_struct_layout(name, byref(size), byref(count)) != 0:
            raise AbiError(f"kvcsum: {api.path} has no struct {c_name}: {api.kvcs_last_error().decode()}")
        if size.value != ctypes.sizeof(struct):
            raise AbiError(
                f"kvcsum: {api.path} says {c_name} is {size.value} bytes, this package's is "
                f"{ctypes.sizeof(struct)}: the struct changed shape; use a matching package and library"
            )
        sized = f"{c_name}_size"  # the older per-struct size call, where there is one
        if sized in _abi.CALLS and getattr(api, sized)() != size.value:
            raise AbiError(f"kvcsum: {api.path}: {sized}() is {getattr(api, sized)()}, not {size.value}")
        ours = [(field, getattr(struct, field).offset, getattr(struct, field).size) for field, _ in struct._fields_]
        theirs = []
        for index in range(count.value):
            field, offset, field_size = c_char_p(), c_size_t(), c_size_t()
            if api.kvcs_struct_field(name, index, byref(field), byref(offset), byref(field_size)) != 0:
                raise AbiError(f"kvcsum: {api.path}: {api.kvcs_last_error().decode()}")
            theirs.append((field.value.decode(), offset.value, field_size.value))
        for index in range(max(len(ours), len(theirs))):
            mine = ours[index] if index < len(ours) else ("(none)", "-", "-")
            library = theirs[index] if index < len(theirs) else ("(none)", "-", "-")
            if mine != library:
                raise AbiError(
                    f"kvcsum: {api.path} lays out field {index} of {c_name} as {library[0]} at offset "
                    f"{library[1]} ({library[2]} bytes), this package as {mine[0]} at offset {mine[1]} "
                    f"({mine[2]} bytes): the struct changed shape; use a matching package and library"
                )
