"""LMDB environment files that are not (yet) a live table: the validated data files of
file-level snapshots (:mod:`materializer.file_snapshot`) trimmed and range-copied, and the file of
a table snapshot written (packed first when its pages are far from full).

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
  is refused by LMDB without an error. The new environment is of key layout ``"2"``
  (:mod:`materializer.value_codec`): the sources' dictionaries are copied under new numbers
  (one number per distinct dictionary, in the sources' key-group order) and each copied
  value's number byte rewritten, nothing recompressed; a layout-``"1"`` source's values get the
  tag byte 0. Beyond 256 distinct dictionaries the values of the further ones are decoded and
  stored with tag 0.
* :func:`iter_key_groups` reads a staged file entry by entry, values decoded, for the heap
  table (which keeps objects, not bytes) and the readers.
* :func:`spool_table_snapshot` writes a table snapshot's file-level object
  (:func:`~materializer.file_snapshot.spool_file_snapshot`). LMDB's compacting copy drops free
  pages but keeps every page as full as it is, and a B-tree filled by inserts in no global order
  keeps its leaves about two thirds full (measured: 65 % for 256-byte values, keys ascending in
  each of 32 key groups or in random order; LMDB splits a page in the middle unless the new key
  goes last on it). So when the snapshot's leaves are estimated less than
  :data:`PACK_BELOW_FILL` full, its records are first appended, in key order, into a temporary
  environment beside the table (:class:`PackedEnvironment`: full pages, like
  :func:`build_environment`'s), and that one is copied. Measured on 250 k entries of 256-byte
  values: a third fewer pages in the file, and so in the table a restore installs from it by
  rename, a quarter fewer bytes in the object, for 0.3 s more CPU in the materializer (+54 %
  over the plain copy) and the packed environment's size on disk while it runs. The read
  transaction ends once the records are appended.

Writes into a new environment go in transactions of at most :data:`TXN_BYTES` of records: LMDB
keeps a write transaction's dirty pages in memory (without ``writemap``), so one transaction for
a whole environment would hold all of it.

Nothing here opens a table: the callers rename a checked environment into place and open it as an
:class:`~materializer.lmdb_table.LmdbStateTable` (the rename is the commit point).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, BinaryIO, Final

import lmdb

from dstl.errors import CorruptObjectError, LocalDiskFullError, StateError
from dstl.keygroups import KeyGroupRange
from materializer.file_snapshot import FileSnapshotMeta, spool_file_snapshot
from materializer.lmdb_table import (
    KEY_PREFIX,
    KG_SID,
    LAYOUT_KEY,
    LAYOUT_VERSION,
    MARKER_KEY,
    LmdbTableSnapshot,
    read_dictionaries,
)
from materializer.local_dirs import OwnDirectory
from materializer.snapshot_format import SnapshotEntry
from materializer.value_codec import MAX_DICTIONARIES, TAG_DICT, ValueCodec, dictionary_key

__all__ = ["PACK_BELOW_FILL", "TXN_BYTES", "PackedEnvironment", "RangeSource",
           "build_environment", "iter_key_groups", "remove_marker", "spool_table_snapshot"]

#: A snapshot whose leaf pages are estimated less full than this is packed before it is copied
#: (the module docstring): below it a packed file is at least a fifth smaller.
PACK_BELOW_FILL: Final = 0.75
#: Records per write transaction into a new environment, at most (its dirty pages are memory).
TXN_BYTES: Final = 16 << 20
_PUT_BYTES: Final = 1 << 20   # records per putmulti call
_PACK_PREFIX: Final = ".dstl-pack-"



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


_Fix = Callable[[bytes, bytes], bytes]   # (record key, stored value) -> value in the target


def _records(cur: Any, end: bytes, fix: _Fix | None) -> Iterator[tuple[bytes, bytes]]:
    for k, v in cur.iternext():
        if k >= end:
            return
        yield (k, v) if fix is None else (k, fix(k, v))


def _copy_range(src_txn: Any, dst: _Appender, source: RangeSource, fix: _Fix | None) -> int:
    """Append the records of ``source.key_groups`` from ``src_txn`` to ``dst``, values through
    ``fix``; returns how many."""
    kgs = source.key_groups
    end = KG_SID.pack(kgs.end + 1, 0)   # real key groups are < 2**15: never the reserved 0xFFFF
    what = f"copying key groups {kgs} of {source.key}"
    with src_txn.cursor() as cur:
        if not cur.set_range(KG_SID.pack(kgs.start, 0)):
            return 0
        records = _records(cur, end, fix)
        if all(a == b for a, b in source.remap.items()):
            return dst.append(records, what)
        return sum(dst.append(_remapped(group, source), what)
                   for group in _by_key_group(records))


class _Appender:
    """Appends records in key order to a new environment, in write transactions of at most
    :data:`TXN_BYTES` (append-mode ``putmulti``: LMDB adds to the last page, which it fills
    before starting the next)."""

    def __init__(self, env: Any) -> None:
        self._env = env
        self._txn: Any = None
        self._pending = 0

    def append(self, records: Iterable[tuple[bytes, bytes]], what: str) -> int:
        """Append ``records`` (strictly increasing keys, above every key appended so far);
        returns how many.

        Raises:
            StateError: LMDB refused records (out of order; ``what`` says what was copied).
        """
        added = 0
        batch: list[tuple[bytes, bytes]] = []
        size = 0
        for record in records:
            batch.append(record)
            size += len(record[0]) + len(record[1])
            if size >= _PUT_BYTES:
                added += self._put(batch, size, what)
                batch, size = [], 0
        return added + (self._put(batch, size, what) if batch else 0)

    def _put(self, batch: list[tuple[bytes, bytes]], size: int, what: str) -> int:
        if self._txn is None:
            self._txn = self._env.begin(write=True)
        with self._txn.cursor() as cur:
            consumed, added = cur.putmulti(batch, append=True)   # the loop runs in C
        if added != consumed:
            raise StateError(f"{what}: LMDB refused {consumed - added} records (out of order: "
                             "the snapshots' key-group ranges overlap)")
        self._pending += size
        if self._pending >= TXN_BYTES:
            self.commit()
        return int(added)

    def commit(self) -> None:
        if self._txn is not None:
            txn, self._txn, self._pending = self._txn, None, 0
            txn.commit()

    def abort(self) -> None:
        if self._txn is not None:
            txn, self._txn = self._txn, None
            txn.abort()


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
    dst_env = _new_environment(target, size)
    copied = 0
    dst = _Appender(dst_env)
    numbers: dict[bytes, int] = {}   # the target's dictionaries: record -> number
    try:
        for source in sorted(sources, key=lambda s: s.key_groups.start):
            try:
                src_env = _open(source.directory, readonly=True)
            except lmdb.Error as exc:
                raise CorruptObjectError(source.key, 0, f"the data file is not an LMDB "
                                                        f"environment: {exc}") from exc
            try:
                with src_env.begin() as r:
                    copied += _copy_range(r, dst, source, _value_fix(r, source, numbers))
            finally:
                src_env.close()
        dst.append([(dictionary_key(n), d) for d, n in sorted(numbers.items(),
                                                              key=lambda x: x[1])]
                   + [(LAYOUT_KEY, LAYOUT_VERSION)], "the reserved records")
        dst.commit()
    finally:
        dst.abort()
        dst_env.close()
    return copied


def _value_fix(txn: Any, source: RangeSource, numbers: dict[bytes, int]) -> _Fix | None:
    """How a value of ``source`` (read in ``txn``) is stored in the layout-``"2"`` target whose
    dictionaries are ``numbers`` (extended with the source's): tag 0 for a layout-``"1"``
    source, its dictionary number renumbered, or None when every value stays as it is."""
    layout = txn.get(LAYOUT_KEY)
    if layout == b"1":
        return lambda k, v: b"\x00" + v
    renumber: dict[int, int | None] = {}
    records = dict(read_dictionaries(txn))
    for number, data in records.items():
        if data not in numbers and len(numbers) < MAX_DICTIONARIES:
            numbers[data] = len(numbers)
        renumber[number] = numbers.get(data)
    if all(a == b for a, b in renumber.items()):
        return None
    codec = ValueCodec(records, where=source.key)   # for the values beyond 256 dictionaries
    dict_tag = TAG_DICT

    def fix(k: bytes, v: bytes) -> bytes:
        if v[0] != dict_tag:
            return v
        new = renumber[v[1]]
        if new is None:
            return b"\x00" + codec.decode(v, k)
        return bytes((dict_tag, new)) + v[2:]

    return fix


def _new_environment(directory: str, size: int) -> Any:
    """A new environment for about ``size`` bytes of pages (its map: twice that; address space,
    and the file grows only as pages are written)."""
    return lmdb.open(directory, map_size=max(size * 2, 64 << 20), subdir=True, sync=False,
                     metasync=False, readahead=False, max_dbs=0)


class PackedEnvironment:
    """A snapshot's records appended, in key order, into a new environment in an own temporary
    directory (the module docstring); copy it with :meth:`copy_to`, then :meth:`close` it (the
    directory goes with it; one left by a killed process is removed by the next one made
    there).

    Raises:
        LocalDiskFullError: the disk filled up; StateError: LMDB failed otherwise.
    """

    def __init__(self, snap: LmdbTableSnapshot, directory: str) -> None:
        self._own = OwnDirectory.create(_PACK_PREFIX, directory)
        self._env: Any = None
        try:
            self._env = _new_environment(self._own.path, snap.copy_size())
            dst = _Appender(self._env)
            try:
                with contextlib.closing(snap.records()) as records:
                    self.records = dst.append(records, f"packing a snapshot in {directory}")
                dst.commit()
            finally:
                dst.abort()
        except lmdb.Error as exc:
            self.close()
            if isinstance(exc, lmdb.DiskError) or "No space left" in str(exc):
                raise LocalDiskFullError(f"packing a snapshot in {self._own.path}: {exc} (free "
                                         "local disk space)", path=self._own.path) from exc
            raise StateError(f"packing a snapshot in {self._own.path} failed: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def copy_size(self) -> int:
        """What :meth:`copy_to` writes: the meta pages and the tree's pages."""
        st = self._env.stat()
        tree = int(st["branch_pages"]) + int(st["leaf_pages"]) + int(st["overflow_pages"])
        return (2 + tree) * int(st["psize"])

    def copy_to(self, fd: int) -> None:
        """LMDB's compacting copy of the packed environment to ``fd`` (a file or a pipe)."""
        self._env.copyfd(fd, compact=True)

    def close(self) -> None:
        """Close the environment and remove its directory. Idempotent."""
        if self._env is not None:
            self._env.close()
            self._env = None
        self._own.remove()

    def __enter__(self) -> PackedEnvironment:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def spool_table_snapshot(snap: LmdbTableSnapshot, meta: FileSnapshotMeta, directory: str, *,
                         zstd_level: int = 1) -> BinaryIO:
    """The file-level object (format v2) of ``snap`` in an unnamed temporary file in
    ``directory`` (the table's parent: one disk), open at its start; the caller closes it.
    Packed first when its leaves are estimated less than :data:`PACK_BELOW_FILL` full (the
    module docstring); ``snap`` is released once nothing needs its read transaction any more.

    Raises:
        LocalDiskFullError, StateError: writing the temporary files; what
            :func:`~materializer.file_snapshot.spool_file_snapshot` raises.
    """
    try:
        if snap.leaf_fill() >= PACK_BELOW_FILL:
            return spool_file_snapshot(snap.copy_to, snap.copy_size(), meta, directory,
                                       zstd_level=zstd_level)
        with PackedEnvironment(snap, directory) as packed:
            snap.release()
            return spool_file_snapshot(packed.copy_to, packed.copy_size(), meta, directory,
                                       zstd_level=zstd_level)
    finally:
        snap.release()


def iter_key_groups(directory: str, key_groups: KeyGroupRange, *, key: str
                    ) -> Iterator[tuple[int, list[SnapshotEntry]]]:
    """``(key group, entries)`` of the staged environment's key groups in ``key_groups``, in
    order; entries are ``(state id, key, namespace, value)`` bytes, like a v1 block's (values
    decoded).

    Raises:
        CorruptValueError: a value does not decode (layout ``"2"``), naming ``key``."""
    try:
        env = _open(directory, readonly=True)
    except lmdb.Error as exc:
        raise CorruptObjectError(key, 0, f"the data file is not an LMDB environment: {exc}"
                                 ) from exc
    psize = KEY_PREFIX.size
    unpack = KEY_PREFIX.unpack_from
    try:
        with env.begin() as txn, txn.cursor() as cur:
            decode = None
            if txn.get(LAYOUT_KEY) != b"1":
                decode = ValueCodec(dict(read_dictionaries(txn)), where=key).decode
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
                block.append((sid, raw[psize:end], raw[end:],
                              value if decode is None else decode(value, raw)))
            if block:
                yield current, block
    finally:
        env.close()
