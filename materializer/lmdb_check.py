"""The one validator of a v2 snapshot's LMDB data file (:mod:`materializer.file_snapshot`).

Theory of operation
-------------------
The file came from a store: nothing hands it to LMDB, or reads it, before
:func:`check_data_file` validated it whole — every page as LMDB's compacting copy writes it
(:func:`materializer.lmdb_pages.parse_data_file`: bounds, page kinds, no cycle, keys in order,
branch keys that separate their subtrees, overflow runs, counts), then DSTL's key layout: every
key a data key of a key group of the snapshot's range — the key group its key's bytes hash to,
as every lookup computes it (internal raw states excepted) — and of a state its metadata
describes, with a key length that fits, or a reserved record: the layout record (present, of
layout ``"1"`` or ``"2"``), at most the table marker and, in layout ``"2"``, dictionary records.
Layout ``"2"`` (:mod:`materializer.value_codec`): every dictionary record's number and size
bounded and zstd loads it; every value has a tag byte, 0 or 1; a tag-1 value names a dictionary
the file holds and its zstd frame's header parses, declares a content size within
``max_decoded_bytes``, and the frame decodes to exactly that size (decoded once here, in one
C call per dictionary, so a table installed from the file never meets a value that does not
decode; bytes after a frame are ignored, as every reader of the value ignores them).
What it accepts, LMDB reads and writes safely, and every
path (restore into LMDB or the heap, range copy, the readers, ``dstl verify`` and
``dstl inspect``) sees the same entries; what it refuses is a
:class:`~dstl.errors.CorruptObjectError` naming the object, the page and the entry.

numpy does the work, over all entries at once; the restore imports this module when it stages
a file (:mod:`restore.file_restore`), so a process that restores nothing never imports numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dstl.errors import CorruptObjectError, CorruptValueError
from dstl.key_hashes import key_groups_for
from materializer.codecs import DEFAULT_MAX_DECODED_VALUE_BYTES
from materializer.file_snapshot import FileSnapshotMeta
from materializer.lmdb_pages import EntrySpans, LmdbFileError, entry_spans, parse_data_file
from materializer.lmdb_table import KEY_PREFIX, LAYOUT_KEY, LAYOUT_VERSIONS, MARKER_KEY
from materializer.value_codec import TAG_DICT, TAG_RAW, ValueCodec, dictionary_number

__all__ = ["ValidFile", "check_data_file"]


@dataclass(frozen=True)
class ValidFile:
    """A validated data file: its entries (the reserved records included), how many are
    state entries, its key layout and, for layout ``"2"``, the codec of its values (with the
    file's dictionaries; errors name the object)."""

    spans: EntrySpans
    entries: int
    layout: bytes = b"1"
    codec: ValueCodec | None = field(default=None, compare=False)
    key: str = ""
    offset: int = 0

    def value(self, i: int) -> bytes:
        """Entry ``i``'s value, decoded (layout ``"2"``).

        Raises:
            CorruptValueError: the value does not decode (naming the object and the entry).
        """
        spans = self.spans
        v, n = int(spans.value_start[i]), int(spans.value_size[i])
        stored = spans.data[v:v + n].tobytes()
        if self.codec is None:
            return stored
        try:
            return self.codec.decode(stored)
        except CorruptValueError as exc:
            raise _at(exc, self.key, self.offset, spans, i) from exc


def check_data_file(data: np.ndarray | str, meta: FileSnapshotMeta, *, key: str, offset: int,
                    max_decoded_bytes: int = DEFAULT_MAX_DECODED_VALUE_BYTES) -> ValidFile:
    """Validate a v2 snapshot's LMDB data file whole — its bytes in memory, or the file at a
    path (mapped read-only) — by the module docstring's rules, against the snapshot's metadata.

    Args:
        key, offset: the snapshot object and the offset of its data, for errors.

    Raises:
        CorruptObjectError: the first rule the file breaks, naming the object, the page or
            entry, and the data file's byte.
    """
    try:
        spans = entry_spans(data) if isinstance(data, str) else parse_data_file(data)
    except LmdbFileError as exc:
        raise CorruptObjectError(key, offset, f"the LMDB data file is not one LMDB's compacting "
                                              f"copy writes: {exc}") from exc
    reserved = _check_keys(spans, meta, key, offset)
    layout, dictionaries = _check_reserved(spans, reserved, key, offset)
    codec = None
    if layout != b"1":
        codec = ValueCodec(where=key, max_decoded_bytes=max_decoded_bytes)
        for number, i in sorted(dictionaries.items()):
            try:
                codec.add(number, _value(spans, i))
            except CorruptValueError as exc:
                raise _at(exc, key, offset, spans, i) from exc
        _check_values(spans, reserved, codec, key, offset, max_decoded_bytes)
    return ValidFile(spans, len(spans) - len(reserved), layout, codec, key, offset)


def _check_keys(spans: EntrySpans, meta: FileSnapshotMeta, key: str, offset: int) -> np.ndarray:
    """Every data key of DSTL's layout for ``meta`` (the module docstring); returns the indexes
    of the reserved records (key group ``0xFFFF``)."""
    head = spans.key_head.astype(np.uint64)
    kg = (head >> np.uint64(48)).astype(np.int64)
    reserved = np.flatnonzero(kg == 0xFFFF)
    data_keys = kg != 0xFFFF
    sid = ((head >> np.uint64(32)) & np.uint64(0xFFFF)).astype(np.int64)
    length = (head & np.uint64(0xFFFFFFFF)).astype(np.int64)
    kgs = meta.key_groups
    short = spans.key_size < KEY_PREFIX.size
    outside = (kg < kgs.start) | (kg > kgs.end)
    unknown = ~np.isin(sid, np.fromiter(map(int, meta.states), np.int64))
    overlong = KEY_PREFIX.size + length > spans.key_size
    bad = data_keys & (short | outside | unknown | overlong)
    if not bad.any():   # the key group is the hash of the key's bytes (lookups compute it),
        #                   except in internal raw states (indexes keyed by other bytes)
        raw = [int(i) for i, m in meta.states.items() if m.get("raw") is True]
        at = np.flatnonzero(data_keys & ~np.isin(sid, np.array(raw, dtype=np.int64)))
        hashed = np.zeros(len(kg), dtype=np.int64)
        hashed[at] = key_groups_for(spans.data, spans.key_start[at] + KEY_PREFIX.size,
                                    length[at], meta.max_parallelism)
        bad = np.zeros(len(kg), dtype=bool)
        bad[at] = hashed[at] != kg[at]
    if bad.any():
        i = int(np.argmax(bad))
        why = ("is shorter than DSTL's 8-byte key prefix" if short[i]
               else f"is in key group {kg[i]}, outside key groups {kgs} of the snapshot"
               if outside[i]
               else f"is of state id {sid[i]}, which the snapshot's metadata does not describe"
               if unknown[i]
               else f"says its key is {length[i]} bytes, longer than the entry's key"
               if overlong[i]
               else f"is stored in key group {kg[i]}, but its key hashes to key group "
                    f"{int(hashed[i])} of {meta.max_parallelism} (a lookup would not find it)")
        raise CorruptObjectError(key, offset, f"entry {i} of the LMDB data file (byte "
                                              f"{int(spans.key_start[i])}), key "
                                              f"{_bytes(spans, i)[:40]!r}, {why}")
    return reserved


def _check_reserved(spans: EntrySpans, reserved: np.ndarray, key: str, offset: int
                    ) -> tuple[bytes, dict[int, int]]:
    """The reserved records are the layout record, of a layout this build reads, at most the
    marker, and (layout ``"2"``) dictionary records; returns the layout and the dictionary
    numbers' entry indexes."""
    found = {_bytes(spans, int(i)): int(i) for i in reserved}
    dictionaries = {n: i for k, i in found.items() if (n := dictionary_number(k)) is not None}
    others = set(found) - {LAYOUT_KEY, MARKER_KEY} - {_bytes(spans, i)
                                                      for i in dictionaries.values()}
    if others or LAYOUT_KEY not in found:
        raise CorruptObjectError(key, offset, f"the LMDB data file's reserved records are "
                                              f"{sorted(found)[:8]}, expected the layout record, "
                                              "at most the table marker, and dictionaries")
    layout = _value(spans, found[LAYOUT_KEY])
    if layout not in LAYOUT_VERSIONS:
        raise CorruptObjectError(key, offset, f"LMDB key layout {layout[:16]!r} in the "
                                              f"data file, expected one of {LAYOUT_VERSIONS!r}")
    if layout == b"1" and dictionaries:
        raise CorruptObjectError(key, offset, "the LMDB data file of key layout '1' holds "
                                              "dictionary records (only layout '2' has them)")
    return layout, dictionaries


def _check_values(spans: EntrySpans, reserved: np.ndarray, codec: ValueCodec, key: str,
                  offset: int, max_decoded_bytes: int) -> None:
    """Every state entry's value framing (layout ``"2"``, the module docstring): the tags,
    dictionary numbers and frame headers over all entries at once, then the tag-1 frames
    decoded in one C call per dictionary; only when one fails, each frame on its own for the
    error."""
    data = np.ones(len(spans), dtype=bool)
    data[reserved] = False
    size = spans.value_size
    start = spans.value_start
    empty = data & (size < 1)
    tag = np.zeros(len(spans), dtype=np.int64)
    has = data & ~empty
    tag[has] = spans.data[start[has]]
    bad_tag = has & (tag != TAG_RAW) & (tag != TAG_DICT)
    framed = has & (tag == TAG_DICT)
    short = framed & (size < 2)
    number = np.full(len(spans), -1, dtype=np.int64)
    numbered = framed & ~short
    number[numbered] = spans.data[start[numbered] + 1]
    unknown = numbered & ~np.isin(number, np.array(codec.numbers, dtype=np.int64))
    bad = empty | bad_tag | short | unknown
    if bad.any():
        i = int(np.argmax(bad))
        why = ("is empty (no tag byte)" if empty[i]
               else f"has the unknown tag {int(tag[i])}, expected {TAG_RAW} or {TAG_DICT}"
               if bad_tag[i]
               else "has tag 1 without a dictionary number" if short[i]
               else f"names dictionary {int(number[i])}, which the file does not hold (it "
                    f"holds {codec.numbers})")
        raise CorruptValueError(key, offset, _bytes(spans, i),
                                f"entry {i} of the LMDB data file (value at byte "
                                f"{int(start[i])}) {why}")
    starts = start[numbered] + 2   # the frames, after the tag and the dictionary number
    lengths = size[numbered] - 2
    declared, parsed = _declared_sizes(spans.data, starts, lengths, max_decoded_bytes)
    numbers = number[numbered]
    if parsed.all() and all(_frames_decode(codec, int(n), spans.data, *(
            column[numbers == n] for column in (starts, lengths, declared)))
            for n in np.unique(numbers)):
        return
    # a frame fails: each one decoded on its own, in entry order, says which and why
    raw = spans.data
    decode = codec.decode_strict
    for i, v, n in zip(np.flatnonzero(numbered).tolist(), start[numbered].tolist(),
                       size[numbered].tolist(), strict=True):
        try:
            decode(raw[v:v + n].tobytes())
        except CorruptValueError as exc:
            raise _at(exc, key, offset, spans, i) from exc


#: zstd's frame magic number, little-endian
_ZSTD_MAGIC = (0x28, 0xB5, 0x2F, 0xFD)
#: a frame header's dictionary id field and content size field widths by their flags
_DICT_ID_BYTES = np.array([0, 1, 2, 4], dtype=np.int64)
_CONTENT_SIZE_BYTES = np.array([0, 2, 4, 8], dtype=np.int64)


def _declared_sizes(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray, limit: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The content size each zstd frame ``data[starts[i]:][:lengths[i]]`` declares in its
    header (zstd's format: magic, frame header descriptor, window descriptor unless single
    segment, dictionary id, content size), and whether the header is one: in the frame, a
    content size declared and at most ``limit``. Over all frames at once, a byte column at a
    time."""
    last = len(data) - 1

    def byte(at: np.ndarray) -> np.ndarray:
        out: np.ndarray = data[np.minimum(at, last)].astype(np.int64)
        return out

    ok = lengths >= 6
    for i, m in enumerate(_ZSTD_MAGIC):
        ok &= byte(starts + i) == m
    fhd = byte(starts + 4)
    single = (fhd >> 5) & 1
    width = np.where(fhd >> 6 == 0, single, _CONTENT_SIZE_BYTES[fhd >> 6])
    at = starts + 5 + (1 - single) + _DICT_ID_BYTES[fhd & 3]
    ok &= (width > 0) & (fhd & 0x08 == 0) & (at - starts + width <= lengths)
    declared = np.zeros(len(starts), dtype=np.uint64)
    for j in range(8):
        part = byte(at + j).astype(np.uint64) << np.uint64(8 * j)
        declared |= np.where(width > j, part, np.uint64(0))
    declared += np.where(width == 2, np.uint64(256), np.uint64(0))
    ok &= declared <= np.uint64(limit)
    return declared, ok


def _frames_decode(codec: ValueCodec, number: int, data: np.ndarray, starts: np.ndarray,
                   lengths: np.ndarray, declared: np.ndarray) -> bool:
    """Whether dictionary ``number``'s frames decode to their declared sizes (one C call:
    :meth:`~materializer.value_codec.ValueCodec.frames_decode`)."""
    segments = np.empty(2 * len(starts), dtype="<u8")
    segments[0::2] = starts
    segments[1::2] = lengths
    return codec.frames_decode(number, data, segments.tobytes(),
                               declared.astype("<u8").tobytes())


def _value(spans: EntrySpans, i: int) -> bytes:
    """Entry ``i``'s stored value."""
    v = int(spans.value_start[i])
    return spans.data[v:v + int(spans.value_size[i])].tobytes()


def _at(exc: CorruptValueError, key: str, offset: int, spans: EntrySpans, i: int
        ) -> CorruptValueError:
    """``exc`` (of one value) placed in the object and the data file's entry ``i``."""
    return CorruptValueError(key, offset, _bytes(spans, i),
                             f"entry {i} of the LMDB data file (value at byte "
                             f"{int(spans.value_start[i])}): {exc.detail}")


def _bytes(spans: EntrySpans, i: int) -> bytes:
    """Entry ``i``'s key."""
    start = int(spans.key_start[i])
    return spans.data[start:start + int(spans.key_size[i])].tobytes()
