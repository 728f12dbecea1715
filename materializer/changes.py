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
source, SET_INTERNAL of the target), so replay needs no merge function. :data:`OPS_BY_KIND` says
which ops a state of each kind logs; replay refuses any other (a crafted log could otherwise make
a list operation run on a value state). What each op does — to the entry it changes, and as rows
of the change feed — is the op table below (:func:`apply_op`, :func:`op_rows`): restore, the
state reader and the change feed all use it.

Decoding is strict (the log is untrusted input): every decoder here raises only
:class:`~dstl.errors.CorruptObjectError`, naming the placeholder ``<change>`` and the offset
inside the payload — the replay, which knows the segment and the record, re-raises it naming
those (:func:`dstl.errors.located`). State descriptions (in metadata records, a snapshot's
metadata block and the table marker) are checked by one function, :func:`check_state_meta`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from dstl.errors import CorruptObjectError
from dstl.untrusted import load_json
from materializer.schema import read_recorded

__all__ = [
    "MAX_METADATA_RECORD_BYTES",
    "MAX_STATES_METADATA_BYTES",
    "OPS_BY_KIND",
    "READS_CURRENT",
    "STATE_KINDS",
    "ADD",
    "ADD_ELEMENT",
    "ADD_OR_UPDATE_ELEMENT",
    "CLEAR",
    "METADATA",
    "append_framed",
    "apply_op",
    "check_state_meta",
    "decode_snapshot_states",
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
    "op_rows",
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

#: The kinds of state (``materializer.states.STATE_CLASSES`` has one class per kind).
STATE_KINDS: Final = frozenset({"value", "list", "map", "reducing", "aggregating"})
#: The ops a state of each kind logs (see ``materializer.states``); replay refuses any other.
OPS_BY_KIND: Final = {
    "value": frozenset({CLEAR, SET, SET_INTERNAL}),
    "list": frozenset({CLEAR, SET, SET_INTERNAL, ADD, ADD_ELEMENT}),
    "map": frozenset({CLEAR, SET, SET_INTERNAL, ADD, ADD_OR_UPDATE_ELEMENT, REMOVE_ELEMENT}),
    "reducing": frozenset({CLEAR, SET, SET_INTERNAL}),
    "aggregating": frozenset({CLEAR, SET, SET_INTERNAL}),
}
#: A metadata record describes one state (name, kind, codec names): far below this.
MAX_METADATA_RECORD_BYTES: Final = 64 * 1024
#: A snapshot's state registry (up to 65,536 states of a few hundred bytes each).
MAX_STATES_METADATA_BYTES: Final = 32 * 1024 * 1024
#: Longest state name (``get_state`` refuses longer ones) and codec name.
_MAX_NAME_CHARS: Final = 255

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
    """Pairs of a map ``ADD`` payload (framed as key, value, key, value, ...).

    Raises:
        CorruptObjectError: malformed, or an odd number of items.
    """
    items = iter_framed(data)
    for k in items:
        v = next(items, None)
        if v is None:
            raise CorruptObjectError("<change>", 0, "map entries payload holds an odd number "
                                                    "of items (a key without its value)")
        yield k, v


# --------------------------------------------------------------------------- the op table
#
# What each op does, for every reader of the log: restore (ChangelogKeyedStateBackend.
# apply_change), the state reader (dstl/reader/image.py) and the change feed
# (dstl/reader/changes.py) all go through the two functions below, so an op means one thing.
#
# ======================  =====================================  =================================
# op                      the entry of its key and namespace     rows of the change feed
# ======================  =====================================  =================================
# CLEAR                   removed                                ("clear", None, None)
# SET, SET_INTERNAL       replaced by the payload                ("set", None, the decoded value)
# ADD_ELEMENT (list)      the element appended                   ("add", None, the element)
# ADD (list)              the elements appended, in order        ("add", None, element) each
# ADD (map)               the entries put                        ("put", map key, value) each
# ADD_OR_UPDATE_ELEMENT   the entry put                          ("put", map key, value)
# REMOVE_ELEMENT (map)    the entry removed; an emptied map      ("remove", map key, None)
#                         is removed
# ======================  =====================================  =================================

#: The ops whose effect depends on the entry they change (the others replace or remove it).
READS_CURRENT: Final = frozenset({ADD, ADD_ELEMENT, ADD_OR_UPDATE_ELEMENT, REMOVE_ELEMENT})


def apply_op(op: int, shape: Any, current: Any, payload: bytes, *, objects: bool) -> Any:
    """The entry after one change (the op table's middle column), or ``None`` when the change
    removes it.

    Args:
        op: the change's op, already checked against :data:`OPS_BY_KIND` for ``shape.kind``.
        shape: the state's :class:`~materializer.states.StateShape` (kind and codecs).
        current: the entry before the change (``None``: absent); only read for the ops of
            :data:`READS_CURRENT`.
        payload: the change's payload.
        objects: entries are heap objects (``True``) or their stored bytes (``False``).

    Raises:
        CorruptObjectError: the payload does not decode (named ``<change>``/``<state value>``),
            a map key that is not hashable, or an op this table does not know.
    """
    if op == CLEAR:
        return None
    if op in (SET, SET_INTERNAL):
        return shape.from_bytes(payload) if objects else payload
    codec = shape.codec
    if not objects and shape.kind == "list" and op in (ADD_ELEMENT, ADD):
        # the stored list's bytes as the live write path makes them (append_framed); the new
        # elements are decoded once, so a change that does not decode is refused here
        items = [payload] if op == ADD_ELEMENT else list(iter_framed(payload))
        for e in items:
            codec.decode(e)
        return append_framed(current, items)
    obj = None if current is None else (current if objects else shape.from_bytes(current))
    if op == ADD_ELEMENT:
        obj = [*(obj or []), codec.decode(payload)]
    elif op == ADD and shape.kind == "list":
        obj = [*(obj or []), *(codec.decode(e) for e in iter_framed(payload))]
    elif op == ADD:
        kd = shape.map_key
        obj = dict(obj or {})
        obj.update((kd(k), codec.decode(v)) for k, v in iter_pairs(payload))
    elif op == ADD_OR_UPDATE_ELEMENT:
        kb, vb = decode_map_entry(payload)
        obj = dict(obj or {})
        obj[shape.map_key(kb)] = codec.decode(vb)
    elif op == REMOVE_ELEMENT:
        obj = dict(obj or {})
        obj.pop(shape.map_key(payload), None)
        if not obj:
            return None
    else:
        raise CorruptObjectError("<changelog>", 0, f"unknown op code {op}")
    return obj if objects else shape.to_bytes(obj)


def op_rows(op: int, shape: Any, payload: bytes) -> Iterator[tuple[str, Any, Any]]:
    """``(change, map key, value)`` of one change (the op table's right column): what the
    change feed shows.

    Raises:
        CorruptObjectError: the payload does not decode, or an op this table does not know.
    """
    if op == CLEAR:
        yield "clear", None, None
    elif op in (SET, SET_INTERNAL):  # a list's or a map's SET is its whole value, as restored
        yield "set", None, shape.from_bytes(payload)
    elif op == ADD_ELEMENT:
        yield "add", None, shape.codec.decode(payload)
    elif op == ADD and shape.kind == "list":
        for e in iter_framed(payload):
            yield "add", None, shape.codec.decode(e)
    elif op == ADD:
        kd = shape.key_codec.decode
        for k, v in iter_pairs(payload):
            yield "put", kd(k), shape.codec.decode(v)
    elif op == ADD_OR_UPDATE_ELEMENT:
        kb, vb = decode_map_entry(payload)
        yield "put", shape.key_codec.decode(kb), shape.codec.decode(vb)
    elif op == REMOVE_ELEMENT:
        yield "remove", shape.key_codec.decode(payload), None
    else:
        raise CorruptObjectError("<changelog>", 0, f"unknown op code {op}")


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
    """Decode a METADATA record into ``(state_id, meta)``; ``meta`` passed
    :func:`check_state_meta`.

    Raises:
        CorruptObjectError: not a metadata record, its JSON is malformed, too large or too
            deep, or it does not describe a state.
    """
    if len(data) < OP_SID.size:
        raise CorruptObjectError("<change>", 0, f"metadata record of {len(data)} bytes is "
                                                "shorter than its op and state id")
    op, sid = OP_SID.unpack_from(data, 0)
    if op != METADATA:
        raise CorruptObjectError("<change>", 0, f"expected a metadata record, got op {op}")
    meta = load_json(memoryview(data)[OP_SID.size:], key="<change>", offset=OP_SID.size,
                     what="metadata record", max_bytes=MAX_METADATA_RECORD_BYTES)
    return sid, check_state_meta(meta, key="<change>", offset=OP_SID.size,
                                 what="metadata record")


def check_state_meta(meta: Any, *, key: str, offset: int, what: str) -> dict[str, Any]:
    """Return ``meta`` if it describes a state: an object with a ``name`` (a non-empty string of
    at most 255 characters), a ``kind`` of :data:`STATE_KINDS`, ``value_codec`` and
    ``key_codec`` that are absent, null or strings, and a ``schema`` (the declared type,
    :mod:`materializer.schema`) that is absent or well formed.

    Raises:
        CorruptObjectError: it does not (names ``key``, ``offset`` and the field).
    """
    def bad(reason: str) -> CorruptObjectError:
        return CorruptObjectError(key, offset, f"{what}: {reason}")

    if not isinstance(meta, dict):
        raise bad(f"a state description must be a JSON object, not {type(meta).__name__}")
    name = meta.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME_CHARS:
        raise bad(f"state name {name!r:.80} is not a non-empty string of at most "
                  f"{_MAX_NAME_CHARS} characters")
    kind = meta.get("kind")
    if not isinstance(kind, str) or kind not in STATE_KINDS:
        raise bad(f"state {name!r} has kind {kind!r:.80}, not one of {sorted(STATE_KINDS)}")
    for field in ("value_codec", "key_codec"):
        codec = meta.get(field)
        if codec is not None and (not isinstance(codec, str)
                                  or not 0 < len(codec) <= _MAX_NAME_CHARS):
            raise bad(f"state {name!r} has {field}={codec!r:.80}, not a codec name")
    if "schema" in meta:
        try:
            read_recorded(meta["schema"])
        except ValueError as exc:
            raise bad(f"state {name!r} has a malformed declared type: {exc}") from exc
    return meta


def decode_snapshot_states(metadata: bytes | memoryview, *, key: str,
                           offset: int = 0) -> dict[int, dict[str, Any]]:
    """The state registry in a snapshot's metadata block (``{"states": {"<id>": meta}}``):
    state id -> description (each checked by :func:`check_state_meta`).

    Raises:
        CorruptObjectError: the block is not such a JSON object, a state id is not a decimal
            integer in [0, 65535], or a description is malformed (names ``key`` and ``offset``).
    """
    doc = load_json(metadata, key=key, offset=offset, what="snapshot metadata",
                    max_bytes=MAX_STATES_METADATA_BYTES)
    states = doc.get("states") if isinstance(doc, dict) else None
    if not isinstance(states, dict):
        raise CorruptObjectError(key, offset, "snapshot metadata has no 'states' object (not "
                                              "written by a DSTL backend?)")
    out: dict[int, dict[str, Any]] = {}
    for sid, meta in states.items():
        if not (sid.isascii() and sid.isdigit() and len(sid) <= 5 and int(sid) <= 0xFFFF):
            raise CorruptObjectError(key, offset, f"snapshot metadata: state id {sid!r:.40} is "
                                                  "not an integer in [0, 65535]")
        out[int(sid)] = check_state_meta(meta, key=key, offset=offset,
                                         what=f"snapshot metadata of state {sid}")
    return out
