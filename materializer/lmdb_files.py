"""LMDB environment files that are not (yet) a live table: checking, trimming and range-copying
the data files of file-level snapshots (:mod:`materializer.file_snapshot`).

Theory of operation
-------------------
A restore decompresses a v2 snapshot's data file into a *staging directory* beside the table's
directory (:mod:`restore.file_restore`). Before a staged environment may become a table:

* :func:`check_environment` opens it, checks the key layout record and that its first and last
  data keys lie in the key-group range the metadata claims (keys are key-group prefixed, so the
  two ends bound every key), and deletes the table marker: a marker says which checkpoint a
  table holds, and only the restored backend, once its restore is complete, may claim one (a
  table installed by a restore that is then killed must never look like a checkpoint's table to
  the adopt path of ``dstl.spark.slots``).
* :func:`build_environment` serves the other cases — the restoring backend owns only part of
  a snapshot's key groups, or several snapshots meet its range (rescaling): it opens each staged
  file read-only and copies only the owned key-group ranges into a new environment, in key
  order with append-mode ``putmulti`` (LMDB appends to the last page instead of searching the
  tree), rewriting the state id of every key when the snapshots numbered their states
  differently. Sources are taken in key-group order (the ranges of one checkpoint's snapshots
  are disjoint), and ``putmulti``'s count of added records is checked: an append out of order
  is refused by LMDB without an error.
* :func:`iter_key_groups` reads a staged file entry by entry, for the heap table (which keeps
  objects, not bytes).

Nothing here opens a table: the callers rename a checked environment into place and open it as an
:class:`~materializer.lmdb_table.LmdbStateTable` (the rename is the commit point).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import lmdb

from dstl.errors import CorruptObjectError, StateError
from dstl.keygroups import KeyGroupRange
from materializer.lmdb_table import KEY_PREFIX, KG_SID, LAYOUT_KEY, LAYOUT_VERSION, MARKER_KEY
from materializer.snapshot_format import SnapshotEntry

__all__ = ["RangeSource", "build_environment", "check_environment", "iter_key_groups",
           "iter_raw_chunks"]

_RESERVED: Final = b"\xff\xff"   # key group of the layout and marker records


@dataclass(frozen=True, slots=True)
class RangeSource:
    """One staged environment to copy from.

    Attributes:
        directory: the staged environment (``data.mdb`` inside).
        key: the snapshot object it came from (for messages).
        key_groups: the key groups to copy (already clipped to the target's range).
        remap: the file's state id -> the target's state id (identity: empty or equal ids).
    """

    directory: str
    key: str
    key_groups: KeyGroupRange
    remap: dict[int, int]


def _open(directory: str, *, readonly: bool, map_size: int = 0) -> Any:
    size = max(map_size, os.path.getsize(os.path.join(directory, "data.mdb")) * 2, 1 << 20)
    return lmdb.open(directory, map_size=size, subdir=True, readonly=readonly, lock=not readonly,
                     readahead=False, sync=False, metasync=False, max_dbs=0)


def check_environment(directory: str, key_groups: KeyGroupRange, *, key: str) -> int:
    """Check a staged environment against its snapshot's metadata and delete its marker;
    returns its entry count (the layout record not counted).

    Raises:
        CorruptObjectError: the file is no LMDB environment of DSTL's key layout, or holds key
            groups outside ``key_groups`` (names the snapshot object ``key``).
    """
    try:
        env = _open(directory, readonly=False)
    except lmdb.Error as exc:
        raise CorruptObjectError(key, 0, f"the data file is not an LMDB environment: {exc}"
                                 ) from exc
    try:
        with env.begin(write=True) as txn:
            layout = txn.get(LAYOUT_KEY)
            if layout != LAYOUT_VERSION:
                raise CorruptObjectError(key, 0, f"LMDB key layout {layout!r} in the data file, "
                                                 f"expected {LAYOUT_VERSION!r}")
            with txn.cursor() as cur:
                first = cur.key() if cur.first() else None
                last = cur.key() if cur.set_range(_RESERVED) and cur.prev() else None
            for k in (first, last):
                if k is not None and not k.startswith(_RESERVED) and (
                        len(k) < KEY_PREFIX.size
                        or KG_SID.unpack_from(k, 0)[0] not in key_groups):
                    raise CorruptObjectError(key, 0, f"the data file holds key {k[:8]!r}..., "
                                                     f"outside key groups {key_groups}")
            txn.delete(MARKER_KEY)
        return int(env.stat()["entries"]) - 1
    except lmdb.Error as exc:
        raise CorruptObjectError(key, 0, f"the LMDB data file does not read: {exc}") from exc
    finally:
        env.close()


def _records(cur: Any, end: bytes) -> Iterator[tuple[bytes, bytes]]:
    for k, v in cur.iternext():
        if k >= end:
            return
        yield k, v


def _copy_range(src_txn: Any, dst: Any, source: RangeSource) -> int:
    """Append the records of ``source.key_groups`` from ``src_txn`` to the write cursor ``dst``;
    returns how many."""
    kgs = source.key_groups
    end = KG_SID.pack(kgs.end + 1, 0)   # real key groups are < 2**15: never the reserved 0xFFFF
    with src_txn.cursor() as cur:
        if not cur.set_range(KG_SID.pack(kgs.start, 0)):
            return 0
        records = _records(cur, end)
        if all(a == b for a, b in source.remap.items()):
            consumed, added = dst.putmulti(records, append=True)   # the loop runs in C
            _check_added(consumed, added, source)
            return int(added)
        copied = 0
        for group in _by_key_group(records):
            batch = _remapped(group, source)
            consumed, added = dst.putmulti(batch, append=True)
            _check_added(consumed, added, source)
            copied += added
        return copied


def _check_added(consumed: int, added: int, source: RangeSource) -> None:
    if added != consumed:
        raise StateError(f"copying key groups {source.key_groups} of {source.key}: LMDB refused "
                         f"{consumed - added} records (out of order: the snapshots' key-group "
                         "ranges overlap)")


def _by_key_group(records: Iterator[tuple[bytes, bytes]]) -> Iterator[list[tuple[bytes, bytes]]]:
    group: list[tuple[bytes, bytes]] = []
    current = b""
    for k, v in records:
        if k[:2] != current:
            if group:
                yield group
            group, current = [], k[:2]
        group.append((k, v))
    if group:
        yield group


def _remapped(group: list[tuple[bytes, bytes]], source: RangeSource) -> list[tuple[bytes, bytes]]:
    """One key group's records with their state ids rewritten, re-sorted (the states of a key
    group may change order)."""
    out = []
    for k, v in group:
        kg, sid = KG_SID.unpack_from(k, 0)
        new = source.remap.get(sid)
        if new is None:
            raise CorruptObjectError(source.key, 0, f"the data file holds state id {sid}, which "
                                                    "its metadata does not describe")
        out.append((KG_SID.pack(kg, new) + k[KG_SID.size:], v))
    out.sort()
    return out


def build_environment(target: str, sources: Sequence[RangeSource]) -> int:
    """Create the environment ``target`` (a new directory) holding exactly the key groups the
    ``sources`` name, and DSTL's layout record; returns the records copied.

    Raises:
        CorruptObjectError: a source is not a readable LMDB file or holds undescribed states.
        StateError: the sources' ranges overlap.
    """
    os.makedirs(target)
    size = sum(os.path.getsize(os.path.join(s.directory, "data.mdb")) for s in sources)
    dst_env = lmdb.open(target, map_size=max(size * 2, 64 << 20), subdir=True, sync=False,
                        metasync=False, readahead=False, max_dbs=0)
    copied = 0
    try:
        with dst_env.begin(write=True) as w, w.cursor() as dst:
            for source in sorted(sources, key=lambda s: s.key_groups.start):
                try:
                    src_env = _open(source.directory, readonly=True)
                except lmdb.Error as exc:
                    raise CorruptObjectError(source.key, 0, f"the data file is not an LMDB "
                                                            f"environment: {exc}") from exc
                try:
                    with src_env.begin() as r:
                        copied += _copy_range(r, dst, source)
                finally:
                    src_env.close()
            w.put(LAYOUT_KEY, LAYOUT_VERSION)
    finally:
        dst_env.close()
    return copied


def iter_raw_chunks(directory: str, key_groups: KeyGroupRange, *, key: str, rows: int = 65536
                    ) -> Iterator[tuple[list[bytes], list[bytes]]]:
    """The staged environment's entries in ``key_groups`` as ``(raw keys, values)`` lists of at
    most ``rows`` entries, in key order — raw keys are ``KEY_PREFIX`` + key + namespace. For
    column-wise readers: the lists are built by the cursors' iterators at C speed (one cursor
    for keys, ended by comparing with the first key past the range; one for values, in step),
    with no Python per entry."""
    try:
        env = _open(directory, readonly=True)
    except lmdb.Error as exc:
        raise CorruptObjectError(key, 0, f"the data file is not an LMDB environment: {exc}"
                                 ) from exc
    start, end = KG_SID.pack(key_groups.start, 0), KG_SID.pack(key_groups.end + 1, 0)
    try:
        with env.begin() as txn, txn.cursor() as kcur, txn.cursor() as vcur:
            if not kcur.set_range(start) or not vcur.set_range(start):
                return
            keys = itertools.takewhile(end.__gt__, kcur.iternext(keys=True, values=False))
            values = vcur.iternext(keys=False, values=True)
            while True:
                ks = list(itertools.islice(keys, rows))
                if not ks:
                    return
                vs = list(itertools.islice(values, len(ks)))
                if len(vs) != len(ks):  # one transaction: the cursors see the same entries
                    raise CorruptObjectError(key, 0, "the data file's cursors disagree")
                yield ks, vs
    finally:
        env.close()


def iter_key_groups(directory: str, key_groups: KeyGroupRange, *, key: str
                    ) -> Iterator[tuple[int, list[SnapshotEntry]]]:
    """``(key group, entries)`` of the staged environment's key groups in ``key_groups``, in
    order; entries are ``(state id, key, namespace, value)`` bytes, like a v1 block's."""
    try:
        env = _open(directory, readonly=True)
    except lmdb.Error as exc:
        raise CorruptObjectError(key, 0, f"the data file is not an LMDB environment: {exc}"
                                 ) from exc
    psize = KEY_PREFIX.size
    unpack = KEY_PREFIX.unpack_from
    try:
        with env.begin() as txn, txn.cursor() as cur:
            if not cur.set_range(KG_SID.pack(key_groups.start, 0)):
                return
            current = -1
            block: list[SnapshotEntry] = []
            for raw, value in cur.iternext():
                kg, sid, klen = unpack(raw, 0)
                if kg > key_groups.end:
                    break
                if kg != current:
                    if block:
                        yield current, block
                    current, block = kg, []
                end = psize + klen
                block.append((sid, raw[psize:end], raw[end:], value))
            if block:
                yield current, block
    finally:
        env.close()
