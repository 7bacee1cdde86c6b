"""kvcsum: layout-independent checksums of LLM KV-cache blocks, from Python.

A thin ctypes layer over the C ABI of libkvcsum (no Python extension
module). `pip install ./python` builds the library with cargo and puts it
into the package (kvcsum/libkvcsum.so), where it is looked for first after
$KVCSUM_LIBRARY; then the source tree's target/release and the system
loader (libkvcsum.so.<ABI_VERSION>, as `make install` installs it). No
library anywhere raises kvcsum.MissingLibraryError, saying where it looked;
loading checks the ABI version and every struct's size, so a mismatched
library is refused (kvcsum.AbiError) rather than corrupting memory.
`python -m kvcsum --version` prints the package's version (__version__),
the library's, and the ABI and payload versions.

Verdicts, roles, reasons and the header's other enums are IntEnums
(kvcsum.Verdict, Role, Reason, Algorithm, Policy, Direction, StoredOutcome,
Status), their values the header's; the plain names (kvcsum.MATCH, ...)
are the same members. The package is split by job like src/ffi:
_errors.py, _layers.py, _worker.py (Worker, Blocks, Result), _verify.py
(Verifier, Report and its parts), _topology.py (Topology, Completion and
the TP helpers), _repair.py, _constants.py (the enums of the generated
_enums.py), _base.py (what
they share) and _lib.py (the ctypes declarations); use them through
kvcsum.X.

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
between threads is safe. A Worker needs exclusive use: threads sharing
one take turns, so give each thread its own to checksum in parallel.
Each class's docstring has a "Thread safety:" line saying which of its
calls are which (values and enums are immutable).

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

See docs/SPEC.md for the definition, docs/python.md for the guide and
docs/c-api.md for the C API it wraps.
"""

from __future__ import annotations

from . import _lib  # noqa: F401 (kvcsum._lib, as before)
from ._base import library, version
from ._constants import (
    ALGORITHM_DIFFERS,
    BLOCK_SIZE_UNKNOWN,
    CONSUMER,
    COVERAGE_DIFFERS,
    DECODING_DIFFERS,
    EXTENSION_VERSION,
    FAIL_CLOSED,
    FAIL_OPEN,
    FINGERPRINT_DIFFERS,
    GEOMETRY_DIFFERS,
    HOST,
    INVALID_CHECKSUMS,
    MATCH,
    MISMATCH,
    MIXED,
    MIXED2,
    NO_CHECKSUMS,
    NO_COMMON_POSITION,
    NOT_LOAD_CHECK,
    NOTHING_READ,
    ONE_SIDED_GROUP,
    OTHER_BLOCKS,
    PAYLOAD_VERSION,
    PRODUCER,
    RECEIVING,
    RECORD_VERSION,
    REPLICA_MISSING,
    ROLE_DIFFERS,
    SENDING,
    STATE_TP_DIFFERS,
    STORED_FAILED,
    STORED_MATCHED,
    STORED_NOT_CHECKED,
    STORED_OTHER_ALGORITHM,
    STORED_OTHER_FORMAT,
    STORED_OTHER_TOKENS,
    STORED_OTHER_FINGERPRINT,
    UNCOMPARED_POSITIONS,
    UNVERIFIED,
    WEIGHTED,
    WHOLE_LOAD,
    WORKERS_MISSING,
    Algorithm,
    Direction,
    Policy,
    Reason,
    Role,
    Status,
    StoredOutcome,
    TierOutcome,
    Verdict,
)
from ._errors import (
    BufferTooSmall,
    DeviceError,
    Error,
    InternalError,
    InvalidArgument,
    Malformed,
    NotFound,
    NotReady,
    OutOfBounds,
    Unsupported,
)
from ._layers import Layer, StateTensor, layer, region_of  # noqa: F401 (region_of is public, not in __all__)
from ._lib import ABI_VERSION, BLOCK_CHECKSUM_BYTES, AbiError, MissingLibraryError
from ._payload import LayerDecoding, Payload, PayloadGroup, PayloadLayer, decode_payload
from ._repair import RepairBlock, repair_plan
from ._topology import (
    Completion,
    HeadSource,
    RemoteEngine,
    Topology,
    block_size_ratio,
    handshake_targets,
    head_sources,
    local_kv_replicated,
    rank_heads,
    remote_kv_replicated,
    remote_ranks,
    tp_ratio,
)
from ._verify import Finding, LayerDifference, Mismatch, Report, Uncompared, Verifier, base64_decode, base64_encode
from ._version import __version__  # noqa: F401 (kvcsum.__version__)
from ._tier import TierIndex
from ._worker import Blocks, Result, Worker

__all__ = [
    "ABI_VERSION",
    "BLOCK_CHECKSUM_BYTES",
    "PAYLOAD_VERSION",
    "EXTENSION_VERSION",
    "RECORD_VERSION",
    "AbiError",
    "MissingLibraryError",
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
    "Status",
    "Role",
    "Algorithm",
    "Policy",
    "Verdict",
    "Direction",
    "Reason",
    "StoredOutcome",
    "TierOutcome",
    "TierIndex",
    "HOST",
    "PRODUCER",
    "CONSUMER",
    "WEIGHTED",
    "MIXED",
    "MIXED2",
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
    "DECODING_DIFFERS",
    "GEOMETRY_DIFFERS",
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
    "STORED_OTHER_FORMAT",
    "STORED_OTHER_TOKENS",
    "Worker",
    "Result",
    "Verifier",
    "Report",
    "Mismatch",
    "Uncompared",
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

__all__ += ["RepairBlock", "repair_plan"]
__all__ += ["Payload", "PayloadGroup", "PayloadLayer", "LayerDecoding", "decode_payload"]

# The public classes and functions live in private modules by job; they are
# kvcsum.X to users (reprs, error messages, pickles), as before the split.
for _name in __all__ + ["region_of"]:
    _value = globals()[_name]
    if getattr(_value, "__module__", "").startswith("kvcsum._"):
        _value.__module__ = __name__
del _name, _value
