"""Materializing an on-disk state table from another process than its writer.

Theory of operation
-------------------
Under Spark the executor agent materializes the LMDB tables of the executor's partitions while
workers keep writing them (``dstl.spark.agent``). :func:`materialize_table_directory` opens the
table **read-only** (it never takes LMDB's writer lock, so a worker's open write batch is never
stalled), opens one read transaction, and reads the
:class:`~materializer.table_marker.TableMarker` and every entry from that same transaction — the
marker commits with the state it describes, so the two always agree. The snapshot object gets the
marker's state registry as its metadata (the same snapshot format as an in-process
materialization, so restore does not care who wrote it) and is uploaded under a fresh key. By
default that is the file-level format v2 (:mod:`materializer.file_snapshot`): a compacting copy
of the environment from that read transaction, zstd-compressed — the copy holds the marker too
(a restore deletes it before installing the file: only the restored backend may claim a
checkpoint). The copy is streamed into the compressor (packed first when the table's pages are
far from full), and the object into an unnamed temporary file beside the table
(:func:`~materializer.lmdb_files.spool_table_snapshot`); the read transaction ends before the
upload, and the object is read into memory only for the store's ``put`` (the store seam takes
bytes), so a materialization holds at most one object's bytes, never an uncompressed copy, in
memory.

The result names the marker's *boundary*; a backend installs it with
:meth:`~materializer.backend.ChangelogKeyedStateBackend.install_materialization` only if its own
log contains that boundary. A table with no marker yet (no checkpoint written) or no log since its
snapshot, or whose boundary was already materialized, is skipped (``None``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, BinaryIO

from dstl.checks import check_choice
from dstl.errors import UsageError
from dstl.keygroups import KeyGroupRange
from dstl.options import DstlOptions
from dstl.retry import RetryPolicy
from materializer.backend import upload_snapshot
from materializer.file_snapshot import FileSnapshotMeta
from materializer.handles import SnapshotRef
from materializer.lmdb_files import spool_table_snapshot
from materializer.lmdb_table import LmdbStateTable, LmdbTableSnapshot
from materializer.options import LMDB_SNAPSHOT_FORMATS
from materializer.table_marker import TableMarker

__all__ = ["ExternalMaterialization", "materialize_table_directory"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExternalMaterialization:
    """A snapshot taken from outside the table's writer.

    Attributes:
        ref: the uploaded snapshot object.
        boundary: ``(segment key, offset)`` of the last change set the snapshot reflects.
        marker: the table marker the snapshot was taken at.
        entries: entries written.
        duration_s: snapshot + upload time.
    """

    ref: SnapshotRef
    boundary: tuple[str, int]
    marker: TableMarker
    entries: int
    duration_s: float


def materialize_table_directory(directory: str, key_groups: KeyGroupRange, store: Any, *,
                                zstd_level: int = 1,
                                skip_boundary: tuple[str, int] | None = None,
                                max_block_bytes: int | None = None,
                                retry: RetryPolicy | None = None,
                                snapshot_format: str = "file"
                                ) -> ExternalMaterialization | None:
    """Snapshot the LMDB table in ``directory`` (written by another process) and upload it.

    Args:
        directory: the table's LMDB environment directory.
        key_groups: the table's key-group range (checked against its marker).
        store: the :class:`~dstl.stores.base.BlobStore` to upload to.
        zstd_level: zstd level of the snapshot blocks.
        skip_boundary: a boundary already materialized (nothing new: skip).
        max_block_bytes: the limit on a block's content (the writer's
            ``BackendOptions.max_snapshot_block_bytes``; default the format's; v1 only).
        retry: how the upload retries (default: that of segment uploads at the default
            ``DstlOptions``).
        snapshot_format: ``"file"`` (format v2, the environment file) or ``"entries"`` (v1).

    Returns:
        The materialization, or ``None`` when there is nothing to materialize (no marker yet,
        no log since the table's snapshot, or the same boundary as ``skip_boundary``).

    Raises:
        UsageError: the directory holds no table, or the marker names other key groups.
        CorruptObjectError: the marker does not decode.
        StateError, StorageError: reading the table or uploading failed.
    """
    t0 = time.monotonic()
    check_choice(snapshot_format, "snapshot_format", "materialize_table_directory",
                 LMDB_SNAPSHOT_FORMATS)
    taken = _take_snapshot(directory, key_groups, zstd_level, skip_boundary, max_block_bytes,
                           snapshot_format)
    if taken is None:
        return None
    marker, mat_id = taken.marker, taken.materialization_id
    with taken.object as f:
        data = f.read()
    key = upload_snapshot(store, marker.operator_id, mat_id, data,
                          retry or RetryPolicy.for_uploads(DstlOptions()))
    duration = time.monotonic() - t0
    logger.info("materialized %s (%s, checkpoint %d) from outside its writer: %d entries, %d "
                "bytes to %s in %.1f ms", directory, marker.operator_id, marker.checkpoint_id,
                taken.entries, len(data), key, duration * 1e3)
    return ExternalMaterialization(SnapshotRef(key, len(data), key_groups, mat_id),
                                   taken.boundary, marker, taken.entries, duration)


@dataclass(frozen=True, slots=True)
class _TakenSnapshot:
    """A snapshot object written from one read transaction of the table, in a file open at its
    start (v2: an unnamed temporary file; v1: its bytes in memory); the caller closes it."""

    object: BinaryIO
    marker: TableMarker
    boundary: tuple[str, int]
    materialization_id: int
    entries: int


def _take_snapshot(directory: str, key_groups: KeyGroupRange, zstd_level: int,
                   skip_boundary: tuple[str, int] | None,
                   max_block_bytes: int | None,
                   snapshot_format: str = "file") -> _TakenSnapshot | None:
    """Open the table read-only, read its marker and write its snapshot from one read
    transaction; ``None`` when there is nothing to materialize."""
    table = LmdbStateTable(directory, key_groups, readonly=True)
    try:
        snap = table.snapshot()
        try:
            raw = snap.marker()
            if raw is None:
                return None
            marker = TableMarker.from_bytes(raw, where=f"{directory} (table marker)")
            if marker.key_groups != key_groups:
                raise UsageError(f"LMDB table {directory} holds key groups {marker.key_groups}, "
                                 f"not {key_groups}: it belongs to another partition layout")
            boundary = marker.boundary
            if boundary is None or boundary == skip_boundary:
                return None
            mat_id = marker.materialization_id + 1
            data: BinaryIO
            if snapshot_format == "file":
                data, entries = _write_file(snap, directory, marker, mat_id, zstd_level)
            else:
                metadata = json.dumps({"operator_id": marker.operator_id,
                                       "materialization_id": mat_id,
                                       "checkpoint_id": marker.checkpoint_id,
                                       "boundary": list(boundary), "states": marker.states},
                                      sort_keys=True).encode("utf-8")
                parts: list[bytes] = []
                written = snap.write(parts.append, metadata=metadata, zstd_level=zstd_level,
                                     max_block_bytes=max_block_bytes)
                data, entries = io.BytesIO(b"".join(parts)), written.entries
        finally:
            snap.release()
    finally:
        table.close()
    return _TakenSnapshot(data, marker, boundary, mat_id, entries)


def _write_file(snap: LmdbTableSnapshot, directory: str, marker: TableMarker, mat_id: int,
                zstd_level: int) -> tuple[BinaryIO, int]:
    """A file-level snapshot (format v2) of the read transaction, spooled beside the table.
    Returns the object's temporary file and the table's entry count (layout and marker not
    counted)."""
    assert marker.boundary is not None
    meta = FileSnapshotMeta(marker.key_groups, marker.max_parallelism, marker.states,
                            marker.operator_id, mat_id, boundary=marker.boundary,
                            extra={"checkpoint_id": marker.checkpoint_id})
    entries = max(snap.entry_count() - 2, 0)
    return spool_table_snapshot(snap, meta, os.path.dirname(os.path.abspath(directory)),
                                zstd_level=zstd_level), entries
