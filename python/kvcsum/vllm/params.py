"""kv_transfer_params as KvcsumConnector reads them: one parser that turns
whatever an API client sent into named values, or into the reason the
checksums cannot be used.

Everything in kv_transfer_params comes from outside (a client or a proxy
may send anything JSON can hold: wrong types, huge integers, nested junk,
strings holding NUL). `parse_load` never raises: what it cannot use becomes
an `Unusable` naming the field and its value, which the consumer reports
as UNVERIFIED with that reason, never as an exception or a MATCH.

This module needs neither vLLM nor torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

#: The key of the producer's payload (standard base64 of the msgpack payload).
PAYLOAD_KEY = "kv_checksums"
#: The key of what kvcsum adds beside it: block sizes and the token digest.
INFO_KEY = "kv_checksums_info"

#: The reason names this module gives (kvcsum.Reason names where one fits).
INVALID_CHECKSUMS = "INVALID_CHECKSUMS"

#: Longest kv_checksums text accepted: far above any payload (16 bytes a
#: block position and group, in base64), so a client cannot make the
#: verifier decode an unbounded string.
MAX_PAYLOAD_CHARS = 64 << 20
#: Largest block size accepted from a producer (kvcsum's uint32 bound; vLLM's
#: are a few hundred tokens at most).
MAX_BLOCK_SIZE = (1 << 32) - 1
#: Largest group id accepted (kvcsum's uint32).
MAX_GROUP_ID = (1 << 32) - 1
#: Most groups a producer may name in its block sizes.
MAX_GROUPS = 1024
#: Most decimal digits of a token count in a digest (a count of 2^63 has 19).
_DIGEST = re.compile(r"^(0|[1-9][0-9]{0,18}):([0-9a-f]{32})$")


@dataclasses.dataclass(frozen=True)
class Unusable:
    """Checksums that cannot be used: `reason` (a kvcsum.Reason name, or
    another upper-case word), `message` (names the field and its value)."""

    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class TokenDigest:
    """A digest of a request's first `count` prompt token ids."""

    count: int
    text: str

    def covers(self, token_ids: Iterable[int]) -> bool:
        """Whether `token_ids`' first `count` ids have this digest."""
        return token_digest(token_ids, self.count) == self.text


@dataclasses.dataclass(frozen=True)
class Checksums:
    """A producer's checksums as kv_transfer_params carried them, checked
    for shape: `payload` the base64 text (not yet decoded: the verifier
    judges its bytes), `block_sizes` the producer's {group: block size}
    ({} when it did not say, as a vLLM fork producer does not), `tokens`
    the digest of the prompt tokens covered (None when not sent)."""

    payload: str
    block_sizes: dict
    tokens: TokenDigest | None


@dataclasses.dataclass(frozen=True)
class LoadParams:
    """What a consumer reads from a request's kv_transfer_params.

    `remote_prefill`: the params ask for a P/D load (do_remote_prefill) or
    carry checksums; such loads are verified under verify_loads'
    "remote_prefill". `checksums`: the producer's Checksums, an Unusable, or
    None when the params carry none (NO_CHECKSUMS)."""

    remote_prefill: bool = False
    checksums: Checksums | Unusable | None = None


@dataclasses.dataclass(frozen=True)
class PayloadSummary:
    """What a payload's bytes say of themselves, read before the verifier
    judges them: `num_tokens`, the producer's block size per group where
    the kvcsum extension gives one, the positions it sent per group
    ({group: (first position, positions)}), and the groups whose short
    last value (extension version 4 and later: their last position over
    one token fewer, SPEC section 9) it sent."""

    num_tokens: int
    block_sizes: dict
    positions: dict = dataclasses.field(default_factory=dict)
    short_last: frozenset = frozenset()


def payload_summary(raw: bytes) -> PayloadSummary | None:
    """The summary of payload bytes of the shape docs/SPEC.md section 9
    gives, or None for any other bytes (left to the verifier, which names
    what is wrong). Never raises."""
    try:
        import msgspec

        plain = msgspec.msgpack.decode(raw)
        if not isinstance(plain, list) or len(plain) < 3 or not is_int(plain[1]):
            return None
        sizes, short_last = {}, set()
        if len(plain) == 4 and isinstance(plain[3], list) and len(plain[3]) >= 3 and isinstance(plain[3][2], list):
            # Version 4 groups have 7 elements, version 5 (the geometry last) 8.
            group_len = {4: 7, 5: 8}.get(plain[3][0]) if is_int(plain[3][0]) else None
            for group in plain[3][2]:
                if isinstance(group, list) and len(group) >= 2 and is_int(group[0]) and is_int(group[1]):
                    sizes[group[0]] = group[1]
                    # A version-4 or -5 group's seventh element: a bin of no u64, or one.
                    if group_len and len(group) == group_len and isinstance(group[6], bytes) and len(group[6]) == 8:
                        short_last.add(group[0])
        positions = {}
        if isinstance(plain[2], list):
            for group in plain[2]:
                # `values`: a bin of one little-endian u64 per position.
                if isinstance(group, list) and len(group) >= 4 and is_int(group[0]) and is_int(group[2]) and isinstance(group[3], bytes):
                    positions[group[0]] = (group[2], len(group[3]) // 8)
        return PayloadSummary(plain[1], sizes, positions, frozenset(short_last))
    except Exception:  # noqa: BLE001 - malformed bytes are the verifier's to report
        return None


def consistency(checksums: "Checksums", summary: PayloadSummary | None) -> Unusable | None:
    """Why a payload and the kv_checksums_info beside it disagree (both
    come from the producer, which writes them from one prompt and one
    configuration), or None."""
    if summary is None:
        return None
    if checksums.tokens is not None and summary.num_tokens != checksums.tokens.count:
        return Unusable(
            INVALID_CHECKSUMS,
            f"the payload covers {summary.num_tokens} tokens, {INFO_KEY}.tokens {checksums.tokens.count}",
        )
    for group, size in sorted(summary.block_sizes.items()):
        said = checksums.block_sizes.get(group)
        if said is not None and said != size:
            return Unusable(
                INVALID_CHECKSUMS,
                f"the payload gives group {group} {size}-token blocks, {INFO_KEY}.block_sizes {said}",
            )
    return None


def token_digest(token_ids: Iterable[int], num_tokens: int) -> str:
    """A digest of a request's first num_tokens token ids ("count:hex"):
    binds a payload to the prompt it covers."""
    ids = []
    for token in token_ids:
        if len(ids) >= num_tokens:
            break
        ids.append(int(token))
    data = b"".join(t.to_bytes(8, "little", signed=True) for t in ids)
    return f"{len(ids)}:{hashlib.sha256(data).hexdigest()[:32]}"


def _describe(value: Any) -> str:
    """A short, safe description of a hostile value for a log line."""
    kind = type(value).__name__
    if isinstance(value, (str, bytes)):
        text = repr(value[:40]) + ("..." if len(value) > 40 else "")
        return f"a {kind} {text} of {len(value)} characters" if isinstance(value, str) else f"{kind} of {len(value)}"
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return f"the int {value}" if value.bit_length() <= 64 else f"an int of {value.bit_length()} bits"
    if isinstance(value, (list, tuple, dict)):
        return f"a {kind} of {len(value)} items"
    return f"a {kind}"


def is_int(value: Any) -> bool:
    """A real int (JSON's integers), not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _mapping(params: Any) -> Mapping:
    return params if isinstance(params, Mapping) else {}


def wants_remote_decode(params: Any) -> bool:
    """Whether a producer's request asks for do_remote_decode (any truthy
    JSON value, as the wrapped connectors read it)."""
    try:
        return bool(_mapping(params).get("do_remote_decode"))
    except Exception:  # noqa: BLE001 - a hostile __bool__ cannot come from JSON; be safe anyway
        return False


def parse_load(params: Any) -> LoadParams:
    """A consumer's reading of kv_transfer_params. Never raises."""
    try:
        return _parse_load(params)
    except Exception as error:  # noqa: BLE001 - hostile input must never take the engine down
        return LoadParams(
            remote_prefill=True,
            checksums=Unusable(INVALID_CHECKSUMS, f"kv_transfer_params could not be read ({type(error).__name__})"),
        )


def _parse_load(params: Any) -> LoadParams:
    if params is None:
        return LoadParams()
    if not isinstance(params, Mapping):
        return LoadParams()
    remote = bool(params.get("do_remote_prefill")) or PAYLOAD_KEY in params
    if PAYLOAD_KEY not in params or params.get(PAYLOAD_KEY) is None:
        return LoadParams(remote_prefill=remote, checksums=None)
    return LoadParams(remote_prefill=True, checksums=_checksums(params[PAYLOAD_KEY], params.get(INFO_KEY)))


def _checksums(payload: Any, info: Any) -> Checksums | Unusable:
    if not isinstance(payload, str):
        return Unusable(INVALID_CHECKSUMS, f"{PAYLOAD_KEY} is {_describe(payload)}, not base64 text")
    if len(payload) > MAX_PAYLOAD_CHARS:
        return Unusable(INVALID_CHECKSUMS, f"{PAYLOAD_KEY} holds {len(payload)} characters, above {MAX_PAYLOAD_CHARS}")
    if not payload.isascii() or "\0" in payload:
        return Unusable(INVALID_CHECKSUMS, f"{PAYLOAD_KEY} is {_describe(payload)}, not base64 text (a NUL or a non-ASCII character)")
    if info is None:
        return Checksums(payload, {}, None)
    if not isinstance(info, Mapping):
        return Unusable(INVALID_CHECKSUMS, f"{INFO_KEY} is {_describe(info)}, not an object")
    tokens = None
    if info.get("tokens") is not None:
        tokens = _digest(info["tokens"])
        if isinstance(tokens, Unusable):
            return tokens
    sizes = _block_sizes(info.get("block_sizes"))
    if isinstance(sizes, Unusable):
        return sizes
    return Checksums(payload, sizes, tokens)


def _digest(value: Any) -> TokenDigest | Unusable:
    where = f"{INFO_KEY}.tokens"
    if not isinstance(value, str):
        return Unusable(INVALID_CHECKSUMS, f"{where} is {_describe(value)}, not \"count:digest\"")
    match = _DIGEST.match(value)
    if match is None:
        return Unusable(INVALID_CHECKSUMS, f"{where} is {_describe(value)}, not \"count:digest\" (a decimal count, 32 hex digits)")
    return TokenDigest(int(match.group(1)), value)


def _block_sizes(value: Any) -> dict | Unusable:
    where = f"{INFO_KEY}.block_sizes"
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        return Unusable(INVALID_CHECKSUMS, f"{where} is {_describe(value)}, not an object of group: block size")
    if len(value) > MAX_GROUPS:
        return Unusable(INVALID_CHECKSUMS, f"{where} names {len(value)} groups, above {MAX_GROUPS}")
    out = {}
    for key, size in value.items():
        group = _group_id(key)
        if group is None:
            return Unusable(INVALID_CHECKSUMS, f"{where} has the key {_describe(key)}, not a group id (0 to {MAX_GROUP_ID})")
        if not is_int(size) or not 1 <= size <= MAX_BLOCK_SIZE:
            return Unusable(INVALID_CHECKSUMS, f"{where}[{group}] is {_describe(size)}, not a block size (1 to {MAX_BLOCK_SIZE})")
        if group in out:
            return Unusable(INVALID_CHECKSUMS, f"{where} names group {group} twice")
        out[group] = size
    return out


def _group_id(key: Any) -> int | None:
    if is_int(key):
        group = key
    elif isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10 and str(int(key)) == key:
        group = int(key)
    else:
        return None
    return group if 0 <= group <= MAX_GROUP_ID else None
