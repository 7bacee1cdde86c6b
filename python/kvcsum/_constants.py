"""The constants of kvcsum.h the package hands to C or gets back: one
IntEnum per C enum (generated into _enums from src/ffi, each value the
header's; python/tests/test_package.py reads kvcsum.h to check), the
encoding versions and other constants (from the generated _abi), and the
module-level names the package had before kept as aliases of the members
(kvcsum.MATCH is kvcsum.Verdict.MATCH), so code written against plain ints
keeps working: a member is an int.

Thread safety: enums are immutable; share them freely."""

from . import _abi
# The enums are generated from src/ffi (`make header`), one class per C enum.
from ._enums import (  # noqa: F401 (_CEnum, re-exported as before)
    Algorithm,
    Direction,
    Policy,
    Reason,
    Role,
    Status,
    StoredOutcome,
    TierOutcome,
    Verdict,
    _CEnum,
)


#: The encodings kvcsum.h (of ABI_VERSION) says the library writes and
#: reads: KVCS_PAYLOAD_VERSION (the payload a producer sends),
#: KVCS_EXTENSION_VERSION (its kvcsum extension) and KVCS_RECORD_VERSION
#: (Result.encode()). The library has no call that tells them, so these are
#: the header's, from the generated _abi; python/tests/test_package.py checks
#: them against it.
PAYLOAD_VERSION = _abi.CONSTANTS["KVCS_PAYLOAD_VERSION"]
EXTENSION_VERSION = _abi.CONSTANTS["KVCS_EXTENSION_VERSION"]
RECORD_VERSION = _abi.CONSTANTS["KVCS_RECORD_VERSION"]

#: The `device` of a host worker (KVCS_HOST).
HOST = _abi.CONSTANTS["KVCS_HOST"]
#: The group id of a Finding about the whole load (KVCS_WHOLE_LOAD).
WHOLE_LOAD = _abi.CONSTANTS["KVCS_WHOLE_LOAD"]

# The names of before the enums, each an alias of its member.
PRODUCER, CONSUMER = Role.PRODUCER, Role.CONSUMER
WEIGHTED, MIXED, MIXED2 = Algorithm.WEIGHTED, Algorithm.MIXED, Algorithm.MIXED2
FAIL_OPEN, FAIL_CLOSED = Policy.FAIL_OPEN, Policy.FAIL_CLOSED
MATCH, MISMATCH, UNVERIFIED = Verdict.MATCH, Verdict.MISMATCH, Verdict.UNVERIFIED
SENDING, RECEIVING = Direction.SENDING, Direction.RECEIVING
NO_CHECKSUMS = Reason.NO_CHECKSUMS
INVALID_CHECKSUMS = Reason.INVALID_CHECKSUMS
WORKERS_MISSING = Reason.WORKERS_MISSING
OTHER_BLOCKS = Reason.OTHER_BLOCKS
ONE_SIDED_GROUP = Reason.ONE_SIDED_GROUP
FINGERPRINT_DIFFERS = Reason.FINGERPRINT_DIFFERS
NO_COMMON_POSITION = Reason.NO_COMMON_POSITION
REPLICA_MISSING = Reason.REPLICA_MISSING
STATE_TP_DIFFERS = Reason.STATE_TP_DIFFERS
ROLE_DIFFERS = Reason.ROLE_DIFFERS
UNCOMPARED_POSITIONS = Reason.UNCOMPARED_POSITIONS
NOT_LOAD_CHECK = Reason.NOT_LOAD_CHECK
ALGORITHM_DIFFERS = Reason.ALGORITHM_DIFFERS
BLOCK_SIZE_UNKNOWN = Reason.BLOCK_SIZE_UNKNOWN
NOTHING_READ = Reason.NOTHING_READ
COVERAGE_DIFFERS = Reason.COVERAGE_DIFFERS
DECODING_DIFFERS = Reason.DECODING_DIFFERS
GEOMETRY_DIFFERS = Reason.GEOMETRY_DIFFERS
STORED_FAILED = StoredOutcome.FAILED
STORED_MATCHED = StoredOutcome.MATCHED
STORED_NOT_CHECKED = StoredOutcome.NOT_CHECKED
STORED_OTHER_FINGERPRINT = StoredOutcome.OTHER_FINGERPRINT
STORED_OTHER_ALGORITHM = StoredOutcome.OTHER_ALGORITHM
STORED_OTHER_TOKENS = StoredOutcome.OTHER_TOKENS
STORED_OTHER_FORMAT = StoredOutcome.OTHER_FORMAT
