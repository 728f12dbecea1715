"""The one validator of a v2 snapshot's LMDB data file (:mod:`materializer.file_snapshot`).

Theory of operation
-------------------
The file came from a store: nothing hands it to LMDB, or reads it, before
:func:`check_data_file` validated it whole — every page as LMDB's compacting copy writes it
(:func:`materializer.lmdb_pages.parse_data_file`: bounds, page kinds, no cycle, keys in order,
branch keys that separate their subtrees, overflow runs, counts), then DSTL's key layout: every
key a data key of a key group of the snapshot's range — the key group its key's bytes hash to,
as every lookup computes it (internal raw states excepted) — and of a state its metadata
describes, with a key length that fits, or one of the two reserved records, the layout record
present and of this layout version. What it accepts, LMDB reads and writes safely, and every
path (restore into LMDB or the heap, range copy, the readers, ``dstl verify`` and
``dstl inspect``) sees the same entries; what it refuses is a
:class:`~dstl.errors.CorruptObjectError` naming the object, the page and the entry.

numpy does the work, over all entries at once; the restore imports this module when it stages
a file (:mod:`restore.file_restore`), so a process that restores nothing never imports numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dstl.errors import CorruptObjectError
from dstl.key_hashes import key_groups_for
from materializer.file_snapshot import FileSnapshotMeta
from materializer.lmdb_pages import EntrySpans, LmdbFileError, entry_spans, parse_data_file
from materializer.lmdb_table import KEY_PREFIX, LAYOUT_KEY, LAYOUT_VERSION, MARKER_KEY

__all__ = ["ValidFile", "check_data_file"]


@dataclass(frozen=True)
class ValidFile:
    """A validated data file: its entries (the reserved records included) and how many are
    state entries."""

    spans: EntrySpans
    entries: int


def check_data_file(data: np.ndarray | str, meta: FileSnapshotMeta, *, key: str, offset: int
                    ) -> ValidFile:
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
    _check_reserved(spans, reserved, key, offset)
    return ValidFile(spans, len(spans) - len(reserved))


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


def _check_reserved(spans: EntrySpans, reserved: np.ndarray, key: str, offset: int) -> None:
    """The reserved records are the layout record, of this layout, and at most the marker."""
    found = {_bytes(spans, int(i)): int(i) for i in reserved}
    if set(found) - {LAYOUT_KEY, MARKER_KEY} or LAYOUT_KEY not in found:
        raise CorruptObjectError(key, offset, f"the LMDB data file's reserved records are "
                                              f"{sorted(found)}, expected the layout record "
                                              "and at most the table marker")
    i = found[LAYOUT_KEY]
    layout = spans.data[spans.value_start[i]:spans.value_start[i] + spans.value_size[i]]
    if layout.tobytes() != LAYOUT_VERSION:
        raise CorruptObjectError(key, offset, f"LMDB key layout {layout.tobytes()[:16]!r} in the "
                                              f"data file, expected {LAYOUT_VERSION!r}")


def _bytes(spans: EntrySpans, i: int) -> bytes:
    """Entry ``i``'s key."""
    start = int(spans.key_start[i])
    return spans.data[start:start + int(spans.key_size[i])].tobytes()
