"""Snapshot object format v1: bytes <-> values, no I/O (sans-I/O codec shared by both tables).

Theory of operation
-------------------
A materialized snapshot of a backend's state tables is one object::

    header (8) | metadata block | key-group block ... | index | footer (28)

* The header, the record framing and the trailer are the envelope all DSTL objects share with
  the log's segment format (:mod:`dstl.envelope`, which also verifies them): magic ``b"DSTL"``,
  u8 object kind (1 = log segment, 2 = snapshot), u8 format version (1), u16 flags (0; anything
  else is an :class:`~dstl.errors.UnsupportedFormatError`). Integers are big-endian; checksums are
  ``zlib.crc32``.
* Every block is a record ``u32 frame length | u32 crc32(frame) | zstd frame``; the frame carries
  its content size and zstd's content checksum. A block's content starts with ``u16 key group,
  u32 entry count`` so a block read on its own (ranged read) verifies itself and proves which key
  group it holds. The metadata block (key group ``0xFFFF``) comes first and holds opaque caller
  bytes (the states' descriptions); then one block per NON-EMPTY key group in ascending order,
  each holding the entries of every state in that key group::

      u16 state id | u32 key length | key | u32 namespace length | namespace |
      u32 value length | value

* The index lists the key-group range the snapshot covers (a key group in the range without a
  block is empty) and, per block, ``(key group, record offset, record length, entry count)``.
* The fixed-size footer at the very end locates the index and checks it on its own (for readers
  that fetch only the tail), repeats kind/version/flags, and ends with a crc32 over every byte
  before that field and the end magic ``b"LTSD"``.

A reader that has the whole object uses :func:`decode_snapshot` (verifies everything, the object
crc before any structure is parsed, and returns every entry) or :func:`verify_snapshot_object`
(the same checks but the entries' framing, one block at a time, keeping nothing: a cache
verifying a download; the entries are checked when they are read). A ranged
reader fetches the tail, :func:`decode_footer`, then the index bytes, :func:`decode_index`, then
only the blocks of its key groups, :func:`iter_block` / :func:`decode_block` (each verified by its
record crc, its zstd content checksum and its key-group field).

*Bounded memory.* A block's content is at most ``max_block_bytes`` decompressed (default
:data:`DEFAULT_MAX_SNAPSHOT_BLOCK_BYTES`, ``BackendOptions.max_snapshot_block_bytes``; the encoder
refuses a larger block, a decoder refuses a frame that declares or produces more), and
:func:`iter_block` yields a block's entries one at a time, so reading a crafted snapshot holds at
most one block's content at once, however many blocks its index lists. :class:`SnapshotEncoder` produces the object block by
block, so the heap table can release a key group's map snapshot right after encoding it.

Decoders raise only :class:`~dstl.errors.CorruptObjectError` and its subclasses
(:class:`~dstl.errors.ChecksumMismatchError`, :class:`~dstl.errors.TruncatedObjectError`,
:class:`~dstl.errors.UnsupportedFormatError`), naming the object key and byte offset. The base class
itself is used for structure that is wrong although its checksums match (a forged or buggy object).
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final

from dstl.envelope import (  # the envelope shared with segments
    END_MAGIC,
    FORMAT_VERSION,
    HEADER_SIZE,
    KIND_SEGMENT,
    KIND_SNAPSHOT,
    MAGIC,
    RECORD_HEADER_SIZE,
    ObjectFormat,
    check_end_magic,
    check_header,
    check_kind,
    check_min_size,
    check_object_crc,
    encode_header,
    encode_record,
    encode_trailer,
    open_record,
)
from dstl.errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    TruncatedObjectError,
    UsageError,
)
from dstl.keygroups import MAX_PARALLELISM_LIMIT, KeyGroupRange

__all__ = [
    "END_MAGIC",
    "FOOTER_SIZE",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "KIND_SEGMENT",
    "KIND_SNAPSHOT",
    "MAGIC",
    "DEFAULT_MAX_SNAPSHOT_BLOCK_BYTES",
    "MAX_BLOCK_CONTENT_BYTES",
    "MAX_STATE_ID",
    "METADATA_KEY_GROUP",
    "RECORD_HEADER_SIZE",
    "SNAPSHOT_FORMAT",
    "TAIL_READ_BYTES",
    "TOMBSTONE_LENGTH",
    "block_content",
    "check_snapshot_header",
    "IndexEntry",
    "SnapshotContents",
    "SnapshotEncoder",
    "SnapshotEntry",
    "SnapshotFooter",
    "SnapshotIndex",
    "decode_block",
    "decode_footer",
    "decode_index",
    "decode_metadata_block",
    "decode_snapshot",
    "encode_snapshot",
    "BLOCK_ENTRIES_OFFSET",
    "ENTRY_HEAD",
    "ENTRY_MIN_BYTES",
    "BlockEntries",
    "block_framing_error",
    "iter_block",
    "snapshot_format",
    "verify_snapshot_object",
]

#: Key group of the metadata block (real key groups are < 2**15).
METADATA_KEY_GROUP: Final = 0xFFFF
#: State ids are u16.
MAX_STATE_ID: Final = 0xFFFF
#: Upper bound of ``BackendOptions.max_snapshot_block_bytes`` (one key group's state beyond 1 GiB
#: is a sign of a too-small max parallelism).
MAX_BLOCK_CONTENT_BYTES: Final = 1 << 30
#: Default limit of one block's decompressed content: a forged or crafted frame cannot make a
#: reader allocate more (``BackendOptions.max_snapshot_block_bytes``).
DEFAULT_MAX_SNAPSHOT_BLOCK_BYTES: Final = 64 << 20
#: How much of the tail a ranged reader should fetch first: the footer plus, usually, the index.
TAIL_READ_BYTES: Final = 64 * 1024
#: What the shared envelope (:mod:`dstl.envelope`) expects of a snapshot (with the default limit;
#: :func:`snapshot_format` gives it with another).
SNAPSHOT_FORMAT: Final = ObjectFormat(
    KIND_SNAPSHOT, "snapshot", DEFAULT_MAX_SNAPSHOT_BLOCK_BYTES,
    "raise max_parallelism so key groups are smaller, or raise "
    "BackendOptions.max_snapshot_block_bytes", limit_option="BackendOptions.max_snapshot_block_bytes")

_BLOCK_PREFIX: Final = struct.Struct(">HI")        # key group, entry count
#: An entry's head (state id, key length); then the key, ``u32`` namespace length, namespace,
#: ``u32`` value length, value. Defined here only: the delta format and the bulk restore
#: (:mod:`materializer.replay`) parse entries with it.
ENTRY_HEAD: Final = struct.Struct(">HI")
#: The fewest bytes an entry takes: its head and its two length fields.
ENTRY_MIN_BYTES: Final = ENTRY_HEAD.size + 2 * 4
_U32: Final = struct.Struct(">I")
_INDEX_HEAD: Final = struct.Struct(">HHI")         # range start, range length, block count
_INDEX_ENTRY: Final = struct.Struct(">HQII")       # key group, offset, record length, entries
_FOOTER_HEAD: Final = struct.Struct(">QIIBBH")     # index off, index len, index crc, kind,
#                                                    version, flags; then the envelope's trailer
_FOOTER: Final = struct.Struct(">QIIBBHI4s")       # the same with the trailer (object crc, magic)
FOOTER_SIZE: Final = _FOOTER.size                  # 28

#: A delta's value length that marks a tombstone (the entry has no value bytes): no v1 value can
#: be this long (a block's content is at most :data:`MAX_BLOCK_CONTENT_BYTES`).
TOMBSTONE_LENGTH: Final = 0xFFFFFFFF
TOMBSTONE_BYTES: Final = _U32.pack(TOMBSTONE_LENGTH)

#: One decoded entry: ``(state id, key bytes, namespace bytes, value bytes)``.
SnapshotEntry = tuple[int, bytes, bytes, bytes]


def snapshot_format(max_block_bytes: int | None = None, version: int = FORMAT_VERSION
                    ) -> ObjectFormat:
    """:data:`SNAPSHOT_FORMAT` with another limit on a block's content (``None``: the default)
    and, for the delta format (:mod:`materializer.delta_format`), another version.

    Raises:
        UsageError: the limit is not an int in [1, :data:`MAX_BLOCK_CONTENT_BYTES`].
    """
    if max_block_bytes is not None and not (
            isinstance(max_block_bytes, int) and not isinstance(max_block_bytes, bool)
            and 1 <= max_block_bytes <= MAX_BLOCK_CONTENT_BYTES):
        raise UsageError(f"max_block_bytes={max_block_bytes!r} is not an int in "
                         f"[1, {MAX_BLOCK_CONTENT_BYTES}]")
    fmt = SNAPSHOT_FORMAT.with_limit(max_block_bytes)
    return fmt if version == fmt.version else dataclasses.replace(fmt, version=version)


@dataclass(frozen=True, slots=True)
class SnapshotFooter:
    """The fixed-size footer. ``object_size`` is the whole object's length."""

    index_offset: int
    index_length: int
    index_crc: int
    object_crc: int
    object_size: int


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """Where one block record lives: ``[offset, offset + length)`` of the object."""

    key_group: int       # METADATA_KEY_GROUP for the metadata block
    offset: int
    length: int          # record length, including the 8-byte record header
    entry_count: int


@dataclass(frozen=True, slots=True)
class SnapshotIndex:
    """The decoded index: the covered key-group range and the blocks."""

    key_groups: KeyGroupRange
    metadata: IndexEntry
    blocks: tuple[IndexEntry, ...]   # key-group blocks, ascending key group

    def blocks_for(self, key_groups: KeyGroupRange | None = None) -> list[IndexEntry]:
        """The blocks a reader of ``key_groups`` (default: all) must fetch."""
        if key_groups is None:
            return list(self.blocks)
        return [b for b in self.blocks if b.key_group in key_groups]


@dataclass(frozen=True, slots=True)
class SnapshotContents:
    """A whole decoded snapshot."""

    metadata: bytes
    key_groups: KeyGroupRange
    blocks: dict[int, list[SnapshotEntry]]   # non-empty key groups only

    def entries(self) -> Iterable[tuple[int, SnapshotEntry]]:
        """``(key group, entry)`` in object order."""
        for kg, entries in self.blocks.items():
            for e in entries:
                yield kg, e


# --------------------------------------------------------------------------- encoding


class SnapshotEncoder:
    """Streams a snapshot object: :meth:`start`, :meth:`add_key_group` per key group, :meth:`finish`.

    Each call returns the bytes to append to the object (pure: no I/O). Key groups must come in
    ascending order, each at most once, inside ``key_groups``.

    Args:
        key_groups: the range the snapshot covers (recorded in the index).
        metadata: opaque bytes describing the states (e.g. JSON), stored in the metadata block.
        zstd_level: compression level of every block (1: fast, ratio close to 3; see DstlOptions).
        max_block_bytes: the limit on a block's content (readers must use at least the same).
        version: the format version (1; :data:`materializer.delta_format.DELTA_VERSION` for a
            delta, whose entries may be tombstones: a value of ``None``).
    """

    def __init__(self, key_groups: KeyGroupRange, metadata: bytes = b"", *,
                 zstd_level: int = 1, max_block_bytes: int | None = None,
                 version: int = FORMAT_VERSION) -> None:
        self._fmt = snapshot_format(max_block_bytes, version)
        if not isinstance(metadata, (bytes, bytearray, memoryview)):
            raise UsageError(f"snapshot metadata must be bytes, got {type(metadata).__name__}")
        self._key_groups = key_groups
        self._metadata = bytes(metadata)
        self._zstd_level = zstd_level
        self._offset = 0
        self._crc = 0
        self._index: list[IndexEntry] = []
        self._last_key_group = -1
        self._state = "new"
        self.entries_written = 0

    @property
    def bytes_written(self) -> int:
        """Bytes returned so far."""
        return self._offset

    def _emit(self, data: bytes) -> bytes:
        self._crc = zlib.crc32(data, self._crc)
        self._offset += len(data)
        return data

    def _record(self, content: bytes, what: str) -> bytes:
        return encode_record(content, self._fmt, zstd_level=self._zstd_level, what=what)

    def start(self) -> bytes:
        """The header and the metadata block."""
        if self._state != "new":
            raise UsageError("SnapshotEncoder.start() called twice")
        self._state = "blocks"
        header = encode_header(self._fmt)
        record = self._record(_BLOCK_PREFIX.pack(METADATA_KEY_GROUP, 0) + self._metadata,
                              "the metadata block")
        self._index.append(IndexEntry(METADATA_KEY_GROUP, HEADER_SIZE, len(record), 0))
        return self._emit(header + record)

    def add_key_group(self, key_group: int,
                      entries: Iterable[tuple[int, bytes, bytes, bytes | None]]) -> bytes:
        """Encode one key group's entries (all states) as a block; ``b""`` if there are none.

        Raises:
            UsageError: out of order, outside the range, a state id outside u16, non-bytes.
        """
        if self._state != "blocks":
            raise UsageError("SnapshotEncoder.add_key_group() needs start() first and no "
                             "finish() yet")
        if key_group not in self._key_groups or key_group <= self._last_key_group:
            raise UsageError(f"key group {key_group} is outside {self._key_groups} or not after "
                             f"{self._last_key_group} (blocks go in ascending key-group order)")
        self._last_key_group = key_group
        parts: list[bytes] = [b""]
        append = parts.append
        head = ENTRY_HEAD.pack
        u32 = _U32.pack
        count = 0
        tombstones = self._fmt.version != FORMAT_VERSION
        try:
            for state_id, key, namespace, value in entries:
                append(head(state_id, len(key)))
                append(key)
                append(u32(len(namespace)))
                append(namespace)
                if value is None:
                    if not tombstones:
                        raise UsageError(f"snapshot entry in key group {key_group} has no "
                                         "value (only a delta holds tombstones)")
                    append(TOMBSTONE_BYTES)
                    count += 1
                    continue
                append(u32(len(value)))
                append(value)
                count += 1
        except struct.error as exc:
            raise UsageError(f"snapshot entry in key group {key_group}: state id must be in "
                             f"[0, {MAX_STATE_ID}] and lengths < 4 GiB ({exc})") from exc
        except TypeError as exc:
            raise UsageError(f"snapshot entries of key group {key_group} must be bytes "
                             f"(pass an encoder for heap states): {exc}") from exc
        if count == 0:
            return b""
        parts[0] = _BLOCK_PREFIX.pack(key_group, count)
        try:
            content = b"".join(parts)
        except TypeError as exc:
            raise UsageError(f"snapshot entries of key group {key_group} must be bytes "
                             f"(encode states first): {exc}") from exc
        record = self._record(content, f"key group {key_group}")
        self._index.append(IndexEntry(key_group, self._offset, len(record), count))
        self.entries_written += count
        return self._emit(record)

    def finish(self) -> bytes:
        """The index and the footer; the object is complete after these bytes."""
        if self._state != "blocks":
            raise UsageError("SnapshotEncoder.finish() needs start() first and only once")
        self._state = "done"
        kgs = self._key_groups
        parts = [_INDEX_HEAD.pack(kgs.start, len(kgs), len(self._index))]
        parts.extend(_INDEX_ENTRY.pack(e.key_group, e.offset, e.length, e.entry_count)
                     for e in self._index)
        index = b"".join(parts)
        index_offset = self._offset
        self._emit(index)
        footer_head = _FOOTER_HEAD.pack(index_offset, len(index), zlib.crc32(index),
                                        self._fmt.kind, self._fmt.version, 0)
        self._emit(footer_head)
        tail = encode_trailer(self._crc)
        self._offset += len(tail)
        return index + footer_head + tail


def encode_snapshot(key_groups: KeyGroupRange, metadata: bytes,
                    blocks: Iterable[tuple[int, Iterable[SnapshotEntry]]], *,
                    zstd_level: int = 1, max_block_bytes: int | None = None) -> bytes:
    """Encode a whole snapshot in memory (tests, small states). ``blocks``: ascending key groups."""
    enc = SnapshotEncoder(key_groups, metadata, zstd_level=zstd_level,
                          max_block_bytes=max_block_bytes)
    out = [enc.start()]
    out.extend(enc.add_key_group(kg, entries) for kg, entries in blocks)
    out.append(enc.finish())
    return b"".join(out)


# --------------------------------------------------------------------------- decoding


def decode_footer(tail: bytes | memoryview, object_size: int, *,
                  key: str = "<snapshot>", fmt: ObjectFormat = SNAPSHOT_FORMAT) -> SnapshotFooter:
    """Decode the footer from the last ``len(tail)`` bytes of an object of ``object_size`` bytes.

    Does not verify the object crc (that needs the whole object; see :func:`decode_snapshot`).

    Raises:
        TruncatedObjectError: too short, or the end magic is missing.
        UnsupportedFormatError: not a v1 snapshot.
        CorruptObjectError: the index location is impossible.
    """
    check_min_size(object_size, HEADER_SIZE + FOOTER_SIZE, key, fmt)
    if len(tail) < FOOTER_SIZE:
        raise TruncatedObjectError(key, object_size - len(tail), FOOTER_SIZE, len(tail),
                                   "snapshot footer (the tail read is shorter than the footer)")
    check_end_magic(tail, object_size, key, fmt)
    at = object_size - FOOTER_SIZE
    (index_offset, index_length, index_crc, kind, version, flags, object_crc,
     _end_magic) = _FOOTER.unpack_from(tail, len(tail) - FOOTER_SIZE)
    check_kind(key, at + 16, fmt, kind, version, flags)
    if index_offset < HEADER_SIZE or index_offset + index_length != at:
        raise CorruptObjectError(key, at, f"footer places the index at [{index_offset}, "
                                          f"{index_offset + index_length}), but it must end "
                                          f"at the footer ({at})")
    return SnapshotFooter(index_offset, index_length, index_crc, object_crc, object_size)


def decode_index(index: bytes | memoryview, footer: SnapshotFooter, *,
                 key: str = "<snapshot>") -> SnapshotIndex:
    """Decode and verify the index bytes ``[footer.index_offset, + footer.index_length)``.

    Raises:
        TruncatedObjectError, ChecksumMismatchError, CorruptObjectError: as named.
    """
    at = footer.index_offset
    if len(index) != footer.index_length:
        raise TruncatedObjectError(key, at, footer.index_length, len(index), "snapshot index")
    got = zlib.crc32(index)
    if got != footer.index_crc:
        raise ChecksumMismatchError(key, at, "snapshot index", footer.index_crc, got)
    if len(index) < _INDEX_HEAD.size:
        raise TruncatedObjectError(key, at, _INDEX_HEAD.size, len(index), "snapshot index")
    start, count_kg, n = _INDEX_HEAD.unpack_from(index, 0)
    if len(index) != _INDEX_HEAD.size + n * _INDEX_ENTRY.size or n < 1:
        raise CorruptObjectError(key, at, f"index of {len(index)} bytes cannot hold {n} entries")
    if start + count_kg > MAX_PARALLELISM_LIMIT:
        raise CorruptObjectError(key, at, f"index key-group range start={start} "
                                          f"length={count_kg} exceeds {MAX_PARALLELISM_LIMIT}")
    kgs = KeyGroupRange(start, start + count_kg - 1)
    entries = [IndexEntry(*_INDEX_ENTRY.unpack_from(index, _INDEX_HEAD.size + i * _INDEX_ENTRY.size))
               for i in range(n)]
    _check_index_entries(entries, kgs, footer, key)
    return SnapshotIndex(kgs, entries[0], tuple(entries[1:]))


def _check_index_entries(entries: list[IndexEntry], kgs: KeyGroupRange, footer: SnapshotFooter,
                         key: str) -> None:
    """The metadata block first, then key groups inside ``kgs`` ascending; records contiguous
    from the header to the index."""
    expected_offset = HEADER_SIZE
    previous_kg = -1
    for i, e in enumerate(entries):
        where = footer.index_offset + _INDEX_HEAD.size + i * _INDEX_ENTRY.size
        if i == 0:
            if e.key_group != METADATA_KEY_GROUP:
                raise CorruptObjectError(key, where, "first index entry is not the metadata block")
        elif e.key_group not in kgs or e.key_group <= previous_kg:
            raise CorruptObjectError(key, where, f"index entry {i}: key group {e.key_group} is "
                                                 f"outside {kgs} or out of order")
        if e.offset != expected_offset or e.length < RECORD_HEADER_SIZE:
            raise CorruptObjectError(key, where, f"index entry {i}: block at offset {e.offset} "
                                                 f"length {e.length}, expected offset "
                                                 f"{expected_offset} and length >= "
                                                 f"{RECORD_HEADER_SIZE}")
        expected_offset = e.offset + e.length
        if i:
            previous_kg = e.key_group
    if expected_offset != footer.index_offset:
        raise CorruptObjectError(key, footer.index_offset,
                                 f"blocks end at {expected_offset}, index starts at "
                                 f"{footer.index_offset}")


def _block_content(record: bytes | memoryview, entry: IndexEntry, key: str,
                   fmt: ObjectFormat) -> bytes:
    at = entry.offset
    what = ("metadata block" if entry.key_group == METADATA_KEY_GROUP
            else f"block of key group {entry.key_group}")
    content = open_record(record, key=key, offset=at, fmt=fmt, what=what,
                          expected_length=entry.length)
    if len(content) < _BLOCK_PREFIX.size:
        raise TruncatedObjectError(key, at, _BLOCK_PREFIX.size, len(content), "block content")
    kg, count = _BLOCK_PREFIX.unpack_from(content, 0)
    if kg != entry.key_group or count != entry.entry_count:
        raise CorruptObjectError(key, at, f"block holds key group {kg} with {count} entries, "
                                          f"index says key group {entry.key_group} with "
                                          f"{entry.entry_count}")
    return content


def decode_metadata_block(record: bytes | memoryview, entry: IndexEntry, *,
                          key: str = "<snapshot>", max_block_bytes: int | None = None,
                          version: int = FORMAT_VERSION) -> bytes:
    """The caller's metadata bytes from the metadata block record."""
    if entry.key_group != METADATA_KEY_GROUP:
        raise UsageError(f"index entry {entry} is not the metadata block")
    return _block_content(record, entry, key, snapshot_format(max_block_bytes, version))[
        _BLOCK_PREFIX.size:]


def check_snapshot_header(head: bytes | memoryview, *, key: str = "<snapshot>",
                          version: int = FORMAT_VERSION) -> None:
    """Check an object's first 8 bytes: magic, kind 2, ``version``, flags 0 (a ranged reader
    checks them before it trusts the footer).

    Raises:
        TruncatedObjectError, UnsupportedFormatError: naming ``key`` and the offset.
    """
    check_header(head, key, snapshot_format(None, version))


def block_content(record: bytes | memoryview, entry: IndexEntry, *, key: str = "<snapshot>",
                  max_block_bytes: int | None = None, version: int = FORMAT_VERSION) -> bytes:
    """A key-group block's verified content (record length, CRC, zstd frame within the limit,
    key group and entry count), prefix included: what a format with its own entry rules (the
    delta's) parses from :data:`BLOCK_ENTRIES_OFFSET`."""
    return _block_content(record, entry, key, snapshot_format(max_block_bytes, version))


def iter_block(record: bytes | memoryview, entry: IndexEntry, *, key: str = "<snapshot>",
               max_block_bytes: int | None = None) -> Iterator[SnapshotEntry]:
    """Decode one key group's block record (the bytes ``[entry.offset, + entry.length)``),
    yielding its entries ``(state id, key, namespace, value)`` one at a time, in stored order.

    The record is verified (length, CRC, zstd frame, key group and count) before the first entry
    is yielded; the entries' framing as they are reached, so entries before a malformed one may
    have been yielded when the error is raised (a restore fails as a whole then).

    Raises:
        TruncatedObjectError, ChecksumMismatchError, CorruptObjectError: as named; offsets are
        object offsets (the reason names the position inside the decompressed content).
    """
    content = _block_content(record, entry, key, snapshot_format(max_block_bytes))
    return BlockEntries(content, entry, key)


class BlockEntries:
    """The entries of one verified block (what :func:`iter_block` returns): an iterator of
    ``(state id, key, namespace, value)``. A bulk loader may instead parse ``content`` (the
    block's decompressed content, prefix included) itself before iterating
    (:mod:`materializer.replay`), with the same framing checks and
    :func:`block_framing_error`."""

    __slots__ = ("_it", "content", "entry", "key")

    def __init__(self, content: bytes, entry: IndexEntry, key: str) -> None:
        self.content = content
        self.entry = entry
        self.key = key
        self._it: Iterator[SnapshotEntry] | None = None

    @property
    def started(self) -> bool:
        """Iteration has begun (``content`` may then be partly consumed by it)."""
        return self._it is not None

    def __iter__(self) -> BlockEntries:
        return self

    def __next__(self) -> SnapshotEntry:
        if self._it is None:
            self._it = _entries(self.content, self.entry, self.key)
        return next(self._it)


#: Where a block's entries start in its content (after ``u16 key group, u32 entry count``).
BLOCK_ENTRIES_OFFSET: Final = 6


def block_framing_error(key: str, entry: IndexEntry, end: int, pos: int) -> CorruptObjectError:
    """The error of a block whose entries do not fill its ``end`` content bytes exactly
    (stopped at content byte ``pos``)."""
    return CorruptObjectError(key, entry.offset,
                              f"block of key group {entry.key_group}: {entry.entry_count} "
                              f"entries do not fill its {end} content bytes exactly "
                              f"(stopped at content byte {pos})")


def _entries(content: bytes, entry: IndexEntry, key: str) -> Iterator[SnapshotEntry]:
    end = len(content)
    pos = _BLOCK_PREFIX.size
    head = ENTRY_HEAD.unpack_from
    u32 = _U32.unpack_from
    least, hsize = ENTRY_MIN_BYTES, ENTRY_HEAD.size
    for _ in range(entry.entry_count):
        # the lengths at least; each length is checked before its bytes are sliced.
        if end - pos < least:
            break
        state_id, klen = head(content, pos)
        pos += hsize
        if end - pos < klen + 8:
            break
        k = content[pos:pos + klen]
        pos += klen
        (nlen,) = u32(content, pos)
        pos += 4
        if end - pos < nlen + 4:
            break
        ns = content[pos:pos + nlen]
        pos += nlen
        (vlen,) = u32(content, pos)
        pos += 4
        if end - pos < vlen:
            break
        v = content[pos:pos + vlen]
        pos += vlen
        yield state_id, k, ns, v
    else:
        if pos == end:
            return
    raise block_framing_error(key, entry, end, pos)


def decode_block(record: bytes | memoryview, entry: IndexEntry, *,
                 key: str = "<snapshot>", max_block_bytes: int | None = None
                 ) -> list[SnapshotEntry]:
    """:func:`iter_block` as a list (the whole block verified before it is returned)."""
    return list(iter_block(record, entry, key=key, max_block_bytes=max_block_bytes))


def _verified_index(view: memoryview, key: str, fmt: ObjectFormat) -> SnapshotIndex:
    """Header, size, end magic, the object crc (before any structure is parsed), footer,
    index."""
    size = len(view)
    check_header(view, key, fmt)
    check_min_size(size, HEADER_SIZE + FOOTER_SIZE, key, fmt)
    check_end_magic(view, size, key, fmt)
    check_object_crc(view, key, fmt)
    footer = decode_footer(view[size - FOOTER_SIZE:], size, key=key, fmt=fmt)
    return decode_index(view[footer.index_offset:footer.index_offset + footer.index_length],
                        footer, key=key)


def decode_snapshot(data: bytes | bytearray | memoryview, *, key: str = "<snapshot>",
                    max_block_bytes: int | None = None) -> SnapshotContents:
    """Decode and verify a whole snapshot object, keeping every entry.

    Verifies, in order: header, size and end magic, the object crc (before any structure is
    parsed), the footer, the index, every block.

    Raises:
        TruncatedObjectError, ChecksumMismatchError, UnsupportedFormatError, CorruptObjectError.
    """
    view = memoryview(data)
    fmt = snapshot_format(max_block_bytes)
    index = _verified_index(view, key, fmt)
    m = index.metadata
    metadata = _block_content(view[m.offset:m.offset + m.length], m, key, fmt)[
        _BLOCK_PREFIX.size:]
    blocks = {b.key_group: list(_entries(_block_content(view[b.offset:b.offset + b.length], b,
                                                        key, fmt), b, key))
              for b in index.blocks}
    return SnapshotContents(metadata, index.key_groups, blocks)


def verify_snapshot_object(data: bytes | bytearray | memoryview, *, key: str = "<snapshot>",
                           max_block_bytes: int | None = None,
                           version: int = FORMAT_VERSION) -> None:
    """Verify a whole snapshot object's integrity without parsing its entries, one block at a
    time, keeping nothing (at most one block's content is held at once): header, end magic, the
    object crc, footer, index, and per block its record (length, crc, zstd frame within the
    block limit, zstd's content checksum) and its key group and entry count.

    The entries' own framing is not walked here (that was a second full parse of every entry,
    about as costly as loading them); whoever reads the entries checks it as it goes
    (:func:`iter_block`), so a crafted object whose checksums match but whose entries do not
    fill their block still fails — typed, naming the object — when it is loaded.

    Raises:
        TruncatedObjectError, ChecksumMismatchError, UnsupportedFormatError, CorruptObjectError.
    """
    view = memoryview(data)
    fmt = snapshot_format(max_block_bytes, version)
    index = _verified_index(view, key, fmt)
    for b in (index.metadata, *index.blocks):
        content = _block_content(view[b.offset:b.offset + b.length], b, key, fmt)
        del content
