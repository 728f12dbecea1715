"""LMDB environment files that are not (yet) a live table: trimming and range-copying the
validated data files of file-level snapshots (:mod:`materializer.file_snapshot`).

Theory of operation
-------------------
A restore decompresses a v2 snapshot's data file into a *staging directory* beside the table's
directory (:mod:`restore.file_restore`); a reader decompresses it into memory or a temporary
file. The file came from a store: nothing hands it to LMDB, or reads it, before
:func:`materializer.lmdb_check.check_data_file` validated it whole. Then:

* :func:`remove_marker` deletes the table marker of a validated environment that is to become a
  table: a marker says which checkpoint a table holds, and only the restored backend, once its
  restore is complete, may claim one (a table installed by a restore that is then killed must
  never look like a checkpoint's table to the adopt path of ``dstl.spark.slots``).
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

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lmdb

from dstl.errors import CorruptObjectError, LocalDiskFullError, StateError
from dstl.keygroups import KeyGroupRange
from materializer.lmdb_table import KEY_PREFIX, KG_SID, LAYOUT_KEY, LAYOUT_VERSION, MARKER_KEY
from materializer.snapshot_format import SnapshotEntry

__all__ = ["RangeSource", "build_environment", "iter_key_groups", "remove_marker"]



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


def remove_marker(directory: str, *, key: str) -> None:
    """Delete the table marker of the validated environment in ``directory``."""
    try:
        env = _open(directory, readonly=False)
        try:
            with env.begin(write=True) as txn:
                txn.delete(MARKER_KEY)
        finally:
            env.close()
    except lmdb.Error as exc:
        raise CorruptObjectError(key, 0, f"the LMDB data file does not open: {exc}") from exc


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
        StateError: the sources' ranges overlap, or LMDB failed writing the new environment.
        LocalDiskFullError: the local disk filled up.
    """
    try:
        return _build(target, sources)
    except lmdb.Error as exc:
        if isinstance(exc, lmdb.DiskError) or "No space left" in str(exc):
            raise LocalDiskFullError(f"copying snapshot key groups into {target}: {exc} (free "
                                     "local disk space)", path=target) from exc
        raise StateError(f"copying snapshot key groups into {target} failed: {exc}") from exc


def _build(target: str, sources: Sequence[RangeSource]) -> int:
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
