"""Restoring from file-level snapshots (format v2, :mod:`materializer.file_snapshot`).

Theory of operation
-------------------
Every snapshot object a restore needs is first *staged*: read whole (through the restore cache's
lease, which verified the object crc when it downloaded it, or with one ``get`` that is verified
here), and its data decompressed in chunks into ``data.mdb`` of a new staging directory beside
the restored table (same filesystem: the install is a rename). zstd's content checksum and the
footer's raw size and crc32 are checked while the file is written; a staging directory is named
``.dstl-stage-<pid>-<random>`` and removed when the restore ends, whatever happens (a disk too
small for the file is a :class:`~dstl.errors.LocalDiskFullError` before anything is written);
leftovers of dead processes (a restore killed midway) are removed by the next restore in that
directory (:func:`remove_stale_staging`).

Staging validates the file whole before anything else reads it
(:func:`materializer.lmdb_check.check_data_file`: every page, the key order, DSTL's key layout
against the snapshot's metadata), and checks that the reference names only key groups the
snapshot holds: a forged or damaged file is a :class:`~dstl.errors.CorruptObjectError` naming the
object and nothing of it reaches LMDB or the table. The readers, ``dstl verify`` and
``dstl inspect`` stage files the same way (a reader may decompress a smaller file into memory
instead: :func:`file_snapshot_in_memory`, the same checks).

Then one of three ways, chosen by :func:`install_file_snapshots`:

1. **install** — LMDB target, one snapshot, its key groups inside the restored range and its
   reference standing for all of them (the restore plan did not restrict it), the same state
   ids: delete the staged environment's table marker
   (:func:`materializer.lmdb_files.remove_marker`), then rename it into the table's place
   (:meth:`~materializer.backend.ChangelogKeyedStateBackend.replace_table`). No per-entry work.
2. **range copy** — LMDB target, several snapshots or only part of one (rescaling), or state ids
   that differ: build a new environment from the key groups each staged file is loaded for
   (those of the restored range that its reference, as the restore plan restricted it, stands
   for; the rest of the object is another snapshot's history or nobody's)
   (:func:`materializer.lmdb_files.build_environment`: sorted cursor reads, append-mode
   ``putmulti``, state ids rewritten when needed), then rename it into place as in 1.
3. **entries** — the heap table, or an LMDB restore that also loads v1 snapshots (their entries
   go through the table; a rename would drop them): the staged files are read entry by entry
   into the backend (:func:`materializer.lmdb_files.iter_key_groups`).

Until the rename, the restored backend's table is the empty one it was opened with; after it, a
complete, checked table without a marker. A restore killed at any point therefore leaves either
staging debris (never opened as a table), an empty table, or a complete table without a marker —
none of which the adopt path (``dstl.spark.slots``) takes for a checkpoint's table, since that
needs a marker naming the checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dstl.errors import (
    DECODER_BUGS,
    CorruptObjectError,
    DstlError,
    LocalDiskFullError,
    StateError,
    placed,
)
from dstl.keygroups import KeyGroupRange
from dstl.stores.base import BlobStore
from dstl.stores.local import pid_alive
from materializer.backend import ChangelogKeyedStateBackend
from materializer.file_snapshot import (
    FILE_SNAPSHOT_VERSION,
    FileSnapshotLayout,
    ReadAt,
    check_data_frame,
    decompress_file_snapshot,
    decompress_file_snapshot_into,
    read_file_snapshot_layout,
    snapshot_version,
    verify_file_snapshot,
)
from materializer.handles import SnapshotRef
from materializer.lmdb_files import RangeSource, build_environment, iter_key_groups, remove_marker

if TYPE_CHECKING:
    from materializer.lmdb_check import ValidFile

__all__ = ["STAGE_PREFIX", "StagedSnapshot", "file_snapshot_in_memory",
           "install_file_snapshots", "is_file_snapshot", "remove_stale_staging",
           "stage_file_snapshot", "validate_file_snapshot"]

STAGE_PREFIX = ".dstl-stage-"


@dataclass(frozen=True, slots=True)
class StagedSnapshot:
    """A v2 snapshot decompressed into a staging directory (``directory/data.mdb``) and
    validated (``valid``: its entries, the file mapped)."""

    ref: SnapshotRef
    layout: FileSnapshotLayout
    directory: str
    valid: ValidFile


def is_file_snapshot(head: bytes) -> bool:
    """Whether an object whose first bytes are ``head`` is a v2 (file-level) snapshot."""
    return snapshot_version(head) == FILE_SNAPSHOT_VERSION



def remove_stale_staging(parent: str) -> int:
    """Remove the staging directories in ``parent`` left by dead processes; returns how many."""
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(parent):
            if not name.startswith(STAGE_PREFIX):
                continue
            pid = name[len(STAGE_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
                removed += 1
    return removed


def new_staging_directory(parent: str) -> str:
    """A new, empty staging directory in ``parent`` (named for :func:`remove_stale_staging`)."""
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", dir=parent)


def stage_file_snapshot(ref: SnapshotRef, read: ReadAt, size: int, parent: str, *,
                        verified: bool) -> StagedSnapshot:
    """Decompress the v2 object ``ref`` into a new staging directory in ``parent`` and validate
    it whole (the module docstring).

    Args:
        ref: the snapshot.
        read, size: the object's bytes (a lease's ``read``, or a slice of bytes in memory).
        parent: where the staging directory goes (the restored table's parent directory).
        verified: the object crc was checked already (the cache's verify did it).

    Raises:
        CorruptObjectError (and subclasses): naming ``ref.key``; nothing is left behind.
        LocalDiskFullError: ``parent``'s disk cannot hold the file.
    """
    layout = (read_file_snapshot_layout(read, size, key=ref.key) if verified
              else verify_file_snapshot(read, size, key=ref.key))
    _check_reference(ref, layout)
    check_data_frame(read, layout, key=ref.key)
    try:
        directory = new_staging_directory(parent)
        free = shutil.disk_usage(directory).free
        if free < layout.raw_size:
            raise OSError(errno.ENOSPC, f"{layout.raw_size} bytes needed, {free} free")
    except OSError as exc:
        raise _local_error(exc, parent, ref.key) from exc
    from materializer.lmdb_check import check_data_file  # numpy: imported when first needed
    try:
        path = os.path.join(directory, "data.mdb")
        decompress_file_snapshot(read, layout, path, key=ref.key)
        valid = check_data_file(path, layout.meta, key=ref.key, offset=layout.data_offset)
    except OSError as exc:
        shutil.rmtree(directory, ignore_errors=True)
        raise _local_error(exc, directory, ref.key) from exc
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return StagedSnapshot(ref, layout, directory, valid)


def file_snapshot_in_memory(ref: SnapshotRef, read: ReadAt, layout: FileSnapshotLayout
                            ) -> ValidFile:
    """The checks of :func:`stage_file_snapshot` for a v2 object whose data a reader
    decompresses into memory (``layout``: its verified layout): the reference, the zstd data,
    the LMDB file validated whole; the result's spans index the decompressed bytes.

    Raises:
        CorruptObjectError (and subclasses): naming ``ref.key``.
    """
    import numpy as np

    from materializer.lmdb_check import check_data_file
    _check_reference(ref, layout)
    data = np.empty(layout.raw_size, dtype=np.uint8)
    decompress_file_snapshot_into(read, layout, data, key=ref.key)
    return check_data_file(data, layout.meta, key=ref.key, offset=layout.data_offset)


def _check_reference(ref: SnapshotRef, layout: FileSnapshotLayout) -> None:
    """The reference stands only for key groups the snapshot holds (a reference wider than
    the file would read the rest as empty state).

    Raises:
        CorruptObjectError: naming the object.
    """
    held = layout.meta.key_groups
    if ref.key_groups.intersection(held) != ref.key_groups:
        raise CorruptObjectError(ref.key, 0, f"the checkpoint's reference stands for key groups "
                                             f"{ref.key_groups}, the snapshot holds {held}")


def validate_file_snapshot(read: ReadAt, size: int, *, key: str) -> StagedSnapshot:
    """Check a v2 object as a restore would — every stored byte, the zstd data, the LMDB file
    whole — in a temporary directory removed before returning (``dstl verify``,
    ``dstl inspect``); the result's ``directory`` no longer exists.

    Raises:
        CorruptObjectError (and subclasses): naming ``key``.
        LocalDiskFullError: the temporary directory's disk cannot hold the file.
    """
    layout = read_file_snapshot_layout(read, size, key=key)
    ref = SnapshotRef(key, size, layout.meta.key_groups, layout.meta.materialization_id)
    staged = stage_file_snapshot(ref, read, size, tempfile.gettempdir(), verified=False)
    shutil.rmtree(staged.directory, ignore_errors=True)
    return staged


def _local_error(exc: OSError, path: str, key: str) -> DstlError:
    """A local file system failure while staging ``key`` in ``path``, typed."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return LocalDiskFullError(f"staging snapshot {key} in {path}: {exc} (free local disk "
                                  "space: a file snapshot needs its uncompressed size there)",
                                  path=path)
    return StateError(f"staging snapshot {key} in {path} failed: {exc}")


def _register(backend: ChangelogKeyedStateBackend, staged: StagedSnapshot,
              max_parallelism: int, allow_pickle: bool) -> dict[int, int]:
    """Register the snapshot's states; return its state id -> the backend's."""
    meta = staged.layout.meta
    if meta.max_parallelism != max_parallelism:
        raise CorruptObjectError(staged.ref.key, 0, f"file snapshot of max_parallelism "
                                                    f"{meta.max_parallelism}, restoring "
                                                    f"{max_parallelism}")
    return {int(sid): backend.register_restored_state(m, int(sid), allow_pickle=allow_pickle)
            for sid, m in meta.states.items()}


def install_file_snapshots(backend: ChangelogKeyedStateBackend, staged: Sequence[StagedSnapshot],
                           key_groups: KeyGroupRange, *, whole_table: bool,
                           allow_pickle: bool = False) -> int:
    """Load staged v2 snapshots into ``backend`` (one of the three ways of the module
    docstring); returns the entries restored.

    Args:
        backend: the new backend (its table still empty).
        staged: the staged snapshots.
        key_groups: the restored range.
        whole_table: the staged snapshots are all there is to load (no v1 snapshot), so the
            LMDB table may be replaced by a rename.
        allow_pickle: as for ``restore_backend``.

    Raises:
        CorruptObjectError: a staged file is not what its metadata says (names the object).
    """
    if not staged:
        return 0   # nothing to install: the table stays the empty one it was opened with
    remaps = [_register(backend, s, backend.max_parallelism, allow_pickle) for s in staged]
    if backend.table_kind != "lmdb" or not whole_table:
        return sum(_load_entries(backend, s, r, key_groups) for s, r in zip(staged, remaps))
    parent = os.path.dirname(backend.tables.path)
    if len(staged) == 1 and _installable(staged[0], remaps[0], key_groups):
        s = staged[0]
        remove_marker(s.directory, key=s.ref.key)
        backend.replace_table(s.directory)
        return s.valid.entries
    sources = [RangeSource(s.directory, s.ref.key, _share(s, key_groups), r)
               for s, r in zip(staged, remaps)]
    target = os.path.join(new_staging_directory(parent), "env")
    try:
        entries = build_environment(target, [s for s in sources if len(s.key_groups)])
        backend.replace_table(target)
    finally:
        shutil.rmtree(os.path.dirname(target), ignore_errors=True)
    return entries


def _share(s: StagedSnapshot, key_groups: KeyGroupRange) -> KeyGroupRange:
    """The key groups this snapshot is loaded for: those of the restored range that its
    reference stands for (a restore plan restricts a reference to the key groups whose history
    it starts; the rest of the object's range is another snapshot's, or nobody's)."""
    return s.layout.meta.key_groups.intersection(s.ref.key_groups).intersection(key_groups)


def _installable(s: StagedSnapshot, remap: dict[int, int], key_groups: KeyGroupRange) -> bool:
    """The staged table may become the backend's as it is: it holds only key groups of the
    restored range, its reference stands for all of them, and its state ids are the backend's."""
    kgs = s.layout.meta.key_groups
    return (kgs.start >= key_groups.start and kgs.end <= key_groups.end
            and _share(s, key_groups) == kgs
            and all(a == b for a, b in remap.items()))


def _load_entries(backend: ChangelogKeyedStateBackend, s: StagedSnapshot, remap: dict[int, int],
                  key_groups: KeyGroupRange) -> int:
    """Entry by entry (heap table, or mixed with v1 snapshots)."""
    wanted = _share(s, key_groups)
    if not len(wanted):
        return 0
    n = 0
    for kg, entries in iter_key_groups(s.directory, wanted, key=s.ref.key):
        unknown = {e[0] for e in entries} - remap.keys()
        if unknown:
            raise CorruptObjectError(s.ref.key, 0, f"the data file holds state ids "
                                                   f"{sorted(unknown)} in key group {kg}, which "
                                                   "its metadata does not describe")
        try:
            n += backend.load_snapshot_entries(kg, entries, remap)
        except (DstlError, *DECODER_BUGS) as exc:
            raise placed(exc, s.ref.key, s.layout.data_offset, f"key group {kg} of the LMDB data "
                                                                "file") from exc
    return n


def read_at(store: BlobStore, key: str) -> tuple[ReadAt, int]:
    """The whole object ``key`` with one ``get``, as a ranged reader and its size."""
    data = memoryview(store.get(key))
    return (lambda off, n: bytes(data[off:off + n])), len(data)
