"""Segment format v1: bytes <-> change sets. Pure: no I/O, no threads, no clock.

Theory of operation
-------------------
A *segment* is one uploaded object holding the change sets of many writers of one process.
Every change set is its own *record*: a zstd frame (with zstd's content checksum) preceded by its
length and a CRC-32 of the frame bytes, so a handle ``(segment key, offset, length)`` can fetch and
verify exactly one change set with a ranged read, without touching the rest of the object. The
decompressed record body starts with the writer's log id and the sqn, so a handle that points at the
wrong record is detected too. A trailer index (log id, sqn, key-group range, offset, length, change
count) and a footer with a CRC-32 over the whole object make the object self-describing and let a
whole-object read verify every byte.

The header, the record framing (length, CRC-32, zstd frame) and the trailer (object CRC, end
magic) are the envelope every DSTL object shares, in :mod:`dstl.envelope`; this module adds the
record body, the trailer index and the footer fields before the trailer.

Layout (all integers big-endian; byte tables in ``docs/format.md``)::

    header   "DSTL" | u8 kind=1 | u8 version=1 | u16 flags=0                       8 bytes
    record*  u32 frame_len | u32 crc32(frame) | frame                         8 + frame_len
             frame = zstd( u16 log_id_len | log_id | u64 sqn | u32 n_blocks | block* )
             block = i32 key_group | u32 block_len | ( u32 len | payload )*
             (blocks in ascending key-group order, so the metadata key group -1 comes first;
              changes of one key group keep their append order)
    index    u32 n | n * ( u16 log_id_len | log_id | u64 sqn | i32 kg_min | i32 kg_max |
                           u64 offset | u64 length | u32 change_count | u64 payload_bytes )
    footer   u64 index_offset | u32 index_len | u32 n | u32 crc32(bytes[0:-8]) | "LTSD"  24 bytes

Invariants the decoders enforce (and raise only :class:`~dstl.errors.CorruptObjectError`
subclasses naming the object and the offset otherwise): magic, kind, version and flags are known;
the footer's CRC covers every byte before it, so any single-bit flip or truncation of a segment is
detected when it is read whole; a record's CRC covers its frame, so a flipped bit inside a ranged
read is detected too; decompression happens only after the CRC matched (so a damaged size field can
never trigger a huge allocation); the record's log id and sqn equal what the handle expects.
Semantic checks on top (a log never holds what its writer refuses to append): one segment holds a
change set ``(log id, sqn)`` at most once (the scheduler starts a new segment rather than repeat
one); every block of a record lies in its index entry's ``[kg_min, kg_max]``; and a reader that
knows the writer's key-group range (the handle's) refuses a change outside it.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from dstl.envelope import (
    END_MAGIC,
    FORMAT_VERSION,
    HEADER_SIZE,
    KIND_SEGMENT,
    MAGIC,
    RECORD_HEADER_SIZE,
    ObjectFormat,
    check_end_magic,
    check_header,
    check_min_size,
    check_object_crc,
    encode_header,
    encode_record,
    encode_trailer,
    open_record,
)
from dstl.errors import CorruptObjectError, TruncatedObjectError, UsageError

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "FOOTER_SIZE",
    "KIND_SEGMENT",
    "MAGIC",
    "END_MAGIC",
    "RECORD_HEADER_SIZE",
    "BLOCK_HEAD_BYTES",
    "BODY_HEAD_BYTES",
    "DEFAULT_MAX_CHANGE_SET_BYTES",
    "MAX_CHANGE_SET_BYTES",
    "SEGMENT_FORMAT",
    "ChangeSet",
    "IndexEntry",
    "SegmentContents",
    "body_blocks",
    "build_change_set",
    "decode_record",
    "decode_segment",
    "encode_segment",
    "iter_body_changes",
    "segment_format",
]

FOOTER_SIZE: Final = 24
#: The largest change-set body (decompressed record content) any reader accepts, whatever its
#: options say: the upper bound of ``DstlOptions.max_change_set_bytes``.
MAX_CHANGE_SET_BYTES: Final = 1 << 31
#: The default limit on a change-set body (``DstlOptions.max_change_set_bytes``): a reader never
#: decompresses more for one record, however small and however crafted the segment (a zstd frame
#: can expand 30,000 times), and the writer rolls a change set over before it grows past it.
DEFAULT_MAX_CHANGE_SET_BYTES: Final = 32 << 20
#: What the shared envelope (:mod:`dstl.envelope`) expects of a segment (with the default limit;
#: :func:`segment_format` gives it with another).
SEGMENT_FORMAT: Final = ObjectFormat(
    KIND_SEGMENT, "segment", DEFAULT_MAX_CHANGE_SET_BYTES,
    "keep single state values below it, or raise DstlOptions.max_change_set_bytes",
    limit_option="DstlOptions.max_change_set_bytes")
#: Body bytes of a change set besides its blocks: u16 log id length, u64 sqn, u32 block count.
BODY_HEAD_BYTES: Final = 14
#: Bytes of one block header in a body (i32 key group, u32 block length).
BLOCK_HEAD_BYTES: Final = 8

_BODY_HEAD_SQN = struct.Struct(">QI")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_BLOCK = struct.Struct(">iI")
_INDEX_FIXED = struct.Struct(">QiiQQIQ")
_FOOTER_HEAD = struct.Struct(">QII")

#: Frame-length prefix of one change inside a block (exported for the writer's hot path).
CHANGE_LEN: Final = _U32


def segment_format(max_change_set_bytes: int | None = None) -> ObjectFormat:
    """:data:`SEGMENT_FORMAT` with another limit on a change-set body (``None``: the default).

    Raises:
        UsageError: the limit is not an int in [1, :data:`MAX_CHANGE_SET_BYTES`].
    """
    if max_change_set_bytes is not None and not (
            isinstance(max_change_set_bytes, int) and not isinstance(max_change_set_bytes, bool)
            and 1 <= max_change_set_bytes <= MAX_CHANGE_SET_BYTES):
        raise UsageError(f"max_change_set_bytes={max_change_set_bytes!r} is not an int in "
                         f"[1, {MAX_CHANGE_SET_BYTES}]")
    return SEGMENT_FORMAT.with_limit(max_change_set_bytes)


@dataclass(frozen=True, slots=True)
class ChangeSet:
    """A writer's frozen change set, ready to be written into a segment.

    Attributes:
        log_id: the writer's log id.
        sqn: the change set's sequence number.
        body: the uncompressed record body (see module docstring).
        change_count: number of changes.
        payload_bytes: sum of the payload lengths (Flink's "size" of a change set).
        kg_min, kg_max: smallest and largest key group present (-1 = metadata).
    """

    log_id: str
    sqn: int
    body: bytes
    change_count: int
    payload_bytes: int
    kg_min: int
    kg_max: int

    @property
    def size(self) -> int:
        """Bytes this change set holds in memory (what back-pressure counts)."""
        return len(self.body)


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One change set's entry in a segment's trailer index."""

    log_id: str
    sqn: int
    kg_min: int
    kg_max: int
    offset: int
    length: int
    change_count: int
    payload_bytes: int


def build_change_set(log_id: str, sqn: int, blocks: Mapping[int, bytes | bytearray],
                     change_count: int, payload_bytes: int) -> ChangeSet:
    """Freeze a writer's active blocks into a :class:`ChangeSet`.

    Args:
        log_id: writer log id (UTF-8 encodable, at most 65535 bytes).
        sqn: sequence number, ``>= 0``.
        blocks: key group -> concatenated ``u32 len | payload`` changes of that key group.
        change_count: total changes in ``blocks``.
        payload_bytes: total payload bytes in ``blocks``.
    """
    lid = log_id.encode("utf-8")
    if len(lid) > 0xFFFF:
        raise UsageError(f"log id of {len(lid)} bytes is too long (max 65535)")
    kgs = sorted(blocks)
    parts: list[bytes | bytearray] = [_U16.pack(len(lid)), lid, _BODY_HEAD_SQN.pack(sqn, len(kgs))]
    for kg in kgs:
        buf = blocks[kg]
        parts.append(_BLOCK.pack(kg, len(buf)))
        parts.append(buf)
    return ChangeSet(log_id, sqn, b"".join(parts), change_count, payload_bytes,
                     kgs[0] if kgs else 0, kgs[-1] if kgs else -1)


def encode_segment(change_sets: Sequence[ChangeSet], zstd_level: int = 1, *,
                   max_change_set_bytes: int | None = None) -> tuple[bytes, list[IndexEntry]]:
    """Encode change sets (of any writers) into one segment.

    Args:
        change_sets: at least one.
        zstd_level: compression level.
        max_change_set_bytes: the limit on one body (default
            :data:`DEFAULT_MAX_CHANGE_SET_BYTES`; readers must use at least the same).

    Returns:
        The segment bytes and one :class:`IndexEntry` per change set, in input order; an entry's
        ``(offset, length)`` is what a handle needs for a ranged read.

    Raises:
        UsageError: no change sets (DSTL never writes empty objects), or a change set above
            the limit (the decoder would refuse it).
    """
    if not change_sets:
        raise UsageError("refusing to encode an empty segment (no change sets)")
    ids = {(cs.log_id, cs.sqn) for cs in change_sets}
    if len(ids) != len(change_sets):
        dup = next(cs for i, cs in enumerate(change_sets)
                   if (cs.log_id, cs.sqn) in {(c.log_id, c.sqn) for c in change_sets[:i]})
        raise UsageError(f"refusing to encode change set ({dup.log_id!r}, sqn {dup.sqn}) twice "
                         "into one segment (a reader could not tell them apart); upload it in "
                         "another segment")
    fmt = segment_format(max_change_set_bytes)
    parts: list[bytes] = [encode_header(fmt)]
    entries: list[IndexEntry] = []
    pos = HEADER_SIZE
    for cs in change_sets:
        record = encode_record(cs.body, fmt, zstd_level=zstd_level,
                               what=f"change set ({cs.log_id!r}, sqn {cs.sqn})")
        parts.append(record)
        entries.append(IndexEntry(cs.log_id, cs.sqn, cs.kg_min, cs.kg_max, pos, len(record),
                                  cs.change_count, cs.payload_bytes))
        pos += len(record)
    index = _encode_index(entries)
    parts.append(index)
    parts.append(_FOOTER_HEAD.pack(pos, len(index), len(entries)))
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    parts.append(encode_trailer(crc))
    return b"".join(parts), entries


def _encode_index(entries: Sequence[IndexEntry]) -> bytes:
    parts = [_U32.pack(len(entries))]
    for e in entries:
        lid = e.log_id.encode("utf-8")
        parts.append(_U16.pack(len(lid)))
        parts.append(lid)
        parts.append(_INDEX_FIXED.pack(e.sqn, e.kg_min, e.kg_max, e.offset, e.length,
                                       e.change_count, e.payload_bytes))
    return b"".join(parts)


# --------------------------------------------------------------------------- decoding


@dataclass(frozen=True, slots=True)
class SegmentContents:
    """A decoded, fully verified segment: its index entries in file order."""

    key: str
    entries: tuple[IndexEntry, ...]
    size: int


def decode_segment(data: bytes | memoryview, key: str = "<segment>", *,
                   max_change_set_bytes: int | None = None) -> SegmentContents:
    """Verify a whole segment (header, object CRC, footer, index, every record) and return its
    index. The object CRC is checked before any structure is parsed; records are opened one at a
    time (at most one body, of at most ``max_change_set_bytes``, is held at once).

    Raises:
        CorruptObjectError: (or a subclass) naming ``key`` and the offset of the first problem.
    """
    fmt = segment_format(max_change_set_bytes)
    mv = memoryview(data)
    n = len(mv)
    check_header(mv, key, fmt)
    check_min_size(n, HEADER_SIZE + FOOTER_SIZE, key, fmt)
    check_end_magic(mv, n, key, fmt)
    check_object_crc(mv, key, fmt)
    foot = n - FOOTER_SIZE
    index_offset, index_len, count = _FOOTER_HEAD.unpack_from(mv, foot)
    if index_offset < HEADER_SIZE or index_offset + index_len != foot:
        raise CorruptObjectError(key, foot, f"index at {index_offset}+{index_len} does not end at "
                                            f"the footer ({foot})")
    entries = _decode_index(mv, index_offset, foot, count, key)
    _check_unique(entries, key)
    pos = HEADER_SIZE
    for e in entries:
        if e.offset != pos:
            raise CorruptObjectError(key, e.offset, f"index entry for sqn {e.sqn} points at "
                                                    f"{e.offset}, expected {pos}")
        body = _open_change_set(mv[e.offset:e.offset + e.length], key, e.offset, fmt,
                                e.length)
        head_end = _check_body_identity(body, key, e.offset, e.log_id, e.sqn)
        _check_blocks_in_range(body, head_end, e, key)
        del body  # before the next record is opened: one body at a time
        pos += e.length
    if pos != index_offset:
        raise CorruptObjectError(key, pos, f"records end at {pos} but the index starts at "
                                           f"{index_offset}")
    return SegmentContents(key, tuple(entries), n)


def _check_unique(entries: Sequence[IndexEntry], key: str) -> None:
    """A change set appears once per segment (two records of one ``(log id, sqn)`` would make
    every handle naming it ambiguous)."""
    seen: set[tuple[str, int]] = set()
    for e in entries:
        if (e.log_id, e.sqn) in seen:
            raise CorruptObjectError(key, e.offset, f"the index names change set ({e.log_id!r}, "
                                                    f"sqn {e.sqn}) twice")
        seen.add((e.log_id, e.sqn))


def _check_blocks_in_range(body: bytes, pos: int, e: IndexEntry, key: str) -> None:
    """Every key-group block of a record lies in its index entry's ``[kg_min, kg_max]``."""
    end = len(body)
    (n_blocks,) = _U32.unpack_from(body, pos - 4)
    for _ in range(n_blocks):
        if end - pos < _BLOCK.size:
            raise TruncatedObjectError(key, e.offset, pos + _BLOCK.size, end, "block header")
        kg, blen = _BLOCK.unpack_from(body, pos)
        if not e.kg_min <= kg <= e.kg_max:
            raise CorruptObjectError(key, e.offset, f"change set ({e.log_id!r}, sqn {e.sqn}) "
                                                    f"holds key group {kg}, outside its indexed "
                                                    f"range [{e.kg_min}, {e.kg_max}]")
        pos += _BLOCK.size + blen


def _decode_index(mv: memoryview, start: int, end: int, count: int, key: str
                  ) -> list[IndexEntry]:
    pos = start
    (n,) = _U32.unpack_from(mv, pos) if end - pos >= 4 else (None,)
    if n is None or n != count:
        raise CorruptObjectError(key, pos, f"index count {n} does not match footer count {count}")
    pos += 4
    if n * (2 + _INDEX_FIXED.size) > end - pos:
        raise TruncatedObjectError(key, pos, n * (2 + _INDEX_FIXED.size), end - pos,
                                   f"index of {n} entries")
    entries: list[IndexEntry] = []
    for _ in range(n):
        if end - pos < 2:
            raise TruncatedObjectError(key, pos, 2, end - pos, "index entry")
        (lid_len,) = _U16.unpack_from(mv, pos)
        pos += 2
        if end - pos < lid_len + _INDEX_FIXED.size:
            raise TruncatedObjectError(key, pos, lid_len + _INDEX_FIXED.size, end - pos,
                                       "index entry")
        try:
            log_id = bytes(mv[pos:pos + lid_len]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorruptObjectError(key, pos, "log id is not UTF-8") from exc
        pos += lid_len
        sqn, kg_min, kg_max, off, length, cc, pb = _INDEX_FIXED.unpack_from(mv, pos)
        pos += _INDEX_FIXED.size
        entries.append(IndexEntry(log_id, sqn, kg_min, kg_max, off, length, cc, pb))
    if pos != end:
        raise CorruptObjectError(key, pos, f"{end - pos} unexpected bytes after the index")
    return entries


def _open_change_set(record: bytes | memoryview, key: str, offset: int, fmt: ObjectFormat,
                     expected_length: int | None = None) -> bytes:
    """Check a record's length and CRC, then decompress it (see :func:`dstl.envelope.open_record`)."""
    return open_record(record, key=key, offset=offset, fmt=fmt,
                       what="change-set record", expected_length=expected_length)


def _check_body_identity(body: bytes, key: str, offset: int, log_id: str, sqn: int) -> int:
    """Check the body names ``(log_id, sqn)``; return the offset of its first block."""
    if len(body) < 2:
        raise TruncatedObjectError(key, offset, 2, len(body), "change-set body")
    (lid_len,) = _U16.unpack_from(body, 0)
    head_end: int = 2 + int(lid_len) + _BODY_HEAD_SQN.size
    if len(body) < head_end:
        raise TruncatedObjectError(key, offset, head_end, len(body), "change-set body")
    got_lid = body[2:2 + lid_len]
    got_sqn = int(_BODY_HEAD_SQN.unpack_from(body, 2 + lid_len)[0])
    if got_lid != log_id.encode("utf-8") or got_sqn != sqn:
        raise CorruptObjectError(key, offset, f"record holds change set "
                                              f"({got_lid.decode('utf-8', 'replace')!r}, "
                                              f"sqn {got_sqn}), expected ({log_id!r}, sqn {sqn})",
                                 hint="the handle does not match the object")
    return head_end


def decode_record(record: bytes | memoryview, *, key: str, offset: int, log_id: str, sqn: int,
                  max_change_set_bytes: int | None = None) -> bytes:
    """Verify one change-set record fetched with a ranged read; return its body.

    Args:
        record: exactly the bytes ``[offset, offset + length)`` of the segment.
        key, offset: where they came from (for error messages).
        log_id, sqn: which change set the handle says this is.
        max_change_set_bytes: the limit on the body (default
            :data:`DEFAULT_MAX_CHANGE_SET_BYTES`).

    Raises:
        CorruptObjectError: (or a subclass) naming ``key`` and the offset.
    """
    body = _open_change_set(record, key, offset, segment_format(max_change_set_bytes))
    _check_body_identity(body, key, offset, log_id, sqn)
    return body


def _check_block_range(kg: int, log_range: tuple[int, int] | None,
                       recorded: tuple[int, int] | None, key: str, offset: int) -> None:
    """A block's key group lies in the writer's range (the handle's; metadata excepted) and in
    the range recorded for its change set (index entry or reference), or the object is corrupt."""
    if log_range is not None and kg != -1 and not log_range[0] <= kg <= log_range[1]:
        raise CorruptObjectError(key, offset, f"change set holds key group {kg}, outside its "
                                              f"log's range [{log_range[0]}, {log_range[1]}]",
                                 hint="the handle and the object disagree")
    if recorded is not None and not recorded[0] <= kg <= recorded[1]:
        raise CorruptObjectError(key, offset, f"change set holds key group {kg}, outside its "
                                              f"recorded range [{recorded[0]}, {recorded[1]}]")


def body_blocks(body: bytes, *, key: str = "<change set>", offset: int = 0,
                key_groups: object = None, log_range: tuple[int, int] | None = None,
                recorded: tuple[int, int] | None = None) -> list[tuple[int, int, int]]:
    """The key-group blocks of a verified body, as ``(key_group, start, end)``: the byte range
    of the block's ``u32 len | payload`` changes in ``body``, key groups ascending.

    The bulk replay reads a change set this way, one block at a time, instead of one change at a
    time through :func:`iter_body_changes`, which walks the blocks with this function. The block
    framing is checked here (every block inside the body, nothing after the last); the changes'
    framing by the caller.

    Args:
        body: a body returned by :func:`decode_record` (already checksum-verified).
        key, offset: for error messages.
        key_groups: if given, a container of key groups to keep; metadata (-1) is always kept.
        log_range, recorded: as for :func:`iter_body_changes`: a block outside the writer's
            range or the recorded range is corruption, kept or not.

    Raises:
        CorruptObjectError: (or a subclass) naming ``key`` and ``offset``.
    """
    end = len(body)
    try:
        (lid_len,) = _U16.unpack_from(body, 0)
        pos = 2 + lid_len
        _, n_blocks = _BODY_HEAD_SQN.unpack_from(body, pos)
    except struct.error as exc:
        raise TruncatedObjectError(key, offset, 2 + _BODY_HEAD_SQN.size, end,
                                   "change-set body") from exc
    pos += _BODY_HEAD_SQN.size
    out: list[tuple[int, int, int]] = []
    unpack_block = _BLOCK.unpack_from
    for _ in range(n_blocks):
        if end - pos < _BLOCK.size:
            raise TruncatedObjectError(key, offset, pos + _BLOCK.size, end, "block header")
        kg, blen = unpack_block(body, pos)
        pos += _BLOCK.size
        bend = pos + blen
        if bend > end:
            raise TruncatedObjectError(key, offset, bend, end, "key-group block")
        if log_range is not None or recorded is not None:
            _check_block_range(kg, log_range, recorded, key, offset)
        if key_groups is None or kg == -1 or kg in key_groups:  # type: ignore[operator]
            out.append((kg, pos, bend))
        pos = bend
    if pos != end:
        raise CorruptObjectError(key, offset, f"{end - pos} unexpected bytes after the last block")
    return out


def iter_body_changes(body: bytes, *, key: str = "<change set>", offset: int = 0,
                      key_groups: object = None, log_range: tuple[int, int] | None = None,
                      recorded: tuple[int, int] | None = None) -> Iterator[tuple[int, bytes]]:
    """Yield ``(key_group, payload)`` of a verified body, key groups ascending, append order kept.

    Args:
        body: a body returned by :func:`decode_record` (already checksum-verified).
        key, offset: for error messages.
        key_groups: if given, a container of key groups to keep (``kg in key_groups``); the
            metadata key group (-1) is always yielded.
        log_range: if given, the writer's inclusive key-group range ``(start, end)``: a block
            outside it (other than metadata) is corruption, whether kept or not.
        recorded: if given, the ``(kg_min, kg_max)`` recorded for the change set (index entry,
            or the handle's reference): every block, metadata included, must lie in it.

    Raises:
        CorruptObjectError: (or a subclass) naming ``key`` and ``offset``.
    """
    unpack_len = _U32.unpack_from
    for kg, pos, bend in body_blocks(body, key=key, offset=offset, key_groups=key_groups,
                                     log_range=log_range, recorded=recorded):
        while pos < bend:
            if bend - pos < 4:
                raise TruncatedObjectError(key, offset, pos + 4, bend, "change length")
            (n,) = unpack_len(body, pos)
            pos += 4
            if pos + n > bend:
                raise TruncatedObjectError(key, offset, pos + n, bend, "change payload")
            yield kg, body[pos:pos + n]
            pos += n
