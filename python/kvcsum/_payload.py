"""A producer's payload read back through the library's own decoder
(kvcs_payload_*): what a payload says, for tools and logs (`python -m
kvcsum inspect`), without parsing msgpack here."""

from __future__ import annotations

import dataclasses
import struct
from ctypes import byref, c_uint64, c_void_p

from . import _lib
from ._base import _bytes_of, _c, _check, _member, _sized, library
from ._constants import Algorithm


@dataclasses.dataclass(frozen=True)
class LayerDecoding:
    """How the producer declared it reads one layer's bytes (SPEC section
    7, "Decoding"); None where a fact is not declared. The scales are
    given as floats and as their binary64 bits, which is what is compared.

    Thread safety: immutable (a frozen dataclass); share it freely."""

    layer_number: int
    dtype: str | None
    head_size: int | None
    k_scale_bits: int | None
    v_scale_bits: int | None

    @property
    def k_scale(self) -> float | None:
        """K's scale as a float, None where not declared."""
        return _float_of(self.k_scale_bits)

    @property
    def v_scale(self) -> float | None:
        """V's scale as a float, None where not declared."""
        return _float_of(self.v_scale_bits)


@dataclasses.dataclass(frozen=True)
class PayloadLayer:
    """A per-layer partial of the extension (detail mode): heads
    `first_head .. first_head + num_heads` of `layer_number`, one value per
    block position of its group.

    Thread safety: immutable (a frozen dataclass); share it freely."""

    layer_number: int
    first_head: int
    num_heads: int
    values: tuple


@dataclasses.dataclass(frozen=True)
class PayloadGroup:
    """One group of a payload, with what the extension says of it (None or
    empty where it says nothing).

    Thread safety: immutable (a frozen dataclass); share it freely."""

    group_id: int
    fingerprint: int
    first_position: int
    values: tuple
    block_size: int | None
    coverage: int | None
    marks: int | None
    layers: tuple
    decodings: tuple
    #: The value of the group's position holding the request's last token
    #: over one token fewer (extension version 4), which a load of one
    #: token fewer is compared with (SPEC section 10); None where not sent.
    short_last: int | None = None


@dataclasses.dataclass(frozen=True)
class Payload:
    """A decoded payload (SPEC section 9): `extension_version` 0 for a plain
    payload (vLLM's), whose algorithm is WEIGHTED and which says nothing of
    the producer's TP size (None) or block sizes.

    Thread safety: immutable (a frozen dataclass); share it freely."""

    version: int
    num_tokens: int
    extension_version: int
    producer_tp_size: int | None
    algorithm: Algorithm
    groups: tuple

    def group(self, group_id: int) -> PayloadGroup | None:
        """The group `group_id`, if the payload has it."""
        return next((g for g in self.groups if g.group_id == group_id), None)


def _float_of(bits: int | None) -> float | None:
    return None if bits is None else struct.unpack("<d", struct.pack("<Q", bits))[0]


def decode_payload(data: bytes | str) -> Payload:
    """The payload `data` (bytes, or the base64 text of
    kv_transfer_params["kv_checksums"]) as the library decodes it:
    Malformed (a ValueError) naming the byte and what is wrong for anything
    that is not a payload, TypeError for an argument that is neither."""
    lib = library()
    if isinstance(data, str):
        text = _c(data, "data")
        buffer, length = _sized(lambda buf, cap, n: lib.kvcs_base64_decode(text, len(text), buf, cap, n))
        data = bytes(buffer[:length])
    raw, length = _bytes_of(data, "data")
    handle = c_void_p()
    _check(lib.kvcs_payload_decode(raw, length, byref(handle)))
    try:
        return _read(lib, handle)
    finally:
        lib.kvcs_payload_destroy(handle)


def _values(call) -> tuple:
    buffer, length = _sized(call, c_uint64)
    return tuple(buffer[:length])


def _read(lib, handle) -> Payload:
    info = _lib.STRUCTS["kvcs_payload_summary"]()
    _check(lib.kvcs_payload_info(handle, byref(info)))
    groups = []
    for g in range(info.num_groups):
        entry = _lib.STRUCTS["kvcs_group_checksums"]()
        _check(lib.kvcs_payload_group(handle, g, byref(entry)))
        values = _values(lambda buf, cap, n: lib.kvcs_payload_values(handle, g, buf, cap, n))
        short_last = _values(lambda buf, cap, n: lib.kvcs_payload_short_last(handle, g, buf, cap, n))
        layers = []
        for i in range(entry.num_layers):
            layer = _lib.STRUCTS["kvcs_layer_checksums"]()
            _check(lib.kvcs_payload_layer(handle, g, i, byref(layer)))
            layer_values = _values(lambda buf, cap, n: lib.kvcs_payload_layer_values(handle, g, i, buf, cap, n))
            layers.append(PayloadLayer(layer.layer_number, layer.first_head, layer.num_heads, layer_values))
        decodings = []
        for i in range(entry.num_decodings):
            decoding = _lib.STRUCTS["kvcs_layer_decoding"]()
            _check(lib.kvcs_payload_decoding(handle, g, i, byref(decoding)))
            decodings.append(
                LayerDecoding(
                    decoding.layer_number,
                    decoding.dtype.decode() if decoding.dtype else None,
                    decoding.head_size or None,
                    decoding.k_scale_bits or None,
                    decoding.v_scale_bits or None,
                )
            )
        groups.append(
            PayloadGroup(
                entry.group_id,
                entry.fingerprint,
                entry.first_position,
                values,
                entry.block_size or None,
                entry.coverage if entry.has_coverage else None,
                entry.marks if entry.has_marks else None,
                tuple(layers),
                tuple(decodings),
                short_last[0] if short_last else None,
            )
        )
    return Payload(
        info.version,
        info.num_tokens,
        info.extension_version,
        info.producer_tp_size or None,
        _member(Algorithm, info.algorithm),
        tuple(groups),
    )
