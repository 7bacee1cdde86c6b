"""`python -m kvcsum inspect`: what a payload says, for an operator reading
logs (docs/operations.md). It decodes through the library
(kvcsum.decode_payload), prints the payload's version, tokens, groups,
fingerprints, algorithm, block sizes, values per position and short last
values, and with a second payload the differences; `--json` prints the
same as one JSON object for scripts. Exit status: 0, or with two payloads 0
when they say the same and 1 when they differ; 2 for input that is not a
payload (the message says which input and what is wrong). A reader that
closes the pipe early (`| head`) ends it quietly."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import sys

from ._constants import Algorithm

#: `kv_checksums` as a log or a kv_transfer_params dump shows it:
#: 'kv_checksums': 'kwE...', "kv_checksums": "kwE...", kv_checksums=kwE...
_IN_PARAMS = re.compile(r"""kv_checksums['"]?\s*[:=]\s*['"]?([A-Za-z0-9+/=\s]+)""")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


class InputError(Exception):
    """An input that is not a payload: exit status 2 with this message."""


def payload_text(text: str, what: str) -> str:
    """The base64 of a payload from what an operator pasted: the base64
    itself (whitespace, line breaks and quotes around it are dropped), or a
    line or dump that holds `kv_checksums` with its value."""
    found = _IN_PARAMS.search(text)
    if found:
        text = found.group(1)
    text = "".join(text.split()).strip("'\"")
    if not text:
        raise InputError(f"{what} is empty (give the base64 text of kv_checksums)")
    if not _BASE64.fullmatch(text):
        bad = next(c for c in text if not (c.isalnum() or c in "+/="))
        raise InputError(
            f"{what} is not base64: {bad!r} at character {text.index(bad)} of {len(text)} "
            "(kv_checksums is standard base64, A-Z a-z 0-9 + / and = padding)"
        )
    return text


def read_input(argument: str | None, path: str | None, what: str):
    """A payload as the library takes it: base64 text, or the bytes of a
    binary file."""
    if path is None:
        return payload_text(argument or "", what)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        raise InputError(f"{what}: cannot read {path}: {error.strerror or error}") from None
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return data  # a binary payload (msgpack), as Verifier.payload gives it
    return payload_text(text, f"{what} ({path})")


def _hex(value: int) -> str:
    return f"{value:#018x}"


def _scale(bits: int | None) -> str:
    if bits is None:
        return "not declared"
    return f"{struct.unpack('<d', struct.pack('<Q', bits))[0]!r} (bits {bits:#018x})"


def _algorithm(value) -> str:
    return f"{value.name} ({int(value)})" if isinstance(value, Algorithm) else f"unknown ({value})"


def describe(payload, title: str = "payload") -> list[str]:
    """The lines `inspect` prints for one payload."""
    groups = f"{len(payload.groups)} group" + ("" if len(payload.groups) == 1 else "s")
    lines = [f"{title}: version {payload.version}, {payload.num_tokens} tokens, {groups}"]
    if payload.extension_version:
        lines.append(
            f"  extension version {payload.extension_version}: algorithm {_algorithm(payload.algorithm)}, "
            f"producer TP size {payload.producer_tp_size}"
        )
    else:
        lines.append(
            "  no extension (a plain payload, as vLLM sends it): algorithm WEIGHTED (1); "
            "the producer's TP size and block sizes are not sent"
        )
    for group in payload.groups:
        end = group.first_position + len(group.values)
        block = f"block size {group.block_size}" if group.block_size else "block size not sent"
        lines.append(
            f"  group {group.group_id}: fingerprint {_hex(group.fingerprint)}, "
            f"positions {group.first_position}..{end} ({len(group.values)} values), {block}"
        )
        if group.coverage is not None:
            lines.append(f"    coverage {_hex(group.coverage)}")
        if group.marks is not None:
            marks = "none" if group.marks == 0 else _hex(group.marks)
            lines.append(f"    marks (aliases, shard-keyed state) {marks}")
        for d in group.decodings:
            lines.append(
                f"    layer {d.layer_number} decoding: dtype {d.dtype or 'not declared'}, "
                f"head_size {d.head_size or 'not declared'}, k_scale {_scale(d.k_scale_bits)}, "
                f"v_scale {_scale(d.v_scale_bits)}"
            )
        if group.layers:
            ranges = ", ".join(
                f"{layer.layer_number} (heads {layer.first_head}..{layer.first_head + layer.num_heads})"
                for layer in group.layers
            )
            lines.append(f"    layer partials: {ranges}")
        width = len(str(max(end - 1, 0)))
        for i, value in enumerate(group.values):
            lines.append(f"    position {group.first_position + i:>{width}}: {value:016x}")
        if group.short_last is not None:
            lines.append(
                f"    short last value (position {end - 1} over {payload.num_tokens - 1} tokens, "
                f"for a load of one token fewer): {group.short_last:016x}"
            )
    return lines


def differences(first, second) -> list[str]:
    """What differs between two payloads, one line each: the facts, then
    the positions whose values differ (as numbered: where block sizes
    differ, positions hold other tokens and are not compared)."""
    out = []
    shown = {"algorithm": _algorithm, "producer_tp_size": lambda v: "not sent" if v is None else str(v)}
    for name in ("num_tokens", "extension_version", "producer_tp_size", "algorithm"):
        a, b = getattr(first, name), getattr(second, name)
        if a != b:
            show = shown.get(name, str)
            out.append(f"{name}: {show(a)} vs {show(b)}")
    ids_a = [g.group_id for g in first.groups]
    ids_b = [g.group_id for g in second.groups]
    for group_id in sorted(set(ids_a) | set(ids_b)):
        a, b = first.group(group_id), second.group(group_id)
        if a is None or b is None:
            out.append(f"group {group_id}: only in the {'second' if a is None else 'first'} payload")
            continue
        for name in ("fingerprint", "block_size", "coverage", "marks", "short_last"):
            x, y = getattr(a, name), getattr(b, name)
            if x != y:
                show = (lambda v: "not sent" if v is None else _hex(v)) if name != "block_size" else str
                out.append(f"group {group_id}: {name} {show(x)} vs {show(y)}")
        decodings_a = {d.layer_number: d for d in a.decodings}
        decodings_b = {d.layer_number: d for d in b.decodings}
        for layer in sorted(set(decodings_a) | set(decodings_b)):
            if decodings_a.get(layer) != decodings_b.get(layer):
                out.append(f"group {group_id}: layer {layer} decoding {decodings_a.get(layer)} vs {decodings_b.get(layer)}")
        if a.block_size and b.block_size and a.block_size != b.block_size:
            out.append(
                f"group {group_id}: block sizes {a.block_size} and {b.block_size} differ: positions hold other "
                "tokens, values not compared"
            )
            continue
        values_a = dict(enumerate(a.values, a.first_position))
        values_b = dict(enumerate(b.values, b.first_position))
        only = []
        for position in sorted(set(values_a) | set(values_b)):
            x, y = values_a.get(position), values_b.get(position)
            if x is None or y is None:
                only.append(position)
            elif x != y:
                out.append(f"group {group_id}: position {position}: {x:016x} vs {y:016x}")
        if only:
            out.append(f"group {group_id}: positions in one payload only: {_runs(only)}")
    return out


def _runs(positions: list[int]) -> str:
    """Sorted positions as half-open runs: "0..3, 7..8"."""
    runs = []
    start = previous = positions[0]
    for position in positions[1:]:
        if position != previous + 1:
            runs.append(f"{start}..{previous + 1}")
            start = position
        previous = position
    runs.append(f"{start}..{previous + 1}")
    return ", ".join(runs)


def as_json(payload) -> dict:
    """One payload as plain JSON values: every field of kvcsum.Payload, the
    algorithm by name, scales beside their bits."""
    out = dataclasses.asdict(payload)
    out["algorithm"] = payload.algorithm.name if isinstance(payload.algorithm, Algorithm) else int(payload.algorithm)
    for group in out["groups"]:
        for decoding in group["decodings"]:
            for name in ("k_scale", "v_scale"):
                bits = decoding[f"{name}_bits"]
                decoding[name] = None if bits is None else struct.unpack("<d", struct.pack("<Q", bits))[0]
    return out


def _print(text: str) -> None:
    """Prints `text`; a reader that closed the pipe (`| head`) ends the
    output quietly: BrokenPipeError is turned into a quiet stop, with
    stdout pointed at /dev/null so that Python's flush at exit raises
    nothing either."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise _PipeClosed from None


class _PipeClosed(Exception):
    """The reader of stdout went away."""


def main(arguments) -> int:
    """Runs `inspect` on parsed arguments (payloads, files); a closed
    stdout ends it with the status it would have had."""
    try:
        return _main(arguments)
    except _PipeClosed:
        return getattr(arguments, "status_if_closed", 0)


def _main(arguments) -> int:
    from ._errors import Error
    from ._payload import decode_payload

    inputs = [(text, None) for text in arguments.payloads or []] + [(None, path) for path in arguments.file or []]
    if not 1 <= len(inputs) <= 2:
        print(
            f"python -m kvcsum inspect: give one payload, or two to compare (got {len(inputs)})",
            file=sys.stderr,
        )
        return 2
    payloads = []
    for number, (text, path) in enumerate(inputs, 1):
        what = f"payload {number}" if len(inputs) > 1 else "the payload"
        try:
            payloads.append(decode_payload(read_input(text, path, what)))
        except InputError as error:
            print(f"python -m kvcsum inspect: {error}", file=sys.stderr)
            return 2
        except Error as error:
            print(f"python -m kvcsum inspect: {what} is not a kvcsum payload: {error}", file=sys.stderr)
            return 2
        except ImportError as error:  # no library to decode with
            print(f"python -m kvcsum inspect: {type(error).__name__}: {error}", file=sys.stderr)
            return 2
    found = differences(*payloads) if len(payloads) == 2 else []
    status = 1 if found else 0
    arguments.status_if_closed = status
    if getattr(arguments, "json", False):
        document = {"payloads": [as_json(p) for p in payloads]}
        if len(payloads) == 2:
            document["differences"] = found
        _print(json.dumps(document, indent=2))
        return status
    for number, payload in enumerate(payloads, 1):
        _print("\n".join(describe(payload, f"payload {number}" if len(payloads) > 1 else "payload")))
    if len(payloads) == 1:
        return 0
    if not found:
        _print("the two payloads say the same")
        return 0
    _print(f"differences ({len(found)}):")
    _print("\n".join(f"  {line}" for line in found))
    return 1
