"""Change payloads: what a keyed backend appends to its log, and how replay reads it back. Pure.

Data record (key group = the key's group)::

    u8 op | u16 state_id | u32 key_len | key | u32 ns_len | namespace | op payload

Metadata record (key group -1, logged before a state's first change and again after every
materialization starts, so the log after a snapshot is self-describing)::

    u8 8 (METADATA) | u16 state_id | UTF-8 JSON {"name", "kind", "value_codec", ...}

Op payloads (op codes follow Flink's ``StateChangeOperation``):

====  =====================  ==========================================================
code  op                     payload
====  =====================  ==========================================================
0     CLEAR                  none
1     SET                    value bytes (value state)
2     SET_INTERNAL           the whole new value/accumulator (list, map, reducing,
                             aggregating): replay never re-runs user functions
3     ADD                    ``u32 n`` then n length-prefixed items: the elements (list
                             add_all), or keys and values alternating (map put_all; n is
                             twice the number of entries)
5     ADD_ELEMENT            one list element
6     ADD_OR_UPDATE_ELEMENT  ``u32 key_len | map key | value``
7     REMOVE_ELEMENT         map key
8     METADATA               see above
====  =====================  ==========================================================

Code 4 (Flink's MERGE_NS) is reserved: DSTL logs a namespace merge as its effects (CLEAR of each
source, SET_INTERNAL of the target), so replay needs no merge function.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from dstl.errors import CorruptObjectError

__all__ = [
    "ADD",
    "ADD_ELEMENT",
    "ADD_OR_UPDATE_ELEMENT",
    "CLEAR",
    "METADATA",
    "append_framed",
    "REMOVE_ELEMENT",
    "SET",
    "SET_INTERNAL",
    "Change",
    "decode_change",
    "decode_metadata",
    "decode_map_entry",
    "encode_key_ns",
    "encode_map_entry",
    "encode_metadata",
    "frame",
    "iter_framed",
    "iter_pairs",
]

CLEAR: Final = 0
SET: Final = 1
SET_INTERNAL: Final = 2
ADD: Final = 3
MERGE_NS: Final = 4  # reserved, never written
ADD_ELEMENT: Final = 5
ADD_OR_UPDATE_ELEMENT: Final = 6
REMOVE_ELEMENT: Final = 7
METADATA: Final = 8

OP_SID: Final = struct.Struct(">BH")
_U32: Final = struct.Struct(">I")
_pack_u32 = _U32.pack


def encode_key_ns(key: bytes, namespace: bytes) -> bytes:
    """The ``key`` and ``namespace`` part of a data record (cached per current key/namespace)."""
    return b"".join((_pack_u32(len(key)), key, _pack_u32(len(namespace)), namespace))


def encode_map_entry(key: bytes, value: bytes) -> bytes:
    """The payload of ADD_OR_UPDATE_ELEMENT: ``u32 key_len | key | value``."""
    return _pack_u32(len(key)) + key + value


def decode_map_entry(payload: bytes) -> tuple[bytes, bytes]:
    """Inverse of :func:`encode_map_entry`."""
    if len(payload) < 4:
        raise CorruptObjectError("<change>", 0, "map entry payload shorter than its length")
    (kl,) = _U32.unpack_from(payload, 0)
    if 4 + kl > len(payload):
        raise CorruptObjectError("<change>", 4, "map entry key runs past the payload")
    return payload[4:4 + kl], payload[4 + kl:]


def frame(items: list[bytes]) -> bytes:
    """``u32 n`` then each item length-prefixed."""
    parts = [_pack_u32(len(items))]
    for it in items:
        parts.append(_pack_u32(len(it)))
        parts.append(it)
    return b"".join(parts)


def append_framed(framed: bytes | None, items: list[bytes]) -> bytes:
    """``framed`` (a :func:`frame` result, or None) with ``items`` appended, without decoding."""
    if not framed:
        return frame(items)
    (n,) = _U32.unpack_from(framed, 0)
    parts = [_pack_u32(n + len(items)), framed[4:]]
    for it in items:
        parts.append(_pack_u32(len(it)))
        parts.append(it)
    return b"".join(parts)


def iter_framed(data: bytes, pos: int = 0) -> Iterator[bytes]:
    """Inverse of :func:`frame`."""
    try:
        (n,) = _U32.unpack_from(data, pos)
        pos += 4
        for _ in range(n):
            (ln,) = _U32.unpack_from(data, pos)
            pos += 4
            if pos + ln > len(data):
                raise CorruptObjectError("<change>", pos, "framed item runs past the payload")
            yield data[pos:pos + ln]
            pos += ln
    except struct.error as exc:
        raise CorruptObjectError("<change>", pos, f"malformed framed list: {exc}") from exc


def iter_pairs(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Pairs of a map ``ADD`` payload (framed as key, value, key, value, ...)."""
    items = iter_framed(data)
    for k in items:
        yield k, next(items)


@dataclass(frozen=True, slots=True)
class Change:
    """A decoded data record."""

    op: int
    state_id: int
    key: bytes
    namespace: bytes
    payload: bytes


def decode_change(data: bytes) -> Change:
    """Decode a data record (not METADATA).

    Raises:
        CorruptObjectError: the record is malformed.
    """
    try:
        op, sid = OP_SID.unpack_from(data, 0)
        (kl,) = _U32.unpack_from(data, 3)
        key_end = 7 + kl
        (nl,) = _U32.unpack_from(data, key_end)
        ns_end = key_end + 4 + nl
        if ns_end > len(data):
            raise CorruptObjectError("<change>", key_end, "namespace runs past the record")
        return Change(op, sid, data[7:key_end], data[key_end + 4:ns_end], data[ns_end:])
    except struct.error as exc:
        raise CorruptObjectError("<change>", 0, f"malformed change record: {exc}") from exc


def encode_metadata(state_id: int, meta: dict[str, Any]) -> bytes:
    """A METADATA record for ``state_id``."""
    return OP_SID.pack(METADATA, state_id) + json.dumps(meta, sort_keys=True).encode("utf-8")


def decode_metadata(data: bytes) -> tuple[int, dict[str, Any]]:
    """Decode a METADATA record into ``(state_id, meta)``.

    Raises:
        CorruptObjectError: not a metadata record, or its JSON is malformed.
    """
    try:
        op, sid = OP_SID.unpack_from(data, 0)
        if op != METADATA:
            raise CorruptObjectError("<change>", 0, f"expected a metadata record, got op {op}")
        meta = json.loads(data[3:].decode("utf-8"))
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise CorruptObjectError("<change>", 0, f"malformed metadata record: {exc}") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) \
            or not isinstance(meta.get("kind"), str):
        raise CorruptObjectError("<change>", 3, f"metadata record lacks name/kind: {meta!r}")
    return sid, meta
