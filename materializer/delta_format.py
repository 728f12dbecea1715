"""Snapshot object format v3, the *delta*: bytes <-> values, no I/O.

Theory of operation
-------------------
An incremental materialization writes, instead of the whole table, the final stored value of
every ``(state, key, namespace)`` that changed since the previous materialization of the same
backend — or a *tombstone* where the entry was removed. The checkpoint's handle then names the
last full snapshot (the *base*, format v1 or v2) followed by every delta written since, in order
(:class:`~materializer.handles.SnapshotRef` with ``delta=True``); a restore loads the base and
applies the deltas in order, then replays the log.

The object is the v1 layout (:mod:`materializer.snapshot_format`) with version byte 3 in the
header and the footer, and two rules of its own for the entries of a key-group block:

* an entry's ``u32`` value length :data:`~materializer.snapshot_format.TOMBSTONE_LENGTH`
  (``0xFFFFFFFF``) marks a tombstone: no value bytes follow;
* entries are strictly ascending by ``(state id, key, namespace)`` (bytes compared
  lexicographically), so no entry appears twice and a reader can merge or search a block.

The metadata block holds :class:`DeltaMeta` as canonical JSON: the range, the job's max
parallelism, the operator, the materialization id, the id of the piece it ``follows`` (the
previous materialization: the base or the previous delta) and the states' descriptions.

Everything read is untrusted. Decoding checks, besides the v1 envelope, footer, index and block
checks (with version 3 expected): the metadata (every field), that the index covers exactly the
metadata's range, the entries' framing, their order, that every state id is described, and that
every key of a state that is not an internal raw state lies in the key group whose block holds it
(``key_group_for``, what every lookup computes). Every failure is a
:class:`~dstl.errors.CorruptObjectError` subclass naming the object and the offset.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from dstl.errors import CorruptObjectError, TruncatedObjectError, UsageError
from dstl.keygroups import MAX_PARALLELISM_LIMIT, KeyGroupRange, key_group_for
from dstl.untrusted import load_json
from materializer.changes import check_state_meta
from materializer.snapshot_format import (
    BLOCK_ENTRIES_OFFSET,
    ENTRY_HEAD,
    ENTRY_MIN_BYTES,
    FOOTER_SIZE,
    HEADER_SIZE,
    TAIL_READ_BYTES,
    TOMBSTONE_LENGTH,
    IndexEntry,
    SnapshotEncoder,
    SnapshotIndex,
    block_content,
    block_framing_error,
    check_snapshot_header,
    decode_footer,
    decode_index,
    decode_metadata_block,
    snapshot_format,
    verify_snapshot_object,
)
from materializer.state_tables import BytesSource, RangeSource

__all__ = [
    "DELTA_FORMAT",
    "DELTA_VERSION",
    "DeltaEntry",
    "DeltaMeta",
    "DeltaReader",
    "decode_delta",
    "encode_delta",
    "verify_delta_object",
]

#: The format version byte of a delta object.
DELTA_VERSION: Final = 3
#: What the shared envelope expects of a delta (the default block limit).
DELTA_FORMAT: Final = snapshot_format(None, DELTA_VERSION)

#: One entry: ``(state id, key, namespace, value)``; ``value`` ``None`` is a tombstone.
DeltaEntry = tuple[int, bytes, bytes, bytes | None]

_U32: Final = struct.Struct(">I")
_META_FIELDS: Final = frozenset({"format", "key_groups", "max_parallelism", "operator_id",
                                 "materialization_id", "follows", "up_to", "states"})


@dataclass(frozen=True, slots=True)
class DeltaMeta:
    """The metadata block of a delta.

    Attributes:
        key_groups: the backend's range (the index covers exactly this range).
        max_parallelism: the job's number of key groups.
        operator_id: whose table.
        materialization_id: this delta's materialization.
        follows: the materialization id of the piece this delta applies on (the base or the
            previous delta); a restore refuses a chain in which it is not the previous piece.
        up_to: the first sqn of the backend's log not reflected.
        states: state id (a decimal string) -> the state's metadata, as in v1 and v2.
    """

    key_groups: KeyGroupRange
    max_parallelism: int
    operator_id: str
    materialization_id: int
    follows: int
    up_to: int
    states: dict[str, Any]

    def to_bytes(self) -> bytes:
        obj = {"format": "delta", "key_groups": self.key_groups.to_json_obj(),
               "max_parallelism": self.max_parallelism, "operator_id": self.operator_id,
               "materialization_id": self.materialization_id, "follows": self.follows,
               "up_to": self.up_to, "states": self.states}
        return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, *, key: str, offset: int) -> DeltaMeta:
        """Parse and check the metadata JSON (untrusted).

        Raises:
            CorruptObjectError: not DSTL's delta metadata (names the field).
        """
        obj = load_json(data, key=key, what="delta metadata", max_bytes=len(data), offset=offset)
        try:
            if not isinstance(obj, dict) or obj.get("format") != "delta":
                raise ValueError('not an object with "format": "delta"')
            if set(obj) != _META_FIELDS:
                raise ValueError(f"fields {sorted(obj)}, expected {sorted(_META_FIELDS)}")
            kgs = KeyGroupRange.from_json_obj(obj["key_groups"])
            mp, mat, follows, up_to = (obj[f] for f in ("max_parallelism",
                                                        "materialization_id", "follows", "up_to"))
            if not all(type(v) is int for v in (mp, mat, follows, up_to)):
                raise ValueError("max_parallelism, materialization_id, follows and up_to must "
                                 "be integers")
            if not 0 < mp <= MAX_PARALLELISM_LIMIT or kgs.end >= mp or not len(kgs):
                raise ValueError(f"key groups {kgs} do not fit max_parallelism {mp}")
            if not 0 <= follows < mat < 1 << 63 or not 0 <= up_to < 1 << 63:
                raise ValueError(f"materialization_id={mat} follows={follows} up_to={up_to} "
                                 "out of range (follows must be below the id)")
            op, states = obj["operator_id"], obj["states"]
            if not isinstance(op, str) or not op:
                raise ValueError("operator_id must be a non-empty string")
            if not isinstance(states, dict) or not all(
                    isinstance(s, str) and s.isdigit() and len(s) <= 5 and int(s) <= 0xFFFF
                    and str(int(s)) == s for s in states):
                raise ValueError("states is not an object of state id -> metadata")
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptObjectError(key, offset, f"delta metadata is not DSTL's: {exc}") from exc
        for sid, m in states.items():
            check_state_meta(m, key=key, offset=offset, what=f"state {sid} of the delta metadata")
        return cls(kgs, mp, op, mat, follows, up_to, states)

    def raw_state_ids(self) -> frozenset[int]:
        """The internal raw states (their keys are not hashed to their key group)."""
        return frozenset(int(s) for s, m in self.states.items() if m.get("raw") is True)


# --------------------------------------------------------------------------- encoding


def encode_delta(meta: DeltaMeta, blocks: Iterable[tuple[int, Iterable[DeltaEntry]]], *,
                 zstd_level: int = 1, max_block_bytes: int | None = None) -> bytes:
    """Encode a delta object in memory (a delta holds what changed in one interval).

    Args:
        meta: the metadata.
        blocks: ``(key group, entries)`` in ascending key-group order, each block's entries
            strictly ascending by ``(state id, key, namespace)``; empty blocks are left out.

    Raises:
        UsageError: out-of-order key groups or entries, a state id or length out of range.
    """
    enc = SnapshotEncoder(meta.key_groups, meta.to_bytes(), zstd_level=zstd_level,
                          max_block_bytes=max_block_bytes, version=DELTA_VERSION)
    out = [enc.start()]
    for kg, entries in blocks:
        out.append(enc.add_key_group(kg, _ascending(kg, entries)))
    out.append(enc.finish())
    return b"".join(out)


def _ascending(kg: int, entries: Iterable[DeltaEntry]) -> Iterator[DeltaEntry]:
    previous: tuple[int, bytes, bytes] | None = None
    for e in entries:
        order = (e[0], e[1], e[2])
        if previous is not None and not previous < order:
            raise UsageError(f"delta entries of key group {kg} are not strictly ascending by "
                             f"(state id, key, namespace) at {order!r:.120}")
        previous = order
        yield e


# --------------------------------------------------------------------------- decoding


def _entries(content: bytes, entry: IndexEntry, key: str, meta: DeltaMeta,
             raw: frozenset[int]) -> Iterator[DeltaEntry]:
    """The entries of a verified block content, checked as they are reached."""
    end = len(content)
    pos = BLOCK_ENTRIES_OFFSET
    kg = entry.key_group
    mp = meta.max_parallelism
    states = meta.states
    previous: tuple[int, bytes, bytes] | None = None
    least, hsize = ENTRY_MIN_BYTES, ENTRY_HEAD.size
    for _ in range(entry.entry_count):
        if end - pos < least:
            break
        sid, klen = ENTRY_HEAD.unpack_from(content, pos)
        pos += hsize
        if end - pos < klen + 8:
            break
        k = content[pos:pos + klen]
        pos += klen
        (nlen,) = _U32.unpack_from(content, pos)
        pos += 4
        if end - pos < nlen + 4:
            break
        ns = content[pos:pos + nlen]
        pos += nlen
        (vlen,) = _U32.unpack_from(content, pos)
        pos += 4
        v: bytes | None
        if vlen == TOMBSTONE_LENGTH:
            v = None
        elif end - pos < vlen:
            break
        else:
            v = content[pos:pos + vlen]
            pos += vlen
        order = (sid, k, ns)
        if previous is not None and not previous < order:
            raise CorruptObjectError(key, entry.offset,
                                     f"block of key group {kg}: entries are not strictly "
                                     f"ascending by (state id, key, namespace) at content "
                                     f"byte {pos}")
        previous = order
        if str(sid) not in states:
            raise CorruptObjectError(key, entry.offset,
                                     f"block of key group {kg}: state id {sid} is not "
                                     "described by the delta's metadata")
        if sid not in raw and key_group_for(k, mp) != kg:
            raise CorruptObjectError(key, entry.offset,
                                     f"block of key group {kg}: key {k[:40]!r} belongs to key "
                                     f"group {key_group_for(k, mp)}")
        yield sid, k, ns, v
    else:
        if pos == end:
            return
    raise block_framing_error(key, entry, end, pos)


class DeltaReader:
    """Reads a delta object: its metadata, then chosen key groups only.

    With ``bytes`` the whole object is verified first (object crc included); with a
    :class:`~materializer.state_tables.RangeSource` it fetches the tail, the metadata block and
    only the blocks asked for, each verified by its own crc and checks.

    Raises (constructor):
        TruncatedObjectError, ChecksumMismatchError, UnsupportedFormatError (not a v3 object),
        CorruptObjectError: as named, naming ``key``.
    """

    def __init__(self, source: bytes | bytearray | memoryview | RangeSource, *,
                 key: str = "<delta>", max_block_bytes: int | None = None) -> None:
        self.key = key
        self._max = max_block_bytes
        if isinstance(source, (bytes, bytearray, memoryview)):
            verify_delta_object(source, key=key, max_block_bytes=max_block_bytes)
            source = BytesSource(bytes(source))
        self._source = source
        fmt = snapshot_format(max_block_bytes, DELTA_VERSION)
        size = source.size()
        tail_len = min(size, TAIL_READ_BYTES)
        tail = source.read(size - tail_len, tail_len)
        if len(tail) != tail_len:
            raise TruncatedObjectError(key, size - tail_len, tail_len, len(tail), "tail read")
        check_snapshot_header(source.read(0, min(size, HEADER_SIZE)), key=key,
                              version=DELTA_VERSION)
        footer = decode_footer(tail, size, key=key, fmt=fmt)
        start = footer.index_offset - (size - tail_len)
        index_bytes = (tail[start:len(tail) - FOOTER_SIZE] if start >= 0
                       else source.read(footer.index_offset, footer.index_length))
        self._index: SnapshotIndex = decode_index(index_bytes, footer, key=key)
        m = self._index.metadata
        raw_meta = decode_metadata_block(source.read(m.offset, m.length), m, key=key,
                                         max_block_bytes=max_block_bytes, version=DELTA_VERSION)
        self.metadata_offset = m.offset
        self.meta = DeltaMeta.from_bytes(raw_meta, key=key, offset=m.offset)
        if self._index.key_groups != self.meta.key_groups:
            raise CorruptObjectError(key, footer.index_offset,
                                     f"index covers key groups {self._index.key_groups}, the "
                                     f"metadata says {self.meta.key_groups}")
        self._raw = self.meta.raw_state_ids()

    @property
    def key_groups(self) -> KeyGroupRange:
        return self.meta.key_groups

    def block_key_groups(self) -> list[int]:
        """The key groups that have a block (entries), ascending."""
        return [b.key_group for b in self._index.blocks_for(None)]

    def read(self, key_groups: KeyGroupRange | None = None
             ) -> Iterator[tuple[int, int, Iterator[DeltaEntry]]]:
        """``(key group, block offset, entries)`` of the non-empty key groups in
        ``key_groups`` (default all), ascending; consume a block's entries before the next."""
        for b in self._index.blocks_for(key_groups):
            record = self._source.read(b.offset, b.length)
            content = block_content(record, b, key=self.key, max_block_bytes=self._max,
                                    version=DELTA_VERSION)
            del record
            yield b.key_group, b.offset, _entries(content, b, self.key, self.meta, self._raw)


def verify_delta_object(data: bytes | bytearray | memoryview, *, key: str = "<delta>",
                        max_block_bytes: int | None = None) -> None:
    """Integrity of a whole delta object without parsing its entries (a cache's check of a
    download): header (version 3), end magic, object crc, footer, index, every block record.

    Raises:
        CorruptObjectError and its subclasses, naming ``key`` and the offset.
    """
    verify_snapshot_object(data, key=key, max_block_bytes=max_block_bytes,
                           version=DELTA_VERSION)


def decode_delta(data: bytes | bytearray | memoryview, *, key: str = "<delta>",
                 max_block_bytes: int | None = None
                 ) -> tuple[DeltaMeta, dict[int, list[DeltaEntry]]]:
    """A whole delta, verified and decoded: its metadata and every block's entries.

    Raises:
        CorruptObjectError and its subclasses, naming ``key`` and the offset.
    """
    reader = DeltaReader(data, key=key, max_block_bytes=max_block_bytes)
    return reader.meta, {kg: list(entries) for kg, _, entries in reader.read()}
