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

*Deltas.* Given a :class:`DeltaBase` — the pieces of the previous materialization (a full
snapshot and the deltas after it), the table's ``table_id`` at that cut, and a function naming
the entries changed since that cut up to a boundary — the materialization writes a delta (format
v3, :mod:`materializer.delta_format`) instead: the value of every changed entry as of the same
read transaction, or a tombstone. It does so only when all of these hold, else it writes a full
snapshot:

1. the marker's ``table_id`` is the one of the previous cut (no snapshot was loaded into the table
   since: every change in between was logged, and the caller saw it);
2. the checkpoint the table is at names no snapshot (its task asked for the newest
   materialization before the previous one was written: the table was not loaded since, rule 1,
   so the chain describes it), or names the previous pieces' full snapshot first, then only
   pieces this chain holds or held (``DeltaBase.lineage``: deltas a merge replaced included),
   with the same ids — the chain the delta extends is the one the checkpoints use, or its
   continuation not installed yet — and its materialization id is that of its last piece;
3. the caller knows the entries changed up to the marker's boundary (``changed`` returns them)
   and they are at most ``max_entries``;
4. the compaction rule (:func:`materializer.compaction.next_piece`) does not ask for a full
   snapshot: the deltas after the full one add up to at most ``max_ratio`` of its size.

When ``max_deltas`` deltas follow the full snapshot, the delta is a **merged** one: it follows
the full snapshot directly and holds every entry changed since it — the entries of the chain's
deltas (read back from the store, one key group at a time) and those changed since the last cut —
with their values at this cut; the chain becomes the full snapshot and that delta.
"""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Final

from dstl.checks import check_choice
from dstl.errors import CorruptObjectError, DstlError, UsageError
from dstl.keygroups import META_KEY_GROUP, KeyGroupRange
from dstl.options import DstlOptions
from dstl.retry import RetryPolicy
from dstl.segment import iter_body_changes
from materializer.changes import OP_SID
from materializer.compaction import FULL, MERGE, next_piece
from materializer.delta_format import DeltaEntry, DeltaMeta, DeltaReader, encode_delta
from materializer.file_snapshot import FileSnapshotMeta
from materializer.handles import SnapshotRef
from materializer.lmdb_files import spool_table_snapshot
from materializer.lmdb_table import LmdbStateTable, LmdbTableSnapshot
from materializer.options import LMDB_SNAPSHOT_FORMATS
from materializer.snapshot_writers import upload_snapshot
from materializer.table_marker import TableMarker

__all__ = ["ChangedEntries", "DeltaBase", "ExternalMaterialization", "changed_entries",
           "materialize_table_directory"]

logger = logging.getLogger(__name__)

_U32: Final = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class ExternalMaterialization:
    """A snapshot taken from outside the table's writer.

    Attributes:
        ref: the uploaded snapshot object.
        boundary: ``(segment key, offset)`` of the last change set the snapshot reflects.
        marker: the table marker the snapshot was taken at.
        entries: entries written.
        duration_s: snapshot + upload time.
        chain: a delta: the pieces it follows (a full snapshot, then deltas).
        merged: a delta that follows the full snapshot directly and holds every entry changed
            since it (it replaces the deltas of the chain it was taken on).
    """

    ref: SnapshotRef
    boundary: tuple[str, int]
    marker: TableMarker
    entries: int
    duration_s: float
    chain: tuple[SnapshotRef, ...] = ()
    merged: bool = False  # a delta that replaces the deltas of the chain it was taken on

    @property
    def pieces(self) -> tuple[SnapshotRef, ...]:
        """The snapshot pieces a checkpoint names with this one: the full snapshot (``ref``
        itself when not a delta) and the deltas after it, ``ref`` last."""
        return (*self.chain, self.ref)


@dataclass(frozen=True, slots=True)
class ChangedEntries:
    """The entries changed since a delta base's cut, up to a boundary.

    Attributes:
        entries: ``(key group, state id, key, namespace)`` of every changed entry (a superset is
            correct: an unchanged entry is written again with its current value).
        up_to: the first sqn of the writer's log after the boundary (the delta's ``up_to``).
    """

    entries: set[tuple[int, int, bytes, bytes]]
    up_to: int


@dataclass(frozen=True, slots=True)
class DeltaBase:
    """What a delta written from outside the table's writer follows (see the module docstring).

    Attributes:
        pieces: the previous materialization's pieces (a full snapshot, then deltas).
        table_id: the table's ``table_id`` at that materialization's cut.
        changed: the entries changed since that cut up to a boundary, or ``None`` when not
            known (a full snapshot is written then).
        max_deltas, max_ratio, max_entries: the compaction rule
            (``BackendOptions.max_snapshot_deltas``, ``max_delta_ratio``, ``max_delta_entries``).
        lineage: ``(object key, materialization id)`` of every piece written in this chain since
            its full snapshot, the deltas a merge replaced included (empty: ``pieces``'s own).
    """

    pieces: tuple[SnapshotRef, ...]
    table_id: str
    changed: Callable[[tuple[str, int]], ChangedEntries | None]
    max_deltas: int
    max_ratio: float
    max_entries: int
    lineage: frozenset[tuple[str, int]] = frozenset()

    def known(self) -> frozenset[tuple[str, int]]:
        """The pieces a checkpoint of this chain may name."""
        return self.lineage | {(p.key, p.materialization_id) for p in self.pieces}


def changed_entries(bodies: Iterable[bytes], into: set[tuple[int, int, bytes, bytes]]) -> None:
    """Add ``(key group, state id, key, namespace)`` of every data change in the change-set
    ``bodies`` (verified bodies, as a writer built them) to ``into``.

    Raises:
        CorruptObjectError: a body or change record is malformed.
    """
    add = into.add
    for body in bodies:
        for kg, payload in iter_body_changes(body):
            if kg == META_KEY_GROUP:
                continue
            try:
                _op, sid = OP_SID.unpack_from(payload, 0)
                (kl,) = _U32.unpack_from(payload, 3)
                (nl,) = _U32.unpack_from(payload, 7 + kl)
            except struct.error as exc:
                raise CorruptObjectError("<change set>", 0,
                                         f"malformed change record: {exc}") from exc
            ns_at = 11 + kl
            if ns_at + nl > len(payload):
                raise CorruptObjectError("<change set>", 0, "namespace runs past the record")
            add((kg, sid, payload[7:7 + kl], payload[ns_at:ns_at + nl]))


def materialize_table_directory(directory: str, key_groups: KeyGroupRange, store: Any, *,
                                zstd_level: int = 1,
                                skip_boundary: tuple[str, int] | None = None,
                                max_block_bytes: int | None = None,
                                retry: RetryPolicy | None = None,
                                snapshot_format: str = "file",
                                delta_base: DeltaBase | None = None,
                                previous_id: int = 0
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
        delta_base: what a delta would follow (``None``: always a full snapshot); a delta is
            written only under the rules of the module docstring.
        previous_id: the materialization id of the caller's previous snapshot of this table: a
            full snapshot's id is above it and above the marker's (a task may have installed
            that snapshot after this cut, raising its base's id to it).

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
                           snapshot_format, delta_base, store, previous_id)
    if taken is None:
        return None
    marker, mat_id = taken.marker, taken.materialization_id
    with taken.object as f:
        data = f.read()
    key = upload_snapshot(store, marker.operator_id, mat_id, data,
                          retry or RetryPolicy.for_uploads(DstlOptions()))
    duration = time.monotonic() - t0
    kind = ("merged delta" if taken.merged else "delta") if taken.chain else "snapshot"
    logger.info("materialized %s (%s, checkpoint %d) from outside its writer: %s of %d entries, "
                "%d bytes to %s in %.1f ms", directory, marker.operator_id,
                marker.checkpoint_id, kind, taken.entries, len(data), key, duration * 1e3)
    return ExternalMaterialization(SnapshotRef(key, len(data), key_groups, mat_id,
                                               delta=bool(taken.chain)),
                                   taken.boundary, marker, taken.entries, duration, taken.chain,
                                   taken.merged)


@dataclass(frozen=True, slots=True)
class _TakenSnapshot:
    """A snapshot object written from one read transaction of the table, in a file open at its
    start (v2: an unnamed temporary file; v1: its bytes in memory); the caller closes it."""

    object: BinaryIO
    marker: TableMarker
    boundary: tuple[str, int]
    materialization_id: int
    entries: int
    chain: tuple[SnapshotRef, ...] = ()  # a delta: the pieces it follows
    merged: bool = False  # a delta that replaces the deltas of its chain


def _take_snapshot(directory: str, key_groups: KeyGroupRange, zstd_level: int,
                   skip_boundary: tuple[str, int] | None,
                   max_block_bytes: int | None,
                   snapshot_format: str = "file",
                   delta_base: DeltaBase | None = None, store: Any = None,
                   previous_id: int = 0) -> _TakenSnapshot | None:
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
            mat_id = max(marker.materialization_id, previous_id) + 1
            if delta_base is not None:
                delta = _take_delta(snap, marker, boundary, delta_base, zstd_level,
                                    max_block_bytes, store)
                if delta is not None:
                    return delta
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
    Returns the object's temporary file and the table's entry count (the reserved records not
    counted)."""
    assert marker.boundary is not None
    meta = FileSnapshotMeta(marker.key_groups, marker.max_parallelism, marker.states,
                            marker.operator_id, mat_id, snap.layout, boundary=marker.boundary,
                            extra={"checkpoint_id": marker.checkpoint_id})
    entries = max(snap.entry_count() - snap.reserved_records(), 0)
    return spool_table_snapshot(snap, meta, os.path.dirname(os.path.abspath(directory)),
                                zstd_level=zstd_level), entries


def _delta_chain(marker: TableMarker, base: DeltaBase, key_groups: KeyGroupRange
                 ) -> tuple[tuple[SnapshotRef, ...], bool] | None:
    """The pieces a delta at ``marker`` follows and whether it is a merged one (rules 1, 2 and 4
    of the module docstring), or ``None`` when the next materialization must be a full
    snapshot."""
    pieces = base.pieces
    named = marker.snapshots
    if (not base.table_id or marker.table_id != base.table_id or not pieces
            or pieces[0].delta or any(p.key_groups != key_groups for p in pieces)):
        return None
    if named and (named[0] != (pieces[0].key, pieces[0].materialization_id)
                  or not set(named) <= base.known()
                  or marker.materialization_id != named[-1][1]):
        return None
    kind = next_piece(pieces[0].size, [d.size for d in pieces[1:]], base.max_deltas,
                      base.max_ratio)
    if kind == FULL:
        return None
    return pieces, kind == MERGE


def _take_delta(snap: LmdbTableSnapshot, marker: TableMarker, boundary: tuple[str, int],
                base: DeltaBase, zstd_level: int, max_block_bytes: int | None,
                store: Any = None) -> _TakenSnapshot | None:
    """A delta of the entries changed since ``base``'s cut (a merged one: since its full
    snapshot), read from ``snap``; ``None`` when a full snapshot must be written instead."""
    decided = _delta_chain(marker, base, marker.key_groups)
    if decided is None:
        return None
    chain, merge = decided
    changed = base.changed(boundary)
    if changed is None or len(changed.entries) > base.max_entries:
        return None
    by_kg: dict[int, set[tuple[int, bytes, bytes]]] = {}
    for kg, sid, k, ns in changed.entries:
        by_kg.setdefault(kg, set()).add((sid, k, ns))
    states = dict(marker.states)
    readers: list[DeltaReader] = []
    if merge:
        if store is None:
            return None
        try:
            for piece in chain[1:]:
                reader = DeltaReader(store.get(piece.key), key=piece.key,
                                     max_block_bytes=max_block_bytes)
                for state_id, described in reader.meta.states.items():
                    states.setdefault(state_id, described)
                readers.append(reader)
        except DstlError as exc:
            logger.warning("materializing %s: reading its deltas back for a merge failed (%s); "
                           "this materialization is full", marker.operator_id, exc)
            return None
        follows: tuple[SnapshotRef, ...] = chain[:1]
    else:
        follows = chain
    kgs = sorted(set(by_kg) | {kg for r in readers for kg in r.block_key_groups()})
    counted = [0]

    def blocks() -> Iterator[tuple[int, list[DeltaEntry]]]:
        for kg in kgs:
            keys = by_kg.pop(kg, set())
            one = KeyGroupRange(kg, kg)
            for r in readers:
                for _kg, _at, entries in r.read(one):
                    keys.update((sid, k, ns) for sid, k, ns, _v in entries)
            order = sorted(keys)
            values = snap.get_many((sid, kg, k, ns) for sid, k, ns in order)
            counted[0] += len(order)
            yield kg, [(sid, k, ns, v) for (sid, k, ns), v in zip(order, values, strict=True)]

    mat_id = chain[-1].materialization_id + 1
    meta = DeltaMeta(marker.key_groups, marker.max_parallelism, marker.operator_id, mat_id,
                     follows[-1].materialization_id, changed.up_to, states)
    data = encode_delta(meta, blocks(), zstd_level=zstd_level, max_block_bytes=max_block_bytes)
    return _TakenSnapshot(io.BytesIO(data), marker, boundary, mat_id, counted[0], follows,
                          merged=merge)
