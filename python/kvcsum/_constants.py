"""The constants of kvcsum.h the package hands to C or gets back."""

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
