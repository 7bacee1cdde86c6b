"""The constants of kvcsum.h the package hands to C or gets back: one
IntEnum per C enum, each value the header's (python/tests/test_package.py
reads kvcsum.h to check), and the module-level names the package had before
kept as aliases of the members (kvcsum.MATCH is kvcsum.Verdict.MATCH), so
code written against plain ints keeps working: a member is an int.

Thread safety: enums are immutable; share them freely."""

import enum


class _CEnum(enum.IntEnum):
    """An IntEnum that prints as its number on every Python 3 (3.11 made
    str() of an IntEnum the number; before, it was "Verdict.MATCH"), so
    messages read as they did with plain ints. repr() names the member."""

    def __str__(self) -> str:
        return int.__repr__(self)

    __format__ = int.__format__


class Status(_CEnum):
    """kvcs_status: the outcome of a call (kvcsum.Error.status).

    Thread safety: immutable."""

    OK = 0
    INVALID_ARGUMENT = 1
    OUT_OF_BOUNDS = 2
    UNSUPPORTED = 3
    NOT_FOUND = 4
    MALFORMED = 5
    NOT_READY = 6
    DEVICE = 7
    BUFFER_TOO_SMALL = 8
    INTERNAL = 9


class Role(_CEnum):
    """kvcs_role: which columns a checksum computes (Worker.checksum) and
    which side a Verifier expects (Verifier.expect).

    Thread safety: immutable."""

    PRODUCER = 0
    CONSUMER = 1


class Algorithm(_CEnum):
    """kvcs_algorithm: the checksum algorithm (Worker.set_algorithm,
    docs/SPEC.md section 12); MIXED2 is the default, WEIGHTED vLLM's, MIXED
    the default of kvcsum 0.2 (kept to verify against a 0.2 peer).

    Thread safety: immutable."""

    WEIGHTED = 1
    MIXED = 2
    MIXED2 = 3


class Policy(_CEnum):
    """kvcs_policy: whether an UNVERIFIED load passes (Verifier.set_policy).

    Thread safety: immutable."""

    FAIL_OPEN = 0
    FAIL_CLOSED = 1


class Verdict(_CEnum):
    """kvcs_verdict: a verifier's judgement of a load (Report.verdict).

    Thread safety: immutable."""

    MATCH = 0
    MISMATCH = 1
    UNVERIFIED = 2


class Direction(_CEnum):
    """kvcs_direction: what a worker finished (Completion.report).

    Thread safety: immutable."""

    SENDING = 0
    RECEIVING = 1


class Reason(_CEnum):
    """kvcs_unverified_reason without the KVCS_UNVERIFIED_ prefix: why a
    load or a group was not compared (Report.reason, Finding.reason);
    NONE where nothing was left uncompared.

    Thread safety: immutable."""

    NONE = 0
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
    DECODING_DIFFERS = 17
    GEOMETRY_DIFFERS = 18


class StoredOutcome(_CEnum):
    """kvcs_stored_outcome without the KVCS_STORED_ prefix: a load check's
    verdict on one block position (the values of Result.stored).

    Thread safety: immutable."""

    FAILED = 0
    MATCHED = 1
    NOT_CHECKED = 2
    OTHER_FINGERPRINT = 3  # stored under other layers, identities, heads or block size: not compared
    OTHER_ALGORITHM = 4  # stored with another algorithm: not compared
    OTHER_TOKENS = 5  # stored holding another number of valid tokens (a partial block): not compared
    OTHER_FORMAT = 6  # kvcsum 0.2.0's format, its value not matching: not compared


class TierOutcome(_CEnum):
    """kvcs_tier_outcome without the KVCS_TIER_ prefix: a tier check's
    outcome of one loaded block (the values TierIndex.check gives).

    Thread safety: immutable."""

    MATCHED = 1
    MISMATCHED = 2
    NO_BLOCK_HASH = 3  # unknown: a partial block
    UNKNOWN_BLOCK = 4  # unknown: never stored here, or dropped by the bound
    TOO_MANY_VALUES = 5  # unknown: more values than kept, or two positions
    OTHER_POSITION = 6  # unknown: stored at another position
    NOT_CHECKSUMMED = 7  # unknown: a group the worker skips


#: The encodings kvcsum.h (of ABI_VERSION) says the library writes and
#: reads: KVCS_PAYLOAD_VERSION (the payload a producer sends),
#: KVCS_EXTENSION_VERSION (its kvcsum extension) and KVCS_RECORD_VERSION
#: (Result.encode()). The library has no call that tells them, so these are
#: the header's; python/tests/test_package.py checks them against it.
PAYLOAD_VERSION = 1
EXTENSION_VERSION = 5
RECORD_VERSION = 7

#: The `device` of a host worker (KVCS_HOST).
HOST = -1
#: The group id of a Finding about the whole load (KVCS_WHOLE_LOAD).
WHOLE_LOAD = 0xFFFFFFFF

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
