"""``SnapshotWriters``: a keyed backend's side of a materialization — what is cut on the owner
thread, and the job that writes and uploads it on the materializer thread.

Theory of operation
-------------------
- **Full snapshot.** The table's snapshot is taken at the cut (heap: bump the map versions and
  copy bucket arrays; LMDB: open a read transaction) and written out later: format v1 (entries
  in blocks, :mod:`materializer.snapshot_format`) or, for LMDB with
  ``lmdb_snapshot_format="file"``, a file-level copy of the environment (format v2,
  :mod:`materializer.file_snapshot`).
- **Delta.** With ``incremental_snapshots``, the entries changed since the previous cut (noted
  by the write path, :meth:`~materializer.state_access.StateTableAccess.take_changes`) are read
  at the cut and written as a delta that follows the base's pieces; the rule between full, delta
  and merged delta is :mod:`materializer.compaction`'s. A delta only continues this backend's
  own chain (:attr:`SnapshotWriters.chain_id`); a failed write forgets the changes, so the next
  materialization is full.
- **Metadata.** Every cut clears the registry's logged metadata records: the log after it must
  describe its states again.
- **Upload.** :func:`upload_snapshot` writes a fresh name per attempt, retried as segment uploads
  are, deleting the name of a failed attempt (its write may have landed).

Implements :class:`~materializer.manager.SnapshotSource`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from dstl.errors import DstlError, TransientStorageError
from dstl.keygroups import KeyGroupRange
from dstl.layout import snapshot_key
from dstl.retry import RetryBudget, RetryPolicy
from dstl.stores.base import BlobStore, translate_error
from dstl.writer import ChangelogWriter
from materializer.compaction import FULL, MERGE, next_piece
from materializer.delta_format import DeltaMeta, DeltaReader, encode_delta
from materializer.file_snapshot import FileSnapshotMeta
from materializer.handles import SnapshotRef
from materializer.manager import MaterializedBase
from materializer.options import BackendOptions
from materializer.state_access import ChangedEntries, TableSide
from materializer.state_registry import StateRegistry

__all__ = ["SnapshotTable", "SnapshotWriters", "new_snapshot_key", "upload_snapshot"]

logger = logging.getLogger(__name__)


class SnapshotTable(TableSide, Protocol):
    """What the snapshot writers need of the backend's table side: the table, its kind and key
    groups, the codecs, and the entries changed since the previous cut. Implemented by
    :class:`~materializer.state_access.StateTableAccess`."""

    def take_changes(self) -> ChangedEntries | None: ...

    def lose_changes(self) -> None: ...


class SnapshotWriters:
    """The materialization side of one backend (see the module docstring).

    Args:
        access: the backend's table side (its table, codecs and changed entries).
        registry: the backend's states.
        writer: the backend's changelog writer (the log's end is a cut's boundary).
        options: the backend's options.
        store, upload_retry: where snapshots go, and how uploads retry.
        max_parallelism: the job's number of key groups (recorded in the pieces).
        boundary_at: the last change set of the newest durable checkpoint if its log ends
            exactly at the given sqn, else ``None``.
        base_changed: called when a new base is in place (the log may be truncated).
    """

    def __init__(self, access: SnapshotTable, registry: StateRegistry,
                 writer: ChangelogWriter, options: BackendOptions, store: BlobStore,
                 upload_retry: RetryPolicy, max_parallelism: int,
                 boundary_at: Callable[[int], tuple[str, int] | None],
                 base_changed: Callable[[], None]) -> None:
        self._access = access
        self._registry = registry
        self._writer = writer
        self._options = options
        self._store = store
        self._retry = upload_retry
        self._operator_id = access.operator_id
        self._key_groups: KeyGroupRange = access.key_groups
        self._max_parallelism = max_parallelism
        self._heap = access.table_kind == "heap"
        self._boundary_at = boundary_at
        self._base_changed = base_changed
        self._base: Callable[[], MaterializedBase] = MaterializedBase
        #: the newest piece this backend wrote itself (a delta only continues its own chain)
        self.chain_id = -1

    def attach(self, base: Callable[[], MaterializedBase]) -> None:
        """Connect the materialization manager's current base (built after this source)."""
        self._base = base

    def forget_chain(self) -> None:
        """The base is not this backend's own chain (restored, or made elsewhere): the next
        materialization is a full one."""
        self.chain_id = -1

    # ------------------------------------------------------------------ SnapshotSource

    def log_end(self) -> int:
        return int(self._writer.next_sqn())

    def base_changed(self) -> None:
        self._base_changed()

    def take_snapshot(self, materialization_id: int, up_to: int
                      ) -> Callable[[], tuple[SnapshotRef, ...]]:
        delta = self._delta_writer(materialization_id, up_to)
        if delta is not None:
            return delta
        full = self._full_writer(materialization_id, up_to)

        def write() -> tuple[SnapshotRef, ...]:
            try:
                ref = full()
            except BaseException:
                self._access.lose_changes()  # the base did not change: the next one is full
                raise
            self.chain_id = ref.materialization_id
            return (ref,)

        return write

    # ------------------------------------------------------------------ full snapshots

    def encode_entry(self, sid: int, key: Any, ns: Any, state: Any
                     ) -> tuple[bytes, bytes, bytes]:
        """A heap table's entry as a snapshot holds it (bytes)."""
        if sid in self._registry.raw:
            return key, ns, state
        a = self._access
        return (a.key_codec.encode(key), a.namespace_codec.encode(ns),
                self._registry.by_id[sid].shape.to_bytes(state))

    def _full_writer(self, materialization_id: int, up_to: int) -> Callable[[], SnapshotRef]:
        snap = self._access.tables.snapshot()
        meta: dict[str, Any] = {
            "operator_id": self._operator_id, "materialization_id": materialization_id,
            "up_to": up_to, "states": self._registry.metas()}
        boundary = self._boundary_at(up_to)
        if boundary is not None:
            # cut exactly at a checkpoint: every change in it was in some checkpoint's log (what
            # a change feed needs to know; the executor agent's snapshots record the same)
            meta["boundary"] = list(boundary)
        metadata = json.dumps(meta, sort_keys=True).encode("utf-8")
        self._registry.forget_logged()  # the log after up_to must describe its states again
        encode = self.encode_entry if self._heap else None
        o = self._options
        zstd_level, store, retry = o.zstd_level, self._store, self._retry
        max_block = o.max_snapshot_block_bytes
        if not self._heap and o.lmdb_snapshot_format == "file":
            return self._file_snapshot_writer(snap, materialization_id, up_to, boundary)
        operator_id, key_groups = self._operator_id, self._key_groups

        def write() -> SnapshotRef:
            data = snap.to_bytes(metadata=metadata, encode=encode, zstd_level=zstd_level,
                                 max_block_bytes=max_block)
            key = upload_snapshot(store, operator_id, materialization_id, data, retry)
            return SnapshotRef(key, len(data), key_groups, materialization_id)

        return write

    def _file_snapshot_writer(self, snap: Any, materialization_id: int, up_to: int,
                              boundary: tuple[str, int] | None = None
                              ) -> Callable[[], SnapshotRef]:
        """The write-out of a file-level snapshot (format v2) of the LMDB table from ``snap``'s
        read transaction (:func:`~materializer.lmdb_files.spool_table_snapshot`: the copy
        streamed into the compressor, packed first when the pages are far from full, the object
        spooled beside the table and read for the upload once the read transaction ended).
        ``boundary``: the last change set the copy reflects, when the cut is exactly at a
        checkpoint (as in v1)."""
        operator_id, key_groups = self._operator_id, self._key_groups
        meta = FileSnapshotMeta(key_groups, self._max_parallelism, self._registry.metas(),
                                operator_id, materialization_id,
                                self._access.tables.layout.decode(),  # a writer: "1" or "2"
                                boundary=boundary, extra={"up_to": up_to})
        tmp_dir = os.path.dirname(self._access.tables.path)
        zstd_level, store, retry = self._options.zstd_level, self._store, self._retry

        def write() -> SnapshotRef:
            from materializer.lmdb_files import spool_table_snapshot
            try:
                spool = spool_table_snapshot(snap, meta, tmp_dir, zstd_level=zstd_level)
            finally:
                snap.release()
            with spool:
                data = spool.read()
            key = upload_snapshot(store, operator_id, materialization_id, data, retry)
            return SnapshotRef(key, len(data), key_groups, materialization_id)

        return write

    # ------------------------------------------------------------------ deltas

    def _delta_writer(self, materialization_id: int, up_to: int
                      ) -> Callable[[], tuple[SnapshotRef, ...]] | None:
        """On the owner thread, at a materialization's cut: the job writing a delta of the
        entries changed since the previous cut (their values read now, from the table), or
        ``None`` when this materialization must be a full one: incremental snapshots are off,
        the changes are not known, the base is not this backend's own chain, or its deltas add
        up to more than ``max_delta_ratio`` of its full snapshot's size; once
        ``max_snapshot_deltas`` deltas follow the full snapshot, a merged delta that follows it
        directly, holding every entry changed since (the deltas' entries are read back from the
        store). The compaction rule: :mod:`materializer.compaction`."""
        o = self._options
        if not o.incremental_snapshots:
            return None
        dirty = self._access.take_changes()  # later changes belong to the next cut
        base = self._base()
        chain = base.snapshots
        if (dirty is None or not chain or base.restored_log or chain[0].delta
                or base.materialization_id != self.chain_id
                or any(p.key_groups != self._key_groups for p in chain)):
            return None
        kind = next_piece(chain[0].size, [d.size for d in chain[1:]], o.max_snapshot_deltas,
                          o.max_delta_ratio)
        if kind == FULL:
            return None
        follows = chain
        if kind == MERGE:  # every entry changed since the full snapshot: the deltas' and dirty's
            follows = chain[:1]
            try:
                self._add_delta_entries(chain[1:], dirty)
            except DstlError as exc:
                logger.warning("backend %s: reading its deltas back for a merge failed (%s); "
                               "this materialization is full", self._operator_id, exc)
                return None
        blocks: dict[int, list[tuple[int, bytes, bytes, bytes | None]]] = {}
        get = self._access.tables.get
        raw, by_id = self._registry.raw, self._registry.by_id
        for (kg, sid, kb, nb), (tk, tn) in dirty.items():
            v = get(sid, kg, tk, tn)
            if v is None:
                value = None
            elif self._heap and sid not in raw:
                value = by_id[sid].shape.to_bytes(v)
            else:
                value = bytes(v)
            blocks.setdefault(kg, []).append((sid, kb, nb, value))
        for entries in blocks.values():
            entries.sort(key=lambda e: (e[0], e[1], e[2]))
        meta = DeltaMeta(self._key_groups, self._max_parallelism, self._operator_id,
                         materialization_id, follows[-1].materialization_id, up_to,
                         self._registry.metas())
        self._registry.forget_logged()  # the log after up_to must describe its states again
        zstd_level, store, retry = o.zstd_level, self._store, self._retry
        max_block = o.max_snapshot_block_bytes
        operator_id, key_groups = self._operator_id, self._key_groups

        def write() -> tuple[SnapshotRef, ...]:
            try:
                data = encode_delta(meta, sorted(blocks.items()), zstd_level=zstd_level,
                                    max_block_bytes=max_block)
                key = upload_snapshot(store, operator_id, materialization_id, data, retry)
            except BaseException:
                self._access.lose_changes()  # these changes are in no piece: the next is full
                raise
            self.chain_id = materialization_id
            return (*follows, SnapshotRef(key, len(data), key_groups, materialization_id,
                                          delta=True))

        return write

    def _add_delta_entries(self, pieces: Iterable[SnapshotRef], into: ChangedEntries) -> None:
        """Add the entries of this backend's own delta objects ``pieces`` (read from the store)
        to the changed entries ``into``, in the table's key forms."""
        a = self._access
        raw = self._registry.raw
        for piece in pieces:
            reader = DeltaReader(self._store.get(piece.key), key=piece.key,
                                 max_block_bytes=self._options.max_snapshot_block_bytes)
            for kg, _at, entries in reader.read():
                for sid, kb, nb, _v in entries:
                    if (kg, sid, kb, nb) in into:
                        continue
                    if self._heap and sid not in raw:
                        into[(kg, sid, kb, nb)] = (a.key_codec.decode(kb),
                                                   a.namespace_codec.decode(nb))
                    else:
                        into[(kg, sid, kb, nb)] = (kb, nb)


def new_snapshot_key(operator_id: str, materialization_id: int) -> str:
    """A new, unique object key for a snapshot of ``operator_id``: now, plus a random nonce
    (the name itself is :func:`dstl.layout.snapshot_key`'s)."""
    return snapshot_key(operator_id, materialization_id, int(time.time() * 1000),
                        secrets.token_hex(4))


def upload_snapshot(store: BlobStore, operator_id: str, materialization_id: int, data: bytes,
                    policy: RetryPolicy, *, sleep: Callable[[float], None] = time.sleep,
                    draw: Callable[[], float] = random.random) -> str:
    """Write a snapshot object, retried as segment uploads are (``policy``: the storage's
    ``RetryPolicy.for_uploads``; throttling backs off with jitter until the deadline).

    Every attempt writes a fresh name; after a retryable failure that name is deleted, because
    the write may have landed although the client saw an error (a lost response), and nothing
    will ever reference it. A failed delete leaves an orphan for ``collect_orphans``.

    Returns:
        The key that holds ``data``.

    Raises:
        StorageError: the last attempt's error once the policy gives up (chained).
    """
    budget = RetryBudget(policy, time.monotonic())
    attempts = 0
    while True:
        attempts += 1
        key = new_snapshot_key(operator_id, materialization_id)
        try:
            store.put(key, data)
            return key
        except Exception as exc:
            err = translate_error(exc, op="put", key=key, location=store.location)
            if isinstance(err, TransientStorageError):
                _delete_quietly(store, key)
            delay = budget.after_failure(err, attempts, time.monotonic(), draw())
            if delay is None:
                raise err from exc
            logger.warning("snapshot upload %s (attempt %d) failed (%s); retrying in %.3fs",
                           key, attempts, err, delay)
            sleep(delay)


def _delete_quietly(store: BlobStore, key: str) -> None:
    try:
        store.delete([key])
    except Exception as exc:  # noqa: BLE001 - any failure leaves an orphan for collect_orphans
        logger.warning("could not delete %s after its failed upload (%s); it is an orphan "
                       "until collect_orphans", key, exc)
